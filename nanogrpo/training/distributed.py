"""Training backends: one process, DDP, FSDP2 and DeepSpeed ZeRO, behind one small interface.

``train.backend`` picks one; the launcher starts the processes:

    nanogrpo train ...                                              single
    torchrun --nproc_per_node 8 -m nanogrpo.cli train train.backend=ddp ...     (or fsdp2)
    deepspeed --num_gpus 8 --module nanogrpo.cli train train.backend=deepspeed train.zero_stage=2 ...

A :class:`Backend` holds the wrapped model (what forward is called on), the bare
HF module (generation, saving), and does backward, clip + step, collectives and
checkpoints. The update step (:mod:`nanogrpo.training.step`) is written once
against it; ``single`` is a pass-through.

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
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanogrpo.algo.logprobs import lean_head
from nanogrpo.config import Config
from nanogrpo.training.optim import MasterAdamW

log = logging.getLogger("nanogrpo.train")

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


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
            final = save_checkpoint(Path(ckpt_root), step, self.module, tokenizer, None, state,
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


SingleBackend = Backend


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


class DeepSpeedBackend(Backend):
    """DeepSpeed ZeRO 1-3 (the seed's config), AdamW with optional CPU offload, bf16 when the model is."""

    name = "deepspeed"
    # ZeRO-1/2 reduce gradients in buckets filled in the order parameters become ready in backward;
    # a prefix pass on one rank and none on another changes that order, and 2-rank ZeRO-2 steps
    # came out wrong (1 rank: exact). ZeRO-3 also gathers parameters in forwards. So: off.
    prefix_sharing = False

    def __init__(self, model, *, stage: int = 2, lr: float = 1e-6, betas=(0.9, 0.999),
                 weight_decay: float = 0.0, offload: bool = False, max_grad_norm: float = 1.0,
                 keep_rollout_copy: bool = True):
        import deepspeed

        lean_head(model)
        self._dtype = next(model.parameters()).dtype
        self.stage = stage
        self._gen = copy.deepcopy(model).eval().requires_grad_(False) if stage == 3 and keep_rollout_copy \
            else None
        self.ds_config = deepspeed_config(stage, lr, betas, weight_decay, offload, max_grad_norm,
                                          bf16=self._dtype == torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        client_opt = None if offload else torch.optim.AdamW(params, lr=lr, betas=betas,
                                                            weight_decay=weight_decay)
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=params,
                                                 optimizer=client_opt, config=self.ds_config)
        self.engine = engine
        self.module = engine.module
        self.model = engine
        self.optimizer = _DSOptimizer(engine)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def backward(self, loss, last: bool = True) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)

    def clip_and_step(self, max_norm: float) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.engine.zero_grad()
        norm = float(norm) if norm is not None else float("nan")
        return norm

    def _gathered(self):
        import deepspeed

        if self.stage < 3:
            from contextlib import nullcontext

            return nullcontext()
        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)

    def full_state_dict(self):
        with self._gathered():
            if not self.is_main:
                return None
            sd = self.module.state_dict()
            return {k: v.detach().to("cpu", self._dtype, copy=True) for k, v in sd.items()}

    def optimizer_state(self):
        return None  # DeepSpeed writes its own per-rank files (see _save_extra)

    def _save_extra(self, ckpt_root: Path, step: int):
        import shutil

        tmp = Path(ckpt_root) / f".ds-step_{step}"
        if self.is_main and tmp.exists():
            shutil.rmtree(tmp)
        self.barrier()
        self.engine.save_checkpoint(str(tmp), tag="ds")
        self.barrier()
        return lambda d: os.rename(tmp, d / "deepspeed")

    def load_optimizer_state(self, ckpt: Path) -> None:
        d = ckpt / "deepspeed"
        if d.is_dir():
            self.engine.load_checkpoint(str(d), tag="ds")

    @torch.no_grad()
    def before_rollout(self) -> None:
        if self._gen is None:
            return
        own = dict(self._gen.named_parameters())
        with self._gathered():
            for k, p in self.module.named_parameters():
                own[k].copy_(p)


class _DSOptimizer:
    """The learning-rate handle of a DeepSpeed engine's optimizer."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def lr(self) -> float:
        return self.engine.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr

    def zero_grad(self) -> None:
        self.engine.zero_grad()


def deepspeed_config(stage: int, lr: float, betas, weight_decay: float, offload: bool, max_grad_norm: float,
                     bf16: bool) -> dict[str, Any]:
    """The seed's DeepSpeed config (bucket sizes, overlap, CPU optimizer offload), any ZeRO stage."""
    zero: dict[str, Any] = {
        "stage": stage, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
        "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # nanogrpo sizes micro-batches itself (token budget)
        "gradient_accumulation_steps": 1,     # boundaries are set per micro-batch by the update step
        "gradient_clipping": max_grad_norm,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "zero_allow_untested_optimizer": True,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": 1e-8,
                                                        "weight_decay": weight_decay}}
    return cfg


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
        return DeepSpeedBackend(model, stage=t.zero_stage, max_grad_norm=t.max_grad_norm,
                                keep_rollout_copy=rollout_copy, **kw)
    raise ValueError(f"unknown train.backend {t.backend!r}")
