"""``nanogrpo train`` with each library's environment (slow: a real training step each): a verifiers
MultiTurnEnv, an agent written with the ``openai`` package, a TextArena game and an OpenEnv server
started here. The rollout batch the trainer trained on is checked row by row against a hand-written
expectation: the trained tokens are exactly the sampled ones (the rest: chat template and the
environment's text), the rewards follow the library's rules, and the turn counts."""

from __future__ import annotations

import re

import pytest

import nanogrpo
from nanogrpo.config import Config
from nanogrpo.episodes.agents import AgentEpisodes
from nanogrpo.episodes.play import Episodes
from tests.adapter_fixtures import ROWS, answer_of, need, need_verifiers
from tests.test_adapters import openenv_server  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow
QUICK = {"train.steps": 1, "rollout.prompts_per_step": 2, "grpo.group_size": 4, "train.save_every": 0,
         "rewards.workers": 0, "grpo.min_reward_spread": 0.0, "eval.every": 0, "rewards.functions": ["env"]}
"""One step of 2 rows x 4 episodes, every group kept, the episode's return as the only reward."""


@pytest.fixture
def captured(monkeypatch):
    """The real rollout's batches and generations, kept as the trainer makes them."""
    from nanogrpo.rollout.collect import Collector

    batches, gens = [], []
    real = Collector.collect

    def collect(self, *a, **kw):
        out = real(self, *a, **kw)
        batches.append(out[0])
        return out
    monkeypatch.setattr(Collector, "collect", collect)
    for cls in (AgentEpisodes, Episodes):
        def generate(self, *a, _real=cls.generate, **kw):
            gens.append(_real(self, *a, **kw))
            return gens[-1]
        monkeypatch.setattr(cls, "generate", generate)
    return batches, gens


def run(tmp_path, captured, overrides, dataset, env=None):
    cfg = Config.load("demo", {**QUICK, "train.out": str(tmp_path / "run"), **overrides})
    r = nanogrpo.train(cfg, dataset=dataset, env=env)
    (batch,), (gen,) = captured
    rows = r.metrics[-1]
    assert rows["env/episodes"] == 8 and batch.num_seqs >= 8
    return batch, gen, rows


def row_of(batch, j):
    """Batch row ``j``: (prompt ids, completion ids, loss mask, old log-probs), padding removed."""
    p = batch.prompt_len
    am = batch.attention_mask[j].bool()
    prompt = batch.input_ids[j, :p][am[:p]].tolist()
    n = int(batch.completion_mask[j].sum())
    comp = batch.input_ids[j, p:p + n].tolist()
    return prompt, comp, batch.loss_mask[j, :n].tolist(), batch.old_logprobs[j, :n].tolist()


def segments(tok, comp, mask):
    """Alternating ("sampled" | "fed", text) pieces of a completion."""
    out = []
    for t, m in zip(comp, mask):
        kind = "sampled" if m else "fed"
        if out and out[-1][0] == kind:
            out[-1][1].append(t)
        else:
            out.append((kind, [t]))
    return [(k, tok.decode(ids)) for k, ids in out]


def check_rows(batch, gen, tok):
    """Each episode's row is what the rollout generated, trained exactly on the sampled tokens."""
    for j in range(8):
        prompt, comp, mask, lps = row_of(batch, j)
        assert prompt == gen.prompt_ids[j] and comp == gen.completion_ids[j] and mask == gen.loss_masks[j]
        assert lps == pytest.approx([x if m else 0.0 for x, m in zip(gen.logprobs[j], mask)], abs=1e-6)
        assert batch.rewards[j] == pytest.approx(gen.infos[j]["env_reward"])


