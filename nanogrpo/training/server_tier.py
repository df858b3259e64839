"""The server tier in the loop (``rollout.engine=vllm_server``): the weight sync from this trainer to the
vLLM servers, as a part of the run.

    start        the servers get the run's (resumed) weights before any rollout
    after_step   the staleness of the step's samples is logged; the servers get the step's weights
                 (pause, keep in-flight requests, weights bucket by bucket, resume: ``vllm_server/sync.py``)
    close        every request to the servers ends (a producer waiting on one raises at once)

With ``rollout.max_staleness = 0`` each batch is sampled in the loop under the weights it is trained from
(the sync in place of the in-process engine's reload); with ``k > 0`` a producer thread samples ahead
(:mod:`nanogrpo.training.pipeline`). Each step logs ``staleness/min``, ``/mean``, ``/max`` (policy versions
each sample's oldest token is behind the trained weights), ``staleness/spanning`` and the ``sync/…`` figures.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanogrpo.training.run import Part

log = logging.getLogger("nanogrpo.train")


class ServerTier(Part):
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

    def start(self, run) -> dict[str, Any]:
        """The servers get the run's (resumed) weights before any rollout."""
        figures = self.sync(run.version)  # (rank 0's: the others' hold no sync/time_s)
        if run.is_main:
            log.info("vLLM servers synced to version %d in %.2f s", run.version, figures["sync/time_s"])
        return {}

    def after_step(self, run, step: int, item, row: dict[str, Any]) -> None:
        """The step's staleness figures, then the servers get its weights (when they moved)."""
        be = run.backend
        row.update(staleness(item.versions, item.version, be.all_reduce if be.world_size > 1 else None))
        if run.version != self.sync_driver.version:
            row.update(self.sync(run.version))

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

    def close(self, run=None) -> None:
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


