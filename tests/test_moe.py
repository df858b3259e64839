"""Routing replay in the HF forward (nanogrpo.moe): forced experts, recorded experts, the router's
gradient, and the layouts of the log-prob path (prefix sharing, micro-batches, checkpointing, LoRA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanogrpo.algo.logprobs import position_ids_from_mask, token_logprobs
from nanogrpo.errors import ConfigError
from nanogrpo.moe import (
    NO_ROUTE,
    RouteError,
    moe_spec,
    prepare_for_training,
    record_routes,
    replay_routes,
    require_moe,
    trim_routes,
)
from nanogrpo.moe.routes import pack, prompts_share_routes, unpack
from tests.moe_models import EOS, FAMILIES, PAD, batch_tensors, build

FAMS = ["qwen3_moe", "qwen3_moe_unnormed", "olmoe", "mixtral", "qwen2_moe", "gpt_oss"]


def random_routes(spec, n: int, length: int, seed: int = 1, prompt_len: int = 0) -> torch.Tensor:
    """(n, L, layers, k) distinct experts per token, uniformly at random: not the model's own. With
    ``prompt_len``: the two rows of each group share their prompt's record (as an engine that runs a group's
    prompt once records it), but for its last token."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(n, length, spec.moe_layers, spec.num_experts, generator=g).argsort(-1)[..., :spec.top_k]
    if prompt_len:
        idx[1::2, :prompt_len - 1] = idx[0::2, :prompt_len - 1]
    return pack(idx, spec.route_dtype)


def hand_logprobs(model, ids: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """log p(ids[t + 1] | ids[: t + 1]) (S - 1,) of one unpadded row with the experts ``routes``
    (S, layers, k) forced, written out layer by layer and expert by expert (no nanogrpo code): attention
    through the layer's own module, the MoE block by hand from its parameters and the family's published
    rule (gpt-oss: its model card's router and clamped SwiGLU; Qwen2-MoE: its sigmoid-gated shared expert
    beside the routed ones)."""
    m, cfg = model.model, model.config
    s = ids.shape[0]
    h = m.embed_tokens(ids[None])                                            # (1, S, H)
    cos, sin = m.rotary_emb(h, torch.arange(s)[None])
    for li, layer in enumerate(m.layers):
        window = getattr(cfg, "layer_types", None) and cfg.layer_types[li] == "sliding_attention"
        a, _ = layer.self_attn(layer.input_layernorm(h), position_embeddings=(cos, sin),
                               attention_mask=_causal(s, cfg.sliding_window if window else None))
        h = h + a
        x = layer.post_attention_layernorm(h)[0]                             # (S, H)
        idx = routes[:, li]                                                  # (S, k)
        if cfg.model_type == "gpt_oss":
            out = _gpt_oss_experts(layer.mlp, x, idx)
        else:
            out = _swiglu_experts(layer.mlp, cfg, x, idx)
        h = h + out[None]
    logits = model.lm_head(m.norm(h))[0].float()                             # (S, V)
    return logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]       # (S - 1,)


def _causal(s: int, window: int | None) -> torch.Tensor:
    """(1, 1, S, S) additive mask: each query sees the keys up to itself (the last ``window`` of them)."""
    q, k = torch.arange(s)[:, None], torch.arange(s)[None]
    seen = (k <= q) & ((q - k < window) if window else True)
    return torch.zeros(s, s).masked_fill(~seen, float("-inf"))[None, None]


