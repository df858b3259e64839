"""On-policy distillation in the trainer (``[distill]``): the run's teacher and its signal.

    local.py    a teacher in the process: an HF model loaded beside the policy, frozen; the vocabulary check
    server.py   a teacher behind HTTP: a vLLM server's /v1/completions with prompt_logprobs, or
                ``nanogrpo serve --teacher MODEL`` answering the same route; retries, one-line refusals

:class:`Distill` is a part of the run (:class:`~nanogrpo.training.run.Part`) and terms of its update
(:class:`~nanogrpo.training.terms.Terms`), whatever the signal (:data:`nanogrpo.algo.distill.SIGNALS`; no
branch per signal):

    after_rollout   :meth:`Distill.annotate`: the teacher's tensors on the batch, as the reference log-probs
                    are (``teacher_logprobs``, and ``teacher_topk_*`` for ``jsd`` on a sparse support)
    head            :meth:`Distill.divergence`, per micro-batch of the update: what the student's head
                    computes beside its log-probs (``jsd``: the per-token divergence; over the whole
                    vocabulary the teacher's forward runs there, per micro-batch, as in TRL)
    loss            :func:`nanogrpo.algo.distill.distill_terms`: per-token advantages or a per-token loss
    start           the teacher's held-out figures beside the student's baseline (``distill.eval_teacher``)

Temperatures: the ``sampled`` signal compares the teacher's and the student's log-probs of each sampled
token in the run's convention (``rollout.tempered_logprobs``: the temperature and top-k/top-p support the
policy's and reference log-probs are taken with); ``jsd`` takes both distributions at
``distill.temperature`` (default ``rollout.temperature``, TRL's one temperature).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from nanogrpo.algo.distill import DISTILL_STAT_OPS, DistillSpec, distill_metrics, distill_terms, divergence_fn
from nanogrpo.batch import RolloutBatch
from nanogrpo.training.distill.local import LocalTeacher
from nanogrpo.training.run import Part
from nanogrpo.training.terms import Terms

log = logging.getLogger("nanogrpo.distill")

__all__ = ["Distill", "LocalTeacher"]


def _token(token_file: str | None) -> str | None:
    """The shared token a teacher behind ``nanogrpo serve`` asks for: ``server.token_file``'s, else
    ``$NANOGRPO_TOKEN`` (as split mode's; None: none)."""
    import os
    from pathlib import Path

    if token_file:
        p = Path(token_file).expanduser()
        if not p.is_file():
            from nanogrpo.errors import ConfigError

            raise ConfigError(f"token file not found: {p}")
        return p.read_text().strip() or None
    return os.environ.get("NANOGRPO_TOKEN", "").strip() or None


@dataclass
class Distill(Terms, Part):
    """The run's teacher and signal (:meth:`from_config`)."""

    stat_ops = DISTILL_STAT_OPS

    spec: DistillSpec
    teacher: object
    """A :class:`~nanogrpo.training.distill.local.LocalTeacher` or a
    :class:`~nanogrpo.training.distill.server.ServerTeacher`."""
    temperature: float
    """The temperature the teacher's scores are taken at."""
    support: tuple[int, float] | None = None
    """``sampled``: the run's top-k / top-p support of the log-probs (None: the vocabulary)."""
    fn: object = field(default=None, repr=False)
    """The per-chunk divergence (:func:`nanogrpo.algo.distill.divergence_fn`), None for ``sampled``."""

    @classmethod
    def from_config(cls, cfg, student: torch.nn.Module, tokenizer, device: torch.device,
                    cpu_linear: str | None = None) -> Distill | None:
        """The teacher of ``cfg.distill`` loaded (beside ``student``, same dtype and device) or reached (a
        server: its tokenizer checked); None when ``distill.teacher`` is empty. One-line errors.
        ``cpu_linear``: the run's settled ``model.cpu_linear`` for the trainer
        (:func:`~nanogrpo.models.cpu_linear.settle`): a teacher in the process computes as the student
        does, decided once."""
        d = cfg.distill
        if not d.teacher:
            return None
        if d.teacher.startswith(("http://", "https://")):
            from nanogrpo.training.distill.server import ServerTeacher

            teacher = ServerTeacher(d.teacher, tokenizer, timeout_s=d.timeout_s, retry_for_s=d.retry_for_s,
                                    token=_token(cfg.server.token_file),
                                    vocab_size=student.get_output_embeddings().weight.shape[0])
        else:
            dtype = next(student.parameters()).dtype
            teacher = LocalTeacher.load(d.teacher, tokenizer, dtype, device, cfg.model.attn_implementation,
                                        cfg.model.trust_remote_code, cpu_linear or cfg.model.cpu_linear)
            teacher.rows = student.get_output_embeddings().weight.shape[0]  # its top-k: ids the student has
        return cls.with_teacher(cfg, teacher, student)

    @classmethod
    def with_teacher(cls, cfg, teacher, student: torch.nn.Module | None = None) -> Distill:
        """The run's distillation with ``teacher`` (a :class:`LocalTeacher` or a server's client) given;
        ``student``: checked against the teacher's head where the signal compares whole distributions."""
        spec = DistillSpec.from_config(cfg.distill, cfg.rollout)
        head = None
        if spec.needs == "full":
            if student is not None:
                teacher.check_vocab_size(student)
            head = teacher.head()
        elif spec.signal == "jsd" and not teacher.remote:
            teacher.head()  # a head nanogrpo cannot project (an unknown family): refused now
        sampled = spec.signal == "sampled"
        out = cls(spec, teacher,
                  temperature=cfg.rollout.logprob_temperature() if sampled else spec.temperature,
                  support=cfg.rollout.logprob_support() if sampled else None, fn=divergence_fn(spec, head))
        if teacher.remote:
            teacher.check(out.temperature, out.support)  # what the server cannot give: one line, now
        return out

    def annotate(self, batch: RolloutBatch, train, share_prefix: bool) -> None:
        """Put the teacher's tensors the signal needs on ``batch`` (nothing for ``jsd`` over the vocabulary:
        the update runs the teacher); raises (one line) when the teacher cannot give them."""
        if batch.has_images:
            from nanogrpo.errors import ConfigError

            raise ConfigError("distill.teacher with images in the prompts is not supported yet: the teacher "
                              "would score the tokens without the pictures")
        if self.spec.needs == "full":
            return
        k = self.spec.top_k if self.spec.needs == "topk" else 0
        scores = self.teacher.score(batch, train, share_prefix, self.temperature, self.support, k)
        for name, value in scores.items():
            setattr(batch, name, value.to(batch.input_ids.device))
        batch.meta["teacher_temperature"] = self.temperature

    def divergence(self, batch: RolloutBatch, rows: torch.Tensor, ids: torch.Tensor, am: torch.Tensor,
                   prompt_len: int, c: int):
        """What the student's head computes beside its log-probs for one micro-batch of the update
        (``token_stats(divergence=...)``): (fn, teacher tensors (n, c, ...)), or None (``sampled``).
        ``ids``, ``am``: the micro-batch's trimmed rows (prompt ``prompt_len`` + ``c`` completion columns)."""
        if self.fn is None:
            return None
        if self.spec.needs == "full":
            return self.fn, [self.teacher.hidden(ids, am, prompt_len)]
        if batch.teacher_topk_ids is None:
            raise ValueError("distill.signal=jsd: the batch carries no teacher top-k (it was not annotated)")
        return self.fn, [batch.teacher_topk_logprobs[rows][:, :c], batch.teacher_topk_ids[rows][:, :c],
                         batch.teacher_logprobs[rows][:, :c]]

    def teacher_logprobs(self, batch: RolloutBatch, rows: torch.Tensor, c: int) -> torch.Tensor | None:
        """(n, c) the teacher's log-probs of the micro-batch's sampled tokens (``sampled``), else None."""
        if self.fn is not None:
            return None
        if batch.teacher_logprobs is None:
            raise ValueError("distill.signal=sampled: the batch carries no teacher log-probs (it was not "
                             "annotated)")
        return batch.teacher_logprobs[rows][:, :c]

    # -- the loop's points (Part) and the update's (Terms)

    def start(self, run) -> dict[str, float]:
        """A fresh run that evaluates: the teacher's held-out figures, once (``distill.eval_teacher``)."""
        if run.resumed or run.held_out is None or not run.cfg.distill.eval_teacher:
            return {}
        return self.evaluate(run.cfg, run.held_out.rows, run.held_out.rewards, run.root,
                             cpu_linear=run.linears.get("engine"))

    def after_rollout(self, run, item) -> None:
        if item.batch is not None:
            self.annotate(item.batch, run.cfg.train, run.share_prefix)

    def head(self, batch, rows, ids, am, prompt_len, c):
        return self.divergence(batch, rows, ids, am, prompt_len, c)

    def loss(self, batch, rows, logp, head, adv, lm):
        right = None if batch.correct is None else batch.correct[rows]
        return distill_terms(self.spec, logp, self.teacher_logprobs(batch, rows, lm.shape[1]), head, adv, lm,
                             right)

    def metrics(self, tot: dict[str, float]) -> dict[str, float]:
        return distill_metrics(tot, self.spec)

    def evaluate(self, cfg, rows: list[dict], rewards, root,
                 cpu_linear: str | None = None) -> dict[str, float]:
        """The teacher's held-out figures (``eval/teacher/*``: greedy accuracy, format rate, ...) on the rows
        the student is evaluated on, written to ``root/eval/teacher.json``; a server teacher: none (it is
        asked for scores, not completions). Its engine is the one ``auto`` picks, with the run's settled
        ``cpu_linear`` for the fast engine's linears (said once, for the run's own engine)."""
        if self.teacher.remote or not rows:
            return {}
        from pathlib import Path

        from nanogrpo.engines.factory import choose_engine, make_engine
        from nanogrpo.evaluation import evaluate_rows, write_results

        new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        t = self.teacher
        max_len = cfg.data.max_prompt_tokens + new
        name, _ = choose_engine(t.model, max_len)
        engine = make_engine(name, t.model, t.tokenizer, max_len=max_len,
                             **({"cpu_linear": cpu_linear} if cpu_linear else {}))
        with torch.no_grad():
            summary, records = evaluate_rows(engine, t.tokenizer, rows, cfg, rewards, new,
                                             cfg.eval.batch_size, k=1, seed=cfg.eval.seed)
        summary["model"] = t.name
        write_results(summary, records, Path(root) / "eval" / "teacher.json")
        keep = ("accuracy", "format_rate", "reward_mean", "completion_len_mean")
        return {f"eval/teacher/{k}": summary[k] for k in keep if k in summary}
