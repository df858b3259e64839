"""Lean log-probs (fused linear + log-softmax) and the token-budget micro-batching of the update step."""

from __future__ import annotations

import copy

import pytest
import torch

from nanogrpo.algo.logprobs import LeanHead, linear_logprobs, token_logprobs
from nanogrpo.models.tiny import make_model, make_tokenizer


def _naive(h, w, b, t):
    logits = torch.nn.functional.linear(h, w, b).float()
    return logits.log_softmax(-1).gather(-1, t[:, None]).squeeze(-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_linear_logprobs_forward_and_backward_match_naive(bias, chunk):
    torch.manual_seed(0)
    h = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, 50, (10,))
    g = torch.randn(10, dtype=torch.float64)
    out = linear_logprobs(h, w, b, t, chunk)
    ref = _naive(h, w, b, t)
    assert torch.allclose(out, ref.float(), atol=1e-5)
    grads = torch.autograd.grad((out * g).sum(), [h, w] + ([b] if bias else []))
    ref_grads = torch.autograd.grad((ref * g).sum(), [h, w] + ([b] if bias else []))
    for a, r in zip(grads, ref_grads):
        assert torch.allclose(a, r, atol=1e-5)


def test_linear_logprobs_gradcheck():
    torch.manual_seed(1)
    h = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (5,))
    # forward output is float32 by design; compare in float64 via the backward formula instead
    out = linear_logprobs(h, w, None, t, 2)
    (out.sum()).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _naive(h2, w2, None, t).sum().backward()
    assert torch.allclose(h.grad, h2.grad, atol=1e-6) and torch.allclose(w.grad, w2.grad, atol=1e-6)


def test_token_logprobs_grads_match_full_logits_path():
    torch.manual_seed(0)
    tok = make_tokenizer()
    model = make_model("tiny", tok)
    twin = copy.deepcopy(model)
    ids = torch.randint(3, len(tok), (3, 12))
    am = torch.ones_like(ids)
    am[0, :3] = 0
    cm = torch.ones(3, 5, dtype=torch.bool)
    cm[1, 2:] = False
    am[1, 7 + 2:] = 0
    lp = token_logprobs(model, ids, am, 7, cm, chunk=4)
    assert isinstance(model.get_output_embeddings(), LeanHead)
    (lp * torch.arange(1.0, 16.0).view(3, 5)).sum().backward()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = twin(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()
    ref = logits.log_softmax(-1)[:, 6:-1].gather(-1, ids[:, 7:, None]).squeeze(-1) * cm
    assert torch.allclose(lp, ref, atol=1e-5)
    (ref * torch.arange(1.0, 16.0).view(3, 5)).sum().backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n
    # unarmed, the head is still a plain linear layer (generation path)
    out = model(input_ids=ids).logits
    assert out.shape == (3, 12, len(tok))


def _grouped_batch(tok, groups=3, g=4, p=9, c=6, seed=0):
    """Groups of g rows sharing a left-padded prompt; completions of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, len(tok), (groups, p), generator=gen).repeat_interleave(g, 0)
    am = torch.ones(groups * g, p + c, dtype=torch.long)
    am[:g, :4] = 0                                        # group 0: 4 pad tokens on the left
    prompts[:g, :4] = tok.pad_token_id
    comp = torch.randint(3, len(tok), (groups * g, c), generator=gen)
    cm = torch.ones(groups * g, c, dtype=torch.bool)
    for i, n in ((1, 2), (5, 4), (9, 1)):                 # some completions stop early (right padding)
        cm[i, n:] = False
        am[i, p + n:] = 0
        comp[i, n:] = tok.pad_token_id
    return torch.cat([prompts, comp], 1), am, cm


def test_shared_prefix_gives_the_plain_forwards_logprobs_and_gradients():
    torch.manual_seed(0)
    tok = make_tokenizer()
    model = make_model("tiny", tok)
    twin = copy.deepcopy(model)
    ids, am, cm = _grouped_batch(tok)
    w = torch.randn(cm.shape)
    shared = token_logprobs(model, ids, am, 9, cm, chunk=5, share_prefix=True)
    plain = token_logprobs(twin, ids, am, 9, cm, chunk=5, share_prefix=False)
    assert torch.allclose(shared, plain, atol=1e-5) and bool((shared[~cm] == 0).all())
    (shared * w).sum().backward()
    (plain * w).sum().backward()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), n


def test_shared_prefix_runs_each_distinct_prompt_once():
    tok = make_tokenizer()
    model = make_model("tiny", tok)
    ids, am, cm = _grouped_batch(tok)
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        token_logprobs(model, ids, am, 9, cm, share_prefix=True)
        assert seen == [(3, 8), (12, 6)]  # 3 prompts less their last token; then 1 + 5 per row
        seen.clear()
        token_logprobs(model, ids[::4], am[::4], 9, cm[::4], share_prefix=True)  # no prompt repeats
        assert seen == [(3, 14)]                          # one plain forward, the last token left out
        seen.clear()
        model.gradient_checkpointing_enable()             # HF drops the KV cache then: plain forward
        model.train()
        token_logprobs(model, ids, am, 9, cm, share_prefix=True)
        assert seen == [(12, 14)]
    finally:
        hook.remove()
