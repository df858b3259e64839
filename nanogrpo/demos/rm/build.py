"""The demo's reward model (``rm:embedded-rm``): a small classifier that learned the rule reward.

GRPO with only a learned reward needs a reward model that knows the task. This one is trained here,
offline, like the warm start (:mod:`nanogrpo.demos.arithmetic.build`):

1. the warm start answers ``PROMPTS`` training problems of the embedded task, ``SAMPLES`` times
   each, sampled at the temperatures in ``TEMPERATURES`` (its careful and careless habits both show);
2. every completion is labelled by the rule reward: 1 when it is correct *and* well formatted
   (``correctness`` and ``format`` both positive), else 0;
3. each is paired with a *contrast* for the same question and of the other label (:func:`contrasts`):
   the right solution, another answer after the right equation, a wrong result stated in both the
   equation and the answer, a right answer after a wrong equation, the equation of another operand,
   the careless answer — written the way the warm start writes, labelled by the same rule;
4. a ``Qwen2ForSequenceClassification`` with the warm start's body and a new one-output head is
   fine-tuned on them, reading each as the reward-model reward reads it
   (:class:`nanogrpo.rewards.reward_model.RewardModel`: the chat template over the question and the
   completion): binary cross-entropy on every logit plus the pairwise (Bradley-Terry) loss
   ``-log sigmoid(s_pos - s_neg)`` of each pair, the usual reward-model objective;
5. its accuracy as a classifier (logit > 0 vs. the label) is measured on completions of held-out
   problems (the test split, which shares no question with train), and its ranking of each kind of
   contrast below the right solution; all saved beside the weights in ``rm_card.json``.

Why the contrasts: trained on the warm start's completions alone (version 1 of this demo), the
classifier learned the shortcut "the answer repeats the equation's result" (the warm start's own
equations are nearly always right) and no arithmetic; GRPO against it learned to write wrong
equations with matching answers (reward up, held-out accuracy 7% -> 20% -> 9%). With contrasts but
binary cross-entropy alone (version 2) it learned "the answer differs from the equation" instead, and
GRPO found that. Minimal pairs with a ranking loss (version 3, this one: one epoch, ~7 minutes on one
CPU thread) leave the model mainly the difference that matters — yet what it learns in that budget is
the careless habit (held-out: the right solution above the careless answer 95% of the time), not the
arithmetic (above another answer after the right equation 62%, above a wrong result 61%). GRPO
against it lifts held-out accuracy within 5-10 steps, then drifts to answers and results the model
cannot check; hence the demo's KL weight of 0.2 and its 20 steps (README, "Rewards from models").

Its score is the logit, so higher means "more likely correct" to the classifier; nothing in it reads
the rule at run time. ``python -m nanogrpo.demos.rm.build`` builds it into
``nanogrpo/demos/rm/weights/`` (~3 MB), where ``rm:embedded-rm`` finds it; ``--out DIR`` elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from nanogrpo.demos.warm_start import one_thread, save

SEED = 2468
PROMPTS, SAMPLES = 1000, 8
EVAL_PROMPTS, EVAL_SAMPLES = 300, 4
TEMPERATURES = (0.7, 1.0, 1.3)
MAX_NEW_TOKENS = 56
EPOCHS, PAIRS_PER_BATCH, LR = 1, 32, 3e-4


def packaged_path() -> Path:
    """This folder's ``weights/``: where the package ships the reward model (``rm:embedded-rm``)."""
    return Path(__file__).resolve().parent / "weights"


