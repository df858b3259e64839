"""The OpenAI-compatible endpoint in front of the rollout engine, driven by the real ``openai`` package:
what it records is what the engine sampled (ids and log-probs, never re-tokenised), a history sent back
unchanged is one training sequence and a rewritten one two, keys and the loopback bind are enforced,
bodies are capped while they arrive, and the limits refuse requests with a clear error."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import torch

from nanogrpo.algo.logprobs import position_ids_from_mask
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.factory import make_engine
from nanogrpo.episodes.endpoint import HOST, Endpoint, EndpointSettings
from nanogrpo.episodes.endpoint.app import strip_stop, tool_calls
from nanogrpo.episodes.trajectory import assemble
from nanogrpo.models.tiny import make_model, make_tokenizer
from tests.adapter_fixtures import need

openai = need("openai")


class Spy:
    """The real engine, with every generate call's prompts and outputs kept."""

    def __init__(self, engine):
        self.engine, self.name, self.calls = engine, engine.name, []

    def generate(self, prompts, params):
        gen = self.engine.generate(prompts, params)
        self.calls.append((params, [list(p) for p in prompts], gen))
        return gen

    def update_weights(self, sd):
        self.engine.update_weights(sd)


@pytest.fixture(scope="module")
def tiny():
    tok = make_tokenizer()
    return make_model("tiny", tok).eval(), tok


def start(tiny, *, budget=48, max_len=512, max_turns=8, body=1 << 16, seed=3, temperature=1.0):
    model, tok = tiny
    spy = Spy(make_engine("fast", model, tok))
    settings = EndpointSettings(max_len=max_len, max_new_tokens=budget, vocab_size=len(tok),
                                max_turns=max_turns, max_body_bytes=body)
    params = SamplingParams(max_new_tokens=budget, temperature=temperature, seed=seed)
    ep = Endpoint(spy, tok, params, settings)
    return ep.start(), spy


