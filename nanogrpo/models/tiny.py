"""Offline building blocks: a character-level HF tokenizer with a chat template,
and random-init Qwen2-architecture models of named shapes.

Nothing here downloads anything. ``make_tokenizer`` returns a real
``PreTrainedTokenizerFast`` (it saves and loads like any HF tokenizer), and
``make_model`` builds a ``Qwen2ForCausalLM`` from a config alone, so benchmarks
and tests can use e.g. Qwen2.5-0.5B's exact shape without its weights.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from nanogrpo.errors import ModelError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name: (hidden, layers, heads, kv_heads, intermediate, vocab or None for the char vocab, tied)
SHAPES: dict[str, tuple[int, int, int, int, int, int | None, bool]] = {
    "tiny": (64, 2, 4, 2, 128, None, True),
    "demo": (128, 4, 4, 2, 384, None, True),
    "small": (256, 4, 4, 2, 704, None, True),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": (2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
}


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: 3 special tokens + the 100 printable ASCII characters.

    EOS is ``<|im_end|>`` (what the chat template closes each turn with); PAD is
    ``<|endoftext|>``, also used for unknown characters.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(string.printable))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def model_config(shape: str, tokenizer: PreTrainedTokenizerFast | None = None,
                 max_positions: int = 4096) -> Qwen2Config:
    if shape not in SHAPES:
        raise ModelError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    hidden, layers, heads, kv, inter, vocab, tied = SHAPES[shape]
    tok = tokenizer or make_tokenizer()
    return Qwen2Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=inter, vocab_size=vocab or len(tok), max_position_embeddings=max_positions,
        tie_word_embeddings=tied, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )


def make_model(shape: str, tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0,
               dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               attn_implementation: str = "sdpa") -> Qwen2ForCausalLM:
    """A random-init Qwen2 model of a named shape (deterministic for a given seed)."""
    cfg = model_config(shape, tokenizer)
    cfg._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model
