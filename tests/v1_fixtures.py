"""verifiers 0.4 (v1) environments written with its own classes, for the v1 adapter's tests
(importable by ``env.source`` strings, ``verifiers:tests.v1_fixtures:...``)."""

from __future__ import annotations

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int
    """The number to guess (the row's ``secret``)."""


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def found(self, trace) -> float:
        """1 when the model's (only) reply is the number."""
        return 1.0 if trace.last_reply.strip() == str(self.data.secret) else 0.0


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    """Guess the number in one reply (the game demo's rows: ``question`` and ``secret``)."""

    def load(self):
        for secret in range(1, 16):
            yield GuessTask(GuessData(prompt="Tom picks a number, 1-15. Guess it.", secret=secret),
                            self.config.task)
