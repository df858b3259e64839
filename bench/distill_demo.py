"""demo-distill beside GRPO alone: held-out curves, steps to the teacher's accuracy, wall and CPU time.

Runs ``nanogrpo train --config demo-distill`` as shipped and the same config without its teacher (GRPO alone:
the rewards train; ``distill.teacher=""``), at the preset's lr and at the GRPO demo's (1.5e-4), one run at a
time, each its own process; then prints one markdown table (docs/figures.md, "The student learns from a
teacher"): the held-out accuracy at each evaluation, the teacher's (step 0 of the distillation run), the
first evaluated step at or above it (or the gap left at the end), ``nanogrpo train``'s wall time and the CPU
time it and its children used, and the load average around each run (the CPU time is inflated when the
machine is oversubscribed).

    python bench/distill_demo.py --out runs/distill-bench                 # all three
    python bench/distill_demo.py --out runs/distill-bench --runs distill  # one of: distill, grpo, grpo-lr
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "distill": [],                                                     # the preset as shipped
    "grpo": ["distill.teacher=\"\""],                                  # the same, the rewards training
    "grpo-lr": ["distill.teacher=\"\"", "train.lr=1.5e-4"],            # GRPO at the GRPO demo's lr
}


def _run(name: str, out: Path, extra: list[str]) -> dict:
    """One ``nanogrpo train``: its metrics, wall and CPU time, and the load around it."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "nanogrpo.cli", "train", "--config", "demo-distill", "--out", str(run_dir),
           *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        raise SystemExit(f"{name}: nanogrpo train exited {rc}; see {out / f'{name}.log'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"name": name, "keys": " ".join(extra) or "(as shipped)", "wall_s": wall, "cpu_s": cpu,
            "load": (load0, os.getloadavg()[0]),
            "held": [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r],
            "teacher": next((r["eval/teacher/accuracy"] for r in rows if "eval/teacher/accuracy" in r), None)}


def table(results: list[dict]) -> str:
    """The markdown table of ``results`` (the teacher's accuracy from the distillation run)."""
    teacher = next((r["teacher"] for r in results if r["teacher"] is not None), None)
    steps = [s for s, _ in results[0]["held"]]
    head = "| run | keys | " + " | ".join(f"step {s}" for s in steps) + \
        " | steps to the teacher's | wall / CPU (min) | load |"
    lines = [head, "|" + "---|" * (len(steps) + 5)]
    for r in results:
        acc = dict(r["held"])
        reached = next((s for s, a in r["held"] if teacher is not None and a >= teacher), None)
        short = f"not reached: {100 * (teacher - r['held'][-1][1]):.1f} points short" if teacher else ""
        gap = "—" if teacher is None else (f"{reached}" if reached is not None else short)
        cells = " | ".join(f"{100 * acc[s]:.1f}%" if s in acc else "" for s in steps)
        lines.append(f"| {r['name']} | `{r['keys']}` | {cells} | {gap} | {r['wall_s'] / 60:.1f} / "
                     f"{r['cpu_s'] / 60:.1f} | {r['load'][0]:.1f}–{r['load'][1]:.1f} |")
    if teacher is not None:
        lines.append(f"\nThe teacher (embedded-distill) held out: {100 * teacher:.1f}%.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/distill-bench"))
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    a = ap.parse_args(argv)
    names = [n for n in a.runs.split(",") if n]
    bad = [n for n in names if n not in RUNS]
    if bad:
        raise SystemExit(f"unknown run {bad[0]!r}: choose from {', '.join(RUNS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for n in names:
        results.append(_run(n, a.out, RUNS[n]))
        (a.out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"{n}: {results[-1]['held']} in {results[-1]['wall_s']:.0f} s wall, "
              f"{results[-1]['cpu_s']:.0f} s CPU", flush=True)
    text = table(results)
    (a.out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
