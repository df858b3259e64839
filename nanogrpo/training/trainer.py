"""The single-process GRPO loop: rollout -> reference log-probs -> update -> log -> checkpoint.

Everything that can fail on user input (config, reward imports, dataset fields,
model path) is checked in :func:`~nanogrpo.training.prepare.prepare` before any weights are read
(re-exported here: ``from nanogrpo.training.trainer import prepare, train``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nanogrpo.algo.entropy import EntropyControl
from nanogrpo.config import RUN_CONFIG_FILE as CONFIG_FILE
from nanogrpo.config import Config, save_config
from nanogrpo.data import PromptSampler
from nanogrpo.engines.factory import engine_for
from nanogrpo.errors import ConfigError
from nanogrpo.models.cpu_linear import settle
from nanogrpo.models.load import load_model, load_policy, resolve_device
from nanogrpo.rollout.collect import rollout
from nanogrpo.rollout.turns import longest_context
from nanogrpo.training.checkpoint import load_state
from nanogrpo.training.logging_sinks import RunLogger, run_summary
from nanogrpo.training.metrics import merge_rank_metrics
from nanogrpo.training.pipeline import (
    Pipeline,
    ServerTier,
    consume,
    fresh_everywhere,
    produce,
    producer_reduce,
    staleness,
    step_seed,
)
from nanogrpo.training.prepare import PreparedRun, prepare  # noqa: F401 - prepare: re-exported
from nanogrpo.training.schedule import (
    Pending,
    Schedule,
    mini_batch_count,
    pending_state,
    read_pending,
    run_updates,
    updates_taken,
    write_pending,
)
from nanogrpo.training.step import reference_logprobs, step_metrics
from nanogrpo.watch import Monitor, stop_now

log = logging.getLogger("nanogrpo.train")


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to ``train.lr`` over ``warmup_steps``, then constant (the seed: constant)."""
    w = cfg.train.warmup_steps
    return cfg.train.lr * min(1.0, step / w) if w > 0 else cfg.train.lr


