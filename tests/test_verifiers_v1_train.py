"""``nanogrpo train`` with verifiers 0.4 (v1) environments, on the in-process engine (slow: real training
steps, real harness programs): a taskset written by hand with ``@vf.reward`` (the ``null`` harness, a uv
script, in the ``subprocess`` runtime), verifiers' own TextArena environment on GuessTheNumber (no
downloaded data), its OpenEnv environment against an OpenEnv server started here, through an environment
server nanogrpo starts; and environments that break (raise, hang, hand back a trace that is not what was
sampled, kill their server): each such episode ends counted, trains nothing, the run goes on.

Every trained row is checked three ways: it is a branch of one of the episode's traces (its ids exactly,
the trained tokens exactly the trace's sampled mask), every sampled span in it is a request the endpoint
answered (that request's prompt exactly before it, its log-probs exactly), and its reward is the trace's.
"""

from __future__ import annotations

import os
import sys

import pytest

import nanogrpo
from nanogrpo.config import Config
from nanogrpo.demos.game.task import make_split
from tests.adapter_fixtures import need, need_verifiers
from tests.test_adapters import openenv_server  # noqa: F401 - the fixture
from tests.test_adapters_train import captured, row_of  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow
QUICK = {"train.steps": 1, "rollout.prompts_per_step": 2, "grpo.group_size": 2, "train.save_every": 0,
         "rewards.workers": 0, "grpo.min_reward_spread": 0.0, "eval.every": 0, "rewards.functions": ["env"],
         "env.timeout_s": 300}
"""One step of 2 rows x 2 episodes on the game demo's model, every group kept, the episode's reward only."""
CHAT = {"harness": {"id": "nanogrpo-chat"}}
BASH = {"id": "bash", "edit": False, "compaction": None}
"""verifiers' coding agent, its shell only (compaction asks the model's context window of /v1/models)."""


@pytest.fixture(autouse=True)
def v1(monkeypatch):
    need_verifiers("v1")
    # the null and bash harnesses are uv scripts: uv comes with the envs extra, beside this python
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@pytest.fixture
def seen(monkeypatch):
    """The episodes verifiers handed back and the endpoint's record of every session, kept as they pass."""
    from nanogrpo.envs.adapters.verifiers_v1 import program, server
    from nanogrpo.episodes.endpoint.server import Endpoint

    out = {"episodes": [], "logs": []}
    real_result, real_close = program.result_of, Endpoint.close_session

    def result_of(episode):
        out["episodes"].append(episode)
        return real_result(episode)

    def close_session(self, sid):
        log = real_close(self, sid)
        if log is not None:
            out["logs"].append(log)
        return log
    monkeypatch.setattr(program, "result_of", result_of)
    monkeypatch.setattr(server, "result_of", result_of)
    monkeypatch.setattr(Endpoint, "close_session", close_session)
    return out


def train(tmp_path, overrides: dict, rows: list[dict], steps: int = 1):
    cfg = Config.load("demo-game", {**QUICK, "train.steps": steps, "train.out": str(tmp_path / "run"),
                                    **overrides})
    return nanogrpo.train(cfg, dataset=rows)


