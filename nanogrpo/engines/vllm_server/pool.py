"""The servers of ``rollout.servers`` as one pool: requests spread by load, failover, taking servers back.

- **Load.** Each request goes to the usable server with the fewest requests in flight (ties: the
  server used least recently), so a server that answers slower (fewer GPUs, a longer queue) gets
  fewer requests.
- **Failover.** A server that does not answer (:class:`~nanogrpo.engines.vllm_server.http.ServerDown`:
  refused, reset, timed out, 5xx) is taken out at once; the request is sent again to another server
  (``retries`` counts these). A request is tried at most ``max_attempts`` times; when no server is
  usable the pool waits for one up to ``wait_s`` seconds, then raises :class:`NoServer`.
- **Taking back.** A server that is out is probed (``/health``) at most every ``probe_s`` seconds; once it
  answers it is ``back``: alive but *not* usable until the weight sync has given it the current weights
  (:meth:`ServerPool.mark_synced`). A restarted server comes up with its launch weights, so it
  must never serve before that.
- **Taking out ends its requests.** A server taken out (:meth:`ServerPool.mark_out`) has every request
  in flight to it ended at once (:meth:`~nanogrpo.engines.vllm_server.http.ServerClient.abort`): they
  are retried elsewhere at once, not after their timeouts (a stalled server; a server a failed sync left
  paused, whose queued requests would never run).
- **A stalled server is seen in seconds** (:meth:`ServerPool.watch`): while requests or a sync's calls
  are in flight to a server, its ``/health`` is asked every ``every_s`` seconds; one that does not answer
  within ``timeout_s`` (SIGSTOPped, its machine hung, the network cut) is taken out.
- **Closing** (:meth:`ServerPool.close`, the run stopping): every request waiting for a server or in
  flight ends at once, so that no thread outlives a stopped run by a timeout.

Pure Python over any client with ``healthy()`` (tests drive it with real local HTTP servers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nanogrpo.engines.vllm_server.http import ServerDown
from nanogrpo.errors import NanoGRPOError

log = logging.getLogger("nanogrpo.engines.vllm_server")
T = TypeVar("T")

UP, OUT, BACK = "up", "out", "back"


class NoServer(NanoGRPOError):
    """No server of the pool could take a request."""


@dataclass
class Slot:
    """One server and what the pool knows of it."""

    client: Any
    state: str = BACK
    """``up`` (serving the current weights), ``out`` (stopped answering), ``back`` (answers again, or
    has never been synced: waits for the weight sync)."""
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    version: str | None = None
    """The weight version last synced to it."""
    last_used: float = 0.0
    last_probe: float = 0.0
    transfer: Any = None
    """The trainer-side weight-transfer engine bound to this server (the sync driver's)."""
    paused: bool = False
    """Paused by this trainer (``/pause``) and not resumed since: a server whose sync failed stays so."""
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return getattr(self.client, "url", "?")


class ServerPool:
    def __init__(self, clients: list[Any], *, max_attempts: int = 4, wait_s: float = 120.0,
                 probe_s: float = 2.0, probe_timeout_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        if not clients:
            raise ValueError("a server pool needs at least one server")
        self.slots = [Slot(c) for c in clients]
        self.max_attempts, self.wait_s, self.probe_s = max_attempts, wait_s, probe_s
        self.probe_timeout_s = probe_timeout_s
        self.retries = 0
        self.taken_out = 0
        self._clock = clock
        self._cv = threading.Condition()
        self._gate = True
        """False while a weight sync holds the pool (new requests wait; in-flight ones are the servers')."""
        self._closed: str | None = None
        """Why the pool was closed (:meth:`close`); requests then fail at once."""
        self._watcher: threading.Thread | None = None
        self._stop_watch = threading.Event()

    # ------------------------------------------------------------------ choosing a server

    def usable(self) -> list[Slot]:
        return [s for s in self.slots if s.state == UP]

    def _pick(self, avoid: set[int]) -> Slot | None:
        cands = [s for i, s in enumerate(self.slots) if s.state == UP and i not in avoid] or \
                [s for s in self.slots if s.state == UP]
        if not cands:
            return None
        best = min(cands, key=lambda s: (s.in_flight, s.last_used))
        best.in_flight += 1
        best.last_used = self._clock()
        return best

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` on the least-loaded usable server; on :class:`ServerDown` the server is taken out
        (unless it was a connection lost while the server still answers ``/health``: a keep-alive
        connection the server closed as the request went out) and ``fn`` runs again elsewhere (at most
        ``max_attempts`` tries in all)."""
        tried: set[int] = set()
        last: Exception | None = None
        for attempt in range(self.max_attempts):
            slot = self._acquire(tried)
            i = self.slots.index(slot)
            try:
                out = fn(slot.client)
            except ServerDown as e:
                last = e
                tried.add(i)
                self._release(slot, ok=False, err=e, transient=self._transient(slot, e))
                if attempt + 1 < self.max_attempts:
                    with self._cv:
                        self.retries += 1
                continue
            except BaseException:
                self._release(slot, ok=True)
                raise
            self._release(slot, ok=True)
            return out
        raise NoServer(f"a request failed on {self.max_attempts} tries; last: {last}")

    def _acquire(self, avoid: set[int]) -> Slot:
        deadline = self._clock() + self.wait_s
        while True:
            with self._cv:
                if self._closed is not None:
                    raise NoServer(f"the server pool is closed: {self._closed}")
                slot = self._pick(avoid) if self._gate else None
                if slot is not None:
                    return slot
                if self._clock() >= deadline:
                    states = ", ".join(f"{s.url} {s.state}" for s in self.slots)
                    raise NoServer(f"no vLLM server could take a request for {self.wait_s:.0f} s ({states})")
                self._cv.wait(timeout=0.5)
                idle = self._gate and not self.usable()
            if idle:  # no server to send to, none syncing: one out by mistake may hold the weights still
                self.readmit()

    def readmit(self) -> list[Slot]:
        """Servers that are out but still serve exactly the weights they were last synced to (they answer,
        are not paused, and report that version: taken out by a transient fault, not restarted, no sync
        of theirs failed) are taken back at once; a restarted or half-synced one waits for the next sync.
        At most every ``probe_s`` per server. Returns the servers taken back."""
        now = self._clock()
        back = []
        for s in self.slots:
            if s.state != OUT or s.version is None or now - s.last_probe < self.probe_s:
                continue
            s.last_probe = now
            try:
                same = s.client.health(timeout=self.probe_timeout_s) is None and not s.client.is_paused() \
                    and s.client.weight_version() == s.version
            except Exception:  # noqa: BLE001 (it does not answer as it should: it stays out)
                same = False
            if same:
                with self._cv:
                    if s.state == OUT:
                        s.state = UP
                        back.append(s)
                    self._cv.notify_all()
                log.warning("vLLM server %s answers again with the weights it was synced to (version %s): "
                            "serving again", s.url, s.version)
        return back

    def _release(self, slot: Slot, ok: bool, err: Exception | None = None, transient: bool = False) -> None:
        with self._cv:
            slot.in_flight -= 1
            if ok:
                slot.served += 1
            self._cv.notify_all()
        if not ok and not transient and slot.state == UP:
            self.mark_out(slot, err or "a request failed")

    def _transient(self, slot: Slot, err: Exception) -> bool:
        """Whether a request's failure on a serving server was its connection's, not the server's: the
        connection was lost (not refused, not a 5xx, not a stale sample) and the server answers
        ``/health`` at once. Then the server stays in and the request is sent again."""
        from nanogrpo.engines.vllm_server.http import ServerRefused

        text = str(err)
        lost = not isinstance(err, ServerRefused) and type(err) is ServerDown and "HTTP 5" not in text \
            and ("RemoteProtocolError" in text or "ReadError" in text or "WriteError" in text)
        if not lost or slot.state != UP or self._closed is not None:
            return False
        health = getattr(slot.client, "health", None)
        if health is None or health(timeout=self.probe_timeout_s) is not None:
            return False
        log.debug("vLLM server %s: a connection lost (%s), the server answers: sent again", slot.url, text)
        return True

    # ------------------------------------------------------------------ the sync driver's side

    def hold(self) -> None:
        """New requests wait until :meth:`release` (a weight sync is under way)."""
        with self._cv:
            self._gate = False

    def release(self) -> None:
        with self._cv:
            self._gate = True
            self._cv.notify_all()

    def probe(self, force: bool = False) -> list[Slot]:
        """Probe servers that are out (at most every ``probe_s``); those that answer become ``back``.
        Returns the servers waiting for weights (``back``)."""
        now = self._clock()
        due = [s for s in self.slots if s.state == OUT and (force or now - s.last_probe >= self.probe_s)]
        for s in due:
            s.last_probe = now
        if due:  # at once: a stalled server costs the sync one short timeout, not one per server
            with ThreadPoolExecutor(max_workers=len(due)) as exe:
                answers = list(exe.map(lambda s: s.client.healthy(timeout=self.probe_timeout_s), due))
            for s, ok in zip(due, answers, strict=True):
                if ok:
                    with self._cv:
                        s.state = BACK
                    _drop_transfer(s)  # a restarted server has a new transfer engine: init again
                    log.warning("vLLM server %s answers again; it serves once it has the current weights",
                                s.url)
        return [s for s in self.slots if s.state == BACK]

    def mark_synced(self, slot: Slot, version: str) -> None:
        with self._cv:
            slot.version = version
            slot.state = UP
            self._cv.notify_all()

    def mark_out(self, slot: Slot, err: Exception | str) -> None:
        """Take ``slot`` out: it serves nothing until a later sync has given it the whole weights; the
        requests in flight to it end now (retried elsewhere)."""
        with self._cv:
            taken = slot.state != OUT
            if taken:
                slot.state = OUT
                slot.failures += 1
                slot.last_probe = self._clock()
                self.taken_out += 1
            self._cv.notify_all()
        if taken:  # (outside the lock: dropping a transfer group tells its server, which may be stalled)
            _drop_transfer(slot)
            if self._closed is None:  # (a closed pool's requests end by design)
                log.warning("vLLM server %s taken out of the pool: %s", slot.url,
                            str(err).splitlines()[0] if str(err) else type(err).__name__)
        _abort(slot)

    # ------------------------------------------------------------------ liveness and the end

    def watch(self, every_s: float = 2.0, timeout_s: float = 10.0) -> None:
        """Start the liveness watch (a daemon thread): every ``every_s`` seconds, each server with requests
        in flight that does not answer ``/health`` within ``timeout_s`` is taken out."""
        if self._watcher is not None:
            return

        def run() -> None:
            while not self._stop_watch.wait(every_s):
                for s in self.slots:
                    if s.state == OUT or not getattr(s.client, "busy", 0):
                        continue
                    why = s.client.health(timeout=timeout_s)
                    if why is not None and s.state != OUT and not self._stop_watch.is_set():
                        self.mark_out(s, f"stalled: {why}")

        self._watcher = threading.Thread(target=run, name="nanogrpo-server-watch", daemon=True)
        self._watcher.start()

    def close(self, why: str = "the run is stopping") -> None:
        """End the pool: requests waiting for a server fail at once, those in flight are ended, the
        watch stops. Idempotent."""
        with self._cv:
            if self._closed is None:
                self._closed = why
            self._cv.notify_all()
        self._stop_watch.set()
        for s in self.slots:
            _abort(s)

    def stats(self) -> dict[str, float]:
        return {"servers/up": float(len(self.usable())), "servers/retries": float(self.retries),
                "servers/taken_out": float(self.taken_out)}


def _abort(slot: Slot) -> None:
    abort = getattr(slot.client, "abort", None)
    if abort is not None:
        abort()


def _drop_transfer(slot: Slot) -> None:
    """Forget a server's trainer-side transfer engine (its process group ends without waiting)."""
    engine, slot.transfer = slot.transfer, None
    if engine is not None:
        try:
            engine.shutdown()
        except Exception as e:  # noqa: BLE001 (the group is being dropped either way)
            log.debug("shutting down the transfer engine of %s: %s", slot.url, e)
