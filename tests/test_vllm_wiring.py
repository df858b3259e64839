"""How the trainer, the split-mode worker/trainer and the config treat an engine like vLLM's, without vLLM.

An engine that holds its own copy of the weights (``owns_weights``) must get the policy after
every update; one whose log-probs are not the trainer's numerics (``behaviour_logprobs``) makes
even the first update take the clipped ratio against its recorded log-probs. Here an ``hf``
engine plays that part with log-probs shifted by a known amount, so the ratio is far from 1
exactly when the trainer uses them. The real vLLM engine: ``tests/test_vllm.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nanogrpo.cli import main
from nanogrpo.config import load_config
from nanogrpo.engines.base import Generation
from nanogrpo.engines.hf import HFEngine
from nanogrpo.errors import ConfigError
from nanogrpo.training.metrics import read_metrics
from tests.run_fixtures import write_tiny_run_assets

SHIFT = 0.5
"""Added to the engine's log-probs: the ratio against them is exp(-0.5) = 0.61, clipped at 0.8."""


class OwnCopyEngine:
    """An ``hf`` engine over a *separate copy* of the policy, with log-probs off by ``SHIFT``."""

    name = "owncopy"
    owns_weights = True

    def __init__(self, model, tokenizer, behaviour: bool):
        import copy

        self.copy = copy.deepcopy(model)
        self.inner = HFEngine(self.copy, tokenizer=tokenizer)
        self.behaviour_logprobs = behaviour
        self.loads = 0

    def generate(self, prompts, params) -> Generation:
        gen = self.inner.generate(prompts, params)
        gen.logprobs = [[x + SHIFT for x in lp] for lp in gen.logprobs]
        return gen

    def update_weights(self, state_dict) -> None:
        self.inner.update_weights(state_dict)

    def load_from(self, model) -> None:
        self.loads += 1
        self.update_weights(model.state_dict())


@pytest.mark.parametrize("behaviour", [True, False])
@pytest.mark.slow
def test_trainer_pushes_weights_and_takes_the_ratio_against_behaviour_logprobs(tmp_path, monkeypatch,
                                                                                behaviour):
    import nanogrpo.engines.factory as factory  # where the run's setup takes its engine from

    d = write_tiny_run_assets(tmp_path)
    built = []

    def fake_engine_for(cfg, model, tok, **kw):
        built.append(OwnCopyEngine(model, tok, behaviour))
        return built[-1]

    monkeypatch.setattr(factory, "engine_for", fake_engine_for)
    out = tmp_path / "run"
    assert main(["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--out", str(out),
                 "--steps", "3", "rollout.prompts_per_step=2", "grpo.group_size=4",
                 "rollout.max_new_tokens=8", 'rewards.functions=["tests.reward_fixtures:length"]',
                 "rewards.workers=0", "train.lr=1e-2", "train.save_every=0", "grpo.beta=0"]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]  # step 0: the held-out baseline
    engine = built[0]
    updates = sum(r["loss"] is not None for r in rows)
    assert updates > 0 and engine.loads == updates               # one push per version it ran with
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_3")
    for k, v in saved.state_dict().items():                       # the engine's copy is the final policy
        assert torch.allclose(engine.copy.state_dict()[k], v), k
    clip = [r["clip_frac"] for r in rows if r["loss"] is not None]
    if behaviour:
        assert all(c > 0 for c in clip), clip                     # ratio 0.61 against the engine's
    else:
        assert all(c == 0 for c in clip), clip                    # on-policy: logp.detach(), ratio 1


