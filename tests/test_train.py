"""The single-process trainer end to end on a tiny random model, and its failure modes."""

import json
import subprocess
import sys

import pytest
import torch

from nanogrpo.cli import main
from nanogrpo.config import load_config
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.training.backend import Backend
from nanogrpo.training.metrics import read_metrics
from nanogrpo.training.optim import MasterAdamW
from nanogrpo.training.step import policy_update
from tests.test_batch import make_batch

REQUIRED = ["step", "loss", "reward_mean", "reward_std", "accuracy", "format_rate", "kl",
            "completion_len_mean", "rollout_time_s", "train_time_s", "step_time_s", "tokens_per_s"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    make_model("tiny", tok, seed=0).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _args(tiny_dir, out, steps=3, *extra):
    return ["train", "--model", str(tiny_dir), "--out", str(out), "--steps", str(steps),
            "rollout.prompts_per_step=2", "grpo.group_size=4", "rollout.max_new_tokens=12",
            'rewards.functions=["tests.reward_fixtures:length","correctness","format"]',
            "rewards.workers=0", "train.save_every=2", *extra]


@pytest.mark.slow
def test_train_writes_run_directory(tiny_dir, tmp_path):
    out = tmp_path / "run"
    assert main(_args(tiny_dir, out)) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: the held-out baseline (the demo evaluates)
    # step 0: the held-out baseline, and the facts every row carries (the run's cpu_linear decisions)
    facts = {k for k in rows[-1] if k.startswith("cpu_linear/")}
    assert facts == {"cpu_linear/trainer", "cpu_linear/engine"}
    assert set(rows[0]) == {"step"} | facts | {k for k in rows[-1] if k.startswith("eval/")}
    for key in REQUIRED:
        assert key in rows[1], key
    assert any(r.get("loss") is not None for r in rows), "no update happened"
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert {"step_0", "step_2", "step_3", "latest"} <= set(ckpts)
    assert (out / "config.yaml").is_file()
    # checkpoints are plain HF models; step_0 is the starting policy
    from transformers import AutoModelForCausalLM
    m0 = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_0")
    m3 = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_3")
    start = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), start.state_dict().values()))
    assert any(not torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m3.state_dict().values()))


@pytest.mark.slow
def test_eval_prints_one_json_object(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_dir, out, 1)) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "checkpoints" / "step_1"), "--n", "5"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    res = json.loads(line)
    assert res["n"] == 5 and 0 <= res["accuracy"] <= 1 and 0 <= res["format_rate"] <= 1


def test_nonfinite_loss_skips_the_update_and_keeps_weights():
    tok = make_tokenizer()
    model = make_model("tiny", tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = make_batch()
    batch.old_logprobs[0, 0] = float("nan")
    cfg = load_config(overrides=["train.micro_batch_size=2", "rollout.max_new_tokens=5"])
    be = Backend(model, MasterAdamW(model.parameters(), lr=1e-2))
    res = policy_update(be, batch, cfg, on_policy=False)
    assert res.skipped_nonfinite
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    res = policy_update(be, make_batch(), cfg, on_policy=True)
    assert not res.skipped_nonfinite


@pytest.mark.parametrize("extra,match", [
    (["--model", "./no/such/model"], "model path not found: ./no/such/model"),
    (["--data", "/nonexistent/data.jsonl"], "not found"),
    (["grpo.grop_size=3"], "unknown config key 'grpo.grop_size'"),
    (['rewards.functions=["no_such_module:fn"]'], "no_such_module"),
    (["--config", "/nonexistent.toml"], "config file not found"),
    # a preset name misspelt: the shipped presets listed, the closest named (issue 44)
    (["--config", "demo-fast"], "shipped presets: demo, demo-dialogue, demo-distill, demo-game, demo-moe, "
                                "demo-rm, demo-tools, demo-vision (did you mean 'demo-game'?)"),
])
def test_bad_input_fails_at_start_with_one_line(extra, match, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanogrpo: error:") and match in err
    assert len(err.splitlines()) == 1
    assert not out.exists()  # nothing expensive happened, nothing written


def test_train_help_lists_every_shipped_preset(capsys, monkeypatch):
    """`nanogrpo train --help` names the eight shipped presets (issue 44: it named `demo` only)."""
    from nanogrpo import entry_points

    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at the terminal's width (and inside names)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    names = entry_points.preset_names()
    assert len(names) == 8 and f"shipped preset: {', '.join(names)}" in text, text


def test_dataset_without_named_fields(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "1+1", "a": "2"}\n')
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "question" in err and "d.jsonl" in err


def test_malformed_config_file(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text("[train\n")
    assert main(["train", "--config", str(f)]) == 2
    assert "malformed" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "nanogrpo.cli", "train", "grpo.nope=1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown config key" in r.stderr


def test_deepspeed_launcher_local_rank_argument_is_accepted(monkeypatch):
    """``deepspeed --module nanogrpo.cli train ...`` runs ``nanogrpo.cli --local_rank=0 train ...``."""
    from nanogrpo.cli import strip_launcher_args

    monkeypatch.setenv("LOCAL_RANK", "")  # recorded, so the value the call sets is undone afterwards
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_launcher_args(["--local_rank=1", "train", "--steps", "3"]) == ["train", "--steps", "3"]
    import os

    assert os.environ["LOCAL_RANK"] == "1"
    assert strip_launcher_args(["train", "--local_rank", "0", "x=1"]) == ["train", "x=1"]
    assert os.environ["LOCAL_RANK"] == "1"  # the launcher's environment wins
