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
retrying cannot help; raised to the caller with the server's one-line reason).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from nanogrpo import http_limits
from nanogrpo.errors import NanoGRPOError

__all__ = ["ServerClient", "ServerDown", "ServerFault", "generate_cap"]


class ServerFault(NanoGRPOError):
    """A server answered, but not with what was asked (4xx, a reply over its cap, not JSON)."""


class ServerDown(ServerFault):
    """A server did not answer (connection refused or lost, a timeout) or failed (5xx)."""


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
        self._http = httpx.Client(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, cap: int = http_limits.SMALL, timeout: float | None = None,
              body: Any = None, params: dict | None = None) -> Any:
        url = f"{self.url}{path}"
        try:
            r = http_limits.request(self._http, method, url, cap=cap, json=body, params=params,
                                    timeout=timeout or self.control_timeout_s)
        except http_limits.BodyError as e:
            raise ServerFault(f"{method} {url}: {e}") from None
        except httpx.HTTPError as e:  # refused, reset, timed out
            raise ServerDown(f"{method} {url}: {type(e).__name__}: {e}") from None
        if r.status_code >= 500:
            raise ServerDown(f"{method} {url}: HTTP {r.status_code}: {_reason(r)}")
        if r.status_code >= 400:
            raise ServerFault(f"{method} {url}: HTTP {r.status_code}: {_reason(r)}")
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
        try:
            self._call("GET", "/health", timeout=timeout)
            return True
        except ServerFault:
            return False

    # ---------------------------------------------------------------- the RL routes

    def pause(self, mode: str = "keep") -> None:
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

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
