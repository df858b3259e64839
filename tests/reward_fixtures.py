"""User reward functions for tests/test_rewards.py, resolved as ``tests.reward_fixtures:NAME``."""

from __future__ import annotations

import os
import time

NOT_CALLABLE = 42


def length(completion: str, sample: dict) -> float:
    """Number of characters: a deterministic, cheap reward. ``TEST_REWARD_SLEEP`` (seconds per call) slows
    it down, for a test that must catch a run in the middle of its steps however busy the machine is."""
    if os.environ.get("TEST_REWARD_SLEEP"):
        time.sleep(float(os.environ["TEST_REWARD_SLEEP"]))
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


def pid(completion: str, sample: dict) -> float:
    """The id of the process the reward runs in."""
    return float(os.getpid())


def cut_off(completion: str, sample: dict) -> float:
    """1 for a completion the token limit cut off (``finish_reason == "length"``), 0 if the model ended it."""
    return {"length": 1.0, "stop": 0.0}[sample["finish_reason"]]


# ----------------------------------------------------------------------------- batched rewards
# (tests/test_rewards_batched.py). Batched functions mark themselves with nanogrpo.rewards.batched or
# the attribute ``batched = True``; a sample's "log" key, when present, names a file each call appends
# one line to (its pid and row count), so a test can count the calls made in a worker process.

from nanogrpo.rewards import batched  # noqa: E402


def _log_call(samples: list[dict]) -> None:
    path = samples[0].get("log") if samples else None
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {len(samples)}\n")


@batched
def rows_in_call(completions: list[str], samples: list[dict]) -> list[float]:
    """Each row scores the number of rows in its call (one call over N rows: N everywhere)."""
    _log_call(samples)
    return [float(len(completions))] * len(completions)


@batched(chunk_size=3)
def rows_in_call_of_3(completions: list[str], samples: list[dict]) -> list[float]:
    """As rows_in_call, asking for chunks of 3 rows."""
    _log_call(samples)
    return [float(len(completions))] * len(completions)


def length_batched(completions: list[str], samples: list[dict]):
    """Length of each completion, as a numpy array (marked by attribute, not by the decorator)."""
    import numpy as np

    _log_call(samples)
    return np.array([len(c) for c in completions], dtype=np.float64)


length_batched.batched = True


@batched
def faulty_batch(completions: list[str], samples: list[dict]) -> list[float]:
    """A chunk holding 'raise' raises, one holding 'short' returns one value too few, one holding
    'hang' sleeps 100 s; otherwise 1.0 per row except NaN for 'nan' and a string for 'str'."""
    if "raise" in completions:
        raise RuntimeError("batch scorer failed")
    if "hang" in completions:
        time.sleep(100)
    values: list = [float("nan") if c == "nan" else "x" if c == "str" else 1.0 for c in completions]
    return values[:-1] if "short" in completions else values


@batched
def not_a_list(completions: list[str], samples: list[dict]) -> float:
    return 1.0


class Scorer:
    """A callable object that is batched through its class attribute."""

    batched = True

    def __init__(self, bonus: float):
        self.bonus = bonus

    def __call__(self, completions: list[str], samples: list[dict]) -> list[float]:
        return [self.bonus + len(c) for c in completions]
