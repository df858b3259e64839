"""The GRPO policy loss and its variants, as pure functions of tensors.

Per completion token t (DESIGN §2):

    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1             (k3 estimator)
    ratio_t   = exp(logp_t - old_t)
    surr_t    = min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)
    loss_t    = -(surr_t - beta * kl_t)

On-policy (the seed; samples from the current weights, first update on them)
``old_t`` is ``logp_t.detach()``: the ratio is exactly 1, the clip never binds and
the gradient is ``A * grad logp_t``. Off-policy (stale samples, or several updates
per batch) ``old_t`` is the behaviour log-prob recorded at generation time.

Variants differ in the reduction (and Dr. GRPO also in the advantage):

    grpo     mean over each completion's tokens, then mean over completions (seed)
    dapo     token-level mean over the whole batch; clip-higher (eps_high = 0.28)
    dr_grpo  sum over tokens / (completions * max_new_tokens); advantages not std-scaled

Reductions take *whole-batch* totals so that summing the losses of the
micro-batches of one step gives exactly the loss of the full batch.

The mask is the one the caller gives: the completion mask, or, for multi-turn
rollouts with tools, the loss mask, which leaves out the tool-output tokens (the
model reads them as context but did not sample them). Masked tokens count in no
sum: not the surrogate, not the KL, not a completion's length (``grpo``), not the
token total (``dapo``).

Departures from the seed: the mask keeps the first EOS (the seed's
``token != pad`` drops it where pad == EOS, so the model never learns to stop);
the clipped ratio is used for stale samples (the seed's vLLM variant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchTotals:
    """Counts over the whole optimisation batch (all micro-batches of one step)."""

    num_seqs: int
    num_tokens: int
    max_new_tokens: int


def k3_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    d = ref - logp                                                     # (N, T)
    return torch.exp(d) - d - 1                                        # (N, T), >= 0


def per_token_loss(logp: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                   adv: torch.Tensor, *, beta: float, eps_low: float, eps_high: float
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Unreduced loss (N, T) and per-token diagnostics (detached).

    logp: (N, T) policy log-probs, requires grad; old: (N, T) behaviour log-probs
    or None for on-policy; ref: (N, T) reference log-probs or None when beta == 0;
    adv: (N,) advantages.
    """
    old = logp.detach() if old is None else old                        # (N, T)
    ratio = torch.exp(logp - old)                                      # (N, T)
    a = adv.unsqueeze(1)                                               # (N, 1)
    surr1 = ratio * a                                                  # (N, T)
    surr2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a         # (N, T)
    surr = torch.min(surr1, surr2)                                     # (N, T)
    loss = -surr                                                       # (N, T)
    diag = {"ratio": ratio.detach(), "clipped": (surr2 < surr1).detach().float()}
    if beta > 0:
        if ref is None:
            raise ValueError("beta > 0 needs reference log-probs")
        kl = k3_kl(logp, ref)                                          # (N, T)
        loss = loss + beta * kl                                        # (N, T)
        diag["kl"] = kl.detach()
    return loss, diag


def reduce_seq_mean(loss: torch.Tensor, mask: torch.Tensor, tot: BatchTotals) -> torch.Tensor:
    per_seq = (loss * mask).sum(1) / mask.sum(1).clamp(min=1)          # (N,)
    return per_seq.sum() / tot.num_seqs                                # ()


def reduce_token_mean(loss: torch.Tensor, mask: torch.Tensor, tot: BatchTotals) -> torch.Tensor:
    return (loss * mask).sum() / max(tot.num_tokens, 1)                # ()


def reduce_constant(loss: torch.Tensor, mask: torch.Tensor, tot: BatchTotals) -> torch.Tensor:
    return (loss * mask).sum() / (tot.num_seqs * tot.max_new_tokens)   # ()


@dataclass(frozen=True)
class LossVariant:
    reduce: Callable[[torch.Tensor, torch.Tensor, BatchTotals], torch.Tensor]
    scale_std: bool
    eps_high: float


LOSSES: dict[str, LossVariant] = {
    "grpo": LossVariant(reduce_seq_mean, scale_std=True, eps_high=0.2),
    "dapo": LossVariant(reduce_token_mean, scale_std=True, eps_high=0.28),
    "dr_grpo": LossVariant(reduce_constant, scale_std=False, eps_high=0.2),
}


def policy_loss(variant: str, logp: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                adv: torch.Tensor, mask: torch.Tensor, tot: BatchTotals, *, beta: float,
                eps_low: float = 0.2, eps_high: float | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Reduced loss for one micro-batch (a share of the whole batch's loss) and its stats.

    ``mask`` (N, T) marks the tokens trained on (completion tokens, less any tool output);
    ``tot`` holds the same mask's whole-batch counts.

    Stats are sums over this micro-batch's masked tokens (``kl_sum``, ``clipped_sum``)
    so the caller can total them across micro-batches.
    """
    v = LOSSES[variant]
    mask = mask.to(logp.dtype)                                         # (N, T)
    loss_t, diag = per_token_loss(logp, old, ref, adv, beta=beta, eps_low=eps_low,
                                  eps_high=v.eps_high if eps_high is None else eps_high)
    loss = v.reduce(loss_t, mask, tot)                                 # ()
    stats = {"clipped_sum": float((diag["clipped"] * mask).sum())}
    if "kl" in diag:
        stats["kl_sum"] = float((diag["kl"] * mask).sum())
    return loss, stats
