"""Runs that go wrong on purpose (nanogrpo/bench/watch_faults.py), each caught by the rule meant for it
within the fault's stated bound, and stopped there by ``watch.stop_on`` with a checkpoint; a short demo run
the monitor stays quiet on. Real training on the embedded demo model (slow: 0.5-3 minutes each on a
shared 2-core CPU)."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest

from nanogrpo.bench.watch import fault_config, perturbed_engine
from nanogrpo.bench.watch_faults import FAULTS
from nanogrpo.training.checkpoint import latest_checkpoint
from nanogrpo.training.logging_sinks import run_summary
from nanogrpo.training.metrics import read_metrics
from nanogrpo.training.trainer import prepare, train
from nanogrpo.watch import read_events, replay

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_is_caught_by_its_rule_and_stops_the_run(name, tmp_path):
    f = FAULTS[name]
    last = f.onset + f.within
    cfg = fault_config(name, tmp_path / name, steps=last + 2,
                       overrides=[f'watch.stop_on=["{f.rule}"]', "train.save_every=0"])
    with perturbed_engine(**f.perturb) if f.perturb else nullcontext():
        root = train(prepare(cfg))
    events = read_events(root)
    hit = [e for e in events if e["rule"] == f.rule]
    assert hit, f"{f.rule} never fired; events: {[(e['rule'], e['step']) for e in events]}"
    step = hit[0]["step"]
    assert step <= last, f"{f.rule} fired at step {step}, after the bound {last}"
    # it stopped the run there, cleanly, with a checkpoint of that step and a summary that says so
    rows = read_metrics(root / "metrics.jsonl")
    assert rows[-1]["step"] == step and rows[-1][f"watch/{f.rule}"] == 1.0
    assert latest_checkpoint(root / "checkpoints").name == f"step_{step}"
    assert f"stopped the run at step {step}" in run_summary(root)
    # the event keeps completions of that step beside the run's first ones
    ex = hit[0]["examples"]
    assert ex["before"]["step"] == 1 and ex["now"]["step"] == step and ex["now"]["rows"]
    # the monitor in the loop and a replay of the run's metrics agree
    weights = dict(zip(cfg.rewards.functions, [1.0] * len(cfg.rewards.functions)))
    found = [(x.rule, x.step, x.since) for x in replay(rows, cfg.watch, weights)]
    assert found == [(e["rule"], e["step"], e["since"]) for e in events]


def test_a_healthy_demo_run_raises_no_alarm(tmp_path):
    """12 steps of the demo (every rule past its start window), held-out evaluation every 4: the monitor
    says nothing (the full runs of every demo: tests/test_watch.py replays their metric streams)."""
    from nanogrpo.config import Config

    cfg = Config.load("demo", ["rollout.prompts_per_step=16", "train.steps=12", "eval.every=4", "eval.n=50",
                               "train.save_every=0", f"train.out={tmp_path / 'demo'}"])
    root = train(prepare(cfg))
    assert read_events(root) == []
    assert "watch: no alarm" in run_summary(root)
    row = read_metrics(root / "metrics.jsonl")[-1]
    assert {k for k in row if k.startswith("watch/")} == {f"watch/{n}" for n in cfg.watch.active()}
    assert not any(row[k] for k in row if k.startswith("watch/"))
    assert json.loads((root / "samples.jsonl").read_text().splitlines()[0])["advantage"] is not None
