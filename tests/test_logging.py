"""Run logging: TensorBoard event files readable by tensorboard's own reader, samples, W&B errors,
the one-line summary, and truncation on resume."""

from __future__ import annotations

import json
import os
import sys

import pytest

from nanogrpo.config import Config
from nanogrpo.errors import ConfigError
from nanogrpo.training.logging_sinks import RunLogger, run_summary
from nanogrpo.training.metrics import read_metrics


def _row(step: int, **kw) -> dict:
    return {"step": step, "reward_mean": 0.1 * step, "accuracy": step / 10, "loss": float("nan"),
            "reward/correctness": -1.0, "step_time_s": 0.5, "completion_tokens": 100, **kw}


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_are_readable(tmp_path):
    cfg = Config()
    cfg.log.samples_every = 2
    log = RunLogger(tmp_path, cfg)
    ex = [{"question": "1+1?", "completion": "<think>x</think><answer>2</answer>", "reward": 2.25,
           "correctness": 1.0, "format": 1.25}]
    for s in (1, 2, 3):
        log.log_step(_row(s, **({"eval/accuracy": 0.5} if s == 2 else {})), ex)
    log.close()
    sc = _scalars(tmp_path / "tb")
    assert [(s, round(v, 6)) for s, v in sc["train/reward_mean"]] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert sc["eval/accuracy"] == [(2, 0.5)]
    assert [s for s, _ in sc["reward/correctness"]] == [1, 2, 3]
    assert "train/loss" not in sc  # NaN means "not measured": not plotted as a value
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert any("samples" in t for t in acc.Tags()["tensors"])  # add_text lands as a tensor summary
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2] and samples[0]["format"] == 1.25
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_resume_truncates_every_sink(tmp_path):
    cfg = Config()
    cfg.log.samples_every = 1
    ex = [{"question": "q", "completion": "c", "reward": 1.0}]
    log = RunLogger(tmp_path, cfg)
    for s in (1, 2, 3, 4):
        log.log_step(_row(s), ex)
    log.close()
    log = RunLogger(tmp_path, cfg, resume_step=2)  # resumed from the step-2 checkpoint
    for s in (3, 4):
        log.log_step(_row(s, reward_mean=9.0), ex)
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    rewards = _scalars(tmp_path / "tb")["train/reward_mean"]
    assert [s for s, _ in rewards] == [1, 2, 3, 4] and rewards[-1][1] == 9.0


def test_a_line_being_written_or_torn_by_a_kill_is_left_out(tmp_path):
    """A reader racing the trainer (``nanogrpo report``, a test polling the file) sees a last line
    without its newline; so does ``--resume`` after a kill -9 mid-write. Both skip it: no crash."""
    cfg = Config()
    log = RunLogger(tmp_path, cfg)
    for s in (1, 2, 3):
        log.log_step(_row(s), [])
    log.close()
    for path in (tmp_path / "metrics.jsonl", tmp_path / "samples.jsonl"):
        with open(path, "a") as f:
            f.write('{"step": 4, "reward_mean": 1')              # torn: no closing brace, no newline
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert "3 steps" in run_summary(tmp_path)
    log = RunLogger(tmp_path, cfg, resume_step=3)
    log.log_step(_row(4), [])
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (tmp_path / "samples.jsonl").read_text() == ""


def test_wandb_asked_but_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = Config()
    cfg.log.wandb = True
    cfg.log.tensorboard = False
    with pytest.raises(ConfigError, match="pip install wandb"):
        RunLogger(tmp_path, cfg)


def test_tensorboard_off_writes_no_events(tmp_path):
    cfg = Config()
    cfg.log.tensorboard = False
    log = RunLogger(tmp_path, cfg)
    log.log_step(_row(1))
    log.close()
    assert not (tmp_path / "tb").exists()


def test_one_line_summary(tmp_path):
    log = RunLogger(tmp_path, Config())
    log.log_step(_row(1))
    log.log_step(_row(2, **{"eval/accuracy": 0.75}))
    log.close()
    line = run_summary(tmp_path)
    assert "\n" not in line
    assert "2 steps" in line and "reward 0.100 -> 0.200" in line
    assert "held-out accuracy 75.0% (step 2)" in line
    assert "200 tok/s" in line