def check_trained(batch, seen, n: int) -> list:
    """Each of the ``n`` episode rows (and any extra rows) is a branch of a trace of its row's task, what
    the endpoint sampled, rewarded as its trace; the traces, one per row (None: nothing trained)."""
    records = [r for log in seen["logs"] for r in log.records]
    traces = [t for e in seen["episodes"] for t in e.traces]
    used: set[str] = set()
    out = []
    for j in range(batch.num_seqs):
        prompt, comp, mask, lps = row_of(batch, j)
        if not comp:  # a broken episode's row: nothing trained
            out.append(None)
            continue
        ids = prompt + comp
        task = batch.meta["ids"][int(batch.group_ids[j])]
        hits = [(t, b) for t in traces for b in t.branches
                if b.token_ids == ids and task in (t.task.data.id, t.task.key)
                and b.sampled_mask == [False] * len(prompt) + mask  # the trained tokens: the sampled ones
                and max((abs(x - y) for x, y in zip(lps, b.logprobs[len(prompt):])), default=0) <= 1e-6]
        assert hits, f"row {j} is no branch (ids, mask, log-probs) of any trace of its task"
        fresh = [h for h in hits if h[0].id not in used] if j < n else hits  # episodes: one trace each
        trace, branch = (fresh or hits)[0]
        used.add(trace.id)
        k = 0
        while k < len(comp):  # every sampled span: a request the endpoint answered, exactly
            if not mask[k]:
                k += 1
                continue
            at = len(prompt) + k
            rec = [r for r in records
                   if r.prompt_ids == ids[:at] and r.completion_ids == ids[at:at + len(r.completion_ids)]
                   and mask[k:k + len(r.completion_ids)] == [True] * len(r.completion_ids)
                   and max(abs(x - y) for x, y in zip(lps[k:], r.logprobs)) <= 1e-6]
            assert rec, f"row {j}: the sampled tokens at {at} are no request the endpoint answered"
            k += len(rec[0].completion_ids)
        if j < n:
            assert batch.rewards[j] == pytest.approx(trace.reward)
        out.append(trace)
    return out


