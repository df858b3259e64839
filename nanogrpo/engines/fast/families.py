"""What each model family does differently, in one place: a spec per family, pure functions.

The fast engine has one forward (:mod:`.forward`) for every family here: decoder layers of
grouped-query attention with RoPE and a SiLU-gated MLP, RMSNorm, a linear LM head. What
differs is a field of :class:`Family` or one of the functions below it:

=========  ==================================================================================
family     differences from Llama (the reference: its ``attention_bias`` / ``mlp_bias`` are
           read off the modules, as every family's biases are)
=========  ==================================================================================
qwen2      q/k/v biases; sliding-window layers from ``layer_types`` (``use_sliding_window``)
qwen3      an RMSNorm over each query and key head before RoPE (``q_norm`` / ``k_norm``)
mistral    a sliding window on every layer when ``sliding_window`` is set
ministral  sliding-window layers from ``layer_types``
olmo2      an RMSNorm over the whole query / key projection; the norms after attention and
           MLP instead of before them; its RMSNorm rounds after the weight
smollm3    no RoPE on the layers ``no_rope_layers`` marks 0; windows from ``layer_types``
phi3       fused ``qkv_proj`` / ``gate_up_proj``; partial rotary; a window on every layer
=========  ==================================================================================

RoPE comes from the model's own rotary module (see :func:`nanogrpo.engines.fast.cache.rope_table`),
so every rope type whose frequencies are fixed is reproduced exactly: default, linear, yarn,
llama3. ``dynamic`` and ``longrope`` recompute their frequencies from the length of each call
(transformers rescales past ``max_position_embeddings`` / ``original_max_position_embeddings``),
so the engine is exact, and accepts sequences, only up to that length.

:func:`fast_support` decides from the configuration, and from the modules the model actually
has (a LoRA-wrapped or quantised projection is not a plain weight), whether the fast engine
computes the model exactly, and says in one line why not when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanogrpo.models.cpu_linear import OneDnnLinear


@dataclass(frozen=True)
class Family:
    qk_norm: str | None = None
    """``"head"``: an RMSNorm over each head's D (Qwen3); ``"flat"``: over the whole projection (OLMo2)."""
    post_norm: bool = False
    """Norm the attention and MLP *outputs* (OLMo2's ``post_attention_layernorm`` /
    ``post_feedforward_layernorm``) instead of their inputs."""
    scale_then_round: bool = False
    """RMSNorm as ``(w * x_normed).to(dtype)`` (OLMo2) instead of ``w * x_normed.to(dtype)``."""
    fused: bool = False
    """One ``qkv_proj`` and one ``gate_up_proj`` module (Phi3) instead of q/k/v and gate/up."""
    window_every_layer: bool = False
    """``config.sliding_window``, when set, applies to every layer (Mistral, Phi3); the other
    families list their sliding layers in ``config.layer_types``."""
    nope_layers: bool = False
    """``config.no_rope_layers[i] == 0``: layer i has no RoPE (SmolLM3)."""


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="head"),
    "mistral": Family(window_every_layer=True),
    "ministral": Family(),
    "olmo2": Family(qk_norm="flat", post_norm=True, scale_then_round=True),
    "smollm3": Family(nope_layers=True),
    "phi3": Family(fused=True, window_every_layer=True),
}
"""``config.model_type`` -> its spec: the families the fast engine implements."""

