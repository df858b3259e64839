"""``nanogrpo bench watch``: does the run monitor catch what it should, and only that?

Two kinds of runs, each its own process (``--threads`` torch threads; on a shared 2-core machine 1),
into ``OUT/<name>``:

- the faults of :mod:`nanogrpo.bench.watch_faults` (runs that go wrong on purpose): for each, the step its
  rule fired at, against the fault's onset and the bound it is held to;
- the shipped demos over their full runs (``--demos``): any rule that fires there is a false alarm.

A finished run is not run again, so the command can be re-run to fill in what is missing. At the end it
writes ``OUT/watch.md`` and ``OUT/watch.json`` (per run: what fired, at which step, since when; wall time).

    nanogrpo bench watch --out runs/watch                       # the faults
    nanogrpo bench watch --out runs/watch --demos --only none    # the demos' full runs only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from nanogrpo.bench.watch_faults import FAULTS, SMALL, Fault, PerturbedLogprobs

DEMOS = ["demo", "demo-tools", "demo-game", "demo-dialogue", "demo-vision", "demo-rm", "demo-distill",
         "demo-moe"]
"""The shipped demos (their presets), run whole: no rule may fire."""


@contextlib.contextmanager
def perturbed_engine(**kw):
    """Inside: every run this process trains gets its engine wrapped in :class:`PerturbedLogprobs`
    (the fault injection: the engine factory the run's setup calls swapped, and put back on exit)."""
    from nanogrpo.engines import factory

    real = factory.engine_for
    factory.engine_for = lambda *a, **k: PerturbedLogprobs(real(*a, **k), **kw)
    try:
        yield
    finally:
        factory.engine_for = real


def fault_config(name: str, out: Path, steps: int | None = None, overrides: list[str] = ()):
    from nanogrpo.config import Config

    f = FAULTS[name]
    return Config.load("demo", [*SMALL, *f.overrides, f"train.steps={steps or f.steps}", f"train.out={out}",
                                *overrides])


def run_fault(name: str, out: Path, steps: int | None = None, overrides: list[str] = ()) -> Path:
    """Train fault ``name`` into ``out`` in this process (the engine fault's wrapper included)."""
    from nanogrpo.training.loop import train
    from nanogrpo.training.prepare import prepare

    cfg = fault_config(name, out, steps, overrides)
    f: Fault = FAULTS[name]
    with perturbed_engine(**f.perturb) if f.perturb else contextlib.nullcontext():
        return train(prepare(cfg))


def caught(events: list[dict], f: Fault) -> dict:
    """The fault's verdict from its run's events: the step its rule fired at, and whether that is within
    its bound; every other rule that fired too."""
    hit = next((e for e in events if e["rule"] == f.rule), None)
    step = hit["step"] if hit else None
    return {"rule": f.rule, "onset": f.onset, "within": f.within, "fired_at": step,
            "since": hit["since"] if hit else None,
            "steps_after_onset": None if step is None else step - f.onset,
            "ok": step is not None and step - f.onset <= f.within,
            "others": sorted({e["rule"] for e in events if e["rule"] != f.rule})}


def export_stream(run: Path, path: Path) -> Path:
    """A run's metrics as the rules read them (:data:`nanogrpo.watch.rules.READS` and ``reward/<name>``),
    after one line of facts (the run, its steps, the reward weights): what a test replays."""
    from nanogrpo.config import load_config
    from nanogrpo.training.metrics import read_metrics
    from nanogrpo.watch.rules import READS

    cfg = load_config(run / "config.yaml")
    fns = cfg.rewards.functions
    made = datetime.date.fromtimestamp((run / "metrics.jsonl").stat().st_mtime)
    weights = dict(zip(fns, cfg.rewards.weights or [1.0] * len(fns)))
    meta = {"run": run.name, "steps": cfg.train.steps, "weights": weights,
            "made": f"{run.name} whole (bench watch --demos), {made}"}

    def read(k: str) -> bool:
        return k == "step" or k in READS or (k.startswith("reward/") and k.count("/") == 1)

    keep = [{k: v for k, v in r.items() if read(k)} for r in read_metrics(run / "metrics.jsonl")]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in [meta, *keep]))
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanogrpo bench watch", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/watch"), help="directory of the runs and tables")
    p.add_argument("--only", default="", help="comma-separated faults (default: all; 'none': no fault)")
    p.add_argument("--demos", action="store_true", help="also run the shipped demos whole (false alarms)")
    p.add_argument("--threads", type=int, default=1, help="OMP / torch threads of each run (0: unset)")
    p.add_argument("--export", type=Path, metavar="DIR",
                   help="write the demos' metric streams (what the rules read) from OUT into DIR and stop "
                        "(tests/data/watch: the tests replay them)")
    p.add_argument("--run", help=argparse.SUPPRESS)  # one fault, in this process (what each child runs)
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()] if a.only else list(FAULTS)
    names = [] if names == ["none"] else names
    bad = [n for n in names if n not in FAULTS]
    if bad:
        p.error(f"unknown fault(s) {', '.join(bad)}; known: {', '.join(FAULTS)}")
    a.names = names
    return a


