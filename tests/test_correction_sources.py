"""The rollout correction wherever the behaviour log-probs come from elsewhere: an engine with its own
numerics in the trainer's process (vLLM's part, played by an ``hf`` engine with log-probs off by a known
shift; the real vLLM: ``tests/test_vllm_e2e.py``), a split-mode worker's batch (fresh but marked, or
stale), and several mini-batches. Each step logs the raw weights pi_old / mu before truncation (min /
mean / max), the share truncated, and the k3 KL(mu || pi_old), all against the generating policy."""

from __future__ import annotations

import math

import pytest
import torch

from nanogrpo.cli import main
from nanogrpo.training.metrics import read_metrics
from tests.run_fixtures import write_tiny_run_assets
from tests.test_vllm_wiring import SHIFT, OwnCopyEngine

W = math.exp(-SHIFT)            # pi_old / mu against log-probs raised by SHIFT
K3 = W + SHIFT - 1              # k3 with log(pi_old / mu) = -SHIFT


@pytest.mark.slow
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_in_process_engine_with_its_own_numerics(tmp_path, monkeypatch, mini_batches):
    import nanogrpo.engines.factory as factory  # where the run's setup takes its engine from

    d = write_tiny_run_assets(tmp_path)
    monkeypatch.setattr(factory, "engine_for", lambda cfg, model, tok, **kw: OwnCopyEngine(model, tok, True))
    out = tmp_path / "run"
    assert main(["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--out", str(out),
                 "--steps", "2", "rollout.prompts_per_step=4", "grpo.group_size=4",
                 "rollout.max_new_tokens=8", 'rewards.functions=["tests.reward_fixtures:length"]',
                 "rewards.workers=0", "train.lr=1e-2",
                 "train.save_every=0", "grpo.beta=0", "eval.every=0", f"grpo.mini_batches={mini_batches}",
                 "rollout.correction=token_truncate", "rollout.correction_min=0.7",
                 "rollout.correction_max=2"]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r.get("loss") is not None]
    assert rows
    for r in rows:  # the first pass's mini-batches, each against the trainer's log-probs before any update
        for k in ("is_weight_min", "is_weight_mean", "is_weight_max"):
            assert r[k] == pytest.approx(W, rel=1e-4), k
        assert r["is_corrected_frac"] == 1.0                     # every weight below correction_min
        assert r["is_kl"] == pytest.approx(K3, rel=1e-3)
        if mini_batches == 1:                                    # the ratio measures the update alone
            assert r["ratio_min"] == r["ratio_max"] == 1.0
        else:
            assert r.get("mini_batches") in (1, 2)
    if mini_batches == 2:
        assert any(r["mini_batches"] == 2 and r["ratio_max"] > 1.0 + 1e-4 for r in rows)


@pytest.mark.slow
def test_split_mode_batches_marked_or_stale(tmp_path, monkeypatch):
    """A fresh batch from a worker with its own numerics, and a stale one: the split-mode trainer weighs
    both against its own log-probs and logs the raw weights, the share truncated and the mismatch."""
    from transformers import AutoModelForCausalLM

    from nanogrpo.algo.logprobs import token_logprobs
    from nanogrpo.config import load_config
    from nanogrpo.serve.client import ServerClient
    from nanogrpo.serve.feed import train_from_server
    from nanogrpo.serve.server import ServerState, Settings
    from tests.test_serve_helpers import TOKEN, LiveServer, make_batch

    d = write_tiny_run_assets(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d / "model").eval()
    vocab = model.get_input_embeddings().num_embeddings
    monkeypatch.setenv("NANOGRPO_TOKEN", TOKEN)
    st = ServerState(Settings(vocab_size=vocab, max_weights_body=8 << 20, lease_s=30), TOKEN)
    out = tmp_path / "run"
    cfg = load_config(overrides=[f"model.path={d / 'model'}", "grpo.beta=0", "train.steps=2",
                                 f"train.out={out}", "train.save_every=0", "log.tensorboard=false",
                                 "rewards.workers=0", "train.lr=1e-9", "rollout.correction=token_truncate",
                                 "rollout.correction_max=1.5", "grpo.mini_batches=2"])
    with LiveServer(st) as srv:
        with ServerClient(srv.url, TOKEN) as c:
            for i, marked in enumerate((True, False)):     # step 1: fresh and marked; step 2: one version old
                b = make_batch(vocab=vocab, version=0, seed=i, worker="marked" if marked else "stale")
                with torch.no_grad():
                    exact = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len,
                                           b.completion_mask)
                b.old_logprobs = (exact - SHIFT) * b.completion_mask
                if marked:
                    b.meta["behaviour_logprobs"] = True
                c.upload(b, f"b{i}")
        assert train_from_server(cfg, srv.url) == 0
    rows = {r["worker"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert rows["marked"]["staleness"] == 0 and rows["stale"]["staleness"] == 2  # two mini-batch versions
    for r in rows.values():
        w = math.exp(SHIFT)
        for k in ("is_weight_min", "is_weight_mean", "is_weight_max"):
            assert r[k] == pytest.approx(w, rel=1e-3), k
        assert r["is_corrected_frac"] == 1.0 and r["is_kl"] == pytest.approx(w - SHIFT - 1, rel=1e-2)
        assert r["mini_batches"] == 2 and r["policy_version"] in (2, 4)
