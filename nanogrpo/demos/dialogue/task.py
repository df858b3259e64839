"""The dialogue demo's rows: a made-up word and two changes to make to it, one after the other.

Changes (:data:`OPS`): ``upper`` (``kmp`` -> ``KMP``), ``twice`` (``kmp`` -> ``kmpkmp``), ``dots``
(``kmp`` -> ``k.m.p``). A row: ``question`` (the user's first message, ``"upper kmp"``), ``word``,
``first`` and ``second`` (the two changes, distinct), ``answer`` (the final result), ``id``. Words are
3 to 5 random lowercase letters; train and test are disjoint by a SHA-256 hash of the word, so held-out
dialogues use words never seen in training.
"""

from __future__ import annotations

import hashlib
import random
import string
from typing import Any

from nanogrpo.errors import DataError

OPS = ("upper", "twice", "dots")
TEST_BUCKETS = 10


def apply(op: str, text: str) -> str:
    """``text`` changed by ``op``."""
    if op == "upper":
        return text.upper()
    if op == "twice":
        return text + text
    if op == "dots":
        return ".".join(text)
    raise DataError(f"unknown change {op!r} (one of {', '.join(OPS)})")


def word_split(word: str) -> str:
    digest = hashlib.sha256(f"dialogue|{word}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def make_split(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` dialogues of ``split`` (``train`` or ``test``)."""
    if split not in ("train", "test"):
        raise DataError(f"dialogue task has no split {split!r} (use train or test)")
    rng = random.Random(f"nanogrpo-dialogue:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5)))
        if word_split(word) != split:
            continue
        first, second = rng.sample(OPS, 2)
        rows.append(
            {
                "question": f"{first} {word}",
                "word": word,
                "first": first,
                "second": second,
                "answer": apply(second, apply(first, word)),
                "id": f"dialogue-{split}-{seed}-{len(rows)}",
            }
        )
    return rows
