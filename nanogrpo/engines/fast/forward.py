"""The fast engine's forward, as pure functions of tensors (the same for every family).

One decoder layer is ``pre_attn`` (norm, q/k/v projections, q/k norms, RoPE), attention
(``prefill_attention`` over a prompt, ``decode_attention`` for one new token against the
cache) and ``post_attn`` (output projection, residual, gated MLP). What a family changes is
static and comes in :class:`Arch`; per-layer switches (RoPE or not, a sliding window) come
as arguments. ``lin`` is the linear function: ``F.linear``, or oneDNN's on the CPU.
Each function computes exactly what transformers' modules do, in the same order and
dtypes, so greedy tokens equal ``model.generate``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Arch:
    """The static shape and the family switches of one model (see :mod:`.families`)."""

    nh: int
    nkv: int
    hd: int
    eps: float
    qk_norm: str | None = None
    post_norm: bool = False
    scale_then_round: bool = False


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, scale_then_round: bool = False) -> torch.Tensor:
    """HF's RMSNorm exactly: normalise in float32, then scale and round to the input dtype
    (Llama/Qwen round first, OLMo2 scales first)."""
    return _scale(_unit(x, eps), w, x.dtype, scale_then_round)


def _unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32 (the part of RMSNorm before its weight)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _scale(n: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, scale_then_round: bool) -> torch.Tensor:
    return (w * n).to(dtype) if scale_then_round else w * n.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D]; cos/sin [..., 1, R] with R <= D: the first R dims rotate (partial
    rotary), the rest pass; HF's rotate_half convention."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((rope(x[..., :r], cos, sin), x[..., r:]), -1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def pre_attn(x, ln, qkv_w, qkv_b, q_norm, k_norm, cos, sin, arch: Arch, lin=F.linear):
    """x [..., hidden] -> q [..., nh, D], k [..., nkv, D] (normed and rotated), v [..., nkv, D].
    ``qkv_w``: one fused matrix (rows q, k, v) or three; ``cos`` None: a layer without RoPE."""
    h = x if arch.post_norm else rms_norm(x, ln, arch.eps, arch.scale_then_round)
    nq, nk = arch.nh * arch.hd, arch.nkv * arch.hd
    if len(qkv_w) == 1 and arch.qk_norm != "flat":  # fused: one GEMM, q and k normed and rotated at once
        out = lin(h, qkv_w[0], qkv_b[0])  # [..., nq + 2 nk]
        qk = out[..., :nq + nk].unflatten(-1, (arch.nh + arch.nkv, arch.hd))
        if arch.qk_norm == "head":  # each head's statistic as HF's per-head RMSNorm, then q's / k's weight
            n = _unit(qk, arch.eps)  # [..., nh + nkv, D] float32
            qk = torch.cat((_scale(n[..., :arch.nh, :], q_norm, qk.dtype, arch.scale_then_round),
                            _scale(n[..., arch.nh:, :], k_norm, qk.dtype, arch.scale_then_round)), -2)
        if cos is not None:
            qk = rope(qk, cos.unsqueeze(-2), sin.unsqueeze(-2))
        v = out[..., nq + nk:].unflatten(-1, (arch.nkv, arch.hd))
        return qk[..., :arch.nh, :], qk[..., arch.nh:, :], v
    if len(qkv_w) == 1:  # fused: one GEMM
        q, k, v = lin(h, qkv_w[0], qkv_b[0]).split([nq, nk, nk], -1)  # [..., nq], [..., nk] x 2
    else:
        q, k, v = [lin(h, w, b) for w, b in zip(qkv_w, qkv_b, strict=True)]
    if arch.qk_norm == "flat":  # over the whole projection (OLMo2)
        q, k = rms_norm(q, q_norm, arch.eps, arch.scale_then_round), rms_norm(k, k_norm, arch.eps,
                                                                            arch.scale_then_round)
    q, k, v = q.unflatten(-1, (arch.nh, arch.hd)), k.unflatten(-1, (arch.nkv, arch.hd)), v.unflatten(
        -1, (arch.nkv, arch.hd))
    if arch.qk_norm == "head":  # over each head (Qwen3)
        q, k = rms_norm(q, q_norm, arch.eps, arch.scale_then_round), rms_norm(k, k_norm, arch.eps,
                                                                            arch.scale_then_round)
    if cos is not None:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., 1, R]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
    return q, k, v


def post_attn(x, a, o_w, o_b, ln1, ln2, gu_w, gu_b, down_w, down_b, arch: Arch, lin=F.linear):
    """Output projection and residual, then the SiLU-gated MLP and residual. x, a [..., hidden].
    Pre-norm families norm the MLP's input with ``ln2``; post-norm ones (OLMo2) norm the
    attention output with ``ln1`` and the MLP output with ``ln2``."""
    o = lin(a, o_w, o_b)
    if arch.post_norm:
        x = x + rms_norm(o, ln1, arch.eps, arch.scale_then_round)
        return x + rms_norm(_mlp(x, gu_w, gu_b, down_w, down_b, lin), ln2, arch.eps, arch.scale_then_round)
    x = x + o
    return x + _mlp(rms_norm(x, ln2, arch.eps, arch.scale_then_round), gu_w, gu_b, down_w, down_b, lin)


def _mlp(h, gu_w, gu_b, down_w, down_b, lin):
    if len(gu_w) == 1:
        g, u = lin(h, gu_w[0], gu_b[0]).chunk(2, -1)  # [..., inter] each
    else:
        g, u = [lin(h, w, b) for w, b in zip(gu_w, gu_b, strict=True)]
    return lin(F.silu(g) * u, down_w, down_b)


def head(x, norm_w, lm_w, lm_b, arch: Arch, lin=F.linear) -> torch.Tensor:
    """Final norm + LM head; float32 logits [..., vocab] from the model-dtype GEMM (as HF)."""
    return lin(rms_norm(x, norm_w, arch.eps, arch.scale_then_round), lm_w, lm_b).float()


# ---------------------------------------------------------------- attention and its masks

def decode_mask(slot: torch.Tensor, pad: torch.Tensor, n_kv: int, window: int | None,
                dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [rows, 1, 1, n_kv] for one new token at cache slot ``slot`` (a [1] tensor):
    keys from the row's first real slot ``pad`` [rows] to ``slot``, and within ``window``."""
    ar = torch.arange(n_kv, device=pad.device)
    valid = (ar >= pad[:, None]) & (ar <= slot)  # [rows, n_kv]
    if window is not None:
        valid &= ar > slot - window
    mask = torch.zeros(valid.shape, dtype=dtype, device=pad.device).masked_fill_(~valid, NEG_INF)
    return mask[:, None, None]


