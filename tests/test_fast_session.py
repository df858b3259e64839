"""The fast engine's native multi-turn session (KV cache kept across turns) against a turn-by-turn
``model.generate`` reference, for every family the fast engine runs: greedy tokens equal, log-probs
those of a forward over the final trajectory, sampling deterministic under a seed.

The script drives the session as the multi-turn driver does, with harder cases: prompts of
different lengths, feeds of different lengths (0 included), budgets per row, rows that leave at
different turns, a row continued after it ended at its budget (its cache was freed: re-prefilled).
"""

from __future__ import annotations

import random

import pytest
import torch

from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.fast import FastEngine
from nanogrpo.engines.fast.cached_session import FastSession
from nanogrpo.engines.session import ReprefillSession, open_session
from nanogrpo.engines.stops import StopStrings
from nanogrpo.errors import ModelError
from tests.conformance import CASES, EOS, PAD, PROMPTS, TOK, build, forward_logprobs

FAST = [c for c in CASES if c.engine == "fast"]
STOP = ("y", "'", "h", "G", "u", "m", "ee", "rz", "*", ")c")
"""About one sampled token in ten on the random models completes one of these."""


def script(session, n_rows: int, seed: int, turns: int = 4, first_feeds: bool = False):
    """Step ``session`` like the driver: every row first; then each row that closed a call (and, once,
    a row that hit its budget) continues after a feed of 0-7 tokens, with a budget of 1-9 tokens, the
    rows in shuffled order. Returns per row the list of (feed, budget, tokens, log-probs, reason) of its
    turns. ``first_feeds``: the first step feeds tokens too (after the prompt: no shared prefill)."""
    rng = random.Random(seed)
    log: list[list[tuple]] = [[] for _ in range(n_rows)]
    rows, feeds, budgets = list(range(n_rows)), [[] for _ in range(n_rows)], [9] * n_rows
    if first_feeds:
        feeds = [[rng.randrange(13, 60) for _ in range(r % 3)] for r in rows]
    continued_length = False
    for _ in range(turns):
        gen = session.step(rows, feeds, budgets)
        nxt = []
        for r, f, b, c, lp, why in zip(rows, feeds, budgets, gen.completion_ids, gen.logprobs,
                                       gen.finish_reasons, strict=True):
            log[r].append((list(f), b, c, lp, why))
            if why == "stop_string" or (why == "length" and not continued_length and rng.random() < 0.5):
                continued_length |= why == "length"
                nxt.append(r)
        if not nxt:
            break
        rng.shuffle(nxt)
        rows = nxt
        feeds = [[rng.randrange(13, 60) for _ in range(rng.choice([0, 1, 2, 4, 7]))] for _ in rows]
        budgets = [rng.randrange(1, 10) for _ in rows]
    session.close()
    return log


def reference(model, prompt: list[int], turns: list[tuple], stops: StopStrings) -> list[tuple]:
    """Turn by turn with ``model.generate`` (greedy) over the whole context: cut at EOS, at the first
    prefix whose text holds a stop string, at the budget."""
    ctx, out = list(prompt), []
    for feed, budget, *_ in turns:
        ctx += feed
        with torch.no_grad():
            ids = torch.tensor([ctx])
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                                 do_sample=False, eos_token_id=EOS, pad_token_id=PAD)[0, len(ctx):].tolist()
        why = "length"
        if EOS in new:
            new, why = new[:new.index(EOS) + 1], "stop"
        k = stops.find(new)
        if k is not None:
            new, why = new[:k], "stop_string"
        out.append((new, why))
        ctx += new
    return out


def check_logprobs(model, prompt: list[int], turns: list[tuple], tol: float = 1e-4) -> None:
    """The sampled tokens' log-probs equal a forward over the final trajectory (fed tokens excluded)."""
    comp, sampled, lps = [], [], []
    for feed, _, c, lp, _ in turns:
        comp += feed
        sampled += range(len(comp), len(comp) + len(c))
        comp += c
        lps += lp
    ref = forward_logprobs(model, prompt, comp)[sampled]
    assert (ref - torch.tensor(lps)).abs().max().item() < tol


