"""Everything a run builds once, handed to the loop as one :class:`~nanogrpo.training.run.Run`, in order:

    the policy       loaded, ``model.cpu_linear`` settled, resumed weights, gradient checkpointing, LoRA
    the reference    a frozen copy (LoRA: the adapters off; none at ``grpo.beta`` 0 or in split mode, whose
                     server sends the reference log-probs)
    distillation     the teacher, loaded or reached (``distill.teacher``)
    the backend      single / DDP / FSDP2 / DeepSpeed around the policy, with its optimizer
    the engine       fast / hf / vllm / vllm_server: rollouts and held-out evaluation
    the source       :class:`~nanogrpo.training.sources.LocalRollout`, ``AsyncRollout`` or split mode's
                     :class:`~nanogrpo.serve.feed.ServerFeed`
    the parts        the server tier, MoE routing replay, distillation, mid-batch checkpoints (each from its
                     own module)
    the resume state the policy version, entropy control, each part's state, a step left mid-batch
    the logs         metrics and samples, the run monitor, the progress bar, held-out evaluation (rank 0)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from nanogrpo.algo.entropy import EntropyControl
from nanogrpo.config import RUN_CONFIG_FILE, save_config
from nanogrpo.errors import ConfigError
from nanogrpo.models.cpu_linear import settle
from nanogrpo.models.load import load_model, load_policy
from nanogrpo.training.checkpoint import load_state
from nanogrpo.training.distributed import dist_env, init_distributed, make_backend
from nanogrpo.training.held_out import HeldOut, RunLog
from nanogrpo.training.logging_sinks import RunLogger
from nanogrpo.training.midbatch import MidBatchCheckpoints, read_pending
from nanogrpo.training.prepare import PreparedRun
from nanogrpo.training.run import Clock, Parts, Run
from nanogrpo.training.terms import Terms, terms_of
from nanogrpo.watch import Monitor

log = logging.getLogger("nanogrpo.train")


def setup(prepared: PreparedRun, clock: Clock) -> Run | None:
    """The run of ``prepared``, built (every rank); None when the run to resume has already finished."""
    cfg, root, resume_from = prepared.cfg, prepared.root, prepared.resume_from
    start_step = load_state(resume_from)["step"] if resume_from is not None else 0
    if start_step >= cfg.train.steps:
        log.info("run %s already finished at step %d (train.steps=%d); nothing to do", root, start_step,
                 cfg.train.steps)
        prepared.close()
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # what the start's check could not foresee (a special or full file system)
        raise ConfigError(f"train.out={str(root)!r}: cannot create the run directory ({e.strerror or e}): "
                          "give --out (train.out) a directory you can write") from None
    if dist_env()[0] == 0:  # rank 0 writes the run's files; the others may be reading this one
        save_config(cfg, root / RUN_CONFIG_FILE)
    torch.manual_seed(cfg.train.seed)
    init_distributed(cfg.train.backend)  # before loading: pins this rank's GPU
    split = prepared.feed is not None
    model, tok, device, linears, ref = _policy_and_reference(prepared, not split or bool(cfg.eval.every))
    from nanogrpo.training.distill import Distill

    # [distill]: its teacher, loaded (computing as the trainer does) or reached
    distill = Distill.from_config(cfg, model, tok, device, cpu_linear=linears.get("trainer"))
    servers = cfg.rollout.engine == "vllm_server" and not split
    weights_dtype = next(model.parameters()).dtype  # what the servers hold (FSDP2 trains float32 masters)
    # the server tier generates on the servers and split mode not at all: sharded backends then keep no
    # unsharded copy (unless split mode evaluates)
    backend = make_backend(cfg, model, rollout_copy=bool(cfg.eval.every) if split else not servers)
    main = backend.is_main
    engine = _engine(prepared, backend, tok, linears) if not split or (main and cfg.eval.every) else None
    parts = Parts()
    tier = None
    if servers:
        from nanogrpo.training.server_tier import ServerTier

        tier = ServerTier(cfg, engine, backend, weights_dtype, tok, run_dir=root)
        parts.append(tier)
    source = _source(prepared, backend, model, tok, engine, tier)
    parts.append(source)
    # the features, each a part from its own module (None: not this run's)
    from nanogrpo.training.routing import RoutingReplay

    parts += [p for p in (RoutingReplay.for_run(cfg, model, engine, engine_here=not split), distill,
                          MidBatchCheckpoints()) if p is not None]
    resume_step = start_step if resume_from is not None else None
    logger = RunLogger(root, cfg, resume_step=resume_step,
                       fields={f"cpu_linear/{k}": v for k, v in linears.items()}) if main else None
    monitor = Monitor.for_run(cfg, root, prepared.rewards, resume_step) if main else None
    evaluates = bool(cfg.eval.every) if split else bool(prepared.eval_rows)
    held_out = None
    if evaluates and main:
        # a sharded backend on the server tier keeps no full copy to measure the evaluation's entropy with
        sharded = servers and backend.name in ("fsdp2", "deepspeed")
        held_out = HeldOut(cfg, root, prepared.eval_rows, prepared.rewards, engine, tok, backend.module,
                           policy=None if sharded else backend.rollout_model(), tools=prepared.tools,
                           env=prepared.env)
    run = Run(cfg, root, backend, tok, device, ref, source, parts, terms_of(parts),
              EntropyControl.from_config(cfg.grpo), RunLog(logger, monitor, main, source.label), held_out,
              evaluates, start_step, clock, engine=engine, linears=linears, resumed=resume_from is not None,
              reward_names=[s.strip() for s in cfg.rewards.functions] if split else prepared.rewards.specs)
    if resume_from is not None:
        _restore(run, resume_from)
    return run


def _policy_and_reference(prepared: PreparedRun, engine: bool):
    """(the policy to train, tokenizer, device, ``model.cpu_linear``'s decisions, the frozen reference or
    None). ``engine``: this process runs an engine of its own (its CPU linears are decided too)."""
    cfg, resume_from = prepared.cfg, prepared.resume_from
    ckpt_root = prepared.root / "checkpoints"
    model, tok, device = load_policy(cfg.model, prepared.model_path, cpu_linear="torch")
    # model.cpu_linear decided once per run: a resumed run reuses the checkpoint's decisions
    recorded = load_state(resume_from).get("cpu_linear") if resume_from is not None else None
    linears = settle(cfg.model.cpu_linear, model, recorded,
                     engine=engine and cfg.rollout.engine in ("fast", "auto"))
    adapter = check_resume_kind(resume_from, cfg.model.lora_r)
    dtype = next(model.parameters()).dtype
    if resume_from is not None and not adapter:
        resumed = load_model(str(resume_from), dtype, device, cfg.model.attn_implementation,
                             cfg.model.trust_remote_code, "torch")
        model.load_state_dict(resumed.state_dict())
        del resumed
    ref = None
    wants_ref = cfg.grpo.beta > 0 and prepared.feed is None  # split mode: its server sends them
    if wants_ref and not cfg.model.lora_r and resume_from is not None and (ckpt_root / "step_0").is_dir():
        ref = load_model(str(ckpt_root / "step_0"), dtype, device, cfg.model.attn_implementation,
                         cfg.model.trust_remote_code, linears.get("trainer", cfg.model.cpu_linear))
        ref.eval().requires_grad_(False)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.model.lora_r:
        from nanogrpo.models.lora import apply_lora, load_adapter

        model = (load_adapter(model, resume_from, trainable=True, cfg=cfg.model,
                              gradient_checkpointing=cfg.train.gradient_checkpointing) if adapter
                 else apply_lora(model, cfg.model, cfg.train.gradient_checkpointing))
    if wants_ref and ref is None:
        from nanogrpo.models.lora import reference_for

        ref = reference_for(model)  # LoRA: the same model with adapters disabled, no copy
    return model, tok, device, linears, ref


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


def _engine(prepared: PreparedRun, backend, tok, linears: dict[str, str]):
    """The rollout engine (it serves the held-out evaluation too), built from the (resumed) weights; the
    rows' images checked against it before any step."""
    from nanogrpo.data.images import check_model_takes_images
    from nanogrpo.engines.factory import engine_for
    from nanogrpo.rollout.turns import longest_context

    cfg = prepared.cfg
    longest_new = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)  # the engine serves both
    env = prepared.env
    max_len = longest_context(cfg, tok, longest_new) if env is None else env.longest(longest_new)
    engine = engine_for(cfg, backend.rollout_model(), tok, max_len=max_len, cpu_linear=linears.get("engine"))
    for part in (prepared.rows, prepared.eval_rows or []):  # before any step: one line, not a crash mid-run
        check_model_takes_images(part, cfg.data.image_field, getattr(engine, "vision", None), cfg.model.path,
                                 multi_turn=prepared.tools is not None or prepared.env is not None)
    return engine


