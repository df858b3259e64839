"""The game demo's warm start: the embedded model's shape, taught to play guess-the-number two ways.

Supervised games (:mod:`nanogrpo.demos.game.task`), each turn rendered exactly as the episode rollout
renders it (:class:`~nanogrpo.episodes.render.ChatRenderer`: the model's guess and its EOS trained, the
game's answer not)::

    user: Tom picks a number, 1-15. Guess it.   assistant: 8   user: lower   assistant: 4   user: higher ...

In ``CARELESS_RATE`` of the games the player ignores the feedback and guesses 1, 2, 3, ... (found within
five guesses only when the number is at most 5); in the others it binary-searches (found in at most four).
So the warm start, decoding greedily, plays the careless way (it opens with 1) and finds a third of the
numbers, while the careful games are among its samples: GRPO, rewarded only for finding the number, has
to find the feedback's worth by itself.

Shipped in ``nanogrpo/demos/game/weights/`` (model path ``embedded-game``); rebuild with
``python -m nanogrpo.demos.game.build --out DIR``.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from nanogrpo.config import load_config
from nanogrpo.demos.arithmetic.build import SHAPE
from nanogrpo.demos.game.env import feedback
from nanogrpo.demos.game.task import HIGH, LOW, make_split
from nanogrpo.demos.warm_start import builder_main, one_thread, train_and_save
from nanogrpo.episodes.render import ChatRenderer
from nanogrpo.models.tiny import make_model, make_tokenizer

SEED = 2468
CARELESS_RATE = 0.6
STEPS, BATCH_SIZE, LR = 300, 64, 3e-3
PRESET = "demo-game"


def packaged_path() -> Path:
    """This folder's ``weights/``: where the package ships what this program builds."""
    return Path(__file__).resolve().parent / "weights"


def episode_ids(
    tok, render: ChatRenderer, first: str, turns: list[tuple[str, str | None]]
) -> tuple[list[int], list[bool]]:
    """Token ids and trained-mask of a whole episode as the rollout lays it out: the prompt (``first``
    observation), then per turn the model's ``action`` and EOS (trained) and, unless None, the
    observation that follows (not trained)."""
    ids = render.prompt(first)
    mask = [False] * len(ids)
    for action, obs in turns:
        act = tok(action, add_special_tokens=False).input_ids + [tok.eos_token_id]
        ids += act
        mask += [True] * len(act)
        if obs is not None:
            fed = render.after_turn(obs)
            ids += fed
            mask += [False] * len(fed)
    return ids, mask


def play(secret: int, careless: bool, max_turns: int) -> list[tuple[str, str | None]]:
    """A game's turns: (guess, the game's answer or None once found or out of turns)."""
    lo, hi, turns = LOW, HIGH, []
    for t in range(max_turns):
        guess = LOW + t if careless else (lo + hi) // 2
        if guess == secret:
            return turns + [(str(guess), None)]
        if guess < secret:
            lo = max(lo, guess + 1)
        else:
            hi = min(hi, guess - 1)
        turns.append((str(guess), feedback(guess, secret) if t + 1 < max_turns else None))
    return turns


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
            ids, mask = episode_ids(
                tok, render, r["question"], play(r["secret"], rng.random() < CARELESS_RATE, cfg.env.max_turns)
            )
            seqs.append(ids)
            trained.append(mask)
        return train_and_save(model, tok, seqs, trained, out, steps, batch_size, lr, log_every, replace=True)


def main(argv: list[str] | None = None) -> int:
    return builder_main(argv, "Build the game demo's warm start.", build, packaged_path(), STEPS)


if __name__ == "__main__":
    raise SystemExit(main())