def test_train_with_a_verifiers_multiturn_env(tmp_path, captured):
    need_verifiers("classic")
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.models.source import resolve_model_path

    batch, gen, metrics = run(tmp_path, captured, {"env.source": "verifiers:tests.adapter_fixtures:retry_env",
                                                   "rollout.max_new_tokens": 100}, ROWS)
    tok = load_tokenizer(resolve_model_path("embedded"))
    check_rows(batch, gen, tok)
    for j in range(8):
        row, segs = ROWS[j // 4], segments(tok, *row_of(batch, j)[1:3])
        said = [t.replace("<|im_end|>", "") for k, t in segs if k == "sampled"]
        # one model turn, a second only after a wrong answer (the env's stop condition, max_turns=2)
        right = [answer_of(s) == row["answer"] for s in said]
        assert len(said) == gen.infos[j]["num_turns"] == (1 if right[0] else 2)
        assert all(t == "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
                   for k, t in segs if k == "fed")
        assert batch.rewards[j] == (1.0 if right[-1] else 0.0)  # the rubric: last answer right
    assert metrics["env/turns_mean"] == pytest.approx(sum(x["num_turns"] for x in gen.infos) / 8)
    assert metrics["agent/requests"] == sum(x["num_turns"] for x in gen.infos)


def test_train_an_openai_sdk_agent_through_the_endpoint(tmp_path, captured):
    from nanogrpo.envs.program import agent
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.models.source import resolve_model_path
    from tests.adapter_fixtures import sdk_agent

    batch, gen, metrics = run(tmp_path, captured, {"rollout.max_new_tokens": 100}, ROWS, env=agent(sdk_agent))
    tok = load_tokenizer(resolve_model_path("embedded"))
    check_rows(batch, gen, tok)
    for j in range(8):
        row, segs = ROWS[j // 4], segments(tok, *row_of(batch, j)[1:3])
        said = [t.replace("<|im_end|>", "") for k, t in segs if k == "sampled"]
        assert len(said) == gen.infos[j]["num_turns"]
        assert batch.rewards[j] == (1.0 if answer_of(said[-1]) == row["answer"] else 0.0)
    assert metrics["agent/extra_sequences"] == 0 and metrics["agent/unauthorized_requests"] == 0


GAME_ROWS = [{"question": f"game {i}", "answer": "0", "id": f"g{i}", "seed": 11 + i} for i in range(2)]


def test_train_with_a_textarena_game(tmp_path, captured):
    ta = need("textarena")
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.models.source import resolve_model_path

    batch, gen, metrics = run(tmp_path, captured, {
        "env.source": "textarena:GuessTheNumber-v0", "env.max_turns": 3, "env.max_observation_tokens": 400,
        "data.max_prompt_tokens": 800, "rollout.max_new_tokens": 60}, GAME_ROWS)
    tok = load_tokenizer(resolve_model_path("embedded"))
    check_rows(batch, gen, tok)
    for j in range(8):
        prompt, comp, mask, _ = row_of(batch, j)
        assert "You are playing Guess The Number" in tok.decode(prompt)
        segs = segments(tok, comp, mask)
        raw = [t for k, t in segs if k == "sampled"]
        fed = [t for k, t in segs if k == "fed"]
        # a move cut by the token budget is not sent to the game
        moves = [t.replace("<|im_end|>", "") for t in raw if t.endswith("<|im_end|>")]
        # replay the moves on a fresh game of the same seed: the same messages, the same end
        game = ta.make(env_id="GuessTheNumber-v0")
        game.reset(num_players=1, seed=GAME_ROWS[j // 4]["seed"])
        base = game
        while hasattr(base, "env"):
            base = base.env
        base.state.get_current_player_observation()  # the prompt, already checked
        reward, done = 0.0, False
        for i, m in enumerate(moves):
            done, _ = game.step(m)
            if done:
                reward = float((game.close()[0] or {}).get(0, 0.0))
                break
            news = "\n".join(str(x).strip() for frm, x, _ in base.state.get_current_player_observation()
                             if frm != 0).strip()
            if i < len(fed):
                assert f"user\n{news}<|im_end|>" in fed[i]
        moves = raw
        assert len(moves) == gen.infos[j]["num_turns"] <= 3
        assert gen.finish_reasons[j] == ("done" if done else "max_turns" if len(moves) == 3 else "length")
        assert batch.rewards[j] == pytest.approx(reward)
    assert metrics["env/finish/done"] + metrics["env/finish/max_turns"] + metrics["env/finish/length"] == 8


def test_train_with_an_openenv_server(tmp_path, captured, openenv_server):  # noqa: F811
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.models.source import resolve_model_path

    batch, gen, metrics = run(tmp_path, captured, {
        "env.source": f"openenv:{openenv_server}", "env.max_turns": 3, "rollout.max_new_tokens": 40},
        GAME_ROWS)
    tok = load_tokenizer(resolve_model_path("embedded"))
    check_rows(batch, gen, tok)
    for j in range(8):
        prompt, comp, mask, _ = row_of(batch, j)
        tail = "user\nSay a number from 1 to 9.<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(prompt).endswith(tail)
        segs = segments(tok, comp, mask)
        raw = [t for k, t in segs if k == "sampled"]
        moves = [t.replace("<|im_end|>", "") for t in raw if t.endswith("<|im_end|>")]  # sent to the server
        secret = 5 + GAME_ROWS[j // 4]["seed"] % 3
        expected, hints = 0.0, []
        for m in moves:  # the counting game's rules (tests/adapter_fixtures.py), worked by hand
            nums = re.findall(r"\d+", m)
            n = int(nums[-1]) if nums else None
            if n == secret:
                expected += 1.0
                break
            expected -= 0.1
            hints.append("no number" if n is None else "higher" if n < secret else "lower")
        assert len(raw) == gen.infos[j]["num_turns"] <= 3
        assert [h for (k, t), h in zip([s for s in segs if s[0] == "fed"], hints)
                if f"user\n{h}<|im_end|>" not in t] == []
        assert batch.rewards[j] == pytest.approx(expected)


def test_train_on_the_extra_sequences_of_a_rewritten_history(tmp_path, captured):
    from nanogrpo.envs.program import agent
    from tests.adapter_fixtures import forgetful_agent

    batch, gen, metrics = run(tmp_path, captured, {"rollout.max_new_tokens": 40}, ROWS,
                              env=agent(forgetful_agent))
    assert batch.num_seqs == 16 and batch.group_size == 1  # each episode: its last sequence + the first
    assert metrics["agent/extra_sequences"] == 8 and metrics["agent/rewritten_episodes"] == 8
    for j in range(8):
        (first,) = gen.extra_sequences[j]
        prompt, comp, mask, _ = row_of(batch, 8 + j)
        assert prompt == first.prompt_ids and comp == first.completion_ids and all(mask)
        assert batch.group_ids[8 + j] == batch.group_ids[j] == j // 4
        assert batch.advantages[8 + j] == batch.advantages[j]  # the episode's advantage on both
        assert batch.rewards[8 + j] == batch.rewards[j] == 0.5
    assert metrics["loss"] == metrics["loss"]  # the update ran on them (finite)
