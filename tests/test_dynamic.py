"""Batch composition: DAPO's dynamic sampling (refill rounds until ``prompts_per_step`` informative groups,
surplus and no-signal groups counted, the prompt stream advanced by what was drawn) and its soft overlong
punishment (the built-in ``overlong`` reward), against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from nanogrpo.algo.advantages import refill_size, surplus_mask
from nanogrpo.config import load_config
from nanogrpo.data import PromptSampler
from nanogrpo.engines.base import Generation
from nanogrpo.errors import ConfigError
from nanogrpo.models.tiny import make_tokenizer
from nanogrpo.rewards import RewardRunner, overlong
from nanogrpo.rollout.collect import Collector

TOK = make_tokenizer()


class FakeEngine:
    """Sample j of every prompt is j + 1 copies of one token then EOS: lengths differ within a group."""

    name = "fake"

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, prompts, params) -> Generation:
        self.calls.append(len(prompts))
        comp = [[7] * (j + 1) + [TOK.eos_token_id] for _ in prompts for j in range(params.n)]
        return Generation(comp, [[-0.5] * len(c) for c in comp], ["stop"] * len(comp))


def length_unless_flat(completion: str, sample: dict) -> float:
    """The completion's length, except for rows marked flat (every sample scores 0: no signal)."""
    return 0.0 if sample["flat"] else float(sample["completion_tokens"])


def _rows(flat: list[bool]) -> list[dict]:
    return [{"question": f"{i}+{i}?", "answer": str(2 * i), "flat": f, "id": str(i)}
            for i, f in enumerate(flat)]


def _run(flat: list[bool], over: list[str], per_step: int = 4):
    cfg = load_config(overrides=["data.system_prompt=''", "grpo.group_size=4", "model.chat_template=plain",
                                 f"rollout.prompts_per_step={per_step}", "rollout.max_new_tokens=8", *over])
    rows = _rows(flat)
    sampler = PromptSampler(rows, per_step, seed=0, shuffle=False)
    rewards = RewardRunner([length_unless_flat], workers=0)
    engine = FakeEngine()
    batch, stats = Collector(engine, TOK, rewards, cfg).collect(sampler.next_batch(), seed=1,
                                                                more=sampler.next_batch)
    return batch, stats, sampler, engine


def test_refills_until_the_batch_is_full_and_counts_what_it_drops():
    """Stream: 4 prompts, every other one flat -> 2 kept; refill for 2 more at the 50% keep rate (x1.25 ->
    4 prompts -> 2 kept): full after one refill; nothing left over."""
    flat = [False, True] * 8
    batch, stats, sampler, engine = _run(flat, ["grpo.dynamic_sampling=true"])
    assert engine.calls == [4, 4] and stats.refills == 1
    assert stats.groups_total == 8 and stats.groups_kept == 4 and stats.groups_no_signal == 4
    assert stats.groups_surplus == 0 and batch.num_seqs == 16
    assert batch.meta["ids"] == ["0", "2", "4", "6"]              # the informative ones, in stream order
    assert sampler.state_dict()["index"] == 8                    # the stream advanced by what was drawn
    assert stats.metrics()["refills"] == 1


def test_the_surplus_of_the_last_round_is_dropped_and_counted():
    flat = [False, True, True, True] + [False] * 12
    batch, stats, sampler, engine = _run(flat, ["grpo.dynamic_sampling=true"])
    # round 0 keeps 1 of 4 (25%): 3 missing / 0.25 x 1.25 = 15 -> capped at 4 prompts, all informative
    assert engine.calls == [4, 4] and stats.groups_kept == 4 and stats.groups_surplus == 1
    assert batch.meta["ids"] == ["0", "4", "5", "6"] and sampler.state_dict()["index"] == 8


