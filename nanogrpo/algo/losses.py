"""The policy loss and its variants, as pure functions of tensors.

Per completion token t of sequence i (DESIGN §2), with A_i its advantage:

    log r_t   = IMPORTANCE[level](logp_t - old_t)        token: as is; sequence: the sequence's mean (GSPO)
    loss_t    = OBJECTIVES[objective](r, logp, A)        clip (PPO/GRPO), cispo or sapo
    loss_t   *= off-policy mask_i * entropy mask_t * rollout-correction weight_t    (each when on)
    loss_t   += beta * KL_ESTIMATORS[kl](logp_t, ref_t) (* r_t when ``kl_is_weighted``)
    loss      = REDUCTIONS[reduction](loss, mask, whole-batch totals) - entropy_coef * mean entropy

The order is TRL's ``GRPOTrainer._compute_loss`` (the KL term is neither masked by the off-policy
or entropy masks nor weighted by the correction), which the test suite checks this against.

On-policy (samples from the current weights, first update on them) ``old_t`` is
``logp_t.detach()``: the ratio is exactly 1, the clip never binds and the gradient is
``A * grad logp_t``. Otherwise ``old_t`` is the log-prob the ratio is anchored on: the
behaviour log-prob recorded at generation time, or, with a rollout correction, the
trainer's own log-prob before the update (:mod:`nanogrpo.algo.corrections`).

The named recipes (``grpo.loss``: grpo, dapo, dr_grpo, bnpo, gspo, cispo, sapo) are presets of the
orthogonal keys (:mod:`nanogrpo.algo.presets`); ``LOSSES`` maps each to its preset.

Reductions take *whole-batch* totals (:class:`BatchTotals`) so that summing the losses of the
micro-batches of one step gives exactly the loss of the full batch; sequence-level quantities
(the GSPO ratio, the off-policy mask, sequence corrections) are per row, so a micro-batch, which
holds whole rows, computes them exactly.

The mask is the one the caller gives: the completion mask, or, for multi-turn rollouts with
tools, the loss mask, which leaves out the tool-output tokens (the model reads them as context
but did not sample them), less truncated completions under ``grpo.mask_truncated``. Masked
tokens count in no sum: not the surrogate, the KL, the entropy, a completion's length, the token
total; whatever values sit at masked positions (in ``old``, ``ref``, ``behaviour``) do not matter.

Departures from the seed: the mask keeps the first EOS (the seed's ``token != pad`` drops it
where pad == EOS, so the model never learns to stop); the clipped ratio is used for stale
samples (the seed's vLLM variant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanogrpo.algo.corrections import CORRECTIONS, correction_stats, off_policy_mask
from nanogrpo.algo.presets import LOSS_PRESETS


@dataclass(frozen=True)
class BatchTotals:
    """Counts over the whole optimisation batch (all micro-batches of one step, all ranks)."""

    num_seqs: int
    num_tokens: int
    max_new_tokens: int
    entropy_tokens: int | None = None
    """Tokens the entropy bonus averages over (trained and, with ``top_entropy_quantile``, above the
    threshold); None: ``num_tokens``."""


@dataclass(frozen=True)
class LossSpec:
    """Every setting of the loss, resolved (presets filled in): what :func:`policy_loss` reads."""

    objective: str = "clip"
    importance_sampling: str = "token"
    reduction: str = "seq-mean-token-mean"
    eps_low: float | None = 0.2
    eps_high: float | None = 0.2
    clip_ratio_c: float | None = None
    clip_delta: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_is_weighted: bool = False
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    off_policy_mask_kl: float | None = None
    correction: str = "none"
    correction_min: float | None = None
    correction_max: float | None = 3.0

    @classmethod
    def from_config(cls, grpo, rollout=None) -> LossSpec:
        """From a :class:`nanogrpo.config.GrpoConfig` (and :class:`~nanogrpo.config.RolloutConfig` for the
        correction; None: no correction)."""
        r = grpo.resolved()
        return cls(objective=LOSS_PRESETS[grpo.loss].objective, importance_sampling=r["importance_sampling"],
                   reduction=r["loss_reduction"], eps_low=r["clip_eps_low"], eps_high=r["clip_eps_high"],
                   clip_ratio_c=grpo.clip_ratio_c, clip_delta=grpo.clip_delta, beta=grpo.beta,
                   kl_estimator=grpo.kl_estimator, kl_is_weighted=grpo.kl_is_weighted,
                   sapo_tau_pos=grpo.sapo_temperature_pos, sapo_tau_neg=grpo.sapo_temperature_neg,
                   off_policy_mask_kl=grpo.off_policy_mask_kl,
                   correction=rollout.correction if rollout is not None else "none",
                   correction_min=rollout.correction_min if rollout is not None else None,
                   correction_max=rollout.correction_max if rollout is not None else None)


# ----------------------------------------------------------------------------- KL estimators
# Schulman, "Approximating KL divergence" (2020): estimators of KL(pi || ref) from samples of pi.


def k1_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k1 (Schulman 2020): log pi - log ref; unbiased value, zero-mean gradient (verl "k1")."""
    return logp - ref                                                  # (N, T)


