"""One policy update on one rollout batch: micro-batches, gradient accumulation, clipping.

A non-finite loss or gradient norm skips the whole update (gradients dropped,
weights untouched) and is reported, so one bad batch never corrupts the model.
"""

from __future__ import annotations

import math
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


def micro_batch_indices(batch: RolloutBatch, size: int) -> list[torch.Tensor]:
    """Row indices per micro-batch, rows sorted by completion length so each micro-batch pads little."""
    lengths = batch.completion_mask.sum(1)                                  # (N,)
    order = torch.argsort(lengths, descending=True, stable=True)            # (N,)
    return [order[i:i + size] for i in range(0, order.numel(), size)]


def _trim(batch: RolloutBatch, rows: torch.Tensor):
    """Slice rows and drop columns that are padding for every selected row."""
    am = batch.attention_mask[rows]                                          # (n, P + C)
    cm = batch.completion_mask[rows]                                         # (n, C)
    p = batch.prompt_len
    real_prompt = am[:, :p].bool().any(0)                                    # (P,)
    lead = int(torch.nonzero(real_prompt)[0])                                # leading all-pad columns
    c = int(cm.sum(1).max())                                                 # longest completion here
    cols = slice(lead, p + c)

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows][:, :c]

    return (batch.input_ids[rows][:, cols], am[:, cols], p - lead, cm[:, :c], cut(batch.old_logprobs),
            cut(batch.ref_logprobs), batch.advantages[rows])


def policy_update(model: torch.nn.Module, optimizer, batch: RolloutBatch, grpo: GrpoConfig,
                  train: TrainConfig, *, on_policy: bool, max_new_tokens: int) -> UpdateResult:
    """Accumulate gradients over the batch's micro-batches, clip, step (or skip if non-finite)."""
    model.train()
    totals = BatchTotals(num_seqs=batch.num_seqs, num_tokens=int(batch.completion_mask.sum()),
                         max_new_tokens=max_new_tokens)
    optimizer.zero_grad()
    loss_sum, kl_sum, clip_sum = 0.0, 0.0, 0.0
    use_ref = grpo.beta > 0
    for rows in micro_batch_indices(batch, train.micro_batch_size):
        ids, am, p, cm, old, ref, adv = _trim(batch, rows)
        logp = token_logprobs(model, ids, am, p, cm, chunk=train.logprob_chunk)  # (n, c)
        loss, stats = policy_loss(grpo.loss, logp, None if on_policy else old, ref if use_ref else None,
                                  adv, cm, totals, beta=grpo.beta, eps_low=grpo.clip_eps_low,
                                  eps_high=grpo.clip_eps_high)
        if not torch.isfinite(loss):
            optimizer.zero_grad()
            return UpdateResult(float("nan"), float("nan"), float("nan"), float("nan"), True)
        loss.backward()
        loss_sum += float(loss.detach())
        kl_sum += stats.get("kl_sum", 0.0)
        clip_sum += stats["clipped_sum"]
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return UpdateResult(loss_sum, float("nan"), float("nan"), grad_norm, True)
    optimizer.step()
    optimizer.zero_grad()
    ntok = max(totals.num_tokens, 1)
    return UpdateResult(loss_sum, kl_sum / ntok, clip_sum / ntok, grad_norm, False)
