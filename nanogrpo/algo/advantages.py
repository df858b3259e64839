"""Advantages from rewards (DESIGN §2): two registries, applied in turn.

Rewards arrive flat, prompt-major: group g holds rows ``g*G .. g*G+G-1``.

1. ``AGGREGATIONS`` (``grpo.reward_aggregation``) turn the per-function reward columns
   (N, F) and their weights (F,) into one score per completion (N,):

       sum_then_normalize   the weighted sum (the seed; TRL's default)
       normalize_then_sum   each function normalised within its group, then the weighted sum
                            (GDPO, arXiv 2601.05242; TRL multi_objective_aggregation)

2. ``ADVANTAGES`` (``grpo.advantage``) turn the scores into advantages (N,):

       group         (r - group mean) / (group std + eps)                   GRPO; TRL scale_rewards="group"
       group_mean    r - group mean                                         Dr. GRPO; TRL scale_rewards="none"
       batch_std     (r - group mean) / (std of the whole batch + eps)      LitePPO; TRL scale_rewards="batch"
       rloo          r - mean of the group's other rewards                  RLOO; verl "rloo"
       reinforce_pp  r - group mean, then whitened over the batch's tokens  REINFORCE++-baseline; verl

GDPO as TRL computes it is ``normalize_then_sum`` followed by ``batch_std``: each summed
score has group mean 0, so subtracting the group mean and dividing by the batch std is TRL's
final batch normalisation (the preset when ``grpo.advantage`` is left unset).

Standard deviations are sample ones (``torch.std``); a zero-variance group gets zero
advantages under every estimator but ``reinforce_pp`` (whose batch whitening shifts it; such
groups carry no signal and are dropped before training anyway, :func:`signal_mask`).

Batch-level statistics (``batch_std``, ``reinforce_pp``) are taken over the whole batch: with
several ranks each holding a share, ``reduce`` sums a list of floats over the ranks (every rank
calls it, the same number of times, also with no rows); None means one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Reduce = Callable[[list[float]], list[float]]
"""Sums each value over the ranks (``Backend.all_reduce``); identity in one process."""


def _work(r: torch.Tensor) -> torch.Tensor:
    return r.to(torch.promote_types(r.dtype, torch.float32))


def _check(r: torch.Tensor, g: int) -> None:
    if r.dim() != 1 or r.numel() % g:
        raise ValueError(f"rewards must be flat with a multiple of group_size={g} entries, "
                         f"got shape {tuple(r.shape)}")


def _batch_sums(values: list[float], reduce: Reduce | None) -> list[float]:
    return list(values) if reduce is None else list(reduce(values))


def group(r: torch.Tensor, g: int, *, eps: float, lengths=None, reduce=None) -> torch.Tensor:
    """GRPO (DeepSeekMath, Shao et al. 2024): within-group z-score, the seed's (TRL scale_rewards="group")."""
    x = _work(r).view(-1, g)                                           # (groups, G)
    centred = x - x.mean(dim=1, keepdim=True)                          # (groups, G)
    return (centred / (x.std(dim=1, keepdim=True) + eps)).reshape(-1)  # (N,)


