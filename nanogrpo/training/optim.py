"""AdamW with float32 master weights and optimizer state for low-precision models.

At lr 1e-6 an update applied directly to bf16 weights rounds to zero (bf16 keeps
8 bits of mantissa), so when the policy is bf16 the optimizer owns float32
copies: gradients are upcast into them, AdamW steps in float32, and the result
is cast back into the model's weights. For float32 models this is plain AdamW.
``offload=True`` keeps the masters and Adam moments in CPU memory (the seed's
ZeRO CPU offload, without DeepSpeed).
"""

from __future__ import annotations

from typing import Any

import torch


class MasterAdamW:
    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, offload: bool = False):
        self.params = [p for p in params if p.requires_grad]
        self.uses_master = offload or any(p.dtype != torch.float32 for p in self.params)
        if self.uses_master:
            dev = torch.device("cpu") if offload else None
            self.master = [p.detach().to(dtype=torch.float32, device=dev or p.device).clone()
                           for p in self.params]
            for m in self.master:
                m.requires_grad_(True)
            target = self.master
        else:
            self.master = None
            target = self.params
        self.opt = torch.optim.AdamW(target, lr=lr, betas=betas, weight_decay=weight_decay)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.master is not None:
            for m in self.master:
                m.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.master is None:
            self.opt.step()
            return
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.to(device=m.device, dtype=torch.float32)
        self.opt.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m.to(device=p.device, dtype=p.dtype, non_blocking=True))

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"opt": self.opt.state_dict()}
        if self.master is not None:
            sd["master"] = [m.detach().cpu() for m in self.master]
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.opt.load_state_dict(sd["opt"])
        if self.master is not None and "master" in sd:
            for p, m, saved in zip(self.params, self.master, sd["master"]):
                m.copy_(saved)
                p.copy_(saved.to(device=p.device, dtype=p.dtype))
