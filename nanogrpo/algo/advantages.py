"""Group-relative advantages (DESIGN §2).

Rewards arrive flat, prompt-major: group g holds rows ``g*G .. g*G+G-1``.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_std: bool = True,
                     std_eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps), std the sample std (as ``torch.std``).

    ``scale_std=False`` gives Dr. GRPO's unscaled ``r_i - mean``. A zero-variance
    group yields all-zero advantages (never NaN).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be flat with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)                          # (groups, G)
    centred = r - r.mean(dim=1, keepdim=True)                         # (groups, G)
    if scale_std:
        centred = centred / (r.std(dim=1, keepdim=True) + std_eps)    # (groups, G)
    return centred.reshape(-1)                                        # (groups*G,)


def signal_mask(rewards: torch.Tensor, group_size: int, min_spread: float = 0.01) -> torch.Tensor:
    """True for each group whose rewards span at least ``min_spread`` (the seed drops the rest)."""
    r = rewards.float().view(-1, group_size)                          # (groups, G)
    return (r.max(dim=1).values - r.min(dim=1).values) >= min_spread  # (groups,)
