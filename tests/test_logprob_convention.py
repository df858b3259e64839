"""The log-prob convention switch (``rollout.tempered_logprobs``): engines, the trainer's
log-prob paths and the single-process trainer all compute log-probs at the same temperature."""

from __future__ import annotations

import pytest
import torch

from nanogrpo.algo.logprobs import _full_logprobs, linear_logprobs, position_ids_from_mask, token_logprobs
from nanogrpo.config import RolloutConfig
from nanogrpo.engines import SamplingParams, make_engine
from nanogrpo.rollout.collect import pad_batch
from tests.test_engines import PAD, PROMPTS, TOK, qwen

T = 0.7


def test_linear_logprobs_at_a_temperature_match_naive_forward_and_backward():
    torch.manual_seed(0)
    h = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 40, (9,))
    g = torch.randn(9, dtype=torch.float64)
    out = linear_logprobs(h, w, b, t, chunk=4, temperature=T)
    ref = (torch.nn.functional.linear(h, w, b) / T).log_softmax(-1).gather(-1, t[:, None])[:, 0]
    assert out.dtype == torch.float64 and torch.allclose(out, ref, atol=1e-12)
    grads = torch.autograd.grad((out * g).sum(), [h, w, b])
    for a, r in zip(grads, torch.autograd.grad((ref * g).sum(), [h, w, b])):
        assert torch.allclose(a, r, atol=1e-5)


def _batch(model, engine: str, cfg: RolloutConfig):
    params = SamplingParams(max_new_tokens=12, temperature=cfg.temperature, n=2, seed=0,
                            logprob_temperature=cfg.logprob_temperature())
    gen = make_engine(engine, model, TOK).generate(PROMPTS, params)
    prompts = [p for p in PROMPTS for _ in range(2)]
    ids, am, cm, old, p = pad_batch(prompts, gen.completion_ids, gen.logprobs, PAD)
    return ids, am.long(), cm, old, p


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_on_policy_ratio_is_one_under_either_convention(engine):
    """exp(logp - old) = 1 (old: the engine's log-probs) with tempered_logprobs off and on, on the
    lean, prompt-shared and full paths; the two conventions differ by log_softmax(l/T) - log_softmax(l)."""
    model = qwen("tiny")
    got = {}
    for tempered in (False, True):
        cfg = RolloutConfig(temperature=T, tempered_logprobs=tempered)
        temp = cfg.logprob_temperature()
        assert temp == (T if tempered else 1.0)
        ids, am, cm, old, p = _batch(model, engine, cfg)
        model.train()
        with torch.no_grad():
            paths = {"lean": token_logprobs(model, ids, am, p, cm, share_prefix=False, temperature=temp),
                     "shared": token_logprobs(model, ids, am, p, cm, share_prefix=True, temperature=temp),
                     "full": _full_logprobs(model, ids, am, position_ids_from_mask(am), p, temp)[0] * cm}
        for name, logp in paths.items():
            ratio = torch.exp(logp - old)[cm]
            assert (ratio - 1).abs().max().item() < 1e-5, (tempered, name)
        got[tempered] = (ids, am, cm, p, paths["lean"])
    # same sequences under the other convention: the difference is the tempering, token by token
    ids, am, cm, p, tempered_lp = got[True]
    with torch.no_grad():
        plain = token_logprobs(model, ids, am, p, cm, temperature=1.0)
        pos = position_ids_from_mask(am)
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()
    tgt = ids[:, p:, None]
    want = ((logits[:, p - 1:-1] / T).log_softmax(-1).gather(-1, tgt) - logits[:, p - 1:-1].log_softmax(-1)
            .gather(-1, tgt))[..., 0] * cm
    assert torch.allclose(tempered_lp - plain, want, atol=2e-5)
    assert (tempered_lp - plain)[cm].abs().max() > 0.05  # the conventions really differ here


