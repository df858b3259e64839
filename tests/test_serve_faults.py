"""Regression tests for the faults found by attacking a real `nanogrpo serve` (issue 12), one or more each.

Each reproduces the attack as the issue describes it; all failed on the server before the fix.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from nanogrpo.serve.client import encode_state_dict
from nanogrpo.serve.server import ServerState, Settings, create_app
from tests.test_serve_helpers import TOKEN, VOCAB, LiveServer, make_batch

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _state(**kw) -> ServerState:
    ref_fn = kw.pop("ref_fn", None)
    layout = kw.pop("layout", None)
    kw = {"vocab_size": VOCAB, "max_seqs": 64, "max_len": 64, "max_body": 64 << 10,
          "max_weights_body": 1 << 20, **kw}
    return ServerState(Settings(**kw), TOKEN, ref_fn, layout)


def run(st: ServerState, fn):
    async def main():
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await fn(c)
    return asyncio.run(main())


# --------------------------------------------------------------------------- 1. idle connections


HOLDER = """
import socket, sys, time
conns = []
for _ in range(int(sys.argv[2])):
    try:
        conns.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5))
    except OSError:
        pass
print(len(conns), flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_idle_connections_from_another_process_do_not_deny_service():
    """Fault 1: 300 idle TCP connections (no token, nothing sent) held by another process made every
    request, /health included, answer 503 until they closed. Now /health, a good upload and a get
    answer within 5 s (the oldest idle sockets make room), and idle sockets time out."""
    st = _state(idle_timeout_s=2.0)
    with LiveServer(st) as srv:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(srv.port), "300"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert int(holder.stdout.readline()) >= 290           # the sockets are open and idle
            body = make_batch().to_bytes()
            t0 = time.monotonic()
            with httpx.Client(base_url=srv.url, timeout=5) as c:
                assert c.get("/health").status_code == 200
                r = c.post("/upload", content=body, headers={**AUTH, "X-Batch-Id": "b-1"})
                assert r.status_code == 200, r.text
                r = c.get("/get", headers=AUTH)
                assert r.status_code == 200 and r.content == body
            assert time.monotonic() - t0 < 5
            assert st.guard.evicted >= 300 - st.s.max_connections_per_client
            deadline = time.monotonic() + 10                       # then the idle ones time out
            while st.guard.timed_out == 0 or len(st.guard.all) > 1:
                assert time.monotonic() < deadline, st.guard.stats()
                time.sleep(0.2)
        finally:
            holder.kill()
            holder.wait()


# --------------------------------------------------------------------------- 2. malformed weights


def _header_body(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


BAD_WEIGHTS = {
    # byte range != shape x itemsize (the offsets still tile the body)
    "short_range": _header_body({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "long_range": _header_body({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
    "string_dim": _header_body({"w": {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}}, b"\0" * 4),
    "negative_dim": _header_body({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "float_dim": _header_body({"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, b"\0" * 4),
    "bool_dim": _header_body({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
    "meta_not_string": _header_body({"__metadata__": {"a": 1},
                                     "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
}


@pytest.mark.parametrize("kind", sorted(BAD_WEIGHTS))
def test_malformed_weights_never_replace_good_ones(kind):
    """Fault 2: each of these was accepted and replaced the good weights, and every worker died on it."""
    good = encode_state_dict({"w": torch.ones(1)}, 1)
    st = _state()

    async def fn(c):
        r = await c.post("/weights", content=good, headers={**AUTH, "X-Policy-Version": "1"})
        assert r.status_code == 200, r.text
        r = await c.post("/weights", content=BAD_WEIGHTS[kind], headers={**AUTH, "X-Policy-Version": "2"})
        assert r.status_code == 400, (r.status_code, r.text)
        r = await c.get("/weights", params={"have": -1}, headers=AUTH)
        assert r.status_code == 200 and r.headers["x-policy-version"] == "1" and r.content == good
    run(st, fn)


def test_beta0_server_holds_publishes_to_the_first_ones_names_and_shapes():
    """Fault 2 on a beta=0 server (no reference model): a publish whose names or shapes differ from
    the first accepted one is refused."""
    st = _state()

    async def fn(c):
        first = encode_state_dict({"a": torch.ones(2), "b": torch.ones(3)}, 1)
        assert (await c.post("/weights", content=first, headers={**AUTH, "X-Policy-Version": "1"})
                ).status_code == 200
        for i, sd in enumerate([{"a": torch.ones(2)}, {"a": torch.ones(2), "b": torch.ones(4)},
                                {"a": torch.ones(2), "b": torch.ones(3), "c": torch.ones(1)}]):
            r = await c.post("/weights", content=encode_state_dict(sd, 2 + i),
                             headers={**AUTH, "X-Policy-Version": str(2 + i)})
            assert r.status_code == 400, (i, r.text)
        assert (await c.get("/weights/version", headers=AUTH)).json()["version"] == 1
    run(st, fn)


# --------------------------------------------------------------------------- 3. version jumps


def test_a_version_jump_is_refused_and_the_relay_keeps_moving():
    """Fault 3: X-Policy-Version 999999999999 was accepted, freezing the relay (every later publish
    got 409) and expiring every queued batch as stale."""
    st = _state(max_staleness=2)
    w = encode_state_dict({"w": torch.ones(1)}, 0)

    async def publish(c, v: str) -> httpx.Response:
        return await c.post("/weights", content=w, headers={**AUTH, "X-Policy-Version": v})

    async def fn(c):
        assert (await publish(c, "0")).status_code == 200
        r = await c.post("/upload", content=make_batch(version=0).to_bytes(), headers=AUTH)
        assert r.status_code == 200
        r = await publish(c, "999999999999")
        assert 400 <= r.status_code < 500 and r.status_code != 409, r.text
        assert (await publish(c, "1")).status_code == 200
        assert (await c.get("/get", headers=AUTH)).status_code == 200      # the batch was not expired
    run(st, fn)


# --------------------------------------------------------------------------- 4. vanished long-poll


@pytest.mark.slow
def test_a_long_poll_whose_client_vanished_loses_no_batch():
    """Fault 4: GET /get?wait=20, the client closes its socket, an upload arrives: the batch went to
    the dead socket and was gone."""
    st = _state(lease_s=1.0)
    body = make_batch().to_bytes()
    with LiveServer(st) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(f"GET /get?wait=20 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        time.sleep(0.3)
        s.close()                                                       # the trainer was killed mid-poll
        time.sleep(0.3)
        assert c.post("/upload", content=body, headers={**AUTH, "X-Batch-Id": "b-4"}).status_code == 200
        time.sleep(1.5)                                                 # the dead poll's turn first
        r = c.get("/get", params={"wait": 5}, headers=AUTH)
        assert r.status_code == 200 and r.content == body
        assert st.queue.redelivered == 0           # the dead poll saw its client leave and took nothing


# --------------------------------------------------------------------------- 5. reference failure


def test_a_reference_failure_leaves_the_batch_retryable():
    """Fault 5: the batch id was recorded before the reference forward; the forward failed, the client's
    retry was told "duplicate" and the batch was lost."""
    calls = []

    def flaky_ref(batch):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory")
        return torch.full(batch.completion_mask.shape, -1.0)
    st = _state(ref_fn=flaky_ref)
    body = make_batch().to_bytes()

    async def fn(c):
        h = {**AUTH, "X-Batch-Id": "b-5"}
        r = await c.post("/upload", content=body, headers=h)
        assert r.status_code == 503, (r.status_code, r.text)           # retryable, not a 500
        r = await c.post("/upload", content=body, headers=h)
        assert r.status_code == 200 and r.json()["queued"], r.text
        r = await c.get("/get", headers=AUTH)
        assert r.status_code == 200
    run(st, fn)


# --------------------------------------------------------------------------- 6. header parsing


def test_non_ascii_digits_in_a_version_header_are_a_400():
    """Fault 6: '²' passes str.isdigit() and int() refuses it: a 500."""
    st = _state()
    w = encode_state_dict({"w": torch.ones(1)}, 0)

    async def fn(c):
        for v in (b"\xb2", b"1\xb3", b"\xb9", "²".encode()):   # ², 1³, ¹ as the server decodes them (latin-1)
            r = await c.post("/weights", content=w, headers={**AUTH, "X-Policy-Version": v})
            assert r.status_code == 400, (v, r.status_code, r.text)
        assert (await c.get("/weights/version", headers=AUTH)).json()["version"] == -1
    run(st, fn)


def test_a_deeply_nested_worker_id_is_a_400_and_queues_nothing():
    """Fault 6: a worker id nested ~1,000 levels deep in the JSON header of a batch over 1 MB (decoded in a
    thread, on a shallow stack) passed the decoder, then raised RecursionError on the event loop: a 500
    after the batch was queued."""
    from safetensors.torch import save as st_save

    from nanogrpo.batch import FORMAT

    b = make_batch(groups=16, g=4, c=4000)                                   # > 1 MB
    header = json.dumps({"format": FORMAT, "prompt_len": b.prompt_len, "group_size": b.group_size,
                         "policy_version": 0, "meta": {"worker": "@"}})
    header = header.replace('"@"', "[" * 970 + '"w"' + "]" * 970)   # json.dumps itself would recurse
    body = st_save({k: v.contiguous() for k, v in b.tensors().items()}, metadata={"nanogrpo": header})
    assert len(body) > 1 << 20
    st = _state(max_body=8 << 20, max_seqs=4096, max_len=8192)

    async def fn(c):
        r = await c.post("/upload", content=body, headers=AUTH)
        assert r.status_code == 400, (r.status_code, r.text)
        assert (await c.get("/get", headers=AUTH)).status_code == 204
    run(st, fn)
    assert st.stats()["batches_in"] == 0
