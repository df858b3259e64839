"""The monitor in the loop: every step's row through the rules; what fires is said, logged and kept.

When a rule fires (its finding appears where there was none the step before):

- one line on the screen, ``WARNING nanogrpo.watch: step 23: entropy_collapse since step 21: ...``;
- the row gets ``watch/<rule>`` = 1 (0 while it is quiet; every checked rule, every step), so
  TensorBoard and W&B plot it;
- an event in ``RUN/watch.jsonl``: the finding (rule, step, since, message, the numbers, the series
  that show it) and a few completions of that step beside the run's first ones, which
  ``nanogrpo report`` draws, and the run's summary line lists;
- with the rule in ``watch.stop_on``, :attr:`Monitor.stop` is set: the loop saves a checkpoint of the
  step and ends the run. A rule may also end the run by its own settings (``episodes_failed`` after
  ``stop_after`` failed steps in a row): an event of its own at that step, its line in the run's
  summary.

On resume the monitor reads the run's rows back (``metrics.jsonl``, already cut at the checkpoint)
without saying anything again, and ``watch.jsonl`` is cut at the checkpoint's step like the other logs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from nanogrpo.config.watch import WatchConfig
from nanogrpo.watch.history import History
from nanogrpo.watch.rules import RULES, Finding

log = logging.getLogger("nanogrpo.watch")

WATCH_FILE = "watch.jsonl"
"""A run directory's watch events, one JSON object per line."""
EVIDENCE_ROWS = 4
"""Completions kept with an event, of the step it fired at and of the run's first logged step."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL log, also while a run writes it: a last line without its newline (being
    written, or torn by a kill) is left out."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def read_events(root: Path | str) -> list[dict[str, Any]]:
    """The events of a run directory (``RUN/watch.jsonl``), oldest first; [] when it has none."""
    return read_jsonl(Path(root) / WATCH_FILE)


def _cut(path: Path, resume_step: int | None) -> None:
    """A fresh run empties the events file; a resumed one keeps the events of steps <= ``resume_step``."""
    kept = [] if resume_step is None else [e for e in read_jsonl(path) if e["step"] <= resume_step]
    path.write_text("".join(json.dumps(e) + "\n" for e in kept))


class Monitor:
    """The rules of ``cfg`` over a run's rows. ``root``: the run directory (None: nothing written);
    ``weights``: each reward function's weight by name; ``resume_step``: the step of the checkpoint
    being resumed (its rows are read back from ``root``); ``quiet``: no screen line."""

    def __init__(self, cfg: WatchConfig, root: Path | None = None, weights: dict[str, float] | None = None,
                 resume_step: int | None = None, quiet: bool = False):
        self.cfg = cfg
        self.root = None if root is None else Path(root)
        self.quiet = quiet
        self.history = History(dict(weights or {}))
        self.rules = [(n, RULES[n], getattr(cfg, n)) for n in cfg.active()]
        self.firing: dict[str, Finding] = {}
        self.events: list[dict[str, Any]] = []
        """Every event so far (this process's and, on resume, the run's before it)."""
        self.stop: Finding | None = None
        """The finding of a ``watch.stop_on`` rule that fired: the run should end after this step."""
        self.before: dict[str, Any] | None = None
        """The run's first logged completions ({"step", "rows"}): what an event's are shown beside."""
        if self.root is None:
            return
        _cut(self.root / WATCH_FILE, resume_step)
        self.events = read_events(self.root)
        if resume_step is None:
            return
        for r in read_jsonl(self.root / "metrics.jsonl"):
            if r.get("step", 0) <= resume_step:
                self._check(r)
        first = read_jsonl(self.root / "samples.jsonl")
        if first:
            s0 = first[0]["step"]
            self.before = {"step": s0, "rows": [_shown(r) for r in first if r["step"] == s0][:EVIDENCE_ROWS]}

    @classmethod
    def for_run(cls, cfg, root: Path, rewards=None, resume_step: int | None = None) -> Monitor | None:
        """The monitor of a run (``cfg`` the whole config; ``rewards`` its :class:`RewardRunner`, whose
        names and weights split the reward); None when ``watch`` checks no rule."""
        if not cfg.watch.active():
            return None
        if rewards is not None:
            weights = dict(zip(rewards.specs, rewards.weights))
        else:  # split mode's trainer scores nothing: the names as the config gives them
            fns = cfg.rewards.functions
            weights = dict(zip(fns, cfg.rewards.weights or [1.0] * len(fns)))
        return cls(cfg.watch, root, weights, resume_step)

    def _check(self, row: dict[str, Any]) -> list[Finding]:
        """Add ``row``; the findings that are new this step, or end the run from this step (the firing set
        updated)."""
        self.history.add(row)
        if row.get("reward_mean") is None:
            return []  # a row with the held-out baseline only (step 0)
        new = []
        for name, rule, settings in self.rules:
            found = rule(self.history, settings)
            if found is None:
                self.firing.pop(name, None)
                continue
            before = self.firing.get(name)
            if before is None or (found.stop and not before.stop):
                new.append(found)
            self.firing[name] = found
        return new

    def observe(self, row: dict[str, Any], examples: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """Check the rules after the step ``row`` (its metrics, evaluation included); ``examples``: its
        rollout table. Returns the ``watch/<rule>`` metrics to add to the row."""
        step = int(row["step"])
        for f in self._check(row):
            stop = f.rule in self.cfg.stop_on or f.stop
            now = {"step": step, "rows": [_shown(e) for e in examples or []][:EVIDENCE_ROWS]}
            event = {**f.to_dict(), "stop": stop, "examples": {"before": self.before, "now": now}}
            if f.stop:
                event["stop_reason"] = f.message
            self.events.append(event)
            if self.root is not None:
                with open(self.root / WATCH_FILE, "a") as fh:
                    fh.write(json.dumps(event, default=_plain) + "\n")
            if stop and self.stop is None:
                self.stop = f
            if not self.quiet:
                why = f" -- stopping the run (watch.{f.rule}.stop_after)" if f.stop else \
                    " -- stopping the run (watch.stop_on)" if stop else ""
                log.warning("step %d: %s since step %d: %s%s", step, f.rule, f.since, f.message, why)
        if examples and self.before is None:
            self.before = {"step": step, "rows": [_shown(e) for e in examples][:EVIDENCE_ROWS]}
        if row.get("reward_mean") is None:
            return {}
        return {f"watch/{name}": float(name in self.firing) for name, _, _ in self.rules}


def _shown(example: dict[str, Any]) -> dict[str, Any]:
    """A rollout-table row as an event keeps it: everything but its images."""
    return {k: v for k, v in example.items() if k not in ("images", "step")}


def _plain(v: Any) -> Any:
    return float(v) if hasattr(v, "__float__") else str(v)


def replay(rows: list[dict[str, Any]], cfg: WatchConfig | None = None,
           weights: dict[str, float] | None = None) -> list[Finding]:
    """The findings the monitor would have made over ``rows`` (a run's ``metrics.jsonl``), in order: a run
    judged afterwards, or thresholds tried on runs already made."""
    m = Monitor(cfg or WatchConfig(), weights=weights, quiet=True)
    found = []
    for r in rows:
        found += m._check(r)
    return found


def stop_now(monitor: Monitor | None, backend, cfg: WatchConfig) -> bool:
    """Whether the run stops after this step (a ``watch.stop_on`` rule fired on rank 0, which alone
    runs the monitor, or a rule ended it by its own settings). With several ranks and a rule that may
    stop the run (:meth:`~nanogrpo.config.watch.WatchConfig.may_stop`), a collective every rank calls."""
    stop = monitor is not None and monitor.stop is not None
    if backend is not None and backend.world_size > 1 and cfg.may_stop():
        return bool(backend.all_reduce([float(stop)], ["max"])[0])
    return stop


def summary(events: list[dict[str, Any]]) -> str:
    """``watch: entropy_collapse at step 23 (since 21); stopped the run at step 23`` / ``watch: no alarm``;
    a rule that ended the run by its own settings adds its line (``...: all 32 episodes of this step
    failed ...``)."""
    if not events:
        return "watch: no alarm"
    parts = [f"{e['rule']} at step {e['step']} (since {e['since']})" for e in events
             if not e.get("stop_reason")]
    stopped = next((e for e in events if e.get("stop")), None)
    if stopped is None:
        return "watch: " + ", ".join(parts)
    why = f" ({stopped['rule']}: {stopped['stop_reason']})" if stopped.get("stop_reason") else ""
    return "watch: " + ", ".join(parts) + f"; stopped the run at step {stopped['step']}{why}"