STATIC_ROPE = ("default", "linear", "yarn", "llama3")
"""RoPE types with fixed frequencies: the engine's table equals the model's at every position."""
LENGTH_BOUND_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the length of each call: exact up to :func:`rope_limit`."""
PLAIN_LINEARS = (torch.nn.Linear, OneDnnLinear)


@dataclass
class LayerParts:
    """The modules of one decoder layer the fast engine reads its weights from."""

    qkv: list[torch.nn.Module]
    """``[q_proj, k_proj, v_proj]``, or ``[qkv_proj]`` (rows q, then k, then v)."""
    o: torch.nn.Module
    gate_up: list[torch.nn.Module]
    """``[gate_proj, up_proj]``, or ``[gate_up_proj]`` (rows gate, then up)."""
    down: torch.nn.Module
    norm1: torch.nn.Module
    """Before attention, or after it (``Family.post_norm``)."""
    norm2: torch.nn.Module
    """Before the MLP, or after it (``Family.post_norm``)."""
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None

    def linears(self) -> list[torch.nn.Module]:
        return [*self.qkv, self.o, *self.gate_up, self.down]


def layer_parts(fam: Family, layer: torch.nn.Module) -> LayerParts:
    a, m = layer.self_attn, layer.mlp
    return LayerParts(
        qkv=[a.qkv_proj] if fam.fused else [a.q_proj, a.k_proj, a.v_proj], o=a.o_proj,
        gate_up=[m.gate_up_proj] if fam.fused else [m.gate_proj, m.up_proj], down=m.down_proj,
        norm1=layer.post_attention_layernorm if fam.post_norm else layer.input_layernorm,
        norm2=layer.post_feedforward_layernorm if fam.post_norm else layer.post_attention_layernorm,
        q_norm=a.q_norm if fam.qk_norm else None, k_norm=a.k_norm if fam.qk_norm else None)


def layer_windows(fam: Family, cfg) -> list[int | None]:
    """Per layer: its sliding window W (a query sees the W keys ending at itself), or None."""
    n, w = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None)
    if not w:
        return [None] * n
    if fam.window_every_layer:
        return [int(w)] * n
    types = getattr(cfg, "layer_types", None)
    if types is None and getattr(cfg, "max_window_layers", None) is not None:  # configs without layer_types
        types = ["sliding_attention" if i >= cfg.max_window_layers else "full_attention" for i in range(n)]
    types = types or ["full_attention"] * n
    on = getattr(cfg, "use_sliding_window", True) is not False
    return [int(w) if on and t == "sliding_attention" else None for t in types]


def layer_rope(fam: Family, cfg) -> list[bool]:
    """Per layer: whether it applies RoPE."""
    n = cfg.num_hidden_layers
    if fam.nope_layers and getattr(cfg, "no_rope_layers", None) is not None:
        return [bool(x) for x in cfg.no_rope_layers]
    return [True] * n


def rope_params(cfg) -> dict:
    """The config's RoPE parameters (``rope_parameters`` in transformers 5, ``rope_scaling`` before)."""
    p = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return dict(p) if isinstance(p, dict) else {}


def rope_type(cfg) -> str:
    p = rope_params(cfg)
    if p and all(isinstance(v, dict) for v in p.values()):  # one RoPE per layer type (Gemma3, OLMo3)
        return "per-layer-type"
    return str(p.get("rope_type") or p.get("type") or "default")


def rope_limit(cfg) -> tuple[int | None, str | None]:
    """(the longest sequence the engine's RoPE equals the model's for, None = any length;
    or a reason the engine cannot reproduce this rope type at all)."""
    kind = rope_type(cfg)
    if kind in STATIC_ROPE:
        return None, None
    if kind == "dynamic":
        return int(cfg.max_position_embeddings), None
    if kind == "longrope":
        orig = (rope_params(cfg).get("original_max_position_embeddings")
                or getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings)
        return int(orig), None
    return None, (f"rope_type {kind!r} is not one the fast engine reproduces "
                  f"({', '.join(STATIC_ROPE + LENGTH_BOUND_ROPE)})")


def length_bound_reason(cfg, limit: int, length: int) -> str:
    return (f"{rope_type(cfg)} RoPE: transformers recomputes its frequencies for sequences longer than "
            f"{limit} tokens, and these reach {length}")


def fast_support(model, max_len: int | None = None) -> tuple[Family | None, str]:
    """(the model's family spec, why it runs on the fast engine) or (None, why it does not).

    ``max_len``: the longest sequence (prompt + completion) the engine will be asked for, if known.
    Decides on ``model.config`` and the modules present, never on the class name."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None, (f"{type(model).__name__} is not a plain transformers model (PEFT/LoRA or another "
                      "wrapper): the fast engine reads plain weights only")
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0):
        return None, (f"{kind} is a mixture of experts: the fast engine has no grouped expert matmul; "
                      "the hf engine computes it exactly")
    fam = FAMILIES.get(kind)
    if fam is None:
        return None, f"model_type {kind!r} is not a family the fast engine implements ({', '.join(FAMILIES)})"
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return None, f"hidden_act {act!r}: the fast engine's MLP is SiLU-gated"
    limit, why = rope_limit(cfg)
    if why:
        return None, why
    if limit is not None and max_len is not None and max_len > limit:
        return None, length_bound_reason(cfg, limit, max_len)
    try:
        layers = list(model.model.layers)
        parts = [layer_parts(fam, lyr) for lyr in layers]
        head = model.get_output_embeddings()
    except AttributeError as e:
        return None, f"{kind}: the modules are not laid out as the fast engine expects ({e})"
    names = {m: n for n, m in model.named_modules()}
    for mod in (m for p in parts for m in p.linears()):
        if type(mod) not in PLAIN_LINEARS:
            return None, (f"{names.get(mod, '?')} is a {type(mod).__name__} (LoRA, quantised or custom), "
                          "not a plain linear layer")
    if not isinstance(head, torch.nn.Linear):
        return None, f"the LM head is a {type(head).__name__}, not a linear layer"
    extra = "" if limit is None else f", exact up to {limit} tokens ({rope_type(cfg)} RoPE)"
    return fam, f"{kind} is a family the fast engine implements{extra}"
