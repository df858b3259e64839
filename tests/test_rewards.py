"""Rewards: extraction, built-ins, spec resolution, and the guarded runner."""

from __future__ import annotations

import logging
import math
import time

import pytest

from nanogrpo.config import RewardsConfig
from nanogrpo.errors import ConfigError, RewardError
from nanogrpo.grading import extract_answer
from nanogrpo.grading.extract import last_number
from nanogrpo.rewards import (
    RewardResult,
    RewardRunner,
    correctness,
    format_reward,
    resolve,
)
from nanogrpo.rewards.resolve import resolve_all

# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("It costs $1,234.50 dollars in total", "1,234.50"),
        ("She has 72 apples", "72"),
        ("Add 3 and 4 to get 1,234", "1,234"),
        ("So 3/4 of the pie", "3/4"),
        ("The temperature fell to -4.5 degrees", "-4.5"),
        ("x = -3", "-3"),
        ("5-3", "5-3"),  # an expression, evaluated (2), not its last number
        (r"the answer is \frac{1}{2}", r"\frac{1}{2}"),
        (r"so \boxed{18}", "18"),
        ("Total: 18.", "18"),
        ("we need .5 cups", ".5"),
        ("no answer here at all", None),
        ("", None),
    ],
)
def test_answer_as_written_in_messy_text(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>7 and 8</think><answer> 15 </answer>", "15"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last block wins
        ("<think>3 then 4</think><answer>72 apples</answer> 99", "72"),  # tag beats last number
        (r"<answer>\frac{144}{2}</answer>", r"\frac{144}{2}"),
        ("<think>it is 5</think><answer>7", "7"),  # unclosed: what follows the tag
        ("<think>5</think><answer>", None),  # an answer tag with nothing after it: no answer
        ("<answer><answer>9</answer>", "9"),
        ("<answer>  </answer> 9", None),  # empty block: nothing extracted
        ("<answer>\n-12\n</answer>", "-12"),
    ],
)
def test_extract_answer_tags(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_last_number_is_the_seeds_rule_read_as_written() -> None:
    assert last_number(r"-\frac{3}{4}") == r"-\frac{3}{4}"
    assert last_number("1,2345") == "2345"
    assert last_number("so 6 × 7 = 42 apples (7 boxes)") == "7"
    assert last_number("no digits") is None


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize(
    "completion, reference",
    [
        (r"<answer>\frac{144}{2}</answer>", "72"),
        ("<answer>1,234</answer>", "1234"),
        ("<answer>$18.00</answer>", "18"),
        (r"<answer>\$18</answer>", "18"),
        (r"<answer>\boxed{18}</answer>", "18"),
        (r"<answer>\frac{1}{2}</answer>", "0.5"),
        ("<answer>72 apples</answer>", "72"),
        ("<answer>x = 5</answer>", "5"),
        ("<answer>3/4</answer>", "0.75"),
        ("First 10, then 5, so the answer is 1,234", "1,234"),
        ("<think>...</think><answer>-7</answer>", "-7"),
    ],
)
def test_correctness_true(completion: str, reference: str) -> None:
    assert correctness(completion, {"answer": reference}) == 1.0


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("<answer>17</answer>", "18"),
        ("<answer>0.333</answer>", "1/3"),
        ("<answer>7</answer>", "-7"),
        ("<answer>18</answer> 17", "17"),  # the answer block counts, not the last number
        ("no number here", "5"),
        ("<answer></answer>", "5"),
        ("<answer>banana</answer>", "5"),
    ],
)
def test_correctness_false(completion: str, reference: str) -> None:
    assert correctness(completion, {"answer": reference}) == -1.0


# ----------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>a</think><answer>1</answer>", 1.25),
        ("<think>multi\nline</think><answer>1\n2</answer>", 1.25),
        ("  <think>a</think><answer>1</answer>\n", 1.25),  # whitespace around the blocks
        ("<think>a</think> <answer>1</answer>", 1.25),  # and between them (the seed: [\n ]*)
        ("<think>a</think><answer>1</answer> trailing", -1.0),
        ("preamble <think>a</think><answer>1</answer>", -1.0),
        ("<answer>1</answer>", -1.0),
        ("<think>a</think><answer>1", -1.0),
        ("", -1.0),
    ],
)
def test_format_reward(completion: str, expected: float) -> None:
    assert format_reward(completion, {}) == expected


# ----------------------------------------------------------------------------- registry