def train(run: PreparedRun) -> Path:
    t_start = time.perf_counter()  # the end line says the whole time, loading and evaluations included
    cfg = run.cfg
    root = run.root
    root.mkdir(parents=True, exist_ok=True)
    ckpt_root = root / "checkpoints"
    start_step = 0
    if run.resume_from is not None:
        start_step = load_state(run.resume_from)["step"]
        if start_step >= cfg.train.steps:
            log.info("run %s already finished at step %d (train.steps=%d); nothing to do", root, start_step,
                     cfg.train.steps)
            run.rewards.close()
            return root
    from nanogrpo.training.distributed import dist_env, init_distributed, make_backend

    if dist_env()[0] == 0:  # rank 0 writes the run's files; the others may be reading this one
        save_config(cfg, root / CONFIG_FILE)
    torch.manual_seed(cfg.train.seed)

    init_distributed(cfg.train.backend)  # before loading: pins this rank's GPU
    model, tok, device = load_policy(cfg.model, run.model_path, cpu_linear="torch")
    # model.cpu_linear decided once per run: a resumed run reuses the checkpoint's decisions
    recorded = load_state(run.resume_from).get("cpu_linear") if run.resume_from is not None else None
    linears = settle(cfg.model.cpu_linear, model, recorded, engine=cfg.rollout.engine in ("fast", "auto"))
    adapter = check_resume_kind(run.resume_from, cfg.model.lora_r)
    if run.resume_from is not None and not adapter:
        resumed = load_model(str(run.resume_from), next(model.parameters()).dtype, device,
                             cfg.model.attn_implementation, cfg.model.trust_remote_code, "torch")
        model.load_state_dict(resumed.state_dict())
        del resumed
    ref = None
    if cfg.grpo.beta > 0 and not cfg.model.lora_r:  # LoRA: the reference is the adapter-disabled model
        if run.resume_from is not None and (ckpt_root / "step_0").is_dir():
            ref = load_model(str(ckpt_root / "step_0"), next(model.parameters()).dtype, device,
                             cfg.model.attn_implementation, cfg.model.trust_remote_code,
                             linears.get("trainer", cfg.model.cpu_linear))
            ref.eval().requires_grad_(False)
        else:
            ref = None
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.model.lora_r:
        from nanogrpo.models.lora import apply_lora, load_adapter

        model = (load_adapter(model, run.resume_from, trainable=True, cfg=cfg.model,
                              gradient_checkpointing=cfg.train.gradient_checkpointing) if adapter
                 else apply_lora(model, cfg.model, cfg.train.gradient_checkpointing))
    if cfg.grpo.beta > 0 and ref is None:
        from nanogrpo.models.lora import reference_for

        ref = reference_for(model)  # LoRA: the same model with adapters disabled, no copy
    from nanogrpo.training.distill import Distill

    distill = Distill.from_config(cfg, model, tok, device)  # [distill]: its teacher, loaded or reached
    servers = cfg.rollout.engine == "vllm_server"
    weights_dtype = next(model.parameters()).dtype  # what the servers hold (FSDP2 trains float32 masters)
    # single / ddp / fsdp2 / deepspeed (nanogrpo.training.distributed); the server tier generates on the
    # servers, so sharded backends keep no unsharded copy (the sync gathers one tensor at a time)
    backend = make_backend(cfg, model, rollout_copy=not servers)
    optimizer = backend.optimizer
    longest_new = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)  # the engine serves both
    max_len = longest_context(cfg, tok, longest_new) if run.env is None else run.env.longest(longest_new)
    engine = engine_for(cfg, backend.rollout_model(), tok,  # vllm: built from the (resumed) weights
                        max_len=max_len, cpu_linear=linears.get("engine"))
    from nanogrpo.data.images import check_model_takes_images

    for part in (run.rows, run.eval_rows or []):  # before any step: one line, not a crash mid-run
        check_model_takes_images(part, cfg.data.image_field, getattr(engine, "vision", None), cfg.model.path,
                                 multi_turn=run.tools is not None or run.env is not None)
    sampler = PromptSampler(run.rows, cfg.rollout.prompts_per_step, seed=cfg.train.seed,
                            shuffle=cfg.data.shuffle)
    sampler_state = None  # the pipeline's: the sampler's state after the last trained batch was drawn
    version = 0
    control = EntropyControl.from_config(cfg.grpo)  # the entropy-bonus coefficient (adaptive: it moves)
    pending = None  # a step a mid-batch checkpoint interrupted (train.save_every_updates)
    if run.resume_from is not None:
        state = backend.restore(run.resume_from)
        sampler.load_state_dict(state["sampler"])
        version = state.get("policy_version", start_step)
        control.load_state_dict(state.get("entropy_control"))
        pending = read_pending(run.resume_from, state, backend.rank, device)
        if pending is not None:  # its version counts the step's updates so far; the step adds them
            version -= updates_taken(pending.sched)
        if backend.is_main:
            log.info("resuming %s from %s", root, run.resume_from.name)
    # rank 0 alone writes the logs (metrics are merged over ranks in train_step) and evaluates
    logger = RunLogger(root, cfg, resume_step=start_step if run.resume_from else None,
                       fields={f"cpu_linear/{k}": v for k, v in linears.items()}) if backend.is_main else None
    watch = Monitor.for_run(cfg, root, run.rewards, start_step if run.resume_from else None) \
        if backend.is_main else None  # the run monitor (rank 0: it alone has the held-out rows)

    def save(step: int) -> None:
        backend.save(ckpt_root, step, tok, {"policy_version": version,
                                            "sampler": sampler_state or sampler.state_dict(),
                                            "entropy_control": control.state_dict(), "cpu_linear": linears},
                     save_merged=cfg.model.lora_save_merged)

    def save_mid_batch(step: int, batch, sched: Schedule, roll: dict) -> None:
        """After an optimizer step inside ``step`` (``train.save_every_updates``): the weights so far, the
        batch and where its schedule stands, so that a resume continues at the next optimizer step."""
        every = cfg.train.save_every_updates
        res = sched.results[-1]
        now = version + updates_taken(sched)
        if not every or res.skipped_nonfinite or now % every or sched.done >= sched.total(cfg):
            return  # (the step's end is a step checkpoint's business: train.save_every)
        backend.save(ckpt_root, step - 1, tok, {"policy_version": now, "sampler": sampler.state_dict(),
                                                "entropy_control": control.state_dict(),
                                                "cpu_linear": linears, "pending": pending_state(step, sched)},
                     save_merged=cfg.model.lora_save_merged, name=f"step_{step}_update_{sched.done}",
                     rank_files=lambda d: write_pending(d, backend.rank, batch, sched, roll))
        _test_stop(f"step_{step}_update_{sched.done}")

    tier = ServerTier(cfg, engine, backend, weights_dtype, tok, run_dir=root) if servers else None
    if tier is not None:  # the servers get the run's (resumed) weights before any rollout
        first_sync = tier.sync(version)
        if backend.is_main:
            log.info("vLLM servers synced to version %d in %.2f s", version, first_sync["sync/time_s"])
    eval_policy = None if servers and backend.name in ("fsdp2", "deepspeed") else backend.rollout_model()
    if run.resume_from is None:
        # the held-out baseline first, then step_0: a kill between the two resumes from step_0 with the
        # baseline row kept; a kill before step_0 exists starts the run (and the baseline) over
        if run.eval_rows:  # the held-out curve starts at the baseline (not again on resume)
            if backend.world_size > 1:
                backend.before_rollout()
            if backend.is_main:
                base = {"step": 0, **_held_out_eval(cfg, model, tok, engine, run, 0, eval_policy)}
                if distill is not None and cfg.distill.eval_teacher:  # the student's target, once
                    base.update(distill.evaluate(cfg, run.eval_rows, run.rewards, run.root))
                if watch is not None:
                    watch.observe(base)  # the monitor's held-out baseline
                logger.log_step(base)
        _test_stop("baseline")
        save(0)
        _test_stop("step_0")
    bar = tqdm(range(start_step + 1, cfg.train.steps + 1), initial=start_step, total=cfg.train.steps,
               desc="nanogrpo", dynamic_ncols=True, disable=not backend.is_main)
    pipe = None
    if tier is not None and cfg.rollout.max_staleness:
        rank, world = backend.rank, backend.world_size
        reduce = producer_reduce() if world > 1 else None
        pipe = Pipeline(lambda s: produce(cfg, s, tok, engine, sampler, run.rewards, run.tools, run.env,
                                          rank=rank, world=world, reduce=reduce),
                        start_step + 1, cfg.train.steps, cfg.rollout.max_staleness)
    try:
        for step in bar:
            resume = pending if pending is not None and pending.step == step else None
            pending = None
            fresh, extra = True, {}
            versions: list = []
            if pipe is not None:
                made, waited = pipe.get(step)
                resume = consume(cfg, made, ref, device, backend, distill)
                sampler_state, versions = made.sampler_state, made.versions
                fresh = fresh_everywhere(not versions or min(lo for lo, _ in versions) == version, backend)
                extra = {"pipeline/trainer_wait_s": waited,
                         "pipeline/producer_wait_s": pipe.take_producer_wait()}
            with engine.recording() if pipe is None and tier is not None else nullcontext([]) as rec:
                row = train_step(cfg, step, model, ref, tok, engine, optimizer, sampler, run.rewards, version,
                                 device, backend=backend, tools=run.tools, env=run.env, control=control,
                                 resume=resume, fresh=fresh, distill=distill,
                                 on_update=save_mid_batch if cfg.train.save_every_updates else None)
            row.update(extra)
            if tier is not None:
                row.update(staleness(versions or rec, version,
                                     backend.all_reduce if backend.world_size > 1 else None))
            version += row.pop("_updates")
            if tier is not None:
                row.update(tier.sync(version) if version != tier.sync_driver.version else {})
                if pipe is not None:
                    pipe.trained(step)
            examples = row.pop("_examples", None)
            if run.eval_rows and (step % cfg.eval.every == 0 or step == cfg.train.steps):
                if backend.world_size > 1:
                    backend.before_rollout()  # sharded backends: the engine's copy gets this step's update
                if backend.is_main:
                    row.update(_held_out_eval(cfg, model, tok, engine, run, step, eval_policy))
            if watch is not None:
                row.update(watch.observe(row, examples))
            if logger is not None:
                logger.log_step(row, examples)
            loss = f"{row['loss']:.4f}" if row["loss"] is not None else "- (no group with signal)"
            bar.set_postfix_str(f"reward {row['reward_mean']:.3f} acc {row['accuracy']:.3f} loss {loss}")
            stop = stop_now(watch, backend, cfg.watch)  # watch.stop_on: a checkpoint of this step, then out
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.steps or stop:
                save(step)
            if stop:
                break
    finally:
        if tier is not None:  # first: a producer waiting on a server ends at once
            tier.close()
        if pipe is not None:
            pipe.close()
        bar.close()
        if logger is not None:
            logger.close()
        run.rewards.close()
        if run.tools is not None:
            run.tools.close()
        if run.env is not None:
            run.env.close()
    if backend.is_main:
        log.info(run_summary(root, wall_s=time.perf_counter() - t_start, start_step=start_step))
    # Under a launcher the process group stays up: destroying it while DDP's reducer still holds it
    # deadlocked (the group's destructor joins a gloo thread that waits for the GIL). The CLI leaves
    # a launched rank with os._exit once the run is done (see nanogrpo.cli.cmd_train).
    backend.barrier()
    return root


