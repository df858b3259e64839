"""On-policy distillation: a teacher's log-probs as the signal, pure functions of tensors.

The student samples, a teacher scores the student's own tokens, and the student moves towards the
teacher where it went wrong (Agarwal et al., "On-Policy Distillation of Language Models", GKD, ICLR
2024). ``SIGNALS`` (``distill.signal``) holds the two ways the teacher's opinion becomes a gradient:

    sampled   A_t = log p_teacher(y_t) - log p_student(y_t)            a per-token advantage, no gradient
              through it: the policy-gradient term on the student's own samples lowers the reverse KL
              KL(student || teacher) (the per-token reverse KL of on-policy distillation as Thinking
              Machines' "On-Policy Distillation", 2025, runs it beside RL); needs only the teacher's
              log-probs of the sampled tokens, which any server that scores a prompt returns.
    jsd       D_t = generalised JSD(p_student(. | y_<t), p_teacher(. | y_<t); beta) at temperature T,
              a per-token loss with its gradient (TRL 1.16 ``DistillationTrainer``): beta = 0 the
              forward KL(teacher || student), 1 the reverse KL(student || teacher), between them
              beta KL(teacher || m) + (1 - beta) KL(student || m), m = (1 - beta) p_student + beta p_teacher.
              Over the whole vocabulary (``top_k`` = 0: a teacher in the process) or over a sparse support
              built from the teacher's top-k (``top_k`` > 0: what a server returns), as TRL's
              ``ServerDistillationTrainer``: beta = 0 the teacher's top-k, beta = 1 the sampled token,
              between them the teacher's top-k and the sampled token; with ``add_tail`` one more bucket
              holds the mass outside the support (TRL ``loss_add_tail``), else both are renormalised on it.

With the GRPO rewards beside it (``distill.weight`` = w < 1) the two mix, per token::

    A_t    = (1 - w) A_i + w (log p_teacher(y_t) - log p_student(y_t))     (sampled)
    A_t    = (1 - w) A_i,   loss_t += w D_t                                  (jsd)

and the reduction (``grpo.loss_reduction``) is the run's, over the same tokens; with w = 1 (no rewards
needed) the policy term of ``jsd`` is zero and the loss is TRL's divergence (its token-mean reduction is
``grpo.loss_reduction=token-mean``).

Departures from TRL: its ``beta`` = 1 sparse support (the sampled token alone) and 0 < beta < 1 one
(the teacher's top-1 and the sampled token) are kept; for ``top_k`` > 1 with 0 < beta < 1 the support is
the teacher's top-k and the sampled token (TRL refuses that setting). The parity tests
(``tests/test_parity_trl_distill.py``) run TRL's own loss code on the same tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DistillSpec:
    """The resolved ``[distill]`` settings the loss reads."""

    signal: str = "sampled"
    weight: float = 1.0
    beta: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    add_tail: bool = True

    @classmethod
    def from_config(cls, distill, rollout) -> DistillSpec:
        """From a :class:`~nanogrpo.config.DistillConfig` and the run's
        :class:`~nanogrpo.config.RolloutConfig` (``distill.temperature`` None: ``rollout.temperature``,
        TRL's one temperature for both)."""
        t = rollout.temperature if distill.temperature is None else distill.temperature
        return cls(signal=distill.signal, weight=distill.weight, beta=distill.beta,
                   temperature=t if t > 0 else 1.0, top_k=distill.support_size(), add_tail=distill.add_tail)

    @property
    def needs(self) -> str:
        """What the signal needs from the teacher: ``sampled`` (log-probs of the sampled tokens), ``topk``
        (and its top-k), ``full`` (its whole distribution at every position: a teacher in the process)."""
        return SIGNALS[self.signal].needs(self)


# ----------------------------------------------------------------------------- divergences


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float,
                    support: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised JSD (Agarwal et al. 2024; TRL's convention) between two distributions given as
    log-probs over the last dimension (..., V) -> (...,): beta 0 KL(teacher || student), 1
    KL(student || teacher), else beta KL(teacher || m) + (1 - beta) KL(student || m) with
    m = (1 - beta) p_student + beta p_teacher. ``support``: (..., V) bool, the entries that exist
    (the others are ignored whatever they hold)."""
    if support is not None:
        student = torch.where(support, student, 0.0)                   # (..., V) 0 * log 0 -> 0
        teacher = torch.where(support, teacher, 0.0)
    ps = student.exp() if support is None else torch.where(support, student.exp(), 0.0)  # (..., V)
    pt = teacher.exp() if support is None else torch.where(support, teacher.exp(), 0.0)  # (..., V)
    if beta == 0.0:
        return (pt * (teacher - student)).sum(-1)                      # (...,) KL(t || s)
    if beta == 1.0:
        return (ps * (student - teacher)).sum(-1)                      # (...,) KL(s || t)
    log_m = torch.logaddexp(student + math.log(1 - beta), teacher + math.log(beta))  # (..., V)
    if support is not None:
        log_m = torch.where(support, log_m, 0.0)
    return (beta * pt * (teacher - log_m) + (1 - beta) * ps * (student - log_m)).sum(-1)  # (...,)


def add_tail(logp: torch.Tensor, support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A distribution over the support plus one bucket for the rest: (..., K) log-probs (-inf or anything
    off ``support``) -> (..., K + 1) with log(1 - sum_support p) last, and its (..., K + 1) support."""
    lp = torch.where(support, logp, -math.inf)                         # (..., K)
    total = torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7)     # (..., 1) < 0: some mass is left
    tail = torch.log(-torch.expm1(total))                              # (..., 1) log(1 - sum p)
    return torch.cat([lp, tail], -1), torch.cat([support, torch.ones_like(support[..., :1])], -1)


def sparse_support(beta: float, topk_ids: torch.Tensor, targets: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's sparse support (module docstring): (ids (..., S), support (..., S) bool) from the teacher's
    top-k ids (..., K) and the sampled tokens (...,): beta 0 the top-k; 1 the sampled token; else both
    (the sampled token counted once)."""
    if beta == 0.0:
        return topk_ids, torch.ones_like(topk_ids, dtype=torch.bool)
    t = targets.unsqueeze(-1)                                          # (..., 1)
    if beta == 1.0:
        return t, torch.ones_like(t, dtype=torch.bool)
    fresh = ~(topk_ids == t).any(-1, keepdim=True)                     # (..., 1) not among the top-k
    ids = torch.cat([topk_ids, torch.where(fresh, t, topk_ids[..., :1])], -1)  # (..., K + 1)
    return ids, torch.cat([torch.ones_like(topk_ids, dtype=torch.bool), fresh], -1)


def sparse_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, support: torch.Tensor, beta: float,
               tail: bool) -> torch.Tensor:
    """The generalised JSD on a sparse support (..., S): the student's and teacher's log-probs of the
    support's tokens (normalised over the vocabulary), made distributions by a tail bucket or by
    renormalising on the support -> (...,)."""
    if tail:
        s, sup = add_tail(student_logp, support)                       # (..., S + 1)
        t, _ = add_tail(teacher_logp, support)
    else:
        s = torch.where(support, student_logp, -math.inf)              # (..., S)
        t = torch.where(support, teacher_logp, -math.inf)
        s, t = s - torch.logsumexp(s, -1, keepdim=True), t - torch.logsumexp(t, -1, keepdim=True)
        sup = support
    return generalized_jsd(s, t, beta, sup)                            # (...,)


# ----------------------------------------------------------------------------- per-chunk divergences
# What the update evaluates, chunk by chunk, on the student's logits (c, V) (acc dtype, untempered) of the
# trained positions: each (student logits, sampled tokens (c,), *teacher tensors of those positions)
# -> (c, 2):
# [:, 0] the divergence D_t (with its gradient), [:, 1] log p_student(y_t) - log p_teacher(y_t) at the same
# temperature (the reverse-KL metric's sample, no gradient)


def full_divergence(spec: DistillSpec, weight: torch.Tensor, bias: torch.Tensor | None,
                    logit_map: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Callable:
    """``jsd`` over the vocabulary: the teacher tensor is its last hidden state (c, H_t), projected through
    its head ``weight`` (V, H_t) / ``bias`` here (never a (N, C, V) tensor of the teacher's), then mapped
    as the teacher's own forward maps it (``logit_map``: a scale, a soft cap;
    :class:`~nanogrpo.algo.heads.LogitMap`)."""

    def div(s_logits: torch.Tensor, targets: torch.Tensor, t_hidden: torch.Tensor) -> torch.Tensor:
        t_logits = F.linear(t_hidden.to(weight.dtype), weight, bias).to(s_logits.dtype)  # (c, V) the head's
        if logit_map is not None:
            t_logits = logit_map(t_logits)                             # (c, V) the teacher's logits
        if t_logits.shape[-1] != s_logits.shape[-1]:
            raise ValueError(f"the teacher's head has {t_logits.shape[-1]} outputs, the student's "
                             f"{s_logits.shape[-1]}: jsd over the vocabulary needs the same vocabulary")
        s = F.log_softmax(s_logits / spec.temperature, -1)             # (c, V)
        t = F.log_softmax(t_logits / spec.temperature, -1)             # (c, V)
        gap = (s - t).detach().gather(-1, targets[:, None]).squeeze(-1)  # (c,)
        return torch.stack([generalized_jsd(s, t, spec.beta), gap], -1)  # (c, 2)
    return div


def topk_divergence(spec: DistillSpec) -> Callable:
    """``jsd`` on the sparse support: the teacher tensors are its top-k log-probs (c, K) and ids (c, K)
    and its log-prob of the sampled token (c,), all at temperature ``spec.temperature``."""

    def div(s_logits: torch.Tensor, targets: torch.Tensor, t_topk: torch.Tensor, t_ids: torch.Tensor,
            t_sampled: torch.Tensor) -> torch.Tensor:
        s = F.log_softmax(s_logits / spec.temperature, -1)             # (c, V)
        ids, sup = sparse_support(spec.beta, t_ids, targets)           # (c, S) each
        t = t_topk.to(s.dtype)                                         # (c, K)
        if spec.beta == 1.0:
            t = t_sampled.to(s.dtype).unsqueeze(-1)                    # (c, 1)
        elif spec.beta > 0.0:
            t = torch.cat([t, t_sampled.to(s.dtype).unsqueeze(-1)], -1)  # (c, K + 1)
        gap = s.detach().gather(-1, targets[:, None]).squeeze(-1) - t_sampled.to(s.dtype)  # (c,)
        d = sparse_jsd(s.gather(-1, ids), t, sup, spec.beta, spec.add_tail)  # (c,)
        return torch.stack([d, gap], -1)                               # (c, 2)
    return div


def chunked_divergence(fn, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       targets: torch.Tensor, extra: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """``fn(logits, targets, *extra)`` (T, 2) over the logits ``h @ weight.T + bias`` (acc dtype), ``chunk``
    tokens at a time, each chunk under activation checkpointing: its (chunk, V) logits and whatever ``fn``
    builds from them are recomputed in the backward, never kept (the distillation divergence,
    :mod:`nanogrpo.algo.distill`; the gradient is autograd's of ``fn``).
    h: (T, H); extra: tensors (T, ...) aligned with h."""
    from torch.utils.checkpoint import checkpoint

    dev = h.device.type  # the matmul in autocast's dtype when on; log-softmax in float32 (float64: 64)
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32

    def part(hc, tc, *ec):
        with torch.autocast(hc.device.type, enabled=False):
            z = F.linear(hc.to(dt), weight.to(dt), None if bias is None else bias.to(dt)).to(acc)  # (c, V)
            return fn(z, tc, *ec)                                              # (c, 2)

    step = max(1, int(chunk))
    outs = []
    for i in range(0, h.shape[0], step):
        args = (h[i:i + step], targets[i:i + step], *[e[i:i + step] for e in extra])
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            outs.append(checkpoint(part, *args, use_reentrant=False))
        else:
            outs.append(part(*args))
    return torch.cat(outs) if outs else h.new_zeros(0, 2, dtype=acc)            # (T, 2)


# ----------------------------------------------------------------------------- the signals


@dataclass(frozen=True)
class Signal:
    """One ``distill.signal``: what it needs from the teacher and how it enters the loss."""

    needs: Callable[[DistillSpec], str]
    uses_divergence: bool
    """Whether the update computes a per-token divergence with its gradient (``jsd``)."""
    paper: str


SIGNALS: dict[str, Signal] = {
    "sampled": Signal(lambda s: "sampled", False,
                      "per-token reverse KL as advantage: Agarwal et al. 2024; Thinking Machines 2025"),
    "jsd": Signal(lambda s: "topk" if s.top_k > 0 else "full", True,
                  "generalised JSD: Agarwal et al. 2024 (GKD), TRL 1.16 DistillationTrainer"),
}


def divergence_fn(spec: DistillSpec, head: tuple | None = None) -> Callable | None:
    """The per-chunk divergence the update computes for ``spec`` (None: the signal has none); ``head``:
    the teacher's output head (weight, bias[, logit map]) for the whole-vocabulary ``jsd``."""
    if not SIGNALS[spec.signal].uses_divergence:
        return None
    if spec.needs == "full":
        if head is None:
            raise ValueError("jsd over the whole vocabulary needs the teacher's head (a teacher in the "
                             "process)")
        return full_divergence(spec, *head)
    return topk_divergence(spec)


def distill_terms(spec: DistillSpec, logp: torch.Tensor, teacher: torch.Tensor | None,
                  divergence: torch.Tensor | None, adv: torch.Tensor, mask: torch.Tensor,
                  correct: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """(per-token advantages (N, T), per-token loss to add (N, T) or None, stats) of one micro-batch.

    logp: (N, T) the student's log-probs of the sampled tokens (with gradient; only its value is read);
    teacher: (N, T) the teacher's (``sampled``; None for ``jsd``); divergence: (N, T, 2) what the update's
    per-chunk divergence gave (``jsd``: [..., 0] the divergence with its gradient, [..., 1] the student's
    minus the teacher's log-prob of the sampled token; None for ``sampled``); adv: (N,) the GRPO
    advantages; mask: (N, T) the trained tokens; correct: (N,) bool, whether each completion was right
    (the task's accuracy), for the stats split by it (None: unknown).
    Stats are detached 0-dim sums over the masked tokens (:data:`DISTILL_STAT_OPS`)."""
    m = mask.bool()                                                    # (N, T)
    mf = m.to(logp.dtype)
    w = spec.weight
    base = adv.to(logp.dtype).unsqueeze(1) * (1 - w)                   # (N, 1)
    extra = None
    if SIGNALS[spec.signal].uses_divergence:
        if divergence is None:
            raise ValueError(f"distill.signal={spec.signal} needs the per-token divergence")
        gap = torch.where(m, -divergence[..., 1].detach().to(logp.dtype), 0.0)  # (N, T) log p_t - log p_s
        a = base.expand_as(gap)                                        # (N, T)
        extra = w * torch.where(m, divergence[..., 0].to(logp.dtype), 0.0)  # (N, T)
    else:
        if teacher is None:
            raise ValueError(f"distill.signal={spec.signal} needs the teacher's log-probs of the sampled "
                             "tokens")
        gap = torch.where(m, teacher.to(logp.dtype) - logp.detach(), 0.0)  # (N, T) log p_t - log p_s
        a = base + w * gap                                             # (N, T)
    stats = {"distill_rkl_sum": (-gap * mf).sum(), "distill_tokens": mf.sum()}
    if extra is not None:
        stats["distill_div_sum"] = (extra.detach() * mf).sum() / w
    if correct is not None:
        c = correct.to(m.device).bool().unsqueeze(1) & m               # (N, T)
        wr = ~correct.to(m.device).bool().unsqueeze(1) & m
        stats.update({"distill_rkl_correct_sum": (-gap * c).sum(), "distill_tokens_correct": c.sum(),
                      "distill_rkl_wrong_sum": (-gap * wr).sum(), "distill_tokens_wrong": wr.sum()})
    return a, extra, stats


DISTILL_STAT_OPS: dict[str, str] = {
    "distill_rkl_sum": "sum", "distill_tokens": "sum", "distill_div_sum": "sum",
    "distill_rkl_correct_sum": "sum", "distill_tokens_correct": "sum",
    "distill_rkl_wrong_sum": "sum", "distill_tokens_wrong": "sum",
}
"""How each stat of :func:`distill_terms` combines over micro-batches and ranks."""


def distill_metrics(tot: dict[str, float], spec: DistillSpec) -> dict[str, float]:
    """The logged ``distill/*`` metrics from the whole-batch stat totals: ``reverse_kl`` (the per-token
    reverse KL to the teacher, estimated on the student's samples: mean of log p_s - log p_t), the same on
    correct and on wrong completions (those with tokens in the batch), and the ``jsd`` divergence's per-token
    mean."""
    out = {}
    if tot.get("distill_tokens", 0) > 0:
        out["distill/reverse_kl"] = tot["distill_rkl_sum"] / tot["distill_tokens"]
        if SIGNALS[spec.signal].uses_divergence:
            out["distill/divergence"] = tot["distill_div_sum"] / tot["distill_tokens"]
    for k in ("correct", "wrong"):  # where the task says which completions are right and some are
        n = tot.get(f"distill_tokens_{k}", 0)
        if n:
            out[f"distill/reverse_kl_{k}"] = tot[f"distill_rkl_{k}_sum"] / n
    return out
