"""Numbers as people and models write them, read exactly (as :class:`fractions.Fraction`).

:func:`find_numbers` finds every number written in digits and reads what is
around it: ``1,234`` / ``1 234`` / ``1{,}234`` (thousands), ``-5`` / ``−5`` /
``–5`` / ``- 5`` / ``negative 5`` / ``5 below zero``, ``3/4``, ``1 1/2`` / ``1½`` /
``1\\frac{1}{2}`` / ``1 and 1/2``, ``¾``, ``\\frac34`` / ``\\dfrac{3}{4}``,
``$70k`` / ``70 thousand`` / ``1.5 million`` / ``$2.4M`` / ``2 dozen``,
``18 dollars and 50 cents``, ``1.2e3`` / ``1.2 \\times 10^3``, ``25%``, and compound
quantities (``2 hours and 30 minutes``, ``5'6"``: :attr:`Num.measure`); the power of a
unit or a variable (the 2 of ``m^2``) is no number of its own.
:func:`find_number_words` reads numbers written in words ("forty-two",
"one hundred and five", "a dozen", "two thirds", "negative five": :mod:`nanogrpo.grading.number_words`).

A number can mean more than one value: ``25%`` is 25 (the reference is often the
bare number) and 1/4; ``2100 cents`` is 2100 and 21 (dollars). Those land in
:attr:`Num.values`, the written value first.

Every pattern is linear in the text (no nested unbounded repetition), numbers
longer than :data:`MAX_DIGITS` digits are skipped and exponents are bounded, so
adversarial input costs time proportional to its length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from nanogrpo.grading.number_words import AMBIGUOUS_DENOMS, BELOW_ZERO_RE, DENOMS, NEG_WORD_RE, word_numbers
from nanogrpo.grading.units import Measure, compound_at

__all__ = ["Num", "MAX_DIGITS", "normalize", "find_numbers", "find_number_words", "read_number",
           "leading_number"]

MAX_DIGITS = 30
"""Longer digit runs are not read as numbers (no answer has them; huge ints cost time)."""

_VULGAR = {"½": Fraction(1, 2), "⅓": Fraction(1, 3), "⅔": Fraction(2, 3), "¼": Fraction(1, 4),
           "¾": Fraction(3, 4), "⅕": Fraction(1, 5), "⅖": Fraction(2, 5), "⅗": Fraction(3, 5),
           "⅘": Fraction(4, 5), "⅙": Fraction(1, 6), "⅚": Fraction(5, 6), "⅐": Fraction(1, 7),
           "⅛": Fraction(1, 8), "⅜": Fraction(3, 8), "⅝": Fraction(5, 8), "⅞": Fraction(7, 8),
           "⅑": Fraction(1, 9), "⅒": Fraction(1, 10)}
_SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")

# One character for another, so indices stay valid: minus signs and dashes, the spaces used to
# group thousands, fraction slashes, full-width digits.
_TRANSLATE = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\u2010": "-", "\u2011": "-",
                            "\ufe63": "-", "\uff0d": "-", "\u00a0": " ", "\u2009": " ",
                            "\u202f": " ", "\u2007": " ", "\u200a": " ", "\u2044": "/", "\u2215": "/",
                            **{chr(0xFF10 + d): str(d) for d in range(10)}})


def normalize(text: str) -> str:
    """``text`` with Unicode minus signs (``−``, ``‐``, ``‑``, ``﹣``, ``－``, en dash), thin/no-break spaces,
    fraction slashes and full-width
    digits replaced by their ASCII forms (same length, so positions carry over)."""
    return text if text.isascii() else text.translate(_TRANSLATE)


_INT = r"[0-9]{1,3}(?:(?:,|\{,\}|\\,|\\ | )[0-9]{3})+(?![0-9])|[0-9]+"
_FRAC_ARG = r"(?:\{[ \t]{0,2}(-?[0-9]+(?:\.[0-9]+)?)[ \t]{0,2}\}|([0-9]))"
_FRAC = r"\\[dt]?frac[ \t]{0,2}" + _FRAC_ARG + r"[ \t]{0,2}" + _FRAC_ARG
_NUMBER_RE = re.compile(
    r"(?P<frac>" + _FRAC + r")"
    r"|(?P<vulgar>[" + "".join(_VULGAR) + r"])"
    r"|(?<![0-9.])(?P<num>(?:" + _INT + r")(?:\.[0-9]+)?|\.[0-9]+)"
)
_GROUP_SEP_RE = re.compile(r"\{,\}|\\,|\\ |[, ]")

# Extensions read at the end of a number: anchored (.match at the number's end) with bounded gaps,
# so each costs a constant, however the text goes on.
_GAP, _GAP1 = r"[ \t]{0,2}", r"[ \t]{1,2}"
_SLASH_RE = re.compile(r"/([0-9]{1,30})(?![0-9./])")  # MAX_DIGITS
_MIXED_RE = re.compile(
    r"(?:(?:" + _GAP1 + r"(?:and" + _GAP1 + r")?|-)([0-9]{1,6})/([0-9]{1,6})(?![0-9./]|\s{0,3}=)"
    r"|" + _GAP + r"([" + "".join(_VULGAR) + r"])"
    r"|" + _GAP + r"(?:and" + _GAP1 + r")?" + _FRAC +
    r"|" + _GAP1 + r"and" + _GAP1 + r"(?:a|one)" + _GAP1 + r"(half|third|quarter)\b)"
)
_DENOM_AFTER_RE = re.compile(r"[ \t]{1,2}([A-Za-z]{5,11})(?![-A-Za-z])")
_SCI_RE = re.compile(
    r"[eE]([+-]?[0-9]{1,2})(?![0-9])"
    r"|" + _GAP + r"(?:\\times|\\cdot|×|·|\*|x)" + _GAP + r"10" + _GAP +
    r"(?:\^" + _GAP + r"(?:\{" + _GAP + r"([+-]?[0-9]{1,2})" + _GAP + r"\}|([+-]?[0-9]{1,2}))"
    r"|([⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]{1,2}))"
)
_SCALE_WORD = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12,
               "k": 10**3, "m": 10**6, "mn": 10**6, "b": 10**9, "bn": 10**9, "hundred": 100,
               "dozen": 12, "dozens": 12}
_SCALE_RE = re.compile(r"(?:" + _GAP + r"(thousand|million|billion|trillion|hundred|dozens?)\b|([kK])\b"
                       r"|(M|B|bn|mn)\b)")
_PERCENT_RE = re.compile(_GAP + r"(?:%|\\%|percent\b|per ?cent\b)")
_DOLLARS = r"(?:dollars?|bucks|USD|\\text\{" + _GAP + r"dollars?" + _GAP + r"\})"
_CENTS_RE = re.compile(r"(?:" + _GAP1 + _DOLLARS + r")?"
                       r"(?:" + _GAP1 + r"and)?" + _GAP + r"([0-9]{1,2})" + _GAP + r"(?:cents?\b|¢)")
_CENTS_UNIT_RE = re.compile(_GAP + r"(?:cents?\b|¢)")
_UNIT_POWER_RE = re.compile(r"(?:[A-Za-z]|\\(?:text|mathrm|mbox|textrm)\s{0,2}\{[A-Za-z ]{1,20}\})"
                            r"\s{0,2}\^\s{0,2}\{?\s{0,2}-?$")
_SPACED_SIGN_RE = re.compile(r"(?:^|[=:(\[{$,\n]|\b(?:is|are|was|were|be|been|equals?|of|at|to|by|from|"
                             r"answer|"
                             r"result|total|value|change|difference|about|approximately))[ \t]{0,3}$",
                             re.IGNORECASE)
_PLAIN_AFTER = frozenset(",.;:!?)]}\n\r\"=+<>|&")
_CURRENCY = "$€£¥₹"


@dataclass(frozen=True)
class Num:
    """A number found in a text: ``text[start:end]`` reads as ``values[0]`` (others: other readings)."""

    start: int
    end: int
    values: tuple[Fraction, ...]
    words: bool = False
    """Written in words ("forty-two")."""
    measure: Measure | None = None
    """A compound quantity (``2 hours and 30 minutes``, ``$3 and 25 cents``): its kind and amount in the
    kind's smallest unit (:mod:`nanogrpo.grading.units`); ``values`` then hold its value in its first unit."""

    @property
    def value(self) -> Fraction:
        return self.values[0]


