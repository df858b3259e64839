"""``rm:`` reward models: a tiny random-init sequence-classification model built offline scores every
row as a forward of that row alone does, in any batch composition; the plain (text-pair) format for a
tokenizer without a chat template; refusals of models that are not one-output classifiers."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

from nanogrpo.config import Config, RewardsConfig
from nanogrpo.errors import RewardError
from nanogrpo.models.tiny import make_tokenizer, model_config
from nanogrpo.rewards import RewardRunner, reward_runner
from nanogrpo.rewards.reward_model import RewardModel, model_rewards

QUESTIONS = ["Tom has 3 apples and buys 4 more. How many apples does Tom have?", "2+2?", "What is 6*7?"]
COMPLETIONS = ["<think>3+4=7</think><answer>7</answer>", "<answer>5</answer>", "", "x" * 90,
               "<think>6*7=42</think><answer>42</answer>", "no idea", "4", "<think>long " * 8 + "</think>"]


def _rows(n: int = 24, seed: int = 0) -> tuple[list[str], list[dict]]:
    rng = random.Random(seed)
    comps = [rng.choice(COMPLETIONS) + str(rng.randint(0, 99)) * rng.randint(0, 3) for _ in range(n)]
    samples = [{"question": rng.choice(QUESTIONS), "answer": "7"} for _ in range(n)]
    return comps, samples


def _qwen_rm(tmp_path, pad: bool = True, max_positions: int | None = None):
    tok = make_tokenizer()
    cfg = model_config("tiny", tok)
    cfg.num_labels = 1
    cfg.pad_token_id = tok.pad_token_id if pad else None
    cfg.architectures = ["Qwen2ForSequenceClassification"]
    if max_positions:
        cfg.max_position_embeddings = max_positions
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(cfg).eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # distinct scores per row
    path = tmp_path / ("rm" if pad else "rm-nopad")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


def _direct(model, tok, completion: str, sample: dict, max_positions: int | None = None) -> float:
    """A forward of the row alone over the text the chat template renders."""
    text = tok.apply_chat_template([{"role": "user", "content": sample["question"]},
                                    {"role": "assistant", "content": completion}], tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if max_positions:
        ids = ids[:, -max_positions:]
    own = model.config.pad_token_id
    model.config.pad_token_id = None  # a single row: the head reads its last token
    try:
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, 0])
    finally:
        model.config.pad_token_id = own


@pytest.mark.parametrize("pad", [True, False])
def test_scores_equal_a_forward_of_each_row_alone_in_any_batch(tmp_path, pad) -> None:
    path, model, tok = _qwen_rm(tmp_path, pad=pad)
    comps, samples = _rows(16)
    expected = [_direct(model, tok, c, s) for c, s in zip(comps, samples)]
    assert len({round(x, 4) for x in expected}) > 8  # the rows really score differently
    rm = RewardModel(str(path), device="cpu")
    for budget in (1, 400, 10**6):  # one row per forward ... everything in one forward
        rm.batch_tokens = budget
        for order in (list(range(len(comps))), [13, 3, 15, 4, 0, 9]):
            got = rm.score([comps[i] for i in order], [samples[i] for i in order])
            assert all(kind == "ok" for kind, _ in got)
            assert [v for _, v in got] == pytest.approx([expected[i] for i in order], abs=2e-5)
        stats = rm.metrics()
        assert stats["rm/rows_per_s"] > 0 and stats["rm/truncated"] == 0
        assert rm.metrics() == {}  # reset once read


def test_batches_keep_to_the_token_budget(tmp_path) -> None:
    path, _, _ = _qwen_rm(tmp_path)
    rm = RewardModel(str(path), device="cpu", batch_tokens=100)
    lengths = {0: 10, 1: 60, 2: 30, 3: 30, 4: 5, 5: 120}
    groups = rm.batches(lengths)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 100 for g in groups)
    assert groups[0] == [5]  # longer than the budget: alone


def test_chat_rows_are_scored_as_their_conversation(tmp_path) -> None:
    path, model, tok = _qwen_rm(tmp_path)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rm = RewardModel(str(path), device="cpu")
    enc, cut = rm.encode("<answer>4</answer>", {"question": "2+2?", "messages": turns})
    text = tok.apply_chat_template([*turns, {"role": "assistant", "content": "<answer>4</answer>"}],
                                   tokenize=False)
    assert enc == {"input_ids": tok(text, add_special_tokens=False)["input_ids"]} and not cut


def test_long_rows_keep_their_last_tokens_and_are_counted(tmp_path) -> None:
    path, model, tok = _qwen_rm(tmp_path, max_positions=48)
    comps, samples = _rows(8)
    rm = RewardModel(str(path), device="cpu", batch_tokens=200)
    got = [v for _, v in rm.score(comps, samples)]
    assert got == pytest.approx([_direct(model, tok, c, s, 48) for c, s in zip(comps, samples)], abs=2e-5)
    longer = sum(rm.encode(c, s)[1] for c, s in zip(comps, samples))
    assert 0 < longer < 8 and rm.metrics()["rm/truncated"] == longer


def _bert_rm(tmp_path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789+?<>/=*"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"), do_lower_case=True)
    cfg = BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, num_labels=1,
                     architectures=["BertForSequenceClassification"])
    torch.manual_seed(1)
    model = BertForSequenceClassification(cfg).eval()
    path = tmp_path / "bert-rm"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


def test_a_tokenizer_without_chat_template_reads_the_text_pair(tmp_path) -> None:
    path, model, tok = _bert_rm(tmp_path)
    assert not getattr(tok, "chat_template", None)
    comps, samples = _rows(12, seed=3)
    with torch.no_grad():
        expected = [float(model(**tok(s["question"], c, return_tensors="pt")).logits[0, 0])
                    for c, s in zip(comps, samples)]
    rm = RewardModel(str(path), device="cpu", batch_tokens=150)
    assert [v for _, v in rm.score(comps, samples)] == pytest.approx(expected, abs=2e-5)


def test_models_that_are_not_one_output_classifiers_are_refused_at_start(tmp_path) -> None:
    tok = make_tokenizer()
    Qwen2ForCausalLM(model_config("tiny", tok)).save_pretrained(tmp_path / "lm")
    with pytest.raises(RewardError, match="is a Qwen2ForCausalLM, not a sequence-classification model"):
        RewardModel(str(tmp_path / "lm"))
    cfg = model_config("tiny", tok)
    cfg.num_labels = 2
    Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "two")
    with pytest.raises(RewardError, match="has 2 outputs; a reward model has one"):
        RewardModel(str(tmp_path / "two"))
    with pytest.raises(RewardError, match="rm:./no/such/dir.*not found"):
        reward_runner(Config(rewards=RewardsConfig(functions=["rm:./no/such/dir"], workers=0)))
    with pytest.raises(RewardError, match="name the model after 'rm:'"):
        reward_runner(Config(rewards=RewardsConfig(functions=["rm:"], workers=0)))
    with pytest.raises(RewardError, match="reward models load through nanogrpo.models"):
        RewardRunner([f"rm:{tmp_path / 'two'}"], workers=0)  # without reward_runner's maker it loads none


def test_the_runner_scales_a_reward_model_and_reports_its_throughput(tmp_path) -> None:
    path, model, tok = _qwen_rm(tmp_path)
    comps, samples = _rows(16)
    spec = f"rm:{path}"
    raw = [_direct(model, tok, c, s) for c, s in zip(comps, samples)]
    for scale in ("none", "zscore"):
        cfg = RewardsConfig(functions=[spec, "format"], weights=[2.0, 1.0], rm_scale=scale, workers=0)
        with RewardRunner.from_config(cfg, make_rm=model_rewards(cfg, device="cpu")) as runner:
            res = runner.score(comps, samples)
        got = res.per_function[spec]
        if scale == "none":
            assert got == pytest.approx(raw, abs=2e-5)
        else:
            mean = sum(raw) / len(raw)
            std = (sum((x - mean) ** 2 for x in raw) / len(raw)) ** 0.5
            assert got == pytest.approx([(x - mean) / std for x in raw], abs=1e-4)
        assert res.total == pytest.approx([2 * a + b for a, b in zip(got, res.per_function["format"])])
        assert res.metrics["rm/rows_per_s"] > 0 and "rm/tokens_per_s" in res.metrics


def test_the_rm_demo_config_is_its_preset() -> None:
    from pathlib import Path

    from nanogrpo.config import load_config, preset_path

    cfg = load_config(Path(__file__).parents[1] / "configs" / "demo-rm.toml")
    assert cfg == load_config(preset_path("demo-rm"))
    assert cfg.rewards.functions == ["rm:embedded-rm"]
    # the rule-reward demo but for the reward, the KL weight, the run's length and the run directory
    demo = load_config(preset_path("demo"))
    same = {"rewards": demo.rewards, "train": demo.train, "grpo": demo.grpo, "eval": demo.eval}
    assert cfg.model_copy(update=same) == demo
    assert cfg.grpo.model_copy(update={"beta": demo.grpo.beta}) == demo.grpo
    assert cfg.eval.model_copy(update={"every": demo.eval.every}) == demo.eval
    assert cfg.train.model_copy(update={"out": demo.train.out, "steps": demo.train.steps}) == demo.train


def test_the_shipped_demo_reward_model_loads_and_knows_the_task() -> None:
    """rm:embedded-rm: the shipped classifier scores a right answer above the careless habit's answer,
    as its card says it does on held-out problems."""
    import json

    from nanogrpo.demos.rm.build import packaged_path

    card = json.loads((packaged_path() / "rm_card.json").read_text())
    assert card["held_out_ranking"]["right_above_careless"] > 0.9
    rm = RewardModel("embedded-rm", device="cpu")
    sample = {"question": "Tom has 13 apples and buys 4 more. How many apples does Tom have?", "answer": "17"}
    good, careless = "<think>13+4=17</think><answer>17</answer>", "<think>13+4=17</think><answer>13</answer>"
    (k1, s_good), (k2, s_bad) = rm.score([good, careless], [sample, sample])
    assert k1 == k2 == "ok" and s_good > s_bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_reward_model_runs_in_bf16_close_to_float32(tmp_path) -> None:
    path, model, tok = _qwen_rm(tmp_path)
    comps, samples = _rows()
    rm = RewardModel(str(path), device="cuda")
    got = [v for _, v in rm.score(comps, samples)]
    assert rm.model.dtype == torch.bfloat16 and rm.device.type == "cuda"
    expected = [_direct(model, tok, c, s) for c, s in zip(comps, samples)]
    spread = max(expected) - min(expected)
    assert max(abs(a - b) for a, b in zip(got, expected)) < 0.05 * spread + 0.02


def test_the_demo_reward_models_contrasts_carry_the_rules_labels() -> None:
    from nanogrpo.demos.arithmetic.task import make_split
    from nanogrpo.demos.rm.build import NEGATIVE_KINDS, POSITIVE_KINDS, contrasts, label, training_pairs

    rng = random.Random(0)
    rows = make_split("train", 200, seed=1)
    for row in rows:
        alt = contrasts(row, rng)
        assert all(label(alt[k], row) == 1.0 for k in POSITIVE_KINDS), alt
        assert all(label(alt[k], row) == 0.0 for k in NEGATIVE_KINDS), alt
    sampled = [(rows[0], contrasts(rows[0], rng)["careless"]), (rows[1], contrasts(rows[1], rng)["right"])]
    for row, pos, neg in training_pairs(sampled, seed=3):
        assert label(pos, row) == 1.0 and label(neg, row) == 0.0
