"""The loss mask: tool-output tokens are context, never trained on, never in the KL or the length
normalisation. Checked on a hand-built trajectory against a computation that drops those tokens,
and on the wire (safetensors round trip, validation)."""

import pytest
import torch

from nanogrpo.algo.logprobs import position_ids_from_mask
from nanogrpo.batch import BatchError, RolloutBatch
from nanogrpo.config import load_config
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.training.distributed import Backend
from nanogrpo.training.step import policy_update

# one trajectory per row: prompt | model turn | tool output | model turn | padding
# M = sampled by the model (trained), T = tool output (context only), . = padding
LAYOUT = ["MMMTTTTMM.", "MMTTMMMMMM", "MMMMM.....", "MTTTTTTMM."]


def hand_built(tok, seed=0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n, p, c = len(LAYOUT), 4, len(LAYOUT[0])
    ids = torch.randint(3, len(tok), (n, p + c), generator=g)
    cm = torch.tensor([[ch != "." for ch in row] for row in LAYOUT])
    lm = torch.tensor([[ch == "M" for ch in row] for row in LAYOUT])
    am = torch.cat([torch.ones(n, p, dtype=torch.int8), cm.to(torch.int8)], 1)
    am[1, 0] = 0                                  # one left-padded prompt
    ids[1, 0] = tok.pad_token_id
    return RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, loss_mask=lm,
                        rewards=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                        advantages=torch.tensor([1.2, -0.7, 0.4, -0.9]), group_ids=torch.tensor([0, 0, 1, 1]),
                        old_logprobs=-torch.rand(n, c, generator=g) * cm,
                        ref_logprobs=-torch.rand(n, c, generator=g) * 3 * cm, prompt_len=p, group_size=2)


def reference_loss(model, b: RolloutBatch, variant: str, beta: float, max_new: int) -> torch.Tensor:
    """The GRPO loss with the tool tokens dropped, written out token by token: a plain forward of
    each row, and sums over the model's own tokens only (lists of indices, no masks)."""
    per_row, all_terms = [], []
    for i in range(b.num_seqs):
        am = b.attention_mask[i:i + 1].long()
        logits = model(input_ids=b.input_ids[i:i + 1], attention_mask=am,
                       position_ids=position_ids_from_mask(am)).logits[0]
        keep = [t for t, ch in enumerate(LAYOUT[i]) if ch == "M"]
        terms = []
        for t in keep:
            pos = b.prompt_len + t
            lp = torch.log_softmax(logits[pos - 1].float(), -1)[b.input_ids[i, pos]]
            ratio = torch.exp(lp - lp.detach())
            d = b.ref_logprobs[i, t] - lp
            kl = torch.exp(d) - d - 1
            terms.append(-(ratio * b.advantages[i] - beta * kl))
        per_row.append(torch.stack(terms).sum() / len(terms))
        all_terms += terms
    if variant == "grpo":
        return torch.stack(per_row).mean()
    if variant == "dapo":
        return torch.stack(all_terms).sum() / len(all_terms)
    return torch.stack(all_terms).sum() / (b.num_seqs * max_new)          # dr_grpo


class _GradTap(Backend):
    """The single-process backend, but the step keeps the gradients instead of applying them."""

    grads: dict[str, torch.Tensor]

    def clip_and_step(self, max_norm: float) -> float:
        self.grads = {k: p.grad.clone() for k, p in self.module.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad()
        return 0.0


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo"])
def test_loss_and_gradient_skip_tool_tokens(variant):
    tok = make_tokenizer()
    model = make_model("tiny", tok, seed=1)
    model.config.use_cache = True
    b = hand_built(tok)
    beta, max_new = 0.04, 12
    cfg = load_config(overrides=[f"grpo.loss={variant}", f"grpo.beta={beta}", "train.micro_batch_size=3",
                                 f"rollout.max_new_tokens={max_new}"])
    be = _GradTap(model, lr=1e-3)
    res = policy_update(be, b, cfg, on_policy=True)
    model.zero_grad()
    ref = reference_loss(model, b, variant, beta, max_new)
    ref.backward()
    assert res.loss == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(be.grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the reported KL is the mean over the model's tokens only
    n_model = sum(row.count("M") for row in LAYOUT)
    assert int(b.loss_mask.sum()) == n_model


def test_tool_token_values_do_not_matter():
    """Whatever sits in old/ref log-probs at tool positions, the update is the same."""
    tok = make_tokenizer()
    cfg = load_config(overrides=["grpo.beta=0.04", "train.micro_batch_size=4", "rollout.max_new_tokens=12"])
    out = []
    for junk in (0.0, -7.0):
        model = make_model("tiny", tok, seed=1)
        b = hand_built(tok)
        tool = b.completion_mask & ~b.loss_mask
        b.ref_logprobs[tool] = junk
        b.old_logprobs[tool] = junk
        be = _GradTap(model, lr=1e-3)
        res = policy_update(be, b, cfg, on_policy=False)
        out.append((res.loss, res.kl, be.grads))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6) and out[0][1] == pytest.approx(out[1][1], rel=1e-6)
    for k in out[0][2]:
        torch.testing.assert_close(out[0][2][k], out[1][2][k])


def test_wire_round_trip_and_validation():
    tok = make_tokenizer()
    b = hand_built(tok)
    back = RolloutBatch.from_bytes(b.to_bytes(), vocab_size=len(tok))
    assert torch.equal(back.loss_mask, b.loss_mask)
    assert torch.equal(back.select(torch.tensor([3, 1])).loss_mask, b.loss_mask[[3, 1]])
    no_mask = RolloutBatch.from_bytes(hand_built(tok).to_bytes(), vocab_size=len(tok))
    no_mask.loss_mask = None
    assert RolloutBatch.from_bytes(no_mask.to_bytes()).loss_mask is None
    assert torch.equal(no_mask.trained_mask, no_mask.completion_mask)

    bad = hand_built(tok)
    bad.loss_mask[2, 7] = True                    # a padding position
    with pytest.raises(BatchError, match="loss_mask must be a subset of completion_mask"):
        RolloutBatch.from_bytes(bad.to_bytes())
    bad = hand_built(tok)
    bad.loss_mask[0] = False
    with pytest.raises(BatchError, match="at least one token in loss_mask"):
        bad.validate()
    bad = hand_built(tok)
    bad.loss_mask = bad.loss_mask.to(torch.int8)
    with pytest.raises(BatchError, match="loss_mask must be torch.bool"):
        bad.validate()
    bad = hand_built(tok)
    bad.loss_mask = bad.loss_mask[:, :5]
    with pytest.raises(BatchError, match="loss_mask has shape"):
        bad.validate()
