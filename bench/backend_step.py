"""One GRPO update step through a training backend, timed, under that backend's launcher.

The same step as the trainer's (``nanogrpo.training.step.policy_update``: lean log-probs,
token-budget micro-batches, clipping, AdamW) on a random-init model of a named shape,
wrapped by the backend the config names: ``single``, ``ddp``, ``fsdp2`` or ``deepspeed``
(ZeRO 1-3, optionally with the optimizer on the CPU, the seed's setup). Each rank
updates on its share of ``--rows`` completions of ``--len`` tokens (prompts of
``--prompt`` tokens shared by groups of 8), with reference log-probs given (the reference
model is out of process, as in the seed). Prints one JSON line from rank 0: median step
time, peak device memory (the largest rank's), loss; with $OUT set, appends it to
``$OUT/backend_step.jsonl``.

    python bench/backend_step.py --backend single --shape qwen2.5-1.5b
    torchrun --nproc_per_node 1 bench/backend_step.py --backend fsdp2 --shape qwen2.5-1.5b
    deepspeed --num_gpus 1 bench/backend_step.py --backend deepspeed --stage 2 --offload 1
    bash bench/gpu_backends.sh        # all of them on one GPU (installs carried DeepSpeed wheels)

On the CPU it runs as well (gloo, float32; DeepSpeed picks its CPU accelerator itself):
``tests/test_distributed.py`` runs it there on a tiny shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_batch(n: int, prompt: int, length: int, vocab: int, group: int = 8, seed: int = 0):
    """n completions of ``length`` tokens; groups of ``group`` rows share a ``prompt``-token prompt."""
    from nanogrpo.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (-(-n // group), prompt), generator=g).repeat_interleave(group, 0)[:n]
    ids = torch.cat([prompts, torch.randint(3, vocab, (n, length), generator=g)], 1)
    adv = torch.randn(n, generator=g)
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones(n, prompt + length, dtype=torch.int8),
                        completion_mask=torch.ones(n, length, dtype=torch.bool), rewards=adv.clone(),
                        advantages=adv, group_ids=torch.arange(n) // group,
                        old_logprobs=torch.zeros(n, length), prompt_len=prompt, group_size=group,
                        ref_logprobs=-torch.rand(n, length, generator=g) * 5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["single", "ddp", "fsdp2", "deepspeed"], default="single")
    ap.add_argument("--stage", type=int, default=2, help="DeepSpeed ZeRO stage")
    ap.add_argument("--offload", type=int, default=0, help="optimizer (and its states) on the CPU: 0/1")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="nanogrpo.models.tiny.SHAPES")
    ap.add_argument("--rows", type=int, default=16, help="completions per step, over all ranks")
    ap.add_argument("--len", type=int, default=512, help="completion tokens each")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens each")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--grad-ckpt", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="the first is left out of the median")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher
    a = ap.parse_args(argv)

    from nanogrpo.config import Config
    from nanogrpo.models.tiny import make_model
    from nanogrpo.training.distributed import init_distributed, make_backend
    from nanogrpo.training.step import policy_update

    init_distributed(a.backend)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = Config.model_validate({
        "grpo": {"beta": 0.04},
        "train": {"backend": a.backend, "zero_stage": a.stage, "optimizer_offload": bool(a.offload),
                  "micro_batch_size": a.micro_batch_size, "gradient_checkpointing": bool(a.grad_ckpt),
                  "lr": 1e-6},
        "rollout": {"max_new_tokens": a.len},
    })
    t0 = time.perf_counter()
    model = make_model(a.shape, dtype=dtype, device=device)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    be = make_backend(cfg, model)
    build_s = time.perf_counter() - t0
    full = make_batch(a.rows, a.prompt, a.len, model.config.vocab_size)
    rows = torch.arange(a.rows)[be.rank::be.world_size]
    batch = full.select(rows).to(device) if rows.numel() else None
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(a.steps):
        if cuda:
            torch.cuda.synchronize()
        be.barrier()
        s = time.perf_counter()
        res = policy_update(be, batch, cfg, on_policy=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
        losses.append(res.loss)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    peak, slowest = be.all_reduce([peak, statistics.median(times[1:] or times)], ops=["max", "max"])
    if be.is_main:
        row = {"backend": a.backend, "stage": a.stage if a.backend == "deepspeed" else None,
               "offload": bool(a.offload), "world": be.world_size, "shape": a.shape,
               "params_b": round(n_params / 1e9, 3), "rows": a.rows, "len": a.len, "prompt": a.prompt,
               "micro_batch_size": a.micro_batch_size, "grad_ckpt": bool(a.grad_ckpt),
               "step_s_median": round(slowest, 3), "peak_gpu_gib": round(peak, 2) if cuda else None,
               "build_s": round(build_s, 1), "loss": losses, "step_s": [round(t, 3) for t in times],
               "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
        line = json.dumps(row)
        print(line, flush=True)
        if os.environ.get("OUT"):
            with open(Path(os.environ["OUT"]) / "backend_step.jsonl", "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
