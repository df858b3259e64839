"""Agent programs: code that drives the model itself, through an OpenAI client, and says how it went.

An environment (:mod:`nanogrpo.envs.base`) is called by the rollout once per model turn. An agent
program is the other way round: it is called **once per episode** and calls the model as often as
it likes, through the OpenAI SDK (or any library built on it), then answers the episode's reward::

    def solve(row, client):                      # env.source = "agent:my_agents:solve"
        oa = client.openai()                     # openai.OpenAI(base_url=..., api_key=...)
        msgs = [{"role": "user", "content": row["question"]}]
        reply = oa.chat.completions.create(model=client.model, messages=msgs)
        ...                                      # tools, follow-ups, several calls
        return 1.0 if check(reply, row) else 0.0  # or AgentResult(reward, success, info)

During a rollout ``client`` points at nanogrpo's endpoint in front of the rollout engine
(:mod:`nanogrpo.episodes.endpoint`: loopback only, a key per episode), which records every request's
token ids; the rollout assembles the episode's training sequences from them
(:mod:`nanogrpo.episodes.trajectory`). A program that already reads ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY`` runs unchanged given ``client.environ()``.

- ``run(row, client)`` may be ``async def`` (``client.async_openai()``); it runs under
  ``env.timeout_s`` for the **whole episode** (model calls included), counted from when it starts; a
  program that raises, runs past it or answers a non-finite reward gets ``env.error_penalty``
  (counted), the run goes on. At most ``env.max_concurrent`` run at once; left at 0, a program's
  ``episodes_at_once()`` (optional: how many of its episodes this machine can run at once, None for
  no bound) says how many.
- it answers a number (the reward; success when above 0), an :class:`AgentResult`, or a dict with
  ``reward`` (and optionally ``success``, ``info``).
- a plain function ``fn(row, client)`` is a program through ``env.source = "agent:module:function"``
  or ``nanogrpo.train(env=agent(fn))``; a class with a ``run`` method is one as ``module:Class``.

Nothing here knows tokens or training.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from nanogrpo.errors import ConfigError


@dataclass(frozen=True)
class ModelClient:
    """Where an agent program reaches the model: an OpenAI-compatible ``base_url`` and the episode's key."""

    base_url: str
    api_key: str
    model: str = "nanogrpo"
    session_key: str = ""
    """The key of the endpoint's token route sessions (``/inference/v1/generate`` with an
    ``X-Session-ID`` header naming the episode): for a client shared by many episodes, which cannot
    carry a key per episode (:mod:`nanogrpo.episodes.endpoint.records`)."""
    tokenizer: str = ""
    """Where the engine's tokenizer loads from (a directory or hub id): for programs that render
    prompts to token ids themselves."""
    max_turns: int = 0
    """The episode's limit on model calls (``env.max_turns``; 0: not said); past it requests are refused."""
    max_tokens: int = 0
    """The episode's limit on sampled tokens (``rollout.max_new_tokens``; 0: not said)."""

    def openai(self, **kwargs):
        """An ``openai.OpenAI`` client for this episode (no retries: a refused request is an answer)."""
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **kwargs})

    def async_openai(self, **kwargs):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **kwargs})

    def environ(self) -> dict[str, str]:
        """The variables the OpenAI SDKs read, for a program run as a subprocess."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model}


@dataclass
class TokenSequence:
    """A conversation as a program recorded it in token ids: what the model read and wrote, in order,
    which tokens it sampled (``mask``) and their log-probs (0 elsewhere)."""

    ids: list[int]
    mask: list[bool]
    logprobs: list[float]


@dataclass
class AgentResult:
    """What an agent program's episode came to."""

    reward: float
    success: bool | None = None
    """None: the reward is above 0."""
    info: dict[str, Any] = field(default_factory=dict)
    sequences: list[TokenSequence] | None = None
    """The program's own record of what to train (a library that keeps token ids, as verifiers 0.4's
    traces do), checked against the endpoint's record of every request: each sampled span must be a
    request's sampled tokens, with that request's prompt before it. None: the endpoint's record is
    trained (:mod:`nanogrpo.episodes.trajectory`)."""
    sessions: list[str] = field(default_factory=list)
    """The token route sessions (``X-Session-ID``) whose requests are this episode's."""


class Program:
    """An agent program made of a function ``fn(row, client)`` (see the module docstring)."""

    def __init__(self, fn, **kwargs):
        if not callable(fn):
            raise ConfigError(f"an agent program must be callable as fn(row, client), "
                              f"got {type(fn).__name__}")
        self.fn, self.kwargs = fn, kwargs
        if inspect.iscoroutinefunction(fn):
            self.run = self._run_async

    def run(self, row: dict, client: ModelClient) -> Any:
        return self.fn(row, client, **self.kwargs)

    async def _run_async(self, row: dict, client: ModelClient) -> Any:
        return await self.fn(row, client, **self.kwargs)

    def __repr__(self) -> str:
        return f"agent({getattr(self.fn, '__qualname__', self.fn)!r})"


def agent(fn, **kwargs) -> Program:
    """``fn(row, client, **kwargs)`` as an agent program (``nanogrpo.train(env=agent(fn))``)."""
    return Program(fn, **kwargs)


def episodes_at_once(program: Any) -> int | None:
    """What ``program`` says this machine can run of its episodes at once (its optional
    ``episodes_at_once()``, or an attribute of that name); None: no bound."""
    hint = getattr(program, "episodes_at_once", None)
    n = hint() if callable(hint) else hint
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def is_program(obj: Any) -> bool:
    """An agent program: it has ``run`` and is not a turn-by-turn environment (no ``step``)."""
    return callable(getattr(obj, "run", None)) and not callable(getattr(obj, "step", None))


def as_agent_result(value: Any) -> AgentResult:
    """An :class:`AgentResult` from what a program answered; ValueError (one line) for anything else or a
    reward that is not a finite number."""
    if isinstance(value, AgentResult):
        res = value
    elif isinstance(value, dict) and "reward" in value:
        res = AgentResult(value["reward"], value.get("success"), dict(value.get("info") or {}))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        res = AgentResult(value)
    else:
        raise ValueError(f"an agent program answered {type(value).__name__}: answer the reward (a number), "
                         "an AgentResult or a dict with 'reward'")
    try:
        reward = float(res.reward)
    except (TypeError, ValueError):
        raise ValueError(f"an agent program answered a reward of type {type(res.reward).__name__}") from None
    if not math.isfinite(reward):
        raise ValueError(f"an agent program answered a non-finite reward ({reward})")
    if res.success is not None and not isinstance(res.success, bool):
        raise ValueError(f"an agent program answered success={res.success!r}, not a bool")
    return AgentResult(reward, res.success, res.info, res.sequences, list(res.sessions))


def load(rest: str, kwargs: dict) -> Any:
    """``env.source = "agent:module:function"`` (or ``agent:path/file.py:function``): a factory of
    :class:`Program` over the function, called with ``env.kwargs``."""
    from nanogrpo.envs.imports import import_attr

    fn = import_attr(rest, "env.source 'agent:...'")
    if inspect.isclass(fn):
        raise ConfigError(f"env.source 'agent:{rest}': name a function fn(row, client); a class with a run "
                          "method is a source by itself ('module:Class')")
    program = Program(fn, **kwargs)
    return lambda: program


__all__ = ["AgentResult", "ModelClient", "Program", "TokenSequence", "agent", "as_agent_result", "is_program",
           "load"]
