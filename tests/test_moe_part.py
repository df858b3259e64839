"""The routing-replay part (nanogrpo.moe.part) driven as the loop will drive it: setup, after the rollout,
around each micro-batch forward (as training/step.py runs them), after each optimizer step, after the step."""

from __future__ import annotations

import pytest
import torch

from nanogrpo.algo.logprobs import token_logprobs
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import Config
from nanogrpo.errors import ConfigError
from nanogrpo.moe import RouteError, record_routes, router_disagreement
from nanogrpo.moe.part import POLICY, RoutingReplay
from nanogrpo.moe.routes import NO_ROUTE, unpack
from nanogrpo.rollout.hf import HFEngine
from nanogrpo.training.step import _trim, micro_batch_indices
from tests.moe_models import TOK, build
from tests.test_moe_engine import rollout


def cfg(mode: str, engine: str = "hf") -> Config:
    return Config.from_dict({}, {"moe.routing_replay": mode, "rollout.engine": engine})


def loop_logprobs(part, model, batch, share: bool = True, **kw) -> torch.Tensor:
    """(N, C) log-probs over micro-batches of 4 rows, each forward under ``part.forward`` (as step.py
    will run them)."""
    out = torch.zeros(batch.completion_mask.shape)
    for rows in micro_batch_indices(batch, 4, 0, share_prefix=share):
        ids, am, p, lm, *_ = _trim(batch, rows)
        with part.forward(model, batch, rows, **kw):
            lp = token_logprobs(model, ids, am, p, lm, share_prefix=share)
        out[rows, :lp.shape[1]] = lp.detach()
    return out


def test_setup_refuses_replay_on_a_dense_model_and_asks_the_engine_for_routes():
    from tests.conformance import CASES
    from tests.conformance import build as build_dense

    dense = build_dense(next(c for c in CASES if c.name.startswith("Qwen3 (")))
    assert RoutingReplay.setup(cfg("off"), dense) is None
    with pytest.raises(ConfigError, match="moe.routing_replay=policy needs a mixture-of-experts model"):
        RoutingReplay.setup(cfg("policy"), dense)
    model = build("mixtral", router_jitter_noise=0.2)
    engine = HFEngine(model, tokenizer=TOK)
    part = RoutingReplay.setup(cfg("off"), model, engine)
    assert part.mode == "off" and engine.record_routes                      # the metric, replay off
    assert model.model.layers[0].mlp.jitter_noise == 0.0

    class NoRoutes:
        name = "vllm"

    with pytest.raises(ConfigError, match="moe.routing_replay=rollout: the vllm engine records no routes"):
        RoutingReplay.setup(cfg("rollout"), model, NoRoutes())


def test_r3_through_the_part_gives_the_engine_s_log_probs_and_logs_the_mismatch():
    model = build("qwen3_moe")
    engine = HFEngine(model, tokenizer=TOK)
    part = RoutingReplay.setup(cfg("rollout"), model, engine)
    batch, _ = rollout(model)
    batch = part.after_rollout(batch)
    assert part.share_prefix(batch)
    lp = loop_logprobs(part, model, batch, measure=True)
    cm = batch.completion_mask
    assert float((lp - batch.old_logprobs)[cm].abs().max()) < 1e-4
    part.after_update(batch, lp)
    loop_logprobs(part, model, batch, measure=True)                         # a second update: not reported
    part.after_update(batch, lp + 5.0)
    m = part.step_metrics(reduce=lambda values, ops: values)
    assert set(m) == {"mismatch_abs", "mismatch_abs_max", "mismatch_kl", "mismatch_ratio_out",
                      "router_disagreement", "routes_groups_dropped"}
    assert m["mismatch_abs"] < 1e-5 and m["router_disagreement"] == 0.0 and m["routes_groups_dropped"] == 0


def test_samples_without_routes_drop_their_group_and_an_engine_without_any_is_refused():
    model = build("qwen3_moe")
    part = RoutingReplay.setup(cfg("rollout"), model, HFEngine(model, tokenizer=TOK))
    batch, _ = rollout(model)                                               # 4 groups of 3
    cut = batch.routes.clone()
    cut[4, batch.prompt_len] = 255                                          # row 4 (group 1): one token lost
    kept = part.after_rollout(RolloutBatch(**{**batch.tensors(), "routes": cut}, prompt_len=batch.prompt_len,
                                           group_size=3))
    assert kept.num_seqs == 9 and 1 not in kept.group_ids.tolist()
    assert part.step_metrics()["routes_groups_dropped"] == 1
    last = batch.routes.clone()
    last[:, -1] = 255                                                       # last tokens only: all kept
    assert part.after_rollout(RolloutBatch(**{**batch.tensors(), "routes": last}, prompt_len=batch.prompt_len,
                                           group_size=3)).num_seqs == 12
    none = RolloutBatch(**{**batch.tensors(), "routes": None}, prompt_len=batch.prompt_len, group_size=3)
    with pytest.raises(RouteError, match="moe.routing_replay=rollout: the batch has no routes"):
        part.after_rollout(none)
    other = batch.routes[..., :1]
    with pytest.raises(RouteError, match="do not fit qwen3_moe's 2 MoE layers x top 2"):
        part.after_rollout(RolloutBatch(**{**batch.tensors(), "routes": other.contiguous()},
                                        prompt_len=batch.prompt_len, group_size=3))
    assert RoutingReplay.setup(cfg("off"), model).after_rollout(none) is none   # off: nothing needed


def test_r2_records_in_the_pass_before_the_update_and_replays_after_the_weights_move():
    model = build("olmoe")
    part = RoutingReplay.setup(cfg("policy"), model, HFEngine(model, tokenizer=TOK))
    batch, _ = rollout(model)
    engine_routes = batch.routes.clone()
    loop_logprobs(part, model, batch, record=True)                           # the pass before the update
    assert batch.meta["routes"] == POLICY
    assert (unpack(batch.routes)[~batch.attention_mask.bool()] == NO_ROUTE).all()
    flipped, compared = router_disagreement(batch.routes, engine_routes)
    assert flipped == 0 and compared > 0                                    # float32: the engine's own
    assert part.step_metrics()["router_disagreement"] == 0.0                # measured in the record pass
    with torch.no_grad():                                                   # the weights move
        for router in part.spec.routers:
            router.weight.add_(torch.randn_like(router.weight))
    moved = loop_logprobs(part, model, batch)                               # replays the record
    plain = loop_logprobs(RoutingReplay("off", part.spec), model, batch)    # routes itself
    assert float((moved - plain)[batch.completion_mask].abs().max()) > 1e-3
    ids, am = batch.input_ids, batch.attention_mask
    with record_routes(model, ids, am) as now:
        token_logprobs(model, ids, am, batch.prompt_len, batch.completion_mask)
    assert router_disagreement(now.routes, batch.routes)[0] > 0             # the record is not today's top-k
    back = RolloutBatch.from_bytes(batch.to_bytes())                        # a mid-batch checkpoint keeps it
    assert back.meta["routes"] == POLICY and torch.equal(back.routes, batch.routes)
