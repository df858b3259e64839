"""Evaluation with the training rewards: greedy pass@1, or pass@k and maj@k with sampling.

With ``k == 1`` each problem gets one greedy completion. With ``k > 1`` each gets
``k`` completions sampled at ``eval.temperature`` (default: the rollout's) from a
fixed seed, so evaluations of different checkpoints see the same random streams.

Summary fields:

- ``accuracy``: share of completions whose extracted answer verifies against the
  reference (the built-in ``correctness``); with ``k > 1`` the mean over all
  samples, i.e. the unbiased estimate of sampled pass@1, also reported as ``pass@1``;
- ``format_rate``: share well formed by the run's format reward (``format_boxed`` when
  the run uses it, ``format_strict`` likewise, else the seed's ``<think>…</think><answer>…</answer>``);
- ``reward_mean``: mean of the configured weighted reward;
- ``pass@k``: share of problems with at least one correct completion among k;
- ``maj@k``: share of problems whose most frequent final answer (ties: the one
  seen first) is correct; answers are compared as written down by a grader
  (:func:`~nanogrpo.grading.grade.final_answer`: ``\\dfrac{1}{2}`` and ``\\frac12``, ``$1,234`` and
  ``1234.0`` vote together);
- ``n`` problems, ``k``, ``skipped_long_prompts``, ``time_s``;
- with a tool (``tools.enabled``): ``tool_use_rate`` (share of completions that call it at least
  once) and ``tool_calls_mean`` (calls per completion);
- with an environment (``[env]``): each problem is an episode (``k`` per row), ``accuracy`` its success
  rate (the environment's ``info["success"]``, else a return above 0), ``pass@k`` the share of rows with
  a successful episode among k, ``turns_mean`` (model turns per episode), ``return_mean`` and
  ``finish/REASON`` counts (``maj@k`` and ``format_rate`` mean nothing there: not reported);
- given the policy model (``policy``): ``entropy``, the policy's mean per-token entropy over the
  completions' tokens (the sampled ones: tool output left out), at the run's log-prob temperature,
  from the same chunked pass the trainer uses (:func:`nanogrpo.algo.logprobs.token_stats`).

Generation goes through the rollout engine (``make_engine``: the fast engine for the
families it implements, else ``hf``), ``eval.batch_size`` prompts per call; ``nanogrpo eval`` shows a
progress bar over the problems (with the accuracy so far), the held-out evaluation inside training none.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nanogrpo.config import Config
from nanogrpo.data import encode_prompts, load_eval_rows
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.factory import engine_for
from nanogrpo.episodes.play import Episodes
from nanogrpo.grading.grade import final_answer
from nanogrpo.grading.latex import clean, plain_values
from nanogrpo.rewards import RewardRunner, correctness
from nanogrpo.rewards.builtin import BUILTIN, format_name
from nanogrpo.rollout.collect import completion_samples, generate, pad_batch
from nanogrpo.rollout.turns import longest_context
from nanogrpo.tools.runner import ToolRunner


def vote_key(answer: str | None) -> str | None:
    """Normalised answer for majority voting: a plain number by its exact value (``$1,234.0`` ->
    ``1234``, ``\\frac{1}{2}`` -> ``1/2``); LaTeX without its spacing (``\\frac{1}{2}`` ->
    ``\\frac{1}{2}``, ``( 2, 3 )`` -> ``(2,3)``); other text lower-cased."""
    if answer is None:
        return None
    values = plain_values(answer.replace("$", "").rstrip(".%"))
    if values is not None:
        return str(values[0])
    return "".join(clean(answer).split()).lower() or None


def majority_index(answers: list[str | None]) -> int | None:
    """Index of the first completion carrying the most frequent (non-empty) answer; None if none has one."""
    keys = [vote_key(a) for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(i for i, k in enumerate(keys) if k is not None and counts[k] == best)


@torch.no_grad()
def completion_entropy(model, prompts: list[list[int]], completions: list[list[int]],
                       masks: list[list[bool]] | None, pad_id: int, temperature: float = 1.0,
                       micro_batch: int = 16, chunk: int = 1024,
                       support: tuple[int, float] | None = None, images=None) -> tuple[float, int]:
    """(sum of the policy's per-token entropies over the completions' tokens, their count); ``masks``: the
    tokens that count (multi-turn: the sampled ones), None: all. No (N, L, V) tensor is formed.
    ``images``: each completion's prompt images (:class:`~nanogrpo.data.images.VisionInputs`), or None."""
    from nanogrpo.algo.logprobs import token_stats

    dev = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(completions), micro_batch):
        comps = completions[i:i + micro_batch]
        if not any(comps):
            continue
        zeros = [[0.0] * len(c) for c in comps]
        ids, am, cm, _, p = pad_batch(prompts[i:i + micro_batch], comps, zeros, pad_id)
        if masks is not None:
            for j, m in enumerate(masks[i:i + micro_batch]):
                cm[j, :len(m)] &= torch.tensor(m, dtype=torch.bool)
        mm = None
        if images is not None:
            from nanogrpo.algo.vision import concat
            from nanogrpo.models.vision import forward_kwargs

            part = images[i:i + micro_batch]
            pv, grid, _ = concat([(v.pixel_values, v.grid) for v in part], part[0].pixel_values.shape[1])

            def mm(x, pv=pv, grid=grid):
                return forward_kwargs(model, x, pv, grid)
        _, ent = token_stats(model, ids.to(dev), am.to(dev), p, cm.to(dev), chunk=chunk,
                             temperature=temperature, entropy="value", support=support, mm=mm)  # (n, C)
        total += float(ent[cm.to(dev)].double().sum())
        count += int(cm.sum())
    return total, count


