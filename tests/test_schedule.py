"""The update schedule (``grpo.mini_batches`` x ``updates_per_batch``): mini-batches of whole groups, each one
optimizer step normalised by its own totals, in TRL's and verl's order; old log-probs of later mini-batches
from the generating policy; micro-batch invariance of every loss under several mini-batches."""

from __future__ import annotations

import copy

import pytest
import torch

from nanogrpo.algo.entropy import EntropyControl
from nanogrpo.algo.losses import LOSSES
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import load_config
from nanogrpo.errors import ConfigError
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.training.distributed import Backend
from nanogrpo.training.schedule import (
    Schedule,
    group_splits,
    mini_batch_count,
    mini_batch_rows,
    proximal_logprobs,
    run_updates,
)
from nanogrpo.training.step import batch_logprobs, policy_update, step_metrics

TOK = make_tokenizer()


def _batch(seed: int = 0, groups: int = 3, g: int = 4, p: int = 5, c: int = 7) -> RolloutBatch:
    n = groups * g
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, c + 1, (n,), generator=gen)
    cm = torch.arange(c)[None] < lens[:, None]
    ids = torch.randint(3, len(TOK), (n, p + c), generator=gen)
    am = torch.cat([torch.ones(n, p, dtype=torch.bool), cm], 1).to(torch.int8)
    am[1, :2] = 0
    ids[1, :2] = TOK.pad_token_id
    adv = torch.randn(n, generator=gen)
    return RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=adv, advantages=adv,
                        group_ids=torch.arange(n) // g, prompt_len=p, group_size=g,
                        old_logprobs=(-torch.rand(n, c, generator=gen) * 4) * cm,
                        ref_logprobs=(-torch.rand(n, c, generator=gen) * 4) * cm,
                        truncated=torch.rand(n, generator=gen) < 0.25)


def _model():
    return make_model("tiny", TOK, seed=3, dtype=torch.float64)


def _cfg(over: list[str], mbs: int = 8):
    return load_config(overrides=["grpo.beta=0.04", "train.lr=1e-2", f"train.micro_batch_size={mbs}",
                                  "rollout.prompts_per_step=3", "rollout.max_new_tokens=7", *over])


def _run(over: list[str], mbs: int = 8, batch=None, fresh=True, exact=True):
    cfg = _cfg(over, mbs)
    model = _model()
    be = Backend(model, lr=1e-2)
    b = batch if batch is not None else _batch()
    sched = Schedule(parts=mini_batch_count(b, cfg.grpo.mini_batches))
    run_updates(be, b, cfg, sched, fresh=fresh, exact=exact, control=EntropyControl.from_config(cfg.grpo))
    return sched, model


def test_group_splits_are_contiguous_and_even():
    assert group_splits(5, 2) == [(0, 3), (3, 5)]
    assert group_splits(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert group_splits(2, 3) == [(0, 1), (1, 2), (2, 2)]
    b = _batch(groups=3)
    rows = mini_batch_rows(b, 2)
    assert rows[0].tolist() == list(range(8)) and rows[1].tolist() == list(range(8, 12))
    assert mini_batch_rows(None, 2) == [None, None]
    assert mini_batch_count(b, 2) == 2 and mini_batch_count(b, 5) == 3 and mini_batch_count(None, 4) == 1


def test_each_mini_batch_is_one_optimizer_step_with_its_own_totals():
    """Pass by pass, mini-batch by mini-batch: each step is exactly policy_update on that mini-batch's rows
    (its own sequence and token totals), anchored on the behaviour log-probs after the first."""
    over = ["grpo.loss=dr_grpo", "grpo.mini_batches=2", "grpo.updates_per_batch=2"]
    b = _batch()
    sched, model = _run(over, batch=b)
    assert sched.done == 4 and len(sched.results) == 4
    cfg = _cfg(over)
    ref_model = _model()
    be = Backend(ref_model, lr=1e-2)
    rows = mini_batch_rows(b, 2)
    for u in range(4):
        mb = b.select(rows[u % 2])
        res = policy_update(be, mb, cfg, on_policy=(u == 0))
        assert res.loss == pytest.approx(sched.results[u].loss, rel=1e-12), u
    for (k, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=k)
    # the first step is on-policy (ratio 1); the second mini-batch's, trained after it, moved off 1
    assert sched.results[0].metrics["ratio_min"] == sched.results[0].metrics["ratio_max"] == 1.0
    assert sched.results[1].metrics["ratio_max"] != 1.0


def test_constant_normaliser_uses_the_mini_batch_totals():
    """dr_grpo divides by the mini-batch's completions x max_new_tokens: split in two, each step's loss is
    its rows' share of the whole-batch loss, scaled up by whole / mini-batch completions."""
    b = _batch()
    cfg = _cfg(["grpo.loss=dr_grpo"])
    rows = mini_batch_rows(b, 2)
    losses = []
    for r in rows + [torch.arange(b.num_seqs)]:
        model = _model()
        be = Backend(model, lr=1e-2)
        losses.append(policy_update(be, b.select(r), cfg, on_policy=True).loss)
    n0, n1 = len(rows[0]), len(rows[1])
    assert losses[0] * n0 / 12 + losses[1] * n1 / 12 == pytest.approx(losses[2], rel=1e-10)


VARIANTS = {**{n: [f"grpo.loss={n}"] for n in LOSSES},
            "grpo+everything": ["grpo.mask_truncated=true", "grpo.top_entropy_quantile=0.4",
                                "grpo.entropy_coef=0.1", "grpo.off_policy_mask_kl=0.05",
                                "grpo.kl_is_weighted=true",
                                "grpo.clip_ratio_c=3", "rollout.correction=token_truncate",
                                "rollout.correction_max=2"],
            "gspo+sequence_mask": ["grpo.loss=gspo", "rollout.correction=sequence_mask",
                                   "rollout.correction_min=0.2", "rollout.correction_max=5"]}
FAST = ("grpo", "grpo+everything")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST else pytest.mark.slow)
                                  for n in VARIANTS])
