"""Exactly-once delivery: leases, acknowledgements, re-delivery under the same id (queue and HTTP)."""

from __future__ import annotations

import asyncio

import httpx

from nanogrpo.serve.queue import AckResult, BatchQueue
from nanogrpo.serve.server import ServerState, Settings, create_app
from tests.test_serve_helpers import TOKEN, VOCAB, make_batch

AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _queue(capacity: int = 4, lease_s: float = 10.0) -> tuple[BatchQueue, Clock]:
    clock = Clock()
    return BatchQueue(capacity, lease_s, remember=8, clock=clock), clock


def test_a_batch_leaves_only_when_acked_and_a_lapsed_lease_brings_it_back_first():
    q, clock = _queue()
    q.put("a", b"A", 0)
    q.put("b", b"B", 0)
    first = q.lease()
    old = first.lease
    assert first.id == "a" and q.depth() == 2
    q.start_clock(old)
    clock.t = 9.9
    assert q.lease().id == "b"                    # a's lease still runs
    clock.t = 10.1
    again = q.lease()                             # a's lease ran out: a comes back, first in line
    assert again.id == "a" and again.lease != old and q.redelivered == 1
    assert q.ack(old) == (AckResult.LOST, "a")                  # the old lease lost it to the new one
    assert q.ack(again.lease) == (AckResult.ACKED, "a")
    assert q.ack(again.lease) == (AckResult.AGAIN, "a")         # a retried ack is answered the same way
    assert q.acked == 1 and q.seen("a")


def test_the_lease_clock_starts_when_the_body_has_gone_out():
    q, clock = _queue(lease_s=1.0)
    q.put("a", b"A", 0)
    item = q.lease()
    clock.t = 100.0                               # a slow send: the lease has not started running
    assert q.lease() is None
    q.start_clock(item.lease)
    clock.t = 100.5
    assert q.lease() is None
    clock.t = 101.5
    assert q.lease().id == "a"


def test_a_late_ack_wins_while_nobody_else_holds_the_batch():
    q, clock = _queue(lease_s=1.0)
    q.put("a", b"A", 0)
    lease = q.lease().lease
    q.start_clock(lease)
    clock.t = 2.0
    q.expire_leases()                              # back in the queue, not delivered again yet
    assert len(q.ready) == 1
    assert q.ack(lease) == (AckResult.ACKED, "a")
    assert not q.ready and q.lease() is None


def test_leases_of_another_server_instance_and_unknown_ones():
    q, _ = _queue()
    other, _ = _queue()
    other.put("a", b"A", 0)
    lease = other.lease().lease
    assert q.ack(lease)[0] == AckResult.OTHER_SERVER
    assert q.ack(f"{q.instance}.99.deadbeef")[0] == AckResult.UNKNOWN


def test_ids_are_seen_while_processing_queued_leased_and_after_ack_and_freed_by_abandon():
    q, _ = _queue()
    q.begin("a")
    assert q.seen("a") and q.depth() == 1
    q.abandon("a")                                 # e.g. the reference forward failed
    assert not q.seen("a") and q.depth() == 0
    q.begin("a")
    q.put("a", b"A", 0)
    assert q.seen("a") and q.depth() == 1
    q.ack(q.lease().lease)
    assert q.seen("a") and q.depth() == 0


def test_stale_drop_spares_leased_batches_and_is_remembered():
    q, _ = _queue()
    for i, v in enumerate([0, 0, 5]):
        q.put(f"b{i}", b"x", v)
    q.lease()                                      # b0 is in flight: not the server's to drop
    assert q.drop_older_than(3) == 1 and [it.id for it in q.ready] == ["b2"]
    assert q.seen("b1") and q.expired == 1


def test_memory_of_done_ids_and_old_leases_is_bounded():
    q, _ = _queue(capacity=100)
    for i in range(50):
        q.put(f"b{i}", b"x", 0)
        q.ack(q.lease().lease)
    assert len(q.done) <= 8 and len(q.old_leases) <= 8


def _state(**kw) -> ServerState:
    return ServerState(Settings(vocab_size=VOCAB, max_seqs=64, max_len=64, max_body=64 << 10, **kw), TOKEN)


def test_http_get_leases_ack_confirms_and_an_unacked_batch_is_delivered_again():
    # the queue's clock is the test's: on the wall clock a 0.2 s lease could lapse between the first and
    # the second GET on a busy shared machine, and the batch would rightly be handed out twice
    st = _state(lease_s=0.2)
    clock = Clock()
    st.queue.clock = clock
    body = make_batch().to_bytes()

    async def fn(c):
        r = await c.post("/upload", content=body, headers={**AUTH, "X-Batch-Id": "w-1"})
        assert r.status_code == 200
        r1 = await c.get("/get", headers=AUTH)
        assert r1.status_code == 200 and r1.headers["x-batch-id"] == "w-1" and r1.headers["x-lease"]
        assert (await c.get("/get", headers=AUTH)).status_code == 204        # leased: not handed out twice
        clock.t += 0.3                                                        # the consumer never acks
        r2 = await c.get("/get", params={"wait": 1}, headers=AUTH)
        assert r2.status_code == 200 and r2.headers["x-batch-id"] == "w-1" and r2.content == body
        r = await c.post("/ack", params={"lease": r1.headers["x-lease"]}, headers=AUTH)
        assert r.status_code == 409
        r = await c.post("/ack", params={"lease": r2.headers["x-lease"]}, headers=AUTH)
        assert r.status_code == 200 and r.json() == {"acked": True, "id": "w-1", "again": False}
        r = await c.post("/ack", headers={**AUTH, "X-Lease": r2.headers["x-lease"]})
        assert r.status_code == 200 and r.json()["again"]
        assert (await c.post("/ack", params={"lease": "nope"}, headers=AUTH)).status_code == 400
        # a re-upload of a batch already consumed is a duplicate, not a second copy
        r = await c.post("/upload", content=body, headers={**AUTH, "X-Batch-Id": "w-1"})
        assert r.json()["duplicate"] and st.queue.depth() == 0
        s = (await c.get("/stats", headers=AUTH)).json()
        assert s["batches_out"] == 1 and s["delivered"] == 2 and s["redelivered"] == 1

    async def main():
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            await fn(c)
    asyncio.run(main())
