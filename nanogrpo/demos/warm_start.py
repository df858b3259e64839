"""What the demos' builders share: torch on one thread, supervised steps, an atomic save.

Each builder (``python -m nanogrpo.demos.NAME.build``) makes its own sequences and model, then ends the
same way: :func:`train_and_save` (:func:`sft`, then :func:`save`) inside :func:`one_thread`. One thread
and fixed seeds give the same weights on every machine of the same torch build, which is how the
shipped ``weights/`` were made. :func:`builder_main` is their command line.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["builder_main", "one_thread", "sft", "save", "train_and_save"]


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside the block (one reduction order: the same weights on every run), the
    caller's thread count after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sft(model, pad_id: int, seqs: list[list[int]], trained: list[list[bool]], steps: int, batch_size: int,
        lr: float, log_every: int) -> None:
    """Supervised steps over ``seqs`` in order, ``batch_size`` at a time: next-token loss on the
    positions ``trained`` marks (completions; not prompts, not tool output), AdamW with warmup and
    a cosine decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    model.train()
    t0 = time.time()
    for step in range(steps):
        scale = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        idx = range(step * batch_size, (step + 1) * batch_size)
        L = max(len(seqs[i]) for i in idx)
        ids = torch.full((batch_size, L), pad_id, dtype=torch.long)
        labels = torch.full((batch_size, L), -100, dtype=torch.long)
        for j, i in enumerate(idx):
            s = torch.tensor(seqs[i])
            ids[j, :len(s)] = s
            labels[j, :len(s)] = torch.where(torch.tensor(trained[i]), s, -100)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"warm start step {step + 1}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    model.eval()


def save(model, tok, out: Path, files: dict[str, str] | None = None, replace: bool = False) -> Path:
    """Save model and tokenizer (HF format), and ``files`` (name -> text) beside them, to ``out``
    atomically: a temporary directory renamed. An ``out`` that exists is replaced (``replace``) or kept
    (a build into the cache that another process finished first)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    if out.exists() and replace:
        shutil.rmtree(out)
    if out.exists():
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out


def train_and_save(model, tok, seqs: list[list[int]], trained: list[list[bool]], out: Path, steps: int,
                   batch_size: int, lr: float, log_every: int, replace: bool = False) -> Path:
    """A builder's tail: :func:`sft` over ``seqs`` (``trained`` marks the positions learnt), then
    :func:`save` to ``out``."""
    sft(model, tok.pad_token_id, seqs, trained, steps, batch_size, lr, log_every)
    return save(model, tok, out, replace=replace)


def builder_main(argv: list[str] | None, description: str, build: Callable[..., Path], out: Path, steps: int,
                 batch_size: int | None = None, lr: float | None = None) -> int:
    """A builder's command line: ``--out`` (default ``out``, the shipped weights' folder), ``--steps`` and,
    where given a default, ``--batch-size`` and ``--lr``; then ``build(out, steps=..., ...)``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--steps", type=int, default=steps)
    if batch_size is not None:
        ap.add_argument("--batch-size", type=int, default=batch_size)
    if lr is not None:
        ap.add_argument("--lr", type=float, default=lr)
    a = ap.parse_args(argv)
    extra = {k: getattr(a, k) for k in ("batch_size", "lr") if hasattr(a, k)}
    build(a.out, steps=a.steps, **extra)
    print(f"saved {a.out}")
    return 0
