"""The generation interface every rollout engine implements.

Generation knows nothing of training: token ids in; completion ids, the
log-probabilities of the sampled tokens and a finish reason per sequence out.

Log-probabilities are ``log_softmax(logits / logprob_temperature)`` of the sampled
tokens in float32: by default (1.0) the *untempered* model distribution, the seed's
convention, i.e. exactly what the trainer's forward pass computes for the same weights
(the ``old_t`` of DESIGN §2). Temperature, top-p and top-k shape what is *sampled*, not
what is reported; ``rollout.tempered_logprobs`` sets ``logprob_temperature`` to the
sampling temperature (TRL's and verl's convention) in the engine and the trainer alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    """Samples per prompt; results are prompt-major (prompt 0's n samples first)."""
    seed: int | None = None
    logprob_temperature: float = 1.0
    """Engines report ``log_softmax(logits / logprob_temperature)`` of the sampled tokens; 1.0 is
    the untempered model distribution (the seed's convention)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Generation:
    """Outputs for ``len(prompts) * n`` sequences, prompt-major order."""

    completion_ids: list[list[int]]
    """Each ends at and includes the first EOS when one was produced."""
    logprobs: list[list[float]]
    """Same lengths as ``completion_ids``."""
    finish_reasons: list[str]
    """``"stop"`` (emitted EOS) or ``"length"`` (hit ``max_new_tokens``)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Engine-specific timings (e.g. ``prefill_s``, ``decode_s``)."""


@runtime_checkable
class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        """Sample ``params.n`` completions for each prompt (token ids, no padding)."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new policy weights in place (no re-compilation, no re-capture)."""
        ...
