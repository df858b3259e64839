"""Where a completion's final answer is: the rules :mod:`~nanogrpo.grading.extract` (the value it
states) and :mod:`~nanogrpo.grading.latex` (the answer kept as written) share.

The first rule that applies:

1. the last complete ``<answer>…</answer>`` block; if a ``</think>`` follows it (a draft inside the
   think block), what comes after that ``</think>`` is looked at first;
2. without a complete block, the text after an unclosed ``<answer>``;
3. without tags, the whole completion (``past_think``: the text after the last ``</think>`` when any
   follows it; the reasoning's drafts are not the answer).

A base model that runs on into a new turn ("\\nQuestion: …", "\\nUser: …") after its answer is read up
to that turn. :func:`last_announcement` finds the last "the answer is" / "Answer:" / "####" of a text.
Every scan is a ``str.find`` or a pattern that cannot backtrack without bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["OPEN", "CLOSE", "THINK_CLOSE", "Region", "answer_region", "cut_new_turn", "last_announcement"]

OPEN, CLOSE, THINK_CLOSE = "<answer>", "</answer>", "</think>"

_NEW_TURN_RE = re.compile(r"\n[ \t>#*]{0,6}(?:Question|Problem|User|Human|Q|Instruction)[ \t*]{0,4}:"
                          r"|<\|im_start\|>|<\|user\|>|<\|start_header_id\|>")
_ANNOUNCE_RE = re.compile(
    r"\banswer\b(?:\s{1,3}to\s{1,3}(?:the|this)\s{1,3}(?:question|problem))?[ \t]{0,3}(?:\*\*[ \t]{0,3})?"
    r"(?:is\b|would\s{1,3}be\b|will\s{1,3}be\b|=|:)|####", re.IGNORECASE)


@dataclass(frozen=True)
class Region:
    """Where the final answer is (module docstring)."""

    text: str
    """The answer block's content, the text after an unclosed ``<answer>``, or (no tags) the completion."""
    tagged: bool
    """The answer is in ``<answer>`` tags (rules 1 and 2), not somewhere in the text (rule 3)."""
    after_think: str | None = None
    """Rule 1 only: the text after a ``</think>`` that follows the block, where a box or an announced
    answer wins over the block (a draft)."""


def answer_region(text: str, past_think: bool = False) -> Region:
    """Where the final answer of ``text`` is (module docstring)."""
    first_close = text.find(CLOSE)
    if first_close != -1 and text.rfind(OPEN, 0, first_close) != -1:
        text = cut_new_turn(text, first_close)
        close = text.rfind(CLOSE)
        start = text.rfind(OPEN, 0, close)
        think_end = text.rfind(THINK_CLOSE)
        after = text[think_end + len(THINK_CLOSE):] if think_end > close else None
        return Region(text[start + len(OPEN):close], True, after)
    open_at = text.rfind(OPEN)
    if open_at != -1:  # an answer tag never closed (cut off, or forgotten)
        return Region(text[open_at + len(OPEN):], True)
    if past_think:
        think_end = text.rfind(THINK_CLOSE)
        if think_end != -1 and text[think_end + len(THINK_CLOSE):].strip():
            text = text[think_end + len(THINK_CLOSE):]
    first_digit = next((i for i, c in enumerate(text[:2000]) if c.isdigit()), 0)
    return Region(cut_new_turn(text, first_digit), False)


def cut_new_turn(text: str, after: int) -> str:
    """``text`` up to a new turn a base model wrote after position ``after`` ("\\nQuestion: …")."""
    m = _NEW_TURN_RE.search(text, after)
    return text[:m.start()] if m is not None else text


def last_announcement(text: str) -> re.Match | None:
    """The last "answer is" / "Answer:" / "####" in ``text`` (looking back over at most 64 "answer"s)."""
    found = None
    pos = len(text)
    for _ in range(64):
        i = max(text.rfind("nswer", 0, pos), text.rfind("NSWER", 0, pos))
        if i < 1:
            break
        found = _ANNOUNCE_RE.match(text, i - 1)
        if found is not None:
            break
        pos = i
    hashes = text.rfind("####")
    if hashes != -1 and (found is None or hashes > found.start()):
        found = _ANNOUNCE_RE.match(text, hashes)
    return found
