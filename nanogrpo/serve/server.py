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
import json
import logging
import os
import signal
from pathlib import Path

import torch

from nanogrpo.batch import RolloutBatch
from nanogrpo.config import config_from
from nanogrpo.errors import ConfigError
from nanogrpo.serve.routes import create_app
from nanogrpo.serve.state import RefFn, ServerState, Settings
from nanogrpo.serve.weights import WeightLayout

log = logging.getLogger("nanogrpo.serve")

__all__ = ["Settings", "ServerState", "create_app", "make_ref_fn", "main", "uvicorn_config"]


# ---------------------------------------------------------------------- reference model


def make_ref_fn(model: torch.nn.Module, device: torch.device, micro_batch: int, chunk: int) -> RefFn:
    from nanogrpo.algo.logprobs import batch_token_logprobs
    from nanogrpo.models.vision import is_vision

    def ref(batch: RolloutBatch) -> torch.Tensor:
        # at the temperature the worker's run takes log-probs at (rollout.tempered_logprobs), which
        # the upload checked; the trainer refuses a batch whose temperature is not its own
        b = batch.to(device)
        sup = batch.meta.get("logprob_support")  # (top_k, top_p): over the support, as the worker's
        if b.has_images or is_vision(model):  # a vision-language model: micro-batches with their rows' images
            return _with_images(model, b, micro_batch, chunk,
                                float(batch.meta.get("logprob_temperature", 1.0)),
                                (int(sup[0]), float(sup[1])) if sup else None)
        return batch_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, b.completion_mask,
                                    micro_batch, chunk,
                                    temperature=float(batch.meta.get("logprob_temperature", 1.0)),
                                    support=(int(sup[0]), float(sup[1])) if sup else None)
    return ref


@torch.no_grad()
def _with_images(model, b: RolloutBatch, micro_batch: int, chunk: int, temperature: float, support
                 ) -> torch.Tensor:
    """Reference log-probs (N, C) of a batch whose prompts carry images, ``micro_batch`` rows at a time."""
    from nanogrpo.algo.logprobs import token_logprobs
    from nanogrpo.batch import BatchError
    from nanogrpo.models.vision import forward_kwargs, image_token_error

    err = image_token_error(model, b)
    if err:
        raise BatchError(err)  # the client's: a 4xx
    out = []
    for i in range(0, b.num_seqs, micro_batch):
        rows = torch.arange(i, min(i + micro_batch, b.num_seqs))
        pv, grid, _ = b.images_of(rows) if b.has_images else (None, None, None)
        out.append(token_logprobs(model, b.input_ids[rows], b.attention_mask[rows], b.prompt_len,
                                  b.completion_mask[rows], chunk, temperature=temperature, support=support,
                                  mm=lambda x, pv=pv, grid=grid: forward_kwargs(model, x, pv, grid)))
    return torch.cat(out)                                                     # (N, C)


def _cache() -> Path:
    return Path(os.environ.get("NANOGRPO_CACHE", Path.home() / ".cache" / "nanogrpo"))


def default_state_file(host: str, port: int) -> Path:
    return _cache() / f"serve-{host}-{port}.json"


