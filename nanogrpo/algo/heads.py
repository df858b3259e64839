"""What a model's logits are, read off its type: the linear head's output as it is (the lean path of
:mod:`nanogrpo.algo.logprobs` applies), or that output mapped elementwise (a scale, a soft cap:
:data:`LOGIT_MAPS`), or not known to be either."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PLAIN_HEAD_TYPES = {"qwen2", "qwen3", "llama", "mistral", "ministral", "qwen2_moe", "qwen3_moe", "phi3",
                    "olmo2", "smollm3", "gpt2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "olmoe", "mixtral"}
"""Model types whose logits are exactly ``lm_head(last hidden state)``: the lean path applies.
(Gemma2/3 soft-cap their logits, Cohere and Granite scale them: :data:`LOGIT_MAPS`, not here.)
Checked by ``tests/test_conformance.py``."""
VISION_WRAPPERS = {"llava"}
"""Vision-language types whose head is their language model's: plain when that model's type is."""


@dataclass(frozen=True)
class LogitMap:
    """What a model's forward does to its linear head's output before the softmax, in transformers'
    order: ``z * scale``, then ``z / divide``, then the soft cap ``cap * tanh(z / cap)``. The identity
    (the default) for the :data:`PLAIN_HEAD_TYPES`."""

    scale: float = 1.0
    divide: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.divide == 1.0 and not self.softcap

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """The model's logits from its head's output z (..., V), out of place (autograd sees it)."""
        if self.scale != 1.0:
            z = z * self.scale                                                # (..., V)
        if self.divide != 1.0:
            z = z / self.divide
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def _num(x, default: float = 1.0) -> float:
    return default if x is None else float(x)


LOGIT_MAPS: dict[str, Callable[[torch.nn.Module], LogitMap]] = {
    # logits = lm_head(h) * self.logit_scale (the model's attribute, config.logit_scale at init)
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"),
                    lambda m: LogitMap(scale=_num(getattr(m, "logit_scale", m.config.logit_scale)))),
    # logits = tanh(lm_head(h) / cap) * cap when config.final_logit_softcapping is set
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma", "nanochat"),
                    lambda m: LogitMap(softcap=m.config.final_logit_softcapping or None)),
    # logits = lm_head(h) / config.logits_scaling
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared",
                     "granitemoehybrid"),
                    lambda m: LogitMap(divide=_num(m.config.logits_scaling))),
    # logits = lm_head(h) * config.logits_scaling (muP; Granite divides by its namesake)
    "hyperclovax": lambda m: LogitMap(scale=_num(m.config.logits_scaling)),
    # logits = lm_head(h) * self.model.lm_head_multiplier
    "falcon_h1": lambda m: LogitMap(scale=_num(getattr(m.model, "lm_head_multiplier",
                                                       m.config.lm_head_multiplier))),
}
"""Model types whose logits are their linear head's output mapped elementwise (each entry: the
transformers ``*ForCausalLM`` module -> its :class:`LogitMap`, read off the model as its forward reads
it). Checked against each family's own ``forward().logits`` by ``tests/test_logit_maps.py``. Their
log-probs take the ``full`` path (the model's forward applies the map after the head, so the lean head
cannot stand in for it); a distillation teacher's head projection applies the map
(:func:`logit_map`)."""


def unwrap(model):
    """The HF model inside DDP / DeepSpeed / torch.compile wrappers (PEFT models pass through)."""
    seen = 0
    while seen < 8:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model, seen = inner, seen + 1
    return model


def logit_map(model) -> LogitMap | None:
    """What ``model``'s forward does to its linear head's output: the identity for the
    :data:`PLAIN_HEAD_TYPES`, the family's map for :data:`LOGIT_MAPS`, None for anything else (its logits
    are not known to be a function of the head's output alone). ``model`` may be wrapped (DDP, PEFT, ...)."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner   # PEFT
    cfg = getattr(inner, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype in VISION_WRAPPERS:
        mtype = getattr(getattr(cfg, "text_config", None), "model_type", None)
        return LogitMap() if mtype in PLAIN_HEAD_TYPES else None
    if mtype in PLAIN_HEAD_TYPES:
        return LogitMap()
    make = LOGIT_MAPS.get(mtype)
    return None if make is None else make(inner)