def k2_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k2 (Schulman 2020): (log pi - log ref)^2 / 2; its gradient is the reverse KL's (verl "k2")."""
    return 0.5 * (logp - ref) ** 2                                     # (N, T)


def k3_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 (Schulman 2020): exp(ref - logp) - (ref - logp) - 1 >= 0; the seed's and TRL's (verl clamps it)."""
    d = ref - logp                                                     # (N, T)
    return torch.exp(d) - d - 1                                        # (N, T), >= 0


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1_kl, "k2": k2_kl, "k3": k3_kl,
}

# ----------------------------------------------------------------------------- importance-sampling level


def token_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO / GRPO: one ratio per token."""
    return log_ratio                                                   # (N, T)


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025): the length-normalised sequence ratio exp(mean_t log r_t), one per sequence,
    gradient through the mean (TRL importance_sampling_level="sequence")."""
    s = (log_ratio * mask).sum(-1, keepdim=True)                       # (N, 1)
    return s / mask.sum(-1, keepdim=True).clamp(min=1.0)               # (N, 1)


IMPORTANCE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": token_log_ratio, "sequence": sequence_log_ratio,
}

# ----------------------------------------------------------------------------- per-token objectives
# Each: (ratio (N, T|1), logp (N, T), adv (N, 1), spec)
#    -> (loss (N, T|1), clip indicators {"low" | "high" | "dual": bool (N, T|1)})


def clip_objective(ratio, logp, a, spec: LossSpec):
    """PPO's clipped surrogate (Schulman et al. 2017) as GRPO uses it; ``clip_delta`` bounds the unclipped
    ratio (INTELLECT-2, TRL delta) and ``clip_ratio_c`` the loss of negative advantages (dual-clip PPO,
    Ye et al. 2020, verl clip_ratio_c)."""
    lo, hi = 1 - spec.eps_low, 1 + spec.eps_high
    coef2 = torch.clamp(ratio, lo, hi)                                 # (N, T|1)
    coef1 = ratio if spec.clip_delta is None else torch.clamp(ratio, max=spec.clip_delta)  # (N, T|1)
    loss = -torch.min(coef1 * a, coef2 * a)                            # (N, T|1)
    bound = spec.clip_delta
    if spec.clip_ratio_c is not None:
        loss = torch.where(a < 0, torch.min(loss, -a * spec.clip_ratio_c), loss)  # (N, T|1) dual-clip
        bound = spec.clip_ratio_c
    r = ratio.detach()                                                 # (N, T|1)
    clipped = {"low": (r < lo) & (a < 0), "high": (r > hi) & (a > 0)}
    if bound is not None:
        clipped["dual"] = (r > bound) & (a < 0)
    return loss, clipped


def cispo_objective(ratio, logp, a, spec: LossSpec):
    """CISPO (MiniMax-M1, 2025): -sg(min(r, eps_max)) * A * logp; the weight, not the update, is clipped
    (as TRL: ``clip_eps_high`` is eps_max itself, no lower bound)."""
    w = torch.clamp(ratio, max=spec.eps_high).detach()                 # (N, T|1)
    return -w * a * logp, {"high": (ratio.detach() > spec.eps_high) & (a > 0)}  # (N, T)


def sapo_objective(ratio, logp, a, spec: LossSpec):
    """SAPO (Gao et al. 2025): the hard clip replaced by the soft gate sigmoid(tau (r - 1)) * 4 / tau, tau by
    the advantage's sign (TRL sapo_temperature_pos / _neg)."""
    tau = torch.where(a > 0, a.new_tensor(spec.sapo_tau_pos), a.new_tensor(spec.sapo_tau_neg))  # (N, 1)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a, {}        # (N, T|1)


OBJECTIVES: dict[str, Callable] = {"clip": clip_objective, "cispo": cispo_objective, "sapo": sapo_objective}

# ----------------------------------------------------------------------------- reductions
# Each: (loss (N, T), mask (N, T), whole-batch totals) -> () ; micro-batch results add up to the batch's.


