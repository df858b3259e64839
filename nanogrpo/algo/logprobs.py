"""Per-token log-probabilities of completion tokens, without a (N, L, V) tensor.

The seed runs ``log_softmax`` over the full vocabulary at every position of
every row. Here the backbone returns hidden states; only the hidden states at
completion positions (mask True) are projected through the LM head, ``chunk``
tokens at a time, each chunk under activation checkpointing so that its
(chunk, V) float32 logits are recomputed in the backward pass instead of kept.
Peak extra memory is one chunk's logits, whatever the batch or vocabulary.

Models whose head is not a plain linear projection of the last hidden state
(logit soft-capping, scaled heads) take the ``full`` path: the model's own
logits, row by row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

PLAIN_HEAD_TYPES = {"qwen2", "qwen3", "llama", "mistral", "qwen2_moe", "qwen3_moe", "phi3", "olmo2"}


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)                # (N, L)


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()                           # (c, V)
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (c,)


def _backbone_and_head(model: torch.nn.Module):
    head = model.get_output_embeddings()
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else None
    mtype = getattr(getattr(model, "config", None), "model_type", None)
    if backbone is None or not isinstance(head, torch.nn.Linear) or mtype not in PLAIN_HEAD_TYPES:
        return None, None
    return backbone, head


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   prompt_len: int, completion_mask: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Log-probs (N, C) float32 of ``input_ids[:, prompt_len:]`` under ``model``; 0 where masked.

    input_ids/attention_mask: (N, P + C), prompts left-padded to P, completions
    right-padded to C. completion_mask: (N, C) bool.
    """
    pos = position_ids_from_mask(attention_mask)                              # (N, L)
    targets = input_ids[:, prompt_len:]                                       # (N, C)
    backbone, head = _backbone_and_head(model)
    if backbone is None:
        return _full_logprobs(model, input_ids, attention_mask, pos, prompt_len)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                      use_cache=False).last_hidden_state                      # (N, L, H)
    h = hidden[:, prompt_len - 1:-1]                                          # (N, C, H) predicts targets
    sel = completion_mask.bool()                                              # (N, C)
    h_sel, t_sel = h[sel], targets[sel]                                       # (T, H), (T,)
    out = []
    for i in range(0, t_sel.numel(), chunk):
        hc, tc = h_sel[i:i + chunk], t_sel[i:i + chunk]
        if torch.is_grad_enabled() and hc.requires_grad:
            out.append(checkpoint(_chunk_logprobs, hc, head.weight, head.bias, tc, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(hc, head.weight, head.bias, tc))
    flat = torch.cat(out) if out else h_sel.new_zeros(0, dtype=torch.float32)  # (T,)
    res = torch.zeros(sel.shape, dtype=torch.float32, device=flat.device)     # (N, C)
    return res.masked_scatter(sel, flat)


def _full_logprobs(model, input_ids, attention_mask, pos, prompt_len):
    rows = []
    for i in range(input_ids.shape[0]):  # one row at a time bounds the (L, V) logits
        logits = model(input_ids=input_ids[i:i + 1], attention_mask=attention_mask[i:i + 1],
                       position_ids=pos[i:i + 1], use_cache=False).logits[0, prompt_len - 1:-1]  # (C, V)
        rows.append(logits.float().log_softmax(-1).gather(-1, input_ids[i, prompt_len:, None]).squeeze(-1))
    return torch.stack(rows)                                                  # (N, C)


@torch.no_grad()
def batch_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         prompt_len: int, completion_mask: torch.Tensor, micro_batch_size: int = 16,
                         chunk: int = 4096) -> torch.Tensor:
    """``token_logprobs`` without gradients, ``micro_batch_size`` rows at a time (reference model)."""
    out = []
    for i in range(0, input_ids.shape[0], micro_batch_size):
        sl = slice(i, i + micro_batch_size)
        out.append(token_logprobs(model, input_ids[sl], attention_mask[sl], prompt_len,
                                  completion_mask[sl], chunk))
    return torch.cat(out)                                                     # (N, C)
