"""Exact resume inside a rollout batch: a run stopped between two optimizer steps of one batch
(``grpo.mini_batches`` x ``updates_per_batch``) resumes from its mid-batch checkpoint to the same
metrics as a run that never stopped, for every loss; and a kill -9 there too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanogrpo.cli import main
from nanogrpo.training.checkpoint import latest_checkpoint, load_state
from tests.run_fixtures import comparable_metrics, this_process_threads, write_tiny_run_assets
from tests.test_resume import LOSS_RUNS

REPO = Path(__file__).resolve().parents[1]
SCHEDULE = ["grpo.mini_batches=2", "grpo.updates_per_batch=2", "train.save_every_updates=1",
            "model.cpu_linear=torch"]  # pinned: a resumed process must not time its way to another BLAS


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return write_tiny_run_assets(tmp_path_factory.mktemp("resume-schedule"))


def _args(assets: Path, out: Path, steps: int, over: list[str]) -> list[str]:
    return ["train", "--model", str(assets / "model"), "--data", str(assets / "data.jsonl"),
            "--out", str(out), "--steps", str(steps), "--seed", "7",
            "data.answer_delimiter=####", "data.system_prompt=''",
            "rollout.max_new_tokens=10", "rollout.prompts_per_step=4", "grpo.group_size=4",
            "rewards.functions=['tests.reward_fixtures:length','format']", "rewards.workers=0",
            "train.lr=1e-3", "train.save_every=0", "grpo.beta=0.04", "log.samples_every=1", "eval.every=0",
            *SCHEDULE, *over]


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(LOSS_RUNS))
def test_stopped_between_two_optimizer_steps_resumes_exactly(assets, loss, monkeypatch):
    """Each loss with its own options: stopped right after the first of step 2's four optimizer steps (its
    mid-batch checkpoint written), resumed, the run logs what the uninterrupted one logs."""
    straight, cut = assets / f"{loss}-straight", assets / f"{loss}-cut"
    assert main(_args(assets, straight, 3, LOSS_RUNS[loss])) == 0
    monkeypatch.setenv("NANOGRPO_TEST_STOP_AFTER", "step_2_update_1")
    with pytest.raises(SystemExit, match="stopped after step_2_update_1"):
        main(_args(assets, cut, 3, LOSS_RUNS[loss]))
    monkeypatch.delenv("NANOGRPO_TEST_STOP_AFTER")
    ckpt = latest_checkpoint(cut / "checkpoints")
    assert ckpt.name == "step_2_update_1" and load_state(ckpt)["pending"]["done"] == 1
    assert [r["step"] for r in comparable_metrics(cut)] == [1]
    assert main(["train", "--resume", str(cut), "--steps", "3"]) == 0
    rows = comparable_metrics(straight)
    assert comparable_metrics(cut) == rows
    assert any(r.get("mini_batches") == 2 for r in rows), "the test needs batches cut in two"
    versions = [0] + [r["policy_version"] for r in rows]
    assert all(v1 - v0 == 2 * r["mini_batches"] for v0, v1, r in zip(versions, versions[1:], rows))
    # the mid-batch resume point is gone once a later checkpoint exists
    assert not [p for p in (cut / "checkpoints").iterdir() if "_update_" in p.name]


@pytest.mark.slow
def test_kill9_between_two_optimizer_steps_then_resume_is_exact(assets):
    over = ["grpo.loss=dapo", "rollout.correction=token_truncate", "grpo.dynamic_sampling=true"]
    straight, killed = assets / "k-straight", assets / "k-killed"
    assert main(_args(assets, straight, 4, over)) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO), **this_process_threads()}  # as the straight run here
    # the killed run scores each completion 0.05 s slower (same rewards): a step_3_update_* checkpoint
    # then stays the latest for 1.8 s instead of 0.85 s (measured at a load of 9), so that a busy
    # machine letting this loop look late does not miss it
    proc = subprocess.Popen([sys.executable, "-m", "nanogrpo.cli", *_args(assets, killed, 4, over)], cwd=REPO,
                            env={**env, "TEST_REWARD_SLEEP": "0.05"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    pointer = killed / "checkpoints" / "latest"
    t0 = time.time()
    while not (pointer.is_file() and pointer.read_text().startswith("step_3_update_")):
        assert proc.poll() is None, proc.stderr.read().decode()[-800:]
        assert time.time() - t0 < 300, "timed out waiting for a mid-batch checkpoint of step 3"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    name = latest_checkpoint(killed / "checkpoints").name
    assert "_update_" in name, name
    resumed = subprocess.run([sys.executable, "-m", "nanogrpo.cli", "train", "--resume", str(killed),
                              "--steps", "4"], cwd=REPO, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert comparable_metrics(killed) == comparable_metrics(straight)
    state = json.loads((killed / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert "pending" not in state and state["step"] == 4


@pytest.mark.slow
def test_split_mode_trainer_stopped_mid_batch_resumes_exactly(tmp_path, monkeypatch):
    """Split mode: the mid-batch checkpoint holds the schedule (the batch stays in the trainer's inbox), and
    the resumed trainer finishes the step and the run as an uninterrupted one does."""
    from transformers import AutoModelForCausalLM

    from nanogrpo.config import load_config
    from nanogrpo.serve.client import ServerClient
    from nanogrpo.serve.feed import train_from_server
    from nanogrpo.serve.server import ServerState, Settings
    from tests.test_serve_helpers import TOKEN, LiveServer, make_batch

    d = write_tiny_run_assets(tmp_path)
    vocab = AutoModelForCausalLM.from_pretrained(d / "model").get_input_embeddings().num_embeddings
    monkeypatch.setenv("NANOGRPO_TOKEN", TOKEN)

    def run(out, stop: str | None):
        st = ServerState(Settings(vocab_size=vocab, max_weights_body=8 << 20, lease_s=30), TOKEN)
        cfg = load_config(overrides=[f"model.path={d / 'model'}", "grpo.beta=0", "train.steps=3",
                                     f"train.out={out}", "train.save_every=0", "log.tensorboard=false",
                                     "rewards.workers=0", "train.lr=1e-2", "server.max_staleness=20",
                                     *SCHEDULE, "rollout.correction=token_truncate"])
        with LiveServer(st) as srv:
            with ServerClient(srv.url, TOKEN) as c:
                for i in range(3):
                    c.upload(make_batch(vocab=vocab, seed=i, groups=2), f"b{i}")
            if stop is None:
                assert train_from_server(cfg, srv.url) == 0
                return
            monkeypatch.setenv("NANOGRPO_TEST_STOP_AFTER", stop)
            with pytest.raises(SystemExit, match=f"stopped after {stop}"):
                train_from_server(cfg, srv.url)
            monkeypatch.delenv("NANOGRPO_TEST_STOP_AFTER")
            assert latest_checkpoint(out / "checkpoints").name == stop
            assert train_from_server(cfg, srv.url, resume_dir=out) == 0

    run(tmp_path / "straight", None)
    run(tmp_path / "cut", "step_2_update_3")
    drop = ("batch_ids", "dropped_ids", "wait_time_s", "client_retries")
    a, b = (comparable_metrics(tmp_path / r) for r in ("straight", "cut"))
    assert [{k: v for k, v in r.items() if k not in drop} for r in b] == \
        [{k: v for k, v in r.items() if k not in drop} for r in a]
    assert [r["policy_version"] for r in a] == [4, 8, 12] and all(r["mini_batches"] == 2 for r in a)
    assert all(r["loss"] != 0.0 for r in a)
