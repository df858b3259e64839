"""What a verifiers 0.4 environment is built from: ``env.source`` and ``env.kwargs`` made into the
``EnvConfig`` verifiers builds it from (``vf.load_environment(vf.resolve_env_config(...))``).

verifiers finds its plugins by id: a taskset id names an importable top-level module (``my-env``
imports ``my_env``) whose ``__all__`` exports one ``vf.Taskset`` subclass (and optionally one
``vf.Env``); an env id and a harness id likewise. A class named by ``verifiers:module:Class`` lives in
a module verifiers may not find that way (a dotted module, a file, one exporting several): it is
given the id :func:`plugin_id` makes and a module of that name holding just that class is registered
(``sys.modules``; with the Env its module pairs it with, :func:`partner_env`), in this process and in
an environment server nanogrpo starts (which resolves the source the same way).

Pinned for a local run, unless ``env.kwargs`` says otherwise: each agent seat (role) of the env with
no harness gets the ``null`` harness (a plain chat loop; a taskset that bundles its own harness keeps
it) and with no runtime the ``subprocess`` runtime (verifiers' default is a remote sandbox: an account
and the network); its ``max_turns`` and ``max_output_tokens`` are the run's (``env.max_turns``,
``rollout.max_new_tokens``), so verifiers stops an episode at the run's limits itself.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import types
from typing import Any

from nanogrpo.envs.adapters.common import require
from nanogrpo.errors import ConfigError

WHAT = "env.source 'verifiers:...'"
NANOGRPO_KEYS = ("renderer",)
"""``env.kwargs`` keys that are nanogrpo's, not the EnvConfig's: ``renderer`` (the train client's
``renderers`` config, e.g. ``{name = "default", tool_parser = "qwen3"}``; default: from the model)."""


def vf():
    """``verifiers.v1``, or a one-line ConfigError."""
    require("verifiers", "verifiers>=0.4", WHAT)
    if installed() != "v1":
        raise ConfigError(f"{WHAT}: the v1 adapter needs verifiers 0.4 or later (installed: the classic 0.3)")
    try:
        import verifiers.v1 as v1
    except ImportError as e:
        raise ConfigError(f"{WHAT}: verifiers has no v1 API ({type(e).__name__}: {e}); "
                          "pip install 'verifiers>=0.4'") from None
    return v1


def installed() -> str:
    """``"v1"`` when the installed verifiers is 0.4 or later (the v1 API only), ``"classic"`` before
    (0.3 ships an early ``verifiers.v1`` beside the classic API; its classic one is what is used),
    ``""`` when none is installed. Read from the package's metadata, without importing it."""
    from importlib import metadata

    try:
        version = metadata.version("verifiers")
    except metadata.PackageNotFoundError:
        return ""
    head = []
    for part in version.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        head.append(int(digits) if digits else 0)
    return "v1" if tuple(head) >= (0, 4) else "classic"


