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


def micro_batch_indices(batch: RolloutBatch, size: int, tokens: int = 0) -> list[torch.Tensor]:
    """Row indices per micro-batch: rows sorted by length, at most ``size`` rows and (if > 0)
    ``tokens`` padded tokens (rows x (longest prompt + longest completion)) per micro-batch."""
    clen = batch.completion_mask.sum(1)                                     # (N,)
    plen = batch.attention_mask[:, :batch.prompt_len].sum(1)                # (N,)
    order = torch.argsort(clen * (batch.prompt_len + 1) + plen, descending=True, stable=True)  # (N,)
    if tokens <= 0:
        return [order[i:i + size] for i in range(0, order.numel(), size)]
    out, cur, mp, mc = [], [], 0, 0
    for i in order.tolist():
        np_, nc = max(mp, int(plen[i])), max(mc, int(clen[i]))
        if cur and (len(cur) >= size or (len(cur) + 1) * (np_ + nc) > tokens):
            out.append(torch.tensor(cur, dtype=torch.long, device=order.device))
            cur, np_, nc = [], int(plen[i]), int(clen[i])
        cur.append(i)
        mp, mc = np_, nc
    if cur:
        out.append(torch.tensor(cur, dtype=torch.long, device=order.device))
    return out


def _trim(batch: RolloutBatch, rows: torch.Tensor):
    """Slice rows and drop columns that are padding for every selected row."""
    am = batch.attention_mask[rows]                                          # (n, P + C)
    cm = batch.completion_mask[rows]                                         # (n, C)
    p = batch.prompt_len
    real_prompt = am[:, :p].bool().any(0)                                    # (P,)
    lead = int(torch.nonzero(real_prompt)[0])                                # leading all-pad columns
    c = max(int(cm.sum(1).max()), 1)                                         # longest completion here

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows][:, :c]

    return (batch.input_ids[rows][:, lead:p + c], am[:, lead:p + c], p - lead, cm[:, :c],
            cut(batch.old_logprobs), cut(batch.ref_logprobs), batch.advantages[rows])


def _autocast(model, enabled: bool):
    if not enabled:
        return nullcontext()
    dev = next(iter(model.parameters())).device.type
    return torch.autocast(dev, dtype=torch.bfloat16)


def policy_update(model: torch.nn.Module, optimizer, batch: RolloutBatch | None, grpo: GrpoConfig,
                  train: TrainConfig, *, on_policy: bool, max_new_tokens: int, backend=None) -> UpdateResult:
    """Accumulate gradients over the batch's micro-batches, clip, step (or skip if non-finite).

    ``backend`` (a :class:`nanogrpo.train.distributed.Backend`) owns the wrapped model, the
    backward pass and the optimizer step; None means one process with ``model`` and ``optimizer``.
    Under several ranks ``batch`` is this rank's share (None if it has no rows).
    """
    from nanogrpo.train.distributed import SingleBackend

    be = backend if backend is not None else SingleBackend(model, optimizer)
    fwd = be.model
    fwd.train()
    n_local = 0 if batch is None else batch.num_seqs
    t_local = 0 if batch is None else int(batch.completion_mask.sum())
    mbs = [] if batch is None else micro_batch_indices(batch, train.micro_batch_size,
                                                       train.micro_batch_tokens)
    n_seqs, n_tok, n_mb = be.all_reduce([n_local, t_local, len(mbs)], ops=["sum", "sum", "max"])
    totals = BatchTotals(num_seqs=int(n_seqs), num_tokens=int(n_tok), max_new_tokens=max_new_tokens)
    be.zero_grad()
    loss_sum, kl_sum, clip_sum, bad = 0.0, 0.0, 0.0, 0.0
    use_ref = grpo.beta > 0
    for k in range(int(n_mb)):
        last = k == int(n_mb) - 1
        with _autocast(be.module, train.autocast):
            if k < len(mbs):
                ids, am, p, cm, old, ref, adv = _trim(batch, mbs[k])
                logp = token_logprobs(fwd, ids, am, p, cm, chunk=train.logprob_chunk,
                                      share_prefix=train.share_prefix and be.prefix_sharing)  # (n, c)
                loss, stats = policy_loss(grpo.loss, logp, None if on_policy else old,
                                          ref if use_ref else None, adv, cm, totals, beta=grpo.beta,
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
