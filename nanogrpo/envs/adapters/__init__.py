"""Environments from the libraries people already use, each a few dozen lines over
:mod:`nanogrpo.envs.base` (or :mod:`nanogrpo.envs.program`), chosen by ``env.source``:

- ``verifiers:...``: a verifiers environment, by the verifiers installed: 0.4 and later, the v1 API
  (tasksets, harnesses, traces; :mod:`.verifiers_v1`), 0.3 the classic one (``MultiTurnEnv``,
  ``ToolEnv``, rubrics, :mod:`.verifiers`). Either calls the model itself, pointed at nanogrpo's
  endpoint (an agent program);
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
    """A factory for a library's environment object (a verifiers 0.4 ``Env`` or ``Taskset``, class or
    instance; a verifiers 0.3 ``Environment``; a TextArena ``Env``), or None when it is none of them."""
    mro = obj.__mro__ if isinstance(obj, type) else type(obj).__mro__
    mods = [c.__module__ or "" for c in mro]  # a subclass defined anywhere counts
    if any(m.startswith("verifiers.v1.") for m in mods):
        from nanogrpo.envs.adapters.verifiers_v1 import adapt as adapt_v1

        return adapt_v1(obj)
    if isinstance(obj, type):
        return None
    if any(m.startswith("verifiers.") for m in mods):
        from nanogrpo.envs.adapters.verifiers import VerifiersProgram

        program = VerifiersProgram(obj)
        return lambda: program
    if any(m.startswith("textarena.") for m in mods):
        raise ConfigError("a TextArena game from Python: pass env.source='textarena:GAME-ID' (each episode "
                          "makes its own game)")
    return None
