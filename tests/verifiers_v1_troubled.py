"""A verifiers 0.4 environment that breaks on purpose, by the number of the row (``secret``): 1 raises in
``run()``, 2 hangs, 3 hands back a trace whose first sampled token is not the one sampled, 13 kills the
process it runs in once (an environment server's: ``env.server = "start"``; a file marks that it did);
any other is the guess game (:mod:`tests.verifiers_v1_fixtures`)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import verifiers.v1 as vf

from tests.verifiers_v1_fixtures import GuessTask, GuessTaskset


class TroubledConfig(vf.TasksetConfig):
    kill_marker: str = ""
    """Where the secret-13 task notes that it killed its server (so that it does so once)."""


class TroubledTaskset(vf.Taskset[GuessTask, TroubledConfig]):
    load = GuessTaskset.load


class TroubledEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        secret = task.data.secret
        if secret == 1:
            raise RuntimeError("the environment broke")
        if secret == 2:
            await asyncio.sleep(3600)
        if secret == 13 and self.config.taskset.kill_marker:
            marker = Path(self.config.taskset.kill_marker)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        await agents.agent.run(task)

    async def finalize(self, task, episode):
        if task.data.secret == 3:
            node = next(n for t in episode.traces for n in t.nodes if any(n.mask))
            k = node.mask.index(True)
            node.token_ids[k] = 3 + (node.token_ids[k] - 2) % 90


__all__ = ["TroubledEnv", "TroubledTaskset"]
