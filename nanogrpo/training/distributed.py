"""Training backends: one process, DDP, FSDP2 and DeepSpeed ZeRO, behind one small interface.

``train.backend`` picks one; the launcher starts the processes:

    nanogrpo train ...                                              single
    torchrun --nproc_per_node 8 -m nanogrpo.cli train train.backend=ddp ...     (or fsdp2)
    deepspeed --num_gpus 8 --module nanogrpo.cli train train.backend=deepspeed train.zero_stage=2 ...

The interface is :class:`~nanogrpo.training.backend.Backend` (``single`` is it, a
pass-through); this module holds DDP and FSDP2, joining and leaving the process
group and :func:`make_backend`; DeepSpeed is :mod:`nanogrpo.training.deepspeed_backend`.

Data: ``rollout.prompts_per_step`` is the *global* number of prompts per step;
every rank draws the same sampler stream and keeps rows ``rank::world``
(:meth:`Backend.shard`), so the stream is resumable from rank 0's state.

Rollout under N ranks: each rank generates for its own prompts with a local
model. DDP and ZeRO-1/2 hold full weights on every rank: the engine uses the
module itself. FSDP2 and ZeRO-3 hold shards, so each rank keeps a full,
unsharded copy for generation (``rollout_model``) whose weights are refreshed
from the shards before each rollout (``before_rollout``: an all-gather). That
costs one more copy of the weights per rank; when it does not fit, run split
mode (``nanogrpo rollout`` workers + ``nanogrpo train --server``) instead.

Checkpoints from any backend are one HF-format model gathered on rank 0
(``save_pretrained``); the optimizer state resumes on the same backend
(DDP: rank 0's state; FSDP2: a full optimizer state dict; DeepSpeed: its own
per-rank files under ``deepspeed/`` in the checkpoint).
"""

from __future__ import annotations

import copy
import datetime
import inspect
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanogrpo.algo.logprobs import lean_head
from nanogrpo.config import Config
from nanogrpo.training.backend import Backend

log = logging.getLogger("nanogrpo.train")



def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment (1 process when unset)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=60)
"""How long a rank waits in a collective: rank 0 alone evaluates and saves while the others wait in
the next step's first collective (NCCL's default, 10 minutes, is short for a long evaluation)."""


def init_distributed(backend: str) -> tuple[int, int]:
    """Join the process group (gloo on CPU, nccl on CUDA) and pin this rank's GPU; returns (rank, world)."""
    rank, world, local = dist_env()
    if backend == "single":
        if world > 1:
            raise RuntimeError(f"WORLD_SIZE={world} but train.backend=single: set train.backend to "
                               "ddp, fsdp2 or deepspeed")
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        if backend == "deepspeed":
            import deepspeed
            from deepspeed.accelerator import get_accelerator

            # gloo on the CPU accelerator (DeepSpeed would pick oneCCL when its bindings are present)
            deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu"
                                       else None, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    timeout=COLLECTIVE_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def leave_launched_rank(rc: int = 0) -> None:
    """End a launched rank whose work is done: every rank past one last barrier, output flushed, then
    ``os._exit`` without interpreter teardown. Tearing down gloo's process group at exit aborted the
    process now and then (SIGABRT, "terminate called without an active exception", no Python frame,
    even after a barrier: CI, under load), or deadlocked when destroyed while DDP's reducer held it."""
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)




class DDPBackend(Backend):
    """DistributedDataParallel: full replicas, gradients all-reduced (averaged) in backward."""

    name = "ddp"

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        from torch.nn.parallel import DistributedDataParallel as DDP

        lean_head(model)
        dev = next(model.parameters()).device
        # no buffer sync in forwards (ranks run different numbers of them with prefix sharing; the
        # buffers, RoPE tables, are equal anyway); torch >= 2.13 names the switch forward_sync_buffers
        new = "forward_sync_buffers" in inspect.signature(DDP).parameters
        no_sync = {"forward_sync_buffers": False} if new else {"broadcast_buffers": False}
        self.model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, **no_sync)


class FSDP2Backend(Backend):
    """FSDP2 (``fully_shard``) per decoder layer + root; float32 shards (the masters), compute in
    the model's original dtype (``MixedPrecisionPolicy``), reduce in float32; optional CPU offload."""

    name = "fsdp2"
    prefix_sharing = False  # every forward all-gathers: ranks must run the same number

    def __init__(self, model, *, cpu_offload: bool = False, keep_rollout_copy: bool = True, **kw):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        lean_head(model)
        orig = next(model.parameters()).dtype
        self._dtype = orig
        self._gen = copy.deepcopy(model).eval().requires_grad_(False) if keep_rollout_copy else None
        model.to(torch.float32)
        mp = MixedPrecisionPolicy(param_dtype=None if orig == torch.float32 else orig,
                                  reduce_dtype=torch.float32)
        extra = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
        layers = getattr(model.get_decoder(), "layers", None)
        if layers is None:
            raise RuntimeError("train.backend=fsdp2 needs a decoder with .layers (Llama/Qwen-style)")
        for layer in layers:
            fully_shard(layer, mp_policy=mp, **extra)
        fully_shard(model, mp_policy=mp, **extra)
        kw.pop("offload", None)
        super().__init__(model, **kw)

    def clip_and_step(self, max_norm: float) -> float:
        return super().clip_and_step(max_norm)

    def _opts(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **kw)

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.module, options=self._opts(cpu_offload=True))
        return {k: v.to(self._dtype) for k, v in sd.items()} if self.is_main else None

    def optimizer_state(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        sd = get_optimizer_state_dict(self.module, self.optimizer.opt, options=self._opts(cpu_offload=True))
        return {"fsdp2_full": sd} if self.is_main else None

    def load_optimizer_state(self, ckpt: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        f = ckpt / "optimizer.pt"
        if f.is_file():
            sd = torch.load(f, weights_only=True, map_location="cpu")["fsdp2_full"]
            set_optimizer_state_dict(self.module, self.optimizer.opt, sd, options=self._opts())

    @torch.no_grad()
    def before_rollout(self) -> None:
        if self._gen is None:
            return
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.module, options=self._opts())  # all-gather, every rank
        own = self._gen.state_dict()
        for k, v in sd.items():
            own[k].copy_(v)


def make_backend(cfg: Config, model: torch.nn.Module, rollout_copy: bool = True) -> Backend:
    """The configured backend around ``model`` (already on this rank's device, full weights loaded).
    ``rollout_copy=False``: sharded backends keep no full copy for generation (split mode's trainer
    generates nothing, unless it evaluates)."""
    t = cfg.train
    kw = dict(lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay, offload=t.optimizer_offload)
    if t.backend == "single":
        return Backend(model, **kw)
    if t.backend == "ddp":
        return DDPBackend(model, **kw)
    if t.backend == "fsdp2":
        if cfg.model.lora_r:
            raise RuntimeError("LoRA with train.backend=fsdp2 is not supported: use ddp or deepspeed")
        return FSDP2Backend(model, cpu_offload=t.fsdp_cpu_offload, keep_rollout_copy=rollout_copy, **kw)
    if t.backend == "deepspeed":
        from nanogrpo.training.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(model, stage=t.zero_stage, max_grad_norm=t.max_grad_norm,
                                keep_rollout_copy=rollout_copy, **kw)
    raise ValueError(f"unknown train.backend {t.backend!r}")


__all__ = ["Backend", "DDPBackend", "FSDP2Backend", "dist_env", "init_distributed",
           "leave_launched_rank", "make_backend"]
