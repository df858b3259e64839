"""An LLM judge's prompt and how its reply becomes a score.

Templates are text with ``{field}`` placeholders: ``{completion}`` (the completion graded),
``{question}``, ``{answer}`` (the reference) and any other field of the sample (a dataset column).
Only ``{name}`` with a plain identifier inside is a placeholder; every other brace (a JSON example in
the prompt) is left as it is. Built-ins (``rewards.judge_template``):

- ``correct``: is this answer correct given the reference? Scored ``yes_no`` (1 / 0);
- ``rate``: rate the response from 1 to 10. Scored ``number`` in ``[1, 10]``.

Anything else names a template file. Replies are read after the last ``</think>`` (reasoning models);
what cannot be read as a score is *unparseable* (scored the penalty, counted):

- ``yes_no``: the first word (``yes`` / ``no``, also ``correct`` / ``incorrect``, ``true`` /
  ``false``, ``right`` / ``wrong``), else a labelled verdict (``Verdict: no``), else the last line's
  first word, else the only one of yes / no the reply uses;
- ``number``: the whole reply when it is a number, else the last labelled one (``Score: 7``,
  ``rating of 8/10``), else the last line when it is a number, else the only distinct number in range;
  ``N/10`` and ``N out of 10`` read as N. A number outside the range is unparseable.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from nanogrpo.errors import RewardError

__all__ = ["TEMPLATES", "SCORING", "load_template", "render", "parse_score", "placeholders"]

TEMPLATES: dict[str, str] = {
    "correct": (
        "You are grading an answer to a question against the reference answer.\n\n"
        "Question:\n{question}\n\n"
        "Reference answer:\n{answer}\n\n"
        "Answer to grade:\n{completion}\n\n"
        "Does the final answer of the answer to grade agree with the reference answer? "
        "Reply with one word: yes or no."
    ),
    "rate": (
        "Rate the response to the question below for correctness, helpfulness and clarity, on a scale "
        "from 1 (worst) to 10 (best).\n\n"
        "Question:\n{question}\n\n"
        "Response:\n{completion}\n\n"
        "Reply with the rating only: a whole number from 1 to 10."
    ),
}
SCORING = {"correct": "yes_no", "rate": "number"}
"""How each built-in template's replies are read (``rewards.judge_score=auto``); a file: ``number``."""

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def placeholders(template: str) -> list[str]:
    return _FIELD.findall(template)


def load_template(name: str) -> tuple[str, str]:
    """``(template text, default scoring)`` for a built-in name or a template file."""
    if name in TEMPLATES:
        text, scoring = TEMPLATES[name], SCORING[name]
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise RewardError(f"rewards.judge_template {name!r}: not a built-in ({', '.join(TEMPLATES)}) and "
                              "no such file")
        text, scoring = path.read_text(), "number"
    if "completion" not in placeholders(text):
        raise RewardError(f"rewards.judge_template {name!r} has no {{completion}} placeholder: the judge "
                          "would never see the completion")
    return text, scoring


def render(template: str, completion: str, sample: dict[str, Any]) -> str:
    """The template with each ``{field}`` replaced; a field the sample lacks raises KeyError."""
    def value(m: re.Match) -> str:
        key = m.group(1)
        if key == "completion":
            return completion
        if key not in sample:
            raise KeyError(f"the judge template's {{{key}}} is not a field of the sample "
                           f"(fields: {', '.join(sorted(map(str, sample)))[:200]})")
        v = sample[key]
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)

    return _FIELD.sub(value, template)


# ----------------------------------------------------------------------------- reading replies

_THINK_END = "</think>"
_WORD = re.compile(r"[A-Za-z]+")
_YES = {"yes", "correct", "true", "right"}
_NO = {"no", "incorrect", "false", "wrong"}
_NUM = r"[-+]?\d+(?:\.\d+)?"
_DENOM = re.compile(rf"(?<![\d.])({_NUM})\s*(?:/|out of)\s*{_NUM}", re.IGNORECASE)
"""``8/10``, ``8 out of 10``. It starts at a number's first digit only: tried inside a run of digits it
took time quadratic (and worse) in the run, so a judge's 1 MiB reply of digits took hours to read."""
_LABELLED_NUM = re.compile(rf"\b(?:score|rating|grade|rate|mark|points?)\b[^0-9\n+-]{{0,20}}?({_NUM})",
                           re.IGNORECASE)
_LABELLED_YN = re.compile(r"\b(?:verdict|answer|judg(?:e)?ment|decision|correct\?)\W{0,5}([A-Za-z]+)",
                          re.IGNORECASE)


def _visible(reply: str) -> str:
    """The reply after a reasoning model's last ``</think>``, markdown emphasis and quotes removed."""
    if _THINK_END in reply:
        reply = reply.rsplit(_THINK_END, 1)[1]
    return re.sub(r"[*_`\"'#>]", "", reply).strip()


def _verdict(word: str) -> float | None:
    w = word.lower()
    return 1.0 if w in _YES else 0.0 if w in _NO else None


def parse_yes_no(reply: str) -> float | None:
    text = _visible(reply)
    words = _WORD.findall(text)
    if not words:
        return None
    first = _verdict(words[0])
    if first is not None:
        return first
    labelled = [v for m in _LABELLED_YN.finditer(text) if (v := _verdict(m.group(1))) is not None]
    if labelled:
        return labelled[-1]
    last_line = _WORD.findall(text.splitlines()[-1]) if text.splitlines() else []
    if last_line and (v := _verdict(last_line[0])) is not None:
        return v
    kinds = {w.lower() for w in words} & {"yes", "no"}
    return (1.0 if kinds == {"yes"} else 0.0) if len(kinds) == 1 else None


def parse_number(reply: str, lo: float, hi: float) -> float | None:
    text = _DENOM.sub(r"\1", _visible(reply))
    inside = lambda x: lo <= x <= hi  # noqa: E731

    def first_number(s: str) -> float | None:
        s = s.strip().rstrip(".!")
        return float(s) if re.fullmatch(_NUM, s) else None

    whole = first_number(text)
    if whole is not None:
        return whole if inside(whole) else None
    labelled = [float(m.group(1)) for m in _LABELLED_NUM.finditer(text)]
    if labelled:
        return labelled[-1] if inside(labelled[-1]) else None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines and (last := first_number(lines[-1])) is not None:
        return last if inside(last) else None
    found = {float(x) for x in re.findall(_NUM, text)}
    in_range = {x for x in found if inside(x)}
    return in_range.pop() if len(in_range) == 1 and len(found) == 1 else None


def parse_score(reply: str, scoring: str, lo: float, hi: float) -> float | None:
    """The score a reply gives, or None when it cannot be read (see the module docstring)."""
    return parse_yes_no(reply) if scoring == "yes_no" else parse_number(reply, lo, hi)
