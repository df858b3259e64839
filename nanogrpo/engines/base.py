"""The generation interface every rollout engine implements.

Generation knows nothing of training: token ids in; completion ids, the
log-probabilities of the sampled tokens and a finish reason per sequence out.

Multi-turn rollouts (tool calls) go through a :class:`TurnSession`: trajectories
that alternate sampled turns with fed tokens (tool output). Any engine gets one
from :func:`nanogrpo.engines.session.open_session`, which re-prefills each
trajectory's whole context every turn through ``generate``; an engine that can keep
its KV cache across turns implements ``open_session`` itself (the hook below).

Log-probabilities are ``log_softmax(logits / logprob_temperature)`` of the sampled
tokens in float32: by default (1.0) the *untempered* model distribution, the seed's
convention, i.e. exactly what the trainer's forward pass computes for the same weights
(the ``old_t`` of DESIGN §2). Temperature, top-p and top-k shape what is *sampled*, not
what is reported; ``rollout.tempered_logprobs`` sets ``logprob_temperature`` to the
sampling temperature (TRL's and verl's convention) in the engine and the trainer alike, and
with top-k / top-p ``support_logprobs``: the log-probs of exactly what is sampled, over the
kept support, which the trainer computes likewise (:mod:`nanogrpo.algo.support`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

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
    support_logprobs: bool = False
    """Report the log-probs of the distribution the tokens are drawn from: ``logits / temperature``
    restricted to the position's top-k / top-p support and renormalised (``logprob_temperature`` must be
    ``temperature``; :mod:`nanogrpo.algo.support`, ``rollout.tempered_logprobs`` with top-k / top-p)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a sequence ends at the first token whose decoded text completes one (the rule of
    :mod:`nanogrpo.engines.stops`; that token is kept), finish reason ``"stop_string"``. Needs an
    engine built with a tokenizer. An engine that does not stop early ignores it; a
    :class:`TurnSession` always cuts there, so results agree, only compute differs."""

    resume_after_eos: bool = False
    """Multi-turn sessions whose turns end at EOS (chat turns with an environment): a row that ended at
    EOS may be stepped again, so a session that keeps caches (the fast engine's) keeps its cache then too
    (by default only rows that completed a stop string are expected back)."""

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
    """``"stop"`` (emitted EOS), ``"length"`` (hit ``max_new_tokens``) or ``"stop_string"`` (completed
    one of ``SamplingParams.stop``)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Engine-specific timings (e.g. ``prefill_s``, ``decode_s``)."""
    images: list | None = None
    """Vision-language rollouts: each sequence's prompt images (:class:`~nanogrpo.data.images.VisionInputs`),
    set by the rollout that passed them (the batch carries them to the update)."""
    routes: list[torch.Tensor | None] | None = None
    """Mixture-of-experts models, when the engine records routes (``moe.routing_replay``): per sequence, the
    experts each MoE layer chose for each token of its prompt (no padding) then its completion,
    (prompt + completion tokens, moe_layers, top_k) uint8 / int16, ``NO_ROUTE`` where none was recorded
    (the last token: never fed back); None for a sequence the engine returned no routes for
    (:mod:`nanogrpo.moe.routes`). None: the engine records none."""


@dataclass
class MultiTurnGeneration(Generation):
    """A :class:`Generation` of whole multi-turn trajectories: sampled turns and the tokens fed between
    them (tool output, an environment's observations), with a mask of which were sampled."""

    loss_masks: list[list[bool]] = field(default_factory=list)
    """Per trajectory, per completion token: True if the model sampled it (trained), False if fed."""
    infos: list[dict[str, Any]] = field(default_factory=list)
    """Per trajectory: ``turns`` (a dict per turn: ``text``, ``tool_call``, ``tool_output``,
    ``tool_status``), ``tool_calls``, ``tool_errors`` (the keys rewards see in their sample dict)."""
    tool_metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        """Sample ``params.n`` completions for each prompt (token ids, no padding)."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new policy weights in place (no re-compilation, no re-capture)."""
        ...


@runtime_checkable
class TurnSession(Protocol):
    """Trajectories that alternate sampled turns with fed tokens, for multi-turn rollouts.

    Opened on ``len(prompts) * params.n`` trajectories; trajectory ``r = i * n + j`` is prompt
    ``i``'s sample ``j`` (prompt-major, as :meth:`Engine.generate`). The caller then calls
    :meth:`step` once per turn:

    - ``rows``: distinct trajectory indices, each listed at most once per step, a subset of the
      previous step's rows (the first step lists every trajectory). A trajectory left out of a step
      is finished for good: the session may free its state.
    - ``feeds[k]``: tokens appended to ``rows[k]``'s context before sampling: context the model reads
      but did not sample (tool output, the template around it); empty in the first step.
    - ``budgets[k]`` >= 1: the most tokens ``rows[k]`` may sample in this step.

    Each listed trajectory then samples from its whole context (prompt, everything sampled and fed
    so far, in order) until it emits EOS (kept; ``"stop"``), completes a stop string of
    ``params.stop`` (by :mod:`nanogrpo.engines.stops`' rule; that token kept; ``"stop_string"``), or
    samples ``budgets[k]`` tokens (``"length"``). The result lists the sampled tokens, their
    untempered log-probs and the finish reason of each listed row, in ``rows`` order.
    ``params.max_new_tokens`` is unused (budgets come per step); randomness follows ``params.seed``.
    """

    def step(self, rows: Sequence[int], feeds: Sequence[Sequence[int]], budgets: Sequence[int]) -> Generation:
        ...

    def close(self) -> None:
        """Free whatever the session holds (idempotent)."""
        ...


class MultiTurnEngine(Engine, Protocol):
    """The optional engine hook: an engine that keeps each trajectory's state (its KV cache) across
    turns implements ``open_session``. ``max_len`` bounds every trajectory's context length (prompt +
    sampled + fed tokens) for the whole session, so a static cache can be sized once."""

    def open_session(self, prompts: list[list[int]], params: SamplingParams, max_len: int) -> TurnSession:
        ...
