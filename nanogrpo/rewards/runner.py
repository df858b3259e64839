"""Score a batch of completions with several rewards, never crashing the run.

:class:`RewardRunner` takes a list of rewards (names, Python callables, model rewards: see
:mod:`nanogrpo.rewards.entries`), resolves every one at construction (a bad one fails at start),
then :meth:`RewardRunner.score` scores a batch with each:

- a per-completion function is called once per completion, ``fn(completion, sample)``;
- a batched function (:mod:`nanogrpo.rewards.batching`) once per batch, or per chunk of
  ``chunk_size`` rows, ``fn(completions, samples)``;
- a model reward (``rm:``, ``judge:``) once per batch, in this process.

A call that raises, hangs past its timeout, or returns NaN/inf/a non-number (a batched one: a result
that is not one number per row) is scored ``penalty`` on the rows it covers, counted in the
:class:`RewardResult`, and logged on the ``nanogrpo.rewards`` logger (the first few per function; a
summary at :meth:`RewardRunner.close`). So is a judge's reply without a readable score.

With ``workers >= 1`` functions run in worker processes (:mod:`nanogrpo.rewards.pool`) and a hang is
cut at its timeout; a callable that cannot be pickled runs in this process on a thread with the same
deadline (:mod:`nanogrpo.rewards.inline`). With ``workers == 0`` every function runs in this
process, called directly: no isolation, and a hanging function hangs the run (only math_verify's own
signal timeout, main thread only, bounds the built-in ``correctness``).

:func:`reward_runner` builds a run's runner from its config: what every command (train, eval, serve's
workers, ``nanogrpo bench step``) calls.
"""

from __future__ import annotations

import logging
import math
import statistics
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanogrpo.errors import RewardError
from nanogrpo.rewards.calls import BAD, ERROR, OK, TIMEOUT, Outcome, call_batch, call_reward
from nanogrpo.rewards.entries import INLINE, MODEL, POOL, Entry, ModelReward, build_entries
from nanogrpo.rewards.inline import run_inline
from nanogrpo.rewards.pool import Call, WorkerPool

__all__ = ["RewardResult", "RewardRunner", "RewardItem", "reward_runner"]

log = logging.getLogger("nanogrpo.rewards")

RewardItem = str | Callable[..., Any] | ModelReward
"""One entry of a reward list: a name/spec, a Python callable, or a model reward object."""

_WARN_LIMIT = 3
"""Problems logged per reward function per run; later ones are only counted."""

SCALES = ("none", "zscore")
"""``rewards.rm_scale``: what a reward model's scores go through before the weights apply."""


@dataclass
class RewardResult:
    """Rewards for one batch."""

    total: list[float]
    """Weighted sum over the functions, one per completion."""
    per_function: dict[str, list[float]]
    """Each function's value (keyed by its name) as it enters the weighted sum: unweighted, after a
    reward model's scaling (``rm_scale``), ``penalty`` where the call failed."""
    failures: int = 0
    """Rows scored the penalty because their call raised (or its worker process died, or a judge's
    request failed)."""
    timeouts: int = 0
    """Rows whose call was abandoned at its deadline."""
    non_finite: int = 0
    """Rows whose value was NaN, inf or not a number (a judge's reply without a readable score too)."""
    failures_by_function: dict[str, int] = field(default_factory=dict)
    """Rows scored the penalty, per function (any of the three reasons)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Model rewards' figures for this batch (``judge/latency_s``, ``rm/rows_per_s``, ...)."""


@dataclass
class _Problems:
    by_kind: dict[str, Counter] = field(default_factory=lambda: {ERROR: Counter(), TIMEOUT: Counter(),
                                                                   BAD: Counter()})

    def total(self, name: str) -> int:
        return sum(c[name] for c in self.by_kind.values())


Task = tuple[int, int, list[int]]
"""``(task id, entry index, rows it covers)``."""


