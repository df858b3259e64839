"""Answers of other forms than a number or an expression: multiple-choice letters (:func:`choice`,
:func:`choices`), word answers (:func:`words`), numbers in a base (:func:`base_number`), clock times
(:func:`clock`, :func:`same_time`), inequalities as intervals (:func:`as_interval`), and the delimited math
inside a sentence (:func:`math_segments`).

Every pattern is bounded; none can backtrack without bound.
"""

from __future__ import annotations

import re

from nanogrpo.grading.latex import _BOX_RE, _DELIMS_RE, _unwrap

__all__ = ["choice", "choices", "words", "base_number", "clock", "clocks_in", "same_time", "as_interval",
           "is_interval", "math_segments", "math_segment_matches", "MATH_SEGMENT_RE"]

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


_CLOCK_RE = re.compile(r"(?<![\d:.])([01]?\d|2[0-3])(?:\s{0,2}:\s{0,2}([0-5]\d))?"
                       r"(?:\s{0,3}(?:([AaPp])\.?\s{0,2}[Mm]\b\.?|o'clock\b))?(?![\d:])")
_CLOCK_MARKUP_RE = re.compile(r"\\(?:text|mathrm|mbox|textrm|textbf)\s{0,2}\{|\\[ ,;]|[{}$*`]")


def clock(text: str) -> tuple[int, int, str | None] | None:
    """``(hour, minute, "am" | "pm" | None)`` of an answer that is a time of day (``8:30 PM``, ``8:30pm``,
    ``8 p.m.``, ``\\text{8:30 a.m.}``, ``20:30``, ``7 o'clock``), or None. An hour without minutes needs
    its a.m./p.m. or o'clock (``8`` is a number), and a 12-hour suffix needs an hour from 1 to 12."""
    t = " ".join(_CLOCK_MARKUP_RE.sub(" ", text).split()).rstrip(".").strip()
    m = _CLOCK_RE.fullmatch(t)
    if m is None:
        return None
    hour, minute, half = int(m.group(1)), m.group(2), m.group(3)
    suffix = None if half is None else ("am" if half in "Aa" else "pm")
    if minute is None and half is None and "o'clock" not in t:
        return None
    if suffix is not None and not 1 <= hour <= 12:
        return None
    return hour, int(minute or 0), suffix


def clocks_in(text: str) -> list[tuple[int, int, str | None]]:
    """The clock times written in a sentence ("She gets home at 8:30 p.m."), in order: those with
    minutes or with a.m./p.m. (a bare number is no time)."""
    t = _CLOCK_MARKUP_RE.sub(" ", text)
    out = []
    for m in _CLOCK_RE.finditer(t):
        if m.group(2) is not None or m.group(3) is not None:
            found = clock(m.group(0))
            if found is not None:
                out.append(found)
    return out


def _minutes(hour: int, minute: int, suffix: str) -> int:
    return (hour % 12 + (12 if suffix == "pm" else 0)) * 60 + minute


def same_time(a: tuple[int, int, str | None], b: tuple[int, int, str | None]) -> bool:
    """Whether two clock times (:func:`clock`) are the same time of day: with a.m./p.m. on both, exactly;
    with it on one side only, the other read on a 24-hour clock (``20:30`` = ``8:30 PM``) or, for an
    hour from 1 to 12, on the 12-hour clock (``8:30`` = ``8:30 PM``: the question says which half)."""
    if a[2] is None:
        a, b = b, a
    if a[2] is None:  # neither says which half of the day: as written (the caller's plain comparison)
        return a[:2] == b[:2]
    mine = _minutes(*a)
    if b[2] is not None:
        return mine == _minutes(*b)
    return b[0] * 60 + b[1] == mine or (1 <= b[0] <= 12 and (b[0] % 12) * 60 + b[1] == mine % 720)


_REL_RE = re.compile(r"(<=?|>=?|≤|≥|\\[lg]e(?:q(?:slant)?)?(?![A-Za-z]))")
_INTERVAL_RE = re.compile(r"^\s*[\[(][^\[\]()]{0,80}(?:\([^()]{0,40}\)[^\[\]()]{0,40})*,.{0,80}[\])]\s*$")


def _less(rel: str) -> tuple[bool, bool]:
    """``(points left to right, strict)`` of a relation: ``<`` is (True, True), ``\\geq`` (False, False)."""
    return rel.startswith("<") or rel in ("≤",) or rel.startswith("\\l"), rel in ("<", ">")


def _operand(text: str) -> bool:
    """Whether ``text`` can be one side of an inequality: math, no words, no list, no equation."""
    bare = re.sub(r"\\[A-Za-z]+", " ", text)
    return bool(text) and len(text) <= 80 and not re.search(r"[A-Za-z]{2,}|[,=;:?!]", bare)


def as_interval(text: str) -> str | None:
    """An inequality in one variable as the interval it describes, in LaTeX: ``2 \\le x < 5`` ->
    ``[2, 5)``, ``x > 3`` and ``3 < x`` -> ``(3, \\infty)``, ``5 \\ge x \\ge 2`` -> ``[2, 5]``; None for
    anything else (two variables, relations pointing both ways, no variable)."""
    if len(text) > 200:
        return None
    parts = [p.strip() for p in _REL_RE.split(text.strip().rstrip("."))]
    if not all(_operand(p) for p in parts[::2]):
        return None  # "The solution set is 2 \\le x \\le 5": a sentence, not an inequality
    var = re.compile(r"[A-Za-z]")
    if len(parts) == 5 and var.fullmatch(parts[2]) and parts[0] and parts[4]:
        (l1, s1), (l2, s2) = _less(parts[1]), _less(parts[3])
        if l1 != l2:
            return None
        lo, hi, s_lo, s_hi = (parts[0], parts[4], s1, s2) if l1 else (parts[4], parts[0], s2, s1)
        return ("(" if s_lo else "[") + lo + ", " + hi + (")" if s_hi else "]")
    if len(parts) == 3 and parts[0] and parts[2]:
        if var.fullmatch(parts[0]) and not var.fullmatch(parts[2]):
            less, strict = _less(parts[1])
            bound = parts[2]
        elif var.fullmatch(parts[2]) and not var.fullmatch(parts[0]):
            less, strict = _less(parts[1])
            less, bound = not less, parts[0]  # "3 < x" is "x > 3"
        else:
            return None
        if less:
            return "(-\\infty, " + bound + (")" if strict else "]")
        return ("(" if strict else "[") + bound + ", \\infty)"
    return None


def is_interval(latex: str) -> bool:
    """Whether ``latex`` is one interval: ``[2, 5)``, ``(-\\infty, 3]``."""
    return len(latex) <= 200 and _INTERVAL_RE.match(latex) is not None and "\\cup" not in latex


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
