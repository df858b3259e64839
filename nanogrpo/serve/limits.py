"""Connection and request limits of ``nanogrpo serve``: open sockets cannot deny service.

uvicorn's own ``limit_concurrency`` counts connections, not requests, and nothing times out
a connection that never sends a request line: a few hundred idle sockets (no token needed)
made every request answer 503. So the server runs uvicorn's h11 protocol under
:class:`ConnectionGuard`, and its app under :class:`Admission`:

- a connection must send a complete request head within ``idle_timeout_s`` of being
  accepted, and again after each response (a slowloris, or a socket that sends nothing, is
  closed; so is one that trickles a body nobody reads);
- at most ``max_per_client`` connections per client address and ``max_connections`` in all:
  a connection beyond either cap makes room by closing the *oldest idle* connection (one not
  being served: no request, or a request head still arriving) of that client, or of anyone
  for the total; held-open sockets therefore never lock out a client that sends requests.
  Only when every connection is busy serving a request is the new one closed at once;
- at most ``max_requests`` requests are served at once, ``max_requests_per_client`` per
  client address; beyond, 503 with ``Retry-After``. ``/health`` is never refused (it does no work).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class ConnectionGuard:
    """The server's open connections, by client address, oldest first."""

    def __init__(self, idle_timeout_s: float = 10.0, max_connections: int = 512, max_per_client: int = 64):
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.all: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self.by_client: dict[str, collections.OrderedDict[Any, None]] = {}
        self.evicted = self.timed_out = self.refused = 0

    def stats(self) -> dict[str, int]:
        return {"connections": len(self.all), "connections_evicted": self.evicted,
                "connections_timed_out": self.timed_out, "connections_refused": self.refused}

    def admit(self, conn) -> None:
        mine = self.by_client.setdefault(conn.client_key, collections.OrderedDict())
        mine[conn] = None
        self.all[conn] = None
        if len(mine) > self.max_per_client:
            self._make_room(mine, conn)
        if len(self.all) > self.max_connections and conn in self.all:
            self._make_room(self.all, conn)

    def release(self, conn) -> None:
        self.all.pop(conn, None)
        mine = self.by_client.get(conn.client_key)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_client[conn.client_key]

    def _make_room(self, candidates: Iterable, new) -> None:
        victim = next((c for c in candidates if c is not new and not c.busy()), None)
        if victim is None:
            self.refused += 1
            victim = new
        else:
            self.evicted += 1
        self.release(victim)
        victim.close()

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol class under this guard (``uvicorn.Config(http=...)``)."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head and the guard's caps."""

    guard: ConnectionGuard

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_timer = None
        self._seen = None  # the request cycle last seen starting
        self.client_key = self.client[0] if self.client else "?"
        self._arm()
        self.guard.admit(self)

    def connection_lost(self, exc) -> None:
        self.guard.release(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check_started()

    def on_response_complete(self) -> None:
        seen = self.cycle
        super().on_response_complete()   # may start a pipelined request
        if self.transport.is_closing():
            return
        if self.cycle is seen:
            self._arm()
        else:
            self._check_started()

    # -- state
    def busy(self) -> bool:
        """Serving a request (its head arrived, its response is not complete)."""
        return self.cycle is not None and self.cycle is self._seen and not self.cycle.response_complete

    def close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _check_started(self) -> None:
        if self.cycle is not None and self.cycle is not self._seen:
            self._seen = self.cycle
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._idle_timer = self.loop.call_later(self.guard.idle_timeout_s, self._idle_timeout)

    def _disarm(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_timeout(self) -> None:
        self._idle_timer = None
        if not self.busy() and not self.transport.is_closing():
            self.guard.timed_out += 1
            self.guard.release(self)
            self.transport.close()


class Admission:
    """ASGI middleware: caps on requests being served at once, in all and per client address."""

    def __init__(self, app, max_requests: int = 64, max_per_client: int = 32, retry_after_s: int = 1,
                 exempt: tuple[str, ...] = ("/health",)):
        self.app = app
        self.max_requests = max_requests
        self.max_per_client = max_per_client
        self.retry_after_s = retry_after_s
        self.exempt = exempt
        self.active = 0
        self.per_client: collections.Counter[str] = collections.Counter()
        self.refused = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("?",))[0]
        if self.active >= self.max_requests or self.per_client[client] >= self.max_per_client:
            self.refused += 1
            body = b"server busy: too many requests in progress; retry later\n"
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", str(self.retry_after_s).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        self.active += 1
        self.per_client[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]
