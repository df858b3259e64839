"""The game demo written for verifiers 0.4 (the v1 API), beside the classic environment
(:mod:`nanogrpo.demos.game.env`): the same game, rows, rules and reward, as a verifiers environment
package would write it, so the two ways read side by side.

- a **task** (:class:`GameTask`) holds one game's data (the row's ``question`` as its prompt, its
  ``secret``) and scores a finished trace with ``@vf.reward``: 0.9 ** k for a number found at the model's
  turn k (0, 1, ...; the classic preset's ``grpo.turn_reward_discount = 0.9``), else 0; and a ``success``
  metric (what ``accuracy`` counts);
- the **env** (:class:`GameEnv`) plays it: the model moves first, the game answers ``higher`` / ``lower``
  as the user's next message (an ``interaction``), until the number is found or the agent's turn limit
  (``env.max_turns``) ends it;
- the **taskset** (:class:`GameTaskset`) lists its own games (the train split's rows); a run's dataset
  rows (``data.source = "game"``) become tasks the same way (their ``question`` and ``secret``).

``nanogrpo train --config configs/demo-game-v1.toml`` (needs ``pip install 'nanogrpo[envs]'``). The
harness: ``nanogrpo-chat`` (the ``null`` harness's chat loop in the trainer's process; the ``null`` uv
script would start a Python process per turn). What it costs beside the classic environment:
docs/figures.md.
"""

from __future__ import annotations

import verifiers.v1 as vf

from nanogrpo.demos.game.env import feedback, read_guess
from nanogrpo.demos.game.task import make_split

DISCOUNT = 0.9


class GameData(vf.TaskData):
    secret: int
    """The number to find (1 to 15)."""


class GameTask(vf.Task[GameData, vf.State, vf.TaskConfig]):
    def found_at(self, trace) -> int | None:
        """The model's turn that found the number (0, 1, ...), None if none did."""
        for k, msg in enumerate(trace.assistant_messages):
            if read_guess(msg.content or "") == self.data.secret:
                return k
        return None

    @vf.reward
    async def found(self, trace) -> float:
        k = self.found_at(trace)
        return 0.0 if k is None else DISCOUNT ** k

    @vf.metric
    async def success(self, trace) -> float:
        return float(self.found_at(trace) is not None)


class GameTaskset(vf.Taskset[GameTask, vf.TasksetConfig]):
    def load(self):
        for row in make_split("train", 1000):
            data = GameData(id=row["id"], prompt=row["question"], secret=row["secret"])
            yield GameTask(data, self.config.task)


class GameEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as game:
            turn = await game.turn()  # the model's first guess
            while not turn.terminated and read_guess(turn.last_reply) != task.data.secret:
                turn = await game.turn(feedback(read_guess(turn.last_reply), task.data.secret))


__all__ = ["GameEnv", "GameTaskset"]