def _int(s: str) -> int | None:
    digits = _GROUP_SEP_RE.sub("", s)
    return int(digits) if 0 < len(digits) <= MAX_DIGITS else None


def _decimal(s: str) -> Fraction | None:
    if s.isdigit():  # the common case
        return Fraction(int(s)) if len(s) <= MAX_DIGITS else None
    whole, _, frac = s.partition(".")
    if len(whole) + len(frac) > MAX_DIGITS * 2:
        return None
    whole_v = _int(whole) if whole else 0
    if whole_v is None:
        return None
    return Fraction(whole_v) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)


def _frac_value(m: re.Match, base: int) -> Fraction | None:
    """Value of a ``\\frac`` whose numerator/denominator groups start at ``base``."""
    num = m.group(base) or m.group(base + 1)
    den = m.group(base + 2) or m.group(base + 3)
    n, d = _decimal(num.lstrip("-")), _decimal(den)
    if n is None or d is None or d == 0:
        return None
    return -n / d if num.startswith("-") else n / d


def _sign_before(text: str, start: int) -> int:
    """Where the minus sign of the number at ``start`` begins (``-5``, ``$-5``, ``-$5``, ``- 5``,
    ``negative 5``), or -1 when it has none."""
    i = start
    if i > 0 and text[i - 1] in _CURRENCY:
        i -= 1
        if i > 0 and text[i - 1] == "\\":
            i -= 1
    if i > 0 and text[i - 1] == "-":
        # "-5" after a space, bracket, "=" or the start, not "5-3" / "x-3" / "40-45" (a range or subtraction)
        negative = i < 2 or not (text[i - 2].isalnum() or text[i - 2] in ")]}.")
        return i - 1 if negative else -1
    j = i
    while j > 0 and i - j < 2 and text[j - 1] in " \t":
        j -= 1
    if i - j and j > 0 and text[j - 1] == "-" and _SPACED_SIGN_RE.search(text, max(0, j - 24), j - 1):
        return j - 1  # "- 5" after "=", "is", a bracket or the start; "10 - 5", "x - 5" subtract
    m = NEG_WORD_RE.search(text, max(0, i - 12), i)
    if m is None:
        return -1
    if m.group(0)[0] in "mM":
        before = text[max(0, m.start() - 8):m.start()].rstrip()
        if before and (before[-1].isdigit() or before[-1] in ")]}"):
            return -1  # "10 minus 5" subtracts
    return m.start()


