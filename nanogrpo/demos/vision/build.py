"""The vision demo's warm start: a tiny Qwen2-VL taught to read the numbers, carelessly.

A random-init Qwen2-VL (``nanogrpo.models.tiny_vision``: the real model classes, a character-level
tokenizer with Qwen's image tokens) is trained on pictures of train-split numbers, the answer
written ``<answer>407</answer>``. In ``CARELESS_RATE`` of them the answer is written backwards
(``<answer>704</answer>``), so the warm start can read the digits but, decoding greedily, mostly
writes them in the wrong order: its held-out accuracy starts low while the right answer is already
among its samples. GRPO, rewarded only for correct answers, has to find the right order by itself.

The result ships in ``nanogrpo/demos/vision/weights/`` (model ``embedded-vision``). Rebuild it with
``python -m nanogrpo.demos.vision.build --out DIR`` (183 s on a shared 2-core CPU, 2026-12-03: the same
bytes as the shipped ``model.safetensors``).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from nanogrpo.config import load_config
from nanogrpo.data.images import encode_with_images
from nanogrpo.demos.vision.task import make_split
from nanogrpo.demos.warm_start import builder_main, one_thread, save
from nanogrpo.models.tiny_vision import make_vlm, preprocessor_config
from nanogrpo.models.vision import forward_kwargs, image_spec

SEED = 1234
CARELESS_RATE = 0.6
STEPS, BATCH_SIZE, LR = 1500, 32, 1e-3
SHAPE = dict(hidden=96, layers=3, vision_hidden=64, vision_layers=2, patch=4)
MIN_PIXELS, MAX_PIXELS = 64, 8 * 24


def packaged_path() -> Path:
    """This folder's ``weights/``: where the package ships what this program builds."""
    return Path(__file__).resolve().parent / "weights"


def completion(row: dict, rng: random.Random, rate: float = CARELESS_RATE) -> str:
    """``<answer>N</answer>``, the digits reversed at ``rate``."""
    text = row["answer"]
    return f"<answer>{text[::-1] if rng.random() < rate else text}</answer>"


def build(out: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
          log_every: int = 50) -> Path:
    with one_thread():  # built on one thread: the same reduction order everywhere
        return _build(out, steps, batch_size, lr, log_every)


def _build(out: Path, steps: int, batch_size: int, lr: float, log_every: int) -> Path:
    import json
    import math
    import time

    data_cfg = load_config(preset="demo-vision").data
    torch.manual_seed(SEED)
    model, tok = make_vlm("qwen2_vl", seed=SEED, **SHAPE)
    spec = image_spec(model, tok, None, MIN_PIXELS, MAX_PIXELS)
    rows = make_split("train", steps * batch_size, seed=SEED)
    rng = random.Random(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    model.train()
    t0 = time.time()
    for step in range(steps):
        scale = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        part = rows[step * batch_size:(step + 1) * batch_size]
        prompts, _, vis = encode_with_images(tok, part, data_cfg, "auto", spec)
        seqs = [p + tok(completion(r, rng), add_special_tokens=False).input_ids + [tok.eos_token_id]
                for p, r in zip(prompts, part)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        am = torch.zeros_like(ids)
        for j, (s, p) in enumerate(zip(seqs, prompts)):
            ids[j, :len(s)] = torch.tensor(s)
            labels[j, len(p):len(s)] = torch.tensor(s[len(p):])
            am[j, :len(s)] = 1
        pv = torch.cat([v.pixel_values for v in vis])
        grid = torch.cat([v.grid for v in vis])
        kw = {k: v for k, v in forward_kwargs(model, ids, pv, grid).items() if k != "position_ids"}
        loss = model(input_ids=ids, attention_mask=am, labels=labels, **kw).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"warm start step {step + 1}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    return save(model, tok, out, files={
        "preprocessor_config.json": json.dumps(preprocessor_config(model, MIN_PIXELS, MAX_PIXELS), indent=1)})


def main(argv: list[str] | None = None) -> int:
    return builder_main(argv, "Build the vision demo's warm-start model.", build, packaged_path(), STEPS,
                        BATCH_SIZE, LR)


if __name__ == "__main__":
    raise SystemExit(main())