def _test_stop(name: str) -> None:
    """Test hook: ``NANOGRPO_TEST_STOP_AFTER=NAME`` ends the run (SystemExit) right after that point, as a
    kill there would, minus the kill: ``step_N_update_U`` (that mid-batch checkpoint written),
    ``baseline`` (the step-0 held-out row logged, ``step_0`` not yet saved), ``step_0`` (saved)."""
    if os.environ.get("NANOGRPO_TEST_STOP_AFTER") == name:
        raise SystemExit(f"stopped after {name} (NANOGRPO_TEST_STOP_AFTER)")


def check_resume_kind(resume_from: Path | None, lora_r: int) -> bool:
    """Whether ``resume_from`` is a LoRA adapter checkpoint; a loud error if it does not fit the config."""
    if resume_from is None:
        return False
    adapter = (Path(resume_from) / "adapter_config.json").is_file()
    if adapter and not lora_r:
        raise ConfigError(f"{resume_from} holds a LoRA adapter but model.lora_r is 0; resume with the "
                          "run's own config (model.lora_r > 0)")
    if lora_r and not adapter:
        raise ConfigError(f"{resume_from} holds a full model, not a LoRA adapter, but model.lora_r = "
                          f"{lora_r}; resume with model.lora_r=0")
    return adapter


