"""``env.source = "verifiers:NAME"``: a verifiers environment (its classic API: ``vf.MultiTurnEnv`` with
``env_response``, ``vf.ToolEnv``, ``vf.StatefulToolEnv``, ``vf.Rubric``) trained as it runs.

A verifiers environment drives the model itself: its ``rollout`` calls the model through an OpenAI
client, asks ``env_response`` for the next message, checks its stop conditions, and its rubric scores
the finished rollout. So it is an agent program (:mod:`nanogrpo.envs.program`): each episode runs the
environment's own ``run_rollout`` with an OpenAI client pointed at nanogrpo's endpoint (the episode's
key), which records the tokens; the reward is the rubric's. Its turn limit (``max_turns``) and its
own parser apply as written; the endpoint's limits (``env.max_turns`` model calls,
``rollout.max_new_tokens`` sampled tokens) refuse requests past them, which verifiers records as the
rollout's error (its rubric still scores it).

- ``verifiers:NAME``: ``vf.load_environment(NAME, **env.kwargs)`` (an installed environment module);
- ``verifiers:module:attr`` / ``verifiers:path/file.py:attr``: an environment object, or a function
  returning one (called with ``env.kwargs``);
- from Python, ``nanogrpo.train(env=vf_env)``.

The dataset rows give the rollout its input: ``prompt`` (chat messages; else the row's ``question``
as the user's message, after the environment's system prompt), ``answer``, ``info``. A
rollout succeeds when its reward reaches the environment's ``pass_threshold``. Needs verifiers 0.3.x
(0.4 removed the classic API: ``pip install 'verifiers>=0.3.1,<0.4'``); with verifiers 0.4 installed,
``verifiers:...`` is the v1 adapter's (:mod:`nanogrpo.envs.adapters.verifiers_v1`).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from nanogrpo.envs.adapters.common import require
from nanogrpo.envs.program import AgentResult, ModelClient
from nanogrpo.errors import ConfigError

WHAT = "env.source 'verifiers:...'"


def _vf():
    vf = require("verifiers", "verifiers>=0.3.1,<0.4", WHAT)
    if not hasattr(vf, "MultiTurnEnv"):
        raise ConfigError(f"{WHAT}: verifiers {getattr(vf, '__version__', '?')} has no classic API "
                          "(MultiTurnEnv); pip install 'verifiers>=0.3.1,<0.4'")
    return vf


def rollout_input(env, row: dict[str, Any], index: int) -> dict[str, Any]:
    prompt = row.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
        prompt = ([{"role": "system", "content": env.system_prompt}] if env.system_prompt else []) + \
            list(env.few_shot or []) + [{"role": "user", "content": str(row.get("question", ""))}]
    out = {"prompt": prompt, "example_id": int(row.get("example_id", index)),
           "answer": str(row.get("answer", ""))}
    if row.get("info") is not None:
        out["info"] = row["info"]
    return out


class VerifiersProgram:
    """A verifiers environment as an agent program."""

    def __init__(self, env):
        vf = _vf()
        if not isinstance(env, vf.Environment):
            raise ConfigError(f"{WHAT}: expected a verifiers Environment, got {type(env).__name__}")
        self.env = env
        self.episodes = 0

    async def run(self, row: dict[str, Any], client: ModelClient) -> AgentResult:
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        self.episodes += 1
        oa = client.async_openai()
        try:
            out = await self.env.run_rollout(rollout_input(self.env, row, self.episodes),
                                             OpenAIChatCompletionsClient(oa), client.model, {})
        finally:
            await oa.close()
        reward = float(out.get("reward") or 0.0)
        info = {k: v for k, v in (out.get("metrics") or {}).items()
                if isinstance(v, (int, float)) and math.isfinite(v)}
        if out.get("error") is not None:
            info["error"] = str(out["error"])[:300]
        threshold = getattr(self.env, "pass_threshold", 0.5)
        return AgentResult(reward, reward >= threshold, info)


def load(rest: str, kwargs: dict, server: str = ""):
    """The factory for ``verifiers:NAME`` (see the module docstring); the environment loads once, at start.
    Which adapter runs is chosen by the verifiers installed: 0.4 and later (the v1 API) are
    :mod:`.verifiers_v1`'s, 0.3 this one's."""
    from nanogrpo.envs.adapters.verifiers_v1 import installed

    if installed() == "v1":
        from nanogrpo.envs.adapters.verifiers_v1 import load as load_v1

        return load_v1(rest, kwargs, server)
    if server:
        raise ConfigError("env.server is for verifiers 0.4 environments; the verifiers installed is 0.3 "
                          "(the classic API, in process only)")
    vf = _vf()
    if ":" in rest:
        from nanogrpo.envs.imports import import_attr

        obj = import_attr(rest, "env.source 'verifiers:...'")
        env = obj(**kwargs) if (inspect.isfunction(obj) or inspect.ismethod(obj)) else obj
    else:
        try:
            env = vf.load_environment(rest, **kwargs)
        except Exception as e:  # noqa: BLE001 - its own error, in one line, at start
            raise ConfigError(f"env.source 'verifiers:{rest}': vf.load_environment failed "
                              f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})") from None
    program = VerifiersProgram(env)
    return lambda: program
