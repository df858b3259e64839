"""Tiny random-init mixture-of-experts models and a batch for the MoE tests (tests/test_moe*.py)."""

from __future__ import annotations

import torch
import transformers as tf

from nanogrpo.models.tiny import make_tokenizer
from nanogrpo.rollout.collect import pad_batch

TOK = make_tokenizer()
V, EOS, PAD = len(TOK), TOK.eos_token_id, TOK.pad_token_id
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=V, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
              tie_word_embeddings=False, initializer_range=0.2, max_position_embeddings=128)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

FAMILIES = {
    "qwen3_moe": lambda **kw: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **COMMON, head_dim=8, num_experts=6, norm_topk_prob=True, **{**MOE, **kw})),
    "qwen3_moe_unnormed": lambda **kw: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **COMMON, head_dim=8, num_experts=6, norm_topk_prob=False, **{**MOE, **kw})),
    "olmoe": lambda **kw: tf.OlmoeForCausalLM(tf.OlmoeConfig(
        **COMMON, num_experts=6, norm_topk_prob=False, num_experts_per_tok=2, **kw)),
    "mixtral": lambda **kw: tf.MixtralForCausalLM(tf.MixtralConfig(
        **COMMON, head_dim=8, num_local_experts=6, num_experts_per_tok=2, **kw)),
    # a shared expert beside the routed ones, gated by a sigmoid; biases in q, k, v
    "qwen2_moe": lambda **kw: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        **COMMON, num_experts=6, norm_topk_prob=False, shared_expert_intermediate_size=16, **{**MOE, **kw})),
    # a router with a bias, the softmax over the chosen experts only, clamped SwiGLU experts with biases,
    # attention sinks, sliding and full layers in turn; its expert width is intermediate_size
    "gpt_oss": lambda **kw: tf.GptOssForCausalLM(tf.GptOssConfig(
        **{**COMMON, "intermediate_size": 16}, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
        sliding_window=4, **kw)),
}
ATTENTION = {"gpt_oss": "eager"}
"""Families whose attention transformers runs only eagerly (gpt-oss: its sinks)."""


def build(family: str, seed: int = 0, attn: str | None = None, dtype=torch.float32, **kw):
    """A tiny random-init MoE model of ``family`` (eval mode); ``attn``: sdpa, or the family's own."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FAMILIES[family](**kw)
    model.config._attn_implementation = attn or ATTENTION.get(family, "sdpa")
    return model.to(dtype).eval()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
COMPLETIONS = [[50, 51, 52, EOS], [60, 61], [70, 71, 72, 73, 74], [80], [40, 41, 42], [43, 44, 45, 46, EOS]]


def batch_tensors():
    """Three groups of two rows (a shared prompt each): ids, attention mask, completion mask, P."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    ids, am, cm, _, p = pad_batch(prompts, COMPLETIONS, [[0.0] * len(c) for c in COMPLETIONS], PAD)
    return ids, am, cm, p
