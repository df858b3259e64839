"""Which models are mixtures of experts, and how each family turns router logits into gate weights.

Every MoE family transformers 5 ships here routes through a ``*TopKRouter`` module whose forward maps
the tokens' hidden states (T, H) to ``(router_logits (T, E), gate weights (T, k), expert ids (T, k))``;
the sparse block then runs each token through its k experts and sums their outputs with the weights.
What differs between families is only how the weights follow from the logits and the chosen experts,
one pure function each (:data:`GATES`), written as the family's own router computes them so that
given the router's own choice they return its own weights bit for bit:

=============================  ===============================================================
family (``model_type``)        gate weights of the experts ``idx`` (T, k)
=============================  ===============================================================
qwen2_moe, qwen3_moe, olmoe    softmax over all E experts (float32), gathered at ``idx``,
                               renormalised to sum 1 when ``norm_topk_prob``, cast to the
                               logits' dtype
mixtral                        softmax over all E (float32), gathered, always renormalised,
                               kept in float32
gpt_oss                        the logits (with the router's bias) gathered at ``idx``, softmax
                               over those k in the logits' dtype
=============================  ===============================================================

So a replayed route keeps the router in the graph: the weights are a differentiable function of the
router's own logits over the recorded experts (:mod:`nanogrpo.moe.replay`).

:func:`moe_spec` finds the routers of a model (plain, LoRA-wrapped, or inside DDP / FSDP2 / DeepSpeed
wrappers) in layer order; :func:`prepare_for_training` turns off what would make a training forward
differ from the sampling one (router jitter noise) or break the log-prob path (the auxiliary
load-balancing loss, which nanogrpo does not train: its ``router_logits`` outputs do not follow
the prefix-shared forward's layout).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanogrpo.errors import ConfigError


class RouteError(ValueError):
    """Routes that do not fit the model or the batch, or a model replay cannot drive; one line."""


MAX_EXPERTS = 32767
"""The most experts a route record names (int16, -1 for none)."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype that holds expert ids ``0 .. num_experts - 1`` and no-route (255 / -1)."""
    if num_experts < 255:
        return torch.uint8
    if num_experts <= MAX_EXPERTS:
        return torch.int16
    raise RouteError(f"{num_experts} experts: route records hold at most {MAX_EXPERTS}")


