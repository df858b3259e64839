"""The top-k / top-p support: which tokens a sampler keeps, and log-probs over them.

With ``rollout.tempered_logprobs`` and ``top_k > 0`` or ``top_p < 1`` the distribution samples are
drawn from is ``softmax(logits / T)`` *restricted to the kept tokens and renormalised*. vLLM reports
the log-probs of that distribution (``processed_logprobs``); a trainer that computes
``log_softmax(logits / T)`` over the whole vocabulary then differs from it at every position by the
log of the kept mass, so the importance ratio is biased below 1 even on-policy (TRL issue #6789).
nanogrpo computes every log-prob of such a run over the support instead: the engines report the
sampling distribution's log-probs, and the trainer (policy and reference forwards alike) applies the
same rule to its own ``logits / T`` at each position, so that on-policy the two agree to rounding and
the ratio is that of the two sampling distributions. The support is the policy's own: no per-position
information crosses the wire (``top_k`` and ``top_p`` do, in the batch header, split mode).

The rule (:func:`truncate`) is vLLM's, HF ``generate``'s and the fast engine's: top-k first (ties at
the k-th value kept), then the smallest head of the renormalised, descending distribution whose mass
reaches ``top_p`` (a token is kept while the mass strictly above it is below ``top_p``; the first
always). Every kept set is then ``{v : z_v >= tau}`` for a threshold ``tau`` per position
(:func:`support_threshold`), which the chunked log-prob pass saves for its backward instead of
sorting again; the sampled token is always counted in (:func:`keep_mask`): a token the trainer's
rule would leave out (rounding at the edge, or a policy that moved) gets a small probability, not
-inf.
"""

from __future__ import annotations

import torch

Support = tuple[int, float]
"""(top_k, top_p): 0 / 1.0 are off."""

MASKED = -1e30
"""What a token outside the support has for a logit in the log-prob pass: finite, so ``0 * masked`` is 0
(an ``-inf`` would turn the entropy's ``p * log p`` and its gradient into NaN)."""


def truncate(z: torch.Tensor, top_k: int, top_p: float | torch.Tensor | None) -> torch.Tensor:
    """z (rows, V) scaled logits -> the same with -inf outside the support (no host sync, fixed shapes:
    runs inside a CUDA graph; ``top_p`` may be a [1] tensor). ``top_p`` None or >= 1: no top-p."""
    if top_k:
        kth = z.topk(min(int(top_k), z.shape[-1]), -1).values[:, -1:]          # (rows, 1)
        z = z.masked_fill(z < kth, float("-inf"))                              # (rows, V)
    if top_p is not None and (isinstance(top_p, torch.Tensor) or top_p < 1.0):
        srt, idx = z.sort(-1, descending=True)                                 # (rows, V) each
        p = srt.softmax(-1)                                                    # (rows, V)
        srt = srt.masked_fill(p.cumsum(-1) - p >= top_p, float("-inf"))        # mass above >= top_p: out
        z = torch.full_like(z, float("-inf")).scatter(-1, idx, srt)            # (rows, V)
    return z


def support_threshold(z: torch.Tensor, support: Support) -> torch.Tensor:
    """(rows,) the smallest kept value of each row of z (rows, V): the support is ``z >= threshold``."""
    kept = truncate(z, support[0], support[1] if support[1] < 1.0 else None)    # (rows, V)
    return torch.where(torch.isfinite(kept), kept, float("inf")).amin(-1)      # (rows,)


def keep_mask(z: torch.Tensor, threshold: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(rows, V) bool: the support (``z >= threshold``) plus each row's sampled token ``targets`` (rows,)."""
    keep = z >= threshold[:, None]                                             # (rows, V)
    return keep.scatter(-1, targets[:, None], True)


def support_logprobs(z: torch.Tensor, targets: torch.Tensor, support: Support) -> torch.Tensor:
    """Reference implementation (materialises (rows, V)): log-probs (rows,) of ``targets`` under
    ``softmax(z)`` restricted to the support (plus the target). For tests and the engines' host side."""
    keep = keep_mask(z, support_threshold(z, support), targets)               # (rows, V)
    masked = z.masked_fill(~keep, float("-inf"))                               # (rows, V)
    return masked.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(masked, -1)


def active(support: Support | None) -> bool:
    return support is not None and (support[0] > 0 or support[1] < 1.0)
