"""``ServerClient``: the one way workers and the trainer talk to ``nanogrpo serve``.

Every request has a timeout. Connection failures, timeouts, 5xx and "busy"
answers (429/503, honouring ``Retry-After``) are retried with exponential
backoff and jitter for up to ``retry_for_s`` seconds from the first failure, then raise
:class:`ServerError` (a server that keeps answering "busy, retry after" is alive, and is
waited for without limit); a 4xx that retrying cannot fix raises at once with the
server's one-line reason. Uploads carry an ``X-Batch-Id`` that stays the same
across retries, so a retry after a lost answer never queues a batch twice.

``get`` returns a :class:`Delivery` under a lease; the consumer acknowledges it with
``ack`` once the batch is safe with it (the server then forgets it; an unacknowledged lease
puts it back in the queue). Publishing is idempotent for its own retries (``X-Publish-Id``)
and refuses loudly when the server holds a newer version from someone else. Fetched
weights are validated against the receiver's model before anything is copied
(:func:`load_published`).

Every answer is read with a cap (:mod:`nanogrpo.http_limits`): a batch at most ``max_batch_bytes``
(2 x ``server.max_body_mb``), weights at most the receiver's model's size
(:func:`~nanogrpo.serve.weights.weights_cap`), anything else 1 MiB. An answer past its cap is a
:class:`ServerError` at once (not retried: the same answer would come again), never a buffer
without end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file

from nanogrpo import http_limits
from nanogrpo.batch import RolloutBatch
from nanogrpo.errors import NanoGRPOError
from nanogrpo.serve.auth import auth_headers
from nanogrpo.serve.weights import WeightLayout, WeightsError, check_weights, check_weights_file, weights_cap

log = logging.getLogger("nanogrpo.serve.client")
WEIGHTS_FORMAT = "nanogrpo.weights/1"


def batch_read_cap(max_body_mb: float) -> int:
    """The most of a batch a client reads from ``/get`` when the server's upload cap is ``max_body_mb``
    MiB: twice it (the server adds reference log-probs, 4 bytes a completion token: less than the batch's
    own 8-byte token ids)."""
    return int(2 * max_body_mb * (1 << 20))


MAX_BATCH_BYTES = batch_read_cap(256.0)


class ServerError(NanoGRPOError):
    """The server refused a request for good, or stayed away longer than the retry budget."""


def _publishable(state_dict: dict[str, torch.Tensor], version: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors to send (those sharing storage, tied embeddings, once; on the CPU) and the metadata."""
    seen: set[tuple[int, int]] = set()
    storages: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        ptr = v.untyped_storage().data_ptr()
        key = (ptr, v.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        v = v.detach()
        if v.device.type != "cpu":
            v = v.to("cpu")
        elif ptr in storages:  # another view of a storage already sent (safetensors refuses shared memory)
            v = v.clone()
        storages.add(ptr)
        out[k] = v.contiguous()
    return out, {"nanogrpo": json.dumps({"format": WEIGHTS_FORMAT, "version": version})}


def encode_state_dict(state_dict: dict[str, torch.Tensor], version: int) -> bytes:
    """Safetensors bytes of a state dict; tensors sharing storage (tied embeddings) are sent once."""
    tensors, meta = _publishable(state_dict, version)
    return st_save(tensors, metadata=meta)


def write_state_dict(state_dict: dict[str, torch.Tensor], version: int, path) -> int:
    """:func:`encode_state_dict` into the file ``path`` (a publish streams it from there: the body is
    never a second copy of the weights in memory); returns its size."""
    tensors, meta = _publishable(state_dict, version)
    st_save_file(tensors, str(path), metadata=meta)
    return os.path.getsize(path)


class _FileBody:
    """A request body read from a file in chunks, from its start at every attempt (retries resend it)."""

    def __init__(self, path, chunk: int = 1 << 20):
        self.path, self.chunk = path, chunk

    def __iter__(self):
        with open(self.path, "rb") as f:
            while data := f.read(self.chunk):
                yield data


def decode_state_dict(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)


def load_published(data, layout: WeightLayout) -> dict[str, torch.Tensor]:
    """Published weights (bytes, or the path of a file holding them) as a state dict, after checking them
    in full against the receiver's model (:func:`nanogrpo.serve.weights.check_weights`); raises
    :class:`~nanogrpo.serve.weights.WeightsError` (or the decoder's error) before anything is loaded."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        check_weights(bytes(data), layout)
        return st_load(bytes(data))
    check_weights_file(data, layout)
    return st_load_file(str(data))


@dataclass
class Delivery:
    """A batch taken from the server under a lease (acknowledge it with :meth:`ServerClient.ack`)."""

    body: bytes
    batch_id: str
    lease: str
    policy_version: int


class ServerClient:
    """``max_batch_bytes``: the most of a batch ``get`` reads (2 x the server's upload cap: a batch
    grows by the reference log-probs the server adds)."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 60.0,
                 retry_for_s: float = 600.0, backoff_min_s: float = 0.25, backoff_max_s: float = 10.0,
                 max_batch_bytes: int = MAX_BATCH_BYTES):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_batch_bytes = int(max_batch_bytes)
        self.retry_for_s = retry_for_s
        self.backoff = (backoff_min_s, backoff_max_s)
        self.http = httpx.Client(base_url=self.url, headers=auth_headers(token),
                                 timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)))
        self.retries = 0

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ core
    def _request(self, method: str, path: str, what: str, *, ok: tuple[int, ...] = (200,),
                 timeout: float | None = None, cap: int = http_limits.SMALL,
                 too_large: str = "is the URL a nanogrpo server, no proxy between sending without end?",
                 into=None, **kw) -> httpx.Response:
        """One request, retried as the module docstring says; its answer read with at most ``cap``
        bytes (past it: :class:`ServerError` saying ``too_large``, not retried). ``into``: a path a 2xx
        answer's body is written to (from its start at every attempt), not kept in memory."""
        deadline: float | None = None  # the retry window opens at the first failure: a slow attempt
        delay = self.backoff[0]         # that then fails (a lost answer) still gets its retries
        away_since: float | None = None
        while True:
            try:
                with open(into, "wb") if into is not None else contextlib.nullcontext() as sink:
                    r = http_limits.request(self.http, method, path, cap=cap, sink=sink,
                                            timeout=timeout or httpx.USE_CLIENT_DEFAULT, **kw)
                if r.status_code in ok:
                    if away_since is not None:
                        log.info("%s: server %s answered again after %.1f s", what, self.url,
                                    time.monotonic() - away_since)
                    return r
                reason = r.text.strip().splitlines()[0][:300] if r.text.strip() else ""
                if r.status_code in (408, 429, 503) or r.status_code >= 500:
                    problem = f"HTTP {r.status_code} {reason}"
                    ra = r.headers.get("retry-after", "")
                    wait = min(float(ra), 60.0) if ra.isdigit() else delay
                    if ra.isdigit() and r.status_code in (429, 503):
                        # busy, not away (e.g. the queue is full because the trainer is slower than
                        # the workers): wait as long as it takes, the server is alive
                        deadline = time.monotonic() + self.retry_for_s
                else:
                    raise ServerError(f"{what}: server {self.url} refused with HTTP {r.status_code}: "
                                      f"{reason}")
            except http_limits.BodyError as e:
                raise ServerError(f"{what}: server {self.url} sent a {e}: {too_large}") from None
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {str(e)[:200]}"
                wait = delay
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.retry_for_s
            if now + wait > deadline:
                raise ServerError(f"{what}: server {self.url} unavailable for {self.retry_for_s:.0f} s "
                                  f"(last: {problem}); is `nanogrpo serve` running?")
            if away_since is None:
                away_since = now
                log.warning("%s: %s; retrying with backoff for up to %.0f s", what, problem, self.retry_for_s)
            else:
                log.debug("%s: %s; retrying", what, problem)
            self.retries += 1
            time.sleep(wait * (0.75 + 0.5 * random.random()))
            delay = min(delay * 2, self.backoff[1])

    # ------------------------------------------------------------------ endpoints
    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health", "health").json()

    def stats(self) -> dict[str, Any]:
        return self._request("GET", "/stats", "stats").json()

    def upload(self, batch: RolloutBatch | bytes, batch_id: str | None = None) -> dict[str, Any]:
        """Queue a batch under ``batch_id`` (default: a fresh one), the same id on every retry."""
        body = batch if isinstance(batch, bytes) else batch.to_bytes()
        headers = {"X-Batch-Id": batch_id or uuid.uuid4().hex, "Content-Type": "application/octet-stream"}
        return self._request("POST", "/upload", "upload", content=body, headers=headers).json()

    def get(self, wait_s: float = 10.0) -> Delivery | None:
        """The next ready batch, leased to us, waiting up to ``wait_s`` seconds on the server; None when
        none came. Acknowledge it with :meth:`ack` (else it goes back in the queue after the lease)."""
        r = self._request("GET", "/get", "get batch", ok=(200, 204), params={"wait": wait_s},
                          timeout=self.timeout_s + wait_s, cap=self.max_batch_bytes,
                          too_large="a batch larger than this side reads: set server.max_body_mb here to the "
                                    "server's --max-body-mb (or check for a proxy that sends without end)")
        if r.status_code == 204:
            return None
        try:
            return Delivery(r.content, r.headers["x-batch-id"], r.headers["x-lease"],
                            int(r.headers["x-policy-version"]))
        except (KeyError, ValueError):
            raise ServerError(f"get batch: server {self.url} answered without a batch id, lease and "
                              "version: is it a nanogrpo server of this version?") from None

    def ack(self, lease: str) -> str:
        """Acknowledge a delivery: ``acked`` (the batch is ours; also for a repeated ack), ``lost`` (the
        lease ran out and the batch went to another consumer: drop our copy), or ``gone`` (the server
        restarted since: its queue, that batch included, is gone, so nobody else gets it)."""
        r = self._request("POST", "/ack", "acknowledge batch", ok=(200, 409, 410), params={"lease": lease})
        return {200: "acked", 409: "lost", 410: "gone"}[r.status_code]

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Publish weights as ``version``. A retry whose first attempt landed is a success; a server
        holding a newer version from someone else is a :class:`ServerError`."""
        pid = uuid.uuid4().hex
        with tempfile.TemporaryDirectory(prefix="nanogrpo-publish-") as tmp:
            path = Path(tmp) / "weights.safetensors"
            size = write_state_dict(state_dict, version, path)
            r = self._request("POST", "/weights", "publish weights", ok=(200, 409), content=_FileBody(path),
                              headers={"X-Policy-Version": str(version), "X-Publish-Id": pid,
                                       "Content-Type": "application/octet-stream",
                                       "Content-Length": str(size)})
        if r.status_code == 409 and r.headers.get("x-publish-id") != pid:
            held = r.headers.get("x-policy-version", "?")
            raise ServerError(f"publish weights: server {self.url} holds policy version {held}, not "
                              f"older than this trainer's {version}: another trainer publishes to this "
                              "server (one trainer per server), or it serves another run; stop the other "
                              "publisher or restart `nanogrpo serve`")

    def weights_version(self) -> int:
        return int(self._request("GET", "/weights/version", "weights version").json()["version"])

    def fetch_weights(self, have: int, layout: WeightLayout) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The published weights when newer than version ``have`` (checked against ``layout``, the
        receiver's model, before they are decoded), else None. Invalid weights raise
        :class:`~nanogrpo.serve.weights.WeightsError` (or the decoder's error)."""
        with tempfile.TemporaryDirectory(prefix="nanogrpo-fetch-") as tmp:
            path = Path(tmp) / "weights.safetensors"  # the body goes to disk as it arrives, then is decoded
            r = self._request("GET", "/weights", "fetch weights", ok=(200, 204), params={"have": have},
                              cap=weights_cap(layout), into=path,
                              too_large="more than this worker's model can hold: does the trainer train the "
                                        "same model (model.path)?")
            if r.status_code == 204:
                return None
            version = r.headers.get("x-policy-version", "")
            if not version.isascii() or not version.isdigit():
                raise WeightsError(f"server {self.url} sent weights without a policy version")
            return int(version), load_published(path, layout)
