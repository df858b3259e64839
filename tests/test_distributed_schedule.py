"""The update schedule on 2 ranks (FSDP2, whose forwards gather shards: every collective must match):
mini-batches, the proximal forward before the first step, dynamic sampling's refill rounds, a stop between
two optimizer steps and an exact resume from the mid-batch checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.test_distributed import LAUNCH_TIMEOUT, _env, _port, _run

ROOT = str(Path(__file__).resolve().parents[1])


def _cmd(assets: Path, out: Path, steps: int, resume: bool = False) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(_port()), "-m", "nanogrpo.cli", "train"]
    if resume:
        return launch + ["--resume", str(out), "--steps", str(steps)]
    return launch + ["--model", str(assets / "model"), "--data", str(assets / "data.jsonl"),
                     "--out", str(out), "--steps", str(steps), "--seed", "3", "data.answer_delimiter=####",
                     "data.system_prompt=''",
                     "rollout.max_new_tokens=8", "rollout.prompts_per_step=4", "grpo.group_size=4",
                     "rewards.workers=0", "train.lr=1e-2", "train.save_every=0", "log.tensorboard=false",
                     "rewards.functions=['tests.reward_fixtures:length']", "train.backend=fsdp2",
                     "model.cpu_linear=torch", "grpo.mini_batches=2", "grpo.updates_per_batch=2",
                     "rollout.correction=token_truncate", "grpo.dynamic_sampling=true", "grpo.max_refills=2",
                     "train.save_every_updates=1"]


@pytest.mark.slow
def test_two_rank_schedule_stops_mid_batch_and_resumes_exactly(tmp_path):
    from nanogrpo.training.checkpoint import latest_checkpoint
    from tests.run_fixtures import comparable_metrics, write_tiny_run_assets

    assets = write_tiny_run_assets(tmp_path)
    out = _run(_cmd(assets, tmp_path / "straight", 3), LAUNCH_TIMEOUT, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stdout[-6000:]
    cut = _run(_cmd(assets, tmp_path / "cut", 3), LAUNCH_TIMEOUT,
               env={**_env(), "NANOGRPO_TEST_STOP_AFTER": "step_2_update_1"}, cwd=ROOT)
    assert cut.returncode != 0 and "stopped after step_2_update_1" in cut.stdout, cut.stdout[-6000:]
    ckpt = latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert ckpt.name == "step_2_update_1"
    assert sorted(p.name for p in (ckpt / "pending").iterdir())[:2] == ["batch_rank0.safetensors",
                                                                         "batch_rank1.safetensors"]
    out = _run(_cmd(assets, tmp_path / "cut", 3, resume=True), LAUNCH_TIMEOUT, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stdout[-6000:]
    straight = comparable_metrics(tmp_path / "straight")
    assert comparable_metrics(tmp_path / "cut") == straight
    trained = [r for r in straight if r.get("loss") is not None]
    assert trained and all("is_weight_mean" in r and "refills" in r for r in trained)
    assert any(r.get("mini_batches") == 2 for r in trained)
