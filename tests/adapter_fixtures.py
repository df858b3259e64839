"""Environments written with each library's own classes, for tests/test_adapters.py (importable by
``env.source`` strings, ``tests.adapter_fixtures:...``)."""

from __future__ import annotations

import importlib
import os
import re

import pytest


def need(module: str):
    """``import module``, or skip the test when it is not installed, unless ``NANOGRPO_REQUIRE_ENVS=1``
    (set by ``.ci/run``, which installs the envs extra): then its absence is a failure."""
    if os.environ.get("NANOGRPO_REQUIRE_ENVS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[envs]')")


def verifiers_api() -> str:
    """``"v1"`` (verifiers 0.4 or later), ``"classic"`` (0.3) or ``""`` (none), from its metadata."""
    from nanogrpo.envs.adapters.verifiers_v1.source import installed

    return installed()


def need_verifiers(api: str):
    """``import verifiers`` when the installed one is ``api`` (``"v1"``: 0.4, ``"classic"``: 0.3; the two
    cannot share an environment), else skip the test, unless the environment is meant to have it:
    ``NANOGRPO_REQUIRE_ENVS=1`` (the envs extra: v1) or ``NANOGRPO_REQUIRE_CLASSIC=1`` (verifiers 0.3,
    ``.ci/run`` installs it in place for the classic tests)."""
    required = os.environ.get("NANOGRPO_REQUIRE_ENVS" if api == "v1" else "NANOGRPO_REQUIRE_CLASSIC") == "1"
    have = verifiers_api() or "none"
    if have != api:
        if required:
            pytest.fail(f"verifiers ({api}) is required here, the installed one is {have}")
        pytest.skip(f"needs verifiers {'>=0.4' if api == 'v1' else '0.3'} (installed: {have})")
    return importlib.import_module("verifiers")


def answer_of(text: str) -> str | None:
    m = re.findall(r"<answer>(.*?)</answer>", text)
    return m[-1].strip() if m else None


# ----------------------------------------------------------------------------- verifiers (classic API)

def make_retry_env(rows: list[dict], max_turns: int = 2):
    """A ``vf.MultiTurnEnv``: the model answers an arithmetic question; a wrong answer gets the user's
    "Wrong, try again." and another turn; the rubric scores 1 if the last answer is right."""
    import verifiers as vf
    from datasets import Dataset

    class RetryEnv(vf.MultiTurnEnv):
        @vf.stop
        async def solved(self, state) -> bool:
            steps = state["trajectory"]
            if not steps:
                return False
            last = steps[-1]["completion"][-1]["content"] or ""
            return answer_of(last) == state["answer"]

        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Wrong, try again."}]

    def last_answer_right(completion, answer, **kwargs) -> float:
        said = [m["content"] for m in completion if m["role"] == "assistant"]
        return 1.0 if said and answer_of(said[-1] or "") == answer else 0.0

    data = Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in rows])
    return RetryEnv(dataset=data, rubric=vf.Rubric(funcs=[last_answer_right]), max_turns=max_turns,
                    system_prompt=None)


# ----------------------------------------------------------------------------- OpenEnv

