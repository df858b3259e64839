"""Model and tokenizer loading: round trips, clear errors."""

import pytest

from nanogrpo.errors import ModelError
from nanogrpo.models.load import load_tokenizer, resolve_model_path
from nanogrpo.models.tiny import make_model, make_tokenizer


def test_char_tokenizer_round_trips_through_save_and_load(tmp_path):
    # a Qwen2 config.json beside a generic tokenizer must not turn it into Qwen2Tokenizer
    tok = make_tokenizer()
    make_model("tiny", tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    text = "<think>12 + 3 = 15</think>\n<answer>15</answer>"
    assert loaded(text).input_ids == tok(text).input_ids
    assert loaded.decode(loaded(text).input_ids) == text
    msgs = [{"role": "user", "content": "What is 1 + 2?"}]
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)


def test_missing_paths_are_clear(tmp_path):
    with pytest.raises(ModelError, match="model path not found"):
        resolve_model_path("./nope/model")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    # hub ids: tests/test_hub_source.py


def _saved(tmp_path, case_prefix: str):
    from tests.conformance import CASES, TOK, build

    case = next(c for c in CASES if c.name.startswith(case_prefix))
    model = build(case)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(tmp_path)
    TOK.save_pretrained(tmp_path)
    return case, model


def test_a_model_without_sdpa_loads_with_eager_and_says_so(tmp_path, caplog):
    import logging

    import torch

    from nanogrpo.models.load import load_model

    _saved(tmp_path, "Gemma2")
    with caplog.at_level(logging.INFO, logger="nanogrpo.models"):
        model = load_model(str(tmp_path), torch.float32, torch.device("cpu"))  # the default, sdpa
    assert model.config._attn_implementation == "eager"
    assert [r.getMessage() for r in caplog.records if "attention" in r.getMessage()] == [
        f"{tmp_path} has no sdpa attention in this transformers; loading it with "
        "model.attn_implementation=eager"]
    with pytest.raises(ModelError, match="=flash_attention_2.*set model.attn_implementation"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), "flash_attention_2")


def test_dropout_is_off_in_train_mode_and_the_config_keeps_it(tmp_path):
    """GPT-2 with dropout 0.1: after load_model its train-mode forward is the eval-mode forward, it is
    still in train mode (gradient checkpointing needs it, and still recomputes), and the config is intact."""
    import torch

    from nanogrpo.models.load import load_model

    _, orig = _saved(tmp_path, "GPT-2")
    model = load_model(str(tmp_path), torch.float32, torch.device("cpu"), cpu_linear="torch")
    assert (model.config.resid_pdrop, model.config.attn_pdrop, model.config.embd_pdrop) == (0.1, 0.1, 0.1)
    ids = torch.randint(3, 100, (2, 20))
    model.gradient_checkpointing_enable()
    model.train()
    calls = []
    model.transformer.h[0].attn.register_forward_hook(lambda *a: calls.append(1))
    out = model(ids).logits
    out.sum().backward()
    assert len(calls) == 2  # forward, then recomputed in backward: checkpointing still acts
    with torch.no_grad():
        assert torch.equal(out.detach(), model(ids).logits) and all(m.training for m in model.modules())
        model.eval()
        assert torch.allclose(out.detach(), model(ids).logits, atol=1e-6)
    model.save_pretrained(tmp_path / "again")
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "again").resid_pdrop == 0.1
    # without load_model's switch the same forward is perturbed: the check above can fail
    orig.train()
    assert not torch.allclose(orig(ids).logits, orig(ids).logits)
