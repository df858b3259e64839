"""Asking the HF hub in seconds: one request, no retries, a deadline that holds all told.

huggingface_hub's own download path retries a dead network for about a minute (printing a warning
per retry); a name lookup that hangs is bounded by no timeout at all. :func:`ask` runs one request
on a daemon thread and waits at most ``timeout_s`` for it, so "is the hub there?" is answered in
seconds whatever the network does; the callers turn the answer into one line
(:mod:`nanogrpo.models.source` for models, :mod:`nanogrpo.data.sources` for datasets).

Both checks are HEAD requests (:func:`head`; huggingface_hub's ``get_hf_file_metadata`` for a model's
``config.json``): an answer to a HEAD has no body, so nothing past its headers is read, and a hub
(or a mirror at ``HF_ENDPOINT``) that streams without end cannot fill the memory of the thread that
:func:`ask` leaves behind (:mod:`nanogrpo.http_limits`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["TIMEOUT_S", "ask", "endpoint", "head", "network_errors", "offline", "reason"]

TIMEOUT_S = 5.0
"""How long the hub has to answer, all included (name lookup, connecting, and whatever
huggingface_hub asks the hub first)."""


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set: the hub is never asked."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(f and f.upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def endpoint() -> str:
    """The hub's address (``HF_ENDPOINT``, else huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def ask(request: Callable[[], Any], timeout_s: float = TIMEOUT_S) -> Any:
    """``request()``'s result within ``timeout_s``, or what it raised, or TimeoutError. It runs on a
    daemon thread, left behind if it outlasts the deadline."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, request()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            outcome.append((False, e))

    thread = threading.Thread(target=run, name="nanogrpo-hub-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def head(url: str, timeout_s: float = TIMEOUT_S) -> int:
    """The status of a HEAD request to ``url`` through huggingface_hub's own session (its proxies, headers
    and token): any answer says the hub is there. No body is read."""
    from huggingface_hub.utils import build_hf_headers, get_session

    return int(get_session().head(url, headers=build_hf_headers(), timeout=timeout_s).status_code)


def network_errors() -> tuple[type[BaseException], ...]:
    """What a failed connection raises: OSError (requests' errors are OSErrors; so are
    huggingface_hub's HTTP errors: catch those first), and the transport errors of the HTTP
    client this huggingface_hub uses (httpx, or its fork httpx2)."""
    errs: list[type[BaseException]] = [OSError, TimeoutError]
    for name in ("httpx", "httpx2"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "TransportError"):
            errs.append(mod.TransportError)
    return tuple(errs)


def reason(e: BaseException) -> str:
    """The first line of an error, shortened."""
    text = str(e).strip().splitlines()
    return (text[0][:200] if text else type(e).__name__).rstrip(".")
