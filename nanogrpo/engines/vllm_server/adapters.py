"""LoRA runs on the server tier: the servers keep the frozen base weights and serve the adapter; after each
update only the adapter moves (``vllm_server.lora_sync=adapter``, the default with ``model.lora_r > 0``).

One sync (:meth:`AdapterSync.sync`), driven by trainer rank 0:

1. the adapter's tensors are taken from the policy (every rank: an FSDP2 shard is gathered) and rank 0
   writes them once, as PEFT saves an adapter, to ``vllm_server.adapter_dir/policy-v<version>``;
2. servers that were never synced or were restarted (``back``) get the whole base weights through the
   weight-transfer protocol first (:class:`~nanogrpo.engines.vllm_server.sync.WeightSync`, its
   transaction: paused, every bucket, finished, read back), the adapter loaded before they are resumed;
3. every serving server loads the new adapter by name (``POST /v1/load_lora_adapter``) and must list it
   (``GET /v1/models``: the version read back); a server that fails is taken out (its requests ended and
   retried elsewhere) and synced whole once it answers again. No pause: requests in flight keep the
   adapter they named, so a sample never spans two versions;
4. adapters older than the staleness window are unloaded (``POST /v1/unload_lora_adapter``) and their
   files removed, so a server holds at most ``max_staleness + 2`` (``nanogrpo vllm-serve`` starts it with
   ``--max-loras`` that many).

Every request names the newest adapter (``"model": "policy-v<version>"``) and its answer says which one
served it: the sample's version, checked against the window as a full sync's ``weight_versions`` are. A
server that does not hold the named adapter (restarted, or its load failed) answers 404: taken out, the
request retried elsewhere.

**Why vLLM's runtime LoRA loading and not the weight-transfer protocol.** vLLM's transfer engines (NCCL,
IPC, nanogrpo's gloo) write into the served model's own parameters, through its layerwise reload; a LoRA
adapter is not one of them but an entry of vLLM's LoRA manager, which only ``/v1/load_lora_adapter`` (or
a LoRA resolver plugin) fills, and it reads the adapter from a directory. So the trainer writes each
version once and every server reads it by path: ``vllm_server.adapter_dir`` must be readable by the
servers (the same machine, or a filesystem shared across machines: the same constraint as TRL's adapter
sync). A data-parallel ``vllm serve`` loads an adapter on the replica that answers only: run one server
per replica.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nanogrpo.engines.vllm_server.http import ServerFault
from nanogrpo.engines.vllm_server.pool import BACK, OUT, UP, Slot
from nanogrpo.engines.vllm_server.sync import SyncError, WeightSync

log = logging.getLogger("nanogrpo.engines.vllm_server")

PREFIX = "policy-v"


def adapter_name(version: int) -> str:
    """The name a server serves version ``version``'s adapter under (the requests' ``model``)."""
    return f"{PREFIX}{version}"


def adapter_version(name: Any) -> int | None:
    """The version in an adapter's name, None for another name."""
    if isinstance(name, str) and name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
        return int(name[len(PREFIX):])
    return None


def adapter_sync_metrics(time_s: float, send_s: float, adapter_bytes: int, servers: int,
                         base: dict[str, float]) -> dict[str, float]:
    """The metrics of one adapter sync (docs/guides/scaling-out.md has the table of every ``sync/*``):

    - ``sync/adapter_mb``: the adapter, in MiB (written once, read by each server);
    - ``sync/base_servers``, ``sync/base_mb``: the servers that got the frozen base weights whole (new to the
      run or restarted: :class:`WeightSync`'s ``sync/servers``) and the MiB sent to them all (its
      ``sync/mb``);
    - ``sync/servers``: the servers holding the new adapter after the sync (those synced whole included);
    - ``sync/mb``: every MiB sent, ``adapter_mb x servers + base_mb``;
    - ``sync/send_s``: the seconds that moved them (the adapter written, the base to the servers that needed
      it, every server's load and read-back), ``sync/mb_per_s`` = ``sync/mb / sync/send_s``;
    - ``sync/time_s``: the whole sync (the adapter's tensors gathered, the old adapters unloaded too). No
      serving server is paused on this path: it is the trainer's wait, not the servers'.

    ``base``: the base sync's metrics (:meth:`WeightSync.sync` with ``back_only``; empty on ranks > 0)."""
    mb = adapter_bytes / 2**20
    base_servers = base.get("sync/servers", 0.0)
    base_mb = base.get("sync/mb", 0.0) if base_servers else 0.0
    moved = mb * servers + base_mb
    return {"sync/time_s": time_s, "sync/send_s": send_s, "sync/adapter_mb": mb, "sync/base_mb": base_mb,
            "sync/base_servers": base_servers, "sync/servers": float(servers), "sync/mb": moved,
            "sync/mb_per_s": moved / send_s if send_s > 0 else float("nan")}


