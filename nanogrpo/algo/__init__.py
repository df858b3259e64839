"""The GRPO algorithm: advantages, losses (a registry of variants), token log-probs."""

from nanogrpo.algo.advantages import group_advantages, signal_mask
from nanogrpo.algo.logprobs import token_logprobs
from nanogrpo.algo.losses import LOSSES, BatchTotals, k3_kl, policy_loss

__all__ = ["group_advantages", "signal_mask", "token_logprobs", "LOSSES", "BatchTotals", "k3_kl",
           "policy_loss"]
