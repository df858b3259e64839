"""Guess the number: the model guesses, the game answers ``higher`` or ``lower``, until it is found.

One episode per :class:`GuessNumber` (``env.source = "nanogrpo.demos.game.env:GuessNumber"``). Reward 1
for the turn that finds the number (``grpo.turn_reward_discount`` makes a quicker find worth more), 0
otherwise; ``env.max_turns`` guesses at most. A binary search finds any number of 1..15 in four guesses;
guessing without the feedback finds it in four with probability 4/15.
"""

from __future__ import annotations

from nanogrpo.demos.game.task import HIGH, LOW
from nanogrpo.envs import Environment, StepResult


def read_guess(action: str) -> int | None:
    text = action.strip()
    return int(text) if text.isdigit() and len(text) <= 3 else None


def feedback(guess: int | None, secret: int) -> str:
    """What the game answers a wrong guess."""
    if guess is None or not LOW <= guess <= HIGH:
        return f"a number, {LOW}-{HIGH}"
    return "higher" if guess < secret else "lower"


class GuessNumber(Environment):
    def reset(self, row: dict) -> str:
        self.secret = int(row["secret"])
        return row["question"]

    def step(self, action: str) -> StepResult:
        guess = read_guess(action)
        if guess == self.secret:
            return StepResult(reward=1.0, done=True, info={"success": True})
        return StepResult(feedback(guess, self.secret), 0.0, info={"success": False})
