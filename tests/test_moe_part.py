"""The routing-replay part (nanogrpo.training.routing) driven as the loop drives it: setup, after the rollout,
around each micro-batch forward (as training/step.py runs them), the update's metrics, after the step."""

from __future__ import annotations

import pytest
import torch

from nanogrpo.algo.logprobs import token_logprobs
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import Config
from nanogrpo.engines.hf import HFEngine
from nanogrpo.errors import ConfigError
from nanogrpo.moe import RouteError, record_routes, router_disagreement
from nanogrpo.moe.routes import NO_ROUTE, unpack
from nanogrpo.training.micro import micro_batch_indices, trim_rows
from nanogrpo.training.routing import POLICY, RoutingReplay
from tests.moe_models import TOK, build
from tests.test_moe_engine import rollout


def _one_process():
    from types import SimpleNamespace

    return SimpleNamespace(backend=SimpleNamespace(world_size=1))


def cfg(mode: str, engine: str = "hf") -> Config:
    return Config.from_dict({}, {"moe.routing_replay": mode, "rollout.engine": engine})


def loop_logprobs(part, model, batch, share: bool = True, kind: str = "pass") -> torch.Tensor:
    """(N, C) log-probs over micro-batches of 4 rows, each forward under ``part.forward`` (as step.py
    runs them)."""
    out = torch.zeros(batch.completion_mask.shape)
    for rows in micro_batch_indices(batch, 4, 0, share_prefix=share):
        ids, am, p, lm, *_ = trim_rows(batch, rows)
        with part.forward(model, batch, rows, kind):
            lp = token_logprobs(model, ids, am, p, lm, share_prefix=share)
        out[rows, :lp.shape[1]] = lp.detach()
    return out


def test_setup_refuses_replay_on_a_dense_model_and_asks_the_engine_for_routes():
    from tests.conformance import CASES
    from tests.conformance import build as build_dense

    dense = build_dense(next(c for c in CASES if c.name.startswith("Qwen3 (")))
    assert RoutingReplay.for_run(cfg("off"), dense) is None
    with pytest.raises(ConfigError, match="moe.routing_replay=policy needs a mixture-of-experts model"):
        RoutingReplay.for_run(cfg("policy"), dense)
    model = build("mixtral", router_jitter_noise=0.2)
    engine = HFEngine(model, tokenizer=TOK)
    part = RoutingReplay.for_run(cfg("off"), model, engine)
    assert part.mode == "off" and engine.record_routes                      # the metric, replay off
    assert model.model.layers[0].mlp.jitter_noise == 0.0

    class NoRoutes:
        name = "vllm"

    with pytest.raises(ConfigError, match="moe.routing_replay=rollout: the vllm engine records no routes"):
        RoutingReplay.for_run(cfg("rollout"), model, NoRoutes())


def test_r3_through_the_part_gives_the_engine_s_log_probs_and_logs_the_mismatch():
    model = build("qwen3_moe")
    engine = HFEngine(model, tokenizer=TOK)
    part = RoutingReplay.for_run(cfg("rollout"), model, engine)
    batch, _ = rollout(model)
    batch = part.check(batch)
    assert part.share_prefix(batch)
    lp = loop_logprobs(part, model, batch, kind="update")
    cm = batch.completion_mask
    assert float((lp - batch.old_logprobs)[cm].abs().max()) < 1e-4
    part.stats()                                                            # (this pass's counts: dropped)
    # the run's update, two optimizer steps on the batch: the step reports its first (the sampling weights)
    from nanogrpo.algo.entropy import EntropyControl
    from nanogrpo.training.backend import Backend
    from nanogrpo.training.schedule import Schedule, run_updates
    from nanogrpo.training.step import step_metrics

    batch.advantages = torch.linspace(-1.0, 1.0, batch.num_seqs)           # a gradient to move the weights
    run_cfg = Config.from_dict({}, {"grpo.group_size": 3, "grpo.beta": 0.0, "grpo.updates_per_batch": 2,
                                    "train.lr": 0.5, "rollout.engine": "hf"})
    sched = run_updates(Backend(model, lr=0.5), batch, run_cfg, Schedule(parts=1), fresh=True, exact=True,
                        control=EntropyControl.from_config(run_cfg.grpo), terms=part)
    m = step_metrics(sched.results, 1, part.first_update)
    assert {"mismatch_abs", "mismatch_abs_max", "mismatch_kl", "mismatch_ratio_out",
            "router_disagreement"} <= set(m)
    assert m["mismatch_abs"] < 1e-5 and m["router_disagreement"] == 0.0
    assert sched.results[1].metrics["mismatch_abs"] > 1e-3                  # the second: the weights moved
    row = {}
    part.after_step(_one_process(), 1, None, row)
    assert row["routes_groups_dropped"] == 0


