"""The HTTP client of one ``vllm serve`` process: generation (``POST /inference/v1/generate``, vLLM's
token-in-token-out route) and the RL control routes (``/pause``, ``/resume``, the weight-transfer
routes, ``/update_weight_version``, ``/weight_info``).

Every answer is read with a cap (:mod:`nanogrpo.http_limits`): a generation at most
:func:`generate_cap` (64 KiB + 1 KiB per token it may sample: each token comes back with its id,
log-prob and rank), every other answer :data:`~nanogrpo.http_limits.SMALL` (1 MiB). Past it: a
:class:`ServerFault` (the request is not retried on that server; the pool counts it as the server's
failure).

Failures are of two kinds: :class:`ServerDown` (no connection, a timeout, a 5xx: the server is taken out
of the pool and the request goes elsewhere) and :class:`ServerFault` (a 4xx: our request is wrong,
retrying cannot help; raised to the caller with the server's one-line reason). A refused connection is
:class:`ServerRefused` (nothing listens at the URL: said at once, never waited out).

:meth:`ServerClient.abort` ends every request in flight to the server at once (their sockets shut
down: each raises :class:`ServerDown`), for a server taken out of the pool while requests wait on it
(stalled, or paused by a sync that failed and never to be resumed): they go elsewhere in milliseconds
instead of waiting out their timeouts.
"""

from __future__ import annotations

import json
import socket
import threading
import weakref
from typing import Any

import httpcore
import httpx

from nanogrpo import http_limits
from nanogrpo.errors import NanoGRPOError

__all__ = ["ServerClient", "ServerDown", "ServerFault", "ServerMissing", "ServerRefused", "generate_cap"]


class ServerFault(NanoGRPOError):
    """A server answered, but not with what was asked (4xx, a reply over its cap, not JSON)."""


class ServerDown(ServerFault):
    """A server did not answer (connection refused or lost, a timeout) or failed (5xx)."""


class ServerRefused(ServerDown):
    """Nothing listens at the server's address (the connection was refused)."""


class ServerMissing(ServerFault):
    """The server answered 404: a route it does not serve, or a model (LoRA adapter) it does not hold."""


