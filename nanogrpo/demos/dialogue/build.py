"""The dialogue demo's warm start: the embedded model's shape, taught to ask for the size and then,
sometimes, to ignore the answer.

Supervised dialogues (:mod:`nanogrpo.demos.dialogue.task`), rendered as the episode rollout renders them
(:func:`nanogrpo.demos.game.build.episode_ids`: the model's answers trained, the customer's messages not)::

    user: one soup, please   assistant: size?   user: large   assistant: large soup

In ``CARELESS_RATE`` of the dialogues the second answer ignores the customer's reply and orders the
default size (``medium soup``); in the others it takes the size from the reply. Decoding greedily the
warm start orders medium whatever it was told (right for a third of the orders), while the listening
answers are among its samples: GRPO, rewarded only for the right order, learns to read the reply.

Shipped in ``nanogrpo/demos/dialogue/weights/`` (model path ``embedded-dialogue``); rebuild with
``python -m nanogrpo.demos.dialogue.build --out DIR``.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from nanogrpo.config import load_config
from nanogrpo.demos.arithmetic.build import SHAPE
from nanogrpo.demos.dialogue.env import reply
from nanogrpo.demos.dialogue.task import make_split
from nanogrpo.demos.game.build import episode_ids
from nanogrpo.demos.warm_start import builder_main, one_thread, train_and_save
from nanogrpo.episodes.render import ChatRenderer
from nanogrpo.models.tiny import make_model, make_tokenizer

SEED = 1357
CARELESS_RATE = 0.6
DEFAULT_SIZE = "medium"
STEPS, BATCH_SIZE, LR = 200, 64, 3e-3
PRESET = "demo-dialogue"


def packaged_path() -> Path:
    """This folder's ``weights/``: where the package ships what this program builds."""
    return Path(__file__).resolve().parent / "weights"


def dialogue(row: dict, rng: random.Random) -> list[tuple[str, str | None]]:
    """The dialogue's turns: the model asks, the customer answers, the model orders (listening or not)."""
    size = row["size"] if rng.random() >= CARELESS_RATE else DEFAULT_SIZE
    return [("size?", reply("size?", row["size"])), (f"{size} {row['item']}", None)]


def build(
    out: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR, log_every: int = 50
) -> Path:
    with one_thread():  # one thread: the same reduction order, the same weights, on every run
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
        return train_and_save(model, tok, seqs, trained, out, steps, batch_size, lr, log_every, replace=True)


def main(argv: list[str] | None = None) -> int:
    return builder_main(argv, "Build the dialogue demo's warm start.", build, packaged_path(), STEPS)


if __name__ == "__main__":
    raise SystemExit(main())
