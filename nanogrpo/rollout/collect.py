"""One rollout: prompts -> G completions each -> rewards -> advantages -> a RolloutBatch.

The same function runs inside the single-process trainer and inside each
``nanogrpo rollout`` worker; only where the batch goes differs. With a tool
(``tools``), each completion is a multi-turn trajectory (:mod:`nanogrpo.rollout.turns`):
the rewards see its whole text and, in the sample dict, its ``turns`` and
``tool_calls``; the batch carries a ``loss_mask`` that leaves the tool output out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from nanogrpo.algo.advantages import Reduce, advantages, signal_mask
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import DataConfig, GrpoConfig, RolloutConfig
from nanogrpo.data import encode_prompts
from nanogrpo.rewards import RewardRunner, correctness
from nanogrpo.rewards.builtin import BUILTIN, format_name
from nanogrpo.rollout.engine import Engine, Generation, SamplingParams


@dataclass
class RolloutStats:
    reward_mean: float = float("nan")
    reward_std: float = float("nan")
    accuracy: float = float("nan")
    format_rate: float = float("nan")
    completion_len_mean: float = float("nan")
    completion_tokens: int = 0
    num_completions: int = 0
    groups_total: int = 0
    groups_kept: int = 0
    prompts_skipped: int = 0
    stop_rate: float = float("nan")
    reward_failures: int = 0
    reward_timeouts: int = 0
    reward_non_finite: int = 0
    reward_by_function: dict[str, float] = field(default_factory=dict)
    reward_failures_by_function: dict[str, int] = field(default_factory=dict)
    """Rows each reward scored the penalty (raised, timed out, non-finite, unreadable judge reply)."""
    reward_model_metrics: dict[str, float] = field(default_factory=dict)
    """Model rewards' figures (``judge/…``, ``rm/…``), :attr:`nanogrpo.rewards.RewardResult.metrics`."""
    tool_metrics: dict[str, float] = field(default_factory=dict)
    """``tools/…`` metrics of multi-turn rollouts (:func:`nanogrpo.rollout.turns.tool_metrics`)."""
    examples: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        out = {k: v for k, v in self.__dict__.items()
               if k not in ("examples", "reward_by_function", "reward_failures_by_function",
                            "reward_model_metrics", "tool_metrics")}
        out.update({f"reward/{k}": v for k, v in self.reward_by_function.items()})
        out.update({f"reward/{k}/failures": v for k, v in self.reward_failures_by_function.items()})
        out.update(self.reward_model_metrics)
        out.update(self.tool_metrics)
        return out


def _metric_column(name: str, fn, per_function: dict[str, list[float]], texts: list[str],
                   samples: list[dict]) -> list[float]:
    if name in per_function:
        return per_function[name]
    return [fn(t, s) for t, s in zip(texts, samples)]


def completion_samples(rows: list[dict], g: int, finish_reasons: list[str]) -> list[dict[str, Any]]:
    """One sample dict per completion, what its reward functions see: a copy of the dataset row
    plus ``finish_reason`` (``"stop"``: the model ended it; ``"length"``: the token limit cut it off),
    a reserved key that replaces a dataset column of that name. Rows are copied, so a reward that
    writes into its sample cannot reach its group's other completions."""
    return [dict(row, finish_reason=finish_reasons[i * g + j])
            for i, row in enumerate(rows) for j in range(g)]


