"""One guarded reward call, shared by the in-process path and the worker processes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["OK", "ERROR", "BAD", "TIMEOUT", "Outcome", "call_reward", "one_line"]

OK, ERROR, BAD, TIMEOUT = "ok", "error", "bad", "timeout"
"""Outcome kinds: a finite float; raised (or killed its worker); returned NaN/inf/non-number; timed out."""

Outcome = tuple[str, Any]
"""``(kind, value)``: the float for ``OK``, else a one-line reason."""


def one_line(e: BaseException) -> str:
    """``"TypeName: first line of message"``, at most 200 characters."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text[:200]


def call_reward(fn: Callable[[str, dict], Any], completion: str, sample: dict) -> Outcome:
    """Call ``fn(completion, sample)``; never raises for an ordinary exception in ``fn``."""
    try:
        value = fn(completion, sample)
    except Exception as e:  # a user reward may raise anything; it is scored, counted and logged
        return ERROR, one_line(e)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return BAD, f"returned {type(value).__name__} {str(value)[:50]!r}, not a number"
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError) as e:
        return BAD, f"returned {type(value).__name__} that float() rejects ({one_line(e)})"
    if not math.isfinite(number):
        return BAD, f"returned {number}"
    return OK, number
