"""The server tier's GPU transfers, vLLM's own trainer-side engines: ``nccl`` (trainer on GPU 0, a server on
GPU 1) and ``ipc`` (a server on the trainer's own GPU). After a sync the server's log-probs of a probe
prompt must equal the trainer's forward (float32 weights). ``gpu``-marked; skipped without CUDA (and
without a second GPU for nccl) or without vLLM (``pip install -e ".[vllm-gpu,dev]"``). Not run yet: no GPU
has been lent to this project (docs/unmeasured.md).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-gpu]')")

from nanogrpo.config import Config  # noqa: E402
from nanogrpo.launch import start, wait_healthy  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(transfer: str, device: str, server_gpu: str, tmp: Path) -> float:
    from transformers import AutoModelForCausalLM

    from nanogrpo.demos.arithmetic.build import embedded_path
    from nanogrpo.engines.base import SamplingParams
    from nanogrpo.engines.vllm_server import state_source
    from nanogrpo.engines.vllm_server.engine import ServerEngine
    from nanogrpo.engines.vllm_server.http import ServerClient
    from nanogrpo.engines.vllm_server.pool import ServerPool
    from nanogrpo.engines.vllm_server.sync import WeightSync

    port = _port()
    url = f"http://127.0.0.1:{port}"
    cfg = Config.load(None, ["rollout.engine=vllm_server", "rollout.servers=" + json.dumps([url]),
                             "model.dtype=float32", f"vllm_server.transfer={transfer}",
                             "vllm_server.gpu_memory_utilization=0.3"])
    proc = start(cfg, port, state_dir=tmp, devices=server_gpu, log=tmp / "server.log")
    try:
        wait_healthy(url, proc, log=tmp / "server.log")
        model = AutoModelForCausalLM.from_pretrained(str(embedded_path()), dtype=torch.float32)
        model = model.to(device).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        pool = ServerPool([ServerClient(url)])
        engine = ServerEngine(pool, [2])
        WeightSync(pool, state_source(model, torch.float32), transfer=transfer).sync(1)
        engine.min_version = engine.max_version = 1
        prompt = [1, 5, 6, 7, 8]
        ids, lps = engine.sample_on_server(pool.slots[0], prompt, SamplingParams(max_new_tokens=8, seed=3))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids], device=device)).logits[0, len(prompt) - 1:-1].float()
        mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids, device=device)[:, None])[:, 0]
        return float((mine.cpu() - torch.tensor(lps)).abs().max())
    finally:
        proc.terminate()
        proc.wait(timeout=120)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl: the trainer on GPU 0, the server on GPU 1")
def test_nccl_sync_gives_the_server_the_trainers_weights(tmp_path):
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count())))
    assert _probe("nccl", "cuda:0", "1", tmp_path) < 1e-3


def test_ipc_sync_gives_a_colocated_server_the_trainers_weights(tmp_path):
    assert _probe("ipc", "cuda:0", "0", tmp_path) < 1e-3
