"""Tiny vision-language checkpoints and image datasets for the vision tests (built in code, offline)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nanogrpo.models.tiny_vision import make_vlm, save_vlm

MIN_PIXELS, MAX_PIXELS = 8 * 8, 32 * 32


def picture(h: int, w: int, seed: int = 0):
    """An RGB PIL image of random pixels (deterministic)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
    return Image.fromarray(x.numpy())


def checkpoint(family: str, tmp: Path, seed: int = 0) -> Path:
    model, tok = make_vlm(family, seed=seed)
    return save_vlm(model, tok, tmp / f"model-{family}", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def image_dataset(tmp: Path, n: int = 8, sizes=((16, 16), (24, 40))) -> Path:
    """``data.jsonl`` beside ``img/*.png``: rows whose question shows one image of one of ``sizes``
    (alternating), answer the row's number; the paths are relative to the file."""
    (tmp / "img").mkdir(parents=True, exist_ok=True)
    with open(tmp / "data.jsonl", "w") as f:
        for i in range(n):
            h, w = sizes[i % len(sizes)]
            picture(h, w, seed=i).save(tmp / "img" / f"{i}.png")
            f.write(json.dumps({"question": f"<image>{i}+{i}?", "answer": f"#### {2 * i}",
                                "images": [f"img/{i}.png"]}) + "\n")
    return tmp / "data.jsonl"
