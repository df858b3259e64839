"""Exact resume: a run stopped (cleanly, or by kill -9 at any moment) and resumed logs the same metrics
as one that never stopped."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanogrpo.cli import main
from nanogrpo.models import cpu_linear
from nanogrpo.models.cpu_linear import onednn_available
from nanogrpo.training.checkpoint import latest_checkpoint
from tests.run_fixtures import comparable_metrics, evaluated_on, this_process_threads, write_tiny_run_assets

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A random-init tiny Qwen2 + char tokenizer, and 12 GSM8K-format problems."""
    return write_tiny_run_assets(tmp_path_factory.mktemp("resume"))


def _args(assets: Path, out: Path, steps: int) -> list[str]:
    return ["train", "--model", str(assets / "model"), "--data", str(assets / "data.jsonl"),
            "--out", str(out), "--steps", str(steps), "--seed", "7",
            "data.answer_delimiter=####", "data.system_prompt=''",
            "rollout.max_new_tokens=10", "rollout.prompts_per_step=2", "grpo.group_size=4",
            "rewards.functions=['tests.reward_fixtures:length','format']", "rewards.workers=0",
            "train.lr=1e-3", "train.save_every=2", "grpo.beta=0.04", "log.samples_every=1",
            "eval.every=3", "eval.n=2", evaluated_on(assets / "data.jsonl")]


def _resume_args(out: Path, steps: int) -> list[str]:
    return ["train", "--resume", str(out), "--steps", str(steps)]


def _comparable(run: Path) -> list[dict]:
    return comparable_metrics(run)


@pytest.fixture(scope="module")
def straight(assets) -> list[dict]:
    out = assets / "straight"
    assert main(_args(assets, out, 6)) == 0
    rows = _comparable(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # step 0: the held-out baseline
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3, 6]
    assert sum(r.get("loss") is not None for r in rows) >= 3, "the test needs steps that update the model"
    return rows


@pytest.mark.slow
def test_resume_in_halves_is_exact(assets, straight, capsys):
    out = assets / "halves"
    assert main(_args(assets, out, 3)) == 0
    assert main(_resume_args(out, 6)) == 0
    assert "resuming" in capsys.readouterr().err  # an INFO line
    assert _comparable(out) == straight
    samples = [json.loads(x)["step"] for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples == sorted(samples) and set(samples) == {1, 2, 3, 4, 5, 6}


def test_resume_of_finished_run_does_nothing(assets, straight, capsys):
    out = assets / "straight"
    before = (out / "metrics.jsonl").read_bytes()
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    assert main(_resume_args(out, 6)) == 0
    said = capsys.readouterr().err  # an INFO line
    assert "already finished" in said and "nothing to do" in said
    assert (out / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ckpts


_CLI = """
import os, sys
from nanogrpo.models import cpu_linear
faster = os.environ.get("TEST_ONEDNN_FASTER")  # the shape classes (their rows) oneDNN times faster for
if faster is not None:
    cpu_linear.onednn_faster = lambda rows, *a: str(rows) in faster.split(",")
from nanogrpo.cli import main
raise SystemExit(main(sys.argv[1:]))
"""
"""``nanogrpo`` with model.cpu_linear=auto's timing set by ``TEST_ONEDNN_FASTER`` (the test's own hook)."""


def _timing(straight: list[dict], same: bool) -> dict[str, str]:
    """The timing the straight run's decisions came from (``same``), or the opposite one for both shape
    classes, as a resumed process on a loaded machine can measure."""
    decided = {cpu_linear.TRAIN_ROWS: straight[-1]["cpu_linear/trainer"],
               cpu_linear.DECODE_ROWS: straight[-1]["cpu_linear/engine"]}
    return {"TEST_ONEDNN_FASTER": ",".join(str(r) for r, v in decided.items() if (v == "onednn") == same)}


def _spawn(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **this_process_threads(), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", _CLI, *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the training subprocess")


def _steps_logged(out: Path) -> int:
    p = out / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.is_file() else 0


def _saving(out: Path) -> bool:
    ck = out / "checkpoints"
    return ck.is_dir() and any(p.name.startswith(".tmp-step_") for p in ck.iterdir())


@pytest.mark.slow
def test_kill9_anywhere_then_resume_is_exact(assets, straight):
    """kill -9 at several points (mid-step, mid-checkpoint-save, twice in one run), resume, finish.
    ``model.cpu_linear=auto``: every resumed process times the opposite of what the run decided and
    must reuse the checkpoint's decisions. A fresh start (nothing to resume yet) times as the straight
    run did: two separate runs may pick differently on a loaded machine, which no record can help.

    The killed processes score each completion 0.1 s slower (0.8 s a step; the rewards are the same): on
    a busy shared machine this process can see a kill point late, and a tiny model's last two steps
    took less than that, so the kill meant for step 6 landed after the run had ended."""
    rng = random.Random(0)
    scenarios = [
        ("during the save of step_2", [lambda o: _saving(o) and _steps_logged(o) >= 2]),
        ("mid step 4, then again mid step 6",
         [lambda o: _steps_logged(o) >= 3, lambda o: _steps_logged(o) >= 5]),
        ("right after start", [lambda o: (o / "config.yaml").is_file()]),
    ]
    for name, kill_points in scenarios:
        out = assets / f"kill-{name.split()[0]}-{len(kill_points)}-{rng.randrange(1000)}"
        args = _args(assets, out, 6)
        for i, point in enumerate(kill_points):
            env = {"NANOGRPO_TEST_SAVE_SLEEP": "3"} if "save" in name else {"TEST_REWARD_SLEEP": "0.1"}
            env.update(_timing(straight, same=latest_checkpoint(out / "checkpoints") is None))
            proc = _spawn(args if i == 0 else _resume_args(out, 6), env)
            reached = _wait_for(lambda p=point, o=out: p(o), proc)
            assert reached, f"{name}: run ended before the kill point: {proc.stderr.read().decode()[-800:]}"
            time.sleep(rng.uniform(0.0, 0.3))  # a random moment after the point
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stderr.close()
            if "save" in name:
                assert _saving(out), "the kill was meant to land inside save_checkpoint"
            last = latest_checkpoint(out / "checkpoints")
            assert last is None or last.name != "step_6", f"{name}: the kill landed after the run had ended"
        same = latest_checkpoint(out / "checkpoints") is None
        resumed = subprocess.run([sys.executable, "-c", _CLI, *_resume_args(out, 6)], cwd=REPO, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO), **this_process_threads(),
                                      **_timing(straight, same)},
                                 capture_output=True)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert same or "as the checkpoint recorded" in resumed.stderr, resumed.stderr[-2000:]
        assert _comparable(out) == straight, f"kill {name}: metrics differ from the uninterrupted run"
        assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")], name



