"""One policy update on one rollout batch: micro-batches, gradient accumulation, clipping.

Micro-batches (:mod:`nanogrpo.training.micro`): rows packed by length, the columns that are padding for
all of a micro-batch's rows dropped.

Exactness: every micro-batch's loss is normalised by whole-batch totals (over all
ranks), so the micro-batch losses sum to the full-batch loss and the accumulated
gradient is the full-batch gradient, whatever the split. Under N ranks, each
rank's loss is multiplied by N before backward because DDP, FSDP2 and DeepSpeed
*average* gradients over ranks; ranks pad their micro-batch count to the
largest with zero-weight micro-batches so that every collective is matched.

Whole-batch quantities: besides the token and sequence counts (:class:`BatchTotals`), the
``grpo.top_entropy_quantile`` threshold is the quantile over every trained token of the batch (all
ranks), from one forward without gradients before the update (:func:`entropy_threshold_pass`);
sequence-level quantities (GSPO's ratio, the off-policy mask, sequence corrections) are per row
and micro-batches hold whole rows.

Which log-probs the ratio is anchored on (``old``) and which the correction compares with the
trainer's own (``behaviour``) is :func:`nanogrpo.algo.corrections.anchor`'s rule: without a
correction, the recorded behaviour log-probs whenever the update is off-policy (the seed's), and
nothing on-policy; with one, the trainer's own log-probs before the batch's first update
(``old_logprobs``, e.g. the first update's :attr:`UpdateResult.logprobs`), against the engine's.
The mismatch stats (``is_*``) are logged wherever the behaviour log-probs are compared.

What features add inside the update (on-policy distillation's teacher signal) comes through the run's
:class:`~nanogrpo.training.terms.Terms`, at fixed points of :func:`policy_update`.

A non-finite loss or gradient norm skips the whole update (gradients dropped,
weights untouched) and is reported, so one bad batch never corrupts the model.

The model runs in train mode (HF's gradient checkpointing acts only then) with its
dropout off: :func:`nanogrpo.models.load.disable_dropout`, applied when it is loaded,
zeroes every dropout probability on the modules (the saved config keeps its values).
"""

from __future__ import annotations

import math
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch

from nanogrpo.algo.corrections import anchor, logprob_gap_stats
from nanogrpo.algo.entropy import entropy_mask, entropy_threshold
from nanogrpo.algo.logprobs import acc_dtype, token_logprobs
from nanogrpo.algo.losses import STAT_OPS, BatchTotals, LossSpec, policy_loss
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import Config, GrpoConfig, TrainConfig
from nanogrpo.training.micro import forward_rows, micro_batch_indices, trained_mask
from nanogrpo.training.terms import Terms


@dataclass
class UpdateResult:
    loss: float
    kl: float
    clip_frac: float
    grad_norm: float
    skipped_nonfinite: bool
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-update metrics over the whole batch: ``entropy``, ``clip_frac_low`` / ``_high`` / ``_dual``,
    ``ratio_min`` / ``_mean`` / ``_max``, ``logprob_gap`` / ``_max`` (the trainer's log-probs of the policy
    that generated the batch against the engine's, per token), and where they apply ``is_weight_*``,
    ``is_corrected_frac``, ``is_kl``, ``off_policy_masked_frac``, ``entropy_coef``, ``entropy_threshold``."""
    logprobs: torch.Tensor | None = None
    """(N, C) this rank's policy log-probs from this update's forward (before its optimizer step), 0 off
    the trained tokens: the anchor (``old_logprobs``) for later updates on the same batch."""
    bonus_entropy: float = float("nan")
    """Mean entropy over the tokens the entropy bonus acts on (adaptive entropy control's measurement)."""


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: RolloutBatch, train: TrainConfig, share_prefix: bool,
                   temperature: float = 1.0, entropy: bool = False, mask: torch.Tensor | None = None,
                   support: tuple[int, float] | None = None, terms: Terms | None = None,
                   kind: str = "pass") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, C) float32 (float64 for a float64 model) of the trained tokens (0 elsewhere), and with
    ``entropy`` the policy's entropies there, without gradients, over the micro-batches the update packs
    (length-sorted rows, all-padding columns dropped), so long-tailed completion lengths (multi-turn
    trajectories) cost little padding and tool output no log-prob; of ``logits / temperature`` (the run's
    convention); under ``terms.forward`` (the run's :class:`~nanogrpo.training.terms.Terms`; ``kind``: what
    the forward is to them).
    The reference forward, the top-ρ entropy threshold, and the trainer's log-probs before an update."""
    mask = batch.trained_mask if mask is None else mask
    dt = acc_dtype(next(iter(model.parameters())).dtype)                                      # float32 / 64
    out = torch.zeros(batch.completion_mask.shape, dtype=dt, device=batch.input_ids.device)    # (N, C)
    ent = torch.zeros_like(out) if entropy else None                                           # (N, C)
    for rows in micro_batch_indices(batch, train.micro_batch_size, train.micro_batch_tokens, share_prefix):
        _, (lp, h) = forward_rows(model, batch, rows, mask, train, share_prefix, terms, kind,
                                  temperature=temperature, entropy="value" if entropy else "none",
                                  support=support)                                           # (n, c)
        out[rows, :lp.shape[1]] = lp.to(dt)
        if entropy:
            ent[rows, :h.shape[1]] = h.to(dt)
    return out, ent