class RewardRunner:
    """Runs rewards over batches; see the module docstring for the failure policy.

    ``rewards``: names (``"correctness"``, ``"module:function"``, ``"rm:PATH"``, ``"judge:URL"``),
    Python callables (per-completion or batched) or model reward objects, in any mix; ``weights``
    one per reward (None: all 1.0). Names in the breakdown: a spec is its own name, a callable its
    ``__name__`` (``lambda``; a second of the same name gets ``_2``). ``make_model`` builds the
    model reward a ``rm:`` / ``judge:`` spec names (default: with the ``rewards`` config's defaults;
    :meth:`from_config` supplies one with the run's settings)."""

    def __init__(self, rewards: Sequence[RewardItem], weights: Sequence[float] | None = None,
                 timeout_s: float = 5.0, penalty: float = -1.0, workers: int = 1,
                 truncated_correct: bool = True, *, chunk_size: int = 0, batch_timeout_s: float = 60.0,
                 rm_scale: str = "none", make_model: Callable[[str], ModelReward] | None = None,
                 overlong_settings: tuple[int | None, float] = (None, 1.0),
                 truncated_last_number: bool = False):
        if isinstance(rewards, (str, bytes)) or not isinstance(rewards, Sequence):
            raise RewardError(f"rewards must be a list of names or functions, got {type(rewards).__name__}")
        if not rewards:
            raise RewardError("no reward functions given: name at least one")
        if weights is not None and len(weights) != len(rewards):
            raise RewardError(f"{len(weights)} reward weights for {len(rewards)} reward functions")
        if timeout_s <= 0 or batch_timeout_s <= 0 or workers < 0 or chunk_size < 0:
            raise RewardError(f"reward timeouts must be > 0, workers and chunk_size >= 0 (got timeout_s="
                              f"{timeout_s}, batch_timeout_s={batch_timeout_s}, workers={workers}, "
                              f"chunk_size={chunk_size})")
        if rm_scale not in SCALES:
            raise RewardError(f"rm_scale {rm_scale!r}: one of {', '.join(SCALES)}")
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(rewards)
        self.timeout_s = float(timeout_s)
        self.penalty = float(penalty)
        self.workers = workers
        self.truncated_correct = truncated_correct
        self.truncated_last_number = truncated_last_number
        self.rm_scale = rm_scale
        self._closed = False
        self._pool: WorkerPool | None = None
        if make_model is None:  # rm: / judge: specs with the config's defaults
            from nanogrpo.config import RewardsConfig

            make_model = _model_factory(RewardsConfig(), None, None)
        self.entries: list[Entry] = build_entries(
            rewards, workers=workers, timeout_s=self.timeout_s, batch_timeout_s=float(batch_timeout_s),
            chunk_size=chunk_size, truncated_correct=truncated_correct, make_model=make_model,
            overlong_settings=overlong_settings, truncated_last_number=truncated_last_number)
        self.specs = [e.name for e in self.entries]
        """Each reward's name, in order (the keys of :attr:`RewardResult.per_function`)."""
        self._problems = _Problems()
        self._logged: Counter = Counter()
        self.abandoned_threads = 0
        in_pool = [e for e in self.entries if e.where == POOL]
        self._pool_index = {id(e): k for k, e in enumerate(in_pool)}
        if in_pool:
            self._pool = WorkerPool([e.source for e in in_pool], workers, [e.timeout_s for e in in_pool],
                                    truncated_correct=truncated_correct, batched=[e.batched for e in in_pool],
                                    overlong_settings=overlong_settings,
                                    truncated_last_number=truncated_last_number)
        models = [e.model for e in self.entries if e.model is not None]
        self._finalizer = weakref.finalize(self, _shut_down, self._pool, models)

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    @classmethod
    def from_config(cls, cfg: Any, rewards: Sequence[RewardItem] | None = None, *, run_dir: Any = None,
                    make_rm: Callable[[str, str], ModelReward] | None = None) -> RewardRunner:
        """Build from a :class:`nanogrpo.config.RewardsConfig`; ``rewards`` (names, callables, model
        rewards) replaces ``cfg.functions`` when given, with ``cfg.weights`` still one per entry.
        ``run_dir``: the run directory (a judge's persistent cache lives there); ``make_rm``: builds the
        reward model of an ``rm:`` spec on the run's device (:func:`reward_runner` passes
        :func:`nanogrpo.rewards.reward_model.model_rewards`)."""
        items = list(rewards) if rewards is not None else list(cfg.functions)
        weights = cfg.weights
        if weights is not None and len(weights) != len(items):
            raise RewardError(f"rewards.weights has {len(weights)} entries for {len(items)} rewards")
        return cls(items, weights, cfg.timeout_s, cfg.penalty, cfg.workers, cfg.truncated_correct,
                   chunk_size=cfg.chunk_size, batch_timeout_s=cfg.batch_timeout_s,
                   rm_scale=cfg.rm_scale, make_model=_model_factory(cfg, run_dir, make_rm),
                   overlong_settings=(getattr(cfg, "overlong_buffer", None),
                                      getattr(cfg, "overlong_penalty", 1.0)),
                   truncated_last_number=getattr(cfg, "truncated_last_number", False))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RewardRunner:
        """Start the worker processes and load model rewards now (optional: :meth:`score` does it)."""
        if self._pool is not None:
            self._pool.start()
        for e in self.entries:
            if e.model is not None:
                e.model.start()
        return self

    def close(self) -> None:
        """Stop the workers, release model rewards, and log a summary of the run's reward problems, if
        any. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        for name in self.specs:
            if self._problems.total(name) > _WARN_LIMIT:
                c = self._problems.by_kind
                log.warning("reward %r over the run: %d raised, %d timed out, %d non-finite (scored %g each)",
                            name, c[ERROR][name], c[TIMEOUT][name], c[BAD][name], self.penalty)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ scoring

    def score(self, completions: Sequence[str], samples: Sequence[dict]) -> RewardResult:
        """Score ``completions[i]`` against ``samples[i]`` (its sample dict: the dataset row, plus
        ``finish_reason`` when the rollout sets it) with every reward."""
        if self._closed:
            raise RuntimeError("RewardRunner.score called after close()")
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        completions, samples = list(completions), list(samples)
        tasks = self._plan(len(completions))
        results: dict[int, Any] = {}
        waits = {tid: self.entries[k].model.submit(completions, samples) for tid, k, _ in tasks
                 if self.entries[k].where == MODEL and hasattr(self.entries[k].model, "submit")}
        pool_calls: list[Call] = []
        inline: list[Task] = []
        for task in tasks:
            tid, k, rows = task
            e = self.entries[k]
            if e.where == POOL:
                what = ([completions[r] for r in rows], [samples[r] for r in rows]) if e.batched \
                    else (completions[rows[0]], samples[rows[0]])
                pool_calls.append((tid, self._pool_index[id(e)], *what))
            elif e.where == INLINE:
                inline.append(task)
        if pool_calls:
            results.update(self._pool.run(pool_calls))
        if inline:
            results.update(self._run_inline(inline, completions, samples))
        metrics: dict[str, float] = {}
        for tid, k, _ in tasks:
            e = self.entries[k]
            if e.where == MODEL:  # a judge's requests ran while the functions above did
                results[tid] = waits[tid]() if tid in waits else e.model.score(completions, samples)
                metrics.update(e.model.metrics())
        result = self._collect(tasks, results, len(completions))
        result.metrics = metrics
        return result

    def score_one(self, completion: str, sample: dict) -> float:
        """Weighted total reward of a single completion."""
        return self.score([completion], [sample]).total[0]

    def _plan(self, n: int) -> list[Task]:
        tasks: list[Task] = []
        for k, e in enumerate(self.entries):
            if e.where == MODEL:
                tasks.append((len(tasks), k, list(range(n))))
                continue
            size = (e.chunk_size or n) if e.batched else 1
            for start in range(0, n, max(size, 1)):
                tasks.append((len(tasks), k, list(range(start, min(start + size, n)))))
        return tasks

    def _run_inline(self, tasks: list[Task], completions: list[str], samples: list[dict]) -> dict[int, Any]:
        def thunk(e: Entry, rows: list[int]) -> Callable[[], Any]:
            if e.batched:
                return lambda: call_batch(e.fn, [completions[r] for r in rows], [samples[r] for r in rows])
            return lambda: call_reward(e.fn, completions[rows[0]], samples[rows[0]])

        calls = [(tid, thunk(self.entries[k], rows), self.entries[k].timeout_s) for tid, k, rows in tasks]
        if not self.workers:  # rewards.workers=0: plain calls, no thread, no deadline
            return {tid: fn() for tid, fn, _ in calls}
        results, abandoned = run_inline(calls)
        self.abandoned_threads += abandoned
        return results

    def _collect(self, tasks: list[Task], results: dict[int, Any], n: int) -> RewardResult:
        per = {name: [0.0] * n for name in self.specs}
        ok = {name: [False] * n for name in self.specs}
        counts: Counter = Counter()
        by_fn: Counter = Counter()
        for tid, k, rows in tasks:
            name = self.specs[k]
            res = results[tid]
            outs: list[Outcome] = res if isinstance(res, list) else [res] * len(rows)
            failed: dict[str, list[tuple[int, str]]] = {}
            for r, (kind, value) in zip(rows, outs, strict=True):
                if kind == OK:
                    per[name][r], ok[name][r] = value, True
                else:
                    failed.setdefault(kind, []).append((r, value))
                    per[name][r] = self.penalty
            for kind, bad in failed.items():
                counts[kind] += len(bad)
                by_fn[name] += len(bad)
                self._report(name, kind, bad, whole=not isinstance(res, list) and len(rows) > 1)
        for e in self.entries:
            if e.where == MODEL and self.rm_scale == "zscore" and getattr(e.model, "scalable", False):
                _zscore(per[e.name], ok[e.name])
        total = [sum(w * per[s][i] for s, w in zip(self.specs, self.weights, strict=True)) for i in range(n)]
        return RewardResult(total, per, counts[ERROR], counts[TIMEOUT], counts[BAD],
                            {name: by_fn[name] for name in self.specs})

    def _report(self, name: str, kind: str, bad: list[tuple[int, str]], whole: bool) -> None:
        """Count ``bad`` (rows, reasons) of one call (``whole``: one batched call's failure covering its
        rows) or of a batch's per-completion calls, and log the first few messages per reward."""
        self._problems.by_kind[kind][name] += len(bad)
        what = {ERROR: "raised", TIMEOUT: "timed out", BAD: "gave no finite number"}[kind]
        if whole:
            lines = [(f"on a call over batch items {bad[0][0]}-{bad[-1][0]} ({len(bad)} rows)", bad[0][1])]
        else:
            lines = [(f"on batch item {r}", reason) for r, reason in bad]
        for where, reason in lines:
            self._logged[name] += 1
            if self._logged[name] > _WARN_LIMIT:
                return
            more = "; further problems with this reward are counted, not logged" \
                if self._logged[name] == _WARN_LIMIT else ""
            log.warning("reward %r %s %s (%s): scored %g%s", name, what, where, reason, self.penalty, more)


