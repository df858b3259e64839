"""The loss variants, k3 KL and advantages against numbers worked out by hand."""

import math

import pytest
import torch

from nanogrpo.algo import BatchTotals, group_advantages, k3_kl, policy_loss, signal_mask
from nanogrpo.rollout.collect import pad_batch

LN = math.log


def _case():
    # two completions: row 0 has 2 tokens, row 1 has 1 token (second position masked)
    logp = torch.tensor([[LN(0.5), LN(0.25)], [LN(0.5), 0.0]], requires_grad=True)
    ref = torch.tensor([[LN(0.25), LN(0.25)], [LN(0.5), 0.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    return logp, ref, adv, mask


def test_k3_kl_by_hand():
    # ref - logp = ln(1/2): exp = 0.5, kl = 0.5 + ln 2 - 1 = 0.1931472
    kl = k3_kl(torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)]))
    assert kl.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-7)
    assert k3_kl(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0
    # k3 is never negative
    a, b = torch.randn(1000), torch.randn(1000)
    assert (k3_kl(a, b) >= -1e-7).all()


# per-token losses with beta = 0.1, on-policy (ratio = 1):
#   row 0: t0 = -(1 - 0.1 * 0.1931472) = -0.98068528, t1 = -(1 - 0) = -1
#   row 1: t0 = -(-1 - 0) = 1
KL00 = 0.5 + math.log(2) - 1
T00, T01, T10 = -(1 - 0.1 * KL00), -1.0, 1.0


@pytest.mark.parametrize("variant,expected", [
    ("grpo", ((T00 + T01) / 2 + T10) / 2),          # mean per completion, then over completions
    ("dapo", (T00 + T01 + T10) / 3),                # token-level mean over the batch
    ("dr_grpo", (T00 + T01 + T10) / (2 * 4)),       # constant: completions * max_new_tokens (4)
])
def test_loss_variants_by_hand(variant, expected):
    logp, ref, adv, mask = _case()
    tot = BatchTotals(num_seqs=2, num_tokens=3, max_new_tokens=4)
    loss, stats = policy_loss(variant, logp, None, ref, adv, mask, tot, beta=0.1)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["kl_sum"] == pytest.approx(KL00, abs=1e-6)
    assert float(stats["clip_low_sum"] + stats["clip_high_sum"]) == 0.0


def test_on_policy_gradient_is_advantage_times_grad_logp():
    logp, ref, adv, mask = _case()
    tot = BatchTotals(num_seqs=2, num_tokens=3, max_new_tokens=4)
    loss, _ = policy_loss("grpo", logp, None, None, adv, mask, tot, beta=0.0)
    loss.backward()
    # d/dlogp of -(A * ratio) / len_i / N: row 0 -> -1/2/2, row 1 -> +1/1/2, masked -> 0
    assert logp.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 0.5, 0.0])


@pytest.mark.parametrize("variant,a,p_new,p_old,expected", [
    ("grpo", 1.0, 0.6, 0.4, -1.2),     # ratio 1.5, A>0: clipped to 1 + 0.2
    ("grpo", -1.0, 0.6, 0.4, 1.5),     # ratio 1.5, A<0: min picks the unclipped -1.5
    ("grpo", 1.0, 0.2, 0.4, -0.5),     # ratio 0.5, A>0: unclipped 0.5 is smaller
    ("grpo", -1.0, 0.2, 0.4, 0.8),     # ratio 0.5, A<0: clipped to 1 - 0.2 -> -0.8
    ("dapo", 1.0, 0.6, 0.4, -1.28),    # clip-higher: 1 + 0.28
])
def test_clipped_ratio_by_hand(variant, a, p_new, p_old, expected):
    logp = torch.tensor([[LN(p_new)]])
    old = torch.tensor([[LN(p_old)]])
    tot = BatchTotals(num_seqs=1, num_tokens=1, max_new_tokens=1)
    loss, _ = policy_loss(variant, logp, old, None, torch.tensor([a]), torch.ones(1, 1, dtype=torch.bool),
                          tot, beta=0.0)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_micro_batch_losses_sum_to_full_batch_loss():
    torch.manual_seed(0)
    n, t = 6, 5
    logp = -torch.rand(n, t)
    ref = -torch.rand(n, t)
    adv = torch.randn(n)
    lens = torch.tensor([5, 1, 3, 2, 5, 4])
    mask = torch.arange(t)[None] < lens[:, None]
    for variant in ("grpo", "dapo", "dr_grpo"):
        tot = BatchTotals(num_seqs=n, num_tokens=int(mask.sum()), max_new_tokens=t)
        full, _ = policy_loss(variant, logp, None, ref, adv, mask, tot, beta=0.04)
        parts = sum(policy_loss(variant, logp[i:i + 2], None, ref[i:i + 2], adv[i:i + 2], mask[i:i + 2], tot,
                                beta=0.04)[0] for i in range(0, n, 2))
        assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def test_beta_positive_needs_reference():
    logp, _, adv, mask = _case()
    with pytest.raises(ValueError, match="reference"):
        policy_loss("grpo", logp, None, None, adv, mask, BatchTotals(2, 3, 4), beta=0.1)


def test_advantages_by_hand_and_zero_variance_groups():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 4)
    std = math.sqrt(5 / 3)  # sample std of 1..4
    assert adv[:4].tolist() == pytest.approx([x / (std + 1e-4) for x in (-1.5, -0.5, 0.5, 1.5)], abs=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]           # flat group: zeros, not NaN
    assert signal_mask(r, 4).tolist() == [True, False]        # and it is dropped
    assert group_advantages(r, 4, scale_std=False)[:4].tolist() == [-1.5, -0.5, 0.5, 1.5]
    assert signal_mask(torch.tensor([1.0, 1.005]), 2).tolist() == [False]  # spread < 0.01
    with pytest.raises(ValueError):
        group_advantages(torch.ones(6), 4)


def test_mask_keeps_eos_when_pad_equals_eos():
    pad = eos = 0
    ids, am, cm, lp, p = pad_batch([[5, 6], [7]], [[8, 9, eos], [10]], [[-0.1, -0.2, -0.3], [-0.4]], pad)
    assert p == 2
    assert ids.tolist() == [[5, 6, 8, 9, eos], [pad, 7, 10, pad, pad]]
    # the EOS (same id as pad) is inside the mask of row 0; the padding of row 1 is not
    assert cm.tolist() == [[True, True, True], [True, False, False]]
    assert am.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert lp[0].tolist() == pytest.approx([-0.1, -0.2, -0.3])