class AdapterSync:
    """The adapter of ``module`` (a PEFT model) to every server of ``base.pool``; ``base`` is the full sync
    of the frozen base weights (a :class:`WeightSync` over them) for servers that need them whole.
    ``adapter_dir``: where each version is written (the servers read it there); ``keep``: how many versions
    stay loaded (the staleness window plus the newest). ``rank`` / ``broadcast``: as :class:`WeightSync`'s."""

    def __init__(self, base: WeightSync, module, adapter_dir: str | Path, *, keep: int = 2, rank: int = 0,
                 broadcast: Callable[[Any], Any] | None = None):
        from nanogrpo.models.lora import check_adapter_servable

        check_adapter_servable(module)
        self.base, self.pool, self.module = base, base.pool, module
        self.dir = Path(adapter_dir)
        self.keep, self.rank = max(1, keep), rank
        self.broadcast = broadcast or (lambda x: x)
        self.version: int | None = None
        self.history: list[int] = []
        self.failures = 0
        self.last: dict[str, float] = {}
        self._lock = threading.Lock()
        base.after = self._load_on  # a server synced whole gets the adapter before it is resumed

    # ------------------------------------------------------------------ one server

    def _load_on(self, slot: Slot, version: int) -> None:
        """Load version ``version``'s adapter on ``slot`` and read it back (raises on failure)."""
        name = adapter_name(version)
        if slot.state == BACK:  # synced whole (new to this run, or restarted): adapters of another run go
            slot.extra["adapters"] = set()
            for old in slot.client.models():
                if adapter_version(old) is not None:
                    slot.client.unload_adapter(old)
        slot.client.load_adapter(name, str(self.dir / name))
        if name not in slot.client.models():
            raise ServerFault(f"{slot.url} does not list the adapter {name} it was told to load")
        slot.extra.setdefault("adapters", set()).add(version)

    def _load(self, slot: Slot, version: int) -> bool:
        try:
            self._load_on(slot, version)
            return True
        except Exception as e:  # noqa: BLE001 (whatever went wrong, that server is out, not the sync)
            with self._lock:
                self.failures += 1
            log.error("loading the adapter %s on %s failed (%s); it is out of the pool until a later sync "
                      "gives it the whole weights", adapter_name(version), slot.url,
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.pool.mark_out(slot, f"adapter load failed: {e}")
            return False

    # ------------------------------------------------------------------ the sync

    def sync(self, version: int) -> dict[str, float]:
        """Give every reachable server version ``version``'s adapter (and the base weights to those that
        need them). Every trainer rank calls it. Returns its metrics (:func:`adapter_sync_metrics`; rank 0's
        count the bytes, the other ranks' are zeros)."""
        from nanogrpo.models.lora import adapter_state_dict, write_adapter

        t0 = time.perf_counter()
        tensors = adapter_state_dict(self.module)  # every rank: FSDP2 gathers are collectives
        t_send = time.perf_counter()
        nbytes = 0
        if self.rank == 0:
            nbytes = write_adapter(self.module, self.dir / adapter_name(version), tensors)
        del tensors
        whole = self.base.sync(version, back_only=True)  # restarted / new servers: the base, then the adapter
        loaded: list[Slot] = []
        if self.rank == 0:
            fresh = {id(s) for s in self.pool.slots
                     if s.state == UP and version in s.extra.get("adapters", ())}
            serving = [s for s in self.pool.slots if s.state == UP and id(s) not in fresh]
            with ThreadPoolExecutor(max_workers=max(1, len(serving))) as exe:
                ok = list(exe.map(lambda s: self._load(s, version), serving))
            loaded = [s for s, good in zip(serving, ok, strict=True) if good]
            loaded += [s for s in self.pool.slots if id(s) in fresh and s.state == UP]
            for s in loaded:
                self.pool.mark_synced(s, str(version))
        t_sent = time.perf_counter()
        up = self.broadcast([s.url for s in self.pool.usable()] if self.rank == 0 else None)
        if self.rank != 0:
            for s in self.pool.slots:
                if s.url in up:
                    self.pool.mark_synced(s, str(version))
                else:
                    self.pool.mark_out(s, "rank 0's adapter sync did not reach it")
        if not up:
            raise SyncError(f"adapter sync to version {version}: no vLLM server holds the new adapter "
                            f"({', '.join(s.url + ' ' + s.state for s in self.pool.slots)}); not training "
                            "on old ones. A server that cannot read vllm_server.adapter_dir (another "
                            f"machine: {self.dir}) fails so: share it, or use vllm_server.lora_sync=merged")
        self.version = version
        self.history.append(version)
        if self.rank == 0:
            self._forget(self.floor(self.keep - 1))
        self.last = adapter_sync_metrics(time.perf_counter() - t0, t_sent - t_send, nbytes, len(loaded),
                                         whole)
        return dict(self.last)

    def _forget(self, floor: int) -> None:
        """Unload the adapters older than ``floor`` from every server holding them; remove their files."""
        for s in self.pool.slots:
            held = s.extra.get("adapters", set())
            for v in sorted(v for v in held if v < floor):
                if s.state != OUT:
                    try:
                        s.client.unload_adapter(adapter_name(v))
                    except ServerFault as e:  # it is gone, or the server is: nothing to keep
                        log.debug("unloading %s from %s: %s", adapter_name(v), s.url, e)
                held.discard(v)
        for d in self.dir.glob(f"{PREFIX}*"):
            v = adapter_version(d.name)
            if v is not None and v < floor:
                shutil.rmtree(d, ignore_errors=True)

    def floor(self, max_staleness: int) -> int:
        if not self.history:
            return 0
        return self.history[max(0, len(self.history) - 1 - max_staleness)]

    def close(self) -> None:
        self.base.close()