def test_max_refills_bounds_the_rounds_and_the_step_trains_on_what_it_has():
    batch, stats, _, engine = _run([True] * 40, ["grpo.dynamic_sampling=true", "grpo.max_refills=2"])
    assert batch is None and stats.refills == 2 and len(engine.calls) == 3 and stats.groups_kept == 0
    batch, stats, _, _ = _run([False, True, True, True] * 10,
                              ["grpo.dynamic_sampling=true", "grpo.max_refills=0"])
    assert stats.refills == 0 and stats.groups_kept == 1 and batch.num_seqs == 4


def test_without_dynamic_sampling_nothing_is_refilled_and_nothing_new_is_logged():
    batch, stats, sampler, engine = _run([False, True] * 8, [])
    assert engine.calls == [4] and stats.groups_kept == 2 and sampler.state_dict()["index"] == 4
    m = stats.metrics()
    assert "refills" not in m and "groups_surplus" not in m and "groups_no_signal" not in m


def test_surplus_mask():
    keep = torch.tensor([True, False, True, True, False, True])
    assert surplus_mask(keep, 2).tolist() == [False, False, False, True, False, True]
    assert not surplus_mask(keep, 4).any()


def test_refill_size():
    assert refill_size(target=8, kept=6, generated=8, cap=8) == 4      # 2 missing / 0.75 x 1.25 = 3.3
    assert refill_size(target=8, kept=4, generated=8, cap=8) == 8      # 4 / 0.5 x 1.25 = 10: capped
    assert refill_size(target=8, kept=0, generated=8, cap=8) == 8      # nothing kept: a full batch
    assert refill_size(target=8, kept=7, generated=8, cap=8) == 2


# ----------------------------------------------------------------------------- overlong


@pytest.mark.parametrize("n,want", [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0)])
def test_overlong_is_dapos_soft_punishment(n, want):
    """L_max 100, L_cache 20: 0 up to 80 tokens, then (80 - n) / 20, -1 at the limit (DAPO eq. 13)."""
    s = {"completion_tokens": n, "max_new_tokens": 100}
    assert overlong("", s, buffer=20) == pytest.approx(want)
    assert overlong("", s) == pytest.approx(want)                     # default buffer: a fifth of the limit
    assert overlong("", s, buffer=20, penalty=0.5) == pytest.approx(want / 2)


def test_overlong_needs_the_lengths_the_rollout_sets():
    with pytest.raises(ValueError, match="completion_tokens"):
        overlong("text", {"answer": "1"})


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_overlong_settings_reach_the_reward_in_and_out_of_process(workers):
    cfg = load_config(overrides=["rewards.functions=['overlong']", "rewards.overlong_buffer=4",
                                 "rewards.overlong_penalty=2", f"rewards.workers={workers}"])
    runner = RewardRunner.from_config(cfg.rewards)
    try:
        res = runner.score(["a", "b", "c"],
                           [{"completion_tokens": n, "max_new_tokens": 10} for n in (6, 8, 10)])
    finally:
        runner.close()
    assert res.total == pytest.approx([0.0, -1.0, -2.0])


def test_overlong_in_a_rollout_reads_the_sampled_length():
    cfg = load_config(overrides=["data.system_prompt=''", "grpo.group_size=4", "rollout.prompts_per_step=2",
                                 "rollout.max_new_tokens=5", "rewards.overlong_buffer=2",
                                 "model.chat_template=plain",
                                 "rewards.functions=['overlong']", "rewards.workers=0"])
    rewards = RewardRunner.from_config(cfg.rewards)
    batch, stats = Collector(FakeEngine(), TOK, rewards, cfg).collect(_rows([False, False]), seed=1)
    # lengths 2..5 (with EOS) against a limit of 5, buffer 2: 0, 0, -0.5, -1
    assert batch.rewards[:4].tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert stats.reward_by_function["overlong"] == pytest.approx(-0.375)


def test_an_overlong_buffer_past_the_limit_is_refused():
    with pytest.raises(ConfigError, match="overlong_buffer=600 is longer than rollout.max_new_tokens=512"):
        load_config(overrides=["rewards.overlong_buffer=600"])
