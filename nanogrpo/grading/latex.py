"""The final answer of a completion as LaTeX, the way a competition grader reads it.

:func:`final_span` finds the final answer with the rules of :mod:`nanogrpo.grading.region` (where)
and :mod:`nanogrpo.grading.extract` (the last ``<answer>`` block, a box or an announcement in it or
after a ``</think>`` that follows it; without tags the later of the last ``\\boxed{}`` and the last
"the answer is …"), but keeps its text as written: no number is read out of ``\\frac{\\sqrt3}{2}``.
Boxes written in one sentence ("$x = \\boxed{-2}$ and $x = \\boxed{5}$") are one answer, a list.
Without tags, text after a ``</think>`` is where the answer is; the reasoning is read only when nothing
follows it.

:func:`clean` takes off what a grader ignores and keeps the rest of the LaTeX intact: math
delimiters, ``\\boxed``, ``\\left`` / ``\\right``, ``\\displaystyle``, ``\\dfrac`` / ``\\tfrac``
(as ``\\frac``), spacing (``\\,``, ``\\!``, ``~``), thousands separators (``1{,}000``, ``1,\\!000``),
degrees (``^\\circ``), ``\\$``, bold, units in ``\\text{}`` after a value, ``x \\in``, the
variable of ``x = 5`` / ``f(x) = 3x - 1`` (one variable for all solutions), "or" / "and" between
solutions (a list), a trailing period, a unit after a plain number however written (``72°F``,
``60 km/h``; :mod:`nanogrpo.grading.units`). :func:`plain_values` reads a plain number; answers of
other forms (letters, words, bases, math inside a sentence) are read by :mod:`nanogrpo.grading.forms`.

Every scan is bounded (:data:`WINDOW` characters around the answer, boxes of at most
:data:`MAX_BOX` characters), and no pattern can backtrack without bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from nanogrpo.grading.numbers import leading_number, normalize
from nanogrpo.grading.region import answer_region, last_announcement
from nanogrpo.grading.units import unit_end

__all__ = ["Span", "final_span", "clean", "plain_values", "split_top", "braced_end", "MATH_NAMES", "WINDOW",
           "MAX_BOX"]

WINDOW = 600
"""Characters read after an announcement, and of a region handed to math_verify."""
MAX_BOX = 1000
"""Characters scanned for a box's closing brace (a 3x3 matrix of fractions fits)."""


@dataclass(frozen=True)
class Span:
    """The final answer: ``text`` as written (a box's content, boxes of one sentence joined by ", ",
    an announced value, or an answer block); ``boxed`` when it came from boxes."""

    text: str
    boxed: bool = False


