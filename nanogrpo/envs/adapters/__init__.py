"""Environments from the libraries people already use, each a few dozen lines over
:mod:`nanogrpo.envs.base` (or :mod:`nanogrpo.envs.program`), chosen by ``env.source``:

- ``verifiers:NAME`` (:mod:`.verifiers`): a verifiers environment (``MultiTurnEnv.env_response``,
  ``ToolEnv``, ``StatefulToolEnv``, rubrics), loaded with ``vf.load_environment(NAME, **env.kwargs)``
  or named as ``verifiers:module:attr``; it calls the model through its own OpenAI client, pointed at
  nanogrpo's endpoint (an agent program);
- ``textarena:GAME-ID`` (:mod:`.textarena`): a single-player TextArena game;
- ``openenv:URL`` (:mod:`.openenv`): an OpenEnv environment server (its WebSocket session API).

Each library is imported when its adapter is used; a missing one is a one-line error naming the
``pip install`` to run. :func:`adapt` turns a library's object given from Python
(``nanogrpo.train(env=vf_env)``) into a factory.
"""

from __future__ import annotations

from typing import Any

from nanogrpo.errors import ConfigError


def adapt(obj: Any):
    """A factory for a library's environment object (a verifiers ``Environment``, a TextArena ``Env``),
    or None when ``obj`` is none of them."""
    mods = [c.__module__ or "" for c in type(obj).__mro__]  # a subclass defined anywhere counts
    if any(m.startswith("verifiers.") for m in mods):
        from nanogrpo.envs.adapters.verifiers import VerifiersProgram

        program = VerifiersProgram(obj)
        return lambda: program
    if any(m.startswith("textarena.") for m in mods):
        raise ConfigError("a TextArena game from Python: pass env.source='textarena:GAME-ID' (each episode "
                          "makes its own game)")
    return None
