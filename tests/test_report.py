"""nanogrpo report: PNG plots of several runs overlaid, and a markdown summary."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from nanogrpo.cli import main
from nanogrpo.report import PANELS, moving_average

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib not installed (pip install matplotlib)")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(d: Path, rate: float, steps: int = 30, with_eval: bool = True) -> Path:
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            acc = 1 - math.exp(-rate * s)
            row = {"step": s, "reward_mean": 2 * acc - 1, "accuracy": acc, "format_rate": min(1.0, s / 20),
                   "kl": None if s == 1 else 0.001 * s, "completion_len_mean": 40.0, "step_time_s": 1.2,
                   "completion_tokens": 600}
            if with_eval and s % 10 == 0:
                row.update({"eval/accuracy": acc - 0.1, "eval/format_rate": 0.5})
            f.write(json.dumps(row) + "\n")
    return d


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@needs_matplotlib
@pytest.mark.slow
def test_report_two_runs(tmp_path, capsys):
    a = _run(tmp_path / "lr-1e-6", 0.05)
    b = _run(tmp_path / "lr-3e-6", 0.1, steps=25, with_eval=False)
    out = tmp_path / "report"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    for name in [p.file for p in PANELS] + ["overview"]:
        w, h = _png_size(out / f"{name}.png")
        assert w >= 600 and h >= 400
    from matplotlib import image

    img = image.imread(out / "accuracy.png")
    assert img.ndim == 3 and img.std() > 0.01  # something was drawn
    md = (out / "report.md").read_text()
    assert "| lr-1e-6 | 30 |" in md and "| lr-3e-6 | 25 |" in md
    assert "![accuracy](accuracy.png)" in md
    assert str(out / "report.md") in capsys.readouterr().out


@needs_matplotlib
@pytest.mark.slow
def test_report_single_run_defaults_beside_it(tmp_path):
    a = _run(tmp_path / "run", 0.05)
    assert main(["report", str(a)]) == 0
    assert (a / "report" / "reward.png").is_file() and (a / "report" / "report.md").is_file()


def test_report_distinguishes_runs_with_the_same_name(tmp_path):
    from nanogrpo.report import label_runs, load_run

    runs = [load_run(_run(tmp_path / "x" / "run", 0.1)), load_run(_run(tmp_path / "y" / "run", 0.1))]
    label_runs(runs)
    assert [r.label for r in runs] == ["x/run", "y/run"]


def test_report_on_a_non_run_is_an_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


@needs_matplotlib
def test_many_runs_get_distinct_colours_and_one_legend_entry_each(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nanogrpo.report import draw_panel, load_run, run_colors

    runs = []
    for i in range(12):
        d = _run(tmp_path / f"r{i}", 0.05 + 0.01 * i, steps=10)
        with open(d / "metrics.jsonl", "a") as f:  # an entropy panel: train and held-out series
            f.write(json.dumps({"step": 11, "entropy": 0.4, "eval/entropy": 0.5}) + "\n")
        runs.append(load_run(d))
    colors = run_colors(plt, len(runs))
    assert len(set(colors)) == 12 and colors[:10] == [plt.get_cmap("tab10")(i) for i in range(10)]
    entropy = next(p for p in PANELS if p.file == "entropy")
    fig, ax = plt.subplots()
    assert draw_panel(ax, runs, entropy, colors)
    assert ax.get_legend_handles_labels()[1] == [f"r{i}" for i in range(12)]
    plt.close(fig)


@needs_matplotlib
def test_plots_do_not_zoom_onto_noise(tmp_path):
    """A format rate of 0.965-1.0 filled its plot and read as a trend (issue 44): shares span [0, 1], other
    quantities' axes reach 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nanogrpo.report import draw_panel, load_run, run_colors

    d = tmp_path / "flat"
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, 41):
            f.write(json.dumps({"step": s, "format_rate": 0.965 + 0.035 * (s % 3 == 0), "accuracy": 0.5,
                                "step_time_s": 30 + (s % 2), "reward_mean": -1.2 + 0.01 * (s % 4)}) + "\n")
    run = load_run(d)
    limits = {}
    for panel in PANELS:
        fig, ax = plt.subplots()
        if draw_panel(ax, [run], panel, run_colors(plt, 1)):
            limits[panel.file] = ax.get_ylim()
        plt.close(fig)
    lo, hi = limits["format_rate"]
    assert lo <= 0 and hi >= 1
    assert limits["accuracy"][0] <= 0 and limits["accuracy"][1] >= 1
    assert limits["step_time"][0] == 0  # 30-31 s a step: from 0, not 29.95-31.05
    assert limits["reward"][1] == 0  # all below 0: up to 0


