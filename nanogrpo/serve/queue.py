"""The server's batch queue: ready batches, leases on delivered ones, and the ids it has already seen.

A batch's life, under the id its uploader gave it (``X-Batch-Id``)::

    upload ── (reference forward) ──► ready ── GET /get ──► leased ── POST /ack ──► done (gone)
                                        ▲                      │
                                        └── lease not acked ───┘   within lease_s after the body went out

Delivery is exactly once: a batch leaves the queue only when a consumer acknowledges the
lease it was delivered under. A lease that is not acknowledged in time (the trainer died,
or the client of a long poll vanished before the body reached it) puts the batch back at
the front of the queue, under the same id, for the next ``/get``. Exactly one ack wins per
batch: acking again with the lease that won is answered "acked" again (a retry after a lost
answer), a late ack with an expired lease still wins if the batch has not been delivered
again, and is refused (409) once another lease holds it or has acked it. Leases carry the
server's instance id, so an ack to a restarted server is told the lease is from a previous
instance (its queue, that batch included, died with it).

An id is "seen" while its batch is being processed, queued, leased, or for the last
``remember`` batches done: a second upload of it is a duplicate (not queued twice).
Everything is bounded: the queue by ``capacity``, the memory of done ids and old leases by
``remember``.
"""

from __future__ import annotations

import collections
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

LEASE_RE = re.compile(r"[0-9a-f]{8}\.[0-9]{1,15}\.[0-9a-f]{8}")
"""The shape of a lease id: ``<server instance>.<counter>.<random>``."""


@dataclass
class Item:
    id: str
    body: bytes
    version: int
    lease: str | None = None
    deadline: float | None = None
    """When an unacknowledged lease runs out (monotonic seconds); None while the body is still going out."""


class AckResult:
    ACKED = "acked"            # this ack took the batch out of the queue
    AGAIN = "again"            # this lease had already acked it (a retried ack)
    LOST = "lost"              # the batch went to another lease, or was dropped as stale, before this ack
    UNKNOWN = "unknown"        # no such lease on this server (too old to remember, or never issued)
    OTHER_SERVER = "restarted" # the lease is from a previous instance of the server


class BatchQueue:
    def __init__(self, capacity: int, lease_s: float, remember: int = 65536,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.lease_s = lease_s
        self.remember = remember
        self.clock = clock
        self.instance = secrets.token_hex(4)
        self.ready: collections.deque[Item] = collections.deque()
        self.leased: dict[str, Item] = {}
        self.by_id: dict[str, Item] = {}
        self.processing: set[str] = set()
        self.done: collections.OrderedDict[str, str] = collections.OrderedDict()
        """id -> the lease that acked it ('' when the server dropped it as stale)."""
        self.old_leases: collections.OrderedDict[str, str] = collections.OrderedDict()
        """lease -> id, for leases that are no longer live (to tell "lost" from "unknown")."""
        self._counter = 0
        self.batches_in = self.delivered = self.acked = self.redelivered = self.expired = 0

    # ------------------------------------------------------------------ state
    def depth(self) -> int:
        """Batches held: being processed, ready, or leased and not yet acknowledged."""
        return len(self.ready) + len(self.leased) + len(self.processing)

    def full(self) -> bool:
        return self.depth() >= self.capacity

    def seen(self, batch_id: str) -> bool:
        return batch_id in self.processing or batch_id in self.by_id or batch_id in self.done

    # ------------------------------------------------------------------ upload side
    def begin(self, batch_id: str) -> None:
        """An upload under ``batch_id`` is being processed (decoded, reference forward): it holds a slot."""
        self.processing.add(batch_id)

    def abandon(self, batch_id: str) -> None:
        """The upload failed after :meth:`begin`; the id is free again (the client may retry it)."""
        self.processing.discard(batch_id)

    def put(self, batch_id: str, body: bytes, version: int) -> None:
        self.processing.discard(batch_id)
        item = Item(batch_id, body, version)
        self.ready.append(item)
        self.by_id[batch_id] = item
        self.batches_in += 1

    # ------------------------------------------------------------------ consumer side
    def lease(self) -> Item | None:
        """The next ready batch, now leased (its clock starts with :meth:`start_clock`); None if none."""
        self.expire_leases()
        if not self.ready:
            return None
        item = self.ready.popleft()
        self._counter += 1
        item.lease = f"{self.instance}.{self._counter}.{secrets.token_hex(4)}"
        item.deadline = None
        self.leased[item.lease] = item
        self.delivered += 1
        return item

    def start_clock(self, lease: str) -> None:
        """The lease's body has gone out: from now on it has ``lease_s`` seconds to be acknowledged."""
        item = self.leased.get(lease)
        if item is not None and item.deadline is None:
            item.deadline = self.clock() + self.lease_s

    def expire_leases(self) -> int:
        """Put batches whose lease ran out back at the front of the queue (oldest first); return how many."""
        now = self.clock()
        late = [item for item in self.leased.values() if item.deadline is not None and item.deadline <= now]
        for item in sorted(late, key=lambda it: it.deadline, reverse=True):
            self._forget_lease(item.lease, item.id)
            item.lease, item.deadline = None, None
            self.ready.appendleft(item)
            self.redelivered += 1
        return len(late)

    def ack(self, lease: str) -> tuple[str, str | None]:
        """Acknowledge ``lease``: (:class:`AckResult` value, the batch id when known)."""
        if not lease.startswith(self.instance + "."):
            return AckResult.OTHER_SERVER, None
        item = self.leased.pop(lease, None)
        if item is not None:
            self._finish(item, lease)
            return AckResult.ACKED, item.id
        bid = self.old_leases.get(lease)
        if bid is None:
            return AckResult.UNKNOWN, None
        if self.done.get(bid) == lease:
            return AckResult.AGAIN, bid
        item = self.by_id.get(bid)
        if item is not None and item.lease is None:  # expired, back in the queue, not delivered again yet
            self.ready.remove(item)
            self._finish(item, lease)
            return AckResult.ACKED, bid
        return AckResult.LOST, bid

    def _finish(self, item: Item, lease: str) -> None:
        self.by_id.pop(item.id, None)
        self._remember(self.done, item.id, lease)
        self._forget_lease(lease, item.id)
        self.acked += 1

    def _forget_lease(self, lease: str, batch_id: str) -> None:
        self.leased.pop(lease, None)
        self._remember(self.old_leases, lease, batch_id)

    def _remember(self, d: collections.OrderedDict, key: str, value: str) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > self.remember:
            d.popitem(last=False)

    # ------------------------------------------------------------------ staleness
    def drop_older_than(self, oldest_version: int) -> int:
        """Remove ready (not leased) batches generated before ``oldest_version``; return how many."""
        kept = collections.deque()
        dropped = 0
        for item in self.ready:
            if item.version >= oldest_version:
                kept.append(item)
                continue
            self.by_id.pop(item.id, None)
            self._remember(self.done, item.id, "")
            dropped += 1
        self.ready = kept
        self.expired += dropped
        return dropped

    def clear(self) -> int:
        """Drop everything (shutdown); return how many batches were held."""
        lost = self.depth()
        self.ready.clear()
        self.leased.clear()
        self.by_id.clear()
        self.processing.clear()
        return lost
