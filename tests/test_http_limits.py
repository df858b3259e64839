"""Every HTTP body nanogrpo reads has a cap (nanogrpo/http_limits.py): against a loopback server that
answers 200 and streams without end (tests/endless_fixtures.py, bounded there at 64 MiB a answer), each
client stops at its cap, closes the connection, ends with its documented penalty or error, and this
process's peak memory grows by little more than the cap times the requests in flight. Without the caps
each client would read the server's whole 64 MiB a request (the judge: 4 x 64 MiB, twice over)."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
import torch

from nanogrpo import http_limits
from nanogrpo.rewards.judges.judge import Judge
from nanogrpo.serve.client import ServerClient, ServerError, batch_read_cap, encode_state_dict
from nanogrpo.serve.weights import WeightLayout, weights_cap
from tests.endless_fixtures import EndlessServer, PeakMemory, endless, json_answer

MiB = 1 << 20
SLACK_MB = 8
"""What a client may hold beyond its caps: its own buffers, httpx's, allocator slack."""


# ---------------------------------------------------------------------------- the helper


@pytest.mark.parametrize("mode", ["chunked", "close", "gzip"])
def test_a_reply_without_end_stops_at_the_cap_and_the_connection_is_closed(mode) -> None:
    with EndlessServer({"/x": endless(mode), "/ok": json_answer({"a": 1})}) as srv, httpx.Client() as c:
        with PeakMemory() as mem, pytest.raises(http_limits.BodyError) as e:
            http_limits.request(c, "GET", srv.url + "/x", cap=MiB, timeout=10)
        assert str(e.value).startswith(f"reply over {MiB} bytes from {srv.url}/x")
        assert mem.growth_mb < 1 + SLACK_MB, mem.growth_mb
        (answer,) = srv.answers_to("/x")
        assert answer.client_left   # the client hung up before the server's own bound: it did not drain
        assert http_limits.request(c, "GET", srv.url + "/ok", cap=MiB).json() == {"a": 1}  # usable after


def test_an_async_client_stops_at_the_cap_too() -> None:
    async def go(url: str) -> None:
        async with httpx.AsyncClient() as c:
            with pytest.raises(http_limits.BodyError, match=f"reply over {MiB} bytes"):
                await http_limits.arequest(c, "POST", url, cap=MiB, json={"q": 1}, timeout=10)

    with EndlessServer({"/x": endless()}) as srv:
        with PeakMemory() as mem:
            asyncio.run(go(srv.url + "/x"))
        assert mem.growth_mb < 1 + SLACK_MB, mem.growth_mb
        assert srv.answers_to("/x")[0].client_left


def test_a_sink_takes_the_body_to_a_file_under_the_same_cap(tmp_path) -> None:
    """``sink``: a 2xx body goes to the file as it arrives, not into memory; the cap still ends an endless
    one (the file holds no more than the cap); an error answer is read as text, not written."""
    with EndlessServer({"/x": endless(), "/ok": json_answer({"a": 1}),
                        "/no": json_answer({"e": 1}, status=500)}) as srv, httpx.Client() as c:
        with open(tmp_path / "ok", "wb") as f:
            r = http_limits.request(c, "GET", srv.url + "/ok", cap=MiB, sink=f)
        assert r.content == b"" and (tmp_path / "ok").read_bytes() == b'{"a": 1}'
        with PeakMemory() as mem, open(tmp_path / "x", "wb") as f, pytest.raises(http_limits.BodyError):
            http_limits.request(c, "GET", srv.url + "/x", cap=8 * MiB, sink=f)
        assert (tmp_path / "x").stat().st_size <= 8 * MiB and mem.growth_mb < 1 + SLACK_MB, mem.growth_mb
        with open(tmp_path / "no", "wb") as f:
            r = http_limits.request(c, "GET", srv.url + "/no", cap=MiB, sink=f)
        assert r.status_code == 500 and r.json() == {"e": 1} and (tmp_path / "no").read_bytes() == b""


def test_a_declared_length_over_the_cap_is_refused_before_the_body_is_read() -> None:
    with EndlessServer({"/x": endless("length")}) as srv, httpx.Client() as c:
        with pytest.raises(http_limits.BodyError, match=f"reply over {MiB} bytes"):
            http_limits.request(c, "GET", srv.url + "/x", cap=MiB)
        assert srv.answers_to("/x")[0].client_left


