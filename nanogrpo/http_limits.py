"""Every HTTP body nanogrpo reads is read with a cap: a peer that answers 200 and streams without end
(an attacker, a broken proxy) costs a bounded amount of memory and one clear error, never the process.

The API (works with ``httpx`` clients and any client with its interface, e.g. huggingface_hub's
``httpx2``)::

    from nanogrpo import http_limits

    r = http_limits.request(client, "GET", url, cap=http_limits.SMALL, timeout=5.0)   # httpx.Client
    r = await http_limits.arequest(client, "POST", url, cap=1 << 20, json=body)      # httpx.AsyncClient
    r.status_code, r.headers, r.content, r.text, r.json()      # an ordinary response, its body read

    with client.stream("GET", url) as resp:                   # a response you opened streaming
        data = http_limits.read_capped(resp, cap)              # (async: await aread_capped(resp, cap))

Rules, the same for every client:

- a 2xx body is read as it arrives and at most ``cap`` bytes of it: one byte more raises
  :class:`BodyError` (``str``: ``reply over CAP bytes from URL``); a ``Content-Length`` above the cap
  raises before any of the body is read. The connection is closed, not returned to the pool;
- any other answer (an error page: the caller wants its status and first line) is read up to
  :data:`ERROR_BODY` bytes and cut there, without an error; the connection of a 5xx answer is not
  reused (a server whose handler raised closes it right after answering, and a request sent on it in
  that moment reads a reset: a healthy server taken for a dead one);
- the request asks for ``Accept-Encoding: identity``. A body compressed anyway (gzip, deflate) is
  decoded here with the cap on the *decoded* bytes, 64 KiB at a time (a 64 KiB gzip of zeros
  decodes to 64 MiB: httpx's own decoder would hold it all); another encoding is a :class:`BodyError`;
- a body of ``n`` bytes briefly costs ``2n`` when its pieces are joined (as ``httpx``'s own read);
- time is the caller's: pass a timeout (``httpx``'s bounds each read; the judge also bounds the whole
  request), or a peer that trickles under the cap holds the caller for as long as it trickles.

Each client, what it reads, its bound, and what happens past it (docs/reference/http-bounds.md has
the same table):

- ``judge:URL`` (:mod:`nanogrpo.rewards.judges.judge`): ``/chat/completions`` replies and ``/models``, at most
  ``rewards.judge_max_reply_bytes`` (1 MiB) each; past it the row scores the penalty as an error
  (``reply over N bytes``, counted in ``judge/errors``, not retried) and the run goes on. Memory:
  at most ``judge_concurrency`` x the cap.
- ``ServerClient`` (:mod:`nanogrpo.serve.client`, split mode): ``GET /get``, a rollout batch, at most
  2 x ``server.max_body_mb`` (the server's upload cap, plus the reference log-probs it adds);
  ``GET /weights`` at most the receiver's model's size, every tensor of its layout at 8 bytes an
  element (F64, the widest accepted) plus the safetensors header
  (:func:`nanogrpo.serve.weights.weights_cap`); every other answer (``/health``, ``/stats``,
  ``/upload``, ``/ack``, ``/weights/version``, a publish's answer) :data:`SMALL`. Past it: a
  :class:`~nanogrpo.serve.client.ServerError` at once, not retried.
- The server tier's ``ServerClient`` (:mod:`nanogrpo.engines.vllm_server.http`): a ``vllm serve``'s
  ``POST /inference/v1/generate`` answer (one sample) at most 64 KiB + 1 KiB per token it may take
  (:func:`~nanogrpo.engines.vllm_server.http.generate_cap`); ``/health``, ``/pause``, ``/resume``,
  ``/weight_info``, ``/update_weight_version`` and the weight-transfer routes :data:`SMALL`. Past it: a
  ``ServerFault`` (that request fails on that server; a sync step's failure takes the server out).
- ``openenv:URL`` (:mod:`nanogrpo.envs.adapters.openenv`): the server's ``/schema`` at start, at most
  1 MiB (past it: one line at start); its WebSocket messages at most ``env.kwargs.max_message_bytes``
  (1 MiB, the client library's own limit).
- The agent endpoint (:mod:`nanogrpo.episodes.endpoint`) is a server: request bodies capped at 1 MiB
  while they stream (413).
- Hub checks (:mod:`nanogrpo.hub`: a model's ``config.json`` in :mod:`nanogrpo.models.source`, a
  dataset in :mod:`nanogrpo.data.sources`): HEAD requests, so no body at all; headers are capped at
  100 KiB by httpcore's parser.

Not nanogrpo's reads: ``transformers`` and ``datasets`` download models and datasets with their own
clients (to disk); point ``HF_ENDPOINT`` only at a hub you trust.
A new client reads through this module, with a bound that fits what it reads, and adds its row here.

Servers nanogrpo runs (``nanogrpo serve``, the agent endpoint) read each request body through
:func:`receive_capped`: as it arrives, with or without ``Content-Length``, refused (:class:`BodyRefused`)
past its cap (413), past its deadline (408), or when it is shorter than declared or its client left (400),
before any of it is parsed (``nanogrpo serve``: 413 past ``server.max_body_mb``; headers: 64 KiB).
"""

