"""Routing replay under DDP and FSDP2 (2 CPU ranks, gloo): the hooks sit on the routers inside the wrapped
model; each rank's replayed log-probs and the routers' averaged gradients equal one process's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanogrpo.algo.logprobs import token_logprobs
from nanogrpo.moe import moe_spec, replay_routes
from tests.moe_dist_worker import the_batch
from tests.moe_models import batch_tensors, build
from tests.test_distributed import LAUNCH_TIMEOUT, _env, _port, _run
from tests.test_moe import random_routes

WORKER = Path(__file__).parent / "moe_dist_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_replay_under_ddp_and_fsdp2_is_the_single_process_replay(backend, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_port()), str(WORKER), "--backend", backend, "--out", str(tmp_path)]
    out = _run(cmd, LAUNCH_TIMEOUT, env=_env())
    assert out.returncode == 0, out.stdout[-4000:]
    model = build("qwen3_moe")
    spec = moe_spec(model)
    batch = the_batch(lambda ids: random_routes(spec, *ids.shape, seed=11, prompt_len=batch_tensors()[3]))
    with replay_routes(model, batch.routes, batch.input_ids, batch.attention_mask):
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                            batch.completion_mask, share_prefix=False)
        lp.sum().backward()
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    got = ranks[0]["logprobs"] + ranks[1]["logprobs"]
    torch.testing.assert_close(got, lp.detach(), atol=1e-5, rtol=0)
    for i, router in enumerate(spec.routers):                               # ranks average their gradients
        torch.testing.assert_close(ranks[0][f"router{i}"] * 2, router.weight.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ranks[1][f"router{i}"], ranks[0][f"router{i}"])
    assert all(int(r["flipped"]) > 0 for r in ranks)                        # the record was not the model's
