"""What a run's reward list holds, and where each entry runs.

An entry of ``rewards.functions`` (or of the list handed to :class:`~nanogrpo.rewards.RewardRunner`)
is one of:

- a **name**: a built-in (``correctness``), ``module:function`` or ``path/to/file.py:function``
  (:mod:`nanogrpo.rewards.resolve`); worker processes resolve it by name again;
- a **Python callable** (a function, a lambda, a closure, a ``functools.partial``, an object with
  ``__call__``): sent to the worker processes pickled (by name when its module imports there, else
  by value with cloudpickle), or, when it cannot be pickled, run in this process with the same
  timeout and penalty (a call past its timeout is abandoned on its thread, not killed). One line
  at start says which;
- a **model reward**: ``rm:PATH_OR_HUB_ID`` (:mod:`nanogrpo.rewards.reward_model`) or ``judge:URL``
  (:mod:`nanogrpo.rewards.judges.judge`), or an object of those classes; it runs in this process
  (a reward model on its device, a judge's requests on its own event loop) over the whole batch.

Any function may be batched (:mod:`nanogrpo.rewards.batching`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from nanogrpo.errors import RewardError
from nanogrpo.rewards.batching import declared_chunk_size, declared_timeout_s, is_batched
from nanogrpo.rewards.builtin import BUILTIN
from nanogrpo.rewards.calls import Outcome, one_line
from nanogrpo.rewards.resolve import resolve

__all__ = ["Entry", "ModelReward", "POOL", "INLINE", "MODEL", "build_entries", "MAX_PICKLE_BYTES"]

log = logging.getLogger("nanogrpo.rewards")

POOL, INLINE, MODEL = "pool", "inline", "model"
"""Where an entry runs: the worker processes; this process (a thread with a deadline, or a plain call
when ``workers == 0``); a model reward's own :meth:`ModelReward.score`."""

MAX_PICKLE_BYTES = 64 * 2**20
"""A callable that pickles to more than this (it holds a model, a big table) runs in this process
rather than being copied into every worker."""

MODEL_PREFIXES = ("rm:", "judge:")


@runtime_checkable
class ModelReward(Protocol):
    """A reward scored by a model in this process over a whole batch (a reward model, an LLM judge)."""

    name: str

    def start(self) -> None:
        """Load / connect ahead of the first batch (optional: :meth:`score` does it when needed)."""

    def score(self, completions: list[str], samples: list[dict]) -> list[Outcome]:
        """One outcome per row; never raises for a fault of the model or the server."""

    def metrics(self) -> dict[str, float]:
        """Figures since the previous call (``judge/latency_s``, ``rm/rows_per_s``, ...), then reset."""

    def close(self) -> None:
        """Release the model / connections. Idempotent."""


@dataclass
class Entry:
    """One reward of the run."""

    name: str
    """Its key in the reward breakdown and the metrics (``reward/<name>``)."""
    where: str
    """:data:`POOL`, :data:`INLINE` or :data:`MODEL`."""
    fn: Callable[..., Any] | None = None
    """The function (None for a model reward)."""
    model: ModelReward | None = None
    source: str | bytes | None = None
    """What a worker process loads: the spec (resolved by name) or the pickled callable."""
    batched: bool = False
    chunk_size: int = 0
    """Rows per call of a batched function; 0: the whole batch."""
    timeout_s: float = 5.0
    """Deadline of one call (per completion, or per chunk for a batched function)."""


def _callable_name(fn: Any) -> str:
    base = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(base, "__name__", None) or type(base).__name__
    return "lambda" if name == "<lambda>" else name


