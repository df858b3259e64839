"""A simulated user: asks for a change to a word, replies to the model's answer, asks for one more.

One episode per :class:`SimulatedUser` (``env.source = "nanogrpo.demos.dialogue.env:SimulatedUser"``):

- the user's first message is the row's question (``"upper kmp"``);
- to the model's first answer the user replies ``"ok. now twice"`` when it is right, or
  ``"no, KMP. now twice"`` (the right result) when it is not: either way the second change applies to
  the right first result;
- the model's second answer ends the episode.

Per-turn rewards: 0.5 for a right first answer, 1 for a right second one (``info["success"]``).
"""

from __future__ import annotations

from nanogrpo.demos.dialogue.task import apply
from nanogrpo.envs import Environment, StepResult


def reply(first_answer: str, right: str, second: str) -> str:
    """What the user says to the model's first answer."""
    return f"ok. now {second}" if first_answer.strip() == right else f"no, {right}. now {second}"


class SimulatedUser(Environment):
    def reset(self, row: dict) -> str:
        self.first = apply(row["first"], row["word"])
        self.second_op = row["second"]
        self.final = apply(self.second_op, self.first)
        self.turn = 0
        return row["question"]

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            right = action.strip() == self.first
            return StepResult(reply(action, self.first, self.second_op), 0.5 if right else 0.0)
        success = action.strip() == self.final
        return StepResult(reward=1.0 if success else 0.0, done=True, info={"success": success})
