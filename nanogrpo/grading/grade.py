"""Whether a completion's final answer equals the reference: the verdict of the built-in ``correctness``.

The reference is read once (cached) as what it is: a plain number (``42``, ``\\$18.90``, ``25\\%``,
``\\frac{3}{4}``), a multiple-choice letter (``\\text{(B)}``), a word (``\\text{odd}``), a number in
another base (``1011_2``), or LaTeX (``\\frac{\\sqrt{3}}{2}``, ``[-1,4)``, ``1, 2, 3``,
``\\begin{pmatrix}3\\\\7\\end{pmatrix}``).

The final answer is found as written (:func:`nanogrpo.grading.latex.final_span`) and what a grader
ignores is taken off (:func:`~nanogrpo.grading.latex.clean`). Then:

- a plain number against a plain number: exact, as fractions (no math_verify call); a unit after it,
  however written (``96 m^2``, ``45 km/h``, ``-4°F``), is part of the number, not math; when the
  question asks in a scale ("how many millions"), a value is read in it too (``$4.5M`` is 4.5);
- a compound quantity (``2 hours and 30 minutes``, ``5'6"``): in the unit the question asks for, and
  no value at all when it names none (the stricter reading; money is read in dollars);
- against a number reference, an answer in words and numbers ("She has 42 apples left.", ``42 (6 ×
  7)``, ``7 × 6 = 42``): the number reader of :mod:`nanogrpo.grading.extract` (GSM8K-style), which
  refuses hedges ("42 or 56"), ranges and negations; an expression (``\\sqrt{16}``, ``2^{10}``, a list
  ``5, -5``, anything with a variable) goes to math_verify instead, so that no number is picked out
  of ``2\\sqrt{2}``;
- a time of day (``8:30 PM``, ``8:30 p.m.``, ``20:30``) against one with a.m./p.m. on either side: as
  times (``8:30 pm`` = ``20:30`` = ``8:30 PM``; ``8:30 AM`` is not); a sentence with one time in it
  ("She arrives at 8:30 p.m.") gives that time, with two different ones it gives none;
- a letter, a word, a base: compared as such (``(B)`` = ``\\textbf{(B)}``; "The function is odd." =
  ``\\text{odd}`` but "even, not odd" is not; ``1011_{2}`` = ``1011`` but ``1011_3`` is not);
- an inequality in one variable against an interval, or the other way round: as that interval
  (``2 \\le x < 5`` = ``[2, 5)``, ``x > 3`` = ``(3, \\infty)``);
- anything else: math_verify on the answer, delimited, so it is read whole (lists as multisets when
  the reference is a list; tuples, intervals, sets and matrices by structure); a sentence with math
  in it is left to math_verify's own reading of that sentence. A finite decimal never equals an
  irrational reference (``0.8660254`` is not ``\\frac{\\sqrt3}{2}``, which math_verify's rounding would
  allow).

A completion that announces nothing (no tags, no box, no "answer is") is read by the number reader
against a number reference (its last sentence: extract's rule 4), else by math_verify over the end of the
text after the reasoning when delimited math is there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from nanogrpo.grading import verify
from nanogrpo.grading.extract import Answer, read_answer
from nanogrpo.grading.forms import (
    as_interval,
    base_number,
    choice,
    choices,
    clock,
    clocks_in,
    is_interval,
    math_segment_matches,
    math_segments,
    same_time,
    words,
)
from nanogrpo.grading.latex import MATH_NAMES, clean, final_span, plain_values, split_top
from nanogrpo.grading.numbers import Num, read_number
from nanogrpo.grading.region import OPEN, THINK_CLOSE
from nanogrpo.grading.units import Measure, drop_units, in_asked_unit, with_scale

THINK_OPEN = "<think>"

__all__ = ["Reference", "reference", "grade", "answer_equals", "answered", "kind", "final_answer"]

_LONG_DECIMAL_RE = re.compile(r"[0-9]\.([0-9]{6,})\s*$")


@dataclass(frozen=True)
class Reference:
    text: str
    """As the dataset writes it."""
    latex: str
    """With what a grader ignores taken off."""
    values: tuple[Fraction, ...] | None = None
    """The values of a plain number (``25%``: 25 and 1/4); None when it is not one."""
    tolerance: Fraction = Fraction(0)
    """A reference written as a long decimal (``2.666666666666667``) matches what rounds to it."""
    choice: str | None = None
    choices: frozenset[str] | None = None
    """Several letters to choose, in any order (``\\text{A, E}``)."""
    words: str | None = None
    base: tuple[str, int] | None = None
    clock: tuple[int, int, str | None] | None = None
    """A time of day (``8:30 PM``; ``8:30`` too, compared as a time only against an answer that says
    a.m. or p.m.)."""


@lru_cache(maxsize=4096)
def reference(text: str) -> Reference:
    """The reference ``text`` read as what it is (cached: it repeats for every completion of a group)."""
    letter = choice(text)
    if letter is not None:
        return Reference(text, text, choice=letter)
    letters = choices(text)
    if letters is not None:
        return Reference(text, text, choices=letters)
    latex = clean(text)
    when = clock(text)
    if when is not None and when[2] is not None:
        return Reference(text, latex, clock=when)
    values = plain_values(latex, units=False)  # "3m^2" is a monomial; "12 \\text{ m}^2" was cleaned to 12
    if values is not None:
        m = _LONG_DECIMAL_RE.search(latex)
        tol = Fraction(1, 2 * 10 ** len(m.group(1))) if m else Fraction(0)
        return Reference(text, latex, values, tol)
    base = base_number(latex)
    if base is not None:
        return Reference(text, latex, base=base)
    return Reference(text, latex, words=words(text), clock=when)


# ----------------------------------------------------------------------------- what an answer is

_ENGLISH_2 = frozenset("is be so we it to of at by if as an on no my do or and am are was".split())
_COMMAND_RE = re.compile(r"\\(?:begin|end)\s{0,2}\{[A-Za-z]{1,12}\*?\}|\\[A-Za-z]+")
_TOKEN_RE = re.compile(r"(?<![A-Za-z\\])[A-Za-z]{2,}(?![A-Za-z])")
_VARIABLE_RE = re.compile(r"(?<![A-Za-z\\])[A-Za-z](?![A-Za-z])")
_TIMES_X_RE = re.compile(r"(?<=\d)\s+x\s+(?=\d)")
_SYMBOLIC_CMD_RE = re.compile(r"\\(?!frac\b|times\b|cdot\b|div\b|%)[A-Za-z]+")


def kind(text: str) -> str:
    """What a cleaned answer is: ``number`` (plain), ``prose`` (has words), ``arithmetic`` (numbers
    and operators only: ``6 × 7``, ``42 (6 × 7)``, ``7 × 6 = 42``) or ``symbolic`` (a variable, a
    LaTeX command beyond fractions and products, a power, a subscript, brackets, a list)."""
    if plain_values(text) is not None:
        return "number"
    text = drop_units(text)  # "96 m^2 (12 × 8)": a unit's power is no math
    bare = _COMMAND_RE.sub(" ", text)
    for w in _TOKEN_RE.findall(bare):
        low = w.lower()
        if low in _ENGLISH_2 or (len(w) > 2 and low not in MATH_NAMES):
            return "prose"
    if (_SYMBOLIC_CMD_RE.search(text) or any(c in text for c in "^_[]")
            or _VARIABLE_RE.search(_TIMES_X_RE.sub(" * ", bare)) or len(split_top(text)) > 1):
        return "symbolic"
    return "arithmetic"


# ----------------------------------------------------------------------------- the verdict

_NEGATION_RE = re.compile(r"(?:\bnot|n't|\bnever|\bnor|\bneither)\s+(?:\w+\s+){0,2}$", re.IGNORECASE)


def _words_match(ref_words: str, text: str) -> bool:
    """Whether ``text`` (an answer or a sentence) gives the word answer ``ref_words`` un-negated and
    without an alternative."""
    t = " ".join(clean(text).replace("\\text", " ").replace("{", " ").replace("}", " ").split()).lower()
    if words(text) == ref_words:
        return True
    hits = [m for m in re.finditer(r"(?<![a-z])" + re.escape(ref_words) + r"(?![a-z])", t)]
    if not hits or re.search(r"\bor\b", text, re.IGNORECASE):
        return False
    return any(not _NEGATION_RE.search(t[max(0, m.start() - 40):m.start()]) for m in hits)


def _numbers(completion: str, ref: Reference, question: str | None) -> bool:
    """The GSM8K-style verdict: the number reader's answer against a number reference (without answer
    tags, in what follows the reasoning when something does)."""
    if OPEN not in completion and THINK_CLOSE in completion:
        after = completion[completion.rfind(THINK_CLOSE) + len(THINK_CLOSE):]
        if after.strip():
            completion = after
    answer = read_answer(completion, question)
    if answer is None:
        return False
    if answer.values:
        return _match(answer.values, ref, question, answer.measure)
    if not any(c.isdigit() or c == "\\" for c in answer.text):
        return False  # words without a number cannot equal one
    return verify.equal(clean(answer.text), ref.latex)


def _match(values: tuple[Fraction, ...], ref: Reference, question: str | None,
           measure: Measure | None = None) -> bool:
    """Whether a number answer's ``values`` give the number reference: a compound quantity in the unit the
    question asks for (none named: no value, the stricter reading), any value in the scale it asks in
    (``1.5 million`` is 1.5 when it asks in millions); a long-decimal reference within its rounding."""
    if measure is not None:
        value = in_asked_unit(measure, question)
        if value is None:
            return False
        values = (value,)
    values = with_scale(values, question)
    if ref.tolerance:
        return any(abs(p - r) <= ref.tolerance for p in values for r in ref.values)
    return not set(values).isdisjoint(ref.values)


_MARKUP_RE = re.compile(r"\\\$|\\(?:text|mathrm|mbox|textrm)\s{0,2}\{|\\[()\[\],; ]|[{}$*`]")


def _compound(raw: str) -> Num | None:
    """The compound quantity an answer is, whole (``2 hours and 30 minutes``, ``5'6"``, ``\\$3 and 25
    cents``, ``2 \\text{ h } 30 \\text{ min}``), or None."""
    num = read_number(" ".join(_MARKUP_RE.sub(" ", raw).split()))
    return num if num is not None and num.measure is not None else None


def _decimal_vs_exact(values: tuple[Fraction, ...], written: str, ref: Reference) -> bool:
    """A plain number against a LaTeX reference: exact when the reference is a rational number; a
    finite decimal never equals an irrational one; an integer may equal ``\\sqrt{16}`` (math_verify)."""
    exact = verify.rational_value(ref.latex)
    if isinstance(exact, Fraction):
        return exact in values
    if "." in written or exact == verify.IRRATIONAL:
        return False
    return verify.equal(written, ref.latex)


def _against(text: str, raw: str, completion: str, ref: Reference, question: str | None) -> bool:
    """Whether the answer ``text`` (cleaned; ``raw`` as written) of ``completion`` equals ``ref``."""
    if ref.choice is not None:
        return choice(raw) == ref.choice or choice(text) == ref.choice
    if ref.choices is not None:
        return choices(raw) == ref.choices or choices(text) == ref.choices
    if ref.clock is not None:
        mine = clock(raw)
        if mine is None and ref.clock[2] is not None:
            found = set(clocks_in(raw))
            mine = found.pop() if len(found) == 1 else None
            if mine is None:
                return False
        if mine is not None and (mine[2] or ref.clock[2]):
            return same_time(mine, ref.clock)
    if ref.words is not None:
        return _words_match(ref.words, raw)
    what = kind(text)
    if ref.base is not None:
        base = base_number(text)
        if base is not None:
            return base == ref.base
        return what == "number" and text.replace(",", "").upper() == ref.base[0]
    if ref.values is not None:
        compound = _compound(raw) if what != "number" else None
        if compound is not None:
            return _match(compound.values, ref, question, compound.measure)
        if what == "number":
            return _match(plain_values(text) or (), ref, question)
        if what == "arithmetic":
            return _numbers(completion, ref, question)
        parts = split_top(text) if what == "symbolic" else []
        if len(parts) > 1 and all(plain_values(p) for p in parts):
            same = len({plain_values(p)[0] for p in parts}) == 1  # "1/2 (or 0.5)": one value, twice written
            return same and _match(plain_values(parts[0]), ref, question)
        if what == "prose":
            if _hedged(raw):
                return False
            segments = math_segments(raw)
            if segments and kind(clean(segments[-1])) == "symbolic":
                return _prose(raw, ref)  # "The area is $6\\sqrt{3}$.": no number picked out of the math
            return _numbers(completion, ref, question)
        return verify.equal(text, ref.latex)
    if "".join(text.split()) == "".join(ref.latex.split()):
        return True  # written as the reference is
    if is_interval(ref.latex) and (interval := as_interval(text)) is not None:
        return verify.equal(interval, ref.latex)  # "2 \\le x < 5" against [2, 5)
    if is_interval(text) and (interval := as_interval(ref.latex)) is not None:
        return verify.equal(text, interval)
    if what == "number":
        return _decimal_vs_exact(plain_values(text) or (), text, ref)
    if what == "prose":
        return _prose(raw, ref)
    parts = split_top(text)
    if 1 < len(parts) <= 3 and not _is_list(ref.latex) and all(verify.equal(p, parts[0]) for p in parts[1:]):
        text = parts[0]  # one value written two ways ("\\frac12 or 0.5"), against a reference of one value
    return verify.equal(text, ref.latex)


def _is_list(latex: str) -> bool:
    return len(split_top(latex)) > 1 or "\\pm" in latex


_HEDGE_RE = re.compile(r"\b(?:might|maybe|perhaps|possibly|could|either|unless)\b", re.IGNORECASE)
_COPULA_RE = re.compile(r"\b(?:is|are|was|were|equals?|be)\b|:", re.IGNORECASE)
_NOT_BEFORE_RE = re.compile(r"(?:\bnot|n't|\bnever|\bnor)\s*(?:equal\s+to\s+|be\s+)?[$\\(\[]*\s*$",
                            re.IGNORECASE)


def _hedged(raw: str) -> bool:
    """Whether a sentence offers two answers: "$\\frac{14}{3}$, but it might be $\\frac{13}{3}$"."""
    segments = math_segment_matches(raw)
    return any(_HEDGE_RE.search(raw, a.end(), b.start()) for a, b in zip(segments, segments[1:]))


def _last_interval(segments: list[re.Match], ref: Reference) -> str | None:
    """The interval the last delimited math of a sentence describes when it is an inequality and the
    reference an interval (:func:`~nanogrpo.grading.forms.as_interval`), else None."""
    if not segments or not is_interval(ref.latex):
        return None
    return as_interval(clean(next(g for g in segments[-1].groups() if g is not None)))


def _prose(raw: str, ref: Reference) -> bool:
    """A sentence against a LaTeX reference: math_verify's reading of it (the last delimited math,
    joined lists, "answer is"), else what follows its last "is" / "are" / "=" when that is math;
    never a value the sentence negates ("not $\\frac12$")."""
    segments = math_segment_matches(raw)
    negated = [m for m in segments if _NOT_BEFORE_RE.search(raw, max(0, m.start() - 30), m.start())]
    if negated:  # "$\\frac12$, not $\\frac13$": read without what it rules out
        if len(negated) == len(segments):
            return False
        for m in reversed(negated):
            raw = raw[:m.start()] + " " * (m.end() - m.start()) + raw[m.end():]
        segments = [m for m in segments if m not in negated]
    if _hedged(raw):
        return False
    interval = _last_interval(segments, ref)
    if interval:  # "The solution is $x < -2$." against (-\\infty, -2)
        return verify.equal(interval, ref.latex)
    if segments and verify.region_equal(raw, ref.latex):
        return True
    cop = None
    for cop in _COPULA_RE.finditer(raw):  # noqa: B007 - the last one counts
        pass
    if cop is None or _NOT_BEFORE_RE.search(raw[cop.end():cop.end() + 12] + " $"):
        return False
    tail = clean(raw[cop.end():])
    return bool(tail) and kind(tail) in ("number", "symbolic", "arithmetic") and (
        verify.equal(tail, ref.latex) if kind(tail) != "number" else _decimal_vs_exact(
            plain_values(tail) or (), tail, ref))


def grade(completion: str, reference_text: str, question: str | None = None) -> bool:
    """Whether ``completion``'s final answer equals the reference (module docstring)."""
    ref = reference(reference_text)
    span = final_span(completion)
    if span is None:
        if ref.values is not None:
            return _numbers(completion, ref, question)
        tail = completion[completion.rfind(THINK_CLOSE) + len(THINK_CLOSE):] if THINK_CLOSE in completion \
            else completion
        tail = tail[-verify.MAX_REGION:]
        if ref.words is not None:
            return _words_match(ref.words, tail[-200:])
        segments = math_segment_matches(tail[-verify.MAX_REGION:])
        if not segments:
            return False  # no delimited math at the end: nothing a LaTeX reference could equal
        interval = _last_interval(segments, ref)
        return verify.equal(interval, ref.latex) if interval else verify.region_equal(tail, ref.latex)
    if len(span.text) > verify.MAX_REGION:  # no final answer is this long: a passage, read as one
        if ref.values is not None:
            return _numbers(completion, ref, question)
        if ref.words is not None:
            return _words_match(ref.words, span.text[-200:])
        return verify.region_equal(span.text, ref.latex)
    text = clean(span.text)
    if not text:
        return False
    return _against(text, span.text, completion, ref, question)


