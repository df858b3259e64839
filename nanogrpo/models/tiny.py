"""Offline building blocks: a character-level HF tokenizer with a chat template,
and random-init Qwen2- and Qwen3-architecture models of named shapes.

Nothing here downloads anything. ``make_tokenizer`` returns a real
``PreTrainedTokenizerFast`` (it saves and loads like any HF tokenizer), and
``make_model`` builds a ``Qwen2ForCausalLM`` (or, for ``qwen3-*`` shapes, a
``Qwen3ForCausalLM``) from a config alone, so benchmarks and tests can use e.g.
Qwen2.5-0.5B's or Qwen3-0.6B's exact shape without its weights.
"""

from __future__ import annotations

import string
from typing import NamedTuple

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from nanogrpo.errors import ModelError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)



class Shape(NamedTuple):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int | None
    """None: the char tokenizer's vocabulary."""
    tied: bool
    head_dim: int | None = None
    """None: hidden // heads."""
    family: str = "qwen2"
    """``qwen2`` (QKV biases) or ``qwen3`` (no biases; RMSNorm on each query / key head)."""


SHAPES: dict[str, Shape] = {
    "tiny": Shape(64, 2, 4, 2, 128, None, True),
    "demo": Shape(128, 4, 4, 2, 384, None, True),
    "small": Shape(256, 4, 4, 2, 704, None, True),
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": Shape(2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": Shape(3584, 28, 28, 4, 18944, 152064, False),
    "qwen3-tiny": Shape(64, 2, 4, 2, 128, None, True, family="qwen3"),
    "qwen3-small": Shape(256, 4, 4, 2, 704, None, True, family="qwen3"),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 3072, 151936, True, 128, "qwen3"),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 6144, 151936, True, 128, "qwen3"),
    "qwen3-4b": Shape(2560, 36, 32, 8, 9728, 151936, True, 128, "qwen3"),
    "qwen3-8b": Shape(4096, 36, 32, 8, 12288, 151936, False, 128, "qwen3"),
}
_CLASSES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


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
                 max_positions: int = 4096) -> PreTrainedConfig:
    if shape not in SHAPES:
        raise ModelError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    sh = SHAPES[shape]
    tok = tokenizer or make_tokenizer()
    # Qwen3Config's own default head_dim is 128, whatever the hidden size: always say it
    extra = {"head_dim": sh.head_dim or sh.hidden // sh.heads} if sh.family == "qwen3" else {}
    return _CLASSES[sh.family][0](
        hidden_size=sh.hidden, num_hidden_layers=sh.layers, num_attention_heads=sh.heads,
        num_key_value_heads=sh.kv_heads, intermediate_size=sh.intermediate, vocab_size=sh.vocab or len(tok),
        max_position_embeddings=max_positions, tie_word_embeddings=sh.tied, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        **extra,
    )


def make_model(shape: str, tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0,
               dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               attn_implementation: str = "sdpa") -> PreTrainedModel:
    """A random-init Qwen2 (or Qwen3, for ``qwen3-*``) model of a named shape (deterministic for a
    given seed)."""
    cfg = model_config(shape, tokenizer)
    cfg._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = _CLASSES[SHAPES[shape].family][1](cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model
