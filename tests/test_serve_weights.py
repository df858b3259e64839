"""Published weights: a fuzz of hand-edited safetensors headers (non-UTF-8 bytes included) against the real
loader, the relay's version rules, the publishing client's 409 handling, and a worker that cannot load
what it fetched."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import httpx
import pytest
import torch
from safetensors.torch import load as st_load

from nanogrpo.engines.hf import load_in_place
from nanogrpo.models.tiny import make_model
from nanogrpo.serve.client import ServerClient, ServerError, encode_state_dict, load_published
from nanogrpo.serve.server import ServerState, Settings, create_app
from nanogrpo.serve.weights import WeightLayout, WeightsError, check_weights
from tests.test_serve_helpers import TOKEN, VOCAB, LiveServer

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _split(body: bytes) -> tuple[str, bytes]:
    n = int.from_bytes(body[:8], "little")
    return body[8:8 + n].decode(), body[8 + n:]


def _join(header: bytes | str, data: bytes, n: int | None = None) -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return (len(raw) if n is None else n).to_bytes(8, "little") + raw + data


def _mutate(rng: random.Random, header: str, data: bytes) -> bytes:
    """One hand edit of a valid body: of the header's JSON text, its bytes, its length or the data."""
    h = json.loads(header)
    names = [k for k in h if k != "__metadata__"]
    name = rng.choice(names)
    kind = rng.randrange(16)
    if kind == 0:                                                  # a shape entry of another type/sign
        dims = h[name]["shape"]
        dims[rng.randrange(len(dims))] = rng.choice(["1", -1, 1.0, True, None, 2**64, [1], {}, 0, 10**6])
    elif kind == 1:                                                # data offsets moved or mistyped
        off = h[name]["data_offsets"]
        i = rng.randrange(2)
        off[i] = rng.choice([off[i] + rng.choice([-4, -2, -1, 1, 2, 4]), str(off[i]), float(off[i]),
                             -off[i] - 1, None, 2**70])
        if rng.random() < 0.2:
            h[name]["data_offsets"] = off + [0]
    elif kind == 2:                                                # dtype
        h[name]["dtype"] = rng.choice(["f32", "F32 ", "I64", "BOOL", "U8", 5, None, "F8_E4M3", "F64", "BF16",
                                       "F16", ["F32"]])
    elif kind == 3:                                                # metadata values
        h["__metadata__"] = rng.choice([{"a": 1}, {"a": None}, {"a": ["x"]}, {"a": {"b": "c"}}, "m", [1],
                                        {"a": "ok"}, {}])
    elif kind == 4:                                                # an entry removed, renamed, added
        choice = rng.randrange(3)
        if choice == 0:
            del h[name]
        elif choice == 1:
            h[name + ".x"] = h.pop(name)
        else:
            h["extra"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    elif kind == 5:                                                # extra / missing keys in an entry
        if rng.random() < 0.5:
            h[name]["extra"] = 1
        else:
            del h[name][rng.choice(["dtype", "shape", "data_offsets"])]
    elif kind == 6:                                                # two entries' shapes swapped
        other = rng.choice(names)
        h[name]["shape"], h[other]["shape"] = h[other]["shape"], h[name]["shape"]
    elif kind == 7:                                                # raw bytes: not UTF-8
        raw = bytearray(header.encode())
        pos = rng.randrange(len(raw))
        raw[pos:pos] = rng.choice([b"\xff", b"\xc0\x80", b"\x80", b"\xed\xa0\x80", b"\xf5\x80\x80\x80",
                                   b"\xfe"])
        return _join(bytes(raw), data)
    elif kind == 8:                                                # a lone surrogate escape in a name
        text = json.dumps(h).replace(json.dumps(name), json.dumps(name)[:-1] + '\\ud800"', 1)
        return _join(text, data)
    elif kind == 9:                                                # a duplicated key
        entry = json.dumps({name: h[name]})[1:-1]
        return _join("{" + entry + ", " + json.dumps(h)[1:], data)
    elif kind == 10:                                               # NaN / Infinity / huge numbers
        lit = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "9" * 5000])
        text = json.dumps(h).replace(str(h[name]["data_offsets"][1]), lit, 1)
        return _join(text, data)
    elif kind == 11:                                               # the length field wrong
        raw = json.dumps(h).encode()
        return _join(raw, data, n=rng.choice([0, 1, len(raw) - 1, len(raw) + 1, 2**63,
                                              len(raw) + len(data) + 9]))
    elif kind == 12:                                               # data truncated or padded
        return _join(json.dumps(h), data[:-rng.randrange(1, 9)] if rng.random() < 0.5 else data + b"\0" * 4)
    elif kind == 13:                                               # deep nesting
        depth = rng.choice([50, 999, 5000, 100_000])
        text = json.dumps(h).replace(json.dumps(h[name]["shape"]), "[" * depth + "1" + "]" * depth, 1)
        return _join(text, data)
    elif kind == 14:                                               # valid edits: padding, order
        text = json.dumps(dict(rng.sample(list(h.items()), len(h))))
        return _join(text + " " * rng.randrange(8), data)
    else:                                                          # not an object at the top
        return _join(rng.choice(["[]", "1", '"x"', "null", " {}", "{}", "{" * 3]), data)
    return _join(json.dumps(h), data)


