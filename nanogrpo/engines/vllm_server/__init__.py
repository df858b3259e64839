"""``rollout.engine=vllm_server``: rollouts on running vLLM servers, weights synced by the trainer.

- :mod:`~nanogrpo.engines.vllm_server.http`: one server's client (generation, the RL routes), bounded reads;
- :mod:`~nanogrpo.engines.vllm_server.pool`: the servers as one pool (load, failover, taking back);
- :mod:`~nanogrpo.engines.vllm_server.engine`: the :class:`~nanogrpo.engines.base.Engine` over the pool;
- :mod:`~nanogrpo.engines.vllm_server.sync`: the weight sync through vLLM's weight-transfer protocol;
- :mod:`~nanogrpo.engines.vllm_server.adapters`: LoRA runs, the adapter alone after each update;
- :mod:`~nanogrpo.engines.vllm_server.contact`: first contact (reachable, the trainer's model, routes
  returned where the run replays them).

docs/guides/scaling-out.md is the manual.
"""

from __future__ import annotations

import torch

from nanogrpo.engines.hf import resolve_special_ids


def server_engine(cfg, model, tokenizer):
    """The run's :class:`~nanogrpo.engines.vllm_server.engine.ServerEngine` over ``cfg.rollout.servers``
    (``model``: the policy, for its EOS ids and, a mixture of experts, the layout of its routes)."""
    from nanogrpo.engines.vllm_inprocess import import_vllm
    from nanogrpo.engines.vllm_inprocess.routes import route_spec
    from nanogrpo.engines.vllm_server.engine import ServerEngine
    from nanogrpo.engines.vllm_server.http import ServerClient
    from nanogrpo.engines.vllm_server.pool import ServerPool

    import_vllm()  # the trainer-side transfer engines are vLLM's
    v = cfg.vllm_server
    clients = [ServerClient(u, timeout_s=v.request_timeout_s, transfer_timeout_s=v.transfer_timeout_s)
               for u in cfg.rollout.servers]
    pool = ServerPool(clients, max_attempts=v.max_attempts, wait_s=v.wait_s)
    eos, _ = resolve_special_ids(model, tokenizer)
    return ServerEngine(pool, eos, tokenizer=tokenizer, tempered_logprobs=cfg.rollout.tempered_logprobs,
                        stop_strings=cfg.tools.enabled, concurrency=v.concurrency,
                        adapters=serves_adapter(cfg), route_spec=route_spec(model))


def serves_adapter(cfg) -> bool:
    """Whether the servers serve the run's LoRA adapter on its frozen base (only the adapter moves)."""
    return cfg.model.lora_r > 0 and cfg.vllm_server.lora_sync == "adapter"


def state_source(module: torch.nn.Module, dtype: torch.dtype):
    """The policy's weights as a ``WeightSource`` (:class:`~nanogrpo.transfer.source.StateSource`): HF names,
    LoRA adapters merged, ``lm_head.weight`` of a tied model sent (vLLM's CPU build keeps its own copy),
    cast to ``dtype`` (the servers' weights)."""
    from nanogrpo.engines.vllm_inprocess import policy_state_dict
    from nanogrpo.transfer.source import StateSource

    return StateSource(_hf_names(policy_state_dict, module), dtype)


def base_source(module: torch.nn.Module, dtype: torch.dtype):
    """A PEFT policy's frozen base weights (adapters left out, nothing merged) as a ``WeightSource``: what
    a server serving the adapter holds (:mod:`~nanogrpo.engines.vllm_server.adapters`)."""
    from nanogrpo.models.lora import base_state_dict
    from nanogrpo.transfer.source import StateSource

    return StateSource(_hf_names(base_state_dict, module), dtype)


def _hf_names(take, module):
    def state() -> dict[str, torch.Tensor]:
        sd = take(module)
        sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}
        if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return sd

    return state
