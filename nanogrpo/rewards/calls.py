"""One guarded reward call, shared by the in-process paths and the worker processes.

A per-completion reward is called as ``fn(completion, sample)`` and gives one :data:`Outcome`.
A batched reward (:func:`nanogrpo.rewards.batching.batched`) is called as ``fn(completions,
samples)`` over a chunk of rows and gives either one outcome for the whole chunk (it raised, or
returned something that is not a list of the chunk's length) or a list with one outcome per row
(each value checked on its own: a NaN in row 3 costs row 3 only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["OK", "ERROR", "BAD", "TIMEOUT", "Outcome", "call_reward", "call_batch", "check_value", "one_line"]

OK, ERROR, BAD, TIMEOUT = "ok", "error", "bad", "timeout"
"""Outcome kinds: a finite float; raised (or killed its worker); returned NaN/inf/non-number (or, for
a model's reply, no readable score); timed out."""

Outcome = tuple[str, Any]
"""``(kind, value)``: the float for ``OK``, else a one-line reason."""


def one_line(e: BaseException) -> str:
    """``"TypeName: first line of message"``, at most 200 characters."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text[:200]


def check_value(value: Any) -> Outcome:
    """``(OK, float)`` for a finite real number, else ``(BAD, reason)``."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return BAD, f"returned {type(value).__name__} {str(value)[:50]!r}, not a number"
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError) as e:
        return BAD, f"returned {type(value).__name__} that float() rejects ({one_line(e)})"
    if not math.isfinite(number):
        return BAD, f"returned {number}"
    return OK, number


def call_reward(fn: Callable[[str, dict], Any], completion: str, sample: dict) -> Outcome:
    """Call ``fn(completion, sample)``; never raises for an ordinary exception in ``fn``."""
    try:
        value = fn(completion, sample)
    except Exception as e:  # a user reward may raise anything; it is scored, counted and logged
        return ERROR, one_line(e)
    return check_value(value)


def call_batch(fn: Callable[[list[str], list[dict]], Any], completions: Sequence[str],
               samples: Sequence[dict]) -> Outcome | list[Outcome]:
    """Call ``fn(completions, samples)`` once; one outcome for the whole chunk when it raised or its
    result is not a sequence of ``len(completions)`` values, else one outcome per row."""
    try:
        values = fn(list(completions), list(samples))
    except Exception as e:  # as call_reward: a user reward may raise anything
        return ERROR, one_line(e)
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
        values = values.tolist()  # a numpy array or torch tensor of scores
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
        return BAD, f"returned {type(values).__name__}, not a list of {len(completions)} numbers"
    if len(values) != len(completions):
        return BAD, f"returned {len(values)} values for {len(completions)} completions"
    return [check_value(v) for v in values]
