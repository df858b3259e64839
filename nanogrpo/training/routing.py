"""Routing replay for mixture-of-experts models (``[moe]``): a part of the run, and terms of its update.

The engine and the trainer can send a token to different experts (other kernels, batch shapes,
precision), so the trainer's log-probs are not those the tokens were sampled with. The mechanics are
:mod:`nanogrpo.moe`; this module is where they join the loop (:class:`RoutingReplay`, registered in
:mod:`nanogrpo.training.setup` for a MoE model):

    after_rollout   the batch's routes checked against the model; under ``rollout`` the groups with a sample
                    the engine returned no routes for are dropped and counted (``routes_groups_dropped``)
    forward         around every micro-batch forward (the update's, the proximal pass, the reference):
                    replay the record, record the policy's own (R2), or compare its top-k with the engine's
    loss            the train-inference log-prob gap of the update's tokens (no term added to the loss)
    stats/metrics   ``mismatch_abs``, ``mismatch_abs_max``, ``mismatch_kl`` (k3), ``mismatch_ratio_out``,
                    ``router_disagreement``: the step logs its first optimizer step's, at the sampling weights

``moe.routing_replay``:

- ``rollout`` (R3): ``batch.routes`` come from the engine; every forward replays its micro-batch's
  slice (:func:`~nanogrpo.moe.routes.trim_routes`), the reference's included;
- ``policy`` (R2): the trainer's own routes at the weights that sampled the batch, recorded in the pass
  over the whole batch before the first optimizer step (the proximal pass of
  :mod:`nanogrpo.training.schedule`, which R2 asks for whenever the batch takes more than one optimizer
  step), written into ``batch.routes`` (a mid-batch checkpoint keeps them) and replayed by the later
  forwards; the reference routes itself;
- ``off``: routes only measured: where the engine recorded them, the policy's forwards compare their own
  top-k with them (``router_disagreement``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch

from nanogrpo.errors import ConfigError
from nanogrpo.moe.families import MoeSpec, RouteError, moe_spec, prepare_for_training, require_moe
from nanogrpo.moe.metrics import STAT_OPS, mismatch_metrics, mismatch_sums, route_sums
from nanogrpo.moe.replay import compare_routes, record_routes, replay_routes
from nanogrpo.moe.routes import (
    check_routes,
    empty_routes,
    prompts_share_routes,
    rows_without_routes,
    trim_columns,
    trim_routes,
)
from nanogrpo.training.run import Part
from nanogrpo.training.terms import Terms

log = logging.getLogger("nanogrpo.moe")
POLICY = "policy"
"""``batch.meta["routes"]`` once R2 recorded the trainer's own routes into ``batch.routes``."""
FIRST_UPDATE = ("mismatch_abs", "mismatch_abs_max", "mismatch_kl", "mismatch_ratio_out",
                "router_disagreement")
"""The step's figures taken from its first optimizer step alone (the weights that sampled the batch)."""