def reference_logprobs(ref: torch.nn.Module, batch: RolloutBatch, cfg: Config, share_prefix: bool,
                       terms: Terms | None = None) -> torch.Tensor:
    """Reference log-probs (N, C) float32 of the trained tokens (0 elsewhere) in the run's convention
    (``rollout.tempered_logprobs``: its temperature and support): :func:`batch_logprobs`."""
    return batch_logprobs(ref, batch, cfg.train, share_prefix, cfg.rollout.logprob_temperature(),
                          support=cfg.rollout.logprob_support(), terms=terms, kind="reference")[0].float()


def no_grad_passes(batch: RolloutBatch | None, mask: torch.Tensor | None, train: TrainConfig, be,
                   share_prefix: bool, terms: Terms | None = None, kind: str = "pass", **stats):
    """``token_stats`` over the update's micro-batches in eval mode under the update's autocast, for a
    caller under ``torch.no_grad``: yields (rows, log-probs (n, c), entropies (n, c) or None, loss mask
    (n, c)) per micro-batch. A collective on sharded backends: a rank with fewer micro-batches (or no
    batch) runs empty forwards to match the others, as the update does. ``terms``, ``kind``: as
    :func:`~nanogrpo.training.micro.forward_rows`'s."""
    fwd = be.model
    mbs = [] if batch is None else micro_batch_indices(batch, train.micro_batch_size,
                                                       train.micro_batch_tokens, share_prefix)
    n_mb = int(be.all_reduce([float(len(mbs))], ["max"])[0]) if be.world_size > 1 else len(mbs)
    was = fwd.training
    fwd.eval()
    try:
        for k in range(n_mb):
            with _autocast(be.module, train.autocast):
                if k < len(mbs):
                    cut, (lp, ent) = forward_rows(fwd, batch, mbs[k], mask, train, share_prefix, terms,
                                                  kind, **stats)                          # (n, c) each
                    yield mbs[k], lp, ent, cut[3]
                else:
                    _zero_loss(fwd, be.device, train.logprob_chunk)
    finally:
        fwd.train(was)


@torch.no_grad()
def entropy_threshold_pass(batch: RolloutBatch | None, cfg: Config, be, share_prefix: bool,
                           terms: Terms | None = None) -> tuple[float, int]:
    """``grpo.top_entropy_quantile``: (the entropy threshold over every trained token of the batch, on every
    rank, and how many tokens reach it), from one forward without gradients over the update's
    micro-batches (``no_grad_passes``: a collective)."""
    mask = None if batch is None else trained_mask(batch, cfg.grpo)          # (N, C)
    parts = [torch.zeros(0, dtype=torch.float64)]
    for _, _, ent, lm in no_grad_passes(batch, mask, cfg.train, be, share_prefix, terms, "pass",
                                        temperature=cfg.rollout.logprob_temperature(),
                                        support=cfg.rollout.logprob_support(), entropy="value"):
        parts.append(ent[lm.bool()].double().cpu())                          # (t,)
    values = be.all_gather_values(torch.cat(parts))                          # (T_all,)
    thr = entropy_threshold(values, cfg.grpo.top_entropy_quantile)
    return thr, int((values >= thr).sum())