def _check_signature(name: str, fn: Any, batched: bool) -> None:
    """A function that cannot take two positional arguments fails at start, not on every call."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have none: called as they are
    try:
        sig.bind(None, None)
    except TypeError:
        shape = "fn(completions: list[str], samples: list[dict]) -> list[float]" if batched \
            else "fn(completion: str, sample: dict) -> float"
        raise RewardError(f"reward {name!r}: its signature {sig} does not take two arguments; a reward is "
                          f"{shape}") from None


def _importable(module_name: str) -> bool:
    """Whether a fresh process finds ``module_name``'s top-level package by importing it (what is already
    in ``sys.modules`` does not count: a file loaded by path is there but imports nowhere else)."""
    top = module_name.partition(".")[0]
    if top in sys.builtin_module_names:
        return True
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            if find is not None and find(top, None) is not None:
                return True
        except (ImportError, ValueError, AttributeError, TypeError):
            continue
    return False


def pickled(fn: Any) -> tuple[bytes | None, str]:
    """``(payload, how)``: ``fn`` pickled for a worker process, or ``(None, why not)``.

    What plain pickle sends by name (a function of a module the worker can import, an object of such
    a class) goes that way; lambdas, closures, functions of ``__main__`` and of modules the import
    system cannot find (a file loaded by path) go by value through cloudpickle."""
    import cloudpickle

    module_name = getattr(getattr(fn, "func", fn), "__module__", None)
    module = sys.modules.get(module_name) if module_name else None
    findable = module_name == "__main__" or module is None or _importable(module_name)
    data, how = None, "pickled by name"
    try:
        if findable:
            try:
                data = pickle.dumps(fn)
            except Exception:  # noqa: BLE001 - not picklable by name: try by value below
                data = None
        if data is None:
            how = "pickled by value"
            if not findable:
                cloudpickle.register_pickle_by_value(module)
            try:
                data = cloudpickle.dumps(fn)
            finally:
                if not findable:
                    cloudpickle.unregister_pickle_by_value(module)
    except Exception as e:  # noqa: BLE001 - whatever pickling a user object raises, we fall back
        return None, f"it cannot be pickled ({one_line(e)})"
    if len(data) > MAX_PICKLE_BYTES:
        return None, f"it pickles to {len(data) / 2**20:.0f} MiB (over {MAX_PICKLE_BYTES // 2**20} MiB)"
    return data, how


def build_entries(items: Sequence[Any], *, workers: int, timeout_s: float, batch_timeout_s: float,
                  chunk_size: int, truncated_correct: bool = True, truncated_last_number: bool = False,
                  overlong_settings: tuple[int | None, float] = (None, 1.0),
                  make_model: Callable[[str], ModelReward] | None = None) -> list[Entry]:
    """Resolve every item (a bad one raises :class:`RewardError`), name it and decide where it runs;
    logs one line per callable saying where it runs."""
    entries: list[Entry] = []
    notices: list[tuple[Entry, str, int]] = []
    auto: list[bool] = []  # whether each entry's name was taken from a callable (it may change)
    seen_specs: set[str] = set()
    seen_objects: list[Any] = []
    for item in items:
        if isinstance(item, str):
            spec = item.strip()
            if spec in seen_specs:
                raise RewardError(f"reward {spec!r} is listed more than once; list each reward once")
            seen_specs.add(spec)
            if spec.startswith(MODEL_PREFIXES):
                if make_model is None:
                    raise RewardError(f"reward {spec!r}: model rewards need the run's config "
                                      "(build the runner with RewardRunner.from_config)")
                entries.append(Entry(spec, MODEL, model=make_model(spec)))
                auto.append(False)
                continue
            fn = resolve(spec, truncated_correct, overlong_settings,
                         truncated_last_number=truncated_last_number)
            entries.append(_function_entry(spec, fn, spec if workers else None, workers, timeout_s,
                                           batch_timeout_s, chunk_size))
            auto.append(False)
            continue
        if any(item is o for o in seen_objects):
            raise RewardError(f"reward {_callable_name(item)!r} is listed more than once; "
                              "list each reward once")
        seen_objects.append(item)
        if isinstance(item, ModelReward):
            entries.append(Entry(item.name, MODEL, model=item))
            auto.append(True)
            continue
        if not callable(item):
            raise RewardError(f"reward entry {item!r} is a {type(item).__name__}: give a name "
                              "('correctness', 'module:function', 'rm:PATH', 'judge:URL') or a function")
        name = _callable_name(item)
        builtin = next((k for k, v in BUILTIN.items() if v is item), None)
        fn = resolve(builtin, truncated_correct, overlong_settings,
                     truncated_last_number=truncated_last_number) if builtin else item  # settings apply
        entry = _function_entry(builtin or name, fn, None, workers, timeout_s, batch_timeout_s, chunk_size)
        if workers and builtin:
            entry.source = builtin
        elif workers:
            payload, how = pickled(item)
            entry.source = payload
            if payload is None:
                entry.where = INLINE
                notices.append((entry, f"runs in this process: {how}; a call past its timeout is abandoned "
                                       "on its thread (never killed) and scored the penalty",
                                logging.WARNING))
            else:
                notices.append((entry, f"runs in the reward worker processes ({how})", logging.INFO))
        else:
            notices.append((entry, "runs in this process (rewards.workers=0: no timeout)", logging.INFO))
        entries.append(entry)
        auto.append(builtin is None)
    _unique_names(entries, auto)
    for entry, text, level in notices:  # WARNING: no isolation the run asked for; else information
        log.log(level, "reward %r (a callable) %s", entry.name, text)
    if not entries:
        raise RewardError("no reward functions given: name at least one")
    return entries


def _function_entry(name: str, fn: Any, source: str | None, workers: int, timeout_s: float,
                    batch_timeout_s: float, chunk_size: int) -> Entry:
    batched = is_batched(fn)
    _check_signature(name, fn, batched)
    chunk = declared_chunk_size(fn)
    own_timeout = declared_timeout_s(fn)
    return Entry(name, POOL if workers else INLINE, fn=fn, source=source, batched=batched,
                 chunk_size=(chunk if chunk is not None else chunk_size) if batched else 1,
                 timeout_s=own_timeout or (batch_timeout_s if batched else timeout_s))


def _unique_names(entries: list[Entry], auto: list[bool]) -> None:
    """Names taken from a callable give way: a second ``lambda`` becomes ``lambda_2``, and a callable
    never takes a name given by the list (a spec) or a built-in's (``correctness`` drives the accuracy
    metric) unless it is that built-in."""
    used = {e.name for e, a in zip(entries, auto) if not a}
    for e, a in zip(entries, auto):
        if not a:
            continue
        base = e.name
        if base in used or base in BUILTIN:
            i = 2
            while f"{base}_{i}" in used:
                i += 1
            e.name = f"{base}_{i}"
        used.add(e.name)
