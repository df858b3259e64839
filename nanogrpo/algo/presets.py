"""The named policy-optimisation recipes (``grpo.loss``) as plain data, and the names of every variant.

A preset fills the orthogonal keys it leaves unset: the per-token objective, the
importance-sampling level, the loss reduction, the clip range and the advantage
estimator. An explicit key in the config overrides the preset's value.
This module imports nothing heavy: :mod:`nanogrpo.config` reads it before torch is loaded.

    name     objective  ratio     reduction            clip (low, high)  advantage   paper
    grpo     clip       token     seq-mean-token-mean  0.2, 0.2          group       DeepSeekMath, Shao 2024
    dapo     clip       token     token-mean           0.2, 0.28         group       DAPO, Yu 2025
    dr_grpo  clip       token     constant             0.2, 0.2          group_mean  Dr. GRPO, Liu 2025
    bnpo     clip       token     token-mean           0.2, 0.2          group       BNPO, Xiao 2025
    gspo     clip       sequence  seq-mean-token-mean  3e-4, 4e-4        group       GSPO, Zheng 2025
    cispo    cispo      token     token-mean           -, 5.0 (ε_max)    group       MiniMax-M1 2025, ScaleRL
    sapo     sapo       token     seq-mean-token-mean  - (soft gate)     group       SAPO, Gao 2025
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossPreset:
    objective: str
    """Per-token policy objective (``nanogrpo.algo.losses.OBJECTIVES``)."""
    importance_sampling: str
    reduction: str
    eps_low: float | None
    """None: the objective has no lower clip (cispo, sapo)."""
    eps_high: float | None
    """cispo: ε_max, the bound on the importance weight itself (not 1 + ε); sapo: None."""
    advantage: str
    paper: str


LOSS_PRESETS: dict[str, LossPreset] = {
    "grpo": LossPreset("clip", "token", "seq-mean-token-mean", 0.2, 0.2, "group",
                       "DeepSeekMath, Shao et al. 2024"),
    "dapo": LossPreset("clip", "token", "token-mean", 0.2, 0.28, "group", "DAPO, Yu et al. 2025"),
    "dr_grpo": LossPreset("clip", "token", "constant", 0.2, 0.2, "group_mean", "Dr. GRPO, Liu et al. 2025"),
    "bnpo": LossPreset("clip", "token", "token-mean", 0.2, 0.2, "group", "BNPO, Xiao et al. 2025"),
    "gspo": LossPreset("clip", "sequence", "seq-mean-token-mean", 3e-4, 4e-4, "group",
                       "GSPO, Zheng et al. 2025"),
    "cispo": LossPreset("cispo", "token", "token-mean", None, 5.0, "group",
                        "MiniMax-M1, 2025 (ε_max = 5 from ScaleRL, Khatri et al. 2025)"),
    "sapo": LossPreset("sapo", "token", "seq-mean-token-mean", None, None, "group", "SAPO, Gao et al. 2025"),
}

LOSS_NAMES = tuple(LOSS_PRESETS)
ADVANTAGE_NAMES = ("group", "group_mean", "batch_std", "rloo", "reinforce_pp")
AGGREGATION_NAMES = ("sum_then_normalize", "normalize_then_sum")
IMPORTANCE_NAMES = ("token", "sequence")
REDUCTION_NAMES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "constant")
KL_NAMES = ("k1", "k2", "k3")
CORRECTION_NAMES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