@pytest.mark.slow
def test_fuzzed_headers_either_fail_the_check_or_load_into_the_model(tmp_path):
    """Anything check_weights accepts, the real loader (safetensors) decodes and the model loads; anything
    else is a WeightsError (one line), never another exception. The check of a body on disk (what the
    server runs on a spooled publish, a worker on a fetch) says the same of each."""
    from nanogrpo.serve.weights import check_weights_file

    def verdict(check, arg):
        try:
            return check(arg, layout)
        except WeightsError as e:
            return str(e)

    model = make_model("tiny", seed=0)
    layout = WeightLayout.of_model(model)
    header, data = _split(encode_state_dict(model.state_dict(), 1))
    rng = random.Random(0)
    accepted = rejected = 0
    target = make_model("tiny", seed=1)
    for _ in range(800):
        body = _mutate(rng, header, data)
        (tmp_path / "body").write_bytes(body)
        assert verdict(check_weights_file, tmp_path / "body") == verdict(check_weights, body)
        try:
            shapes = check_weights(body, layout)
        except WeightsError as e:
            assert "\n" not in str(e)
            rejected += 1
            continue
        accepted += 1
        sd = st_load(body)
        assert {k: tuple(v.shape) for k, v in sd.items()} == shapes
        load_in_place(target, sd)
        for k, v in sd.items():
            assert torch.equal(target.state_dict()[k], v.to(target.state_dict()[k].dtype))
    assert rejected > 600 and accepted > 30, (accepted, rejected)
    print(f"weights fuzz: {accepted} accepted, {rejected} rejected")