def _child(argv: list[str], log: Path, threads: int) -> tuple[int, float]:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    return rc, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.run:
        run_fault(a.run, a.out)
        return 0
    if a.export:
        for d in DEMOS:
            if (a.out / d / "metrics.jsonl").is_file():
                print(f"[bench watch] {export_stream(a.out / d, a.export / f'{d}.jsonl')}")
        return 0
    from nanogrpo.watch import read_events

    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    cli = [sys.executable, "-m", "nanogrpo.cli"]
    jobs = [(n, [*cli, "bench", "watch", "--run", n, "--out", str(a.out / n)]) for n in a.names]
    if a.demos:
        jobs += [(d, [*cli, "train", "--config", d, "--out", str(a.out / d)]) for d in DEMOS]
    for name, cmd in jobs:
        run = a.out / name
        done = (run / "watch.jsonl").is_file() and (run / "metrics.jsonl").is_file() and \
            (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("step_*"))
        wall = None
        if not done or not (run / "bench_wall_s").is_file():
            print(f"[bench watch] {name}: {' '.join(cmd[1:])}", flush=True)
            run.mkdir(parents=True, exist_ok=True)
            rc, wall = _child(cmd, a.out / f"{name}.log", a.threads)
            if rc != 0:
                print(f"[bench watch] {name} failed (exit {rc}); see {a.out / f'{name}.log'}", flush=True)
                results[name] = {"error": f"exit {rc}"}
                continue
            (run / "bench_wall_s").write_text(f"{wall:.1f}\n")
        wall = float((run / "bench_wall_s").read_text())
        events = read_events(run)
        res = {"wall_s": wall,
               "events": [{k: e[k] for k in ("rule", "step", "since", "message")} for e in events]}
        if name in FAULTS:
            res.update(caught(events, FAULTS[name]))
        else:
            res["false_alarms"] = len(events)
        results[name] = res
        said = (f"{res['rule']} fired at step {res['fired_at']} (onset {res['onset']}, bound {res['within']})"
                if name in FAULTS else f"{len(events)} alarm(s)")
        print(f"[bench watch] {name}: {said}, {wall / 60:.1f} min", flush=True)
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "threads": a.threads, "load": os.getloadavg()}
    (a.out / "watch.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (a.out / "watch.md").write_text(table(results, meta))
    print((a.out / "watch.md").read_text())
    return 0 if all(r.get("ok", r.get("false_alarms") == 0) for r in results.values()) else 1


def table(results: dict[str, dict], meta: dict) -> str:
    lines = [f"# nanogrpo bench watch ({meta['date']}, {meta['cpus']} CPUs, {meta['threads']} thread(s) "
             "a run)",
             "", "| run | rule meant to catch it | fired at step (onset, bound) | other rules | wall |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | | {r['error']} | | |")
        elif "rule" in r:
            at = r["fired_at"] if r["fired_at"] is not None else "never"
            lines.append(f"| {name} | {r['rule']} | {at} "
                         f"({r['onset']}, +{r['within']}) | {', '.join(r['others']) or '-'} | "
                         f"{r['wall_s'] / 60:.1f} min |")
        else:
            fired = ", ".join(f"{e['rule']}@{e['step']}" for e in r["events"]) or "none"
            lines.append(f"| {name} (demo, whole) | none | {fired} | | {r['wall_s'] / 60:.1f} min |")
    return "\n".join(lines) + "\n"