class _Sockets(httpcore.SyncBackend):
    """httpcore's own network backend, keeping the sockets it opens so that :meth:`abort` can shut them
    down: a thread blocked reading an answer then gets end-of-stream at once (closing the socket from
    another thread would not wake it). An abort also ends the calls already begun (:meth:`begin`) that
    had not yet opened their connection: it would otherwise open after the abort and wait out its
    timeout."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._epoch = 0
        self._local = threading.local()

    def begin(self) -> None:
        """This thread begins a call: an :meth:`abort` from now on ends it."""
        self._local.epoch = self._epoch

    def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
        stream = super().connect_tcp(*args, **kwargs)
        sock = stream.get_extra_info("socket")
        with self._lock:
            self._open.add(sock)
            late = getattr(self._local, "epoch", self._epoch) != self._epoch
        if late:  # aborted while this call was on its way: it ends like the others
            _shut(sock)
        return stream

    def abort(self) -> int:
        with self._lock:
            self._epoch += 1
            socks = list(self._open)
            self._open = weakref.WeakSet()
        for sock in socks:
            _shut(sock)
        return len(socks)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def generate_cap(max_tokens: int) -> int:
    """Bytes a ``/inference/v1/generate`` answer of one sample of at most ``max_tokens`` tokens may take."""
    return (64 << 10) + 1024 * max(1, int(max_tokens))


class ServerClient:
    """One vLLM server at ``url`` (``http://host:port``). Thread-safe (one ``httpx.Client``)."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, control_timeout_s: float = 30.0,
                 transfer_timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout_s, self.control_timeout_s, self.transfer_timeout_s = \
            timeout_s, control_timeout_s, transfer_timeout_s
        self._sockets = _Sockets()
        transport = httpx.HTTPTransport()
        # httpx's transport over httpcore's pool, built with the backend that keeps its sockets
        transport._pool = httpcore.ConnectionPool(max_connections=256, max_keepalive_connections=64,
                                                  network_backend=self._sockets)
        self._http = httpx.Client(transport=transport)
        self._busy = 0
        self._busy_lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    @property
    def busy(self) -> int:
        """Requests in flight to this server (health checks not counted)."""
        return self._busy

    def abort(self) -> int:
        """End every request in flight to this server now (each raises :class:`ServerDown`); returns how
        many connections were open. The client stays usable: later requests open new connections."""
        return self._sockets.abort()

    def _call(self, method: str, path: str, *, cap: int = http_limits.SMALL, timeout: float | None = None,
              body: Any = None, params: dict | None = None, counted: bool = True, text: bool = False) -> Any:
        url = f"{self.url}{path}"
        self._sockets.begin()
        if counted:
            with self._busy_lock:
                self._busy += 1
        try:
            r = http_limits.request(self._http, method, url, cap=cap, json=body, params=params,
                                    timeout=timeout or self.control_timeout_s)
        except http_limits.BodyError as e:
            raise ServerFault(f"{method} {url}: {e}") from None
        except httpx.ConnectError as e:
            refused = isinstance(e.__context__, ConnectionRefusedError) or "refused" in str(e).lower()
            raise (ServerRefused if refused else ServerDown)(
                f"{method} {url}: {'connection refused (nothing listens there)' if refused else e}") from None
        except httpx.HTTPError as e:  # reset, timed out, shut down by abort()
            raise ServerDown(f"{method} {url}: {type(e).__name__}: {e or 'connection closed'}") from None
        finally:
            if counted:
                with self._busy_lock:
                    self._busy -= 1
        if r.status_code >= 500:
            raise ServerDown(f"{method} {url}: HTTP {r.status_code}: {_reason(r)}")
        if r.status_code >= 400:
            raise (ServerMissing if r.status_code == 404 else ServerFault)(
                f"{method} {url}: HTTP {r.status_code}: {_reason(r)}")
        if text:
            return r.content.decode("utf-8", "replace")
        try:
            return json.loads(r.content) if r.content else None
        except ValueError:
            raise ServerFault(f"{method} {url}: the answer is not JSON") from None

    # ---------------------------------------------------------------- generation and health

    def generate(self, body: dict, max_tokens: int) -> dict:
        out = self._call("POST", "/inference/v1/generate", body=body, cap=generate_cap(max_tokens),
                         timeout=self.timeout_s)
        if not isinstance(out, dict) or not isinstance(out.get("choices"), list):
            raise ServerFault(f"POST {self.url}/inference/v1/generate: an answer without choices")
        return out

    def healthy(self, timeout: float = 5.0) -> bool:
        return self.health(timeout) is None

    def health(self, timeout: float = 5.0) -> str | None:
        """None when ``/health`` answers 200 within ``timeout`` seconds, else why not (one line)."""
        try:
            self._call("GET", "/health", timeout=timeout, counted=False)
            return None
        except ServerFault as e:
            return str(e)

    def model_info(self) -> dict | None:
        """The server's model as nanogrpo's worker extension reports it (``POST /collective_rpc``
        ``nanogrpo_model_info``: :mod:`nanogrpo.transfer.worker`), None when the server was started
        without it (its command line lacks ``--worker-extension-cls``)."""
        try:
            out = self._call("POST", "/collective_rpc", body={"method": "nanogrpo_model_info"})
        except ServerRefused:
            raise
        except ServerFault:
            return None
        results = out.get("results") if isinstance(out, dict) else None
        return results[0] if isinstance(results, list) and results and isinstance(results[0], dict) \
            else None

    # ---------------------------------------------------------------- the RL routes

    def pause(self, mode: str = "keep") -> None:
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        out = self._call("GET", "/is_paused")
        return bool(out.get("is_paused")) if isinstance(out, dict) else False

    def weight_version(self) -> str | None:
        out = self._call("GET", "/weight_info")
        return None if not isinstance(out, dict) else out.get("weight_version")

    def update_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", body={"new_version": version})

    # vLLM's VLLMWeightSyncClient protocol (what its trainer-side engines drive):
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", body={"init_info": init_info},
                   timeout=self.transfer_timeout_s)

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update", timeout=self.transfer_timeout_s)

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload  # IPC handles

        self._call("POST", "/update_weights", body={"update_info": _json_safe_update_payload(update_info)},
                   timeout=self.transfer_timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("POST", "/finish_weight_update",
                   body=None if weight_version is None else {"weight_version": weight_version},
                   timeout=self.transfer_timeout_s)

    # vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; docs/guides/scaling-out.md)
    def load_adapter(self, name: str, path: str) -> None:
        """Load the adapter at ``path`` as ``name``; one already loaded under that name is replaced."""
        self._call("POST", "/v1/load_lora_adapter",
                   body={"lora_name": name, "lora_path": path, "load_inplace": True},
                   timeout=self.transfer_timeout_s, text=True)

    def unload_adapter(self, name: str) -> None:
        self._call("POST", "/v1/unload_lora_adapter", body={"lora_name": name}, text=True)

    def models(self) -> list[str]:
        """The names the server serves (``GET /v1/models``): its model and each LoRA adapter loaded."""
        out = self._call("GET", "/v1/models")
        data = out.get("data") if isinstance(out, dict) else None
        return [m.get("id") for m in data or [] if isinstance(m, dict)]

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("POST", "/shutdown_weight_transfer_engine")


def _reason(r: Any) -> str:
    """The first line of an error answer (vLLM's ``{"error": {"message": ...}}`` or ``{"detail": ...}``)."""
    try:
        out = json.loads(r.content)
        if isinstance(out, dict):
            err = out.get("error", out.get("detail", out))
            msg = err.get("message", err) if isinstance(err, dict) else err
            return str(msg).splitlines()[0][:300] if str(msg) else ""
    except ValueError:
        pass
    return r.content[:300].decode("utf-8", "replace").splitlines()[0] if r.content else ""
