"""The variants TRL does not have, against numbers worked out by hand and verl 0.9.1's formulas
(``verl/trainer/ppo/core_algos.py``, written out here independently, loop by loop); and the
properties every variant must keep: micro-batch exactness, masked positions that do not matter,
one-line refusals of combinations that mean nothing. (TRL's variants: ``tests/test_parity_trl.py``.)"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from nanogrpo.algo.advantages import ADVANTAGES, advantages
from nanogrpo.algo.corrections import CORRECTIONS, anchor, correction_stats, off_policy_mask
from nanogrpo.algo.entropy import EntropyControl, entropy_mask, entropy_threshold
from nanogrpo.algo.losses import KL_ESTIMATORS, LOSSES, STAT_OPS, BatchTotals, LossSpec, policy_loss
from nanogrpo.config import load_config
from nanogrpo.errors import ConfigError

D = torch.float64


# ----------------------------------------------------------------------------- advantages


def verl_rloo(scores: list[float], index: list[int]) -> list[float]:
    """verl compute_rloo_outcome_advantage, per row."""
    groups: dict[int, list[float]] = {}
    for s, i in zip(scores, index):
        groups.setdefault(i, []).append(s)
    out = []
    for s, i in zip(scores, index):
        n, mean = len(groups[i]), sum(groups[i]) / len(groups[i])
        out.append(s * n / (n - 1) - mean * n / (n - 1) if n > 1 else s)
    return out


def verl_reinforce_pp_baseline(scores: list[float], index: list[int], lengths: list[int]) -> list[float]:
    """verl compute_reinforce_plus_plus_baseline_outcome_advantage: group mean off, then masked_whiten over
    the (bs, response_length) tokens (masked mean, Bessel-corrected masked variance, rsqrt(var + 1e-8))."""
    groups: dict[int, list[float]] = {}
    for s, i in zip(scores, index):
        groups.setdefault(i, []).append(s)
    x = [s - sum(groups[i]) / len(groups[i]) for s, i in zip(scores, index)]
    tokens = [v for v, n in zip(x, lengths) for _ in range(n)]
    mean = sum(tokens) / (len(tokens) + 1e-8)
    var = sum((t - mean) ** 2 for t in tokens) / (len(tokens) + 1e-8) * len(tokens) / (len(tokens) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in x]


SCORES = [1.0, 2.0, 3.0, 4.0, 0.5, 0.5, 0.5, 0.5, -1.0, 0.0, 0.0, 2.5]
INDEX = [i // 4 for i in range(12)]
LENGTHS = [5, 1, 3, 7, 2, 2, 9, 4, 6, 1, 1, 3]


def test_rloo_is_the_leave_one_out_baseline():
    r = torch.tensor(SCORES, dtype=D)
    adv = ADVANTAGES["rloo"](r, 4, eps=1e-4)
    # r - mean(others)
    assert adv[:4].tolist() == pytest.approx([1 - 3, 2 - 8 / 3, 3 - 7 / 3, 4 - 2], abs=1e-12)
    assert adv.tolist() == pytest.approx(verl_rloo(SCORES, INDEX), abs=1e-12)
    assert adv[4:8].tolist() == [0.0] * 4


def test_reinforce_pp_baseline_is_verls_token_whitening():
    r = torch.tensor(SCORES, dtype=D)
    adv = ADVANTAGES["reinforce_pp"](r, 4, eps=1e-4, lengths=torch.tensor(LENGTHS, dtype=D))
    assert adv.tolist() == pytest.approx(verl_reinforce_pp_baseline(SCORES, INDEX, LENGTHS), rel=1e-7)
    tok = torch.tensor(LENGTHS, dtype=D)
    assert float((adv * tok).sum() / tok.sum()) == pytest.approx(0.0, abs=1e-12)  # zero mean over tokens
    # without lengths every sequence weighs one token
    flat = ADVANTAGES["reinforce_pp"](r, 4, eps=1e-4)
    assert flat.tolist() == pytest.approx(verl_reinforce_pp_baseline(SCORES, INDEX, [1] * 12), rel=1e-7)


def test_group_mean_and_batch_std_by_hand():
    r = torch.tensor(SCORES, dtype=D)
    assert ADVANTAGES["group_mean"](r, 4, eps=1e-4)[:4].tolist() == [-1.5, -0.5, 0.5, 1.5]
    std = torch.tensor(SCORES, dtype=D).std().item()            # over the whole batch, sample std
    got = ADVANTAGES["batch_std"](r, 4, eps=1e-4)
    assert got[:4].tolist() == pytest.approx([x / (std + 1e-4) for x in (-1.5, -0.5, 0.5, 1.5)], abs=1e-12)
    assert got[4:8].tolist() == [0.0] * 4


def test_normalize_then_sum_by_hand():
    per_fn = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=D)  # one group of 4
    w = torch.tensor([1.0, 2.0], dtype=D)
    std = math.sqrt(1 / 3)                          # sample std of [1, 0, 1, 0] and of [0, 1, 1, 0]
    z = (torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D) - 0.5) / (std + 1e-4)
    z2 = (torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=D) - 0.5) / (std + 1e-4)
    _, score = advantages(per_fn, w, 4, estimator="group_mean", aggregation="normalize_then_sum")
    assert score.tolist() == pytest.approx((z + 2 * z2).tolist(), abs=1e-12)
    _, plain = advantages(per_fn, w, 4, estimator="group_mean")
    assert plain.tolist() == [1.0, 2.0, 3.0, 0.0]               # sum_then_normalize: the weighted sum


@pytest.mark.parametrize("estimator", ["batch_std", "reinforce_pp"])
def test_batch_level_estimators_see_every_ranks_rows(estimator):
    """Two 'ranks' each holding half the groups (one with none) get the whole batch's advantages."""
    r = torch.tensor(SCORES, dtype=D)
    lengths = torch.tensor(LENGTHS, dtype=D)
    whole = ADVANTAGES[estimator](r, 4, eps=1e-4, lengths=lengths)
    parts: list[list[float]] = [[], []]
    barrier = threading.Barrier(2)
    lock = threading.Lock()

    def reduce(values: list[float]) -> list[float]:  # an all-reduce(sum) between the two threads
        with lock:
            parts[0].append(values)
        barrier.wait()
        total = [sum(v) for v in zip(*parts[0])]
        barrier.wait()
        with lock:
            parts[0].clear()
        barrier.wait()
        return total

    out: dict[int, torch.Tensor] = {}
    shares = {0: slice(0, 12), 1: slice(12, 12)}  # rank 1 holds no rows

    def run(rank: int) -> None:
        sl = shares[rank]
        out[rank] = ADVANTAGES[estimator](r[sl], 4, eps=1e-4, lengths=lengths[sl], reduce=reduce)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(out[0], whole)
    assert out[1].numel() == 0


