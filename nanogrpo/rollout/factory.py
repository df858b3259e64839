"""Pick a rollout engine by name: ``make_engine("auto" | "fast" | "hf" | "vllm", model, tokenizer)``."""

from __future__ import annotations

from nanogrpo.rollout.engine import Engine

FAST_FAMILIES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
"""Model classes the fast engine implements; ``auto`` falls back to ``hf`` for any other."""

ENGINES = ("auto", "fast", "hf", "vllm")


def make_engine(name: str, model, tokenizer=None, **kwargs) -> Engine:
    """Build the named engine over a live HF model (weights shared with the caller).

    ``kwargs`` go to the engine's constructor (e.g. ``eos_token_id``, ``pad_token_id``,
    ``ignore_eos``). ``vllm`` builds vLLM over a copy of the model's weights (see
    :mod:`nanogrpo.rollout.vllm_engine`); :func:`engine_for` passes it the ``[vllm]`` config.
    """
    if name == "auto":
        name = "fast" if type(model).__name__ in FAST_FAMILIES else "hf"
    if name == "hf":
        from nanogrpo.rollout.hf import HFEngine

        return HFEngine(model, tokenizer=tokenizer, **kwargs)
    if name == "fast":
        from nanogrpo.rollout.fast import FastEngine

        return FastEngine(model, tokenizer=tokenizer, **kwargs)
    if name == "vllm":
        from nanogrpo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer=tokenizer, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {', '.join(ENGINES)}")


def engine_for(cfg, model, tokenizer=None, **kwargs) -> Engine:
    """The engine ``cfg.rollout.engine`` names, with its settings from ``cfg`` (a :class:`Config`)."""
    if cfg.rollout.engine == "vllm":
        from nanogrpo.rollout.vllm_engine import vllm_options

        kwargs = {**vllm_options(cfg), **kwargs}
    return make_engine(cfg.rollout.engine, model, tokenizer, **kwargs)
