"""``[rewards]``: reward functions, their workers and penalties, reward models and judges."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from nanogrpo.config.base import _Strict


class RewardsConfig(_Strict):
    functions: list[str] = Field(default_factory=lambda: ["correctness", "format"])
    """Built-in names (``correctness``, ``format``, ``format_strict``, ``format_boxed``, ``overlong``;
    ``env``: a multi-turn episode's return, which ``[env]`` runs put first by themselves),
    ``module:function`` or
    ``path/to/file.py:function`` (per-completion or batched, ``nanogrpo.rewards.batching``). (Python's
    API also takes callables: ``nanogrpo.rewards.entries``.)"""
    weights: list[float] | None = None
    """One weight per function; None means all 1.0."""
    timeout_s: float = Field(5.0, gt=0)
    """A reward call taking longer than this is abandoned and scored ``penalty``."""
    penalty: float = -1.0
    """The score of a reward call that raises, hangs past its timeout or returns a non-finite number
    (counted in the metrics; the run goes on)."""
    workers: int = Field(1, ge=0)
    """Reward worker processes (isolate hangs and crashes); 0 runs rewards in-process."""
    chunk_size: int = Field(0, ge=0)
    """Rows per call of a batched reward that names no ``chunk_size`` of its own; 0: the whole rollout
    batch in one call. Chunks of one batch run in parallel over the workers."""
    batch_timeout_s: float = Field(60.0, gt=0)
    """A batched reward's call (one chunk) taking longer than this is abandoned and its rows scored
    ``penalty`` (a function may name its own: ``@batched(timeout_s=...)``)."""
    rm_device: str = "auto"
    """Where an ``rm:`` reward model runs: a torch device (``cuda:1``, ``cpu``); ``auto``: the
    trainer's device (``model.device``; in split mode the rollout worker's)."""
    rm_batch_tokens: int = Field(16384, gt=0)
    """Padded tokens per reward-model forward (rows x longest row, rows sorted by length)."""
    rm_scale: Literal["none", "zscore"] = "none"
    """``zscore``: a reward model's scores become ``(s - mean) / std`` over the rollout batch before the
    weights apply (puts an unbounded logit on the scale of the rule rewards beside it)."""
    judge_model: str | None = None
    """The model a ``judge:URL`` reward asks; None: the first one ``URL/models`` lists."""
    judge_template: str = "correct"
    """The judge's prompt: ``correct`` (is the answer right, given the reference? yes/no), ``rate`` (1-10),
    or a template file with ``{completion}``, ``{question}``, ``{answer}`` and any sample field
    (``nanogrpo.rewards.judges.templates``)."""
    judge_score: Literal["auto", "yes_no", "number"] = "auto"
    """How a reply is read: ``yes_no`` (1 / 0) or ``number`` (in ``judge_range``); ``auto``: the
    template's own (a file: ``number``)."""
    judge_range: tuple[float, float] = (1.0, 10.0)
    """A ``number`` score outside it is unparseable (scored ``penalty``, counted)."""
    judge_concurrency: int = Field(16, ge=1)
    """Requests in flight at once."""
    judge_timeout_s: float = Field(60.0, gt=0)
    """One request; past it (or on 429 / 5xx / a failed connection) it is retried with backoff."""
    judge_retries: int = Field(4, ge=0)
    """Retries of one judge request (exponential backoff with jitter, ``Retry-After`` honoured)."""
    judge_deadline_s: float = Field(300.0, gt=0)
    """A batch's requests end here, retries included: rows without a reply score ``penalty``."""
    judge_max_tokens: int = Field(64, ge=1)
    """``max_tokens`` of each judge request: the reply holds a verdict or a score, not an essay."""
    judge_request: dict[str, Any] = Field(default_factory=dict)
    """Extra fields of the request body (``{top_p = 1}``); a null value removes a default field
    (``{max_tokens = null, max_completion_tokens = 512}``)."""
    judge_max_reply_bytes: int = Field(1 << 20, ge=1024)
    """The most of one reply (and of ``URL/models``) that is read (1 MiB; a chat completion is a few
    kilobytes): past it the connection is closed and the row scores ``penalty`` as an error (counted),
    so a judge that streams without end holds at most ``judge_concurrency`` x this in memory."""
    judge_api_key_env: str = "NANOGRPO_JUDGE_API_KEY"
    """Environment variable holding the judge's API key (unset: no key is sent); never the key itself."""
    judge_cache: str = "auto"
    """``auto``: ``RUN/judge_cache.sqlite`` (a resumed run or a repeated completion is not asked twice;
    in memory where there is no run directory, e.g. a rollout worker); ``memory``; ``off``; or a file."""
    truncated_correct: bool = True
    """Whether the built-in ``correctness`` credits a completion the token limit cut off
    (``finish_reason == "length"``). True (the seed): it is read like any other. False: it scores
    -1 whatever it says (DAPO's overlong filtering), so answers that never finish earn nothing."""
    truncated_last_number: bool = False
    """Whether the built-in ``correctness`` may credit a completion the token limit cut off before it
    gave any final answer (no ``<answer>`` block, no ``\\boxed{}``, no "the answer is …"). False: it
    scores -1 whatever its last number is, so the policy is not paid for running out of tokens at the
    right moment. True: it is read like a completion that ended by itself, by its last sentence with a
    number, as the seed reads its last number (for parity runs).
    Moot when ``truncated_correct`` is false (every cut-off completion scores -1)."""
    overlong_buffer: int | None = Field(None, gt=0)
    """The built-in ``overlong`` reward (DAPO's soft overlong punishment): its penalty ramps from 0 to
    -``overlong_penalty`` over the last this many tokens before ``rollout.max_new_tokens``. None: a fifth
    of the limit (DAPO: 4,096 of 20,480)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The built-in ``overlong``'s penalty at the token limit (verl's ``penalty_factor``)."""

    @model_validator(mode="after")
    def _weights_match(self) -> RewardsConfig:
        if not self.functions:
            raise ValueError("rewards.functions is empty: name at least one reward")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(
                f"rewards.weights has {len(self.weights)} entries but rewards.functions has "
                f"{len(self.functions)}"
            )
        return self

    def resolved_weights(self) -> list[float]:
        return list(self.weights) if self.weights is not None else [1.0] * len(self.functions)
