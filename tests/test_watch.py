"""The run monitor (nanogrpo.watch): each rule on metric streams made to trip it and on streams that
must not; the monitor's events, screen line, metrics, stop and resume; the metrics it reads; the report's
watch section. Fast: no model, except the replays of real runs' streams (tests/data/watch/), which are
metric rows only."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from nanogrpo.algo.corrections import logprob_gap_stats
from nanogrpo.config import RULE_NAMES, Config, ConfigError, WatchConfig
from nanogrpo.rollout.collect import distinct_ngrams, example_rows, sampled_nll
from nanogrpo.watch import RULES, WATCH_FILE, History, Monitor, read_events, replay, summary
from nanogrpo.watch import rules as R

DATA = Path(__file__).parent / "data" / "watch"


def rows(n: int, **series) -> list[dict]:
    """``n`` training rows; each keyword a constant, a list of n values, or a function of the step."""
    out = []
    for i in range(n):
        r = {"step": i + 1, "reward_mean": 0.0, "reward_std": 1.0, "accuracy": 0.2, "groups_kept": 16}
        for k, v in series.items():
            r[k] = v(i + 1) if callable(v) else v[i] if isinstance(v, list) else v
        out.append(r)
    return out


def history(rs: list[dict], weights=None) -> History:
    h = History(dict(weights or {}))
    for r in rs:
        h.add(r)
    return h


def test_the_registry_is_the_configs_list_of_rules():
    assert list(RULES) == list(RULE_NAMES)
    assert all(hasattr(WatchConfig(), n) for n in RULES)


# ----------------------------------------------------------------------------- each rule


def test_reward_hacking_fires_when_the_reward_climbs_and_the_accuracy_does_not():
    s = WatchConfig().reward_hacking
    climb = rows(12, reward_mean=lambda t: 0.2 * t, accuracy=0.3)
    f = R.reward_hacking(history(climb), s)
    assert f is not None and f.rule == "reward_hacking" and f.step == 12
    assert "train accuracy 30.0% -> 30.0%" in f.message
    # the accuracy climbs with it: the run working
    assert R.reward_hacking(history(rows(12, reward_mean=lambda t: 0.2 * t,
                                         accuracy=lambda t: 0.1 + 0.05 * t)), s) is None
    # a small rise (below min_gain start spreads) is noise
    assert R.reward_hacking(history(rows(12, reward_mean=lambda t: 0.02 * t, accuracy=0.3)), s) is None
    # before 2 x window steps: nothing
    assert R.reward_hacking(history(climb[:2 * s.window - 1]), s) is None


def test_reward_hacking_reads_held_out_accuracy_too_when_the_run_evaluates():
    s = WatchConfig().reward_hacking
    rs = [{"step": 0, "eval/accuracy": 0.30}] + rows(12, reward_mean=lambda t: 0.2 * t, accuracy=0.2)
    rs[10]["eval/accuracy"] = 0.29  # step 10: held-out flat, and train accuracy too
    f = R.reward_hacking(history(rs), s)
    assert f is not None and "train accuracy 20.0% -> 20.0% and held-out accuracy 30.0% (step 0) -> 29.0% " \
                             "(step 10)" in f.message
    rs[10]["eval/accuracy"] = 0.45  # held-out rose with the reward: no alarm
    assert R.reward_hacking(history(rs), s) is None
    # held-out flat while the training prompts' accuracy rose with the reward (the tag_format fault's run,
    # learning correctness, had held-out 37% at step 5 and 38% at step 25): overfitting at worst, no hack
    rs = [{"step": 0, "eval/accuracy": 0.30}] + rows(12, reward_mean=lambda t: 0.2 * t,
                                                       accuracy=lambda t: 0.1 + 0.05 * t)
    rs[10]["eval/accuracy"] = 0.29
    assert R.reward_hacking(history(rs), s) is None


def test_reward_hacking_also_fires_when_held_out_falls_from_its_best_while_the_reward_rises():
    s = WatchConfig().reward_hacking
    rs = [{"step": 0, "eval/accuracy": 0.1}] + rows(20, reward_mean=lambda t: 0.2 * t,
                                                      accuracy=lambda t: 0.1 + 0.03 * t)
    rs[5]["eval/accuracy"], rs[10]["eval/accuracy"], rs[20]["eval/accuracy"] = 0.5, 0.55, 0.35
    f = R.reward_hacking(history(rs), s)
    assert f is not None and f.since == 10 and "fell 55.0% (step 10) -> 35.0% (step 20)" in f.message
    rs[20]["eval/accuracy"] = 0.45  # a 10-point dip: within the rule's noise allowance (max_drop 15)
    assert R.reward_hacking(history(rs), s) is None


def test_one_component_names_the_component_that_is_not_the_task():
    s = WatchConfig().one_component
    w = {"correctness": 1.0, "format": 1.0}
    rs = rows(12, **{"reward/correctness": 0.0, "reward/format": lambda t: 0.2 * t})
    f = R.one_component(history(rs, w), s)
    assert f is not None and f.values["component"] == "format" and "format carries 100%" in f.message
    # the task's own reward carrying the gain is the run working
    rs = rows(12, **{"reward/correctness": lambda t: 0.2 * t, "reward/format": 0.0})
    assert R.one_component(history(rs, w), s) is None
    # two components sharing the gain
    rs = rows(12, **{"reward/correctness": lambda t: 0.1 * t, "reward/format": lambda t: 0.1 * t})
    assert R.one_component(history(rs, w), s) is None
    # weights count: format's rise x 0.1 is small beside correctness's
    rs = rows(12, **{"reward/correctness": lambda t: 0.1 * t, "reward/format": lambda t: 0.2 * t})
    assert R.one_component(history(rs, {"correctness": 1.0, "format": 0.1}), s) is None
    # one reward only: nothing to split
    alone = rows(12, **{"reward/format": lambda t: 0.2 * t})
    assert R.one_component(history(alone, {"format": 1}), s) is None


def test_length_limit_fires_when_completions_grow_to_the_limit():
    s = WatchConfig().length_limit
    rs = rows(10, truncated_frac=[0.0] * 4 + [0.2, 0.4, 0.6, 0.7, 0.8, 0.9], completion_len_mean=40.0)
    f = R.length_limit(history(rs), s)
    assert f is not None and f.since == 7 and "80% of completions cut off" in f.message
    # a run that starts long is not growing
    assert R.length_limit(history(rows(10, truncated_frac=0.8)), s) is None


def test_template_collapse_fires_when_the_distinct_ngram_ratio_halves():
    s = WatchConfig().template_collapse
    rs = rows(10, distinct_ngrams=[0.08] * 5 + [0.07, 0.05, 0.03, 0.02, 0.02])
    f = R.template_collapse(history(rs), s)
    assert f is not None and f.since == 8
    assert R.template_collapse(history(rows(10, distinct_ngrams=[0.08] * 5 + [0.06] * 5)), s) is None


def test_entropy_collapse_needs_both_the_fraction_and_the_floor():
    s = WatchConfig().entropy_collapse
    f = R.entropy_collapse(history(rows(10, entropy=[0.5] * 6 + [0.2, 0.02, 0.004, 0.002])), s)
    assert f is not None and f.since == 8 and f.thresholds["entropy"] == pytest.approx(0.1)
    # the lr_collapse fault's shape: 0.28 at the start, 0.07 once it samples one template (26%, under 0.1)
    f = R.entropy_collapse(history(rows(10, entropy=[0.28] * 6 + [0.09, 0.07, 0.07, 0.07])), s)
    assert f is not None and f.since == 8 and f.thresholds["entropy"] == pytest.approx(0.084)
    # a 60% fall is not yet one
    assert R.entropy_collapse(history(rows(10, entropy=[0.28] * 6 + [0.11] * 4)), s) is None
    # below 30% of the start but above the floor (a high-entropy start): not a collapse
    assert R.entropy_collapse(history(rows(10, entropy=[2.0] * 6 + [0.15] * 4)), s) is None
    # a policy that started sure of itself and stays so
    assert R.entropy_collapse(history(rows(10, entropy=0.005)), s) is None
    # sure of answers that are right: converged, not collapsed
    solved = rows(10, entropy=[0.5] * 6 + [0.02, 0.004, 0.002, 0.001], accuracy=0.97)
    assert R.entropy_collapse(history(solved), s) is None
    # entropy spent on answers that became right (the tool demo: 47% -> 80%): learning, not collapse; a
    # smaller rise than ``learned`` is not enough
    learning = rows(10, entropy=[0.5] * 6 + [0.05] * 4, accuracy=[0.47] * 3 + [0.6] * 3 + [0.8] * 4)
    assert R.entropy_collapse(history(learning), s) is None
    barely = rows(10, entropy=[0.5] * 6 + [0.05] * 4, accuracy=[0.47] * 3 + [0.5] * 3 + [0.52] * 4)
    assert R.entropy_collapse(history(barely), s) is not None
    # data without reference answers (accuracy NaN): nothing to guard with, and the line says so
    f = R.entropy_collapse(history(rows(10, entropy=[0.5] * 6 + [0.05] * 4, accuracy=float("nan"))), s)
    assert f is not None and "no accuracy logged" in f.message and "nan" not in f.message


def test_spikes_compare_a_step_with_the_median_of_the_steps_before():
    w = WatchConfig()
    kl = [0.0, 0.004, 0.006, 0.005, 0.007, 0.006, 0.01, 0.012, 0.01, 0.011, 0.8, 0.7]
    f = R.kl_spike(history(rows(12, kl=kl)), w.kl_spike)
    assert f is not None and (f.since, f.step) == (11, 12) and "107.7x the median 0.0065" in f.message
    # one step up, then back: a small batch's noisy estimate (the tool demo had a step at 13x)
    assert R.kl_spike(history(rows(12, kl=kl[:-1] + [0.01])), w.kl_spike) is None
    one = WatchConfig(kl_spike={"hold": 1}).kl_spike  # watch.kl_spike.hold=1: a single step is enough
    f = R.kl_spike(history(rows(11, kl=kl[:-1])), one)
    assert f is not None and (f.since, f.step) == (11, 11) and "for 1 step(s)" in f.message
    high = [3 * x for x in kl[:-2]] + [0.15, 0.15]
    assert R.kl_spike(history(rows(12, kl=high)), w.kl_spike) is None   # 7.7x the median: not a jump
    assert R.kl_spike(history(rows(12, kl=[0.0] * 10 + [0.05] * 2)), w.kl_spike) is None  # from 0, small
    assert R.kl_spike(history(rows(11, kl=kl[1:])), w.kl_spike) is None  # before 10 steps to compare with
    clip = [0.01, 0.02, 0.02, 0.03, 0.02, 0.01, 0.02, 0.02, 0.03, 0.02, 0.3, 0.35]
    assert R.clip_spike(history(rows(12, clip_frac=clip)), w.clip_spike) is not None
    assert R.clip_spike(history(rows(12, clip_frac=[0.0] * 12)), w.clip_spike) is None


def test_engine_drift_fires_on_a_gap_and_skips_stale_steps():
    s = WatchConfig().engine_drift
    gap = [1e-7] * 6 + [0.25, 0.24, 0.26]
    f = R.engine_drift(history(rows(9, logprob_gap=gap)), s)
    assert f is not None and f.since == 7
    assert R.engine_drift(history(rows(9, logprob_gap=1e-7)), s) is None
    # an engine in lower precision: its own gap from the start, steady
    assert R.engine_drift(history(rows(9, logprob_gap=0.03)), s) is None
    assert R.engine_drift(history(rows(9, logprob_gap=[0.03] * 6 + [0.2] * 3)), s) is not None
    # stale samples' gap is the policy's lag too: left out
    rs = rows(9, logprob_gap=gap, **{"staleness/max": [0] * 6 + [2] * 3})
    assert R.engine_drift(history(rs), s) is None


def test_no_signal_fires_after_window_steps_without_a_group_unless_solved():
    s = WatchConfig().no_signal
    f = R.no_signal(history(rows(6, groups_kept=[8, 8, 8, 0, 0, 0], accuracy=0.4)), s)
    assert f is not None and f.since == 4
    assert R.no_signal(history(rows(6, groups_kept=[8, 8, 8, 0, 0, 0], accuracy=1.0)), s) is None
    assert R.no_signal(history(rows(6, groups_kept=[8, 8, 8, 0, 1, 0], accuracy=0.4)), s) is None


def _episodes(failed: list[int], n: int = 8, why: str = "env_timeout") -> list[dict]:
    """Rows of a run with ``n`` episodes a step, ``failed[i]`` of them failed at step i + 1 (as ``why``)."""
    return rows(len(failed), **{"env/episodes": n, "env/failed": failed, f"env/finish/{why}": failed,
                                "env/finish/done": [n - f for f in failed], "env/groups_dropped": 0})


def test_episodes_failed_fires_at_the_first_step_whose_every_episode_failed_and_ends_the_run_at_the_third():
    """Issue 50, item 12: a verifiers run whose every episode timed out said nothing ('watch: no alarm')."""
    s = WatchConfig().episodes_failed
    assert R.episodes_failed(history(_episodes([0, 3, 7])), s) is None  # some episodes ended well
    f = R.episodes_failed(history(_episodes([0, 8])), s)
    assert f is not None and f.step == f.since == 2 and not f.stop
    assert f.message.startswith("all 8 episodes of this step failed (env_timeout): they ran past "
                                "env.timeout_s; raise env.timeout_s")
    f = R.episodes_failed(history(_episodes([0, 8, 8, 8])), s)
    assert f.since == 2 and f.stop and f.values["steps_in_a_row"] == 3
    f = R.episodes_failed(history(_episodes([8, 8, 4, 8])), s)
    assert f.since == 4 and not f.stop  # the streak starts again
    errs = R.episodes_failed(history(_episodes([8], why="env_error")), s)
    assert "(env_error): they ended in an error of the environment" in errs.message
    dropped = rows(1, **{"env/episodes": 0, "env/failed": 0, "env/groups_dropped": 4})
    assert "no episode of this step ran" in R.episodes_failed(history(dropped), s).message
    nothing = rows(1, **{"env/episodes": 0, "env/failed": 0, "env/groups_dropped": 0})  # no row on a rank
    assert R.episodes_failed(history(nothing), s) is None
    assert R.episodes_failed(history(_episodes([8, 8, 8])), WatchConfig(episodes_failed={"stop_after": 0})
                             .episodes_failed).stop is False


def test_the_monitor_ends_the_run_at_the_third_failed_step_with_the_line_in_the_summary(tmp_path, caplog):
    m = Monitor(WatchConfig(), tmp_path)
    with caplog.at_level(logging.WARNING, logger="nanogrpo.watch"):
        out = [m.observe(r) for r in _episodes([0, 8, 8, 8])]
    assert [o["watch/episodes_failed"] for o in out] == [0.0, 1.0, 1.0, 1.0]
    assert m.stop is not None and m.stop.step == 4
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("step 2: episodes_failed since step 2: all 8 episodes")
    assert lines[1].endswith("stopping the run (watch.episodes_failed.stop_after)")
    end = summary(read_events(tmp_path))
    assert end.startswith("watch: episodes_failed at step 2 (since 2); stopped the run at step 4 "
                          "(episodes_failed: all 8 episodes of this step failed (env_timeout)"), end
    assert WatchConfig().may_stop() and not WatchConfig(episodes_failed={"stop_after": 0}).may_stop()
    assert not WatchConfig(off=["episodes_failed"]).may_stop()


# ----------------------------------------------------------------------------- config


def test_the_watch_config_is_typed_and_checked():
    cfg = Config.load("demo", ["watch.entropy_collapse={fraction: 0.05}", "watch.stop_on=[engine_drift]"])
    assert cfg.watch.entropy_collapse.fraction == 0.05 and cfg.watch.entropy_collapse.window == 3
    cfg = Config.load("demo", ["watch.entropy_collapse.floor=0.005", "watch.kl_spike.hold=3"])  # one key
    assert (cfg.watch.entropy_collapse.floor, cfg.watch.entropy_collapse.fraction) == (0.005, 0.3)
    assert cfg.watch.kl_spike.hold == 3
    with pytest.raises(ConfigError, match="grpo.beta is not a table"):
        Config.load("demo", ["grpo.beta.x=1"])
    assert cfg.watch.active() == list(RULE_NAMES)
    assert Config.load("demo", ['watch.off=["kl_spike"]']).watch.active() == \
        [n for n in RULE_NAMES if n != "kl_spike"]
    assert Config.load("demo", ["watch.enabled=false"]).watch.active() == []
    with pytest.raises(ConfigError, match="watch.stop_on: unknown rule 'entropy'"):
        Config.load("demo", ["watch.stop_on=[entropy]"])
    with pytest.raises(ConfigError, match="did you mean 'fraction'"):
        Config.load("demo", ["watch.entropy_collapse={fractoin: 0.05}"])
    with pytest.raises(ConfigError, match="turns off"):
        Config.load("demo", ["watch.stop_on=[kl_spike]", "watch.off=[kl_spike]"])


# ----------------------------------------------------------------------------- the monitor


def _collapse(n: int = 10) -> list[dict]:
    return rows(n, entropy=[0.5] * 6 + [0.004] * (n - 6))


def test_the_monitor_says_it_once_logs_it_and_keeps_the_completions(tmp_path, caplog):
    cfg = WatchConfig(stop_on=["entropy_collapse"])
    m = Monitor(cfg, tmp_path, {"correctness": 1.0})
    first = [{"question": "q1", "completion": "<think>1+1=2</think><answer>2</answer>", "reward": 2.25,
              "advantage": 0.7, "images": ["data:image/png;base64,xx"]}]
    with caplog.at_level(logging.WARNING, logger="nanogrpo.watch"):
        out = [m.observe(r, first if r["step"] in (1, 9) else None) for r in _collapse()]
    assert [o["watch/entropy_collapse"] for o in out] == [0.0] * 8 + [1.0, 1.0]
    assert set(out[0]) == {f"watch/{n}" for n in RULE_NAMES}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("step 9: entropy_collapse since step 7: entropy 0.0040")
    assert lines[0].endswith("stopping the run (watch.stop_on)")
    events = read_events(tmp_path)
    assert len(events) == 1 and events[0]["stop"] and m.stop is not None and m.stop.step == 9
    ex = events[0]["examples"]
    assert ex["before"]["step"] == 1 and ex["now"]["step"] == 9
    assert "images" not in ex["now"]["rows"][0] and ex["now"]["rows"][0]["advantage"] == 0.7
    assert summary(events) == "watch: entropy_collapse at step 9 (since 7); stopped the run at step 9"
    assert summary([]) == "watch: no alarm"


def test_a_resumed_monitor_remembers_without_saying_it_again(tmp_path, caplog):
    rs = _collapse(12)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs[:10]))
    m = Monitor(WatchConfig(), tmp_path)
    for r in rs[:10]:
        m.observe(r)
    assert len(read_events(tmp_path)) == 1
    # killed after step 10, resumed from a checkpoint at step 8: the event at step 9 is dropped with the
    # rows after the checkpoint, and seen again when step 9 is trained again
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs[:8]))
    m = Monitor(WatchConfig(), tmp_path, resume_step=8)
    assert read_events(tmp_path) == [] and m.history.steps == 8
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanogrpo.watch"):
        for r in rs[8:]:
            m.observe(r)
    assert [e["step"] for e in read_events(tmp_path)] == [9] and len(caplog.records) == 1
    # resumed after the event: it stays said
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    m = Monitor(WatchConfig(), tmp_path, resume_step=10)
    assert "entropy_collapse" in m.firing and len(read_events(tmp_path)) == 1


def test_replay_is_the_monitor_without_its_side_effects():
    found = replay(_collapse(), WatchConfig())
    assert [(f.rule, f.step, f.since) for f in found] == [("entropy_collapse", 9, 7)]
    assert replay(_collapse(), WatchConfig(off=["entropy_collapse"])) == []


# ----------------------------------------------------------------------------- the metrics it reads


def test_distinct_ngrams_counts_a_groups_repeats_once():
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    assert distinct_ngrams([a, a, b, b], 2) == 1.0             # each prompt sure of its own answer
    assert distinct_ngrams([a, a, a, a], 2) == 0.5              # two prompts, one template
    assert distinct_ngrams([a, [1, 2, 3, 4, 6], b, b], 2) == pytest.approx(5 / 6)
    assert math.isnan(distinct_ngrams([[1, 2]] * 4, 2))


def test_sampled_nll_is_the_mean_negative_logprob_of_the_models_own_tokens():
    assert sampled_nll([[-1.0, -3.0], [-2.0]]) == pytest.approx(2.0)
    # multi-turn: the fed (environment / tool) tokens are not the policy's samples
    assert sampled_nll([[-1.0, -50.0, -3.0]], [[1, 0, 1]]) == pytest.approx(2.0)
    assert math.isnan(sampled_nll([[]])) and math.isnan(sampled_nll([[-1.0]], [[0]]))
    # an estimate of the entropy: tokens drawn from p, their mean -log p converges to H(p)
    p = torch.tensor([0.7, 0.2, 0.1])
    draws = torch.multinomial(p, 20000, replacement=True, generator=torch.Generator().manual_seed(0))
    h = float(-(p * p.log()).sum())
    assert sampled_nll([p.log()[draws].tolist()]) == pytest.approx(h, rel=0.02)


def test_entropy_collapse_reads_every_completion_where_the_run_logs_sampled_nll():
    """A collapsing policy's groups all agree, so the trainer trains on none and measures no ``entropy``
    (NaN); ``sampled_nll`` comes from every completion, and the rule reads it."""
    s = WatchConfig().entropy_collapse
    nan = float("nan")
    rs = rows(10, entropy=[0.5] * 6 + [nan] * 4, sampled_nll=[0.5] * 6 + [0.004, 0.002, 0.001, 0.001],
              groups_kept=[16] * 6 + [0] * 4)
    f = R.entropy_collapse(history(rs), s)
    assert f is not None and f.since == 7 and f.metrics[0] == f.values["read"] == "sampled_nll"
    assert "estimated from the sampled tokens" in f.message
    # the trainer's entropy still low on the few groups it trains on is not read when sampled_nll is logged
    rs = rows(10, entropy=[0.5] * 6 + [0.001] * 4, sampled_nll=0.5)
    assert R.entropy_collapse(history(rs), s) is None


def test_logprob_gap_is_measured_on_the_trained_tokens_only():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    engine = torch.tensor([[-1.1, -2.0, -9.0], [-0.5, -0.2, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    st = logprob_gap_stats(trainer, engine, mask)
    assert st["logprob_gap_sum"].item() == pytest.approx(0.4) and st["logprob_gap_max"].item() == \
        pytest.approx(0.3)


def test_the_rollout_table_takes_two_of_each_group():
    assert example_rows(32, 8, 8) == [0, 1, 8, 9, 16, 17, 24, 25]
    assert example_rows(16, 8, 2) == [0, 1]
    assert example_rows(4, 1, 3) == [0, 1, 2]


# ----------------------------------------------------------------------------- real runs, replayed


@pytest.mark.parametrize("stream", sorted(p.name for p in DATA.glob("*.jsonl")))
def test_no_rule_fires_on_the_shipped_demos_full_runs(stream):
    """The metric streams of the demos' full runs (docs/figures.md, "The run monitor"), replayed through
    every rule at its defaults: 0 alarms."""
    lines = (DATA / stream).read_text().splitlines()
    meta, rs = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert len(rs) >= meta["steps"]
    assert replay(rs, WatchConfig(), meta["weights"]) == []


def test_every_shipped_demo_has_its_full_run_replayed():
    """A demo shipped without its stream here would go unchecked: nanogrpo bench watch --demos runs them all
    (nanogrpo.bench.watch.DEMOS), --export writes the streams."""
    from nanogrpo import entry_points
    from nanogrpo.bench.watch import DEMOS

    assert sorted(DEMOS) == entry_points.preset_names()
    assert sorted(p.stem for p in DATA.glob("*.jsonl")) == entry_points.preset_names()
    # the streams were recorded with the metric the entropy rule reads first
    for p in DATA.glob("*.jsonl"):
        assert any("sampled_nll" in json.loads(x) for x in p.read_text().splitlines()[1:]), p.name


@pytest.mark.slow  # matplotlib: the whole report, ~5 s
def test_the_report_draws_each_event(tmp_path):
    pytest.importorskip("matplotlib")
    from nanogrpo.report import main as report

    run = tmp_path / "run"
    run.mkdir()
    rs = _collapse()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    m = Monitor(WatchConfig(), run)
    for r in rs:
        m.observe(r, [{"question": "q", "completion": f"step {r['step']}", "reward": 1.0, "advantage": 0.5}])
    assert report([str(run)]) == 0
    md = (run / "report" / "report.md").read_text()
    assert "## Watch" in md and "**entropy_collapse** at step 9 (since step 7)" in md
    assert (run / "report" / "watch_run_entropy_collapse_9.png").stat().st_size > 10_000
    assert (run / WATCH_FILE).is_file()
