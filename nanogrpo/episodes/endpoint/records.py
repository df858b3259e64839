"""What the endpoint records: per episode (one key), every request's exact token ids.

A request's prompt is built from token ids already known wherever it can be: when the text a
request renders (its chat messages through the chat template, or its completion prompt) starts
with the text of an earlier request of the same episode *as sampled* (that request's prompt text
followed by the decoded tokens it sampled), the ids of that earlier request (prompt + sampled) are
reused as they are and only the rest of the text is tokenised. So an agent that sends its history
back unchanged reads exactly the tokens the model sampled (never re-tokenised), and the trajectory
assembled from the records (:mod:`nanogrpo.episodes.trajectory`) is one sequence. A program that
rewrites its history (drops a turn, edits a message, re-renders a tool call differently) gets a
fresh tokenisation, and its trajectory splits there: said in the metrics, never a silent mismatch.

**Sessions** (the token route, ``/inference/v1/generate``): a client shared by many episodes (verifiers'
train client, one per run) cannot carry a key per episode. It sends the endpoint's session key and
names its episode in the ``X-Session-ID`` header instead; while sessions are open (a rollout), the first
request of a session opens its log, with the same budget and limits as a keyed episode. The rollout
takes the logs of the sessions its episodes claim (:meth:`OpenEpisodes.close_session`) and closes the rest
when it ends (:meth:`OpenEpisodes.close_sessions`); a closed session's later requests are refused.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

REMEMBERED = 1 << 16
"""Closed session ids remembered (their stragglers refused); older ones are forgotten."""


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


class OpenEpisodes:
    """The open episodes by key, thread-safe (the HTTP thread records, the rollout reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, EpisodeLog] = {}
        self.session_key = "ngs-" + secrets.token_urlsafe(24)
        """The key of the token route's sessions (the module docstring)."""
        self._sessions: dict[str, EpisodeLog] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._session_budget: int | None = None
        """Sessions are open (a rollout runs) when set: each new one may sample this many tokens."""

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
        self.close_sessions()

    # ------------------------------------------------------------------ sessions

    def open_sessions(self, budget: int) -> None:
        """Accept new sessions, each with a budget of ``budget`` tokens, until :meth:`close_sessions`."""
        with self._lock:
            self._session_budget = budget

    def session(self, sid: str) -> EpisodeLog | None:
        """The log of session ``sid``, opened on its first request; None when sessions are closed or
        this one was closed."""
        with self._lock:
            log = self._sessions.get(sid)
            if log is None and self._session_budget is not None and sid not in self._closed:
                log = self._sessions[sid] = EpisodeLog(sid, budget=self._session_budget)
            return log

    def close_session(self, sid: str) -> EpisodeLog | None:
        """Session ``sid``'s log (None if it made no request); its later requests are refused."""
        with self._lock:
            self._forget(sid)
            log = self._sessions.pop(sid, None)
            if log is not None:
                log.closed = True
            return log

    def close_sessions(self) -> list[EpisodeLog]:
        """Stop accepting sessions; the logs of those still open (no episode claimed them), closed."""
        with self._lock:
            self._session_budget = None
            logs = list(self._sessions.values())
            self._sessions.clear()
            for log in logs:
                log.closed = True
                self._forget(log.key)
            return logs

    def _forget(self, sid: str) -> None:
        self._closed[sid] = None
        while len(self._closed) > REMEMBERED:
            self._closed.popitem(last=False)

    # ------------------------------------------------------------------ limits

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
    tokens left times ``per_token``, :func:`~nanogrpo.episodes.render.token_bytes`) raises
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
