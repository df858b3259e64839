"""``nanogrpo bench variants``: the embedded demo under each main policy-optimisation setting, same seed and
budget, one after the other; a table and ``nanogrpo report``'s overlaid curves.

Each setting is the demo preset (``nanogrpo train`` with no arguments) plus its keys (:data:`SETTINGS`),
run as its own ``nanogrpo train`` process (``--threads`` torch threads; on a shared 2-core machine 1)
into ``OUT/<setting>``. A finished run is not run again (an interrupted one is resumed), so the command
can be re-run to fill in what is missing. At the end it writes ``OUT/variants.md`` and
``OUT/variants.json`` (held-out accuracy at step 0 and at the end, its gain, entropy at the end, wall
time, per setting) and the report of all runs in ``OUT/report`` (``heldout_accuracy.png``,
``entropy.png``, ...).

    nanogrpo bench variants --out runs/variants --threads 1
    nanogrpo bench variants --out runs/variants --only grpo,gspo --steps 40
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from nanogrpo.bench.sweep import chosen, machine_meta, read_rows, run_sweep, thread_env

SETTINGS: dict[str, list[str]] = {
    "grpo": ["grpo.loss=grpo"],
    "dapo": ["grpo.loss=dapo"],
    "dr_grpo": ["grpo.loss=dr_grpo"],
    "gspo": ["grpo.loss=gspo", "grpo.mini_batches=4"],
    "grpo+mb4": ["grpo.loss=grpo", "grpo.mini_batches=4"],
    "cispo": ["grpo.loss=cispo"],
    "cispo+mb4": ["grpo.loss=cispo", "grpo.mini_batches=4"],
    "sapo": ["grpo.loss=sapo"],
    "sapo+mb4": ["grpo.loss=sapo", "grpo.mini_batches=4"],
    "grpo+dynamic": ["grpo.loss=grpo", "grpo.dynamic_sampling=true"],
    "grpo+entropy": ["grpo.loss=grpo", "grpo.entropy_coef=0.01"],
}
"""Setting name -> its keys on top of the demo preset. With one optimizer step per batch the ratio is exactly
1 and the losses' gradients coincide (CISPO's is DAPO's, SAPO's and GSPO's are GRPO's); they differ off
policy, so GSPO, and CISPO and SAPO beside their on-policy runs, get four optimizer steps per batch
(``grpo.mini_batches``, where the clip or gate binds), with GRPO under the same schedule as their baseline."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanogrpo bench variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/variants"), help="directory of the runs and tables")
    p.add_argument("--only", default="", help="comma-separated settings (default: all of them)")
    p.add_argument("--steps", type=int, default=0, help="train.steps (0: the demo's)")
    p.add_argument("--seed", type=int, default=0, help="train.seed, the same for every setting")
    p.add_argument("--threads", type=int, default=1, help="OMP / torch threads of each run (0: unset)")
    p.add_argument("--no-report", action="store_true", help="skip nanogrpo report")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every setting")
    a = p.parse_args(argv)
    a.names = chosen(p, a.only, SETTINGS, SETTINGS)
    return a


def summarize(name: str, run: Path, wall_s: float | None) -> dict:
    """One setting's line: held-out accuracy at step 0 and at the last evaluation, entropy at the end."""
    rows = read_rows(run)
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    trained = [r for r in rows if r.get("entropy") is not None]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    acc0, acc1 = first.get("eval/accuracy"), last.get("eval/accuracy")
    return {"setting": name, "keys": SETTINGS[name], "steps": rows[-1]["step"] if rows else 0,
            "heldout_acc_start": acc0, "heldout_acc_end": acc1,
            "gain_points": None if acc0 is None or acc1 is None else round(100 * (acc1 - acc0), 1),
            "entropy_end": trained[-1]["entropy"] if trained else None,
            "eval_entropy_end": last.get("eval/entropy"),
            "train_acc_end": rows[-1].get("accuracy") if rows else None,
            "wall_s": wall_s, "train_s": round(sum(r.get("step_time_s") or 0.0 for r in rows), 1)}


def table(lines: list[dict]) -> str:
    def f(v, spec):
        return "–" if v is None else format(v, spec)

    out = ["| setting | keys | held-out acc step 0 | held-out acc end | gain (points) | entropy end "
           "(train / held-out) | wall time |", "|---|---|---|---|---|---|---|"]
    for x in lines:
        wall = "–" if x["wall_s"] is None else f"{x['wall_s'] / 60:.1f} min"
        out.append(f"| {x['setting']} | `{' '.join(x['keys'])}` | {f(x['heldout_acc_start'], '.3f')} | "
                   f"{f(x['heldout_acc_end'], '.3f')} | {f(x['gain_points'], '+.1f')} | "
                   f"{f(x['entropy_end'], '.3f')} / {f(x['eval_entropy_end'], '.3f')} | {wall} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    env = thread_env(a.threads)
    from nanogrpo.config import config_from

    steps = a.steps or config_from(None).train.steps
    rc, times = run_sweep(a.names, a.out, steps, lambda name, run: [
        "--out", str(run), "--steps", str(steps), "--seed", str(a.seed), *SETTINGS[name], *a.overrides],
        env, a.out / "wall_times.json")
    if rc:
        return rc
    lines = [summarize(n, a.out / n, times.get(n, {}).get("wall_s")) for n in a.names
             if read_rows(a.out / n)]
    meta = machine_meta(threads=a.threads, seed=a.seed, steps=steps, overrides=a.overrides)
    (a.out / "variants.json").write_text(json.dumps({"meta": meta, "settings": lines}, indent=1))
    md = table(lines)
    (a.out / "variants.md").write_text(md + "\n")
    print(md)
    if not a.no_report and lines:  # `nanogrpo report` over every run (its own process: a layer beside this)
        return subprocess.run([sys.executable, "-m", "nanogrpo.cli", "report",
                               *[str(a.out / x["setting"]) for x in lines], "--out", str(a.out / "report")],
                              env=env).returncode
    return 0