# ----------------------------------------------------------------------------- KL estimators


def test_k1_k2_k3_values_and_gradients_by_hand():
    logp = torch.tensor([math.log(0.5)], dtype=D, requires_grad=True)
    ref = torch.tensor([math.log(0.25)], dtype=D)
    d = math.log(0.5) - math.log(0.25)                           # log pi - log ref = ln 2
    expect = {"k1": (d, 1.0), "k2": (d * d / 2, d), "k3": (0.5 + d - 1, 1 - 0.5)}
    for name, (value, grad) in expect.items():
        v = KL_ESTIMATORS[name](logp, ref)
        (g,) = torch.autograd.grad(v.sum(), logp)
        assert v.item() == pytest.approx(value, abs=1e-12), name
        assert g.item() == pytest.approx(grad, abs=1e-12), name


# ----------------------------------------------------------------------------- objectives


def _one(spec: LossSpec, logp: float, old: float, adv: float, grad: bool = False):
    lp = torch.tensor([[logp]], dtype=D, requires_grad=True)
    loss, stats = policy_loss(spec, lp, torch.tensor([[old]], dtype=D), None, torch.tensor([adv], dtype=D),
                              torch.ones(1, 1, dtype=torch.bool), BatchTotals(1, 1, 1))
    if grad:
        return loss.item(), torch.autograd.grad(loss, lp)[0].item(), stats
    return loss.item(), stats


