"""Score a batch of completions with several reward functions, never crashing the run.

:class:`RewardRunner` resolves every reward at construction (a bad spec fails at
start), then :meth:`RewardRunner.score` calls each function on each completion.
A call that raises, hangs past ``timeout_s``, or returns NaN/inf/a non-number is
scored ``penalty``, counted in the :class:`RewardResult`, and logged on the
``nanogrpo.rewards`` logger (the first few per function; a summary at
:meth:`RewardRunner.close`).

With ``workers >= 1`` the calls run in worker processes (:mod:`nanogrpo.rewards.pool`)
and a hang is cut at ``timeout_s``. With ``workers == 0`` they run in this
process with no isolation: a hanging user function hangs the run, and only
math_verify's own signal timeout (main thread only) bounds the built-in
``correctness``.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nanogrpo.errors import RewardError
from nanogrpo.rewards.calls import BAD, ERROR, OK, TIMEOUT, Outcome, call_reward
from nanogrpo.rewards.pool import Call, WorkerPool
from nanogrpo.rewards.registry import resolve_all

__all__ = ["RewardResult", "RewardRunner"]

log = logging.getLogger("nanogrpo.rewards")

_WARN_LIMIT = 3
"""Problems logged per reward function per run; later ones are only counted."""


@dataclass
class RewardResult:
    """Rewards for one batch."""

    total: list[float]
    """Weighted sum over the functions, one per completion."""
    per_function: dict[str, list[float]]
    """Unweighted value of each function (keyed by its spec), penalty where the call failed."""
    failures: int = 0
    """Calls that raised (or whose worker process died)."""
    timeouts: int = 0
    """Calls abandoned at the deadline."""
    non_finite: int = 0
    """Calls that returned NaN, inf or something that is not a number."""


@dataclass
class _Problems:
    by_kind: dict[str, Counter] = field(default_factory=lambda: {ERROR: Counter(), TIMEOUT: Counter(),
                                                                   BAD: Counter()})

    def total(self, spec: str) -> int:
        return sum(c[spec] for c in self.by_kind.values())


class RewardRunner:
    """Runs reward functions over batches; see the module docstring for the failure policy."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] | None = None, timeout_s: float = 5.0,
                 penalty: float = -1.0, workers: int = 1, truncated_correct: bool = True):
        specs = [s.strip() for s in specs]
        if not specs:
            raise RewardError("no reward functions given: name at least one")
        dupes = sorted(s for s, c in Counter(specs).items() if c > 1)
        if dupes:
            raise RewardError(f"reward {dupes[0]!r} is listed more than once; list each reward once")
        if weights is not None and len(weights) != len(specs):
            raise RewardError(f"{len(weights)} reward weights for {len(specs)} reward functions")
        if timeout_s <= 0 or workers < 0:
            raise RewardError(f"reward timeout_s must be > 0 and workers >= 0 (got {timeout_s}, {workers})")
        self.specs = specs
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(specs)
        self.timeout_s = float(timeout_s)
        self.penalty = float(penalty)
        self.workers = workers
        self.truncated_correct = truncated_correct
        self._fns = [fn for _, fn in resolve_all(specs, truncated_correct)]  # fail at start on a bad spec
        self._problems = _Problems()
        self._closed = False
        self._pool: WorkerPool | None = None
        if workers:
            self._pool = WorkerPool(specs, workers, self.timeout_s, truncated_correct=truncated_correct)
            self._finalizer = weakref.finalize(self, self._pool.close)

    @classmethod
    def from_config(cls, cfg: Any) -> RewardRunner:
        """Build from a :class:`nanogrpo.config.RewardsConfig`."""
        return cls(cfg.functions, cfg.resolved_weights(), cfg.timeout_s, cfg.penalty, cfg.workers,
                   cfg.truncated_correct)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RewardRunner:
        """Start the worker processes now (optional: :meth:`score` starts them when first needed)."""
        if self._pool is not None:
            self._pool.start()
        return self

    def close(self) -> None:
        """Stop the workers and log a summary of the run's reward problems, if any. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._finalizer()
        for spec in self.specs:
            if self._problems.total(spec) > _WARN_LIMIT:
                c = self._problems.by_kind
                log.warning("reward %r over the run: %d raised, %d timed out, %d non-finite (scored %g each)",
                            spec, c[ERROR][spec], c[TIMEOUT][spec], c[BAD][spec], self.penalty)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ scoring

    def score(self, completions: Sequence[str], samples: Sequence[dict]) -> RewardResult:
        """Score ``completions[i]`` against ``samples[i]`` (its sample dict: the dataset row, plus
        ``finish_reason`` when the rollout sets it) with every function."""
        if self._closed:
            raise RuntimeError("RewardRunner.score called after close()")
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        nf = len(self._fns)
        pairs = enumerate(zip(completions, samples, strict=True))
        calls: list[Call] = [(i * nf + k, k, c, s) for i, (c, s) in pairs for k in range(nf)]
        if self._pool is not None:
            outcomes = self._pool.run(calls)
        else:
            outcomes = {cid: call_reward(self._fns[k], c, s) for cid, k, c, s in calls}
        return self._collect(outcomes, len(completions))

    def score_one(self, completion: str, sample: dict) -> float:
        """Weighted total reward of a single completion."""
        return self.score([completion], [sample]).total[0]

    def _collect(self, outcomes: dict[int, Outcome], n: int) -> RewardResult:
        nf = len(self._fns)
        per = {spec: [0.0] * n for spec in self.specs}
        counts: Counter = Counter()
        for i in range(n):
            for k, spec in enumerate(self.specs):
                kind, value = outcomes[i * nf + k]
                if kind != OK:
                    counts[kind] += 1
                    self._report(spec, i, kind, value)
                    value = self.penalty
                per[spec][i] = value
        total = [sum(w * per[s][i] for s, w in zip(self.specs, self.weights, strict=True)) for i in range(n)]
        return RewardResult(total, per, counts[ERROR], counts[TIMEOUT], counts[BAD])

    def _report(self, spec: str, item: int, kind: str, reason: str) -> None:
        self._problems.by_kind[kind][spec] += 1
        seen = self._problems.total(spec)
        if seen > _WARN_LIMIT:
            return
        what = {ERROR: "raised", TIMEOUT: "timed out", BAD: "gave a non-finite value"}[kind]
        more = "; further problems with this reward are counted, not logged" if seen == _WARN_LIMIT else ""
        log.warning("reward %r %s on batch item %d (%s): scored %g%s",
                    spec, what, item, reason, self.penalty, more)
