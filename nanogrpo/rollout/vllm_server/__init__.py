"""``rollout.engine=vllm_server``: rollouts on running vLLM servers, weights synced by the trainer.

- :mod:`~nanogrpo.rollout.vllm_server.http`: one server's client (generation, the RL routes), bounded reads;
- :mod:`~nanogrpo.rollout.vllm_server.pool`: the servers as one pool (load, failover, taking back);
- :mod:`~nanogrpo.rollout.vllm_server.engine`: the :class:`~nanogrpo.rollout.engine.Engine` over the pool;
- :mod:`~nanogrpo.rollout.vllm_server.sync`: the weight sync through vLLM's weight-transfer protocol.

docs/guides/scaling-out.md is the manual.
"""

from __future__ import annotations

import torch

from nanogrpo.rollout.hf import resolve_special_ids


def server_engine(cfg, model, tokenizer):
    """The run's :class:`~nanogrpo.rollout.vllm_server.engine.ServerEngine` over ``cfg.rollout.servers``
    (``model``: the policy, for its EOS ids)."""
    from nanogrpo.rollout.vllm_engine import import_vllm
    from nanogrpo.rollout.vllm_server.engine import ServerEngine
    from nanogrpo.rollout.vllm_server.http import ServerClient
    from nanogrpo.rollout.vllm_server.pool import ServerPool

    import_vllm()  # the trainer-side transfer engines are vLLM's
    v = cfg.vllm_server
    clients = [ServerClient(u, timeout_s=v.request_timeout_s, transfer_timeout_s=v.transfer_timeout_s)
               for u in cfg.rollout.servers]
    pool = ServerPool(clients, max_attempts=v.max_attempts, wait_s=v.wait_s)
    eos, _ = resolve_special_ids(model, tokenizer)
    return ServerEngine(pool, eos, tokenizer=tokenizer, tempered_logprobs=cfg.rollout.tempered_logprobs,
                        stop_strings=cfg.tools.enabled, concurrency=v.concurrency)


def state_source(module: torch.nn.Module, dtype: torch.dtype):
    """The policy's weights as a ``WeightSource`` (:class:`~nanogrpo.transfer.source.StateSource`): HF names,
    LoRA adapters merged, ``lm_head.weight`` of a tied model sent (vLLM's CPU build keeps its own copy),
    cast to ``dtype`` (the servers' weights)."""
    from nanogrpo.rollout.vllm_engine import policy_state_dict
    from nanogrpo.transfer.source import StateSource

    def state() -> dict[str, torch.Tensor]:
        sd = policy_state_dict(module)
        sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}
        if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return sd

    return StateSource(state, dtype)