def verl_vanilla(ratio: float, a: float, lo: float, hi: float, c: float) -> float:
    """verl compute_policy_loss_vanilla's per-token loss with dual-clip (clip_ratio_c = c)."""
    pg1, pg2 = -a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi)
    clip1 = max(pg1, pg2)
    return min(-a * c, clip1) if a < 0 else clip1


@pytest.mark.parametrize("ratio", [0.3, 0.8, 1.0, 1.1, 1.5, 2.9, 3.5, 8.0])
@pytest.mark.parametrize("a", [-1.3, 0.7])
def test_dual_clip_is_verls(ratio, a):
    spec = LossSpec(clip_ratio_c=3.0)
    loss, grad, stats = _one(spec, math.log(ratio), 0.0, a, grad=True)
    assert loss == pytest.approx(verl_vanilla(ratio, a, 0.2, 0.2, 3.0), abs=1e-12)
    assert float(stats["clip_dual_sum"]) == float(a < 0 and ratio > 3.0)
    if a < 0 and ratio > 3.0:
        assert grad == 0.0                                      # past c the loss is a constant
    # TRL's two-sided delta is the same bound for negative advantages (hence one or the other)
    assert _one(LossSpec(clip_delta=3.0), math.log(ratio), 0.0, a)[0] == pytest.approx(loss, abs=1e-12)


@pytest.mark.parametrize("ratio,a,clipped", [(1.5, 1.0, True), (1.5, -1.0, False), (0.5, 1.0, False),
                                             (0.5, -1.0, False), (9.0, 2.0, True)])
def test_cispo_clips_the_weight_not_the_gradient(ratio, a, clipped):
    """-sg(min(r, eps_max)) A logp: the gradient is -min(r, eps_max) A, never 0 (PPO's clip would zero it)."""
    spec = LossSpec(objective="cispo", eps_high=1.25, eps_low=None, reduction="token-mean")
    logp = math.log(0.3 * ratio)
    loss, grad, stats = _one(spec, logp, math.log(0.3), a, grad=True)
    w = min(ratio, 1.25)
    assert loss == pytest.approx(-w * a * logp, abs=1e-12)
    assert grad == pytest.approx(-w * a, abs=1e-12)
    assert float(stats["clip_high_sum"]) == float(clipped)


@pytest.mark.parametrize("a", [-0.8, 1.2])
def test_sapo_gate(a):
    """-sigmoid(tau (r - 1)) 4 / tau A; on-policy its gradient is GRPO's (-A), its slope decays off-policy."""
    spec = LossSpec(objective="sapo", eps_low=None, eps_high=None)
    tau = 1.0 if a > 0 else 1.05
    for ratio in (1.0, 1.4, 0.6):
        loss, grad, _ = _one(spec, math.log(ratio), 0.0, a, grad=True)
        s = 1 / (1 + math.exp(-tau * (ratio - 1)))
        assert loss == pytest.approx(-s * 4 / tau * a, abs=1e-12)
        assert grad == pytest.approx(-4 * s * (1 - s) * a * ratio, abs=1e-12)   # d/dlogp = ratio d/dr
    assert _one(spec, 0.0, 0.0, a, grad=True)[1] == pytest.approx(-a, abs=1e-12)


def test_gspo_ratio_is_the_geometric_mean_and_clips_whole_sequences():
    logp = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[math.log(0.4), math.log(0.25), -9.0]], dtype=D)   # junk at the masked position
    mask = torch.tensor([[True, True, False]])
    spec = LossSpec(importance_sampling="sequence", eps_low=3e-4, eps_high=4e-4)
    s = math.exp((math.log(0.5 / 0.4) + math.log(0.2 / 0.25)) / 2)          # = 1 exactly: (1.25 * 0.8)^(1/2)
    loss, stats = policy_loss(spec, logp, old, None, torch.tensor([1.0], dtype=D), mask, BatchTotals(1, 2, 3))
    assert s == pytest.approx(1.0) and loss.item() == pytest.approx(-1.0, abs=1e-12)
    (g,) = torch.autograd.grad(loss, logp)
    assert g.flatten().tolist() == pytest.approx([-0.5, -0.5, 0.0], abs=1e-12)  # A s (1/|y|) per token
    assert float(stats["ratio_count"]) == 1.0                               # counted per sequence