@pytest.mark.slow
@pytest.mark.parametrize("point", ["baseline", "step_0"])
def test_stopped_around_the_first_checkpoint_resumes_with_the_baseline_row(assets, straight, point,
                                                                           monkeypatch):
    """Stopped after the step-0 held-out row and before ``step_0`` is saved (the run starts over), or
    right after ``step_0`` (resumed from it): either way the resumed run logs the baseline once and
    everything the uninterrupted run logs. (Saving ``step_0`` before the baseline lost the row.)"""
    out = assets / f"stop-{point}"
    monkeypatch.setenv("TEST_ONEDNN_FASTER", _timing(straight, same=True)["TEST_ONEDNN_FASTER"])
    monkeypatch.setenv("NANOGRPO_TEST_STOP_AFTER", point)
    with pytest.raises(SystemExit, match=f"stopped after {point}"):
        main(_args(assets, out, 6))
    monkeypatch.delenv("NANOGRPO_TEST_STOP_AFTER")
    assert [r["step"] for r in _comparable(out)] == [0]
    assert (latest_checkpoint(out / "checkpoints") is None) == (point == "baseline")
    assert main(_resume_args(out, 6)) == 0
    assert _comparable(out) == straight

LOSS_RUNS = {  # every loss, each with the options that carry state or bind only off-policy
    "grpo": ["grpo.loss=grpo", "grpo.entropy_coef=0.01", "grpo.entropy_target=9.0"],  # adaptive control
    "dapo": ["grpo.loss=dapo", "grpo.mask_truncated=true", "grpo.top_entropy_quantile=0.5"],
    "dr_grpo": ["grpo.loss=dr_grpo", "grpo.clip_ratio_c=3"],
    "bnpo": ["grpo.loss=bnpo", "grpo.kl_is_weighted=true"],
    "gspo": ["grpo.loss=gspo", "rollout.correction=sequence_mask", "rollout.correction_min=0.1"],
    "cispo": ["grpo.loss=cispo", "grpo.clip_eps_high=1.1", "rollout.correction=token_truncate"],
    "sapo": ["grpo.loss=sapo", "grpo.advantage=rloo", "grpo.off_policy_mask_kl=0.01"],
}


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(LOSS_RUNS))
def test_resume_is_exact_for_every_loss(assets, loss):
    """Two updates per batch (the ratio moves off 1, the clip and corrections bind) and the loss's own
    options; stopped after step 2 and resumed, the run logs what the uninterrupted one does."""
    # the engine's log-probs enter these updates (corrections, the later update's anchor): exact only as
    # the resumed run reuses the CPU linears `auto` picked (recorded in the checkpoint)
    over = ["eval.every=0", "log.samples_every=0", "grpo.updates_per_batch=2", *LOSS_RUNS[loss]]
    straight, halves = assets / f"{loss}-straight", assets / f"{loss}-halves"
    assert main(_args(assets, straight, 4)[:-2] + over) == 0
    assert main(_args(assets, halves, 2)[:-2] + over) == 0
    assert main(_resume_args(halves, 4)) == 0
    rows = _comparable(straight)
    assert _comparable(halves) == rows
    trained = [r for r in rows if r.get("loss") is not None]
    assert trained and all("entropy" in r and "ratio_max" in r for r in trained)
    assert any(r["ratio_max"] != 1.0 for r in trained), "the second update should move the ratio"


