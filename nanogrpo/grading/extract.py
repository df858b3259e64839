"""Read a completion's final answer the way a careful human grader does.

Where the answer is (the first rule that applies; tags and new turns found by
:mod:`nanogrpo.grading.region`):

1. the last complete ``<answer>…</answer>`` block (an empty one means "no answer"); if a
   ``</think>`` follows it (a draft inside the think block) and a boxed or announced answer
   comes after that, that one;
2. without a complete block, the text after an unclosed ``<answer>``;
3. without tags, the later of the last ``\\boxed{…}`` and the last announced answer ("the final
   answer is …", "Answer: …", "#### …"); boxed values that differ are no answer;
4. else the last sentence that holds a number.

What that region announces (the first rule that applies): a boxed value; an announced answer;
a leading result before its explanation (``42 (6 × 7)``, ``$35, because …``); then, in the
last sentence with a number (its main clause, before "because", "since" or a bracket): the
result of an equation (``7 × 6 = 42``), the value after a conclusion word and a copula ("so
the total is 42"), the only number, or the last number not taken from the question ("Leo
earned $10 for 50 minutes" -> 10). An arithmetic expression alone (``6 × 7``) is left to
math_verify.

What is no answer: a value offered with another, a range, a negated value
(:mod:`nanogrpo.grading.hedges`: "42 or 56", ``40-45``, "not 42"), an empty block, boxed values that
disagree. A base model that runs on into a new turn ("\\nQuestion: …", "\\nUser: …") after its answer
is read up to that turn.

Numbers are read by :mod:`nanogrpo.grading.numbers`. The cost is linear in the length of the
completion whatever it holds: tags are found with ``str.find``, numbers are parsed only in
bounded windows (a region's first and last :data:`WINDOW` characters, an announcement's
sentence), boxes are scanned a bounded distance, and no pattern can backtrack without bound.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from nanogrpo.grading.arithmetic import evaluate
from nanogrpo.grading.hedges import Hedged, check_hedges, unnegated
from nanogrpo.grading.numbers import Num, find_number_words, find_numbers, normalize
from nanogrpo.grading.region import answer_region, last_announcement
from nanogrpo.grading.units import Measure

__all__ = ["Answer", "read_answer", "extract_answer", "last_number", "WINDOW"]

WINDOW = 400
"""Characters of a region read for its leading result, and of its last sentence."""
_MAX_BOX = 400
"""Characters scanned for a box's closing brace."""
_MAX_TEXT = 300
"""Longest non-numeric answer passed on (to math_verify)."""


@dataclass(frozen=True)
class Answer:
    """The final answer of a completion."""

    text: str
    """As written (``"$1,234.50"``, ``"forty-two"``, ``"\\frac{3}{4}"``, ``"6 × 7"``)."""
    values: tuple[Fraction, ...] = ()
    """The numbers it can mean (``25%``: 25 and 1/4); empty when it is not a plain number."""
    measure: Measure | None = None
    """A compound quantity's kind and amount (``2 hours and 30 minutes``; :attr:`Num.measure`)."""


