"""MoE models on the engines: auto picks hf for them (the fast engine refuses in one line); the hf engine
records every token's route; with the routes replayed (R3) the trainer's log-probs of the samples, at the
weights that sampled them, are the engine's; in bf16 routes flip without replay."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tf

from nanogrpo.algo.logprobs import token_logprobs
from nanogrpo.batch import RolloutBatch
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.factory import make_engine
from nanogrpo.engines.hf import HFEngine
from nanogrpo.errors import ModelError
from nanogrpo.moe import (
    NO_ROUTE,
    batch_routes,
    mismatch_metrics,
    mismatch_sums,
    moe_spec,
    record_routes,
    replay_routes,
    router_disagreement,
    trim_routes,
)
from nanogrpo.moe.routes import unpack
from nanogrpo.rollout.collect import pad_batch
from tests.moe_models import COMMON, PAD, TOK, build

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [40, 41, 42, 43]]


def rollout(model, n: int = 3, new: int = 10, prompts=PROMPTS):
    """The hf engine's samples as a batch with their routes: (batch, generation)."""
    spec = moe_spec(model)
    gen = HFEngine(model, tokenizer=TOK, record_routes=True).generate(
        prompts, SamplingParams(max_new_tokens=new, temperature=1.0, n=n, seed=0))
    rows = [p for p in prompts for _ in range(n)]
    ids, am, cm, lp, p = pad_batch(rows, gen.completion_ids, gen.logprobs, PAD)
    k = ids.shape[0]
    batch = RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=torch.zeros(k),
                         advantages=torch.zeros(k), group_ids=torch.arange(k) // n, old_logprobs=lp,
                         prompt_len=p, group_size=n, routes=batch_routes(gen.routes, am, p, spec))
    return batch, gen


@pytest.mark.parametrize("fam", ["olmoe", "mixtral"])
def test_auto_gives_moe_models_the_hf_engine_and_fast_refuses_in_one_line(fam, caplog):
    model = build(fam)
    with caplog.at_level(logging.INFO, logger="nanogrpo.engines"):
        assert make_engine("auto", model, TOK).name == "hf"
    assert [r.getMessage() for r in caplog.records] == [
        f"rollout engine: hf ({fam} is a mixture of experts: the fast engine has no grouped expert matmul; "
        "the hf engine computes it exactly)"]
    with pytest.raises(ModelError, match=f"^the fast rollout engine cannot run this model: {fam} is a "
                                         "mixture of experts") as e:
        make_engine("fast", model, TOK)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fam", ["qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss"])
def test_the_hf_engine_records_the_route_of_every_prompt_and_completion_token(fam):
    model = build(fam)
    batch, gen = rollout(model)
    spec = moe_spec(model)
    longest = max(map(len, gen.completion_ids))
    for i, r in enumerate(gen.routes):
        assert r.shape == (len(PROMPTS[i // 3]) + len(gen.completion_ids[i]), 2, 2) and r.dtype == torch.uint8
        u = unpack(r)
        assert (u[:-1] >= 0).all()
        # the last sampled token is never fed back; a row that ended early had its EOS fed with the others
        assert bool((u[-1] == NO_ROUTE).all()) == (len(gen.completion_ids[i]) == longest)
    RolloutBatch.from_bytes(batch.to_bytes(), num_experts=spec.num_experts)  # a valid wire record
    # the model routes the same tokens the same way when the trainer runs them (float32)
    with record_routes(model, batch.input_ids, batch.attention_mask, compare=batch.routes) as rec:
        token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len, batch.completion_mask)
    flipped, compared = router_disagreement(rec.routes, batch.routes)
    assert compared >= int(batch.attention_mask.sum() - batch.num_seqs) * 2 and flipped == 0
    assert rec.stats.flipped == 0 and rec.stats.token_layers > 0
    # memory per sample: 4 bytes a token here (2 layers x top 2, uint8)
    assert sum(r.numel() for r in gen.routes) == int(batch.attention_mask.sum()) * spec.bytes_per_token


@pytest.mark.parametrize("fam", ["qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss"])
def test_r3_on_the_batch_s_micro_batches_gives_the_engine_s_log_probs(fam):
    """The loop's path: engine routes onto the batch, over the wire, micro-batches trimmed as the update
    trims them, each forward under replay of its slice: the trainer's log-probs are the engine's."""
    from nanogrpo.config import TrainConfig
    from nanogrpo.training.micro import micro_batch_indices, trim_rows

    model = build(fam)
    batch, _ = rollout(model, n=3, new=12)
    batch = RolloutBatch.from_bytes(batch.to_bytes(), num_experts=6)
    train = TrainConfig(micro_batch_size=4)
    worst = 0.0
    for share in (True, False):
        for rows in micro_batch_indices(batch, train.micro_batch_size, 0, share_prefix=share):
            ids, am, p, lm, beh, *_ = trim_rows(batch, rows)
            with replay_routes(model, trim_routes(batch, rows), ids, am) as tr:
                lp = token_logprobs(model, ids, am, p, lm, share_prefix=share)
            assert tr.stats.flipped == 0 and tr.stats.shared_prompt_conflicts == 0
            worst = max(worst, float((lp.detach() - beh)[lm].abs().max()))
    assert worst < 1e-4


def _bf16_model(fam: str, seed: int = 0):
    """16 experts, top 4, 3 layers: enough (token, layer) pairs for bf16 to flip some."""
    kw = {**COMMON, "hidden_size": 64, "num_hidden_layers": 3}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if fam == "qwen3_moe":
            model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
                **kw, head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                norm_topk_prob=True))
        else:
            model = tf.OlmoeForCausalLM(tf.OlmoeConfig(**kw, num_experts=16, num_experts_per_tok=4))
    return model.to(torch.bfloat16).eval()


@pytest.mark.parametrize("fam", ["qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss"])
def test_in_bf16_routes_flip_without_replay_and_r3_removes_their_gap(fam):
    """bf16: the engine (KV-cached decode, one token a step) and the trainer (one forward over the padded
    batch) round differently, and some routers pick another expert. Replay forces the engine's experts:
    the gap left is the dense layers' bf16 rounding, the flips' share of it gone."""
    model = _bf16_model(fam)
    prompts = [[5 + 7 * i + j for j in range(3 + i % 5)] for i in range(8)]
    batch, _ = rollout(model, n=4, new=20, prompts=prompts)
    ids, am, p, cm, beh = (batch.input_ids, batch.attention_mask, batch.prompt_len, batch.completion_mask,
                           batch.old_logprobs)
    with record_routes(model, ids, am, compare=batch.routes) as own:
        plain = token_logprobs(model, ids, am, p, cm)
    with replay_routes(model, batch.routes, ids, am) as tr:
        replayed = token_logprobs(model, ids, am, p, cm)
    flipped, compared = router_disagreement(own.routes, batch.routes)
    assert flipped > 0 and own.stats.flipped > 0 and tr.stats.token_layers > 0
    off = mismatch_metrics({k: float(v) for k, v in mismatch_sums(plain, beh, cm).items()})
    on = mismatch_metrics({k: float(v) for k, v in mismatch_sums(replayed, beh, cm).items()})
    assert on["mismatch_abs_max"] < off["mismatch_abs_max"] / 2
    assert on["mismatch_kl"] < off["mismatch_kl"] / 2
    assert on["mismatch_abs"] < off["mismatch_abs"]
