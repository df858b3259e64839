"""nanogrpo eval: greedy pass@1, sampled pass@k / maj@k, per-sample JSONL and summary JSON."""

from __future__ import annotations

import json

import pytest

from nanogrpo.cli import main
from nanogrpo.config import Config
from nanogrpo.engines.base import Generation
from nanogrpo.evaluation import evaluate_rows, majority_index, vote_key
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.rewards import RewardRunner


def test_vote_key_normalises_numbers():
    assert vote_key("1,234") == vote_key("$1234.00") == vote_key("1234") == "1234"
    assert vote_key("0.50") == vote_key("1/2") == vote_key("\\frac{1}{2}") == vote_key("\\dfrac12")
    assert vote_key("(2, 3)") == vote_key("\\left( 2,3 \\right)") != vote_key("[2,3]")
    assert vote_key("  The   Answer ") == vote_key("the answer")
    assert vote_key(None) is None


def test_majority_index_first_of_most_frequent():
    assert majority_index(["3", "5", "5.0", "3", "5"]) == 1
    assert majority_index(["7", "8"]) == 0  # tie: the answer seen first
    assert majority_index([None, None]) is None
    assert majority_index([None, "4"]) == 1


class ScriptedEngine:
    """Returns fixed completions, prompt-major, ``params.n`` per prompt."""

    name = "scripted"

    def __init__(self, tok, script: list[list[str]]):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, params):
        self.calls.append(params)
        texts = [self.script.pop(0)[j] for _ in prompts for j in range(params.n)] if params.n == 1 else \
            [t for _ in prompts for t in self.script.pop(0)]
        ids = [self.tok.encode(t, add_special_tokens=False) for t in texts]
        return Generation(ids, [[0.0] * len(x) for x in ids], ["stop"] * len(ids))


ROWS = [{"id": "a", "question": "1+1?", "answer": "2"}, {"id": "b", "question": "2+2?", "answer": "4"},
        {"id": "c", "question": "3+3?", "answer": "6"}]


def _cfg() -> Config:
    cfg = Config()
    cfg.data.system_prompt = ""
    cfg.rollout.temperature = 0.7
    return cfg


def test_pass_at_k_and_maj_at_k():
    tok = make_tokenizer()
    script = [["<think>a</think><answer>2</answer>", "<answer>3</answer>", "2"],   # maj 2 (right), pass
              ["<answer>5</answer>", "5", "<answer>4</answer>"],                   # maj 5 (wrong), pass
              ["1", "2", "3"]]                                                     # tie -> 1 (wrong), fail
    engine = ScriptedEngine(tok, script)
    with RewardRunner(["correctness", "format"], workers=0) as rewards:
        summary, records = evaluate_rows(engine, tok, ROWS, _cfg(), rewards, max_new_tokens=8, batch_size=1,
                                         k=3, seed=5)
    assert summary["n"] == 3 and summary["k"] == 3 and summary["temperature"] == 0.7
    assert summary["pass@3"] == pytest.approx(2 / 3)
    assert summary["maj@3"] == pytest.approx(1 / 3)
    assert summary["accuracy"] == pytest.approx(3 / 9)
    assert summary["format_rate"] == pytest.approx(1 / 9)
    assert all(p.temperature == 0.7 and p.n == 3 and p.seed is not None for p in engine.calls)
    assert len({p.seed for p in engine.calls}) == 3  # one sampling stream per batch
    r0 = records[0]
    assert r0["question"] == "1+1?" and r0["extracted"] == ["2", "3", "2"]
    assert r0["correct"] == [True, False, True]
    assert r0["majority"] == "2" and r0["majority_correct"] and len(r0["rewards"]) == 3
    assert r0["reward_breakdown"]["format"] == [1.25, -1.0, -1.0]