def default_weights_dir(host: str, port: int) -> Path:
    return _cache() / f"relay-{host}-{port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanogrpo serve", description=(
        "Reference/data server for split mode. Rollout workers upload batches; the trainer takes them. "
        "The shared token comes from $NANOGRPO_TOKEN or --token-file (never the command line); binding "
        "anything but a loopback address requires one."))
    p.add_argument("--config", help="config file or preset (model.path, grpo.beta, server.* are read)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--ref-model", help="reference model (default: model.path)")
    p.add_argument("--teacher", help="a distillation teacher to hold (default: distill.teacher when it is a "
                                     "model): trainers with distill.teacher=http://HOST:PORT score with it")
    p.add_argument("--device", help="device of the reference model (default: model.device)")
    p.add_argument("--token-file", help="file holding the shared token")
    p.add_argument("--vocab-size", type=int, help="token ids must be below this (default: from the model)")
    p.add_argument("--max-body-mb", type=float, help="cap on an uploaded batch (default: server.max_body_mb)")
    p.add_argument("--max-weights-mb", type=float, default=65536.0, help="cap on published weights")
    p.add_argument("--state-file", type=Path, help="where the queue depth is recorded for restart reports")
    p.add_argument("--weights-dir", type=Path,
                   help="where published weights are spooled and served from, one model's worth on a disk "
                        "(default: $NANOGRPO_CACHE or ~/.cache/nanogrpo, relay-HOST-PORT)")
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
    from nanogrpo.serve.auth import is_loopback, load_token
    from nanogrpo.serve.weights import layout_from_config

    overrides = list(a.overrides)
    if a.ref_model:
        overrides.append(f"model.path={json.dumps(a.ref_model)}")
    if a.device:
        overrides.append(f"model.device={json.dumps(a.device)}")
    cfg = config_from(a.config, overrides)
    token = load_token(a.token_file or cfg.server.token_file)
    if not is_loopback(a.host) and token is None:
        raise ConfigError(f"refusing to bind {a.host} (not loopback) without a token: set NANOGRPO_TOKEN or "
                          "--token-file")
    from nanogrpo.models.load import load_model, resolve_device, resolve_dtype, resolve_model_path

    settings = Settings(
        max_seqs=cfg.rollout.prompts_per_step * cfg.grpo.group_size * 4,
        max_len=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
        max_body=int((a.max_body_mb or cfg.server.max_body_mb) * (1 << 20)),
        max_weights_body=int(a.max_weights_mb * (1 << 20)),
        queue_size=cfg.server.queue_size, max_staleness=cfg.server.max_staleness, lease_s=cfg.server.lease_s,
        max_version_step=cfg.server.max_version_step,
        state_file=a.state_file or default_state_file(a.host, a.port),
        weights_dir=a.weights_dir or default_weights_dir(a.host, a.port))
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
        log.info("reference model %s loaded on %s (beta=%g)", cfg.model.path, device, cfg.grpo.beta)
    else:
        path = resolve_model_path(cfg.model.path)
        if vocab is None:
            vocab = _vocab_from_config(path, cfg.model.trust_remote_code)
        layout = layout_from_config(path, cfg.model.trust_remote_code)
        log.info("beta=0: no reference model; brokering batches only (published weights are checked "
                    "against %s)", "the model's config" if layout else "the first accepted publish")
    teacher = None
    remote = cfg.distill.teacher.startswith(("http:", "https:"))
    path = a.teacher or ("" if remote else cfg.distill.teacher)
    if path:
        from nanogrpo.training.distill.local import LocalTeacher

        device = resolve_device(cfg.model.device)
        teacher = LocalTeacher.load(path, None, resolve_dtype(cfg.model.dtype, device), device,
                                    cfg.model.attn_implementation, cfg.model.trust_remote_code,
                                    cfg.model.cpu_linear)
        teacher.head()  # a head the routes can project (one line otherwise)
        vocab = vocab or teacher.model.get_input_embeddings().num_embeddings
        log.info("distillation teacher %s loaded on %s: /v1/completions scores prompts", path, device)
    if vocab is None:
        raise ConfigError("cannot tell the vocabulary size: pass --vocab-size")
    settings.vocab_size = vocab
    if cfg.tools.enabled:  # tool trajectories also carry tool outputs: the longest a tool run asks for
        from nanogrpo.models.load import load_tokenizer
        from nanogrpo.rollout.turns import longest_context

        tok = load_tokenizer(str(resolve_model_path(cfg.model.path)), cfg.model.trust_remote_code)
        settings.max_len = longest_context(cfg, tok, cfg.rollout.max_new_tokens)
    return ServerState(settings, token, ref_fn, layout, teacher), token


def uvicorn_config(st: ServerState, host: str, port: int, access_log: bool = False):
    """The uvicorn config of a server: its app under the request caps, h11 under the connection guard."""
    import uvicorn

    from nanogrpo.serve.limits import Admission, ConnectionGuard

    s = st.s
    max_conns = s.max_connections
    try:  # leave file descriptors for the listening socket, the state file, the model's files, and one
        import resource  # open weights file per connection fetching them

        max_conns = min(max_conns, max(16, (resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64) // 2))
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
    log.info("serving on http://%s:%d (token %s, queue %d, vocab %d, body cap %.0f MB)", a.host, a.port,
                "required" if token else "off", st.s.queue_size, st.s.vocab_size, st.s.max_body / 2**20)
    # uvicorn ends a SIGTERM by raising the signal again once it has shut down, under the handler it found
    # at start: with the default one the process died there, before st.close() below (no state recorded,
    # the relay's weights left on disk). This one ends it through the finally instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.Server(config).run()
    finally:
        st.close()
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)
