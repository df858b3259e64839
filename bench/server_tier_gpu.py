"""The server tier on GPUs: sync time and rollout tokens/s with 1 and 2 vLLM servers (Qwen2.5-0.5B and 7B
shapes, random init: no download). Not run yet (no GPU lent to this project); written for a GPU session:

    pip install -e ".[vllm-gpu,dev]"
    python bench/server_tier_gpu.py --shape qwen2.5-0.5b --transfer nccl     # trainer GPU 0, servers GPU 1, 2
    python bench/server_tier_gpu.py --shape qwen2.5-7b --transfer nccl

The trainer's model lives on GPU 0; server ``i`` runs on GPU ``i + 1`` (``--transfer ipc``: one server on
GPU 0 beside the trainer). For 1 and then 2 servers: ``--repeats`` syncs (median time, GB/s per server),
(with 2 servers, one after another and at once, ``vllm_server.parallel_sync``, alternating),
then one rollout of ``--prompts`` x ``--group`` samples of ``--new-tokens`` tokens each (EOS ignored, so
every sample has the same length): tokens/s over the servers. One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--transfer", default="nccl", choices=["nccl", "ipc"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    a = ap.parse_args(argv)

    from nanogrpo.config import Config
    from nanogrpo.engines.base import SamplingParams
    from nanogrpo.engines.vllm_server import state_source
    from nanogrpo.engines.vllm_server.engine import ServerEngine
    from nanogrpo.engines.vllm_server.http import ServerClient
    from nanogrpo.engines.vllm_server.pool import ServerPool
    from nanogrpo.engines.vllm_server.sync import WeightSync
    from nanogrpo.launch import start, wait_healthy
    from nanogrpo.models.tiny import make_model, make_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="nanogrpo-bench-gpu-"))
    tok = make_tokenizer()
    model = make_model(a.shape, tok, seed=0, dtype=torch.bfloat16)
    model.save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    model = model.to("cuda:0").eval()
    counts = [1] if a.transfer == "ipc" else [1, 2]
    ports = [_port() for _ in range(max(counts))]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    cfg = Config.load(None, [f"model.path={tmp / 'model'}", "model.dtype=bfloat16",
                             "rollout.engine=vllm_server", "rollout.servers=" + json.dumps(urls),
                             f"vllm_server.transfer={a.transfer}",
                             f"vllm_server.gpu_memory_utilization={0.4 if a.transfer == 'ipc' else 0.85}",
                             "data.max_prompt_tokens=64", f"rollout.max_new_tokens={a.new_tokens}"])
    procs = [start(cfg, p, state_dir=tmp, devices=str(0 if a.transfer == "ipc" else i + 1),
                   log=tmp / f"server{i}.log") for i, p in enumerate(ports)]
    try:
        for u, pr, i in zip(urls, procs, range(len(procs)), strict=True):
            wait_healthy(u, pr, log=tmp / f"server{i}.log")
        for n in counts:
            pool = ServerPool([ServerClient(u) for u in urls[:n]])
            engine = ServerEngine(pool, [tok.eos_token_id], ignore_eos=True, concurrency=256)
            sync = WeightSync(pool, state_source(model, torch.bfloat16), transfer=a.transfer)
            times, at_once = [], []
            v = 0
            for r in range(a.repeats + 1):  # with 2 servers also at once (parallel_sync), A B A B
                for parallel in ([False, True] if n > 1 else [False]):
                    v += 1
                    sync.parallel = parallel
                    out = sync.sync(v)
                    if r > 0:
                        (at_once if parallel else times).append(out["sync/time_s"])
            engine.min_version = engine.max_version = v
            gb = out["sync/mb"] / 1024 / n
            med = sorted(times)[len(times) // 2]
            prompts = [[5 + (i % 90)] * 32 for i in range(a.prompts)]
            params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, n=a.group, seed=0)
            engine.generate(prompts[:4], SamplingParams(max_new_tokens=8, n=1, seed=0))  # warm up
            t0 = time.perf_counter()
            g = engine.generate(prompts, params)
            dt = time.perf_counter() - t0
            toks = sum(len(c) for c in g.completion_ids)
            print(json.dumps({"bench": "server_tier_gpu", "shape": a.shape, "transfer": a.transfer,
                              "servers": n,
                              "gb_per_server": round(gb, 2), "sync_s_median": round(med, 3),
                              "gb_per_s_per_server": round(gb / med, 1),
                              "sync_s_median_at_once": round(sorted(at_once)[len(at_once) // 2], 3)
                              if at_once else None, "rollout_tokens": toks,
                              "rollout_s": round(dt, 2), "tokens_per_s": round(toks / dt)}), flush=True)
            sync.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
