"""Answers of other forms than a number or an expression: multiple-choice letters (:func:`choice`,
:func:`choices`), word answers (:func:`words`), numbers in a base (:func:`base_number`), and the delimited
math inside a sentence (:func:`math_segments`).

Every pattern is bounded; none can backtrack without bound.
"""

from __future__ import annotations

import re

from nanogrpo.rewards.latex import _BOX_RE, _DELIMS_RE, _unwrap

__all__ = ["choice", "choices", "words", "base_number", "math_segments", "math_segment_matches",
           "MATH_SEGMENT_RE"]

_TEXT_OPEN = r"(?:\\(?:text|textbf|mathrm|mathbf|mbox|textrm)\s{0,2}\{\s{0,2})?"
_CHOICE_RE = re.compile(r"^\s*" + _TEXT_OPEN + r"\(\s{0,2}([A-Ha-h])\s{0,2}\)"
                        r"|^\s*" + _TEXT_OPEN + r"([A-H])\s{0,2}\}?\s*(?:[.:)]|$)")
_LETTERS_RE = re.compile(r"^\(?([A-H])\)?(?:\s{0,3}(?:,|\band\b)\s{0,3}(?:\band\b\s{0,3})?"
                         r"\(?([A-H])\)?){1,7}$")


def _plain_letters(text: str) -> str:
    t = _DELIMS_RE.sub(" ", _unwrap(text, _BOX_RE)).replace("*", " ")
    t = re.sub(r"\\(?:text|textbf|mathrm|mathbf|mbox|textrm)\s{0,2}\{", " ", t).replace("}", " ")
    return " ".join(t.split()).rstrip(".")


def choice(text: str) -> str | None:
    """The multiple-choice letter ``text`` gives (``(B)``, ``B``, ``\\text{(B)}``, ``\\textbf{(B)} 12``),
    upper-cased, or None (also for several letters: :func:`choices`)."""
    t = " ".join(_DELIMS_RE.sub(" ", _unwrap(text, _BOX_RE)).replace("*", " ").split())
    if choices(t) is not None:
        return None
    m = _CHOICE_RE.match(t)
    if m is None:
        return None
    return (m.group(1) or m.group(2)).upper()


def choices(text: str) -> frozenset[str] | None:
    """The letters of a several-letter choice (``\\text{A, E}``, ``(B), (D)``, ``A and C``), or None."""
    t = _plain_letters(text)
    if _LETTERS_RE.match(t) is None:
        return None
    return frozenset(re.findall(r"[A-H]", t))


_WORD_TOKEN_RE = re.compile(r"[A-Za-z][A-Za-z'-]*[A-Za-z]")


def words(text: str) -> str | None:
    """``text`` as a word answer (``\\text{odd}``, ``Devon``, ``neither``, ``\\text{no solution}``),
    lower-cased; None unless it is one to four words of two letters or more (``p - q`` is no word)."""
    t = " ".join(_DELIMS_RE.sub(" ", _unwrap(text, _BOX_RE)).split())
    m = re.match(r"^\s*" + _TEXT_OPEN + r"([^{}\\$]{2,60}?)\s{0,2}\}?\s*\.?\s*$", t)
    if m is None:
        return None
    tokens = m.group(1).split()
    if not 1 <= len(tokens) <= 4 or not all(_WORD_TOKEN_RE.fullmatch(w) for w in tokens):
        return None
    return " ".join(tokens).lower()


_BASE_RE = re.compile(r"^\s*" + _TEXT_OPEN + r"([0-9A-Za-z]{1,40})\s{0,2}\}?\s{0,2}"
                      r"_\s{0,2}\{?\s{0,2}(\d{1,2})\s{0,2}\}?\s*$")


def base_number(text: str) -> tuple[str, int] | None:
    """``(digits, base)`` of a number written with its base: ``1011_2``, ``1011_{2}``, ``\\text{A3}_{16}``."""
    m = _BASE_RE.match(text)
    if m is None:
        return None
    return m.group(1).upper(), int(m.group(2))


MATH_SEGMENT_RE = re.compile(r"\$\$([^$]{1,400})\$\$|(?<![\\$])\$([^$\n]{1,400})(?<!\\)\$"
                             r"|\\\((.{1,400}?)\\\)|\\\[(.{1,400}?)\\\]", re.DOTALL)
"""Delimited math: ``$$…$$``, ``$…$``, ``\\(…\\)``, ``\\[…\\]`` (its content: the group that matched)."""


_PROSE_IN_MATH_RE = re.compile(r"(?<![A-Za-z\\])[A-Za-z]{2,}\s+[A-Za-z]{2,}(?![A-Za-z])")
_TEXT_CMD_RE = re.compile(r"\\(?:text|mbox|textrm|mathrm|textbf|operatorname)\s{0,2}\{[^{}]{0,60}\}"
                          r"|\\[A-Za-z]+")


def math_segment_matches(text: str) -> list[re.Match]:
    """The delimited math in ``text``, in order (:data:`MATH_SEGMENT_RE`), without what two dollar signs
    of prose enclose ("a profit of $60, a loss of $20": currency, not math)."""
    out = []
    for m in MATH_SEGMENT_RE.finditer(text):
        content = next(g for g in m.groups() if g is not None)
        if m.group(2) is not None and _PROSE_IN_MATH_RE.search(_TEXT_CMD_RE.sub(" ", content)):
            continue
        out.append(m)
    return out


def math_segments(text: str) -> list[str]:
    """The delimited math (``$…$``, ``$$…$$``, ``\\(…\\)``, ``\\[…\\]``) in ``text``, in order."""
    return [next(g for g in m.groups() if g is not None) for m in math_segment_matches(text)]
