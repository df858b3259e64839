"""Tool functions for the tests, named as ``tests.tool_fixtures:NAME`` like a user's own."""

import time


def echo_question(call: str, sample: dict) -> str:
    return f"{call} | {sample['question']}"


def hang(call: str, sample: dict) -> str:
    while True:
        time.sleep(1)


def calls_reward(completion: str, sample: dict) -> float:
    """A reward on the trajectory: the number of tool calls (from the sample dict) plus a check that
    every turn's text is in the completion."""
    assert all(t["text"].replace("<|im_end|>", "") in completion for t in sample["turns"])
    return float(sample["tool_calls"])


def show_sample(call: str, sample: dict) -> str:
    return repr(sample)
