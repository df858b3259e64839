"""The GRPO algorithm: advantages, losses (registries of variants), corrections, entropy, token log-probs.

    presets.py      the named recipes (``grpo.loss``) as plain data; no torch (the config reads it)
    advantages.py   ADVANTAGES (estimators), AGGREGATIONS (several reward functions), signal_mask,
                    surplus_mask / refill_size (dynamic sampling)
    losses.py       OBJECTIVES, IMPORTANCE, REDUCTIONS, KL_ESTIMATORS, LossSpec, policy_loss
    corrections.py  CORRECTIONS (rollout importance sampling), off_policy_mask
    entropy.py      entropy_threshold / entropy_mask (top-ρ tokens), EntropyControl (bonus coefficient)
    distill.py      SIGNALS (on-policy distillation: sampled, jsd), generalized_jsd, distill_terms
    support.py      the top-k / top-p support and log-probs over it (no truncated-support bias)
    logprobs.py     chunked token log-probs and entropies (no batch x length x vocabulary tensor)

Names are imported lazily so that ``nanogrpo.algo.presets`` costs no torch import.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "ADVANTAGES": "advantages", "AGGREGATIONS": "advantages", "advantages": "advantages",
    "group_advantages": "advantages", "signal_mask": "advantages", "surplus_mask": "advantages",
    "refill_size": "advantages", "truncate": "support", "support_logprobs": "support",
    "OBJECTIVES": "losses", "IMPORTANCE": "losses", "REDUCTIONS": "losses", "KL_ESTIMATORS": "losses",
    "LOSSES": "losses", "BatchTotals": "losses", "LossSpec": "losses", "k3_kl": "losses",
    "policy_loss": "losses",
    "CORRECTIONS": "corrections", "off_policy_mask": "corrections",
    "EntropyControl": "entropy", "entropy_mask": "entropy", "entropy_threshold": "entropy",
    "SIGNALS": "distill", "DistillSpec": "distill", "distill_terms": "distill", "generalized_jsd": "distill",
    "token_logprobs": "logprobs", "token_stats": "logprobs",
    "LOSS_PRESETS": "presets",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'nanogrpo.algo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nanogrpo.algo.{_WHERE[name]}"), name)