def prefill_mask(pad: torch.Tensor, width: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [b, 1, P, P] over left-padded prompts: causal, from each row's first real
    token, within ``window``. Pad queries see themselves (no all-masked row, no NaN)."""
    ar = torch.arange(width, device=pad.device)
    keep = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] >= pad[:, None, None])  # [b, P, P]
    if window is not None:
        keep &= (ar[None, :] > ar[:, None] - window)[None]
    keep |= torch.eye(width, dtype=torch.bool, device=pad.device)[None]
    return torch.zeros(keep.shape, dtype=dtype, device=pad.device).masked_fill_(~keep, NEG_INF)[:, None]


def decode_attention(q, k, v, mask, cpu: bool) -> torch.Tensor:
    """One decode step: q [rows, kv, g, D] (the g query heads of a KV head as its query block),
    k/v [rows, kv, n, D], mask [rows, 1, 1, n] -> [rows, kv, g, D]."""
    if cpu:  # a few queries per row: two batched matmuls beat the SDPA kernel here
        s = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(mask)  # [rows, kv, g, n]
        return torch.matmul(s.softmax(-1), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def prefill_attention(q, k, v, mask) -> torch.Tensor:
    """q [b, nh, P, D], k/v [b, nkv, P, D], mask [b, 1, P, P] -> [b, nh, P, D]."""
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                          attn_mask=mask)
