"""``nanogrpo serve``: the reference/data server (the seed's companion server, made safe to leave running).

Endpoints (all but ``/health`` need ``Authorization: Bearer TOKEN`` when a token is set)::

    POST /upload            body = RolloutBatch.to_bytes()     200 queued | 4xx reason | 429/503 + Retry-After
    GET|POST /get?wait=S    200 batch bytes | 204 nothing ready (waits up to S seconds for one)
    POST /weights           body = safetensors state dict, header X-Policy-Version: N   (own size cap)
    GET  /weights?have=N    200 newer weights + X-Policy-Version | 204 nothing newer than N
    GET  /weights/version   {"version": N}  (-1: none published yet)
    GET  /health            {"ok": true}  (no token)
    GET  /stats             queue depths, batches in/out, reference tokens/s, rejections by reason

Every upload is read with a size cap and a time limit, decoded with
:meth:`RolloutBatch.from_bytes` (safetensors, never pickle) and validated in full
before anything is queued, so a truncated body (a worker killed mid-upload) or
any malformed record leaves the queue untouched. Errors are one line of text
with a 4xx status. With ``grpo.beta > 0`` a frozen reference model adds
per-token reference log-probs (one worker thread, off the event loop); with
``beta == 0`` no model is loaded. The queue is bounded (``server.queue_size``):
a full server answers 503 with ``Retry-After`` instead of growing.

The server keeps its queue in memory only. It records the queue depth in a
small state file; a restarted server reads it and logs how many queued batches
the previous one lost.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hmac
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from nanogrpo.batch import BatchError, RolloutBatch
from nanogrpo.errors import ConfigError

log = logging.getLogger("nanogrpo.serve")

OCTET = "application/octet-stream"
_BATCH_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_WEIGHT_DTYPES = {"F32", "F16", "BF16", "F64"}


@dataclass
class Settings:
    """Server limits and behaviour; ``nanogrpo serve`` fills these from the config and flags."""

    vocab_size: int | None = None
    max_seqs: int | None = 4096
    max_len: int | None = 8192
    max_body: int = 256 << 20
    """Cap on an uploaded batch (bytes)."""
    max_weights_body: int = 64 << 30
    """Cap on a published state dict (bytes): only ``POST /weights`` may send more than ``max_body``."""
    queue_size: int = 16
    max_pending: int = 4
    """Uploads allowed to wait for reference log-probs at once (beyond it: 429)."""
    max_reading: int = 8
    """Upload bodies read at once (beyond it: 429): in-flight bodies hold at most max_reading x max_body."""
    retry_after_s: int = 2
    body_timeout_s: float = 120.0
    max_wait_s: float = 30.0
    state_file: Path | None = None
    max_staleness: int | None = None
    """When set, queued batches more than this many versions behind the published weights are discarded
    (the trainer would drop them anyway) so that their queue slots go to fresh batches."""


class Reject(Exception):
    """An error answer: HTTP status, a stats bucket and a one-line reason."""

    def __init__(self, status: int, bucket: str, reason: str, retry_after: int | None = None):
        super().__init__(reason)
        self.status, self.bucket, self.reason, self.retry_after = status, bucket, reason, retry_after


RefFn = Callable[[RolloutBatch], torch.Tensor]


class ServerState:
    """Everything the app holds; bounded in size whatever clients send."""

    def __init__(self, settings: Settings, token: str | None = None, ref_fn: RefFn | None = None,
                 weight_shapes: dict[str, tuple[int, ...]] | None = None):
        self.s = settings
        self.token = token
        self.ref_fn = ref_fn
        self.weight_shapes = weight_shapes
        self.ready: collections.deque[tuple[bytes, int]] = collections.deque()
        self.pending = 0
        self.reading = 0
        self.seen_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.weights: bytes | None = None
        self.weights_version = -1
        self.weights_busy = False
        self.batches_in = self.batches_out = self.seqs_in = self.duplicates = self.expired = 0
        self.ref_tokens = 0
        self.ref_seconds = 0.0
        self.rejected: collections.Counter[str] = collections.Counter()
        self.workers: collections.Counter[str] = collections.Counter()
        self.started = time.time()
        self._new_batch: asyncio.Event | None = None  # created on the running loop, at first use
        self._ref_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanogrpo-ref")

    # ------------------------------------------------------------------ bookkeeping
    def depth(self) -> int:
        return len(self.ready) + self.pending

    def expire_stale(self) -> None:
        if self.s.max_staleness is None or self.weights_version < 0:
            return
        oldest = self.weights_version - self.s.max_staleness
        kept = [item for item in self.ready if item[1] >= oldest]
        if len(kept) != len(self.ready):
            self.expired += len(self.ready) - len(kept)
            self.ready = collections.deque(kept)
            self.record_state()

    def event(self) -> asyncio.Event:
        if self._new_batch is None:
            self._new_batch = asyncio.Event()
        return self._new_batch

    def stats(self) -> dict[str, Any]:
        return {
            "queue_ready": len(self.ready), "queue_pending_ref": self.pending,
            "queue_size": self.s.queue_size,
            "batches_in": self.batches_in, "batches_out": self.batches_out, "sequences_in": self.seqs_in,
            "duplicates": self.duplicates, "expired_stale": self.expired,
            "ref_model": self.ref_fn is not None, "ref_tokens": self.ref_tokens,
            "ref_tokens_per_s": self.ref_tokens / self.ref_seconds if self.ref_seconds > 0 else 0.0,
            "weights_version": self.weights_version,
            "weights_bytes": len(self.weights) if self.weights is not None else 0,
            "rejected": dict(self.rejected), "rejected_total": sum(self.rejected.values()),
            "workers": dict(self.workers), "uptime_s": time.time() - self.started,
        }

    def record_state(self) -> None:
        """Write the queue depth to the state file (atomic rename), so a restart can report the loss."""
        if self.s.state_file is None:
            return
        try:
            self.s.state_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.s.state_file.parent, prefix=".serve-state-")
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "queued": self.depth(), "time": time.time()}, f)
            os.replace(tmp, self.s.state_file)
        except OSError as e:  # the server keeps serving; only the restart report is lost
            log.warning("cannot write state file %s: %s", self.s.state_file, e)

    def report_previous(self) -> int:
        """Log (and return) how many batches the previous server left queued when it stopped."""
        f = self.s.state_file
        if f is None or not f.is_file():
            return 0
        try:
            prev = json.loads(f.read_text())
            lost = int(prev.get("queued", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            log.warning("state file %s is unreadable; cannot tell what the previous server lost", f)
            return 0
        if lost:
            log.warning("the previous server (pid %s) stopped with %d queued batch(es); they are lost "
                        "(workers regenerate; the trainer carries on)", prev.get("pid"), lost)
        else:
            log.info("the previous server stopped with an empty queue; nothing lost")
        return lost

    def close(self) -> None:
        lost = self.depth()
        if lost:
            log.warning("shutting down with %d queued batch(es); they are lost", lost)
        self.ready.clear()
        self.pending = 0
        self.record_state()
        self._ref_pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- request helpers


def _check_auth(st: ServerState, request: Request) -> None:
    if st.token is None:
        return
    got = request.headers.get("authorization", "")
    if not got:
        raise Reject(401, "auth", "missing token: send 'Authorization: Bearer TOKEN'")
    scheme, _, value = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode("utf-8", "replace"),
                                                               st.token.encode()):
        raise Reject(401, "auth", "wrong token")


async def _read_body(request: Request, cap: int, timeout_s: float) -> bytes:
    """The request body, refusing more than ``cap`` bytes and bodies slower than ``timeout_s``."""
    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.isdigit() or len(cl) > 19:
            raise Reject(400, "bad_header", "Content-Length is not a non-negative integer")
        if int(cl) > cap:
            raise Reject(413, "too_large", f"body of {cl} bytes exceeds the limit of {cap} bytes")
    buf = bytearray()

    async def pull() -> None:
        async for chunk in request.stream():
            buf.extend(chunk)
            if len(buf) > cap:
                raise Reject(413, "too_large", f"body exceeds the limit of {cap} bytes")

    try:
        await asyncio.wait_for(pull(), timeout_s)
    except asyncio.TimeoutError:
        raise Reject(408, "slow_client", f"body not received within {timeout_s:.0f} s") from None
    except ClientDisconnect:
        raise Reject(400, "disconnect", "client disconnected before the body was complete") from None
    if cl is not None and len(buf) != int(cl):
        raise Reject(400, "truncated", f"body has {len(buf)} bytes but Content-Length says {cl}")
    return bytes(buf)


def _int_param(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise Reject(400, "bad_param", f"query parameter {name!r} must be a number") from None
    if not lo <= v <= hi:
        raise Reject(400, "bad_param", f"query parameter {name!r} must be in [{lo}, {hi}]")
    return v


def _decode(st: ServerState, body: bytes) -> RolloutBatch:
    try:
        return RolloutBatch.from_bytes(body, vocab_size=st.s.vocab_size, max_seqs=st.s.max_seqs,
                                       max_len=st.s.max_len)
    except BatchError as e:
        raise Reject(400, "bad_batch", str(e)) from None
    except Exception as e:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's fault
        raise Reject(400, "bad_batch", f"undecodable batch ({type(e).__name__})") from None


def check_weights(body: bytes, shapes: dict[str, tuple[int, ...]] | None) -> int:
    """Validate a safetensors state dict's header (no tensor is materialised); return the tensor count."""
    if len(body) < 8:
        raise Reject(400, "bad_weights", "body too short for safetensors")
    n = int.from_bytes(body[:8], "little")
    if n <= 1 or n > min(len(body) - 8, 64 << 20):
        raise Reject(400, "bad_weights", "safetensors header length out of range")
    try:
        header = json.loads(body[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        raise Reject(400, "bad_weights", "safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise Reject(400, "bad_weights", "safetensors header must be an object")
    header.pop("__metadata__", None)
    if not header:
        raise Reject(400, "bad_weights", "state dict holds no tensors")
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (a, b) = info["dtype"], [int(x) for x in info["shape"]], info["data_offsets"]
            a, b = int(a), int(b)
        except (TypeError, KeyError, ValueError):
            raise Reject(400, "bad_weights", f"tensor {name[:80]!r}: malformed entry") from None
        if not isinstance(dtype, str) or dtype not in _WEIGHT_DTYPES:
            raise Reject(400, "bad_weights", f"tensor {name[:80]!r}: dtype {str(dtype)[:10]} is not floating")
        if shapes is not None:
            if name not in shapes:
                raise Reject(400, "bad_weights", f"tensor {name[:80]!r} is not in the reference model")
            if tuple(shape) != shapes[name]:
                raise Reject(400, "bad_weights", f"tensor {name[:80]!r} has shape {tuple(shape)}, "
                                                 f"the reference model has {shapes[name]}")
        spans.append((a, b))
    spans.sort()
    end = 0
    for a, b in spans:
        if a != end or b < a:
            raise Reject(400, "bad_weights", "tensor data offsets overlap or leave gaps")
        end = b
    if end != len(body) - 8 - n:
        raise Reject(400, "bad_weights", "tensor data does not match the body length")
    return len(spans)


# ---------------------------------------------------------------------- the app


def create_app(st: ServerState) -> Starlette:
    def guarded(handler, auth: bool = True):
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    _check_auth(st, request)
                return await handler(request)
            except Reject as r:
                st.rejected[r.bucket] += 1
                headers = {"Retry-After": str(r.retry_after)} if r.retry_after is not None else None
                return PlainTextResponse(r.reason + "\n", status_code=r.status, headers=headers)
        return endpoint

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True, "queue_ready": len(st.ready), "weights_version": st.weights_version})

    async def stats(request: Request) -> Response:
        return JSONResponse(st.stats())

    async def upload(request: Request) -> Response:
        if st.depth() >= st.s.queue_size:
            raise Reject(503, "queue_full", f"queue full ({st.s.queue_size} batches); retry later",
                         st.s.retry_after_s)
        if st.ref_fn is not None and st.pending >= st.s.max_pending:
            raise Reject(429, "busy", "reference model busy; retry later", st.s.retry_after_s)
        bid = request.headers.get("x-batch-id")
        if bid is not None and not _BATCH_ID.match(bid):
            raise Reject(400, "bad_header", "X-Batch-Id must be 1-64 characters of [A-Za-z0-9._:-]")
        if st.reading >= st.s.max_reading:
            raise Reject(429, "busy", f"{st.reading} uploads already arriving; retry later",
                         st.s.retry_after_s)
        st.reading += 1
        try:
            body = await _read_body(request, st.s.max_body, st.s.body_timeout_s)
        finally:
            st.reading -= 1
        if bid is not None and bid in st.seen_ids:
            st.duplicates += 1
            return JSONResponse({"queued": False, "duplicate": True, "depth": st.depth()})
        if len(body) > (1 << 20):
            batch = await asyncio.to_thread(_decode, st, body)
        else:
            batch = _decode(st, body)
        if st.depth() >= st.s.queue_size:  # filled up while this body was arriving
            raise Reject(503, "queue_full", f"queue full ({st.s.queue_size} batches); retry later",
                         st.s.retry_after_s)
        if bid is not None:
            st.seen_ids[bid] = None
            while len(st.seen_ids) > 4096:
                st.seen_ids.popitem(last=False)
        if st.ref_fn is not None:
            st.pending += 1
            try:
                t0 = time.perf_counter()
                ref = await asyncio.get_running_loop().run_in_executor(st._ref_pool, st.ref_fn, batch)
                st.ref_seconds += time.perf_counter() - t0
                st.ref_tokens += int(batch.attention_mask.sum())
            except Exception as e:
                log.exception("reference log-probs failed")
                st.rejected["ref_failed"] += 1
                return PlainTextResponse(f"reference log-probs failed: {type(e).__name__}\n", status_code=500)
            finally:
                st.pending -= 1
            batch.ref_logprobs = ref.float().cpu() * batch.completion_mask
            body = batch.to_bytes()
        st.ready.append((body, batch.policy_version))
        st.batches_in += 1
        st.seqs_in += batch.num_seqs
        worker = str(batch.meta.get("worker", "?"))[:64]
        if worker in st.workers or len(st.workers) < 256:
            st.workers[worker] += 1
        st.event().set()
        st.record_state()
        return JSONResponse({"queued": True, "depth": st.depth()})

    async def get(request: Request) -> Response:
        wait = _int_param(request, "wait", 0.0, 0.0, st.s.max_wait_s)
        deadline = time.monotonic() + wait
        st.expire_stale()
        while not st.ready:
            left = deadline - time.monotonic()
            if left <= 0:
                return Response(status_code=204, headers={"X-Queue-Depth": str(st.depth())})
            ev = st.event()
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        body, version = st.ready.popleft()
        st.batches_out += 1
        st.record_state()
        return Response(body, media_type=OCTET,
                        headers={"X-Policy-Version": str(version), "X-Queue-Depth": str(st.depth())})

    async def publish(request: Request) -> Response:
        raw = request.headers.get("x-policy-version", "")
        if not raw.isdigit() or len(raw) > 12:
            raise Reject(400, "bad_header", "X-Policy-Version must be a non-negative integer")
        version = int(raw)
        if version <= st.weights_version:
            raise Reject(409, "old_version", f"version {version} is not newer than {st.weights_version}")
        if st.weights_busy:
            raise Reject(429, "busy", "another weights upload is in progress", st.s.retry_after_s)
        st.weights_busy = True
        try:
            body = await _read_body(request, st.s.max_weights_body, st.s.body_timeout_s * 10)
            count = await asyncio.to_thread(check_weights, body, st.weight_shapes)
            if version <= st.weights_version:
                raise Reject(409, "old_version", f"version {version} is not newer than {st.weights_version}")
            st.weights, st.weights_version = body, version
        finally:
            st.weights_busy = False
        st.expire_stale()
        log.info("policy version %d published (%d tensors, %.1f MB)", version, count, len(body) / 1e6)
        return JSONResponse({"version": version, "tensors": count})

    async def weights(request: Request) -> Response:
        have = int(_int_param(request, "have", -1, -1, 1e15))
        if st.weights is None or st.weights_version <= have:
            return Response(status_code=204, headers={"X-Policy-Version": str(st.weights_version)})
        return Response(st.weights, media_type=OCTET, headers={"X-Policy-Version": str(st.weights_version)})

    async def weights_version(request: Request) -> Response:
        return JSONResponse({"version": st.weights_version})

    routes = [
        Route("/health", guarded(health, auth=False), methods=["GET"]),
        Route("/stats", guarded(stats), methods=["GET"]),
        Route("/upload", guarded(upload), methods=["POST"]),
        Route("/get", guarded(get), methods=["GET", "POST"]),
        Route("/weights", guarded(publish), methods=["POST"]),
        Route("/weights", guarded(weights), methods=["GET"]),
        Route("/weights/version", guarded(weights_version), methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.nanogrpo = st
    return app


# ---------------------------------------------------------------------- reference model


def make_ref_fn(model: torch.nn.Module, device: torch.device, micro_batch: int, chunk: int) -> RefFn:
    from nanogrpo.algo.logprobs import batch_token_logprobs

    def ref(batch: RolloutBatch) -> torch.Tensor:
        b = batch.to(device)
        return batch_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, b.completion_mask,
                                    micro_batch, chunk)
    return ref


def default_state_file(host: str, port: int) -> Path:
    root = Path(os.environ.get("NANOGRPO_CACHE", Path.home() / ".cache" / "nanogrpo"))
    return root / f"serve-{host}-{port}.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanogrpo serve", description=(
        "Reference/data server for split mode. Rollout workers upload batches; the trainer takes them. "
        "The shared token comes from $NANOGRPO_TOKEN or --token-file (never the command line); binding "
        "anything but a loopback address requires one."))
    p.add_argument("--config", help="config file or preset (model.path, grpo.beta, server.* are read)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--ref-model", help="reference model (default: model.path)")
    p.add_argument("--device", help="device of the reference model (default: model.device)")
    p.add_argument("--token-file", help="file holding the shared token")
    p.add_argument("--vocab-size", type=int, help="token ids must be below this (default: from the model)")
    p.add_argument("--max-body-mb", type=float, default=256.0, help="cap on an uploaded batch")
    p.add_argument("--max-weights-mb", type=float, default=65536.0, help="cap on published weights")
    p.add_argument("--state-file", type=Path, help="where the queue depth is recorded for restart reports")
    p.add_argument("--access-log", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p


def _vocab_from_config(path: str, trust_remote_code: bool) -> int | None:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    v = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", None)
    return int(v) if v else None


def build_state(a: argparse.Namespace) -> tuple[ServerState, str | None]:
    from nanogrpo.cli import _base_config
    from nanogrpo.serve.auth import is_loopback, load_token

    overrides = list(a.overrides)
    if a.ref_model:
        overrides.append(f"model.path={json.dumps(a.ref_model)}")
    if a.device:
        overrides.append(f"model.device={json.dumps(a.device)}")
    cfg = _base_config(a.config, overrides)
    token = load_token(a.token_file or cfg.server.token_file)
    if not is_loopback(a.host) and token is None:
        raise ConfigError(f"refusing to bind {a.host} (not loopback) without a token: set NANOGRPO_TOKEN or "
                          "--token-file")
    from nanogrpo.models.load import load_model, resolve_device, resolve_dtype, resolve_model_path

    settings = Settings(
        max_seqs=cfg.rollout.prompts_per_step * cfg.grpo.group_size * 4,
        max_len=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
        max_body=int(a.max_body_mb * (1 << 20)), max_weights_body=int(a.max_weights_mb * (1 << 20)),
        queue_size=cfg.server.queue_size, max_staleness=cfg.server.max_staleness,
        state_file=a.state_file or default_state_file(a.host, a.port))
    ref_fn = None
    shapes = None
    vocab = a.vocab_size
    if cfg.grpo.beta > 0:
        device = resolve_device(cfg.model.device)
        path = resolve_model_path(cfg.model.path)
        model = load_model(path, resolve_dtype(cfg.model.dtype, device), device,
                           cfg.model.attn_implementation, cfg.model.trust_remote_code, cfg.model.cpu_linear)
        model.eval().requires_grad_(False)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        vocab = vocab or model.get_input_embeddings().num_embeddings
        ref_fn = make_ref_fn(model, device, cfg.train.micro_batch_size, cfg.train.logprob_chunk)
        log.warning("reference model %s loaded on %s (beta=%g)", cfg.model.path, device, cfg.grpo.beta)
    else:
        if vocab is None:
            vocab = _vocab_from_config(resolve_model_path(cfg.model.path), cfg.model.trust_remote_code)
        log.warning("beta=0: no reference model; brokering batches only")
    if vocab is None:
        raise ConfigError("cannot tell the vocabulary size: pass --vocab-size")
    settings.vocab_size = vocab
    return ServerState(settings, token, ref_fn, shapes), token


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    a = build_parser().parse_args(argv)
    logging.getLogger("nanogrpo").setLevel(logging.INFO)
    st, token = build_state(a)
    st.report_previous()
    st.record_state()
    app = create_app(st)
    log.warning("serving on http://%s:%d (token %s, queue %d, vocab %d, body cap %.0f MB)", a.host, a.port,
                "required" if token else "off", st.s.queue_size, st.s.vocab_size, st.s.max_body / 2**20)
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level="warning", access_log=a.access_log,
                            timeout_keep_alive=5, limit_concurrency=256, backlog=256,
                            h11_max_incomplete_event_size=64 * 1024, timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    finally:
        st.close()
    return 0