_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)\s{0,2}\{")
_HEADER_RE = re.compile(r"(?:^|\n)[ \t>]{0,4}(?:#{1,4}[ \t]{0,2})?(?:\*\*|__)?[ \t]{0,2}"
                        r"(?:final[ \t]{1,3})?answer[ \t]{0,2}:?[ \t]{0,2}(?:\*\*|__)?[ \t]{0,2}:?[ \t]{0,2}"
                        r"(?=\r?\n)", re.IGNORECASE)
_DELIMS_GAP = r"[\s$,;]*(?:\\[()\[\]][\s$,;]*)*"
_JOIN_RE = re.compile(_DELIMS_GAP + r"(?:(?:and|or|&)\b|\\text\s{0,2}\{\s{0,3}(?:and|or)\s{0,3}\}"
                      r"|\\q?quad)?" + _DELIMS_GAP
                      + r"(?:[A-Za-z](?:_\{?\w{1,3}\}?)?\s{0,3}=\s{0,3})?[\s$]*(?:\\[()\[\]]\s*)*")
"""What may stand between two boxes of one answer: delimiters, commas, "and" / "or", ``x =``."""


# ----------------------------------------------------------------------------- where the answer is


def final_span(text: str) -> Span | None:
    """The final answer of ``text`` as written (module docstring), or None when it states none.
    An empty answer block is an empty span: an answer of nothing, not a reason to look elsewhere."""
    region = answer_region(text, past_think=True)  # without tags, the reasoning's drafts are not the answer
    if region.after_think is not None:  # the block was a draft inside the think block
        after = _announced(region.after_think)
        if after is not None:
            return after
    if region.tagged:
        return _in_region(region.text)
    return _announced(region.text)


def _in_region(region: str) -> Span:
    """The answer in an answer block: a box or an announcement in it, else all of it."""
    found = _announced(region)
    if found is not None:
        return found
    return Span(region.strip())


def _announced(text: str) -> Span | None:
    """The later of the last box and the last announcement ("the answer is", "Answer:", "####",
    "**Final Answer**") in ``text``; None when there is neither."""
    box = _last_box_at(text)
    ann = last_announcement(text)
    header = _last_header(text)
    if header is not None and (ann is None or header.start() > ann.start()):
        ann = header
    if ann is not None and (box is None or ann.start() > box):
        tail = _sentence(text, ann.end())
        if tail.strip():
            inner = _boxes_at_end(tail, _last_box_at(tail))
            return inner if inner is not None else Span(tail.strip())
    if box is not None:
        return _boxes_at_end(text, box)
    return None


def _last_header(text: str) -> re.Match | None:
    """The last line that only says "Final Answer" (``**Final Answer**``, ``### Answer``), among the
    text's last ``8 * WINDOW`` characters; the answer is on the lines after it."""
    found = None
    for m in _HEADER_RE.finditer(text, max(0, len(text) - 8 * WINDOW)):
        found = m
    return found


def _last_box_at(text: str) -> int | None:
    """Position of the last box whose braces close within reach, or None."""
    pos = _last_box_word(text, 0, len(text))
    for _ in range(4):
        if pos == -1:
            return None
        if _box_content(text, pos) is not None:
            return pos
        pos = _last_box_word(text, 0, pos)
    return None


def _last_box_word(text: str, lo: int, hi: int) -> int:
    """Position of the last ``\\boxed`` / ``\\fbox`` / ``\\framebox`` in ``text[lo:hi]``, or -1."""
    return max(text.rfind("\\boxed", lo, hi), text.rfind("\\fbox", lo, hi), text.rfind("\\framebox", lo, hi))


def _box_content(text: str, pos: int) -> tuple[str, int] | None:
    """``(content, end)`` of the box at ``pos``, or None when it is not a complete one."""
    m = _BOX_RE.match(text, pos)
    if m is None:
        return None
    end = braced_end(text, m.end())
    return (text[m.end():end - 1], end) if end != -1 else None


def braced_end(text: str, start: int, limit: int = MAX_BOX) -> int:
    """Index after the brace closing the one just before ``start`` (-1 if not within ``limit``)."""
    depth = 1
    i = start
    end = min(len(text), start + limit)
    while i < end:
        c = text[i]
        if c == "\\":
            i += 2  # \{ and \} are not braces
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _boxes_at_end(text: str, last: int | None) -> Span | None:
    """The last box of ``text`` with the boxes joined to it in the same sentence (by "and", "or",
    commas, "x ="), as one list answer."""
    if last is None:
        return None
    content, _ = _box_content(text, last)  # type: ignore[misc]
    parts = [content]
    pos = last
    for _ in range(8):
        prev = _last_box_word(text, max(0, pos - WINDOW), pos)
        if prev == -1:
            break
        found = _box_content(text, prev)
        if found is None or found[1] > pos:
            break
        gap = _JOIN_RE.match(text, found[1], pos)
        if gap is None or gap.end() != pos:
            break
        parts.insert(0, found[0])
        pos = prev
    return Span(", ".join(p.strip() for p in parts), boxed=True)


def _sentence(text: str, start: int) -> str:
    """``text`` from ``start`` to the end of its sentence (a ``.``, ``!``, ``?`` before a space, or a
    line end, outside math; a display that opens the sentence is read to its end), at most WINDOW."""
    end = min(len(text), start + WINDOW)
    i = start
    while i < end and text[i] in " \t\r\n*:=":
        i += 1
    start = i
    math = None  # the delimiter that closes the math we are in
    depth = 0
    while i < end:
        c = text[i]
        if c == "\\" and i + 1 < end:
            two = text[i:i + 2]
            if math is None and two in ("\\(", "\\["):
                math = "\\)" if two == "\\(" else "\\]"
            elif math == two:
                math = None
            i += 2
            continue
        if c == "$":
            two = text[i:i + 2]
            if math is None:
                math = "$$" if two == "$$" else "$"
            elif math == "$$" and two == "$$":
                math = None
            elif math == "$":
                math = None
            i += 2 if two == "$$" else 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth = max(0, depth - 1)
        elif math is None and depth == 0 and (c == "\n" or (c in ".!?" and (i + 1 >= len(text)
                                                                               or text[i + 1] in " \t\r\n"))):
            break
        i += 1
    return text[start:i]


# ----------------------------------------------------------------------------- what a grader ignores

_UNICODE = str.maketrans({"√": "\\sqrt ", "π": "\\pi ", "∞": "\\infty ", "−": "-", "–": "-",
                          "×": "\\times ", "·": "\\cdot ", "≤": "\\le ", "≥": "\\ge ", "≠": "\\ne ",
                          "∪": "\\cup ", "±": "\\pm ", "°": "^\\circ", "\u00a0": " ", "\u2009": " ",
                          "\u202f": " "})
_DELIMS_RE = re.compile(r"\$\$|(?<!\\)\$|(?<!\\)\\[()\[\]]")
_SIZING_RE = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)\s{0,2}(?:\.|(?=[^A-Za-z]))"
                        r"|\\(?:display|text|script)style\b")