def answered(completion: str) -> bool:
    """Whether ``completion`` gives a final answer at all: an ``<answer>`` block (closed or not), a
    ``\\boxed{}``, an announced answer ("the answer is", "Answer:", "####", "**Final Answer**"), and not
    only inside a ``<think>`` block that never closes (a draft in reasoning that was cut off). A
    completion without one is still read by its last sentence, unless the token limit cut it off
    (:func:`nanogrpo.rewards.builtin.correctness`)."""
    think = completion.rfind(THINK_OPEN)
    if think != -1 and completion.find(THINK_CLOSE, think) == -1 and completion.find(OPEN, think) == -1:
        return False
    return final_span(completion) is not None


def answer_equals(answer: str, reference_text: str) -> bool:
    """Whether ``answer``, as written with nothing around it, equals the reference."""
    text = clean(answer)
    if not text:
        return False
    return _against(text, answer, f"<answer>{answer}</answer>", reference(reference_text), None)


def final_answer(completion: str) -> str | None:
    """The final answer as a grader would write it down (cleaned LaTeX, or the number the number
    reader reads from a sentence), or None: what ``nanogrpo eval`` records and votes on."""
    span = final_span(completion)
    if span is not None and len(span.text) <= verify.MAX_REGION:
        text = clean(span.text)
        what = kind(text) if text else ""
        if what in ("number", "symbolic"):
            return text
        segments = math_segments(span.text) if what == "prose" else []
        if segments and clean(segments[-1]):
            return clean(segments[-1])  # "The area is $9\\pi$ square units." -> 9\\pi
    answer: Answer | None = read_answer(completion)
    if answer is not None:
        return answer.text
    return (clean(span.text) or None) if span is not None else None
