"""One policy update on one rollout batch: micro-batches, gradient accumulation, clipping.

Micro-batches: rows are sorted by length (longest first) and packed greedily
while ``rows x (longest prompt + longest completion)`` stays within
``train.micro_batch_tokens`` (and rows within ``train.micro_batch_size``); each
micro-batch drops the columns that are padding for all its rows, so one long
group gets a micro-batch of its own and short rows share one, padding little.

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

A non-finite loss or gradient norm skips the whole update (gradients dropped,
weights untouched) and is reported, so one bad batch never corrupts the model.

The model runs in train mode (HF's gradient checkpointing acts only then) with its
dropout off: :func:`nanogrpo.models.load.disable_dropout`, applied when it is loaded,
zeroes every dropout probability on the modules (the saved config keeps its values).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from nanogrpo.algo.corrections import anchor, logprob_gap_stats
from nanogrpo.algo.distill import DISTILL_STAT_OPS, distill_metrics, distill_terms
from nanogrpo.algo.entropy import entropy_mask, entropy_threshold
from nanogrpo.algo.logprobs import acc_dtype, token_logprobs, token_stats
from nanogrpo.algo.losses import STAT_OPS, BatchTotals, LossSpec, policy_loss
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import GrpoConfig, RolloutConfig, TrainConfig

OPS = {**STAT_OPS, **DISTILL_STAT_OPS}
"""How every stat of the update's losses combines over micro-batches and ranks."""


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


def micro_batch_indices(batch: RolloutBatch, size: int, tokens: int = 0,
                        share_prefix: bool = False) -> list[torch.Tensor]:
    """Row indices per micro-batch: at most ``size`` rows and (if > 0) ``tokens`` padded tokens
    (rows x (longest prompt + longest completion)) per micro-batch.

    Rows go in order of length, which pads least. With ``share_prefix`` (the forward runs each
    distinct prompt of a micro-batch once) a second packing keeps each group's rows together
    (groups by their longest completion), so that its prompt is shared; the one with the fewer
    forward tokens (distinct prompts x prompt length + rows x completion length, per micro-batch)
    is used."""
    clen = batch.completion_mask.sum(1)                                     # (N,)
    plen = batch.attention_mask[:, :batch.prompt_len].sum(1)                # (N,)
    by_len = torch.argsort(clen * (batch.prompt_len + 1) + plen, descending=True, stable=True)  # (N,)
    pl, cl = plen.tolist(), clen.tolist()
    best = _pack(by_len.tolist(), pl, cl, size, tokens)
    if share_prefix and batch.group_ids is not None:
        gid = batch.group_ids.tolist()
        longest: dict[int, int] = {}
        for g, c in zip(gid, cl):
            longest[g] = max(longest.get(g, 0), c)
        # sorted() is stable: inside a group the rows keep their length order
        grouped = sorted(by_len.tolist(), key=lambda i: (-longest[gid[i]], gid[i]))
        alt = _pack(grouped, pl, cl, size, tokens)
        if _forward_tokens(alt, gid, pl, cl) < _forward_tokens(best, gid, pl, cl):
            best = alt
    return [torch.tensor(mb, dtype=torch.long, device=by_len.device) for mb in best]


def _pack(order: list[int], plen: list[int], clen: list[int], size: int, tokens: int) -> list[list[int]]:
    """Greedy packing in ``order``: a new micro-batch when ``size`` rows or ``tokens`` would be exceeded."""
    out: list[list[int]] = []
    cur: list[int] = []
    mp = mc = 0
    for i in order:
        np_, nc = max(mp, plen[i]), max(mc, clen[i])
        if cur and (len(cur) >= size or (tokens > 0 and (len(cur) + 1) * (np_ + nc) > tokens)):
            out.append(cur)
            cur, np_, nc = [], plen[i], clen[i]
        cur.append(i)
        mp, mc = np_, nc
    if cur:
        out.append(cur)
    return out


