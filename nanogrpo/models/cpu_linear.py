"""Float32 linear layers on the CPU through oneDNN instead of MKL's sgemm, where that is faster.

PyTorch's CPU ``F.linear`` in float32 calls MKL. On AMD CPUs with AVX-512 (the
EPYC machines this project was first built on) MKL takes a slow code path:
measured there at ~100 GFLOP/s per core against ~230 for oneDNN's matmul on the
same shapes and threads, with the same float32 accuracy (no bf16/tf32 inside).
On an AVX2-only EPYC (Zen 3) it is the other way round: MKL is 5-70% faster,
most at the few rows of a decode step. So the default, ``model.cpu_linear =
"auto"``, measures: :func:`onednn_faster` times both on this process's threads
for the shape class at hand (few rows: the rollout engine's decode; many rows:
the trainer's forward and backward) and picks oneDNN only if it is clearly
faster. ``"onednn"`` / ``"torch"`` force one.

A training run decides once (:func:`settle`) and keeps its decisions: the
checkpoint records them and a resumed run reuses them rather than timing again.
On a loaded machine a second timing can pick the other library, whose float32
results differ in their last bits, and exact resume would be lost.

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
import logging
import time

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


log = logging.getLogger("nanogrpo.models")

SETTINGS = ("auto", "onednn", "torch")
DECODE_ROWS = 32
"""Rows of the shape ``auto`` times for the rollout engine (a decode step's batch)."""
TRAIN_ROWS = 256
"""Rows of the shape ``auto`` times for the trainer's linears (a micro-batch's tokens: more, but
GEMM speed per FLOP has levelled off by here)."""
MAX_TIMED = (1024, 2048)
"""The timed product's (in, out) are capped at these: a 7B model's [3584 x 18944] would take
seconds to time, and the ranking of the two libraries does not change past this size."""
MARGIN = 1.25
"""``auto`` picks oneDNN only if it is at least this much faster: close calls keep torch's default. This
does not stop two processes on a loaded machine from deciding differently (measured: the tiny model's
decode shape flipped in 1 of 5 timings on a shared 2-core machine), which is why a run records its
decisions (:func:`settle`)."""
PARTS = ("trainer", "engine")
"""The two decisions of a run: the trainer's linears (many rows) and the fast rollout engine's (decode)."""


def _best_time(fn, reps: int = 3) -> float:
    fn()  # warm-up: first-call setup (oneDNN primitive creation, MKL buffers)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache
def onednn_faster(rows: int, k: int, n: int, threads: int) -> bool:
    """Whether oneDNN's float32 linear beats ``F.linear`` by :data:`MARGIN` on a ``[rows, k] x
    [k, n]`` product (and, for many rows, its backward's two products) with ``threads`` threads.

    Measured once per process and shape (milliseconds for a small model, about a second at the
    cap :data:`MAX_TIMED` that :func:`choose` applies: the best of 2 x 3 runs of each, alternated so
    that a burst of load on a shared machine hits both). ``threads`` is part of the key because
    the answer can change with it; pass ``torch.get_num_threads()``."""
    if not onednn_available():
        return False
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    gy = torch.randn(rows, n, generator=g)
    backward = rows > DECODE_ROWS  # the trainer's linears also run dx = g W and dW = g^T x

    def products(lin):
        def run():
            lin(x, w, None)
            if backward:
                lin(gy, w.t(), None)
                lin(gy.t(), x.t(), None)
        return run

    t_dnn, t_torch = float("inf"), float("inf")
    for _ in range(2):
        t_dnn = min(t_dnn, _best_time(products(_lp)))
        t_torch = min(t_torch, _best_time(products(F.linear)))
    return t_torch > MARGIN * t_dnn


def choose(setting: str, rows: int, k: int, n: int) -> bool:
    """True: float32 CPU linears of this shape class go through oneDNN. ``setting`` is
    ``model.cpu_linear``: ``onednn`` (if this build has it), ``torch``, or ``auto`` (measured,
    :func:`onednn_faster`, on the shape capped at :data:`MAX_TIMED`: models past it share one timing)."""
    if setting not in SETTINGS:
        raise ValueError(f"cpu_linear must be one of {', '.join(SETTINGS)}, not {setting!r}")
    if setting == "torch" or not onednn_available():
        return False
    k, n = min(k, MAX_TIMED[0]), min(n, MAX_TIMED[1])
    return setting == "onednn" or onednn_faster(rows, k, n, torch.get_num_threads())


def settle(setting: str, model: torch.nn.Module, recorded: dict[str, str] | None = None,
           engine: bool = True) -> dict[str, str]:
    """``model.cpu_linear`` decided once for a training run, applied to its ``model`` (loaded with
    ``"torch"``): returns ``{"trainer": "onednn" | "torch", "engine": ...}``, what runs, for the
    checkpoint to record (``{}`` for a model that is not float32 on the CPU; no ``engine`` entry
    when ``engine`` is False: the run's engine has no CPU linears of its own, hf or vllm).

    ``recorded``: the decisions of the checkpoint being resumed; ``auto`` reuses them instead of
    timing again (one INFO line says so), an explicit ``onednn`` / ``torch`` wins. Under
    ``torch.distributed`` rank 0 decides and every rank takes its decisions (they are recorded once)."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
        return {}
    parts = PARTS if engine else PARTS[:1]
    rows = {"trainer": TRAIN_ROWS, "engine": DECODE_ROWS}
    dims = model_dims(model)
    reuse = setting == "auto" and bool(recorded) and all(recorded.get(k) in SETTINGS[1:] for k in parts)
    settings = {k: recorded[k] if reuse else setting for k in parts}
    import torch.distributed as dist

    ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    main = not ranks or dist.get_rank() == 0
    box = [{k: "onednn" if choose(settings[k], rows[k], *dims) else "torch" for k in parts} if main else None]
    if ranks:
        dist.broadcast_object_list(box, src=0)
    decided = box[0]
    if decided["trainer"] == "onednn":
        use_onednn_linears(model)
    said = ", ".join(f"the {'rollout engine' if k == 'engine' else k}'s float32 linears on "
                     f"{'oneDNN' if v == 'onednn' else 'torch BLAS'}" for k, v in decided.items())
    if main and reuse:
        log.info("model.cpu_linear=auto: as the checkpoint recorded, %s (not timed again: the resumed run "
                 "computes as the original did)", said)
    elif main and setting == "auto":
        log.info("model.cpu_linear=auto: %s (timed on this CPU; kept for the run and its resumes)", said)
    return decided


def model_dims(model: torch.nn.Module) -> tuple[int, int]:
    """(hidden, intermediate) of an HF config, for the shapes ``auto`` times; defaults if absent."""
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None) or 1024
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    return int(hidden), int(inter)


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


def apply_cpu_linear(model: torch.nn.Module, setting: str) -> bool:
    """``model.cpu_linear`` for a model's own (trainer's) linears: switch them to oneDNN when
    :func:`choose` says so for the trainer's shape class; returns whether it did. Only float32
    models on the CPU are touched."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
        return False
    hidden, inter = model_dims(model)
    on = choose(setting, TRAIN_ROWS, hidden, inter)
    if on:
        use_onednn_linears(model)
    if setting == "auto":
        log.info("model.cpu_linear=auto: the trainer's float32 linears run on %s (timed on this CPU)",
                 "oneDNN" if on else "torch's BLAS")
    return on
