"""The tool demo's task: multi-digit arithmetic a tiny model cannot do reliably in its head.

Products of two 2-digit numbers, sums and differences of 3-digit numbers, in short word
problems (``"A crate holds 37 rows of 48 cups. How many cups?"``): the embedded 0.8M-parameter
model gets most of these wrong when it computes them itself, and right when it writes
``<code>print(37*48)</code>`` and copies the interpreter's answer. Same construction as
:mod:`nanogrpo.demos.arithmetic.task`: seeded ``random.Random`` streams, train and test disjoint by a
SHA-256 hash of each (template, a, b) key.
"""

from __future__ import annotations

import random
from typing import Any

from nanogrpo.demos.arithmetic.task import ITEMS, NAMES, key_split
from nanogrpo.errors import DataError

# name: (op, question template, operand range a, operand range b)
TEMPLATES: dict[str, tuple[str, str, tuple[int, int], tuple[int, int]]] = {
    "crate": ("*", "A crate holds {a} rows of {b} {i}. How many {i}?", (12, 99), (12, 99)),
    "gets": ("+", "{n} has {a} {i} and gets {b} more. How many now?", (100, 999), (100, 999)),
    "sells": ("-", "{n} had {a} {i} and sold {b}. How many are left?", (500, 999), (100, 499)),
}
WEIGHTS = {"crate": 0.5, "gets": 0.25, "sells": 0.25}


def _compute(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def make_split(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` problems of ``split`` (``train`` or ``test``). Rows: ``question``, ``answer``, ``id``,
    ``template``, ``op``, ``a``, ``b``, ``equation`` (``"37*48=1776"``), ``code`` (``"print(37*48)"``)."""
    if split not in ("train", "test"):
        raise DataError(f"multidigit task has no split {split!r} (use train or test)")
    rng = random.Random(f"nanogrpo-multidigit:{split}:{seed}")
    names, weights = list(WEIGHTS), list(WEIGHTS.values())
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        template = rng.choices(names, weights)[0]
        op, text, ra, rb = TEMPLATES[template]
        a, b = rng.randint(*ra), rng.randint(*rb)
        if key_split(f"multidigit-{template}", a, b) != split:
            continue
        result = _compute(op, a, b)
        rows.append({
            "question": text.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b),
            "answer": str(result), "id": f"multidigit-{split}-{seed}-{len(rows)}", "template": template,
            "op": op, "a": a, "b": b, "equation": f"{a}{op}{b}={result}", "code": f"print({a}{op}{b})",
        })
    return rows
