"""Batched rewards: ``fn(completions: list[str], samples: list[dict]) -> list[float]``.

A reward declares itself batched with the decorator or an attribute::

    from nanogrpo.rewards import batched

    @batched                        # the whole rollout batch in one call
    def brevity(completions, samples):
        return [-len(c) / 100 for c in completions]

    @batched(chunk_size=64, timeout_s=120)   # at most 64 rows per call, each call may take 2 min
    def my_scorer(completions, samples): ...

    class Scorer:                   # or an attribute, e.g. on a callable object
        batched = True
        def __call__(self, completions, samples): ...

The runner calls it once per rollout batch, or once per chunk of ``chunk_size`` rows
(``rewards.chunk_size`` when the function names none; 0 = the whole batch), with the same failure
rules as a per-completion reward: a call that raises, runs past its timeout
(``rewards.batch_timeout_s`` unless it names its own) or returns something that is not a list of one
number per row gives ``rewards.penalty`` to every row of the chunk; a NaN or inf gives it to its own
row. The decorator returns the function itself (marked), so it still pickles by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

__all__ = ["batched", "is_batched", "declared_chunk_size", "declared_timeout_s"]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def batched(fn: F) -> F: ...
@overload
def batched(*, chunk_size: int | None = None, timeout_s: float | None = None) -> Callable[[F], F]: ...


def batched(fn: Any = None, *, chunk_size: int | None = None, timeout_s: float | None = None) -> Any:
    """Mark ``fn`` as a batched reward (see the module docstring); usable bare or with arguments."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 0):
        raise ValueError(f"batched(chunk_size={chunk_size!r}): a whole number >= 0 (0: the whole batch)")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"batched(timeout_s={timeout_s!r}): must be > 0")

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@batched decorates a function, got {type(f).__name__}")
        f.batched = True  # type: ignore[attr-defined]
        f.chunk_size = chunk_size  # type: ignore[attr-defined]
        f.timeout_s = timeout_s  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def is_batched(fn: Any) -> bool:
    """Whether ``fn`` declared itself batched (``fn.batched is True``)."""
    return getattr(fn, "batched", False) is True


def declared_chunk_size(fn: Any) -> int | None:
    """The rows per call ``fn`` asks for (None: the config's ``rewards.chunk_size``)."""
    value = getattr(fn, "chunk_size", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def declared_timeout_s(fn: Any) -> float | None:
    """The per-call timeout ``fn`` asks for (None: the config's)."""
    value = getattr(fn, "timeout_s", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
        else None