_FRAC_RE = re.compile(r"\\[dt]frac\b")
_THOUSANDS_RE = re.compile(r"(?<=\d)(?:\{,\}|,\\!|\\,|\\!|\\ |\{\\,\})(?=\d{3}(?!\d))")
_SPACES_RE = re.compile(r"(?<!\\)\\[,;: ]|\\q?quad\b|~")
_DEGREES_RE = re.compile(r"\^\s{0,2}\{?\s{0,2}\\circ\s{0,2}\}?|\\degree\b"
                         r"|\^\s{0,2}\{\s{0,2}\\text\{\s{0,2}o\s{0,2}\}\s{0,2}\}")
_CONNECT_RE = re.compile(r"\s*(?:\\(?:text|mbox|textrm|mathrm)\s{0,2}\{\s{0,3}(?:or|and)\s{0,3}\}"
                         r"|(?<![A-Za-z\\])(?:or|and)(?![A-Za-z]))\s*")
_TEXT_NUMBER_RE = re.compile(r"\\(?:text|mathrm|mbox|textrm)\s{0,2}\{\s{0,2}([^{}A-Za-z\\]{1,40}?)\s{0,2}\}")
_BOLD_RE = re.compile(r"\\(?:textbf|mathbf|boldsymbol|bm|mathit|textit|emph)\s{0,2}\{")
_SCALE_WORDS = r"(?:thousand|million|billion|trillion|hundred|dozen)s?"
_LETTER_RE = re.compile(r"\s*[A-Za-z](?![A-Za-z])")
_TEXT_SCALE_RE = re.compile(r"\\(?:text|mathrm|mbox|textrm)\s{0,2}\{\s{0,3}(" + _SCALE_WORDS + r")\s{0,3}\}")
_UNIT_RE = re.compile(r"(?<=\S)\s*\\(?:text|mbox|textrm|mathrm|operatorname)\s{0,2}"
                      r"\{(?!\s{0,3}" + _SCALE_WORDS + r"\b)\s{0,3}[A-Za-z][A-Za-z .]{0,30}\}"
                      r"(?:\s{0,2}\^\s{0,2}\{?[23]\}?)?\s*$")
_REPEATING_RE = re.compile(r"(-?)(\d{0,12})\.(\d{0,12})\\overline\s{0,2}\{(\d{1,12})\}")
_COMMAS_RE = re.compile(r",\s*(?:,\s*)+")
_TRAILING_WORDS_RE = re.compile(r"(?<=[0-9}\)\]A-Za-z])(?:\s+[A-Za-z]{2,}\.?){1,4}\s*$")
_IN_RE = re.compile(r"^\s*[A-Za-z]\s{0,2}\\in\s*")
_LHS_RE = re.compile(r"^\s*([A-Za-z](?:_\{?\w{1,3}\}?)?|[A-Za-z]{1,2}\s{0,2}\(\s{0,2}[A-Za-z]\s{0,2}\))"
                     r"\s{0,3}=(?!=)\s*")
_TRAIL = " \t\r\n.,;:"
_UNIT_WORDS_RE = re.compile(r"^(?:\s+[A-Za-z][A-Za-z.]*){1,4}\s*$")
MATH_NAMES = frozenset(
    "pi sqrt frac sin cos tan cot sec csc log ln exp lim max min gcd lcm mod det arcsin arccos arctan sinh "
    "cosh tanh infty inf cup cap pm mp le ge leq geq ne neq to in i e dx dy dz dt".split())


def plain_values(text: str, units: bool = True) -> tuple[Fraction, ...] | None:
    """The values of ``text`` when the whole of it is one plain number (currency before it; ``%``, unit
    words or a unit however written after it: ``5 cm``, ``12 m^2``, ``60 km/h``, ``72°F``), else None:
    ``2\\pi``, ``3i``, ``5x``, ``2^{10}``, ``5 x^2`` are not, nor is a compound quantity (``2 hours and
    30 minutes``: read against the question by the grader). ``units=False``: unit words only, as a reference
    is read (``3m^2`` there is a monomial)."""
    found = _plain(text, units)
    return found[0] if found is not None else None