class RoutingReplay(Part, Terms):
    """The run's routing replay (module docstring): ``mode`` off | rollout | policy over the MoE layers of
    ``spec`` (the policy's), ``ratio_band`` the τ of ``mismatch_ratio_out``."""

    stat_ops = STAT_OPS
    first_update = FIRST_UPDATE

    def __init__(self, mode: str, spec: MoeSpec, ratio_band: float = 2.0):
        self.mode, self.spec, self.ratio_band = mode, spec, ratio_band
        self._specs: dict[int, MoeSpec] = {}
        self._sums: dict[str, torch.Tensor] = {}     # route sums since the last update's stats()
        self._engine_routes: torch.Tensor | None = None  # R2: the engine's record of the batch being recorded
        self.groups_dropped = 0

    @classmethod
    def for_run(cls, cfg, model, engine=None, engine_here: bool = True) -> RoutingReplay | None:
        """At setup: the part for ``model`` under ``cfg.moe``, or None (a dense model, replay off). Replay on
        a dense model, or ``rollout`` with an engine that records no routes, is a ConfigError (one line).
        Turns off router jitter and aux-loss outputs (:func:`~nanogrpo.moe.prepare_for_training`), and asks
        an engine that can (hf) for routes, in every mode (the disagreement metric). ``engine_here``: this
        process samples the batches (False: split mode, whose workers' engines record the routes)."""
        mode = cfg.moe.routing_replay
        if mode != "off":
            spec = require_moe(model, mode)
        else:
            try:
                spec = moe_spec(model)
            except RouteError as e:
                log.info("mixture of experts without route records: %s", e)
                return None
            if spec is None:
                return None
        for change in prepare_for_training(model):
            log.info("MoE training forward: %s", change)
        if engine is not None and hasattr(engine, "record_routes"):
            engine.record_routes = True
        elif mode == "rollout" and engine_here:
            name = getattr(engine, "name", type(engine).__name__)
            raise ConfigError(f"moe.routing_replay=rollout: the {name} engine records no routes; use "
                              "rollout.engine=hf, or moe.routing_replay=policy")
        log.info("routing replay %s: %s", mode, spec.describe())
        return cls(mode, spec, cfg.moe.ratio_band)

    # ------------------------------------------------------------------ the loop's points
    def after_rollout(self, run, item) -> None:
        item.batch = self.check(item.batch)

    def after_step(self, run, step: int, item, row: dict) -> None:
        be = run.backend
        dropped = be.all_reduce([float(self.groups_dropped)])[0] if be.world_size > 1 else self.groups_dropped
        row["routes_groups_dropped"] = int(dropped)
        self.groups_dropped = 0

    def state(self, run) -> dict:
        return {}

    # ------------------------------------------------------------------ the update's points
    @property
    def wants_proximal(self) -> bool:
        """R2 records the policy's routes in the pass before a batch's first optimizer step."""
        return self.mode == POLICY

    def share_prefix(self, batch) -> bool:
        """Whether prefix sharing replays exactly (each group's prompt routed alike in all its rows)."""
        if batch is None or batch.routes is None or self.mode == "off":
            return True
        return prompts_share_routes(batch.routes, batch.input_ids, batch.prompt_len)

    def forward(self, model, batch, rows: torch.Tensor, kind: str):
        """The context for one micro-batch forward of ``model`` (the policy or the reference) over ``rows``
        of ``batch``: replay, record, compare, or nothing. ``kind``: ``proximal`` (the pass over the whole
        batch before its first optimizer step: R2 records there), ``update`` (the policy update's forwards:
        the router disagreement is counted), ``reference`` or ``pass``."""
        if batch is None:
            return nullcontext()
        spec = self._spec(model)
        policy = spec.routers[0] is self.spec.routers[0]
        if kind == "proximal" and self.mode == POLICY and policy:
            return self._record(model, batch, rows, spec)
        if batch.routes is None:
            return nullcontext()
        mine = batch.meta.get("routes") == POLICY                             # R2's record, not the engine's
        ids, am = self._inputs(batch, rows)
        measure = kind == "update" and policy
        if self.mode == "rollout" or (self.mode == POLICY and mine and policy):
            return self._counted(replay_routes(model, trim_routes(batch, rows), ids, am, spec=spec), measure)
        if measure and not mine:
            return self._counted(compare_routes(model, trim_routes(batch, rows), ids, am, spec=spec), True)
        return nullcontext()

    def loss(self, batch, rows, logp, head, adv, lm):
        """No term: the update's log-probs against the engine's (the mismatch sums) as stats."""
        c = lm.shape[1]
        return adv, None, mismatch_sums(logp, batch.old_logprobs[rows][:, :c], lm, self.ratio_band)

    def stats(self) -> dict[str, torch.Tensor]:
        """The route sums the forwards since the last call counted (the proximal pass's, this update's)."""
        out, self._sums = self._sums, {}
        return out

    def metrics(self, tot: dict[str, float]) -> dict[str, float]:
        return mismatch_metrics(tot)

    # ------------------------------------------------------------------ mechanics
    def check(self, batch):
        """The batch's routes checked; under ``rollout`` the groups with a row the engine returned no routes
        for dropped (and counted). Returns the batch, or None when no group is left. A batch without routes
        is a RouteError under ``rollout`` (an engine or server that does not return them)."""
        if batch is None:
            return None
        if batch.routes is None:
            if self.mode == "rollout":
                raise RouteError("moe.routing_replay=rollout: the batch has no routes (an engine or server "
                                 "that does not return them: vLLM needs --enable-return-routed-experts)")
            return batch
        check_routes(batch.routes, self.spec, "the batch's routes")
        if tuple(batch.routes.shape[:2]) != tuple(batch.input_ids.shape):
            raise RouteError(f"the batch's routes {tuple(batch.routes.shape)} do not line up with its "
                             f"input_ids {tuple(batch.input_ids.shape)}")
        missing = rows_without_routes(batch.routes, batch.attention_mask)
        if self.mode != "rollout" or not bool(missing.any()):
            return batch
        bad = torch.unique(batch.group_ids[missing.to(batch.group_ids.device)])
        keep = ~torch.isin(batch.group_ids, bad)
        self.groups_dropped += int(bad.numel())
        log.warning("routing replay: %d group(s) dropped, a sample without routes", int(bad.numel()))
        if not bool(keep.any()):
            return None
        return batch.select(torch.nonzero(keep).flatten())

    def _spec(self, model) -> MoeSpec:
        key = id(model)
        if key not in self._specs:
            self._specs[key] = moe_spec(model)
        return self._specs[key]

    @staticmethod
    def _inputs(batch, rows):
        a, b = trim_columns(batch.attention_mask, batch.completion_mask, batch.prompt_len, rows)
        return batch.input_ids[rows][:, a:b], batch.attention_mask[rows][:, a:b]

    @contextmanager
    def _counted(self, ctx, measure: bool):
        with ctx as trace:
            yield trace
        if measure:
            self._add(route_sums(trace.stats))

    @contextmanager
    def _record(self, model, batch, rows, spec: MoeSpec):
        ids, am = self._inputs(batch, rows)
        a, b = trim_columns(batch.attention_mask, batch.completion_mask, batch.prompt_len, rows)
        if batch.meta.get("routes") != POLICY:  # the pass's first micro-batch: the engine's record set aside
            self._engine_routes = batch.routes
            batch.routes = empty_routes(spec, *batch.input_ids.shape, device=batch.input_ids.device)
            batch.meta["routes"] = POLICY
        theirs = self._engine_routes
        engine = None if theirs is None else theirs[rows.to(theirs.device)][:, a:b]
        with record_routes(model, ids, am, compare=engine, spec=spec) as trace:
            yield trace
        batch.routes[rows.to(batch.routes.device), a:b] = trace.routes.to(batch.routes.device)
        if engine is not None:  # the disagreement with the engine, at the weights that sampled the batch
            self._add(route_sums(trace.stats))

    def _add(self, sums: dict[str, torch.Tensor]) -> None:
        for k, v in sums.items():
            v = v.detach().double()
            old = self._sums.get(k)
            self._sums[k] = v if old is None else old + v if STAT_OPS[k] == "sum" else torch.maximum(old, v)