def _is_power(text: str, start: int) -> bool:
    """Whether the number at ``start`` is the exponent of a unit or a variable (``m^2``, ``x^{-1}``)."""
    j = start
    while j > 0 and start - j < 4 and text[j - 1] in " \t{-":
        j -= 1
    return j > 0 and text[j - 1] == "^" and _UNIT_POWER_RE.search(text, max(0, start - 40), start) is not None


def _currency_before(text: str, start: int) -> bool:
    return start > 0 and (text[start - 1] in _CURRENCY or (start > 1 and text[start - 2] in _CURRENCY
                                                          and text[start - 1] == " "))


def find_numbers(text: str) -> list[Num]:
    """Every number written with digits (or ``\\frac``, ``½``) in ``text``, in order. ``text`` should
    have been through :func:`normalize`."""
    out: list[Num] = []
    pos = 0
    n = len(text)
    while pos < n:
        m = _NUMBER_RE.search(text, pos)
        if m is None:
            break
        start, end = m.start(), m.end()
        pos = end
        kind = m.lastgroup
        if kind == "num" and _is_power(text, start):
            continue  # the 2 of "m^2", "\\text{ cm}^{2}", "x^2": a power, not a number of its own
        value: Fraction | None
        alt: Fraction | None = None
        is_int = False
        if kind == "frac":
            value = _frac_value(m, 2)
        elif kind == "vulgar":
            value = _VULGAR[m.group("vulgar")]
        else:
            raw = m.group("num")
            value = _decimal(raw)
            is_int = "." not in raw
        if value is None:
            continue
        if end == n or text[end] in _PLAIN_AFTER:  # nothing can extend it: the common case, fast
            sign = _sign_before(text, start)
            out.append(Num(start, end, (value,)) if sign < 0 else Num(sign, end, (-value,)))
            pos = end
            continue
        if is_int:
            s = _SLASH_RE.match(text, end)
            if s is not None:
                den = int(s.group(1))
                if den == 0:
                    continue
                value, end, is_int = value / den, s.end(), False
            else:
                mixed = _MIXED_RE.match(text, end)
                part = _mixed_part(mixed) if mixed is not None else None
                if part is not None and 0 < part < 1:
                    value, end, is_int = value + part, mixed.end(), False
                else:
                    den = _DENOM_AFTER_RE.match(text, end)
                    word = den.group(1).lower() if den is not None else ""
                    if word in DENOMS and word != "half" and value and (value == 1) != word.endswith("s"):
                        # "2 thirds"; "3 quarters" is also 3 coins
                        alt = value if word in AMBIGUOUS_DENOMS else None
                        value, end, is_int = value / DENOMS[word], den.end(), False
        sci = _SCI_RE.match(text, end)
        if sci is not None and kind == "num":
            exp_text = (sci.group(1) or sci.group(2) or sci.group(3)
                        or (sci.group(4) or "").translate(_SUPERSCRIPT))
            value, end = value * Fraction(10) ** int(exp_text), sci.end()
        currency = _currency_before(text, start)
        scale = _SCALE_RE.match(text, end)
        if scale is not None and (scale.group(3) in (None, "M") or currency):
            word = next(g for g in scale.groups() if g is not None).lower()
            value, end = value * _SCALE_WORD[word], scale.end()
        values = [value] if alt is None else [value, alt]
        measure = None
        pct = _PERCENT_RE.match(text, end)
        compound = None
        if pct is None and end < n and (text[end] in " \t'′}" or text[end].isalpha()):
            compound = compound_at(text, end, value)
        if pct is not None:
            values.append(value / 100)
            end = pct.end()
        elif compound is not None:  # "2 hours and 30 minutes", "5 ft 6 in", "3 dollars and 25 cents"
            end, measure, first = compound
            values = [first]
        else:
            cents = _CENTS_RE.match(text, end) if is_int else None
            if cents is not None:
                values = [value + Fraction(int(cents.group(1)), 100)]
                end = cents.end()
                measure = ("money", values[0] * 100)
            else:
                unit = _CENTS_UNIT_RE.match(text, end)
                if unit is not None:
                    values.append(value / 100)
        sign = _sign_before(text, start)
        below = BELOW_ZERO_RE.match(text, end)
        if below is not None:
            end = below.end()
        if (below is not None) != (sign >= 0):
            values = [-v for v in values]
            measure = (measure[0], -measure[1]) if measure is not None else None
        out.append(Num(sign if sign >= 0 else start, end, tuple(values), measure=measure))
        pos = end
    return out


