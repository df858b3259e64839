"""Quantities as people write them: a number's unit, a compound quantity, and the unit or the scale a
question asks in.

- :func:`unit_span` / :func:`unit_end`: where the unit written after a number ends, however it is
  written: words and abbreviations (``cm``, ``sq ft``, ``mph``, ``apples``), powers (``m^2``, ``m²``,
  ``cm^{3}``), rates (``km/h``, ``m/s^2``, ``/hour``, ``per day``, ``an hour``), degrees (``°F``,
  ``^\\circ C``, ``\\degree``), LaTeX text (``\\text{ m}^2``, ``\\mathrm{km/h}``). A single letter is a
  unit only when it is one (``m``, ``s``, ``h``, ``g``, ``L``, ``K``...), so ``5 x^2`` is no quantity;
  :func:`drop_units` takes the units after a text's numbers off, so that their powers and slashes are
  not read as math;
- :func:`compound_at`: a quantity in two or three units of one kind (``2 hours and 30 minutes``,
  ``5 ft 6 in``, ``5'6"``, ``3 dollars and 25 cents``, ``1 year 6 months``), as its amount in the
  kind's smallest unit;
- :func:`asked_unit` / :func:`asked_scale`: the unit ("Give the answer in minutes.", ``How many minutes
  …?``, ``… in hours?``) or the scale (``in millions``, ``how many thousand …``) the question's asking
  sentence names, or None; :func:`in_asked_unit` and :func:`with_scale` read an answer's value in them.

No pattern here can backtrack without bound; every scan is anchored or bounded.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

__all__ = ["Measure", "UNITS", "unit_end", "unit_span", "drop_units", "compound_at", "asked_unit",
           "asked_scale", "in_asked_unit", "with_scale"]

Measure = tuple[str, Fraction]
"""A compound quantity: its kind (``time``, ``length``...) and its amount in that kind's smallest unit."""

UNITS: dict[str, tuple[str, Fraction]] = {}
"""Unit word (lower case) -> (kind, size in the kind's smallest unit)."""


def _add(kind: str, size: int, *names: str) -> None:
    for n in names:
        UNITS[n] = (kind, Fraction(size))


_add("time", 1, "second", "seconds", "sec", "secs", "s")
_add("time", 60, "minute", "minutes", "min", "mins")
_add("time", 3600, "hour", "hours", "hr", "hrs", "h")
_add("time", 86400, "day", "days")
_add("time", 604800, "week", "weeks", "wk", "wks")
_add("age", 1, "month", "months", "mo", "mos")
_add("age", 12, "year", "years", "yr", "yrs")
_add("length", 1, "inch", "inches", "in", '"', "″", "''")
_add("length", 12, "foot", "feet", "ft", "'", "′")
_add("length", 36, "yard", "yards", "yd", "yds")
_add("length", 63360, "mile", "miles", "mi")
_add("metric", 1, "millimeter", "millimeters", "millimetre", "millimetres", "mm")
_add("metric", 10, "centimeter", "centimeters", "centimetre", "centimetres", "cm")
_add("metric", 1000, "meter", "meters", "metre", "metres", "m")
_add("metric", 1000000, "kilometer", "kilometers", "kilometre", "kilometres", "km")
_add("weight", 1, "ounce", "ounces", "oz")
_add("weight", 16, "pound", "pounds", "lb", "lbs")
_add("mass", 1, "gram", "grams", "g")
_add("mass", 1000, "kilogram", "kilograms", "kg")
_add("money", 1, "cent", "cents", "¢")
_add("money", 100, "dollar", "dollars", "bucks")
_add("volume", 1, "cup", "cups")
_add("volume", 2, "pint", "pints", "pt")
_add("volume", 4, "quart", "quarts", "qt")
_add("volume", 16, "gallon", "gallons", "gal")
_add("liquid", 1, "milliliter", "milliliters", "millilitre", "millilitres", "ml")
_add("liquid", 1000, "liter", "liters", "litre", "litres", "l")

