"""The training backend interface, and its one-process implementation (``train.backend = single``).

A :class:`Backend` holds the wrapped model (what forward is called on), the bare HF module (generation,
saving), and does backward, clip + step, collectives and checkpoints; the update step
(:mod:`nanogrpo.training.step`) is written once against it. The launched backends
(:mod:`nanogrpo.training.distributed`: DDP, FSDP2; :mod:`nanogrpo.training.deepspeed_backend`) override
what they do differently.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanogrpo.training.optim import MasterAdamW

log = logging.getLogger("nanogrpo.train")

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Backend:
    """One process: the model itself, :class:`MasterAdamW` (optionally offloaded to the CPU)."""

    name = "single"
    prefix_sharing = True
    """Whether forwards may run a prompt prefix pass (``train.share_prefix``): a rank then issues a
    data-dependent number of forwards, which only backends without forward collectives allow."""

    def __init__(self, model: torch.nn.Module, optimizer=None, *, lr: float = 1e-6,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0, offload: bool = False):
        self.module = model
        self.model = model
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() \
            else (0, 1)
        self.optimizer = optimizer if optimizer is not None else MasterAdamW(
            model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, offload=offload)

    # -- devices and collectives
    @property
    def device(self) -> torch.device:
        for p in self.module.parameters():
            return p.device if not hasattr(p, "to_local") else p.to_local().device
        return torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _coll_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")

    def all_reduce(self, values: list[float], ops: list[str] | None = None) -> list[float]:
        if self.world_size == 1:
            return list(values)
        ops = ops or ["sum"] * len(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._coll_device())
        out = t.clone()
        for op in dict.fromkeys(ops):  # same order on every rank (a set's order depends on the hash seed)
            idx = [i for i, o in enumerate(ops) if o == op]
            part = t[idx].clone()
            dist.all_reduce(part, op=_OPS[op])
            out[idx] = part
        return out.tolist()

    def all_gather_values(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D float tensor, concatenated in rank order (lengths may differ)."""
        if self.world_size == 1:
            return t
        n = int(self.all_reduce([float(t.numel())], ["max"])[0])
        dev = self._coll_device()
        pad = torch.full((n + 1,), float("nan"), dtype=torch.float64, device=dev)
        pad[0] = t.numel()
        pad[1:1 + t.numel()] = t.to(dev, torch.float64)
        parts = [torch.empty_like(pad) for _ in range(self.world_size)]
        dist.all_gather(parts, pad)
        return torch.cat([q[1:1 + int(q[0])] for q in parts]).to(t)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def shard(self, rows: list) -> list:
        """This rank's share of a global list of prompts."""
        return rows[self.rank::self.world_size]

    # -- training
    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        loss.backward()

    def clip_and_step(self, max_norm: float) -> float:
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad()
        return norm

    def set_lr(self, lr: float) -> None:
        self.optimizer.set_lr(lr)

    # -- rollout
    _gen: torch.nn.Module | None = None
    """Sharded backends keep an unsharded copy for generation, refreshed by ``before_rollout``."""

    def rollout_model(self) -> torch.nn.Module:
        return self._gen if self._gen is not None else self.module

    def before_rollout(self) -> None:
        pass

    # -- checkpoints
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on rank 0 (CPU tensors), None on other ranks. Collective."""
        if not self.is_main:
            return None
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any] | None:
        return self.optimizer.state_dict() if self.is_main else None

    def load_optimizer_state(self, ckpt: Path) -> None:
        f = ckpt / "optimizer.pt"
        if f.is_file():
            self.optimizer.load_state_dict(torch.load(f, weights_only=True, map_location="cpu"))

    def save(self, ckpt_root: Path, step: int, tokenizer, state: dict[str, Any] | None = None,
             save_merged: bool = False, name: str | None = None, rank_files=None) -> Path:
        """An HF checkpoint written by rank 0 (atomic), after every rank has given its part.
        ``name``: the directory's name (default ``step_{step}``); ``rank_files(dir)``: every rank writes its
        own files into ``dir``, which becomes the checkpoint's ``pending/`` (mid-batch checkpoints)."""
        import shutil

        from nanogrpo.training.checkpoint import save_checkpoint

        sd = self.full_state_dict()
        opt = self.optimizer_state()
        extra = self._save_extra(ckpt_root, step)
        final = Path(ckpt_root) / (name or f"step_{step}")
        if rank_files is not None:
            stage = Path(ckpt_root) / f".stage-{final.name}"
            if self.is_main:
                for old in Path(ckpt_root).glob(".stage-*"):  # left by a save that was killed
                    shutil.rmtree(old, ignore_errors=True)
                stage.mkdir(parents=True)
            self.barrier()
            rank_files(stage)
            self.barrier()
            inner = extra

            def extra(d: Path, inner=inner, stage=stage) -> None:
                if inner is not None:
                    inner(d)
                os.rename(stage, d / "pending")
        if self.is_main:
            final = save_checkpoint(Path(ckpt_root), step, self.module, tokenizer, state,
                                    state_dict=sd, optimizer_state=opt, extra=extra,
                                    save_merged=save_merged, name=name)
            log.info("checkpoint %s", final)
        self.barrier()
        return final

    def _save_extra(self, ckpt_root: Path, step: int):
        return None

    def restore(self, ckpt: Path) -> dict[str, Any]:
        """Optimizer + RNG state from ``ckpt`` (model weights are loaded before wrapping)."""
        from nanogrpo.training.checkpoint import restore

        self.load_optimizer_state(Path(ckpt))
        return restore(Path(ckpt), None)

