"""Float32 linear layers on the CPU through oneDNN instead of MKL's sgemm.

PyTorch's CPU ``F.linear`` in float32 calls MKL. On AMD CPUs (the EPYC
machines this project is built and tested on) MKL takes a slow code path:
measured here at ~100 GFLOP/s per core against ~230 for oneDNN's matmul on the
same shapes and threads, with the same float32 accuracy (no bf16/tf32 inside).
oneDNN's matmul is reachable as ``torch.ops.mkldnn._linear_pointwise`` (the op
Inductor uses for CPU linears); it has no autograd formula, so
:class:`OneDnnLinearFn` supplies one: ``dx = g @ W`` and ``dW = g.T @ x`` through
the same op, ``db = sum(g)``.

:func:`use_onednn_linears` switches the class of a model's plain ``nn.Linear``
modules to :class:`OneDnnLinear` (same parameters, state-dict keys and
behaviour elsewhere): float32 CPU inputs without autocast take the oneDNN
path, anything else (CUDA, bf16, autocast) the ordinary ``F.linear``. The
rollout engine calls :func:`linear` directly. ``model.cpu_linear = "torch"``
turns all of it off.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_available() -> bool:
    """oneDNN's float32 linear exists in this torch build and agrees with ``F.linear``."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g) for s in ((3, 8), (5, 8), (5,)))
        return bool(torch.allclose(_lp(x, w, b), F.linear(x, w, b), atol=1e-5))
    except Exception:  # an op that exists but fails on this build or CPU
        return False


def _lp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _cpu_autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.5
        return torch.is_autocast_cpu_enabled()


def _applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and not _cpu_autocast())


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` without autograd, through oneDNN where it applies (for inference code)."""
    return _lp(x, w, b) if _applies(x, w) and onednn_available() else F.linear(x, w, b)


class OneDnnLinearFn(torch.autograd.Function):
    """y = x @ W.T + b. x: (..., in), W: (out, in), b: (out,) or None; float32 on the CPU."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _lp(x, w, b)                                                   # (..., out)

    @staticmethod
    def backward(ctx, g):                                                     # g: (..., out)
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])                                       # (M, out)
        gx = gw = gb = None
        if need_x:
            gx = _lp(g2, w.t(), None).view(*g.shape[:-1], w.shape[1])        # (..., in) = g @ W
        if need_w:
            gw = _lp(g2.t(), x.reshape(-1, x.shape[-1]).t(), None)            # (out, in) = g.T @ x
        if ctx.has_bias and need_b:
            gb = g2.sum(0)                                                    # (out,)
        return gx, gw, gb


class OneDnnLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose float32 CPU forward (and backward) runs on oneDNN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _applies(x, self.weight):
            return OneDnnLinearFn.apply(x, self.weight, self.bias)
        return super().forward(x)


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Switch the model's plain ``nn.Linear`` modules to :class:`OneDnnLinear`; returns how many.
    No-op (0) when oneDNN's linear is unavailable. The LM head is left alone (the lean log-prob
    path projects it itself) and so are subclasses of ``nn.Linear``."""
    if not onednn_available():
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and m is not head:
            m.__class__ = OneDnnLinear
            n += 1
    return n