def pad_batch(prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
              pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Left-pad prompts, right-pad completions: ids, attention mask, completion mask, logprobs, P."""
    n = len(completions)
    p = max(len(x) for x in prompts)
    c = max(len(x) for x in completions)
    ids = torch.full((n, p + c), pad_id, dtype=torch.int64)
    am = torch.zeros((n, p + c), dtype=torch.int8)
    cm = torch.zeros((n, c), dtype=torch.bool)
    lp = torch.zeros((n, c), dtype=torch.float32)
    for i, (pr, co, lo) in enumerate(zip(prompts, completions, logprobs)):
        ids[i, p - len(pr):p] = torch.tensor(pr, dtype=torch.int64)
        am[i, p - len(pr):p + len(co)] = 1
        ids[i, p:p + len(co)] = torch.tensor(co, dtype=torch.int64)
        cm[i, :len(co)] = True
        lp[i, :len(co)] = torch.tensor(lo, dtype=torch.float32)
    return ids, am, cm, lp, p


def generate(engine: Engine, tokenizer, prompt_ids: list[list[int]], rows: list[dict], params: SamplingParams,
             tools=None) -> Generation:
    """``params.n`` completions per prompt: one ``generate`` call, or multi-turn trajectories (``tools``)."""
    if tools is None:
        return engine.generate(prompt_ids, params)
    from nanogrpo.rollout.turns import generate_with_tools

    return generate_with_tools(engine, tokenizer, tools, prompt_ids, rows, params, tools.cfg.max_turns,
                               tools.cfg.max_output_tokens)


def batch_advantages(per_fn: torch.Tensor, weights: list[float], lengths: torch.Tensor, grpo: GrpoConfig,
                     reduce: Reduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,) float32, scores (N,)) of a step's completions: ``per_fn`` (N, F) the unweighted
    value of each reward function, ``lengths`` (N,) their trained tokens (``grpo.advantage`` and
    ``grpo.reward_aggregation``, :mod:`nanogrpo.algo.advantages`)."""
    return advantages(per_fn, torch.tensor(weights, dtype=per_fn.dtype), grpo.group_size,
                      estimator=grpo.resolved()["advantage"], aggregation=grpo.reward_aggregation,
                      eps=grpo.std_eps, lengths=lengths, reduce=reduce, dtype=torch.float32)


def rollout(engine: Engine, tokenizer, rows: list[dict], rewards: RewardRunner, data: DataConfig,
            cfg: RolloutConfig, grpo: GrpoConfig, *, template: str, seed: int | None,
            policy_version: int = 0, keep_examples: int = 2, tools=None, reduce: Reduce | None = None
            ) -> tuple[RolloutBatch | None, RolloutStats]:
    """Sample, score and package one step's groups; ``None`` when no group carries signal.

    ``tools``: a :class:`nanogrpo.tools.registry.ToolRunner` for multi-turn rollouts, or None.
    ``reduce``: several ranks roll out shares of one batch: sums over them for the batch-level
    advantage estimators (every rank calls this function, with or without rows)."""
    g = grpo.group_size
    stats = RolloutStats()
    prompt_ids, skipped = encode_prompts(tokenizer, rows, data, template)  # ids of the kept rows only
    skipped_set = set(skipped)
    kept_rows = [r for i, r in enumerate(rows) if i not in skipped_set]
    stats.prompts_skipped = len(skipped)
    if not kept_rows:
        if reduce is not None:  # the other ranks' batch-level advantages wait for this rank's (empty) share
            batch_advantages(torch.zeros(0, len(rewards.specs), dtype=torch.float64), rewards.weights,
                             torch.zeros(0), grpo, reduce)
        return None, stats
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, n=g, seed=seed, logprob_temperature=cfg.logprob_temperature())
    gen = generate(engine, tokenizer, prompt_ids, kept_rows, params, tools)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
    samples = completion_samples(kept_rows, g, gen.finish_reasons)
    if tools is not None:
        samples = [{**s, **info} for s, info in zip(samples, gen.infos, strict=True)]
        stats.tool_metrics = dict(gen.tool_metrics)
    scored = rewards.score(texts, samples)
    r = torch.tensor(scored.total, dtype=torch.float32)                           # (N,)
    acc = _metric_column("correctness", correctness, scored.per_function, texts, samples)
    fmt_name = format_name(list(scored.per_function))  # the run's own format reward (format_boxed, ...)
    fmt = _metric_column(fmt_name, BUILTIN[fmt_name], scored.per_function, texts, samples)
    lens = [len(c) for c in gen.completion_ids]
    stats.reward_mean = float(r.mean())
    stats.reward_std = float(r.std()) if r.numel() > 1 else 0.0
    stats.accuracy = sum(a > 0 for a in acc) / len(acc)
    stats.format_rate = sum(f > 0 for f in fmt) / len(fmt)
    stats.completion_len_mean = statistics.fmean(lens)
    stats.completion_tokens = sum(lens)
    stats.num_completions = len(lens)
    stats.stop_rate = sum(f == "stop" for f in gen.finish_reasons) / len(lens)
    stats.reward_failures, stats.reward_timeouts = scored.failures, scored.timeouts
    stats.reward_non_finite = scored.non_finite
    stats.reward_by_function = {k: statistics.fmean(v) for k, v in scored.per_function.items()}
    stats.reward_failures_by_function = dict(scored.failures_by_function)
    stats.reward_model_metrics = dict(scored.metrics)
    stats.examples = [{"question": samples[i]["question"], "completion": texts[i], "reward": scored.total[i],
                       **{k: v[i] for k, v in scored.per_function.items()}}
                      for i in range(min(keep_examples, len(texts)))]

    groups = len(kept_rows)
    stats.groups_total = groups
    per_fn = torch.tensor([scored.per_function[s] for s in rewards.specs], dtype=torch.float64).T  # (N, F)
    trained = [sum(m) for m in gen.loss_masks] if tools is not None else lens                      # (N,)
    adv, score = batch_advantages(per_fn, rewards.weights, torch.tensor(trained, dtype=torch.float64), grpo,
                                  reduce)                                          # (N,) each
    keep = signal_mask(score, g, grpo.min_reward_spread)                           # (groups,)
    stats.groups_kept = int(keep.sum())
    if stats.groups_kept == 0:
        return None, stats
    rows_kept = torch.nonzero(keep.repeat_interleave(g)).squeeze(1)                # (n,)
    idx = rows_kept.tolist()
    ids, am, cm, lp, p = pad_batch([prompt_ids[i // g] for i in idx], [gen.completion_ids[i] for i in idx],
                                   [gen.logprobs[i] for i in idx], tokenizer.pad_token_id)
    group_ids = torch.tensor([i // g for i in idx], dtype=torch.int64)
    lm = None
    if tools is not None:
        lm = torch.zeros_like(cm)                                                  # (n, C)
        for j, i in enumerate(idx):
            lm[j, :len(gen.loss_masks[i])] = torch.tensor(gen.loss_masks[i], dtype=torch.bool)
    batch = RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, loss_mask=lm,
                         rewards=r[rows_kept], advantages=adv[rows_kept], group_ids=group_ids,
                         old_logprobs=lp, prompt_len=p, group_size=g, policy_version=policy_version,
                         truncated=torch.tensor([gen.finish_reasons[i] == "length" for i in idx]),
                         meta={"ids": [str(kept_rows[i // g].get("id", "")) for i in idx[::g]]})
    return batch, stats