def test_bodies_within_the_cap_arrive_whole_compressed_or_not() -> None:
    import gzip
    import json

    doc = {"text": "y" * 50_000}
    packed = gzip.compress(json.dumps(doc).encode())
    routes = {"/plain": json_answer(doc), "/gz": json_answer(doc)}
    routes["/gz"].body, routes["/gz"].headers["Content-Encoding"] = packed, "gzip"
    with EndlessServer(routes) as srv, httpx.Client() as c:
        for path in ("/plain", "/gz"):
            r = http_limits.request(c, "GET", srv.url + path, cap=60_000)
            assert r.status_code == 200 and r.json() == doc and "content-encoding" not in r.headers
        with pytest.raises(http_limits.BodyError):  # the cap counts decoded bytes, not the 100 on the wire
            http_limits.request(c, "GET", srv.url + "/gz", cap=40_000)


def test_an_error_answer_without_end_is_cut_not_raised() -> None:
    with EndlessServer({"/x": endless(status=503, headers={"Retry-After": "1"})}) as srv, httpx.Client() as c:
        r = http_limits.request(c, "GET", srv.url + "/x", cap=100 * MiB)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert len(r.content) == http_limits.ERROR_BODY and r.text.startswith('{"choices"')
        assert srv.answers_to("/x")[0].client_left


def test_an_encoding_not_asked_for_is_refused() -> None:
    routes = {"/br": json_answer({"a": 1}, headers={"Content-Encoding": "br"})}
    with EndlessServer(routes) as srv, httpx.Client() as c:
        with pytest.raises(http_limits.BodyError, match="Content-Encoding 'br'"):
            http_limits.request(c, "GET", srv.url + "/br", cap=MiB)


# ---------------------------------------------------------------------------- judge:URL


def test_a_judge_that_streams_without_end_costs_penalties_and_bounded_memory(tmp_path) -> None:
    """The issue's case: four rows, concurrency 4: each row scores the penalty as an error, "reply over
    1048576 bytes", counted; the peak memory grows by about 4 x 1 MiB; the next batch is judged."""
    template = tmp_path / "bare.txt"
    template.write_text("{completion}")
    routes = {"/v1/models": json_answer({"data": [{"id": "tiny-judge"}]}),
              "/v1/chat/completions": endless()}
    with EndlessServer(routes) as srv:
        judge = Judge(srv.url + "/v1", template=str(template), scoring="number", score_range=(0, 10),
                      concurrency=4, timeout_s=60, retries=2)
        judge.start()
        with PeakMemory() as mem:
            got = judge.score([f"row {i}" for i in range(4)], [{}] * 4)
        stats = judge.metrics()
        assert [k for k, _ in got] == ["error"] * 4, got   # not timeouts: stopped at the cap, not the clock
        assert all(r.startswith(f"reply over {MiB} bytes from {srv.url}/v1/chat/completions") for _, r in got)
        assert stats["judge/errors"] == 4 and stats["judge/requests"] == 4   # not retried
        assert mem.growth_mb < 4 * 1 + SLACK_MB, mem.growth_mb
        answers = srv.answers_to("/v1/chat/completions")
        assert len(answers) == 4 and all(a.client_left for a in answers)
        srv.routes["/v1/chat/completions"] = json_answer({"choices": [{"message": {"content": "7"}}]})
        assert judge.score(["row 9"], [{}]) == [("ok", 7.0)]   # the judge goes on
        judge.close()


def test_a_judge_whose_model_list_has_no_end_costs_penalties(tmp_path) -> None:
    template = tmp_path / "bare.txt"
    template.write_text("{completion}")
    with EndlessServer({"/v1/models": endless()}) as srv:
        judge = Judge(srv.url + "/v1", template=str(template), max_reply_bytes=64 << 10)
        got = judge.score(["a", "b"], [{}, {}])
        assert [k for k, _ in got] == ["error", "error"]
        assert "cannot list the judge's models" in got[0][1] and "reply over 65536 bytes" in got[0][1]
        judge.close()


def test_the_judges_reply_cap_is_a_checked_config_key() -> None:
    from nanogrpo.config import RewardsConfig
    from nanogrpo.errors import RewardError

    assert RewardsConfig().judge_max_reply_bytes == MiB
    with pytest.raises(ValueError, match="judge_max_reply_bytes"):
        RewardsConfig(judge_max_reply_bytes=10)
    with pytest.raises(RewardError, match="max_reply_bytes 10"):
        Judge("http://localhost:1/v1", max_reply_bytes=10)


# ---------------------------------------------------------------------------- the split-mode client


def _tiny_layout() -> tuple[WeightLayout, dict[str, torch.Tensor]]:
    sd = {"embed.weight": torch.randn(50, 16), "proj.weight": torch.randn(16, 16)}
    return WeightLayout.of_published({k: tuple(v.shape) for k, v in sd.items()}), sd


