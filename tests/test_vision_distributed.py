"""A GRPO update on a batch with images, split over 2 ranks (gloo, CPU) under DDP and FSDP2, equals the
single-process update: each rank's rows carry their own images (``RolloutBatch.select``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")

from safetensors.torch import load_file  # noqa: E402

from tests.test_distributed import LAUNCH_TIMEOUT, _env, _port, _run  # noqa: E402
from tests.vision_dist_worker import make_batch, make_cfg  # noqa: E402

WORKER = Path(__file__).parent / "vision_dist_worker.py"


@pytest.mark.slow  # launchers: ~6 s each, as tests/test_distributed.py's
@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_two_ranks_with_images_update_as_one_process(tmp_path, backend):
    from nanogrpo.training.distributed import make_backend
    from nanogrpo.training.step import policy_update

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_port()), str(WORKER), "--backend", backend, "--out", str(tmp_path)]
    out = _run(cmd, LAUNCH_TIMEOUT, env=_env())
    assert out.returncode == 0 and (tmp_path / "result.json").is_file(), out.stdout[-6000:]
    res = json.loads((tmp_path / "result.json").read_text())
    cfg = make_cfg("single")
    model, batch = make_batch(cfg)
    be = make_backend(cfg, model)
    single = policy_update(be, batch, cfg, on_policy=True)
    assert res["world"] == 2 and not res["skipped"]
    assert res["loss"] == pytest.approx(single.loss, rel=1e-5, abs=1e-6)
    assert res["grad_norm"] == pytest.approx(single.grad_norm, rel=1e-4)
    got = load_file(str(tmp_path / "weights.safetensors"))
    for k, v in model.state_dict().items():  # atol: as tests/test_distributed.py's (Adam's first step)
        assert torch.allclose(got[k], v, atol=5e-5), (k, (got[k] - v).abs().max())