# ----------------------------------------------------------------------------- reductions


def test_reductions_by_hand():
    loss_t = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
    tot = BatchTotals(num_seqs=2, num_tokens=4, max_new_tokens=5)
    from nanogrpo.algo.losses import REDUCTIONS
    assert REDUCTIONS["seq-mean-token-mean"](loss_t, mask, tot).item() == pytest.approx((2 + 4) / 2)
    assert REDUCTIONS["token-mean"](loss_t, mask, tot).item() == pytest.approx(10 / 4)
    assert REDUCTIONS["seq-mean-token-sum"](loss_t, mask, tot).item() == pytest.approx(10 / 2)
    assert REDUCTIONS["constant"](loss_t, mask, tot).item() == pytest.approx(10 / (2 * 5))


# ----------------------------------------------------------------------------- corrections


def test_corrections_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.4, 0.1], [0.3, 0.3, 0.3]], dtype=D))
    beh = torch.log(torch.tensor([[0.25, 0.4, 0.9], [0.6, 0.3, 0.3]], dtype=D))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=D)
    m = mask.bool()
    r = [[2.0, 1.0, 1.0], [0.5, 1.0, 1.0]]                         # pi_old / mu, 1 off the mask
    w, raw, out = CORRECTIONS["token_truncate"](old, beh, mask, 0.7, 1.5)
    assert raw.flatten().tolist() == pytest.approx(sum(r, []))
    assert w.flatten().tolist() == pytest.approx([1.5, 1, 1, 0.7, 1, 1])
    assert out.tolist() == [[True, False, False], [True, False, False]]
    w, _, _ = CORRECTIONS["token_mask"](old, beh, mask, 0.7, 1.5)
    assert w.flatten().tolist() == pytest.approx([0.0, 1, 1, 0.0, 1, 1])
    w, raw, _ = CORRECTIONS["sequence_truncate"](old, beh, mask, 0.7, 1.5)
    assert raw.flatten().tolist() == pytest.approx([2.0, 0.5])
    assert w.flatten().tolist() == pytest.approx([1.5, 0.7])
    w, _, _ = CORRECTIONS["sequence_mask"](old, beh, mask, None, 1.5)   # no lower bound
    assert w.flatten().tolist() == pytest.approx([0.0, 0.5])
    assert CORRECTIONS["none"](old, beh, mask, None, 3.0)[0] is None
    st = correction_stats(old, beh, m, CORRECTIONS["token_mask"](old, beh, mask, 0.7, 1.5))
    assert float(st["is_tokens"]) == 5 and float(st["is_corrected"]) == 2
    assert (float(st["is_weight_min"]), float(st["is_weight_max"])) == pytest.approx((0.5, 2.0))
    d = torch.tensor([math.log(2), 0, math.log(0.5), 0, 0])       # k3 of KL(mu || pi_old)
    assert float(st["is_kl_sum"]) == pytest.approx(float((torch.exp(d) - d - 1).sum()))


def test_anchor_rule():
    t, b = torch.zeros(1, 1), torch.ones(1, 1)
    assert anchor("none", True, t, b) == (None, None)            # on-policy, exact engine: nothing to compare
    assert anchor("none", False, t, b) == (b, b)                 # the seed's: the recorded ones, measured
    assert anchor("token_truncate", False, t, b) == (t, b)       # decoupled: the trainer's, weighted
    assert anchor("sequence_mask", True, None, b) == (None, b)


def test_off_policy_mask_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], dtype=D))
    beh = torch.log(torch.tensor([[0.9, 0.9], [0.9, 0.9], [0.5, 0.5]], dtype=D))   # mean log(mu/pi) = ln 1.8
    adv = torch.tensor([[1.0], [-1.0], [-1.0]], dtype=D)
    mask = torch.ones(3, 2, dtype=D)
    keep = off_policy_mask(logp, beh, adv, mask, 0.5)
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0]             # dropped: negative advantage and far off
    assert off_policy_mask(logp, beh, adv, mask, 0.6).flatten().tolist() == [1.0, 1.0, 1.0]


