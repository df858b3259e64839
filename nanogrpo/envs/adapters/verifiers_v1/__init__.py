"""``env.source = "verifiers:..."`` with verifiers 0.4 (the v1 API: tasksets, harnesses, runtimes, traces).

A v1 environment (``vf.Env``) is a taskset (tasks scored by ``@vf.reward``) played by agents, each a
harness (a program: ``null`` for plain chat, ``bash`` for a coding agent, ...) in a runtime (a local
subprocess, a container, a remote sandbox). It calls the model itself, so to nanogrpo it is an agent
program (:mod:`nanogrpo.envs.program`) that answers, beside its reward, its **traces**: every token id
the model read and wrote, which it sampled, and their log-probs. The rollout trains those, after
checking each sampled span against the endpoint's own record of what it sampled
(:mod:`nanogrpo.episodes.agents`).

- ``verifiers:TASKSET-ID``: an installed environment (``vf.load_environment``); ``env.kwargs`` is its
  config (verifiers' ``[env]`` block: ``taskset`` (its knobs), the agent seats (``agent`` for a plain
  taskset, ``player`` for TextArena / OpenEnv, ...), ``timeout``, ...), plus ``renderer``
  (:data:`~.source.NANOGRPO_KEYS`);
- ``verifiers:module:attr`` / ``verifiers:path/file.py:attr``: a ``vf.Taskset`` or ``vf.Env`` subclass
  (or instance), or a function returning one (called with ``env.kwargs``); from Python,
  ``nanogrpo.train(env=vf_env)``;
- ``env.server``: empty (in process), ``"start"`` or an address (:mod:`.server`).

What is pinned for a local run (the ``null`` harness, the ``subprocess`` runtime, the run's limits):
:mod:`.source`. Which tasks: each dataset row is one (:func:`.program.task_of`). The ``null`` harness
is a uv script: its first use installs its packages (openai, mcp, httpx) into uv's cache, from the
package index; ``nanogrpo-chat`` is the same chat loop in process (:mod:`.harness`).
"""

from __future__ import annotations

from typing import Any

from nanogrpo.envs.adapters.verifiers_v1.program import V1Program
from nanogrpo.envs.adapters.verifiers_v1.source import installed, pin, resolve, spec_of


def load(rest: str, kwargs: dict, server: str = ""):
    """The factory for ``verifiers:REST`` with verifiers 0.4 (the module docstring): one program for every
    episode; the env itself is built at the first episode (it needs the run's limits)."""
    from nanogrpo.envs.adapters.verifiers_v1.server import check_address
    from nanogrpo.errors import ConfigError

    spec, options = resolve(rest, kwargs)
    if isinstance(spec, dict):
        pin(spec, 0, 0)  # verifiers resolves the config now: an unknown id or key is a ConfigError at start
    if server:
        check_address(server)
        if server == "start" and not isinstance(spec, dict):
            raise ConfigError("env.server=start: the server builds the environment from its config; name a "
                              "taskset or Env (id or class), not a function returning a built Env")
    program = V1Program(spec, options, server, (rest, dict(kwargs)))
    return lambda: program


def adapt(obj: Any):
    """The factory for a verifiers 0.4 object given from Python (an ``Env``, a ``Taskset`` class or
    instance), or None when it is none."""
    from nanogrpo.envs.adapters.verifiers_v1.source import vf

    v1 = vf()
    kinds = (v1.Env, v1.Taskset)
    if not (isinstance(obj, kinds) or (isinstance(obj, type) and issubclass(obj, kinds))):
        return None
    program = V1Program(spec_of(obj, {}, "env"), {})
    return lambda: program


__all__ = ["V1Program", "adapt", "installed", "load"]