def test_a_tied_weight_may_be_sent_once_or_twice_but_not_left_out():
    model = make_model("tiny", seed=0)
    layout = WeightLayout.of_model(model)
    sd = model.state_dict()
    assert "lm_head.weight" in sd                                   # tied to the embeddings
    check_weights(encode_state_dict(sd, 1), layout)                # sent once (shared storage)
    both = {k: v.clone() for k, v in sd.items()}
    check_weights(encode_state_dict(both, 1), layout)               # sent twice
    without = {k: v for k, v in sd.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")}
    with pytest.raises(WeightsError, match="missing"):
        check_weights(encode_state_dict(without, 1), layout)


def test_views_of_one_storage_are_published_as_their_own_tensors(tmp_path):
    """Weights that are views of one buffer (a fused QKV split, a flat parameter) publish and decode to
    the same values, from memory and from a file; the tensors themselves are not changed."""
    from nanogrpo.serve.client import write_state_dict

    flat = torch.arange(12, dtype=torch.float32)
    sd = {"q": flat[:4].view(2, 2), "k": flat[4:8].view(2, 2), "v": flat[8:].view(2, 2),
          "tied": flat[:4].view(2, 2)}
    layout = WeightLayout({k: (2, 2) for k in ("q", "k", "v")}, [["q"], ["k"], ["v"]])
    write_state_dict(sd, 1, tmp_path / "w.safetensors")
    for got in (load_published(encode_state_dict(sd, 1), layout),
                load_published(tmp_path / "w.safetensors", layout)):
        assert sorted(got) == ["k", "q", "v"]  # "tied" is "q" (same storage, same offset): sent once
        assert all(torch.equal(got[n], sd[n]) for n in got)
    assert torch.equal(flat, torch.arange(12, dtype=torch.float32))


def test_a_publish_that_does_not_fit_the_model_is_refused_and_keeps_the_old_weights():
    model = make_model("tiny", seed=0)
    st = ServerState(Settings(vocab_size=VOCAB, max_weights_body=8 << 20), TOKEN,
                     layout=WeightLayout.of_model(model))
    good = encode_state_dict(model.state_dict(), 1)
    sd = dict(model.state_dict())
    sd["model.norm.weight"] = torch.ones(sd["model.norm.weight"].shape[0] + 1)        # another model's shape
    other = encode_state_dict(sd, 2)

    async def fn(c):
        r = await c.post("/weights", content=good, headers={**AUTH, "X-Policy-Version": "1"})
        assert r.status_code == 200
        r = await c.post("/weights", content=other, headers={**AUTH, "X-Policy-Version": "2"})
        assert r.status_code == 400 and "shape" in r.text
        r = await c.get("/weights", headers=AUTH)
        assert r.headers["x-policy-version"] == "1" and r.content == good

    async def main():
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            await fn(c)
    asyncio.run(main())


def test_the_relay_serves_from_one_file_and_a_fetch_under_way_keeps_its_version(tmp_path):
    """Each publish is spooled to the relay's directory and replaces the served file (the one before
    removed); a fetch that opened the file before a newer publish landed still reads its version whole;
    closing the server removes the directory."""
    from nanogrpo.serve.weights import WeightRelay, check_weights_file

    relay = WeightRelay(directory=tmp_path)
    bodies = {v: encode_state_dict({"w": torch.full((1000,), float(v))}, v) for v in (1, 2, 3)}
    opened = {}
    for v, body in bodies.items():
        spooled = relay.spool_path()
        spooled.write_bytes(body)
        relay.accept(spooled, v, f"p{v}", check_weights_file(spooled))
        opened[v] = relay.open()
        assert [p.name for p in tmp_path.iterdir()] == [f"weights-{v}.safetensors"]
        assert relay.size == len(body) and relay.version == v
    for v, f in opened.items():  # the earlier files are gone from the directory, not from their readers
        with f:
            assert f.read() == bodies[v]
    st = ServerState(Settings(vocab_size=VOCAB), TOKEN)
    st.relay.accept(_spooled(st.relay, bodies[1]), 1, "p", {"w": (1000,)})
    directory = st.relay.directory
    st.close()
    assert not directory.exists()


def test_a_relay_directory_is_cleared_of_a_killed_servers_files_and_publishes_are_capped_by_the_model():
    """A server restarted on a weights directory removes the weight files a killed one left there (and
    nothing else); a publish longer than the model's weights can be (``weights_cap``) is refused (413)
    before its body is read."""
    import tempfile
    from pathlib import Path

    from nanogrpo.serve.weights import WeightRelay, weights_cap

    d = Path(tempfile.mkdtemp())
    for name in ("weights-7.safetensors", "incoming-1-1.safetensors", "notes.txt"):
        (d / name).write_bytes(b"x" * 10)
    relay = WeightRelay(directory=d)
    relay.spool_path()
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    model = make_model("tiny", seed=0)
    layout = WeightLayout.of_model(model)
    st = ServerState(Settings(vocab_size=VOCAB, weights_dir=d), TOKEN, layout=layout)

    async def main():
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/weights", content=b"\0" * (weights_cap(layout) + 1),
                             headers={**AUTH, "X-Policy-Version": "1"})
            assert r.status_code == 413 and "exceeds the limit" in r.text
    asyncio.run(main())
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    st.close()


def _spooled(relay, body: bytes):
    path = relay.spool_path()
    path.write_bytes(body)
    return path


