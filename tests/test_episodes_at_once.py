"""Agent episodes at the machine's pace (issue 50, item 12): at most ``env.max_concurrent`` running at once
(left at 0, what the program says this machine can run), each under ``env.timeout_s`` from when *it*
starts, and a step whose every episode failed said in one line naming the cause and the key to change,
flagged by the run monitor, the run ended after ``watch.episodes_failed.stop_after`` such steps in a row.

Before: every episode of a step started at once (a verifiers 0.4 environment on the ``subprocess``
runtime: a Python process each, 128+ on two cores) under a deadline that ran from the step's start, and
a step whose every episode timed out said nothing (``0 tok/s | watch: no alarm``, exit 0)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

import nanogrpo
from nanogrpo.config import Config
from nanogrpo.engines import SamplingParams, make_engine
from nanogrpo.envs import EnvRunner
from nanogrpo.episodes.agents import AgentEpisodes
from nanogrpo.models.load import load_policy
from tests.adapter_fixtures import ROWS

RUNNING = {"now": 0, "most": 0}
"""Episodes of the programs below running at this moment, and the most at once (one event loop)."""


async def alone_agent(row, client):
    """An episode of 0.4 s that counts how many run beside it."""
    RUNNING["now"] += 1
    RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    try:
        await asyncio.sleep(0.4)
    finally:
        RUNNING["now"] -= 1
    return 1.0


class PairAgent:
    """A program that says two of its episodes are what this machine runs at once."""

    def episodes_at_once(self):
        return 2

    async def run(self, row, client):
        return await alone_agent(row, client)


async def late_agent(row, client):
    await asyncio.sleep(30)
    return 1.0


@pytest.fixture(scope="module")
def policy():
    model, tok, _ = load_policy(Config.load("demo").model)
    return model.eval(), tok


def play(policy, source=None, env=None, n=2, **env_keys):
    model, tok = policy
    over = {"rollout.max_new_tokens": 16, **{f"env.{k}": v for k, v in env_keys.items()}}
    if source is not None:
        over["env.source"] = source
    cfg = Config.load("demo", over)
    agents = AgentEpisodes.from_runner(EnvRunner.from_config(cfg, env), cfg)
    RUNNING.update(now=0, most=0)
    try:
        t0 = time.monotonic()
        gen = agents.generate(make_engine("fast", model, tok), tok, ROWS, SamplingParams(16, n=n, seed=0))
        return gen, time.monotonic() - t0
    finally:
        agents.close()


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_episodes_run_at_most_env_max_concurrent_at_once_each_under_its_own_deadline(policy):
    """Four episodes of 0.4 s, one at a time: 1.6 s in all, past the 1 s deadline, yet every one ends
    well: each one's deadline runs from its own start."""
    gen, wall = play(policy, "agent:tests.test_episodes_at_once:alone_agent", max_concurrent=1,
                     timeout_s=1.0)
    assert gen.finish_reasons == ["done"] * 4, gen.finish_reasons
    assert RUNNING["most"] == 1
    assert wall >= 1.6
    gen, _ = play(policy, "agent:tests.test_episodes_at_once:alone_agent", timeout_s=5.0)
    assert gen.finish_reasons == ["done"] * 4 and RUNNING["most"] == 4  # no bound said: all at once


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_left_at_0_the_bound_is_what_the_program_says_this_machine_runs(policy):
    gen, _ = play(policy, env=PairAgent(), timeout_s=5.0)
    assert gen.finish_reasons == ["done"] * 4 and RUNNING["most"] == 2
    gen, _ = play(policy, env=PairAgent(), timeout_s=5.0, max_concurrent=3)  # the key wins
    assert gen.finish_reasons == ["done"] * 4 and RUNNING["most"] == 3


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_the_runner_starts_the_waiting_calls_as_earlier_ones_end():
    """One at a time: the second call hangs, and its deadline (0.5 s) runs from its own start, not the
    batch's; the third starts when that deadline frees the place."""
    cfg = Config.load("demo", {"env.source": "tests.test_envs:Counter", "env.timeout_s": 0.5})
    run = EnvRunner.from_config(cfg)
    started = {}

    async def call(i):
        started[i] = time.monotonic()
        await asyncio.sleep(5 if i == 1 else 0.3)
        return i

    try:
        out = run.run_all([lambda i=i: call(i) for i in range(3)], "run", [True] * 3, limit=1)
        assert [o.status for o in out] == ["ok", "timeout", "ok"] and out[2].value == 2
        assert started[1] - started[0] >= 0.28  # after the first ended
        assert started[2] - started[1] >= 0.48  # after the second's own 0.5 s
    finally:
        run.close()


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_step_whose_every_episode_timed_out_says_so_in_one_line(policy, caplog):
    with caplog.at_level(logging.WARNING, logger="nanogrpo.envs"):
        gen, wall = play(policy, "agent:tests.test_episodes_at_once:late_agent", timeout_s=0.3)
    assert gen.finish_reasons == ["env_timeout"] * 4 and gen.env_metrics["env/failed"] == 4
    assert wall < 20
    lines = [r.getMessage() for r in caplog.records if "episodes of this step failed" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "all 4 episodes of this step failed (env_timeout)" in lines[0]
    assert "env.timeout_s=0.3 s" in lines[0] and "raise env.timeout_s" in lines[0]
    gen, _ = play(policy, "agent:tests.test_episodes_at_once:alone_agent", timeout_s=5.0)
    assert gen.env_metrics["env/failed"] == 0


@pytest.mark.slow  # a few training steps (over the fast suite's 1.3 s a test)
def test_steps_whose_every_episode_failed_are_flagged_and_three_in_a_row_end_the_run(tmp_path, caplog):
    cfg = Config.load("demo", {
        "env.source": "agent:tests.test_episodes_at_once:late_agent", "env.timeout_s": 0.3, "train.steps": 6,
        "rollout.prompts_per_step": 2, "grpo.group_size": 2, "rollout.max_new_tokens": 16,
        "train.save_every": 0, "eval.every": 0, "rewards.workers": 0, "train.out": str(tmp_path / "run")})
    with caplog.at_level(logging.WARNING):
        run = nanogrpo.train(cfg, dataset=ROWS * 4)
    steps = [r for r in run.metrics if r.get("reward_mean") is not None]
    assert [r["step"] for r in steps] == [1, 2, 3]  # ended at the third such step, not the sixth
    assert run.stopped["rule"] == "episodes_failed"  # what makes `nanogrpo train` exit 3
    assert [r["watch/episodes_failed"] for r in steps] == [1.0, 1.0, 1.0]
    assert all(r["env/failed"] == r["env/episodes"] == 4 for r in steps)
    said = [r.getMessage() for r in caplog.records]
    rollout = [r.getMessage() for r in caplog.records if r.name == "nanogrpo.envs"]
    assert sum("all 4 episodes of this step failed (env_timeout)" in m for m in rollout) == 3  # one a step
    assert any("episodes_failed" in m and "stopping the run" in m for m in said)
    from nanogrpo.training.logging_sinks import run_summary

    end = run_summary(run.root)
    assert "stopped the run at step 3 (episodes_failed: all 4 episodes of this step failed" in end, end
    assert "raise env.timeout_s" in end
