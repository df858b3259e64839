"""The environment libraries, run for real through nanogrpo's rollout: a verifiers multi-turn environment
written with its own classes (it calls the model through its OpenAI client, pointed at the endpoint), an
agent written with the ``openai`` package, a TextArena game and an OpenEnv server started here; each
episode's trajectory (which tokens are trained, rewards, turn counts) checked against what the library
and the endpoint say happened."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from nanogrpo.config import Config
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.factory import make_engine
from nanogrpo.envs.load import resolve
from nanogrpo.envs.runner import EnvRunner
from nanogrpo.episodes.agents import AgentEpisodes
from nanogrpo.errors import ConfigError
from nanogrpo.models.load import load_policy
from tests.adapter_fixtures import ROWS, answer_of, need, need_verifiers, verifiers_api

need("openai")


@pytest.fixture(scope="module")
def policy():
    cfg = Config.load("demo")
    model, tok, _ = load_policy(cfg.model)
    return model.eval(), tok


def agent_episodes(source: str, **env):
    overrides = [f"env.source={source}", "rollout.max_new_tokens=120"]
    overrides += [f"env.{k}={v}" for k, v in env.items()]
    cfg = Config.load("demo", overrides)
    agents = AgentEpisodes.from_runner(EnvRunner.from_config(cfg), cfg)
    assert agents is not None
    return agents


def play(agents, policy, n=2, seed=0):
    model, tok = policy
    params = SamplingParams(max_new_tokens=120, temperature=1.0, n=n, seed=seed)
    try:
        return agents.generate(make_engine("fast", model, tok), tok, ROWS, params)
    finally:
        agents.close()


def check_trajectory(gen, i, tok):
    """Episode ``i``: the trained tokens are exactly what was sampled, the rest is template and the
    program's messages; returns the decoded sampled turns of its last sequence."""
    ids, mask, lps = gen.completion_ids[i], gen.loss_masks[i], gen.logprobs[i]
    assert len(ids) == len(mask) == len(lps)
    assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
    assert all(lp < 0.0 for lp, m in zip(lps, mask) if m)
    turns, cur, fed = [], [], []
    for t, m in zip(ids, mask):
        if m:
            if fed:
                turns.append(("fed", tok.decode(fed)))
                fed = []
            cur.append(t)
        else:
            if cur:
                turns.append(("sampled", tok.decode(cur)))
                cur = []
            fed.append(t)
    if cur:
        turns.append(("sampled", tok.decode(cur)))
    return turns