_DEFAULT_UNIT = {"money": Fraction(100)}
"""The unit a kind is read in when the question names none: money in dollars (GSM8K's convention)."""

# ----------------------------------------------------------------------------- a number's unit

_LETTER_UNITS = frozenset("m s h g l L K C F J N W V".split())
"""Single letters that are units (not variables) after a number."""
_NOT_UNITS = frozenset(
    "pi sqrt frac sin cos tan cot sec csc log ln exp lim max min gcd lcm mod det arcsin arccos arctan sinh "
    "cosh tanh infty inf cup cap pm mp le ge leq geq ne neq to in or and nor not than times cdot div "
    "hundred hundreds thousand thousands million millions billion billions trillion trillions dozen dozens "
    "k K M B bn mn".split())
"""Words that end a quantity rather than name its unit (math, alternatives, operators)."""
_SHORT_UNITS = frozenset("cm mm km ft yd mi oz lb kg mg ml mL hr kW Wh sq cu mo wk yr mph kph kmh fl pt qt "
                         "ha ac GB MB KB TB Hz Pa kJ kWh lbs yds hrs mins secs".split())
_UNIT_WORDS = frozenset("square cubic degree degrees celsius fahrenheit kelvin unit units".split())
_TEXT_RE = re.compile(r"\\(?:text|mathrm|mbox|textrm|operatorname|rm|textnormal)\s{0,2}\{([^{}\\]{0,40})\}")
_DEGREE_RE = re.compile(r"°|º|˚|\\degree\b|\^\s{0,2}(?:\{\s{0,2}\\circ\s{0,2}\}|\\circ\b)"
                        r"|\^\s{0,2}\{\s{0,2}(?:\\text\s{0,2}\{\s{0,2}o\s{0,2}\}|o)\s{0,2}\}")
_WORD_RE = re.compile(r"[A-Za-zµμΩ]{1,20}\.?")
_POWER_RE = re.compile(r"\s{0,2}(?:\^\s{0,2}(?:\{\s{0,2}-?[1-4]\s{0,2}\}|-?[1-4](?![0-9]))|⁻?[¹²³⁴])")
_SEP_RE = re.compile(r"\s{0,2}(?:/|\\cdot|·|⋅|\*|-|\\,|\\ |~)\s{0,2}|\s{1,3}(?:per|an?)\s{1,3}|\s{1,3}")
_LEAD_RE = re.compile(r"(?:[ \t]|\\[,;: !]|~){0,4}(?:/|(?:per|an?)[ \t]{1,3})?")
_MAX_ATOMS = 6


def _unit_word(w: str) -> bool:
    """Whether ``w`` (letters, perhaps a period) can name a unit."""
    bare = w.rstrip(".")
    if len(bare) == 1:
        return bare in _LETTER_UNITS
    low = bare.lower()
    if low in _NOT_UNITS:
        return False
    return len(bare) >= 3 or bare in _SHORT_UNITS or low in UNITS


def unit_end(text: str, pos: int = 0) -> int:
    """Where the unit that starts at ``text[pos:]`` (after optional spaces) ends, when the rest of
    ``text`` is that unit and nothing else (-1 otherwise: a variable, an operator, a second number)."""
    found = unit_span(text, pos)
    return len(text) if found is not None and not text[found[0]:].strip() else -1