def test_trainer_uses_one_convention_for_engine_policy_and_reference(tmp_path, monkeypatch):
    """``nanogrpo train rollout.tempered_logprobs=true``: the behaviour log-probs (engine) and the
    reference log-probs equal the policy's at temperature T before the first update."""
    import nanogrpo.training.schedule as trainer  # where the trainer calls policy_update
    from nanogrpo.cli import main
    from tests.run_fixtures import write_tiny_run_assets

    d = write_tiny_run_assets(tmp_path)
    seen = []
    real = trainer.policy_update

    def spy(be, batch, cfg, **kw):
        if batch is not None and not seen:
            t = cfg.rollout.logprob_temperature()
            with torch.no_grad():
                logp = token_logprobs(be.model, batch.input_ids, batch.attention_mask.long(),
                                      batch.prompt_len, batch.completion_mask, temperature=t)
            cm = batch.completion_mask
            seen.append((t, (logp - batch.old_logprobs)[cm].abs().max().item(),
                         (logp - batch.ref_logprobs)[cm].abs().max().item()))
        return real(be, batch, cfg, **kw)

    monkeypatch.setattr(trainer, "policy_update", spy)
    assert main(["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--out",
                 str(tmp_path / "run"), "--steps", "1", "rollout.prompts_per_step=2", "grpo.group_size=4",
                 "rollout.max_new_tokens=10", f"rollout.temperature={T}", "rollout.tempered_logprobs=true",
                 "grpo.beta=0.04", 'rewards.functions=["tests.reward_fixtures:length"]', "rewards.workers=0",
                 "train.save_every=0", "eval.every=0"]) == 0
    temp, old_diff, ref_diff = seen[0]
    assert temp == T and old_diff < 1e-5 and ref_diff < 1e-5


# ------------------------------------------------------------------ split mode: the wire carries it


@pytest.mark.parametrize("bad", [0, -1.0, 1e9, "0.7", True, None, [0.7]])
def test_an_upload_with_a_bad_logprob_temperature_is_a_400_and_queues_nothing(bad):
    from tests.test_serve_faults import AUTH, _state, run
    from tests.test_serve_helpers import make_batch

    b = make_batch()
    b.meta["logprob_temperature"] = bad
    st = _state()

    async def fn(c):
        r = await c.post("/upload", content=b.to_bytes(), headers=AUTH)
        assert r.status_code == 400 and "logprob_temperature" in r.text, (r.status_code, r.text)
    run(st, fn)
    assert st.stats()["batches_in"] == 0


def test_the_servers_reference_forward_takes_the_workers_temperature():
    """A worker's batch says the temperature its run takes log-probs at; the server's reference
    log-probs are those of ``logits / T`` (not untempered ones, which would bias the KL)."""
    from nanogrpo.algo.logprobs import batch_token_logprobs
    from nanogrpo.batch import RolloutBatch
    from nanogrpo.serve.server import make_ref_fn

    model = qwen()
    ids, am, cm, old, p = _batch(model, "hf", RolloutConfig(temperature=T, tempered_logprobs=True))
    n = ids.shape[0]
    batch = RolloutBatch(input_ids=ids, attention_mask=am.to(torch.int8), completion_mask=cm,
                         rewards=torch.zeros(n), advantages=torch.zeros(n), old_logprobs=old, prompt_len=p,
                         group_ids=torch.arange(n) // 2, group_size=2, meta={"logprob_temperature": T})
    ref = make_ref_fn(model, torch.device("cpu"), 4, 0)
    with torch.no_grad():
        want = batch_token_logprobs(model, ids, am, p, cm, 4, 0, temperature=T)
        untempered = batch_token_logprobs(model, ids, am, p, cm, 4, 0)
        got = ref(batch)
    assert torch.allclose(got, want, atol=1e-6) and not torch.allclose(got, untempered, atol=1e-3)
    assert torch.allclose(got[cm], old[cm], atol=1e-4)  # the engine's own tempered log-probs
    batch.meta.pop("logprob_temperature")                 # an older worker: the seed's convention
    with torch.no_grad():
        assert torch.allclose(ref(batch), untempered, atol=1e-6)