def test_versions_move_forward_by_a_bounded_step_and_a_publisher_behind_is_told_loudly():
    sd = {"w": torch.ones(2)}
    st = ServerState(Settings(vocab_size=VOCAB, max_version_step=10), TOKEN)
    with LiveServer(st) as srv, ServerClient(srv.url, TOKEN, timeout_s=5, retry_for_s=5) as c:
        c.publish(500, sd)                             # a fresh server: a resumed trainer starts anywhere
        c.publish(510, sd)
        with pytest.raises(ServerError, match="HTTP 400"):
            c.publish(521, sd)                         # one step too far
        with pytest.raises(ServerError, match="holds policy version 510"):
            c.publish(505, sd)                         # behind: before, the 409 passed as a success
        with pytest.raises(ServerError, match="holds policy version 510"):
            c.publish(510, sd)                         # the same number, someone else's publish
        assert c.weights_version() == 510


@pytest.mark.slow  # (over 1 s: the fast suite stays under a minute)
@pytest.mark.parametrize("first_attempt_s", [0.0, 1.5], ids=["quick", "slower-than-the-retry-window"])
def test_a_retried_publish_whose_first_attempt_landed_is_a_success(first_attempt_s):
    st = ServerState(Settings(vocab_size=VOCAB), TOKEN)
    # the retry window opens at the first failure: an attempt that took longer than it still gets retried
    with LiveServer(st) as srv, ServerClient(srv.url, TOKEN, timeout_s=5, retry_for_s=1) as c:
        calls = []
        real = c.http.stream  # the client reads every answer streaming (nanogrpo.http_limits)

        @contextlib.contextmanager
        def lose_first_answer(method, path, **kw):
            with real(method, path, **kw) as r:
                if path == "/weights" and method == "POST" and not calls:
                    r.read()
                    calls.append(r.status_code)
                    time.sleep(first_attempt_s)
                    raise httpx.ReadTimeout("answer lost")      # it landed; the client does not know
                yield r
        c.http.stream = lose_first_answer
        c.publish(3, {"w": torch.ones(1)})
        assert calls == [200] and c.weights_version() == 3


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_worker_keeps_its_weights_when_it_cannot_load_a_publish_and_retries_with_backoff():
    from nanogrpo.engines.hf import HFEngine
    from nanogrpo.models.tiny import make_tokenizer
    from nanogrpo.serve.worker import WeightFollower

    tok = make_tokenizer()
    model = make_model("tiny", tok, seed=0).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    st = ServerState(Settings(vocab_size=VOCAB, max_weights_body=8 << 20), TOKEN)   # beta = 0, no layout
    t = [0.0]
    with LiveServer(st) as srv, ServerClient(srv.url, TOKEN, timeout_s=5, retry_for_s=5) as c:
        follower = WeightFollower(c, HFEngine(model, tokenizer=tok), WeightLayout.of_model(model),
                                  backoff_s=(5, 40), clock=lambda: t[0])
        other = dict(make_model("tiny", tok, seed=3).state_dict())
        other["model.norm.weight"] = torch.ones(other["model.norm.weight"].shape[0] + 1)
        c.publish(1, other)                                               # not this worker's model
        assert not follower.poll() and follower.version == 0 and follower.failures == 1
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k])                              # nothing copied
        assert not follower.poll() and follower.failures == 1             # backing off: no fetch
        t[0] = 5.1
        assert not follower.poll() and follower.failures == 2             # next wait: 10 s
        t[0] = 14.0
        assert not follower.poll() and follower.failures == 2
        st.relay.layout = None                                            # a server restarted on the
        st.relay.version = -1                                             # right model, in effect
        new = make_model("tiny", tok, seed=5).state_dict()
        c.publish(2, new)
        t[0] = 15.2
        assert follower.poll() and follower.version == 2 and follower.failures == 0
        for k, v in model.state_dict().items():
            assert torch.equal(v, new[k])


def test_load_published_checks_before_decoding():
    model = make_model("tiny", seed=0)
    body = encode_state_dict(model.state_dict(), 1)
    header, data = _split(body)
    h = json.loads(header)
    name = next(k for k in h if k != "__metadata__")
    h[name]["shape"] = [1]                                                 # short byte range for F32 [1]
    with pytest.raises(WeightsError):
        load_published(_join(json.dumps(h), data), WeightLayout.of_model(model))
