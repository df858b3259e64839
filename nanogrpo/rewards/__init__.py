"""Rewards: the built-in rewards, user rewards by spec or as callables, and the runner that scores a
batch with them.

A reward is a plain function ``fn(completion: str, sample: dict) -> float``, or the same over lists
(``fn(completions, samples) -> list[float]``, marked with :func:`batched`); an LLM judge
(:class:`Judge`, ``judge:URL``, :mod:`nanogrpo.rewards.judges`) or a reward model (``rm:PATH``,
:mod:`nanogrpo.rewards.reward_model`) sits behind the same interface. ``sample`` is the
completion's own dict: a copy of its dataset row (every column) plus the reserved keys
``finish_reason`` (``"stop"``: the model ended the completion; ``"length"``: the token limit cut it
off), ``completion_tokens`` (the tokens the model sampled) and ``max_new_tokens`` (the limit on
them), which replace dataset columns of those names.

How an answer is read and judged right (what ``correctness`` calls) is :mod:`nanogrpo.grading`.
:func:`reward_runner` builds a run's runner from its config.

Importing this package has no side effects; math_verify loads on first use, torch with a reward model.
"""

from nanogrpo.rewards.batching import batched
from nanogrpo.rewards.builtin import correctness, format_boxed, format_reward, format_strict, overlong
from nanogrpo.rewards.resolve import resolve
from nanogrpo.rewards.runner import RewardItem, RewardResult, RewardRunner, reward_runner

__all__ = ["correctness", "format_reward", "format_strict", "format_boxed", "overlong", "resolve", "batched",
           "RewardRunner", "RewardResult", "RewardItem", "reward_runner", "Judge"]


def __getattr__(name: str):
    """``Judge`` loads on first use (it brings asyncio and httpx)."""
    if name == "Judge":
        from nanogrpo.rewards.judges.judge import Judge

        return Judge
    raise AttributeError(f"module 'nanogrpo.rewards' has no attribute {name!r}")