def _forward_tokens(mbs: list[list[int]], gid: list[int], plen: list[int], clen: list[int]) -> int:
    """Tokens the forwards process with prompt sharing: per micro-batch, each distinct prompt once
    (at the micro-batch's padded prompt length) plus every row's padded completion."""
    return sum(len({gid[i] for i in mb}) * max(plen[i] for i in mb) + len(mb) * max(clen[i] for i in mb)
               for mb in mbs)


def trained_mask(batch: RolloutBatch, grpo: GrpoConfig | None = None) -> torch.Tensor:
    """(N, C) bool: the tokens the loss trains on: ``batch.trained_mask`` less, under
    ``grpo.mask_truncated``, the completions the token limit cut off."""
    m = batch.trained_mask                                                   # (N, C)
    if grpo is not None and grpo.mask_truncated and batch.truncated is not None:
        m = m & ~batch.truncated.to(m.device)[:, None]                       # (N, C)
    return m


def _trim(batch: RolloutBatch, rows: torch.Tensor, mask: torch.Tensor | None = None):
    """Slice rows and drop columns that are padding for every selected row. The mask returned is
    the trained one (``mask``, by default ``batch.trained_mask``): tool output stays in the attention
    mask as context but gets no log-prob, loss, KL or share of the length normalisation."""
    am = batch.attention_mask[rows]                                          # (n, P + C)
    cm = batch.completion_mask[rows]                                         # (n, C)
    p = batch.prompt_len
    real_prompt = am[:, :p].bool().any(0)                                    # (P,)
    lead = int(torch.nonzero(real_prompt)[0])                                # leading all-pad columns
    c = max(int(cm.sum(1).max()), 1)                                         # longest completion here
    mask = batch.trained_mask if mask is None else mask

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows][:, :c]

    return (batch.input_ids[rows][:, lead:p + c], am[:, lead:p + c], p - lead, cut(mask),
            cut(batch.old_logprobs), cut(batch.ref_logprobs), batch.advantages[rows])


def _images(model, batch: RolloutBatch, rows: torch.Tensor):
    """``token_stats``' ``mm`` for rows of a batch with images (their pixels, never another row's; the
    vision tower run once per group); None without images."""
    if not batch.has_images:
        return None
    from nanogrpo.models.vision import forward_kwargs

    pv, grid, counts = batch.images_of(rows)
    groups = batch.group_ids[rows]                  # a group's rows share their images: the tower runs once
    return lambda ids: forward_kwargs(model, ids, pv, grid, groups, counts)


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: RolloutBatch, train: TrainConfig, share_prefix: bool,
                   temperature: float = 1.0, entropy: bool = False, mask: torch.Tensor | None = None,
                   support: tuple[int, float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, C) float32 (float64 for a float64 model) of the trained tokens (0 elsewhere), and with
    ``entropy`` the policy's entropies there, without gradients, over the micro-batches the update packs
    (length-sorted rows, all-padding columns dropped), so long-tailed completion lengths (multi-turn
    trajectories) cost little padding and tool output no log-prob; of ``logits / temperature`` (the run's
    convention).
    The reference forward, the top-ρ entropy threshold, and the trainer's log-probs before an update."""
    mask = batch.trained_mask if mask is None else mask
    dt = acc_dtype(next(iter(model.parameters())).dtype)                                      # float32 / 64
    out = torch.zeros(batch.completion_mask.shape, dtype=dt, device=batch.input_ids.device)    # (N, C)
    ent = torch.zeros_like(out) if entropy else None                                           # (N, C)
    for rows in micro_batch_indices(batch, train.micro_batch_size, train.micro_batch_tokens, share_prefix):
        ids, am, p, lm, _, _, _ = _trim(batch, rows, mask)
        lp, h = token_stats(model, ids, am, p, lm, chunk=train.logprob_chunk, share_prefix=share_prefix,
                            temperature=temperature, entropy="value" if entropy else "none",
                            support=support, mm=_images(model, batch, rows))           # (n, c)
        out[rows, :lp.shape[1]] = lp.to(dt)
        if entropy:
            ent[rows, :h.shape[1]] = h.to(dt)
    return out, ent


