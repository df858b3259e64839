"""The server in process: validation, auth, limits, queue, weights relay, a 10k-request fuzz."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
import torch
from safetensors.torch import save as st_save

from nanogrpo.batch import BatchError, RolloutBatch
from nanogrpo.serve.auth import is_loopback, load_token
from nanogrpo.serve.client import decode_state_dict, encode_state_dict
from nanogrpo.serve.server import ServerState, Settings, create_app
from tests.test_serve_helpers import TOKEN, VOCAB, make_batch, malformed_body, rss_mb

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _state(**kw) -> ServerState:
    ref_fn = kw.pop("ref_fn", None)
    token = kw.pop("token", TOKEN)
    return ServerState(Settings(vocab_size=VOCAB, max_seqs=64, max_len=64, max_body=64 << 10,
                                max_weights_body=1 << 20, **kw), token, ref_fn)


def run(st: ServerState, fn):
    async def main():
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await fn(c)
    return asyncio.run(main())


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status_code, self.headers, self.content = status, headers, body
        self.text = body.decode("utf-8", "replace")


async def asgi_call(app, method: str, path: str, headers: dict[str, str], body: bytes | None) -> Answer:
    """One request straight into the ASGI app (no HTTP client): ~10x faster than httpx's transport."""
    path, _, query = path.partition("?")
    raw_headers = [(k.lower().encode(), v if isinstance(v, bytes) else v.encode())
                   for k, v in headers.items()]
    if body is not None and not any(k == b"content-length" for k, _ in raw_headers):
        raw_headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": raw_headers, "client": ("127.0.0.1", 1), "server": ("t", 80)}
    sent = False
    out: dict = {"body": b""}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body or b"", "more_body": False}
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in msg.get("headers", [])}
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    await app(scope, receive, send)
    return Answer(out["status"], out["headers"], out["body"])


# --------------------------------------------------------------------------- unit: batch validation


@pytest.mark.parametrize("seed", range(100))
def test_malformed_bodies_raise_batch_error(seed):
    body = malformed_body(random.Random(seed), make_batch())
    with pytest.raises(BatchError) as e:
        RolloutBatch.from_bytes(body, vocab_size=VOCAB, max_seqs=64, max_len=64)
    assert "\n" not in str(e.value)


def test_good_batch_round_trips():
    b = make_batch()
    back = RolloutBatch.from_bytes(b.to_bytes(), vocab_size=VOCAB)
    for k, v in b.tensors().items():
        assert torch.equal(v, getattr(back, k))
    assert back.meta == b.meta


