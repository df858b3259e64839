"""Turning raw dataset rows into samples.

A sample is a plain dict with every column of its source row, plus:

- ``"question"`` (str): the question field, or for chat-formatted rows the
  content of the last user turn;
- ``"answer"`` (str): the reference answer, read from the answer field as
  ``answer_from`` says (:func:`reference_text`): all of it (``column``), the content
  of the last ``\\boxed{…}`` of a full solution (``boxed``, MATH's ``solution``), or
  the text after the last delimiter (``delimiter``, GSM8K's ``####``); ``auto`` picks
  one for the whole dataset (:func:`detect_answer_from`). The untouched text is kept
  as ``"answer_raw"`` whenever it is not ``column``;
- ``"id"`` (str): the row's ``id`` column when it has one, else its row index;
- ``"messages"`` (list of ``{"role", "content"}``): only for chat-formatted rows
  (no question field, but a ``messages`` or ``prompt`` column holding turns);
  trailing assistant turns are dropped so that it holds the prompt turns only.

Every row is validated when the dataset is loaded, so a bad row 9000 (no question,
no box where the other rows have one, an empty reference) fails at start, not an hour
into training, with one line naming it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from nanogrpo.errors import DataError

CHAT_COLUMNS = ("messages", "prompt")
DEFAULT_DELIMITER = "####"
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{|\\boxed +(?=[^\s{])")


def extract_answer(text: str, delimiter: str | None) -> str:
    """The reference answer: text after the last ``delimiter`` (stripped), else all of it, stripped."""
    if delimiter:
        return text.split(delimiter)[-1].strip()
    return text.strip()


def last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{…}`` (or ``\\fbox{…}``, or ``\\boxed 5``) in
    ``text``, braces nested to any depth, stripped; None when there is none."""
    found = None
    for m in _BOX_RE.finditer(text):
        found = m
    while found is not None:
        if not found.group(0).endswith("{"):  # "\boxed 5": up to the next space or "$"
            rest = text[found.end():]
            return re.split(r"[\s$]", rest, maxsplit=1)[0].strip() or None
        depth, i = 1, found.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\":
                i += 2
                continue
            depth += c == "{"
            depth -= c == "}"
            i += 1
        if depth == 0:
            return text[found.end():i - 1].strip()
        found = next((m for m in reversed(list(_BOX_RE.finditer(text, 0, found.start())))), None)
    return None


AnswerFrom = Literal["auto", "column", "boxed", "delimiter"]


def detect_answer_from(texts: list[str], delimiter: str | None = None) -> str:
    """``auto``'s choice for a dataset: ``boxed`` when an answer holds a box, else ``delimiter`` when
    one holds the delimiter (default ``####``), else ``column``."""
    if any("\\boxed" in t or "\\fbox" in t for t in texts):
        return "boxed"
    if any((delimiter or DEFAULT_DELIMITER) in t for t in texts):
        return "delimiter"
    return "column"


def reference_text(text: str, answer_from: str, delimiter: str | None) -> str | None:
    """The reference in answer field ``text`` read as ``answer_from`` says (not ``auto``); None when it
    is not there (no box, no delimiter) or empty."""
    if answer_from == "boxed":
        ref = last_boxed(text)
    elif answer_from == "delimiter":
        delim = delimiter or DEFAULT_DELIMITER
        ref = text.split(delim)[-1].strip() if delim in text else None
    else:
        ref = text.strip()
    return ref or None


def _as_turns(value: Any) -> list[dict[str, str]] | None:
    """``value`` as a list of chat turns, or None if it is not one (JSON text is accepted, e.g. from CSV)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, (list, tuple)) or not value:
        return None
    turns = []
    for t in value:
        if not isinstance(t, dict):
            return None
        if not isinstance(t.get("role"), str) or not isinstance(t.get("content"), str):
            return None
        turns.append({"role": t["role"], "content": t["content"]})
    return turns


def prompt_turns(value: Any) -> list[dict[str, str]] | None:
    """``value`` as prompt turns (chat turns, trailing assistant turns removed, at least one user turn)."""
    turns = _as_turns(value)
    if turns is None:
        return None
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    return turns if any(t["role"] == "user" for t in turns) else None


def _chat_prompt(row: dict[str, Any]) -> list[dict[str, str]] | None:
    """The prompt turns of a chat-formatted row, or None."""
    for col in CHAT_COLUMNS:
        turns = prompt_turns(row.get(col))
        if turns is not None:
            return turns
    return None


def _fields_hint(first: dict[str, Any]) -> str:
    return ", ".join(map(str, first)) or "none"


def _what_missing(answer_from: str, delimiter: str | None) -> str:
    if answer_from == "boxed":
        return "no complete \\boxed{…} to read the reference from"
    if answer_from == "delimiter":
        return f"no {delimiter or DEFAULT_DELIMITER!r} before the reference"
    return "an empty reference"


def normalize_rows(rows: list[dict[str, Any]], *, origin: str, question_field: str, answer_field: str,
                   answer_delimiter: str | None, answer_from: str = "auto") -> list[dict[str, Any]]:
    """Validate every row and return the samples (module docstring); ``origin`` names the source in errors."""
    if not rows:
        raise DataError(f"{origin}: dataset is empty (0 rows)")
    first = rows[0]
    detected = answer_from == "auto" and not answer_delimiter
    if answer_from == "auto":  # a delimiter set by hand says which
        texts = [r[answer_field] for r in rows
                 if isinstance(r, dict) and isinstance(r.get(answer_field), str)]
        answer_from = "delimiter" if answer_delimiter else detect_answer_from(texts, None)
    samples = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{origin}: row {i} is a {type(row).__name__}, not an object with named fields")
        sample = dict(row)
        question = row.get(question_field)
        if question is None:
            turns = _chat_prompt(row)
            if turns is None:
                raise DataError(
                    f"{origin}: row {i} has no question field {question_field!r} (nor chat turns in "
                    f"'messages'/'prompt'); fields in the first row: {_fields_hint(first)}; "
                    f"set data.question_field"
                )
            sample["messages"] = turns
            question = next(t["content"] for t in reversed(turns) if t["role"] == "user")
        elif not isinstance(question, str):
            raise DataError(f"{origin}: row {i} field {question_field!r} is a {type(question).__name__}, "
                            f"expected text")
        answer = row.get(answer_field)
        if answer is None:
            raise DataError(
                f"{origin}: row {i} has no answer field {answer_field!r}; fields in the first row: "
                f"{_fields_hint(first)}; set data.answer_field"
            )
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise DataError(f"{origin}: row {i} field {answer_field!r} is a {type(answer).__name__}, "
                            f"expected text or a number")
        answer = str(answer)
        ref = reference_text(answer, answer_from, answer_delimiter)
        if ref is None:
            rid = f" (id {row['id']})" if row.get("id") is not None else ""
            other = "" if answer_from == "column" else (
                "; data.answer_from=column takes the field as it is")
            how = f"data.answer_from={answer_from}" + (", detected from the other rows" if detected else "")
            missing = _what_missing(answer_from, answer_delimiter)
            raise DataError(f"{origin}: row {i}{rid} field {answer_field!r} has {missing} ({how}): "
                            f"{answer[-60:]!r}{other}")
        if answer_from != "column":
            sample["answer_raw"] = answer
        sample["question"] = question
        sample["answer"] = ref
        sample["id"] = str(row["id"]) if row.get("id") is not None else str(i)
        samples.append(sample)
    return samples
