"""``nanogrpo report RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG plots and a markdown summary of runs.

Reads each run's ``metrics.jsonl`` and writes, into ``--out`` (default: ``RUN_DIR/report`` for
one run, ``./report`` for several):

- one PNG per quantity, every run overlaid in its own colour with a legend: ``reward.png``,
  ``accuracy.png`` (train: solid; held-out ``eval/accuracy``: dashed with markers),
  ``heldout_accuracy.png`` (held-out only: one line per run), ``format_rate.png`` (train and
  held-out), ``kl.png``, ``entropy.png`` (the policy's mean per-token entropy, train: solid,
  held-out ``eval/entropy``: dashed), ``completion_length.png``, ``step_time.png``;
  noisy curves are drawn faintly with a moving average on top; the y-axis is not zoomed onto the curves
  (a format rate of 0.965-1.0 would fill the plot and look like a trend): shares (accuracy, format rate)
  span 0 to 1, every other quantity's axis reaches 0;
- ``overview.png``: all eight in one figure;
- ``report.md``: a table per run (steps, reward and accuracy at start and end, best held-out
  accuracy, KL, length, step time, throughput) with the plots linked; start and end are the first and the
  last logged step, as the run's end line has them, or, for runs of 20 steps and more, means over the
  first and last tenth of the steps (10 at most, :func:`ends_window`);
- ``samples.html``: the rollout tables the runs logged (``samples.jsonl``, ``log.samples_every``): prompts
  and completions, each beside its prompt's images for vision-language runs (a text run's table has no
  image column), with each reward component and its advantage;
- the run monitor's alarms (``RUN/watch.jsonl``, :mod:`nanogrpo.watch`): a "Watch" section in
  ``report.md`` and one ``watch_<run>_<rule>_<step>.png`` per alarm (its series with the moment marked,
  and completions of that step beside the run's first).

The plots need matplotlib (``pip install matplotlib``, or the ``report`` extra), headless (Agg backend);
without it the report is ``report.md`` (its table, the watch section's alarms) and ``samples.html``, and
one line says how to get the plots.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogrpo.errors import ConfigError
from nanogrpo.training.metrics import read_metrics


@dataclass(frozen=True)
class Panel:
    file: str
    title: str
    ylabel: str
    train_key: str | None
    eval_key: str | None = None
    share: bool = False
    """A share (0 to 1): the y-axis spans [0, 1] whatever the curves (else it reaches 0)."""


PANELS = [
    Panel("reward", "Mean reward per completion", "reward", "reward_mean", "eval/reward_mean"),
    Panel("accuracy", "Accuracy (train: solid, held-out: dashed)", "accuracy", "accuracy", "eval/accuracy",
          share=True),
    Panel("heldout_accuracy", "Held-out accuracy", "accuracy", None, "eval/accuracy", share=True),
    Panel("format_rate", "Format rate (train: solid, held-out: dashed)", "share formatted", "format_rate",
          "eval/format_rate", share=True),
    Panel("kl", "KL to the reference (k3)", "KL per token", "kl"),
    Panel("entropy", "Policy entropy (train: solid, held-out: dashed)", "nats per token", "entropy",
          "eval/entropy"),
    Panel("completion_length", "Completion length", "tokens", "completion_len_mean"),
    Panel("step_time", "Step time", "seconds per step", "step_time_s"),
]


@dataclass
class RunData:
    label: str
    path: Path
    rows: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for r in self.rows:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(int(r["step"]))
                ys.append(float(v))
        return xs, ys


def load_run(path: Path) -> RunData:
    path = Path(path)
    mfile = path / "metrics.jsonl"
    if not mfile.is_file():
        raise ConfigError(f"{path}: not a run directory (no metrics.jsonl)")
    rows = read_metrics(mfile)
    if not rows:
        raise ConfigError(f"{path}: metrics.jsonl is empty (the run logged no step yet)")
    return RunData(path.name, path, rows)


def label_runs(runs: list[RunData]) -> None:
    """Distinct legend labels: the directory name, with its parent when two runs share a name."""
    names = [r.path.resolve().name for r in runs]
    for r in runs:
        full = r.path.resolve()
        r.label = f"{full.parent.name}/{full.name}" if names.count(full.name) > 1 else full.name
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label} ({seen[r.label]})"


def moving_average(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def draw_panel(ax, runs: list[RunData], panel: Panel, colors: list) -> bool:
    drew = False
    both = bool(panel.train_key and panel.eval_key)
    compact = both and len(runs) > 4  # one legend entry per run (the title says solid / dashed)
    for run, color in zip(runs, colors):
        xs, ys = run.series(panel.train_key) if panel.train_key else ([], [])
        if xs:
            drew = True
            window = max(1, len(xs) // 20)
            if window > 1:
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(xs, moving_average(ys, window), color=color, linewidth=1.8,
                        label=f"{run.label} (train, avg {window})" if both and not compact else run.label)
            else:
                ax.plot(xs, ys, color=color, linewidth=1.6, marker="." if len(xs) < 30 else None,
                        label=f"{run.label} (train)" if both and not compact else run.label)
        if panel.eval_key:
            ex, ey = run.series(panel.eval_key)
            if ex:
                drew = True
                label = run.label if not panel.train_key else None if compact and xs else \
                    run.label if compact else f"{run.label} (held-out)"
                ax.plot(ex, ey, color=color, linestyle="--" if panel.train_key else "-", marker="o",
                        markersize=4, linewidth=1.6, label=label)
    ax.set_title(panel.title)
    ax.set_xlabel("training step")
    ax.set_ylabel(panel.ylabel)
    if drew:
        _honest_y(ax, panel.share)
    ax.grid(True, alpha=0.3)
    if drew:
        ax.legend(fontsize=8, loc="best", ncol=2 if len(ax.get_legend_handles_labels()[1]) > 8 else 1)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    return drew


HEADROOM = 0.8
"""The highest point of a curve on an axis that is not a share's sits at most this far up the plot: the band
above it is the legend's (a flat completion length at its cap sat on the top edge, under the legend)."""


