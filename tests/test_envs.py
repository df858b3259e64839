"""The environment interface (nanogrpo.envs): step results, where environments come from, calling them
under a deadline."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from nanogrpo.config import Config, ConfigError
from nanogrpo.envs import Environment, EnvResultError, EnvRunner, StepResult, as_step_result, resolve
from nanogrpo.envs.load import factory_of


class Counter(Environment):
    """Counts the model's turns; done at the third, reward 1 each turn."""

    def __init__(self, start: int = 0):
        self.n = start

    def reset(self, row):
        return f"count from {row['question']}"

    def step(self, action):
        self.n += 1
        return StepResult(f"turn {self.n}", 1.0, self.n >= 3, {"seen": action})


class AsyncEcho:
    async def reset(self, row):
        await asyncio.sleep(0)
        return [{"role": "system", "content": "s"}, {"role": "user", "content": row["question"]}]

    async def step(self, action):
        await asyncio.sleep(0.01)
        return action.upper(), 0.5, False


def test_step_results_of_every_shape():
    assert as_step_result(StepResult("a", 1, True)).done
    gym = as_step_result(("obs", 2, False, True, {"k": 1}))  # gymnasium: truncated ends it too
    assert (gym.observation, gym.reward, gym.done, gym.info) == ("obs", 2.0, True, {"k": 1})
    assert as_step_result(("o", 0.5)).reward == 0.5
    assert as_step_result("just text") == StepResult("just text")
    msgs = as_step_result(([{"role": "tool", "content": "42"}], 0, False)).observation
    assert msgs == [{"role": "tool", "content": "42"}]


@pytest.mark.parametrize(
    "bad, words",
    [
        (("o", float("nan"), False), "non-finite"),
        (("o", math.inf, True), "non-finite"),
        (("o", "lots", False), "not a number"),
        (42, "StepResult"),
        (None, "answered None"),  # a step that forgot its return: an env_error, counted (issue 44)
        ((123, 1.0, False), "observation of type int"),
        (([{"role": "user"}], 1.0, False), "observation"),
        (StepResult("o", info=[1]), "info"),
    ],
)
def test_bad_step_results_are_refused(bad, words):
    with pytest.raises(EnvResultError, match=words):
        as_step_result(bad)


def test_factories_give_one_fresh_environment_per_episode(tmp_path):
    make = factory_of(Counter, {"start": 5})
    a, b = make(), make()
    assert a is not b and a.n == 5
    template = Counter(1)
    copies = factory_of(template)
    c = copies()
    c.step("x")
    assert template.n == 1 and c.n == 2  # an instance is a template: deep-copied per episode

    class Forks(Counter):
        def fork(self):
            return Counter(99)

    assert factory_of(Forks())().n == 99
    f = tmp_path / "my_env.py"
    f.write_text(
        "from nanogrpo.envs import Environment, StepResult\n"
        "class Mine(Environment):\n    def step(self, action):\n"
        "        return StepResult(done=True)\n"
    )
    assert resolve(f"{f}:Mine")().step("a").done
    assert resolve("tests.test_envs:Counter", {"start": 2})().n == 2


@pytest.mark.parametrize(
    "source, words",
    [
        ("nope", "expected 'module:Class'"),
        ("no_such_module_xyz:Env", "cannot import"),
        ("tests.test_envs:Nothing", "no attribute"),
        ("/no/such/file.py:Env", "file not found"),
        ("tests.test_envs:math", "not an environment|expected an environment"),
    ],
)
def test_bad_sources_fail_in_one_line(source, words):
    with pytest.raises(ConfigError, match=words):
        resolve(source)


def test_config_section_and_its_refusals():
    cfg = Config.load(
        "demo",
        ["env.source=tests.test_envs:Counter", "env.kwargs={start: 1}", "grpo.turn_reward_discount=0.9"],
    )
    assert cfg.env.kwargs == {"start": 1} and cfg.grpo.turn_reward_discount == 0.9
    with pytest.raises(ConfigError, match="max_turn"):
        Config.load("demo", ["env.max_turnz=3"])
    with pytest.raises(ConfigError, match="turn_reward_discount"):
        Config.load("demo", ["grpo.turn_reward_discount=1.5"])
    with pytest.raises(ConfigError, match="use one"):
        Config.load("demo-tools", ["env.source=tests.test_envs:Counter"])
    assert EnvRunner.from_config(Config.load("demo")) is None


def _runner(timeout_s=5.0, **kw):
    cfg = Config.load("demo", {"env.source": "tests.test_envs:Counter", "env.timeout_s": timeout_s, **kw})
    return EnvRunner.from_config(cfg)


def test_runner_calls_sync_and_async_environments_concurrently():
    run = _runner()
    try:
        envs = [o.value for o in run.make(3)]
        assert all(isinstance(e, Counter) for e in envs)
        obs = run.call(envs, "reset", [{"question": "1"}] * 3)
        assert [o.value for o in obs] == ["count from 1"] * 3
        aenvs = [AsyncEcho() for _ in range(4)]
        t0 = time.monotonic()
        res = run.call(aenvs, "step", ["a", "b", "c", "d"])
        assert [o.value[0] for o in res] == ["A", "B", "C", "D"]
        assert time.monotonic() - t0 < 3.0  # on one loop, not one after the other past the deadline
        msgs = run.call(aenvs[:1], "reset", [{"question": "q"}])[0].value
        assert msgs[1] == {"role": "user", "content": "q"}
    finally:
        run.close()


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_runner_catches_raising_and_hanging_calls_and_goes_on():
    run = _runner(timeout_s=0.3)
    release = threading.Event()

    class Bad:
        def reset(self, row):
            return "x"

        def step(self, action):
            if action == "raise":
                raise RuntimeError("boom\nsecond line")
            if action == "hang":
                release.wait(30)
            return "fine"

    class AsyncHang:
        async def reset(self, row):
            return "x"

        async def step(self, action):
            await asyncio.sleep(30)

    try:
        envs = [Bad(), Bad(), Bad(), AsyncHang()]
        t0 = time.monotonic()
        out = run.call(envs, "step", ["raise", "hang", "ok", "x"])
        assert time.monotonic() - t0 < 10
        assert [o.status for o in out] == ["error", "timeout", "ok", "timeout"]
        assert out[0].error == "RuntimeError: boom" and out[2].value == "fine"
        again = run.call(envs[:3], "step", ["ok"] * 3)  # the stuck worker was replaced: the run goes on
        assert [o.value for o in again] == ["fine"] * 3
        assert run.counts["step/timeout"] == 2 and run.counts["step/error"] == 1
    finally:
        release.set()
        run.close()


def test_a_failure_is_named_by_the_line_that_says_what_is_missing():
    """nltk's missing-data error (TextArena's Wordle offline) opens with a row of asterisks: the warning
    shows the line that names the missing resource (issue 44: it showed `LookupError: ******…`)."""
    from tests.adapter_fixtures import need

    nltk = need("nltk")
    run = _runner()

    class NeedsData:
        def reset(self, row):
            nltk.data.find("corpora/nanogrpo_no_such_corpus")  # the library's own error, as Wordle's
            return "x"

        def step(self, action):
            return "x"

    try:
        (o,) = run.call([NeedsData()], "reset", [{}])
    finally:
        run.close()
    assert o.status == "error" and o.error == "LookupError: Resource 'nanogrpo_no_such_corpus' not found.", o