def _zscore(values: list[float], ok: list[bool]) -> None:
    """In place: the rows scored (``ok``) become ``(v - mean) / std`` over those rows (std 0: 0)."""
    idx = [i for i, good in enumerate(ok) if good]
    if not idx:
        return
    mean = statistics.fmean(values[i] for i in idx)
    std = statistics.pstdev([values[i] for i in idx]) if len(idx) > 1 else 0.0
    for i in idx:
        values[i] = (values[i] - mean) / std if std > 1e-12 and math.isfinite(std) else 0.0


def _shut_down(pool: WorkerPool | None, models: list[ModelReward]) -> None:
    if pool is not None:
        pool.close()
    for m in models:
        m.close()


def _model_factory(cfg: Any, run_dir: Any, make_rm: Callable[[str, str], ModelReward] | None
                   ) -> Callable[[str], ModelReward]:
    """Builds the model reward an ``rm:`` / ``judge:`` spec names, from the rewards config."""
    made: Counter = Counter()

    def make(spec: str) -> ModelReward:
        kind, _, target = spec.partition(":")
        target = target.strip()
        if not target:
            raise RewardError(f"reward {spec!r}: name the {'model' if kind == 'rm' else 'server URL'} after "
                              f"'{kind}:'")
        made[kind] += 1
        prefix = kind if made[kind] == 1 else f"{kind}_{made[kind]}"
        if kind == "rm":
            if make_rm is None:
                raise RewardError(f"reward {spec!r}: reward models load through nanogrpo.models: build the "
                                  "runner with nanogrpo.rewards.reward_runner(config), or list a "
                                  "nanogrpo.rewards.reward_model.RewardModel object")
            return make_rm(spec, prefix)
        from nanogrpo.rewards.judges.judge import Judge
        from nanogrpo.rewards.judges.reply_cache import NullCache, ReplyCache

        where = cfg.judge_cache
        if where == "auto":
            cache = ReplyCache(Path(run_dir) / "judge_cache.sqlite" if run_dir is not None else None)
        else:
            cache = NullCache() if where == "off" else ReplyCache(None if where == "memory" else where)
        return Judge(target, model=cfg.judge_model, template=cfg.judge_template, scoring=cfg.judge_score,
                     score_range=tuple(cfg.judge_range), concurrency=cfg.judge_concurrency,
                     timeout_s=cfg.judge_timeout_s, deadline_s=cfg.judge_deadline_s,
                     retries=cfg.judge_retries, max_tokens=cfg.judge_max_tokens, request=cfg.judge_request,
                     api_key_env=cfg.judge_api_key_env, cache=cache, name=spec, metric_prefix=prefix,
                     max_reply_bytes=cfg.judge_max_reply_bytes)

    return make


def reward_runner(cfg: Any, rewards: Sequence[RewardItem] | None = None, *,
                  run_dir: Any = None) -> RewardRunner:
    """A run's :class:`RewardRunner` from its :class:`~nanogrpo.config.Config`: ``cfg.rewards`` (or
    ``rewards``: names, callables, model rewards, with ``cfg.rewards.weights``), reward models
    (:mod:`nanogrpo.rewards.reward_model`, loaded on first use) on ``cfg.model.device`` unless
    ``rewards.rm_device`` names one, a judge's cache in ``run_dir``."""
    from nanogrpo.rewards.reward_model import model_rewards  # torch and transformers: on first use

    return RewardRunner.from_config(cfg.rewards, rewards, run_dir=run_dir,
                                    make_rm=model_rewards(cfg.rewards, cfg.model.device))
