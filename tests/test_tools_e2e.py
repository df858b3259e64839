"""Training with a tool end to end: one process, split mode (server + worker + trainer as real processes,
batches with their loss mask on the wire), and the GPU configs on a tiny stand-in model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from nanogrpo.batch import RolloutBatch
from nanogrpo.cli import main
from nanogrpo.training.metrics import read_metrics
from tests.test_serve_e2e import AUTH, _server, _spawn, _stop, free_port

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo-tools.toml"
SMALL = ["rollout.prompts_per_step=4", "grpo.group_size=4", "train.save_every=0", "rewards.workers=0"]


@pytest.mark.slow
def test_demo_tools_config_trains(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--config", str(DEMO), "--out", str(out), "--steps", "2", "eval.every=2",
                 "eval.n=8", *SMALL]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the held-out baseline of a fresh run
    assert rows[0]["eval/n"] == 8 and "eval/tool_use_rate" in rows[0]
    rows = rows[1:]
    assert all(r["tools/calls"] > 0 and r["tools/tool_tokens"] > 0 for r in rows), rows
    assert 0 < rows[0]["tools/use_rate"] <= 1 and rows[0]["tools/turns_mean"] >= 1
    assert rows[-1]["eval/n"] == 8 and "eval/tool_use_rate" in rows[-1]
    samples = [json.loads(x) for x in (out / "eval" / "step_2.samples.jsonl").read_text().splitlines()]
    assert any("<output>" in c for s in samples for c in s["completions"])


@pytest.mark.slow
def test_split_mode_carries_tool_trajectories(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    ov = ["--config", str(DEMO), *SMALL, "train.steps=2", f"train.out={out}", "eval.every=0",
          "server.max_staleness=8", "server.retry_for_s=120", "server.timeout_s=20"]
    server = _server(port, tmp_path, ov, tmp_path / "server.log")
    worker = _spawn(["rollout", "--server", url, "--worker-id", "w1", "--batches", "3", *ov],
                    tmp_path / "w1.log")
    trainer = None
    try:
        with httpx.Client(base_url=url, timeout=20) as c:       # take one batch off the wire ourselves
            deadline = time.monotonic() + 600
            while True:
                r = c.get("/get", headers=AUTH)
                if r.status_code == 200:
                    break
                alive = time.monotonic() < deadline and worker.poll() is None
                assert alive, (tmp_path / "w1.log").read_text()[-3000:]
                time.sleep(1)
        batch = RolloutBatch.from_bytes(r.content)
        assert batch.loss_mask is not None and batch.ref_logprobs is not None
        fed = batch.completion_mask & ~batch.loss_mask
        assert bool(fed.any()), "no tool output in the batch"
        assert batch.meta["rollout"]["tools/calls"] > 0
        from nanogrpo.demos.tools.build import embedded_path
        from nanogrpo.models.load import load_tokenizer

        tok = load_tokenizer(str(embedded_path()))
        row = int(fed.any(1).nonzero()[0])
        completion = batch.input_ids[row, batch.prompt_len:]
        assert tok.decode(completion[fed[row]]).startswith("<output>\n")
        trainer = _spawn(["train", "--server", url, *ov], tmp_path / "trainer.log")
        assert trainer.wait(timeout=600) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        _stop(*[p for p in (worker, trainer, server) if p is not None])
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss"] is not None and r["tools/calls"] > 0 for r in rows), rows


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tools-gsm8k-qwen2.5-1.5b.toml", "tools-gsm8k-qwen3-1.7b.toml"])
def test_gsm8k_tool_configs_train_on_a_tiny_stand_in(name, tmp_path):
    """The GPU configs with a random-init tiny Qwen2 and GSM8K-format rows: every key is real, the
    sandbox starts with their preloads (numpy, sympy), a step runs."""
    from tests.run_fixtures import write_tiny_run_assets

    d = write_tiny_run_assets(tmp_path / "assets")
    out = tmp_path / "run"
    assert main(["train", "--config", str(REPO / "configs" / name), "--model", str(d / "model"),
                 "--data", str(d / "data.jsonl"), "--out", str(out), "--steps", "1",
                 "rollout.max_new_tokens=8", "rollout.prompts_per_step=2", "data.max_prompt_tokens=4000",
                 "eval.every=0", "rewards.workers=0", "model.dtype=float32",
                 "train.gradient_checkpointing=false"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[0]["num_completions"] == 16 and "tools/use_rate" in rows[0]
    from nanogrpo.config import load_config
    from nanogrpo.tools.protocols import Call
    from nanogrpo.tools.runner import ToolRunner

    with ToolRunner(load_config(REPO / "configs" / name).tools) as tools:   # its sandbox, its preloads
        [res] = tools.run([Call("import numpy, sympy\nprint(numpy.arange(4).sum(), sympy.sqrt(8))")], [{}])
    assert (res.status, res.output) == ("ok", "6 2*sqrt(2)")


def test_a_tool_runs_server_admits_its_longest_trajectories(monkeypatch, tmp_path):
    """A tool trajectory carries up to tools.max_turns tool outputs beyond the sampled tokens: the
    server's length bound on uploads is the longest context the run asks for, not prompt + max_new."""
    from nanogrpo.config import load_config
    from nanogrpo.demos.tools.build import embedded_path
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.rollout.turns import longest_context
    from nanogrpo.serve.server import build_parser, build_state

    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path))
    ov = ["--config", str(DEMO), "grpo.beta=0", "tools.max_turns=4", "tools.max_output_tokens=100"]
    st, _ = build_state(build_parser().parse_args(ov))
    cfg = load_config(str(DEMO), ["grpo.beta=0", "tools.max_turns=4", "tools.max_output_tokens=100"])
    want = longest_context(cfg, load_tokenizer(str(embedded_path())), cfg.rollout.max_new_tokens)
    assert st.s.max_len == want > cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens + 4 * 100
    plain, _ = build_state(build_parser().parse_args([*ov, "tools.enabled=false"]))
    assert plain.s.max_len == cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