def group_mean(r: torch.Tensor, g: int, *, eps: float, lengths=None, reduce=None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): the group mean subtracted, no std scaling (TRL scale_rewards="none")."""
    x = _work(r).view(-1, g)                                           # (groups, G)
    return (x - x.mean(dim=1, keepdim=True)).reshape(-1)               # (N,)


def batch_std(r: torch.Tensor, g: int, *, eps: float, lengths=None, reduce=None) -> torch.Tensor:
    """LitePPO (Liu et al. 2025, "Tricks or Traps"): group mean subtracted, scaled by the batch's reward std
    (TRL scale_rewards="batch"; over every rank's rows)."""
    x = _work(r)                                                       # (N,)
    n, s = _batch_sums([float(x.numel()), float(x.double().sum())], reduce)
    mean = s / n if n > 0 else 0.0
    (ss,) = _batch_sums([float(((x.double() - mean) ** 2).sum())], reduce)
    std = (ss / (n - 1)) ** 0.5 if n > 1 else 0.0                      # sample std over the batch
    centred = x.view(-1, g) - x.view(-1, g).mean(dim=1, keepdim=True)  # (groups, G)
    return (centred / (std + eps)).reshape(-1)                         # (N,)


def rloo(r: torch.Tensor, g: int, *, eps: float, lengths=None, reduce=None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean of the group's G - 1 other rewards (verl "rloo")."""
    x = _work(r).view(-1, g)                                           # (groups, G)
    others = (x.sum(dim=1, keepdim=True) - x) / (g - 1)                # (groups, G) leave-one-out mean
    return (x - others).reshape(-1)                                    # (N,)


def reinforce_pp(r: torch.Tensor, g: int, *, eps: float, lengths=None, reduce=None) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): group mean off, then whitened over the batch as verl does it:
    every token carries its sequence's value, mean and unbiased variance over all tokens, rsqrt(var + 1e-8)
    (``eps`` unused)."""
    x = _work(r)                                                       # (N,)
    x = (x.view(-1, g) - x.view(-1, g).mean(dim=1, keepdim=True)).reshape(-1)  # (N,)
    w = torch.ones_like(x) if lengths is None else lengths.to(x)       # (N,) tokens per sequence
    xd, wd = x.double(), w.double()
    tok, s = _batch_sums([float(wd.sum()), float((wd * xd).sum())], reduce)
    mean = s / tok if tok > 0 else 0.0
    (ss,) = _batch_sums([float((wd * (xd - mean) ** 2).sum())], reduce)
    var = ss / (tok - 1) if tok > 1 else 0.0                           # Bessel over tokens, as verl
    return (x - mean) * (var + 1e-8) ** -0.5                           # (N,)


Estimator = Callable[..., torch.Tensor]
ADVANTAGES: dict[str, Estimator] = {
    "group": group, "group_mean": group_mean, "batch_std": batch_std, "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}


def sum_then_normalize(per_fn: torch.Tensor, weights: torch.Tensor, g: int, eps: float) -> torch.Tensor:
    """The seed's (and TRL's default) score: the weighted sum of the reward functions."""
    return _work(per_fn) @ weights.to(_work(per_fn))                   # (N,)


def normalize_then_sum(per_fn: torch.Tensor, weights: torch.Tensor, g: int, eps: float) -> torch.Tensor:
    """GDPO (arXiv 2601.05242): each reward function z-scored within its group, then the weighted sum
    (TRL multi_objective_aggregation="normalize_then_sum"; the batch step is the estimator's)."""
    x = _work(per_fn).view(-1, g, per_fn.shape[1])                     # (groups, G, F)
    z = (x - x.mean(dim=1, keepdim=True)) / (x.std(dim=1, keepdim=True) + eps)  # (groups, G, F)
    return z.reshape(-1, per_fn.shape[1]) @ weights.to(z)              # (N,)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]] = {
    "sum_then_normalize": sum_then_normalize, "normalize_then_sum": normalize_then_sum,
}


def advantages(per_fn: torch.Tensor, weights: torch.Tensor, group_size: int, *, estimator: str = "group",
               aggregation: str = "sum_then_normalize", eps: float = 1e-4,
               lengths: torch.Tensor | None = None, reduce: Reduce | None = None,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,), scores (N,)) from the per-function rewards ``per_fn`` (N, F) and ``weights`` (F,).

    ``lengths`` (N,): trained tokens per completion (``reinforce_pp`` weighs by them);
    ``reduce``: sums over ranks for the batch-level estimators (see the module docstring);
    ``dtype``: the scores are cast to it before the estimator (the trainer: float32, the seed's)."""
    if per_fn.dim() != 2 or per_fn.shape[1] != weights.numel():
        raise ValueError(f"per-function rewards must be (N, {weights.numel()}), got {tuple(per_fn.shape)}")
    score = AGGREGATIONS[aggregation](per_fn, weights, group_size, eps)  # (N,)
    score = score if dtype is None else score.to(dtype)                # (N,)
    _check(score, group_size)
    return ADVANTAGES[estimator](score, group_size, eps=eps, lengths=lengths, reduce=reduce), score


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_std: bool = True,
                     std_eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps) (``scale_std=False``: Dr. GRPO's r_i - mean)."""
    _check(rewards, group_size)
    return (group if scale_std else group_mean)(rewards, group_size, eps=std_eps)


def signal_mask(rewards: torch.Tensor, group_size: int, min_spread: float = 0.01) -> torch.Tensor:
    """True for each group whose rewards span at least ``min_spread`` (the seed drops the rest)."""
    r = rewards.float().view(-1, group_size)                          # (groups, G)
    return (r.max(dim=1).values - r.min(dim=1).values) >= min_spread  # (groups,)


def surplus_mask(keep: torch.Tensor, target: int) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): (groups,) True for the informative groups past the first
    ``target`` ones (``keep``: (groups,) bool, in generation order), which the batch leaves out."""
    return keep & (torch.cumsum(keep.long(), 0) > target)             # (groups,)


def refill_size(target: int, kept: int, generated: int, cap: int) -> int:
    """DAPO dynamic sampling: prompts to draw for the next round, the missing groups over the keep rate seen
    so far with a 25% margin (a round that kept nothing counts as a 10% rate), at most ``cap`` (verl draws
    a whole batch each round)."""
    rate = max(kept / generated if generated else 0.0, 0.1)
    return max(1, min(cap, math.ceil((target - kept) / rate * 1.25)))
