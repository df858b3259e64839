"""Checkpoints: an HF-format model + tokenizer, plus the state to resume exactly.

Layout of ``RUN/checkpoints/step_N/``::

    config.json, model.safetensors, tokenizer files   (``save_pretrained``: loadable by transformers)
    trainer_state.json                                (step, policy version, data position, python RNG,
                                                       what model.cpu_linear=auto decided)
    optimizer.pt                                      (optimizer state; torch tensors only)
    rng.pt                                            (torch CPU/CUDA RNG states)

A mid-batch checkpoint (``train.save_every_updates``), ``RUN/checkpoints/step_N_update_U/``, is taken
inside step N after its U-th optimizer step: the same files (``step`` is N - 1, the last whole step)
plus ``pending/`` with each rank's share of the batch being trained on and ``trainer_state.json``'s
``pending`` (:mod:`nanogrpo.training.schedule`). Only the newest one is kept.

A checkpoint is written to a hidden temporary directory and renamed into place
(an atomic rename on POSIX), then ``RUN/checkpoints/latest`` is replaced
atomically; a kill at any moment leaves the previous checkpoint intact and the
half-written one ignored (and removed at the next save).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.json"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    st: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""A vision-language model's image processor settings: copied from the directory it was loaded from
into each checkpoint, so the checkpoint resizes images as the model's processor does."""


def _copy_processor_files(model, dest: Path) -> None:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    src = getattr(getattr(inner, "config", None), "_name_or_path", None)
    if not src or not Path(src).is_dir() or Path(src).resolve() == dest.resolve():
        return
    for name in PROCESSOR_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dest / name)


def save_checkpoint(ckpt_root: Path, step: int, model, tokenizer, state: dict[str, Any] | None = None, *,
                    state_dict: dict[str, torch.Tensor] | None = None,
                    optimizer_state: dict[str, Any] | None = None, extra=None,
                    save_merged: bool = False, name: str | None = None) -> Path:
    """Write ``ckpt_root/step_{step}`` (or ``ckpt_root/name``) atomically and point ``latest`` at it.

    ``state``: the trainer's state (``trainer_state.json``); ``optimizer_state``: the optimizer's state dict
    (``optimizer.pt``). Distributed backends pass the gathered ``state_dict`` (the model itself may be
    sharded) and ``extra(tmp_dir)`` to move their own files in before the rename. A PEFT model saves its
    adapter; ``save_merged`` adds the merged model under ``merged/``.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_root / (name or f"step_{step}")
    tmp = Path(tempfile.mkdtemp(dir=ckpt_root, prefix=f".tmp-{final.name}-"))
    if state_dict is None:
        model.save_pretrained(tmp, safe_serialization=True)
    else:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _copy_processor_files(model, tmp)
    if save_merged:
        from nanogrpo.models.lora import save_merged as _save_merged

        _save_merged(model, tmp / "merged")
        tokenizer.save_pretrained(tmp / "merged")
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    if extra is not None:
        extra(tmp)
    torch.save(rng_state(), tmp / "rng.pt")
    full_state = {"step": step, "python_rng": _py_rng_to_json(random.getstate()), **(state or {})}
    (tmp / STATE_FILE).write_text(json.dumps(full_state, indent=1))
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)
    _test_pause()
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it
        trash = ckpt_root / f".tmp-old-{final.name}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(ckpt_root)
    _atomic_write_text(ckpt_root / "latest", final.name + "\n")
    for old in ckpt_root.glob("step_*_update_*"):  # mid-batch resume points: only the newest one counts
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _test_pause() -> None:
    """Test hook: ``NANOGRPO_TEST_SAVE_SLEEP=SECONDS`` sleeps with the checkpoint written but not yet
    renamed into place, so a test can kill the process in the middle of a save."""
    delay = os.environ.get("NANOGRPO_TEST_SAVE_SLEEP")
    if delay:
        time.sleep(float(delay))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint (``latest`` pointer, else the highest ``step_N`` with state)."""
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        cand = ckpt_root / pointer.read_text().strip()
        if (cand / STATE_FILE).is_file():
            return cand
    steps = sorted((_order(p.name), p) for p in ckpt_root.glob("step_*")
                   if _order(p.name) is not None and (p / STATE_FILE).is_file())
    return steps[-1][1] if steps else None


def _order(name: str) -> tuple[int, int] | None:
    """Sort key of a checkpoint name: ``step_N`` (N, 0); ``step_N_update_U`` (N - 1, U), after step N - 1."""
    parts = name.split("_")
    if len(parts) == 2 and parts[1].isdigit():
        return int(parts[1]), 0
    if len(parts) == 4 and parts[1].isdigit() and parts[2] == "update" and parts[3].isdigit():
        return int(parts[1]) - 1, int(parts[3])
    return None


def load_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text())


def restore(ckpt: Path, optimizer=None) -> dict[str, Any]:
    """Restore optimizer and RNG streams from ``ckpt``; return the trainer state dict."""
    state = load_state(ckpt)
    if optimizer is not None and (ckpt / "optimizer.pt").is_file():
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location="cpu"))
    set_rng_state(torch.load(ckpt / "rng.pt", weights_only=True))
    random.setstate(_py_rng_from_json(state["python_rng"]))
    return state


def _py_rng_to_json(st: tuple) -> list:
    return [st[0], list(st[1]), st[2]]


def _py_rng_from_json(st: list) -> tuple:
    return (st[0], tuple(st[1]), st[2])