def test_resolve_builtins_and_user_functions(tmp_path) -> None:
    assert resolve("correctness") is correctness
    assert resolve("format") is format_reward
    assert resolve("tests.reward_fixtures:length")("abc", {}) == 3.0
    f = tmp_path / "my_reward.py"
    f.write_text("def r(completion, sample):\n    return 0.25\n")
    assert resolve(f"{f}:r")("", {}) == 0.25
    with RewardRunner([f"{f}:r", "format"], workers=1) as runner:  # the worker re-resolves the file
        assert runner.score(["x"], [{}]).total == [0.25 - 1.0]
    with pytest.raises(RuntimeError, match="after close"):
        runner.score(["x"], [{}])
    assert [s for s, _ in resolve_all(["format", "tests.reward_fixtures:boom"])] == [
        "format", "tests.reward_fixtures:boom"]


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("no_such_mod_xyz:f", ["'no_such_mod_xyz:f'", "cannot import module 'no_such_mod_xyz'",
                               "ModuleNotFoundError"]),
        ("tests.reward_fixtures:missing", ["has no attribute 'missing'", "length"]),
        ("tests.reward_fixtures:NOT_CALLABLE", ["'NOT_CALLABLE' is a int, not a function"]),
        ("correctnes", ["unknown built-in reward", "correctness, env, format", "module:function"]),
        ("nowhere/file.py:f", ["file not found"]),
        (":f", ["both parts"]),
    ],
)
def test_resolve_errors_are_one_line(spec: str, needles: list[str]) -> None:
    with pytest.raises(RewardError) as info:
        resolve(spec)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"reward {spec!r}")
    for needle in needles:
        assert needle in msg


