"""The server tier in the training loop: weight syncs and the asynchronous pipeline
(``rollout.max_staleness``).

With ``rollout.engine=vllm_server`` the loop is::

    sync(v0)                         the servers get the run's (resumed) weights before any rollout
    for each step:  batch <- collect(step)   (now, or already made by the producer thread)
                    update(batch)            the trainer's optimizer steps: v -> v'
                    sync(v')                 pause (keep in-flight) -> weights -> resume

``max_staleness = 0``: ``collect`` runs in the loop, so every batch is sampled under the weights it is
trained from: today's on-policy loop, the sync in place of the in-process engine's reload.

``max_staleness = k > 0``: a producer thread collects the batches of the next steps while the trainer
updates: batch ``s`` may start once step ``s - 1 - k`` is trained and synced, so when step ``s`` trains it
was sampled at most ``k`` syncs ago (a sample paused by a sync continues under the new weights: its
tokens span two versions, as vLLM's ``weight_versions`` spans record). The server engine refuses samples
from outside that window (:attr:`ServerEngine.min_version`). The update then anchors the PPO ratio on
the trainer's own log-probs and ``rollout.correction`` weighs them against the servers' behaviour
log-probs (``algo/corrections.py``). Each batch records the versions it was sampled under
(``batch.policy_version``: the oldest; ``meta["versions"]``), and each step logs ``staleness/min``,
``/mean``, ``/max`` (policy versions behind the trained weights), ``sync/time_s`` (the servers paused),
``pipeline/trainer_wait_s`` (the trainer waiting for its batch) and ``pipeline/producer_wait_s`` (the
producer held by the staleness bound: the servers waiting for weights).

The producer owns the prompt sampler; each batch carries the sampler's state after it was drawn, and a
checkpoint saves *that* state: a resumed run regenerates exactly the batches not yet trained (none lost,
none trained twice).

Several trainer ranks (torchrun DDP / FSDP2): each rank runs its own producer for its share of every
step's prompts (rows ``rank::world`` of the same global stream, as the on-policy loop). The producers'
batch-level sums (advantages over the whole batch, dynamic sampling's refills) go through a gloo group of
their own (:func:`producer_reduce`), so that they never interleave with the update's collectives on the
trainer threads; the trainers agree on whether a step is fresh and merge the staleness figures.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanogrpo.errors import ConfigError

log = logging.getLogger("nanogrpo.train")


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**31 - 1)


# ------------------------------------------------------------------ the servers and their weights


class ServerTier:
    """The run's vLLM servers: its engine's pool and the weight sync from this trainer (every rank)."""

    def __init__(self, cfg, engine, backend, dtype: torch.dtype, tokenizer=None, run_dir: Path | None = None):
        from nanogrpo.engines.vllm_server import base_source, serves_adapter, state_source
        from nanogrpo.engines.vllm_server.sync import WeightSync

        self.cfg, self.engine, self.backend = cfg, engine, backend
        v = cfg.vllm_server
        broadcast = _broadcaster() if backend.world_size > 1 else None
        adapter = serves_adapter(cfg)
        self.source = (base_source if adapter else state_source)(backend.module, dtype)
        self.sync_driver = WeightSync(engine.pool, self.source, transfer=v.transfer,
                                      master_address=v.master_address, bucket_bytes=int(v.bucket_mb * 2**20),
                                      server_world=v.server_world, timeout_s=v.transfer_timeout_s,
                                      rank=backend.rank, broadcast=broadcast, parallel=v.parallel_sync)
        self.k = cfg.rollout.max_staleness
        if adapter:  # LoRA: the base once per server, then the adapter alone (vllm_server/adapters.py)
            from nanogrpo.engines.vllm_server.adapters import AdapterSync

            where = Path(v.adapter_dir) if v.adapter_dir else Path(run_dir or cfg.train.out) / "vllm-adapters"
            self.sync_driver = AdapterSync(self.sync_driver, backend.module, where.resolve(), keep=self.k + 1,
                                           rank=backend.rank, broadcast=broadcast)
        self.probe_ids = tokenizer("12+34=", add_special_tokens=False)["input_ids"] \
            if tokenizer is not None and cfg.vllm_server.probe else None
        if backend.rank == 0:  # first contact: reachable, serving the trainer's model; then the watch
            from nanogrpo.engines.vllm_server.contact import connect
            from nanogrpo.transfer.worker import model_facts

            config = getattr(backend.module, "config", None)
            lora = (cfg.model.lora_r, self.k + 2) if adapter else None
            connect(engine.pool, v.connect_wait_s, model_facts(config) if config is not None else None, lora)
            engine.pool.watch(timeout_s=v.stall_timeout_s)

    def sync(self, version: int) -> dict[str, float]:
        """Every rank: the servers get the current weights as ``version``; the engine's version window
        moves."""
        out = self.sync_driver.sync(version)
        self.engine.max_version = version
        self.engine.min_version = self.sync_driver.floor(self.k)
        out.update(self.engine.pool.stats())
        if self.probe_ids is not None:
            out["sync/probe_diff"] = self.probe()
        return out

    @torch.no_grad()
    def probe(self, new_tokens: int = 8) -> float:
        """Every rank (the forward may be a collective): sample the probe prompt on each serving server
        (T=1, fixed seed: both log-prob modes then report ``log_softmax(logits)``) and return the largest
        difference between its log-probs and this trainer's forward of the same tokens (rank 0's)."""
        from nanogrpo.engines.base import SamplingParams
        from nanogrpo.engines.vllm_server.http import ServerDown

        worst = 0.0
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=1234)
        module = self.backend.module
        was_training = module.training
        module.eval()
        try:
            slots = self.engine.pool.usable() if self.backend.rank == 0 else []
            n = len(slots) if self.backend.world_size == 1 else _broadcaster()(len(slots))
            for i in range(n):
                got = None
                if self.backend.rank == 0:
                    try:
                        got = self.engine.sample_on_server(slots[i], self.probe_ids, params)
                    except ServerDown as e:  # died since its sync: out, and synced again once back
                        self.engine.pool.mark_out(slots[i], e)
                if self.backend.world_size > 1:
                    got = _broadcaster()(got)
                if got is None:
                    continue
                ids, lps = got
                dev = next(module.parameters()).device
                full = torch.tensor([self.probe_ids + ids], device=dev)
                logits = module(full).logits[0, len(self.probe_ids) - 1:-1].float()
                mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids, device=dev)[:, None])[:, 0]
                worst = max(worst, float((mine.cpu() - torch.tensor(lps)).abs().max()))
        finally:
            module.train(was_training)
        return worst

    def close(self) -> None:
        """End every request to the servers now (a producer waiting on one raises at once), then the
        transfer groups."""
        self.engine.pool.close()
        self.sync_driver.close()
        self.engine.close()


def _broadcaster() -> Callable[[Any], Any]:
    import torch.distributed as dist

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    return broadcast


def staleness(versions: list[tuple[int, int]], now: int, all_reduce=None) -> dict[str, float]:
    """``staleness/min|mean|max``: how many policy versions each sample's oldest token is behind ``now``;
    ``staleness/spanning``: samples whose tokens span versions. ``all_reduce`` (several ranks: the
    backend's, called on every rank): over every rank's samples."""
    lag = [now - lo for lo, _ in versions]
    figures = [float(len(lag)), float(sum(lag)), float(min(lag, default=math.inf)),
               float(max(lag, default=-math.inf)), float(sum(lo != hi for lo, hi in versions))]
    if all_reduce is not None:
        figures = all_reduce(figures, ["sum", "sum", "min", "max", "sum"])
    n, total, low, high, spanning = figures
    if not n:
        return {}
    return {"staleness/min": low, "staleness/mean": total / n, "staleness/max": high,
            "staleness/spanning": spanning}


def fresh_everywhere(fresh: bool, backend) -> bool:
    """Whether every rank's share of the step was sampled under the current weights (each rank then takes
    the same path through the update, whose forwards may be collectives)."""
    if backend.world_size == 1:
        return fresh
    return bool(backend.all_reduce([float(fresh)], ["min"])[0])


def producer_reduce() -> Callable[[list[float]], list[float]]:
    """Several ranks, called on every rank in the same order (a new process group): the producers' sums
    over the ranks, on a gloo group of their own, beside the trainer threads' collectives."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")

    def reduce(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=group)
        return t.tolist()

    return reduce


