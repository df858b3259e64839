"""What logging the policy's entropy costs the update step.

The update step (``nanogrpo.training.step.policy_update``: lean log-probs, the GRPO loss, backward,
AdamW) on a random-init model of a named shape, timed with the per-token entropy computed in the
same chunked pass as the log-probs (what every step now does) and with it switched off (the pass
as it was: ``token_stats(entropy="none")``), alternating A/B/A/B so that both see the same machine
load; then the same with the entropy bonus on (``grpo.entropy_coef``: the entropy's gradient too).
Prints one JSON line: median step seconds of each (wall clock, and the process's CPU time, which a
shared machine's load disturbs far less at one thread), the overhead in percent.

    python bench/entropy_cost.py --shape qwen2.5-0.5b --rows 8 --len 128 --threads 2
    python bench/entropy_cost.py --shape small --rows 32 --len 64            # the demo-sized model
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="nanogrpo.models.tiny.SHAPES")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds (the first is left out)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    import nanogrpo.training.micro as micro
    import nanogrpo.training.step as step
    from bench.backend_step import make_batch
    from nanogrpo.config import Config
    from nanogrpo.models.tiny import make_model
    from nanogrpo.training.distributed import Backend

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = make_model(a.shape, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    model.config.use_cache = False
    be = Backend(model, lr=1e-7)
    batch = make_batch(a.rows, a.prompt, a.len, model.config.vocab_size).to(device)
    stats = micro.token_stats

    def no_entropy(*args, entropy="none", **kw):
        return stats(*args, entropy="none", **kw)

    def run(variant: str) -> tuple[float, float]:
        coef = 0.01 if variant == "bonus" else 0.0
        cfg = Config.model_validate({"grpo": {"beta": 0.04, "entropy_coef": coef},
                                     "rollout": {"max_new_tokens": a.len}})
        micro.token_stats = no_entropy if variant == "off" else stats
        try:
            if cuda:
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            step.policy_update(be, batch, cfg, on_policy=True)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0, time.process_time() - c0
        finally:
            micro.token_stats = stats

    times: dict[str, list[tuple[float, float]]] = {"off": [], "on": [], "bonus": []}
    for _ in range(a.rounds):
        for v in times:
            times[v].append(run(v))
    med = {v: statistics.median(w for w, _ in t[1:] or t) for v, t in times.items()}
    cpu = {v: statistics.median(c for _, c in t[1:] or t) for v, t in times.items()}
    print(json.dumps({
        "shape": a.shape, "rows": a.rows, "len": a.len, "prompt": a.prompt, "vocab": model.config.vocab_size,
        "step_s_median": {v: round(t, 4) for v, t in med.items()},
        "step_cpu_s_median": {v: round(t, 4) for v, t in cpu.items()},
        "entropy_logging_overhead_pct": round(100 * (med["on"] / med["off"] - 1), 2),
        "entropy_bonus_overhead_pct": round(100 * (med["bonus"] / med["off"] - 1), 2),
        "entropy_logging_overhead_cpu_pct": round(100 * (cpu["on"] / cpu["off"] - 1), 2),
        "entropy_bonus_overhead_cpu_pct": round(100 * (cpu["bonus"] / cpu["off"] - 1), 2),
        "step_s": {v: [round(w, 4) for w, _ in t] for v, t in times.items()},
        "step_cpu_s": {v: [round(c, 4) for _, c in t] for v, t in times.items()},
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
