"""The update step with every loss variant on a tiny model: the micro-batch split changes nothing (the
entropy quantile and sequence-level quantities included), truncated completions get no loss, the
rollout correction anchors later updates on the trainer's own log-probs, and the step's metrics."""

from __future__ import annotations

import math

import pytest
import torch

from nanogrpo.algo.losses import LOSSES
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import load_config
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.training.distributed import Backend
from nanogrpo.training.step import batch_logprobs, policy_update, step_metrics

TOK = make_tokenizer()


class _GradTap(Backend):
    """The single-process backend, but the step keeps the gradients instead of applying them."""

    grads: dict[str, torch.Tensor]

    def clip_and_step(self, max_norm: float) -> float:
        self.grads = {k: p.grad.clone() for k, p in self.module.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad()
        return 0.0


def _batch(seed: int = 0, n: int = 8, p: int = 5, c: int = 7) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([7, 2, 5, 7, 1, 4, 7, 3])[:n]
    cm = torch.arange(c)[None] < lens[:, None]
    ids = torch.randint(3, len(TOK), (n, p + c), generator=g)
    am = torch.cat([torch.ones(n, p, dtype=torch.bool), cm], 1).to(torch.int8)
    am[1, :2] = 0
    ids[1, :2] = TOK.pad_token_id
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=adv.float(),
                        advantages=adv,
                        group_ids=torch.arange(n) // 4, prompt_len=p, group_size=4,
                        old_logprobs=(-torch.rand(n, c, generator=g, dtype=torch.float64) * 4) * cm,
                        ref_logprobs=(-torch.rand(n, c, generator=g, dtype=torch.float64) * 4) * cm,
                        truncated=torch.tensor([True, False, False, True, False, False, False, False])[:n])


def _model():
    return make_model("tiny", TOK, seed=3, dtype=torch.float64)


def _update(over: list[str], mbs: int, batch=None, on_policy: bool = False, old=None, coef=None):
    cfg = load_config(overrides=["grpo.beta=0.04", f"train.micro_batch_size={mbs}",
                                 "rollout.max_new_tokens=7", *over])
    model = _model()
    be = _GradTap(model, lr=1e-3)
    res = policy_update(be, batch if batch is not None else _batch(), cfg, on_policy=on_policy,
                        old_logprobs=old, entropy_coef=coef)
    return res, be.grads


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
def test_micro_batch_size_changes_neither_loss_nor_gradient(name):
    ref_res, ref_grads = _update(VARIANTS[name], 8)
    for mbs in (1, 3):
        res, grads = _update(VARIANTS[name], mbs)
        assert res.loss == pytest.approx(ref_res.loss, rel=1e-10, abs=1e-13), mbs
        for k, g in ref_grads.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-12, msg=f"{name} {k} mbs={mbs}")
        for k, v in ref_res.metrics.items():
            assert v == pytest.approx(ref_res.metrics[k], rel=1e-9, nan_ok=True), k
            assert res.metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), (k, mbs)


def test_truncated_completions_get_no_loss_but_count_as_sequences():
    b = _batch()
    masked, grads = _update(["grpo.mask_truncated=true"], 3, batch=b)
    # the same as zeroing their advantages and leaving their tokens out of KL and entropy: drop their mask
    b2 = _batch()
    keep = ~b2.truncated
    b2.loss_mask = b2.completion_mask & keep[:, None]
    b2.loss_mask[~keep, 0] = False
    b2.truncated = None
    plain, grads2 = _update([], 3, batch=b2)
    assert masked.loss == pytest.approx(plain.loss, rel=1e-10)
    for k in grads:
        torch.testing.assert_close(grads[k], grads2[k], rtol=1e-9, atol=1e-12)
    # without the flag (or without the batch knowing) nothing is masked
    off, _ = _update([], 3, batch=_batch())
    assert off.loss != pytest.approx(masked.loss)


def test_top_entropy_quantile_keeps_the_top_tokens_of_the_whole_batch():
    b = _batch()
    cfg = load_config(overrides=["train.micro_batch_size=2"])
    _, ent = batch_logprobs(_model(), b, cfg.train, True, entropy=True)
    vals = ent[b.completion_mask]
    res, _ = _update(["grpo.top_entropy_quantile=0.25"], 2, batch=b)
    thr = torch.quantile(vals.float(), 0.75).item()
    assert res.metrics["entropy_threshold"] == pytest.approx(thr, rel=1e-6)
    assert res.metrics["entropy"] == pytest.approx(vals.mean().item(), rel=1e-9)
    full, _ = _update(["grpo.top_entropy_quantile=1.0"], 2, batch=_batch())
    assert "entropy_threshold" not in full.metrics and full.loss != pytest.approx(res.loss)


