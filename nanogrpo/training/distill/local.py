"""A teacher in the process: an HF model loaded beside the policy, frozen, and the vocabulary check.

It scores the student's completions as the reference model does
(:func:`~nanogrpo.training.step.batch_logprobs`: micro-batches, prefix sharing, the lean head) for the
``sampled`` signal; for ``jsd`` it gives its top-k at each position (``distill.top_k``), or its last
hidden state per micro-batch of the update, projected through its head chunk by chunk beside the
student's (:func:`nanogrpo.algo.distill.full_divergence`; TRL's ``_chunked_divergence_loss`` does the same
with its kernel).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from nanogrpo.algo.heads import LogitMap, logit_map
from nanogrpo.algo.logprobs import LeanHead, acc_dtype, position_ids_from_mask
from nanogrpo.batch import RolloutBatch
from nanogrpo.errors import ModelError

log = logging.getLogger("nanogrpo.distill")

PROBE = "<think>12+34=46</think><answer>46</answer> The answer is 1,234.5; x^2 - 3y = 7 (ok?)"
"""Text both tokenizers encode in the vocabulary check (a server teacher's through its ``/tokenize``)."""


def vocabulary_error(student_tok, teacher_tok, where: str) -> str | None:
    """One line when the two tokenizers do not give tokens the same ids (None: they do)."""
    s, t = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s == t:
        return None
    differ = sorted(k for k in s.keys() | t.keys() if s.get(k) != t.get(k))
    k = differ[0]
    return (f"the teacher {where} has another vocabulary than the student's: {len(differ)} of "
            f"{len(s.keys() | t.keys())} tokens differ (e.g. {k!r} is id {s.get(k)} for the student, "
            f"{t.get(k)} for the teacher); distillation compares the two models' probabilities of the same "
            "token ids: use a teacher with the student's tokenizer")


class LocalTeacher:
    """A frozen HF model scoring the student's tokens (``distill.teacher`` = a path, hub id or demo model)."""

    remote = False

    def __init__(self, model: torch.nn.Module, tokenizer, name: str, rows: int | None = None):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.rows = rows
        """The student's head rows: the top-k is taken among the ids below (a teacher head padded past the
        student's, Qwen2.5-7B's 152,064 rows against 1.5B's 151,936, never offers an id the student lacks;
        the log-probs stay normalised over the teacher's whole head). None: the teacher's head."""
        self.model.eval().requires_grad_(False)

    @classmethod
    def load(cls, path: str, student_tok, dtype: torch.dtype, device: torch.device, attn: str = "sdpa",
             trust_remote_code: bool = False, cpu_linear: str = "auto") -> LocalTeacher:
        """Load ``path`` on ``device`` and check its tokenizer against the student's (one-line ModelError;
        ``student_tok`` None: no check, ``nanogrpo serve --teacher``, whose clients check it)."""
        from nanogrpo.models.load import load_model, load_tokenizer, resolve_model_path

        where = resolve_model_path(path)
        tok = load_tokenizer(where, trust_remote_code)
        err = None if student_tok is None else vocabulary_error(student_tok, tok, path)
        if err:
            raise ModelError(err)
        model = load_model(where, dtype, device, attn, trust_remote_code, cpu_linear)
        log.info("distillation teacher %s loaded on %s", path, device)
        return cls(model, tok, path)

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None, LogitMap]:
        """The teacher's output head: weight (V, H), bias or None, and what its forward does to the head's
        output (:class:`~nanogrpo.algo.heads.LogitMap`: Cohere's and Granite's scales, Gemma's soft cap;
        the identity for a plain head). A one-line ModelError when its logits are not known to be such a
        function of its last hidden state (a family of neither
        :data:`~nanogrpo.algo.heads.PLAIN_HEAD_TYPES` nor :data:`~nanogrpo.algo.heads.LOGIT_MAPS`)."""
        fmap = logit_map(self.model)
        h = self.model.get_output_embeddings() if fmap is not None else None
        if not (isinstance(h, LeanHead) or type(h) is torch.nn.Linear):  # (not a quantised Linear subclass)
            mtype = getattr(getattr(self.model, "config", None), "model_type", "?")
            raise ModelError(f"the teacher {self.name} ({mtype}) is not a family whose logits nanogrpo "
                             "computes from its last hidden state (a linear head, then the family's scale or "
                             "soft cap), which distill.signal=jsd projects chunk by chunk: use "
                             "distill.signal=sampled")
        return h.weight, h.bias, fmap

    def check_vocab_size(self, student: torch.nn.Module) -> None:
        """jsd over the whole vocabulary: the two heads must have as many outputs (TRL's check)."""
        n_s = student.get_output_embeddings().weight.shape[0]
        n_t = self.head()[0].shape[0]
        if n_s != n_t:
            raise ModelError(f"the teacher {self.name}'s head has {n_t} outputs, the student's {n_s}: jsd "
                             "over the whole vocabulary compares every token's probability; set "
                             "distill.top_k (e.g. 20) to compare on the teacher's top-k")

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor, am: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """(n, C) rows' last hidden states (n, C, H) at the positions that predict the completion tokens
        ``ids[:, prompt_len:]``."""
        pos = position_ids_from_mask(am)
        out = self.model.base_model(input_ids=ids[:, :-1], attention_mask=am[:, :-1],
                                    position_ids=pos[:, :-1], use_cache=False)
        return out.last_hidden_state[:, prompt_len - 1:]                    # (n, C, H)

    @torch.no_grad()
    def score(self, batch: RolloutBatch, train, share_prefix: bool, temperature: float,
              support: tuple[int, float] | None, top_k: int) -> dict[str, torch.Tensor]:
        """The batch's teacher tensors (:class:`~nanogrpo.batch.RolloutBatch` fields): ``teacher_logprobs``
        (N, C) of the sampled tokens at ``temperature`` (over ``support``), and with ``top_k`` > 0
        ``teacher_topk_logprobs`` / ``teacher_topk_ids`` (N, C, K) of ``logits / temperature``."""
        from nanogrpo.training.step import batch_logprobs

        if top_k == 0:
            lp = batch_logprobs(self.model, batch, train, share_prefix, temperature, support=support)[0]
            return {"teacher_logprobs": lp.float() * batch.trained_mask}
        return self._topk(batch, train, temperature, top_k)

    def _topk(self, batch: RolloutBatch, train, temperature: float, k: int) -> dict[str, torch.Tensor]:
        from nanogrpo.training.micro import micro_batch_indices, trim_rows

        w, b, fmap = self.head()
        n, c = batch.completion_mask.shape
        lp = torch.zeros(n, c, dtype=torch.float32, device=batch.input_ids.device)
        top = torch.zeros(n, c, k, dtype=torch.float32, device=lp.device)
        ids_out = torch.zeros(n, c, k, dtype=torch.int64, device=lp.device)
        mask = batch.trained_mask
        for rows in micro_batch_indices(batch, train.micro_batch_size, train.micro_batch_tokens):
            ids, am, p, lm, _, _, _ = trim_rows(batch, rows, mask)
            h = self.hidden(ids, am, p)                                     # (r, c', H)
            sel = lm.bool()                                                 # (r, c')
            hs, tg = h[sel], ids[:, p:][sel]                                # (T, H), (T,)
            vals, idx, own = [], [], []
            for i in range(0, hs.shape[0], train.logprob_chunk):
                z = F.linear(hs[i:i + train.logprob_chunk], w, b).to(acc_dtype(w.dtype))  # (t, V)
                z = fmap(z) / temperature                                   # (t, V) the teacher's logits / T
                z = z.log_softmax(-1)
                kept = z[:, :self.rows]                                     # (t, V') ids the student has
                if k > kept.shape[-1]:
                    raise ModelError(f"distill.top_k={k} exceeds the vocabulary of {kept.shape[-1]}")
                v, j = kept.topk(k, -1)                                     # (t, k)
                vals.append(v.float())
                idx.append(j)
                own.append(z.gather(-1, tg[i:i + train.logprob_chunk, None]).squeeze(-1).float())
            cc = sel.shape[1]
            sub = torch.zeros(sel.shape, dtype=torch.float32, device=lp.device)
            lp[rows, :cc] = sub.masked_scatter(sel, torch.cat(own)) if own else sub
            t3 = torch.zeros(*sel.shape, k, dtype=torch.float32, device=lp.device)
            i3 = torch.zeros(*sel.shape, k, dtype=torch.int64, device=lp.device)
            if vals:
                t3[sel], i3[sel] = torch.cat(vals), torch.cat(idx)
            top[rows, :cc], ids_out[rows, :cc] = t3, i3
        return {"teacher_logprobs": lp, "teacher_topk_logprobs": top, "teacher_topk_ids": ids_out}

    @torch.no_grad()
    def prompt_logprobs(self, seqs: list[list[int]], temperature: float, k: int, rows: int = 8,
                        chunk: int = 1024) -> list[tuple[torch.Tensor, ...]]:
        """Per sequence, for each of its tokens after the first: (log-prob (L-1,), its rank (L-1,) int,
        the top-k log-probs (L-1, k) and ids (L-1, k)) under ``logits / temperature`` (what a vLLM server's
        ``prompt_logprobs`` hold; ``nanogrpo serve --teacher`` answers with it). ``rows`` sequences per
        forward, ``chunk`` positions per head projection."""
        w, b, fmap = self.head()
        dev = w.device
        out = []
        for a in range(0, len(seqs), rows):
            part = seqs[a:a + rows]
            n = max(len(s) for s in part)
            ids = torch.zeros(len(part), n, dtype=torch.long, device=dev)
            am = torch.zeros_like(ids)
            for i, s in enumerate(part):  # left-padded, as the trainer's batches
                ids[i, n - len(s):], am[i, n - len(s):] = torch.tensor(s, device=dev), 1
            h = self.hidden(ids, am, 1)                                     # (r, n - 1, H)
            for i, s in enumerate(part):
                hs, tg = h[i, n - len(s):], ids[i, n - len(s) + 1:]         # (L - 1, H), (L - 1,)
                lp, rk, tv, ti = [], [], [], []
                for j in range(0, hs.shape[0], chunk):
                    z = F.linear(hs[j:j + chunk], w, b).to(acc_dtype(w.dtype))  # (c, V) the head's
                    z = (fmap(z) / temperature).log_softmax(-1)             # (c, V)
                    own = z.gather(-1, tg[j:j + chunk, None])                # (c, 1)
                    lp.append(own.squeeze(-1).float())
                    rk.append((z > own).sum(-1) + 1)
                    v, t = z.topk(min(k, z.shape[-1]), -1) if k else (z[:, :0], z[:, :0].long())
                    tv.append(v.float())
                    ti.append(t)
                out.append(tuple(torch.cat(x).cpu() for x in (lp, rk, tv, ti)))
        return out
