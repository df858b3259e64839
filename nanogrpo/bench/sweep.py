"""A sweep: named settings of one preset, each run as its own ``nanogrpo train`` process into
``OUT/<setting>``, one after another; what ``nanogrpo bench variants`` and ``nanogrpo bench moe`` share.

A finished run (its last metrics row at the last step, with a held-out evaluation) is not run again and an
interrupted one is resumed, so a sweep can be re-run to fill in what is missing. Each run's wall and CPU
seconds (user + system of its process; a resumed run adds its parts) are kept in a JSON file beside the
runs, since the runs' own metrics cannot say what their processes cost."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def chosen(p: argparse.ArgumentParser, only: str, settings: Iterable[str],
           default: Iterable[str]) -> list[str]:
    """The settings ``--only`` names (comma-separated; empty: ``default``); an unknown one ends the command
    through ``p.error``, naming the known ones."""
    known = list(settings)
    names = [n.strip() for n in only.split(",") if n.strip()] or list(default)
    bad = [n for n in names if n not in known]
    if bad:
        p.error(f"unknown setting(s) {', '.join(bad)}; known: {', '.join(known)}")
    return names


def read_rows(run: Path) -> list[dict]:
    """A run's ``metrics.jsonl`` rows; [] before it has any."""
    from nanogrpo.training.metrics import read_metrics

    f = run / "metrics.jsonl"
    return read_metrics(f) if f.is_file() else []


def finished(run: Path, steps: int) -> bool:
    rows = read_rows(run)
    return bool(rows) and rows[-1].get("step") == steps and "eval/accuracy" in rows[-1]


def thread_env(threads: int) -> dict[str, str]:
    """This process's environment, with ``threads`` OMP / MKL threads for the runs (0: as it is)."""
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_sweep(names: list[str], out: Path, steps: int, fresh: Callable[[str, Path], list[str]],
              env: dict[str, str], times_file: Path) -> tuple[int, dict[str, dict]]:
    """Run each setting of ``names`` up to ``steps`` (``fresh(name, run)``: the ``nanogrpo train`` arguments
    after ``train`` that start it), skipping finished runs and resuming interrupted ones. Returns the first
    non-zero exit status (0 when every run ended well) and, per setting, its ``wall_s`` and ``cpu_s``
    (``times_file``, kept across sweeps; a bare number there is an older sweep's wall seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    kept = json.loads(times_file.read_text()) if times_file.is_file() else {}
    times = {k: v if isinstance(v, dict) else {"wall_s": v, "cpu_s": None} for k, v in kept.items()}
    for name in names:
        run = out / name
        if finished(run, steps):
            print(f"{name}: done already ({run})", file=sys.stderr)
            continue
        resume = (run / "checkpoints").is_dir()
        cmd = [sys.executable, "-m", "nanogrpo.cli", "train"]
        cmd += ["--resume", str(run), "--steps", str(steps)] if resume else fresh(name, run)
        print(f"{name}: {' '.join(cmd[3:])}", file=sys.stderr)
        t0, c0 = time.perf_counter(), _children_cpu()
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0:
            print(f"{name}: nanogrpo train exited {rc}", file=sys.stderr)
            return rc, times
        old = times.get(name, {})
        times[name] = {"wall_s": (old.get("wall_s") or 0.0) + time.perf_counter() - t0,
                       "cpu_s": (old.get("cpu_s") or 0.0) + _children_cpu() - c0}
        times_file.write_text(json.dumps(times, indent=1))
    return 0, times


def machine_meta(**extra) -> dict:
    """The date and the machine a sweep's tables were made on, with the sweep's own settings."""
    return {"date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} {platform.processor()} {os.cpu_count()} cores", **extra}
