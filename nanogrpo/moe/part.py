"""Routing replay as a part of the training loop: built once at setup, called at named points.

    part = RoutingReplay.setup(cfg, model, engine)      # None for a dense model (replay off)
    # after the rollout (and the routes onto the batch: Generation.routes -> batch_routes):
    batch = part.after_rollout(batch)                    # checked; groups without routes dropped, counted
    share = share and part.share_prefix(batch)           # a group's prompt routed alike in every row
    # around every forward of a micro-batch (policy update, old / proximal pass, reference):
    with part.forward(model, batch, rows, record=..., measure=...):  # replay, record (R2) or compare
        token_stats(...)                                 # (and its backward, under gradient checkpointing)
    part.after_update(batch, result.logprobs)            # after each optimizer step
    metrics.update(part.step_metrics(reduce))            # after the step

``moe.routing_replay``:

- ``rollout`` (R3): ``batch.routes`` come from the engine; every forward replays its micro-batch's
  slice (:func:`~nanogrpo.moe.routes.trim_routes`), the reference's included.
- ``policy`` (R2): the trainer's own routes at the weights that sampled the batch, recorded in the pass
  that runs before the first optimizer step over the whole batch (``record=True``: the proximal pass of
  ``training/schedule.py``, which R2 then always needs when the batch takes more than one optimizer step),
  written into ``batch.routes`` (so a mid-batch checkpoint saves them) and replayed by the later forwards.
  The reference routes itself.
- ``off``: routes only measured: where the engine recorded them, the policy forwards compare their own
  top-k with them (``router_disagreement``).

Every mode logs the mismatch (:mod:`nanogrpo.moe.metrics`) of the step's first optimizer step, the one
at the weights that sampled the batch.
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

log = logging.getLogger("nanogrpo.moe")
POLICY = "policy"
"""``batch.meta["routes"]`` once R2 recorded the trainer's own routes into ``batch.routes``."""