def softmax_gather(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE / Qwen3-MoE / OLMoE: softmax over all experts, the chosen ones' probabilities,
    renormalised under ``norm_topk_prob``. logits (T, E), idx (T, k) -> (T, k) in the logits' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)                 # (T, E) float32
    top = probs.gather(-1, idx)                                              # (T, k)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)                            # (T, k) sums to 1
    return top.to(logits.dtype)


def softmax_renorm(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax over all experts in float32, gathered, renormalised; stays float32."""
    top = torch.softmax(logits.float(), dim=-1).gather(-1, idx)              # (T, k)
    return top / top.sum(dim=-1, keepdim=True)                               # (T, k)


def topk_softmax(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """gpt-oss: softmax over the chosen experts' logits only, in the logits' dtype."""
    top = logits.gather(-1, idx)                                             # (T, k)
    return torch.softmax(top, dim=1, dtype=top.dtype)                        # (T, k)


GATES: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "qwen2_moe": softmax_gather,
    "qwen3_moe": softmax_gather,
    "olmoe": softmax_gather,
    "mixtral": softmax_renorm,
    "gpt_oss": topk_softmax,
}
"""``config.model_type`` -> its gate weights of given experts: the families routes are recorded and
replayed for."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, eq=False)
class MoeSpec:
    """A mixture-of-experts model's routing, as replay and the route records need it."""

    model_type: str
    routers: tuple[torch.nn.Module, ...]
    """The ``*TopKRouter`` modules, in layer order (one per MoE layer)."""
    names: tuple[str, ...]
    layer_ids: tuple[int, ...]
    """The decoder layer of each router (dense layers between MoE ones have none)."""
    num_layers: int
    """Decoder layers in all (vLLM's route arrays have one row per decoder layer)."""
    num_experts: int
    top_k: int
    gate: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

    @property
    def moe_layers(self) -> int:
        return len(self.routers)

    @property
    def route_dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    @property
    def bytes_per_token(self) -> int:
        """What one token's routes take in a batch: moe_layers x top_k entries of :attr:`route_dtype`."""
        return self.moe_layers * self.top_k * (1 if self.route_dtype == torch.uint8 else 2)

    def describe(self) -> str:
        return (f"{self.model_type}: {self.moe_layers} MoE layers of {self.num_experts} experts, "
                f"top {self.top_k} ({self.bytes_per_token} bytes of routes per token)")


def hf_model(model) -> torch.nn.Module:
    """The transformers model inside wrappers (DDP, DeepSpeed, torch.compile, PEFT, FSDP2 keeps the
    class): the outermost ``PreTrainedModel`` module."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    raise RouteError(f"{type(model).__name__} holds no transformers model: routing replay drives HF MoE "
                     "models")


def _config(model):
    cfg = hf_model(model).config
    return getattr(cfg, "text_config", None) or cfg


def is_moe(model) -> bool:
    """The model routes tokens to experts (its config says so: ``num_experts`` / ``num_local_experts``)."""
    cfg = _config(model)
    return bool(getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0))


def moe_spec(model) -> MoeSpec | None:
    """The model's routing, or None for a dense model. A mixture of experts of a family not in
    :data:`GATES`, or whose routers are not laid out as expected, is a :class:`RouteError`."""
    if not is_moe(model):
        return None
    cfg = _config(model)
    kind = getattr(cfg, "model_type", None)
    gate = GATES.get(kind)
    if gate is None:
        raise RouteError(f"{kind} is a mixture of experts whose routing nanogrpo does not record or replay "
                         f"(it does {', '.join(GATES)}); set moe.routing_replay=off")
    found = [(n, m) for n, m in hf_model(model).named_modules()
             if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")]
    if not found:
        raise RouteError(f"{kind}: no *TopKRouter modules found (a transformers version whose MoE layers "
                         "nanogrpo does not know)")
    layer_ids = []
    for n, _ in found:
        hit = _LAYER.search(n)
        if hit is None:
            raise RouteError(f"{kind}: router {n} is not inside a numbered decoder layer")
        layer_ids.append(int(hit.group(1)))
    routers = tuple(m for _, m in found)
    experts = {int(m.num_experts) for m in routers}
    ks = {int(m.top_k) for m in routers}
    if len(experts) != 1 or len(ks) != 1:
        raise RouteError(f"{kind}: routers disagree on the expert count {sorted(experts)} or the top-k "
                         f"{sorted(ks)}")
    return MoeSpec(model_type=kind, routers=routers, names=tuple(n for n, _ in found),
                   layer_ids=tuple(layer_ids), num_layers=int(cfg.num_hidden_layers),
                   num_experts=experts.pop(), top_k=ks.pop(), gate=gate)


def require_moe(model, mode: str) -> MoeSpec:
    """:func:`moe_spec` for ``moe.routing_replay=mode``: a dense model or an unknown family is a
    :class:`~nanogrpo.errors.ConfigError` (at start, one line)."""
    try:
        spec = moe_spec(model)
    except RouteError as e:
        raise ConfigError(f"moe.routing_replay={mode}: {e}") from None
    if spec is None:
        kind = getattr(_config(model), "model_type", "?")
        raise ConfigError(f"moe.routing_replay={mode} needs a mixture-of-experts model; {kind} is dense "
                          "(no routers to replay): set moe.routing_replay=off")
    return spec


def prepare_for_training(model) -> list[str]:
    """Turn off, on a MoE model, what makes a training forward not the sampling one: router jitter noise
    (Mixtral's ``router_jitter_noise``, applied in train mode, the mode the trainer runs in) and the
    router-logit outputs of the auxiliary load-balancing loss (``output_router_logits``: nanogrpo trains
    no auxiliary loss, and the loss's mask does not follow the prefix-shared forward). Returns what it
    changed, for one log line; a dense model is left as it is. Like dropout, these are forward-time
    settings: call it where the model is loaded, before any wrapper."""
    if not is_moe(model):
        return []
    changed = []
    inner = hf_model(model)
    for name, m in inner.named_modules():
        v = getattr(m, "jitter_noise", None)
        if isinstance(v, float) and v != 0.0:
            m.jitter_noise = 0.0
            changed.append(f"{name}.jitter_noise {v:g} -> 0")
    for cfg in {id(c): c for c in (inner.config, _config(model))}.values():
        if getattr(cfg, "output_router_logits", False):
            cfg.output_router_logits = False
            changed.append("config.output_router_logits -> False")
    return changed
