"""DeepSpeed ZeRO 1-3 behind the :class:`~nanogrpo.training.distributed.Backend` interface (``train.backend =
deepspeed``): the seed's ZeRO config, AdamW with optional CPU offload, checkpoints in DeepSpeed's own
per-rank files beside the gathered HF model. Imported only when the backend is chosen."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanogrpo.algo.logprobs import lean_head
from nanogrpo.training.backend import Backend


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
