"""The vision task: read the three-digit number drawn in a small picture.

Each row's image is 8 x 24 pixels: three digits of a 3 x 5 pixel font, one per 8 x 8 cell, in a
colour on a dark background, each shifted by up to one pixel (so no two pictures of a number need be
equal). The question is ``"<image>Read the number."``, the answer the number (``"407"``).

Train and test never share a number: each of 100..999 goes to one split by a SHA-256 hash of its
text (one in ``TEST_BUCKETS`` to test), so held-out accuracy counts numbers the model never saw, read
digit by digit. Rows are generated with ``random.Random`` seeded by a string: the same rows in every
process.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from nanogrpo.errors import DataError

FONT = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
}
"""A 3 x 5 pixel font: rows of each digit, 1 = ink."""
COLOURS = ((255, 255, 255), (255, 220, 80), (120, 220, 255), (150, 255, 150))
HEIGHT, CELL, DIGITS = 8, 8, 3
TEST_BUCKETS = 10
QUESTION = "<image>Read the number."


def number_split(number: int) -> str:
    """``"test"`` or ``"train"``: the split a number belongs to (stable across processes)."""
    digest = hashlib.sha256(f"vision|{number}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def draw(number: int, rng: random.Random):
    """The picture of ``number`` (an RGB PIL image, HEIGHT x CELL * DIGITS)."""
    from PIL import Image

    text = str(number)
    img = Image.new("RGB", (CELL * len(text), HEIGHT), (rng.randint(0, 40),) * 3)
    ink = rng.choice(COLOURS)
    px = img.load()
    for k, ch in enumerate(text):
        dx, dy = 2 + rng.randint(-1, 1), 1 + rng.randint(-1, 1)
        for y, row in enumerate(FONT[ch]):
            for x, bit in enumerate(row):
                if bit == "1":
                    px[k * CELL + dx + x, dy + y] = ink
    return img


def make_split(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of ``split`` (``train`` or ``test``): ``question``, ``answer``, ``images`` (one
    picture), ``id``, ``number``."""
    if split not in ("train", "test"):
        raise DataError(f"vision task has no split {split!r} (use train or test)")
    rng = random.Random(f"nanogrpo-vision:{split}:{seed}")
    pool = [v for v in range(100, 1000) if number_split(v) == split]
    rows = []
    for i in range(n):
        v = rng.choice(pool)
        rows.append({"question": QUESTION, "answer": str(v), "images": [draw(v, rng)],
                     "id": f"vision-{split}-{seed}-{i}", "number": v})
    return rows
