"""Mid-batch checkpoints (``train.save_every_updates``): a checkpoint between two optimizer steps of a
batch, holding the weights so far, the batch (each rank's share, reference log-probs included), where its
schedule stands and its rollout figures, so that a resume continues at the next optimizer step instead of
generating the batch again. :class:`MidBatchCheckpoints` is the part that writes them (after each
optimizer step); :func:`read_pending` is what a resume reads back.

A mid-batch checkpoint of step ``N`` after ``U`` optimizer steps is ``checkpoints/step_N_update_U``; its
``trainer_state.json`` records the step as ``N - 1`` (the steps done) and, as ``pending``, where step ``N``
stands.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from nanogrpo.batch import RolloutBatch
from nanogrpo.training.run import Part
from nanogrpo.training.schedule import Schedule
from nanogrpo.training.step import UpdateResult


def test_stop(name: str) -> None:
    """Test hook: ``NANOGRPO_TEST_STOP_AFTER=NAME`` ends the run (SystemExit) right after that point, as a
    kill there would, minus the kill: ``step_N_update_U`` (that mid-batch checkpoint written),
    ``baseline`` (the step-0 held-out row logged, ``step_0`` not yet saved), ``step_0`` (saved)."""
    if os.environ.get("NANOGRPO_TEST_STOP_AFTER") == name:
        raise SystemExit(f"stopped after {name} (NANOGRPO_TEST_STOP_AFTER)")


class MidBatchCheckpoints(Part):
    """After an optimizer step inside a step, every ``train.save_every_updates`` policy versions: the weights
    so far, the batch and where its schedule stands (not after the batch's last optimizer step: the step's
    end is a step checkpoint's business, ``train.save_every``)."""

    def after_update(self, run, step: int, item, sched: Schedule, result) -> None:
        every = run.cfg.train.save_every_updates
        if not every or result.skipped_nonfinite or run.version % every or sched.done >= sched.total(run.cfg):
            return
        name = f"step_{step}_update_{sched.done}"
        be = run.backend
        batch, record = (item.batch, item.rollout_record()) if item.keep else (None, None)
        be.save(run.root / "checkpoints", step - 1, run.tok,
                {**run.trainer_state(), "pending": pending_state(step, sched)},
                save_merged=run.cfg.model.lora_save_merged, name=name,
                rank_files=lambda d: write_pending(d, be.rank, batch, sched, record))
        run.parts.after_save(run, step - 1)
        test_stop(name)


PENDING_DIR = "pending"
"""A mid-batch checkpoint's sub-directory: each rank's share of the batch it was training on."""


@dataclass
class Pending:
    """A step interrupted between two optimizer steps, as a mid-batch checkpoint holds it."""

    step: int
    sched: Schedule
    batch: RolloutBatch | None
    rollout: dict
    """This rank's rollout metrics and examples, as the step's row will log them (``metrics``, ``examples``,
    ``rollout_time_s``)."""


def _result_dict(r: UpdateResult) -> dict:
    return {"loss": r.loss, "kl": r.kl, "clip_frac": r.clip_frac, "grad_norm": r.grad_norm,
            "skipped_nonfinite": r.skipped_nonfinite, "metrics": r.metrics, "bonus_entropy": r.bonus_entropy}


def pending_state(step: int, sched: Schedule) -> dict:
    """The JSON part of a mid-batch checkpoint (``trainer_state.json["pending"]``; the same on every rank)."""
    return {"step": step, "parts": sched.parts, "done": sched.done,
            "results": [_result_dict(r) for r in sched.results]}


def write_pending(d, rank: int, batch: RolloutBatch | None, sched: Schedule, rollout: dict | None) -> None:
    """This rank's share of a mid-batch checkpoint into directory ``d``: its batch (the wire format, reference
    log-probs included; None: kept elsewhere, split mode's inbox), its proximal log-probs and its rollout
    metrics (None: none)."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    if batch is not None:
        (d / f"batch_rank{rank}.safetensors").write_bytes(batch.to_bytes())
    if sched.proximal is not None:
        save_file({"proximal": sched.proximal.detach().contiguous().cpu()},
                  str(d / f"proximal_rank{rank}.safetensors"))
    if rollout is not None:
        (d / f"rollout_rank{rank}.json").write_text(json.dumps(rollout))


def read_pending(ckpt, state: dict, rank: int, device) -> Pending | None:
    """The interrupted step a checkpoint holds (``state["pending"]``), for this rank; None: none."""
    info = state.get("pending")
    if not info:
        return None
    d = Path(ckpt) / PENDING_DIR
    results = [UpdateResult(r["loss"], r["kl"], r["clip_frac"], r["grad_norm"], r["skipped_nonfinite"],
                            r["metrics"], None, r["bonus_entropy"]) for r in info["results"]]
    sched = Schedule(parts=int(info["parts"]), done=int(info["done"]), results=results)
    f = d / f"batch_rank{rank}.safetensors"
    batch = RolloutBatch.from_bytes(f.read_bytes()).to(device) if f.is_file() else None
    p = d / f"proximal_rank{rank}.safetensors"
    if p.is_file():
        sched.proximal = load_file(str(p))["proximal"].to(device)
    r = d / f"rollout_rank{rank}.json"
    return Pending(int(info["step"]), sched, batch, json.loads(r.read_text()) if r.is_file() else {})