def _honest_y(ax, share: bool) -> None:
    """No zoom onto noise: a share's axis spans [0, 1] (a little margin), any other reaches 0 and leaves
    the legend a band above the curves (:data:`HEADROOM`)."""
    lo, hi = ax.get_ylim()
    if share:
        ax.set_ylim(min(lo, -0.02), max(hi, 1.02))
        return
    tops = [max(ys) for line in ax.get_lines()
            if len(ys := [y for y in line.get_ydata() if math.isfinite(y)])]
    top = max(tops, default=hi)
    if lo > 0:
        lo = 0
    if top > 0:
        hi = max(hi, top / HEADROOM)
    elif hi < 0:
        hi = 0
    ax.set_ylim(lo, hi)


def run_colors(plt, n: int) -> list:
    """tab10's colours, then (runs 11-20) their light shades from tab20: no two of 20 runs share one."""
    return [plt.get_cmap("tab20")((2 * i) % 20 + (i // 10) % 2) for i in range(n)]


NO_PLOTS = "no plots: matplotlib is not installed (pip install matplotlib, then nanogrpo report again)"


def pyplot():
    """matplotlib's pyplot on the headless Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(runs: list[RunData], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        raise ConfigError(f"nanogrpo report: {NO_PLOTS}")
    out.mkdir(parents=True, exist_ok=True)
    colors = run_colors(plt, len(runs))
    files = []
    for panel in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        draw_panel(ax, runs, panel, colors)
        fig.tight_layout()
        path = out / f"{panel.file}.png"
        fig.savefig(path)
        plt.close(fig)
        files.append(path)
    fig, axes = plt.subplots(2, 4, figsize=(24, 9), dpi=90)
    for ax, panel in zip(axes.flat, PANELS):
        draw_panel(ax, runs, panel, colors)
    fig.suptitle("nanogrpo: " + ", ".join(r.label for r in runs))
    fig.tight_layout()
    path = out / "overview.png"
    fig.savefig(path)
    plt.close(fig)
    files.append(path)
    return files


def _mean_of(run: RunData, key: str, which: slice) -> float:
    _, ys = run.series(key)
    ys = ys[which]
    return statistics.fmean(ys) if ys else float("nan")


def _f(v: float, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "–"


def ends_window(steps: int) -> int:
    """How many logged steps the start and end figures of a run of ``steps`` steps are means over: a tenth of
    them, 10 at most, 1 (the first and the last step, as the run's end line shows them) below 20. The two
    windows never overlap, so a run that changed never reads as flat."""
    return max(1, min(10, steps // 10))


def _ends_sentence(windows: list[int]) -> str:
    if all(w == 1 for w in windows):
        return "Start → end: the first and the last logged step (as the run's end line on the terminal)."
    return ("Start → end: means over the first and the last tenth of each run's logged steps (at most 10; "
            "a run under 20 steps: its first and last step, as on the terminal).")


def summary_markdown(runs: list[RunData], images: list[Path]) -> str:
    windows = [ends_window(len(r.series("reward_mean")[0]) or len(r.rows)) for r in runs]
    lines = ["# nanogrpo report", "", _ends_sentence(windows), "",
             "| run | steps | reward start → end | train acc start → end | held-out acc (best @ step) | "
             "format end | KL end | length end | step time (median s) | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r, w in zip(runs, windows):
        first, last = slice(0, w), slice(-w, None)
        ex, ey = r.series("eval/accuracy")
        if ey:
            i = max(range(len(ey)), key=lambda j: ey[j])
            held = f"{_f(ey[-1])} (best {_f(ey[i])} @ {ex[i]})"
        else:
            held = "–"
        _, times = r.series("step_time_s")
        toks = sum(r.series("completion_tokens")[1])
        lines.append(
            f"| {r.label} | {r.rows[-1]['step']} | {_f(_mean_of(r, 'reward_mean', first))} → "
            f"{_f(_mean_of(r, 'reward_mean', last))} | {_f(_mean_of(r, 'accuracy', first))} → "
            f"{_f(_mean_of(r, 'accuracy', last))} | {held} | {_f(_mean_of(r, 'format_rate', last))} | "
            f"{_f(_mean_of(r, 'kl', last), '.4f')} | {_f(_mean_of(r, 'completion_len_mean', last), '.1f')} | "
            f"{_f(statistics.median(times) if times else float('nan'), '.2f')} | "
            f"{_f(toks / sum(times) if times and sum(times) > 0 else float('nan'), '.0f')} |")
    lines += ["", "Runs: " + ", ".join(f"`{r.label}` = {r.path}" for r in runs), ""]
    for img in images:
        lines += [f"![{img.stem}]({img.name})", ""]
    if not images:
        lines += [f"*{NO_PLOTS[0].upper()}{NO_PLOTS[1:]}.*", ""]
    return "\n".join(lines)


def watch_lines(runs: list[RunData]) -> list[str]:
    """The watch section without its figures (no matplotlib): each watched run's alarms, in words."""
    from nanogrpo.watch.monitor import WATCH_FILE, read_events, summary

    lines: list[str] = []
    for r in runs:
        if (r.path / WATCH_FILE).is_file():
            events = read_events(r.path)
            lines += [f"### {r.label}", "", summary(events), ""]
            lines += [f"- **{e['rule']}** at step {e['step']} (since step {e['since']}): {e['message']}."
                      + (" The run stopped here (`watch.stop_on`)." if e.get("stop") else "") for e in events]
    return ["## Watch", "", "What the run monitor flagged (`[watch]`, docs/guides/watching-a-run.md).", "",
            *lines] if lines else []


def samples_html(runs: list[RunData], out: Path) -> Path | None:
    """``samples.html``: the sample completions the runs logged (``RUN/samples.jsonl``), each beside its
    prompt's images when it has some (vision-language runs) and its rewards; None when no run logged any."""
    import html
    import json

    parts = []
    for r in runs:
        f = r.path / "samples.jsonl"
        if not f.is_file():
            continue
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        shown = [[u for u in ex.get("images", []) if isinstance(u, str) and u.startswith("data:image/")]
                 for ex in rows]
        with_images = any(shown)  # a text run: no image column
        parts.append(f"<h2>{html.escape(r.label)}</h2><table><tr><th>step</th>"
                     + ("<th>image</th>" if with_images else "")
                     + "<th>question</th><th>completion</th><th>rewards, advantage</th></tr>")
        for ex, urls in zip(rows, shown):
            imgs = "".join(f'<img src="{html.escape(u, quote=True)}" alt="prompt image">' for u in urls)
            scores = ", ".join(f"{html.escape(str(k))}={v:.3g}" if isinstance(v, float) else
                               f"{html.escape(str(k))}={html.escape(str(v))}" for k, v in ex.items()
                               if k not in ("step", "question", "completion", "images"))
            parts.append(f"<tr><td>{ex.get('step', '')}</td>" + (f"<td>{imgs}</td>" if with_images else "")
                         + f"<td><pre>{html.escape(str(ex.get('question', '')))}</pre></td>"
                         f"<td><pre>{html.escape(str(ex.get('completion', '')))}</pre></td>"
                         f"<td>{scores}</td></tr>")
        parts.append("</table>")
    if not parts:
        return None
    out.mkdir(parents=True, exist_ok=True)
    page = out / "samples.html"
    page.write_text("<!doctype html><meta charset=utf-8><title>nanogrpo samples</title><style>"
                    "body{font-family:sans-serif}td{vertical-align:top;border-top:1px solid #ccc;padding:4px}"
                    "img{height:64px;image-rendering:pixelated;margin-right:4px}pre{white-space:pre-wrap;margin:0}"
                    "</style><h1>nanogrpo samples</h1>" + "".join(parts))
    return page


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="nanogrpo report",
        description="PNG plots (reward, accuracy, held-out accuracy, format rate, KL, entropy, completion "
                    "length, step time; runs overlaid), a markdown summary of runs, and samples.html (the "
                    "logged completions, beside their prompts' images).")
    ap.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    ap.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/report for one run, "
                                             "./report for several)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    runs = [load_run(p) for p in a.runs]
    label_runs(runs)
    out = a.out or (a.runs[0] / "report" if len(a.runs) == 1 else Path("report"))
    plt = pyplot()
    if plt is not None:
        images = plot(runs, out)
        from nanogrpo.watch.figures import watch_section

        watch, figures = watch_section([(r.label, r.path, r.rows) for r in runs], out, plt)
    else:
        images, watch, figures = [], watch_lines(runs), []
        out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text(summary_markdown(runs, images) + ("\n" + "\n".join(watch) if watch else ""))
    images += figures
    page = samples_html(runs, out)
    shown = f"; sample completions: {page}" if page else ""
    print(f"report: {md} and {len(images)} plots in {out}{shown}")
    if plt is None:
        print(f"report: {NO_PLOTS}")
    return 0
