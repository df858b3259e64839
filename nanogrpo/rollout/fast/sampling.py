"""Sampling on the device: greedy, or temperature / top-k / top-p by Gumbel-max, with the
log-probability of each chosen token. No host sync, no data-dependent shapes: it runs
inside a captured CUDA graph, where ``temp``, ``top_p`` and ``lp_temp`` are [1] tensors
that each call refills.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def sample(logits: torch.Tensor, mode: tuple, temp: torch.Tensor, top_p: torch.Tensor, lp_temp: torch.Tensor,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] float32 -> (token [rows], its log-prob [rows]).

    ``mode``: ``("greedy",)`` or ``("sample", top_k, use_top_p)``. Tokens are drawn from
    ``softmax(logits / temp)`` cut to the top-k / top-p head; the log-prob reported is that of
    ``log_softmax(logits / lp_temp)`` (``SamplingParams.logprob_temperature``; 1 = the model's
    untempered distribution), whatever shaped the draw."""
    if mode[0] == "greedy":
        tok = logits.argmax(-1)
    else:
        s = logits / temp
        top_k, use_top_p = mode[1], mode[2]
        if top_k:
            kth = s.topk(min(top_k, s.shape[-1]), -1).values[:, -1:]
            s = s.masked_fill(s < kth, NEG_INF)
        if use_top_p:  # keep the smallest head of the sorted distribution with mass >= top_p
            srt, idx = s.sort(-1, descending=True)
            p = srt.softmax(-1)
            srt = srt.masked_fill(p.cumsum(-1) - p >= top_p, NEG_INF)
            s = torch.full_like(s, NEG_INF).scatter(-1, idx, srt)
        noise = torch.empty_like(s).exponential_(generator=gen).clamp_min_(1e-20)
        tok = (s - noise.log()).argmax(-1)  # Gumbel-max: a draw from softmax(s)
    scored = logits / lp_temp  # [rows, vocab]
    lp = scored.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(scored, -1)
    return tok, lp
