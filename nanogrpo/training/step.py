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

A non-finite loss or gradient norm skips the whole update (gradients dropped,
weights untouched) and is reported, so one bad batch never corrupts the model.

The model runs in train mode (HF's gradient checkpointing acts only then) with its
dropout off: :func:`nanogrpo.models.load.disable_dropout`, applied when it is loaded,
zeroes every dropout probability on the modules (the saved config keeps its values).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from nanogrpo.algo.logprobs import token_logprobs
from nanogrpo.algo.losses import BatchTotals, policy_loss
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import GrpoConfig, TrainConfig


@dataclass
class UpdateResult:
    loss: float
    kl: float
    clip_frac: float
    grad_norm: float
    skipped_nonfinite: bool


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


def _trim(batch: RolloutBatch, rows: torch.Tensor):
    """Slice rows and drop columns that are padding for every selected row. The mask returned is
    the trained one (``loss_mask`` when the batch has one): tool output stays in the attention
    mask as context but gets no log-prob, loss, KL or share of the length normalisation."""
    am = batch.attention_mask[rows]                                          # (n, P + C)
    cm = batch.completion_mask[rows]                                         # (n, C)
    p = batch.prompt_len
    real_prompt = am[:, :p].bool().any(0)                                    # (P,)
    lead = int(torch.nonzero(real_prompt)[0])                                # leading all-pad columns
    c = max(int(cm.sum(1).max()), 1)                                         # longest completion here

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows][:, :c]

    return (batch.input_ids[rows][:, lead:p + c], am[:, lead:p + c], p - lead, cut(batch.trained_mask),
            cut(batch.old_logprobs), cut(batch.ref_logprobs), batch.advantages[rows])


@torch.no_grad()
def reference_logprobs(ref: torch.nn.Module, batch: RolloutBatch, train: TrainConfig,
                       share_prefix: bool, temperature: float = 1.0) -> torch.Tensor:
    """Reference log-probs (N, C) float32 of the trained tokens (0 elsewhere), over the micro-batches
    the update packs (length-sorted rows, all-padding columns dropped), so long-tailed completion
    lengths (multi-turn trajectories) cost little padding and tool output no log-prob; of
    ``logits / temperature`` (the run's log-prob convention)."""
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32,
                      device=batch.input_ids.device)                                   # (N, C)
    for rows in micro_batch_indices(batch, train.micro_batch_size, train.micro_batch_tokens, share_prefix):
        ids, am, p, lm, _, _, _ = _trim(batch, rows)
        lp = token_logprobs(ref, ids, am, p, lm, chunk=train.logprob_chunk,
                            share_prefix=share_prefix, temperature=temperature)        # (n, c)
        out[rows, :lp.shape[1]] = lp.float()
    return out


def _autocast(model, enabled: bool):
    if not enabled:
        return nullcontext()
    dev = next(iter(model.parameters())).device.type
    return torch.autocast(dev, dtype=torch.bfloat16)


def policy_update(model: torch.nn.Module, optimizer, batch: RolloutBatch | None, grpo: GrpoConfig,
                  train: TrainConfig, *, on_policy: bool, max_new_tokens: int, backend=None,
                  logprob_temperature: float = 1.0) -> UpdateResult:
    """Accumulate gradients over the batch's micro-batches, clip, step (or skip if non-finite).

    ``backend`` (a :class:`nanogrpo.training.distributed.Backend`) owns the wrapped model, the
    backward pass and the optimizer step; None means one process with ``model`` and ``optimizer``.
    Under several ranks ``batch`` is this rank's share (None if it has no rows).
    ``logprob_temperature``: the policy's log-probs are those of ``logits / logprob_temperature``
    (``RolloutConfig.logprob_temperature()``: the convention the behaviour and reference
    log-probs were computed with).
    """
    from nanogrpo.training.distributed import SingleBackend

    be = backend if backend is not None else SingleBackend(model, optimizer)
    fwd = be.model
    fwd.train()
    n_local = 0 if batch is None else batch.num_seqs
    t_local = 0 if batch is None else int(batch.trained_mask.sum())
    share = train.share_prefix and be.prefix_sharing
    mbs = [] if batch is None else micro_batch_indices(batch, train.micro_batch_size,
                                                       train.micro_batch_tokens, share)
    n_seqs, n_tok, n_mb = be.all_reduce([n_local, t_local, len(mbs)], ops=["sum", "sum", "max"])
    totals = BatchTotals(num_seqs=int(n_seqs), num_tokens=int(n_tok), max_new_tokens=max_new_tokens)
    be.zero_grad()
    loss_sum, kl_sum, clip_sum, bad = 0.0, 0.0, 0.0, 0.0
    use_ref = grpo.beta > 0
    for k in range(int(n_mb)):
        last = k == int(n_mb) - 1
        with _autocast(be.module, train.autocast):
            if k < len(mbs):
                ids, am, p, lm, old, ref, adv = _trim(batch, mbs[k])
                logp = token_logprobs(fwd, ids, am, p, lm, chunk=train.logprob_chunk, share_prefix=share,
                                      temperature=logprob_temperature)           # (n, c), 0 off lm
                loss, stats = policy_loss(grpo.loss, logp, None if on_policy else old,
                                          ref if use_ref else None, adv, lm, totals, beta=grpo.beta,
                                          eps_low=grpo.clip_eps_low, eps_high=grpo.clip_eps_high)
            else:  # padding micro-batch: matches the other ranks' collectives, adds nothing
                loss, stats = _zero_loss(fwd, be.device, train.logprob_chunk), {"clipped_sum": 0.0}
        if not torch.isfinite(loss):
            bad = 1.0
            if be.world_size == 1:
                be.zero_grad()
                return UpdateResult(float("nan"), float("nan"), float("nan"), float("nan"), True)
        be.backward(loss * be.world_size, last=last)
        loss_sum += float(loss.detach())
        kl_sum += stats.get("kl_sum", 0.0)
        clip_sum += stats["clipped_sum"]
    loss_sum, kl_sum, clip_sum, bad = be.all_reduce([loss_sum, kl_sum, clip_sum, bad])
    if bad > 0:
        be.zero_grad()
        return UpdateResult(float("nan"), float("nan"), float("nan"), float("nan"), True)
    grad_norm = be.clip_and_step(train.max_grad_norm)
    if not math.isfinite(grad_norm):
        return UpdateResult(loss_sum, float("nan"), float("nan"), grad_norm, True)
    ntok = max(totals.num_tokens, 1)
    return UpdateResult(loss_sum, kl_sum / ntok, clip_sum / ntok, grad_norm, False)


def _zero_loss(fwd, device, chunk: int) -> torch.Tensor:
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    am = torch.ones_like(ids)
    cm = torch.ones(1, 1, dtype=torch.bool, device=device)
    return token_logprobs(fwd, ids, am, 1, cm, chunk=chunk).sum() * 0.0