def _mixed_part(m: re.Match) -> Fraction | None:
    if m.group(1) is not None:
        d = int(m.group(2))
        return Fraction(int(m.group(1)), d) if d else None
    if m.group(3) is not None:
        return _VULGAR[m.group(3)]
    if m.group(8) is not None:
        return {"half": Fraction(1, 2), "third": Fraction(1, 3), "quarter": Fraction(1, 4)}[m.group(8)]
    return _frac_value(m, 4)


def find_number_words(text: str) -> list[Num]:
    """Numbers written in words, in order (:func:`nanogrpo.grading.number_words.word_numbers`)."""
    return [Num(start, end, values, words=True) for start, end, values in word_numbers(text)]


_FULL_RE = re.compile(r"\s*(?:(?:\\?\$|[€£¥₹])\s*)?")


def read_number(text: str) -> Num | None:
    """``text`` as one number when the whole of it is one (currency, ``%`` and unit words aside):
    ``"$1,234.50"``, ``"-3/4"``, ``"\\frac{1}{2}"``, ``"forty-two"``. Used for reference answers."""
    t = normalize(text).strip().rstrip(".")
    num = leading_number(t)
    if num is None or _has_digits(t[num.end:]):
        return None
    return num


def leading_number(text: str) -> Num | None:
    """The one number of ``text`` (normalised) when ``text`` starts with it (currency aside), whatever
    follows it (a unit with a power: ``12 m^2``): written with digits, else in words; None otherwise."""
    nums = find_numbers(text)
    if len(nums) == 1:
        return nums[0] if _FULL_RE.fullmatch(text[:nums[0].start]) else None
    if not nums:
        words = find_number_words(text)
        if len(words) == 1 and not text[:words[0].start].strip():
            return words[0]
    return None


def _has_digits(s: str) -> bool:
    return any(c.isdigit() for c in s)
