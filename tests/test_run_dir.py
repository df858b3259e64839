"""What a run directory is safe from (issue 50): a second run into it is refused unless asked to continue
(``--resume``) or to replace it (``--overwrite``), from the command line and from Python alike; Ctrl-C says
how to continue; a single data file gives no "held-out" figures measured on its training rows; a run on a
busy CPU says that torch's threads will fight for it."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

import nanogrpo
from nanogrpo.api.runs import RunExistsError, claim_run_dir
from nanogrpo.cli import main
from nanogrpo.training.metrics import read_metrics

ROWS = [{"question": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(5) for b in range(5)]


def _old_run(d: Path) -> Path:
    """A run directory as a finished run leaves it (its files' contents do not matter here)."""
    (d / "checkpoints" / "step_0").mkdir(parents=True)
    (d / "checkpoints" / "step_80").mkdir()
    for step in ("step_0", "step_80"):
        (d / "checkpoints" / step / "trainer_state.json").write_text(json.dumps({"step": int(step[5:])}))
        (d / "checkpoints" / step / "model.safetensors").write_bytes(b"weights of " + step.encode())
    (d / "checkpoints" / "latest").write_text("step_80\n")
    (d / "config.yaml").write_text("train:\n  steps: 80\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n"
                                             for s in range(1, 81)))
    (d / "samples.jsonl").write_text('{"step": 1}\n')
    (d / "judge_cache.sqlite").write_bytes(b"cache")
    (d / "notes.txt").write_text("mine\n")
    return d


def _snapshot(d: Path) -> dict[str, str]:
    """Every file under ``d`` and a hash of its bytes, every directory by name."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(d.rglob("*"))}


def test_a_second_train_into_a_run_is_refused_in_one_line_and_touches_nothing(tmp_path, capsys):
    run = _old_run(tmp_path / "demo")
    before = _snapshot(run)
    assert main(["train", "--out", str(run), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nanogrpo: error:")
    assert f"{run} already holds a run (config.yaml, metrics.jsonl, checkpoints/)" in err
    assert f"nanogrpo train --resume {run}" in err and "--out DIR" in err and "--overwrite" in err
    assert _snapshot(run) == before  # byte for byte, nothing added


def test_from_python_too_and_before_anything_is_written(tmp_path):
    run = _old_run(tmp_path / "nb")
    before = _snapshot(run)
    cfg = nanogrpo.Config.load("demo", {"train.out": str(run), "train.steps": 2})
    with pytest.raises(RunExistsError) as e:  # a NanoGRPOError: one line, exit 2 from the command line
        nanogrpo.train(cfg, dataset=ROWS, rewards=["correctness", lambda c, s: 0.5])
    assert isinstance(e.value, nanogrpo.NanoGRPOError) and "\n" not in str(e.value)
    assert f"nanogrpo.train(resume={str(run)!r})" in str(e.value) and "overwrite=True" in str(e.value)
    assert _snapshot(run) == before  # no RUN/data rows, no reward worker's files


@pytest.mark.parametrize("args", [["--resume", "R", "--overwrite"]])
def test_resume_and_overwrite_together_are_refused(tmp_path, capsys, args):
    run = _old_run(tmp_path / "r")
    before = _snapshot(run)
    assert main(["train", *[str(run) if a == "R" else a for a in args]]) == 2
    assert "continue the run or replace it, not both" in capsys.readouterr().err
    assert _snapshot(run) == before
    with pytest.raises(nanogrpo.ConfigError, match="not both"):
        nanogrpo.train(resume=run, overwrite=True)


def test_a_directory_without_a_run_is_used_as_it_is(tmp_path):
    d = tmp_path / "fresh"
    d.mkdir()
    (d / "notes.txt").write_text("mine\n")
    claim_run_dir(d)  # nothing there is a run's: no refusal, nothing removed
    claim_run_dir(tmp_path / "does-not-exist")
    assert (d / "notes.txt").read_text() == "mine\n"


def test_an_out_that_cannot_be_a_run_directory_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine\n")
    for out, says in ((tmp_path / "a-file", "is a file, not a directory"),
                      (tmp_path / "a-file" / "run", "cannot create the run directory")):
        assert main(["train", "--out", str(out), "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and "--out" in err, err
    assert (tmp_path / "a-file").read_text() == "mine\n"


def test_overwrite_removes_the_old_runs_files_and_leaves_the_rest(tmp_path, caplog):
    run = _old_run(tmp_path / "demo")
    (run / ".metrics.jsonl.123.tmp").write_text("half")
    with caplog.at_level(logging.INFO, logger="nanogrpo"):
        claim_run_dir(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    assert "removed the run that was in" in caplog.text and "left as they were: notes.txt" in caplog.text


def test_under_a_launcher_only_rank_0_decides(tmp_path, monkeypatch):
    """Rank 0 refuses (and the launcher ends the others); a rank > 0 never refuses: rank 0 may already have
    written the new run's config when it looks."""
    run = _old_run(tmp_path / "ddp")
    monkeypatch.setenv("RANK", "1")
    claim_run_dir(run)
    claim_run_dir(run, overwrite=True)
    assert (run / "checkpoints" / "step_80").is_dir()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RunExistsError):
        claim_run_dir(run)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from tests.run_fixtures import write_tiny_run_assets

    return write_tiny_run_assets(tmp_path_factory.mktemp("assets"))


