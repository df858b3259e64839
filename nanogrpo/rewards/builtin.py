"""Built-in rewards: plain functions ``fn(completion, sample) -> float``.

``completion`` is decoded text without EOS/special tokens; ``sample`` is the
dataset row (``"answer"`` holds the reference answer string, ``"question"`` the
question) plus the reserved key ``"finish_reason"``: ``"stop"`` when the model
ended the completion, ``"length"`` when the token limit cut it off (set by the
rollout for every completion; absent when a reward is called directly).

- :func:`correctness`: +1 when the completion's final answer (found and read as a grader
  does, :mod:`nanogrpo.grading.grade`) equals the reference, else -1. Plain numbers are
  compared exactly, as fractions (``1,234.0`` = ``1234``, ``3/4`` = ``0.75``, ``0.333`` !=
  ``1/3``, ``25%`` = ``25``) without math_verify; LaTeX answers (``\\frac{\\sqrt3}{2}``,
  ``[-1,4)``, ``1, 2, 3``, matrices) go to math_verify whole, with what a grader ignores taken
  off; multiple-choice letters, words and numbers in other bases are compared as such. The
  seed compared the last number in the text. A number's unit is part of the number however it is
  written (``96 m^2``, ``45 km/h``, ``-4°F``), a scale word is read against the scale the question asks
  in, a compound quantity (``2 hours and 30 minutes``) in the unit it asks for. A completion the token
  limit cut off before it gave any answer scores -1 (``rewards.truncated_last_number``: the seed's
  last-number reading instead).
- :func:`overlong`: DAPO's soft overlong punishment, 0 to -1 as a completion's length enters the
  last ``buffer`` tokens before the token limit (``rewards.overlong_buffer``, ``_penalty``).
- :func:`format_reward`: 1.25 / -1, the seed's format made explicit (see its docstring);
  :func:`format_strict` allows no whitespace outside or between the blocks;
  :func:`format_boxed`: 1.25 / -1, the R1 prompt's format (one final ``\\boxed{}``).
"""

from __future__ import annotations

import re
from typing import Any

from nanogrpo.grading.grade import answer_equals, answered, grade
from nanogrpo.grading.latex import braced_end

__all__ = ["BUILTIN", "FORMATS", "format_name", "correctness", "overlong", "format_reward", "format_strict",
           "format_boxed", "answers_match", "well_formed", "boxed_well_formed", "warm_up"]


def warm_up() -> None:
    """Import math_verify and sympy and run comparisons through them (a first call costs seconds;
    reward workers do it before taking work, so no call's deadline pays for it)."""
    correctness("<answer>\\frac{1}{2}</answer>", {"answer": "0.5"})
    correctness("<answer>\\frac{\\sqrt{2}}{2}, (1, 2]</answer>", {"answer": "\\frac{1}{\\sqrt{2}}, [1,2)"})
    correctness("The answer is $x^2+1$.", {"answer": "\\sqrt{2}"})
    correctness("<answer>\\{1, x\\}</answer>", {"answer": "(x+1)^2, \\frac{\\sqrt3}{2}"})


def answers_match(pred: str, ref: str) -> bool:
    """Whether the answer ``pred``, as written with nothing around it, equals reference ``ref``."""
    return answer_equals(pred, ref)


def correctness(completion: str, sample: dict[str, Any], *, truncated_correct: bool = True,
                truncated_last_number: bool = False) -> float:
    """+1.0 if the completion's final answer equals ``sample["answer"]``, else -1.0 (also when it gives none).

    A completion the token limit cut off (``sample["finish_reason"] == "length"``) before it gave a
    final answer (an ``<answer>`` block, a box, an announced answer: :func:`~nanogrpo.grading.grade.
    answered`) scores -1.0 whatever its last number is; ``truncated_last_number=True`` (config
    ``rewards.truncated_last_number``) reads it like any other instead (its last sentence with a number,
    as the seed reads its last number).
    ``truncated_correct=False`` (config ``rewards.truncated_correct``) scores -1.0 for every cut-off
    completion, whatever it says, as DAPO's overlong filtering does.
    """
    if sample.get("finish_reason") == "length" and (
            not truncated_correct or not (truncated_last_number or answered(completion))):
        return -1.0
    question = sample.get("question")
    question = question if isinstance(question, str) else None
    return 1.0 if grade(completion, str(sample["answer"]), question) else -1.0


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


_BOX_OPEN_RE = re.compile(r"\\boxed\s{0,2}\{")
_AFTER_BOX_RE = re.compile(r"(?:\s|\$|\\\]|\\\))*")


def boxed_well_formed(completion: str) -> bool:
    """Exactly one ``\\boxed{…}`` in the whole completion, complete and not empty, with nothing after
    it but whitespace and the delimiters closing the math it sits in (``$``, ``$$``, ``\\]``, ``\\)``)."""
    if completion.count("\\boxed") != 1:
        return False
    m = _BOX_OPEN_RE.search(completion)
    if m is None:
        return False
    end = braced_end(completion, m.end(), len(completion))
    if end == -1 or not completion[m.end():end - 1].strip():
        return False
    return _AFTER_BOX_RE.fullmatch(completion, end) is not None


def format_boxed(completion: str, sample: dict[str, Any]) -> float:
    """1.25 if the completion ends with its one final ``\\boxed{…}`` (the R1 prompt "put your final
    answer within \\boxed{}"; see :func:`boxed_well_formed`), else -1.0. A second box anywhere (a
    draft in the reasoning too), an empty or unclosed box, or text after it (even a period) fail."""
    return 1.25 if boxed_well_formed(completion) else -1.0


def overlong(completion: str, sample: dict[str, Any], *, buffer: int | None = None,
             penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): with L = ``sample["max_new_tokens"]`` (the
    token limit) and n = ``sample["completion_tokens"]`` (the tokens the model sampled; the rollout sets
    both), 0 while n <= L - ``buffer``, then ``-penalty * (n - (L - buffer)) / buffer``, down to -penalty
    at the limit (verl's ``overlong_buffer``). ``buffer`` None: L // 5 (DAPO's 4,096 of 20,480)."""
    try:
        n, limit = int(sample["completion_tokens"]), int(sample["max_new_tokens"])
    except KeyError:
        raise ValueError("overlong needs sample['completion_tokens'] and sample['max_new_tokens'] (the "
                         "rollout sets them)") from None
    cache = max(1, limit // 5) if buffer is None else buffer
    return -penalty * min(max(n - (limit - cache), 0), cache) / cache


def env_return(completion: str, sample: dict[str, Any]) -> float:
    """A multi-turn episode's return (``[env]``): its turns' rewards summed, discounted by
    ``grpo.turn_reward_discount``, or ``env.error_penalty`` when the environment broke it (the rollout
    puts it in the sample as ``env_reward``)."""
    if "env_reward" not in sample:
        raise KeyError("the env reward scores episodes of an environment: set env.source")
    return float(sample["env_reward"])


BUILTIN = {"correctness": correctness, "format": format_reward, "format_strict": format_strict,
           "format_boxed": format_boxed, "overlong": overlong, "env": env_return}
FORMATS = ("format_boxed", "format_strict", "format")
"""The built-in format rewards, the one a run's format rate is measured by first."""


def format_name(functions: list[str]) -> str:
    """The format reward a run uses: the first of :data:`FORMATS` named in ``functions`` (``format`` when
    none is): what its ``format_rate`` metrics count."""
    names = {f.strip() for f in functions}
    return next((f for f in FORMATS if f in names), "format")