def test_samples_page_of_a_text_run_has_no_image_column(tmp_path):
    from nanogrpo.report import load_run, samples_html

    d = _run(tmp_path / "text", 0.05, steps=2)
    (d / "samples.jsonl").write_text(json.dumps({"step": 1, "question": "1+1?", "completion": "2",
                                                 "reward": 1.0}) + "\n")
    page = samples_html([load_run(d)], tmp_path / "out").read_text()
    assert "<th>image</th>" not in page and "<td></td>" not in page
    assert "<th>question</th>" in page and "<pre>1+1?</pre>" in page


def _rising(d: Path, rewards: list[float]) -> Path:
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.07}) + "\n")  # the held-out baseline row
        for s, r in enumerate(rewards, 1):
            f.write(json.dumps({"step": s, "reward_mean": r, "accuracy": r / 2, "format_rate": 1.0,
                                "completion_len_mean": 40.0, "step_time_s": 1.0, "completion_tokens": 100})
                    + "\n")
    return d


def _table_row(md: str, label: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_short_run_reads_start_to_end_as_the_terminal_does(tmp_path):
    """A run of 10 steps or fewer had its start and end means over the same 10 steps: the distillation run
    read 0.861 -> 0.861 while its reward rose 0.656 -> 1.305 (issue 50). Now the first and the last step,
    the figures of the run's end line."""
    from nanogrpo.report import load_run, summary_markdown
    from nanogrpo.training.logging_sinks import run_summary

    d = _rising(tmp_path / "distill", [0.656, 0.8, 0.9, 1.1, 1.305])
    md = summary_markdown([load_run(d)], [])
    cells = _table_row(md, "distill")
    assert cells[2] == "0.656 → 1.305" and cells[3] == "0.328 → 0.652"
    assert "reward 0.656 -> 1.305" in run_summary(d) and "train acc 0.328 -> 0.652" in run_summary(d)
    assert "the first and the last logged step" in md


def test_a_longer_runs_ends_are_means_over_a_tenth_never_overlapping(tmp_path):
    from nanogrpo.report import ends_window, load_run, summary_markdown

    assert [ends_window(n) for n in (1, 5, 10, 19, 20, 35, 80, 100, 1000)] == [1, 1, 1, 1, 2, 3, 8, 10, 10]
    assert all(2 * ends_window(n) <= n for n in range(2, 500))  # the two windows never share a step
    d = _rising(tmp_path / "long", [float(s) for s in range(1, 31)])  # 30 steps: means over 3
    cells = _table_row(summary_markdown([load_run(d)], []), "long")
    assert cells[2] == "2.000 → 29.000"


def test_the_report_works_without_matplotlib_and_says_how_to_get_plots(tmp_path, capsys, monkeypatch):
    """`nanogrpo report runs/demo`, as the README says it, after the README's install (no matplotlib): the
    summary and the samples page, and one line on the plots (issue 50: it failed)."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    d = _rising(tmp_path / "demo", [0.5, 0.7, 0.9])
    (d / "samples.jsonl").write_text(json.dumps({"step": 1, "question": "1+1?", "completion": "2"}) + "\n")
    (d / "watch.jsonl").write_text(json.dumps({"rule": "no_signal", "step": 2, "since": 1,
                                               "message": "every reward the same"}) + "\n")
    assert main(["report", str(d)]) == 0
    out = capsys.readouterr().out
    assert "report: no plots: matplotlib is not installed (pip install matplotlib" in out
    md = (d / "report" / "report.md").read_text()
    assert "| demo | 3 | 0.500 → 0.900 |" in md and ".png" not in md
    assert "**no_signal** at step 2 (since step 1): every reward the same." in md
    assert (d / "report" / "samples.html").is_file() and not list((d / "report").glob("*.png"))


@needs_matplotlib
def test_a_flat_curve_at_its_cap_leaves_the_legend_a_band_above_it(tmp_path):
    """The completion length sat on the plot's top edge, under the legend (issue 50)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nanogrpo.report import HEADROOM, draw_panel, load_run, run_colors

    d = _rising(tmp_path / "capped", [0.5] * 80)  # every completion at the 40-token cap
    panel = next(p for p in PANELS if p.file == "completion_length")
    for shape in ((1, 1, (7, 4.2)), (2, 4, (24, 9))):  # the panel alone, and in the overview
        fig, axes = plt.subplots(shape[0], shape[1], figsize=shape[2])
        ax = axes if shape == (1, 1, (7, 4.2)) else axes.flat[6]
        assert draw_panel(ax, [load_run(d)], panel, run_colors(plt, 1))
        fig.tight_layout()
        fig.canvas.draw()
        lo, hi = ax.get_ylim()
        assert lo == 0 and 40.0 <= HEADROOM * hi + 1e-9
        legend = ax.get_legend().get_window_extent()
        curve = ax.transData.transform([(x, y) for line in ax.get_lines() for x, y in line.get_xydata()])
        under = [(x, y) for x, y in curve if legend.x0 <= x <= legend.x1 and legend.y0 - 2 <= y <= legend.y1]
        assert not under, "the curve runs under the legend"
        plt.close(fig)