def test_a_module_that_is_not_importable_is_answered_with_the_form_that_works(tmp_path, monkeypatch):
    """`nanogrpo train 'rewards.functions=[..."myrewards:brevity"]'` beside myrewards.py: the command does
    not import from the current directory; the error names the file form that works (issue 44)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nanogrpo_myrewards.py").write_text("def brevity(completion, sample):\n    return 1.0\n")
    with pytest.raises(RewardError) as info:
        resolve("nanogrpo_myrewards:brevity")
    said = "the file nanogrpo_myrewards.py is here: name it as 'nanogrpo_myrewards.py:brevity'"
    assert said in str(info.value)
    assert resolve("nanogrpo_myrewards.py:brevity")("", {}) == 1.0  # and that form works
    with pytest.raises(RewardError) as info:  # no such file either: the general advice
        resolve("nanogrpo_nowhere:f")
    assert "'path/to/nanogrpo_nowhere.py:f'" in str(info.value) and "PYTHONPATH" in str(info.value)
    from nanogrpo.envs.imports import import_attr

    with pytest.raises(ConfigError, match="name it as 'nanogrpo_myrewards.py:Game'"):  # env.source alike
        import_attr("nanogrpo_myrewards:Game")


def test_resolve_file_that_fails_to_import(tmp_path) -> None:
    f = tmp_path / "broken.py"
    f.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(RewardError, match="cannot import file .*ModuleNotFoundError"):
        resolve(f"{f}:r")


def test_runner_fails_at_construction_on_bad_spec() -> None:
    with pytest.raises(RewardError, match="no_such_mod_xyz"):
        RewardRunner(["format", "no_such_mod_xyz:f"], workers=1)
    with pytest.raises(RewardError, match="more than once"):
        RewardRunner(["format", "format"], workers=0)
    with pytest.raises(RewardError, match="weights"):
        RewardRunner(["format"], weights=[1.0, 2.0], workers=0)


# ----------------------------------------------------------------------------- runner


GOOD = "<think>4 + 3</think><answer>7</answer>"
SAMPLE = {"question": "4 + 3?", "answer": "7"}


def test_runner_applies_weights_in_process() -> None:
    cfg = RewardsConfig(functions=["correctness", "format", "tests.reward_fixtures:length"],
                        weights=[2.0, 0.5, 0.0], workers=0)
    with RewardRunner.from_config(cfg) as runner:
        res = runner.score([GOOD, "wrong 8"], [SAMPLE, SAMPLE])
        one = runner.score_one(GOOD, SAMPLE)
    assert isinstance(res, RewardResult)
    assert res.per_function["correctness"] == [1.0, -1.0]
    assert res.per_function["format"] == [1.25, -1.0]
    assert res.per_function["tests.reward_fixtures:length"] == [float(len(GOOD)), 7.0]
    assert res.total == pytest.approx([2.0 + 0.625, -2.0 - 0.5])
    assert (res.failures, res.timeouts, res.non_finite) == (0, 0, 0)
    assert one == pytest.approx(2.625)


@pytest.mark.parametrize("workers", [0, 1])
def test_raising_and_non_finite_get_the_penalty(workers: int, caplog) -> None:
    specs = ["tests.reward_fixtures:boom", "tests.reward_fixtures:nan_on_x"]
    comps = ["ok", "boom", "x", "inf", "str", "boom"]
    with caplog.at_level(logging.WARNING, logger="nanogrpo.rewards"):
        with RewardRunner(specs, penalty=-3.0, workers=workers) as runner:
            res = runner.score(comps, [SAMPLE] * len(comps))
            for _ in range(3):  # more problems: counted, but the log stays short
                runner.score(["boom"], [SAMPLE])
    assert res.per_function["tests.reward_fixtures:boom"] == [0.5, -3.0, 0.5, 0.5, 0.5, -3.0]
    assert res.per_function["tests.reward_fixtures:nan_on_x"] == [1.0, 1.0, -3.0, -3.0, -3.0, 1.0]
    assert res.total == pytest.approx([1.5, -2.0, -2.5, -2.5, -2.5, -2.0])
    assert (res.failures, res.timeouts, res.non_finite) == (2, 0, 3)
    boom_logs = [r for r in caplog.records if "boom" in r.getMessage()]
    assert 3 <= len(boom_logs) <= 4  # 3 per function, then one summary at close()
    assert "ValueError: boom in completion" in boom_logs[0].getMessage()
    assert "5 raised" in boom_logs[-1].getMessage()


@pytest.mark.slow
def test_hanging_function_is_cut_and_the_rest_still_scored() -> None:
    specs = ["tests.reward_fixtures:hang", "correctness"]
    comps = ["<answer>7</answer>", "hang <answer>7</answer>", "<answer>8</answer>", "<answer>7</answer>"]
    with RewardRunner(specs, timeout_s=1.0, penalty=-5.0, workers=1) as runner:
        runner.start()
        runner.score(["warm"], [SAMPLE])  # worker started, math_verify imported
        t0 = time.monotonic()
        res = runner.score(comps, [SAMPLE] * len(comps))
        elapsed = time.monotonic() - t0
        # the replacement worker scores the next batch normally
        again = runner.score(comps[:1], [SAMPLE])
    assert res.per_function["tests.reward_fixtures:hang"] == [2.0, -5.0, 2.0, 2.0]
    assert res.per_function["correctness"] == [1.0, 1.0, -1.0, 1.0]
    assert res.timeouts == 1 and res.failures == 0
    # 1 s to the cut, then the replacement worker starts (it imports math_verify and sympy first: 1-2 s of
    # CPU, many times that in wall clock when a shared machine's cores are busy) before the rest of the
    # chunk runs; an unbounded hang would be 100 s
    assert elapsed < 60.0, f"hang not bounded: {elapsed:.1f} s"
    assert again.total == [3.0]


def test_worker_crash_costs_one_call() -> None:
    with RewardRunner(["tests.reward_fixtures:die"], penalty=-2.0, workers=1) as runner:
        res = runner.score(["a", "die", "b"], [SAMPLE] * 3)
    assert res.total == [3.0, -2.0, 3.0]
    assert res.failures == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_user_function_sees_every_column(workers: int) -> None:
    samples = [{"question": "q", "answer": "7", "difficulty": 2, "meta": {"tags": ["a", "b"]}},
               {"question": "q", "answer": "8", "difficulty": 0.5, "meta": {"tags": []}}]
    with RewardRunner(["tests.reward_fixtures:columns"], workers=workers) as runner:
        res = runner.score(["c1", "c2"], samples)
    assert res.total == [5.0, 0.5]
    assert res.failures == 0


@pytest.mark.slow
def test_pool_matches_in_process_on_builtins() -> None:
    comps = [GOOD, "<think>x</think><answer>\\frac{14}{2}</answer>", "it is 1,234", "nothing"]
    samples = [SAMPLE, SAMPLE, {"answer": "1234"}, SAMPLE]
    with RewardRunner(["correctness", "format"], workers=0) as a, \
            RewardRunner(["correctness", "format"], workers=1) as b:
        ra, rb = a.score(comps, samples), b.score(comps, samples)
    assert ra == rb
    assert all(math.isfinite(t) for t in ra.total)
    assert ra.total == [2.25, 2.25, 0.0, -2.0]
