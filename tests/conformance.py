"""Model-family conformance: every configuration computed right by the engine ``auto`` picks,
and by the trainer's log-prob paths. Shared by ``tests/test_conformance.py`` and the README
table, which this module prints:

    python -m tests.conformance            # all checks incl. the 2-step trains (~1-2 min on 2 cores)
    python -m tests.conformance --no-train # the fast checks only

Each case is a random-init tiny model built offline from transformers' config classes
(float32, CPU, 2 layers, hidden 64, the char tokenizer's 103-token vocabulary). Checks:

- ``auto``: the engine ``make_engine("auto", ...)`` picks (and why);
- greedy: its greedy tokens equal ``model.generate``'s on left-padded prompts of different
  lengths;
- engine log-probs: its sampled tokens' log-probs vs one full forward per sequence (max |diff|);
- trainer log-probs: ``token_logprobs`` in train mode (as ``training/step.py`` runs it, dropout
  turned off the way ``load_model`` does), with and without prompt sharing, vs a full
  eval-mode forward (max |diff|), and whether the lean (fused head) path applies;
- train: ``nanogrpo train --model DIR`` for 2 steps (rollout.engine=auto, beta 0.04, loaded by
  ``load_model``): the KL logged at step 1, when policy and reference are the same model, is 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers as tf

from nanogrpo.algo.logprobs import lean_head, token_logprobs
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.factory import make_engine
from nanogrpo.models.load import disable_dropout
from nanogrpo.models.tiny import make_tokenizer
from nanogrpo.rollout.collect import pad_batch

TOK = make_tokenizer()
V, EOS, PAD = len(TOK), TOK.eos_token_id, TOK.pad_token_id
PROMPTS = [list(range(5, 17)), [20, 21, 22], list(range(30, 38)), [40, 41, 42, 43, 44, 45]]
"""Four prompts of 12, 3, 8 and 6 tokens: left padding of 0 to 9 tokens."""
N_NEW = 12
TOL = 1e-4
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=V, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
              tie_word_embeddings=False, initializer_range=0.1)
"""A wider init than HF's 0.02: less flat logits, so greedy decoding has no near-ties."""


@dataclass
class Case:
    name: str
    make_config: Callable[[], object]
    model_class: type
    engine: str
    """What ``auto`` must pick."""
    max_len: int | None = None
    """Passed to ``make_engine`` as the trainer does (prompt + new tokens), when it matters."""
    attn: str = "sdpa"


def _llama(**rope) -> tf.LlamaConfig:
    return tf.LlamaConfig(**COMMON, head_dim=16, max_position_embeddings=64, rope_scaling=rope or None)


