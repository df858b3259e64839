"""Turning raw dataset rows into samples.

A sample is a plain dict with every column of its source row, plus:

- ``"question"`` (str): the question field, or for chat-formatted rows the
  content of the last user turn;
- ``"answer"`` (str): the reference answer; with a delimiter (GSM8K: ``####``)
  the stripped text after its last occurrence (the whole stripped text when the
  delimiter is absent, as in the seed). The untouched text is kept as
  ``"answer_raw"`` whenever a delimiter is set;
- ``"id"`` (str): the row's ``id`` column when it has one, else its row index;
- ``"messages"`` (list of ``{"role", "content"}``): only for chat-formatted rows
  (no question field, but a ``messages`` or ``prompt`` column holding turns);
  trailing assistant turns are dropped so that it holds the prompt turns only.

Every row is validated when the dataset is loaded, so a bad row 9000 fails at
start, not an hour into training.
"""

from __future__ import annotations

import json
from typing import Any

from nanogrpo.errors import DataError

CHAT_COLUMNS = ("messages", "prompt")


def extract_answer(text: str, delimiter: str | None) -> str:
    """The reference answer: text after the last ``delimiter`` (stripped), else all of it, stripped."""
    if delimiter:
        return text.split(delimiter)[-1].strip()
    return text.strip()


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


def normalize_rows(rows: list[dict[str, Any]], *, origin: str, question_field: str, answer_field: str,
                   answer_delimiter: str | None) -> list[dict[str, Any]]:
    """Validate every row and return the samples (module docstring); ``origin`` names the source in errors."""
    if not rows:
        raise DataError(f"{origin}: dataset is empty (0 rows)")
    first = rows[0]
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
        if answer_delimiter:
            sample["answer_raw"] = answer
        sample["question"] = question
        sample["answer"] = extract_answer(answer, answer_delimiter)
        sample["id"] = str(row["id"]) if row.get("id") is not None else str(i)
        samples.append(sample)
    return samples
