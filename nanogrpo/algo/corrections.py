"""Rollout corrections: importance weights between the trainer's log-probs and the engine's.

When the completions come from another engine (vLLM's kernels, a split-mode worker) or an older
policy, the trainer's log-probs ``old`` (the policy the PPO ratio is anchored on) and the engine's
behaviour log-probs ``behaviour`` (what the tokens were sampled from) differ. ``CORRECTIONS``
(``rollout.correction``) turn that gap into a weight on each token's policy loss, bounded by
``rollout.correction_min`` / ``correction_max`` (the lower bound optional):

    none               no weight (the gap is only measured)
    token_truncate     w_t = clamp(pi_t / mu_t, min, max)                 TIS (Yao et al. 2025)
    token_mask         w_t = pi_t / mu_t, 0 outside [min, max]            MIS, token level
    sequence_truncate  w_i = clamp(prod_t pi_t / mu_t, min, max)          sequence-level TIS
    sequence_mask      w_i = prod_t pi_t / mu_t, 0 outside [min, max]     sequence-level MIS

each as TRL's ``vllm_importance_sampling_mode`` computes it (its ``_generate_and_score_completions``):
the weights are constants (no gradient), 1 at masked positions, and multiply the policy term only.

:func:`off_policy_mask` is DeepSeek-V3.2's off-policy sequence mask (``grpo.off_policy_mask_kl``,
TRL ``off_policy_mask_threshold``): a sequence with a negative advantage whose mean
log(mu / pi) exceeds the threshold gets no policy loss.

Stats (:func:`correction_stats`): the raw weights before truncation or masking (sum, min, max;
over tokens, or over sequences for the sequence modes), how many were truncated or masked, and
the k3 estimate of KL(mu || pi_old) over the trained tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Correction = Callable[..., tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]]


def _token_ratio(old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    d = torch.nan_to_num(torch.where(mask.bool(), old - behaviour, 0.0), nan=0.0)  # (N, T) 0 off the mask
    return torch.exp(d)                                                # (N, T)


def _seq_ratio(old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    d = torch.nan_to_num(torch.where(mask.bool(), old - behaviour, 0.0), nan=0.0)  # (N, T)
    return torch.exp(d.sum(-1, keepdim=True))                          # (N, 1) product of token ratios


def _outside(r: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
    out = torch.zeros_like(r, dtype=torch.bool)                        # (N, T|1)
    if lo is not None:
        out |= r < lo
    if hi is not None:
        out |= r > hi
    return out


def no_correction(old, behaviour, mask, lo, hi):
    """No weight; the raw token ratios are still measured."""
    return None, _token_ratio(old, behaviour, mask), None


def token_truncate(old, behaviour, mask, lo, hi):
    """Truncated IS (Yao et al. 2025, off-policy RL behind vLLM): the per-token ratio clamped to [lo, hi]."""
    r = _token_ratio(old, behaviour, mask)                             # (N, T)
    return torch.clamp(r, min=lo, max=hi), r, _outside(r, lo, hi)


def token_mask(old, behaviour, mask, lo, hi):
    """Masked IS (TRL token_mask): a token whose ratio leaves [lo, hi] gets weight 0, others their ratio."""
    r = _token_ratio(old, behaviour, mask)                             # (N, T)
    out = _outside(r, lo, hi)                                          # (N, T)
    return r.masked_fill(out, 0.0), r, out


def sequence_truncate(old, behaviour, mask, lo, hi):
    """Sequence-level TIS (TRL sequence_truncate): one ratio per sequence (product over tokens), clamped."""
    r = _seq_ratio(old, behaviour, mask)                               # (N, 1)
    return torch.clamp(r, min=lo, max=hi), r, _outside(r, lo, hi)


def sequence_mask(old, behaviour, mask, lo, hi):
    """Sequence-level MIS (TRL sequence_mask, its default): a sequence whose ratio leaves [lo, hi] dropped."""
    r = _seq_ratio(old, behaviour, mask)                               # (N, 1)
    out = _outside(r, lo, hi)                                          # (N, 1)
    return r.masked_fill(out, 0.0), r, out


CORRECTIONS: dict[str, Correction] = {
    "none": no_correction, "token_truncate": token_truncate, "token_mask": token_mask,
    "sequence_truncate": sequence_truncate, "sequence_mask": sequence_mask,
}
"""Each: (old (N, T), behaviour (N, T), mask (N, T), lo, hi) -> (weight (N, T|1) or None, raw ratio (N, T|1),
truncated-or-masked bool (N, T|1) or None)."""


def correction_stats(old: torch.Tensor, behaviour: torch.Tensor, m: torch.Tensor,
                     result: tuple) -> dict[str, torch.Tensor]:
    """Detached sums / min / max of the raw weights, the count corrected, and the k3 KL(mu || pi_old) sum."""
    _, raw, corrected = result
    sel = m if raw.shape[1] == m.shape[1] else m.any(1, keepdim=True)  # (N, T) or (N, 1)
    inf = torch.tensor(float("inf"), dtype=raw.dtype, device=raw.device)
    d = torch.where(m, old - behaviour, 0.0)                           # (N, T) log(pi_old / mu)
    out = {"is_tokens" if raw.shape[1] == m.shape[1] else "is_seqs": sel.sum(),
           "is_weight_sum": torch.where(sel, raw, 0.0).sum(),
           "is_weight_min": torch.where(sel, raw, inf).min(),
           "is_weight_max": torch.where(sel, raw, -inf).max(),
           "is_kl_sum": torch.where(m, torch.exp(d) - d - 1, 0.0).sum()}
    if corrected is not None:
        out["is_corrected"] = (corrected & sel).sum()
    return out


def logprob_gap_stats(trainer: torch.Tensor, engine: torch.Tensor,
                      m: torch.Tensor) -> dict[str, torch.Tensor]:
    """The trainer-vs-engine log-prob gap, measured whatever the correction: the sum and the largest of
    |log pi_trainer - log mu_engine| over the trained tokens ``m`` (N, T) bool (detached, 0-dim). With an
    exact engine on a fresh batch it is rounding (~1e-6); a kernel, precision or weight-sync mismatch
    shows as a gap (``watch``'s ``engine_drift`` rule)."""
    gap = torch.where(m, (trainer.detach() - engine.to(trainer.dtype)).abs(), 0.0)  # (N, T)
    return {"logprob_gap_sum": torch.nan_to_num(gap, nan=0.0).sum(), "logprob_gap_max": gap.max()}


def off_policy_mask(logp: torch.Tensor, behaviour: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2 (2025) off-policy sequence mask, as TRL's ``get_off_policy_mask``: (N, 1) 1.0 = keep.

    logp: (N, T) current log-probs (detached); behaviour: (N, T); adv: (N, 1); mask: (N, T) float."""
    kl = torch.nan_to_num(torch.where(mask.bool(), behaviour - logp, 0.0), nan=0.0)  # (N, T) log(mu / pi)
    avg = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)  # (N, 1)
    return ((adv >= 0) | (avg <= threshold)).to(mask.dtype)            # (N, 1)


def anchor(correction: str, on_policy: bool, trainer: torch.Tensor | None, behaviour: torch.Tensor | None
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(old, behaviour) for :func:`nanogrpo.algo.losses.policy_loss`: the log-probs the PPO ratio is anchored
    on (None: the policy's own, detached) and the engine's behaviour log-probs, which the correction and
    the mismatch stats compare with the trainer's own log-probs before the update (``proximal``:
    ``trainer``, or None on the batch's first update, whose forward computes them).

    ``none`` (the seed's rule): on-policy (samples from these weights through an engine that computes
    as the trainer does), the policy's own and nothing to compare; off-policy (vLLM, a stale batch),
    the engine's recorded log-probs, measured against the trainer's. A correction: the trainer's own
    log-probs, the engine's as behaviour: decoupled PPO, the ratio measures the update, the weight
    the gap between the engine (or an older policy) and the trainer."""
    if correction == "none":
        return (None, None) if on_policy else (behaviour, behaviour)
    return trainer, behaviour
