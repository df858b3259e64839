"""Every shipped config in configs/ loads and validates, and the GSM8K ones train end to end on CPU with
a random-init tiny Qwen2 in place of Qwen2.5 and a 20-row GSM8K-format fixture (no download, no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanogrpo.cli import main
from nanogrpo.config import SEED_SYSTEM_PROMPT, load_config, preset_path
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.training.metrics import read_metrics
from tests.run_fixtures import evaluated_on

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALL = sorted(CONFIGS.glob("*.toml"))
GSM8K = [p for p in ALL if p.name.startswith("gsm8k-")]
SINGLE = [p for p in GSM8K if not p.stem.endswith(("-split", "-servers"))]  # one process, no servers


def test_the_expected_configs_ship():
    names = {p.name for p in ALL}
    for size in ("0.5b", "1.5b", "3b", "7b"):
        assert f"gsm8k-qwen2.5-{size}.toml" in names
    assert "demo.toml" in names and "gsm8k-qwen2.5-7b-split.toml" in names


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_config_validates(path):
    cfg = load_config(path)
    assert cfg.train.steps > 0


def test_demo_config_is_the_preset():
    assert load_config(CONFIGS / "demo.toml") == load_config(preset_path("demo"))


def test_every_demo_ships_its_preset_as_a_config_copy():
    from nanogrpo import entry_points

    for preset in entry_points.preset_names():
        assert load_config(CONFIGS / f"{preset}.toml") == load_config(preset_path(preset)), preset


@pytest.mark.parametrize("path", GSM8K, ids=lambda p: p.name)
def test_gsm8k_configs_carry_the_seed_recipe(path):
    cfg = load_config(path)
    size = path.stem.split("qwen2.5-")[1].removesuffix("-split").removesuffix("-servers")
    assert cfg.model.path == f"Qwen/Qwen2.5-{size.upper()}"
    assert cfg.data.source == "gsm8k" and cfg.data.answer_delimiter == "####"
    assert cfg.data.system_prompt == SEED_SYSTEM_PROMPT and cfg.data.max_prompt_tokens == 400
    assert cfg.grpo.group_size == 8 and 0.03 <= cfg.grpo.beta <= 0.04
    assert cfg.train.lr == 1e-6 and cfg.train.save_every == 200
    assert cfg.rollout.temperature == 0.9 and cfg.rollout.max_new_tokens == 512
    assert cfg.eval.every > 0 and cfg.log.tensorboard


@pytest.mark.parametrize("path", [p for p in GSM8K if p.stem.endswith("-split")], ids=lambda p: p.name)
def test_split_configs_document_their_commands(path):
    header = path.read_text().split("[model]")[0]
    for cmd in ("nanogrpo serve", "nanogrpo rollout", "nanogrpo train", "--server"):
        assert cmd in header, f"{path.name}: header lacks {cmd!r}"
    assert "[server]" in path.read_text()  # split settings are real, validated keys


@pytest.mark.parametrize("path", [p for p in GSM8K if p.stem.endswith("-servers")], ids=lambda p: p.name)
def test_server_tier_configs_document_their_commands(path):
    header = path.read_text().split("[model]")[0]
    for cmd in ("nanogrpo vllm-serve", "torchrun", "Not run"):
        assert cmd in header, f"{path.name}: header lacks {cmd!r}"
    cfg = load_config(path)
    assert cfg.rollout.engine == "vllm_server" and cfg.rollout.servers and cfg.vllm_server.transfer == "nccl"


@pytest.fixture(scope="module")
def tiny_gsm8k(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gsm8k")
    tok = make_tokenizer()
    make_model("tiny", tok, seed=1).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    with open(d / "gsm8k.jsonl", "w") as f:
        for i in range(20):
            a, b = 3 + i, 2 * i + 1
            answer = f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"
            f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many apples now?",
                                "answer": answer}) + "\n")
    return d


# one config end to end in the fast suite; the others (same code path, other values) are slow
@pytest.mark.parametrize("path", [pytest.param(p, marks=() if i == 0 else pytest.mark.slow)
                                  for i, p in enumerate(SINGLE)], ids=lambda p: p.name)
@pytest.mark.slow
def test_gsm8k_config_trains_end_to_end(path, tiny_gsm8k, tmp_path):
    out = tmp_path / "run"
    rc = main(["train", "--config", str(path), "--model", str(tiny_gsm8k / "model"),
               "--data", str(tiny_gsm8k / "gsm8k.jsonl"), "--out", str(out), "--steps", "2",
               "rollout.max_new_tokens=8", "rollout.prompts_per_step=2", "data.max_prompt_tokens=2000",
               "eval.every=2", "eval.n=3", "rewards.workers=0", evaluated_on(tiny_gsm8k / "gsm8k.jsonl")])
    assert rc == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the held-out baseline
    assert rows[0]["eval/n"] == 3
    assert rows[1]["num_completions"] == 2 * 8 and rows[1]["prompts_skipped"] == 0
    assert rows[-1]["eval/n"] == 3
    assert (out / "checkpoints" / "step_2" / "model.safetensors").is_file()
    assert list((out / "tb").glob("events.out.tfevents.*"))