_VALUE_START_RE = re.compile(r"[ \t\r\n*_`:=~≈>#\"']{0,12}(?:[-−–$(0-9½¼¾⅓⅔]|\\[(\[$]|\\(?:boxed|[dt]?frac)"
                             r"|(?:zero|none|one|two|three|four|five|six|seven|eight|nine|ten|eleven|"
                             r"twelve|[a-z]+teen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|"
                             r"a dozen|half)\b)",
                             re.IGNORECASE)
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s{0,2}\{")
_LATEX_NOISE_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s{0,2}\{"
                             r"|\\(?:left|right|displaystyle|,|!|;|:|quad|qquad)(?![A-Za-z])|\\[()\[\]]")
_LEAD_SKIP = " \t\r\n*_`$\\:=([{~≈>#\"'"
_TAIL_SKIP = " \t\r\n*_`:=~≈>#\"'"
_OPERATOR_AFTER_RE = re.compile(r"[ \t]{0,3}(?:[+*/×÷^·=]|\\times|\\cdot|\\div|-[ \t]{0,2}\$?[0-9]"
                                r"|x[ \t]{0,2}\$?[0-9])")
_OPERATOR_BEFORE_RE = re.compile(r"(?:[+*/×÷^·]|\\times|\\cdot|\\div|\s-|\bx)[ \t$\\]{0,3}$")
_STOP_RE = re.compile(r"[,.;:()\[\]—=\n]|\s-\s|\b(?:since|because|as|which|so|from|per|each|for|in|after|"
                      r"when|with|if|to|given|using|assuming|where|i\.e)\b", re.IGNORECASE)
_ARITHMETIC_RE = re.compile(r"[+×*/÷^]|\\times|\\cdot|\s-\s|\b(?:x|times|plus|minus|divided)\b")
_VERB_RE = re.compile(r"\b(?:is|are|was|were|has|have|had|will|would|can|could|must|needs?|do|does|did|"
                      r"gets?|got|makes?|made|costs?|sold|sells?|buys?|bought|takes?|took|gives?|gave|earns?|earned|"
                      r"pays?|paid|runs?|ran|reads?|lay|lays)\b", re.IGNORECASE)
_EXPLAIN_RE = re.compile(r"[(\[—]|\b(?:because|since)\b", re.IGNORECASE)
_CONCLUSION_RE = re.compile(r"\b(?:so|therefore|thus|hence|total|altogether|overall|finally|result)\b",
                            re.IGNORECASE)
_COPULA_RE = re.compile(r"\b(?:is|are|was|were|be|equals?(?:\s+to)?|makes?|comes\s+to|totals?|gives)\b"
                        r"(?:[ \t]{1,3}(?:about|approximately|exactly|just|only)\b)?"
                        r"[ \t$\\*]{0,4}(?=[0-9.½¼¾-])", re.IGNORECASE)
_PREPOSITION_RE = re.compile(r"\b(?:for|after|before|in|into|from|of|with|by|at|per|than|within|over|during|"
                             r"on|among|across|using)\s+(?:[a-z]+ing\s+|the\s+|an?\s+|each\s+|every\s+)?[$\\]*$",
                             re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"[.!?](?=\s|$)|\n")
_ENUMERATOR_RE = re.compile(r"[ \t]{0,4}(?:(?:step|part)[ \t]{0,2})?[0-9]{1,2}[.):][ \t]{1,3}(?=\D)",
                            re.IGNORECASE)
_EXPRESSION_CHARS = frozenset(" \t+-*/×÷^·()[]{}.$")
_NUMBER_CHARS = "0123456789½⅓⅔¼¾⅕⅖⅗⅘⅙⅚⅐⅛⅜⅝⅞⅑⅒"


# ----------------------------------------------------------------------------- public API


def read_answer(completion: str, question: str | None = None) -> Answer | None:
    """The final answer of ``completion`` (see the module docstring), or None when it gives none.

    ``question`` (optional) lets a sentence that repeats the question's numbers be read as a
    grader reads it ("Leo earned $10 for 50 minutes" -> 10, when 50 is in the question).
    """
    qnums = _question_values(question) if isinstance(question, str) else frozenset()
    try:
        return _read_completion(completion, qnums)
    except Hedged:
        return None


def extract_answer(completion: str) -> str | None:
    """The final answer as written (``"$1,234.50"``, ``"forty-two"``), or None (see :func:`read_answer`)."""
    answer = read_answer(completion)
    return answer.text if answer is not None else None


def last_number(text: str) -> str | None:
    """The last number written with digits in ``text``, as written, or None (the seed's rule,
    with nanogrpo's number reader)."""
    end = _last_digit(text)
    if end < 0:
        return None
    window = normalize(text[max(0, end - WINDOW):end + 100])
    nums = find_numbers(window)
    return window[nums[-1].start:nums[-1].end] if nums else None


# ----------------------------------------------------------------------------- where the answer is


def _read_completion(text: str, qnums: frozenset[Fraction]) -> Answer | None:
    region = answer_region(text)
    if region.after_think is not None:  # the block was a draft inside the think block
        after = _announced(region.after_think, qnums)
        if after is not None:
            return after
    if region.tagged:
        return _read_region(region.text, qnums)
    found = _announced(region.text, qnums)
    if found is not None:
        return found
    return _last_sentence(region.text, qnums, region=False)


def _announced(text: str, qnums: frozenset[Fraction], worded: bool = True) -> Answer | None:
    """The answer a box or an announcement gives (whichever comes last); None if neither gives one.
    ``worded=False`` skips announcements that do not start with their value ("the answer is found by
    multiplying 6 by 7", as opposed to "the answer is 42")."""
    box = _last_box(text)
    ann = last_announcement(text)
    if ann is not None and (box is None or ann.start() > box[0]) and (
            worded or _VALUE_START_RE.match(text, ann.end())):
        found = _read_tail(text, ann.end(), qnums)
        if found is not None:
            return found
    if box is not None:
        _check_other_boxes(text, box)
        return _read_region(box[1], qnums, inner=True)
    return None


def _read_tail(text: str, pos: int, qnums: frozenset[Fraction]) -> Answer | None:
    """The value announced at ``text[pos:]``: the rest of its sentence (or of the next line)."""
    body = text[pos:pos + WINDOW].lstrip(_TAIL_SKIP)
    m = _SENTENCE_END_RE.search(body)
    sentence = (body[:m.start()] if m is not None else body).strip()
    if not sentence:
        return None
    box = _last_box(sentence)
    if box is not None:
        return _read_region(box[1], qnums, inner=True)
    return _read_region(sentence, qnums, inner=True)


def _last_box(text: str) -> tuple[int, str] | None:
    """``(position, content)`` of the last ``\\boxed{…}`` whose braces close within reach."""
    pos = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    for _ in range(4):
        if pos == -1:
            return None
        m = _BOX_RE.match(text, pos)
        content = _braced(text, m.end()) if m is not None else None
        if content is not None:
            return pos, content
        pos = max(text.rfind("\\boxed", 0, pos), text.rfind("\\fbox", 0, pos))
    return None


def _braced(text: str, start: int) -> str | None:
    """Content from ``start`` up to the brace closing the one just before it (None if not within reach)."""
    depth = 1
    for i in range(start, min(len(text), start + _MAX_BOX)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _check_other_boxes(text: str, box: tuple[int, str]) -> None:
    """Raise :class:`~nanogrpo.grading.hedges.Hedged` when a box in the same sentence as the last holds
    another number ("if 6 per box, \\boxed{42}; if 8, \\boxed{56}"); an earlier sentence's box was a step
    or a draft."""
    last = _box_values(box[1])
    pos = box[0]
    for _ in range(3):
        pos = text.rfind("\\boxed", max(0, pos - WINDOW), pos)
        if pos == -1 or _SENTENCE_END_RE.search(text, pos, box[0]):
            return
        m = _BOX_RE.match(text, pos)
        content = _braced(text, m.end()) if m is not None else None
        other = _box_values(content) if content is not None else ()
        if last and other and set(last).isdisjoint(other):
            raise Hedged


def _box_values(content: str) -> tuple[Fraction, ...]:
    nums = find_numbers(normalize(content))
    return nums[0].values if len(nums) == 1 else ()


# ----------------------------------------------------------------------------- what a region says


def _clean(region: str) -> str:
    if "\\" in region:
        region = _LATEX_NOISE_RE.sub(" ", region)
    region = region.strip(" \t\r\n*_`")
    if len(region) > 1 and region[0] == "$" and region[-1] == "$":  # LaTeX math, not dollars
        region = region.strip("$").strip()
    return region


def _read_region(region: str, qnums: frozenset[Fraction], inner: bool = False) -> Answer | None:
    """The value a stretch of text announces (an answer block; ``inner``: a box's content or what an
    announcement says, where no further box or announcement is looked for)."""
    text = _clean(region)
    if not text:
        return None
    if not inner:
        found = _announced(text, qnums, worded=False)  # a box, "the answer is 42"
        if found is not None:
            return found
    head = normalize(text[:WINDOW])
    nums = find_numbers(head)
    if head.lstrip(_LEAD_SKIP)[:1].isalpha():  # "forty-two (6 × 7)"
        nums = sorted(nums + find_number_words(head), key=lambda n: n.start)
    if nums:
        lead = _leading(head, nums)
        if lead is not None:
            return lead
    if not inner:
        found = _announced(text, qnums)  # "the answer is: she has 42 apples"
        if found is not None:
            return found
    return _last_sentence(text, qnums)


def _leading(text: str, nums: list[Num]) -> Answer | None:
    """The result ``text`` starts with, before its explanation (``42 (6 × 7)``), or None."""
    first = nums[0]
    if text[:first.start].strip(_LEAD_SKIP):
        return None
    if _OPERATOR_AFTER_RE.match(text, first.end):
        return None  # an expression: 7 × 6 = 42
    stop = _STOP_RE.search(text, first.end, first.end + 200)
    boundary = stop.start() if stop is not None else min(len(text), first.end + 200)
    if _VERB_RE.search(text, first.end, boundary):
        return None  # "9 eggs are sold, so …": a sentence, not a result
    if any(first.end <= n.start < boundary for n in nums[1:]):
        return None  # "8 ft × 5 ft = 40", "3 bags of 7 apples each, so 21": it goes on to a result
    for concl in _CONCLUSION_RE.finditer(text, first.end, first.end + WINDOW):
        if any(concl.end() <= n.start < concl.end() + 30 for n in nums[1:]):
            return None  # "7 apples in a bag. So 6 bags hold 42": reasoning that ends in a result
    check_hedges(text, first)
    return _as_answer(text, first)


def _last_sentence(text: str, qnums: frozenset[Fraction], region: bool = True) -> Answer | None:
    """The answer in the last sentence of ``text`` that holds a number (its last ``WINDOW`` characters).
    Without one: a number in words, or (``region``: an answer block, a box) the text itself."""
    end_digit = _last_digit(text)
    if end_digit < 0:
        tail = normalize(text[-WINDOW:])
        words = find_number_words(tail)
        kept = unnegated(tail, words)
        if kept:
            return _as_answer(tail, _choose(tail, kept, qnums))
        return Answer(text) if region and not words and len(text) <= _MAX_TEXT else None
    lo = max(0, end_digit - WINDOW)
    start = lo
    for m in _SENTENCE_END_RE.finditer(text, lo, end_digit + 1):  # up to the digit: "4.5" is no sentence end
        start = m.end()
    m = _SENTENCE_END_RE.search(text, end_digit, end_digit + 200)
    end = m.start() if m is not None else min(len(text), end_digit + 200)
    e = _ENUMERATOR_RE.match(text, start, end)
    if e is not None:
        start = e.end()
    sentence = normalize(text[start:end])
    nums = unnegated(sentence, find_numbers(sentence))
    if not nums:
        return None
    pick = _pick(sentence, nums, qnums)
    if isinstance(pick, Answer):
        return pick
    check_hedges(sentence, pick)
    return _as_answer(sentence, pick)


def _pick(s: str, nums: list[Num], qnums: frozenset[Fraction]) -> Num | Answer:
    """Which number of sentence ``s`` is its answer."""
    why = _EXPLAIN_RE.search(s)
    if why is not None and nums[0].end <= why.start():  # "She has $35 left because she spent $65"
        s, nums = s[:why.start()], [n for n in nums if n.end <= why.start()]
    if _is_expression(s, nums):
        value = evaluate(s, nums)
        return Answer(s.strip()[:_MAX_TEXT], (value,) if value is not None else ())
    if "=" in s:
        side = _equation_result(s, nums)
        if side is not None:
            return side
    concl = None
    for concl in _CONCLUSION_RE.finditer(s):  # noqa: B007 - the last one counts
        pass
    pos = 0
    if concl is not None and nums[-1].start >= concl.end():
        pos = concl.end()
        nums = [n for n in nums if n.start >= pos]
    starts = [n.start for n in nums]
    for cop in _COPULA_RE.finditer(s, pos):
        i = bisect.bisect_left(starts, cop.end())
        if i < len(nums) and nums[i].start - cop.end() <= 2:
            return nums[i]
    return nums[0] if len(nums) == 1 else _choose(s, nums, qnums)


def _equation_result(s: str, nums: list[Num]) -> Num | None:
    """The rightmost side of an equation that is a value, not an expression (``6 × 7 = 42``, ``42 = 6 × 7``).
    """
    starts = [n.start for n in nums]
    sides = [m.end() for m in re.finditer("=", s)]
    for eq in reversed(sides):
        i = bisect.bisect_left(starts, eq)
        if i < len(nums) and _value_side(s, eq, nums[i]):
            return nums[i]
    if nums[0].end <= sides[0] and _value_side(s, 0, nums[0]):
        return nums[0]
    return None


def _value_side(s: str, side_start: int, n: Num) -> bool:
    return not s[side_start:n.start].strip(_LEAD_SKIP) and not _OPERATOR_AFTER_RE.match(s, n.end)


def _choose(s: str, nums: list[Num], qnums: frozenset[Fraction]) -> Num:
    """Several numbers and nothing that says which: of those that are neither the object of a preposition
    ("for 50 minutes", "in 3 weeks", "out of 7 dozen") nor an operand ("6 × 7"), those not taken from
    the question, the last."""
    main = [n for n in nums if not (_PREPOSITION_RE.search(s, max(0, n.start - 24), n.start)
                                    or _OPERATOR_AFTER_RE.match(s, n.end)
                                    or _OPERATOR_BEFORE_RE.search(s, max(0, n.start - 12), n.start))] or nums
    fresh = [n for n in main if qnums.isdisjoint(n.values)] or main
    return fresh[-1]


def _is_expression(s: str, nums: list[Num]) -> bool:
    """Whether ``s`` is arithmetic only (``6 × 7``, ``700 + 1``): numbers and operators, no ``=``."""
    if len(nums) < 2 or "=" in s:
        return False
    gaps = [s[a.end:b.start] for a, b in zip(nums, nums[1:])]
    rest = (s[:nums[0].start] + "".join(gaps) + s[nums[-1].end:]).replace("\\times", "×").replace(
        "\\cdot", "·").replace("\\div", "÷")
    return all(c in _EXPRESSION_CHARS for c in rest) and any(c in "+-*/×÷^·" for c in rest)


def _as_answer(text: str, n: Num) -> Answer:
    return Answer(text[n.start:n.end].strip(), n.values, n.measure)


def _last_digit(text: str) -> int:
    """Index of the last digit (or vulgar fraction) in ``text``; -1 if none."""
    last = max(text.rfind(d) for d in "0123456789")
    if not text.isascii():
        last = max(last, max(text.rfind(d) for d in _NUMBER_CHARS[10:]))
    return last


@lru_cache(maxsize=4096)
def _question_values(question: str) -> frozenset[Fraction]:
    return frozenset(v for n in find_numbers(normalize(question[:5000])) for v in n.values)
