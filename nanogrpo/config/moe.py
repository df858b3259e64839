"""``[moe]``: mixture-of-experts models: routing replay and the mismatch metrics (:mod:`nanogrpo.moe`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nanogrpo.config.base import _Strict

ReplayMode = Literal["off", "rollout", "policy"]


class MoeConfig(_Strict):
    """How the trainer routes the tokens of a mixture-of-experts model. A MoE model's engine and trainer can
    send a token to different experts (other kernels, batch shapes, precision), so the trainer's log-probs
    are not those the tokens were sampled with; replaying the engine's routes closes most of that gap
    (R3, arXiv 2510.11370). The mismatch metrics (``mismatch_*``, ``router_disagreement``) are logged for
    every MoE model, replay on or off."""

    routing_replay: ReplayMode = "off"
    """off: the trainer's routers choose their own experts. rollout (R3): the engine records the experts
    every MoE layer chose for every prompt and completion token, and the trainer's forwards (policy, and
    the old-policy and reference ones where they run) use them, the gate weights computed from the
    trainer's own router logits over those experts (so the router still learns). policy (R2): the trainer
    records its own routes at the weights that sampled the batch (a forward over the batch before its
    first optimizer step) and replays them in its updates (mini-batches, several epochs), whatever the
    engine. Needs a mixture-of-experts model
    (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral, gpt-oss); rollout needs an engine that records routes: hf, vllm
    (built with ``enable_return_routed_experts``) or vllm_server (servers started with
    ``--enable-return-routed-experts``, as ``nanogrpo vllm-serve`` starts them for this mode); vLLM needs its
    Model Runner V2 for that, which its CPU build (no Triton) lacks."""
    ratio_band: float = Field(2.0, gt=1.0)
    """τ of ``mismatch_ratio_out``: the share of trained tokens whose trainer/engine probability ratio leaves
    [1/τ, τ]."""


def check_moe(cfg) -> None:
    """``[moe]`` agrees with the rest of the config (ValueError). Whether the model is a mixture of experts
    is checked when it is loaded (:func:`nanogrpo.moe.require_moe`)."""
    mode = cfg.moe.routing_replay
    if mode != "rollout":
        return
    if cfg.tools.enabled or cfg.env.source:
        raise ValueError("moe.routing_replay=rollout: multi-turn rollouts (tools.enabled, env.source) do not "
                         "record routes yet; use moe.routing_replay=policy")
    engine = cfg.rollout.engine
    if engine == "fast":
        raise ValueError("moe.routing_replay=rollout: the fast engine does not run mixture-of-experts "
                         "models; set rollout.engine=hf (or auto, which picks hf for them)")
    if engine == "vllm" and not cfg.vllm.enable_prefix_caching:
        raise ValueError("moe.routing_replay=rollout: vLLM returns MoE routes only with its prefix cache on; "
                         "set vllm.enable_prefix_caching=true")