def reference_logprobs(ref: torch.nn.Module, batch: RolloutBatch, train: TrainConfig,
                       share_prefix: bool, temperature: float = 1.0,
                       support: tuple[int, float] | None = None) -> torch.Tensor:
    """Reference log-probs (N, C) float32 of the trained tokens (0 elsewhere): :func:`batch_logprobs`."""
    return batch_logprobs(ref, batch, train, share_prefix, temperature, support=support)[0].float()


def no_grad_passes(batch: RolloutBatch | None, mask: torch.Tensor | None, train: TrainConfig, be,
                   share_prefix: bool, **stats):
    """``token_stats`` over the update's micro-batches in eval mode under the update's autocast, for a
    caller under ``torch.no_grad``: yields (rows, log-probs (n, c), entropies (n, c) or None, loss mask
    (n, c)) per micro-batch. A collective on sharded backends: a rank with fewer micro-batches (or no
    batch) runs empty forwards to match the others, as the update does."""
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
                    ids, am, p, lm, _, _, _ = _trim(batch, mbs[k], mask)
                    lp, ent = token_stats(fwd, ids, am, p, lm, chunk=train.logprob_chunk,
                                          share_prefix=share_prefix, mm=_images(fwd, batch, mbs[k]),
                                          **stats)                               # (n, c) each
                    yield mbs[k], lp, ent, lm
                else:
                    _zero_loss(fwd, be.device, train.logprob_chunk)
    finally:
        fwd.train(was)


@torch.no_grad()
def entropy_threshold_pass(batch: RolloutBatch | None, grpo: GrpoConfig, train: TrainConfig, be,
                           share_prefix: bool, temperature: float,
                           support: tuple[int, float] | None = None) -> tuple[float, int]:
    """``grpo.top_entropy_quantile``: (the entropy threshold over every trained token of the batch, on every
    rank, and how many tokens reach it), from one forward without gradients over the update's
    micro-batches (``no_grad_passes``: a collective)."""
    mask = None if batch is None else trained_mask(batch, grpo)              # (N, C)
    parts = [torch.zeros(0, dtype=torch.float64)]
    for _, _, ent, lm in no_grad_passes(batch, mask, train, be, share_prefix, temperature=temperature,
                                        support=support, entropy="value"):
        parts.append(ent[lm.bool()].double().cpu())                          # (t,)
    values = be.all_gather_values(torch.cat(parts))                          # (T_all,)
    thr = entropy_threshold(values, grpo.top_entropy_quantile)
    return thr, int((values >= thr).sum())


def _autocast(model, enabled: bool):
    if not enabled:
        return nullcontext()
    dev = next(iter(model.parameters())).device.type
    return torch.autocast(dev, dtype=torch.bfloat16)