def _autocast(model, enabled: bool):
    if not enabled:
        return nullcontext()
    dev = next(iter(model.parameters())).device.type
    return torch.autocast(dev, dtype=torch.bfloat16)


def policy_update(be, batch: RolloutBatch | None, cfg: Config, *, on_policy: bool,
                  old_logprobs: torch.Tensor | None = None, entropy_coef: float | None = None,
                  terms: Terms | None = None) -> UpdateResult:
    """Accumulate gradients over the batch's micro-batches, clip, step (or skip if non-finite).

    ``be`` (a :class:`nanogrpo.training.backend.Backend`) owns the wrapped model, the backward pass and the
    optimizer step. Under several ranks ``batch`` is this rank's share (None if it has no rows). ``cfg``:
    the run's config (``grpo``: the loss; ``train``: micro-batches, clipping; ``rollout``: the correction
    and the log-prob convention, ``logprob_temperature()`` / ``logprob_support()``, that the behaviour and
    reference log-probs were computed with, and ``max_new_tokens``).
    ``on_policy``: the weights are those that generated the batch (first update, exact engine).
    ``old_logprobs``: (N, C) the trainer's log-probs of this rank's rows before the batch's first
    update (the first update's :attr:`UpdateResult.logprobs`), for the later updates on a batch;
    None on the first.
    ``entropy_coef``: the entropy-bonus coefficient of this step (``EntropyControl.applied()``); None:
    ``grpo.entropy_coef``.
    ``terms``: what features add to the forwards and the loss (:class:`~nanogrpo.training.terms.Terms`:
    on-policy distillation's teacher signal), None: nothing.
    """
    grpo, train, rollout = cfg.grpo, cfg.train, cfg.rollout
    terms = terms if terms is not None else Terms()
    ops = {**STAT_OPS, **terms.stat_ops}
    fwd = be.model
    spec = LossSpec.from_config(grpo, rollout)
    coef = grpo.entropy_coef if entropy_coef is None else entropy_coef
    share = train.share_prefix and be.prefix_sharing and terms.share_prefix(batch)
    thr, n_ent = None, None
    if grpo.top_entropy_quantile < 1.0:
        thr, n_ent = entropy_threshold_pass(batch, cfg, be, share, terms)
    fwd.train()
    mask_all = None if batch is None else trained_mask(batch, grpo)          # (N, C)
    n_local = 0 if batch is None else batch.num_seqs
    t_local = 0 if batch is None else int(mask_all.sum())
    mbs = [] if batch is None else micro_batch_indices(batch, train.micro_batch_size,
                                                       train.micro_batch_tokens, share)
    n_seqs, n_tok, n_mb = be.all_reduce([n_local, t_local, len(mbs)], ops=["sum", "sum", "max"])
    totals = BatchTotals(num_seqs=int(n_seqs), num_tokens=int(n_tok), max_new_tokens=rollout.max_new_tokens,
                         entropy_tokens=n_ent)
    acc_dt = acc_dtype(next(iter(be.module.parameters())).dtype)
    kept = None if batch is None else torch.zeros(batch.completion_mask.shape, dtype=acc_dt,
                                                  device=batch.input_ids.device)  # (N, C)
    be.zero_grad()
    loss_sum, bad = 0.0, 0.0
    acc: dict[str, torch.Tensor] = {}
    for k in range(int(n_mb)):
        with ExitStack() as forward:
            if k < len(mbs):  # the terms' context spans the backward (gradient checkpointing recomputes)
                forward.enter_context(terms.forward(fwd, batch, mbs[k], "update"))
            with _autocast(be.module, train.autocast):
                if k < len(mbs):
                    rows = mbs[k]
                    (_, _, _, lm, beh, ref, adv), (logp, ent, *head) = forward_rows(
                        fwd, batch, rows, mask_all, train, share, terms, "update",
                        temperature=rollout.logprob_temperature(), support=rollout.logprob_support(),
                        entropy="grad" if coef != 0.0 else "value")                      # (n, c) each
                    adv, extra, more = terms.loss(batch, rows, logp, head[0] if head else None, adv, lm)
                    trainer_old = None if old_logprobs is None else old_logprobs[rows][:, :lm.shape[1]]
                    gap = logprob_gap_stats(logp if trainer_old is None else trainer_old, beh, lm.bool())
                    old, beh = anchor(spec.correction, on_policy, trainer_old, beh)
                    top = None if thr is None else entropy_mask(ent, lm, thr)
                    loss, stats = policy_loss(spec, logp, old, ref if spec.beta > 0 else None, adv, lm,
                                              totals, behaviour=beh, proximal=trainer_old, entropy=ent,
                                              entropy_mask=top, entropy_coef=coef, extra=extra)
                    kept[rows, :logp.shape[1]] = logp.detach().to(kept.dtype)
                    _accumulate(acc, {**stats, **gap, **more}, ops)
                else:  # padding micro-batch: matches the other ranks' collectives, adds nothing
                    loss = _zero_loss(fwd, be.device, train.logprob_chunk)
            if not torch.isfinite(loss):
                bad = 1.0
                if be.world_size == 1:
                    be.zero_grad()
                    return UpdateResult(float("nan"), float("nan"), float("nan"), float("nan"), True)
            be.backward(loss * be.world_size, last=k == int(n_mb) - 1)
        loss_sum += float(loss.detach())
    _accumulate(acc, terms.stats(), ops)  # what the features counted outside the loss (their forwards)
    keys = list(ops)
    tot = dict(zip(["loss", "bad"] + keys, be.all_reduce([loss_sum, bad] + _stat_values(acc, keys, ops),
                                                         ["sum", "max"] + [ops[k] for k in keys])))
    if tot["bad"] > 0:
        be.zero_grad()
        return UpdateResult(float("nan"), float("nan"), float("nan"), float("nan"), True)
    grad_norm = be.clip_and_step(train.max_grad_norm)
    metrics = {**_metrics(tot, totals, spec, coef, thr, grpo), **terms.metrics(tot)}
    bonus = tot["entropy_masked_sum"] / max(n_ent, 1) if thr is not None else metrics.get("entropy", math.nan)
    if not math.isfinite(grad_norm):
        return UpdateResult(tot["loss"], float("nan"), float("nan"), grad_norm, True, metrics, kept, bonus)
    clip = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    kl = tot["kl_sum"] / max(totals.num_tokens, 1)
    return UpdateResult(tot["loss"], kl, clip, grad_norm, False, metrics, kept, bonus)


