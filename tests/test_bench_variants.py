"""``nanogrpo bench variants``: the settings it runs, its table from the runs' metrics, and a finished run not
run again (the learning runs themselves are the README's; too slow for the suite)."""

from __future__ import annotations

import json

import pytest

from nanogrpo.bench import sweep, variants
from nanogrpo.config import config_from


def test_every_setting_is_a_valid_demo_config_and_the_main_ones_are_there():
    assert {"grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "grpo+dynamic", "grpo+entropy"} <= set(
        variants.SETTINGS)
    for name, keys in variants.SETTINGS.items():
        cfg = config_from(None, keys)
        assert cfg.train.steps == 80 and cfg.eval.every == 20, name
    for name in ("gspo", "grpo+mb4", "cispo+mb4", "sapo+mb4"):  # off policy, where the losses differ
        assert config_from(None, variants.SETTINGS[name]).grpo.mini_batches >= 2, name


def _run(d, evals: dict[int, float], steps: int = 4):
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(steps + 1):
            row = {"step": s}
            if s:
                row.update(loss=0.1, entropy=0.5 - 0.1 * s, accuracy=0.1 * s, step_time_s=2.0)
            if s in evals:
                row.update({"eval/accuracy": evals[s], "eval/entropy": 0.4})
            f.write(json.dumps(row) + "\n")


def test_table_and_skipping_finished_runs(tmp_path, capsys, monkeypatch):
    _run(tmp_path / "grpo", {0: 0.07, 4: 0.52})
    _run(tmp_path / "dapo", {0: 0.07, 2: 0.3}, steps=2)             # cut short: not finished
    (tmp_path / "wall_times.json").write_text(json.dumps({"grpo": 600.0}))
    ran = []
    real = sweep.subprocess.run

    def fake_run(cmd, **kw):  # the training runs are recorded, not run (platform.processor() runs uname)
        if cmd[1:3] != ["-m", "nanogrpo.cli"]:
            return real(cmd, **kw)
        ran.append(cmd)
        return type("R", (), {"returncode": 0})()

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)  # the sweep starts the runs
    assert variants.main(["--out", str(tmp_path), "--only", "grpo,dapo", "--steps", "4", "--no-report"]) == 0
    assert len(ran) == 1 and "--resume" not in ran[0] and "grpo.loss=dapo" in ran[0]  # no checkpoint yet
    out = json.loads((tmp_path / "variants.json").read_text())
    grpo = out["settings"][0]
    assert grpo["setting"] == "grpo" and grpo["gain_points"] == pytest.approx(45.0)
    assert grpo["entropy_end"] == pytest.approx(0.1) and grpo["wall_s"] == 600.0 and grpo["train_s"] == 8.0
    md = (tmp_path / "variants.md").read_text()
    assert "| grpo | `grpo.loss=grpo` | 0.070 | 0.520 | +45.0 | 0.100 / 0.400 | 10.0 min |" in md
