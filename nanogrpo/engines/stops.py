"""Stop strings at the token level: where, in a stream of sampled token ids, a string first appears.

A stop string (``</code>``, ``</tool_call>``) is text, but generation emits tokens, and the two do
not line up: ``</code>`` may take three tokens, or end inside a token that carries more text
(a BPE merge such as ``>\\n``). The rule here is the one that keeps training exact: **a turn ends
at the first token k such that the decoded text of tokens[:k] contains a stop string; token k is
kept whole**, overhang included. The tokens are never re-tokenised: what the model sampled is what
the trainer sees, and the caller finds the stop string in the text.

Decoding is ``tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)``,
so a stop string may be a special token's text. Checking every prefix is quadratic, so a token is
only examined when its own text holds the last character of some stop string (a token cannot
complete a stop string otherwise); that shortcut is exact for stop strings that end in an ASCII
character (a multi-byte character can be completed by a token that decodes to nothing by itself),
and it is switched off, every token examined, when one does not.

:meth:`StopStrings.find` is the reference (one call per finished sequence);
:class:`StopScanner` does the same one token at a time, for engines that stop while they sample.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """A set of stop strings bound to a tokenizer. Empty is allowed (it never stops)."""

    def __init__(self, tokenizer, strings: Sequence[str]):
        strings = tuple(dict.fromkeys(strings))
        if any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop strings must be non-empty text, got {strings!r}")
        if strings and tokenizer is None:
            raise ValueError("stop strings need the tokenizer (to decode sampled tokens)")
        self.tokenizer = tokenizer
        self.strings = strings
        self._last = {s[-1] for s in strings}
        self._every_token = any(ord(ch) > 127 for ch in self._last)
        self._may_end: dict[int, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.strings)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def may_end(self, token: int) -> bool:
        """Whether ``token`` can be the one that completes a stop string (cached per id)."""
        if self._every_token:
            return True
        hit = self._may_end.get(token)
        if hit is None:
            text = self.decode([token])
            hit = self._may_end[token] = any(ch in text for ch in self._last)
        return hit

    def matched(self, text: str) -> str | None:
        """The stop string found in ``text`` that starts first (None if none)."""
        found = [(text.find(s), s) for s in self.strings if s in text]
        return min(found)[1] if found else None

    def find(self, ids: Sequence[int]) -> int | None:
        """The length of the shortest prefix of ``ids`` whose text holds a stop string, or None."""
        if not self.strings:
            return None
        for k, tok in enumerate(ids):
            if self.may_end(tok) and self.matched(self.decode(ids[:k + 1])) is not None:
                return k + 1
        return None

    def scanner(self) -> StopScanner:
        return StopScanner(self)


class StopScanner:
    """Streaming :meth:`StopStrings.find`: feed sampled tokens one at a time; ``push`` returns True
    on the token that completes a stop string (the same token ``find`` would end at)."""

    def __init__(self, stops: StopStrings):
        self.stops = stops
        self.ids: list[int] = []
        self.stopped = False

    def push(self, token: int) -> bool:
        if self.stopped:
            return True
        self.ids.append(int(token))
        st = self.stops
        if st.strings and st.may_end(self.ids[-1]):
            self.stopped = st.matched(st.decode(self.ids)) is not None
        return self.stopped