_IDENTITY = {"sum": 0.0, "min": math.inf, "max": -math.inf}


def _accumulate(acc: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], ops: dict[str, str]) -> None:
    """Fold one micro-batch's stats (0-dim tensors, still on the device) into ``acc`` (``ops``: how each
    combines)."""
    for k, v in stats.items():
        v = v.detach().double()
        if k not in acc:
            acc[k] = v
        elif ops[k] == "sum":
            acc[k] = acc[k] + v
        else:
            acc[k] = torch.minimum(acc[k], v) if ops[k] == "min" else torch.maximum(acc[k], v)


def _stat_values(acc: dict[str, torch.Tensor], keys: list[str], ops: dict[str, str]) -> list[float]:
    """The accumulated stats as floats in ``keys`` order (one device transfer); identities where absent."""
    present = [k for k in keys if k in acc]
    vals = dict(zip(present, torch.stack([acc[k] for k in present]).tolist())) if present else {}
    return [vals.get(k, _IDENTITY[ops[k]]) for k in keys]


def _metrics(tot: dict[str, float], totals: BatchTotals, spec: LossSpec, coef: float, thr: float | None,
             grpo: GrpoConfig) -> dict[str, float]:
    """The update's logged metrics from the whole-batch stat totals."""
    n = max(totals.num_tokens, 1)
    nr = max(tot["ratio_count"], 1.0)  # tokens, or sequences for a sequence-level ratio
    out = {"entropy": tot["entropy_sum"] / n, "clip_frac_low": tot["clip_low_sum"] / nr,
           "clip_frac_high": tot["clip_high_sum"] / nr,
           "ratio_mean": tot["ratio_sum"] / nr if tot["ratio_count"] else math.nan,
           "ratio_min": tot["ratio_min"], "ratio_max": tot["ratio_max"],
           "logprob_gap": tot["logprob_gap_sum"] / n, "logprob_gap_max": tot["logprob_gap_max"]}
    if spec.clip_ratio_c is not None or spec.clip_delta is not None:
        out["clip_frac_dual"] = tot["clip_dual_sum"] / nr
    is_n = tot["is_tokens"] + tot["is_seqs"]
    if is_n > 0:
        out.update({"is_weight_min": tot["is_weight_min"], "is_weight_mean": tot["is_weight_sum"] / is_n,
                    "is_weight_max": tot["is_weight_max"], "is_kl": tot["is_kl_sum"] / n})
        if spec.correction != "none":
            out["is_corrected_frac"] = tot["is_corrected"] / is_n
    if spec.off_policy_mask_kl is not None:
        out["off_policy_masked_frac"] = tot["off_policy_masked_seqs"] / max(totals.num_seqs, 1)
    if coef != 0.0 or grpo.entropy_target is not None:
        out["entropy_coef"] = coef
    if thr is not None:
        out["entropy_threshold"] = thr
    return {k: (v if math.isfinite(v) else math.nan) for k, v in out.items()}