def plugin_id(cls: type, kind: str) -> str:
    """The id :func:`register` gives ``cls``: its module and name, in the form verifiers imports."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    tag = hashlib.sha256(where.encode()).hexdigest()[:8]
    name = "".join(ch if ch.isalnum() else "_" for ch in cls.__qualname__).lower()
    return f"nanogrpo_{kind}_{name}_{tag}"


def register(cls: type, kind: str, partner: type | None = None) -> str:
    """Make ``cls`` (a ``vf.Taskset`` or ``vf.Env`` subclass) a verifiers plugin: a module of its
    :func:`plugin_id` exporting only it (and ``partner``: a taskset's own Env); the id."""
    ident = plugin_id(cls, kind)
    mod = sys.modules.get(ident)
    if mod is None or getattr(mod, cls.__name__, None) is not cls:
        mod = types.ModuleType(ident, f"nanogrpo's registration of {cls.__module__}.{cls.__qualname__}")
        mod.__all__ = []
        for c in (cls, partner) if partner is not None else (cls,):
            setattr(mod, c.__name__, c)
            mod.__all__.append(c.__name__)
        sys.modules[ident] = mod
    return ident


def partner_env(cls: type, v1) -> type | None:
    """The Env a Taskset subclass comes with: its module exports it and exactly one Env subclass through
    ``__all__`` (verifiers' convention for an environment package); None otherwise."""
    mod = sys.modules.get(cls.__module__)
    names = getattr(mod, "__all__", None) or []
    objs = [getattr(mod, n, None) for n in names]
    sets = [o for o in objs if inspect.isclass(o) and issubclass(o, v1.Taskset) and o is not v1.Taskset]
    envs = [o for o in objs if inspect.isclass(o) and issubclass(o, v1.Env) and o is not v1.Env]
    return envs[0] if sets == [cls] and len(envs) == 1 else None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def resolve(rest: str, kwargs: dict) -> tuple[dict | Any, dict]:
    """``(spec, options)`` for ``verifiers:REST``: ``spec`` the raw EnvConfig (a dict) or an ``vf.Env``
    already built (from Python, or a function that returns one); ``options`` nanogrpo's own keys
    (:data:`NANOGRPO_KEYS`)."""
    v1 = vf()
    kw = dict(kwargs)
    options = {k: kw.pop(k) for k in NANOGRPO_KEYS if k in kw}
    if ":" not in rest:
        if not rest:
            raise ConfigError(f"{WHAT}: name a taskset id (an installed environment), e.g. verifiers:my-env")
        return _merge(kw, {"taskset": {"id": rest}}), options
    from nanogrpo.envs.imports import import_attr

    obj = import_attr(rest, WHAT)
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        try:
            obj = obj(**kw)
        except Exception as e:  # noqa: BLE001 - the user's function, in one line, at start
            raise ConfigError(f"env.source 'verifiers:{rest}' raised ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]})") from None
        kw = {}
    return spec_of(obj, kw, f"env.source 'verifiers:{rest}'", v1), options


def spec_of(obj: Any, kw: dict, what: str, v1=None) -> dict | Any:
    """The spec of a verifiers object: an ``Env`` instance as it is; a ``Taskset`` or ``Env`` subclass
    registered (:func:`register`) and named in the config ``kw``; a ``Taskset`` instance by its class and
    its config."""
    v1 = v1 or vf()
    if isinstance(obj, v1.Env):
        if kw:
            raise ConfigError(f"{what}: env.kwargs is for a taskset or env class, not a built Env")
        return obj
    if isinstance(obj, v1.Taskset):
        cfg = obj.config.model_dump(exclude={"id"})
        cls = type(obj)
        return _merge(kw, {"taskset": {**cfg, "id": register(cls, "taskset", partner_env(cls, v1))}})
    if inspect.isclass(obj) and issubclass(obj, v1.Taskset):
        return _merge(kw, {"taskset": {"id": register(obj, "taskset", partner_env(obj, v1))}})
    if inspect.isclass(obj) and issubclass(obj, v1.Env):
        if not (kw.get("taskset") or {}).get("id"):
            raise ConfigError(f"{what}: an Env class needs its seed taskset: env.kwargs.taskset.id")
        return _merge(kw, {"id": register(obj, "env")})
    raise ConfigError(f"{what}: expected a verifiers Taskset or Env (a class, an instance, or a function "
                      f"returning one), got {type(obj).__name__}")


def pin(raw: dict, max_turns: int, max_tokens: int) -> Any:
    """The ``EnvConfig`` of ``raw`` with the local pins (module docstring); a one-line ConfigError when
    verifiers refuses the config."""
    v1 = vf()
    from pydantic import ValidationError
    from verifiers.v1.configs.agent import AgentConfig

    from nanogrpo.envs.adapters.verifiers_v1.harness import register_chat

    register_chat()

    raw = dict(raw)
    taskset_id = (raw.get("taskset") or {}).get("id", "")
    try:
        cls = v1.env_config_type(taskset_id, raw.get("id") or "")
        bundled = v1.default_harness_id(taskset_id) == taskset_id
    except (ImportError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{WHAT}: verifiers cannot load taskset {taskset_id!r} "
                          f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]})") from None
    roles = [n for n, f in cls.model_fields.items() if isinstance(f.default, AgentConfig)]
    for role in roles:
        seat = dict(raw.get(role) or {})
        if "harness" not in seat and not bundled:
            seat["harness"] = {"id": "null"}
        seat.setdefault("runtime", {"type": "subprocess"})
        if max_turns:
            seat.setdefault("max_turns", max_turns)
        if max_tokens:
            seat.setdefault("max_output_tokens", max_tokens)
        raw[role] = seat
    try:
        return v1.resolve_env_config(raw)
    except (ValidationError, ValueError, TypeError, ImportError) as e:
        first = (str(e).splitlines() or [""])
        raise ConfigError(f"{WHAT}: verifiers refuses the env config ({type(e).__name__}: "
                          f"{' '.join(x.strip() for x in first[:3])[:400]})") from None


LOCAL_RUNTIMES = ("subprocess", "docker", "podman", "apptainer")
"""verifiers' runtimes that run a harness's program on this machine (the others: a remote sandbox)."""


def local_harness_seats(spec) -> list[str]:
    """The agent seats of ``spec`` (a raw EnvConfig, or a built Env) whose harness is a program run on
    this machine (a local runtime, a harness other than the in-process ``nanogrpo-chat``)."""
    from verifiers.v1.configs.agent import agent_config_fields

    from nanogrpo.envs.adapters.verifiers_v1.harness import HARNESS_ID

    cfg = pin(spec, 0, 0) if isinstance(spec, dict) else spec.config
    harnesses = cfg.agent_harnesses()
    return [name for name, seat in agent_config_fields(cfg).items()
            if getattr(seat.runtime, "type", "") in LOCAL_RUNTIMES
            and getattr(harnesses.get(name), "id", "") != HARNESS_ID]


def usable_cpus() -> int:
    """The CPU cores this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build(config) -> Any:
    """``vf.load_environment(config)``, failures in one line."""
    v1 = vf()
    try:
        return v1.load_environment(config)
    except Exception as e:  # noqa: BLE001 - verifiers' own error, in one line, at start
        raise ConfigError(f"{WHAT}: verifiers cannot build the env ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:300]})") from None


__all__ = ["NANOGRPO_KEYS", "build", "installed", "local_harness_seats", "pin", "plugin_id", "register",
           "resolve", "spec_of", "usable_cpus", "vf"]
