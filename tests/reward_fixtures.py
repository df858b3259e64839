"""User reward functions for tests/test_rewards.py, resolved as ``tests.reward_fixtures:NAME``."""

from __future__ import annotations

import os
import time

NOT_CALLABLE = 42


def length(completion: str, sample: dict) -> float:
    """Number of characters: a deterministic, cheap reward."""
    return float(len(completion))


def boom(completion: str, sample: dict) -> float:
    """Raises on completions containing 'boom', else 0.5."""
    if "boom" in completion:
        raise ValueError("boom in completion")
    return 0.5


def hang(completion: str, sample: dict) -> float:
    """Sleeps 100 s on completions containing 'hang', else 2.0."""
    if "hang" in completion:
        time.sleep(100)
    return 2.0


def nan_on_x(completion: str, sample: dict) -> float:
    """NaN for 'x', inf for 'inf', a string for 'str', else 1."""
    if completion == "x":
        return float("nan")
    if completion == "inf":
        return float("inf")
    if completion == "str":
        return "1.0"  # type: ignore[return-value]
    return 1.0


def columns(completion: str, sample: dict) -> float:
    """Checks that every dataset column arrives: needs 'answer', 'difficulty' and 'meta'."""
    return float(sample["difficulty"]) + len(sample["meta"]["tags"]) + (sample["answer"] == "7")


def die(completion: str, sample: dict) -> float:
    """Kills its own process on 'die' (a crash, not an exception), else 3."""
    if completion == "die":
        os._exit(13)
    return 3.0


def cut_off(completion: str, sample: dict) -> float:
    """1 for a completion the token limit cut off (``finish_reason == "length"``), 0 if the model ended it."""
    return {"length": 1.0, "stop": 0.0}[sample["finish_reason"]]