def policy_update(model: torch.nn.Module, optimizer, batch: RolloutBatch | None, grpo: GrpoConfig,
                  train: TrainConfig, *, on_policy: bool, max_new_tokens: int, backend=None,
                  logprob_temperature: float = 1.0, rollout: RolloutConfig | None = None,
                  logprob_support: tuple[int, float] | None = None,
                  old_logprobs: torch.Tensor | None = None,
                  entropy_coef: float | None = None, distill=None) -> UpdateResult:
    """Accumulate gradients over the batch's micro-batches, clip, step (or skip if non-finite).

    ``backend`` (a :class:`nanogrpo.training.distributed.Backend`) owns the wrapped model, the
    backward pass and the optimizer step; None means one process with ``model`` and ``optimizer``.
    Under several ranks ``batch`` is this rank's share (None if it has no rows).
    ``logprob_temperature``: the policy's log-probs are those of ``logits / logprob_temperature``
    (``RolloutConfig.logprob_temperature()``; ``logprob_support``: over each position's top-k / top-p
    support, ``RolloutConfig.logprob_support()``: the convention the behaviour and reference
    log-probs were computed with).
    ``on_policy``: the weights are those that generated the batch (first update, exact engine).
    ``rollout``: its ``correction`` settings (None: no correction).
    ``old_logprobs``: (N, C) the trainer's log-probs of this rank's rows before the batch's first
    update (the first update's :attr:`UpdateResult.logprobs`), for the later updates on a batch;
    None on the first.
    ``entropy_coef``: the entropy-bonus coefficient of this step (``EntropyControl.applied()``); None:
    ``grpo.entropy_coef``.
    ``distill``: the run's :class:`~nanogrpo.training.distill.Distill` (on-policy distillation: the
    teacher's signal enters the advantages or the loss, :func:`nanogrpo.algo.distill.distill_terms`), or None.
    """
    from nanogrpo.training.distributed import SingleBackend

    be = backend if backend is not None else SingleBackend(model, optimizer)
    fwd = be.model
    spec = LossSpec.from_config(grpo, rollout)
    coef = grpo.entropy_coef if entropy_coef is None else entropy_coef
    share = train.share_prefix and be.prefix_sharing
    thr, n_ent = None, None
    if grpo.top_entropy_quantile < 1.0:
        thr, n_ent = entropy_threshold_pass(batch, grpo, train, be, share, logprob_temperature,
                                            logprob_support)
    fwd.train()
    mask_all = None if batch is None else trained_mask(batch, grpo)          # (N, C)
    n_local = 0 if batch is None else batch.num_seqs
    t_local = 0 if batch is None else int(mask_all.sum())
    mbs = [] if batch is None else micro_batch_indices(batch, train.micro_batch_size,
                                                       train.micro_batch_tokens, share)
    n_seqs, n_tok, n_mb = be.all_reduce([n_local, t_local, len(mbs)], ops=["sum", "sum", "max"])
    totals = BatchTotals(num_seqs=int(n_seqs), num_tokens=int(n_tok), max_new_tokens=max_new_tokens,
                         entropy_tokens=n_ent)
    ent_mode = "grad" if coef != 0.0 else "value"
    acc_dt = acc_dtype(next(iter(be.module.parameters())).dtype)
    kept = None if batch is None else torch.zeros(batch.completion_mask.shape, dtype=acc_dt,
                                                  device=batch.input_ids.device)  # (N, C)
    be.zero_grad()
    loss_sum, bad = 0.0, 0.0
    acc: dict[str, torch.Tensor] = {}
    for k in range(int(n_mb)):
        last = k == int(n_mb) - 1
        with _autocast(be.module, train.autocast):
            if k < len(mbs):
                rows = mbs[k]
                ids, am, p, lm, beh, ref, adv = _trim(batch, rows, mask_all)
                dv = None if distill is None else distill.divergence(batch, rows, ids, am, p, lm.shape[1])
                logp, ent, *div = token_stats(fwd, ids, am, p, lm, chunk=train.logprob_chunk,
                                              share_prefix=share, temperature=logprob_temperature,
                                              entropy=ent_mode, support=logprob_support,
                                              mm=_images(fwd, batch, rows), divergence=dv)  # (n, c) each
                extra = None
                if distill is not None:  # the teacher's signal: per-token advantages or a per-token loss
                    right = None if batch.correct is None else batch.correct[rows]
                    adv, extra, dstats = distill_terms(
                        distill.spec, logp, distill.teacher_logprobs(batch, rows, lm.shape[1]),
                        div[0] if div else None, adv, lm, right)
                    _accumulate(acc, dstats)
                trainer_old = None if old_logprobs is None else old_logprobs[rows][:, :lm.shape[1]]
                gap = logprob_gap_stats(logp if trainer_old is None else trainer_old, beh, lm.bool())
                old, beh = anchor(spec.correction, on_policy, trainer_old, beh)
                loss, stats = policy_loss(spec, logp, old, ref if spec.beta > 0 else None, adv, lm, totals,
                                          behaviour=beh, proximal=trainer_old, entropy=ent,
                                          entropy_mask=None if thr is None else entropy_mask(ent, lm, thr),
                                          entropy_coef=coef, extra=extra)
                kept[rows, :logp.shape[1]] = logp.detach().to(kept.dtype)
                _accumulate(acc, {**stats, **gap})
            else:  # padding micro-batch: matches the other ranks' collectives, adds nothing
                loss = _zero_loss(fwd, be.device, train.logprob_chunk)
        if not torch.isfinite(loss):
            bad = 1.0
            if be.world_size == 1:
                be.zero_grad()
                return UpdateResult(float("nan"), float("nan"), float("nan"), float("nan"), True)
        be.backward(loss * be.world_size, last=last)
        loss_sum += float(loss.detach())
    keys = list(OPS)
    local = [loss_sum, bad] + _stat_values(acc, keys)
    ops = ["sum", "max"] + [OPS[k] for k in keys]
    tot = dict(zip(["loss", "bad"] + keys, be.all_reduce(local, ops)))
    if tot["bad"] > 0:
        be.zero_grad()
        return UpdateResult(float("nan"), float("nan"), float("nan"), float("nan"), True)
    grad_norm = be.clip_and_step(train.max_grad_norm)
    metrics = _metrics(tot, totals, spec, coef, thr, grpo)
    if distill is not None:
        metrics.update(distill_metrics(tot, distill.spec))
    bonus = tot["entropy_masked_sum"] / max(n_ent, 1) if thr is not None else metrics.get("entropy", math.nan)
    if not math.isfinite(grad_norm):
        return UpdateResult(tot["loss"], float("nan"), float("nan"), grad_norm, True, metrics, kept, bonus)
    clip = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    kl = tot["kl_sum"] / max(totals.num_tokens, 1)
    return UpdateResult(tot["loss"], kl, clip, grad_norm, False, metrics, kept, bonus)