@pytest.mark.slow  # a real server process (~10-40 s on a shared 2-core machine)
def test_split_mode_trainer_takes_the_ratio_against_a_marked_fresh_batch(tmp_path, monkeypatch):
    """A worker whose engine has behaviour log-probs (vllm) marks its batches; the split-mode trainer
    then clips against them even at staleness 0, and treats an unmarked fresh batch as on-policy."""
    from transformers import AutoModelForCausalLM

    from nanogrpo.algo.logprobs import token_logprobs
    from nanogrpo.serve.client import ServerClient
    from tests.test_serve_helpers import TOKEN, free_port, make_batch, start_server

    d = write_tiny_run_assets(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d / "model").eval()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ov = [f"model.path={d / 'model'}", "grpo.beta=0", "rewards.workers=0", "train.save_every=0"]
    server = start_server(port, tmp_path / "state.json", *ov, log=tmp_path / "server.log")
    try:
        client = ServerClient(url, TOKEN, timeout_s=20, retry_for_s=30)
        for version, marked in ((0, False), (1, True)):     # the trainer is at version `version` for each
            b = make_batch(vocab=100, version=version, worker="marked" if marked else "plain", seed=version)
            with torch.no_grad():
                exact = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, b.completion_mask)
            b.old_logprobs = (exact + SHIFT) * b.completion_mask
            b.advantages = torch.tensor([1.0, -1.0]).repeat(b.num_seqs // 2)
            if marked:
                b.meta["behaviour_logprobs"] = True
            client.upload(b)
        client.close()
        monkeypatch.setenv("NANOGRPO_TOKEN", TOKEN)
        assert main(["train", "--server", url, "--out", str(tmp_path / "run"), "--steps", "2",
                     "train.lr=1e-9", *ov]) == 0
    finally:
        server.terminate()
        server.wait(timeout=20)
    rows = {r["worker"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert rows["plain"]["staleness"] == 0 and rows["plain"]["clip_frac"] == 0
    assert rows["marked"]["staleness"] == 0 and rows["marked"]["clip_frac"] > 0.2


def test_vllm_options_from_config():
    from nanogrpo.engines.vllm_inprocess import vllm_options

    cfg = load_config(preset="demo")
    o = vllm_options(cfg)
    assert o["max_model_len"] == 200 + 56 and o["max_batch"] == max(32 * 8, 64)
    assert o["tempered_logprobs"] is False and o["kv_cache_bytes"] == 0 and o["enforce_eager"] is None
    cfg = load_config(preset="demo", overrides=["eval.max_new_tokens=100", "vllm.kv_cache_gib=0.5",
                                                "vllm.max_model_len=0", "vllm.sleep_mode=true",
                                                "vllm.llm_kwargs={max_num_batched_tokens: 8192}"])
    o = vllm_options(cfg)
    assert o["max_model_len"] == 300 and o["kv_cache_bytes"] == 2**29 and o["sleep_mode"] is True
    assert o["llm_kwargs"] == {"max_num_batched_tokens": 8192} and o["stop_strings"] is False
    # a tool run: room for the tool outputs (the engine_for caller's longest_context), stop strings in vLLM
    from nanogrpo.models.tiny import make_tokenizer
    from nanogrpo.rollout.turns import longest_context

    cfg = load_config(preset="demo-tools")
    longest = longest_context(cfg, make_tokenizer(), cfg.rollout.max_new_tokens)
    o = vllm_options(cfg, longest)
    assert o["max_model_len"] == longest > 200 + 80 and o["stop_strings"] is True
    assert vllm_options(load_config(preset="demo-tools", overrides=["vllm.max_model_len=512"]),
                        longest)["max_model_len"] == 512
    assert load_config(overrides=["vllm.max_model_len=4096"]).vllm.max_model_len == 4096
    with pytest.raises(ConfigError, match="vllm.gpu_memory_utlization"):
        load_config(overrides=["vllm.gpu_memory_utlization=0.5"])
    with pytest.raises(ConfigError, match="vllm.gpu_memory_utilization"):
        load_config(overrides=["vllm.gpu_memory_utilization=1.5"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_engine_says_how_to_install_it(tmp_path, capsys):
    d = write_tiny_run_assets(tmp_path)
    code = main(["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--out",
                 str(tmp_path / "run"), "--steps", "1", "rollout.engine=vllm", "rewards.workers=0"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "pip install" in last and "vllm" in last
    assert not (tmp_path / "run").exists()                           # stopped before loading anything


def test_lora_policy_state_dict_is_the_merged_model():
    """vLLM gets a LoRA policy as plain merged weights, computed aside (the PEFT model is untouched)."""
    pytest.importorskip("peft")
    import copy

    from nanogrpo.config import ModelConfig
    from nanogrpo.engines.vllm_inprocess import policy_state_dict
    from nanogrpo.models.lora import apply_lora
    from nanogrpo.models.tiny import make_model, make_tokenizer

    base = make_model("tiny", make_tokenizer(), seed=0)
    model = apply_lora(base, ModelConfig(lora_r=4))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)                                   # a trained adapter: B != 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = policy_state_dict(model)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(got) == set(want)
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert any(not torch.equal(got[k], make_model("tiny", make_tokenizer(), seed=0).state_dict()[k])
               for k in want)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