def drive(ep, fn):
    """Run ``fn()`` in a thread while this thread serves the engine; its result or exception."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e
    t = threading.Thread(target=body)
    t.start()
    ep.serve(until=lambda: not t.is_alive())
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def teacher_forced(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    am = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am)).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return [float(lp[len(prompt) + t - 1, x]) for t, x in enumerate(completion)]


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_recorded_ids_are_what_the_engine_sampled_and_history_is_one_sequence(tiny):
    model, tok = tiny
    ep, spy = start(tiny)
    try:
        key = ep.open_episode()

        def agent():
            c = openai.OpenAI(base_url=ep.url, api_key=key, max_retries=0)
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
            r1 = c.chat.completions.create(model="any", messages=msgs, max_tokens=12, logprobs=True)
            msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "and 4+4?"}]
            r2 = c.chat.completions.create(model="any", messages=msgs, max_tokens=10)
            return r1, r2
        r1, r2 = drive(ep, agent)
        log = ep.close_episode(key)
    finally:
        ep.stop()
    a, b = log.records
    # the engine's own outputs, as it returned them (each call served one request here)
    sampled = [list(gen.completion_ids[0]) for _, _, gen in spy.calls]
    assert [p[0] for _, p, _ in spy.calls] == [a.prompt_ids, b.prompt_ids]
    assert [a.completion_ids, b.completion_ids] == [s[:len(r.completion_ids)]
                                                    for s, r in zip(sampled, (a, b))]
    assert len(a.completion_ids) <= 12 and len(b.completion_ids) <= 10
    # the first prompt is the chat template's rendering, tokenised once
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    text = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    assert a.prompt_ids == tok(text, add_special_tokens=False)["input_ids"] and a.reused == 0
    # the second request reuses the first's ids as sampled (never re-tokenised), then the new text
    assert b.prompt_ids[:len(a.ids)] == a.ids and b.reused == len(a.ids)
    # the reply is the decoded sampled ids; its log-probs are the engine's, which are the model's
    assert r1.choices[0].message.content == tok.decode(a.completion_ids, skip_special_tokens=True)
    assert [x.logprob for x in r1.choices[0].logprobs.content] == pytest.approx(a.logprobs, abs=1e-6)
    assert a.logprobs == pytest.approx(teacher_forced(model, a.prompt_ids, a.completion_ids), abs=2e-4)
    assert r2.usage.prompt_tokens == len(b.prompt_ids) and r2.usage.completion_tokens == len(b.completion_ids)
    # one training sequence: sampled turns trained, the template and the user's reply between them not
    (seq,) = assemble(log.records)
    fed = len(b.prompt_ids) - len(a.ids)
    assert seq.prompt_ids == a.prompt_ids and seq.turns == 2
    assert seq.completion_ids == a.completion_ids + b.prompt_ids[len(a.ids):] + b.completion_ids
    assert seq.loss_mask == [True] * len(a.completion_ids) + [False] * fed + [True] * len(b.completion_ids)
    assert seq.logprobs == a.logprobs + [0.0] * fed + b.logprobs


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_rewritten_history_is_a_separate_sequence(tiny):
    ep, _ = start(tiny)
    try:
        key = ep.open_episode()

        def agent():
            c = openai.OpenAI(base_url=ep.url, api_key=key, max_retries=0)
            r1 = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=6)
            edited = [{"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "(summary) " + r1.choices[0].message.content},
                      {"role": "user", "content": "go on"}]
            c.chat.completions.create(model="m", messages=edited, max_tokens=6)
            # the third request continues the second (unchanged history): same sequence as it
            r3_msgs = edited + [{"role": "assistant", "content": "x"}]
            return c.chat.completions.create(model="m", messages=r3_msgs, max_tokens=6)
        drive(ep, agent)
        log = ep.close_episode(key)
    finally:
        ep.stop()
    first, second, third = log.records
    assert second.reused == 0 and third.reused == 0  # "x" is not what the model wrote
    seqs = assemble(log.records)
    assert len(seqs) == 3  # each request rewrote what the model had written
    assert [s.turns for s in seqs] == [1, 1, 1]
    assert all(s.loss_mask == [True] * len(s.completion_ids) for s in seqs)


def test_completions_token_prompts_streaming_and_stop(tiny):
    model, tok = tiny
    ep, spy = start(tiny, temperature=0.0)
    try:
        key = ep.open_episode()

        def agent():
            c = openai.OpenAI(base_url=ep.url, api_key=key, max_retries=0)
            ids = tok("Q: 1+1=", add_special_tokens=False)["input_ids"]
            r = c.completions.create(model="m", prompt=ids, max_tokens=8, logprobs=1,
                                     extra_body={"return_token_ids": True})
            chunks = list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=5, stream=True))
            return ids, r, chunks
        ids, r, chunks = drive(ep, agent)
        log = ep.close_episode(key)
    finally:
        ep.stop()
    a, b = log.records
    assert a.kind == "completions" and a.prompt_ids == ids
    greedy = make_engine("fast", model, tok).generate([ids], SamplingParams(max_new_tokens=8,
                                                                             temperature=0.0))
    assert a.completion_ids == list(greedy.completion_ids[0])
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == a.completion_ids
    assert choice.model_extra["prompt_token_ids"] == ids
    assert choice.logprobs.token_logprobs == pytest.approx(a.logprobs, abs=1e-6)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        tok.decode(b.completion_ids, skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert strip_stop("abc</code>def", ("</code>",)) == "abc"


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_concurrent_episodes_are_batched_and_kept_apart(tiny):
    ep, spy = start(tiny, budget=16)
    # "together": the four clients are built first (building one takes tens of ms of CPU, under one GIL)
    # and leave at one barrier; then a busy shared machine does not spread the requests past the linger
    ep.batcher.linger_s = 0.5
    try:
        keys = [ep.open_episode() for _ in range(4)]
        clients = [openai.OpenAI(base_url=ep.url, api_key=k, max_retries=0) for k in keys]
        go = threading.Barrier(4)

        def one(c, q):
            go.wait(timeout=30)
            return c.completions.create(model="m", prompt=q, max_tokens=4 + len(q)).choices[0].text

        def agents():
            res = [None] * 4
            ts = [threading.Thread(target=lambda i=i: res.__setitem__(i, one(clients[i], "q" * (i + 1))))
                  for i in range(4)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            return res
        texts = drive(ep, agents)
        logs = [ep.close_episode(k) for k in keys]
    finally:
        ep.stop()
    assert len(spy.calls) < 4  # requests that arrived together shared an engine call
    tok = tiny[1]
    for i, log in enumerate(logs):
        (rec,) = log.records
        assert rec.prompt_ids == tok("q" * (i + 1), add_special_tokens=False)["input_ids"]
        assert len(rec.completion_ids) <= 4 + i + 1
        assert texts[i] == tok.decode(rec.completion_ids, skip_special_tokens=True)


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_keys_are_required_and_die_with_their_episode(tiny):
    ep, _ = start(tiny)
    try:
        key = ep.open_episode()
        msgs = [{"role": "user", "content": "hi"}]

        def calls():
            errs = []
            for k in ("", "ng-not-a-key", key):
                c = openai.OpenAI(base_url=ep.url, api_key=k or "x", max_retries=0,
                                  default_headers={"Authorization": ""} if not k else None)
                try:
                    c.chat.completions.create(model="m", messages=msgs, max_tokens=2)
                    errs.append(None)
                except openai.AuthenticationError as e:
                    errs.append(e.status_code)
            return errs
        assert drive(ep, calls) == [401, 401, None]
        ep.close_episode(key)
        r = httpx.post(ep.url + "/chat/completions", json={"messages": msgs},
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 401 and "key" in r.json()["error"]["message"]
        assert httpx.get(ep.url + "/models").status_code == 401
        live = ep.open_episode()
        models = httpx.get(ep.url + "/models", headers={"Authorization": f"Bearer {live}"}).json()
        assert models["data"][0]["id"] == "nanogrpo"
        assert ep.unauthorized == 4
    finally:
        ep.stop()


def _non_loopback_address() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.254.254.254", 1))  # no packet is sent: the kernel picks the outgoing address
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_bound_to_loopback_only(tiny):
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    ep, _ = start(tiny)
    try:
        assert HOST == "127.0.0.1" and ep.url.startswith("http://127.0.0.1:")
        key = ep.open_episode()
        assert httpx.get(ep.url + "/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        with pytest.raises(OSError):
            socket.create_connection((addr, ep.port), timeout=2).close()
    finally:
        ep.stop()


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_bodies_are_capped_while_they_arrive(tiny):
    ep, _ = start(tiny, body=4096)
    try:
        key = ep.open_episode()
        auth = {"Authorization": f"Bearer {key}"}
        big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
        r = httpx.post(ep.url + "/chat/completions", json=big, headers=auth)
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

        def chunks():  # no content-length: refused once the streamed bytes pass the cap
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(100):
                yield b"y" * 1000
        r = httpx.post(ep.url + "/chat/completions", content=chunks(), headers=auth)
        assert r.status_code == 413
        for bad, why in [(b"[1, 2]", "JSON object"), (b"{nope", "not valid JSON"),
                         (b'{"messages": []}', "non-empty list"),
                         (b'{"messages": [{"role": "user", "content": "a"}], "n": 2}', "'n' must be 1"),
                         (b'{"prompt": [1, 99999]}', "token ids")]:
            path = "/completions" if b"prompt" in bad else "/chat/completions"
            r = httpx.post(ep.url + path, content=bad, headers=auth)
            assert r.status_code == 400 and why in r.json()["error"]["message"], (bad, r.text)
        assert ep.close_episode(key).records == []  # nothing refused was recorded
    finally:
        ep.stop()


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_turn_token_and_context_limits_refuse_with_a_reason(tiny):
    ep, _ = start(tiny, budget=10, max_turns=2, max_len=64)
    try:
        k1, k2, k3 = ep.open_episode(), ep.open_episode(), ep.open_episode()

        def calls():
            out = []
            for key, prompt, n in [(k1, "a", 3), (k1, "b", 3), (k1, "c", 3),       # 3rd: past max_turns
                                   (k2, "d", 10), (k2, "e", 3),                    # budget spent
                                   (k3, "z" * 80, 3)]:                             # past the context
                c = openai.OpenAI(base_url=ep.url, api_key=key, max_retries=0)
                try:
                    c.completions.create(model="m", prompt=prompt, max_tokens=n)
                    out.append("ok")
                except openai.BadRequestError as e:
                    out.append(e.code)
            return out
        assert drive(ep, calls) == ["ok", "ok", "max_turns", "ok", "max_tokens", "context_length_exceeded"]
        logs = [ep.close_episode(k) for k in (k1, k2, k3)]
    finally:
        ep.stop()
    assert [lg.limit for lg in logs] == ["max_turns", "length", "too_long"]
    assert [len(lg.records) for lg in logs] == [2, 1, 0]
    assert sum(len(r.completion_ids) for r in logs[1].records) <= 10


def test_a_flood_of_message_text_is_refused_before_it_is_tokenised(tiny):
    """An agent program's 900 KB message (under the body cap) cannot fit the context: refused with the
    context's reason at once, never tokenised (it took seconds per request, issue 44)."""
    import time

    ep, _ = start(tiny, max_len=64, body=1 << 20)
    try:
        key = ep.open_episode()
        auth = {"Authorization": f"Bearer {key}"}
        for path, body in [("/chat/completions", {"messages": [{"role": "user", "content": "q" * 900_000}]}),
                           ("/completions", {"prompt": "q" * 900_000})]:
            t0 = time.monotonic()
            r = httpx.post(ep.url + path, json=body, headers=auth, timeout=60)
            took = time.monotonic() - t0
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
            assert "bytes" in err["message"] and took < 1.5, (err["message"], took)
        log = ep.close_episode(key)
        assert log.limit == "too_long" and log.refused == 2 and log.records == []
    finally:
        ep.stop()


def test_tool_calls_in_a_reply():
    text = 'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    head, calls = tool_calls(text, 0)
    assert head == "Let me compute."
    assert calls == [{"id": "call_0_0", "type": "function",
                      "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    assert tool_calls("no call here", 0) is None
    assert tool_calls("<tool_call>{not json}</tool_call>", 0) is None


def test_the_guide_examples_run():
    """docs/guides/agents.md: every Python block not marked "Not run here" runs as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "agents.md").read_text()
    blocks = re.findall(r"(\*Not run here[^\n]*(?:\n[^\n]+)*\*\n\n)?```python\n(.*?)```", text, flags=re.S)
    runnable = [code for skip, code in blocks if not skip]
    assert len(runnable) == 2
    ns: dict = {}
    for code in runnable:
        exec(compile(code, "agents.md", "exec"), ns)  # noqa: S102
    assert callable(ns["solve"]) and ns["rec"].finish_reason in ("stop", "length")
    assert 1 <= len(ns["rec"].completion_ids) <= 8