def test_token_rules(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOGRPO_TOKEN", raising=False)
    assert load_token(None) is None
    monkeypatch.setenv("NANOGRPO_TOKEN", TOKEN)
    assert load_token(None) == TOKEN
    f = tmp_path / "tok"
    f.write_text("short\n")
    with pytest.raises(Exception, match="at least"):
        load_token(str(f))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")


def test_refuses_public_bind_without_token(monkeypatch):
    from nanogrpo.errors import ConfigError
    from nanogrpo.serve.server import build_parser, build_state

    monkeypatch.delenv("NANOGRPO_TOKEN", raising=False)
    a = build_parser().parse_args(["--host", "0.0.0.0", "--vocab-size", "50", "grpo.beta=0"])
    with pytest.raises(ConfigError, match="without a token"):
        build_state(a)


# --------------------------------------------------------------------------- the app


def test_upload_get_round_trip_exact_and_empty_is_204():
    st = _state()
    body = make_batch().to_bytes()

    async def fn(c):
        assert (await c.get("/get", headers=AUTH)).status_code == 204
        r = await c.post("/upload", content=body, headers=AUTH)
        assert r.status_code == 200, r.text
        r = await c.get("/get", headers=AUTH)
        assert r.status_code == 200 and r.content == body
        assert (await c.post("/get", headers=AUTH)).status_code == 204
        s = (await c.get("/stats", headers=AUTH)).json()
        assert s["batches_in"] == 1 and s["batches_out"] == 0 and s["queue_leased"] == 1   # until acked
        assert (await c.post("/ack", params={"lease": r.headers["x-lease"]}, headers=AUTH)).json()["acked"]
        s = (await c.get("/stats", headers=AUTH)).json()
        assert s["batches_out"] == 1 and s["queue_leased"] == 0 and s["workers"] == {"w0": 1}
    run(st, fn)


def test_auth_required_except_health():
    st = _state()

    async def fn(c):
        assert (await c.get("/health")).status_code == 200
        for path, method in [("/stats", "GET"), ("/get", "GET"), ("/upload", "POST"), ("/weights", "GET")]:
            r = await c.request(method, path)
            assert r.status_code == 401 and "token" in r.text
            r = await c.request(method, path, headers={"Authorization": "Bearer wrong-token-xxxxxxxxxx"})
            assert r.status_code == 401
    run(st, fn)


def test_queue_full_answers_503_with_retry_after_and_duplicates_are_ignored():
    st = _state(queue_size=2)

    async def fn(c):
        for i in range(2):
            r = await c.post("/upload", content=make_batch(seed=i).to_bytes(),
                             headers={**AUTH, "X-Batch-Id": f"b{i}"})
            assert r.status_code == 200
        r = await c.post("/upload", content=make_batch().to_bytes(), headers=AUTH)
        assert r.status_code == 503 and r.headers["retry-after"].isdigit()
        await c.get("/get", headers=AUTH)
        r = await c.post("/upload", content=make_batch(seed=0).to_bytes(),
                         headers={**AUTH, "X-Batch-Id": "b0"})
        assert r.status_code == 200 and r.json()["duplicate"]
        assert len(st.queue.ready) == 1 and len(st.queue.leased) == 1
    run(st, fn)


def test_oversized_and_truncated_bodies():
    st = _state()

    async def fn(c):
        r = await c.post("/upload", content=b"x" * (65 << 10), headers=AUTH)
        assert r.status_code == 413
        body = make_batch().to_bytes()

        async def partial():
            yield body[:100]
        r = await c.post("/upload", content=partial(), headers={**AUTH, "Content-Length": str(len(body))})
        assert r.status_code == 400
        assert not st.queue.ready
    run(st, fn)


def test_reference_logprobs_added_when_beta_positive():
    from nanogrpo.algo.logprobs import batch_token_logprobs
    from nanogrpo.models.tiny import make_model, make_tokenizer
    from nanogrpo.serve.server import make_ref_fn

    tok = make_tokenizer()
    model = make_model("tiny", tok).eval()
    st = _state(ref_fn=make_ref_fn(model, torch.device("cpu"), 4, 7))
    st.s.vocab_size = len(tok)
    b = make_batch(vocab=len(tok))

    async def fn(c):
        assert (await c.post("/upload", content=b.to_bytes(), headers=AUTH)).status_code == 200
        return RolloutBatch.from_bytes((await c.get("/get", headers=AUTH)).content)
    got = run(st, fn)
    want = batch_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, b.completion_mask)
    torch.testing.assert_close(got.ref_logprobs, want)
    assert st.stats()["ref_tokens_per_s"] > 0


def test_weights_relay_is_conditional_on_version():
    from nanogrpo.models.tiny import make_model

    sd = make_model("tiny").state_dict()
    st = _state()
    st.s.max_weights_body = 8 << 20

    async def fn(c):
        assert (await c.get("/weights", headers=AUTH)).status_code == 204
        body = encode_state_dict(sd, 3)
        r = await c.post("/weights", content=body, headers={**AUTH, "X-Policy-Version": "3"})
        assert r.status_code == 200, r.text
        r = await c.post("/weights", content=body, headers={**AUTH, "X-Policy-Version": "2"})
        assert r.status_code == 409
        assert (await c.post("/weights", content=body[:-5], headers={**AUTH, "X-Policy-Version": "4"})
                ).status_code == 400
        assert (await c.get("/weights/version", headers=AUTH)).json()["version"] == 3
        assert (await c.get("/weights", params={"have": 3}, headers=AUTH)).status_code == 204
        r = await c.get("/weights", params={"have": 1}, headers=AUTH)
        assert r.status_code == 200 and r.headers["x-policy-version"] == "3"
        return decode_state_dict(r.content)
    got = run(st, fn)
    assert "lm_head.weight" not in got  # tied: sent once
    for k, v in got.items():
        assert torch.equal(v, sd[k])


