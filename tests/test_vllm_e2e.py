"""``rollout.engine=vllm`` end to end on the CPU: the demo learns, a run resumes exactly, and split mode
runs with a vLLM rollout worker fed by the weight relay. All slow; they need vLLM (see tests/test_vllm.py:
skipped where it is absent, a failure under ``NANOGRPO_REQUIRE_VLLM=1``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nanogrpo.cli import main
from nanogrpo.training.metrics import read_metrics
from tests.run_fixtures import comparable_metrics, evaluated_on

if os.environ.get("NANOGRPO_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_shape(tmp_path_factory) -> Path:
    """A random-init Qwen2 of the ``demo`` shape (head size 32: vLLM's CPU kernels take no smaller)
    with the char tokenizer, and GSM8K-format rows."""
    from nanogrpo.models.tiny import make_model, make_tokenizer

    d = tmp_path_factory.mktemp("demo_shape")
    tok = make_tokenizer()
    make_model("demo", tok, seed=3).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    with open(d / "data.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"question": f"{i}+{i}?", "answer": f"#### {2 * i}"}) + "\n")
    return d


def _small(d: Path, out: Path, steps: int) -> list[str]:
    return ["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--out", str(out),
            "--steps", str(steps), "rollout.engine=vllm", "rollout.prompts_per_step=2", "grpo.group_size=4",
            "rollout.max_new_tokens=12", 'rewards.functions=["tests.reward_fixtures:length"]',
            "rewards.workers=0", "train.lr=1e-3", "train.save_every=1", "eval.every=2", "eval.n=4",
            evaluated_on(d / "data.jsonl")]


def test_demo_learns_with_vllm(tmp_path):
    """`nanogrpo train rollout.engine=vllm` on the embedded demo, cut to 20 steps for CI (the whole
    80-step run: docs/figures.md, "The demo learns with vLLM"), lifts held-out greedy accuracy by at
    least 25 points over the warm start (both checkpoints evaluated alike; 20-step runs measured +43)."""
    from nanogrpo.config import load_config
    from nanogrpo.evaluation import run_eval
    from nanogrpo.models.load import load_policy

    out = tmp_path / "demo"
    assert main(["train", "rollout.engine=vllm", f"train.out={out}", "eval.every=0", "train.steps=20"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 20 and all(r["clip_frac"] is not None for r in rows if r["loss"] is not None)
    accs = {}
    for step in (0, 20):
        cfg = load_config(preset="demo", overrides=[f"model.path={out / 'checkpoints' / f'step_{step}'}"])
        model, tok, _ = load_policy(cfg.model)
        accs[step] = run_eval(cfg, model, tok, cfg.data.eval_split, 200)["accuracy"]
    print(f"vLLM demo: held-out accuracy step_0 {accs[0]:.3f} -> step_20 {accs[20]:.3f}")
    assert accs[20] >= accs[0] + 0.25, accs


def test_resume_with_vllm_is_exact(tmp_path, demo_shape):
    """Stopped after 2 steps and resumed, a vLLM run logs the same 4 steps as an uninterrupted one: the
    engine is built from the resumed weights, and each update is pushed into it."""
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert main(_small(demo_shape, straight, 4)) == 0
    assert main(_small(demo_shape, halves, 2)) == 0
    assert main(["train", "--resume", str(halves), "--steps", "4"]) == 0
    a, b = comparable_metrics(straight), comparable_metrics(halves)
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4] and a == b   # step 0: the held-out baseline
    assert any(r.get("loss") for r in a) and "eval/accuracy" in a[0] and "eval/accuracy" in a[4]


def test_split_mode_with_a_vllm_worker(tmp_path, demo_shape):
    """Server + one `nanogrpo rollout ... rollout.engine=vllm` worker + trainer (real processes): the
    worker loads each published policy in place and its batches ask for the clipped ratio. A staleness
    bound of 1: a worker that ran ahead on version 0 (it can, while the trainer starts) sees those
    batches dropped from step 3 on, so later steps train on batches from relayed weights."""
    import httpx

    from tests.test_serve_e2e import AUTH, _server, _spawn, _stop
    from tests.test_serve_helpers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    ov = [f"model.path={demo_shape / 'model'}", f"data.source={demo_shape / 'data.jsonl'}",
          "rollout.engine=vllm", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8",
          "grpo.group_size=4", "grpo.beta=0.04", 'rewards.functions=["tests.reward_fixtures:length"]',
          "rewards.workers=0", "train.micro_batch_size=8", "train.save_every=0", "train.steps=6",
          f"train.out={out}", "train.lr=1e-3", "server.max_staleness=1", "server.publish_every=1",
          "server.retry_for_s=300", "server.timeout_s=30", "eval.every=3", "eval.n=4"]
    server = _server(port, tmp_path, ov, tmp_path / "server.log")
    worker = _spawn(["rollout", "--server", url, "--worker-id", "v1", *ov], tmp_path / "worker.log")
    trainer = _spawn(["train", "--server", url, *ov], tmp_path / "trainer.log")
    try:
        assert trainer.wait(timeout=900) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        stats = httpx.get(url + "/stats", headers=AUTH, timeout=10).json()
    finally:
        _stop(worker, trainer, server)
    rows = read_metrics(out / "metrics.jsonl")
    wlog = (tmp_path / "worker.log").read_text()
    assert [r["step"] for r in rows] == list(range(1, 7)) and {r["worker"] for r in rows} == {"v1"}
    assert "engine vllm" in wlog and "now generating with policy version" in wlog, wlog[-3000:]
    assert max(r["batch_policy_version"] for r in rows) > 0        # generated with relayed weights
    assert all(r["loss"] is not None and r["clip_frac"] is not None for r in rows)
    assert "eval/accuracy" in rows[2] and "eval/accuracy" in rows[5]
    assert stats["weights_version"] >= 5


def test_vllm_run_weighs_and_logs_the_engine_trainer_mismatch(tmp_path, demo_shape):
    """``rollout.correction`` behind the in-process vLLM engine, with two mini-batches: every step logs the
    raw weights pi_old / mu (vLLM's float32 kernels against the trainer's: ~1), the share truncated and the
    k3 KL, measured against the trainer's log-probs of the generating policy (the forward before the first
    optimizer step)."""
    out = tmp_path / "corr"
    over = ["eval.every=0", "rollout.prompts_per_step=4", "rollout.correction=token_truncate",
            "rollout.correction_min=0.5", "grpo.mini_batches=2", "rollout.tempered_logprobs=true",
            "rollout.temperature=0.8", "rollout.top_p=0.9"]  # over the top-p support, vLLM and trainer alike
    assert main(_small(demo_shape, out, 2)[:-3] + over) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r.get("loss") is not None]
    assert rows
    for r in rows:
        assert 0.99 < r["is_weight_min"] <= r["is_weight_mean"] <= r["is_weight_max"] < 1.01, r
        assert r["is_corrected_frac"] == 0.0 and 0.0 <= r["is_kl"] < 1e-4
