"""Exact resume with routing replay: the MoE demo stopped between two optimizer steps of one batch (its
mid-batch checkpoint written: under R2 the batch's recorded routes go with it), or at a step's end, and
resumed, logs what the run that never stopped logs, mismatch and router metrics included."""

from __future__ import annotations

import pytest

from nanogrpo.cli import main
from nanogrpo.training.checkpoint import latest_checkpoint, load_state
from tests.run_fixtures import comparable_metrics

RUN = ["--config", "demo-moe", "--seed", "3", "rollout.prompts_per_step=4", "grpo.group_size=4",
       "rollout.max_new_tokens=48", "eval.every=0", "train.save_every=0", "log.samples_every=0",
       "rewards.workers=0", "grpo.mini_batches=2", "grpo.updates_per_batch=2", "train.save_every_updates=1",
       "model.cpu_linear=torch"]  # pinned: a resumed process must not time its way to another BLAS


@pytest.mark.slow  # three short runs of the MoE demo per mode
@pytest.mark.parametrize("mode", ["rollout", "policy"])
def test_a_replayed_run_stopped_mid_batch_resumes_exactly(mode, tmp_path, monkeypatch):
    over = [f"moe.routing_replay={mode}"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(["train", "--out", str(straight), "--steps", "3", *RUN, *over]) == 0
    monkeypatch.setenv("NANOGRPO_TEST_STOP_AFTER", "step_2_update_1")
    with pytest.raises(SystemExit, match="stopped after step_2_update_1"):
        main(["train", "--out", str(cut), "--steps", "3", *RUN, *over])
    monkeypatch.delenv("NANOGRPO_TEST_STOP_AFTER")
    ckpt = latest_checkpoint(cut / "checkpoints")
    assert ckpt.name == "step_2_update_1" and load_state(ckpt)["pending"]["done"] == 1
    assert main(["train", "--resume", str(cut), "--steps", "3"]) == 0
    rows = comparable_metrics(straight)
    assert comparable_metrics(cut) == rows
    trained = [r for r in rows if r.get("loss") is not None]
    assert len(trained) == 3 and all(r["router_disagreement"] == 0.0 for r in trained)
    assert all(r["mismatch_abs_max"] < 1e-4 for r in trained)
