"""Which models the fast engine takes, decided on the configuration; RoPE exactly as the model
computes it; clear refusals. (Per-family outputs are checked in ``tests/test_conformance.py``.)"""

from __future__ import annotations

import logging

import pytest
import torch

from nanogrpo.engines import SamplingParams, make_engine
from nanogrpo.engines.factory import choose_engine
from nanogrpo.engines.fast import FastEngine, fast_support
from nanogrpo.engines.fast.cache import rope_table
from nanogrpo.errors import ModelError
from tests.conformance import CASES, TOK, build

ROPE_CASES = [c for c in CASES if "RoPE" in c.name or "longrope" in c.name or c.name.startswith("Qwen3 (")]
DYNAMIC = next(c for c in CASES if c.name.startswith("Llama, dynamic RoPE (max"))


@pytest.mark.parametrize("case", ROPE_CASES, ids=[c.name for c in ROPE_CASES])
def test_rope_table_is_the_models_own_at_every_position_used(case):
    model = build(case)
    rot = model.model.rotary_emb
    limit = FastEngine(model, tokenizer=TOK).rope_limit
    n = limit or 200
    cos, sin = rope_table(rot, n + 64, limit, torch.float32, torch.device("cpu"))
    x = torch.empty(1)
    pos = torch.tensor([[0, 3, 17, n - 1], [5, 9, 2, n - 2]])  # as a batch of two rows, as the model sees it
    want_cos, want_sin = rot(x, pos)
    assert torch.equal(cos[pos], want_cos) and torch.equal(sin[pos], want_sin)
    if limit is not None:  # rows past the exact range are never read (requests that long are refused)
        assert not cos[limit:].any()


def test_dynamic_rope_table_ignores_an_earlier_longer_call():
    """transformers' dynamic module stays rescaled after a call over more than max_position_embeddings
    positions; the engine's table is built as the model computes a sequence within the limit."""
    model = build(DYNAMIC)
    rot = model.model.rotary_emb
    x = torch.empty(1)
    fresh = rot(x, torch.arange(64)[None])[0][0].clone()
    rot(x, torch.arange(300)[None])  # rescales the module's frequencies (as a long forward would)
    cos, _ = rope_table(rot, 64, 64, torch.float32, torch.device("cpu"))
    assert torch.equal(cos, fresh)


def test_length_bound_rope_is_refused_past_its_range(caplog):
    model = build(DYNAMIC)
    with pytest.raises(ModelError, match=r"dynamic RoPE.*64.*rollout.engine=hf"):
        FastEngine(model, tokenizer=TOK, max_len=100)
    engine = FastEngine(model, tokenizer=TOK)
    with pytest.raises(ModelError, match=r"dynamic RoPE.*longer than 64"):
        engine.generate([list(range(5, 55))], SamplingParams(max_new_tokens=20, temperature=0.0))
    assert engine.generate([list(range(5, 45))], SamplingParams(max_new_tokens=20, temperature=0.0))
    with caplog.at_level(logging.INFO, logger="nanogrpo.engines"):
        assert make_engine("auto", model, TOK, max_len=100).name == "hf"
        assert make_engine("auto", model, TOK, max_len=64).name == "fast"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("rollout engine: hf (dynamic RoPE")


def _qwen2():
    return build(CASES[0])


def test_auto_decides_on_the_configuration():
    model = _qwen2()
    assert choose_engine(model)[0] == "fast"
    from nanogrpo.models.cpu_linear import use_onednn_linears

    use_onednn_linears(model)  # what load_model does on the CPU: still plain weights
    assert choose_engine(model)[0] == "fast"
    model.config.rope_parameters = {"rope_type": "mrope", "rope_theta": 1e6}
    name, why = choose_engine(model)
    assert name == "hf" and "rope_type 'mrope'" in why
    with pytest.raises(ModelError, match="rope_type 'mrope'.*use rollout.engine=hf"):
        FastEngine(model, tokenizer=TOK)
    model = _qwen2()
    model.config.hidden_act = "gelu"
    assert choose_engine(model) == ("hf", "hidden_act 'gelu': the fast engine's MLP is SiLU-gated")
    model = _qwen2()
    model.config.model_type = "exotic"  # a class the engine knows, a configuration it does not
    assert choose_engine(model)[0] == "hf"


