"""Batched rewards and Python callables as rewards: where they run, how often they are called, and the
failure rules (a raise, a hang, a wrong-length or non-finite result: the penalty on the rows it covers)."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time

import pytest

from nanogrpo.config import RewardsConfig
from nanogrpo.errors import RewardError
from nanogrpo.rewards import RewardRunner, batched, correctness
from nanogrpo.rewards.entries import INLINE, POOL
from tests import reward_fixtures as fx

SAMPLE = {"question": "4 + 3?", "answer": "7"}


def _calls(path) -> list[tuple[int, int]]:
    """(pid, rows) of each logged call."""
    if not path.exists():
        return []
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batched_reward_over_256_completions_is_one_call(workers, tmp_path) -> None:
    log = tmp_path / "calls.log"
    comps = [f"c{i}" for i in range(256)]
    samples = [{**SAMPLE, "log": str(log)} for _ in comps]
    with RewardRunner(["tests.reward_fixtures:rows_in_call"], workers=workers) as runner:
        res = runner.score(comps, samples)
    assert res.total == [256.0] * 256
    calls = _calls(log)
    assert len(calls) == 1 and calls[0][1] == 256
    assert (calls[0][0] == os.getpid()) == (workers == 0)  # workers >= 1: in a worker process


def test_chunks_from_config_and_from_the_function(tmp_path) -> None:
    log = tmp_path / "calls.log"
    comps = [f"c{i}" for i in range(10)]
    samples = [{**SAMPLE, "log": str(log)} for _ in comps]
    cfg = RewardsConfig(functions=["tests.reward_fixtures:rows_in_call",
                                   "tests.reward_fixtures:rows_in_call_of_3",
                                   "tests.reward_fixtures:length_batched"],
                        chunk_size=4, workers=0)
    with RewardRunner.from_config(cfg) as runner:
        res = runner.score(comps, samples)
    assert res.per_function["tests.reward_fixtures:rows_in_call"] == [4.0] * 8 + [2.0] * 2
    assert res.per_function["tests.reward_fixtures:rows_in_call_of_3"] == [3.0] * 9 + [1.0]
    assert res.per_function["tests.reward_fixtures:length_batched"] == [float(len(c)) for c in comps]
    assert sorted(rows for _, rows in _calls(log)) == sorted([4, 4, 2, 3, 3, 3, 1, 4, 4, 2])


@pytest.mark.parametrize("workers", [0, 1])
def test_batched_failures_cost_the_rows_they_cover(workers, caplog) -> None:
    spec = "tests.reward_fixtures:faulty_batch"
    # chunks of 3: [ok ok nan] [raise ok ok] [ok short ok] [str ok ok]
    comps = ["a", "b", "nan", "raise", "c", "d", "e", "short", "f", "str", "g", "h"]
    with caplog.at_level(logging.WARNING, logger="nanogrpo.rewards"):
        with RewardRunner([spec, "tests.reward_fixtures:length"], penalty=-4.0, workers=workers,
                          chunk_size=3) as runner:
            res = runner.score(comps, [SAMPLE] * len(comps))
    assert res.per_function[spec] == [1, 1, -4, -4, -4, -4, -4, -4, -4, -4, 1, 1]
    assert res.per_function["tests.reward_fixtures:length"] == [float(len(c)) for c in comps]  # untouched
    assert (res.failures, res.timeouts, res.non_finite) == (3, 0, 5)
    assert res.failures_by_function == {spec: 8, "tests.reward_fixtures:length": 0}
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "raised on a call over batch items 3-5 (3 rows) (RuntimeError: batch scorer failed)" in text
    assert "returned 2 values for 3 completions" in text


def test_a_batched_result_that_is_not_a_list_is_scored_the_penalty() -> None:
    with RewardRunner(["tests.reward_fixtures:not_a_list"], workers=0, penalty=-2.0) as runner:
        res = runner.score(["a", "b"], [SAMPLE] * 2)
    assert res.total == [-2.0, -2.0] and res.non_finite == 2


@pytest.mark.slow
def test_a_hanging_batched_call_is_cut_and_the_other_chunks_scored() -> None:
    spec = "tests.reward_fixtures:faulty_batch"
    comps = ["a", "b", "hang", "c", "d", "e"]
    with RewardRunner([spec], workers=2, chunk_size=3, batch_timeout_s=1.0, penalty=-9.0) as runner:
        runner.start()
        runner.score(["warm"], [SAMPLE])
        t0 = time.monotonic()
        res = runner.score(comps, [SAMPLE] * len(comps))
        elapsed = time.monotonic() - t0
        again = runner.score(["x"], [SAMPLE])  # a replacement worker carries on
    assert res.total == [-9.0, -9.0, -9.0, 1.0, 1.0, 1.0]
    assert res.timeouts == 3
    # 1 s to the cut, then a replacement worker starts (imports: seconds of wall clock on a busy shared
    # machine); an unbounded hang would be 100 s
    assert elapsed < 60, elapsed
    assert again.total == [1.0]


# ----------------------------------------------------------------------------- callables


def test_callables_of_every_kind_run_in_the_workers(caplog) -> None:
    offset = 100.0
    closure = lambda c, s: offset + len(c)  # noqa: E731 - a closure over a local
    partial = functools.partial(lambda c, s, k: k * len(c), k=2.0)
    scorer = fx.Scorer(bonus=0.5)
    fns = [fx.pid, fx.length, closure, partial, scorer, batched(lambda cs, ss: [1.0] * len(cs))]
    with caplog.at_level(logging.INFO, logger="nanogrpo.rewards"):  # information, not a warning
        runner = RewardRunner(fns, weights=[0, 1, 1, 1, 1, 1], workers=1)
    with runner:
        assert [e.where for e in runner.entries] == [POOL] * 6
        res = runner.score(["ab", "abcd"], [SAMPLE] * 2)
    assert runner.specs == ["pid", "length", "lambda", "lambda_2", "Scorer", "lambda_3"]
    assert all(p != os.getpid() for p in res.per_function["pid"])
    assert res.per_function["lambda"] == [102.0, 104.0]
    assert res.per_function["lambda_2"] == [4.0, 8.0]
    assert res.per_function["Scorer"] == [2.5, 4.5]
    assert res.per_function["lambda_3"] == [1.0, 1.0]
    assert res.total == [2 + 102 + 4 + 2.5 + 1, 4 + 104 + 8 + 4.5 + 1]
    notices = [r.getMessage() for r in caplog.records if "a callable" in r.getMessage()]
    assert len(notices) == 6 and all("runs in the reward worker processes" in m for m in notices)
    assert {r.levelname for r in caplog.records if "a callable" in r.getMessage()} == {"INFO"}
    assert "by value" in notices[2]


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_callable_that_cannot_be_pickled_runs_here_with_the_same_rules(caplog) -> None:
    lock, release = threading.Lock(), threading.Event()

    def guarded(completion: str, sample: dict) -> float:  # holds a lock: it cannot be pickled
        assert not lock.locked()
        if completion == "hang":
            release.wait(30)
        if completion == "boom":
            raise ValueError("boom")
        return float(os.getpid())

    with caplog.at_level(logging.WARNING, logger="nanogrpo.rewards"):
        runner = RewardRunner([guarded, "tests.reward_fixtures:length"], workers=1, timeout_s=0.3,
                              penalty=-1.0)
    with runner:
        assert [e.where for e in runner.entries] == [INLINE, POOL]
        res = runner.score(["a", "hang", "boom", "b"], [SAMPLE] * 4)
        release.set()  # the abandoned call returns now; its result must not leak into the next batch
        time.sleep(0.05)
        again = runner.score(["c"], [SAMPLE])
    assert res.per_function["guarded"] == [os.getpid(), -1.0, -1.0, os.getpid()]
    assert (res.failures, res.timeouts) == (1, 1)
    assert again.per_function["guarded"] == [os.getpid()]
    assert runner.abandoned_threads == 1
    notice = next(r.getMessage() for r in caplog.records if "a callable" in r.getMessage())
    assert "runs in this process" in notice and "cannot be pickled" in notice and "lock" in notice


def test_a_function_loaded_from_a_file_goes_to_the_workers_by_value(tmp_path) -> None:
    from nanogrpo.rewards import resolve

    f = tmp_path / "my_rewards.py"
    f.write_text("import os\nBONUS = 3.0\ndef r(completion, sample):\n    return BONUS + os.getpid() * 0\n")
    fn = resolve(f"{f}:r")
    with RewardRunner([fn], workers=1) as runner:
        assert runner.entries[0].where == POOL
        assert runner.score(["x"], [SAMPLE]).total == [3.0]


def test_callable_names_never_take_a_builtin_name_they_do_not_hold() -> None:
    def correctness_like(completion: str, sample: dict) -> float:
        return 0.0

    correctness_like.__name__ = "correctness"
    with RewardRunner([correctness_like, correctness, "format"], workers=0) as runner:
        assert runner.specs == ["correctness_2", "correctness", "format"]
        res = runner.score(["<think>x</think><answer>7</answer>"], [SAMPLE])
    assert res.per_function["correctness"] == [1.0] and res.per_function["correctness_2"] == [0.0]


def test_from_config_takes_callables_with_the_configs_weights() -> None:
    cfg = RewardsConfig(weights=[2.0, 0.5], workers=0)
    with RewardRunner.from_config(cfg, rewards=["correctness", lambda c, s: 4.0]) as runner:
        assert runner.score(["<answer>7</answer>"], [SAMPLE]).total == [2.0 + 2.0]
    with pytest.raises(RewardError, match="rewards.weights has 2 entries for 3 rewards"):
        RewardRunner.from_config(cfg, rewards=["correctness", "format", lambda c, s: 4.0])


@pytest.mark.parametrize("item, needle", [
    (lambda c: 1.0, "does not take two arguments"),
    (42, "is a int: give a name"),
    (None, "is a NoneType"),
])
def test_bad_callables_fail_at_start(item, needle) -> None:
    with pytest.raises(RewardError, match=needle):
        RewardRunner([item], workers=0)


def test_the_same_callable_twice_is_refused() -> None:
    with pytest.raises(RewardError, match="more than once"):
        RewardRunner([fx.length, fx.length], workers=0)
    with pytest.raises(RewardError, match="list of names or functions"):
        RewardRunner("correctness", workers=0)


def test_the_decorator_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        batched(chunk_size=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        batched(timeout_s=0)
    f = batched(chunk_size=8, timeout_s=2.5)(lambda cs, ss: [0.0] * len(cs))
    assert (f.batched, f.chunk_size, f.timeout_s) == (True, 8, 2.5)
    with RewardRunner([f], workers=0, timeout_s=1.0) as runner:
        assert (runner.entries[0].chunk_size, runner.entries[0].timeout_s) == (8, 2.5)


def test_reward_failures_and_model_metrics_merge_over_ranks() -> None:
    """Two ranks' rows: per-function failure counts and a judge's request counts add up, its latency and
    time are the slowest rank's; other keys are left to their own rules."""
    from nanogrpo.training.metrics import merge_rank_metrics

    def row(fails: int, requests: int, latency: float) -> dict:
        return {"step": 1, "reward_mean": 0.0, "reward_std": 1.0, "num_completions": 4,
                "reward/f": 0.5, "reward/f/failures": fails, "judge/requests": requests,
                "judge/latency_s": latency, "judge/time_s": latency * 2, "rm_2/rows_per_s": 10.0}

    rows = [row(1, 5, 0.3), row(2, 7, 0.5)]
    sent = []
    for r in rows:
        merge_rank_metrics(r, lambda vals, ops: sent.append((vals, ops)) or vals, ["reward/f"])
    (va, _), (vb, _) = sent
    both = lambda vals, ops: [x + y if op == "sum" else max(x, y) for x, y, op in zip(va, vb, ops)]  # noqa: E731
    merged = merge_rank_metrics(rows[0], both, ["reward/f"])
    assert merged["reward/f/failures"] == 3 and merged["judge/requests"] == 12
    assert merged["judge/latency_s"] == 0.5 and merged["judge/time_s"] == 1.0
    assert merged["rm_2/rows_per_s"] == 20
