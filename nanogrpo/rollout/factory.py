"""Pick a rollout engine by name: ``make_engine("auto" | "fast" | "hf" | "vllm", model, tokenizer)``."""

from __future__ import annotations

from nanogrpo.rollout.engine import Engine

FAST_FAMILIES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
"""Model classes the fast engine implements; ``auto`` falls back to ``hf`` for any other."""

ENGINES = ("auto", "fast", "hf", "vllm")


def make_engine(name: str, model, tokenizer=None, **kwargs) -> Engine:
    """Build the named engine over a live HF model (weights shared with the caller).

    ``kwargs`` go to the engine's constructor (e.g. ``eos_token_id``, ``pad_token_id``,
    ``ignore_eos``). ``vllm`` is reserved: nanogrpo has no vLLM backend yet, and the
    name only checks that the extra is installed and says so.
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
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ValueError("rollout engine 'vllm' needs the vllm extra, which is not installed "
                             "(pip install vllm); use 'fast' or 'hf' instead") from e
        raise NotImplementedError("rollout engine 'vllm' is not implemented yet; use 'fast' or 'hf'")
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {', '.join(ENGINES)}")
