"""The public API (nanogrpo.Config / train / evaluate / load_checkpoint / Run), used as a notebook
or a script uses it; bad input fails at start with one line, before any weights are read."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import nanogrpo
from nanogrpo.errors import ConfigError, DataError, RewardError, ToolError

ROWS = [{"question": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(7) for b in range(7)]
SMALL = {"rollout.prompts_per_step": 4, "grpo.group_size": 4, "rollout.max_new_tokens": 24,
         "model.cpu_linear": "torch", "train.save_every": 0, "eval.n": 4}


def test_the_package_exports_the_api_functions():
    assert set(nanogrpo.__all__) >= {"Config", "Run", "train", "evaluate", "load_checkpoint"}
    for module in ("nanogrpo.evaluation", "nanogrpo.training.loop"):  # modules do not shadow the functions
        importlib.import_module(module)

    assert callable(nanogrpo.train) and nanogrpo.train.__module__ == "nanogrpo.api"
    assert callable(nanogrpo.evaluate) and nanogrpo.evaluate.__module__ == "nanogrpo.api"
    assert "train" in dir(nanogrpo)


def test_config_from_a_preset_a_file_a_dict_and_overrides(tmp_path):
    C = nanogrpo.Config
    assert C.load().train.steps == 80  # the demo preset, as `nanogrpo train` with no --config
    assert C.load("demo", {"train.steps": 2}).train.steps == 2
    assert C.load("demo", ["train.steps=2", "grpo.beta=0"]).grpo.beta == 0
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 5\n")
    assert C.load(f).train.steps == 5 and C.load(str(f)).data.source == "gsm8k"  # a file: over the defaults
    d = C.from_dict({"train": {"steps": 3}, "grpo.beta": 0.0})  # sections, and dotted keys, over the defaults
    assert (d.train.steps, d.grpo.beta, d.data.source) == (3, 0.0, "gsm8k")
    e = d.with_overrides({"train.lr": 1e-4})
    assert e.train.lr == 1e-4 and d.train.lr == 1e-6  # a new config; the old one is as it was
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo.grop_size'.*did you mean 'group_size'"):
        C.from_dict({"grpo": {"grop_size": 4}})
    with pytest.raises(ConfigError, match="unknown config section 'trian'"):
        C.load("demo", {"trian.steps": 2})
    with pytest.raises(ConfigError, match="not the string"):
        C.load("demo", "train.steps=2")
    with pytest.raises(ConfigError, match="config file not found"):
        C.load(tmp_path / "nope.toml")


@pytest.mark.parametrize("kwargs,error,says", [
    ({"dataset": [{"question": "1+1?"}]}, DataError, "row 0 has no answer field 'answer'"),
    ({"dataset": {"question": "1+1?", "answer": "2"}}, DataError, "a single dict: pass a list of dicts"),
    ({"dataset": {"test": ROWS}}, DataError, "dataset has no split 'train'"),
    ({"dataset": 42}, DataError, "expected rows"),
    ({"eval_dataset": ROWS}, DataError, "eval_dataset without dataset"),
    ({"rewards": [42]}, RewardError, "reward entry 42 is a int"),
    ({"rewards": [lambda completion: 1.0]}, RewardError, "does not take two arguments"),
    ({"tools": lambda call, sample: call}, ToolError, "imports it by name"),
    ({"config": 42}, ConfigError, "config must be a Config"),
    ({"config": {"model": {"path": "/nonexistent/model"}}}, nanogrpo.NanoGRPOError, "model path not found"),
])
def test_bad_input_fails_at_start_in_one_line(tmp_path, kwargs, error, says):
    kwargs.setdefault("config", nanogrpo.Config.load("demo", {"train.out": str(tmp_path / "run"), **SMALL}))
    with pytest.raises(error, match=says) as e:
        nanogrpo.train(**kwargs)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # imports datasets and pandas
def test_datasets_come_as_lists_hf_datasets_dataframes_and_splits(tmp_path):
    import datasets
    import pandas

    from nanogrpo.api.inputs import _data

    cfg = nanogrpo.Config.load("demo", {"train.out": str(tmp_path / "run")})
    for given in (ROWS, iter(ROWS), datasets.Dataset.from_list(ROWS), pandas.DataFrame(ROWS)):
        got = _data(cfg, given, None, tmp_path / "run")
        assert [(r["question"], r["answer"]) for r in got.given["rows"]] == [(r["question"], r["answer"])
                                                                            for r in ROWS]
        assert got.given["eval_rows"] is None and got.cfg.eval.every == 0  # no held-out rows: said, off
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                                   "test": datasets.Dataset.from_list(ROWS[30:])})
    got = _data(cfg, splits, None, tmp_path / "run")
    assert len(got.given["rows"]) == 30 and len(got.given["eval_rows"]) == 19  # eval.n (200) at most
    assert got.cfg.eval.every == 20 and got.cfg.data.source.endswith("data/{split}.jsonl")
    got = _data(cfg, ROWS[:30], {"test": ROWS[30:]}, tmp_path / "run")
    assert len(got.given["eval_rows"]) == 19
    renamed = [{"problem": r["question"], "solution": r["answer"]} for r in ROWS]
    named = cfg.with_overrides({"data.question_field": "problem", "data.answer_field": "solution"})
    assert _data(named, renamed, None, tmp_path / "run").given["rows"][0]["question"] == ROWS[0]["question"]
    held = _data(cfg.with_overrides({"data.eval_source": "arithmetic"}), ROWS, None, tmp_path / "run")
    assert "eval_rows" not in held.given and held.cfg.eval.every == 20  # held out from data.eval_source
    assert held.cfg.data.eval_source == "arithmetic"
    assert not (tmp_path / "run").exists()  # written when the run starts, not before


@pytest.mark.slow
def test_the_public_api_as_a_notebook_uses_it(tmp_path, capsys, caplog):
    from nanogrpo.cli import main

    answers = {r["question"]: r["answer"] for r in ROWS}  # closures over local variables

    def knows_the_answer(completion, sample):
        return 1.0 if answers[sample["question"]] in completion else 0.0

    lock, ran_here = threading.Lock(), []

    def guarded(completion, sample):  # holds a lock: it cannot be sent to a worker process
        with lock:
            ran_here.append(os.getpid())
        return 0.25

    out = tmp_path / "nb"
    cfg = nanogrpo.Config.load("demo", {"train.steps": 2, "train.out": str(out), **SMALL})
    with caplog.at_level(logging.INFO, logger="nanogrpo"):
        run = nanogrpo.train(cfg, rewards=["correctness", lambda c, s: 0.5, knows_the_answer, guarded],
                             dataset=ROWS)

    notices = {r.getMessage().split("'")[1]: r for r in caplog.records if "(a callable)" in r.getMessage()}
    assert set(notices) == {"lambda", "knows_the_answer", "guarded"}  # one line each, at start
    assert "runs in the reward worker processes (pickled by value)" in notices["lambda"].getMessage()
    assert notices["lambda"].levelname == "INFO"
    assert "runs in this process" in notices["guarded"].getMessage()
    assert notices["guarded"].levelname == "WARNING"  # no process isolation: worth a person's look
    assert ran_here and set(ran_here) == {os.getpid()}

    assert isinstance(run, nanogrpo.Run) and run.root == out
    rows = run.metrics
    assert [r["step"] for r in rows] == [1, 2]  # no held-out rows given: no evaluation
    assert all(r["num_completions"] == 16 and r["reward_failures"] == 0 for r in rows)
    assert all(r["reward/lambda"] == 0.5 and r["reward/guarded"] == 0.25 for r in rows)
    assert all(0 <= r["reward/knows_the_answer"] <= 1 for r in rows)
    assert [p.name for p in run.checkpoints] == ["step_0", "step_2"]
    assert run.checkpoint == out / "checkpoints" / "step_2"
    assert run.summary().startswith("nanogrpo: 2 steps")
    # the run is whole on disk: its config names the rows it trained on, copied into it
    assert run.config.data.source == str(out.resolve() / "data" / "{split}.jsonl")
    assert [json.loads(x) for x in (out / "data" / "train.jsonl").read_text().splitlines()] == ROWS
    assert run.config.rewards.functions == ["correctness", "<lambda>", "<knows_the_answer>", "<guarded>"]
    assert run.config.eval.every == 0

    ran_here.clear()
    summary = nanogrpo.evaluate(run, dataset=ROWS[:6])  # a Run: its newest checkpoint, its rewards
    assert summary["n"] == 6 and 0 <= summary["accuracy"] <= 1 and summary["k"] == 1
    assert ran_here  # the callables of the run scored the evaluation too
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nanogrpo"):
        again = nanogrpo.evaluate(str(out), dataset=ROWS[:6])  # from its directory: names only
    assert again["accuracy"] == summary["accuracy"]
    assert ("reward_mean here is over correctness only: the run's other rewards (<lambda>, "
            "<knows_the_answer>, <guarded>) were Python functions given to nanogrpo.train, which its "
            "directory cannot hold; to score with them too, give them again (rewards=[...]") in caplog.text

    model, tok = nanogrpo.load_checkpoint(run)
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(run.checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    assert tok.decode(tok("What is 2 plus 2?")["input_ids"], skip_special_tokens=True) == "What is 2 plus 2?"

    capsys.readouterr()  # the command line reads the same run (its config, its copy of the rows)
    assert main(["eval", "--model", str(run.checkpoint), "--split", "train", "--n", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 3
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2  # the callables are not in the config
    assert "were Python callables given to nanogrpo.train: give them again" in capsys.readouterr().err
    resumed = nanogrpo.train(resume=out, config=run.config.with_overrides({"train.steps": 3}),
                             rewards=["correctness", lambda c, s: 0.5, knows_the_answer, guarded])
    assert [r["step"] for r in resumed.metrics] == [1, 2, 3]


@pytest.mark.slow
def test_the_end_line_says_the_whole_time_in_parts_that_add_up(tmp_path, caplog):
    """The end line's total and its parts come from one clock on the loop's thread (issue 50: "4 steps in
    4.1 min (3.1 in steps, 1.4 in held-out evaluation, 0.0 loading ...)" did not add up)."""
    cfg = nanogrpo.Config.load("demo", {"train.steps": 2, "train.out": str(tmp_path / "run"), "eval.every": 1,
                                        **SMALL})
    with caplog.at_level(logging.INFO, logger="nanogrpo"):
        nanogrpo.train(cfg)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("nanogrpo: 2 steps in"))
    m = re.match(r"nanogrpo: 2 steps in ([\d.]+) s \(([\d.]+) in steps, ([\d.]+) in held-out evaluation, "
                 r"([\d.]+) in checkpoints, ([\d.]+) loading and the rest\)", line)
    assert m, line
    total, steps, evals, saves, rest = map(float, m.groups())
    assert steps > 0 and evals > 0 and rest > 0   # the evaluations: step 0, 1 and 2
    assert abs(steps + evals + saves + rest - total) <= 0.25, line  # each rounded to a tenth


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    """The reward workers start by spawn, which runs the calling script again in each: a script
    whose call is not under ``if __name__ == "__main__":`` gets one line saying so, not a second
    run started inside every worker."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import nanogrpo\n"
        f"cfg = nanogrpo.Config.load('demo', {{'train.steps': 1, 'train.out': {str(tmp_path / 'run')!r}, "
        f"**{SMALL!r}}})\n"
        "nanogrpo.train(cfg, rewards=[lambda c, s: 1.0, 'format'])\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "nanogrpo: error: nanogrpo.train() called again in a process started by spawn" in out.stderr
    assert 'if __name__ == "__main__":' in out.stderr
    assert out.stderr.count("rollout engine:") == 1  # the run itself started once, in the script


@pytest.mark.slow
def test_a_dict_of_splits_gives_the_held_out_rows(tmp_path):
    out = tmp_path / "splits"
    cfg = nanogrpo.Config.load("demo", {"train.steps": 1, "train.out": str(out), "eval.every": 1, **SMALL})
    run = nanogrpo.train(cfg, dataset={"train": ROWS[:20], "test": ROWS[20:30]})
    assert [r["step"] for r in run.metrics] == [0, 1]
    assert run.metrics[0]["eval/n"] == 4  # eval.n of the 10 held-out rows
    assert len((out / "data" / "test.jsonl").read_text().splitlines()) == 10
