"""What a feature adds inside the update: around each micro-batch's forward, beside the head, to the loss.

The update (:func:`~nanogrpo.training.step.policy_update`) and every forward of a batch
(:func:`~nanogrpo.training.micro.forward_rows`: the reference's, the proximal and entropy passes, the
update's) ask the run's :class:`Terms` at these points, whatever the features:

    forward(batch, rows, lead, c)       a context around one micro-batch's forward (``rows`` of ``batch``,
                                        its columns from ``lead``, ``c`` completion columns)
    head(batch, rows, ids, am, p, c)    what the head computes beside the log-probs (``token_stats``'
                                        ``divergence``), or None
    loss(batch, rows, logp, head, adv, lm)   (advantages, an extra per-token loss or None, stats)
    metrics(tot)                        the update's metrics from the stats summed over the batch

:class:`Terms` itself adds nothing; on-policy distillation's teacher
(:class:`~nanogrpo.training.distill.Distill`) is one. :class:`AllTerms` runs several in order.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any

import torch


class Terms:
    """Nothing added: the base every feature that acts inside the update overrides."""

    stat_ops: dict[str, str] = {}
    """How each stat :meth:`loss` returns combines over micro-batches and ranks: ``sum``, ``min``, ``max``."""

    def forward(self, batch, rows: torch.Tensor, lead: int, c: int):
        return nullcontext()

    def head(self, batch, rows: torch.Tensor, ids: torch.Tensor, am: torch.Tensor, prompt_len: int, c: int):
        return None

    def loss(self, batch, rows: torch.Tensor, logp: torch.Tensor, head: Any, adv: torch.Tensor,
             lm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        return adv, None, {}

    def metrics(self, tot: dict[str, float]) -> dict[str, float]:
        return {}


class AllTerms(Terms):
    """Several features' terms, asked in order (at most one may compute beside the head)."""

    def __init__(self, parts: list[Terms]):
        self.parts = parts
        self.stat_ops = {k: v for p in parts for k, v in p.stat_ops.items()}

    def forward(self, batch, rows, lead, c):
        stack = ExitStack()
        for p in self.parts:
            stack.enter_context(p.forward(batch, rows, lead, c))
        return stack

    def head(self, batch, rows, ids, am, prompt_len, c):
        found = [h for p in self.parts if (h := p.head(batch, rows, ids, am, prompt_len, c)) is not None]
        if len(found) > 1:
            raise ValueError("two features compute beside the policy's head in one update")
        return found[0] if found else None

    def loss(self, batch, rows, logp, head, adv, lm):
        extra, stats = None, {}
        for p in self.parts:
            adv, more, s = p.loss(batch, rows, logp, head, adv, lm)
            extra = more if extra is None else extra if more is None else extra + more
            stats.update(s)
        return adv, extra, stats

    def metrics(self, tot):
        return {k: v for p in self.parts for k, v in p.metrics(tot).items()}