def reduce_seq_mean(loss: torch.Tensor, mask: torch.Tensor, tot: BatchTotals) -> torch.Tensor:
    """seq-mean-token-mean (GRPO, the seed): each completion's token mean, then the mean over completions."""
    per_seq = (loss * mask).sum(1) / mask.sum(1).clamp(min=1)          # (N,)
    return per_seq.sum() / tot.num_seqs                                # ()


def reduce_token_mean(loss: torch.Tensor, mask: torch.Tensor, tot: BatchTotals) -> torch.Tensor:
    """token-mean (DAPO): one mean over every trained token of the batch."""
    return (loss * mask).sum() / max(tot.num_tokens, 1)                # ()


def reduce_seq_sum(loss: torch.Tensor, mask: torch.Tensor, tot: BatchTotals) -> torch.Tensor:
    """seq-mean-token-sum (verl): each completion's token sum, then the mean over completions."""
    return (loss * mask).sum() / tot.num_seqs                          # ()


def reduce_constant(loss: torch.Tensor, mask: torch.Tensor, tot: BatchTotals) -> torch.Tensor:
    """constant (Dr. GRPO): the token sum over completions x max_new_tokens (verl seq-mean-token-sum-norm)."""
    return (loss * mask).sum() / (tot.num_seqs * tot.max_new_tokens)   # ()


REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, BatchTotals], torch.Tensor]] = {
    "seq-mean-token-mean": reduce_seq_mean, "token-mean": reduce_token_mean,
    "seq-mean-token-sum": reduce_seq_sum, "constant": reduce_constant,
}

LOSSES = LOSS_PRESETS
"""``grpo.loss`` name -> its preset of the keys above (:mod:`nanogrpo.algo.presets`)."""


# ----------------------------------------------------------------------------- the loss


