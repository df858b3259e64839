"""``nanogrpo bench moe``: the MoE demo (``--config demo-moe``) in bfloat16 without routing replay, with it
(R3), and under GSPO without it; same seed and steps, one run after another; a table of the train-inference
mismatch, the router disagreement, held-out accuracy and time.

Why bfloat16: in float32 the hf engine's decode and the trainer's forward route every token alike (mismatch
~3e-7, no flips), so there is nothing for replay to remove; in bfloat16 they round differently and some
routers pick another expert, as on a GPU. Each setting (:data:`SETTINGS`) is the preset plus
``model.dtype=bfloat16`` and its keys, run as its own ``nanogrpo train`` process (``--threads`` torch
threads) into ``OUT/<setting>``; a finished run is not run again (an interrupted one is resumed). At the
end it writes ``OUT/moe.md`` and ``OUT/moe.json``: per setting the mean over the steps of
``mismatch_abs``, ``mismatch_kl``, ``mismatch_ratio_out``, ``router_disagreement`` and ``clip_frac``, the
largest ``mismatch_abs_max``, held-out accuracy at step 0 and at the end, the median step time, and the
run's wall and CPU time (user + system of its process); and, with matplotlib, ``OUT/moe.png``: those per
step, one line per setting (``nanogrpo report``'s panels).

    nanogrpo bench moe --out runs/moe-bf16 --threads 1
    nanogrpo bench moe --out runs/moe-bf16 --only grpo,r3 --steps 20
    nanogrpo bench moe --out runs/moe-bf16-mb4 --only grpo+mb4,r3+mb4,gspo+mb4
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from nanogrpo.bench.sweep import chosen, machine_meta, read_rows, run_sweep, thread_env

PRESET = "demo-moe"
BASE = ["model.dtype=bfloat16"]
"""Every setting's first keys: bfloat16 weights and compute (float32 masters in the optimizer)."""
SETTINGS: dict[str, list[str]] = {
    "grpo": ['moe.routing_replay="off"', "grpo.loss=grpo"],
    "r3": ['moe.routing_replay="rollout"', "grpo.loss=grpo"],
    "gspo": ['moe.routing_replay="off"', "grpo.loss=gspo"],
    "grpo+mb4": ['moe.routing_replay="off"', "grpo.loss=grpo", "grpo.mini_batches=4"],
    "r3+mb4": ['moe.routing_replay="rollout"', "grpo.loss=grpo", "grpo.mini_batches=4"],
    "gspo+mb4": ['moe.routing_replay="off"', "grpo.loss=gspo", "grpo.mini_batches=4"],
}
"""Setting name -> its keys on top of the preset and :data:`BASE`. The demo takes one optimizer step per
batch, whose ratio is exactly 1 (the hf engine counts as exact: nanogrpo.training.schedule), so there the
mismatch is measured but enters no loss; with four (``+mb4``) the later ones are anchored on the engine's
log-probs, where a flipped route moves the ratio."""
DEFAULT = ("grpo", "r3", "gspo")
MEANS = ("mismatch_abs", "mismatch_kl", "mismatch_ratio_out", "router_disagreement", "clip_frac")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanogrpo bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/moe-bf16"), help="directory of the runs and tables")
    p.add_argument("--only", default="", help=f"comma-separated settings (default: {','.join(DEFAULT)}; "
                                              f"known: {', '.join(SETTINGS)})")
    p.add_argument("--steps", type=int, default=0, help="train.steps (0: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="train.seed, the same for every setting")
    p.add_argument("--threads", type=int, default=1, help="OMP / torch threads of each run (0: unset)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every setting")
    a = p.parse_args(argv)
    a.names = chosen(p, a.only, SETTINGS, DEFAULT)
    return a


def summarize(name: str, run: Path, times: dict | None) -> dict:
    """One setting's line from its run's metrics (and its wall / CPU seconds, when this command ran it)."""
    rows = read_rows(run)
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    out: dict = {"setting": name, "keys": SETTINGS[name], "steps": len(steps)}
    for k in MEANS:
        vals = [r[k] for r in steps if r.get(k) is not None]
        out[k] = statistics.fmean(vals) if vals else None
    tops = [r["mismatch_abs_max"] for r in steps if r.get("mismatch_abs_max") is not None]
    out["mismatch_abs_max"] = max(tops) if tops else None
    out["heldout_acc_start"] = evals[0]["eval/accuracy"] if evals else None
    out["heldout_acc_end"] = evals[-1]["eval/accuracy"] if evals else None
    out["heldout_curve"] = [(r["step"], r["eval/accuracy"]) for r in evals]
    st = [r["step_time_s"] for r in steps if r.get("step_time_s") is not None]
    out["step_time_median_s"] = statistics.median(st) if st else None
    out["wall_s"], out["cpu_s"] = (times or {}).get("wall_s"), (times or {}).get("cpu_s")
    return out


def table(lines: list[dict]) -> str:
    def f(v, spec):
        return "–" if v is None else format(v, spec)

    out = ["| setting | keys | mismatch_abs | mismatch_abs_max | mismatch_kl | mismatch_ratio_out | "
           "router_disagreement | clip_frac | held-out acc step 0 → end | step time (median) | wall / CPU |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in lines:
        wall = "–" if x["wall_s"] is None else f"{x['wall_s'] / 60:.1f} / {x['cpu_s'] / 60:.1f} min"
        out.append(f"| {x['setting']} | `{' '.join(x['keys'])}` | {f(x['mismatch_abs'], '.2e')} | "
                   f"{f(x['mismatch_abs_max'], '.3f')} | {f(x['mismatch_kl'], '.2e')} | "
                   f"{f(x['mismatch_ratio_out'], '.2e')} | {f(x['router_disagreement'], '.2e')} | "
                   f"{f(x['clip_frac'], '.2e')} | "
                   f"{f(x['heldout_acc_start'], '.3f')} → {f(x['heldout_acc_end'], '.3f')} | "
                   f"{f(x['step_time_median_s'], '.1f')} s | {wall} |")
    return "\n".join(out)


def plot(runs: list[Path], out: Path) -> Path | None:
    """The runs' per-step mismatch, router disagreement, clip fraction, held-out accuracy and step time in
    one figure (``nanogrpo report``'s drawing), or None without matplotlib."""
    from nanogrpo.report import Panel, draw_panel, label_runs, load_run, pyplot, run_colors

    plt = pyplot()
    if plt is None:
        return None
    data = [load_run(r) for r in runs]
    label_runs(data)
    panels = [Panel("", "mean |Δ log p|, trainer vs engine", "nats per token", "mismatch_abs"),
              Panel("", "largest |Δ log p| of the step", "nats", "mismatch_abs_max"),
              Panel("", "k3 KL(engine ‖ trainer)", "per token", "mismatch_kl"),
              Panel("", "router disagreement", "share of (token, layer)", "router_disagreement"),
              Panel("", "held-out accuracy", "accuracy", None, "eval/accuracy", share=True),
              Panel("", "step time", "seconds per step", "step_time_s")]
    fig, axes = plt.subplots(2, 3, figsize=(18, 8), dpi=80)
    colors = run_colors(plt, len(data))
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, data, panel, colors)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from nanogrpo.config import config_from

    steps = a.steps or config_from(PRESET).train.steps
    rc, times = run_sweep(a.names, a.out, steps, lambda name, run: [
        "--config", PRESET, "--out", str(run), "--steps", str(steps), "--seed", str(a.seed), *BASE,
        *SETTINGS[name], *a.overrides], thread_env(a.threads), a.out / "times.json")
    if rc:
        return rc
    lines = [summarize(n, a.out / n, times.get(n)) for n in a.names if read_rows(a.out / n)]
    meta = machine_meta(threads=a.threads, seed=a.seed, steps=steps, base=BASE, overrides=a.overrides)
    (a.out / "moe.json").write_text(json.dumps({"meta": meta, "settings": lines}, indent=1))
    md = table(lines)
    (a.out / "moe.md").write_text(md + "\n")
    print(md)
    if lines and (png := plot([a.out / x["setting"] for x in lines], a.out / "moe.png")) is not None:
        print(f"figure: {png}")
    return 0
