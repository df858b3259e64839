"""The GRPO loop, every mode: the seed's step; what runs around it is built once and joins at named points.

    run = setup(prepared)                    everything built once (training/setup.py)
    begin(run)                               the servers synced; held-out baseline and step_0 (a fresh run)
    for step in run.steps():
        row = train_step(run, step)          sample, generate, score; reference log-probs; the updates
        evaluate(run, step, row)             held-out accuracy every eval.every steps
        run.log.record(row)                  the run monitor, metrics.jsonl, the progress bar
        save (every train.save_every steps, at the end, when the monitor stops the run)

The step's batch comes from the run's source (this process's rollout, the async pipeline on vLLM servers, or
split mode's server: :mod:`nanogrpo.training.sources`, :mod:`nanogrpo.serve.feed`). A feature (the server
tier's sync, split mode's publishing, distillation, mid-batch checkpoints) is a part of the run
(:class:`~nanogrpo.training.run.Part`, in its own module) that joins at the points this module calls:
``run.parts.after_rollout``, ``after_update`` (after each optimizer step), ``after_step``, at save and at
the end.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from nanogrpo.config import Config
from nanogrpo.training.logging_sinks import run_summary
from nanogrpo.training.metrics import merge_rank_metrics
from nanogrpo.training.midbatch import test_stop
from nanogrpo.training.prepare import PreparedRun
from nanogrpo.training.run import Clock, Run, StepBatch
from nanogrpo.training.schedule import Schedule, mini_batch_count, run_updates
from nanogrpo.training.setup import setup
from nanogrpo.training.step import reference_logprobs, step_metrics
from nanogrpo.watch import stop_now

log = logging.getLogger("nanogrpo.train")


def train(prepared: PreparedRun) -> Path:
    """Run ``prepared`` up to ``train.steps`` (from its last checkpoint when resuming), every rank; returns
    the run directory."""
    clock = Clock(prepared.started)  # the end line's time: the whole of it, loading and evaluations included
    try:
        run = setup(prepared, clock)
    except BaseException:
        prepared.close()
        raise
    if run is None:  # resumed at its last step already
        return prepared.root
    try:
        begin(run)
        for step in run.steps():
            t0 = time.perf_counter()
            row = train_step(run, step)
            clock.steps_s += time.perf_counter() - t0
            evaluate(run, step, row)
            run.log.record(row, row.pop("_examples", None))
            stop = stop_now(run.log.monitor, run.backend, run.cfg.watch)  # watch.stop_on: save, then out
            every = run.cfg.train.save_every
            if (every and step % every == 0) or step == run.cfg.train.steps or stop:
                run.save(step)
            if stop:
                break
    finally:
        _close(run, prepared)
    if run.is_main:
        log.info(run_summary(run.root, start_step=run.start_step, clock=clock.parts()))
    # Under a launcher the process group stays up: destroying it while DDP's reducer still holds it
    # deadlocked (the group's destructor joins a gloo thread that waits for the GIL). The CLI leaves
    # a launched rank with os._exit once the run is done (see nanogrpo.cli.cmd_train).
    run.backend.barrier()
    return run.root


def begin(run: Run) -> None:
    """Before the first step: the parts start (the servers get the run's weights); a fresh run logs its
    held-out baseline (step 0) and saves ``step_0`` (a kill between the two resumes from ``step_0`` with the
    baseline kept; a kill before ``step_0`` exists starts the run, and the baseline, over)."""
    base = run.parts.start(run)
    if run.resumed:
        return
    if run.evaluates and run.source.baseline:
        row = {"step": 0}
        evaluate(run, 0, row, due=True)
        if run.is_main:
            run.log.record({**row, **base})
    test_stop("baseline")
    run.save(0)
    test_stop("step_0")


def train_step(run: Run, step: int) -> dict[str, Any]:
    """One step: its batch (prompts sampled, ``grpo.group_size`` answers generated and scored, advantages),
    the reference log-probs, the batch's optimizer steps; returns the step's metrics."""
    t0 = time.perf_counter()
    version = run.version
    item = run.source.next(run, step, run.take_pending(step))     # local | async pipeline | split mode
    item.version = version
    if not item.scored:
        run.parts.after_rollout(run, item)                         # routes checked, the teacher's scores
        if run.ref is not None and item.batch is not None:        # the frozen reference (grpo.beta > 0)
            share = run.share_prefix and run.terms.share_prefix(item.batch)
            item.batch.ref_logprobs = reference_logprobs(run.ref, item.batch, run.cfg, share, run.terms)
    item.rollout_s = item.earlier_s + time.perf_counter() - t0
    t1 = time.perf_counter()
    sched = take_updates(run, step, item)
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    row = step_row(run, step, item, sched, time.perf_counter() - t1)
    run.parts.after_step(run, step, item, row)                     # sync the servers, publish, ...
    return row


def take_updates(run: Run, step: int, item: StepBatch) -> Schedule | None:
    """The batch's optimizer steps: ``grpo.mini_batches`` x ``grpo.updates_per_batch``
    (:mod:`nanogrpo.training.schedule`), each one policy version, the parts' ``after_update`` after each. A
    rank without rows still joins the update's collectives; one process without a batch takes none."""
    be, cfg = run.backend, run.cfg
    sched = item.sched
    if sched is None and (item.batch is not None or be.world_size > 1):
        sched = Schedule(parts=mini_batch_count(item.batch, cfg.grpo.mini_batches, be))
    if sched is None:
        return None
    be.set_lr(lr_at(step, cfg))

    def after_update(s: Schedule, result) -> None:
        run.version += int(not result.skipped_nonfinite)
        run.parts.after_update(run, step, item, s, result)

    return run_updates(be, item.batch, cfg, sched, fresh=item.fresh, exact=item.exact, control=run.control,
                       after_update=after_update, terms=run.terms)


def step_row(run: Run, step: int, item: StepBatch, sched: Schedule | None, train_s: float) -> dict[str, Any]:
    """The step's metrics: the rollout's (``item.fields``), the updates', times, the policy version; over
    every rank (a collective under several)."""
    be, cfg = run.backend, run.cfg
    results = sched.results if sched is not None else []
    upd = step_metrics(results, sched.parts, run.terms.first_update) if results else \
        dict.fromkeys(("loss", "kl", "clip_frac", "grad_norm"), math.nan)
    step_s = item.rollout_s + train_s
    tokens = item.fields.get("completion_tokens", 0)
    row: dict[str, Any] = {"step": step, "loss": upd.pop("loss"), **item.fields, "kl": upd.pop("kl"),
                           "clip_frac": upd.pop("clip_frac"), "grad_norm": upd.pop("grad_norm"), **upd,
                           "lr": be.optimizer.lr,
                           "skipped_nonfinite": len(results) - sum(not r.skipped_nonfinite for r in results),
                           "rollout_time_s": item.rollout_s, "train_time_s": train_s, "step_time_s": step_s,
                           "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                           "policy_version": run.version, "_examples": item.examples}
    if cfg.grpo.mini_batches > 1:
        row["mini_batches"] = sched.parts if sched is not None else 0
    if run.device.type == "cuda":
        row["gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if be.world_size > 1:  # every rank logs the same, whole-batch figures (rank 0 writes them)
        row = merge_rank_metrics(row, be.all_reduce, [f"reward/{s}" for s in run.reward_names])
    return row


def evaluate(run: Run, step: int, row: dict[str, Any], due: bool = False) -> None:
    """Held-out evaluation (every ``eval.every`` steps and at the last; ``due``: now) into ``row``."""
    if not run.evaluates or not (due or step % run.cfg.eval.every == 0 or step == run.cfg.train.steps):
        return
    t0 = time.perf_counter()
    if run.backend.world_size > 1:
        run.backend.before_rollout()  # sharded backends: the engine's copy gets this step's update
    if run.held_out is not None:
        run.sync_engine()
        row.update(run.held_out(step))
    run.clock.eval_s += time.perf_counter() - t0


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to ``train.lr`` over ``warmup_steps``, then constant (the seed: constant)."""
    w = cfg.train.warmup_steps
    return cfg.train.lr * min(1.0, step / w) if w > 0 else cfg.train.lr


def _close(run: Run, prepared: PreparedRun) -> None:
    """The run's end, normal or not: the parts (the servers' requests first: a producer waiting on one ends
    at once), the logs, what the run held besides its model."""
    try:
        run.parts.close(run)
    finally:
        run.log.close()
        prepared.close()
