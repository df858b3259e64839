"""Micro-batches: which rows of a batch share one forward, and that forward.

Rows are sorted by length (longest first) and packed greedily while ``rows x (longest prompt + longest
completion)`` stays within ``train.micro_batch_tokens`` (and rows within ``train.micro_batch_size``); each
micro-batch drops the columns that are padding for all its rows, so one long group gets a micro-batch of
its own and short rows share one, padding little. :func:`forward_rows` is the one place a micro-batch
meets the model (the update, the reference, the proximal and entropy passes): the features that change a
forward (:class:`~nanogrpo.training.terms.Terms`) join there.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from nanogrpo.algo.logprobs import token_stats
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import GrpoConfig, TrainConfig


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


def trim_rows(batch: RolloutBatch, rows: torch.Tensor, mask: torch.Tensor | None = None):
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


def forward_rows(model, batch: RolloutBatch, rows: torch.Tensor, mask: torch.Tensor | None,
                 train: TrainConfig, share_prefix: bool, terms=None, kind: str = "pass", **stats):
    """One micro-batch's forward: ``batch``'s ``rows`` trimmed (:func:`trim_rows`; ``mask``: the trained
    tokens), with their images, through :func:`~nanogrpo.algo.logprobs.token_stats` (``stats``: its
    keywords), under ``terms.forward(model, batch, rows, kind)`` (``terms``: the run's
    :class:`~nanogrpo.training.terms.Terms`, None: nothing added). ``kind`` ``update``: the policy update's
    forward, which also computes what ``terms.head`` asks for beside the log-probs, and whose context the
    caller holds open through the backward (gradient checkpointing runs the forward again there).
    Returns (the trimmed rows as :func:`trim_rows` gives them, ``token_stats``' outputs)."""
    cut = trim_rows(batch, rows, mask)
    ids, am, p, lm = cut[:4]
    if kind == "update" and terms is not None:
        stats["divergence"] = terms.head(batch, rows, ids, am, p, lm.shape[1])
    opened = terms is not None and kind != "update"
    with terms.forward(model, batch, rows, kind) if opened else nullcontext():
        out = token_stats(model, ids, am, p, lm, chunk=train.logprob_chunk, share_prefix=share_prefix,
                          mm=_images(model, batch, rows), **stats)
    return cut, out
