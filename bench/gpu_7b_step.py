"""One GRPO update step on a random-init Qwen2.5-7B-shaped model within 80 GB of GPU memory.

The seed's single-GPU setup, done by nanogrpo: bf16 weights and gradients on the
GPU, float32 master weights and AdamW moments on the CPU (``MasterAdamW(offload=True)``),
reference model out of process (its log-probs arrive with the batch: random
here), lean log-probs, gradient checkpointing. 8 completions x 512 tokens
(prompt 128). Reports peak GPU memory and step time; skips without CUDA.

    python bench/gpu_7b_step.py                 # caps this process at 80 GB on a bigger card
    python bench/gpu_7b_step.py --steps 3 --shape qwen2.5-7b --limit-gb 80

Prints a table; with $OUT set, writes $OUT/gpu_7b_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--limit-gb", type=float, default=80.0)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--no-checkpointing", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_7b_step: no CUDA device; skipped")
        return 0
    from nanogrpo.batch import RolloutBatch
    from nanogrpo.config import Config
    from nanogrpo.models.tiny import make_model
    from nanogrpo.training.distributed import Backend
    from nanogrpo.training.step import policy_update

    total = torch.cuda.get_device_properties(0).total_memory
    frac = min(1.0, a.limit_gb * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(frac)
    t0 = time.perf_counter()
    model = make_model(a.shape, dtype=torch.bfloat16, device="cuda")
    if not a.no_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    nparams = sum(p.numel() for p in model.parameters())
    be = Backend(model, lr=1e-6, offload=True)
    t_build = time.perf_counter() - t0
    vocab = model.config.vocab_size
    n, p, c = a.n, a.prompt, a.len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, p + c), generator=g)
    adv = torch.randn(n, generator=g)
    ref = -torch.rand(n, c, generator=g) * 5  # the reference model is out of process: its log-probs arrive
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones(n, p + c, dtype=torch.int8),
                         completion_mask=torch.ones(n, c, dtype=torch.bool), rewards=adv.clone(),
                         advantages=adv, group_ids=torch.zeros(n, dtype=torch.long),
                         old_logprobs=torch.zeros(n, c), prompt_len=p, group_size=n,
                         ref_logprobs=ref).to("cuda")
    train = {"micro_batch_size": a.micro_batch_size, "optimizer_offload": True}
    cfg = Config.model_validate({"grpo": {"beta": 0.04}, "train": train, "rollout": {"max_new_tokens": c}})
    times, peaks, results = [], [], []
    for _ in range(a.steps):
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        s = time.perf_counter()
        res = policy_update(be, batch, cfg, on_policy=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
        peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        results.append(res.loss)
    row = {"device": torch.cuda.get_device_name(0), "shape": a.shape, "params_b": nparams / 1e9,
           "limit_gb": a.limit_gb, "completions": n, "completion_tokens": c, "prompt_tokens": p,
           "micro_batch_size": a.micro_batch_size, "checkpointing": not a.no_checkpointing,
           "peak_gpu_gib": max(peaks), "step_s": times, "step_s_median": sorted(times)[len(times) // 2],
           "build_s": t_build, "loss": results, "torch": torch.__version__}
    print(f"{'model':12} {'params':>7} {'tokens':>12} {'peak GiB':>9} {'step s (median)':>16}")
    print(f"{a.shape:12} {nparams / 1e9:6.2f}B {f'{n}x{c}':>12} {row['peak_gpu_gib']:9.2f} "
          f"{row['step_s_median']:16.2f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_7b_step.json").write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
