"""What ``nanogrpo report`` shows of a watch event: one PNG with the series that show it, the moment it
fired marked (a line at the step, the stretch since ``since`` shaded, the rule's threshold dashed), and
below them a few completions of that step beside the run's first ones, with their rewards and advantages.
matplotlib is imported by the caller's ``plt``."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

TEXT_WIDTH = 70
"""Characters per line of a completion in the figure."""
TEXT_LINES = 4
"""Lines per completion (longer ones are cut, with an ellipsis)."""


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _short(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _completion_text(ex: dict[str, Any]) -> str:
    body = textwrap.wrap(str(ex.get("completion", "")).replace("\n", " / "), TEXT_WIDTH) or [""]
    if len(body) > TEXT_LINES:
        body = body[:TEXT_LINES - 1] + [body[TEXT_LINES - 1][:TEXT_WIDTH - 3] + "..."]
    scores = ", ".join(f"{k.rpartition(':')[2]} {v:+.2f}" for k, v in ex.items()  # file.py:fn -> fn
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "group")
    q = f"Q: {_short(ex.get('question', ''), TEXT_WIDTH - 3)}\n" if ex.get("question") else ""
    return q + "\n".join(body) + f"\n    [{scores}]"


def _column(title: str, block: dict[str, Any] | None) -> str:
    if not block or not block.get("rows"):
        return f"{title}\n(no completions logged)"
    return f"{title}\n\n" + "\n\n".join(_completion_text(ex) for ex in block["rows"])


def event_figure(plt, rows: list[dict[str, Any]], event: dict[str, Any], path: Path, label: str) -> Path:
    """Draw ``event`` (a ``RUN/watch.jsonl`` line) over the run's ``rows`` into ``path``."""
    keys = [k for k in event.get("metrics", []) if _series(rows, k)[0]][:3] or ["reward_mean"]
    ex = event.get("examples") or {}
    before, now = ex.get("before"), ex.get("now")
    left = _column(f"earlier: step {before['step']}" if before else "earlier", before)
    right = _column(f"when it fired: step {now['step']}" if now else "when it fired", now)
    lines = max(left.count("\n"), right.count("\n")) + 1
    fig = plt.figure(figsize=(15, 4.6 + 0.16 * lines), dpi=90)
    grid = fig.add_gridspec(2, len(keys), height_ratios=[4.0, 0.16 * lines + 0.2])
    step, since = event["step"], event["since"]
    for i, key in enumerate(keys):
        ax = fig.add_subplot(grid[0, i])
        xs, ys = _series(rows, key)
        ax.plot(xs, ys, marker="." if len(xs) < 60 else None, linewidth=1.5, color="tab:blue")
        if since < step:
            ax.axvspan(since, step, color="tab:red", alpha=0.12, label=f"since step {since}")
        ax.axvline(step, color="tab:red", linewidth=1.8, label=f"fired at step {step}")
        thr = event.get("thresholds", {}).get(key)
        if isinstance(thr, (int, float)) and math.isfinite(thr):
            ax.axhline(thr, color="gray", linestyle="--", linewidth=1.0, label="the rule's threshold")
        ax.set_title(key)
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    text = fig.add_subplot(grid[1, :])
    text.axis("off")
    for x, column in ((0.0, left), (0.51, right)):
        text.text(x, 1.0, column, va="top", ha="left", family="monospace", fontsize=8.5,
                  transform=text.transAxes)
    msg = textwrap.fill(f"{event['rule']} at step {step} (since {since}): {event['message']}", 170)
    fig.suptitle(f"{label}: {msg}", fontsize=10.5, x=0.01, ha="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def watch_section(runs: list[tuple[str, Path, list[dict[str, Any]]]], out: Path,
                  plt) -> tuple[list[str], list[Path]]:
    """The report's watch section (markdown lines) and its figures, for ``runs`` as (label, run
    directory, metric rows): each run's events, each with its figure; "no alarm" for a watched run
    without any; nothing for a run the monitor did not watch (no ``watch.jsonl``)."""
    from nanogrpo.watch.monitor import WATCH_FILE, read_events, summary

    lines: list[str] = []
    files: list[Path] = []
    for label, root, rows in runs:
        if not (root / WATCH_FILE).is_file():
            continue
        events = read_events(root)
        lines += [f"### {label}", "", summary(events), ""]
        for e in events:
            name = f"watch_{_safe(label)}_{e['rule']}_{e['step']}.png"
            files.append(event_figure(plt, rows, e, out / name, label))
            stop = " The run stopped here (`watch.stop_on`)." if e.get("stop") else ""
            lines += [f"- **{e['rule']}** at step {e['step']} (since step {e['since']}): "
                      f"{e['message']}.{stop}", "", f"  ![{e['rule']} at step {e['step']}]({name})", ""]
    if lines:
        lines = ["## Watch", "", "What the run monitor flagged (`[watch]`, docs/guides/watching-a-run.md): "
                 "each alarm's series with the moment marked, and completions of that step beside the run's "
                 "first.", ""] + lines
    return lines, files


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)