@pytest.mark.slow
@pytest.mark.skipif(not onednn_available(), reason="torch build without oneDNN's linear")
def test_resume_reuses_the_cpu_linear_decisions_when_the_timing_says_otherwise(assets, monkeypatch, capsys):
    """``model.cpu_linear=auto`` decided by timing; the resumed process's timing says the opposite for
    both the trainer's and the engine's shapes (as it can on a loaded machine). It reuses what the
    checkpoint recorded, times nothing, says so in one line, runs its linears on what was recorded and
    logs the same metrics as the uninterrupted run. An explicit ``model.cpu_linear`` on resume wins:
    it is what runs, and what every later row records.

    What runs is observed, not inferred from the metrics: every oneDNN product goes through
    ``cpu_linear._lp`` and every switch of a model's linears through ``use_onednn_linears``, both
    counted here. (Whether the other library changes the metrics depends on the CPU: oneDNN's and
    MKL's float32 products differ in their last bits on some CPUs and shapes and agree on others, and
    a last-bit difference in a log-prob need not change a sampled token, a reward or a logged figure.)"""
    timed, products, switched = [], [], []

    def timing(trainer_fast: bool):
        def onednn_faster(rows, k, n, threads):
            timed.append(rows)
            return trainer_fast if rows == cpu_linear.TRAIN_ROWS else not trainer_fast
        return onednn_faster

    lp, use = cpu_linear._lp, cpu_linear.use_onednn_linears
    monkeypatch.setattr(cpu_linear, "_lp", lambda *a: products.append(1) or lp(*a))
    monkeypatch.setattr(cpu_linear, "use_onednn_linears", lambda m: switched.append(1) or use(m))

    def ran(run_: Path, *args: str) -> tuple[bool, bool]:
        """(the trainer's linears were switched to oneDNN, some product ran on oneDNN) in this run."""
        products.clear()
        switched.clear()
        assert main(list(args)) == 0, run_
        return bool(switched), bool(products)

    # the engine's log-probs enter the later update (its anchor) and the correction
    over = ["eval.every=0", "log.samples_every=0", "grpo.updates_per_batch=2",
            "rollout.correction=token_truncate"]
    straight, halves, forced, forced_dnn = (assets / f"linears-{n}"
                                            for n in ("straight", "halves", "forced", "forced-onednn"))
    monkeypatch.setattr(cpu_linear, "onednn_faster", timing(False))
    # trainer on torch (no switch), engine on oneDNN (its decode products call _lp)
    assert ran(straight, *_args(assets, straight, 4)[:-2], *over) == (False, True)
    assert ran(halves, *_args(assets, halves, 2)[:-2], *over) == (False, True)
    assert sorted(timed) == [32, 32, 256, 256]                     # each run timed both, once
    for run in (halves, forced, forced_dnn):
        if run != halves:
            shutil.copytree(halves, run)
        ckpt = json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())
        assert ckpt["cpu_linear"] == {"trainer": "torch", "engine": "onednn"}
    monkeypatch.setattr(cpu_linear, "onednn_faster", timing(True))  # the resumed process: the other way
    timed.clear()
    capsys.readouterr()
    assert ran(halves, *_resume_args(halves, 4)) == (False, True)  # what was recorded runs, not the timing
    said = [line for line in capsys.readouterr().err.splitlines() if "model.cpu_linear" in line]
    assert timed == [] and len(said) == 1 and "as the checkpoint recorded" in said[0], said
    rows = _comparable(straight)
    assert all(r["cpu_linear/trainer"] == "torch" and r["cpu_linear/engine"] == "onednn" for r in rows)
    assert _comparable(halves) == rows                             # same process config, same CPU: exact

    def later_rows_record(run_: Path, setting: str) -> None:
        after = _comparable(run_)                                  # steps 1-4
        assert after[:2] == rows[:2]
        assert {(r["cpu_linear/trainer"], r["cpu_linear/engine"]) for r in after[2:]} == {(setting,) * 2}
        state = json.loads((run_ / "checkpoints" / "step_4" / "trainer_state.json").read_text())
        assert state["cpu_linear"] == {"trainer": setting, "engine": setting}  # and its own resumes reuse it

    # an explicit setting wins over the record, times nothing, and is what runs: torch everywhere ...
    assert ran(forced, *_resume_args(forced, 4), "model.cpu_linear=torch") == (False, False)
    assert timed == []
    later_rows_record(forced, "torch")
    # ... or oneDNN everywhere (the trainer's linears switched as well)
    assert ran(forced_dnn, *_resume_args(forced_dnn, 4), "model.cpu_linear=onednn") == (True, True)
    assert timed == []
    later_rows_record(forced_dnn, "onednn")
