"""The weight sync: the trainer's weights to every vLLM server, through vLLM's weight-transfer protocol.

**A sync is a transaction.** After it, each server is in exactly one of two states:

- **on the new weights**: paused, sent every bucket, finished (``/finish_weight_update``), its version
  set and read back (``/weight_info``), then resumed; or
- **out**: taken out of the pool, *never resumed* (a server whose update did not finish holds half-loaded
  weights, some of them not even on its device), its queued requests ended and retried elsewhere; it
  serves again only after a later sync has given it the whole weights and resumed it.

``/resume`` is sent only to servers in the first state. One sync (:meth:`WeightSync.sync`), driven by
trainer rank 0:

1. servers that were out and answer again are probed (:meth:`ServerPool.probe`); they get the weights too;
2. new requests are held (the pool's gate) and every serving server is paused with ``mode=keep``
   (``POST /pause?mode=keep``): requests in flight stay in its queue, their KV caches kept. A server that
   refuses the pause (or does not answer) is out and is not sent to;
3. for each server: its trainer-side engine (``vllm_server.transfer``: ``gloo`` ours on the CPU, ``nccl``
   or ``ipc`` vLLM's; one process group per server, so a failure stays that server's) sends the
   weights bucket by bucket (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``),
   then ``/update_weight_version`` sets the version and ``/weight_info`` must read it back. One server
   after another, or, for a one-process trainer with ``parallel`` (``vllm_server.parallel_sync``), every
   server at once, one thread each (the model's state taken once for all of them: a LoRA merge is not
   made once per server); several trainer ranks always go one server after another, since each pass
   gathers FSDP2 shards with collectives that every rank must run in the same order;
4. the servers on the new weights are resumed (``/resume``); a request paused mid-sequence continues
   under the new weights (its ``weight_versions`` then span two versions). A server whose resume fails is
   out.

Faults are seen in seconds, not timeouts: a refused connection is an answer (the transfer group is not
built for a server that said no); a server that stalls (``/health`` silent, :meth:`ServerPool.watch`) is
taken out and its calls ended. When no server holds the new weights the sync raises :class:`SyncError`:
nothing is ever sampled from a server with mixed or old weights (the engine also checks every sample's
version). docs/guides/scaling-out.md has the table of faults and what the trainer does at each.

Several trainer ranks: every rank calls :meth:`WeightSync.sync` (FSDP2 gathers each tensor, a collective,
while rank 0 packs its bucket); rank 0 tells the others how many servers it sends to, and a rank-0
failure mid-send still runs the rest of that pass's gathers
(:meth:`~nanogrpo.transfer.source.StateSource.finish_pass`) so no rank hangs.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from nanogrpo.engines.vllm_server.http import ServerFault
from nanogrpo.engines.vllm_server.pool import BACK, OUT, UP, ServerPool, Slot
from nanogrpo.errors import NanoGRPOError

log = logging.getLogger("nanogrpo.engines.vllm_server")

TRANSFERS = ("gloo", "nccl", "ipc")


class SyncError(NanoGRPOError):
    """No server holds the weights the trainer sent."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightSync:
    """Pushes the trainer's weights (``source``: a ``WeightSource``) to the servers of ``pool``.

    ``transfer``: ``gloo`` | ``nccl`` | ``ipc``; ``master_address``: this machine's address as the
    servers reach it (the transfer's rendezvous); ``bucket_bytes``: the gloo engine's bucket;
    ``server_world``: worker processes per server (tensor x pipeline x data parallel; 1 on the CPU);
    ``rank`` / ``broadcast``: this trainer rank and a function that gives every rank rank 0's object
    (multi-rank trainers; every rank calls it in the same order)."""

    def __init__(self, pool: ServerPool, source, *, transfer: str = "gloo", master_address: str = "127.0.0.1",
                 bucket_bytes: int = 64 << 20, server_world: int = 1, timeout_s: float = 300.0, rank: int = 0,
                 broadcast: Callable[[int], int] | None = None, parallel: bool = False):
        if transfer not in TRANSFERS:
            raise ValueError(f"unknown weight transfer {transfer!r}: one of {TRANSFERS}")
        self.pool, self.source, self.transfer = pool, source, transfer
        self.master_address, self.bucket_bytes = master_address, bucket_bytes
        self.server_world, self.timeout_s, self.rank = server_world, timeout_s, rank
        self.broadcast = broadcast or (lambda x: x)
        self.multi_rank = broadcast is not None
        self.parallel = parallel and not self.multi_rank
        """Send to every server at once (one thread each); never with several trainer ranks."""
        self.version: int | None = None
        self.history: list[int] = []
        """Versions synced, oldest first."""
        self.failures = 0
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self.last: dict[str, float] = {}
        self.after: Callable[[Slot, int], None] | None = None
        """Called for each server once its weights are in and read back, before it is resumed; raising
        fails that server's sync (the LoRA path loads the current adapter here)."""

    # ------------------------------------------------------------------ one server

    def _engine(self, slot: Slot):
        """The trainer-side engine bound to ``slot`` (built, and the server's side initialised, once; one
        build at a time: vLLM's engine registry is not guarded for threads)."""
        with self._build_lock:
            if slot.transfer is None:
                slot.transfer = self._build(slot)
            return slot.transfer

    def _build(self, slot: Slot):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from nanogrpo.transfer.plugin import register

        register()
        world = 1 + self.server_world
        if self.transfer == "gloo":
            from nanogrpo.transfer.gloo import GlooTrainerInitInfo

            info = GlooTrainerInitInfo(master_address=self.master_address,
                                       master_port=free_port(self.master_address), world_size=world,
                                       bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s, rank=0)
        elif self.transfer == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(master_address=self.master_address,
                                       master_port=free_port(self.master_address), world_size=world, rank=0)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        return WeightTransferTrainerFactory.trainer_init(info, client=slot.client, source=self.source)

    def _send_one(self, slot: Slot, version: int) -> None:
        if slot.transfer is None:  # a new transfer group: only for a server that answers at all
            why = slot.client.health()
            if why is not None:
                raise ServerFault(why)
        engine = self._engine(slot)
        try:
            engine.send_weights()
        except ServerFault as e:
            if "already active" not in str(e):
                raise
            # an update left open (a trainer stopped between its last bucket and finish): close it, then
            # send everything again; the server stays paused throughout
            log.warning("%s had a weight update left open (a trainer stopped mid-sync); closing it", slot.url)
            slot.client.finish_weight_update()
            engine.send_weights()
        slot.client.update_weight_version(str(version))
        got = slot.client.weight_version()
        if got != str(version):
            raise ServerFault(f"{slot.url} reads back weight version {got!r} after a sync to {version}")
        if self.after is not None:  # what else the server must hold before it serves (a LoRA adapter)
            self.after(slot, version)

    # ------------------------------------------------------------------ the sync

    def sync(self, version: int, back_only: bool = False) -> dict[str, float]:
        """Give every reachable server the trainer's current weights as ``version`` (the module's
        transaction). Every trainer rank calls it. Returns its metrics (``sync/time_s``, ``sync/mb``,
        ``sync/mb_per_s``, ``sync/servers``). ``back_only``: only the servers waiting for weights
        (``back``: restarted, or never synced), the others left serving as they are (the LoRA path: their
        base weights are current); then no server being usable is the caller's to judge."""
        t0 = time.perf_counter()
        if self.rank != 0:
            for _ in range(self.broadcast(None)):
                for _ in self.source:  # this rank's part of each gather
                    pass
            up = self.broadcast(None)  # which servers hold the new weights (rank 0's word)
            for s in self.pool.slots:
                if s.url in up:
                    self.pool.mark_synced(s, str(version))
                else:
                    self.pool.mark_out(s, "rank 0's weight sync did not reach it")
            if not up and not back_only:
                raise SyncError(f"weight sync to version {version}: no vLLM server holds the new weights")
            if not back_only:
                self.version = version
                self.history.append(version)
            return {}
        pool = self.pool
        pool.probe(force=True)
        pool.hold()
        told = False
        done: list[Slot] = []
        try:
            targets = [s for s in pool.slots if s.state == BACK or (s.state == UP and not back_only)]
            with ThreadPoolExecutor(max_workers=max(1, len(targets))) as exe:
                for slot, err in zip(targets, exe.map(self._pause, targets), strict=True):
                    if err is not None:
                        pool.mark_out(slot, f"pause failed: {err}")
            sending = [s for s in targets if s.state != OUT]  # a server that refused the pause: not sent to
            self.broadcast(len(sending))
            told = True
            t_pause = time.perf_counter()
            if self.parallel and len(sending) > 1:
                with self.source.pinned(), ThreadPoolExecutor(max_workers=len(sending)) as exe:
                    ok = list(exe.map(lambda slot: self._sync_one(slot, version), sending))
            else:
                ok = [self._sync_one(slot, version) for slot in sending]
            t_send = time.perf_counter()
            for slot, good in zip(sending, ok, strict=True):
                if good and slot.state != OUT and self._resume(slot):  # only a whole, finished update
                    pool.mark_synced(slot, str(version))
                    done.append(slot)
        finally:
            pool.release()
            if self.multi_rank:
                if not told:  # rank 0 failed before the passes: the other ranks run none
                    self.broadcast(0)
                self.broadcast([s.url for s in pool.usable()])
        if not pool.usable() and not back_only:
            raise SyncError(f"weight sync to version {version}: no vLLM server holds the new weights "
                            f"({', '.join(s.url + ' ' + s.state for s in pool.slots)}); not training on "
                            "old ones")
        if not back_only:
            self.version = version
            self.history.append(version)
        mb = self.source.total_bytes() / 2**20 if hasattr(self.source, "total_bytes") else float("nan")
        send_s = t_send - t_pause
        moved = mb * len(done)
        self.last = {"sync/time_s": time.perf_counter() - t0, "sync/send_s": send_s, "sync/mb": moved,
                     "sync/mb_per_s": moved / send_s if send_s > 0 else float("nan"),
                     "sync/servers": float(len(done))}
        return dict(self.last)

    def _sync_one(self, slot: Slot, version: int) -> bool:
        """Send to one server; on any failure take it out (it must not serve mixed weights: it stays
        paused, its queued requests are ended) and, with several trainer ranks, run the rest of this
        pass's gathers so that no rank hangs."""
        passes = getattr(self.source, "passes", 0)
        try:
            if slot.state == OUT:  # taken out meanwhile (stalled: the liveness watch)
                raise ServerFault("taken out before its turn")
            self._send_one(slot, version)
            return True
        except Exception as e:
            with self._lock:
                self.failures += 1
            log.error("weight sync to %s failed (%s: %s); it is out of the pool, paused, until a later sync "
                      "gives it the whole weights", slot.url, type(e).__name__,
                      str(e).splitlines()[0] if str(e) else "")
            self.pool.mark_out(slot, f"weight sync failed: {e}")
        if self.multi_rank:  # the other ranks' gathers of this pass must still run
            self.source.finish_pass(started=getattr(self.source, "passes", 0) > passes)
        return False

    def _resume(self, slot: Slot) -> bool:
        try:
            slot.client.resume()
        except Exception as e:  # noqa: BLE001 (whatever went wrong, that server is out, not the sync)
            self.pool.mark_out(slot, f"resume failed: {e}")
            return False
        slot.paused = False
        return True

    @staticmethod
    def _pause(slot: Slot) -> Exception | None:
        if slot.state != UP:
            return None  # a server coming back serves nothing (one a failed sync left paused stays so)
        try:
            slot.client.pause("keep")
            slot.paused = True
            return None
        except Exception as e:  # noqa: BLE001 (whatever went wrong, that server is out, not the sync)
            return e

    def floor(self, max_staleness: int) -> int:
        """The oldest version a sample may be taken under when at most ``max_staleness`` syncs are missing."""
        if not self.history:
            return 0
        return self.history[max(0, len(self.history) - 1 - max_staleness)]

    def close(self) -> None:
        for s in self.pool.slots:
            if s.transfer is not None:
                try:
                    s.transfer.shutdown()
                except Exception:  # noqa: BLE001 (closing: nothing left to protect)
                    pass
                s.transfer = None