def test_correction_anchors_later_updates_on_the_first_updates_log_probs():
    over = ["rollout.correction=token_truncate", "rollout.correction_max=1.5", "rollout.correction_min=0.5"]
    cfg = load_config(overrides=["grpo.beta=0.04", "train.micro_batch_size=3", "train.lr=1e-2",
                                 "rollout.max_new_tokens=7", *over])
    model = _model()
    be = Backend(model, lr=1e-2)
    b = _batch()
    first = policy_update(be, b, cfg, on_policy=False)
    # the first update is anchored on the policy's own log-probs (ratio 1), weighted against the engine's
    assert first.metrics["ratio_min"] == first.metrics["ratio_max"] == 1.0
    assert 0 < first.metrics["is_corrected_frac"] < 1 and first.metrics["is_kl"] > 0
    trained = batch_logprobs(_model(), b, cfg.train, True)[0]
    torch.testing.assert_close(first.logprobs, trained.to(first.logprobs), rtol=1e-9, atol=1e-12)
    second = policy_update(be, b, cfg, on_policy=False, old_logprobs=first.logprobs)
    assert second.metrics["ratio_min"] < 1 < second.metrics["ratio_max"]       # the update moved the policy
    # the weights are those of the first pass, unchanged by the update
    assert second.metrics["is_weight_mean"] == pytest.approx(first.metrics["is_weight_mean"], rel=1e-9)
    m = step_metrics([first, second])
    assert m["loss"] == first.loss and m["ratio_max"] == second.metrics["ratio_max"]
    mean = (first.metrics["clip_frac_high"] + second.metrics["clip_frac_high"]) / 2
    assert m["clip_frac_high"] == pytest.approx(mean)


def test_without_a_correction_the_seeds_anchor_is_kept():
    """No correction: off-policy updates take the recorded behaviour log-probs, as before this change, and
    the gap to the trainer's own is measured; on-policy (an exact engine) nothing is compared."""
    b = _batch()
    res, _ = _update([], 8, batch=b)
    trained = batch_logprobs(_model(), b, load_config().train, True)[0].double()
    ratio = torch.exp(trained - b.old_logprobs)[b.completion_mask]
    assert res.metrics["ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-9)
    assert res.metrics["is_weight_max"] == pytest.approx(ratio.max().item(), rel=1e-9)  # pi_trainer / mu
    assert "is_corrected_frac" not in res.metrics                # measured, not corrected
    on, _ = _update([], 8, batch=_batch(), on_policy=True)
    assert on.metrics["ratio_min"] == on.metrics["ratio_max"] == 1.0
    assert not any(k.startswith("is_") for k in on.metrics)


def test_entropy_bonus_moves_the_gradient_and_is_logged():
    plain, g0 = _update([], 8, on_policy=True)
    bonus, g1 = _update(["grpo.entropy_coef=0.5"], 8, on_policy=True)
    assert bonus.metrics["entropy_coef"] == 0.5 and "entropy_coef" not in plain.metrics
    assert bonus.loss == pytest.approx(plain.loss - 0.5 * plain.metrics["entropy"], rel=1e-9)
    assert any(not torch.allclose(g0[k], g1[k]) for k in g0)
    # the applied coefficient is the caller's (adaptive control), not the config's start value
    zero, g2 = _update(["grpo.entropy_coef=0.5"], 8, on_policy=True, coef=0.0)
    assert zero.loss == pytest.approx(plain.loss, rel=1e-12)
    assert math.isfinite(zero.bonus_entropy)


def test_a_batch_cut_off_entirely_trains_nothing_and_says_so():
    b = _batch()
    b.truncated = torch.ones(b.num_seqs, dtype=torch.bool)
    res, grads = _update(["grpo.mask_truncated=true", "grpo.top_entropy_quantile=0.5"], 3, batch=b)
    assert not res.skipped_nonfinite and res.loss == 0.0
    assert all(not g.any() for g in grads.values())
    assert math.isnan(res.metrics["ratio_mean"]) and math.isnan(res.metrics["ratio_max"])