def test_micro_batch_size_changes_nothing_under_mini_batches(name):
    """Two mini-batches x two passes: every optimizer step's loss and metrics, and the weights after the
    four steps, are the same whatever the micro-batch size."""
    over = [*VARIANTS[name], "grpo.mini_batches=2", "grpo.updates_per_batch=2"]
    ref, ref_model = _run(over, 8)
    assert any(r.metrics["ratio_max"] != 1.0 for r in ref.results), "later steps should move the ratio"
    for mbs in (1, 3):
        sched, model = _run(over, mbs)
        for u, (a, b) in enumerate(zip(ref.results, sched.results, strict=True)):
            assert b.loss == pytest.approx(a.loss, rel=1e-9, abs=1e-13), (u, mbs)
            for k, v in a.metrics.items():
                assert b.metrics[k] == pytest.approx(v, rel=1e-8, abs=1e-12, nan_ok=True), (u, k, mbs)
        for (k, p), q in zip(ref_model.named_parameters(), model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-8, atol=1e-11, msg=f"{name} {k} mbs={mbs}")


def test_a_correction_under_mini_batches_anchors_every_step_on_the_generating_policy():
    """Several mini-batches and a correction: one forward before the first step gives the trainer's
    log-probs of the generating policy; every step's weights and mismatch stats use them."""
    over = ["grpo.mini_batches=3", "rollout.correction=token_truncate", "rollout.correction_max=1.5",
            "rollout.correction_min=0.5"]
    b = _batch()
    sched, _ = _run(over, batch=b, exact=False)
    cfg = _cfg(over)
    before = batch_logprobs(_model(), b, cfg.train, True)[0]
    torch.testing.assert_close(sched.proximal, before.to(sched.proximal), rtol=1e-10, atol=1e-12)
    # mismatch against the generating policy on every mini-batch: the later ones are not measured against
    # the moved weights (their k3 KL is that of the engine's log-probs against `before`)
    m = b.completion_mask
    rows = mini_batch_rows(b, 3)
    for u, r in enumerate(rows):
        d = (before[r] - b.old_logprobs[r].double())[m[r]]
        kl = (torch.exp(d) - d - 1).mean().item()
        assert sched.results[u].metrics["is_kl"] == pytest.approx(kl, rel=1e-6), u
    # the step's metrics average the first pass; ratio extremes over every step
    out = step_metrics(sched.results, 3)
    assert out["is_kl"] == pytest.approx(sum(r.metrics["is_kl"] for r in sched.results) / 3)
    assert out["ratio_max"] == max(r.metrics["ratio_max"] for r in sched.results)


def test_without_a_correction_later_mini_batches_take_the_behaviour_log_probs():
    """Fresh batch from an exact engine, no correction: no extra forward; the first step on-policy, the later
    ones anchored on the engine's recorded log-probs (the seed's rule for stale samples)."""
    b = _batch()
    sched, _ = _run(["grpo.mini_batches=2"], batch=b)
    assert sched.proximal is None
    model = _model()
    be = Backend(model, lr=1e-2)
    cfg = _cfg([])
    policy_update(be, b.select(mini_batch_rows(b, 2)[0]), cfg, on_policy=True)
    r = mini_batch_rows(b, 2)[1]
    after = batch_logprobs(model, b.select(r), cfg.train, True)[0]
    ratio = torch.exp(after - b.old_logprobs[r].double())[b.completion_mask[r]]
    assert sched.results[1].metrics["ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-9)


def test_proximal_pass_equals_the_update_forward():
    b = _batch()
    cfg = _cfg(["train.micro_batch_size=3"])
    model = _model()
    be = Backend(model, lr=1e-2)
    got = proximal_logprobs(b, cfg, be, True)
    want = batch_logprobs(copy.deepcopy(model), b, cfg.train, True)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_mini_batches_beyond_the_batch_are_refused_at_start():
    with pytest.raises(ConfigError, match="mini_batches=9 .*prompts_per_step=8"):
        load_config(overrides=["grpo.mini_batches=9"])
    assert load_config(overrides=["grpo.mini_batches=8"]).grpo.mini_batches == 8