def openenv_app(target: int = 7):
    """An OpenEnv server app (``openenv.core``'s own ``create_app``) for a counting game: the model says
    a number; the server answers "higher" / "lower" and rewards 1 with done when it says ``target``
    (which the reset seed shifts: ``target + seed % 3``); the episode also ends after 3 moves. The move
    ``flood`` is answered with a 10 MiB hint. A move sent as a JSON number is read as its text: verifiers
    0.4's OpenEnv taskset sends a reply that parses as JSON as what it parses to (``"7"``: the number 7),
    which a string field alone refuses (the step a validation error, the episode lost)."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field, field_validator

    class GuessAction(Action):
        guess: str = Field(..., description="the model's move")

        @field_validator("guess", mode="before")
        @classmethod
        def number_as_text(cls, v):
            return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    class GuessObservation(Observation):
        hint: str = Field(default="", description="what the game says")

    class CountingGame(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            self._state = State(episode_id="0", step_count=0)
            self.secret = target

        def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
            self._state = State(episode_id=str(episode_id or 0), step_count=0)
            self.secret = target + (seed or 0) % 3
            return GuessObservation(hint="Say a number from 1 to 9.", done=False, reward=0.0)

        def step(self, action: GuessAction, **kwargs) -> GuessObservation:
            self._state.step_count += 1
            if action.guess == "flood":  # a 10 MiB observation (issue 44)
                return GuessObservation(hint="x" * (10 << 20), done=False, reward=0.0)
            nums = re.findall(r"\d+", action.guess)
            n = int(nums[-1]) if nums else None
            if n == self.secret:
                return GuessObservation(hint="yes", done=True, reward=1.0, metadata={"success": True})
            hint = "no number" if n is None else ("higher" if n < self.secret else "lower")
            return GuessObservation(hint=hint, done=self._state.step_count >= 3, reward=-0.1)

        @property
        def state(self) -> State:
            return self._state

    return create_app(CountingGame, GuessAction, GuessObservation, env_name="counting",
                      max_concurrent_envs=16)


def openenv_template(dest):
    """The environment ``openenv init NAME`` writes (OpenEnv's own template files and substitutions, without
    its ``uv lock``, which needs the network): an echo environment whose ``server/app.py`` calls
    ``create_app(..., max_concurrent_envs=1)``. Returns its directory (:func:`template_app`)."""
    from openenv.cli.commands import init

    name = "nanogrpo_echo"
    env_dir = dest / name
    env_dir.mkdir(parents=True)
    init._copy_template_directory("openenv.cli.templates.openenv_env", "", env_dir,
                                  init._create_template_replacements(name), name)
    app = (env_dir / "server" / "app.py").read_text()
    assert "max_concurrent_envs=1" in app, "the template changed: it no longer limits sessions to 1"
    return env_dir


def template_app(env_dir):
    """The ASGI app of :func:`openenv_template`'s ``server/app.py`` (what ``uvicorn server.app:app`` run in
    ``env_dir`` serves), imported here: its modules ``models`` and ``server`` are put back out of
    ``sys.modules`` and ``sys.path`` afterwards."""
    import sys

    names = ("models", "server", "server.app", "server.nanogrpo_echo_environment")
    sys.path.insert(0, str(env_dir))
    try:
        return importlib.import_module("server.app").app
    finally:
        sys.path.remove(str(env_dir))
        for n in names:
            sys.modules.pop(n, None)


def _rows(n: int) -> list[dict]:
    from nanogrpo.demos.arithmetic.task import make_split

    return [{"question": r["question"], "answer": r["answer"], "id": r["id"]} for r in make_split("test", n)]


ROWS = _rows(2)
"""Two of the embedded demo's held-out problems (its model answers them, right or wrong)."""


def retry_env(max_turns: int = 2):
    """``env.source = "verifiers:tests.adapter_fixtures:retry_env"``."""
    return make_retry_env(ROWS, max_turns=max_turns)


def load_environment(max_turns: int = 2):
    """What ``vf.load_environment("tests.adapter_fixtures")`` calls (an environment module's entry point):
    ``env.source = "verifiers:tests.adapter_fixtures"``."""
    return retry_env(max_turns)


# ----------------------------------------------------------------------------- an OpenAI-SDK agent

def sdk_agent(row, client):
    """An agent written with the ``openai`` package: asks, and when the answer is wrong says so and asks
    again (at most twice); reward 1 for a right final answer."""
    oa = client.openai()
    msgs = [{"role": "user", "content": row["question"]}]
    for _ in range(2):
        r = oa.chat.completions.create(model=client.model, messages=msgs, max_tokens=40)
        text = r.choices[0].message.content
        if answer_of(text) == row["answer"]:
            return 1.0
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Wrong, try again."}]
    return 0.0


def forgetful_agent(row, client):
    """Asks twice, the second time without its first answer (a history rewrite)."""
    oa = client.openai()
    q = [{"role": "user", "content": row["question"]}]
    oa.chat.completions.create(model=client.model, messages=q, max_tokens=20)
    oa.chat.completions.create(model=client.model, messages=q + [{"role": "assistant", "content": "?"},
                                                                 {"role": "user", "content": "Again."}],
                               max_tokens=20)
    return 0.5


def broken_agent(row, client):
    if row["id"] == ROWS[0]["id"]:
        raise RuntimeError("the agent crashed")
    return float("nan")


def slow_agent(row, client):
    import time

    time.sleep(30)
    return 1.0
