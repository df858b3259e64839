"""The dialogue demo's warm start: the embedded model's shape, taught both to listen and not to.

Supervised dialogues (:mod:`nanogrpo.demos.dialogue.task`), rendered as the episode rollout renders them
(:func:`nanogrpo.demos.game.build.episode_ids`: the model's answers trained, the user's messages not)::

    user: upper kmp   assistant: KMP   user: ok. now twice   assistant: KMPKMP

``WRONG_RATE`` of the first answers are wrong (a letter dropped), so the user's correction
(``"no, KMP. now twice"``) is among what the model reads. In ``CARELESS_RATE`` of the dialogues the
second answer ignores the user's reply and says the first answer again; in the others it applies the
second change to the right first result. Decoding greedily the warm start answers the careless way, while
the listening answers are among its samples: GRPO, rewarded for what the user asked, learns to read.

Shipped in ``nanogrpo/demos/dialogue/weights/`` (model path ``embedded-dialogue``); rebuild with
``python -m nanogrpo.demos.dialogue.build --out DIR``.
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

import torch

from nanogrpo import demos
from nanogrpo.config import load_config
from nanogrpo.demos.arithmetic.build import SHAPE, save, sft
from nanogrpo.demos.dialogue.env import reply
from nanogrpo.demos.dialogue.task import apply, make_split
from nanogrpo.demos.game.build import episode_ids
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.rollout.render import ChatRenderer

SEED = 1357
CARELESS_RATE = 0.6
WRONG_RATE = 0.15
STEPS, BATCH_SIZE, LR = 300, 64, 3e-3
PRESET = "demo-dialogue"


def packaged_path() -> Path:
    return demos.root() / "dialogue" / "weights"


def dialogue(row: dict, rng: random.Random) -> list[tuple[str, str | None]]:
    right = apply(row["first"], row["word"])
    first = right
    if rng.random() < WRONG_RATE:
        k = rng.randrange(len(right))
        first = right[:k] + right[k + 1 :]
    second = first if rng.random() < CARELESS_RATE else row["answer"]
    return [(first, reply(first, right, row["second"])), (second, None)]


def build(
    out: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR, log_every: int = 50
) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same reduction order, the same weights, on every run
    try:
        cfg = load_config(preset=PRESET)
        torch.manual_seed(SEED)
        tok = make_tokenizer()
        model = make_model(SHAPE, tok, seed=SEED)
        render = ChatRenderer(tok, cfg.model.chat_template, cfg.data.system_prompt)
        rng = random.Random(SEED)
        seqs, trained = [], []
        for r in make_split("train", steps * batch_size, seed=SEED):
            ids, mask = episode_ids(tok, render, r["question"], dialogue(r, rng))
            seqs.append(ids)
            trained.append(mask)
        sft(model, tok.pad_token_id, seqs, trained, steps, batch_size, lr, log_every)
        if out.exists():
            shutil.rmtree(out)
        return save(model, tok, out)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the dialogue demo's warm start.")
    ap.add_argument("--out", type=Path, default=packaged_path())
    ap.add_argument("--steps", type=int, default=STEPS)
    a = ap.parse_args(argv)
    build(a.out, steps=a.steps)
    print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
