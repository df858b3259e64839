"""``[env]``: multi-turn environments (``nanogrpo.envs``; rollout in ``nanogrpo.episodes.play``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from nanogrpo.config.base import _Strict


class EnvConfig(_Strict):
    """Episodes with an environment instead of one completion per prompt: each dataset row starts
    ``grpo.group_size`` episodes; the model's turns are trained, the environment's observations are
    context only; the episode's return (its per-turn rewards, ``grpo.turn_reward_discount``) is a reward
    column named ``env`` beside any ``rewards.functions``."""

    source: str = ""
    """Where the environment comes from: ``module:Class`` or ``path/to/file.py:Class`` (your own; a class
    or zero-argument factory), or an adapter ``PREFIX:...`` (``nanogrpo.envs.load.LOADERS``). Empty: no
    environment (plain completions, or ``[tools]``). From Python, ``nanogrpo.train(env=obj)``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the class or factory of ``source`` (each episode is one call)."""
    max_turns: int = Field(8, ge=1)
    """Model turns per episode; an episode not done after this many ends (finish reason ``max_turns``)."""
    max_observation_tokens: int = Field(256, gt=0)
    """Tokens of one observation, chat template included; a longer one ends the episode with
    ``error_penalty`` (finish reason ``too_long``). An observation of more bytes of text than this times
    the tokenizer's longest token cannot fit and is refused so before it is tokenised, whatever its size.
    ``rollout.max_new_tokens`` bounds what the model samples over the whole episode (``length``);
    ``data.max_prompt_tokens`` the first observation (a longer one drops the group, counted)."""
    timeout_s: float = Field(30.0, gt=0)
    """Deadline of each environment call (create, ``reset``, ``step``, ``close``); past it the episode
    ends with ``error_penalty`` (``env_timeout``)."""
    error_penalty: float = -1.0
    """The episode reward of an episode the environment broke: it raised (``env_error``), hung
    (``env_timeout``), answered a non-finite reward or not a step result, None included (``env_error``),
    or an observation over ``max_observation_tokens`` (``too_long``). A failure in ``reset`` (a session
    its server refused included) drops the group, counted (``env/groups_dropped``)."""
    server: str = ""
    """verifiers 0.4 environments (``verifiers:...``): where episodes run. Empty: in this process;
    ``"start"``: in a verifiers environment server nanogrpo starts (and restarts if it dies); an address
    ``tcp://HOST:PORT``: a running ``vf.EnvServer`` (``nanogrpo.envs.adapters.verifiers_v1.server``)."""
    workers: int = Field(32, ge=1)
    """Threads running sync environment calls at once (``async def`` methods share one event loop)."""
    max_concurrent: int = Field(0, ge=0)
    """Episodes of agent programs (verifiers 0.4 environments included) running at once; the others wait
    their turn, and each one's deadline (``env.timeout_s``) starts when it starts. 0: what the program
    says this machine can run (verifiers 0.4 with a harness that is a process per turn, the ``null`` or
    ``bash`` harness in the ``subprocess`` runtime: two per CPU core this process may use), else no
    bound. Environments with ``reset``/``step`` play every episode of the step together (their calls:
    ``env.workers``)."""
