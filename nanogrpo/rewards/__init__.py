"""Rewards: answer extraction, the built-in rewards, user rewards by spec, and the runner.

A reward is a plain function ``fn(completion: str, sample: dict) -> float``.
Importing this package has no side effects; math_verify loads on first use.
"""

from nanogrpo.rewards.builtin import correctness, format_reward
from nanogrpo.rewards.extract import extract_answer
from nanogrpo.rewards.registry import resolve
from nanogrpo.rewards.runner import RewardResult, RewardRunner

__all__ = ["extract_answer", "correctness", "format_reward", "resolve", "RewardRunner", "RewardResult"]
