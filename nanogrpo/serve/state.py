"""The server's settings and in-memory state, and :class:`Reject`, the error a request ends with.

:mod:`nanogrpo.serve.routes` reads and changes a :class:`ServerState`; :mod:`nanogrpo.serve.server`
builds one from the config and serves it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanogrpo.batch import BatchError, RolloutBatch
from nanogrpo.serve.queue import BatchQueue
from nanogrpo.serve.weights import WeightLayout, WeightRelay

log = logging.getLogger("nanogrpo.serve")

__all__ = ["RefFn", "Reject", "ServerState", "Settings"]


class Reject(Exception):
    """An error answer: HTTP status, a stats bucket and a one-line reason."""

    def __init__(self, status: int, bucket: str, reason: str, retry_after: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(reason)
        self.status, self.bucket, self.reason = status, bucket, reason
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)


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
    """Batches held: being processed, ready, or delivered and not yet acknowledged."""
    lease_s: float = 60.0
    """A delivered batch not acknowledged this long after its body went out returns to the queue."""
    max_version_step: int = 1000
    """How far one publish may move the policy version forward (once the server holds one)."""
    max_pending: int = 4
    """Uploads allowed to wait for reference log-probs at once (beyond it: 429)."""
    max_reading: int = 8
    """Upload bodies read at once (beyond it: 429): in-flight bodies hold at most max_reading x max_body."""
    retry_after_s: int = 2
    body_timeout_s: float = 120.0
    max_wait_s: float = 30.0
    state_file: Path | None = None
    weights_dir: Path | None = None
    """Where published weights are spooled and served from (None: a private temporary directory)."""
    max_staleness: int | None = None
    """When set, queued batches more than this many versions behind the published weights are discarded
    (the trainer would drop them anyway) so that their queue slots go to fresh batches."""
    idle_timeout_s: float = 10.0
    """A connection must send a request head within this many seconds of opening or of its last answer."""
    max_connections: int = 512
    max_connections_per_client: int = 64
    """Beyond these, the oldest idle connection (of that client, or of anyone) is closed to make room."""
    max_requests: int = 64
    max_requests_per_client: int = 32
    """Requests served at once (``/health`` aside); beyond: 503 with Retry-After."""


RefFn = Callable[[RolloutBatch], torch.Tensor]


class ServerState:
    """Everything the app holds; bounded in size whatever clients send."""

    def __init__(self, settings: Settings, token: str | None = None, ref_fn: RefFn | None = None,
                 layout: WeightLayout | None = None, teacher=None):
        self.s = settings
        self.token = token
        self.ref_fn = ref_fn
        self.teacher = teacher
        """A distillation teacher (:class:`~nanogrpo.training.distill.local.LocalTeacher`) the server scores
        prompts with (:mod:`nanogrpo.serve.teacher`), or None."""
        self.log = log
        self.queue = BatchQueue(settings.queue_size, settings.lease_s)
        self.relay = WeightRelay(layout, settings.max_version_step, settings.weights_dir)
        self.pending = 0
        self.reading = 0
        self.seqs_in = self.duplicates = 0
        self.ref_tokens = 0
        self.ref_seconds = 0.0
        self.rejected: collections.Counter[str] = collections.Counter()
        self.workers: collections.Counter[str] = collections.Counter()
        self.started = time.time()
        self.guard = None   # the ConnectionGuard, when served by uvicorn (main)
        self.admission = None
        self._new_batch: asyncio.Event | None = None  # created on the running loop, at first use
        self._ref_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanogrpo-ref")

    # ------------------------------------------------------------------ bookkeeping
    def event(self) -> asyncio.Event:
        if self._new_batch is None:
            self._new_batch = asyncio.Event()
        return self._new_batch

    def new_batch(self) -> None:
        self.event().set()
        self.record_state()

    def count_upload(self, batch: RolloutBatch) -> None:
        self.seqs_in += batch.num_seqs
        worker = batch.meta.get("worker", "?")
        if worker in self.workers or len(self.workers) < 256:
            self.workers[worker] += 1

    def expire_stale(self) -> None:
        if self.s.max_staleness is None or self.relay.version < 0:
            return
        if self.queue.drop_older_than(self.relay.version - self.s.max_staleness):
            self.record_state()

    async def add_reference(self, batch: RolloutBatch) -> bytes:
        """The batch's bytes with reference log-probs added; a failure (e.g. out of memory) is a 503 that
        leaves the upload retryable."""
        self.pending += 1
        try:
            t0 = time.perf_counter()
            ref = await asyncio.get_running_loop().run_in_executor(self._ref_pool, self.ref_fn, batch)
            self.ref_seconds += time.perf_counter() - t0
            self.ref_tokens += int(batch.attention_mask.sum())
        except BatchError as e:  # the batch disagrees with the model (its images, say): the client's fault
            raise Reject(400, "bad_batch", str(e)) from None
        except Exception as e:  # noqa: BLE001 - the server's own failure, not the client's
            log.exception("reference log-probs failed")
            raise Reject(503, "ref_failed", f"reference log-probs failed ({type(e).__name__}); retry later") \
                from None
        finally:
            self.pending -= 1
        batch.ref_logprobs = ref.float().cpu() * batch.completion_mask
        return batch.to_bytes()

    def stats(self) -> dict[str, Any]:
        q, relay = self.queue, self.relay
        out = {
            "queue_ready": len(q.ready), "queue_leased": len(q.leased), "queue_pending_ref": self.pending,
            "queue_size": self.s.queue_size, "lease_s": q.lease_s,
            "batches_in": q.batches_in, "batches_out": q.acked, "delivered": q.delivered,
            "redelivered": q.redelivered, "sequences_in": self.seqs_in, "duplicates": self.duplicates,
            "expired_stale": q.expired,
            "ref_model": self.ref_fn is not None, "ref_tokens": self.ref_tokens,
            "ref_tokens_per_s": self.ref_tokens / self.ref_seconds if self.ref_seconds > 0 else 0.0,
            "weights_version": relay.version,
            "weights_bytes": relay.size if relay.path is not None else 0,
            "rejected": dict(self.rejected), "rejected_total": sum(self.rejected.values()),
            "workers": dict(self.workers), "uptime_s": time.time() - self.started,
        }
        if self.guard is not None:
            out.update(self.guard.stats())
        if self.admission is not None:
            out["requests_active"] = self.admission.active
            out["requests_refused"] = self.admission.refused
        return out

    def record_state(self) -> None:
        """Write the queue depth to the state file (atomic rename), so a restart can report the loss."""
        if self.s.state_file is None:
            return
        try:
            self.s.state_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.s.state_file.parent, prefix=".serve-state-")
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "queued": self.queue.depth(), "time": time.time()}, f)
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
        lost = self.queue.clear()
        if lost:
            log.warning("shutting down with %d queued batch(es); they are lost", lost)
        self.pending = 0
        self.record_state()
        self.relay.close()
        self._ref_pool.shutdown(wait=False, cancel_futures=True)
