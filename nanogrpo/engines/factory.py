"""Pick a rollout engine by name: ``make_engine("auto" | "fast" | "hf" | "vllm", model, tokenizer)``;
``engine_for(cfg, ...)`` also builds ``vllm_server`` (running vLLM servers, from the config)."""

from __future__ import annotations

import logging

from nanogrpo.engines.base import Engine

ENGINES = ("auto", "fast", "hf", "vllm", "vllm_server")
log = logging.getLogger("nanogrpo.engines")


def choose_engine(model, max_len: int | None = None) -> tuple[str, str]:
    """What ``auto`` picks for ``model`` and why: ``fast`` when it computes this configuration
    exactly (:func:`nanogrpo.engines.fast.families.fast_support`), else ``hf``."""
    from nanogrpo.engines.fast.families import fast_support

    fam, why = fast_support(model, max_len)
    return ("fast" if fam is not None else "hf"), why


def make_engine(name: str, model, tokenizer=None, *, max_len: int | None = None, **kwargs) -> Engine:
    """Build the named engine over a live HF model (weights shared with the caller).

    ``auto`` decides on the model's configuration and logs its choice and the reason in one
    line. ``max_len``: the longest prompt + completion the engine will be asked for, when the
    caller knows it (a length-bound RoPE type is exact only up to some length). ``kwargs`` go
    to the engine's constructor (e.g. ``eos_token_id``, ``pad_token_id``, ``ignore_eos``).
    ``vllm`` builds vLLM over a copy of the model's weights (see
    :mod:`nanogrpo.engines.vllm_inprocess`); :func:`engine_for` passes it the ``[vllm]`` config.
    """
    from nanogrpo.models.vision import is_vision

    vision = is_vision(model)
    if name == "auto" and vision:
        name = "hf"
        log.info("rollout engine: hf (a vision-language model: the fast engine has no vision tower)")
    elif name == "auto":
        name, why = choose_engine(model, max_len)
        log.info("rollout engine: %s (%s)", name, why)
    if vision and name in ("fast", "vllm"):
        why = ("the fast engine has no vision tower nor M-RoPE positions" if name == "fast" else
               "nanogrpo does not pass images to vLLM yet")
        raise ValueError(f"rollout.engine={name} cannot run the vision-language model "
                         f"{model.config.model_type}: "
                         f"{why}; use rollout.engine=hf")
    if name == "hf":
        from nanogrpo.engines.hf import HFEngine

        kwargs.pop("cpu_linear", None)  # hf generates through the model's own linears
        return HFEngine(model, tokenizer=tokenizer, **kwargs)
    if name == "fast":
        from nanogrpo.engines.fast import FastEngine

        return FastEngine(model, tokenizer=tokenizer, max_len=max_len, **kwargs)
    if name == "vllm":
        from nanogrpo.engines.vllm_inprocess import VLLMEngine

        return VLLMEngine(model, tokenizer=tokenizer, **kwargs)
    if name == "vllm_server":
        raise ValueError("rollout engine vllm_server is built from a config (its servers): use "
                         "engine_for(cfg, ...)")
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {', '.join(ENGINES)}")


def engine_for(cfg, model, tokenizer=None, *, cpu_linear: str | None = None, **kwargs) -> Engine:
    """The engine ``cfg.rollout.engine`` names, with its settings from ``cfg`` (a :class:`Config`);
    ``cpu_linear``: the fast engine's, in place of ``cfg.model.cpu_linear`` (a training run's settled
    decision, :func:`~nanogrpo.models.cpu_linear.settle`)."""
    if cfg.rollout.engine in ("fast", "auto"):
        kwargs = {"cpu_linear": cpu_linear or cfg.model.cpu_linear, **kwargs}
    if cfg.rollout.engine == "vllm_server":
        from nanogrpo.engines.vllm_server import server_engine

        return server_engine(cfg, model, tokenizer)
    if cfg.rollout.engine == "vllm":
        from nanogrpo.engines.vllm_inprocess import vllm_options

        kwargs = {**vllm_options(cfg, kwargs.get("max_len")), **kwargs}
    engine = make_engine(cfg.rollout.engine, model, tokenizer, **kwargs)
    from nanogrpo.models.vision import image_spec, is_vision

    if is_vision(model):
        engine.vision = image_spec(model, tokenizer, None, cfg.data.min_image_pixels,
                                   cfg.data.max_image_pixels)
    return engine
