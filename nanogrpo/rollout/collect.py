"""One rollout: prompts -> G completions each -> rewards -> advantages -> a RolloutBatch.

The same function runs inside the single-process trainer and inside each
``nanogrpo rollout`` worker; only where the batch goes differs. With a tool
(``tools``), each completion is a multi-turn trajectory (:mod:`nanogrpo.rollout.turns`):
the rewards see its whole text and, in the sample dict, its ``turns`` and
``tool_calls``; the batch carries a ``loss_mask`` that leaves the tool output out. With an
environment (``env``), each completion is an episode (:mod:`nanogrpo.rollout.episodes`): the
sample dict carries its return (``env_reward``, the ``env`` reward), ``success`` (what ``accuracy``
counts), ``turns`` and ``turn_rewards``; the environment's observations are left out of the loss.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from nanogrpo.algo.advantages import AGGREGATIONS, Reduce, advantages, refill_size, signal_mask, surplus_mask
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import DataConfig, GrpoConfig, RolloutConfig
from nanogrpo.data import encode_prompts
from nanogrpo.engines.base import Engine, Generation, SamplingParams
from nanogrpo.rewards import RewardRunner, correctness
from nanogrpo.rewards.builtin import BUILTIN, format_name


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
    """Groups generated (all rounds of dynamic sampling)."""
    groups_kept: int = 0
    """Groups in the batch; the others carried no signal (or were dynamic sampling's surplus)."""
    prompts_skipped: int = 0
    refills: int | None = None
    """``grpo.dynamic_sampling``: generation rounds after the first (None: not on)."""
    groups_no_signal: int | None = None
    """``grpo.dynamic_sampling``: generated groups dropped because their rewards all agreed."""
    groups_surplus: int | None = None
    """``grpo.dynamic_sampling``: informative groups generated beyond the batch, dropped."""
    stop_rate: float = float("nan")
    truncated_frac: float = float("nan")
    """Share of the completions the token limit cut off (``finish_reason == "length"``)."""
    distinct_ngrams: float = float("nan")
    """Distinct token 4-grams over the step's completions / all their 4-grams, each group's repeats of one
    completion counted once (:func:`distinct_ngrams`): near 1 when prompts get their own answers, falling
    towards 1 / prompts when every prompt gets the same text."""
    sampled_nll: float = float("nan")
    """Mean negative log-prob (the engine's, at the run's log-prob temperature) of the tokens the model
    sampled, over every completion of the step (:func:`sampled_nll`): an estimate of the policy's per-token
    entropy that, unlike the trainer's ``entropy``, counts the groups dropped for want of signal too."""
    reward_failures: int = 0
    reward_timeouts: int = 0
    reward_non_finite: int = 0
    reward_by_function: dict[str, float] = field(default_factory=dict)
    reward_failures_by_function: dict[str, int] = field(default_factory=dict)
    """Rows each reward scored the penalty (raised, timed out, non-finite, unreadable judge reply)."""
    reward_model_metrics: dict[str, float] = field(default_factory=dict)
    """Model rewards' figures (``judge/…``, ``rm/…``), :attr:`nanogrpo.rewards.RewardResult.metrics`."""
    tool_metrics: dict[str, float] = field(default_factory=dict)
    """``tools/…`` metrics of multi-turn rollouts (:func:`nanogrpo.rollout.turns.tool_metrics`), ``env/…``
    ones of episodes (:func:`nanogrpo.rollout.episodes.env_metrics`)."""
    examples: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        out = {k: v for k, v in self.__dict__.items()
               if k not in ("examples", "reward_by_function", "reward_failures_by_function",
                            "reward_model_metrics", "tool_metrics") and v is not None}
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


def completion_samples(rows: list[dict], g: int, finish_reasons: list[str], lengths: list[int] | None = None,
                       max_new_tokens: int | None = None) -> list[dict[str, Any]]:
    """One sample dict per completion, what its reward functions see: a copy of the dataset row
    plus the reserved keys (they replace dataset columns of those names) ``finish_reason``
    (``"stop"``: the model ended it; ``"length"``: the token limit cut it off) and, when given,
    ``completion_tokens`` (the tokens the model sampled; a multi-turn trajectory's tool output left out)
    and ``max_new_tokens`` (the limit on them): what length-aware rewards (``overlong``) read.
    Rows are copied, so a reward that writes into its sample cannot reach its group's other
    completions."""
    extra: list[dict[str, Any]] = [{} for _ in finish_reasons]
    if lengths is not None:
        extra = [{"completion_tokens": n, "max_new_tokens": max_new_tokens} for n in lengths]
    return [dict(row, finish_reason=finish_reasons[i * g + j], **extra[i * g + j])
            for i, row in enumerate(rows) for j in range(g)]


def sampled_nll(logprobs: list[list[float]], masks: list[list[bool]] | None = None) -> float:
    """Mean -log p of the sampled tokens (``masks``: only where 1, the model's own tokens of a multi-turn
    trajectory). The tokens are drawn from the policy, so at ``rollout.temperature`` 1 (or with
    ``rollout.tempered_logprobs``) this is an unbiased estimate of its mean per-token entropy, otherwise the
    cross-entropy of the tempered sampler against it; either falls to 0 as the policy comes to sample one
    continuation. Free (the engine reports the log-probs anyway), and over every completion: the trainer's
    ``entropy`` sees only the groups it trains on, which a collapsing policy leaves few or none of. NaN
    without tokens."""
    if masks is None:  # builtin sums: the step's every token, at C speed
        total, count = sum(map(sum, logprobs)), sum(map(len, logprobs))
    else:
        kept = [[v for v, k in zip(lp, m) if k] for lp, m in zip(logprobs, masks)]
        total, count = sum(map(sum, kept)), sum(map(len, kept))
    return -total / count if count else float("nan")


def distinct_ngrams(completions: list[list[int]], group_size: int, n: int = 4) -> float:
    """Distinct ``n``-grams of token ids over ``completions`` (``group_size`` per prompt, in order) divided by
    their total count, after dropping each group's duplicate completions (a policy sure of its answer to
    one prompt repeats it G times: that is not a template). 1.0: no n-gram shared between completions;
    1 / prompts: every prompt got the same completion. NaN when no completion has ``n`` tokens."""
    grams: list[tuple[int, ...]] = []
    for start in range(0, len(completions), group_size):
        for c in {tuple(c) for c in completions[start:start + group_size]}:
            grams += [c[i:i + n] for i in range(len(c) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


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
             tools=None, images=None) -> Generation:
    """``params.n`` completions per prompt: one ``generate`` call, or multi-turn trajectories (``tools``).
    ``images``: per prompt, its :class:`~nanogrpo.data.images.VisionInputs` (vision-language models)."""
    if images is not None:
        if tools is not None:
            raise ValueError("tools with images are not supported: drop [tools] or the images")
        return engine.generate(prompt_ids, params, images=images)
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


@dataclass
class _Round:
    """One generation round of a step: its prompts (those kept), completions and rewards."""

    prompt_ids: list[list[int]]
    """One per completion (a group's completions share theirs, except episodes whose first
    observations differ)."""
    rows: list[dict]
    gen: Any
    texts: list[str]
    samples: list[dict]
    scored: Any
    skipped: int


def _generate_round(engine: Engine, tokenizer, rows: list[dict], rewards: RewardRunner, data: DataConfig,
                    cfg: RolloutConfig, grpo: GrpoConfig, template: str, seed: int | None, tools,
                    env=None, version: int = 0) -> _Round:
    """Encode, sample ``grpo.group_size`` completions per prompt, score them."""
    if env is not None:
        return _episode_round(engine, tokenizer, rows, rewards, cfg, grpo, seed, env, version)
    spec = getattr(engine, "vision", None)
    images = None
    if spec is not None:  # a vision-language model: every prompt gets its images (maybe none)
        from nanogrpo.data.images import encode_with_images

        prompt_ids, skipped, images = encode_with_images(tokenizer, rows, data, template, spec)
    else:
        prompt_ids, skipped = encode_prompts(tokenizer, rows, data, template)  # ids of the kept rows only
    skipped_set = set(skipped)
    kept_rows = [r for i, r in enumerate(rows) if i not in skipped_set]
    if not kept_rows:
        return _Round([], [], None, [], [], None, len(skipped))
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, n=grpo.group_size, seed=seed,
                            logprob_temperature=cfg.logprob_temperature(),
                            support_logprobs=cfg.logprob_support() is not None)
    gen = generate(engine, tokenizer, prompt_ids, kept_rows, params, tools, images)
    if images is not None:
        gen.images = [v for v in images for _ in range(grpo.group_size)]  # one per completion
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
    sampled = [sum(m) for m in gen.loss_masks] if tools is not None else [len(c) for c in gen.completion_ids]
    samples = completion_samples(kept_rows, grpo.group_size, gen.finish_reasons, sampled, cfg.max_new_tokens)
    if tools is not None:
        samples = [{**s, **info} for s, info in zip(samples, gen.infos, strict=True)]
    prompt_ids = [p for p in prompt_ids for _ in range(grpo.group_size)]  # one per completion
    return _Round(prompt_ids, kept_rows, gen, texts, samples, rewards.score(texts, samples), len(skipped))


def _episode_round(engine: Engine, tokenizer, rows: list[dict], rewards: RewardRunner, cfg: RolloutConfig,
                   grpo: GrpoConfig, seed: int | None, env, version: int = 0) -> _Round:
    """``grpo.group_size`` episodes per row with the environment (``env``: an
    :class:`~nanogrpo.rollout.episodes.Episodes`), scored."""
    if not rows:
        return _Round([], [], None, [], [], None, 0)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, n=grpo.group_size, seed=seed,
                            logprob_temperature=cfg.logprob_temperature(),
                            support_logprobs=cfg.logprob_support() is not None, resume_after_eos=True)
    gen = env.generate(engine, tokenizer, rows, params, version=version)
    kept_rows = [rows[i] for i in gen.kept]
    if not kept_rows:  # every group dropped: the generation stays for its env/… counts
        return _Round([], [], gen, [], [], None, len(rows))
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
    samples = completion_samples(kept_rows, grpo.group_size, gen.finish_reasons,
                                 [sum(m) for m in gen.loss_masks], cfg.max_new_tokens)
    samples = [{**s, **info} for s, info in zip(samples, gen.infos, strict=True)]
    return _Round(gen.prompt_ids, kept_rows, gen, texts, samples, rewards.score(texts, samples),
                  len(rows) - len(kept_rows))


