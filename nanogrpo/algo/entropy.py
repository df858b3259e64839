"""Policy entropy: the top-ρ token mask and the entropy-bonus coefficient.

The per-token entropy H_t = -sum_v pi(v) log pi(v) comes out of the same chunked pass as the
log-probs (:func:`nanogrpo.algo.logprobs.token_stats`); the policy's mean entropy over the trained
tokens is logged every step, the first curve to watch for entropy collapse.

- ``grpo.top_entropy_quantile`` = ρ < 1 ("Beyond the 80/20 Rule", Wang et al. 2025; TRL's
  ``top_entropy_quantile``): the policy term keeps only tokens whose entropy is at least the
  (1 - ρ) quantile of the batch's trained tokens (:func:`entropy_threshold`, over the whole batch,
  every rank; :func:`entropy_mask`). The KL term keeps every token.
- ``grpo.entropy_coef``: the loss subtracts coef x the mean entropy of the tokens the policy term
  acts on (a bonus; gradient through the entropy).
- ``grpo.entropy_target`` set: adaptive control (Skywork-OR1, He et al. 2025; TRL's
  ``use_adaptive_entropy``), :class:`EntropyControl`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> float:
    """The entropy the top ``quantile`` share of tokens reaches: the (1 - ρ) quantile (linear
    interpolation, ``torch.quantile``) of ``entropies`` (T,), every trained token of the batch.
    ρ = 0 keeps only the highest-entropy token(s); an empty batch gives +inf."""
    if entropies.numel() == 0:
        return math.inf
    return float(torch.quantile(entropies.double(), 1.0 - quantile))


def entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(N, T) bool: trained tokens whose entropy is at least ``threshold`` (TRL's get_high_entropy_mask)."""
    return (entropy >= threshold) & mask.bool()                        # (N, T)


def adaptive_coef(coef: float, entropy: float, target: float, step: float, lo: float, hi: float) -> float:
    """Skywork-OR1's update, as TRL: coef + step when the step's entropy is at or below the target, else
    coef - step, within [lo, hi]."""
    return min(coef + step, hi) if entropy <= target else max(coef - step, lo)


@dataclass
class EntropyControl:
    """The entropy-bonus coefficient over a run: constant (``target`` None) or adaptive.

    Adaptive, as TRL's: :meth:`applied` is ``coef`` while the entropy measured at the previous
    optimizer step is at or below ``target`` and 0 otherwise (none before the first measurement);
    :meth:`update` moves ``coef`` by ``step`` after every optimizer step. Its state is saved in
    checkpoints (:meth:`state_dict`), so a resumed run continues it exactly."""

    coef: float = 0.0
    target: float | None = None
    step: float = 0.005
    lo: float = 0.0
    hi: float = 1.0
    last_entropy: float = math.inf

    @classmethod
    def from_config(cls, grpo) -> EntropyControl:
        return cls(coef=grpo.entropy_coef, target=grpo.entropy_target, step=grpo.entropy_coef_step,
                   lo=grpo.entropy_coef_min, hi=grpo.entropy_coef_max)

    @property
    def active(self) -> bool:
        """Whether the loss carries an entropy term at all (then the entropy needs its gradient)."""
        return self.coef != 0.0 or self.target is not None

    def applied(self) -> float:
        """The coefficient this optimizer step's loss uses."""
        if self.target is None:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step: ``entropy`` is its mean over the tokens the bonus acts on."""
        if self.target is None or not math.isfinite(entropy):
            return
        self.coef = adaptive_coef(self.coef, entropy, self.target, self.step, self.lo, self.hi)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, float | None]:
        """JSON-safe (no measurement yet: ``last_entropy`` None)."""
        last = self.last_entropy if math.isfinite(self.last_entropy) else None
        return {"coef": self.coef, "last_entropy": last}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            last = state.get("last_entropy")
            self.coef, self.last_entropy = float(state["coef"]), math.inf if last is None else float(last)
