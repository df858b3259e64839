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
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # hub ids pass through