# ------------------------------------------------------------------ the producer


def produce(cfg, step: int, tok, engine, sampler, rewards, tools, env, rank: int = 0, world: int = 1,
            reduce: Callable[[list[float]], list[float]] | None = None) -> Made:
    """Step ``step``'s batch (this rank's share: rows ``rank::world``), in the producer thread: prompts
    drawn, sampled on the servers, scored (what :func:`~nanogrpo.training.trainer.train_step` does before
    its update). ``reduce``: several ranks, :func:`producer_reduce`'s. The model is not touched here: the
    trainer is updating it."""
    from nanogrpo.rollout.collect import rollout

    t0 = time.perf_counter()
    rows = sampler.next_batch()[rank::world]
    with engine.recording() as versions:
        batch, rstats = rollout(engine, tok, rows, rewards, cfg.data, cfg.rollout, cfg.grpo,
                                template=cfg.model.chat_template, seed=step_seed(cfg.train.seed, step) + rank,
                                policy_version=engine.max_version, tools=tools, env=env, reduce=reduce,
                                keep_examples=cfg.log.samples_per_step,
                                more=lambda n: sampler.next_batch(n)[rank::world],
                                keep_all=bool(cfg.distill.teacher))
    if batch is not None and versions:
        batch.policy_version = min(lo for lo, _ in versions)
        batch.meta["versions"] = [min(lo for lo, _ in versions), max(hi for _, hi in versions)]
    roll = {"metrics": rstats.metrics(), "examples": rstats.examples,
            "rollout_time_s": time.perf_counter() - t0}
    return Made(step, batch, roll, sampler.state_dict(), list(versions))


