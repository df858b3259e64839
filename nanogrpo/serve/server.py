"""``nanogrpo serve``: the reference/data server (the seed's companion server, made safe to leave running).

Rollout workers upload batches; with ``grpo.beta > 0`` a frozen reference model adds
per-token reference log-probs (one worker thread, off the event loop); with ``beta == 0`` no
model is loaded. Trainer ranks take batches with ``/get`` and acknowledge each one
(:mod:`nanogrpo.serve.queue`: exactly-once delivery through leases). The trainer publishes
its weights and workers fetch them (:mod:`nanogrpo.serve.weights`). Endpoints and their
answers: :mod:`nanogrpo.serve.routes`. Connection and request limits (idle sockets cannot
deny service): :mod:`nanogrpo.serve.limits`.

The queue is bounded (``server.queue_size``: a full server answers 503 with
``Retry-After``) and lives in memory only. The server records its depth in a small state
file; a restarted server reads it and logs how many queued batches the previous one lost.
"""

from __future__ import annotations

import argparse
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

from nanogrpo.batch import RolloutBatch
from nanogrpo.errors import ConfigError
from nanogrpo.serve.queue import BatchQueue
from nanogrpo.serve.routes import Reject, create_app
from nanogrpo.serve.weights import WeightLayout, WeightRelay

log = logging.getLogger("nanogrpo.serve")

__all__ = ["Settings", "ServerState", "create_app", "make_ref_fn", "main", "uvicorn_config"]


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
                 layout: WeightLayout | None = None):
        self.s = settings
        self.token = token
        self.ref_fn = ref_fn
        self.log = log
        self.queue = BatchQueue(settings.queue_size, settings.lease_s)
        self.relay = WeightRelay(layout, settings.max_version_step)
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
            "weights_bytes": len(relay.body) if relay.body is not None else 0,
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
        self._ref_pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- reference model


def make_ref_fn(model: torch.nn.Module, device: torch.device, micro_batch: int, chunk: int) -> RefFn:
    from nanogrpo.algo.logprobs import batch_token_logprobs

    def ref(batch: RolloutBatch) -> torch.Tensor:
        # at the temperature the worker's run takes log-probs at (rollout.tempered_logprobs), which
        # the upload checked; the trainer refuses a batch whose temperature is not its own
        b = batch.to(device)
        return batch_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, b.completion_mask,
                                    micro_batch, chunk,
                                    temperature=float(batch.meta.get("logprob_temperature", 1.0)))
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
    p.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
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
    from nanogrpo.serve.weights import layout_from_config

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
        queue_size=cfg.server.queue_size, max_staleness=cfg.server.max_staleness, lease_s=cfg.server.lease_s,
        max_version_step=cfg.server.max_version_step,
        state_file=a.state_file or default_state_file(a.host, a.port))
    ref_fn = None
    layout = None
    vocab = a.vocab_size
    if cfg.grpo.beta > 0:
        device = resolve_device(cfg.model.device)
        path = resolve_model_path(cfg.model.path)
        model = load_model(path, resolve_dtype(cfg.model.dtype, device), device,
                           cfg.model.attn_implementation, cfg.model.trust_remote_code, cfg.model.cpu_linear)
        model.eval().requires_grad_(False)
        layout = WeightLayout.of_model(model)
        vocab = vocab or model.get_input_embeddings().num_embeddings
        ref_fn = make_ref_fn(model, device, cfg.train.micro_batch_size, cfg.train.logprob_chunk)
        log.warning("reference model %s loaded on %s (beta=%g)", cfg.model.path, device, cfg.grpo.beta)
    else:
        path = resolve_model_path(cfg.model.path)
        if vocab is None:
            vocab = _vocab_from_config(path, cfg.model.trust_remote_code)
        layout = layout_from_config(path, cfg.model.trust_remote_code)
        log.warning("beta=0: no reference model; brokering batches only (published weights are checked "
                    "against %s)", "the model's config" if layout else "the first accepted publish")
    if vocab is None:
        raise ConfigError("cannot tell the vocabulary size: pass --vocab-size")
    settings.vocab_size = vocab
    if cfg.tools.enabled:  # tool trajectories also carry tool outputs: the longest a tool run asks for
        from nanogrpo.models.load import load_tokenizer
        from nanogrpo.rollout.turns import longest_context

        tok = load_tokenizer(str(resolve_model_path(cfg.model.path)), cfg.model.trust_remote_code)
        settings.max_len = longest_context(cfg, tok, cfg.rollout.max_new_tokens)
    return ServerState(settings, token, ref_fn, layout), token


def uvicorn_config(st: ServerState, host: str, port: int, access_log: bool = False):
    """The uvicorn config of a server: its app under the request caps, h11 under the connection guard."""
    import uvicorn

    from nanogrpo.serve.limits import Admission, ConnectionGuard

    s = st.s
    max_conns = s.max_connections
    try:  # leave file descriptors for the listening socket, the state file, the model's files
        import resource

        max_conns = min(max_conns, max(16, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64))
    except (ImportError, OSError, ValueError):
        pass
    st.guard = ConnectionGuard(s.idle_timeout_s, max_conns, s.max_connections_per_client)
    st.admission = Admission(create_app(st), s.max_requests, s.max_requests_per_client, retry_after_s=1)
    config = uvicorn.Config(st.admission, host=host, port=port, http=st.guard.protocol(),
                            ws="none", log_level="warning", access_log=access_log, timeout_keep_alive=5,
                            limit_concurrency=None, backlog=1024, h11_max_incomplete_event_size=64 * 1024,
                            timeout_graceful_shutdown=5)
    if access_log:  # uvicorn sets its access logger to log_level (warning), which hides every request
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return config


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    a = build_parser().parse_args(argv)
    logging.getLogger("nanogrpo").setLevel(logging.INFO)
    st, token = build_state(a)
    st.report_previous()
    st.record_state()
    config = uvicorn_config(st, a.host, a.port, a.access_log)
    log.warning("serving on http://%s:%d (token %s, queue %d, vocab %d, body cap %.0f MB)", a.host, a.port,
                "required" if token else "off", st.s.queue_size, st.s.vocab_size, st.s.max_body / 2**20)
    try:
        uvicorn.Server(config).run()
    finally:
        st.close()
    return 0
