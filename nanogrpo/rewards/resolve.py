"""Resolve reward specs: a built-in name, ``module:function`` or ``path/to/file.py:function``.

Every failure raises :class:`~nanogrpo.errors.RewardError` with one line naming
the spec and the reason, so a typo in a config fails at start, not mid-run.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from nanogrpo.errors import RewardError
from nanogrpo.rewards.builtin import BUILTIN, correctness, overlong

__all__ = ["RewardFn", "resolve", "resolve_all"]

RewardFn = Callable[[str, dict], float]


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _is_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or "\\" in module


def _load_file(spec: str, module: str) -> ModuleType:
    path = Path(module).expanduser().resolve()
    if not path.is_file():
        raise RewardError(f"reward {spec!r}: file not found: {path}")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_nanogrpo_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    file_spec = importlib.util.spec_from_file_location(name, path)
    if file_spec is None or file_spec.loader is None:
        raise RewardError(f"reward {spec!r}: cannot load {path} as a Python module")
    mod = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = mod  # before exec, so dataclasses/pickle inside the file can find it
    try:
        file_spec.loader.exec_module(mod)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise RewardError(f"reward {spec!r}: cannot import file {str(path)!r} ({_one_line(e)})") from None
    return mod


def _load_module(spec: str, module: str) -> ModuleType:
    if _is_path(module):
        return _load_file(spec, module)
    try:
        return importlib.import_module(module)
    except (Exception, SystemExit) as e:
        from nanogrpo.envs.imports import file_hint  # "module:attr" specs' shared hint

        raise RewardError(f"reward {spec!r}: cannot import module {module!r} ({_one_line(e)})"
                          f"{file_hint(spec, module, e)}") from None


def resolve(name: str, truncated_correct: bool = True,
            overlong_settings: tuple[int | None, float] = (None, 1.0), *,
            truncated_last_number: bool = False) -> RewardFn:
    """The reward function named by ``name``: a built-in, ``module:function`` or ``file.py:function``.

    ``truncated_correct=False`` (config ``rewards.truncated_correct``) or ``truncated_last_number=True``
    (``rewards.truncated_last_number``) gives the built-in ``correctness`` with that setting bound
    (``functools.partial``): still a plain function of ``(completion, sample)``, and the same in every
    worker process, which resolves by name too.
    ``overlong_settings``: (buffer, penalty) bound into the built-in ``overlong`` likewise
    (``rewards.overlong_buffer``, ``rewards.overlong_penalty``).
    """
    name = name.strip()
    if ":" not in name:
        if name in BUILTIN:
            fn = BUILTIN[name]
            if fn is correctness and (not truncated_correct or truncated_last_number):
                return functools.partial(correctness, truncated_correct=truncated_correct,
                                         truncated_last_number=truncated_last_number)
            if fn is overlong and tuple(overlong_settings) != (None, 1.0):
                return functools.partial(overlong, buffer=overlong_settings[0], penalty=overlong_settings[1])
            return fn
        raise RewardError(
            f"reward {name!r}: unknown built-in reward (built-ins: {', '.join(sorted(BUILTIN))}; "
            "or name your own as 'module:function' or 'path/to/file.py:function')"
        )
    module, _, attr = name.rpartition(":")
    if not module or not attr:
        raise RewardError(f"reward {name!r}: expected 'module:function' with both parts non-empty")
    mod = _load_module(name, module)
    if not hasattr(mod, attr):
        defined = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_"))
        hint = f" (callables there: {', '.join(defined[:10])})" if defined else ""
        raise RewardError(f"reward {name!r}: module {module!r} has no attribute {attr!r}{hint}")
    fn = getattr(mod, attr)
    if not callable(fn):
        raise RewardError(
            f"reward {name!r}: {attr!r} is a {type(fn).__name__}, not a function "
            "fn(completion: str, sample: dict) -> float"
        )
    return fn


def resolve_all(names: Sequence[str], truncated_correct: bool = True) -> list[tuple[str, RewardFn]]:
    """``[(spec, function), ...]`` for each spec, in order; the first bad spec raises RewardError."""
    return [(n, resolve(n, truncated_correct)) for n in names]
