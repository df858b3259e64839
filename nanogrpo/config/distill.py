"""``[distill]``: on-policy distillation from a teacher (:mod:`nanogrpo.algo.distill`,
:mod:`nanogrpo.training.distill`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from nanogrpo.config.base import _Strict


class DistillConfig(_Strict):
    """A teacher scores the student's own samples; its log-probs become the signal, alone (``weight`` = 1)
    or beside the GRPO rewards (``weight`` < 1). Off while ``teacher`` is empty. The names follow TRL's
    ``DistillationConfig`` (``beta``, ``temperature``) and ``ServerDistillationConfig`` (``top_k`` is its
    ``loss_top_k``, ``add_tail`` its ``loss_add_tail``)."""

    teacher: str = ""
    """The teacher: a model directory, hub id or demo model (``embedded-distill``), loaded beside the policy
    (same device and dtype), or the ``http(s)://`` address of a server that scores prompts (a vLLM server's
    ``/v1/completions`` with ``prompt_logprobs``, or ``nanogrpo serve --teacher MODEL``). Its tokenizer
    must map tokens to the student's ids. Empty: no distillation."""
    signal: Literal["jsd", "sampled"] = "jsd"
    """jsd (TRL's ``DistillationTrainer``): the generalised JSD between the two next-token distributions, a
    per-token loss (``beta``, ``temperature``, ``top_k``); sampled: the per-token reverse KL on the sampled
    tokens as a per-token advantage (teacher log-prob minus student log-prob; any server that scores a
    prompt can be its teacher)."""
    weight: float = Field(1.0, gt=0, le=1)
    """The teacher's share of the signal: 1 the teacher alone (the rewards then only report), below 1 the
    advantage mixes (1 - weight) x the GRPO advantage with weight x the teacher's signal."""
    beta: float = Field(1.0, ge=0, le=1)
    """jsd: 0 forward KL(teacher || student), 1 reverse KL(student || teacher) (TRL's default), between
    them the generalised JSD."""
    temperature: float | None = Field(None, gt=0)
    """jsd: both distributions at this temperature (TRL's ``temperature``). None: ``rollout.temperature``,
    as TRL's one temperature for sampling and loss. (sampled takes the run's log-prob convention,
    ``rollout.tempered_logprobs``, for teacher and student alike.)"""
    top_k: int | None = Field(None, ge=0, le=1000)
    """jsd: 0 over the whole vocabulary (a teacher in the process); k > 0 over a sparse support from the
    teacher's top-k (what a server returns; TRL's ``loss_top_k``): beta 0 the top-k, beta 1 the sampled
    token, between them both. None: 0 for a teacher in the process (TRL's ``DistillationTrainer``), 1 for a
    server (``ServerDistillationTrainer``'s default)."""
    add_tail: bool = True
    """jsd with ``top_k`` > 0: one more bucket holds the probability outside the support (TRL's
    ``loss_add_tail``); false: both distributions renormalised on the support."""
    eval_teacher: bool = True
    """Evaluate a teacher in the process once on the held-out problems at the start (``eval/teacher/*``,
    with ``eval.every`` > 0), so the student's curve has its target beside it."""
    timeout_s: float = Field(120.0, gt=0)
    """A server teacher: the time limit of one scoring request."""
    retry_for_s: float = Field(300.0, ge=0)
    """A server teacher: how long a server that does not answer (refused, timed out, 5xx) is retried from
    the first failure before the run stops with one line (a vLLM server restarting a large teacher takes
    minutes); an answer that is not log-probs stops it at once."""

    @field_validator("teacher", mode="before")
    @classmethod
    def _empty_is_off(cls, v):
        """``distill.teacher=`` on the command line (an empty value reads as null): off, as the default."""
        return "" if v is None else v

    @model_validator(mode="after")
    def _combinations(self) -> DistillConfig:
        if not self.teacher:
            return self
        remote = self.remote
        k = self.support_size()
        if self.signal == "jsd" and k == 0 and remote:
            raise ValueError(f"distill.signal=jsd over the whole vocabulary (distill.top_k=0) needs the "
                             f"teacher in the process; {self.teacher} returns its top-k: set distill.top_k "
                             "(e.g. 20) or load the teacher by path")
        if self.signal == "jsd" and k and not self.add_tail and (self.beta == 1 or self.beta == 0 and k == 1):
            what = ", top_k=1" if self.beta == 0 else ": the sampled token"
            raise ValueError(f"distill.add_tail=false with a support of one token (distill.beta={self.beta:g}"
                             f"{what}): renormalised on it the two distributions are both certain and the "
                             "loss is 0; keep add_tail=true")
        if self.signal == "sampled":
            fields = type(self).model_fields
            changed = [k for k in ("beta", "temperature", "top_k", "add_tail")
                       if getattr(self, k) != fields[k].default]
            if changed:
                raise ValueError(f"distill.{changed[0]} is a setting of distill.signal=jsd; the sampled "
                                 "signal takes the teacher's log-prob of each sampled token")
        return self

    @property
    def remote(self) -> bool:
        """The teacher is a server (an ``http(s)://`` address)."""
        return self.teacher.startswith(("http://", "https://"))

    def support_size(self) -> int:
        """``top_k`` resolved: 0 (the whole vocabulary) or k; unset, 0 for a teacher in the process and 1 for
        a server (TRL's defaults)."""
        if self.top_k is not None:
            return self.top_k
        return 1 if self.remote and self.signal == "jsd" else 0
