"""The mixture-of-experts demo (``nanogrpo train --config demo-moe``): its preset, its shipped weights (a
small Qwen3-MoE, the careless-solver warm start), a builder that gives the same weights every time, one
short step of the run with the engine's routes replayed (float32: the trainer's log-probs are the engine's,
no route flips), and, marked slow, ten steps that lift held-out accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanogrpo.cli import main
from nanogrpo.config import load_config
from nanogrpo.demos.arithmetic.task import make_split, solution
from nanogrpo.demos.moe import build as moe_build
from nanogrpo.models.load import load_model, load_tokenizer
from nanogrpo.models.source import resolve_model_path
from nanogrpo.moe import moe_spec
from nanogrpo.training.metrics import read_metrics

SHORT = ["train.steps=1", "rollout.prompts_per_step=4", "grpo.group_size=4", "rollout.max_new_tokens=40",
         "eval.n=8", "train.save_every=0", "model.cpu_linear=torch", "rewards.workers=0"]
MISMATCH = ("mismatch_abs", "mismatch_abs_max", "mismatch_kl", "mismatch_ratio_out", "router_disagreement",
            "routes_groups_dropped")


def test_the_preset_is_the_default_demo_on_a_mixture_of_experts_with_r3():
    cfg, dense = load_config(preset="demo-moe"), load_config(preset="demo")
    assert cfg.model.path == "embedded-moe"
    assert cfg.rollout.engine == "hf" and cfg.moe.routing_replay == "rollout"
    # the default demo's task, prompt, rewards and recipe: only model, engine, replay and steps differ
    assert cfg.data == dense.data and cfg.rewards == dense.rewards and cfg.grpo == dense.grpo
    assert cfg.rollout.model_copy(update={"engine": dense.rollout.engine}) == dense.rollout
    assert (cfg.train.lr, cfg.train.micro_batch_size) == (dense.train.lr, dense.train.micro_batch_size)


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_the_shipped_weights_are_the_builder_s_model():
    path = resolve_model_path("embedded-moe")
    model = load_model(path, torch.float32, torch.device("cpu"), cpu_linear="torch")
    spec = moe_spec(model)
    assert spec.describe() == "qwen3_moe: 4 MoE layers of 8 experts, top 2 (8 bytes of routes per token)"
    for k, v in moe_build.CONFIG.items():
        if k != "rope_theta":  # transformers 5 keeps it in rope_parameters
            assert getattr(model.config, k) == v, k
    saved = json.loads((Path(path) / "config.json").read_text())
    assert saved["output_router_logits"] is False  # the warm start's load-balancing loss is not trained on
    assert sum(p.numel() for p in model.parameters()) == 1_001_728
    # every expert of every layer takes a share of the demo's tokens (held-out problems and their worked
    # solutions): the warm start's router was trained to balance them, so routes differ token to token
    tok = load_tokenizer(path)
    rows = make_split("test", 32)
    counts = torch.zeros(len(spec.routers), 8)

    def count(i):
        def hook(module, args, out):  # out: (router logits, gate weights, expert ids)
            counts[i] += torch.bincount(out[2].flatten(), minlength=8)
        return hook

    hooks = [r.register_forward_hook(count(i)) for i, r in enumerate(spec.routers)]
    with torch.no_grad():
        for r in rows:
            text = (f"<|im_start|>user\n{r['question']}<|im_end|>\n<|im_start|>assistant\n"
                    f"{solution(r)}<|im_end|>")
            model(input_ids=torch.tensor([tok(text).input_ids]))
    for h in hooks:
        h.remove()
    share = counts / counts.sum(-1, keepdim=True)                            # (layers, experts)
    assert bool((share > 0.02).all()), share


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_the_builder_gives_the_same_weights_every_time(tmp_path):
    a = moe_build.build(tmp_path / "a", steps=2, batch_size=4, log_every=0)
    b = moe_build.build(tmp_path / "b", steps=2, batch_size=4, log_every=0)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text())["output_router_logits"] is False
    assert torch.get_num_threads() >= 1  # one_thread() gave the caller's threads back


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_one_step_of_the_demo_replays_the_engine_s_routes(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--config", "demo-moe", "--out", str(out), *SHORT]) == 0
    step = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("step") == 1 and "loss" in r)
    assert all(k in step for k in MISMATCH), sorted(step)
    # float32, one machine: the trainer's forward under the engine's routes gives the engine's log-probs
    assert step["mismatch_abs_max"] < 1e-4 and step["mismatch_ratio_out"] == 0.0
    assert step["router_disagreement"] == 0.0 and step["routes_groups_dropped"] == 0


@pytest.mark.slow
def test_ten_steps_of_the_demo_lift_held_out_accuracy(tmp_path):
    """The shipped preset cut to 10 steps and 100 held-out problems (the whole run, 60 steps: 18.5% -> 71.5%
    on 200, docs/figures.md; its step 10 trained at 69% sampled accuracy, from 32%)."""
    out = tmp_path / "run"
    assert main(["train", "--config", "demo-moe", "--out", str(out), "--steps", "10", "eval.every=10",
                 "eval.n=100", "train.save_every=0", "model.cpu_linear=torch", "rewards.workers=0"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    held = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert len(held) == 2 and held[1] >= held[0] + 0.15, held
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 10 and all(r["router_disagreement"] == 0.0 for r in steps)
    assert max(r["mismatch_abs_max"] for r in steps) < 1e-4