def _swiglu_experts(block, cfg, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen2/3-MoE, OLMoE, Mixtral: softmax over all experts, gathered (renormalised where the family
    does), each chosen expert's SwiGLU; Qwen2-MoE adds its shared expert, gated by a sigmoid."""
    probs = torch.softmax((x @ block.gate.weight.T).float(), -1)            # (S, E)
    w = probs.gather(-1, idx)                                                # (S, k)
    if cfg.model_type == "mixtral" or getattr(cfg, "norm_topk_prob", False):
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate, up = (block.experts.gate_up_proj[e] @ x[t]).chunk(2)       # (I,), (I,)
            y = block.experts.down_proj[e] @ (F.silu(gate) * up)             # (H,)
            out[t] = out[t] + w[t, j].to(y.dtype) * y
    if cfg.model_type == "qwen2_moe":
        sh = block.shared_expert
        y = (F.silu(x @ sh.gate_proj.weight.T) * (x @ sh.up_proj.weight.T)) @ sh.down_proj.weight.T  # (S, H)
        out = out + torch.sigmoid(x @ block.shared_expert_gate.weight.T) * y
    return out


def _gpt_oss_experts(block, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """gpt-oss: router logits with a bias, the softmax over the k chosen ones only; each expert
    ``x W + b`` split into interleaved gate and up, clamped at ``swiglu_limit``, ``(up + 1) * gate *
    sigmoid(alpha gate)``, then ``W_down + b``."""
    r, ex = block.router, block.experts
    logits = x @ r.weight.T + r.bias                                         # (S, E)
    w = torch.softmax(logits.gather(-1, idx), -1)                            # (S, k)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gu = x[t] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]         # (2I,)
            gate, up = gu[0::2].clamp(max=ex.limit), gu[1::2].clamp(-ex.limit, ex.limit)
            y = ((up + 1) * gate * torch.sigmoid(gate * ex.alpha)) @ ex.down_proj[e] + ex.down_proj_bias[e]
            out[t] = out[t] + w[t, j] * y
    return out


def test_every_family_s_routers_are_found_and_a_dense_model_is_refused():
    for fam in FAMS:
        spec = moe_spec(build(fam))
        assert (spec.moe_layers, spec.num_experts, spec.top_k, spec.layer_ids) == (2, 6, 2, (0, 1))
        assert spec.route_dtype == torch.uint8 and spec.bytes_per_token == 4
    sparse = moe_spec(build("qwen3_moe", mlp_only_layers=[0]))             # layer 0 dense, layer 1 MoE
    assert (sparse.moe_layers, sparse.layer_ids, sparse.num_layers) == (1, (1,), 2)
    from tests.conformance import CASES
    from tests.conformance import build as build_dense

    dense = build_dense(next(c for c in CASES if c.name.startswith("Qwen3 (")))
    assert moe_spec(dense) is None
    with pytest.raises(ConfigError) as e:
        require_moe(dense, "rollout")
    assert str(e.value) == ("moe.routing_replay=rollout needs a mixture-of-experts model; qwen3 is dense (no "
                            "routers to replay): set moe.routing_replay=off")
    with pytest.raises(RouteError, match="dense"):
        with replay_routes(dense, torch.zeros(1, 2, 1, 1, dtype=torch.uint8),
                           torch.zeros(1, 2, dtype=torch.long)):
            pass


def test_an_unknown_mixture_of_experts_family_is_refused_in_one_line():
    import transformers as tf

    cfg = tf.Qwen2MoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=50, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=16)
    model = tf.Qwen2MoeForCausalLM(cfg)
    assert moe_spec(model).model_type == "qwen2_moe"
    model.config.model_type = "some_moe"
    with pytest.raises(ConfigError, match=r"^moe.routing_replay=policy: some_moe is a mixture of experts "
                                          r"whose routing nanogrpo does not record or replay \(it does "):
        require_moe(model, "policy")


@pytest.mark.parametrize("fam", FAMS)
def test_replaying_the_model_s_own_routes_is_its_own_forward_bit_for_bit(fam):
    model = build(fam)
    ids, am, cm, p = batch_tensors()
    plain = token_logprobs(model, ids, am, p, cm)
    with record_routes(model, ids, am) as rec:
        assert torch.equal(token_logprobs(model, ids, am, p, cm), plain)   # recording changes nothing
    r = unpack(rec.routes)
    assert (r[:, :-1][am[:, :-1].bool()] >= 0).all() and (r[~am.bool()] == NO_ROUTE).all()
    with replay_routes(model, rec.routes, ids, am) as tr:
        assert torch.equal(token_logprobs(model, ids, am, p, cm), plain)
    assert tr.stats.flipped == 0 and tr.stats.token_layers > 0


@pytest.mark.parametrize("fam", FAMS)
def test_replay_equals_a_hand_written_forward_with_the_routes_forced(fam):
    """The log-probs under replay of routes that are not the model's own equal a forward written out by
    hand with those experts, row by row without padding; the model's own forward differs."""
    model = build(fam)
    spec = moe_spec(model)
    ids, am, cm, p = batch_tensors()
    routes = random_routes(spec, *ids.shape, prompt_len=p)
    plain = token_logprobs(model, ids, am, p, cm)
    with replay_routes(model, routes, ids, am) as tr:
        got = token_logprobs(model, ids, am, p, cm)
    assert tr.stats.disagreement > 0.5 and tr.stats.shared_prompt_conflicts == 0
    assert (got - plain)[cm].abs().max() > 1e-2                             # the record was used
    r = unpack(routes)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            real = am[i].bool()
            want = hand_logprobs(model, ids[i][real], r[i][real])[-int(cm[i].sum()):]
            torch.testing.assert_close(got[i][cm[i]], want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_the_router_learns_under_replay_with_the_hand_written_gradient(fam):
    """The router's weight gets the gradient of the hand-written forward with the experts forced (a replay
    that froze the router, or computed the gate weights elsewhere, fails this)."""
    model = build(fam)
    spec = moe_spec(model)
    ids, am, cm, p = batch_tensors()
    routes = random_routes(spec, *ids.shape, seed=3, prompt_len=p)
    with replay_routes(model, routes, ids, am):
        (token_logprobs(model, ids, am, p, cm) * cm).sum().backward()
    got = [r.weight.grad.clone() for r in spec.routers]
    model.zero_grad()
    r = unpack(routes)
    total = sum(hand_logprobs(model, ids[i][am[i].bool()], r[i][am[i].bool()])[-int(cm[i].sum()):].sum()
                for i in range(ids.shape[0]))
    total.backward()
    for g, router in zip(got, spec.routers, strict=True):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, router.weight.grad, atol=1e-4, rtol=1e-4)


def test_prefix_sharing_micro_batches_and_the_full_path_follow_the_record():
    """The same routes replayed through every layout of the log-prob path give the same log-probs: one
    forward, the prompt once per group then the suffixes, row at a time (a head off the lean path), and
    micro-batches (rows selected, columns trimmed as training/micro.py's trim_rows does)."""
    from nanogrpo.batch import RolloutBatch
    from nanogrpo.training.micro import trim_rows

    model = build("qwen3_moe")
    spec = moe_spec(model)
    ids, am, cm, p = batch_tensors()
    routes = random_routes(spec, *ids.shape, seed=5, prompt_len=p)
    assert prompts_share_routes(routes, ids, p)
    with replay_routes(model, routes, ids, am):
        one = token_logprobs(model, ids, am, p, cm, share_prefix=False)
    with replay_routes(model, routes, ids, am) as shared:
        two = token_logprobs(model, ids, am, p, cm, share_prefix=True)
    torch.testing.assert_close(two, one, atol=1e-5, rtol=0)
    assert shared.stats.token_layers < ids.numel() * 2                      # each prompt ran once
    assert shared.stats.shared_prompt_conflicts == 0
    apart = random_routes(spec, *ids.shape, seed=5)                         # each row routed its prompt
    assert not prompts_share_routes(apart, ids, p)
    with replay_routes(model, apart, ids, am) as tr:
        token_logprobs(model, ids, am, p, cm, share_prefix=True)
    assert tr.stats.shared_prompt_conflicts > 0                             # counted, never silent
    model.config.model_type = "not_plain"                                   # the row-at-a-time path
    with replay_routes(model, routes, ids, am, spec=spec):
        full = token_logprobs(model, ids, am, p, cm) * cm
    model.config.model_type = "qwen3_moe"
    torch.testing.assert_close(full, one, atol=1e-5, rtol=0)
    n = ids.shape[0]
    batch = RolloutBatch(input_ids=ids, attention_mask=am.to(torch.int8), completion_mask=cm,
                         rewards=torch.zeros(n), advantages=torch.zeros(n), group_ids=torch.arange(n) // 2,
                         old_logprobs=torch.zeros(cm.shape), prompt_len=p, group_size=2, routes=routes)
    for rows, width in ((torch.tensor([2, 3]), 8), (torch.tensor([5, 1]), 12), (torch.tensor([3]), 4)):
        mids, mam, mp, mlm, *_ = trim_rows(batch, rows)
        mr = trim_routes(batch, rows)
        assert mr.shape[:2] == mids.shape == (len(rows), width)
        with replay_routes(model, mr, mids, mam):
            lp = token_logprobs(model, mids, mam, mp, mlm)
        torch.testing.assert_close(lp, one[rows][:, :lp.shape[1]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fam", ["olmoe", "mixtral"])
def test_a_record_is_the_same_whichever_path_ran_the_forward(fam):
    """One forward, prompts once then suffixes, and row at a time (a head off the lean path) record the same
    routes for every token they all run."""
    model = build(fam)
    spec = moe_spec(model)
    ids, am, cm, p = batch_tensors()
    records = []
    for share in (False, True):
        with record_routes(model, ids, am) as rec:
            token_logprobs(model, ids, am, p, cm, share_prefix=share)
        records.append(rec.routes)
    model.config.model_type = "not_plain"
    try:
        with record_routes(model, ids, am, spec=spec) as rec:
            token_logprobs(model, ids, am, p, cm)
    finally:
        model.config.model_type = fam
    assert (unpack(records[0])[:, -1] == NO_ROUTE).all()                    # the lean path stops one short
    for r in (records[1], rec.routes):
        assert torch.equal(r[:, :-1], records[0][:, :-1])


def test_gradient_checkpointing_replays_in_the_recompute():
    model = build("qwen3_moe")
    spec = moe_spec(model)
    ids, am, cm, p = batch_tensors()
    routes = random_routes(spec, *ids.shape, seed=7, prompt_len=p)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        if ckpt:
            model.gradient_checkpointing_enable()                           # as training/setup.py does
        model.train()
        with replay_routes(model, routes, ids, am):                         # open through the backward
            token_logprobs(model, ids, am, p, cm).sum().backward()
        grads.append([q.grad.clone() for q in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_lora_and_wrappers_reach_the_routers():
    peft = pytest.importorskip("peft")
    model = build("qwen3_moe")
    spec = moe_spec(model)
    ids, am, cm, p = batch_tensors()
    routes = random_routes(spec, *ids.shape, seed=9, prompt_len=p)
    with replay_routes(model, routes, ids, am):
        want = token_logprobs(model, ids, am, p, cm)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))

    class Wrapper(torch.nn.Module):                                         # as DDP / DeepSpeed hold it
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    for wrapped in (lora, Wrapper(lora)):
        assert moe_spec(wrapped).routers == spec.routers
        with replay_routes(wrapped, routes, ids, am) as tr:
            got = token_logprobs(wrapped, ids, am, p, cm)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert tr.stats.flipped > 0


def test_routes_that_do_not_fit_get_one_line():
    model = build("qwen3_moe")
    spec = moe_spec(model)
    ids, am, cm, p = batch_tensors()
    good = random_routes(spec, *ids.shape)
    cases = [
        (good[..., :1], r"routes of shape \(6, 12, 2, 1\) do not fit qwen3_moe's 2 MoE layers x top 2"),
        (good[:, :, :1], r"routes of shape \(6, 12, 1, 2\) do not fit qwen3_moe's 2 MoE layers x top 2"),
        (torch.full_like(good, 7), r"routes name expert 7; qwen3_moe has 6 experts: routes of another"),
        (good.long(), "routes must be a uint8 or int16 tensor, got torch.int64"),
        (good[:, :-1], r"routes of shape \(6, 11, 2, 2\) do not line up with input_ids \(6, 12\)"),
    ]
    for routes, msg in cases:
        with pytest.raises(RouteError, match=msg):
            with replay_routes(model, routes, ids, am):
                pass
    inner = model.model                                                     # the decoder: not hooked
    with pytest.raises(RouteError, match="ran outside a forward of the model the routes were armed on"):
        with replay_routes(model, good, ids, am):
            inner(input_ids=ids, attention_mask=am)
    other = ids.clone()
    other[0, -3] = 99                                                       # not the armed batch
    with pytest.raises(RouteError, match="replay/record was armed with another batch than the forward runs"):
        with replay_routes(model, good, ids, am):
            token_logprobs(model, other[:1], am[:1], p, cm[:1])


def test_training_forwards_lose_router_jitter_and_aux_outputs():
    model = build("mixtral", router_jitter_noise=0.1, output_router_logits=True)
    ids, am, cm, p = batch_tensors()
    model.train()
    changed = prepare_for_training(model)
    assert changed == ["model.layers.0.mlp.jitter_noise 0.1 -> 0", "model.layers.1.mlp.jitter_noise 0.1 -> 0",
                       "config.output_router_logits -> False"]
    a = token_logprobs(model, ids, am, p, cm, share_prefix=True)
    model.eval()
    b = token_logprobs(model, ids, am, p, cm, share_prefix=False)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    q = build("qwen3_moe", output_router_logits=True)
    with pytest.raises(RuntimeError):                                       # the aux loss vs the cache
        token_logprobs(q, ids, am, p, cm, share_prefix=True)
    prepare_for_training(q)
    token_logprobs(q, ids, am, p, cm, share_prefix=True)
    assert prepare_for_training(build("qwen3_moe")) == []


def test_positions_of_the_hand_forward_are_the_trainer_s():
    """The hand-written forward runs unpadded rows from position 0: the trainer's left-padded rows use the
    same positions (position_ids_from_mask), so the two compare token for token."""
    _, am, _, _ = batch_tensors()
    pos = position_ids_from_mask(am)
    for i in range(am.shape[0]):
        assert pos[i][am[i].bool()].tolist() == list(range(int(am[i].sum())))
    assert EOS != PAD and set(FAMILIES) >= set(FAMS)
