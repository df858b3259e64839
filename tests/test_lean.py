"""Lean log-probs (fused linear + log-softmax) and the token-budget micro-batching of the update step."""

from __future__ import annotations

import copy

import pytest
import torch

from nanogrpo.algo.logprobs import LeanHead, linear_logprobs, token_logprobs
from nanogrpo.models.tiny import make_model, make_tokenizer


def _naive(h, w, b, t, temperature=1.0):
    logits = torch.nn.functional.linear(h, w, b)
    lp = (logits / temperature).log_softmax(-1)                       # (T, V) the whole matrix
    return lp.gather(-1, t[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_linear_logprobs_forward_and_backward_match_naive(bias, chunk):
    """float64 in, float64 out (exact to rounding); float32 in, float32 out (the trainer's precision)."""
    torch.manual_seed(0)
    h = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, 50, (10,))
    g = torch.randn(10, dtype=torch.float64)
    out = linear_logprobs(h, w, b, t, chunk)
    ref, _ = _naive(h, w, b, t)
    assert out.dtype == torch.float64 and torch.allclose(out, ref, atol=1e-12)
    grads = torch.autograd.grad((out * g).sum(), [h, w] + ([b] if bias else []))
    ref_grads = torch.autograd.grad((ref * g).sum(), [h, w] + ([b] if bias else []))
    for a, r in zip(grads, ref_grads):
        assert torch.allclose(a, r, atol=1e-12)
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    out32 = linear_logprobs(h32, w32, None if b is None else b.detach().float(), t, chunk)
    assert out32.dtype == torch.float32 and torch.allclose(out32.double(), _naive(h, w, b, t)[0], atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_entropy_in_the_same_pass_matches_the_full_softmax(temperature, chunk):
    """``entropy="grad"``: log-probs and entropies equal the full-matrix ones, and so do the gradients of any
    mix of the two (d/dz of H folded into the log-prob's backward chunk); ``"value"``: no entropy gradient."""
    torch.manual_seed(3)
    h = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 40, (9,))
    g1, g2 = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    out = linear_logprobs(h, w, b, t, chunk, temperature, entropy="grad")      # (T, 2)
    lp, ent = _naive(h, w, b, t, temperature)
    torch.testing.assert_close(out[:, 0], lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, 1], ent, rtol=0, atol=1e-12)
    grads = torch.autograd.grad((out[:, 0] * g1 + out[:, 1] * g2).sum(), [h, w, b])
    ref = torch.autograd.grad((lp * g1 + ent * g2).sum(), [h, w, b])
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-11)
    def fn(h_, w_):
        return linear_logprobs(h_, w_, None, t[:4], chunk, temperature, "grad")
    assert torch.autograd.gradcheck(fn, (h[:4].detach().requires_grad_(), w.detach().requires_grad_()))
    val = linear_logprobs(h, w, b, t, chunk, temperature, entropy="value")
    assert not torch.autograd.grad(val[:, 1].sum(), [h], retain_graph=True)[0].any()  # no entropy gradient
    torch.testing.assert_close(val, out.detach(), rtol=0, atol=0)
    # the entropy column adds nothing to the log-prob's gradient
    ga = torch.autograd.grad((val[:, 0] * g1).sum(), [h])[0]
    gb = torch.autograd.grad((linear_logprobs(h, w, b, t, chunk, temperature) * g1).sum(), [h])[0]
    torch.testing.assert_close(ga, gb, rtol=0, atol=1e-13)


def test_linear_logprobs_gradcheck():
    torch.manual_seed(1)
    h = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (5,))
    assert torch.autograd.gradcheck(lambda h_, w_: linear_logprobs(h_, w_, None, t, 2), (h, w))


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