def _tiny(assets: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--model", str(assets / "model"), "--data", str(assets / "data.jsonl"),
            "--out", str(out), "--steps", str(steps), "rollout.max_new_tokens=6",
            "rollout.prompts_per_step=2", "grpo.group_size=2", "data.answer_delimiter=####",
            "rewards.functions=['tests.reward_fixtures:length']", "rewards.workers=0", "train.save_every=1",
            "model.cpu_linear=torch", "log.tensorboard=false", *extra]


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_overwrite_replaces_a_real_run_whole(assets, tmp_path, capsys):
    """No stale ``step_N`` or ``latest`` of the old run survives beside the new one (issue 50: ``latest``
    reset to step_0 while step_20..step_80 stayed, and a resume said "already finished")."""
    out = tmp_path / "run"
    assert main(_tiny(assets, out, 2, "eval.every=0")) == 0
    assert main(_tiny(assets, out, 1, "eval.every=0")) == 2  # refused: the run of two steps is kept
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    (out / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    assert main(_tiny(assets, out, 1, "eval.every=0", "--overwrite")) == 0
    assert "removed the run that was in" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_0", "step_1"]
    assert (out / "notes.txt").read_text() == "mine\n"
    assert main(["train", "--resume", str(out), "--steps", "2"]) == 0  # it continues the new run
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_ctrl_c_says_how_to_continue_the_run(tmp_path, capsys, monkeypatch):
    import nanogrpo.api

    out = tmp_path / "run"

    def interrupted(cfg, **kw):  # a run stopped by Ctrl-C after its checkpoint at step 40
        ckpt = Path(cfg.train.out) / "checkpoints" / "step_40"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text('{"step": 40}')
        raise KeyboardInterrupt

    monkeypatch.setattr(nanogrpo.api, "train", interrupted)
    assert main(["train", "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip() == (f"nanogrpo: interrupted; continue it from step_40: "
                                               f"nanogrpo train --resume {out}")

    def before_any_checkpoint(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(nanogrpo.api, "train", before_any_checkpoint)
    assert main(["train", "--out", str(tmp_path / "other")]) == 130
    assert capsys.readouterr().err.strip() == "nanogrpo: interrupted"  # nothing to continue


# ----------------------------------------------------------------------------- one data file, held out?


def test_which_sources_give_the_training_rows_as_held_out_ones(tmp_path):
    from nanogrpo.config import DataConfig
    from nanogrpo.data.sources import held_out_file_is_training_file

    f = tmp_path / "my.jsonl"
    assert held_out_file_is_training_file(DataConfig(source=str(f))) == f
    assert held_out_file_is_training_file(DataConfig(source=str(f), eval_source=str(f))) == f
    assert held_out_file_is_training_file(DataConfig(source=str(tmp_path / "my_{split}.jsonl"))) is None
    assert held_out_file_is_training_file(DataConfig(source=str(f), eval_source=str(tmp_path / "t.jsonl"))) \
        is None
    for source in ("gsm8k", "arithmetic", "hf:openai/gsm8k"):
        assert held_out_file_is_training_file(DataConfig(source=source)) is None


def test_one_data_file_gives_no_held_out_figures_from_the_cli_and_python_alike(assets, tmp_path, capsys,
                                                                               caplog):
    """The demo's base evaluates every 20 steps and at the end; on one file of the user's, those "held-out"
    figures would be the training rows': no evaluation, and one line why and how to get one."""
    out = tmp_path / "cli"
    assert main(_tiny(assets, out, 1)) == 0
    said = capsys.readouterr().err
    assert f"no held-out evaluation: {assets / 'data.jsonl'} is one file" in said
    assert "data.eval_source=FILE" in said and "{split}" in said
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1] and not any(k.startswith("eval/") for k in rows[0])
    assert nanogrpo.Run(out).config.eval.every == 0  # and so its resumes
    cfg = nanogrpo.Config.load("demo", {"train.out": str(tmp_path / "py"), "train.steps": 1,
                                        "model.path": str(assets / "model"), "rollout.max_new_tokens": 6,
                                        "rollout.prompts_per_step": 2, "grpo.group_size": 2,
                                        "data.answer_delimiter": "####", "rewards.workers": 0,
                                        "model.cpu_linear": "torch", "log.tensorboard": False})
    with caplog.at_level(logging.INFO, logger="nanogrpo"):
        run = nanogrpo.train(cfg, dataset=str(assets / "data.jsonl"),
                             rewards=["tests.reward_fixtures:length"])
    assert "no held-out evaluation" in caplog.text
    assert [r["step"] for r in run.metrics] == [1] and run.config.eval.every == 0


def test_a_held_out_file_named_on_purpose_is_kept_and_said(assets, tmp_path, capsys):
    out = tmp_path / "named"
    from tests.run_fixtures import evaluated_on

    assert main(_tiny(assets, out, 1, "eval.n=2", evaluated_on(assets / "data.jsonl"))) == 0
    assert "data.eval_source is the training file" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]  # step 0: the baseline


# ----------------------------------------------------------------------------- a shared CPU


def test_oversubscription_is_threads_beside_the_busy_processes_past_the_cores():
    from nanogrpo.console import oversubscribed, shared_cpu_line

    assert not oversubscribed(threads=2, load=0.1, cores=2)  # a quiet machine
    assert not oversubscribed(threads=2, load=0.7, cores=2)  # the wake of `pip install`, a minute on
    assert oversubscribed(threads=2, load=1.0, cores=2)  # one other busy process: a thread waits
    assert oversubscribed(threads=2, load=4.6, cores=2)  # issue 50: 4.2x the CPU for the same work
    assert not oversubscribed(threads=1, load=6.0, cores=2)  # one thread waits for nothing
    assert not oversubscribed(threads=8, load=3.0, cores=16)
    line = shared_cpu_line(threads=2, load=4.6, cores=2)
    assert "load 4.6 on 2 cores" in line and "OMP_NUM_THREADS=1" in line and "\n" not in line
    assert shared_cpu_line(threads=1, load=4.6, cores=2) is None


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_run_on_a_busy_cpu_says_so_at_start(tmp_path, monkeypatch, caplog):
    import os

    import torch

    import nanogrpo.training.prepare as preparing  # where nanogrpo.train takes prepare from

    class Started(Exception):
        pass

    def prepare(*a, **kw):  # the line comes before the run is prepared: stop there
        raise Started

    monkeypatch.setattr(preparing, "prepare", prepare)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (4.6, 4.0, 3.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cfg = nanogrpo.Config.load("demo", {"train.out": str(tmp_path / "busy"), "model.device": "cpu"})
    with caplog.at_level(logging.INFO, logger="nanogrpo"), pytest.raises(Started):
        nanogrpo.train(cfg)
    assert "this CPU is busy (load 4.6 on 2 cores) and torch runs 2 threads" in caplog.text
    caplog.clear()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    with caplog.at_level(logging.INFO, logger="nanogrpo"), pytest.raises(Started):
        nanogrpo.train(cfg)
    assert "this CPU is busy" not in caplog.text


def _stopped_run(root, steps: int, ckpt: int, stop: bool):
    """A run directory as the trainer leaves it: its config, ``checkpoints/step_<ckpt>`` complete, and a
    monitor event at that step (one that stopped the run, or only flagged it)."""
    import json

    from nanogrpo.config import RUN_CONFIG_FILE, Config, save_config
    from nanogrpo.training.checkpoint import STATE_FILE

    root.mkdir(parents=True)
    save_config(Config.load("demo", {"train.steps": steps, "train.out": str(root)}), root / RUN_CONFIG_FILE)
    (root / "checkpoints" / f"step_{ckpt}").mkdir(parents=True)
    (root / "checkpoints" / f"step_{ckpt}" / STATE_FILE).write_text("{}")
    event = {"rule": "episodes_failed", "step": ckpt, "since": 1, "message": "all 4 episodes failed",
             "stop": stop}
    (root / "watch.jsonl").write_text(json.dumps(event) + "\n")


def test_a_run_the_monitor_ended_early_exits_3_naming_the_rule_and_the_way_on(tmp_path, capsys):
    from nanogrpo.api import Run
    from nanogrpo.cli import STOPPED_BY_MONITOR, _stopped_status

    _stopped_run(tmp_path / "stopped", steps=6, ckpt=3, stop=True)
    assert Run(tmp_path / "stopped").stopped["rule"] == "episodes_failed"
    assert _stopped_status(tmp_path / "stopped") == STOPPED_BY_MONITOR == 3
    err = capsys.readouterr().err
    assert "stopped the run at step 3 (episodes_failed" in err
    assert f"nanogrpo train --resume {tmp_path / 'stopped'}" in err
    assert _stopped_status(tmp_path / "stopped", "http://h:8000") == 3  # split mode: the resume names it
    assert capsys.readouterr().err.strip().endswith("--server http://h:8000")
    # flagged only, or continued to its last step after the stop: it ran its steps, exit 0
    _stopped_run(tmp_path / "flagged", steps=6, ckpt=3, stop=False)
    _stopped_run(tmp_path / "finished", steps=3, ckpt=3, stop=True)
    for name in ("flagged", "finished"):
        assert Run(tmp_path / name).stopped is None
        assert _stopped_status(tmp_path / name) == 0
    assert _stopped_status(tmp_path / "no-run-here") == 0
