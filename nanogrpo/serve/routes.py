"""The server's HTTP routes (starlette). All but ``/health`` need ``Authorization: Bearer TOKEN`` when a
token is set; it is checked before a body is read.

    POST /upload            body = RolloutBatch.to_bytes(), X-Batch-Id: ID
                            200 {"queued": true, "id", "depth"} | 200 {"duplicate": true, ...} (ID seen)
                            | 4xx reason | 429/503 + Retry-After (busy / full; retry)
                            | 503 without Retry-After (the reference forward failed; retry)
    GET|POST /get?wait=S    200 batch bytes + X-Batch-Id, X-Lease, X-Lease-Seconds, X-Policy-Version
                            | 204 nothing ready within S seconds
    POST /ack?lease=L       200 {"acked": true, "id", "again"} | 409 the lease lost its batch
                            | 410 the lease is from a previous server instance
    POST /weights           body = safetensors state dict, X-Policy-Version: N, X-Publish-Id: P (optional)
                            200 {"version", "tensors"} | 400 invalid | 409 not newer (+ the server's
                            X-Policy-Version and X-Publish-Id) | 429 another publish is arriving
    GET  /weights?have=N    200 newer weights + X-Policy-Version | 204 nothing newer than N
    GET  /weights/version   {"version": N, "publish_id": P}  (-1: none published yet)
    GET  /health            {"ok": true, "queue_ready": ready batches, "weights_version": N}  (no token)
    GET  /stats             queue, delivery, weights, reference-model and connection figures

Every input is validated before anything changes: headers are ASCII-strict (``[0-9]`` digits,
not whatever ``str.isdigit`` accepts), bodies are read with a size cap and a time limit, a
batch is decoded and validated in full (its ``meta`` too) before it takes a queue slot, and
weights before they replace the old ones (:mod:`nanogrpo.serve.weights`). A bad request
gets a 4xx with a one-line reason and leaves the state as it was.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import math
import os
import re
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from nanogrpo.batch import BatchError, RolloutBatch
from nanogrpo.http_limits import BodyRefused, receive_capped
from nanogrpo.serve.queue import LEASE_RE, AckResult
from nanogrpo.serve.state import Reject, ServerState
from nanogrpo.serve.weights import MAX_VERSION, WeightsError, check_weights_file, weights_cap

OCTET = "application/octet-stream"
ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
"""Batch and publish ids."""
_UINT = re.compile(r"[0-9]{1,16}")
_NUMBER = re.compile(r"-?[0-9]{1,16}(\.[0-9]{1,9})?")
MAX_META_DEPTH = 16
MAX_WORKER_LEN = 128


# ---------------------------------------------------------------------- request helpers


def check_auth(token: str | None, request: Request) -> None:
    if token is None:
        return
    got = request.headers.get("authorization", "")
    if not got:
        raise Reject(401, "auth", "missing token: send 'Authorization: Bearer TOKEN'")
    scheme, _, value = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode("utf-8", "replace"),
                                                               token.encode()):
        raise Reject(401, "auth", "wrong token")


async def read_body(request: Request, cap: int, timeout_s: float) -> bytes:
    """The request body, refusing more than ``cap`` bytes and bodies slower than ``timeout_s``
    (:func:`nanogrpo.http_limits.receive_capped`)."""
    buf = bytearray()
    await _receive(request, cap, timeout_s, buf.extend)
    return bytes(buf)


async def spool_body(request: Request, cap: int, timeout_s: float, path) -> int:
    """:func:`read_body` into the file ``path`` as it arrives (a weights publish: never whole in memory);
    returns its size. The file is removed when the body is refused."""
    try:
        with open(path, "wb") as f:
            return await _receive(request, cap, timeout_s, f.write)
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise


async def _receive(request: Request, cap: int, timeout_s: float, write) -> int:
    try:
        return await receive_capped(request, cap, timeout_s, write)
    except BodyRefused as e:
        raise Reject(e.status, e.reason, e.message) from None


def _file_chunks(f, chunk: int = 1 << 20):
    """An open file's bytes in chunks, then the file closed (a response body starlette iterates in a
    worker thread)."""
    try:
        while data := f.read(chunk):
            yield data
    finally:
        f.close()


def number_param(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not _NUMBER.fullmatch(raw):
        raise Reject(400, "bad_param", f"query parameter {name!r} must be a decimal number")
    v = float(raw)
    if not lo <= v <= hi:
        raise Reject(400, "bad_param", f"query parameter {name!r} must be in [{lo:g}, {hi:g}]")
    return v


def _check_meta(meta: dict) -> None:
    """``meta`` nests at most MAX_META_DEPTH deep and holds only finite numbers (``1e999`` parses as
    inf, which the batch could not be encoded with again); walked without recursion (a hostile header
    may nest 1,000 deep)."""
    stack = [(meta, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > MAX_META_DEPTH:
                raise Reject(400, "bad_batch", f"meta is nested deeper than {MAX_META_DEPTH} levels")
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
        elif isinstance(v, float) and not math.isfinite(v):
            raise Reject(400, "bad_batch", "meta holds a non-finite number")


def decode_batch(st: ServerState, body: bytes) -> RolloutBatch:
    """Decode and validate an uploaded batch in full (tensors, header, meta); :class:`Reject` if bad."""
    try:
        batch = RolloutBatch.from_bytes(body, vocab_size=st.s.vocab_size, max_seqs=st.s.max_seqs,
                                        max_len=st.s.max_len)
    except BatchError as e:
        raise Reject(400, "bad_batch", str(e)) from None
    except Exception as e:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's fault
        raise Reject(400, "bad_batch", f"undecodable batch ({type(e).__name__})") from None
    if batch.policy_version > MAX_VERSION:
        raise Reject(400, "bad_batch", f"policy_version must be at most {MAX_VERSION}")
    _check_meta(batch.meta)
    worker = batch.meta.get("worker", "?")
    if not isinstance(worker, str) or len(worker) > MAX_WORKER_LEN:
        raise Reject(400, "bad_batch", f"meta.worker must be a string of at most {MAX_WORKER_LEN} characters")
    t = batch.meta.get("logprob_temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 100:
        raise Reject(400, "bad_batch", "meta.logprob_temperature must be a number in (0, 100]")
    sup = batch.meta.get("logprob_support")
    if sup is not None and not (isinstance(sup, list) and len(sup) == 2 and type(sup[0]) is int
                                and 0 <= sup[0] <= 1 << 24 and isinstance(sup[1], (int, float))
                                and not isinstance(sup[1], bool) and 0 < sup[1] <= 1):
        raise Reject(400, "bad_batch", "meta.logprob_support must be [top_k >= 0, top_p in (0, 1]] or absent")
    return batch


def _id_header(request: Request, name: str) -> str | None:
    value = request.headers.get(name)
    if value is not None and not ID_RE.fullmatch(value):
        raise Reject(400, "bad_header", f"{name} must be 1-64 characters of [A-Za-z0-9._:-]")
    return value


# ---------------------------------------------------------------------- the routes
# Each handler takes the server's state and the request; create_app binds them to one state.


def guard(st: ServerState, handler, auth: bool = True):
    """``handler(request)`` behind the token check (``auth``) and the refusals: a :class:`Reject` becomes
    its status and one-line reason, counted in ``st.rejected``."""
    async def endpoint(request: Request) -> Response:
        try:
            if auth:
                check_auth(st.token, request)
            return await handler(request)
        except Reject as r:
            st.rejected[r.bucket] += 1
            return PlainTextResponse(r.reason + "\n", status_code=r.status, headers=r.headers or None)
    return endpoint


def _busy(st: ServerState, reason: str) -> Reject:
    return Reject(503, "queue_full", reason, st.s.retry_after_s)


def _retry_later(st: ServerState, bucket: str, reason: str) -> Reject:
    return Reject(429, bucket, reason, st.s.retry_after_s)


async def health(st: ServerState, request: Request) -> Response:
    return JSONResponse({"ok": True, "queue_ready": len(st.queue.ready), "weights_version": st.relay.version})


async def stats(st: ServerState, request: Request) -> Response:
    return JSONResponse(st.stats())


def _admit_upload(st: ServerState, bid: str) -> None:
    """Refuse an upload before its body is read: its batch is being processed, the queue is full, the
    reference model or the upload slots are busy."""
    q = st.queue
    if bid in q.processing:
        raise _retry_later(st, "in_progress", f"batch {bid} is being processed; retry later")
    if q.full() and not q.seen(bid):  # a retry of a queued batch is told "duplicate" instead
        raise _busy(st, f"queue full ({q.capacity} batches); retry later")
    if st.ref_fn is not None and st.pending >= st.s.max_pending:
        raise _retry_later(st, "busy", "reference model busy; retry later")
    if st.reading >= st.s.max_reading:
        raise _retry_later(st, "busy", f"{st.reading} uploads already arriving; retry later")


async def upload(st: ServerState, request: Request) -> Response:
    q = st.queue
    bid = _id_header(request, "x-batch-id") or uuid.uuid4().hex
    _admit_upload(st, bid)
    st.reading += 1
    try:
        body = await read_body(request, st.s.max_body, st.s.body_timeout_s)
    finally:
        st.reading -= 1
    batch = await asyncio.to_thread(decode_batch, st, body) if len(body) > (1 << 20) \
        else decode_batch(st, body)
    # valid: the queue's state decides (it may also have moved while the body arrived)
    if bid in q.processing:
        raise _retry_later(st, "in_progress", f"batch {bid} is being processed; retry later")
    if q.seen(bid):
        st.duplicates += 1
        return JSONResponse({"queued": False, "duplicate": True, "id": bid, "depth": q.depth()})
    if q.full():
        raise _busy(st, f"queue full ({q.capacity} batches); retry later")
    q.begin(bid)  # holds a slot and the id; abandoned (id free for a retry) if anything below fails
    try:
        if st.ref_fn is not None:
            body = await st.add_reference(batch)  # Reject(503) on failure: the client retries
        q.put(bid, body, batch.policy_version)
    finally:
        q.abandon(bid)
    st.count_upload(batch)
    st.new_batch()
    return JSONResponse({"queued": True, "id": bid, "depth": q.depth()})


async def get(st: ServerState, request: Request) -> Response:
    q = st.queue
    wait = number_param(request, "wait", 0.0, 0.0, st.s.max_wait_s)
    deadline = time.monotonic() + wait
    while True:
        if await request.is_disconnected():  # a long poll whose client left must not take a batch
            return Response(status_code=204, headers={"X-Queue-Depth": str(q.depth())})
        item = q.lease()
        if item is not None:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            return Response(status_code=204, headers={"X-Queue-Depth": str(q.depth())})
        ev = st.event()
        ev.clear()
        try:
            await asyncio.wait_for(ev.wait(), min(left, 0.5))
        except asyncio.TimeoutError:
            pass
    st.record_state()
    headers = {"X-Batch-Id": item.id, "X-Lease": item.lease, "X-Lease-Seconds": f"{q.lease_s:g}",
               "X-Policy-Version": str(item.version), "X-Queue-Depth": str(q.depth())}
    # the lease's clock starts once the body has gone out
    return Response(item.body, media_type=OCTET, headers=headers,
                    background=BackgroundTask(q.start_clock, item.lease))


async def ack(st: ServerState, request: Request) -> Response:
    lease = request.query_params.get("lease") or request.headers.get("x-lease") or ""
    if not LEASE_RE.fullmatch(lease):
        raise Reject(400, "bad_param", "lease must be the X-Lease of a /get answer")
    result, bid = st.queue.ack(lease)
    if result in (AckResult.ACKED, AckResult.AGAIN):
        st.record_state()
        return JSONResponse({"acked": True, "id": bid, "again": result == AckResult.AGAIN})
    if result == AckResult.OTHER_SERVER:
        raise Reject(410, "ack_gone", "lease from a previous server instance: its queue is gone")
    raise Reject(409, "ack_lost", f"lease {lease} no longer holds its batch: it ran out and the batch "
                                  "went to another consumer, or was dropped as stale")


def _check_version(relay, version: int) -> None:
    """A publish of ``version`` is refused unless it is newer than the relay's (409, with the relay's
    version and publish id) and within the bounded step (400)."""
    why = relay.check_version(version)
    if why == "old":
        raise Reject(409, "old_version", f"version {version} is not newer than the server's "
                     f"{relay.version}", headers={"X-Policy-Version": str(relay.version),
                                                  "X-Publish-Id": relay.publish_id})
    if why:
        raise Reject(400, "bad_version", why)


async def _receive_weights(st: ServerState, request: Request, version: int, pid: str) -> tuple[int, dict]:
    """The publish's body spooled to disk and checked against the model's layout, then taken as the
    relay's weights; returns its size and the tensors' shapes."""
    relay = st.relay
    cap = st.s.max_weights_body if relay.layout is None else \
        min(st.s.max_weights_body, weights_cap(relay.layout))  # no more than the model can hold
    spooled = relay.spool_path()
    size = await spool_body(request, cap, st.s.body_timeout_s * 10, spooled)
    try:
        shapes = await asyncio.to_thread(check_weights_file, spooled, relay.layout)
        _check_version(relay, version)
    except BaseException as e:
        spooled.unlink(missing_ok=True)
        if isinstance(e, WeightsError):
            raise Reject(400, "bad_weights", str(e)) from None
        raise
    relay.accept(spooled, version, pid, shapes)
    return size, shapes


async def publish(st: ServerState, request: Request) -> Response:
    relay = st.relay
    raw = request.headers.get("x-policy-version", "")
    if not _UINT.fullmatch(raw):
        raise Reject(400, "bad_header", "X-Policy-Version must be a non-negative integer (ASCII digits)")
    version = int(raw)
    pid = _id_header(request, "x-publish-id") or ""
    _check_version(relay, version)
    if relay.busy:
        raise _retry_later(st, "busy", "another weights upload is in progress")
    relay.busy = True
    try:
        size, shapes = await _receive_weights(st, request, version, pid)
    finally:
        relay.busy = False
    st.expire_stale()
    st.log.info("policy version %d published (%d tensors, %.1f MB)", version, len(shapes), size / 1e6)
    return JSONResponse({"version": version, "tensors": len(shapes)})


async def weights(st: ServerState, request: Request) -> Response:
    relay = st.relay
    have = int(number_param(request, "have", -1, -1, MAX_VERSION))
    headers = {"X-Policy-Version": str(relay.version), "X-Publish-Id": relay.publish_id}
    if relay.path is None or relay.version <= have:
        return Response(status_code=204, headers=headers)
    f = relay.open()  # opened at once: a publish meanwhile replaces the file, not what this reply sends
    headers["Content-Length"] = str(os.fstat(f.fileno()).st_size)
    return StreamingResponse(_file_chunks(f), media_type=OCTET, headers=headers)


async def weights_version(st: ServerState, request: Request) -> Response:
    return JSONResponse({"version": st.relay.version, "publish_id": st.relay.publish_id})


ROUTES = [("/health", health, ["GET"]), ("/stats", stats, ["GET"]), ("/upload", upload, ["POST"]),
          ("/get", get, ["GET", "POST"]), ("/ack", ack, ["POST"]), ("/weights", publish, ["POST"]),
          ("/weights", weights, ["GET"]), ("/weights/version", weights_version, ["GET"])]
"""Path, handler, methods; every route but ``/health`` needs the token."""


def create_app(st: ServerState) -> Starlette:
    """The server's app: :data:`ROUTES` bound to ``st`` behind :func:`guard`, and ``nanogrpo serve
    --teacher``'s routes when it has a teacher (prompts scored as a vLLM server scores them)."""
    guarded = functools.partial(guard, st)
    routes = [Route(path, guarded(functools.partial(handler, st), auth=handler is not health),
                    methods=methods) for path, handler, methods in ROUTES]
    if st.teacher is not None:
        from nanogrpo.serve.teacher import teacher_routes

        routes += teacher_routes(st, guarded, read_body)
    app = Starlette(routes=routes)
    app.state.nanogrpo = st
    return app
