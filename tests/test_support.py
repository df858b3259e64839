"""No truncated-support bias: with tempered log-probs and top-k / top-p, the engines report the log-probs of
the distribution they sample from (the kept support, renormalised) and the trainer computes its own over
the same support, chunked, gradients and entropies included; the ratio is then 1 on-policy, where a
full-vocabulary trainer against support log-probs (vLLM's processed log-probs, TRL #6789) sits below it."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from nanogrpo.algo.logprobs import (
    _full_logprobs,
    linear_logprobs,
    position_ids_from_mask,
    token_logprobs,
    token_stats,
)
from nanogrpo.algo.support import keep_mask, support_logprobs, support_threshold, truncate
from nanogrpo.config import RolloutConfig, load_config
from nanogrpo.engines import SamplingParams, make_engine
from nanogrpo.rollout.collect import pad_batch
from tests.test_engines import PAD, PROMPTS, TOK, qwen

T = 0.7
SUPPORTS = [(5, 1.0), (0, 0.8), (7, 0.6), (0, 0.3), (1, 1.0)]


def vllm_apply_top_k_top_p(logits: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    """vLLM 0.32 ``apply_top_k_top_p_pytorch`` (v1/sample/ops/topk_topp_sampler.py), written out."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        top_k_mask = logits_sort.gather(1, (logits_sort.size(1) - torch.full((logits.shape[0],), k))[:, None])
        logits_sort.masked_fill_(logits_sort < top_k_mask, -float("inf"))
    if p is not None:
        probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
        top_p_mask = probs_sum <= 1 - p
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits.clone().scatter_(dim=-1, index=logits_idx, src=logits_sort)


@pytest.mark.parametrize("k,p", SUPPORTS)
def test_the_support_is_vllms_and_hfs(k, p):
    torch.manual_seed(k * 10 + int(p * 10))
    z = torch.randn(64, 50, dtype=torch.float64) * 2
    ours = torch.isfinite(truncate(z, k, p))
    vllm = torch.isfinite(vllm_apply_top_k_top_p(z.clone(), k or None, p if p < 1 else None))
    hf = z.clone()
    if k:
        hf = TopKLogitsWarper(k)(None, hf)
    if p < 1:
        hf = TopPLogitsWarper(p)(None, hf)
    assert torch.equal(ours, vllm) and torch.equal(ours, torch.isfinite(hf))
    thr = support_threshold(z, (k, p))
    assert torch.equal(z >= thr[:, None], ours)                    # the support is z >= its threshold
    tgt = torch.randint(0, 50, (64,))
    assert keep_mask(z, thr, tgt).gather(-1, tgt[:, None]).all()   # the sampled token always counts


@pytest.mark.parametrize("k,p", SUPPORTS)
def test_chunked_support_logprobs_entropies_and_gradients_match_the_naive_ones(k, p):
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 50, (37,))
    g = torch.randn(37, dtype=torch.float64)
    out = linear_logprobs(h, w, b, tgt, chunk=8, temperature=T, entropy="grad", support=(k, p))   # (T, 2)
    z = torch.nn.functional.linear(h, w, b) / T
    keep = keep_mask(z.detach(), support_threshold(z.detach(), (k, p)), tgt)
    lp = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
    want_lp = lp.gather(-1, tgt[:, None])[:, 0]
    want_h = -(lp.exp() * torch.where(keep, lp, 0.0)).sum(-1)
    torch.testing.assert_close(out[:, 0], want_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, 0], support_logprobs(z, tgt, (k, p)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, 1], want_h, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((out[:, 0] * g).sum() + 0.3 * out[:, 1].sum(), [h, w, b])
    want = torch.autograd.grad((want_lp * g).sum() + 0.3 * want_h.sum(), [h, w, b])
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10)
    assert torch.isfinite(out).all()
    if k == 1:  # one token kept: probability 1 (or the sampled token's share when it is another)
        assert (out[:, 1] >= 0).all()


@pytest.mark.parametrize("chunk", [8, 5, 3])
@pytest.mark.parametrize("k,p", [(5, 1.0), (0, 0.8)])
def test_the_backward_keeps_the_forwards_support_whatever_the_gemms_rounding(monkeypatch, chunk, k, p):
    """A GEMM's last bits can depend on its row count (MKL, 8 rows against 4, on an AMX Xeon; with MKL held
    to AVX2, as the AMD EPYCs' path may be, the test above failed by 0.48 in a gradient). The support's
    smallest kept logit is the saved threshold itself, so a backward that recomputed the logits in other
    row blocks than the forward could leave that token out. A stand-in GEMM whose rows move with its row
    count (a uniform shift: the log-probs do not change) makes any such mismatch fail on every CPU."""
    real = torch.nn.functional.linear

    def linear(x, w, b=None):
        return real(x, w, b) + x.shape[0] * 2.0 ** -44                  # (rows, V): rounding by row count

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 50, (37,))
    g = torch.randn(37, dtype=torch.float64)
    out = linear_logprobs(h, w, b, tgt, chunk=chunk, temperature=T, entropy="grad", support=(k, p))
    z = linear(h, w, b) / T
    keep = keep_mask(z.detach(), support_threshold(z.detach(), (k, p)), tgt)
    lp = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
    want_lp = lp.gather(-1, tgt[:, None])[:, 0]
    want_h = -(lp.exp() * torch.where(keep, lp, 0.0)).sum(-1)
    torch.testing.assert_close(out[:, 0], want_lp, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((out[:, 0] * g).sum() + 0.3 * out[:, 1].sum(), [h, w, b])
    want = torch.autograd.grad((want_lp * g).sum() + 0.3 * want_h.sum(), [h, w, b])
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10)