def test_greedy_default_is_pass_at_1():
    tok = make_tokenizer()
    engine = ScriptedEngine(tok, [["2"], ["4"], ["x"]])
    with RewardRunner(["correctness"], workers=0) as rewards:
        summary, _ = evaluate_rows(engine, tok, ROWS, _cfg(), rewards, max_new_tokens=8, batch_size=8)
    assert engine.calls[0].temperature == 0.0 and engine.calls[0].n == 1
    assert summary["accuracy"] == summary["pass@1"] == summary["maj@1"] == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalmodel")
    tok = make_tokenizer()
    make_model("tiny", tok, seed=2).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    with open(d / "test.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"question": f"{i}+1?", "answer": f"so\n#### {i + 1}"}) + "\n")
    return d


def _eval(tiny, tmp_path, capsys, *extra):
    out = tmp_path / "ev" / "summary.json"
    rc = main(["eval", "--model", str(tiny / "model"), "--data", str(tiny / "test.jsonl"), "--n", "4",
               "--out", str(out), "data.answer_delimiter=####", "rollout.max_new_tokens=6",
               "rewards.workers=0", *extra])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return printed, out


def test_cli_eval_sampled_writes_summary_and_samples(tiny, tmp_path, capsys):
    printed, out = _eval(tiny, tmp_path, capsys, "--k", "3", "--split", "test")
    assert json.loads(out.read_text()) == printed
    assert printed["k"] == 3 and printed["n"] == 4 and printed["split"] == "test"
    assert {"pass@3", "maj@3", "accuracy", "format_rate"} <= set(printed)
    recs = [json.loads(x) for x in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and recs[0]["answer"] == "1"
    assert all(len(r["completions"]) == len(r["rewards"]) == len(r["extracted"]) == 3 for r in recs)


def test_the_help_names_the_samples_file_eval_writes(tiny, tmp_path, capsys, monkeypatch):
    """The help (and the docs) said OUT.samples.jsonl; `--out ev/s.json` writes ev/s.samples.jsonl
    (issue 50)."""
    import re

    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    said = re.search(r"--out (\S+) writes (\S+)", capsys.readouterr().out)
    assert said, "the help shows what --out writes"
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--model", str(tiny / "model"), "--data", str(tiny / "test.jsonl"), "--n", "2",
                 "--out", said[1], "data.answer_delimiter=####", "rollout.max_new_tokens=4",
                 "rewards.workers=0"]) == 0
    assert (tmp_path / said[1]).is_file() and (tmp_path / said[2]).is_file()


def test_cli_eval_greedy_is_deterministic(tiny, tmp_path, capsys):
    a, _ = _eval(tiny, tmp_path, capsys)
    b, _ = _eval(tiny, tmp_path, capsys)
    assert {"accuracy", "format_rate", "n"} <= set(a) and a["k"] == 1
    a.pop("time_s"), b.pop("time_s")
    assert a == b


def test_cli_eval_shows_its_progress(tiny, tmp_path, capsys):
    """`nanogrpo eval --k K` showed nothing until its JSON line (~100 s on the demo); a bar over the
    problems, with the accuracy so far, shows it working (issue 44)."""
    rc = main(["eval", "--model", str(tiny / "model"), "--data", str(tiny / "test.jsonl"), "--n", "4",
               "--k", "2", "data.answer_delimiter=####", "rollout.max_new_tokens=6", "rewards.workers=0",
               "eval.batch_size=2"])
    out, err = capsys.readouterr()
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["n"] == 4
    assert "eval (k=2): " in err and "0/4" in err and "4/4" in err and "acc " in err, err


def test_a_missing_local_model_is_said_at_once(tmp_path, monkeypatch, capsys):
    """`nanogrpo eval --model runs/nothere` beside runs/: a typo of a local path, said at once (issue 44: it
    was taken for a hub id, 'the HF hub cannot be reached', after ~20 s)."""
    import time

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    t0 = time.monotonic()
    rc = main(["eval", "--model", "runs/nothere"])
    err = capsys.readouterr().err
    said = "model path not found: runs/nothere (runs/ is a directory here, holding demo"
    assert rc == 2 and said in err, err
    assert "hub" not in err.split("(runs/")[0] and time.monotonic() - t0 < 10


def test_cli_eval_rejects_bad_k(tiny, tmp_path, capsys):
    rc = main(["eval", "--model", str(tiny / "model"), "--data", str(tiny / "test.jsonl"), "--k", "0"])
    assert rc == 2 and "--k" in capsys.readouterr().err