CASES: list[Case] = [
    Case("Qwen2 (QKV bias)", lambda: tf.Qwen2Config(**COMMON), tf.Qwen2ForCausalLM, "fast"),
    Case("Qwen2, sliding window 6 on layer 2",
         lambda: tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1),
         tf.Qwen2ForCausalLM, "fast"),
    Case("Qwen3 (q/k norm)", lambda: tf.Qwen3Config(**COMMON, head_dim=16), tf.Qwen3ForCausalLM, "fast"),
    Case("Qwen3-MoE (4 experts, top 2)",
         lambda: tf.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32), tf.Qwen3MoeForCausalLM, "hf"),
    Case("Llama 3 (llama3 RoPE scaling)",
         lambda: _llama(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=32), tf.LlamaForCausalLM, "fast"),
    Case("Llama, linear RoPE scaling", lambda: _llama(rope_type="linear", factor=2.0), tf.LlamaForCausalLM,
         "fast"),
    Case("Llama, dynamic RoPE (max_position_embeddings 64)", lambda: _llama(rope_type="dynamic", factor=2.0),
         tf.LlamaForCausalLM, "fast", max_len=52),
    Case("Llama, dynamic RoPE, sequences past max_position_embeddings",
         lambda: _llama(rope_type="dynamic", factor=2.0), tf.LlamaForCausalLM, "hf", max_len=128),
    Case("Llama, yarn RoPE",
         lambda: _llama(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
         tf.LlamaForCausalLM, "fast"),
    Case("Mistral, window 6 (shorter than the sequences)",
         lambda: tf.MistralConfig(**COMMON, head_dim=16, sliding_window=6), tf.MistralForCausalLM, "fast"),
    Case("Mistral, window 4096 (longer)",
         lambda: tf.MistralConfig(**COMMON, head_dim=16, sliding_window=4096), tf.MistralForCausalLM, "fast"),
    Case("Ministral, window 6 on layer 1",
         lambda: tf.MinistralConfig(**COMMON, head_dim=16, sliding_window=6,
                                    layer_types=["sliding_attention", "full_attention"]),
         tf.MinistralForCausalLM, "fast"),
    Case("OLMo2 (flat q/k norm, post-norms)", lambda: tf.Olmo2Config(**COMMON), tf.Olmo2ForCausalLM, "fast"),
    Case("SmolLM3 (no RoPE on layer 2)", lambda: tf.SmolLM3Config(**COMMON, no_rope_layer_interval=2),
         tf.SmolLM3ForCausalLM, "fast"),
    Case("Phi3 (fused projections, partial rotary 0.5)",
         lambda: tf.Phi3Config(**COMMON, partial_rotary_factor=0.5), tf.Phi3ForCausalLM, "fast"),
    Case("Phi3, longrope (original 64 positions)",
         lambda: tf.Phi3Config(**COMMON, max_position_embeddings=256, original_max_position_embeddings=64,
                               rope_scaling={"rope_type": "longrope", "long_factor": [2.0] * 8,
                                             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0]}),
         tf.Phi3ForCausalLM, "fast", max_len=52),
    Case("Gemma2 (soft-capping; no sdpa: loads with eager)", lambda: tf.Gemma2Config(**COMMON, head_dim=16),
         tf.Gemma2ForCausalLM, "hf", attn="eager"),
    Case("Gemma3", lambda: tf.Gemma3TextConfig(**COMMON, head_dim=16), tf.Gemma3ForCausalLM, "hf"),
    Case("GPT-2 (dropout 0.1)",
         lambda: tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=V,
                               eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
                               tie_word_embeddings=False, initializer_range=0.1,
                               resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
         tf.GPT2LMHeadModel, "hf"),
]


def build(case: Case, seed: int = 0):
    """The case's random-init model, float32, eval mode, attention as the case says."""
    cfg = case.make_config()
    cfg._attn_implementation = case.attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = case.model_class(cfg)
    return model.eval()


def hf_greedy(model, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """``model.generate`` greedy on left-padded prompts, each cut after its first EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                             eos_token_id=EOS, pad_token_id=PAD)[:, width:].tolist()
    return [r[:r.index(EOS) + 1] if EOS in r else r for r in out]


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax of one eval-mode forward over prompt + completion (no padding), at the completion."""
    was = model.training
    model.eval()
    try:
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    finally:
        model.train(was)
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def fast_checks(case: Case) -> dict:
    """Everything but the training run; one dict of results (see the module docstring)."""
    model = build(case)
    engine = make_engine("auto", model, TOK, max_len=case.max_len)
    from nanogrpo.engines.factory import choose_engine

    _, why = choose_engine(model, case.max_len)
    want = hf_greedy(model, PROMPTS, N_NEW)
    got = engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, temperature=0.0)).completion_ids
    gen = engine.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, temperature=1.0, n=2, seed=0))
    prompts = [p for p in PROMPTS for _ in range(2)]
    full = [forward_logprobs(model, p, c) for p, c in zip(prompts, gen.completion_ids, strict=True)]
    engine_diff = max((f - torch.tensor(lp)).abs().max().item()
                      for f, lp in zip(full, gen.logprobs, strict=True))
    # the trainer's log-probs: a RolloutBatch's layout (left-padded prompts, right-padded completions),
    # the model in train mode with its dropout off, as load_model and training/step.py have it
    disable_dropout(model)
    model.train()
    ids, am, cm, _, p = pad_batch(prompts, gen.completion_ids, gen.logprobs, PAD)
    ref = torch.zeros(cm.shape)
    for i, f in enumerate(full):
        ref[i, :len(f)] = f
    trainer = {}
    with torch.no_grad():
        for share in (False, True):
            lp = token_logprobs(model, ids, am.long(), p, cm, chunk=7, share_prefix=share)
            trainer[share] = (lp - ref)[cm].abs().max().item()
    return {"case": case.name, "engine": engine.name, "expected_engine": case.engine, "why": why,
            "greedy_equal": got == want, "distinct_greedy": len({tuple(c) for c in want}),
            "engine_logprob_diff": engine_diff, "lean": lean_head(model) is not None,
            "trainer_logprob_diff": trainer[False], "trainer_shared_logprob_diff": trainer[True],
            "sampled_tokens": sum(len(c) for c in gen.completion_ids)}


