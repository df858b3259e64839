"""Math equivalence through math_verify, bounded and cached.

math_verify needs ``$…$`` (or ``\\boxed{}``) around bare LaTeX to find it, and its own timeouts use
``signal.alarm``, which works only in the main thread: elsewhere they are off and the caller bounds
the time (reward worker processes, each call under a deadline). Before sympy sees a text, what could
cost it seconds is refused (:func:`safe`: long texts, factorials, long digit runs, big or stacked
powers). Parses and verdicts are cached: a reference repeats for every completion of its group, and
a group's completions often give the same answer; a call that ran out of time is not (:class:`TimedOut`).
"""

from __future__ import annotations

import functools
import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

__all__ = ["equal", "region_equal", "safe", "rational_value", "TimedOut", "IRRATIONAL", "MAX_CHARS"]

TIMEOUT_S = 5
MAX_CHARS = 400
"""Longest answer handed to sympy (a 3x3 matrix of fractions fits)."""
MAX_REGION = 400
"""Longest stretch of text math_verify is asked to find an answer in (its patterns cost time
quadratic in the text for some inputs: ~100 ms at 1,200 characters of ``\\(``)."""
MAX_DELIMITERS = 12
"""More math delimiters than this in a region and only its last :data:`SHORT_REGION` characters are read."""
SHORT_REGION = 160
MAX_DEPTH = 10
"""Deepest nesting of brackets and braces handed to sympy (its LaTeX parser recurses on each)."""
_UNSAFE_RE = re.compile(r"(?<!\\)!(?!=)|[0-9]{16}|\^\s*\{?\s*-?[0-9]{3}|\^[^\^]{0,40}\^"
                        r"|\\(?:int|sum|prod|lim)\b")
_MAX_OPERATORS = 24
IRRATIONAL = "irrational"


def _timeout() -> int | None:
    """math_verify's signal-based timeout where it can work (the main thread), else None."""
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def safe(text: str, limit: int = MAX_CHARS) -> bool:
    """Whether sympy may be asked about ``text`` without risking seconds."""
    return (len(text) <= limit and not _UNSAFE_RE.search(text)
            and sum(text.count(c) for c in "+-*/^") <= _MAX_OPERATORS and _depth(text) <= MAX_DEPTH)


def _depth(text: str) -> int:
    depth = deepest = 0
    for c in text:
        if c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth -= 1
    return deepest


class TimedOut(Exception):
    """math_verify ran out of its time (:data:`TIMEOUT_S`): on a loaded machine a call that is normally
    fast can. The verdict of that call is "not shown equal", and it is not cached (:func:`_cached`), so
    the same answer is asked again next time instead of being graded wrong for the rest of the run."""


def _cached(maxsize: int, on_timeout: Any):
    """``lru_cache`` for a verdict, except that a call that timed out (:class:`TimedOut`, from any parse
    or comparison under it) answers ``on_timeout`` and leaves no entry."""
    def wrap(fn):
        inner = lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args):
            try:
                return inner(*args)
            except TimedOut:
                return on_timeout

        call.cache_clear, call.cache_info = inner.cache_clear, inner.cache_info
        return call
    return wrap


def _math_verify(fn, *args, failed: Any, **kw):
    """``fn`` (math_verify's ``parse`` or ``verify``) with its errors read as it reads them itself
    (``failed``), except a timeout, which raises :class:`TimedOut`."""
    from math_verify.errors import TimeoutException

    try:
        return fn(*args, raise_on_error=True, **kw)
    except TimeoutException:
        raise TimedOut() from None
    except Exception:  # noqa: BLE001 (math_verify's own rule with raise_on_error=False)
        return failed