def consume(cfg, made: Made, ref, device, backend=None, distill=None):
    """The trainer's side of a produced batch: on its device, with the reference log-probs (computed here,
    in the trainer's thread: a LoRA reference is the policy itself with its adapters off), as the
    :class:`~nanogrpo.training.schedule.Pending` that ``train_step`` continues from. Several ranks: every
    rank calls it (the mini-batch count is agreed; a rank without rows still joins the update)."""
    from nanogrpo.training.schedule import Pending, Schedule, mini_batch_count
    from nanogrpo.training.step import reference_logprobs

    batch = made.batch
    if batch is not None:
        batch = batch.to(device)
        if ref is not None:
            batch.ref_logprobs = reference_logprobs(ref, batch, cfg.train, cfg.train.share_prefix,
                                                    temperature=cfg.rollout.logprob_temperature(),
                                                    support=cfg.rollout.logprob_support())
        if distill is not None:  # the teacher scores it here too (its own device, its own thread)
            distill.annotate(batch, cfg.train, cfg.train.share_prefix)
    several = backend is not None and backend.world_size > 1
    sched = Schedule(parts=mini_batch_count(batch, cfg.grpo.mini_batches, backend)) \
        if batch is not None or several else None
    return Pending(made.step, sched, batch, made.roll)


@dataclass
class Made:
    """One step's batch as the producer made it."""

    step: int
    batch: Any
    roll: dict
    sampler_state: dict
    versions: list[tuple[int, int]] = field(default_factory=list)
    error: BaseException | None = None


class Pipeline:
    """A producer thread that runs ``make(step)`` for steps ``first..last`` in order, at most ``k`` steps
    ahead of the trainer: step ``s`` starts once :meth:`trained` has been called for ``s - 1 - k``."""

    def __init__(self, make: Callable[[int], Made], first: int, last: int, k: int):
        if k < 1:
            raise ConfigError("Pipeline needs max_staleness >= 1 (0 is the loop without a producer)")
        self.make, self.first, self.last, self.k = make, first, last, k
        self._done = first - 1
        self._cv = threading.Condition()
        self._out: queue.Queue[Made] = queue.Queue()
        self._stop = False
        self.producer_wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="nanogrpo-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for step in range(self.first, self.last + 1):
            t0 = time.perf_counter()
            with self._cv:
                while not self._stop and self._done < step - 1 - self.k:
                    self._cv.wait(timeout=1.0)
                if self._stop:
                    return
                self.producer_wait_s += time.perf_counter() - t0
            try:
                made = self.make(step)
            except BaseException as e:  # noqa: BLE001 (handed to the trainer, which raises it)
                self._out.put(Made(step, None, {}, {}, error=e))
                return
            self._out.put(made)

    def get(self, step: int) -> tuple[Made, float]:
        """Step ``step``'s batch (made in order) and how long the trainer waited for it."""
        t0 = time.perf_counter()
        made = self._out.get()
        if made.error is not None:
            raise made.error
        if made.step != step:
            raise RuntimeError(f"the producer made step {made.step}'s batch where step {step} was due")
        return made, time.perf_counter() - t0

    def trained(self, step: int) -> None:
        """Step ``step`` is trained and its weights synced: the producer may run ``k`` steps past it."""
        with self._cv:
            self._done = step
            self._cv.notify_all()

    def take_producer_wait(self) -> float:
        with self._cv:
            w, self.producer_wait_s = self.producer_wait_s, 0.0
        return w

    def close(self, wait_s: float = 30.0) -> None:
        """Stop the producer; wait for it up to ``wait_s`` seconds (close the servers' pool first: a
        producer inside a rollout then ends at once). It is a daemon: one still running does not hold
        the process."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=wait_s)
