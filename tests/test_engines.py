"""Rollout engines against HF ``generate`` and a plain forward pass (CPU, float32, tiny models).

GPU checks (CUDA graphs, compile, bf16) carry ``@pytest.mark.gpu`` and skip without CUDA.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

from nanogrpo.engines import HFEngine, SamplingParams, make_engine
from nanogrpo.engines.fast import FastEngine
from nanogrpo.errors import ConfigError, ModelError
from nanogrpo.models.tiny import make_model, make_tokenizer, model_config

TOK = make_tokenizer()
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id
PROMPTS = [[5, 6, 7, 8, 9, 20, 21, 22], [10, 11], [12, 13, 14, 40, 50], [60, 61, 62, 63]]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def qwen(shape: str = "small", seed: int = 0, device="cpu", dtype=None) -> Qwen2ForCausalLM:
    """Untied random Qwen2 (a tied random model just repeats its input token)."""
    cfg = model_config(shape, TOK)
    cfg.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = Qwen2ForCausalLM(cfg)
    return m.to(device=device, dtype=dtype).eval()


def llama(seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(TOK), max_position_embeddings=512,
                      rope_theta=10000.0, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


def hf_greedy(model, prompts, n_new: int, eos: int = EOS) -> list[list[int]]:
    """``model.generate`` greedy on left-padded prompts, each cut after its first EOS."""
    width = max(map(len, prompts))
    dev = next(model.parameters()).device
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=PAD)[:, width:].tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in out]


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Reference: log_softmax of one full forward pass, gathered at the completion tokens."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion], device=dev)).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(1, torch.tensor(completion, device=dev)[:, None])[:, 0].cpu()


GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


@pytest.mark.parametrize("build", [lambda: make_model("tiny", TOK), lambda: qwen("small"), llama],
                         ids=["qwen-tiny", "qwen-small", "llama"])
@pytest.mark.parametrize("fuse", [True, False])
def test_fast_greedy_matches_hf_generate(build, fuse):
    model = build()
    want = hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)
    got = FastEngine(model, tokenizer=TOK, fuse=fuse).generate(PROMPTS, GREEDY)
    assert got.completion_ids == want
    assert len({tuple(c) for c in want}) > 1


def test_hf_engine_greedy_matches_generate():
    model = qwen()
    got = HFEngine(model, EOS, PAD).generate(PROMPTS, GREEDY)
    assert got.completion_ids == hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_logprobs_match_a_forward_pass(engine):
    model = qwen()
    params = SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.9, top_k=30, n=2, seed=1)
    gen = make_engine(engine, model, TOK).generate(PROMPTS, params)
    for i, (comp, lps) in enumerate(zip(gen.completion_ids, gen.logprobs, strict=True)):
        assert len(comp) == len(lps) > 0
        ref = forward_logprobs(model, PROMPTS[i // 2], comp)
        assert (ref - torch.tensor(lps)).abs().max().item() < 1e-4


def _eos_for_row0(model, prompts, n_new):
    """A token that greedy row 0 produces early and no other row ever produces."""
    runs = hf_greedy(model, prompts, n_new, eos=10**6)  # never stops
    others = {t for r in runs[1:] for t in r}
    for t in runs[0][2:]:
        if t not in others:
            return t
    pytest.skip("no token unique to row 0 (model seed changed?)")


@pytest.mark.parametrize("engine", ["fast", "hf"])
@pytest.mark.slow
def test_one_row_stops_at_eos_others_run_on(engine):
    model = qwen()
    eos = _eos_for_row0(model, PROMPTS, GREEDY.max_new_tokens)
    kw = {"check_every": 2} if engine == "fast" else {}  # also exercises batch compaction
    gen = make_engine(engine, model, eos_token_id=eos, pad_token_id=PAD, **kw).generate(PROMPTS, GREEDY)
    assert gen.finish_reasons == ["stop", "length", "length", "length"]
    assert gen.completion_ids[0][-1] == eos and eos not in gen.completion_ids[0][:-1]
    assert [len(c) for c in gen.completion_ids[1:]] == [GREEDY.max_new_tokens] * 3
    assert gen.completion_ids == hf_greedy(model, PROMPTS, GREEDY.max_new_tokens, eos=eos)


def test_compaction_keeps_results():
    """Rows finishing at different times, compacted into smaller batches, same tokens as without."""
    model = qwen()
    prompts = [PROMPTS[0]] * 12 + PROMPTS[1:]  # 12 of 15 rows stop early
    eos = _eos_for_row0(model, PROMPTS, GREEDY.max_new_tokens)
    base = dict(eos_token_id=eos, pad_token_id=PAD)
    want = FastEngine(model, compact=False, **base).generate(prompts, GREEDY)
    got = FastEngine(model, check_every=1, **base).generate(prompts, GREEDY)
    assert got.stats["compactions"] >= 1
    assert got.completion_ids == want.completion_ids and got.finish_reasons == want.finish_reasons
    assert max(abs(a - b) for x, y in zip(got.logprobs, want.logprobs, strict=True)
               for a, b in zip(x, y, strict=True)) < 1e-5


@pytest.mark.slow
def test_graph_layout_on_cpu():
    """The CUDA path's bookkeeping, run eagerly on CPU: rows padded to power-of-two buckets,
    a scratch slot written by warm-ups, states kept between calls, compaction into pre-built
    smaller buckets. Same tokens as HF."""
    model = qwen()
    eos = _eos_for_row0(model, PROMPTS, GREEDY.max_new_tokens)
    prompts = [PROMPTS[0]] * 12 + PROMPTS[1:]  # 15 rows -> bucket 16; 3 live rows -> bucket 8
    engine = FastEngine(model, eos_token_id=eos, pad_token_id=PAD, check_every=1)
    engine.use_graphs = True  # warm-ups and buckets as on CUDA; nothing is captured off CUDA
    want = hf_greedy(model, prompts, GREEDY.max_new_tokens, eos=eos)
    for _ in range(2):
        got = engine.generate(prompts, GREEDY)
        assert got.completion_ids == want and got.stats["compactions"] == 1
    assert sorted(k[0] for k in engine._states) == [8, 16]
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, n=3, seed=5)
    first, again = engine.generate(PROMPTS, sampled), engine.generate(PROMPTS, sampled)
    assert first.completion_ids == again.completion_ids


def test_samples_share_the_prefill_and_differ():
    engine = FastEngine(qwen(), tokenizer=TOK)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0, n=3))
    assert greedy.stats["prefill_rows"] == len(PROMPTS)
    one = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert greedy.completion_ids == [c for c in one.completion_ids for _ in range(3)]
    sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=0))
    for i in range(len(PROMPTS)):
        assert len({tuple(c) for c in sampled.completion_ids[3 * i:3 * i + 3]}) == 3


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_seeded_sampling_is_reproducible(engine):
    eng = make_engine(engine, qwen(), TOK)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=7)
    a, b = eng.generate(PROMPTS, params), eng.generate(PROMPTS, params)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    c = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=8))
    assert c.completion_ids != a.completion_ids


@pytest.mark.parametrize("engine", ["fast", "hf"])
@pytest.mark.slow
def test_update_weights_in_place(engine):
    model = qwen()
    eng = make_engine(engine, model, TOK)
    before = eng.generate(PROMPTS, GREEDY).completion_ids
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in qwen(seed=1).state_dict().items()}
    eng.update_weights(new)
    after = eng.generate(PROMPTS, GREEDY).completion_ids
    fresh_model = qwen(seed=2)
    fresh_model.load_state_dict(new)
    assert after != before
    assert after == make_engine(engine, fresh_model, TOK).generate(PROMPTS, GREEDY).completion_ids
    with pytest.raises(KeyError):
        eng.update_weights({"not.a.weight": torch.zeros(1)})


@pytest.mark.slow
def test_fast_engine_sees_trainer_steps_and_swapped_storage():
    """Fused weights stay the model's parameters: an optimizer step is visible with no copy,
    autograd still works, and a parameter whose storage was swapped is put back."""
    model = qwen()
    engine = FastEngine(model, tokenizer=TOK)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(torch.tensor([PROMPTS[0]]), labels=torch.tensor([PROMPTS[0]])).loss.backward()
    opt.step()
    model.eval()
    assert engine.generate(PROMPTS, GREEDY).completion_ids == hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)
    q = model.model.layers[0].self_attn.k_proj.weight
    q.data = q.data.clone() * 1.5  # e.g. someone's load_state_dict(assign=True)
    got = engine.generate(PROMPTS, GREEDY).completion_ids
    assert got == hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)


def test_factory_and_errors():
    model = qwen("tiny")
    assert make_engine("auto", model, TOK).name == "fast"
    assert make_engine("hf", model, TOK).name == "hf"
    if importlib.util.find_spec("vllm") is None:  # with vLLM: tests/test_vllm.py
        with pytest.raises(ConfigError, match="pip install"):
            make_engine("vllm", model, TOK)
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_engine("nope", model, TOK)
    with pytest.raises(ModelError, match="hf"):
        FastEngine(torch.nn.Linear(2, 2), EOS, PAD)
    with pytest.raises(ValueError):
        FastEngine(model, tokenizer=TOK).generate([[]], GREEDY)


def test_bench_rollout_cli(capsys):
    from nanogrpo.bench.rollout import main

    assert main(["--shape", "tiny", "--batch", "4", "--prompt-len", "8", "--new-tokens", "6",
                 "--engines", "fast,hf", "--repeats", "1"]) == 0
    import json

    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["engine"] for r in rows] == ["fast", "hf"] and all(r["tok_per_s"] > 0 for r in rows)


# ---------------------------------------------------------------- GPU (CUDA graphs, compile, bf16)

@pytest.mark.gpu
@cuda
def test_gpu_graphs_match_hf_fp32():
    model = qwen(device="cuda")
    want = hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)
    for kw in ({}, {"compile": False}, {"cuda_graphs": False, "compile": False}):
        gen = FastEngine(model, tokenizer=TOK, **kw).generate(PROMPTS, GREEDY)
        assert gen.completion_ids == want, kw
    assert FastEngine(model, tokenizer=TOK).generate(PROMPTS, GREEDY).stats["cuda_graphs"] == 1.0


@pytest.mark.gpu
@cuda
def test_gpu_sampling_logprobs_seed_and_updates_bf16():
    model = qwen(device="cuda", dtype=torch.bfloat16)
    engine = FastEngine(model, tokenizer=TOK)
    params = SamplingParams(max_new_tokens=32, temperature=0.9, top_p=0.95, n=4, seed=3)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert a.completion_ids == b.completion_ids
    assert a.stats["cuda_graphs"] == 1.0
    worst = max((forward_logprobs(model, PROMPTS[i // 4], c) - torch.tensor(lp)).abs().max().item()
                for i, (c, lp) in enumerate(zip(a.completion_ids, a.logprobs, strict=True)))
    print(f"bf16 logprob max abs diff vs forward: {worst:.4f}")
    assert worst < 0.25
    states = len(engine._states)
    before = engine.generate(PROMPTS, GREEDY).completion_ids
    engine.update_weights({k: v * 1.1 for k, v in copy.deepcopy(model.state_dict()).items()})
    assert engine.generate(PROMPTS, GREEDY).completion_ids != before
    assert len(engine._states) == states + 1  # the greedy state; nothing re-captured for new weights