_IDENTITY = {"sum": 0.0, "min": math.inf, "max": -math.inf}


def _accumulate(acc: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    """Fold one micro-batch's stats (0-dim tensors, still on the device) into ``acc``."""
    for k, v in stats.items():
        v = v.detach().double()
        if k not in acc:
            acc[k] = v
        elif OPS[k] == "sum":
            acc[k] = acc[k] + v
        else:
            acc[k] = torch.minimum(acc[k], v) if OPS[k] == "min" else torch.maximum(acc[k], v)


def _stat_values(acc: dict[str, torch.Tensor], keys: list[str]) -> list[float]:
    """The accumulated stats as floats in ``keys`` order (one device transfer); identities where absent."""
    present = [k for k in keys if k in acc]
    vals = dict(zip(present, torch.stack([acc[k] for k in present]).tolist())) if present else {}
    return [vals.get(k, _IDENTITY[OPS[k]]) for k in keys]


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


def step_metrics(results: list[UpdateResult], per_pass: int = 1) -> dict[str, float]:
    """One step's metrics from its updates: loss, kl, grad norm, entropy and the correction stats of the
    first pass over the batch (its first ``per_pass`` = ``grpo.mini_batches`` optimizer steps: the batch as
    generated; means of their values, extremes of their extremes); clip fractions averaged and ratio
    extremes over all of them."""
    first = results[0]
    out = {"loss": first.loss, "kl": first.kl, "clip_frac": first.clip_frac, "grad_norm": first.grad_norm,
           **first.metrics}
    if per_pass > 1:
        out.update(_pass_metrics(results[:per_pass]))
        for k in ("logprob_gap", "logprob_gap_max"):  # the first optimizer step's: before any weight moved
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