from __future__ import annotations

import asyncio
import re
import socket
import zlib
from typing import Any

from nanogrpo.errors import NanoGRPOError

__all__ = ["ERROR_BODY", "SMALL", "BodyError", "BodyRefused", "aread_capped", "arequest", "read_capped",
           "receive_capped", "request"]

SMALL = 1 << 20
"""A health, stats or other JSON answer of a few kilobytes: 1 MiB."""
ERROR_BODY = 64 << 10
"""What is read of an answer that is not 2xx (for its reason); the rest is left unread."""
_DECODE_STEP = 64 << 10
"""Decoded bytes produced per step when a body comes compressed."""
_DROP = ("content-encoding", "content-length", "transfer-encoding")
_UINT = re.compile(r"[0-9]{1,16}")


class BodyError(NanoGRPOError):
    """A body was not read: over its cap, or in an encoding not asked for. ``cap``, ``url`` say which."""

    def __init__(self, message: str, url: str, cap: int):
        super().__init__(message)
        self.url, self.cap = url, cap


def request(client: Any, method: str, url: str, *, cap: int, sink: Any = None, **kw: Any) -> Any:
    """``client.request(method, url, **kw)`` with its body read under ``cap`` (module docstring): a
    response like the client's own, its body in ``.content``. Raises :class:`BodyError`. ``sink`` (a
    binary file): a 2xx body is written there as it arrives, not kept (``.content`` is then empty)."""
    with client.stream(method, url, headers=_identity(kw.pop("headers", None)), **kw) as resp:
        return _with_body(resp, read_capped(resp, cap, sink))


async def arequest(client: Any, method: str, url: str, *, cap: int, **kw: Any) -> Any:
    """:func:`request` for an async client (``httpx.AsyncClient``)."""
    async with client.stream(method, url, headers=_identity(kw.pop("headers", None)), **kw) as resp:
        return _with_body(resp, await aread_capped(resp, cap))


def read_capped(resp: Any, cap: int, sink: Any = None) -> bytes:
    """The body of a response opened streaming, at most ``cap`` bytes of it when it is 2xx (else cut at
    :data:`ERROR_BODY`); raises :class:`BodyError` and closes ``resp`` past the cap. ``sink``: as
    :func:`request`'s."""
    body = _Body(resp, cap, sink)
    try:
        if body.declared_too_large():
            body.over()
        if resp.is_stream_consumed:  # built in memory (a mock transport): already read and decoded
            return body.whole(resp.content)
        for raw in resp.iter_raw():
            if body.feed(raw):
                break
        return body.finish()
    except BodyError:
        resp.close()
        raise
    finally:
        if body.cut:
            resp.close()
        elif resp.status_code >= 500:
            _not_reused(resp)


async def aread_capped(resp: Any, cap: int) -> bytes:
    """:func:`read_capped` for a response of an async client."""
    body = _Body(resp, cap)
    try:
        if body.declared_too_large():
            body.over()
        if resp.is_stream_consumed:
            return body.whole(resp.content)
        async for raw in resp.aiter_raw():
            if body.feed(raw):
                break
        return body.finish()
    except BodyError:
        await resp.aclose()
        raise
    finally:
        if body.cut:
            await resp.aclose()
        elif resp.status_code >= 500:
            _not_reused(resp)


# ---------------------------------------------------------------------- request bodies (servers)