def test_sliding_layers_per_family():
    from transformers import MistralConfig, Qwen2Config, SmolLM3Config

    from nanogrpo.engines.fast.families import FAMILIES, layer_windows

    def wins(kind, cfg):
        return layer_windows(FAMILIES[kind], cfg)

    q = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert wins("qwen2", q) == [None, None, 8, 8]
    q.layer_types = None  # a config written before transformers had layer_types: max_window_layers says
    assert wins("qwen2", q) == [None, None, 8, 8]
    assert wins("qwen2", Qwen2Config(num_hidden_layers=2, sliding_window=8)) == [None, None]
    assert wins("mistral", MistralConfig(num_hidden_layers=2, sliding_window=5)) == [5, 5]
    assert wins("mistral", MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    s = SmolLM3Config(num_hidden_layers=2, sliding_window=4,
                      layer_types=["sliding_attention", "full_attention"])
    assert wins("smollm3", s) == [None, None]  # use_sliding_window is off
    s.use_sliding_window = True
    assert wins("smollm3", s) == [4, None]


def test_wrapped_or_non_plain_projections_take_hf():
    peft = pytest.importorskip("peft")
    model = _qwen2()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    fam, why = fast_support(lora)
    assert fam is None and "PEFT" in why
    fam, why = fast_support(model)  # the base model now holds LoRA layers: its weights are not the model's
    assert fam is None and "q_proj" in why and "not a plain linear" in why

    class Int8Linear(torch.nn.Linear):  # e.g. a quantised layer: weights are not what they look like
        pass

    model = _qwen2()
    model.model.layers[1].mlp.down_proj.__class__ = Int8Linear
    fam, why = fast_support(model)
    assert fam is None and "model.layers.1.mlp.down_proj is a Int8Linear" in why


def test_moe_takes_hf_with_the_reason(caplog):
    moe = build(next(c for c in CASES if "MoE" in c.name))
    with caplog.at_level(logging.INFO, logger="nanogrpo.engines"):
        assert make_engine("auto", moe, TOK).name == "hf"
    assert [r.getMessage() for r in caplog.records] == [
        "rollout engine: hf (qwen3_moe is a mixture of experts: the fast engine has no grouped expert "
        "matmul; the hf engine computes it exactly)"]


LAYOUT = [c for c in CASES if c.name.startswith(("Mistral, window 6", "Qwen3 (", "Phi3, long", "SmolLM3"))]


@pytest.mark.parametrize("case", LAYOUT, ids=[c.name for c in LAYOUT])
def test_graph_layout_of_windowed_and_length_bound_families_on_cpu(case):
    """The CUDA path's bookkeeping run eagerly on the CPU (row buckets, 64-slot cache lengths,
    warm-ups on the scratch slot, full-cache masked attention): same greedy tokens as generate."""
    from tests.conformance import PROMPTS, hf_greedy

    model = build(case)
    engine = FastEngine(model, tokenizer=TOK, check_every=2)
    engine.use_graphs = True
    got = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert got.completion_ids == hf_greedy(model, PROMPTS, 10)
    assert sorted(k[0] for k in engine._states) == [8]


COMPILED = [c for c in CASES if c.name.split(" ")[0] in ("Qwen3", "OLMo2", "SmolLM3", "Phi3")
            and "longrope" not in c.name]


@pytest.mark.slow
@pytest.mark.parametrize("case", COMPILED, ids=[c.name for c in COMPILED])
def test_compiled_decode_step_of_each_family(case):
    """The GPU path compiles the per-layer functions with fullgraph=True; on the CPU the same
    compile runs (inductor), so a family whose forward does not trace fails here, not on a GPU."""
    import warnings

    model = build(case)
    want = FastEngine(model, tokenizer=TOK, compile=False).generate(PROMPTS_SHORT, GREEDY).completion_ids
    engine = FastEngine(model, tokenizer=TOK, compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = engine.generate(PROMPTS_SHORT, GREEDY).completion_ids
    assert not [w for w in caught if "FastEngine" in str(w.message)], "compile fell back to eager"
    assert engine.use_compile and got == want


PROMPTS_SHORT = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