def policy_loss(spec: LossSpec | str, logp: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                adv: torch.Tensor, mask: torch.Tensor, tot: BatchTotals, *, beta: float | None = None,
                eps_low: float | None = None, eps_high: float | None = None,
                behaviour: torch.Tensor | None = None, proximal: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, entropy_mask: torch.Tensor | None = None,
                entropy_coef: float = 0.0, extra: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reduced loss for one micro-batch (its share of the whole batch's loss) and its stats.

    logp: (N, T) policy log-probs, requires grad; old: (N, T) the log-probs the ratio is anchored on,
    or None (on-policy: ``logp.detach()``); ref: (N, T) reference log-probs or None when beta == 0;
    adv: (N,), or (N, T) per-token advantages (on-policy distillation, :mod:`nanogrpo.algo.distill`);
    mask: (N, T) the trained tokens; ``tot`` the same mask's whole-batch counts. extra: (N, T) a per-token
    loss added beside the KL term, reduced with the rest (the distillation divergence), or None.
    behaviour: (N, T) the engine's log-probs when the correction or the off-policy mask needs them, or
    for the mismatch stats; proximal: (N, T) the trainer's own log-probs before the update, which the
    correction weighs against ``behaviour`` (None: ``logp.detach()``, the first update's; with a
    correction it is ``old``). entropy: (N, T) per-token policy entropy (with gradient when
    ``entropy_coef`` != 0), entropy_mask: (N, T) bool, the top-ρ tokens the policy term keeps.

    ``spec`` may be a preset name (then ``beta``, ``eps_low``, ``eps_high`` fill it in; with a
    :class:`LossSpec` they are ignored).
    Stats are detached 0-dim tensors (no device sync here): sums over this micro-batch's masked tokens
    (``*_sum``), minima and maxima, which the caller totals across micro-batches and ranks as
    :data:`STAT_OPS` says.
    """
    if isinstance(spec, str):
        p = LOSS_PRESETS[spec]
        spec = LossSpec(objective=p.objective, importance_sampling=p.importance_sampling,
                        reduction=p.reduction,
                        eps_low=p.eps_low if eps_low is None else eps_low,
                        eps_high=p.eps_high if eps_high is None else eps_high, beta=beta or 0.0)
    m = mask.bool()                                                    # (N, T)
    mf = m.to(logp.dtype)                                              # (N, T)
    old = logp.detach() if old is None else old.to(logp.dtype)         # (N, T)
    a = adv.to(logp.dtype)                                             # (N, 1) or (N, T)
    a = a.unsqueeze(1) if a.dim() == 1 else a
    log_ratio = torch.where(m, logp - old, 0.0)                        # (N, T) 0 off the mask
    ratio = torch.exp(IMPORTANCE[spec.importance_sampling](log_ratio, mf))  # (N, T) or (N, 1)
    loss_t, clipped = OBJECTIVES[spec.objective](ratio, logp, a, spec)  # (N, T|1)
    stats = _ratio_stats(ratio.detach(), clipped, m)
    if spec.off_policy_mask_kl is not None:
        src = old if behaviour is None else behaviour.to(logp.dtype)   # (N, T) TRL: sampling, else old
        keep = off_policy_mask(logp.detach(), src, a, mf, spec.off_policy_mask_kl)  # (N, 1)
        loss_t = loss_t * keep                                         # (N, T|1)
        stats["off_policy_masked_seqs"] = (keep == 0).sum()
    if entropy_mask is not None:
        loss_t = loss_t * entropy_mask.to(logp.dtype)                  # (N, T)
    if behaviour is not None:
        beh = behaviour.to(logp.dtype)                                 # (N, T)
        prox = logp.detach() if proximal is None else proximal.to(logp.dtype)  # (N, T) pi_old
        with torch.no_grad():
            corr = CORRECTIONS[spec.correction](prox, beh, mf, spec.correction_min, spec.correction_max)
            stats.update(correction_stats(prox, beh, m, corr))
        if corr[0] is not None:
            loss_t = loss_t * corr[0]                                  # (N, T|1) weight, no gradient
    if spec.beta > 0:
        if ref is None:
            raise ValueError("beta > 0 needs reference log-probs")
        ref = torch.where(m, ref.to(logp.dtype), logp.detach())         # (N, T) 0 KL off the mask
        kl = KL_ESTIMATORS[spec.kl_estimator](logp, ref)               # (N, T)
        stats["kl_sum"] = (kl.detach() * mf).sum()
        if spec.kl_is_weighted:
            kl = kl * ratio                                            # (N, T) DeepSeek-V3.2
        loss_t = loss_t + spec.beta * kl                               # (N, T)
    if extra is not None:
        loss_t = loss_t + torch.where(m, extra.to(logp.dtype), 0.0)    # (N, T)
    loss = REDUCTIONS[spec.reduction](loss_t.expand_as(mf), mf, tot)   # ()
    if entropy is not None:
        ent = torch.where(m, entropy.to(logp.dtype), 0.0)              # (N, T)
        stats["entropy_sum"] = ent.detach().sum()
        em = mf if entropy_mask is None else mf * entropy_mask.to(logp.dtype)  # (N, T) the bonus's tokens
        if entropy_mask is not None:
            stats["entropy_masked_sum"] = (ent.detach() * em).sum()
        if entropy_coef != 0.0:
            n_ent = tot.num_tokens if tot.entropy_tokens is None else tot.entropy_tokens
            loss = loss - entropy_coef * (ent * em).sum() / max(n_ent, 1)  # () mean over the batch's tokens
    return loss, stats


STAT_OPS: dict[str, str] = {
    "ratio_count": "sum", "clip_low_sum": "sum", "clip_high_sum": "sum", "clip_dual_sum": "sum",
    "ratio_sum": "sum", "ratio_min": "min", "ratio_max": "max", "kl_sum": "sum", "entropy_sum": "sum",
    "entropy_masked_sum": "sum",
    "off_policy_masked_seqs": "sum", "is_tokens": "sum", "is_seqs": "sum", "is_weight_sum": "sum",
    "is_weight_min": "min", "is_weight_max": "max", "is_corrected": "sum", "is_kl_sum": "sum",
    "logprob_gap_sum": "sum", "logprob_gap_max": "max",
}
"""How each stat of :func:`policy_loss` combines over micro-batches and ranks."""


def _ratio_stats(r: torch.Tensor, clipped: dict[str, torch.Tensor],
                 m: torch.Tensor) -> dict[str, torch.Tensor]:
    """Counts of the clip indicators, and the ratio's sum, min and max, over the trained tokens (a token-level
    ratio) or the sequences with a trained token (a sequence-level one, as TRL counts GSPO's)."""
    unit = m if r.shape[1] == m.shape[1] else m.any(1, keepdim=True)  # (N, T) or (N, 1)
    r = r.expand_as(unit)
    inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
    out = {"ratio_count": unit.sum(), "ratio_sum": torch.where(unit, r, 0.0).sum(),
           "ratio_min": torch.where(unit, r, inf).min(), "ratio_max": torch.where(unit, r, -inf).max()}
    for k in ("low", "high", "dual"):
        if k in clipped:
            out[f"clip_{k}_sum"] = (clipped[k].expand_as(unit) & unit).sum()
    return out
