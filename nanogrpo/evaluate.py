"""Greedy pass@1 evaluation with the training rewards.

``accuracy`` is the share of problems whose extracted answer verifies against
the reference (the built-in ``correctness``); ``format_rate`` the share that
matches the seed's ``<think>…</think><answer>…</answer>`` format; ``reward_mean``
the mean of the configured weighted reward.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nanogrpo.config import Config
from nanogrpo.data import encode_prompts, load_rows
from nanogrpo.rewards import RewardRunner, correctness, format_reward
from nanogrpo.rollout.engine import SamplingParams
from nanogrpo.rollout.factory import make_engine


def evaluate_rows(engine, tokenizer, rows: list[dict], cfg: Config, rewards: RewardRunner,
                  max_new_tokens: int, batch_size: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Greedy completions for ``rows``; returns the summary and one record per problem."""
    records: list[dict[str, Any]] = []
    skipped = 0
    t0 = time.perf_counter()
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        ids, skip = encode_prompts(tokenizer, chunk, cfg.data, cfg.model.chat_template)
        skipped += len(skip)
        kept = [r for j, r in enumerate(chunk) if j not in set(skip)]
        if not kept:
            continue
        gen = engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, n=1))
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
        scored = rewards.score(texts, kept)
        for r, t, total in zip(kept, texts, scored.total):
            records.append({"id": r.get("id"), "question": r["question"], "answer": r["answer"],
                            "completion": t, "correct": correctness(t, r) > 0,
                            "formatted": format_reward(t, r) > 0, "reward": total})
    n = len(records)
    summary = {
        "accuracy": sum(x["correct"] for x in records) / n if n else float("nan"),
        "format_rate": sum(x["formatted"] for x in records) / n if n else float("nan"),
        "reward_mean": statistics.fmean(x["reward"] for x in records) if n else float("nan"),
        "n": n, "skipped_long_prompts": skipped, "time_s": round(time.perf_counter() - t0, 3),
    }
    return summary, records


def run_eval(cfg: Config, model, tokenizer, split: str, n: int, out: Path | None = None) -> dict[str, Any]:
    rows = load_rows(cfg.data, split)[:n]
    engine = make_engine(cfg.rollout.engine, model, tokenizer)
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    model.eval()
    with RewardRunner.from_config(cfg.rewards) as rewards, torch.no_grad():
        summary, records = evaluate_rows(engine, tokenizer, rows, cfg, rewards, max_new, cfg.eval.batch_size)
    summary["split"] = split
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary) + "\n")
        with open(out.with_suffix(".samples.jsonl"), "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return summary
