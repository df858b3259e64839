"""``"module:attr"`` / ``"path/to/file.py:attr"`` to the object it names, with one-line errors (what
``env.source`` and the adapters' sources use); :func:`file_hint`, what to write instead when such a module
is not importable (reward specs' errors too, :mod:`nanogrpo.rewards.resolve`)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from nanogrpo.errors import ConfigError


def import_attr(spec: str, what: str = "env.source", expected: str = "'module:attr' or 'path/to/file.py:attr'"
                ) -> Any:
    module, _, attr = spec.rpartition(":")
    if not module or not attr:
        raise ConfigError(f"{what} {spec!r}: expected {expected}")
    try:
        if module.endswith(".py") or "/" in module:
            path = Path(module).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"{what} {spec!r}: file not found: {path}")
            name = f"_nanogrpo_env_{path.stem}_{abs(hash(str(path))) % 10**8}"
            file_spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except ConfigError:
        raise
    except (Exception, SystemExit) as e:
        first = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"{what} {spec!r}: cannot import {module!r} "
                          f"({type(e).__name__}: {first}){file_hint(spec, module, e)}") from None
    if not hasattr(mod, attr):
        raise ConfigError(f"{what} {spec!r}: {module!r} has no attribute {attr!r}")
    return getattr(mod, attr)


def file_hint(spec: str, module: str, e: BaseException) -> str:
    """What to write instead when ``module`` (of ``module:function``) is not importable at all: the file
    form, ``module.py:function`` (``nanogrpo`` run as a command does not look in the current directory
    for modules); empty when the module exists but failed inside."""
    if not isinstance(e, ModuleNotFoundError) or e.name not in (module, module.split(".")[0]):
        return ""
    attr = spec.rpartition(":")[2]
    path = Path(*module.split(".")).with_suffix(".py")
    if path.is_file():
        return f"; the file {path} is here: name it as {f'{path}:{attr}'!r}"
    return (f"; name a file as {f'path/to/{path.name}:{attr}'!r}, or make {module!r} importable "
            "(pip install it, or add its folder to PYTHONPATH)")
