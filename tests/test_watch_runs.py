"""Runs that go wrong on purpose (nanogrpo/bench/watch_faults.py), each caught by the rule meant for it
within the fault's stated bound, and stopped there by ``watch.stop_on`` with a checkpoint; before anything
fires, the monitor in the loop logs every rule, quiet. Real training on the embedded demo model (slow:
5-40 s of CPU each). That no rule fires on the shipped demos' full runs is tests/test_watch.py's replay of
their recorded metric streams (and ``nanogrpo bench watch --demos``, which trains them whole)."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest

from nanogrpo.bench.watch import fault_config, perturbed_engine
from nanogrpo.bench.watch_faults import FAULTS
from nanogrpo.training.checkpoint import latest_checkpoint
from nanogrpo.training.logging_sinks import run_summary
from nanogrpo.training.loop import train
from nanogrpo.training.metrics import read_metrics
from nanogrpo.training.prepare import prepare
from nanogrpo.watch import read_events, replay

pytestmark = pytest.mark.slow


EVAL = {"reward_hacking": ["eval.n=40"]}
"""Held-out evaluation only for the rule that reads it (40 problems, not the bench's 100); the other faults
train without it: the same steps (evaluation is greedy: it draws nothing from the sampler's seeded
generator), a third less CPU (CI's budget)."""


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_is_caught_by_its_rule_and_stops_the_run(name, tmp_path):
    f = FAULTS[name]
    last = f.onset + f.within
    cfg = fault_config(name, tmp_path / name, steps=last + 2,
                       overrides=[f'watch.stop_on=["{f.rule}"]', "train.save_every=0",
                                  *EVAL.get(f.rule, ["eval.every=0"])])
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
    # every training step logs every rule's watch/<rule>, 0 until the first alarm
    first = min(e["step"] for e in events)
    train_rows = [r for r in rows if "reward_mean" in r]
    assert all({k for k in r if k.startswith("watch/")} == {f"watch/{n}" for n in cfg.watch.active()}
               for r in train_rows)
    assert first > 1 and not any(r[k] for r in train_rows if r["step"] < first for k in r
                                 if k.startswith("watch/"))
    assert latest_checkpoint(root / "checkpoints").name == f"step_{step}"
    assert f"stopped the run at step {step}" in run_summary(root)
    # the event keeps completions of that step beside the run's first ones
    ex = hit[0]["examples"]
    assert ex["before"]["step"] == 1 and ex["now"]["step"] == step and ex["now"]["rows"]
    # the rollout table of log.samples_every (5) steps, each row with its advantage
    assert json.loads((root / "samples.jsonl").read_text().splitlines()[0])["advantage"] is not None
    # the monitor in the loop and a replay of the run's metrics agree
    weights = dict(zip(cfg.rewards.functions, [1.0] * len(cfg.rewards.functions)))
    found = [(x.rule, x.step, x.since) for x in replay(rows, cfg.watch, weights)]
    assert found == [(e["rule"], e["step"], e["since"]) for e in events]
