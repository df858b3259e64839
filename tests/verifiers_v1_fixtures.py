"""A verifiers 0.4 (v1) taskset written with its own classes, as a user writes one: guess the number in
one reply, scored by a ``@vf.reward`` (``env.source = "verifiers:tests.verifiers_v1_fixtures:GuessTaskset"``;
the rows are the game demo's: ``question``, ``secret``)."""

from __future__ import annotations

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int
    """The number to guess (the row's ``secret``)."""


def guessed(reply: str) -> int | None:
    text = reply.strip()
    return int(text) if text.isdigit() and len(text) <= 3 else None


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def closeness(self, trace) -> float:
        """1 for the number, less the further the reply is from it; 0 for a reply that is no number."""
        g = guessed(trace.last_reply)
        return 0.0 if g is None else max(0.0, 1.0 - abs(g - self.data.secret) / 15)

    @vf.metric
    async def success(self, trace) -> float:
        return float(guessed(trace.last_reply) == self.data.secret)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    """Fifteen games, one per number (the taskset's own tasks; a dataset's rows may name others)."""

    def load(self):
        for secret in range(1, 16):
            yield GuessTask(GuessData(id=f"secret-{secret}", prompt="Tom picks a number, 1-15. Guess it.",
                                      secret=secret), self.config.task)


__all__ = ["GuessTaskset"]