def _generate(model, engine: str, k: int, p: float, support: bool):
    params = SamplingParams(max_new_tokens=12, temperature=T, top_k=k, top_p=p, n=3, seed=0,
                            logprob_temperature=T, support_logprobs=support)
    gen = make_engine(engine, model, TOK).generate(PROMPTS, params)
    prompts = [q for q in PROMPTS for _ in range(3)]
    ids, am, cm, old, plen = pad_batch(prompts, gen.completion_ids, gen.logprobs, PAD)
    return ids, am.long(), cm, old, plen


@pytest.mark.parametrize("engine", ["fast", "hf"])
@pytest.mark.parametrize("k,p", [(8, 1.0), (0, 0.7)])
def test_engines_and_trainer_agree_over_the_support(engine, k, p):
    """On-policy, the engine's support log-probs equal the trainer's (lean, prompt-shared and full paths):
    ratio 1; the trainer's full-vocabulary log-probs sit above them by the log of the kept mass."""
    model = qwen("tiny")
    ids, am, cm, old, plen = _generate(model, engine, k, p, support=True)
    with torch.no_grad():
        paths = {"lean": token_logprobs(model, ids, am, plen, cm, share_prefix=False, temperature=T,
                                        support=(k, p)),
                 "shared": token_logprobs(model, ids, am, plen, cm, temperature=T, support=(k, p)),
                 "full": _full_logprobs(model, ids, am, position_ids_from_mask(am), plen, T,
                                        support=(k, p))[0] * cm}
        whole = token_logprobs(model, ids, am, plen, cm, temperature=T)
    for name, logp in paths.items():
        assert (logp - old)[cm].abs().max().item() < 1e-5, name
    gap = (whole - old)[cm]                                     # log of the kept mass, <= 0
    assert gap.max().item() < 1e-5 and gap.min().item() < -0.05
    # without support_logprobs the engines report the whole vocabulary's (the old convention)
    _, _, cm2, old2, _ = _generate(model, engine, k, p, support=False)
    assert torch.equal(cm2, cm) and (old2 - whole)[cm].abs().max().item() < 1e-5


def test_the_config_turns_support_on_only_for_tempered_truncated_sampling():
    assert RolloutConfig().logprob_support() is None
    assert RolloutConfig(top_p=0.9).logprob_support() is None                         # seed convention
    assert RolloutConfig(tempered_logprobs=True).logprob_support() is None
    assert RolloutConfig(tempered_logprobs=True, top_k=20, top_p=0.95).logprob_support() == (20, 0.95)
    from nanogrpo.engines.vllm_inprocess import vllm_options  # tempered + top-p: vLLM takes it
    cfg = load_config(overrides=["rollout.tempered_logprobs=true", "rollout.top_p=0.9"])
    assert vllm_options(cfg)["tempered_logprobs"] is True


def test_a_support_request_with_another_logprob_temperature_is_refused():
    with pytest.raises(ValueError, match="logprob_temperature must be the temperature"):
        make_engine("hf", qwen("tiny"), TOK).generate(
            PROMPTS, SamplingParams(4, temperature=T, top_p=0.8, support_logprobs=True))


@pytest.mark.slow
def test_policy_update_trains_over_the_support_and_the_first_ratio_is_one(tmp_path, monkeypatch):
    """A run with tempered log-probs and top-p: the behaviour and reference log-probs the trainer gets are
    over the support, equal to the policy's before its first update; the step logs ratio 1."""
    import nanogrpo.training.schedule as schedule
    from nanogrpo.cli import main
    from tests.run_fixtures import write_tiny_run_assets

    d = write_tiny_run_assets(tmp_path)
    seen = []
    real = schedule.policy_update

    def spy(be, batch, cfg, **kw):
        if batch is not None and not seen:
            support = cfg.rollout.logprob_support()
            with torch.no_grad():
                logp, _ = token_stats(be.model, batch.input_ids, batch.attention_mask.long(),
                                      batch.prompt_len, batch.completion_mask,
                                      temperature=cfg.rollout.logprob_temperature(), support=support)
            cm = batch.completion_mask
            seen.append((support, (logp - batch.old_logprobs)[cm].abs().max().item(),
                         (logp - batch.ref_logprobs)[cm].abs().max().item()))
        return real(be, batch, cfg, **kw)

    monkeypatch.setattr(schedule, "policy_update", spy)
    for engine in ("fast", "hf"):
        seen.clear()
        assert main(["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--out",
                     str(tmp_path / engine), "--steps", "1", "rollout.prompts_per_step=2",
                     "grpo.group_size=4", "rollout.max_new_tokens=10", f"rollout.temperature={T}",
                     "rollout.tempered_logprobs=true",
                     "rollout.top_p=0.8", "rollout.top_k=30", f"rollout.engine={engine}", "grpo.beta=0.04",
                     'rewards.functions=["tests.reward_fixtures:length"]', "rewards.workers=0",
                     "train.save_every=0", "eval.every=0"]) == 0
        sup, old_diff, ref_diff = seen[0]
        assert sup == (30, 0.8) and old_diff < 1e-5 and ref_diff < 1e-5, engine