def step_metrics(results: list[UpdateResult], per_pass: int = 1, first_update: tuple[str, ...] = ()
                 ) -> dict[str, float]:
    """One step's metrics from its updates: loss, kl, grad norm, entropy and the correction stats of the
    first pass over the batch (its first ``per_pass`` = ``grpo.mini_batches`` optimizer steps: the batch as
    generated; means of their values, extremes of their extremes); clip fractions averaged and ratio
    extremes over all of them. The log-prob gap, and ``first_update`` (features' measures of the weights
    that sampled the batch: :attr:`~nanogrpo.training.terms.Terms.first_update`), the first step's alone."""
    first = results[0]
    out = {"loss": first.loss, "kl": first.kl, "clip_frac": first.clip_frac, "grad_norm": first.grad_norm,
           **first.metrics}
    if per_pass > 1:
        out.update(_pass_metrics(results[:per_pass]))
        for k in ("logprob_gap", "logprob_gap_max", *first_update):  # before any weight moved
            if k in first.metrics:
                out[k] = first.metrics[k]
    done = [r for r in results if not r.skipped_nonfinite and r.metrics]
    if len(done) > 1:
        out["clip_frac"] = sum(r.clip_frac for r in done) / len(done)
        for k in ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_mean"):
            if k in done[0].metrics:
                out[k] = sum(r.metrics[k] for r in done) / len(done)
        for k, pick in (("ratio_min", min), ("ratio_max", max)):
            out[k] = pick((r.metrics[k] for r in done if not math.isnan(r.metrics[k])), default=math.nan)
    return out


def _pass_metrics(results: list[UpdateResult]) -> dict[str, float]:
    """The first pass's metrics over its mini-batches' optimizer steps: ``*_min`` / ``*_max`` their extremes,
    the rest their mean (skipped, non-finite steps left out)."""
    done = [r for r in results if not r.skipped_nonfinite and r.metrics]
    if not done:
        return {}
    out = {k: sum(getattr(r, k) for r in done) / len(done) for k in ("loss", "kl", "clip_frac", "grad_norm")}
    for k in done[0].metrics:
        vals = [r.metrics[k] for r in done if k in r.metrics and not math.isnan(r.metrics[k])]
        pick = min if k.endswith("_min") else max if k.endswith("_max") else None
        out[k] = (pick(vals) if pick else sum(vals) / len(vals)) if vals else math.nan
    return out


def _zero_loss(fwd, device, chunk: int) -> torch.Tensor:
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    am = torch.ones_like(ids)
    cm = torch.ones(1, 1, dtype=torch.bool, device=device)
    return token_logprobs(fwd, ids, am, 1, cm, chunk=chunk).sum() * 0.0
