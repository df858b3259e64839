"""A simulated customer: orders an item, answers what the model asks, checks the order it is told.

One episode per :class:`SimulatedUser` (``env.source = "nanogrpo.demos.dialogue.env:SimulatedUser"``):

- the customer's first message is the row's question (``"one soup, please"``); the size is not in it;
- the customer replies to the model's first answer: an order that names the right size and item
  (``"large soup"``) is accepted at once (reward 1, done); a wrong one gets ``"no, large"``; anything
  else (the question ``"size?"``) gets the size: ``"large"``;
- the model's second answer is checked (reward 1 if it is the order ``"large soup"``) and ends the
  episode (``env.max_turns = 2``).

Success (``info["success"]``): the order was said right.
"""

from __future__ import annotations

from nanogrpo.demos.dialogue.task import SIZES
from nanogrpo.envs import Environment, StepResult


def reply(first_answer: str, size: str) -> str:
    """What the customer says to the model's first answer (not the right order)."""
    words = first_answer.strip().split()
    return f"no, {size}" if words and words[0] in SIZES else size


class SimulatedUser(Environment):
    def reset(self, row: dict) -> str:
        self.size, self.order = row["size"], f"{row['size']} {row['item']}"
        self.turn = 0
        return row["question"]

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if action.strip() == self.order:
            return StepResult(reward=1.0, done=True, info={"success": True})
        if self.turn == 1:
            return StepResult(reply(action, self.size), 0.0, info={"success": False})
        return StepResult(reward=0.0, done=True, info={"success": False})