def _bad_weights(rng: random.Random) -> bytes:
    """A safetensors-shaped body whose header is wrong in some way."""
    entry = rng.choice([{"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
                        {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
                        {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]},
                        {"dtype": "F32", "shape": [1], "data_offsets": "ab"},
                        {"dtype": "F32", "shape": [1], "data_offsets": [0, 400]},
                        {"dtype": "F32", "shape": [{}], "data_offsets": [0, 4]}, [1, 2], None, "F32"])
    header = rng.choice([{"w": entry}, {"w": entry, "__metadata__": {"a": "b"}}, {}, [entry], "s"])
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + b"\0" * rng.choice([0, 4, 8])


@pytest.mark.slow
@pytest.mark.parametrize("total", [10_400])
def test_fuzz_10k_malformed_requests_all_4xx(total):
    """>= 10,000 malformed requests of every kind: all 4xx, memory flat, then a good upload round-trips."""
    st = _state(queue_size=4)
    rng = random.Random(1234)
    good = make_batch()
    good_body = good.to_bytes()
    weights_ok = encode_state_dict({"w": torch.zeros(2, 2)}, 1)
    statuses: dict[int, int] = {}

    def request(i: int) -> tuple[str, str, dict, bytes | None]:
        kind = rng.random()
        if kind < 0.70:
            return "POST", "/upload", dict(AUTH), malformed_body(rng, good)
        if kind < 0.74:
            return "POST", "/upload", dict(AUTH), good_body + b"\0" * (64 << 10)          # oversized
        if kind < 0.80:
            bad = rng.choice([{}, {"Authorization": "Bearer nope-nope-nope-nope"},
                              {"Authorization": "Basic x"}, {"Authorization": TOKEN},
                              {"Authorization": "Bearer " + TOKEN[:-1]}])
            return "POST", "/upload", bad, good_body                                   # wrong/missing token
        if kind < 0.86:
            h = dict(AUTH)
            if rng.random() < 0.5:
                h["Content-Length"] = rng.choice(["abc", "-1", "1" * 30, "a b", "0x10", "1e3"])
            else:
                h["X-Batch-Id"] = rng.choice(["a b", "x" * 65, "a/b", "<>", "\t", "id;drop"])
            return "POST", "/upload", h, good_body                                     # garbage headers
        if kind < 0.90:
            return "GET", f"/get?wait={rng.choice(['x', '-1', '1e9', 'nan', 'inf'])}", dict(AUTH), None
        if kind < 0.93:
            v = rng.choice(["", "x", "-3", "1.5", "99999999999999999"])
            body = rng.choice([weights_ok[:rng.randrange(len(weights_ok))], b"junk", good_body,
                               _bad_weights(rng)])
            h = {**AUTH, "X-Policy-Version": v or "7"} if v else dict(AUTH)
            if not v:
                h["X-Policy-Version"] = "7"
            return "POST", "/weights", h, body if v else body[:40]                      # bad weights
        if kind < 0.96:                                # non-ASCII digits, odd leases, deep or huge headers
            sub = rng.randrange(4)
            if sub == 0:
                v = rng.choice([b"\xb2", b"1\xb3", b"\xb9\xb9", "１".encode(), b"+1", b" 1", b"1 ", b"0x1"])
                return "POST", "/weights", {**AUTH, "X-Policy-Version": v}, weights_ok
            if sub == 1:
                lease = rng.choice(["", "x", "0" * 300, "deadbeef.1", "deadbeef.1.deadbee", "../../x", "%00"])
                return "POST", f"/ack?lease={lease}", dict(AUTH), None
            if sub == 2:
                have = rng.choice(["x", "1e99", "²", "-2", "9" * 40])
                return "GET", f"/weights?have={have}", dict(AUTH), None
            meta = rng.choice(['{"worker": ' + "[" * 990 + "1" + "]" * 990 + "}", '{"worker": 1}',
                               '{"worker": "' + "w" * 200 + '"}', '{"x": 1e999}', '{"x": ' + "9" * 5000 + "}",
                               '{"a": {"b": ' + "[" * 18 + "1" + "]" * 18 + "}}"])
            header = json.dumps({"format": "nanogrpo.batch/1", "prompt_len": good.prompt_len,
                                 "group_size": good.group_size, "policy_version": rng.choice([0, 10**30]),
                                 "meta": "@"}).replace('"@"', meta)
            tensors = {k: v.contiguous() for k, v in good.tensors().items()}
            return "POST", "/upload", dict(AUTH), st_save(tensors, metadata={"nanogrpo": header})
        method = rng.choice(["PUT", "DELETE", "GET", "POST"])
        return method, rng.choice(["/nope", "/upload/x", "/", "/health/x"]), AUTH, None

    app = create_app(st)

    async def fn(c):
        rss0 = None
        n = 0
        for i in range(total):
            method, path, headers, body = request(i)
            r = await asgi_call(app, method, path, headers, body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert 400 <= r.status_code < 500, (i, method, path, headers, r.status_code, r.text)
            assert "\n" not in r.text.strip()
            n += 1
            if i == 1000:
                rss0 = rss_mb()
        rss1 = rss_mb()
        assert (await c.get("/health")).status_code == 200
        assert not st.queue.ready and st.relay.path is None
        assert not list(st.relay.directory.iterdir())  # no refused publish left a spooled file behind
        st.relay.close()
        r = await c.post("/upload", content=good_body, headers=AUTH)
        assert r.status_code == 200
        back = await c.get("/get", headers=AUTH)
        assert back.content == good_body
        return n, rss0, rss1
    n, rss0, rss1 = run(st, fn)
    assert n == total
    assert sum(st.rejected.values()) >= total - statuses.get(404, 0) - statuses.get(405, 0)
    assert rss1 - rss0 < 64, f"memory grew from {rss0:.0f} MB to {rss1:.0f} MB"
    print(f"fuzz: {n} requests, statuses {statuses}, rss {rss0:.0f} -> {rss1:.0f} MB, "
          f"rejections {dict(st.rejected)}")


def test_staleness_policy_and_server_side_expiry():
    from nanogrpo.serve.feed import staleness_action

    assert staleness_action(0, 2) == "on_policy"
    assert staleness_action(2, 2) == "off_policy"
    assert staleness_action(3, 2) == "drop" and staleness_action(-1, 2) == "drop"
    st = _state(max_staleness=1)

    async def fn(c):
        for v in (0, 1, 2):
            r = await c.post("/upload", content=make_batch(version=v).to_bytes(), headers=AUTH)
            assert r.status_code == 200
        body = encode_state_dict({"w": torch.zeros(1)}, 2)
        r = await c.post("/weights", content=body, headers={**AUTH, "X-Policy-Version": "2"})
        assert r.status_code == 200
        r = await c.get("/get", headers=AUTH)
        return RolloutBatch.from_bytes(r.content).policy_version
    assert run(st, fn) == 1
    assert st.queue.expired == 1 and len(st.queue.ready) == 1 and len(st.queue.leased) == 1


@pytest.mark.slow
def test_client_gives_up_loudly_when_server_away_and_never_retries_a_4xx():
    import time

    from nanogrpo.serve.client import ServerClient, ServerError
    from tests.test_serve_helpers import free_port

    c = ServerClient(f"http://127.0.0.1:{free_port()}", TOKEN, timeout_s=1, retry_for_s=0.8,
                     backoff_min_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="unavailable for"):
        c.get(wait_s=0)
    assert time.monotonic() - t0 < 5 and c.retries >= 2

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, text="input_ids outside the vocabulary [0, 50)\n")
    c.http = httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler))
    before = c.retries
    with pytest.raises(ServerError, match="HTTP 400: input_ids outside"):
        c.upload(make_batch())
    assert c.retries == before


def test_too_many_bodies_arriving_at_once_get_429():
    st = _state(max_reading=2)
    st.reading = 2                                    # two slow uploads in flight

    async def fn(c):
        r = await c.post("/upload", content=make_batch().to_bytes(), headers=AUTH)
        assert r.status_code == 429 and r.headers["retry-after"].isdigit()
        st.reading = 0
        assert (await c.post("/upload", content=make_batch().to_bytes(), headers=AUTH)).status_code == 200
    run(st, fn)
