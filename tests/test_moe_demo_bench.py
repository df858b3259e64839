"""``nanogrpo bench moe``: the settings it runs (each a valid config of the MoE demo in bfloat16), its table
from the runs' metrics, and a finished run not run again (the runs themselves are docs/figures.md's; too
slow for the suite)."""

from __future__ import annotations

import json

import pytest

from nanogrpo.bench import SUBCOMMANDS, moe, sweep
from nanogrpo.config import config_from


def test_every_setting_is_the_demo_in_bfloat16_with_its_replay_mode_and_loss():
    assert SUBCOMMANDS["moe"] == "nanogrpo.bench.moe"
    assert set(moe.DEFAULT) <= set(moe.SETTINGS)
    want = {"grpo": ("off", "grpo", 1), "r3": ("rollout", "grpo", 1), "gspo": ("off", "gspo", 1),
            "grpo+mb4": ("off", "grpo", 4), "r3+mb4": ("rollout", "grpo", 4), "gspo+mb4": ("off", "gspo", 4)}
    assert set(want) == set(moe.SETTINGS)
    for name, keys in moe.SETTINGS.items():
        cfg = config_from(moe.PRESET, [*moe.BASE, *keys])
        assert cfg.model.dtype == "bfloat16" and cfg.model.path == "embedded-moe", name
        assert (cfg.moe.routing_replay, cfg.grpo.loss, cfg.grpo.mini_batches) == want[name], name


def _run(d, evals: dict[int, float], steps: int = 4, flips: float = 0.01):
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(steps + 1):
            row = {"step": s}
            if s:
                row.update(loss=0.1, step_time_s=float(s), mismatch_abs=1e-3 * s, mismatch_abs_max=0.1 * s,
                           mismatch_kl=1e-5, mismatch_ratio_out=0.0, router_disagreement=flips, clip_frac=0.0)
            if s in evals:
                row["eval/accuracy"] = evals[s]
            f.write(json.dumps(row) + "\n")


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_table_and_skipping_finished_runs(tmp_path, monkeypatch):
    _run(tmp_path / "grpo", {0: 0.185, 4: 0.5})
    _run(tmp_path / "r3", {0: 0.185, 2: 0.3}, steps=2)                  # cut short: not finished
    (tmp_path / "times.json").write_text(json.dumps({"grpo": {"wall_s": 600.0, "cpu_s": 300.0}}))
    ran = []
    real = sweep.subprocess.run

    def fake_run(cmd, **kw):  # the training runs are recorded, not run (platform.processor() runs uname)
        if cmd[1:3] != ["-m", "nanogrpo.cli"]:
            return real(cmd, **kw)
        ran.append(cmd)
        return type("R", (), {"returncode": 0})()

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)  # the sweep starts the runs
    assert moe.main(["--out", str(tmp_path), "--only", "grpo,r3", "--steps", "4"]) == 0
    assert len(ran) == 1 and "--resume" not in ran[0]                  # no checkpoint yet: a fresh run
    assert ran[0][3:7] == ["train", "--config", "demo-moe", "--out"]
    assert "model.dtype=bfloat16" in ran[0] and 'moe.routing_replay="rollout"' in ran[0]
    out = json.loads((tmp_path / "moe.json").read_text())
    grpo = out["settings"][0]
    assert grpo["setting"] == "grpo" and grpo["steps"] == 4
    assert grpo["mismatch_abs"] == pytest.approx(2.5e-3) and grpo["mismatch_abs_max"] == pytest.approx(0.4)
    assert grpo["router_disagreement"] == pytest.approx(0.01) and grpo["step_time_median_s"] == 2.5
    assert grpo["heldout_curve"] == [[0, 0.185], [4, 0.5]] and grpo["cpu_s"] == 300.0
    md = (tmp_path / "moe.md").read_text()
    assert ("| grpo | `moe.routing_replay=\"off\" grpo.loss=grpo` | 2.50e-03 | 0.400 | 1.00e-05 | 0.00e+00 | "
            "1.00e-02 | 0.00e+00 | 0.185 → 0.500 | 2.5 s | 10.0 / 5.0 min |") in md