def test_summary_shows_the_held_out_gain_from_step_0(tmp_path):
    """The end of ``nanogrpo train`` shows what the demo exists to show: held-out accuracy of the
    starting policy (the step-0 evaluation) beside the last one, and the gain in points."""
    log = RunLogger(tmp_path, Config())
    log.log_step({"step": 0, "eval/accuracy": 0.07, "eval/format_rate": 1.0})  # the baseline row
    for s in (1, 2, 3):
        log.log_step(_row(s, **({"eval/accuracy": 0.47} if s == 2 else {})))
    log.log_step(_row(4, **{"eval/accuracy": 0.535}))
    log.close()
    line = run_summary(tmp_path)
    assert "held-out accuracy 7.0% (step 0) -> 53.5% (step 4), +46.5 points" in line
    assert "reward 0.100 -> 0.400" in line  # the train figures start at step 1, not the eval-only row
    (tmp_path / "worse").mkdir()
    log = RunLogger(tmp_path / "worse", Config())
    log.log_step({"step": 0, "eval/accuracy": 0.5})
    log.log_step(_row(1, **{"eval/accuracy": 0.25}))
    log.close()
    assert "50.0% (step 0) -> 25.0% (step 1), -25.0 points" in run_summary(tmp_path / "worse")


def _two_ranks(rows: list[dict], keys: list[str]) -> list[dict]:
    """merge_rank_metrics on each of two simulated ranks: the all-reduce combines both ranks' vectors."""
    import math

    from nanogrpo.training.metrics import merge_rank_metrics

    sent = []
    for r in rows:  # first pass: what each rank contributes
        merge_rank_metrics(r, lambda vals, ops: sent.append((vals, ops)) or vals, keys)
    (va, ops), (vb, _) = sent

    def reduce(vals, ops_):
        return [x + y if op == "sum" else max(x, y) for x, y, op in zip(va, vb, ops_)]

    out = [merge_rank_metrics(r, reduce, keys) for r in rows]
    assert all(isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
               for k, v in out[0].items() if k in ("reward_mean", "reward_std", "num_completions"))
    return out


def test_rank_metrics_merge_into_whole_batch_figures():
    import statistics

    ra, rb = [1.0, 0.0, 2.0, 2.0], [0.5, 0.5, 3.0, 1.0, 0.0, 0.0]
    keys = ["reward/f"]

    def row(rw, t):
        return {"step": 3, "loss": 0.25, "reward_mean": statistics.fmean(rw),
                "reward_std": statistics.stdev(rw),
                "accuracy": sum(x > 0.9 for x in rw) / len(rw), "num_completions": len(rw),
                "completion_tokens": 10 * len(rw), "groups_kept": 1, "reward/f": statistics.fmean(rw),
                "step_time_s": t, "rollout_time_s": t / 2, "tokens_per_s": 10 * len(rw) / t}

    a, b = _two_ranks([row(ra, 2.0), row(rb, 4.0)], keys)
    assert a == b
    allr = ra + rb
    assert a["num_completions"] == 10 and a["completion_tokens"] == 100 and a["groups_kept"] == 2
    assert a["reward_mean"] == pytest.approx(statistics.fmean(allr))
    assert a["reward/f"] == pytest.approx(statistics.fmean(allr))
    assert a["reward_std"] == pytest.approx(statistics.stdev(allr))
    assert a["accuracy"] == pytest.approx(sum(x > 0.9 for x in allr) / 10)
    assert a["step_time_s"] == 4.0 and a["tokens_per_s"] == pytest.approx(100 / 4.0)
    assert a["loss"] == 0.25 and "gpu_mem_gib" not in a


def test_a_rank_without_completions_weighs_nothing():
    full = {"step": 1, "reward_mean": 0.5, "reward_std": 0.1, "accuracy": 0.5, "num_completions": 4,
            "reward/f": 0.5, "step_time_s": 1.0}
    empty = {"step": 1, "reward_mean": float("nan"), "reward_std": float("nan"), "accuracy": float("nan"),
             "num_completions": 0, "step_time_s": 1.0}  # no reward/f key: its rollout kept no rows
    a, b = _two_ranks([full, empty], ["reward/f"])
    assert a["reward_mean"] == b["reward_mean"] == pytest.approx(0.5)
    assert a["reward/f"] == pytest.approx(0.5) and a["num_completions"] == 4
    assert a["reward_std"] == pytest.approx(0.1)