# ----------------------------------------------------------------------------- entropy


def test_entropy_threshold_and_mask():
    ent = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.3, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    thr = entropy_threshold(ent[mask], 0.4)                        # top 40% of the 5 trained tokens
    assert thr == pytest.approx(torch.quantile(torch.tensor([0.1, 0.9, 0.5, 0.7, 0.3]), 0.6).item())
    assert entropy_mask(ent, mask, thr).tolist() == [[False, True, False], [True, False, False]]
    assert entropy_mask(ent, mask, entropy_threshold(ent[mask], 0.0)).sum() == 1   # only the highest


def test_adaptive_entropy_control_follows_trl():
    c = EntropyControl(coef=0.01, target=1.0, step=0.005, lo=0.0, hi=0.02)
    assert c.active and c.applied() == 0.0                        # nothing measured yet: no bonus
    c.update(0.8)                                                  # below target: +step, applied next step
    assert (c.coef, c.applied()) == (pytest.approx(0.015), pytest.approx(0.015))
    c.update(0.9)
    assert c.coef == pytest.approx(0.02)                           # capped at hi
    c.update(1.5)                                                  # above target: -step, and no bonus
    assert (c.coef, c.applied()) == (pytest.approx(0.015), 0.0)
    c.update(float("nan"))                                         # a skipped update changes nothing
    state = c.state_dict()
    d = EntropyControl(coef=0.01, target=1.0)
    d.load_state_dict(state)
    assert (d.coef, d.last_entropy) == (c.coef, c.last_entropy)
    assert EntropyControl().state_dict()["last_entropy"] is None   # JSON-safe before any measurement
    static = EntropyControl(coef=0.03)
    static.update(0.1)
    assert static.applied() == 0.03 and not EntropyControl().active


def test_entropy_bonus_is_a_whole_batch_mean():
    logp = -torch.rand(4, 3, dtype=D)
    ent = torch.rand(4, 3, dtype=D, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    tot = BatchTotals(4, int(mask.sum()), 3)
    base, _ = policy_loss(LossSpec(), logp, None, None, torch.zeros(4, dtype=D), mask, tot)
    loss, stats = policy_loss(LossSpec(), logp, None, None, torch.zeros(4, dtype=D), mask, tot, entropy=ent,
                              entropy_coef=0.1)
    assert (loss - base).item() == pytest.approx(-0.1 * ent[mask].mean().item(), abs=1e-12)
    assert float(stats["entropy_sum"]) == pytest.approx(ent[mask].sum().item())


# ----------------------------------------------------------------------------- every variant: invariants

SPECS = {
    **{name: ["grpo.loss=" + name] for name in LOSSES},
    "grpo+dual_clip": ["grpo.clip_ratio_c=3"],
    "grpo+delta": ["grpo.clip_delta=1.5"],
    "grpo+seq-mean-token-sum": ["grpo.loss_reduction=seq-mean-token-sum"],
    "grpo+k1": ["grpo.kl_estimator=k1"], "grpo+k2": ["grpo.kl_estimator=k2"],
    "dapo+kl_is_weighted": ["grpo.loss=dapo", "grpo.kl_is_weighted=true"],
    "grpo+off_policy_mask": ["grpo.off_policy_mask_kl=0.01"],
    "gspo+sequence_mask": ["grpo.loss=gspo", "rollout.correction=sequence_mask", "rollout.correction_min=0.5",
                           "rollout.correction_max=2"],
    "cispo+token_truncate": ["grpo.loss=cispo", "rollout.correction=token_truncate"],
    "sapo+token_mask": ["grpo.loss=sapo", "rollout.correction=token_mask", "rollout.correction_max=1.5"],
}


def _random_case(n: int = 6, t: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, t, generator=g, dtype=D) * 3).requires_grad_()
    old = logp.detach() + (torch.rand(n, t, generator=g, dtype=D) - 0.5) * 0.8
    beh = old + (torch.rand(n, t, generator=g, dtype=D) - 0.5) * 0.8
    ref = -torch.rand(n, t, generator=g, dtype=D) * 3
    ent = torch.rand(n, t, generator=g, dtype=D) * 2
    adv = torch.randn(n, generator=g, dtype=D)
    lens = torch.tensor([5, 1, 3, 2, 5, 4])[:n]
    mask = torch.arange(t)[None] < lens[:, None]
    return logp, old, beh, ref, ent, adv, mask