class RoutingReplay:
    """The loop's routing-replay part (module docstring)."""

    def __init__(self, mode: str, spec: MoeSpec, ratio_band: float = 2.0):
        self.mode, self.spec, self.ratio_band = mode, spec, ratio_band
        self._specs: dict[int, MoeSpec] = {}
        self._update: dict[str, torch.Tensor] = {}     # this optimizer step's sums
        self._first: dict[str, torch.Tensor] | None = None
        self.groups_dropped = 0

    # ------------------------------------------------------------------ setup
    @classmethod
    def setup(cls, cfg, model, engine=None) -> RoutingReplay | None:
        """At start: the part for ``model`` under ``cfg.moe``, or None (a dense model, replay off). Replay on
        a dense model, or ``rollout`` with an engine that records no routes, is a ConfigError (one line).
        Turns off router jitter and aux-loss outputs (:func:`prepare_for_training`), and asks an engine that
        can (hf) for routes, in every mode (the disagreement metric)."""
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
        elif mode == "rollout":
            name = getattr(engine, "name", type(engine).__name__)
            raise ConfigError(f"moe.routing_replay=rollout: the {name} engine records no routes; use "
                              "rollout.engine=hf, or moe.routing_replay=policy")
        log.info("routing replay %s: %s", mode, spec.describe())
        return cls(mode, spec, cfg.moe.ratio_band)

    def _spec(self, model) -> MoeSpec:
        key = id(model)
        if key not in self._specs:
            self._specs[key] = moe_spec(model)
        return self._specs[key]

    # ------------------------------------------------------------------ after the rollout
    def after_rollout(self, batch):
        """Check the batch's routes; under ``rollout`` drop (and count) the groups with a row the engine
        returned no routes for. Returns the batch, or None when no group is left. An engine that returned
        none at all is a RouteError under ``rollout`` (a vLLM server started without the flag)."""
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

    def share_prefix(self, batch) -> bool:
        """Whether prefix sharing replays exactly (each group's prompt routed alike in all its rows)."""
        if batch is None or batch.routes is None or self.mode == "off":
            return True
        return prompts_share_routes(batch.routes, batch.input_ids, batch.prompt_len)

    # ------------------------------------------------------------------ around each forward
    def forward(self, model, batch, rows: torch.Tensor, *, record: bool = False, measure: bool = False):
        """The context for one micro-batch forward of ``model`` (the policy or the reference) over ``rows``
        of ``batch``, trimmed as ``training/step.py``'s ``_trim`` trims them: replay, record, compare, or
        nothing.

        ``record``: this is the pass over the whole batch before its first optimizer step (R2 records the
        policy's routes there; the other modes treat it as any forward). ``measure``: count the router
        disagreement (the policy update's forwards; the step reports its first update's). Keep the context
        open through the backward when gradient checkpointing is on."""
        if batch is None:
            return nullcontext()
        spec = self._spec(model)
        policy = spec.routers[0] is self.spec.routers[0]
        if record and self.mode == POLICY and policy:
            return self._record(model, batch, rows, spec)
        if batch.routes is None:
            return nullcontext()
        mine = batch.meta.get("routes") == POLICY                             # R2's record, not the engine's
        ids, am = self._inputs(batch, rows)
        if self.mode == "rollout" or (self.mode == POLICY and mine and policy):
            ctx = replay_routes(model, trim_routes(batch, rows), ids, am, spec=spec)
            return self._counted(ctx, measure and self.mode == "rollout")
        if measure and policy and not mine:
            return self._counted(compare_routes(model, trim_routes(batch, rows), ids, am, spec=spec), True)
        return nullcontext()

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
        mine = batch.routes is None or batch.meta.get("routes") == POLICY
        engine = None if mine else trim_routes(batch, rows)
        with record_routes(model, ids, am, compare=engine, spec=spec) as trace:
            yield trace
        if batch.routes is None or batch.meta.get("routes") != POLICY:
            batch.routes = empty_routes(spec, *batch.input_ids.shape, device=batch.input_ids.device)
            batch.meta["routes"] = POLICY
        batch.routes[rows.to(batch.routes.device), a:b] = trace.routes.to(batch.routes.device)
        if engine is not None:  # the disagreement with the engine, at the weights that sampled the batch
            self._add(route_sums(trace.stats))

    # ------------------------------------------------------------------ after each optimizer step, the step
    def _add(self, sums: dict[str, torch.Tensor]) -> None:
        for k, v in sums.items():
            v = v.detach().double().cpu()
            old = self._update.get(k)
            both = v if old is None else old + v if STAT_OPS[k] == "sum" else torch.maximum(old, v)
            self._update[k] = both

    def after_update(self, batch, logprobs: torch.Tensor | None) -> None:
        """After each optimizer step, with the update's batch and its forward's log-probs (``UpdateResult.
        logprobs``, (N, C), before the schedule drops them): the mismatch against the engine's
        (``batch.old_logprobs``) over the trained tokens. The step keeps its first update's (the weights
        that sampled the batch)."""
        if batch is not None and logprobs is not None:
            mask = batch.trained_mask
            c = min(logprobs.shape[1], mask.shape[1])
            self._add(mismatch_sums(logprobs[:, :c], batch.old_logprobs[:, :c], mask[:, :c], self.ratio_band))
        if self._first is None:
            self._first = self._update
        self._update = {}

    def step_metrics(self, reduce=None) -> dict[str, float]:
        """After the step: its first optimizer step's mismatch metrics and the groups dropped since the last
        call. ``reduce(values, ops)``: the backend's ``all_reduce`` under several ranks (a collective: every
        rank calls it)."""
        first = self._first if self._first is not None else self._update
        keys = list(STAT_OPS)
        ident = {"sum": 0.0, "max": float("-inf")}
        vals = [float(first[k]) if k in first else ident[STAT_OPS[k]] for k in keys]
        vals.append(float(self.groups_dropped))
        if reduce is not None:
            vals = list(reduce(vals, [STAT_OPS[k] for k in keys] + ["sum"]))
        tot = dict(zip(keys, vals))
        out = mismatch_metrics(tot)
        out["routes_groups_dropped"] = float(vals[-1])
        self._first, self._update, self.groups_dropped = None, {}, 0
        return out