def test_samples_without_routes_drop_their_group_and_an_engine_without_any_is_refused():
    model = build("qwen3_moe")
    part = RoutingReplay.for_run(cfg("rollout"), model, HFEngine(model, tokenizer=TOK))
    batch, _ = rollout(model)                                               # 4 groups of 3
    cut = batch.routes.clone()
    cut[4, batch.prompt_len] = 255                                          # row 4 (group 1): one token lost
    kept = part.check(RolloutBatch(**{**batch.tensors(), "routes": cut}, prompt_len=batch.prompt_len,
                                           group_size=3))
    assert kept.num_seqs == 9 and 1 not in kept.group_ids.tolist()
    row = {}
    part.after_step(_one_process(), 1, None, row)
    assert row["routes_groups_dropped"] == 1
    last = batch.routes.clone()
    last[:, -1] = 255                                                       # last tokens only: all kept
    assert part.check(RolloutBatch(**{**batch.tensors(), "routes": last}, prompt_len=batch.prompt_len,
                                           group_size=3)).num_seqs == 12
    none = RolloutBatch(**{**batch.tensors(), "routes": None}, prompt_len=batch.prompt_len, group_size=3)
    with pytest.raises(RouteError, match="moe.routing_replay=rollout: the batch has no routes"):
        part.check(none)
    other = batch.routes[..., :1]
    with pytest.raises(RouteError, match="do not fit qwen3_moe's 2 MoE layers x top 2"):
        part.check(RolloutBatch(**{**batch.tensors(), "routes": other.contiguous()},
                                        prompt_len=batch.prompt_len, group_size=3))
    assert RoutingReplay.for_run(cfg("off"), model).check(none) is none   # off: nothing needed


def test_r2_records_in_the_pass_before_the_update_and_replays_after_the_weights_move():
    model = build("olmoe")
    part = RoutingReplay.for_run(cfg("policy"), model, HFEngine(model, tokenizer=TOK))
    batch, _ = rollout(model)
    engine_routes = batch.routes.clone()
    loop_logprobs(part, model, batch, kind="proximal")                       # the pass before the update
    assert batch.meta["routes"] == POLICY
    assert (unpack(batch.routes)[~batch.attention_mask.bool()] == NO_ROUTE).all()
    flipped, compared = router_disagreement(batch.routes, engine_routes)
    assert flipped == 0 and compared > 0                                    # float32: the engine's own
    counted = {k: float(v) for k, v in part.stats().items()}                # measured in the record pass
    assert part.metrics(counted)["router_disagreement"] == 0.0
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


@pytest.mark.slow  # two short runs through the command line (over the fast suite's 0.4 s a test)
@pytest.mark.parametrize("fam", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("mode", ["rollout", "policy"])
def test_qwen2_moe_and_gpt_oss_train_from_a_directory_with_replay(fam, mode, tmp_path):
    """Beyond the demo's Qwen3-MoE: a tiny Qwen2-MoE (a gated shared expert) and gpt-oss (a biased router,
    eager attention with sinks) saved as a user's model directory, trained two steps by ``nanogrpo train
    --model DIR`` with replay on: the engine is hf (auto), every sample carries routes, the update's
    log-probs are the engine's (float32), no route disagrees."""
    from nanogrpo.cli import main
    from nanogrpo.training.metrics import read_metrics
    from tests.moe_models import TOK

    model_dir, out = tmp_path / fam, tmp_path / "run"
    build(fam).save_pretrained(model_dir)
    TOK.save_pretrained(model_dir)
    (tmp_path / "length.py").write_text("def length(completion, sample):\n    return len(completion) / 50\n")
    assert main(["train", "--model", str(model_dir), "--out", str(out), f"moe.routing_replay={mode}",
                 f'rewards.functions=["{tmp_path / "length.py"}:length"]', "train.steps=2",
                 "rollout.prompts_per_step=4", "grpo.group_size=4", "rollout.max_new_tokens=24",
                 "eval.every=0", "train.save_every=0", "model.cpu_linear=torch", "rewards.workers=0"]) == 0
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["mismatch_abs_max"] < 1e-4 and r["mismatch_ratio_out"] == 0.0
        assert r["router_disagreement"] == 0.0 and r["routes_groups_dropped"] == 0