def test_the_split_mode_client_stops_at_each_answers_cap() -> None:
    layout, sd = _tiny_layout()
    routes = {"/health": endless(), "/get": endless(headers={"X-Batch-Id": "b", "X-Lease": "l",
                                                               "X-Policy-Version": "0"}),
              "/weights": endless(headers={"X-Policy-Version": "5"})}
    with EndlessServer(routes) as srv, ServerClient(srv.url, timeout_s=10, retry_for_s=5,
                                                     max_batch_bytes=4 * MiB) as c:
        for call, cap in [(c.health, http_limits.SMALL), (lambda: c.get(wait_s=0), 4 * MiB),
                          (lambda: c.fetch_weights(-1, layout), weights_cap(layout))]:
            with PeakMemory() as mem, pytest.raises(ServerError) as e:
                call()
            assert f"sent a reply over {cap} bytes" in str(e.value), e.value
            assert mem.growth_mb < cap / MiB + SLACK_MB, mem.growth_mb
        assert c.retries == 0  # the same answer would come again: not asked twice
        assert [a.client_left for p in routes for a in srv.answers_to(p)] == [True] * 3


def test_the_caps_fit_what_a_real_server_sends() -> None:
    """Weights in the widest dtype a receiver accepts fit the weights cap; a batch with the reference
    log-probs the server adds fits twice its upload."""
    from nanogrpo.models.tiny import make_model, make_tokenizer
    from tests.test_serve_helpers import make_batch

    model = make_model("tiny", make_tokenizer(), seed=0)
    layout = WeightLayout.of_model(model)
    wide = {k: v.double() for k, v in model.state_dict().items()}
    assert len(encode_state_dict(wide, 2**53 - 1)) <= weights_cap(layout)
    assert weights_cap(layout) < 9 * sum(p.numel() for p in model.parameters()) + (1 << 20)
    batch = make_batch()
    batch.ref_logprobs = None
    upload = batch.to_bytes()
    batch.ref_logprobs = torch.zeros_like(batch.old_logprobs)
    assert len(batch.to_bytes()) <= batch_read_cap(len(upload) / MiB)


# ---------------------------------------------------------------------------- hub checks


def test_the_dataset_hub_check_reads_no_body(monkeypatch) -> None:
    """``hf:NAME`` asks the hub with a HEAD: a hub (mirror) whose answer never ends is still an answer."""
    from huggingface_hub import constants

    from nanogrpo.data.sources import _reachable

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with EndlessServer({"/api/datasets/org/data": endless()}) as srv:
        monkeypatch.setattr(constants, "ENDPOINT", srv.url)
        with PeakMemory() as mem:
            _reachable("org/data")   # no DataError: the hub answered
        assert [(a.method, a.sent) for a in srv.answers_to("/api/datasets/org/data")] == [("HEAD", 0)]
        assert mem.growth_mb < SLACK_MB, mem.growth_mb


# ---------------------------------------------------------------------------- nanogrpo serve


def test_the_server_caps_a_chunked_upload_without_content_length() -> None:
    """An upload without Content-Length, chunk after chunk without end: 413 once past the server's cap,
    and the server holds about the cap, not what was sent."""
    from nanogrpo.serve.server import ServerState, Settings
    from tests.test_serve_helpers import TOKEN, VOCAB, LiveServer

    st = ServerState(Settings(vocab_size=VOCAB, max_body=MiB), TOKEN)
    piece = b"x" * (64 << 10)
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent = [0]

    def send_without_end(s: socket.socket) -> None:  # until the server or the test hangs up, or 64 MiB
        try:
            while sent[0] < (64 << 20):
                s.sendall(frame)
                sent[0] += len(piece)
        except OSError:
            pass

    with LiveServer(st) as srv, PeakMemory() as mem:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        s.sendall(f"POST /upload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        sender = threading.Thread(target=send_without_end, args=(s,), daemon=True)
        sender.start()
        answer = b""
        while b"limit" not in answer:
            more = s.recv(4096)
            assert more, answer
            answer += more
        s.shutdown(socket.SHUT_RDWR)
        s.close()
        sender.join(10)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"exceeds the limit of 1048576 bytes" in answer
    assert mem.growth_mb < 2 + SLACK_MB, mem.growth_mb
    assert st.queue.depth() == 0 and st.rejected["too_large"] == 1


# ---------------------------------------------------------------------------- the docs' example


def test_the_docs_example_client_works_and_stops_at_its_cap() -> None:
    """docs/reference/http-bounds.md's example of a new client, run as it is written."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "http-bounds.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.S)
    scope: dict = {}
    exec(compile(code, "http-bounds.md", "exec"), scope)
    routes = {"/ok/v1/models": json_answer({"data": [{"id": "m1"}, {"id": "m2"}]}),
              "/bad/v1/models": endless()}
    with EndlessServer(routes) as srv:
        assert scope["server_models"](srv.url + "/ok") == ["m1", "m2"]
        with pytest.raises(RuntimeError, match=f"the server's model list: reply over {MiB} bytes"):
            scope["server_models"](srv.url + "/bad")
