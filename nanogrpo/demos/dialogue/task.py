"""The dialogue demo's rows: a customer orders a food item; the size comes only in a later reply.

A row: ``question`` (the customer's first message, e.g. ``"one soup, please"``), ``item``, ``size``
(``small``, ``medium`` or ``large``: what the customer answers when asked), ``answer`` (the order as the
model should say it: ``"large soup"``), ``id``. Train and test are disjoint by (wording, item, size): a
SHA-256 hash of the key puts it in one split, so held-out dialogues are orders never seen in training.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from nanogrpo.errors import DataError

ITEMS = ("tea", "soup", "pie", "cake", "rice", "salad", "pizza", "juice", "bread", "milk", "coffee", "pasta",
         "fries", "wrap", "taco", "bagel", "donut", "cola", "latte", "curry", "burger", "toast", "muffin",
         "chili")
SIZES = ("small", "medium", "large")
WORDINGS = ("{i} please", "one {i}, please", "I'd like a {i}")
TEST_BUCKETS = 5


def key_split(wording: int, item: str, size: str) -> str:
    digest = hashlib.sha256(f"dialogue|{wording}|{item}|{size}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def make_split(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` orders of ``split`` (``train`` or ``test``)."""
    if split not in ("train", "test"):
        raise DataError(f"dialogue task has no split {split!r} (use train or test)")
    rng = random.Random(f"nanogrpo-dialogue:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        w, item, size = rng.randrange(len(WORDINGS)), rng.choice(ITEMS), rng.choice(SIZES)
        if key_split(w, item, size) != split:
            continue
        rows.append({"question": WORDINGS[w].format(i=item), "item": item, "size": size,
                     "answer": f"{size} {item}", "id": f"dialogue-{split}-{seed}-{len(rows)}"})
    return rows
