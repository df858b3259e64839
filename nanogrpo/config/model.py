"""``[model]``: which model, its dtype and device, LoRA."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nanogrpo.config.base import _Strict


class ModelConfig(_Strict):
    path: str = "embedded"
    """Local directory or hub id of an HF causal LM; ``embedded`` is nanogrpo's shipped tiny model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """``auto``: bfloat16 on a GPU, float32 on the CPU."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``); a model
    without ``sdpa`` (Gemma2) is loaded with ``eager``, said in one line."""
    device: str = "auto"
    """``auto``: ``cuda`` when available, else ``cpu``."""
    trust_remote_code: bool = False
    """Let transformers run the model repository's own Python code (models not in transformers)."""
    cpu_linear: Literal["auto", "onednn", "torch"] = "auto"
    """On the CPU in float32, linear layers run through oneDNN (``nanogrpo.models.cpu_linear``: ~2x
    MKL's sgemm on AVX-512 AMD CPUs, slower than it on AVX2 ones; same accuracy) or through
    PyTorch's default (``torch``); ``auto`` times both on this CPU, once for the trainer's shapes
    and once for the rollout engine's decode, and takes oneDNN only where it is clearly (25%) faster.
    The two differ in the last bits of a float32 result: pin one for runs that must be bit-identical
    across machines."""
    chat_template: Literal["auto", "plain"] = "auto"
    """``auto`` uses the tokenizer's chat template and fails loudly if it has none;
    ``plain`` renders ``system\\n\\nuser\\n`` text for base models."""
    lora_r: int = Field(0, ge=0)
    """LoRA rank (needs ``peft``); 0 trains all weights. With LoRA the reference log-probs come
    from the same model with its adapters disabled: no second copy."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the adapters' update is scaled by ``lora_alpha / lora_r``."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA adapters' input (0: none, as every RL forward runs without dropout)."""
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Names of the linear modules that get LoRA adapters (peft's ``target_modules``)."""
    train_vision: bool = False
    """Vision-language models: train the vision tower too; false: it is frozen (the projector into the
    language model trains, and LoRA adapts the language model only)."""
    lora_save_merged: bool = False
    """Checkpoints also hold the merged model (``merged/``) besides the adapter."""
