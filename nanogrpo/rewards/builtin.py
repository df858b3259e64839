"""Built-in rewards: plain functions ``fn(completion, sample) -> float``.

``completion`` is decoded text without EOS/special tokens; ``sample`` is the
dataset row (``"answer"`` holds the reference answer string, ``"question"`` the
question) plus the reserved key ``"finish_reason"``: ``"stop"`` when the model
ended the completion, ``"length"`` when the token limit cut it off (set by the
rollout for every completion; absent when a reward is called directly).

- :func:`correctness`: +1 when the completion's final answer (read as a grader
  reads it, :mod:`nanogrpo.rewards.extract`) equals the reference, else -1.
  Numbers are compared exactly, as fractions (``1,234.0`` = ``1234``, ``3/4`` =
  ``0.75``, ``0.333`` != ``1/3``, ``25%`` = ``25``); answers that are not plain
  numbers go to math_verify. The seed compared the last number in the text.
- :func:`format_reward`: 1.25 / -1, the seed's format made explicit (see its docstring);
  :func:`format_strict` allows no whitespace outside or between the blocks.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

from nanogrpo.rewards.extract import Answer, read_answer
from nanogrpo.rewards.numbers import read_number

__all__ = ["BUILTIN", "correctness", "format_reward", "format_strict", "answers_match", "well_formed",
           "warm_up"]

# math_verify's own timeout uses signal.alarm, which only works on the main thread.
_MV_TIMEOUT_S = 5
_MV_MAX_CHARS = 120
# What sympy could spend seconds on: factorials, long digit runs, big or stacked powers.
_UNSAFE_RE = re.compile(r"!|[0-9]{16}|\^\s*\{?\s*[0-9]{3}|\^[^\^]*\^")


def _mv_timeout() -> int | None:
    """math_verify's signal-based timeout where it can work (main thread), else None."""
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[Any, ...]:
    """math_verify parse with LaTeX and plain-expression extraction (cached: references repeat G times)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    if "$" not in text and "\\boxed" not in text:
        text = f"${text}$"  # bare LaTeX is not found without delimiters ("6 \\times 7" would parse as 7)
    return tuple(parse(text, extraction_config=configs, parsing_timeout=_mv_timeout()))


_LONG_DECIMAL_RE = re.compile(r"[0-9]\.([0-9]{6,})\s*$")


@lru_cache(maxsize=4096)
def _reference(ref: str) -> tuple[tuple[Fraction, ...], Fraction] | None:
    """``(values, tolerance)`` of a reference that is a plain number, else None (cached: it repeats G
    times). A reference written as a long decimal (``2.666666666666667``, a float's rendering)
    matches what rounds to it at that precision (``8/3``); otherwise the tolerance is 0."""
    num = read_number(ref)
    if num is None:
        return None
    m = _LONG_DECIMAL_RE.search(ref)
    return num.values, (Fraction(1, 2 * 10 ** len(m.group(1))) if m else Fraction(0))


def _math_verify(pred: str, ref: str) -> bool:
    if len(pred) > _MV_MAX_CHARS or _UNSAFE_RE.search(pred) or sum(pred.count(c) for c in "+-*/^") > 12:
        return False  # sympy can take seconds on these; a final answer is not that long
    from math_verify import verify

    gold, guess = _parse(ref), _parse(pred)
    if not gold or not guess:
        return False
    return bool(verify(list(gold), list(guess), timeout_seconds=_mv_timeout()))


def warm_up() -> None:
    """Import math_verify and sympy and run one comparison through them (a first call costs seconds;
    reward workers do it before taking work, so no call's deadline pays for it)."""
    _math_verify("\\sqrt{4}", "x+1")
    correctness("<answer>\\frac{1}{2}</answer>", {"answer": "0.5"})


def answers_match(pred: Answer | str, ref: str) -> bool:
    """Whether the answer ``pred`` (an :class:`Answer`, or answer text) equals reference ``ref``."""
    if isinstance(pred, str):
        num = read_number(pred)
        pred = Answer(pred.strip(), num.values if num is not None else ())
    reference = _reference(ref)
    if reference is not None:
        ref_values, tol = reference
        if pred.values:
            if tol:
                return any(abs(p - r) <= tol for p in pred.values for r in ref_values)
            return not set(pred.values).isdisjoint(ref_values)
        if not any(c.isdigit() or c == "\\" for c in pred.text):
            return False  # words without a number cannot equal one
        return _math_verify(pred.text, ref)
    if " ".join(pred.text.split()).casefold() == " ".join(ref.split()).casefold():
        return True
    return _math_verify(pred.text, ref)


def correctness(completion: str, sample: dict[str, Any], *, truncated_correct: bool = True) -> float:
    """+1.0 if the completion's final answer equals ``sample["answer"]``, else -1.0 (also when it gives none).

    ``truncated_correct=False`` (config ``rewards.truncated_correct``) scores -1.0 for a
    completion the token limit cut off (``sample["finish_reason"] == "length"``), whatever it
    says, as DAPO's overlong filtering does; the default, as the seed, reads it like any other.
    """
    if not truncated_correct and sample.get("finish_reason") == "length":
        return -1.0
    question = sample.get("question")
    answer = read_answer(completion, question if isinstance(question, str) else None)
    if answer is None:
        return -1.0
    return 1.0 if answers_match(answer, str(sample["answer"])) else -1.0


_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_WS = " \t\r\n"


def well_formed(completion: str, strict: bool = False) -> bool:
    """Exactly one each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>``, in that order, with
    only spaces, tabs, ``\\r`` and ``\\n`` before, between and after the two blocks (``strict``: nothing)."""
    if any(completion.count(tag) != 1 for tag in _TAGS):
        return False
    a, b, c, d = (completion.find(tag) for tag in _TAGS)
    if not a < b < c < d:
        return False
    outside = (completion[:a], completion[b + len(_TAGS[1]):c], completion[d + len(_TAGS[3]):])
    return all(not part if strict else not part.strip(_WS) for part in outside)


def format_reward(completion: str, sample: dict[str, Any]) -> float:
    """1.25 if the completion is ``<think>…</think>`` then ``<answer>…</answer>``, else -1.0.

    Accepted: optional whitespace (spaces, tabs, ``\\r``, ``\\n``), ``<think>``, any text
    without the four tags, ``</think>``, optional whitespace, ``<answer>``, any text without
    the four tags (empty too), ``</answer>``, optional whitespace. So Qwen's
    ``"<think>\\n…\\n</think>\\n<answer>\\n42\\n</answer>"`` and ``\\r\\n`` line ends pass; a second,
    nested or stray tag of any of the four, text outside the blocks, a missing or unclosed
    block, tags in another order or case do not. This is the seed's rule (``^<think>.*?</think>
    [\\n ]*<answer>.*?</answer>$`` plus exactly one of each tag) with all whitespace allowed
    around the blocks; ``format_strict`` allows none.
    """
    return 1.25 if well_formed(completion) else -1.0


def format_strict(completion: str, sample: dict[str, Any]) -> float:
    """1.25 if the completion is exactly ``<think>…</think><answer>…</answer>`` (one of each tag,
    nothing before, between or after the blocks, not even whitespace), else -1.0."""
    return 1.25 if well_formed(completion, strict=True) else -1.0


BUILTIN = {"correctness": correctness, "format": format_reward, "format_strict": format_strict}