@pytest.mark.slow  # W&B starts a service process: ~10-20 s
def test_the_rollout_table_reaches_tensorboard_and_wandb(tmp_path, monkeypatch):
    """Every ``log.samples_every`` steps the rollout table (prompts, completions, each reward component, the
    total, the advantage) goes to samples.jsonl, to TensorBoard as a text table and, with ``log.wandb``, to
    W&B as a ``wandb.Table`` (W&B's offline mode: the table's JSON in the run's files; wandb is an optional
    extra: it skips without it, except with ``NANOGRPO_REQUIRE_WANDB=1``, set by ``.ci/run``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if os.environ.get("NANOGRPO_REQUIRE_WANDB") == "1":
        import wandb  # CI installed the wandb extra: a missing wandb is a failure
    else:
        wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = Config.load("demo", ["log.wandb=true", "log.samples_every=2"])
    ex = [{"group": 0, "question": "2+3?", "completion": "<answer>5</answer>", "correctness": 1.0,
           "format": 1.25, "reward": 2.25, "advantage": 0.9, "finish_reason": "stop"},
          {"group": 0, "question": "2+3?", "completion": "<answer>6</answer>", "correctness": -1.0,
           "format": 1.25, "reward": 0.25, "advantage": -0.9, "finish_reason": "stop"}]
    log = RunLogger(tmp_path, cfg)
    for s in (1, 2):
        log.log_step(_row(s), ex)
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [2, 2]
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.startswith("| group | question | completion | correctness | format | reward | advantage |")
    assert "| 0 | 2+3? | <answer>6</answer> | -1 | 1.25 | 0.25 | -0.9 | stop |" in text
    tables = list((tmp_path / "wandb").glob("offline-run-*/files/media/table/samples_2_*.table.json"))
    assert len(tables) == 1, wandb.__version__
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["group", "question", "completion", "correctness", "format", "reward",
                                "advantage", "finish_reason"]
    assert table["data"][1][2:] == ["<answer>6</answer>", -1.0, 1.25, 0.25, -0.9, "stop"]


def test_the_end_line_says_the_whole_time_and_what_it_is_made_of(tmp_path):
    """A run of 80 steps of 35.3 s (47.1 min) whose held-out evaluations took 6.2 min and its loading and
    checkpoints the rest of 56.6 min ended on "80 steps in 47.1 min" (issue 44): the end line now says the
    whole time and its parts; a run read back later says what its figure leaves out."""
    log = RunLogger(tmp_path, Config())
    log.log_step({"step": 0, "eval/accuracy": 0.07, "eval/time_s": 40.0})
    for s in range(1, 81):
        log.log_step(_row(s, step_time_s=35.325, **({"eval/time_s": 40.0, "eval/accuracy": 0.5}
                                                     if s % 10 == 0 else {})))
    log.close()
    clock = {"total": 56.6 * 60, "steps": 47.1 * 60, "eval": 6.0 * 60, "save": 0.4 * 60, "rest": 3.1 * 60}
    line = run_summary(tmp_path, clock=clock)
    assert line.startswith("nanogrpo: 80 steps in 56.6 min (47.1 in steps, 6.0 in held-out evaluation, "
                           "0.4 in checkpoints, 3.1 loading and the rest)"), line
    assert "80 steps: 47.1 min in steps + 6.0 min in held-out evaluation (loading and checkpoints not " \
        "counted)" in run_summary(tmp_path)
    this = {"total": 13 * 60, "steps": 11.8 * 60, "eval": 1.3 * 60, "save": 0.1 * 60, "rest": 0.8 * 60}
    resumed = run_summary(tmp_path, start_step=60, clock=this)  # steps 61-80 in this session
    assert "steps 61-80 (resumed) in 13.0 min (11.8 in steps, 1.3 in held-out evaluation" in resumed, resumed