@pytest.mark.parametrize("name", list(SPECS))
def test_micro_batch_losses_and_gradients_sum_to_the_full_batch(name):
    cfg = load_config(overrides=["grpo.beta=0.04", *SPECS[name]])
    spec = LossSpec.from_config(cfg.grpo, cfg.rollout)
    logp, old, beh, ref, ent, adv, mask = _random_case()
    emask = entropy_mask(ent, mask, entropy_threshold(ent[mask], 0.5))
    tot = BatchTotals(num_seqs=6, num_tokens=int(mask.sum()), max_new_tokens=5,
                      entropy_tokens=int(emask.sum()))
    kw = dict(behaviour=beh, entropy_coef=0.05)
    full, stats = policy_loss(spec, logp, old, ref, adv, mask, tot, entropy=ent, entropy_mask=emask, **kw)
    (g_full,) = torch.autograd.grad(full, logp)
    parts, acc = 0.0, {}
    for i in (0, 2, 4):
        sl = slice(i, i + 2)
        loss, st = policy_loss(spec, logp[sl], old[sl], ref[sl], adv[sl], mask[sl], tot, entropy=ent[sl],
                               entropy_mask=emask[sl], behaviour=beh[sl], entropy_coef=0.05)
        parts = parts + loss
        for k, v in st.items():
            op = STAT_OPS[k]
            acc[k] = v if k not in acc else (acc[k] + v if op == "sum" else torch.minimum(acc[k], v)
                                             if op == "min" else torch.maximum(acc[k], v))
    (g_parts,) = torch.autograd.grad(parts, logp)
    assert parts.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(g_parts, g_full, rtol=1e-12, atol=1e-14)
    assert set(acc) == set(stats)
    for k in stats:
        assert float(acc[k]) == pytest.approx(float(stats[k]), rel=1e-12, abs=1e-12), k


@pytest.mark.parametrize("name", list(SPECS))
def test_values_at_masked_positions_do_not_matter(name):
    """Junk (even inf / NaN) where the mask is off changes neither the loss nor its gradient."""
    cfg = load_config(overrides=["grpo.beta=0.04", *SPECS[name]])
    spec = LossSpec.from_config(cfg.grpo, cfg.rollout)
    logp, old, beh, ref, ent, adv, mask = _random_case()
    tot = BatchTotals(num_seqs=6, num_tokens=int(mask.sum()), max_new_tokens=5)
    out = []
    for junk in (0.0, float("inf"), float("nan"), -50.0):
        o, b, r = (x.masked_fill(~mask, junk) for x in (old, beh, ref))
        loss, _ = policy_loss(spec, logp, o, r, adv, mask, tot, behaviour=b, entropy=ent, entropy_coef=0.05)
        out.append((loss.item(), torch.autograd.grad(loss, logp)[0]))
    for loss, grad in out[1:]:
        assert loss == pytest.approx(out[0][0], rel=1e-12)
        torch.testing.assert_close(grad, out[0][1])


# ----------------------------------------------------------------------------- configs