def _held_out_eval(cfg: Config, model, tok, engine, run: PreparedRun, step: int,
                   policy=None) -> dict[str, Any]:
    """Evaluate on ``run.eval_rows``; returns ``eval/<field>`` metrics and writes ``RUN/eval/step_N.json``.
    ``policy``: a full-weight copy of the policy this rank may run alone (``Backend.rollout_model()``),
    whose entropy over the evaluation's completions is reported (``eval/entropy``)."""
    from nanogrpo.evaluation import evaluate_rows, write_results

    model.eval()
    with torch.no_grad():
        summary, records = evaluate_rows(engine, tok, run.eval_rows, cfg, run.rewards,
                                         cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                                         cfg.eval.batch_size, k=cfg.eval.k, temperature=cfg.eval.temperature,
                                         seed=cfg.eval.seed, tools=run.tools, policy=policy, env=run.env)
    summary["split"] = cfg.data.eval_split
    write_results(summary, records, run.root / "eval" / f"step_{step}.json")
    return {f"eval/{k}": v for k, v in summary.items() if not isinstance(v, str)}


def train_step(cfg: Config, step: int, model, ref, tok, engine, optimizer, sampler, rewards, version: int,
               device: torch.device, backend=None, tools=None, env=None,
               control: EntropyControl | None = None,
               resume: Pending | None = None, on_update=None, fresh: bool = True,
               distill=None) -> dict[str, Any]:
    """One step: rollout, reference log-probs, the batch's optimizer steps (``grpo.mini_batches`` x
    ``grpo.updates_per_batch``, :mod:`nanogrpo.training.schedule`), the step's metrics.
    ``control``: the run's entropy-bonus coefficient (updated after each optimizer step).
    ``resume``: the step as a mid-batch checkpoint left it (its batch, rollout metrics and the optimizer
    steps already taken): no rollout, the schedule continues. ``on_update(step, batch, sched, rollout)``
    runs after each optimizer step (mid-batch checkpoints). ``fresh``: the batch was sampled under the
    current weights (False: a stale batch of the asynchronous pipeline). ``distill``: the run's
    :class:`~nanogrpo.training.distill.Distill` (its teacher scores the batch; no group is dropped)."""
    from nanogrpo.training.distributed import SingleBackend

    t0 = time.perf_counter()
    control = control if control is not None else EntropyControl.from_config(cfg.grpo)
    be = backend if backend is not None else SingleBackend(model, optimizer)
    rank, world = be.rank, be.world_size
    share_ok = be.prefix_sharing
    if resume is None:
        rows = sampler.next_batch()
        if world > 1:
            rows = be.shard(rows)  # every rank draws the same global stream and keeps rows rank::world
            be.before_rollout()    # FSDP2 / ZeRO-3: refresh the full-weight copy the engine reads
        model.eval()
        batch, rstats = rollout(engine, tok, rows, rewards, cfg.data, cfg.rollout, cfg.grpo,
                                template=cfg.model.chat_template,
                                seed=step_seed(cfg.train.seed, step) + rank,
                                policy_version=version, tools=tools, env=env,
                                keep_examples=cfg.log.samples_per_step,
                                reduce=be.all_reduce if world > 1 else None,
                                more=lambda n: be.shard(sampler.next_batch(n)),  # dynamic sampling's refills
                                keep_all=distill is not None)
        roll = {"metrics": rstats.metrics(), "examples": rstats.examples,
                "rollout_time_s": time.perf_counter() - t0}
        if batch is not None:
            batch = batch.to(device)
            if ref is not None:
                batch.ref_logprobs = reference_logprobs(ref, batch, cfg.train,
                                                        cfg.train.share_prefix and share_ok,
                                                        temperature=cfg.rollout.logprob_temperature(),
                                                        support=cfg.rollout.logprob_support())
            if distill is not None:
                distill.annotate(batch, cfg.train, cfg.train.share_prefix and share_ok)
        sched = Schedule(parts=mini_batch_count(batch, cfg.grpo.mini_batches, be)) \
            if batch is not None or world > 1 else None
    else:
        batch, sched, roll = resume.batch, resume.sched, resume.rollout
    t_roll = time.perf_counter()
    if sched is not None:  # a rank without rows still joins the update's collectives
        optimizer.set_lr(lr_at(step, cfg))
        # vllm: its kernels are not the trainer's, so even the first update takes the clipped ratio
        # against the engine's recorded log-probs (the seed's vLLM variant), not logp.detach()
        exact = not getattr(engine, "behaviour_logprobs", False)
        after = None if on_update is None else (lambda s, r: on_update(step, batch, s, roll))
        run_updates(model, optimizer, batch, cfg, sched, fresh=fresh, exact=exact, backend=be,
                    control=control, max_new_tokens=cfg.rollout.max_new_tokens, after_update=after,
                    distill=distill)
        # vllm keeps its own copy of the weights: push this step's update (vLLM servers: the loop syncs them)
        remote = getattr(engine, "remote", False)
        if updates_taken(sched) and getattr(engine, "owns_weights", False) and not remote:
            engine.load_from(model)
    results = sched.results if sched is not None else []
    updates = sum(not r.skipped_nonfinite for r in results)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    roll_s = roll["rollout_time_s"] + (t_roll - t0 if resume is not None else 0.0)
    step_time = roll_s + (t_end - t_roll)
    upd = step_metrics(results, sched.parts) if results else \
        dict.fromkeys(("loss", "kl", "clip_frac", "grad_norm"), math.nan)
    rm = dict(roll["metrics"])
    row: dict[str, Any] = {"step": step, "loss": upd.pop("loss"), **rm, "kl": upd.pop("kl"),
                           "clip_frac": upd.pop("clip_frac"), "grad_norm": upd.pop("grad_norm"), **upd,
                           "lr": optimizer.lr, "skipped_nonfinite": len(results) - updates,
                           "rollout_time_s": roll_s, "train_time_s": t_end - t_roll,
                           "step_time_s": step_time,
                           "tokens_per_s": rm["completion_tokens"] / step_time if step_time > 0 else 0.0,
                           "policy_version": version + updates, "_updates": updates,
                           "_examples": roll["examples"]}
    if cfg.grpo.mini_batches > 1:
        row["mini_batches"] = sched.parts if sched is not None else 0
    if device.type == "cuda":
        row["gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if world > 1:  # every rank logs the same, whole-batch figures (rank 0 writes them)
        row = merge_rank_metrics(row, be.all_reduce, [f"reward/{s}" for s in rewards.specs])
    return row


__all__ = ["PreparedRun", "prepare", "train", "resolve_device"]
