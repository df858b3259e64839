"""The pieces verifiers 0.4 (v1) environments train through, without an environment: the endpoint's token
route (vLLM's ``/inference/v1/generate``) read by verifiers' own client (``renderers``) and by nanogrpo's
server-tier client, its sessions; and the check of a program's claimed token sequences against what the
endpoint recorded (a mismatch is said, never trained)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from nanogrpo.episodes.endpoint.records import Record
from nanogrpo.episodes.trajectory import check_claimed
from tests.adapter_fixtures import need_verifiers
from tests.test_endpoint import drive, start, tiny  # noqa: F401 - the fixture


def rec(prompt, completion, lps, why="stop"):
    return Record(0, "tokens", list(prompt), list(completion), list(lps), why, 0)


def test_claimed_sequences_are_checked_span_by_span():
    r1 = rec([1, 2, 3], [7, 8, 2], [-0.5, -0.25, -0.125])
    r2 = rec([1, 2, 3, 7, 8, 2, 9, 9], [5, 2], [-1.0, -2.0], "length")
    ids = [1, 2, 3, 7, 8, 2, 9, 9, 5, 2]
    mask = [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2
    lps = [0.0] * 3 + [-0.5, -0.25, -0.125, 0.0, 0.0, -1.0, -2.0]
    seq = check_claimed(ids, mask, lps, [r2, r1])
    assert seq.prompt_ids == [1, 2, 3] and seq.completion_ids == ids[3:] and seq.loss_mask == mask[3:]
    assert seq.logprobs == lps[3:] and seq.turns == 2 and seq.finish_reason == "length"
    # two turns with nothing fed between them are one run of sampled tokens: still two requests
    r3 = rec([1, 2, 3, 7, 8, 2], [6], [-3.0])
    joined = check_claimed([1, 2, 3, 7, 8, 2, 6], [False] * 3 + [True] * 4,
                           [0.0] * 3 + [-0.5, -0.25, -0.125, -3.0], [r1, r3])
    assert joined.turns == 2 and joined.completion_ids == [7, 8, 2, 6]
    # what is not what was sampled: a token, the context before it, a log-prob, the lengths
    bad_token = ids[:4] + [9] + ids[5:]
    assert "no request" in check_claimed(bad_token, mask, lps, [r1, r2])
    assert "no request" in check_claimed([0] + ids[1:], mask, lps, [r1, r2])
    assert "not the engine's" in check_claimed(ids, mask, lps[:3] + [-0.4] + lps[4:], [r1, r2])
    assert "differ in length" in check_claimed(ids, mask[:-1], lps, [r1, r2])
    assert "no sampled token" in check_claimed(ids, [False] * len(ids), lps, [r1, r2])
    assert "no request" in check_claimed(ids, mask, lps, [])


@pytest.mark.slow
def test_token_route_is_what_verifiers_and_the_server_tier_read(tiny):  # noqa: F811
    need_verifiers("v1")
    from openai import AsyncOpenAI
    from renderers.client import generate
    from renderers.default import DefaultRenderer

    from nanogrpo.engines.vllm_server.engine import ServerEngine, StaleSample

    model, tok = tiny
    ep, spy = start(tiny, budget=12)
    try:
        ep.version = 5
        ep.open_sessions()
        key = ep.session_key
        msgs = [{"role": "user", "content": "1+1="}]

        async def verifiers_turn(sid):
            client = AsyncOpenAI(base_url=ep.url, api_key=key, default_headers={"X-Session-ID": sid})
            try:
                return await generate(client=client, renderer=DefaultRenderer(tok), messages=msgs, model="m",
                                      sampling_params={"max_tokens": 6, "temperature": 0.3})
            finally:
                await client.close()

        out = drive(ep, lambda: asyncio.run(verifiers_turn("trace-a")))
        log = ep.close_session("trace-a")
        (r,) = log.records
        # renderers rendered the chat template itself and sent the ids; the engine sampled from exactly those
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert r.prompt_ids == out["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        assert out["completion_ids"] == r.completion_ids and out["completion_logprobs"] == r.logprobs
        params, prompts, gen = spy.calls[-1]
        assert prompts == [r.prompt_ids] and gen.completion_ids[0][:len(r.completion_ids)] == r.completion_ids
        assert len(r.completion_ids) <= 6 and params.temperature == 1.0  # the run's, not the request's

        url = ep.url.removesuffix("/v1") + "/inference/v1/generate"
        stops = list(range(3, 67))  # 64 of the ~100 characters: a 6-token sample all but surely meets one
        body = {"token_ids": r.prompt_ids, "sampling_params": {"max_tokens": 6, "stop_token_ids": stops},
                "return_token_ids": True}

        def post(b, sid="trace-b", auth=key):
            headers = {"Authorization": f"Bearer {auth}"} | ({"X-Session-ID": sid} if sid else {})
            return httpx.post(url, json=b, headers=headers, timeout=60)

        res = drive(ep, lambda: post(body))
        assert res.status_code == 200, res.text
        out = res.json()
        # nanogrpo's server-tier client reads the same answer: ids, log-probs, the weight version
        engine = ServerEngine(pool=None, eos_ids=[tok.eos_token_id])
        engine.min_version = engine.max_version = 5
        ids, lps, why, ver = engine._parse(type("Client", (), {"url": url}), out)
        (r2,) = ep.close_session("trace-b").records
        assert ids == r2.completion_ids and lps == r2.logprobs and ver == (5, 5)
        assert out["prompt_token_ids"] == r.prompt_ids
        # stop_token_ids: cut after the first one (sampling is causal: as if the engine had stopped there)
        assert ids[-1] in stops and not set(ids[:-1]) & set(stops) and why == "stop"
        assert out["choices"][0]["stop_reason"] == ids[-1]
        engine.min_version = engine.max_version = 6
        with pytest.raises(StaleSample):  # a sample of other weights than the trainer's is refused
            engine._parse(type("Client", (), {"url": url}), out)

        refused = drive(ep, lambda: [post(body, sid=None).status_code, post(body, auth="nope").status_code,
                                     post({**body, "stream": True}, "trace-c").status_code,
                                     post({**body, "token_ids": [10**6]}, "trace-c").status_code,
                                     post(body, "trace-a").status_code])
        # no session header; a key no one has; streaming; an id past the vocabulary; a closed session
        assert refused == [400, 401, 400, 400, 401]
        assert [g.key for g in ep.close_sessions()] == ["trace-c"]
        assert drive(ep, lambda: post(body, "trace-d").status_code) == 401  # no rollout open: no new session
    finally:
        ep.stop()


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_harness_run_as_a_process_per_turn_bounds_the_episodes_to_the_cpu_cores():
    """verifiers' ``null`` harness in the ``subprocess`` runtime (what nanogrpo pins by default) starts a
    Python process per turn, seconds of CPU each: two episodes per usable core at once (issue 50, item 12);
    the in-process ``nanogrpo-chat`` harness, or a server elsewhere, is no bound."""
    need_verifiers("v1")
    import os

    from nanogrpo.envs.adapters.verifiers_v1 import load

    cores = len(os.sched_getaffinity(0))
    source = "tests.verifiers_v1_fixtures:GuessTaskset"
    assert load(source, {})().episodes_at_once() == 2 * cores
    assert load(source, {"agent": {"harness": {"id": "nanogrpo-chat"}}})().episodes_at_once() is None
    assert load(source, {"agent": {"runtime": {"type": "prime"}}})().episodes_at_once() is None
    assert load(source, {}, "tcp://127.0.0.1:5999")().episodes_at_once() is None
