"""A step in which every episode failed: the line the rollout logs, and what the rule ``episodes_failed``
(:mod:`nanogrpo.watch.rules`) reads.

Episodes with an environment or an agent program log ``env/failed`` (the episodes that ended broken:
an error, a deadline, a trace not sampled, an observation too long) beside ``env/episodes`` and a count
per finish reason (``env/finish/<reason>``). A step whose episodes all failed, or none of whose groups
could start (``env/groups_dropped``, ``env/prompts_too_long`` with no episode), trains nothing from the
environment: :func:`all_failed` says why in one line, naming the key to change; the rollout logs it at
that step, and the rule fires (several such steps in a row end the run, ``watch.episodes_failed``).
"""

from __future__ import annotations

import math
from typing import Any

from nanogrpo.watch.history import History

CAUSES = {
    "env_timeout": ("ran past env.timeout_s", "raise env.timeout_s (an agent program's deadline is its "
                    "whole episode's, from when it starts), or lower env.max_concurrent (episodes at once)"),
    "env_error": ("ended in an error of the environment (the first is logged above)",
                  "fix what it says (env.source, env.kwargs)"),
    "mismatch": ("handed back tokens that are not what was sampled",
                 "give the program the model's own renderer (env.kwargs.renderer)"),
    "too_long": ("answered an observation over env.max_observation_tokens",
                 "raise env.max_observation_tokens"),
}
"""Per finish reason of a failed episode: what happened, and what to change."""
NOT_STARTED = ("none of its groups started (a reset failed, or a first observation is over "
               "data.max_prompt_tokens; env/groups_dropped, env/prompts_too_long)",
               "fix the environment's reset, or raise data.max_prompt_tokens")


def _num(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def all_failed(row: dict[str, Any], timeout_s: float | None = None) -> str | None:
    """One line when every episode of the step ``row`` failed (or none could start): how many, the most
    common cause, the key to change; None when any episode ended well or the row has no episodes."""
    n, failed = _num(row, "env/episodes"), _num(row, "env/failed")
    if n <= 0:
        if _num(row, "env/groups_dropped") + _num(row, "env/prompts_too_long") <= 0:
            return None
        what, change = NOT_STARTED
        return f"no episode of this step ran: {what}; {change}"
    if failed < n:
        return None
    counts = {why: _num(row, f"env/finish/{why}") for why in CAUSES}
    why = max(counts, key=lambda k: counts[k])
    what, change = CAUSES[why] if counts[why] > 0 else ("failed", "see the environment's errors logged above")
    if why == "env_timeout" and timeout_s is not None:
        what = what.replace("env.timeout_s", f"env.timeout_s={timeout_s:g} s")
    many = f"{counts[why]:.0f} {why}" if counts[why] < n else why
    return f"all {n:.0f} episodes of this step failed ({many}): they {what}; {change}"


def _row_at(h: History, step: int) -> dict[str, float]:
    """The ``env/…`` values logged at ``step``."""
    out = {}
    for key, pts in h.series.items():
        if key.startswith("env/") and pts and pts[-1][0] >= step:
            for s, v in reversed(pts):
                if s == step:
                    out[key] = v
                    break
                if s < step:
                    break
    return out


def failed_streak(h: History) -> tuple[str, int, int] | None:
    """(the latest step's :func:`all_failed` line, the first step of the streak of such steps, its
    length) when the latest step's episodes all failed; None otherwise."""
    pts = h.points("env/episodes")
    if not pts or pts[-1][0] != h.last_step:
        return None
    line = all_failed(_row_at(h, h.last_step))
    if line is None:
        return None
    since, streak = h.last_step, 0
    for step, _ in reversed(pts):
        if all_failed(_row_at(h, step)) is None:
            break
        since, streak = step, streak + 1
    return line, since, streak