def test_presets_fill_the_keys_and_explicit_keys_win():
    r = load_config(overrides=["grpo.loss=gspo"]).grpo.resolved()
    assert (r["importance_sampling"], r["loss_reduction"], r["clip_eps_low"], r["clip_eps_high"]) == \
        ("sequence", "seq-mean-token-mean", 3e-4, 4e-4)
    assert load_config(overrides=["grpo.loss=dapo"]).grpo.resolved()["clip_eps_high"] == 0.28
    assert load_config(overrides=["grpo.loss=dr_grpo"]).grpo.resolved()["advantage"] == "group_mean"
    assert load_config(overrides=["grpo.loss=cispo"]).grpo.resolved()["clip_eps_high"] == 5.0
    r = load_config(overrides=["grpo.loss=dapo", "grpo.clip_eps_high=0.3", "grpo.advantage=rloo",
                               "grpo.loss_reduction=constant"]).grpo.resolved()
    assert (r["clip_eps_high"], r["advantage"], r["loss_reduction"]) == (0.3, "rloo", "constant")
    gdpo = load_config(overrides=["grpo.reward_aggregation=normalize_then_sum"]).grpo.resolved()
    assert gdpo["advantage"] == "batch_std"
    # the defaults are the seed's
    spec = LossSpec.from_config(load_config().grpo)
    got = (spec.objective, spec.reduction, spec.eps_low, spec.eps_high, spec.kl_estimator, spec.correction)
    assert got == ("clip", "seq-mean-token-mean", 0.2, 0.2, "k3", "none")


@pytest.mark.parametrize("over,match", [
    (["grpo.loss=gspo", "grpo.loss_reduction=token-mean"], "importance_sampling=sequence"),
    (["grpo.importance_sampling=sequence", "grpo.loss=dapo"], "only seq-mean-token-mean"),
    (["grpo.loss=sapo", "grpo.clip_eps_high=0.3"], "means nothing for grpo.loss=sapo"),
    (["grpo.loss=sapo", "grpo.clip_ratio_c=3"], "grpo.clip_ratio_c means nothing"),
    (["grpo.loss=cispo", "grpo.clip_eps_low=0.1"], "grpo.clip_eps_low means nothing for grpo.loss=cispo"),
    (["grpo.loss=cispo", "grpo.clip_delta=2"], "clip_delta means nothing"),
    (["grpo.loss=cispo", "grpo.clip_eps_high=0.28"], "is ε_max, the bound on the importance weight itself"),
    (["grpo.clip_delta=1.5", "grpo.clip_ratio_c=3"], "set one"),
    (["grpo.clip_delta=1.1"], "must exceed 1 + clip_eps_high"),
    (["grpo.clip_ratio_c=1.2"], "must exceed 1 + clip_eps_high"),
    (["grpo.clip_ratio_c=0.5"], "clip_ratio_c"),
    (["grpo.kl_is_weighted=true", "grpo.beta=0"], "grpo.beta = 0"),
    (["grpo.entropy_target=0.5", "grpo.entropy_coef=2"], "outside"),
    (["grpo.entropy_coef_min=0.5", "grpo.entropy_coef_max=0.1"], "exceeds"),
    (["grpo.top_entropy_quantile=1.5"], "top_entropy_quantile"),
    (["grpo.advantage=gae"], "grpo.advantage"),
    (["grpo.loss_reduction=sum"], "grpo.loss_reduction"),
    (["grpo.kl_estimator=k4"], "grpo.kl_estimator"),
    (["rollout.correction=token_mask", "rollout.correction_max=null"], "needs a bound"),
    (["rollout.correction_min=2", "rollout.correction_max=1.5"], "must be below"),
    (["rollout.correction=tis"], "rollout.correction"),
])
def test_meaningless_combinations_are_refused_in_one_line(over, match):
    with pytest.raises(ConfigError, match=match.replace("+", r"\+")) as e:
        load_config(overrides=over)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("eps", ["1", "1.5", "5.0"])
def test_cispo_accepts_a_weight_bound_of_one_or_more(eps):
    """DAPO's habit (0.28) is refused above; a bound on the weight at or above the on-policy 1 is CISPO's."""
    cfg = load_config(overrides=["grpo.loss=cispo", f"grpo.clip_eps_high={eps}"])
    assert cfg.grpo.eps_high() == float(eps)
    with pytest.raises(ConfigError, match="clip_eps_high=0.99 with grpo.loss=cispo"):
        load_config(overrides=["grpo.loss=cispo", "grpo.clip_eps_high=0.99"])
