"""The game demo's rows: who thinks of which number (1 to 15), in one of a few wordings.

Each row starts one game (:mod:`nanogrpo.demos.game.env`): ``question`` (what the model is told
first), ``answer`` and ``secret`` (the number, as text and as int), ``id``. Train and test are disjoint
by (wording, name, secret): a SHA-256 hash of the key puts it in one split, so held-out games are never
seen in training (the same construction as :mod:`nanogrpo.demos.arithmetic.task`).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from nanogrpo.errors import DataError

LOW, HIGH = 1, 15
NAMES = ("Tom", "Ann", "Sam", "Mia", "Leo", "Eva", "Ben", "Zoe", "Max", "Ivy", "Dan", "Amy")
WORDINGS = (
    "{n} picks a number, 1-15. Guess it.",
    "Guess {n}'s number (1-15).",
    "{n} thinks of a number from 1 to 15. Guess.",
)
TEST_BUCKETS = 5


def key_split(wording: int, name: str, secret: int) -> str:
    digest = hashlib.sha256(f"game|{wording}|{name}|{secret}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def make_split(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` games of ``split`` (``train`` or ``test``)."""
    if split not in ("train", "test"):
        raise DataError(f"game task has no split {split!r} (use train or test)")
    rng = random.Random(f"nanogrpo-game:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        w, name, secret = rng.randrange(len(WORDINGS)), rng.choice(NAMES), rng.randint(LOW, HIGH)
        if key_split(w, name, secret) != split:
            continue
        rows.append(
            {
                "question": WORDINGS[w].format(n=name),
                "answer": str(secret),
                "secret": secret,
                "id": f"game-{split}-{seed}-{len(rows)}",
            }
        )
    return rows
