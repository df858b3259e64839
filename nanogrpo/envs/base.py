"""The environment interface: what a multi-turn task (a game, a simulated user, a tool world) implements.

An environment plays **one episode** with the model, turn by turn::

    class GuessNumber(Environment):
        def reset(self, row):                  # start an episode from a dataset row
            self.secret = int(row["answer"])
            return "Guess my number, 1 to 15."   # the first observation: the prompt
        def step(self, action):                # the model's turn (its text, special tokens left out)
            guess = int(action) if action.strip().isdigit() else None
            if guess == self.secret:
                return StepResult(reward=1.0, done=True, info={"success": True})
            return StepResult("higher" if guess is not None and guess < self.secret else "lower")

- ``reset(row) -> Observation``: the episode's first observation, which becomes the prompt. A string
  is the user's message (after ``data.system_prompt``, if any); a list of chat messages
  (``{"role": ..., "content": ...}``) is the whole prompt, system message included.
- ``step(action) -> StepResult``: the model's turn, as text; the answer is the next observation (a
  string: the user's next message; a list of messages: any roles, e.g. ``tool``), a reward for this
  turn (float, default 0), whether the episode is over, and free-form ``info``. A tuple
  ``(observation, reward, done[, info])`` (Gymnasium's and SkyRL's order) is read the same way; ``None``
  (a ``step`` that forgot its ``return``) is not an answer: ``env_error``, as any other wrong type.
- both may be ``async def``; both run in worker threads (sync) or on one event loop (async), with a
  deadline (``env.timeout_s``); an environment that raises, hangs, answers a non-finite reward or an
  observation longer than ``env.max_observation_tokens`` ends its episode with ``env.error_penalty``
  and a count, never the run. An observation is measured in bytes before it is tokenised: one over
  ``max_observation_bytes`` (the token limit times the tokenizer's longest token, in bytes: it cannot
  fit) is refused as too long without being tokenised, whatever its size.
- ``close()`` (optional): called once when the episode ends, whatever ended it.

**One object per episode.** Each episode gets a fresh environment (``env.source = "module:Class"``:
``Class(**env.kwargs)``; an instance given to ``nanogrpo.train(env=obj)``: ``obj.fork()`` if it has
one, else ``copy.deepcopy(obj)``), so state lives in ``self``. Episodes of one group start from the
same row (GRPO compares them): an environment that draws at random should seed from the row.

**Success.** ``info["success"]`` of the last step (a bool) says whether the episode succeeded (what
``accuracy`` counts); without it, an episode succeeds when its reward is above 0.

**Running model-written code.** An environment that executes what the model writes (code, shell) asks
for the sandbox of :mod:`nanogrpo.tools`: it declares a ``sandbox`` attribute (the base class does, as
None) and the runner sets it, before ``reset``, to a :class:`SandboxHandle`:
``self.sandbox.run(code) -> (status, output)``, under the ``[tools]`` limits (time, memory, files,
output; no network where the kernel allows). Environment code itself is trusted as the user's own.

Nothing here knows tokens or training: the rollout (:mod:`nanogrpo.episodes.play`) renders the
observations with the chat template, trains the model's tokens only and keeps the KV cache across turns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Union, runtime_checkable

Message = dict[str, str]
"""A chat message: ``{"role": "user" | "assistant" | "system" | "tool" | ..., "content": str}``."""
Observation = Union[str, list[Message]]
"""What the model is shown: a user message's text, or chat messages."""


@dataclass
class StepResult:
    """An environment's answer to one model turn."""

    observation: Observation | None = None
    """The next observation (None or empty once ``done``)."""
    reward: float = 0.0
    """This turn's reward; the episode's return sums them (``grpo.turn_reward_discount``)."""
    done: bool = False
    """The episode is over (the observation, if any, is not shown)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form; ``success`` (bool) is read (see the module docstring); rewards see every step's info."""


class SandboxHandle(Protocol):
    """What an environment's ``sandbox`` attribute is set to (:class:`nanogrpo.envs.runner.EnvSandbox`)."""

    def run(self, code: str) -> tuple[str, str]:
        """Run Python ``code`` in the sandbox: (status, output); status ``ok``, ``error``, ``timeout``,
        ``crash``, ``overflow`` or ``denied`` (never raises for what the code does)."""
        ...


@runtime_checkable
class EnvironmentLike(Protocol):
    """Any object with these two methods is an environment (sync or ``async def``)."""

    def reset(self, row: dict[str, Any]) -> Observation: ...

    def step(self, action: str) -> Any: ...


