"""A verifiers 0.4 taskset's own tasks as dataset rows (``data.source = "verifiers:..."``, or
:func:`taskset_rows` from Python): each row carries the task's data whole (``task``), which is what
the episode plays (:func:`.traces.task_of`), beside the ``question`` (its prompt's text), an ``answer``
(the task's ``answer`` field if it has one, else ``"(none)"``: the environment scores) and ``id``.

Splits are disjoint by position in the taskset's ``load()`` order: ``train`` is the first ``n``
tasks, ``test`` (``eval``, ``validation``) the ``n`` after ``train_size`` of them; an infinite taskset
(TextArena's) is read no further.
"""

from __future__ import annotations

import itertools
from typing import Any

from nanogrpo.envs.adapters.verifiers_v1 import source
from nanogrpo.errors import DataError

NO_ANSWER = "(none)"


def taskset_rows(rest: str, kwargs: dict | None = None, start: int = 0, n: int = 100) -> list[dict[str, Any]]:
    """Rows of tasks ``start .. start + n`` of the taskset of ``verifiers:REST`` (``kwargs``: as
    ``env.kwargs``, its ``taskset`` knobs apply)."""
    v1 = source.vf()
    spec, _ = source.resolve(rest, dict(kwargs or {}))
    if isinstance(spec, dict):
        taskset = v1.load_taskset(source.pin(spec, 0, 0).taskset)
    else:
        taskset = spec.taskset
    rows = []
    for task in itertools.islice(iter(taskset), start, start + n):
        data = task.data.model_dump(mode="json")
        answer = data.get("answer")
        rows.append({"question": task.data.prompt_text, "id": str(task.data.id or task.key), "task": data,
                     "answer": NO_ANSWER if answer is None else str(answer)})
    if not rows:
        raise DataError(f"data.source 'verifiers:{rest}': the taskset has no task from position {start}")
    return rows


def split_rows(rest: str, split: str, train_size: int, eval_size: int) -> list[dict[str, Any]]:
    """``data.source = "verifiers:REST"``: the rows of ``split`` (module docstring)."""
    if split == "train":
        return taskset_rows(rest, None, 0, train_size)
    if split in ("test", "eval", "validation"):
        return taskset_rows(rest, None, train_size, eval_size)
    raise DataError(f"data.source 'verifiers:{rest}' has no split {split!r} (use train or test)")


__all__ = ["split_rows", "taskset_rows"]
