"""The environment demos (guess the number, a simulated user): their games and users, their rows, the
documentation's examples, ``nanogrpo eval`` on held-out episodes, and short training runs end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nanogrpo.cli import main
from nanogrpo.demos.dialogue.env import SimulatedUser
from nanogrpo.demos.dialogue.task import make_split as dialogue_rows
from nanogrpo.demos.game.build import play
from nanogrpo.demos.game.env import GuessNumber
from nanogrpo.demos.game.task import HIGH, LOW
from nanogrpo.demos.game.task import make_split as game_rows
from nanogrpo.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
SMALL = ["rollout.prompts_per_step=4", "grpo.group_size=4", "train.save_every=0", "rewards.workers=0"]


def _play(env, row, actions):
    env.reset(row)
    return [env.step(a) for a in actions]


def test_the_game_answers_higher_and_lower_and_ends_at_the_number():
    env = GuessNumber()
    row = {"question": "Guess.", "secret": 11, "answer": "11"}
    assert env.reset(row) == "Guess."
    steps = _play(env, row, ["8", "12", "x", "99", "11"])
    assert [s.observation for s in steps[:4]] == ["higher", "lower", "a number, 1-15", "a number, 1-15"]
    assert [s.reward for s in steps] == [0, 0, 0, 0, 1.0] and steps[-1].done and steps[-1].info["success"]
    for secret in range(LOW, HIGH + 1):  # the careful player finds every number in 4; the careless one by 5
        assert play(secret, False, 5)[-1] == (str(secret), None) and len(play(secret, False, 5)) <= 4
        found = play(secret, True, 5)[-1][0] == str(secret)
        assert found == (secret <= 5)


def test_game_rows_hold_out_their_keys():
    train, test = game_rows("train", 2000), game_rows("test", 300)
    key = lambda r: (r["question"], r["secret"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert {r["secret"] for r in test} == set(range(LOW, HIGH + 1))


def test_the_simulated_customer_replies_to_the_first_answer():
    row = {"question": "one soup, please", "item": "soup", "size": "large", "answer": "large soup"}
    asked = _play(SimulatedUser(), row, ["size?", "large soup"])
    assert asked[0].observation == "large" and asked[0].reward == 0 and not asked[0].done
    assert asked[1].done and asked[1].reward == 1.0 and asked[1].info["success"]
    wrong = _play(SimulatedUser(), row, ["medium soup", "medium soup"])
    assert wrong[0].observation == "no, large" and wrong[1].done and not wrong[1].info["success"]
    at_once = _play(SimulatedUser(), row, ["large soup"])
    assert at_once[0].done and at_once[0].info["success"]
    train, test = dialogue_rows("train", 3000), dialogue_rows("test", 300)
    key = lambda r: (r["question"], r["size"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert all(r["answer"] == f"{r['size']} {r['item']}" for r in test)


@pytest.mark.slow  # (over 1 s: the fast suite stays under a minute)
def test_the_guide_examples_run():
    text = (REPO / "docs" / "guides" / "environments.md").read_text()
    blocks = re.findall(r"(\*Not run here[^\n]*\*\n\n)?```python\n(.*?)```", text, flags=re.S)
    runnable = [code for skip, code in blocks if not skip]
    assert len(runnable) >= 2
    ns: dict = {}
    for code in runnable:
        exec(compile(code, "environments.md", "exec"), ns)  # noqa: S102
    env = ns["GuessNumber"]()
    env.reset({"answer": "3"})
    assert env.step("3").done


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
@pytest.mark.parametrize("demo", ["game", "dialogue"])
def test_eval_plays_held_out_episodes(demo, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--config", f"demo-{demo}", "--model", f"embedded-{demo}", "--n", "12",
                 "--out", str(out), "rewards.workers=0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = [json.loads(x) for x in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert summary["n"] == len(records) == 12
    wins = [c for r in records for c in r["correct"]]
    assert summary["accuracy"] == pytest.approx(sum(wins) / len(wins))
    turns = [t for r in records for t in r["turns"]]
    assert summary["turns_mean"] == pytest.approx(sum(turns) / len(turns))
    assert all(1 <= t <= (5 if demo == "game" else 2) for t in turns)
    for r in records:
        [transcript] = r["transcripts"]
        assert len(transcript) == r["turns"][0] and r["id"].startswith(f"{demo}-test")


@pytest.mark.slow
@pytest.mark.parametrize("demo", ["game", "dialogue"])
def test_demo_config_trains(demo, tmp_path):
    out = tmp_path / "run"
    config = REPO / "configs" / f"demo-{demo}.toml"
    assert main(["train", "--config", str(config), "--out", str(out), "--steps", "2", "eval.every=2",
                 "eval.n=8", *SMALL]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/n"] == 8 and "eval/turns_mean" in rows[0]
    for r in rows[1:]:
        assert r["env/episodes"] == 16 and r["env/turns_mean"] >= 1 and 0 <= r["accuracy"] <= 1
        assert sum(v for k, v in r.items() if k.startswith("env/finish/")) == 16