def run_case(model, engine, n: int = 2, seed: int = 1, first_feeds: bool = False):
    prompts = PROMPTS
    params = SamplingParams(max_new_tokens=9, temperature=0.0, n=n, stop=STOP)
    session = open_session(engine, TOK, prompts, params, max_len=60)
    assert isinstance(session, FastSession)
    log = script(session, len(prompts) * n, seed, first_feeds=first_feeds)
    stops = StopStrings(TOK, STOP)
    for r, turns in enumerate(log):
        want = reference(model, prompts[r // n], turns, stops)
        assert [(c, why) for _, _, c, _, why in turns] == want, f"row {r}"
        check_logprobs(model, prompts[r // n], turns)
    return log


QUICK = ("Qwen2 (", "Qwen3 (", "Mistral, window 6", "SmolLM3", "Phi3 (", "Llama, dynamic")
"""The fast suite's share of the families (GQA, q/k norms, windows, no-RoPE layers, partial rotary,
length-bound RoPE); the rest run with the slow tests."""


@pytest.mark.parametrize("case", [c if c.name.startswith(QUICK) else pytest.param(c, marks=pytest.mark.slow)
                                  for c in FAST], ids=[c.name for c in FAST])
@pytest.mark.slow
def test_greedy_multiturn_equals_turn_by_turn_generate(case):
    model = build(case)
    engine = FastEngine(model, tokenizer=TOK, max_len=case.max_len)
    log = run_case(model, engine)
    reasons = {why for turns in log for *_, why in turns}
    assert "stop_string" in reasons and len({len(t) for t in log}) > 1, "the script exercised too little"


@pytest.mark.parametrize("case", [c for c in FAST if c.name.startswith("Mistral, window 6")],
                         ids=lambda c: c.name)
@pytest.mark.slow
def test_graph_layout_on_cpu(case):
    """The CUDA path's bookkeeping run eagerly: rows in power-of-two buckets with filler rows, 64-slot
    cache lengths, smaller buckets created before the caches are laid out, compaction between them."""
    model = build(case)
    engine = FastEngine(model, tokenizer=TOK, check_every=2)
    engine.use_graphs = True
    run_case(model, engine, n=3, seed=4)
    assert {k[0] for k in engine._states} >= {8, 16}


def test_first_step_with_feeds_prefills_each_row():
    """A first step that feeds tokens after the prompts (allowed, not what the driver does) prefills
    each row's whole context instead of sharing the prompts' prefill: same reference."""
    model = build(FAST[0])
    run_case(model, FastEngine(model, tokenizer=TOK), first_feeds=True)


def test_sampling_is_seeded_and_logprobs_match_a_forward():
    case = FAST[0]
    model = build(case)
    engine = FastEngine(model, tokenizer=TOK)
    params = SamplingParams(max_new_tokens=9, temperature=1.0, top_k=50, n=3, seed=7, stop=STOP)
    logs = [script(engine.open_session(PROMPTS, params, 60), 12, seed=2) for _ in range(2)]
    assert logs[0] == logs[1]
    for r, turns in enumerate(logs[0]):
        check_logprobs(model, PROMPTS[r // 3], turns)
    other = script(engine.open_session(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 8}), 60), 12, 2)
    assert other != logs[0]


def test_compaction_and_stats():
    """Rows that end early are compacted away within a turn; the first turn is the shared prefill."""
    model = build(FAST[0])
    engine = FastEngine(model, tokenizer=TOK)
    prompts = [PROMPTS[0]] * 2 + PROMPTS[1:]
    session = engine.open_session(prompts, SamplingParams(max_new_tokens=40, temperature=0.0, n=4, stop=STOP),
                                  100)
    gen = session.step(list(range(20)), [[]] * 20, [40] * 20)
    assert gen.stats["prefill_tokens"] == sum(map(len, prompts))
    assert gen.stats["compactions"] >= 1 and gen.stats["decode_steps"] == max(map(len, gen.completion_ids))
    rows = [r for r, why in enumerate(gen.finish_reasons) if why == "stop_string"]
    assert rows
    gen2 = session.step(rows, [[20, 21]] * len(rows), [5] * len(rows))
    assert gen2.stats["prefill_tokens"] == 3 * len(rows)  # the last sampled token and the feed: no re-prefill
    session.close()


def test_session_with_an_engine_without_hook_reprefills_and_agrees():
    """The generic path (ReprefillSession over FastEngine.generate) gives the same trajectories."""
    model = build(FAST[0])
    engine = FastEngine(model, tokenizer=TOK)
    params = SamplingParams(max_new_tokens=9, temperature=0.0, n=2, stop=STOP)
    native = script(engine.open_session(PROMPTS, params, 60), 8, seed=3)
    generic = script(ReprefillSession(engine, TOK, PROMPTS, params), 8, seed=3)
    strip = [[(f, b, c, why) for f, b, c, _, why in t] for t in native]
    assert strip == [[(f, b, c, why) for f, b, c, _, why in t] for t in generic]


def test_clear_errors():
    dynamic = next(c for c in CASES if c.name.startswith("Llama, dynamic RoPE (max"))
    engine = FastEngine(build(dynamic), tokenizer=TOK, max_len=52)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    with pytest.raises(ModelError, match="dynamic RoPE.*reach 100"):
        engine.open_session(PROMPTS, params, max_len=100)
    session = engine.open_session(PROMPTS, params, max_len=64)
    with pytest.raises(ValueError, match="one feed and one budget per row"):
        session.step([0, 1], [[]], [4, 4])
    first = session.step([0, 1, 2, 3], [[]] * 4, [4] * 4)
    with pytest.raises(ModelError, match="dynamic RoPE"):  # a turn past the limit, rather than wrong RoPE
        session.step([0], [[20] * 40], [30])
    assert session.contexts[0] == PROMPTS[0] + first.completion_ids[0]  # refused: nothing changed
    session.step([0], [[20] * 4], [3])
    with pytest.raises(ValueError, match="still live"):
        session.step([0, 0], [[], []], [1, 1])
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        FastEngine(build(FAST[0]), eos_token_id=EOS).open_session(PROMPTS, SamplingParams(8, stop=("x",)), 60)