TRAIN_NEW = 12


def train_check(case: Case, tmp: Path) -> dict:
    """``nanogrpo train --model DIR`` for 2 steps; the metrics of step 1 and the saved config.
    Prompts + completions reach ``case.max_len`` (52 if unset), so ``auto`` picks as in the row."""
    from nanogrpo.cli import main as cli
    from nanogrpo.training.metrics import read_metrics

    model = build(case)
    model.config._attn_implementation = "sdpa"  # saved as users have it: load_model handles the rest
    model.save_pretrained(tmp / "model")
    TOK.save_pretrained(tmp / "model")
    with open(tmp / "data.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"{i}+{i}?", "answer": f"#### {2 * i}"}) + "\n")
    with contextlib.redirect_stdout(sys.stderr):  # the CLI's progress lines: not the table's stdout
            code = cli(["train", "--model", str(tmp / "model"), "--data", str(tmp / "data.jsonl"), "--out",
                    str(tmp / "run"), "--steps", "2", "rollout.prompts_per_step=2", "grpo.group_size=4",
                    f"rollout.max_new_tokens={TRAIN_NEW}",
                    f"data.max_prompt_tokens={(case.max_len or 52) - TRAIN_NEW}",
                    "grpo.beta=0.04", 'rewards.functions=["tests.reward_fixtures:length","format"]',
                    "rewards.workers=0", "train.save_every=0", "eval.every=0"])
    rows = read_metrics(tmp / "run" / "metrics.jsonl") if code == 0 else []
    last = tmp / "run" / "checkpoints" / "step_2" / "config.json"
    saved = json.loads(last.read_text()) if last.is_file() else {}
    return {"exit_code": code, "kl_step1": rows[0]["kl"] if rows else None, "steps": len(rows),
            "saved_config": saved}


def table(rows: list[dict]) -> str:
    """The README's conformance table."""
    def diff(x):
        return f"{x:.1e}" if x is not None else "–"
    out = ["| configuration | `auto` picks | greedy = `generate` | engine log-probs | "
           "trainer log-probs (path) | shared prompts | 2-step train: KL at step 1 |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["greedy_equal"] and r["engine_logprob_diff"] <= TOL and r["trainer_logprob_diff"] <= TOL
        kl = r.get("kl_step1")
        out.append(f"| {r['case']} | **{r['engine']}** | {'yes' if r['greedy_equal'] else 'NO'} | "
                   f"{diff(r['engine_logprob_diff'])} | {diff(r['trainer_logprob_diff'])} "
                   f"({'lean' if r['lean'] else 'full'}) | {diff(r['trainer_shared_logprob_diff'])} | "
                   f"{'–' if 'kl_step1' not in r else kl}{'' if ok else ' **FAIL**'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="model-family conformance table (markdown)")
    ap.add_argument("--no-train", action="store_true", help="skip the 2-step training runs")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per case")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for case in CASES:
        row = fast_checks(case)
        if not a.no_train:
            with tempfile.TemporaryDirectory(prefix="nanogrpo_conf_") as tmp:
                tr = train_check(case, Path(tmp))
            row["kl_step1"] = tr["kl_step1"]
        rows.append(row)
        if a.json:
            print(json.dumps(row), file=sys.stderr)
    print(table(rows))
    print("\nWhy `auto` picked what it did:\n")
    for r in rows:
        print(f"- {r['case']}: {r['why']}")
    print(f"\n({datetime.date.today().isoformat()}, {platform.machine()} CPU, torch {torch.__version__}, "
          f"transformers {tf.__version__}, float32; `python -m tests.conformance"
          f"{' --no-train' if a.no_train else ''}`; "
          f"engine log-probs: max |diff| to a full forward over {N_NEW} sampled tokens x 8 sequences; "
          f"trainer: train mode, vs a full eval-mode forward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
