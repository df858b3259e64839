"""Numbers written in words, read exactly: "forty-two", "one hundred and five", "a dozen", "half a
dozen", "none", "one and a half", fractions ("two thirds", "a quarter", "three and two fifths"), with
their signs ("negative five", "minus five" but not "ten minus five", "five below zero").
:func:`nanogrpo.grading.numbers.find_number_words` gives them as numbers.

A phrase is at most 12 words; every pattern is bounded.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["word_numbers", "DENOMS", "AMBIGUOUS_DENOMS", "BELOW_ZERO_RE", "NEG_WORD_RE"]

Found = tuple[int, int, tuple[Fraction, ...]]
"""A number in words: ``(start, end, values)`` (``text[start:end]``, its values, the first the usual one)."""

_GAP, _GAP1 = r"[ \t]{0,2}", r"[ \t]{1,2}"
BELOW_ZERO_RE = re.compile(r"(?:" + _GAP1 + r"degrees?)?(?:" + _GAP + r"°(?:" + _GAP + r"[CF])?)?" + _GAP1 +
                           r"below" + _GAP1 + r"(?:zero|0)\b", re.IGNORECASE)
"""A sign after a number: "five below zero", "4 degrees below zero"."""
NEG_WORD_RE = re.compile(r"(?:negative|minus)\s+$", re.IGNORECASE)
"""A sign in words before a number: "negative", "minus"."""

_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2)
         for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_BIG = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_WORDS = {**_UNITS, **_TENS, **_BIG, "hundred": 100, "dozen": 12, "none": 0, "half": 0, "a": 0, "an": 0,
          "and": 0}
_WORD_RE = re.compile(r"[A-Za-z]+")
_MAX_PHRASE = 12
_DENOM_ROOTS = {"half": 2, "third": 3, "quarter": 4, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7,
                "eighth": 8, "ninth": 9, "tenth": 10, "twelfth": 12, "hundredth": 100, "thousandth": 1000}
DENOMS = {**_DENOM_ROOTS, **{w + "s": d for w, d in _DENOM_ROOTS.items() if w != "half"}, "halves": 2}
AMBIGUOUS_DENOMS = frozenset({"quarter", "quarters"})
"""Also coins: "three quarters" is 3/4 or 3 (both readings kept)."""


def _fraction_value(words: list[str]) -> tuple[Fraction, ...] | None:
    """The value of a fraction in words ending with its denominator: "two thirds", "a quarter", "one
    half", "three and one fifth", "a dozen and a half"; None when it is none: a singular denominator
    needs a numerator of one ("twenty-fifth" is an ordinal), a plural one a numerator above one."""
    den_word = words[-1]
    den = DENOMS[den_word]
    body = words[:-1]
    cut = max((i for i, w in enumerate(body) if w == "and"), default=-1)
    whole_words, num_words = (body[:cut], body[cut + 1:]) if cut >= 0 else ([], body)
    if not num_words:
        return None
    num = Fraction(1) if num_words in (["a"], ["an"], ["one"]) else _phrase_value(num_words)
    if num is None or num.denominator != 1 or num < 1 or (num == 1) == den_word.endswith("s"):
        return None
    whole = _phrase_value(whole_words) if whole_words else Fraction(0)
    if whole is None:
        return None
    value = whole + num / den
    return (value, whole + num) if den_word in AMBIGUOUS_DENOMS and not whole_words else (value,)


def _phrase_value(words: list[str]) -> Fraction | None:
    """Value of a run of number words, or None when it is not a number ("a", "and", "half" alone...)."""
    while words and words[-1] in ("a", "an", "and"):
        words = words[:-1]
    while words and words[0] == "and":
        words = words[1:]
    if not words or all(w in ("a", "an", "and") for w in words):
        return None
    if len(words) > _MAX_PHRASE:
        return None
    total, current = Fraction(0), Fraction(0)
    seen = False
    i = 0
    while i < len(words):
        w = words[i]
        nxt = words[i + 1] if i + 1 < len(words) else None
        if w in ("a", "an"):
            if nxt in ("dozen", "hundred", "thousand", "million", "billion", "trillion"):
                current += 1
            elif nxt == "half":
                current += Fraction(1, 2)
                i += 1
            seen = seen or nxt is not None
        elif w == "half":
            if nxt in ("a", "an") and i + 2 < len(words) and words[i + 2] == "dozen":
                current, i = current + 6, i + 2
            else:
                current += Fraction(1, 2)
        elif w == "and":
            pass
        elif w == "none" or w in _UNITS or w in _TENS:
            current += 0 if w == "none" else _WORDS[w]
        elif w == "hundred":
            current = (current or 1) * 100
        elif w == "dozen":
            current = (current or 1) * 12
        else:  # thousand, million...
            total += (current or 1) * _BIG[w]
            current = Fraction(0)
        seen = True
        i += 1
    return total + current if seen else None


def word_numbers(text: str) -> list[Found]:
    """Numbers written in words, in order, as ``(start, end, values)``: "forty-two", "one hundred and
    five", "a dozen", "none", "two thirds", "negative five", "five below zero"."""
    out: list[Found] = []
    run: list[tuple[str, int, int]] = []

    def flush() -> None:
        if run:
            words = [w for w, _, _ in run]
            # a leading "a"/"and" belongs to the phrase only before a scale word ("a dozen") or a
            # denominator ("a third")
            while words and words[0] in ("a", "an", "and") and not (
                    len(words) > 1 and (words[1] in ("dozen", "hundred", "thousand", "million")
                                        or words[1] in DENOMS)):
                words, run[:] = words[1:], run[1:]
            values = _fraction_value(words) if len(words) > 1 and words[-1] in DENOMS else None
            if values is None and words and words[-1] in DENOMS and words[-1] != "half":
                words, run[:] = words[:-1], run[:-1]  # "twenty-fifth": the denominator is no part of it
            if values is None:
                value = _phrase_value(words) if words else None
                values = (value,) if value is not None else None
            if values is not None and run:
                out.append(_signed_words(text, run[0][1], run[-1][2], values, out))
            run.clear()

    prev_end = -1
    for m in _WORD_RE.finditer(text):
        if out and not run and m.start() < out[-1][1]:
            continue  # "zero" of "five below zero"
        w = m.group(0).lower()
        if w in DENOMS and w != "half" and run and _only_separators(text, prev_end, m.start()) \
                and not text.startswith("-", m.end()):  # "fourth-graders" are no fourths
            run.append((w, m.start(), m.end()))
            flush()  # a denominator ends the phrase
        elif w in _WORDS and (not run or _only_separators(text, prev_end, m.start())):
            run.append((w, m.start(), m.end()))
        else:
            flush()
            if w in _WORDS:
                run.append((w, m.start(), m.end()))
        prev_end = m.end()
    flush()
    return out


def _signed_words(text: str, start: int, end: int, values: tuple[Fraction, ...],
                  before: list[Found]) -> Found:
    """The number in words at ``text[start:end]`` with its sign: "negative five", "minus five" (not
    "ten minus five"), "five below zero"."""
    negative = False
    m = NEG_WORD_RE.search(text, max(0, start - 12), start)
    if m is not None:
        prev = text[max(0, m.start() - 8):m.start()].rstrip()
        subtracts = m.group(0)[0] in "mM" and (
            (prev and prev[-1].isdigit()) or (before and before[-1][1] >= m.start() - 2))
        if not subtracts:
            start, negative = m.start(), True
    below = BELOW_ZERO_RE.match(text, end)
    if below is not None:
        end, negative = below.end(), not negative
    return start, end, tuple(-v for v in values) if negative else values


def _only_separators(text: str, a: int, b: int) -> bool:
    gap = text[a:b]
    return len(gap) <= 3 and all(c in " -\n\t" for c in gap)