def _source(prepared: PreparedRun, backend, model, tok, engine, tier):
    """Where the run's batches come from: the feed it was prepared with (split mode), the async pipeline,
    or this process."""
    cfg = prepared.cfg
    if prepared.feed is not None:  # split mode's server
        return prepared.feed.source(cfg, backend, model, prepared.root, fresh=prepared.resume_from is None)
    from nanogrpo.data import PromptSampler
    from nanogrpo.rollout.collect import Collector
    from nanogrpo.training.sources import AsyncRollout, LocalRollout

    sampler = PromptSampler(prepared.rows, cfg.rollout.prompts_per_step, seed=cfg.train.seed,
                            shuffle=cfg.data.shuffle)
    several = backend.world_size > 1
    collector = Collector(engine, tok, prepared.rewards, cfg, tools=prepared.tools, env=prepared.env,
                          reduce=backend.all_reduce if several else None)
    if tier is not None and cfg.rollout.max_staleness:
        return AsyncRollout(sampler, collector, cfg, backend.world_size)
    return LocalRollout(sampler, collector, recording=tier is not None)


def _restore(run: Run, ckpt: Path) -> None:
    """The run's state from checkpoint ``ckpt``: optimizer and random streams (the backend's), the policy
    version, entropy control, each part's state, a step left mid-batch."""
    state = run.backend.restore(ckpt)
    run.version = run.engine_version = state.get("policy_version", run.start_step)
    run.control.load_state_dict(state.get("entropy_control"))
    run.parts.restore(state)
    run.pending = read_pending(ckpt, state, run.backend.rank, run.device)
    if run.is_main:
        log.info("resuming %s from %s (policy version %d)", run.root, ckpt.name, run.version)


def local_run(cfg, model, tok, engine, rewards, sampler, *, ref=None, optimizer=None) -> Run:
    """A one-process run around objects already built, rolling out here, with no logs, evaluation or
    checkpoints: what a benchmark times with :func:`~nanogrpo.training.loop.train_step`."""
    from nanogrpo.rollout.collect import Collector
    from nanogrpo.training.backend import Backend
    from nanogrpo.training.sources import LocalRollout

    source = LocalRollout(sampler, Collector(engine, tok, rewards, cfg))
    backend = Backend(model, optimizer, lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas),
                      weight_decay=cfg.train.weight_decay)
    return Run(cfg, Path(cfg.train.out), backend, tok, next(model.parameters()).device, ref, source,
               Parts([source]), Terms(), EntropyControl.from_config(cfg.grpo), RunLog(None, None, False),
               None, False, 0, Clock(), engine=engine, reward_names=list(rewards.specs))
