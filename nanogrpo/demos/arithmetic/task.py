"""The embedded task: short arithmetic word problems, generated in code.

Sized for the demo's character-level tiny model on a CPU: a number up to 19
plus or minus a one-digit number, and products of one-digit numbers, in questions under 90
characters, e.g. ``"Tom has 13 apples and buys 4 more. How many apples does Tom have?"``.
Answers are integers (as text, like every sample's ``"answer"``).

Train and test are disjoint by construction: each (template, a, b) key is
assigned to one split by a SHA-256 hash of its text, so no test question (in
any wording) ever appears in train. Generation uses ``random.Random`` seeded
with a string and ``hashlib``, never ``hash()``: the same call gives the same
rows in every process and Python version.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from nanogrpo.errors import DataError

NAMES = ("Tom", "Ann", "Sam", "Mia", "Leo", "Eva", "Ben", "Zoe", "Max", "Ivy", "Dan", "Amy")
ITEMS = ("apples", "pears", "pens", "cards", "books", "shells", "stamps", "coins", "eggs", "plums")

# name: (op, question template). Operands are {a} and {b}; {n} is a name, {i} an item.
TEMPLATES: dict[str, tuple[str, str]] = {
    "buys": ("+", "{n} has {a} {i} and buys {b} more. How many {i} does {n} have?"),
    "finds": ("+", "{n} had {a} {i} and found {b} more. How many {i} now?"),
    "gives": ("-", "{n} has {a} {i} and gives away {b}. How many {i} are left?"),
    "takes": ("-", "A bag holds {a} {i}. {n} takes {b} out. How many {i} stay in the bag?"),
    "rows": ("*", "A box holds {a} rows of {b} {i}. How many {i} are in the box?"),
    "packs": ("*", "{n} buys {a} packs of {b} {i}. How many {i} is that?"),
}
# Probability of each template: addition and subtraction mostly, some multiplication.
WEIGHTS = {"buys": 0.2, "finds": 0.2, "gives": 0.2, "takes": 0.2, "rows": 0.1, "packs": 0.1}
TEST_BUCKETS = 10
"""One key in ``TEST_BUCKETS`` goes to test (by hash), the rest to train."""


def _operands(op: str, rng: random.Random) -> tuple[int, int]:
    if op == "+":
        return rng.randint(2, 19), rng.randint(2, 9)
    if op == "-":
        a = rng.randint(10, 19)
        return a, rng.randint(2, 9)
    return rng.randint(2, 9), rng.randint(2, 9)


def _compute(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def key_split(template: str, a: int, b: int) -> str:
    """``"test"`` or ``"train"``: the split the (template, a, b) key belongs to (stable across processes)."""
    digest = hashlib.sha256(f"{template}|{a}|{b}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def make_split(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` problems of ``split`` (``train`` or ``test``); train and test never share a question.

    Rows: ``question``, ``answer`` (integer as text), ``id``, ``template``, ``op``, ``a``, ``b``,
    ``equation`` (e.g. ``"23+14=37"``).
    """
    if split not in ("train", "test"):
        raise DataError(f"arithmetic task has no split {split!r} (use train or test)")
    rng = random.Random(f"nanogrpo-arithmetic:{split}:{seed}")
    names, weights = list(WEIGHTS), list(WEIGHTS.values())
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        template = rng.choices(names, weights)[0]
        op, text = TEMPLATES[template]
        a, b = _operands(op, rng)
        if key_split(template, a, b) != split:
            continue
        result = _compute(op, a, b)
        rows.append({
            "question": text.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b),
            "answer": str(result),
            "id": f"arith-{split}-{seed}-{len(rows)}",
            "template": template,
            "op": op,
            "a": a,
            "b": b,
            "equation": f"{a}{op}{b}={result}",
        })
    return rows


def solution(sample: dict[str, Any]) -> str:
    """Worked answer for supervised warm-start: ``"<think>23+14=37</think><answer>37</answer>"``."""
    try:
        op, a, b = sample["op"], int(sample["a"]), int(sample["b"])
        result = _compute(op, a, b)
    except (KeyError, TypeError, ValueError):
        raise DataError(f"sample {sample.get('id', '?')}: solution() needs an arithmetic sample "
                        f"(with op, a, b), got fields {', '.join(map(str, sample))}") from None
    return f"<think>{a}{op}{b}={result}</think><answer>{result}</answer>"
