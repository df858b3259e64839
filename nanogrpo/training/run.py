"""What the loop holds: the :class:`Run` (everything built once), the :class:`Part` a feature is, the
:class:`StepBatch` a source hands over, and the :class:`Clock` the end line's time comes from.

A feature of a run (the server tier's weight sync, split mode's publishing, on-policy distillation, mid-batch
checkpoints, ...) is a :class:`Part`: an object in a module of its own that joins the loop at its named
points, each called by the loop in one visible place, on every rank, in the order the parts were listed::

    start(run)                              before the first step (the servers get the run's weights);
                                            returns fields for the held-out baseline row
    after_rollout(run, item)                the step's batch is made and has its reference log-probs
    after_update(run, step, item, sched, result)   after each optimizer step (``run.version`` counts it)
    after_step(run, step, item, row)        the step's updates are done, its metrics in ``row``
    state(run) / restore(state)             what a checkpoint keeps of it / reads back on resume
    after_save(run, step)                   a checkpoint of ``step`` is written
    close(run)                              the run ends (normally or not)

The batch's source (:mod:`nanogrpo.training.sources`, :mod:`nanogrpo.serve.feed`) is a part too, with
``next(run, step, pending)`` besides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanogrpo.config import Config
from nanogrpo.training.schedule import Schedule
from nanogrpo.training.terms import Terms


class Part:
    """A feature at the loop's named points (see the module docstring); every point does nothing here."""

    baseline = True
    """A source's: whether a fresh run evaluates its starting policy (step 0) before the first step."""

    def start(self, run: Run) -> dict[str, Any]:
        return {}

    def after_rollout(self, run: Run, item: StepBatch) -> None:
        pass

    def after_update(self, run: Run, step: int, item: StepBatch, sched: Schedule, result) -> None:
        pass

    def after_step(self, run: Run, step: int, item: StepBatch, row: dict[str, Any]) -> None:
        pass

    def state(self, run: Run) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        pass

    def after_save(self, run: Run, step: int) -> None:
        pass

    def close(self, run: Run) -> None:
        pass


class Parts(list):
    """The run's parts, each point called on every part in order."""

    def start(self, run: Run) -> dict[str, Any]:
        return {k: v for p in self for k, v in p.start(run).items()}

    def after_rollout(self, run: Run, item: StepBatch) -> None:
        for p in self:
            p.after_rollout(run, item)

    def after_update(self, run: Run, step: int, item: StepBatch, sched: Schedule, result) -> None:
        for p in self:
            p.after_update(run, step, item, sched, result)

    def after_step(self, run: Run, step: int, item: StepBatch, row: dict[str, Any]) -> None:
        for p in self:
            p.after_step(run, step, item, row)

    def state(self, run: Run) -> dict[str, Any]:
        return {k: v for p in self for k, v in p.state(run).items()}

    def restore(self, state: dict[str, Any]) -> None:
        for p in self:
            p.restore(state)

    def after_save(self, run: Run, step: int) -> None:
        for p in self:
            p.after_save(run, step)

    def close(self, run: Run) -> None:
        """Every part's ``close``, the first error raised after all have run."""
        err = None
        for p in self:
            try:
                p.close(run)
            except Exception as e:  # noqa: BLE001 (the others still close)
                err = err or e
        if err is not None:
            raise err


