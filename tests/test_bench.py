"""``nanogrpo bench step`` on the tiny shape: one real trainer step, one JSON line with the fields."""

from __future__ import annotations

import json

import pytest
import torch

from nanogrpo import bench
from nanogrpo.bench import step as bench_step

FIELDS = {"system", "engine", "shape", "device", "dtype", "prompts", "gens", "max_new", "beta",
          "step_s_median", "gen_s_median", "gen_share", "completion_tok_per_s", "step_times", "gen_times",
          "groups_kept", "updates"}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_step_bench_prints_one_json_line(capsys, tmp_path):
    out = tmp_path / "r.jsonl"
    rc = bench_step.main(["--shape", "tiny", "--steps", "1", "--prompts", "2", "--gens", "2",
                          "--max-new", "4", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert FIELDS <= row.keys(), FIELDS - row.keys()
    assert row["system"] == "nanogrpo" and row["shape"] == "tiny" and row["device"] == "cpu"
    assert row["dtype"] == "float32" and (row["prompts"], row["gens"], row["max_new"]) == (2, 2, 4)
    assert row["beta"] == 0.04 and row["peak_rss_gib"] > 0 and "error" not in row
    assert len(row["step_times"]) == 1 and len(row["gen_times"]) == 1
    assert row["step_s_median"] > 0 and 0 < row["gen_share"] <= 1
    assert row["groups_kept"] == [2] and row["updates"] == 1  # random rewards: every group trains
    assert row["completion_tok_per_s"] == pytest.approx(2 * 2 * 4 / row["step_s_median"], rel=1e-2)
    assert json.loads(out.read_text()) == row


def test_bench_dispatch(capsys):
    assert bench.main(["nope"]) == 2
    assert bench.main([]) == 2
    assert set(bench.SUBCOMMANDS) == {"rollout", "step", "rewards", "turns", "variants", "watch", "moe"}
    with pytest.raises(SystemExit):
        bench.main(["step", "--gens", "1"])


@pytest.mark.slow
def test_turns_bench_prints_one_json_line_per_engine(capsys):
    rc = bench.main(["turns", "--engines", "fast,fast-reprefill", "--repeats", "1",
                     "rollout.prompts_per_step=2", "grpo.group_size=2", "rollout.max_new_tokens=24"])
    assert rc == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert [r["engine"] for r in rows] == ["fast", "fast-reprefill"]
    for r in rows:
        assert r["trajectories"] == 4 and r["max_turns"] == 2 and r["median_generate_s"] > 0
        assert 0 < r["median_sampled"] <= 4 * 24 and len(r["generate_s"]) == 1
    with pytest.raises(SystemExit):
        bench.main(["turns", "--engines", "nope"])
