"""What the rules read: a run's metric rows so far, kept as one series per key.

Each rule is a pure function of a :class:`History` (and its settings), so the same function judges a
run while it trains (:class:`~nanogrpo.watch.monitor.Monitor`) and afterwards from its
``metrics.jsonl`` (:func:`~nanogrpo.watch.monitor.replay`): the same rows give the same findings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


@dataclass
class History:
    """The rows of a run, step by step. ``weights``: each reward function's weight by its name (the
    ``reward/<name>`` metrics), for the rules that split the reward into its components."""

    weights: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Key -> [(step, value)] of the rows where it was a finite number, in step order."""
    steps: int = 0
    """Training steps seen (rows with a ``reward_mean``; a step-0 row holds the held-out baseline only)."""
    last_step: int = 0

    def add(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", self.last_step + 1))
        self.last_step = step
        if _number(row.get("reward_mean")) is not None:
            self.steps += 1
        for k, v in row.items():
            x = _number(v)
            if x is not None and k != "step" and not k.startswith("watch/"):
                self.series.setdefault(k, []).append((step, x))

    def points(self, key: str) -> list[tuple[int, float]]:
        """[(step, value)] of ``key`` so far."""
        return self.series.get(key, [])

    def values(self, key: str) -> list[float]:
        return [v for _, v in self.series.get(key, [])]

    def first(self, key: str, n: int) -> list[float]:
        """The first ``n`` values of ``key`` (fewer when it has fewer)."""
        return [v for _, v in self.series.get(key, [])[:n]]

    def last(self, key: str, n: int) -> list[float]:
        """The last ``n`` values of ``key`` (fewer when it has fewer): O(n), whatever the run's length."""
        return [v for _, v in self.series.get(key, [])[-n:]]

    def count(self, key: str) -> int:
        return len(self.series.get(key, []))

    def components(self) -> list[str]:
        """The reward functions with a mean logged (``reward/<name>``; not ``reward/<name>/failures``)."""
        return [k[len("reward/"):] for k in self.series if k.startswith("reward/") and k.count("/") == 1]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if not n:
        return math.nan
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def streak_start(points: list[tuple[int, float]], holds) -> int:
    """The first step of the trailing run of points whose value ``holds(value)``; the last point's step
    when none does (the window's mean tipped over before any single step did)."""
    since = points[-1][0]
    for step, v in reversed(points):
        if not holds(v):
            break
        since = step
    return since