class Environment:
    """Optional base class (an environment need only have ``reset`` and ``step``)."""

    sandbox: SandboxHandle | None = None
    """Set by the runner before ``reset`` (see the module docstring)."""
    max_observation_bytes: int | None = None
    """Set by the rollout before ``reset``: no observation of more bytes of text can be shown (the
    longest of ``data.max_prompt_tokens`` and ``env.max_observation_tokens`` times the tokenizer's
    longest token). An environment that reads its observations from outside (a socket, a file) may stop
    reading past it and raise :class:`ObservationTooLong`; the rollout refuses a longer one anyway."""

    def reset(self, row: dict[str, Any]) -> Observation:
        """The episode's first observation; by default the row's ``question`` as the user's message."""
        return str(row["question"])

    def step(self, action: str) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__}.step(action) must answer a StepResult")

    def close(self) -> None:
        """Called once when the episode ends."""


class EnvResultError(ValueError):
    """An environment answered something that is not a step result (its episode ends with the penalty)."""


class ObservationTooLong(EnvResultError):
    """An observation over its byte bound, refused before it was tokenised (or read whole): the episode
    ends as ``too_long`` (the first observation: its group is dropped, as a prompt over
    ``data.max_prompt_tokens``)."""


class SessionRefused(RuntimeError):
    """An environment server refused to open a session for an episode (at capacity). The episode's
    group is dropped and counted (``env/groups_dropped``), as for any ``reset`` that fails, and the
    runner says once, in one line, that the server's concurrency limit is below the episodes in flight
    and how to raise it (``hint``)."""

    def __init__(self, message: str, limit: int | None = None, hint: str = ""):
        super().__init__(message)
        self.limit, self.hint = limit, hint


def text_bytes(obs: Any, cap: int) -> int:
    """The UTF-8 size of an observation's text (a string, or the contents of its messages), measured no
    further than needed to know it is over ``cap``: a string of more characters than ``cap`` is over
    without being encoded (each character is at least one byte); the answer is then a lower bound."""
    texts = [obs] if isinstance(obs, str) else [m.get("content") for m in obs or () if isinstance(m, dict)]
    total = 0
    for t in texts:
        if not isinstance(t, str):
            continue
        if total + len(t) > cap:
            return total + len(t)
        total += len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass"))
        if total > cap:
            return total
    return total


def check_observation(obs: Any, where: str) -> Observation | None:
    """``obs`` if it is an observation (str, list of messages, None); :class:`EnvResultError` otherwise."""
    if obs is None or isinstance(obs, str):
        return obs
    if isinstance(obs, (list, tuple)) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in obs
    ):
        return [dict(m) for m in obs]
    raise EnvResultError(
        f"{where} answered an observation of type {type(obs).__name__}: use a string or a "
        "list of {'role': ..., 'content': ...} messages"
    )


def as_step_result(value: Any) -> StepResult:
    """A :class:`StepResult` from what ``step`` returned: a StepResult, a tuple ``(observation, reward,
    done[, info])`` or ``(observation, reward, terminated, truncated, info)`` (Gymnasium), a bare
    observation (reward 0, not done). Raises :class:`EnvResultError` for anything else (``None``
    included: a ``step`` without its ``return``) and for a reward that is not a finite number."""
    if isinstance(value, StepResult):
        res = value
    elif value is None:
        raise EnvResultError("step answered None (no return?): answer a StepResult; to end the episode, "
                             "StepResult(reward=..., done=True)")
    elif isinstance(value, str) or (isinstance(value, list) and all(isinstance(m, dict) for m in value)):
        res = StepResult(value)
    elif isinstance(value, tuple) and 2 <= len(value) <= 5:
        if len(value) == 5:  # gymnasium: obs, reward, terminated, truncated, info
            obs, reward, terminated, truncated, info = value
            res = StepResult(obs, reward, bool(terminated) or bool(truncated), info)
        else:
            res = StepResult(*value)
    else:
        raise EnvResultError(
            f"step answered {type(value).__name__}: answer a StepResult or a tuple "
            "(observation, reward, done[, info])"
        )
    res.observation = check_observation(res.observation, "step")
    try:
        reward = float(res.reward)
    except (TypeError, ValueError):
        raise EnvResultError(
            f"step answered a reward of type {type(res.reward).__name__}, not a number"
        ) from None
    if not math.isfinite(reward):
        raise EnvResultError(f"step answered a non-finite reward ({reward})")
    res.reward = reward
    res.done = bool(res.done)
    if res.info is None:
        res.info = {}
    if not isinstance(res.info, dict):
        raise EnvResultError(f"step answered info of type {type(res.info).__name__}, not a dict")
    return res


__all__ = [
    "Environment",
    "EnvironmentLike",
    "EnvResultError",
    "Message",
    "Observation",
    "ObservationTooLong",
    "SandboxHandle",
    "SessionRefused",
    "StepResult",
    "as_step_result",
    "check_observation",
    "text_bytes",
]