def test_verifiers_multiturn_env_through_the_endpoint(policy):
    need_verifiers("classic")
    _, tok = policy
    gen = play(agent_episodes("verifiers:tests.adapter_fixtures:retry_env"), policy)
    assert len(gen.completion_ids) == 4 and gen.kept == [0, 1]
    for i in range(4):
        row, info = ROWS[i // 2], gen.infos[i]
        turns = check_trajectory(gen, i, tok)
        sampled = [t for k, t in turns if k == "sampled"]
        assert 1 <= info["num_turns"] <= 2  # MultiTurnEnv(max_turns=2): at most two model calls
        assert len(sampled) == info["num_turns"] or info["sequences"] > 1
        # the environment's reply, between two sampled turns, is context: template + its message
        for k, t in turns:
            if k == "fed":
                assert t == "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n" or \
                    t.endswith("<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")
        # the rubric's reward, worked out here from what the model wrote
        last = sampled[-1].replace("<|im_end|>", "")
        expected = 1.0 if answer_of(last) == row["answer"] else 0.0
        assert info["env_reward"] == expected and info["success"] == (expected >= 0.5)
        # a first answer that was right ends the episode after one turn (the env's stop condition)
        first = answer_of(sampled[0].replace("<|im_end|>", ""))
        assert len(sampled) == (1 if first == row["answer"] else 2) or info["sequences"] > 1
    assert gen.env_metrics["env/episodes"] == 4
    assert gen.env_metrics["agent/requests"] == sum(x["num_turns"] for x in gen.infos)


@pytest.mark.slow  # (over 1.3 s: the fast suite stays under a minute)
def test_an_openai_sdk_agent_trains_through_the_endpoint(policy):
    _, tok = policy
    gen = play(agent_episodes("agent:tests.adapter_fixtures:sdk_agent"), policy, n=4, seed=1)
    assert len(gen.completion_ids) == 8
    for i in range(8):
        row, info = ROWS[i // 4], gen.infos[i]
        turns = check_trajectory(gen, i, tok)
        sampled = [t.replace("<|im_end|>", "") for k, t in turns if k == "sampled"]
        fed = [t for k, t in turns if k == "fed"]
        assert info["sequences"] == 1 and len(sampled) == info["num_turns"] <= 2
        assert all(f.endswith("user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n") for f in fed)
        right = [answer_of(s) == row["answer"] for s in sampled]
        assert info["env_reward"] == (1.0 if right[-1] else 0.0) and gen.finish_reasons[i] == "done"
        assert right[:-1] == [False] * (len(right) - 1)  # it asked again only after a wrong answer
    assert gen.env_metrics["agent/extra_sequences"] == 0


@pytest.mark.slow  # (over 1 s: the fast suite stays under a minute)
def test_a_history_rewrite_is_an_extra_sequence_said_in_the_metrics(policy):
    _, tok = policy
    gen = play(agent_episodes("agent:tests.adapter_fixtures:forgetful_agent"), policy, n=2)
    for i in range(4):
        assert gen.infos[i]["sequences"] == 2 and gen.infos[i]["env_reward"] == 0.5
        (first,) = gen.extra_sequences[i]
        assert first.turns == 1 and all(first.loss_mask)
        assert all(gen.loss_masks[i])  # the second request's prompt is all context, its reply all trained
        tail = "<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(gen.prompt_ids[i]).endswith(tail)
    m = gen.env_metrics
    assert m["agent/rewritten_episodes"] == 4 and m["agent/extra_sequences"] == 4
    assert m["agent/sequences_per_episode"] == 2.0


@pytest.mark.slow  # (over 1.3 s: the fast suite stays under a minute)
def test_a_program_that_raises_answers_nan_or_hangs_gets_the_penalty_and_the_run_goes_on(policy):
    gen = play(agent_episodes("agent:tests.adapter_fixtures:broken_agent", error_penalty=-2.0), policy)
    assert gen.finish_reasons == ["env_error"] * 4
    assert [x["env_reward"] for x in gen.infos] == [-2.0] * 4
    assert gen.env_metrics["env/finish/env_error"] == 4
    t0 = time.monotonic()
    gen = play(agent_episodes("agent:tests.adapter_fixtures:slow_agent", timeout_s=1.5), policy)
    assert time.monotonic() - t0 < 25  # the 30 s sleeps were not waited for
    assert gen.finish_reasons == ["env_timeout"] * 4 and gen.env_metrics["env/finish/env_timeout"] == 4


def test_verifiers_load_environment_and_objects_from_python():
    need_verifiers("classic")
    from tests.adapter_fixtures import retry_env

    program = resolve("verifiers:tests.adapter_fixtures", {"max_turns": 3})()  # vf.load_environment
    assert type(program).__name__ == "VerifiersProgram" and program.env.max_turns == 3
    assert resolve(retry_env())().env.max_turns == 2  # a verifiers Environment object given from Python


@pytest.mark.slow  # (over 1.3 s: the fast suite stays under a minute)
def test_sources_that_cannot_load_are_one_line_errors():
    # (verifiers 0.4 says a taskset is missing either when its config type is looked up or when the env
    # config is resolved, depending on what else is installed; both are one line naming it)
    missing = ("cannot load taskset|taskset 'no_such_env_module_xyz' not found" if verifiers_api() == "v1"
               else "load_environment failed")
    for source, words in [("verifiers:no_such_env_module_xyz", missing),
                          ("textarena:NoSuchGame-v0", "no such TextArena game"),
                          ("openenv:not-a-url", "expected a URL"),
                          ("agent:tests.adapter_fixtures:NoSuchThing", "no attribute")]:
        with pytest.raises(ConfigError, match=words) as e:
            resolve(source)
        assert "\n" not in str(e.value)


def test_textarena_game_with_its_real_rules():
    need("textarena")
    import textarena as ta

    # the secret of seed 3, read from the library's own game
    probe = ta.make(env_id="GuessTheNumber-v0")
    probe.reset(num_players=1, seed=3)
    secret = probe.state.game_state["game_number"]
    env = resolve("textarena:GuessTheNumber-v0")()
    first = env.reset({"seed": 3, "question": "", "answer": ""})
    assert first.startswith("You are Player 0. You are playing Guess The Number.")
    lo, hi, moves = 1, 20, 0
    while True:  # a player that uses the feedback: binary search
        guess = (lo + hi) // 2
        res = env.step(f"My guess: [{guess}]")
        moves += 1
        if res.done:
            break
        assert res.observation == f"The target number is {'higher' if guess < secret else 'lower'}."
        lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
    assert guess == secret and res.reward == 1.0 and res.info["success"] is True and moves <= 5


def test_textarena_observations_are_bounded_while_they_are_joined():
    """A game's messages are joined no further than max_observation_bytes (the rollout sets it): past it
    the reset ends as too_long, the text never built whole (issue 44)."""
    need("textarena")
    from nanogrpo.envs.runner import EnvRunner

    cfg = Config.load("demo", ["env.source=textarena:GuessTheNumber-v0"])
    runner = EnvRunner.from_config(cfg)
    try:
        roomy, tight = [o.value for o in runner.make(1, {"max_observation_bytes": 100_000})] + \
            [o.value for o in runner.make(1, {"max_observation_bytes": 60})]
        ok, refused = runner.call([roomy, tight], "reset", [{"seed": 3}, {"seed": 3}])
        assert ok.ok and len(ok.value) > 60
        assert refused.status == "too_long" and "more than 60 characters" in refused.error, refused
    finally:
        runner.close()


@pytest.fixture
def openenv_server():
    need("openenv.core")
    import uvicorn

    from tests.adapter_fixtures import openenv_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(openenv_app(target=5), log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    t.join(10)


@pytest.mark.slow  # (over 1.3 s: the fast suite stays under a minute)
def test_openenv_server_episodes(openenv_server):
    from nanogrpo.envs.runner import EnvRunner

    cfg = Config.load("demo", [f"env.source=openenv:{openenv_server}"])
    runner = EnvRunner.from_config(cfg)  # the action field ("guess") read from the server's /schema
    try:
        envs = [o.value for o in runner.make(2)]
        rows = [{"seed": 0, "question": "", "answer": ""}, {"seed": 1, "question": "", "answer": ""}]
        starts = runner.call(envs, "reset", rows)
        assert [o.value for o in starts] == ["Say a number from 1 to 9."] * 2
        # targets 5 (seed 0) and 6 (seed 1); the two sessions are separate environments on the server
        first = runner.call(envs, "step", ["I say 5", "I say 5"])
        assert [(o.value.reward, o.value.done, o.value.observation) for o in first] == \
            [(1.0, True, None), (-0.1, False, "higher")]
        more = [runner.call(envs[1:], "step", [a])[0].value for a in ("7", "no idea")]
        assert [(r.observation, r.done) for r in more] == [("lower", False), (None, True)]
        runner.close_envs(envs)
    finally:
        runner.close()


@pytest.mark.slow  # (over 1 s: the fast suite stays under a minute)
def test_openenv_observations_are_bounded_by_what_the_rollout_can_show(openenv_server):
    """The WebSocket read stops at what an observation may hold (max_observation_bytes, JSON-escaped):
    a 10 MiB answer ends the episode as too_long without being read (issue 44), well under 1 MiB."""
    import time

    from nanogrpo.envs.runner import EnvRunner

    cfg = Config.load("demo", [f"env.source=openenv:{openenv_server}"])
    runner = EnvRunner.from_config(cfg)
    try:
        (env,) = [o.value for o in runner.make(1, {"max_observation_bytes": 3328})]
        assert env.message_cap() == 6 * 3328 + 65536
        (o,) = runner.call([env], "reset", [{"seed": 0}])
        assert o.ok
        t0 = time.monotonic()
        (o,) = runner.call([env], "step", ["flood"])
        assert o.status == "too_long" and "not read" in o.error and time.monotonic() - t0 < 10, o
        runner.close_envs([env])
    finally:
        runner.close()


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_an_openenv_server_at_capacity_drops_and_counts_and_says_so_once(policy, tmp_path, caplog):
    """The server `openenv init` scaffolds (max_concurrent_envs=1; its app served by uvicorn, as its README
    says) against 8 episodes at once: 7 sessions are refused, each group with a refused episode is dropped
    and counted (env/groups_dropped, reset/refused), and one warning line, once a run, says that the
    server's limit is below the episodes in flight and how to raise it (issue 44: every group was dropped
    silently)."""
    import logging

    import uvicorn

    need("openenv.core")
    from nanogrpo.episodes.play import Episodes
    from tests.adapter_fixtures import openenv_template, template_app

    app = template_app(openenv_template(tmp_path))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        model, tok = policy
        cfg = Config.load("demo", [f"env.source=openenv:{url}", "grpo.group_size=4"])
        eps = Episodes.from_config(cfg)  # the action field ("message") read from the template's /schema
        rows = [{"question": "a", "seed": 1}, {"question": "b", "seed": 2}]
        params = SamplingParams(max_new_tokens=40, temperature=1.0, n=4, seed=1, resume_after_eos=True)
        try:
            with caplog.at_level(logging.WARNING, logger="nanogrpo"):
                gens = [eps.generate(make_engine("fast", model, tok), tok, rows, params) for _ in range(2)]
        finally:
            eps.close()
    finally:
        server.should_exit = True
        t.join(10)
    for gen in gens:
        assert gen.kept == [] and gen.env_metrics["env/groups_dropped"] == 2
    assert eps.runner.counts["reset/refused"] == 14  # 7 of 8 each step, counted
    said = [r.getMessage() for r in caplog.records if "the server refused" in r.getMessage()]
    assert len(said) == 1, said  # one line, once a run (and the run's count at its end)
    assert any("14 reset/refused" in r.getMessage() for r in caplog.records)
    assert "refused 7 of the 8 sessions" in said[0] and "(its limit: 1)" in said[0]
    assert "max_concurrent_envs" in said[0] and "at least 8" in said[0]


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_openenv_messages_are_capped(openenv_server):
    from nanogrpo.envs.runner import EnvRunner

    cfg = Config.load("demo", [f"env.source=openenv:{openenv_server}",
                               'env.kwargs={"max_message_bytes": 40}'])
    runner = EnvRunner.from_config(cfg)
    try:
        (env,) = [o.value for o in runner.make(1)]
        (o,) = runner.call([env], "reset", [{"seed": 0}])
        # a too-big message is not read: the episode ends as too_long (issue 44: it was an env_error)
        assert o.status == "too_long" and runner.counts["reset/too_long"] == 1, o
    finally:
        runner.close()
