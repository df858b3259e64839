"""Where a run's environment comes from: ``env.source`` (a string) or an object given in Python.

Everything resolves to a **factory**: a zero-argument callable that returns a fresh environment for
one episode (:mod:`nanogrpo.envs.base`).

- ``"module:Class"`` / ``"path/to/file.py:Class"``: your own class, called with ``env.kwargs`` per
  episode (a zero-argument function that returns an environment works the same way);
- ``"PREFIX:REST"`` where ``PREFIX`` is a key of :data:`LOADERS`: that library's adapter
  (``verifiers:NAME``, ``textarena:GAME-ID``, ``openenv:URL``), imported only when used;
- from Python (``nanogrpo.train(env=...)``): a class or factory as above, or an instance, which is a
  template: each episode gets ``obj.fork()`` if it has that method, else ``copy.deepcopy(obj)``.

A source that does not import, or names nothing callable, is a :class:`~nanogrpo.errors.ConfigError`
at start, in one line.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from nanogrpo.envs.imports import import_attr
from nanogrpo.errors import ConfigError

Factory = Callable[[], Any]
"""A zero-argument callable that returns a fresh environment (one episode)."""

LOADERS: dict[str, str] = {
    # prefix -> "module:function" of a loader ``fn(rest: str, kwargs: dict) -> Factory``, imported lazily.
    "agent": "nanogrpo.envs.program:load",
    "verifiers": "nanogrpo.envs.adapters.verifiers:load",
    "textarena": "nanogrpo.envs.adapters.textarena:load",
    "openenv": "nanogrpo.envs.adapters.openenv:load",
}
"""``env.source`` prefixes handled by an adapter: ``"PREFIX:REST"`` -> ``loader(REST, env.kwargs)``."""


def _import_attr(spec: str) -> Any:
    return import_attr(spec, "env.source", "'module:Class', 'path/to/file.py:Class' or one of "
                       + (", ".join(p + ":..." for p in sorted(LOADERS)) or "the adapters"))


def _check_env(obj: Any, what: str) -> None:
    if callable(getattr(obj, "run", None)) and not callable(getattr(obj, "step", None)):
        return  # an agent program (nanogrpo.envs.program)
    missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(
            f"{what} is not an environment: it has no {' or '.join(missing)} method "
            "(see nanogrpo/envs/base.py)"
        )


def factory_of(obj: Any, kwargs: Mapping[str, Any] | None = None, what: str = "env") -> Factory:
    """The factory for ``obj``: a class or zero-argument function (called with ``kwargs``), or an
    instance (forked or deep-copied per episode)."""
    kwargs = dict(kwargs or {})
    from nanogrpo.envs.adapters import adapt

    adapted = adapt(obj)  # a library's environment object or class (verifiers)
    if adapted is not None:
        if kwargs:
            raise ConfigError(f"{what}: env.kwargs is for env.source; configure the object given in Python")
        return adapted
    if inspect.isclass(obj):
        _check_env(obj, f"{what} ({obj.__name__})")
        return lambda: obj(**kwargs)
    if (callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None))) or (
            not inspect.isfunction(obj) and callable(getattr(obj, "run", None))):  # or an agent program
        if kwargs:
            raise ConfigError(f"{what}: env.kwargs is for a class or factory, not an instance")
        fork = getattr(obj, "fork", None)
        return fork if callable(fork) else (lambda: copy.deepcopy(obj))
    if callable(obj):
        return lambda: obj(**kwargs)
    raise ConfigError(f"{what}: expected an environment class, a factory or an instance with reset() and "
                      f"step(), got {type(obj).__name__}")


def resolve(source: Any, kwargs: Mapping[str, Any] | None = None, server: str = "") -> Factory:
    """The factory for ``env.source`` (a string, see the module docstring) or a Python object;
    ``server``: ``env.server`` (verifiers 0.4 environments only)."""
    spec = source.strip() if isinstance(source, str) else None
    prefix, sep, rest = (spec or "").partition(":")
    if server and not (sep and prefix == "verifiers"):
        raise ConfigError(f"env.server={server!r} is for verifiers 0.4 environments (env.source = "
                          "'verifiers:...'); leave it empty")
    if spec is None:
        return factory_of(source, kwargs)
    if sep and prefix in LOADERS:
        loader = _import_attr(LOADERS[prefix])
        return loader(rest, dict(kwargs or {}), server=server) if server else loader(rest, dict(kwargs or {}))
    return factory_of(_import_attr(spec), kwargs, what=f"env.source {spec!r}")


__all__ = ["Factory", "LOADERS", "factory_of", "resolve"]