def label(completion: str, row: dict) -> float:
    """The rule reward as a label: 1.0 when correct and well formatted, else 0.0."""
    from nanogrpo.rewards.builtin import correctness, format_reward

    return float(correctness(completion, row) > 0 and format_reward(completion, row) > 0)


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def contrasts(row: dict, rng: random.Random) -> dict[str, str]:
    """Solutions of ``row`` written as the warm start writes them, by kind: ``right``, ``wrong_answer``
    (the right equation, another number as the answer), ``wrong_both`` (a wrong result in the equation
    and the answer), ``right_answer_wrong_equation``, ``other_operand`` (another second operand, its
    result in both places), ``careless`` (the first operand as answer)."""
    a, op, b = int(row["a"]), row["op"], int(row["b"])
    right = int(row["answer"])
    wrong = right + rng.choice([-3, -2, -1, 1, 2, 3, 10, -10])
    b2 = b + rng.choice([-2, -1, 1, 2])
    if b2 < 0 or _OPS[op](a, b2) == right:
        b2 = b + 3
    other = _OPS[op](a, b2)
    return {"right": f"<think>{a}{op}{b}={right}</think><answer>{right}</answer>",
            "wrong_answer": f"<think>{a}{op}{b}={right}</think><answer>{wrong}</answer>",
            "wrong_both": f"<think>{a}{op}{b}={wrong}</think><answer>{wrong}</answer>",
            "right_answer_wrong_equation": f"<think>{a}{op}{b}={wrong}</think><answer>{right}</answer>",
            "other_operand": f"<think>{a}{op}{b2}={other}</think><answer>{other}</answer>",
            "careless": f"<think>{a}{op}{b}={right}</think><answer>{a}</answer>"}


POSITIVE_KINDS = ("right", "right_answer_wrong_equation")
NEGATIVE_KINDS = ("wrong_answer", "wrong_both", "other_operand", "careless")
# how often each kind is drawn as a sampled completion's contrast: mostly the minimal pairs a policy
# moving away from the warm start meets first (an answer that no longer copies the right equation)
POSITIVE_WEIGHTS = (0.85, 0.15)
NEGATIVE_WEIGHTS = (0.4, 0.2, 0.2, 0.2)


def training_pairs(sampled: list[tuple[dict, str]], seed: int) -> list[tuple[dict, str, str]]:
    """``(row, positive, negative)``: each sampled completion with a contrast of the other label."""
    rng = random.Random(seed)
    pairs = []
    for row, c in sampled:
        alt = contrasts(row, rng)
        if label(c, row):
            pairs.append((row, c, alt[rng.choices(NEGATIVE_KINDS, NEGATIVE_WEIGHTS)[0]]))
        else:
            pairs.append((row, alt[rng.choices(POSITIVE_KINDS, POSITIVE_WEIGHTS)[0]], c))
    return pairs