def _informative(rnd: _Round, rewards: RewardRunner, grpo: GrpoConfig) -> torch.Tensor:
    """(groups,) bool: the round's groups whose scores (the reward aggregation's, as the advantages see them)
    do not all agree."""
    if not rnd.rows:
        return torch.zeros(0, dtype=torch.bool)
    per_fn = torch.tensor([rnd.scored.per_function[s] for s in rewards.specs], dtype=torch.float64).T
    score = AGGREGATIONS[grpo.reward_aggregation](per_fn, torch.tensor(rewards.weights, dtype=torch.float64),
                                                  grpo.group_size, grpo.std_eps).float()  # (N,)
    return signal_mask(score, grpo.group_size, grpo.min_reward_spread)              # (groups,)


def _sum(reduce: Reduce | None, values: list[float]) -> list[float]:
    return list(values) if reduce is None else list(reduce(values))


def rollout(engine: Engine, tokenizer, rows: list[dict], rewards: RewardRunner, data: DataConfig,
            cfg: RolloutConfig, grpo: GrpoConfig, *, template: str, seed: int | None,
            policy_version: int = 0, keep_examples: int = 2, tools=None, reduce: Reduce | None = None,
            more=None, env=None, keep_all: bool = False) -> tuple[RolloutBatch | None, RolloutStats]:
    """Sample, score and package one step's groups; ``None`` when no group carries signal.

    ``tools``: a :class:`nanogrpo.tools.registry.ToolRunner` for multi-turn rollouts, or None.
    ``env``: an :class:`~nanogrpo.rollout.episodes.Episodes` (episodes with an environment), or None.
    ``keep_all``: no group is dropped for rewards that all agree (on-policy distillation: the teacher's
    signal is in every group).
    ``reduce``: several ranks roll out shares of one batch: sums over them for the batch-level
    advantage estimators and the refill decisions (every rank calls this function, with or without rows).
    ``more(n)``: this rank's share of the next ``n`` prompts of the (global) prompt stream, for
    ``grpo.dynamic_sampling``'s refill rounds: while fewer informative groups than this rank's share of
    ``rollout.prompts_per_step`` (its first ``rows``) are kept, on any rank, up to ``grpo.max_refills``
    more rounds are generated (every rank the same number; a rank already full draws its share and
    leaves it). The batch then keeps the first ``len(rows)`` informative groups; the rest are dropped
    and counted (``groups_surplus``). Advantages are computed over every completion generated for the
    step (so that batch-level estimators see the same population with or without refills)."""
    g = grpo.group_size
    stats = RolloutStats()
    target = len(rows)
    rounds = [_generate_round(engine, tokenizer, rows, rewards, data, cfg, grpo, template, seed, tools, env,
                              policy_version)]
    dynamic = grpo.dynamic_sampling and more is not None
    if dynamic:
        informative = [_informative(rounds[0], rewards, grpo)]
        while True:
            kept, made = int(sum(int(m.sum()) for m in informative)), sum(len(m) for m in informative)
            short, all_kept, all_made = _sum(reduce, [float(kept < target), float(kept), float(made)])
            if short == 0 or len(rounds) > grpo.max_refills:
                break
            n_total = _sum(reduce, [float(target)])[0]
            new_rows = more(refill_size(int(n_total), int(all_kept), int(all_made), int(n_total)))
            r_seed = None if seed is None else (seed + 1_000_003 * len(rounds)) % 2**31
            rnd = _generate_round(engine, tokenizer, new_rows if kept < target else [], rewards, data, cfg,
                                  grpo, template, r_seed, tools, env, policy_version)
            rounds.append(rnd)
            informative.append(_informative(rnd, rewards, grpo))
        stats.refills = len(rounds) - 1
    stats.prompts_skipped = sum(r.skipped for r in rounds)
    multi = tools is not None or env is not None
    if multi:  # every round's, those whose groups were all dropped included (env/groups_dropped)
        parts = [(len(x.gen.completion_ids), x.gen.tool_metrics if env is None else x.gen.env_metrics)
                 for x in rounds if x.gen is not None]
        if parts:
            stats.tool_metrics = _merge_tool_metrics(parts)
        elif env is not None:  # no row on this rank: the same keys, zero (every rank merges them)
            stats.tool_metrics = env.metrics_of_nothing()
    live = [r for r in rounds if r.rows]
    if not live:
        if reduce is not None:  # the other ranks' batch-level advantages wait for this rank's (empty) share
            batch_advantages(torch.zeros(0, len(rewards.specs), dtype=torch.float64), rewards.weights,
                             torch.zeros(0), grpo, reduce)
        return None, stats
    prompt_ids = [p for r in live for p in r.prompt_ids]
    kept_rows = [row for r in live for row in r.rows]
    comp = [c for r in live for c in r.gen.completion_ids]
    lps = [lp for r in live for lp in r.gen.logprobs]
    reasons = [f for r in live for f in r.gen.finish_reasons]
    texts = [t for r in live for t in r.texts]
    samples = [x for r in live for x in r.samples]
    per_function = {k: [v for r in live for v in r.scored.per_function[k]]
                    for k in live[0].scored.per_function}
    total = [v for r in live for v in r.scored.total]
    r = torch.tensor(total, dtype=torch.float32)                                  # (N,)
    if env is not None:  # an episode's success (the environment's say, else a return above 0)
        acc = [1.0 if s["success"] else 0.0 for s in samples]
    else:
        acc = _metric_column("correctness", correctness, per_function, texts, samples)
    fmt_name = format_name(list(per_function))  # the run's own format reward (format_boxed, ...)
    fmt = _metric_column(fmt_name, BUILTIN[fmt_name], per_function, texts, samples) \
        if env is None or fmt_name in per_function else []
    lens = [len(c) for c in comp]
    stats.reward_mean = float(r.mean())
    stats.reward_std = float(r.std()) if r.numel() > 1 else 0.0
    stats.accuracy = sum(a > 0 for a in acc) / len(acc)
    stats.format_rate = sum(f > 0 for f in fmt) / len(fmt) if fmt else float("nan")
    stats.completion_len_mean = statistics.fmean(lens)
    stats.completion_tokens = sum(lens)
    stats.num_completions = len(lens)
    stats.stop_rate = sum(f in ("stop", "done") for f in reasons) / len(lens)  # done: an episode's end
    stats.truncated_frac = sum(f == "length" for f in reasons) / len(lens)
    stats.distinct_ngrams = distinct_ngrams(comp, g)
    stats.sampled_nll = sampled_nll(lps, [m for x in live for m in x.gen.loss_masks] if multi else None)
    stats.reward_failures = sum(x.scored.failures for x in live)
    stats.reward_timeouts = sum(x.scored.timeouts for x in live)
    stats.reward_non_finite = sum(x.scored.non_finite for x in live)
    stats.reward_by_function = {k: statistics.fmean(v) for k, v in per_function.items()}
    fails: dict[str, int] = {}
    for x in live:
        for k, v in x.scored.failures_by_function.items():
            fails[k] = fails.get(k, 0) + v
    stats.reward_failures_by_function = fails
    stats.reward_model_metrics = dict(live[-1].scored.metrics)
    shown = example_rows(len(texts), g, keep_examples)
    stats.examples = [{"question": samples[i].get("question", ""), "completion": texts[i], "reward": total[i],
                       **{k: v[i] for k, v in per_function.items()}, **_example_images(samples[i], data)}
                      for i in shown]

    groups = len(kept_rows)
    stats.groups_total = groups
    per_fn = torch.tensor([per_function[s] for s in rewards.specs], dtype=torch.float64).T  # (N, F)
    loss_masks = [m for x in live for m in x.gen.loss_masks] if multi else None
    trained = [sum(m) for m in loss_masks] if multi else lens                    # (N,)
    adv, score = batch_advantages(per_fn, rewards.weights, torch.tensor(trained, dtype=torch.float64), grpo,
                                  reduce)                                          # (N,) each
    for ex, i in zip(stats.examples, shown):  # the rollout table: each row's advantage and group
        ex.update(advantage=float(adv[i]), group=i // g, finish_reason=reasons[i])
    keep = signal_mask(score, g, grpo.min_reward_spread)                           # (groups,)
    if keep_all:
        keep = torch.ones_like(keep)
    if dynamic:
        stats.groups_no_signal = int((~keep).sum())
        surplus = surplus_mask(keep, target)                                       # (groups,) past the batch
        stats.groups_surplus = int(surplus.sum())
        keep &= ~surplus
    stats.groups_kept = int(keep.sum())
    if stats.groups_kept == 0:
        return None, stats
    rows_kept = torch.nonzero(keep.repeat_interleave(g)).squeeze(1)                # (n,)
    idx = rows_kept.tolist()
    prompts_b, comp_b, lps_b = [prompt_ids[i] for i in idx], [comp[i] for i in idx], [lps[i] for i in idx]
    masks_b = [loss_masks[i] for i in idx] if multi else None
    cut_b = [reasons[i] == "length" for i in idx]
    rows_b, size = list(idx), g
    extra = [e for x in live
             for e in getattr(x.gen, "extra_sequences", None) or [[]] * len(x.gen.completion_ids)]
    if any(extra[i] for i in idx):  # agent programs that rewrote their history: more rows, same advantage
        for i in idx:
            for sq in extra[i]:
                prompts_b.append(sq.prompt_ids)
                comp_b.append(sq.completion_ids)
                lps_b.append(sq.logprobs)
                masks_b.append(sq.loss_mask)
                cut_b.append(sq.finish_reason == "length")
                rows_b.append(i)
        size = 1  # groups are no longer runs of group_size rows; group_ids still say which group
    if not any(comp_b):  # every episode kept broke before the model wrote a token: nothing to train
        stats.groups_kept = 0
        return None, stats
    rows_t = torch.tensor(rows_b, dtype=torch.int64)
    ids, am, cm, lp, p = pad_batch(prompts_b, comp_b, lps_b, tokenizer.pad_token_id)
    group_ids = torch.tensor([i // g for i in rows_b], dtype=torch.int64)
    lm = None
    if multi:
        lm = torch.zeros_like(cm)                                                  # (n, C)
        for j, m in enumerate(masks_b):
            lm[j, :len(m)] = torch.tensor(m, dtype=torch.bool)
    vis = {}
    if live[0].gen is not None and getattr(live[0].gen, "images", None) is not None:
        from nanogrpo.algo.vision import concat

        per = [v for x in live for v in x.gen.images]                              # one per completion
        pv, grid, counts = concat([(per[i].pixel_values, per[i].grid) for i in rows_b],
                                  per[0].pixel_values.shape[1])
        vis = {"pixel_values": pv, "image_grid_thw": grid, "image_counts": counts}
    batch = RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, loss_mask=lm, **vis,
                         rewards=r[rows_t], advantages=adv[rows_t], group_ids=group_ids,
                         old_logprobs=lp, prompt_len=p, group_size=size, policy_version=policy_version,
                         truncated=torch.tensor(cut_b), correct=torch.tensor([acc[i] > 0 for i in rows_b]),
                         meta={"ids": [str(kept_rows[i // g].get("id", "")) for i in idx[::g]]})
    return batch, stats


def example_rows(n: int, group_size: int, count: int) -> list[int]:
    """Which of a step's ``n`` completions its rollout table shows: the first two of each group, group after
    group, ``count`` in all (two of one group show its advantages' contrast; several groups, several
    prompts)."""
    per = min(2, group_size)
    return [i * group_size + j for i in range(n // group_size) for j in range(per)][:count]


def _example_images(sample: dict, data: DataConfig) -> dict:
    """``{"images": [PNG data URIs]}`` for a logged example whose prompt has images (``nanogrpo report``
    shows them beside the completion), else nothing."""
    imgs = sample.get(data.image_field)
    if not imgs or not isinstance(imgs, list) or not all(hasattr(x, "save") for x in imgs):
        return {}
    from nanogrpo.data.images import data_uri

    return {"images": [data_uri(x) for x in imgs]}


def _merge_tool_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Several rounds' ``tools/…`` (``env/…``) metrics as one: rates and means weighted by completions
    (NaN when there is none: every group dropped), counts and times added."""
    n = sum(k for k, _ in parts)
    out: dict[str, float] = {}
    for k in parts[0][1]:
        mean = k.endswith(("_per_completion", "_per_episode", "_rate", "_mean"))
        if mean:
            out[k] = sum(c * m.get(k, 0.0) for c, m in parts if c) / n if n else float("nan")
        else:
            out[k] = sum(m.get(k, 0.0) for _, m in parts)
    return out