def _bar(rows: list[dict], k: int, progress: bool) -> tqdm:
    return tqdm(total=len(rows), desc=f"eval (k={k})" if k > 1 else "eval", unit="problem",
                dynamic_ncols=True, disable=not progress)


def _advance(bar: tqdm, n: int, records: list[dict[str, Any]]) -> None:
    flat = [c for x in records for c in x["correct"]]
    if flat:
        bar.set_postfix_str(f"acc {sum(flat) / len(flat):.3f}", refresh=False)
    bar.update(n)


def evaluate_rows(engine, tokenizer, rows: list[dict], cfg: Config, rewards: RewardRunner,
                  max_new_tokens: int, batch_size: int, k: int = 1, temperature: float | None = None,
                  seed: int = 0, tools=None, policy=None, env=None,
                  progress: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Completions for ``rows`` (greedy when ``k == 1``); returns the summary and one record per problem.
    ``tools``: a :class:`nanogrpo.tools.runner.ToolRunner` (multi-turn completions) or None.
    ``policy``: the model whose entropy over the completions is reported (``entropy``), or None.
    ``env``: an :class:`~nanogrpo.episodes.play.Episodes`: the rows start episodes, scored by success.
    ``progress``: a progress bar over the problems on stderr (``nanogrpo eval``)."""
    bar = _bar(rows, k, progress)
    try:
        if env is not None:
            return _evaluate_episodes(engine, tokenizer, rows, cfg, rewards, max_new_tokens, batch_size, k,
                                      temperature, seed, env, policy, bar)
        return _evaluate_completions(engine, tokenizer, rows, cfg, rewards, max_new_tokens, batch_size, k,
                                     temperature, seed, tools, policy, bar)
    finally:
        bar.close()


def _evaluate_completions(engine, tokenizer, rows: list[dict], cfg: Config, rewards: RewardRunner,
                          max_new_tokens: int, batch_size: int, k: int, temperature: float | None, seed: int,
                          tools, policy, bar: tqdm) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """:func:`evaluate_rows` of plain (or tool-calling) completions."""
    records: list[dict[str, Any]] = []
    skipped = 0
    ent_sum, ent_n = 0.0, 0
    t0 = time.perf_counter()
    temp = 0.0 if k == 1 else (temperature or cfg.rollout.temperature)
    for b, i in enumerate(range(0, len(rows), batch_size)):
        chunk = rows[i:i + batch_size]
        spec, images = getattr(engine, "vision", None), None
        if spec is not None:  # a vision-language model: the rows' images go with their prompts
            from nanogrpo.data.images import encode_with_images

            ids, skip, images = encode_with_images(tokenizer, chunk, cfg.data, cfg.model.chat_template, spec)
        else:
            ids, skip = encode_prompts(tokenizer, chunk, cfg.data, cfg.model.chat_template)
        skipped += len(skip)
        kept = [r for j, r in enumerate(chunk) if j not in set(skip)]
        if not kept:
            bar.update(len(chunk))
            continue
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temp, n=k,
                                top_p=cfg.rollout.top_p if k > 1 else 1.0,
                                top_k=cfg.rollout.top_k if k > 1 else 0,
                                seed=None if k == 1 else seed * 1_000_003 + b)
        gen = generate(engine, tokenizer, ids, kept, params, tools, images)
        if policy is not None:
            s_, n_ = completion_entropy(policy, [x for x in ids for _ in range(k)], gen.completion_ids,
                                        gen.loss_masks if tools is not None else None, tokenizer.pad_token_id,
                                        cfg.rollout.logprob_temperature(), cfg.train.micro_batch_size,
                                        cfg.train.logprob_chunk, cfg.rollout.logprob_support(),
                                        None if images is None else [v for v in images for _ in range(k)])
            ent_sum, ent_n = ent_sum + s_, ent_n + n_
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
        sampled = [sum(m) for m in gen.loss_masks] if tools is not None else \
            [len(c) for c in gen.completion_ids]
        samples = completion_samples(kept, k, gen.finish_reasons, sampled, max_new_tokens)  # as in training
        calls = [info["tool_calls"] for info in gen.infos] if tools is not None else [0] * len(texts)
        if tools is not None:
            samples = [{**s, **info} for s, info in zip(samples, gen.infos, strict=True)]
        scored = rewards.score(texts, samples)
        well_formed = BUILTIN[format_name(cfg.rewards.functions)]
        for p, r in enumerate(kept):
            sl = slice(p * k, (p + 1) * k)
            comps = texts[sl]
            correct = [correctness(t, r) > 0 for t in comps]
            answers = [final_answer(t) for t in comps]
            maj = majority_index(answers)
            records.append({
                "id": r.get("id"), "question": r["question"], "answer": r["answer"],
                "completions": comps, "rewards": scored.total[sl],
                "reward_breakdown": {name: vals[sl] for name, vals in scored.per_function.items()},
                "extracted": answers, "correct": correct,
                "formatted": [well_formed(t, r) > 0 for t in comps],
                "majority": answers[maj] if maj is not None else None,
                "majority_correct": bool(maj is not None and correct[maj]),
                "tool_calls": calls[sl],
            })
        _advance(bar, len(chunk), records)
    n = len(records)
    flat = [c for x in records for c in x["correct"]]
    fmt = [f for x in records for f in x["formatted"]]
    rew = [v for x in records for v in x["rewards"]]
    nan = float("nan")
    summary = {
        "accuracy": sum(flat) / len(flat) if flat else nan,
        "format_rate": sum(fmt) / len(fmt) if fmt else nan,
        "reward_mean": statistics.fmean(rew) if rew else nan,
        "n": n, "k": k, "temperature": temp,
        "pass@1": sum(flat) / len(flat) if flat else nan,
        f"pass@{k}": sum(any(x["correct"]) for x in records) / n if n else nan,
        f"maj@{k}": sum(x["majority_correct"] for x in records) / n if n else nan,
        "completion_len_mean": statistics.fmean(len(tokenizer.encode(c, add_special_tokens=False))
                                                for x in records for c in x["completions"]) if n else nan,
        "skipped_long_prompts": skipped, "time_s": round(time.perf_counter() - t0, 3),
    }
    if policy is not None:
        summary["entropy"] = ent_sum / ent_n if ent_n else nan
    if tools is not None:
        used = [c for x in records for c in x["tool_calls"]]
        summary["tool_use_rate"] = sum(c > 0 for c in used) / len(used) if used else nan
        summary["tool_calls_mean"] = statistics.fmean(used) if used else nan
    return summary, records


def _evaluate_episodes(engine, tokenizer, rows: list[dict], cfg: Config, rewards: RewardRunner,
                       max_new_tokens: int, batch_size: int, k: int, temperature: float | None, seed: int,
                       env, policy, bar: tqdm) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """:func:`evaluate_rows` with an environment: ``k`` episodes per row (greedy when ``k == 1``)."""
    records: list[dict[str, Any]] = []
    skipped, ent_sum, ent_n = 0, 0.0, 0
    finishes: Counter = Counter()
    lens: list[int] = []
    t0 = time.perf_counter()
    temp = 0.0 if k == 1 else (temperature or cfg.rollout.temperature)
    for b, i in enumerate(range(0, len(rows), batch_size)):
        chunk = rows[i:i + batch_size]
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temp, n=k,
                                top_p=cfg.rollout.top_p if k > 1 else 1.0,
                                top_k=cfg.rollout.top_k if k > 1 else 0,
                                seed=None if k == 1 else seed * 1_000_003 + b, resume_after_eos=True)
        gen = env.generate(engine, tokenizer, chunk, params)
        kept = [chunk[j] for j in gen.kept]
        skipped += len(chunk) - len(kept)
        if not kept:
            bar.update(len(chunk))
            continue
        if policy is not None:
            s_, n_ = completion_entropy(policy, gen.prompt_ids, gen.completion_ids, gen.loss_masks,
                                        tokenizer.pad_token_id, cfg.rollout.logprob_temperature(),
                                        cfg.train.micro_batch_size, cfg.train.logprob_chunk,
                                        cfg.rollout.logprob_support())
            ent_sum, ent_n = ent_sum + s_, ent_n + n_
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
        samples = completion_samples(kept, k, gen.finish_reasons, [sum(m) for m in gen.loss_masks],
                                     max_new_tokens)
        samples = [{**s, **info} for s, info in zip(samples, gen.infos, strict=True)]
        scored = rewards.score(texts, samples)
        finishes.update(gen.finish_reasons)
        lens += [len(c) for c in gen.completion_ids]
        for p, r in enumerate(kept):
            sl = slice(p * k, (p + 1) * k)
            records.append({
                "id": r.get("id"), "question": r.get("question"), "answer": r.get("answer"),
                "completions": texts[sl], "rewards": scored.total[sl],
                "reward_breakdown": {name: vals[sl] for name, vals in scored.per_function.items()},
                "correct": [s["success"] for s in samples[sl]],
                "returns": [s["env_reward"] for s in samples[sl]],
                "turns": [s["num_turns"] for s in samples[sl]], "finish_reasons": gen.finish_reasons[sl],
                "transcripts": [s["turns"] for s in samples[sl]],
            })
        _advance(bar, len(chunk), records)
    n = len(records)
    nan = float("nan")
    flat = [c for x in records for c in x["correct"]]
    turns = [t for x in records for t in x["turns"]]
    summary: dict[str, Any] = {
        "accuracy": sum(flat) / len(flat) if flat else nan,
        "reward_mean": statistics.fmean(v for x in records for v in x["rewards"]) if n else nan,
        "return_mean": statistics.fmean(v for x in records for v in x["returns"]) if n else nan,
        "turns_mean": statistics.fmean(turns) if turns else nan,
        "n": n, "k": k, "temperature": temp,
        "pass@1": sum(flat) / len(flat) if flat else nan,
        f"pass@{k}": sum(any(x["correct"]) for x in records) / n if n else nan,
        "completion_len_mean": statistics.fmean(lens) if lens else nan, "skipped_long_prompts": skipped,
        "time_s": round(time.perf_counter() - t0, 3),
        **{f"finish/{w}": finishes[w] for w in sorted(finishes)},
    }
    if policy is not None:
        summary["entropy"] = ent_sum / ent_n if ent_n else nan
    return summary, records


def write_results(summary: dict[str, Any], records: list[dict[str, Any]], out: Path) -> None:
    """``out`` gets the summary JSON; ``out`` with its suffix replaced by ``.samples.jsonl`` (``ev/s.json``:
    ``ev/s.samples.jsonl``) one record per problem."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    with open(out.with_suffix(".samples.jsonl"), "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def run_eval(cfg: Config, model, tokenizer, split: str, n: int, out: Path | None = None, k: int | None = None,
             engine=None, rows: list[dict] | None = None,
             rewards: RewardRunner | None = None, env=None, progress: bool = True) -> dict[str, Any]:
    """Evaluate ``model`` on the first ``n`` problems of ``split`` (``k`` defaults to ``eval.k``; the
    problems come from ``data.eval_source``, else ``data.source``); ``rows``: samples to take them from
    instead, ``rewards``: a runner instead of ``cfg.rewards``', ``env``: an environment object instead of
    ``env.source``'s (episodes: ``accuracy`` is their success rate); ``progress``: a bar on stderr."""
    rows = (rows if rows is not None else load_eval_rows(cfg.data, split))[:n]
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    episodes = Episodes.from_config(cfg, env)
    from nanogrpo.data.images import check_images_early, check_model_takes_images
    from nanogrpo.models.vision import is_vision

    if engine is None:  # before the engine is built: vLLM and fast take no images
        check_images_early(rows, cfg.data.image_field, engine=cfg.rollout.engine, vision=is_vision(model),
                           model=cfg.model.path, multi_turn=episodes is not None or cfg.tools.enabled)
    max_len = longest_context(cfg, tokenizer, max_new) if episodes is None else episodes.longest(max_new)
    engine = engine or engine_for(cfg, model, tokenizer, max_len=max_len)

    check_model_takes_images(rows, cfg.data.image_field, getattr(engine, "vision", None), cfg.model.path)
    model.eval()
    tools = ToolRunner.from_config(cfg.tools)
    if rewards is None:
        from nanogrpo.rewards import reward_runner

        runner = reward_runner(cfg)  # rm: reward models on the policy's device
    else:
        runner = rewards
    try:
        with torch.no_grad():
            summary, records = evaluate_rows(engine, tokenizer, rows, cfg, runner, max_new,
                                             cfg.eval.batch_size, k=k or cfg.eval.k,
                                             temperature=cfg.eval.temperature, seed=cfg.eval.seed,
                                             tools=tools, policy=model, env=episodes, progress=progress)
    finally:
        if episodes is not None:
            episodes.close()
        if rewards is None:
            runner.close()
        if tools is not None:
            tools.close()
    summary["split"] = split
    if out is not None:
        write_results(summary, records, out)
    return summary