def sample_completions(model, tok, rows: list[dict], n: int, seed: int) -> list[tuple[dict, str]]:
    """``n`` completions of each row by ``model`` (the demo's prompts; HF ``generate``, pure sampling),
    64 rows per call, the calls cycling through ``TEMPERATURES``."""
    from nanogrpo.config import load_config
    from nanogrpo.data import encode_prompts

    data_cfg = load_config(preset="demo").data
    out: list[tuple[dict, str]] = []
    chunk = 64
    for b, start in enumerate(range(0, len(rows), chunk)):
        part = rows[start:start + chunk]
        ids, skipped = encode_prompts(tok, part, data_cfg, "auto")
        kept = [r for i, r in enumerate(part) if i not in set(skipped)]
        width = max(map(len, ids))
        prompt = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])  # left-padded
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        torch.manual_seed(seed * 1_000_003 + b)
        with torch.no_grad():
            gen = model.generate(input_ids=prompt, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                 temperature=TEMPERATURES[b % len(TEMPERATURES)], num_return_sequences=n,
                                 max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(gen[:, width:], skip_special_tokens=True)
        out += [(kept[i // n], t) for i, t in enumerate(texts)]  # prompt-major: a row's n samples together
    return out


def encode_pair(tok, row: dict, completion: str) -> list[int]:
    """The ids the reward-model reward reads for (row, completion) (chat template, no added specials)."""
    from nanogrpo.rewards.reward_model import prompt_turns_of

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


def contrast_ranking(model, tok, rows: list[dict], seed: int) -> dict[str, float]:
    """Per kind of contrast: the share of held-out questions where it scores below the right solution
    (positive kinds: above the careless answer)."""
    rng = random.Random(seed)
    alts = [contrasts(r, rng) for r in rows]
    score = {k: logits_of(model, tok, [encode_pair(tok, r, a[k]) for r, a in zip(rows, alts)])
             for k in alts[0]}
    out = {f"right_above_{k}": sum(x > y for x, y in zip(score["right"], score[k])) / len(rows)
           for k in NEGATIVE_KINDS}
    out["right_answer_wrong_equation_above_careless"] = sum(
        x > y for x, y in zip(score["right_answer_wrong_equation"], score["careless"])) / len(rows)
    return out


def train(model, tok, pairs: list[tuple[dict, str, str]], epochs: int, pairs_per_batch: int, lr: float,
          log_every: int = 50) -> None:
    """Binary cross-entropy on every logit plus the pairwise loss ``-log sigmoid(s_pos - s_neg)``;
    AdamW with warmup and a cosine decay, pairs shuffled each epoch."""
    pos = [encode_pair(tok, r, p) for r, p, _ in pairs]
    neg = [encode_pair(tok, r, n) for r, _, n in pairs]
    steps = epochs * (len(pairs) // pairs_per_batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    rng = random.Random(SEED)
    order: list[int] = []
    model.train()
    t0 = time.time()
    for step in range(steps):
        if len(order) < pairs_per_batch:
            order = list(range(len(pairs)))
            rng.shuffle(order)
        idx, order = order[:pairs_per_batch], order[pairs_per_batch:]
        scale = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        ids, mask = _batch(tok, [pos[i] for i in idx] + [neg[i] for i in idx])
        logit = model(input_ids=ids, attention_mask=mask).logits[:, 0]              # (2P,)
        s_pos, s_neg = logit[:len(idx)], logit[len(idx):]                           # (P,) each
        target = torch.cat([torch.ones(len(idx)), torch.zeros(len(idx))])
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, target)
        rank = torch.nn.functional.softplus(s_neg - s_pos).mean()                    # -log sigmoid(pos - neg)
        loss = bce + rank
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"reward model step {step + 1}/{steps} bce {bce.item():.4f} rank {rank.item():.4f} "
                  f"({time.time() - t0:.0f}s)")
    model.eval()


def build(out: Path, prompts: int = PROMPTS, epochs: int = EPOCHS) -> dict:
    """Sample, label, pair, fine-tune, measure, save (HF format, atomically) to ``out``; returns the card."""
    with one_thread():  # as the warm start: one thread, the same reduction order everywhere
        return _build(Path(out), prompts, epochs)


def _build(out: Path, prompts: int, epochs: int) -> dict:
    from transformers import Qwen2ForSequenceClassification

    from nanogrpo.config import ModelConfig
    from nanogrpo.demos.arithmetic.build import embedded_path
    from nanogrpo.demos.arithmetic.task import make_split
    from nanogrpo.models.load import load_policy

    t0 = time.time()
    policy, tok, _ = load_policy(ModelConfig(path="embedded", device="cpu", cpu_linear="torch"))
    policy.eval()
    sampled = sample_completions(policy, tok, make_split("train", prompts, seed=SEED), SAMPLES, SEED)
    pairs = training_pairs(sampled, SEED)
    eval_rows = make_split("test", EVAL_PROMPTS, seed=SEED)
    eval_pairs = sample_completions(policy, tok, eval_rows, EVAL_SAMPLES, SEED + 1)
    print(f"sampled {len(sampled)} + {len(eval_pairs)} completions ({time.time() - t0:.0f}s)")
    torch.manual_seed(SEED)
    model = Qwen2ForSequenceClassification.from_pretrained(
        str(embedded_path()), num_labels=1, pad_token_id=tok.pad_token_id, dtype=torch.float32)
    model.config.architectures = ["Qwen2ForSequenceClassification"]
    before = accuracy(model.eval(), tok, eval_pairs)
    train(model, tok, pairs, epochs, PAIRS_PER_BATCH, LR)
    card = {"held_out": accuracy(model, tok, eval_pairs),
            "held_out_ranking": contrast_ranking(model, tok, eval_rows, SEED + 2),
            "held_out_before_training": before, "train_completions": len(sampled),
            "train_positive_rate": sum(label(c, r) for r, c in sampled) / len(sampled),
            "held_out_problems": EVAL_PROMPTS, "samples_per_problem": [SAMPLES, EVAL_SAMPLES],
            "temperatures": list(TEMPERATURES), "epochs": epochs, "pairs_per_batch": PAIRS_PER_BATCH,
            "lr": LR, "seed": SEED, "build_time_s": round(time.time() - t0, 1), "torch": torch.__version__}
    print(f"held-out classifier accuracy {card['held_out']['accuracy']:.3f} (before fine-tuning "
          f"{before['accuracy']:.3f}); ranking {card['held_out_ranking']}; {card['build_time_s']:.0f}s")
    save(model, tok, out, files={"rm_card.json": json.dumps(card, indent=1) + "\n"}, replace=True)
    return card


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
