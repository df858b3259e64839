"""What the endpoint records: per episode (one key), every request's exact token ids.

A request's prompt is built from token ids already known wherever it can be: when the text a
request renders (its chat messages through the chat template, or its completion prompt) starts
with the text of an earlier request of the same episode *as sampled* (that request's prompt text
followed by the decoded tokens it sampled), the ids of that earlier request (prompt + sampled) are
reused as they are and only the rest of the text is tokenised. So an agent that sends its history
back unchanged reads exactly the tokens the model sampled (never re-tokenised), and the trajectory
assembled from the records (:mod:`nanogrpo.rollout.trajectory`) is one sequence. A program that
rewrites its history (drops a turn, edits a message, re-renders a tool call differently) gets a
fresh tokenisation, and its trajectory splits there: said in the metrics, never a silent mismatch.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field


@dataclass
class Record:
    """One request of an episode, as the engine saw it and answered it."""

    index: int
    """The request's order in its episode (0, 1, ...)."""
    kind: str
    """``"chat"`` (``/v1/chat/completions``) or ``"completions"`` (``/v1/completions``)."""
    prompt_ids: list[int]
    """The prompt's token ids exactly as the engine read them."""
    completion_ids: list[int]
    """The sampled tokens (an EOS included when the model emitted one)."""
    logprobs: list[float]
    """The engine's log-probs of ``completion_ids`` (the run's convention, ``rollout.tempered_logprobs``)."""
    finish_reason: str
    """The engine's: ``stop`` (EOS), ``stop_string`` (one of the request's ``stop``), ``length``."""
    reused: int
    """How many of ``prompt_ids`` were an earlier request's ids taken as they were (0: tokenised anew)."""
    text: str = field(repr=False, default="")
    """Prompt text + the decoded sampled tokens (special tokens kept): what a later request's text is
    matched against for reuse."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


@dataclass
class EpisodeLog:
    """The requests of one episode (one key), in the order the engine answered them."""

    key: str
    records: list[Record] = field(default_factory=list)
    refused: int = 0
    """Requests refused for a limit (turns, context length) or as malformed."""
    limit: str | None = None
    """The first limit a request hit (``max_turns``, ``context``), None if none."""
    pending: int = 0
    """Requests admitted, not yet answered."""
    budget: int = 0
    """Tokens the episode may still sample (granted to requests as they are admitted)."""
    closed: bool = False


class Episodes:
    """The open episodes by key, thread-safe (the HTTP thread records, the rollout reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, EpisodeLog] = {}

    def open(self, budget: int) -> str:
        """A new episode that may sample ``budget`` tokens over all its requests; its key."""
        key = "ng-" + secrets.token_urlsafe(24)
        with self._lock:
            self._open[key] = EpisodeLog(key, budget=budget)
        return key

    def get(self, key: str | None) -> EpisodeLog | None:
        if not key:
            return None
        with self._lock:
            return self._open.get(key)

    def close(self, key: str) -> EpisodeLog:
        """The episode's log; its key is refused from now on."""
        with self._lock:
            log = self._open.pop(key)
            log.closed = True
            return log

    def close_all(self) -> None:
        with self._lock:
            for log in self._open.values():
                log.closed = True
            self._open.clear()

    def reserve(self, log: EpisodeLog, max_turns: int, want: int) -> int | str:
        """Admit one more request of ``log`` and grant it up to ``want`` tokens of the episode's budget:
        the tokens granted, or the limit it hits (``"max_turns"``: answered and pending requests;
        ``"length"``: no token left)."""
        with self._lock:
            if log.closed or len(log.records) + log.pending >= max_turns:
                return "max_turns"
            granted = min(want, log.budget)
            if granted < 1:
                return "length"
            log.pending += 1
            log.budget -= granted
            return granted

    def add(self, log: EpisodeLog, rec: Record | None, granted: int) -> None:
        """Settle a reserved request: its record (None: it failed); unsampled tokens go back to the budget."""
        with self._lock:
            log.pending -= 1
            log.budget += granted - (len(rec.completion_ids) if rec is not None else 0)
            if rec is not None and not log.closed:
                rec.index = len(log.records)
                log.records.append(rec)

    def refuse(self, log: EpisodeLog, limit: str | None = None) -> None:
        with self._lock:
            log.refused += 1
            if limit is not None and log.limit is None:
                log.limit = limit


class TooLong(ValueError):
    """A request's new text holds more bytes than the tokens left in the context can hold: refused
    without tokenising it."""


def encode_with_reuse(tokenizer, text: str, earlier: list[Record], max_len: int | None = None,
                      per_token: int = 1) -> tuple[list[int], int]:
    """Token ids of ``text``: the ids of the longest earlier record whose sampled text ``text`` starts
    with, then the rest tokenised on its own; ``(ids, reused)``. No such record: all of it tokenised.
    ``max_len``: the context's length in tokens; text the rest of it cannot hold (more bytes than the
    tokens left times ``per_token``, :func:`~nanogrpo.rollout.render.token_bytes`) raises
    :class:`TooLong` before any of it is tokenised."""
    from nanogrpo.envs.base import text_bytes

    best = None
    for rec in earlier:
        if rec.text and text.startswith(rec.text) and (best is None or len(rec.text) > len(best.text)):
            best = rec
    head = best.ids if best is not None else []
    rest = text[len(best.text):] if best is not None else text
    if max_len is not None:
        cap = max(max_len - len(head), 0) * per_token
        size = text_bytes(rest, cap)
        if size > cap:
            raise TooLong(f"the prompt's text is {'at least ' if size > cap + 1 else ''}{size} bytes; this "
                          f"run's context holds {max_len} tokens (at most {max_len * per_token} bytes of "
                          "text with this tokenizer)")
    return head + encode(tokenizer, rest), len(head)


def encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
