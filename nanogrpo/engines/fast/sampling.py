"""Sampling on the device: greedy, or temperature / top-k / top-p by Gumbel-max, with the
log-probability of each chosen token. No host sync, no data-dependent shapes: it runs
inside a captured CUDA graph, where ``temp``, ``top_p`` and ``lp_temp`` are [1] tensors
that each call refills.
"""

from __future__ import annotations

import torch

from nanogrpo.algo.support import truncate


def sample(logits: torch.Tensor, mode: tuple, temp: torch.Tensor, top_p: torch.Tensor, lp_temp: torch.Tensor,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] float32 -> (token [rows], its log-prob [rows]).

    ``mode``: ``("greedy",)`` or ``("sample", top_k, use_top_p, support)``. Tokens are drawn from
    ``softmax(logits / temp)`` cut to the top-k / top-p head (:func:`nanogrpo.algo.support.truncate`,
    vLLM's rule); the log-prob reported is that of ``log_softmax(logits / lp_temp)``
    (``SamplingParams.logprob_temperature``; 1 = the model's untempered distribution), whatever shaped
    the draw, or with ``support`` (``SamplingParams.support_logprobs``; then ``lp_temp`` is ``temp``) that of
    the distribution the token was drawn from: ``logits / temp`` over the kept head, renormalised."""
    if mode[0] == "greedy":
        tok = logits.argmax(-1)
    else:
        s = truncate(logits / temp, mode[1], top_p if mode[2] else None)  # [rows, vocab], -inf outside
        noise = torch.empty_like(s).exponential_(generator=gen).clamp_min_(1e-20)
        tok = (s - noise.log()).argmax(-1)  # Gumbel-max: a draw from softmax(s)
        if len(mode) > 3 and mode[3]:
            return tok, s.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(s, -1)
    scored = logits / lp_temp  # [rows, vocab]
    lp = scored.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(scored, -1)
    return tok, lp
