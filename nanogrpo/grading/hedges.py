"""What makes a stated value no answer: a value offered with another ("42 or 56", ``36, 42``, "12 (or
13)"), the end of a range (``40-45``, "between 40 and 45", "6 to 7"), a negation ("not 42").

:func:`check_hedges` raises :class:`Hedged` for a number so offered; :func:`unnegated` drops the numbers a
"not" negates. Every pattern looks a bounded distance around the number and cannot backtrack without
bound.
"""

from __future__ import annotations

import re

from nanogrpo.grading.numbers import Num, find_numbers

__all__ = ["Hedged", "check_hedges", "unnegated"]


class Hedged(Exception):
    """The text names an answer but hedges it: no answer, and no looking elsewhere."""


_AFTER_ALT_RE = re.compile(r"[ \t]{0,3}(?:\([ \t]{0,2})?"
                           r"(?:(?P<list>,|;|\band\b)|/|\bor\b|\bto\b|-|~|\band/or\b)"
                           r"(?:[ \t]{1,3}(?:maybe|perhaps)\b)?[ \t$\\]{0,4}(?=[0-9])", re.IGNORECASE)
_LIST_END_RE = re.compile(r"[ \t]{0,3}(?:[A-Za-z]+[ \t]{0,3})?(?:$|[,;.)\n]|\b(?:and|or)\b)")
_CHANGE_RE = re.compile(r"\b(?:dropp?e?d?|drops|fell|falls|rose|rises|went|goes|increased?|decreased?|grew|"
                        r"grows|changed?|reduced?|cut|raised?|lowered?|moved?|climbed|sank)\b", re.IGNORECASE)
_BEFORE_ALT_RE = re.compile(r"(?:\b(?:between|either)\s+[$\\]*\s*"
                            r"|[0-9%]\s*(?:,|\bor|\bto|-|\band)\s*[$\\]*\s*)$", re.IGNORECASE)
_OR_NEAR_RE = re.compile(r"\b(?:or|and/or)\s+(?:maybe\s+|perhaps\s+|possibly\s+|even\s+)?[$\\]*\s*(?=[0-9])",
                         re.IGNORECASE)
_NEGATED_RE = re.compile(r"(?:\bnot|n't|\bnever)\s+(?:equal\s+to\s+|be\s+|exactly\s+)?[$\\]*\s*$",
                         re.IGNORECASE)


def check_hedges(text: str, n: Num) -> None:
    """Raise :class:`Hedged` when ``n`` comes with an alternative or is the end of a range."""
    alt = _AFTER_ALT_RE.match(text, n.end)
    if alt is not None:
        if alt.group("list") is None:
            raise Hedged  # "42 or 56", "40-45", "6 to 7"
        other = find_numbers(text[alt.end():alt.end() + 40])
        if other and _LIST_END_RE.match(text, alt.end() + other[0].end):
            raise Hedged  # "36, 42", "6 and 8" (not "$18, 9 eggs at $2 each")
    near = _OR_NEAR_RE.search(text, n.end, n.end + 60)
    if near is not None:
        other = find_numbers(text[near.end():near.end() + 40])
        if other and set(other[0].values).isdisjoint(n.values):
            raise Hedged
    window = text[max(0, n.start - 30):n.start]
    change = window.rstrip(" $\\").endswith("to") and _CHANGE_RE.search(text, 0, n.start)  # "fell to 20"
    if _BEFORE_ALT_RE.search(window) and not window.rstrip().endswith(("=", "is", ":")) and not change:
        raise Hedged


def unnegated(text: str, nums: list[Num]) -> list[Num]:
    """``nums`` without those a "not" / "n't" / "never" negates ("not 42")."""
    low = text.lower()
    if "not" not in low and "n't" not in low and "never" not in low:
        return nums
    return [n for n in nums if not _negated(text, n)]


def _negated(text: str, n: Num) -> bool:
    return _NEGATED_RE.search(text, max(0, n.start - 30), n.start) is not None
