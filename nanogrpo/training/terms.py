"""What a feature adds inside the update: around each micro-batch's forward, beside the head, to the loss.

The update (:func:`~nanogrpo.training.step.policy_update`) and every forward of a batch
(:func:`~nanogrpo.training.micro.forward_rows`: the reference's, the proximal and entropy passes, the
update's) ask the run's :class:`Terms` at these points, whatever the features:

    share_prefix(batch)                 whether the batch's forwards may run a group's prompt once
    forward(model, batch, rows, kind)   a context around one micro-batch's forward of ``model`` (``kind``:
                                        ``update``, ``proximal``, ``reference`` or ``pass``; the update's
                                        stays open through its backward)
    head(batch, rows, ids, am, p, c)    what the head computes beside the log-probs (``token_stats``'
                                        ``divergence``), or None
    loss(batch, rows, logp, head, adv, lm)   (advantages, an extra per-token loss or None, stats)
    stats()                             stats gathered outside ``loss`` since the last call (per update)
    metrics(tot)                        the update's metrics from the stats summed over the batch

:class:`Terms` itself adds nothing; on-policy distillation's teacher
(:class:`~nanogrpo.training.distill.Distill`) and MoE routing replay
(:class:`~nanogrpo.training.routing.RoutingReplay`) are terms. :class:`AllTerms` runs several in order.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any

import torch


class Terms:
    """Nothing added: the base every feature that acts inside the update overrides."""

    stat_ops: dict[str, str] = {}
    """How each stat combines over micro-batches and ranks: ``sum``, ``min``, ``max``."""
    first_update: tuple[str, ...] = ()
    """Metrics a step takes from its first optimizer step alone (the weights that sampled the batch)."""
    wants_proximal = False
    """Whether a batch of several optimizer steps needs the forward over it before the first one
    (:func:`~nanogrpo.training.schedule.proximal_logprobs`) for this feature's sake."""

    def share_prefix(self, batch) -> bool:
        return True

    def forward(self, model, batch, rows: torch.Tensor, kind: str):
        return nullcontext()

    def head(self, batch, rows: torch.Tensor, ids: torch.Tensor, am: torch.Tensor, prompt_len: int, c: int):
        return None

    def loss(self, batch, rows: torch.Tensor, logp: torch.Tensor, head: Any, adv: torch.Tensor,
             lm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        return adv, None, {}

    def stats(self) -> dict[str, torch.Tensor]:
        return {}

    def metrics(self, tot: dict[str, float]) -> dict[str, float]:
        return {}


class AllTerms(Terms):
    """Several features' terms, asked in order (at most one may compute beside the head)."""

    def __init__(self, parts: list[Terms]):
        self.parts = parts
        self.stat_ops = {k: v for p in parts for k, v in p.stat_ops.items()}
        self.first_update = tuple(k for p in parts for k in p.first_update)
        self.wants_proximal = any(p.wants_proximal for p in parts)

    def share_prefix(self, batch) -> bool:
        return all(p.share_prefix(batch) for p in self.parts)

    def forward(self, model, batch, rows, kind):
        stack = ExitStack()
        for p in self.parts:
            stack.enter_context(p.forward(model, batch, rows, kind))
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

    def stats(self):
        return {k: v for p in self.parts for k, v in p.stats().items()}

    def metrics(self, tot):
        return {k: v for p in self.parts for k, v in p.metrics(tot).items()}


def terms_of(parts: list) -> Terms:
    """The run's terms: those of ``parts`` that act inside the update, as one (none: :class:`Terms`)."""
    mine = [p for p in parts if isinstance(p, Terms)]
    return mine[0] if len(mine) == 1 else AllTerms(mine) if mine else Terms()