def _plain(text: str, units: bool = True) -> tuple[tuple[Fraction, ...], str] | None:
    """``(values, the number as written)``, the number without a unit that is more than words."""
    s = _TEXT_SCALE_RE.sub(r" \1", normalize(text)).strip().rstrip(".")  # "85 \\text{ million}": a scale word
    num = leading_number(s)
    if num is None or num.measure is not None:
        return None
    rest = s[num.end:]
    if rest.strip() in ("", "\\%", "%"):
        return num.values, s
    if _UNIT_WORDS_RE.match(rest) is not None and not any(w.lower() in MATH_NAMES for w in rest.split()):
        return num.values, s  # "42 apples", kept as written ("5 x" may be a product)
    if units and unit_end(s, num.end) == len(s):
        if _LETTER_RE.match(rest):
            return num.values, s  # "3 m^2", kept as written: against a LaTeX reference it may be a monomial
        return num.values, s[:num.end]  # "72°F", "13 \\text{ cm}^2", "60 km/h": the unit goes
    return None


def clean(text: str) -> str:
    """``text`` with what a grader ignores taken off (module docstring); the rest stays as written."""
    t = text.replace("**", " ").replace("`", " ")
    found = _plain(t)
    if found is not None:  # "$2B", "1 and 1/2", ".5", "42 apples", "12 m^2": as the number reader reads them
        values, number = found
        bare = _THOUSANDS_RE.sub("", number).replace("\\$", "").strip().lstrip("$").strip().rstrip(_TRAIL)
        return bare if plain_values(bare) == values else number.strip()
    t = t.translate(_UNICODE) if not t.isascii() else t
    t = _DELIMS_RE.sub(" ", t)
    t = _unwrap(t, _BOX_RE)
    t = _unwrap(t, _BOLD_RE)
    t = _TEXT_NUMBER_RE.sub(r"\1", t)
    t = _SIZING_RE.sub("", t)
    t = _FRAC_RE.sub("\\\\frac", t)
    t = _THOUSANDS_RE.sub("", t)
    t = re.sub(r"(?<!\\)\\!", "", t)
    t = _SPACES_RE.sub(" ", t)
    t = _DEGREES_RE.sub("", t)
    t = t.replace("\\$", "")
    t = re.sub(r"(?<!\\)%", r"\\%", t)
    t = _REPEATING_RE.sub(_repeating, t)
    t = t.replace("\\varnothing", "\\emptyset")
    t = _COMMAS_RE.sub(", ", _CONNECT_RE.sub(", ", t)).strip().lstrip(",").rstrip(_TRAIL)
    for _ in range(2):
        t = _UNIT_RE.sub("", t).strip().rstrip(_TRAIL)
    t = _trailing_words(t)
    t = _IN_RE.sub("", t)
    t = _drop_variable(t)
    return " ".join(t.split()).rstrip(_TRAIL)


def _repeating(m: re.Match) -> str:
    """``0.1\\overline{6}`` as the fraction it is (``\\frac{1}{6}``)."""
    whole, fixed, period = m.group(2) or "0", m.group(3), m.group(4)
    value = Fraction(int(whole)) + Fraction(int(fixed + period) - int(fixed or "0"),
                                            10 ** len(fixed) * (10 ** len(period) - 1))
    return f"{m.group(1) or ''}\\frac{{{value.numerator}}}{{{value.denominator}}}"


def _trailing_words(t: str) -> str:
    """``9\\pi square units`` -> ``9\\pi``: plain words after a value (not "or", "and", math names)."""
    m = _TRAILING_WORDS_RE.search(t)
    if m is None or not any(c.isdigit() or c == "\\" for c in t[:m.start()]):
        return t
    if any(w.lower().rstrip(".") in MATH_NAMES for w in m.group(0).split()):
        return t
    return t[:m.start()].rstrip()


def _unwrap(t: str, opener: re.Pattern) -> str:
    """``t`` with each ``\\cmd{X}`` that ``opener`` matches replaced by ``X`` (bounded passes)."""
    for _ in range(8):
        m = opener.search(t)
        if m is None:
            return t
        end = braced_end(t, m.end(), len(t))
        if end == -1:
            return t[:m.start()] + t[m.end():]
        t = t[:m.start()] + t[m.end():end - 1] + t[end:]
    return t


def split_top(t: str) -> list[str]:
    """``t`` split at the commas outside brackets and braces."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(t):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0 and not t[max(0, i - 1):i] == "\\":
            parts.append(t[start:i])
            start = i + 1
    parts.append(t[start:])
    return [p.strip() for p in parts]


def _drop_variable(t: str) -> str:
    """``x = 5`` -> ``5``; ``x = 1, x = 2`` -> ``1, 2``; kept when the parts name different variables
    (``a = 2, b = 3``) or a side is an expression (``x + y = 5``)."""
    if "=" not in t:
        return t
    parts = split_top(t)
    names = set()
    out = []
    for p in parts:
        m = _LHS_RE.match(p)
        if m is None or "=" in p[m.end():]:
            out.append(p)
            continue
        names.add(m.group(1).replace(" ", ""))
        out.append(p[m.end():])
    if len(names) != 1 or any(not o for o in out):
        return t
    return ", ".join(out)