@dataclass
class StepBatch:
    """One step's batch as its source hands it to the loop (this rank's share)."""

    batch: Any
    """The :class:`~nanogrpo.batch.RolloutBatch` on the trainer's device, or None (no group carried signal
    on this rank)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The rollout's figures for the step's row (reward, accuracy, lengths, ... its source's figures)."""
    examples: list[dict[str, Any]] | None = None
    """The step's rollout table (a few completions with their rewards and advantages)."""
    fresh: bool = True
    """Sampled under the weights the step starts from (False: a stale batch)."""
    exact: bool = True
    """Sampled by an engine that computes as the trainer does (False: vLLM's kernels: even the first update
    takes the clipped ratio against its log-probs)."""
    sched: Schedule | None = None
    """Where the batch's optimizer steps stand when a mid-batch checkpoint resumed the step; None: new."""
    scored: bool = False
    """Its reference log-probs and teacher scores are on it already (a step resumed mid-batch)."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """Server tier: the (first, last) weight version each sample was generated under."""
    earlier_s: float = 0.0
    """Seconds spent making it before the step began (a producer thread's rollout, a resumed step's)."""
    rollout_s: float = 0.0
    """Seconds the step's batch took in all (``earlier_s`` and the step's own until its updates; set by the
    loop)."""
    version: int = 0
    """The policy version the step started from (set by the loop)."""
    keep: bool = True
    """A mid-batch checkpoint stores the batch and its rollout figures (False: its source keeps them)."""
    info: dict[str, Any] = field(default_factory=dict)
    """What the source needs again after the step (split mode: the batch's id, worker, lag)."""

    def rollout_record(self) -> dict[str, Any]:
        """The rollout's figures as a mid-batch checkpoint stores them (``pending/rollout_rank{r}.json``)."""
        return {"metrics": self.fields, "examples": self.examples, "rollout_time_s": self.rollout_s}


@dataclass
class Clock:
    """Where the run's wall time went, measured on this process's loop thread with one clock (the parts
    add up to the whole): steps, held-out evaluation, checkpoints; the rest is loading."""

    start: float = field(default_factory=time.perf_counter)
    steps_s: float = 0.0
    eval_s: float = 0.0
    save_s: float = 0.0

    def parts(self) -> dict[str, float]:
        total = time.perf_counter() - self.start
        rest = total - self.steps_s - self.eval_s - self.save_s
        return {"total": total, "steps": self.steps_s, "eval": self.eval_s, "save": self.save_s, "rest": rest}


@dataclass
class Run:
    """A run, built once by :func:`~nanogrpo.training.setup.setup`: what the loop and its helpers read."""

    cfg: Config
    root: Path
    backend: Any
    """The :class:`~nanogrpo.training.backend.Backend`: the policy (``backend.module``), its optimizer,
    collectives, checkpoints."""
    tok: Any
    device: torch.device
    ref: torch.nn.Module | None
    """The frozen reference (None: ``grpo.beta`` 0, or split mode, whose server sends its log-probs)."""
    source: Any
    """Where each step's batch comes from (``next(run, step, pending)``), also one of :attr:`parts`."""
    parts: Parts
    terms: Terms
    """What features add inside the update (:mod:`nanogrpo.training.terms`)."""
    control: Any
    """The entropy-bonus coefficient (:class:`~nanogrpo.algo.entropy.EntropyControl`): in each update's
    loss, moved after each optimizer step, kept in checkpoints."""
    log: Any
    """:class:`~nanogrpo.training.run_log.RunLog`: metrics, the run monitor, the progress bar."""
    held_out: Any
    """:class:`~nanogrpo.training.held_out.HeldOut` (rank 0, ``eval.every``), else None."""
    evaluates: bool
    """Whether the run evaluates on held-out rows (every rank: the evaluation may be a collective)."""
    start_step: int
    clock: Clock
    engine: Any = None
    """The rollout engine (local rollouts and evaluation), None when this process generates nothing."""
    version: int = 0
    """The policy version: optimizer steps that changed the weights, since the run began."""
    engine_version: int = 0
    """The version an engine that holds its own copy of the weights (vLLM) last received."""
    pending: Any = None
    """A step a mid-batch checkpoint interrupted (:class:`~nanogrpo.training.midbatch.Pending`)."""
    linears: dict[str, str] = field(default_factory=dict)
    """``model.cpu_linear``'s decisions, recorded in checkpoints."""
    reward_names: list[str] = field(default_factory=list)
    """The names the ``reward/<name>`` means are logged under (the same on every rank)."""
    resumed: bool = False

    @property
    def is_main(self) -> bool:
        return self.backend.rank == 0

    @property
    def share_prefix(self) -> bool:
        """Whether forwards run a group's prompt once (``train.share_prefix``, where the backend allows)."""
        return self.cfg.train.share_prefix and self.backend.prefix_sharing

    def steps(self):
        """The steps left to run (a progress bar on rank 0)."""
        return self.log.steps(self.start_step, self.cfg.train.steps)

    def take_pending(self, step: int):
        """The mid-batch checkpoint's interrupted step if it is ``step`` (once)."""
        pending, self.pending = self.pending, None
        return pending if pending is not None and pending.step == step else None

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint's ``trainer_state.json`` keeps of the run (every rank calls it: a part may
        reduce over ranks)."""
        return {"policy_version": self.version, "cpu_linear": self.linears,
                "entropy_control": self.control.state_dict(), **self.parts.state(self)}

    def save(self, step: int) -> None:
        """A checkpoint of ``step`` (every rank; rank 0 writes it)."""
        t0 = time.perf_counter()
        self.backend.save(self.root / "checkpoints", step, self.tok, self.trainer_state(),
                          save_merged=self.cfg.model.lora_save_merged)
        self.parts.after_save(self, step)
        self.clock.save_s += time.perf_counter() - t0

    def sync_engine(self) -> None:
        """An engine that holds its own copy of the weights (in-process vLLM) gets the trained ones."""
        e = self.engine
        if e is not None and getattr(e, "owns_weights", False) and not getattr(e, "remote", False) \
                and self.engine_version != self.version:
            e.load_from(self.backend.rollout_model())
            self.engine_version = self.version
