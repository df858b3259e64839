"""The documentation's screenshots, rendered from real runs by nanogrpo's own commands.

    python docs/scripts/screenshots.py                 # the demo run (80 steps: minutes), then the PNGs
    python docs/scripts/screenshots.py --reuse         # render again from the last capture (no run)

1. ``capture``: runs ``nanogrpo train`` (the demo, or the overrides given after ``--``) in a
   pseudo-terminal of a fixed size, as a user's terminal would run it (progress bar redrawn in place),
   and keeps every byte it printed with its time (``RUN/terminal.jsonl``);
2. ``render``: replays those bytes through a terminal emulator (``pyte``) and draws the screen at two
   moments, mid-run and at the end, as PNGs (matplotlib, a monospace font): ``docs/figures/
   train_terminal_mid.png`` and ``train_terminal_end.png``;
3. runs ``nanogrpo report RUN`` and keeps its overview and held-out plots as ``docs/figures/
   report_overview.png`` and ``report_heldout_accuracy.png``.

``--watch`` does the same for the run monitor: a run that goes wrong on purpose (the ``echo_judge`` fault of
``nanogrpo/bench/watch_faults.py``: a judge that likes a phrase) with ``watch.stop_on`` naming its rule,
the terminal at the end (the watch line, the run stopped) as ``docs/figures/watch_terminal.png``, and the
report's figure of the alarm as ``docs/figures/watch_report_event.png``.

PNGs are reduced to a 256-colour palette (Pillow) to keep the repository small. Needs the ``docs``
extra (pyte) and the ``report`` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs" / "figures"
COLS, ROWS = 150, 16


def capture(argv: list[str], log: Path, cols: int = COLS, rows: int = ROWS) -> int:
    """Run ``argv`` on a pseudo-terminal of ``cols`` x ``rows``; every chunk it prints, with its time,
    goes to ``log`` (JSON lines ``{"t": seconds, "b": latin-1 text}``). Returns the exit code."""
    import fcntl
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {**os.environ, "COLUMNS": str(cols), "LINES": str(rows), "TERM": "xterm-256color"}
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    start = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        while True:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    break
                t = round(time.monotonic() - start, 3)
                f.write(json.dumps({"t": t, "b": chunk.decode("latin-1")}) + "\n")
                f.flush()
            elif proc.poll() is not None:
                break
    os.close(master)
    return proc.wait()


def screens(log: Path, at: list[float], cols: int = COLS, rows: int = ROWS) -> list[list[str]]:
    """The terminal's screen (``rows`` lines of text) after the bytes printed up to each share of the
    run in ``at`` (0.5: half-way through the run's time, 1.0: the end)."""
    import pyte

    chunks = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    end = chunks[-1]["t"] if chunks else 0.0
    out = []
    for share in at:
        screen = pyte.Screen(cols, rows)
        stream = pyte.ByteStream(screen)
        for c in chunks:
            if c["t"] > share * end:
                break
            stream.feed(c["b"].encode("latin-1"))
        out.append([line.rstrip() for line in screen.display])
    return out


def render(lines: list[str], png: Path, title: str) -> None:
    """Draw a terminal screen as a PNG: light text on a dark background, a monospace font."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    while lines and not lines[-1]:
        lines = lines[:-1]
    width = max([len(line) for line in lines] + [60])
    fig = plt.figure(figsize=(width * 0.075 + 0.4, (len(lines) + 2) * 0.19 + 0.3), dpi=110)
    fig.patch.set_facecolor("#1e1e1e")
    fig.text(0.012, 0.985, title, color="#9cdcfe", family="DejaVu Sans Mono", fontsize=8.5, va="top")
    for i, line in enumerate(lines):
        colour = "#f48771" if line.startswith("WARNING") else "#d4d4d4"
        fig.text(0.012, 0.985 - (i + 1.6) / (len(lines) + 2.2), line, color=colour, family="DejaVu Sans Mono",
                 fontsize=8.5, va="top")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, facecolor=fig.get_facecolor())
    plt.close(fig)
    _palette(png)


def _palette(png: Path) -> None:
    from PIL import Image

    Image.open(png).convert("RGB").quantize(colors=256).save(png, optimize=True)


def _out(run: Path) -> list[str]:
    return [] if run == Path("runs/demo") else ["--out", str(run)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=Path("runs/demo"), help="the run directory (the demo's own)")
    ap.add_argument("--reuse", action="store_true", help="render the last capture again; run nothing")
    ap.add_argument("--watch", action="store_true", help="the run monitor's screenshots (a faulty run)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the demo run")
    a = ap.parse_args(argv)
    if a.watch:
        return watch_screens(a.run if a.run != Path("runs/demo") else Path("runs/watch-echo-judge"), a.reuse,
                             a.overrides)
    log = a.run / "terminal.jsonl"
    if not a.reuse:
        if a.run.exists():
            shutil.rmtree(a.run)
        code = capture([sys.executable, "-m", "nanogrpo.cli", "train", *_out(a.run), *a.overrides], log)
        if code != 0:
            print(f"nanogrpo train exited with {code}; its output is in {log}", file=sys.stderr)
            return code
    mid, end = screens(log, [0.5, 1.0])
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    cmd = f"$ {threads}nanogrpo train" + "".join(f" {o}" for o in [*_out(a.run), *a.overrides])
    render(mid, FIGURES / "train_terminal_mid.png", cmd + "      (half-way)")
    render(end, FIGURES / "train_terminal_end.png", cmd + "      (the end)")
    report = [sys.executable, "-m", "nanogrpo.cli", "report", str(a.run), "--out", str(a.run / "report")]
    subprocess.run(report, check=True)
    for name in ("overview", "heldout_accuracy"):
        shutil.copyfile(a.run / "report" / f"{name}.png", FIGURES / f"report_{name}.png")
        _palette(FIGURES / f"report_{name}.png")
    print(f"screenshots: {FIGURES}/train_terminal_{{mid,end}}.png, report_{{overview,heldout_accuracy}}.png")
    return 0


def watch_screens(run: Path, reuse: bool, overrides: list[str]) -> int:
    """``--watch``: the echo_judge fault, stopped by its rule; the terminal's end and the alarm's figure."""
    from nanogrpo.bench.watch_faults import FAULTS, SMALL

    fault = FAULTS["echo_judge"]
    keys = [*SMALL, *fault.overrides, f"train.steps={fault.steps}", f'watch.stop_on=["{fault.rule}"]',
            *overrides]
    log = run / "terminal.jsonl"
    if not reuse:
        if run.exists():
            shutil.rmtree(run)
        argv = [sys.executable, "-m", "nanogrpo.cli", "train", "--out", str(run), *keys]
        code = capture(argv, log, rows=20)
        if code != 0:
            print(f"nanogrpo train exited with {code}; its output is in {log}", file=sys.stderr)
            return code
    (end,) = screens(log, [1.0], rows=20)
    shown = " ".join(k if "[" not in k else f"'{k}'" for k in keys)
    render(end, FIGURES / "watch_terminal.png", f"$ nanogrpo train --out {run} {shown}")
    subprocess.run([sys.executable, "-m", "nanogrpo.cli", "report", str(run), "--out", str(run / "report")],
                   check=True)
    (fig,) = sorted((run / "report").glob(f"watch_*_{fault.rule}_*.png"))
    shutil.copyfile(fig, FIGURES / "watch_report_event.png")
    _palette(FIGURES / "watch_report_event.png")
    print(f"screenshots: {FIGURES}/watch_terminal.png, watch_report_event.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
