"""The demo's reward model (``rm:embedded-rm``): a small classifier that learned the rule reward.

GRPO with only a learned reward needs a reward model that knows the task. This one is trained here,
offline, like the warm start (:mod:`nanogrpo.models.warmstart`):

1. the warm start answers ``PROMPTS`` training problems of the embedded task, ``SAMPLES`` times
   each, sampled at the temperatures in ``TEMPERATURES`` (its careful and careless habits both show);
2. each of those completions also gives one *variant* (:func:`variants`): its ``<think>`` equation
   and ``<answer>`` edited the way a policy drifts — a wrong result stated consistently in both,
   another operand, a right answer after a wrong equation. Without them the classifier learns the
   shortcut "the answer repeats the equation's result" (the warm start's own equations are nearly
   always right), and GRPO against it learns to write wrong equations with matching answers: the
   first version of this demo did exactly that (reward up, held-out accuracy 7% -> 20% -> 9%);
3. every completion is labelled by the rule reward: 1 when it is correct *and* well formatted
   (``correctness`` and ``format`` both positive), else 0;
4. a ``Qwen2ForSequenceClassification`` with the warm start's body and a new one-output head is
   fine-tuned on them (binary cross-entropy on its logit), reading each pair as the reward-model
   reward reads it (:class:`nanogrpo.rewards.rm.RewardModel`: the chat template over the question
   and the completion);
5. its accuracy as a classifier (logit > 0 vs. the label) is measured on completions of held-out
   problems (the test split, which shares no question with train), the warm start's own and their
   variants apart, and saved beside the weights in ``rm_card.json``.

Its score is the logit, so higher means "more likely correct" to the classifier; nothing in it reads
the rule at run time. Shipped in ``nanogrpo/models/embedded_rm/`` (~3 MB); rebuild with
``python -m nanogrpo.models.reward_model --out DIR`` (about ten minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import time
from importlib import resources
from pathlib import Path

import torch

SEED = 2468
PROMPTS, SAMPLES = 2400, 8
EVAL_PROMPTS, EVAL_SAMPLES = 400, 4
TEMPERATURES = (0.7, 1.0, 1.3)
MAX_NEW_TOKENS = 56
EPOCHS, BATCH_SIZE, LR = 2, 64, 1e-3


def packaged_path() -> Path:
    return Path(str(resources.files("nanogrpo") / "models" / "embedded_rm"))


def embedded_rm_path() -> Path:
    """Directory of the shipped demo reward model, building it into the cache once if it is missing."""
    p = packaged_path()
    if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
        return p
    root = Path(os.environ.get("NANOGRPO_CACHE", Path.home() / ".cache" / "nanogrpo"))
    key = f"{SEED}-{PROMPTS}-{SAMPLES}-{TEMPERATURES}-{EPOCHS}-{BATCH_SIZE}-{LR}-{torch.__version__}"
    out = root / f"embedded-rm-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (out / "model.safetensors").is_file():
        print(f"building the demo reward model into {out} (once; about ten minutes)")
        build(out)
    return out


def label(completion: str, row: dict) -> float:
    """The rule reward as a label: 1.0 when correct and well formatted, else 0.0."""
    from nanogrpo.rewards.builtin import correctness, format_reward

    return float(correctness(completion, row) > 0 and format_reward(completion, row) > 0)


_SOLUTION = re.compile(r"<think>(\d+)([-+*])(\d+)=(-?\d+)</think><answer>(-?\d+)</answer>")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def variants(completion: str, row: dict, rng: random.Random) -> list[str]:
    """Edits of a well-formed ``<think>a op b=z</think><answer>y</answer>`` completion (none for another
    shape): a wrong result in both places; a right answer after a wrong result; another second operand
    with its own result in both places; the fully right solution."""
    m = _SOLUTION.fullmatch(completion.strip())
    if not m:
        return []
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    right = int(row["answer"])
    wrong = right + rng.choice([-3, -2, -1, 1, 2, 3, 10, -10])
    b2 = max(0, b + rng.choice([-2, -1, 1, 2]))
    other = _OPS[op](a, b2)
    return [f"<think>{a}{op}{b}={wrong}</think><answer>{wrong}</answer>",
            f"<think>{a}{op}{b}={wrong}</think><answer>{right}</answer>",
            f"<think>{a}{op}{b2}={other}</think><answer>{other}</answer>",
            f"<think>{a}{op}{b}={right}</think><answer>{right}</answer>"]


def one_variant_each(pairs: list[tuple[dict, str]], seed: int) -> list[tuple[dict, str]]:
    """One variant (picked at random) of each completion that has any."""
    rng = random.Random(seed)
    out: list[tuple[dict, str]] = []
    for row, c in pairs:
        v = variants(c, row, rng)
        if v:
            out.append((row, rng.choice(v)))
    return out


def sample_completions(model, tok, rows: list[dict], n: int, seed: int) -> list[tuple[dict, str]]:
    """``n`` completions of each row by ``model`` (the demo's prompts), cycling through ``TEMPERATURES``."""
    from nanogrpo.config import load_config
    from nanogrpo.data import encode_prompts
    from nanogrpo.rollout.engine import SamplingParams
    from nanogrpo.rollout.factory import make_engine

    data_cfg = load_config(preset="demo").data
    engine = make_engine("fast", model, tok, max_len=data_cfg.max_prompt_tokens + MAX_NEW_TOKENS)
    out: list[tuple[dict, str]] = []
    chunk = 64
    for b, start in enumerate(range(0, len(rows), chunk)):
        part = rows[start:start + chunk]
        ids, skipped = encode_prompts(tok, part, data_cfg, "auto")
        kept = [r for i, r in enumerate(part) if i not in set(skipped)]
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, n=n, seed=seed * 1_000_003 + b,
                                temperature=TEMPERATURES[b % len(TEMPERATURES)])
        gen = engine.generate(ids, params)
        texts = [tok.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
        out += [(kept[i // n], t) for i, t in enumerate(texts)]
    return out


def encode_pair(tok, row: dict, completion: str) -> list[int]:
    """The ids the reward-model reward reads for (row, completion) (chat template, no added specials)."""
    from nanogrpo.rewards.rm import prompt_turns_of

    conv = [*prompt_turns_of(row), {"role": "assistant", "content": completion}]
    return tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]


def _batch(tok, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, :len(s)] = torch.tensor(s)
        mask[j, :len(s)] = 1
    return ids, mask


def logits_of(model, tok, seqs: list[list[int]], batch_size: int = 128) -> list[float]:
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(seqs), batch_size):
            ids, mask = _batch(tok, seqs[i:i + batch_size])
            out += model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
    return out


def accuracy(model, tok, pairs: list[tuple[dict, str]]) -> dict[str, float]:
    """Classifier accuracy (logit > 0 vs. the rule's label), overall and per class."""
    labels = [label(c, r) for r, c in pairs]
    preds = [x > 0 for x in logits_of(model, tok, [encode_pair(tok, r, c) for r, c in pairs])]
    pos = [p for p, y in zip(preds, labels) if y == 1.0]
    neg = [not p for p, y in zip(preds, labels) if y == 0.0]
    return {"accuracy": sum(p == (y == 1.0) for p, y in zip(preds, labels)) / len(labels),
            "accuracy_on_correct": sum(pos) / len(pos) if pos else math.nan,
            "accuracy_on_incorrect": sum(neg) / len(neg) if neg else math.nan,
            "positive_rate": sum(labels) / len(labels), "n": len(labels)}


def train(model, tok, pairs: list[tuple[dict, str]], epochs: int, batch_size: int, lr: float,
          log_every: int = 50) -> None:
    """Binary cross-entropy on the logit, AdamW with warmup and a cosine decay, shuffled each epoch."""
    seqs = [encode_pair(tok, r, c) for r, c in pairs]
    labels = [label(c, r) for r, c in pairs]
    steps = epochs * (len(seqs) // batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    rng = random.Random(SEED)
    order: list[int] = []
    model.train()
    t0 = time.time()
    for step in range(steps):
        if len(order) < batch_size:
            order = list(range(len(seqs)))
            rng.shuffle(order)
        idx, order = order[:batch_size], order[batch_size:]
        scale = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        ids, mask = _batch(tok, [seqs[i] for i in idx])
        logit = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        target = torch.tensor([labels[i] for i in idx])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"reward model step {step + 1}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    model.eval()


def build(out: Path, prompts: int = PROMPTS, epochs: int = EPOCHS) -> dict:
    """Sample, label, fine-tune, measure and save (HF format, atomically) to ``out``; returns the card."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the warm start: one thread, the same reduction order everywhere
    try:
        return _build(Path(out), prompts, epochs)
    finally:
        torch.set_num_threads(threads)


def _build(out: Path, prompts: int, epochs: int) -> dict:
    from transformers import Qwen2ForSequenceClassification

    from nanogrpo.config import ModelConfig
    from nanogrpo.data import make_split
    from nanogrpo.models.load import load_policy

    t0 = time.time()
    policy, tok, _ = load_policy(ModelConfig(path="embedded", device="cpu", cpu_linear="torch"))
    policy.eval()
    sampled = sample_completions(policy, tok, make_split("train", prompts, seed=SEED), SAMPLES, SEED)
    train_pairs = sampled + one_variant_each(sampled, SEED)
    random.Random(SEED).shuffle(train_pairs)
    eval_pairs = sample_completions(policy, tok, make_split("test", EVAL_PROMPTS, seed=SEED), EVAL_SAMPLES,
                                    SEED + 1)
    eval_variants = one_variant_each(eval_pairs, SEED + 1)
    print(f"sampled {len(sampled)} + {len(eval_pairs)} completions, {len(train_pairs) - len(sampled)} + "
          f"{len(eval_variants)} variants ({time.time() - t0:.0f}s)")
    torch.manual_seed(SEED)
    model = Qwen2ForSequenceClassification.from_pretrained(
        str(_policy_dir()), num_labels=1, pad_token_id=tok.pad_token_id, dtype=torch.float32)
    model.config.architectures = ["Qwen2ForSequenceClassification"]
    before = accuracy(model.eval(), tok, eval_pairs)
    train(model, tok, train_pairs, epochs, BATCH_SIZE, LR)
    card = {"held_out": accuracy(model, tok, eval_pairs),
            "held_out_variants": accuracy(model, tok, eval_variants), "held_out_before_training": before,
            "train_examples": len(train_pairs), "train_completions": len(sampled), "train_positive_rate":
                sum(label(c, r) for r, c in train_pairs) / len(train_pairs),
            "held_out_problems": EVAL_PROMPTS, "samples_per_problem": [SAMPLES, EVAL_SAMPLES],
            "temperatures": list(TEMPERATURES), "epochs": epochs, "batch_size": BATCH_SIZE, "lr": LR,
            "seed": SEED, "build_time_s": round(time.time() - t0, 1), "torch": torch.__version__}
    print(f"held-out classifier accuracy {card['held_out']['accuracy']:.3f} on the warm start's completions, "
          f"{card['held_out_variants']['accuracy']:.3f} on their variants (before fine-tuning "
          f"{before['accuracy']:.3f}); {card['build_time_s']:.0f}s")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "rm_card.json").write_text(json.dumps(card, indent=1) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return card


def _policy_dir() -> Path:
    from nanogrpo.models.warmstart import embedded_path

    return embedded_path()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the demo's reward model (rm:embedded-rm).")
    ap.add_argument("--out", type=Path, default=packaged_path())
    ap.add_argument("--prompts", type=int, default=PROMPTS)
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    a = ap.parse_args(argv)
    build(a.out, a.prompts, a.epochs)
    print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