def unit_span(text: str, pos: int = 0, depth: int = 0) -> tuple[int, bool] | None:
    """``(end, marked)`` of the longest unit that starts at ``text[pos:]`` (after optional spaces), or
    None when none does; ``marked``: it is a unit by its form (a power, a rate, a degree sign,
    ``\\text{}``) or a known unit (``cm``, ``mph``, ``m``), not only a word (``apples``)."""
    i = _LEAD_RE.match(text, pos).end()  # "$12/hour", "$12 an hour", "12\\,\\text{m}"
    marked = text[pos:i].strip().startswith("/")
    end = -1
    joined = False
    for _ in range(_MAX_ATOMS):
        m = _DEGREE_RE.match(text, i)
        if m is not None:
            i, marked = m.end(), True
            if text[i:i + 1].isalpha():
                m = _WORD_RE.match(text, i)  # "°F"
                if m is None or not _unit_word(m.group(0)):
                    return None
                i = m.end()
        elif (m := _TEXT_RE.match(text, i)) is not None:
            inner = m.group(1)
            if inner.strip():
                found = None if depth else unit_span(inner, 0, 1)
                if found is None or inner[found[0]:].strip():
                    break
            i, marked = m.end(), True
        else:
            m = _WORD_RE.match(text, i)
            if m is None or not _unit_word(m.group(0)):
                break
            word = m.group(0).rstrip(".")
            known = (word in _LETTER_UNITS or word in _SHORT_UNITS or word.lower() in UNITS
                     or word.lower() in _UNIT_WORDS)
            if end != -1 and not known and not joined:
                break  # "12 m long": a word after a space is the sentence going on, not the unit
            i = m.end()
            marked = marked or known
        p = _POWER_RE.match(text, i)
        if p is not None:
            i, marked = p.end(), True
        end = i
        sep = _SEP_RE.match(text, i)
        if sep is None:
            break
        joined = sep.group(0).strip() in ("/", "\\cdot", "·", "⋅", "*", "-", "per", "a", "an")
        marked = marked or joined
        i = sep.end()
    return (end, marked) if end != -1 else None


_AFTER_NUMBER_RE = re.compile(r"[0-9](?=[ \t]{0,2}(?:[A-Za-z°º˚/^]|\\(?:text|mathrm|mbox|textrm|degree|,)))")


def drop_units(text: str) -> str:
    """``text`` without the units written after its numbers (``96 m^2 (12 × 8)`` -> ``96 (12 × 8)``), so
    that a unit's power or slash is not taken for math; plain words stay (``42 apples``)."""
    out, last = [], 0
    for m in _AFTER_NUMBER_RE.finditer(text):
        if m.start() < last:
            continue
        found = unit_span(text, m.end())
        if found is not None and found[1]:
            out.append(text[last:m.end()])
            last = found[0]
    return "".join(out) + text[last:] if out else text


# ----------------------------------------------------------------------------- compound quantities

def _part(k: int) -> str:
    """One more part of a compound quantity: a separator (``,``, ``and``), a number, its unit."""
    return (r"[ \t]{0,2}\}?(?:[ \t]{0,2},)?(?:[ \t]{1,2}and)?[ \t]{0,2}"
            rf"(?P<n{k}>[0-9]{{1,4}}(?:\.[0-9]{{1,4}})?)(?![0-9./])[ \t]{{0,2}}"
            rf"(?P<u{k}>[A-Za-z]{{1,12}}|[\"″¢]|'')")


_COMPOUND_RE = re.compile(r"[ \t]{0,2}(?P<u1>[A-Za-z]{1,12}|['′])\.?" + _part(2) + r"(?:\.?" + _part(3) + ")?"
                          r"(?![A-Za-z0-9])[ \t]{0,2}\}?")


def _unit(word: str, kind: str | None = None) -> tuple[str, Fraction] | None:
    if word == "m" and kind == "time":
        return UNITS["min"]  # "2h 30m"
    found = UNITS.get(word) or UNITS.get(word.lower())
    if found is None or (kind is not None and found[0] != kind):
        return None
    return found


def compound_at(text: str, end: int, value: Fraction) -> tuple[int, Measure, Fraction] | None:
    """A compound quantity whose first number (``value``) ends at ``end``: ``(end of the quantity,
    (kind, amount in the kind's smallest unit), value in its first unit)``, or None. Each part's unit
    is smaller than the one before it and of the same kind."""
    m = _COMPOUND_RE.match(text, end)
    if m is None:
        return None
    first = _unit(m.group("u1"))
    if first is None:
        return None
    kind, size = first
    amount = value * size
    for k in (2, 3):
        word = m.group(f"u{k}")
        if word is None:
            break
        part = _unit(word, kind)
        if part is None or part[1] >= size:
            return None
        size = part[1]
        amount += Fraction(m.group(f"n{k}")) * size
    return m.end(), (kind, amount), amount / first[1]