@lru_cache(maxsize=8192)
def parse_latex(text: str) -> tuple[Any, ...]:
    """math_verify's reading of bare LaTeX ``text`` (delimited here so that it is found whole); raises
    :class:`TimedOut` (and caches nothing) when it runs out of time."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return tuple(_math_verify(parse, f"${text}$", failed=[], parsing_timeout=_timeout(),
                              extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()]))


@lru_cache(maxsize=4096)
def parse_region(text: str) -> tuple[Any, ...]:
    """math_verify's own reading of a stretch of text (it finds the answer in it: the last
    delimited math, an "answer is …", a box, else a number); raises :class:`TimedOut` as
    :func:`parse_latex`."""
    from math_verify import parse

    return tuple(_math_verify(parse, text, failed=[], parsing_timeout=_timeout()))


def _verify(gold: tuple[Any, ...], guess: tuple[Any, ...]) -> bool:
    from math_verify import verify

    if not gold or not guess:
        return False
    g, p = _single(gold[0]), _single(guess[0])
    if _one_against_many(g, p) or _one_against_many(p, g) or _clearly_different(g, p):
        return False
    return bool(_math_verify(verify, list(gold), list(guess), failed=False, timeout_seconds=_timeout()))


def _single(x: Any) -> Any:
    """The element of a one-element set (``1, 1`` is ``{1}``), else ``x``."""
    import sympy

    if isinstance(x, sympy.FiniteSet) and len(x) == 1:
        return next(iter(x))
    return x


def _one_against_many(one: Any, many: Any) -> bool:
    """A single value against a set or tuple of several: never equal (math_verify would still compare
    them as sets, slowly)."""
    import sympy

    return (isinstance(one, sympy.Expr) and not isinstance(one, sympy.Tuple)
            and isinstance(many, (sympy.FiniteSet, sympy.Tuple)) and len(many) > 1)


_POINTS = (0.7390851332, 1.3247179572)
"""Where expressions are evaluated to tell them apart (positive, away from 0, 1 and each other)."""


def _value_at(x: Any, point: float) -> complex:
    """``x`` at ``point`` (its i-th variable, by name, at ``point + 0.1123 * i``)."""
    names = sorted(x.free_symbols, key=lambda s: s.name)
    return complex(x.subs({s: point + 0.1123 * i for i, s in enumerate(names)}).evalf(20))


def _clearly_different(gold: Any, guess: Any) -> bool:
    """Whether two parsed answers are expressions (no set, relation, matrix or percent) whose values
    differ by more than any rounding math_verify allows, at a number or two: math_verify would go on to
    sympy's ``simplify``, which takes tens of milliseconds to say the same (``\\frac{\\sqrt3}{2}`` or
    ``x^2+7x+10`` against a wrong ``1``). Answers with different variables are left to math_verify
    (it reads ``ab`` as ``a b``), except a number against an expression that is not constant."""
    import sympy

    def far(a: complex, b: complex) -> bool:
        return abs(a - b) > 1e-4 * max(1.0, abs(a), abs(b))

    try:
        if not all(isinstance(x, sympy.Expr) and not x.has(sympy.UnevaluatedExpr) for x in (gold, guess)):
            return False
        gold, guess = gold.doit(), guess.doit()
        names_g = {s.name for s in gold.free_symbols}
        names_p = {s.name for s in guess.free_symbols}
        if not all(n.isalpha() and len(n) == 1 for n in names_g | names_p):
            return False  # \\text{odd}, \\text{3}, x_1: symbols math_verify compares by name
        if names_g == names_p:
            return any(far(_value_at(gold, p), _value_at(guess, p)) for p in _POINTS)
        if names_g and not names_p:
            return far(_value_at(gold, _POINTS[0]), _value_at(gold, _POINTS[1]))
        if names_p and not names_g:
            return far(_value_at(guess, _POINTS[0]), _value_at(guess, _POINTS[1]))
    except (TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError, RecursionError):
        return False
    return False


@_cached(maxsize=8192, on_timeout=False)
def equal(pred: str, ref: str) -> bool:
    """Whether LaTeX answer ``pred`` equals reference ``ref`` (both bare, wrappers already taken off)."""
    if not safe(pred) or not safe(ref):
        return False
    return _verify(parse_latex(ref), parse_latex(pred))


@_cached(maxsize=4096, on_timeout=False)
def region_equal(region: str, ref: str) -> bool:
    """Whether the answer math_verify reads in ``region`` (its last :data:`MAX_REGION` characters)
    equals reference ``ref``."""
    region = region[-MAX_REGION:]
    if sum(region.count(d) for d in ("$", "\\(", "\\[", "\\boxed")) > MAX_DELIMITERS:
        region = region[-SHORT_REGION:]
    if not safe(ref) or _UNSAFE_RE.search(region) or _depth(region) > 3 * MAX_DEPTH:
        return False
    guess = parse_region(region)
    if not guess or not safe(str(guess[-1])):
        return False
    return _verify(parse_latex(ref), guess)


@_cached(maxsize=4096, on_timeout=None)
def rational_value(ref: str) -> Fraction | str | None:
    """The exact value of reference ``ref`` when it is a rational number (``2^{10}``, ``\\sqrt{2.25}``),
    :data:`IRRATIONAL` when it is a number not known to be rational (``\\frac{\\sqrt3}{2}``, ``2\\pi``,
    ``\\log_2 3``), None when it is no number (a set, an expression in ``x``, unreadable)."""
    if not safe(ref):
        return None
    parsed = parse_latex(ref)
    if not parsed:
        return None
    value = parsed[0]
    try:
        import sympy

        if not isinstance(value, sympy.Expr):
            return None
        value = value.doit()
        if value.free_symbols or not value.is_number:
            return None
        value = sympy.nsimplify(value) if value.is_Float else value
        if value.is_Rational:
            return Fraction(int(value.p), int(value.q))
        return IRRATIONAL  # a number not known to be rational: no finite decimal is it exactly
    except (TypeError, ValueError, AttributeError, RecursionError):
        return None


def clear_caches() -> None:
    """Forget every parse and verdict (benchmarks time cold calls with it)."""
    for fn in (parse_latex, parse_region, equal, region_equal, rational_value):
        fn.cache_clear()
