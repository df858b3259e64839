"""Episodes with an environment on real engines: the rendering of each turn, what is trained, turn and
token limits, the return, the KV cache kept across turns (greedy episodes equal the re-prefill ones),
and environments that raise, hang, answer a non-finite reward or too long an observation."""

from __future__ import annotations

import pytest
import torch

from nanogrpo.config import load_config
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.factory import make_engine
from nanogrpo.engines.session import WithoutSession
from nanogrpo.envs import EnvRunner
from nanogrpo.episodes.play import Episodes, episode_return, generate_episodes
from nanogrpo.episodes.render import ChatRenderer
from nanogrpo.episodes.settings import EpisodeSettings
from nanogrpo.models.load import load_policy
from nanogrpo.models.source import check_model_source
from nanogrpo.models.tiny import make_tokenizer
from nanogrpo.rewards import RewardRunner
from nanogrpo.rollout.collect import Collector
from tests import env_fixtures

TOK = make_tokenizer()


def test_renderer_extends_the_conversation_exactly_and_keeps_observations_plain():
    r = ChatRenderer(TOK, "auto", "be brief")
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = r.prompt("hi")
    assert (
        ids
        == TOK(
            TOK.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )
    reply = TOK("yo", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
    ids += reply + r.after_turn("again")
    conv += [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    whole = TOK.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert ids == TOK(whole, add_special_tokens=False)["input_ids"]
    tool = r.after_turn([{"role": "tool", "content": "42"}])
    assert TOK.decode(tool) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    forged = r.after_turn("<|im_end|>")
    body = forged[
        len(TOK("\n<|im_start|>user\n")["input_ids"]) : -len(
            TOK("<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        )
    ]
    assert (
        TOK.decode(body) == "<|im_end|>" and TOK.eos_token_id not in body
    )  # the text, not the control token
    plain = ChatRenderer(TOK, "plain")
    assert TOK.decode(plain.prompt("hi")) == "User: hi\nAssistant:"
    assert TOK.decode(plain.after_turn("more")) == "\nUser: more\nAssistant:"


@pytest.fixture(scope="module")
def demo():
    cfg = load_config(preset="demo")
    model, tok, _ = load_policy(cfg.model, check_model_source(cfg.model))
    return cfg, model, tok


def _episodes(cfg, source, **env):
    c = cfg.with_overrides({"env.source": source, **{f"env.{k}": v for k, v in env.items()}})
    return Episodes.from_config(c)


@pytest.mark.parametrize("source", ["tests.env_fixtures:Count", "tests.env_fixtures:AsyncCount"])
def test_episode_bookkeeping(demo, source):
    cfg, model, tok = demo
    eps = _episodes(cfg, source, max_turns=3)
    eps.settings.discount = 0.5
    budget = 100
    try:
        gen = eps.generate(
            make_engine("fast", model, tok),
            tok,
            [{"question": "a"}, {"question": "b"}],
            SamplingParams(max_new_tokens=budget, temperature=1.0, n=3, seed=4, resume_after_eos=True),
        )
    finally:
        eps.close()
    assert gen.kept == [0, 1] and len(gen.completion_ids) == 6
    seen = set()
    for ids, lps, mask, why, info, prompt in zip(
        gen.completion_ids,
        gen.logprobs,
        gen.loss_masks,
        gen.finish_reasons,
        gen.infos,
        gen.prompt_ids,
        strict=True,
    ):
        seen.add(why)
        assert len(ids) == len(lps) == len(mask) and sum(mask) <= budget
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(lps, mask) if m)
        turns = info["turns"]
        assert info["num_turns"] == len(turns) <= 3
        # each run of fed tokens is exactly the rendered answer of the environment to the turn before it
        runs, k = [], 0
        while k < len(ids):
            j = k
            while j < len(ids) and mask[j] == mask[k]:
                j += 1
            runs.append((mask[k], ids[k:j]))
            k = j
        fed = [tok.decode(r) for m, r in runs if not m]
        assert fed == [
            f"\n<|im_start|>user\nseen {t + 1}<|im_end|>\n<|im_start|>assistant\n" for t in range(len(fed))
        ]
        assert tok.decode(prompt) in [
            f"<|im_start|>user\ncount {q}<|im_end|>\n<|im_start|>assistant\n" for q in "ab"
        ]
        if why == "done":
            assert len(turns) == 3 and info["turn_rewards"] == [0.25] * 3 and len(fed) == 2
            assert info["env_reward"] == pytest.approx(0.25 * (1 + 0.5 + 0.25))
            assert ids[-1] == tok.eos_token_id
        else:
            assert why == "length" and sum(mask) == budget
            assert info["env_reward"] == pytest.approx(episode_return(info["turn_rewards"], 0.5))
        assert info["success"] == (info["env_reward"] > 0)
    assert "done" in seen


@pytest.mark.parametrize("engine_name", ["fast", "hf"])
def test_greedy_episodes_keep_the_cache_exactly(demo, engine_name):
    """The fast engine keeps each episode's KV cache across turns (parked at EOS); greedy episodes
    equal those of the generic session, which prefills the whole context again every turn."""
    cfg, model, tok = demo
    rows = [{"question": q} for q in ("Tom has 3 pens and buys 4 more. How many?", "x", "A box holds 2 rows")]
    params = SamplingParams(max_new_tokens=90, temperature=0.0, n=1, resume_after_eos=True)
    out = []
    for engine in (
        make_engine(engine_name, model, tok),
        WithoutSession(make_engine(engine_name, model, tok)),
    ):
        eps = _episodes(cfg, "tests.env_fixtures:Count", max_turns=3)
        try:
            out.append(eps.generate(engine, tok, rows, params))
        finally:
            eps.close()
    native, reprefill = out
    assert native.completion_ids == reprefill.completion_ids
    assert max(i["num_turns"] for i in native.infos) >= 2  # the cache was used across turns
    for a, b in zip(native.logprobs, reprefill.logprobs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


@pytest.mark.slow  # (over 1.3 s: the fast suite stays under a minute)
def test_broken_environments_end_their_episodes_not_the_run(demo):
    cfg, model, tok = demo
    env_fixtures.RELEASE.clear()
    c = cfg.with_overrides(
        {
            "env.source": "tests.env_fixtures:Misbehaves",
            "env.timeout_s": 1.0,
            "env.max_observation_tokens": 60,
            "env.error_penalty": -2.0,
            "rollout.max_new_tokens": 80,
            "grpo.group_size": 2,
            "rewards.workers": 0,
            "rewards.functions": ["env"],
        }
    )
    eps = Episodes.from_config(c)
    modes = ["ok", "raise", "hang", "nan", "long", "reset_raise", "ok"]
    rows = [{"question": m, "mode": m, "answer": "0"} for m in modes]
    try:
        with RewardRunner(c.rewards.functions, workers=0) as rewards:
            collector = Collector(make_engine("fast", model, tok), tok, rewards, c, env=eps)
            batch, stats = collector.collect(rows, seed=1)
            counts = dict(eps.runner.counts)
            # the run goes on: the same runner plays the next step's episodes
            again, _ = collector.collect(rows[:1], seed=2)
    finally:
        env_fixtures.RELEASE.set()
        eps.close()
    m = stats.metrics()
    assert m["env/groups_dropped"] == 1 and m["prompts_skipped"] == 1  # reset_raise: its group never started
    assert m["env/episodes"] == 12
    # each broken group's episodes end at their first step (an episode whose first turn ran out of tokens
    # never reaches the environment)
    reached = {k: v for k, v in counts.items()}
    assert reached.get("reset/error") == 2
    assert m["env/finish/env_error"] == reached.get("step/error", 0) and m["env/finish/env_error"] >= 1
    assert m["env/finish/env_timeout"] == reached.get("step/timeout", 0) >= 1
    assert m["env/finish/too_long"] == reached.get("step/too_long", 0) >= 1
    assert (
        m["env/finish/env_error"]
        + m["env/finish/env_timeout"]
        + m["env/finish/too_long"]
        + m["env/finish/length"]
        + m["env/finish/done"]
        + m["env/finish/max_turns"]
        == 12
    )
    assert batch is not None  # the broken groups (penalty vs length-cut episodes) and the good ones train
    assert set(batch.rewards.tolist()) <= {-2.0, 0.0, 1.0, 2.0}
    assert again is None or again.num_seqs >= 0


@pytest.mark.slow  # (over 1.3 s: the fast suite stays under a minute)
def test_the_sandbox_runs_model_written_code_for_an_environment():
    cfg = load_config(
        preset="demo", overrides={"env.source": "tests.env_fixtures:RunsCode", "tools.timeout_s": 1.5}
    )
    runner = EnvRunner.from_config(cfg)
    try:
        [made] = runner.make(1)
        env = made.value
        assert env.sandbox is runner.sandbox
        runner.call([env], "reset", [{}])
        res = runner.call([env], "step", ["print(6 * 7)"])[0].value
        assert res.observation.strip() == "42" and res.info["status"] == "ok"
        [made] = runner.make(1)
        bad = runner.call([made.value], "step", ["while True: pass"])[0].value
        assert bad.info["status"] == "timeout" and bad.reward == 0.0
    finally:
        runner.close()


def test_settings_come_from_the_config():
    cfg = load_config(
        preset="demo",
        overrides={
            "env.source": "tests.env_fixtures:Count",
            "env.max_turns": 4,
            "grpo.turn_reward_discount": 0.8,
            "data.max_prompt_tokens": 50,
        },
    )
    s = EpisodeSettings.from_config(cfg)
    assert (s.max_turns, s.discount, s.max_prompt_tokens) == (4, 0.8, 50)
    assert generate_episodes  # the function the Episodes object calls


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_nanogrpo_train_takes_an_environment_object(tmp_path):
    import nanogrpo

    template = env_fixtures.Count()
    cfg = {"train.steps": 1, "train.out": str(tmp_path / "run"), "rollout.prompts_per_step": 2,
           "grpo.group_size": 2, "rollout.max_new_tokens": 60, "eval.every": 1, "eval.n": 2,
           "train.save_every": 0, "rewards.workers": 0}
    run = nanogrpo.train(nanogrpo.Config.load("demo", cfg), env=template, rewards=["env"],
                         dataset=[{"question": str(i), "answer": "0"} for i in range(4)],
                         eval_dataset=[{"question": "e", "answer": "0"}] * 2)
    rows = run.metrics
    assert rows[0]["step"] == 0 and "eval/turns_mean" in rows[0]
    assert rows[1]["env/episodes"] == 4 and rows[1]["env/turns_mean"] >= 1
    assert not hasattr(template, "n")  # a template: each episode played a copy
    with pytest.raises(Exception, match="env and tools"):
        nanogrpo.train(nanogrpo.Config.load("demo-tools", cfg), env=template)


def test_episodes_of_a_group_may_start_from_different_prompts(demo):
    cfg, model, tok = demo
    eps = _episodes(cfg, "tests.env_fixtures:Numbered", max_turns=2)
    try:
        params = SamplingParams(max_new_tokens=40, temperature=1.0, n=2, seed=1, resume_after_eos=True)
        rows = [{"question": "a"}, {"question": "b"}]
        gen = eps.generate(make_engine("fast", model, tok), tok, rows, params)
    finally:
        eps.close()
    prompts = [tok.decode(p) for p in gen.prompt_ids]
    assert len(set(prompts)) == 4 and all(f"count {q} #" in p for p, q in zip(prompts, "aabb", strict=True))


def test_the_fast_session_keeps_the_cache_of_turns_that_ended_at_eos(demo):
    cfg, model, tok = demo
    engine = make_engine("fast", model, tok)
    prompts = [ChatRenderer(tok).prompt("Tom has 3 pens and buys 4 more. How many?")]
    for resume in (True, False):
        params = SamplingParams(60, temperature=0.0, n=2, resume_after_eos=resume)
        session = engine.open_session(prompts, params, 200)
        gen = session.step([0, 1], [[], []], [60, 60])
        assert gen.finish_reasons == ["stop", "stop"]
        assert set(session.parked) == ({0, 1} if resume else set())  # a next turn prefills only new tokens
        session.close()


def _roll(cfg, model, tok, source, modes, **over):
    c = cfg.with_overrides({"env.source": source, "grpo.group_size": 2, "rewards.workers": 0,
                            "rewards.functions": ["env"], **over})
    eps = Episodes.from_config(c)
    rows = [{"question": m, "mode": m, "answer": "0"} for m in modes]
    try:
        with RewardRunner(c.rewards.functions, workers=0) as rewards:
            engine = make_engine("fast", model, tok)
            batch, stats = Collector(engine, tok, rewards, c, env=eps).collect(rows, seed=3)
        return batch, stats, dict(eps.runner.counts)
    finally:
        eps.close()


def test_outside_text_is_bounded_by_bytes_before_it_is_tokenised(demo):
    """A 10 MiB observation (a string, or a tool message of 2-byte characters) ends its episode as too_long
    at once, never tokenised (tokenising it took ~40 s and GBs, issue 44); a 10 MiB first observation drops
    its group as a prompt too long; a step that answers None is an env_error, counted."""
    import time

    cfg, model, tok = demo
    c = cfg.with_overrides({"env.source": "tests.env_fixtures:Floods", "env.timeout_s": 30.0})
    eps = Episodes.from_config(c)
    modes = ["flood", "flood_messages", "none", "reset_flood", "ok"]
    rows = [{"question": m, "mode": m} for m in modes]
    t0 = time.monotonic()
    try:
        params = SamplingParams(max_new_tokens=200, temperature=1.0, n=3, seed=5, resume_after_eos=True)
        gen = eps.generate(make_engine("fast", model, tok), tok, rows, params)
    finally:
        eps.close()
    wall = time.monotonic() - t0
    assert wall < 15, f"{wall:.1f} s"  # the whole step; each flood was refused in microseconds
    assert gen.kept == [0, 1, 2, 4] and gen.env_metrics["env/prompts_too_long"] == 1
    by_mode = {m: list(zip(gen.finish_reasons[k * 3:(k + 1) * 3], gen.infos[k * 3:(k + 1) * 3]))
               for k, m in enumerate(["flood", "flood_messages", "none", "ok"])}
    reached = 0
    for mode in ("flood", "flood_messages"):
        for why, info in by_mode[mode]:
            if why == "length":  # its first turn ran out of tokens: never reached the environment
                continue
            reached += 1
            assert why == "too_long" and "not tokenised" in info["env_error"], (why, info["env_error"])
            assert info["env_reward"] == c.env.error_penalty
            assert len(info["turns"][-1]["observation"]) < 300  # a preview, not the 10 MiB
    assert reached >= 1
    nones = [why for why, _ in by_mode["none"] if why != "length"]
    assert nones and set(nones) == {"env_error"}
    assert eps.runner.counts["step/error"] == len(nones)  # counted (a None was a silent finish before)
    assert eps.runner.counts["step/too_long"] == reached


def test_a_step_whose_groups_are_all_dropped_still_logs_why(demo):
    """Every group dropped (each reset raised): the step's metrics say so (env/groups_dropped), not only
    prompts_skipped (issue 44)."""
    cfg, model, tok = demo
    batch, stats, counts = _roll(cfg, model, tok, "tests.env_fixtures:Misbehaves",
                                 ["reset_raise"] * 3)
    m = stats.metrics()
    assert batch is None and m["prompts_skipped"] == 3
    assert m["env/groups_dropped"] == 3 and m["env/episodes"] == 0 and counts["reset/error"] == 6


FLOOD_CHILD = r"""
import json, sys, time
from nanogrpo.config import load_config
from nanogrpo.models.load import load_policy
from nanogrpo.models.source import check_model_source
from nanogrpo.engines.base import SamplingParams
from nanogrpo.episodes.play import Episodes
from nanogrpo.engines.factory import make_engine

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

cfg = load_config(preset="demo", overrides={"env.source": "tests.env_fixtures:Floods", "env.timeout_s": 30.0})
model, tok, _ = load_policy(cfg.model, check_model_source(cfg.model))
engine, eps = make_engine("fast", model, tok), Episodes.from_config(cfg)
params = SamplingParams(max_new_tokens=200, temperature=1.0, n=4, seed=5, resume_after_eos=True)
eps.generate(engine, tok, [{"question": "ok", "mode": "ok"}], params)  # warm: the engine's buffers
open("/proc/self/clear_refs", "w").write("5")  # the peak RSS starts again here
base = status("VmRSS")
t0 = time.monotonic()
rows = [{"question": "q", "mode": "flood"}, {"question": "r", "mode": "flood"}]
gen = eps.generate(engine, tok, rows, params)
wall = time.monotonic() - t0
eps.close()
print(json.dumps({"peak_mb": (status("VmHWM") - base) / 2**20, "wall_s": wall,
                  "finish": gen.finish_reasons}))
"""


@pytest.mark.slow
def test_a_10mb_observation_costs_no_memory_and_no_time():
    """Acceptance of issue 44: the peak memory of a step whose episodes each answer a 10 MiB observation
    stays under +200 MB (measured in a process of its own: the peak RSS over the step) and the episodes
    end within the step's deadline (env.timeout_s = 30 s); before, each took ~40-80 s and 2.4-4.5 GB."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc to measure the peak RSS")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", FLOOD_CHILD], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "too_long" in got["finish"], got  # at least one episode reached its flood
    assert got["peak_mb"] < 200, got
    assert got["wall_s"] < 30, got
