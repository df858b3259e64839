"""Built-in rewards: plain functions ``fn(completion, sample) -> float``.

``completion`` is decoded text without EOS/special tokens; ``sample`` is the
dataset row, whose ``"answer"`` holds the reference answer string.

- :func:`correctness`: +1 when the extracted answer equals the reference, else -1
  (seed: last number, verified with math_verify; nanogrpo first looks inside
  ``<answer>``, see :mod:`nanogrpo.rewards.extract`). Plain numbers are compared
  exactly as fractions in microseconds; anything else goes to math_verify.
- :func:`format_reward`: the seed's 1.25 / -1 for ``<think>..</think><answer>..</answer>``.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

from nanogrpo.rewards.extract import extract_answer, last_number

__all__ = ["BUILTIN", "correctness", "format_reward", "answers_match"]

_FORMAT_RE = re.compile(r"^<think>.*?</think><answer>.*?</answer>$", re.DOTALL)

# "$1,234.50", "-18", "3/4", ".5", "72 apples", "18 dollars." -> a number (units dropped).
_PLAIN_RE = re.compile(
    r"^(?:\\?\$\s*)?(-?)\s*(?:\\?\$\s*)?"
    r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)"
    r"(?:\s*[A-Za-z][A-Za-z ]*)?\.?$"
)

# math_verify's own timeout uses signal.alarm, which only works on the main thread.
_MV_TIMEOUT_S = 5


def _as_number(text: str) -> Fraction | None:
    """``text`` as an exact number when it is a plain number (optionally $ and unit words)."""
    m = _PLAIN_RE.match(text.strip())
    if m is None:
        return None
    try:
        return Fraction(m.group(1) + m.group(2).replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _mv_timeout() -> int | None:
    """math_verify's signal-based timeout where it can work (main thread), else None."""
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[Any, ...]:
    """math_verify parse with LaTeX and plain-expression extraction (cached: references repeat G times)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    parsed = parse(text, extraction_config=configs, parsing_timeout=_mv_timeout())
    if not parsed:
        # math_verify gives up on e.g. "\$18": retry on the last number alone.
        num = last_number(text)
        if num is not None and num != text:
            parsed = parse(num.replace(",", ""), extraction_config=configs, parsing_timeout=_mv_timeout())
    return tuple(parsed)


def answers_match(pred: str, ref: str) -> bool:
    """Whether answer ``pred`` equals reference ``ref`` mathematically."""
    a, b = _as_number(pred), _as_number(ref)
    if a is not None and b is not None:
        return a == b  # exact, as math_verify judges plain numbers (0.333 != 1/3)
    from math_verify import verify

    gold, guess = _parse(ref), _parse(pred)
    if not gold or not guess:
        return False
    return bool(verify(list(gold), list(guess), timeout_seconds=_mv_timeout()))


def correctness(completion: str, sample: dict[str, Any]) -> float:
    """+1.0 if the completion's answer equals ``sample["answer"]``, else -1.0 (also when none is found)."""
    pred = extract_answer(completion)
    if pred is None:
        return -1.0
    return 1.0 if answers_match(pred, str(sample["answer"])) else -1.0


def format_reward(completion: str, sample: dict[str, Any]) -> float:
    """1.25 if the stripped completion is exactly ``<think>..</think><answer>..</answer>``, else -1.0."""
    return 1.25 if _FORMAT_RE.match(completion.strip()) else -1.0


BUILTIN = {"correctness": correctness, "format": format_reward}