# ----------------------------------------------------------------------------- what the question asks

_SENTENCE_RE = re.compile(r"[^.?!\n]*\?|[^.?!\n]+[.!]?\s*$")
_HOW_MANY_RE = re.compile(r"\bhow\s{1,3}(?:many|much)\s{1,3}"
                          r"(?:(?:more|fewer|less|total|whole|full|square|cubic)\s{1,3})?([a-z]{2,12})\b")
_IN_UNIT_RE = re.compile(r"\b(?:in|into|in\s{1,3}terms\s{1,3}of|as)\s{1,3}(?:(?:whole|full|total)\s{1,3})?"
                         r"([a-z]{2,12})\b")
_INSTRUCTION_RE = re.compile(r"\b(?:answer|express|give|write|state|report|round)\b[^.?!]{0,40}?\bin\s{1,3}"
                             r"(?:(?:whole|full|total)\s{1,3})?([a-z]{2,12})\b")
_WORDS_RE = re.compile(r"[a-z]{2,12}")
_SCALE_RE = re.compile(r"\b(?:in|how\s{1,3}many|number\s{1,3}of)\s{1,3}(?:[a-z]{1,12}\s{1,3})?"
                       r"(thousands?|millions?|billions?|trillions?)\b")
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}


@lru_cache(maxsize=4096)
def _asking(question: str) -> str:
    """The question's asking part, lower-cased: from its last sentence that ends in "?" (with any
    instruction after it, "Answer in minutes."), else its last sentence."""
    q = question[-2000:].lower()
    last = None
    for m in _SENTENCE_RE.finditer(q):
        if m.group(0).rstrip().endswith("?"):
            last = m
    if last is not None:
        return q[last.start():]
    found = list(_SENTENCE_RE.finditer(q))
    return found[-1].group(0) if found else q


def _question_unit(word: str, kind: str) -> Fraction | None:
    if word == "in" or len(word) < 2:
        return None  # "in" is a preposition here; single letters are variables
    found = UNITS.get(word)
    return found[1] if found is not None and found[0] == kind else None


@lru_cache(maxsize=4096)
def asked_unit(question: str | None, kind: str) -> Fraction | None:
    """The size of the unit of ``kind`` the question asks its answer in ("Give your answer in inches.",
    then "How many minutes …", then "… in hours?"), or None when it names none or several."""
    if not question:
        return None
    ask = _asking(question)
    for pattern in (_INSTRUCTION_RE, _HOW_MANY_RE, _IN_UNIT_RE):
        for m in pattern.finditer(ask):
            size = _question_unit(m.group(1), kind)
            if size is not None:
                return size
    sizes = {s for w in _WORDS_RE.findall(ask) if (s := _question_unit(w, kind)) is not None}
    return sizes.pop() if len(sizes) == 1 else None


@lru_cache(maxsize=4096)
def asked_scale(question: str | None) -> int | None:
    """The scale the question asks its answer in ("in millions", "how many thousand dollars"), or None."""
    if not question:
        return None
    m = _SCALE_RE.search(_asking(question))
    return _SCALES[m.group(1).rstrip("s")] if m is not None else None


def in_asked_unit(measure: Measure, question: str | None) -> Fraction | None:
    """A compound quantity's value in the unit the question asks for (money: dollars unless it asks
    for cents); None when the question does not say (the stricter reading: no value is taken)."""
    kind, amount = measure
    size = asked_unit(question, kind) or _DEFAULT_UNIT.get(kind)
    return amount / size if size is not None else None


def with_scale(values: tuple[Fraction, ...], question: str | None) -> tuple[Fraction, ...]:
    """``values`` plus each one read in the scale the question asks in (``1.5 million`` or
    ``1,500,000`` is 1.5 when it asks in millions); a value below that scale gains nothing."""
    scale = asked_scale(question)
    if scale is None:
        return values
    return values + tuple(v / scale for v in values if abs(v) >= scale)