class BodyRefused(NanoGRPOError):
    """A request body a server refused while reading it: ``status`` (400, 408 or 413), ``reason`` (a tag:
    ``bad_header``, ``too_large``, ``slow_client``, ``disconnect``, ``truncated``) and a one-line message."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


async def receive_capped(request: Any, cap: int, timeout_s: float, write: Any) -> int:
    """Hand a request's body (starlette's ``Request``) to ``write`` chunk by chunk as it arrives; returns
    its size. Refused (:class:`BodyRefused`): more than ``cap`` bytes (before any is read when
    ``Content-Length`` says so), a body slower than ``timeout_s``, a client that left, a body shorter
    than declared, a ``Content-Length`` that is not ASCII digits."""
    from starlette.requests import ClientDisconnect

    cl = request.headers.get("content-length")
    if cl is not None:
        if not _UINT.fullmatch(cl):
            raise BodyRefused(400, "bad_header", "Content-Length is not a non-negative integer")
        if int(cl) > cap:
            raise BodyRefused(413, "too_large", f"body of {cl} bytes exceeds the limit of {cap} bytes")
    size = 0

    async def pull() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise BodyRefused(413, "too_large", f"body exceeds the limit of {cap} bytes")
            write(chunk)

    try:
        await asyncio.wait_for(pull(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyRefused(408, "slow_client", f"body not received within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise BodyRefused(400, "disconnect", "client disconnected before the body was complete") from None
    if cl is not None and size != int(cl):
        raise BodyRefused(400, "truncated", f"body has {size} bytes but Content-Length says {cl}")
    return size


# ---------------------------------------------------------------------- internals


def _identity(headers: Any) -> Any:
    out = {"Accept-Encoding": "identity"}
    if headers:
        out.update(headers)
    return out


def _not_reused(resp: Any) -> None:
    """Shut the connection of ``resp`` down, so that the client's pool drops it instead of reusing it."""
    stream = (getattr(resp, "extensions", None) or {}).get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass


def _with_body(resp: Any, data: bytes) -> Any:
    """A response of the client's own class holding ``data`` (already decoded: no Content-Encoding)."""
    headers = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in _DROP]
    return type(resp)(resp.status_code, headers=headers, content=data, request=resp.request)


class _Body:
    """One body being read: the bytes so far, the decoder of a compressed one, the cap that applies."""

    def __init__(self, resp: Any, cap: int, sink: Any = None):
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        self.url = str(resp.request.url) if _has_request(resp) else "the server"
        self.ok = 200 <= resp.status_code < 300
        self.sink = sink if self.ok else None
        self.cap = cap if self.ok else ERROR_BODY
        self.declared = resp.headers.get("content-length", "")
        self.parts: list[bytes] = []
        self.size = 0
        self.cut = False  # stopped before the end: the connection cannot be reused
        enc = resp.headers.get("content-encoding", "").strip().lower()
        self.decoder = None
        if enc in ("gzip", "x-gzip"):
            self.decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif enc == "deflate":
            self.decoder = zlib.decompressobj()
        elif enc not in ("", "identity"):
            self.cut = True
            if self.ok:
                raise BodyError(f"reply in Content-Encoding {enc[:40]!r} from {self.url}, though identity "
                                "was asked: not read", self.url, cap)
            self.parts.append(f"(body in Content-Encoding {enc[:40]!r}, not read)".encode())
            self.cap = 0

    def declared_too_large(self) -> bool:
        return self.ok and self.decoder is None and self.declared.isdigit() and int(self.declared) > self.cap

    def over(self) -> None:
        raise BodyError(f"reply over {self.cap} bytes from {self.url} (stopped reading there)", self.url,
                        self.cap)

    def feed(self, raw: bytes) -> bool:
        """Take one piece off the wire; True once the body is cut (non-2xx past ERROR_BODY)."""
        if self.cap == 0 and self.cut:
            return True
        if self.decoder is None:
            return self._add(raw)
        try:
            while raw:
                if self._add(self.decoder.decompress(raw, min(_DECODE_STEP, self.cap - self.size + 1))):
                    return True
                raw = self.decoder.unconsumed_tail
        except zlib.error as e:
            raise BodyError(f"reply from {self.url} is not valid compressed data ({e})", self.url,
                            self.cap) from None
        return False

    def whole(self, content: bytes) -> bytes:
        self.decoder = None
        self._add(content)
        return b"".join(self.parts)

    def finish(self) -> bytes:
        if self.decoder is not None and not self.cut:
            try:
                self._add(self.decoder.flush())
            except zlib.error as e:
                raise BodyError(f"reply from {self.url} is not valid compressed data ({e})", self.url,
                                self.cap) from None
        return b"".join(self.parts)

    def _add(self, data: bytes) -> bool:
        if self.size + len(data) > self.cap:
            if self.ok:
                self.over()
            self.parts.append(data[:self.cap - self.size])
            self.size = self.cap
            self.cut = True
            return True
        if data:
            if self.sink is not None:
                self.sink.write(data)
            else:
                self.parts.append(data)
            self.size += len(data)
        return False


def _has_request(resp: Any) -> bool:
    try:
        resp.request  # noqa: B018 - httpx raises RuntimeError when a response has none
    except RuntimeError:
        return False
    return True
