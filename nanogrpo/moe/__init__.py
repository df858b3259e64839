"""Mixture-of-experts models: routing replay (R3, arXiv 2510.11370) and the train-inference mismatch.

A MoE model's rollout engine and its trainer can route a token to different experts (kernels, batch
shapes and precision move the router's top-k), so the trainer's log-probs are not the ones the tokens
were sampled with. Routing replay records the experts the engine chose for every token and forces them
in the trainer's forward, the gate weights still computed from the trainer's own router logits.

    families.py  which models are MoE, their routers, each family's gate weights of given experts
    routes.py    route records: compact dtype, batch layout, micro-batch slices, vLLM's formats
    replay.py    hooks on the HF forward: replay a record, record the model's own, record generate()
    metrics.py   log-prob gap (mean |Δ|, k3 KL, share outside [1/τ, τ]) and router disagreement

What the training loop calls, and at which of its points: :class:`nanogrpo.training.routing.RoutingReplay`.
"""

from nanogrpo.moe.families import (
    GATES,
    MoeSpec,
    RouteError,
    is_moe,
    moe_spec,
    prepare_for_training,
    require_moe,
    route_dtype,
)
from nanogrpo.moe.metrics import mismatch_metrics, mismatch_sums, route_sums, router_disagreement
from nanogrpo.moe.replay import (
    GenerationRoutes,
    RouteStats,
    RouteTrace,
    compare_routes,
    record_routes,
    replay_routes,
)
from nanogrpo.moe.routes import (
    NO_ROUTE,
    batch_routes,
    check_routes,
    from_completion_output,
    from_server_choice,
    from_vllm,
    route_bytes,
    trim_routes,
)

__all__ = [
    "GATES", "GenerationRoutes", "MoeSpec", "NO_ROUTE", "RouteError", "RouteStats", "RouteTrace",
    "batch_routes", "check_routes", "compare_routes", "from_completion_output",
    "from_server_choice", "from_vllm", "is_moe", "mismatch_metrics", "mismatch_sums", "moe_spec",
    "prepare_for_training", "record_routes", "replay_routes", "require_moe", "route_bytes", "route_dtype",
    "route_sums", "router_disagreement", "trim_routes",
]
