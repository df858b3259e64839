"""Per-step metrics: one JSON object per line in ``RUN/metrics.jsonl``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null means "not measured this step"
    return v


def complete_lines(text: str) -> list[str]:
    """The non-empty lines of a JSONL text that end in a newline: a last line without one is still
    being written (a reader racing the trainer) or was torn by a kill, and is left out."""
    return [line for line in text.split("\n")[:-1] if line.strip()]


def truncate_jsonl(path: Path, resume_step: int | None) -> None:
    """Start a run's JSONL log: empty it (fresh run) or keep the rows of steps <= ``resume_step``
    (a torn last line, killed mid-write, is dropped)."""
    if resume_step is None:
        path.write_text("")
    elif path.exists():
        kept = [line for line in complete_lines(path.read_text())
                if json.loads(line).get("step", 0) <= resume_step]
        path.write_text("".join(line + "\n" for line in kept))


class MetricsWriter:
    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        truncate_jsonl(path, resume_step)
        self._f = open(path, "a")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file, also while a run is writing it (its unfinished last line is skipped)."""
    return [json.loads(line) for line in complete_lines(Path(path).read_text())]


COUNT_KEYS = ("completion_tokens", "num_completions", "groups_total", "groups_kept", "prompts_skipped",
              "reward_failures", "reward_timeouts", "reward_non_finite")
"""Summed over ranks."""
MAX_KEYS = ("rollout_time_s", "train_time_s", "step_time_s", "gpu_mem_gib")
"""The slowest (largest) rank's value."""
MEAN_KEYS = ("reward_mean", "accuracy", "format_rate", "completion_len_mean", "stop_rate", "truncated_frac",
             "distinct_ngrams", "sampled_nll")
"""Per-completion means: weighted by each rank's completions (as are the ``reward/<function>`` means;
``distinct_ngrams``, a ratio within each rank's completions, is so averaged too)."""
TOOL_KEYS = {"tools/calls": "sum", "tools/errors": "sum", "tools/timeouts": "sum", "tools/denied": "sum",
             "tools/max_turns_hit": "sum", "tools/generated_tokens": "sum", "tools/tool_tokens": "sum",
             "tools/calls_per_completion": "mean", "tools/use_rate": "mean", "tools/turns_mean": "mean",
             "tools/time_s": "max"}
"""Multi-turn rollouts' metrics (present on every rank or on none: the config decides)."""
DYNAMIC_KEYS = {"groups_no_signal": "sum", "groups_surplus": "sum", "refills": "max"}
"""``grpo.dynamic_sampling``'s counts (on every rank or on none); every rank runs the same rounds."""
REWARD_METRIC_OPS = {"failures": "sum", "requests": "sum", "retries": "sum", "cache_hits": "sum",
                     "prompt_tokens": "sum", "completion_tokens": "sum", "unparseable": "sum",
                     "errors": "sum", "timeouts": "sum", "truncated": "sum", "rows_per_s": "sum",
                     "tokens_per_s": "sum",
                     "latency_s": "max", "latency_max_s": "max", "time_s": "max"}
"""Reward metrics by their last part: each function's ``reward/<name>/failures`` and model rewards'
figures (``judge/…``, ``rm/…``, ``rm_2/…``; the same keys on every rank: the config decides)."""


def _reward_metric_ops(row: dict[str, Any]) -> dict[str, str]:
    ops = {}
    for k in row:
        head, _, last = k.rpartition("/")
        if last in REWARD_METRIC_OPS and ((k.startswith("reward/") and last == "failures")
                                           or re.fullmatch(r"(judge|rm)(_\d+)?", head)):
            ops[k] = REWARD_METRIC_OPS[last]
    return ops


def _env_metric_ops(row: dict[str, Any]) -> dict[str, str]:
    """Episodes' ``env/…`` and ``agent/…`` metrics (:func:`nanogrpo.episodes.play.env_metrics`): means
    and rates weighted by completions, ``env/time_s`` the slowest rank's, counts (episodes, finish
    reasons, groups dropped, prompts too long, requests) added."""
    ops = {}
    for k in row:
        if k.startswith(("env/", "agent/")):
            ops[k] = "max" if k.endswith("time_s") else \
                "mean" if k.endswith(("_mean", "_rate", "_per_episode")) else "sum"
    return ops


def merge_rank_metrics(row: dict[str, Any], all_reduce, reward_keys: list[str] = ()) -> dict[str, Any]:
    """One step's metrics over all ranks from each rank's own ``row`` (a collective: every rank calls
    it). Counts add up, per-completion means (``MEAN_KEYS`` and ``reward_keys``) are weighted by each
    rank's completions, ``reward_std`` is the pooled (unbiased) standard deviation, times are the
    slowest rank's, ``tokens_per_s`` follows from those; the update's metrics (loss, kl, grad norm)
    are already global. A rank without completions weighs nothing.

    ``all_reduce(values, ops)`` is :meth:`nanogrpo.training.distributed.Backend.all_reduce`."""
    tools = {**{k: op for k, op in {**TOOL_KEYS, **DYNAMIC_KEYS}.items() if k in row},
             **_reward_metric_ops(row), **_env_metric_ops(row)}
    means = list(MEAN_KEYS) + sorted(reward_keys) + [k for k, op in tools.items() if op == "mean"]
    counts = list(COUNT_KEYS) + [k for k, op in tools.items() if op == "sum"]
    maxes = list(MAX_KEYS) + [k for k, op in tools.items() if op == "max"]

    def num(k: str) -> float:
        v = row.get(k)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else math.nan

    n = num("num_completions") if num("num_completions") > 0 else 0.0
    m, s = num("reward_mean"), num("reward_std")
    sq = (n - 1) * s * s + n * m * m if n > 0 and math.isfinite(m) and math.isfinite(s) else 0.0
    vals = [n, sq] + [num(k) * n if n > 0 and math.isfinite(num(k)) else 0.0 for k in means]
    vals += [num(k) if math.isfinite(num(k)) else 0.0 for k in counts]
    vals += [num(k) if math.isfinite(num(k)) else 0.0 for k in maxes]
    out = all_reduce(vals, ["sum"] * (2 + len(means) + len(counts)) + ["max"] * len(maxes))
    total, sq_total = out[0], out[1]
    out_means, out_counts = out[2:2 + len(means)], out[2 + len(means):2 + len(means) + len(counts)]
    out_maxes = out[2 + len(means) + len(counts):]
    merged = dict(row)
    for k, v in zip(means, out_means):
        merged[k] = v / total if total > 0 else math.nan
    for k, v in zip(counts, out_counts):
        merged[k] = int(v)
    for k, v in zip(maxes, out_maxes):
        if k in row:
            merged[k] = v
    mean = merged["reward_mean"]
    merged["reward_std"] = (math.sqrt(max(sq_total - total * mean * mean, 0.0) / (total - 1)) if total > 1
                            else 0.0 if total == 1 else math.nan)
    if "tokens_per_s" in row:
        t = merged.get("step_time_s") or 0.0
        merged["tokens_per_s"] = merged["completion_tokens"] / t if t > 0 else 0.0
    return merged
