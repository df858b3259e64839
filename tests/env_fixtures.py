"""Environments for the tests: well-behaved ones and ones that break in each way an episode must survive."""

from __future__ import annotations

import asyncio
import threading

from nanogrpo.envs import Environment, StepResult

RELEASE = threading.Event()
"""Set at the end of a test to let the hanging environments' threads go."""


class Count(Environment):
    """Answers ``seen N``; reward 0.25 a turn; done after the third turn."""

    def reset(self, row):
        self.n = 0
        return f"count {row['question']}"

    def step(self, action):
        self.n += 1
        return StepResult(f"seen {self.n}", 0.25, self.n >= 3, {"action": action})


class Misbehaves(Environment):
    """Behaves as :class:`Count` except as ``row["mode"]`` says: ``raise`` / ``hang`` / ``nan`` /
    ``long`` (an observation of 500 characters) at the first step, ``reset_raise`` in reset."""

    def reset(self, row):
        self.mode, self.n = row["mode"], 0
        if self.mode == "reset_raise":
            raise ValueError("no such level")
        return "go"

    def step(self, action):
        self.n += 1
        if self.mode == "raise":
            raise RuntimeError("the game crashed")
        if self.mode == "hang":
            RELEASE.wait(60)
        if self.mode == "nan":
            return "x", float("nan"), False
        if self.mode == "long":
            return "y" * 500, 1.0, False
        return StepResult(f"seen {self.n}", 1.0, self.n >= 2)


class AsyncCount:
    """:class:`Count` with ``async def`` methods (no base class)."""

    async def reset(self, row):
        await asyncio.sleep(0)
        self.n = 0
        return [{"role": "user", "content": f"count {row['question']}"}]

    async def step(self, action):
        await asyncio.sleep(0.001)
        self.n += 1
        return f"seen {self.n}", 0.25, self.n >= 3


class RunsCode(Environment):
    """Runs the model's action as Python in the sandbox it is handed; answers its output."""

    def reset(self, row):
        return "code"

    def step(self, action):
        status, output = self.sandbox.run(action)
        return StepResult(output, 1.0 if status == "ok" else 0.0, True, {"status": status})


class Numbered(Count):
    """:class:`Count` whose first observation differs per episode (a counter across instances)."""

    made = 0

    def reset(self, row):
        Numbered.made += 1
        self.n = 0
        return f"count {row['question']} #{Numbered.made}"


FLOOD_BYTES = 10 * 2**20


class Floods(Environment):
    """``row["mode"]``: ``flood`` answers a 10 MiB observation at the first step (``flood_messages``: as a
    tool message), ``reset_flood`` starts with one, ``none`` answers None (a step without its return),
    anything else plays :class:`Count`."""

    def reset(self, row):
        self.mode, self.n = row["mode"], 0
        return "z" * FLOOD_BYTES if self.mode == "reset_flood" else "go"

    def step(self, action):
        self.n += 1
        if self.mode == "flood":
            return StepResult("y" * FLOOD_BYTES, 0.5)
        if self.mode == "flood_messages":
            return StepResult([{"role": "tool", "content": "é" * (FLOOD_BYTES // 2)}], 0.5)
        if self.mode == "none":
            return None
        return StepResult(f"seen {self.n}", 0.25, self.n >= 3)