def test_a_hand_written_taskset_trains_with_the_null_harness(tmp_path, captured, seen):  # noqa: F811
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.models.source import resolve_model_path
    from tests.verifiers_v1_fixtures import guessed

    rows = make_split("train", 2)
    r = train(tmp_path, {"env.source": "verifiers:tests.verifiers_v1_fixtures:GuessTaskset"}, rows)
    (batch,), (gen,) = captured
    m = r.metrics[-1]
    assert m["env/episodes"] == 4 and m["env/finish/done"] == 4 and m["agent/mismatched_sequences"] == 0
    assert m["agent/unclaimed_requests"] == 0 and m["agent/requests"] == 4
    traces = check_trained(batch, seen, 4)
    by_id = {row["id"]: row for row in rows}
    tok = load_tokenizer(str(resolve_model_path("embedded-game")))
    for j, trace in enumerate(traces[:4]):
        assert trace.agent.config.harness.id == "null" and trace.agent.config.runtime.type == "subprocess"
        # verifiers rendered the prompt with the very tokenizer the engine uses (ids as nanogrpo's own)
        chat = tok.apply_chat_template([{"role": "user", "content": trace.task.data.prompt}],
                                       add_generation_prompt=True, tokenize=False)
        prompt = row_of(batch, j)[0]
        assert prompt == tok(chat, add_special_tokens=False)["input_ids"]
        secret = by_id[batch.meta["ids"][j // 2]]["secret"]
        assert trace.task.data.secret == secret  # the dataset row became the task
        g = guessed(trace.last_reply)
        assert batch.rewards[j] == (0.0 if g is None else max(0.0, 1.0 - abs(g - secret) / 15))  # @vf.reward
        assert gen.infos[j]["success"] == (g == secret)  # the task's success metric


def test_a_step_of_32_null_harness_episodes_keeps_the_default_deadline(tmp_path):
    """32 episodes of the null harness (a Python process each) under the default env.timeout_s (30 s):
    two per CPU core at a time, each timed from its own start, every one ends well. All at once, on two
    cores, every one ran past the deadline before its first model call (issue 50, item 12)."""
    rows = make_split("train", 4)
    r = train(tmp_path, {"env.source": "verifiers:tests.verifiers_v1_fixtures:GuessTaskset",
                         "env.timeout_s": 30.0, "rollout.prompts_per_step": 4, "grpo.group_size": 8}, rows)
    m = r.metrics[-1]
    assert m["env/episodes"] == 32 and m["env/finish/env_timeout"] == 0 and m["env/failed"] == 0, m
    assert m["agent/requests"] == 32 and m["env/finish/done"] == 32


def test_verifiers_textarena_env_plays_guess_the_number(tmp_path, captured, seen):  # noqa: F811
    need("textarena")
    from nanogrpo.envs.adapters.verifiers_v1.tasks import taskset_rows

    rows = taskset_rows("tests.verifiers_v1_textarena:GameTaskset", n=2)  # its own tasks: seeded games
    r = train(tmp_path, {"env.source": "verifiers:tests.verifiers_v1_textarena:GameTaskset",
                         "env.max_turns": 2, "env.kwargs": {"player": CHAT}, "data.max_prompt_tokens": 1200,
                         "env.max_observation_tokens": 300}, rows)
    (batch,), _ = captured
    m = r.metrics[-1]
    assert m["env/episodes"] == 4 and m["agent/mismatched_sequences"] == 0
    traces = check_trained(batch, seen, 4)
    by_id = {row["id"]: row for row in rows}
    for j, trace in enumerate(traces[:4]):
        row = by_id[batch.meta["ids"][j // 2]]
        assert "Guess The Number" in trace.task.data.prompt and trace.task.data.info == row["task"]["info"]
        assert trace.task.key == row["id"]
        assert trace.num_turns <= 2 and trace.agent.name == "player"
        # the game engine answered each move that did not end the game (verifiers' TextArenaEnv)
        users = [m for m in trace.messages if m.role == "user"]
        assert len(users) == trace.num_turns
        assert "game_reward" in trace.rewards


def test_verifiers_openenv_env_through_an_env_server(tmp_path, captured, seen, openenv_server):  # noqa: F811
    kwargs = {"taskset": {"base_url": openenv_server, "resets": [{"seed": 0}, {"seed": 1}]}, "player": CHAT}
    from nanogrpo.envs.adapters.verifiers_v1.tasks import taskset_rows

    rows = taskset_rows("openenv", kwargs, n=2)
    r = train(tmp_path, {"env.source": "verifiers:openenv", "env.kwargs": kwargs, "env.max_turns": 2,
                         "env.server": "start", "rollout.max_new_tokens": 40, "data.max_prompt_tokens": 1200,
                         "env.max_observation_tokens": 1200}, rows)
    (batch,), _ = captured
    m = r.metrics[-1]
    assert m["env/episodes"] == 4 and m["agent/mismatched_sequences"] == 0
    traces = check_trained(batch, seen, 4)
    for trace in traces[:4]:
        first = trace.messages[0]
        assert "Say a number from 1 to 9." in first.content  # the OpenEnv server's observation
        assert "openenv_reward" in trace.rewards


def test_environments_that_break_end_their_episode_and_the_run_goes_on(tmp_path, captured, seen):  # noqa: F811
    rows = [{"question": "Tom picks a number, 1-15. Guess it.", "answer": str(s), "secret": s, "id": f"t{s}"}
            for s in (1, 2, 3, 9)]
    r = train(tmp_path, {"env.source": "verifiers:tests.verifiers_v1_troubled:TroubledTaskset",
                         "env.timeout_s": 20, "env.kwargs": {"agent": CHAT}, "rollout.prompts_per_step": 4,
                         "env.error_penalty": -0.5}, rows, steps=2)
    assert len(r.metrics) == 2
    for m, batch in zip(r.metrics, captured[0]):
        assert m["env/finish/env_error"] == 2 and m["env/finish/env_timeout"] == 2
        assert m["env/finish/mismatch"] == 2 and m["agent/mismatched_sequences"] == 2
        assert m["env/finish/done"] == 2
        traces = check_trained(batch, seen, 8)
        for j in range(8):
            secret = int(batch.meta["ids"][j // 2][1:])
            if secret in (1, 2, 3):  # raised, hung, tampered with: nothing trained, the penalty
                assert traces[j] is None and batch.rewards[j] == -0.5
            else:
                assert traces[j].task.data.secret == secret == 9


def test_an_env_server_that_dies_ends_its_episodes_and_is_started_again(tmp_path, captured, seen):  # noqa: F811
    marker = tmp_path / "killed"
    rows = [{"question": "Tom picks a number, 1-15. Guess it.", "answer": str(s), "secret": s, "id": f"t{s}"}
            for s in (13, 9)]
    kwargs = {"agent": CHAT, "taskset": {"kill_marker": str(marker)}}
    r = train(tmp_path, {"env.source": "verifiers:tests.verifiers_v1_troubled:TroubledTaskset",
                         "env.server": "start", "env.kwargs": kwargs}, rows, steps=2)
    first, second = r.metrics
    # the secret-13 episode killed the server (SIGKILL) with every episode it was playing: counted, the
    # run went on; the next step's episodes ran on a server started again
    assert marker.exists() and first["env/finish/env_error"] >= 2 and first["env/finish/done"] <= 2
    assert second["env/finish/done"] == 4 and second["env/finish/env_error"] == 0
    check_trained(captured[0][-1], seen, 4)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The tiny tool-calling model: shipped in tests/data (344 KB, ``python -m tests.verifiers_v1_tools OUT``
    rebuilds it: ten minutes of a loaded 2-core CPU), built here when missing."""
    need_verifiers("v1")
    from tests.verifiers_v1_tools import SHIPPED, build_tool_model

    if (SHIPPED / "model.safetensors").is_file():
        return str(SHIPPED)
    return str(build_tool_model(tmp_path_factory.mktemp("tool-model") / "model"))


def test_the_bash_harness_runs_the_models_command_in_the_subprocess_runtime(tmp_path, captured, seen,  # noqa: F811
                                                                             tool_model):
    from tests.verifiers_v1_tools import CALL, COMMAND

    rows = [{"question": "Write 42 to answer.txt.", "answer": "42", "id": "answer"}]
    r = train(tmp_path, {"env.source": "verifiers:tests.verifiers_v1_tools:AnswerTaskset",
                         "model.path": tool_model, "rollout.prompts_per_step": 1,
                         "rollout.max_new_tokens": 120, "env.max_turns": 3,
                         "data.max_prompt_tokens": 300, "env.max_observation_tokens": 100,
                         "rollout.temperature": 0.1,  # the tiny model's habit, not its second guesses
                         "env.kwargs": {"agent": {"harness": BASH},
                                        "renderer": {"name": "default", "tool_parser": "qwen3"}}}, rows)
    (batch,), _ = captured
    m = r.metrics[-1]
    assert m["env/episodes"] == 2 and m["env/finish/done"] == 2 and m["agent/mismatched_sequences"] == 0
    traces = check_trained(batch, seen, 2)
    for trace in traces[:2]:
        assert trace.agent.config.harness.id == "bash" and trace.agent.config.runtime.type == "subprocess"
        calls = [c for a in trace.assistant_messages for c in (a.tool_calls or [])]
        # the model's call, parsed from its tokens; the command ran where the harness runs it (the
        # runtime's working directory), and the reward read its file back from there
        assert [(c.name, c.arguments) for c in calls] == [("bash", '{"command": "' + COMMAND + '"}')]
        assert [t.content for t in trace.tool_messages] == ["42\n"]
        assert trace.rewards["wrote_42"].score == 1.0 and trace.reward == 1.0
    from nanogrpo.models.load import load_tokenizer

    tok = load_tokenizer(tool_model)
    said = [tok.decode([t for t, k in zip(*row_of(batch, j)[1:3]) if k]) for j in range(batch.num_seqs)]
    assert any(CALL in s for s in said)  # the call was sampled by the model and trained


def test_nanogrpo_eval_plays_a_v1_environment(tmp_path):
    import json
    import subprocess
    from pathlib import Path

    from tests.verifiers_v1_fixtures import guessed

    root = Path(__file__).resolve().parents[1]
    source = "verifiers:tests.verifiers_v1_fixtures:GuessTaskset"
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "nanogrpo.cli", "eval", "--model", "embedded-game", "--config", "demo-game",
           "--data", source, "--split", "train", "--n", "4", "--out", str(out), f"env.source={source}",
           "env.kwargs=" + json.dumps({"agent": CHAT}), 'rewards.functions=["env"]']
    res = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    records = [json.loads(x) for x in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert summary["n"] == len(records) == 4 and summary["k"] == 1  # greedy, one episode per task
    correct = []
    for rec in records:  # the taskset's own tasks (secret 1, 2, 3, 4); success is its metric
        secret = int(rec["id"].split("-")[1])
        assert rec["correct"] == [guessed(rec["completions"][0]) == secret]
        correct += rec["correct"]
    assert summary["accuracy"] == sum(correct) / 4 and summary["finish/done"] == 4
