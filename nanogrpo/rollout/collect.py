"""One rollout: prompts -> G completions each -> rewards -> advantages -> a RolloutBatch.

:class:`Collector` is built once per run (engine, tokenizer, rewards, tool or environment, config) and
makes each step's batch (:meth:`Collector.collect`); the same object runs inside the trainer and inside
each ``nanogrpo rollout`` worker, only where the batch goes differs. With a tool (``tools``), each
completion is a multi-turn trajectory (:mod:`nanogrpo.rollout.turns`): the rewards see its whole text
and, in the sample dict, its ``turns`` and ``tool_calls``; the batch carries a ``loss_mask`` that leaves
the tool output out. With an environment (``env``), each completion is an episode
(:mod:`nanogrpo.episodes.play`): the sample dict carries its return (``env_reward``, the ``env``
reward), ``success`` (what ``accuracy`` counts), ``turns`` and ``turn_rewards``; the environment's
observations are left out of the loss. The step's figures are :class:`~nanogrpo.rollout.stats.RolloutStats`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from nanogrpo.algo.advantages import AGGREGATIONS, Reduce, advantages, refill_size, signal_mask, surplus_mask
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import Config, DataConfig, GrpoConfig
from nanogrpo.data import encode_prompts
from nanogrpo.engines.base import Engine, Generation, SamplingParams
from nanogrpo.rewards import RewardRunner, correctness
from nanogrpo.rewards.builtin import BUILTIN, format_name
from nanogrpo.rollout.stats import (
    RolloutStats,
    distinct_ngrams,
    example_rows,
    merge_tool_metrics,
    sampled_nll,
)


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


@dataclass
class _Step:
    """A step's completions over all its rounds (those with rows), flattened in order."""

    prompt_ids: list[list[int]]
    rows: list[dict]
    comp: list[list[int]]
    lps: list[list[float]]
    reasons: list[str]
    texts: list[str]
    samples: list[dict]
    per_function: dict[str, list[float]]
    total: list[float]
    loss_masks: list[list[bool]] | None
    """Multi-turn rollouts: per completion, the tokens the model sampled (1) and those fed to it (0)."""

    @classmethod
    def of(cls, live: list[_Round], multi: bool) -> _Step:
        names = live[0].scored.per_function
        return cls([p for r in live for p in r.prompt_ids], [row for r in live for row in r.rows],
                   [c for r in live for c in r.gen.completion_ids],
                   [lp for r in live for lp in r.gen.logprobs],
                   [f for r in live for f in r.gen.finish_reasons], [t for r in live for t in r.texts],
                   [x for r in live for x in r.samples],
                   {k: [v for r in live for v in r.scored.per_function[k]] for k in names},
                   [v for r in live for v in r.scored.total],
                   [m for r in live for m in r.gen.loss_masks] if multi else None)


class Collector:
    """A run's rollout, built once: ``engine`` samples, ``rewards`` score, ``cfg`` (the run's config) says
    how (``data``, ``rollout``, ``grpo``, the chat template, the rollout table's size; with
    ``distill.teacher`` no group is dropped: the teacher's signal is in every group). ``tools``: a
    :class:`nanogrpo.tools.runner.ToolRunner` for multi-turn rollouts; ``env``: an
    :class:`~nanogrpo.episodes.play.Episodes` (episodes with an environment). ``reduce``: several ranks
    roll out shares of one batch: sums over them for the batch-level advantage estimators and the
    refill decisions (every rank then calls :meth:`collect`, with or without rows)."""

    def __init__(self, engine: Engine, tokenizer, rewards: RewardRunner, cfg: Config, *, tools=None, env=None,
                 reduce: Reduce | None = None):
        self.engine, self.tok, self.rewards, self.cfg = engine, tokenizer, rewards, cfg
        self.tools, self.env, self.reduce = tools, env, reduce
        self.keep_all = bool(cfg.distill.teacher)
        self.multi = tools is not None or env is not None

    def collect(self, rows: list[dict], *, seed: int | None, version: int = 0,
                more=None) -> tuple[RolloutBatch | None, RolloutStats]:
        """Sample, score and package one step's groups; ``None`` when no group carries signal. ``version``:
        the policy version the batch is sampled under.

        ``more(n)``: this rank's share of the next ``n`` prompts of the (global) prompt stream, for
        ``grpo.dynamic_sampling``'s refill rounds: while fewer informative groups than this rank's share of
        ``rollout.prompts_per_step`` (its first ``rows``) are kept, on any rank, up to ``grpo.max_refills``
        more rounds are generated (every rank the same number; a rank already full draws its share and
        leaves it). The batch then keeps the first ``len(rows)`` informative groups; the rest are dropped
        and counted (``groups_surplus``). Advantages are computed over every completion generated for the
        step (so that batch-level estimators see the same population with or without refills)."""
        grpo = self.cfg.grpo
        stats = RolloutStats()
        rounds = self._rounds(rows, seed, version, more, stats)
        stats.prompts_skipped = sum(r.skipped for r in rounds)
        if self.multi:  # every round's, those whose groups were all dropped included (env/groups_dropped)
            parts = [(len(x.gen.completion_ids),
                      x.gen.tool_metrics if self.env is None else x.gen.env_metrics)
                     for x in rounds if x.gen is not None]
            if parts:
                stats.tool_metrics = merge_tool_metrics(parts)
            elif self.env is not None:  # no row on this rank: the same keys, zero (every rank merges them)
                stats.tool_metrics = self.env.metrics_of_nothing()
        live = [r for r in rounds if r.rows]
        if not live:
            if self.reduce is not None:  # the other ranks' batch-level advantages wait for this rank's share
                batch_advantages(torch.zeros(0, len(self.rewards.specs), dtype=torch.float64),
                                 self.rewards.weights, torch.zeros(0), grpo, self.reduce)
            return None, stats
        s = _Step.of(live, self.multi)
        acc = self._describe(s, live, stats)
        per_fn = torch.tensor([s.per_function[k] for k in self.rewards.specs],
                              dtype=torch.float64).T                                       # (N, F)
        trained = [sum(m) for m in s.loss_masks] if self.multi else [len(c) for c in s.comp]  # (N,)
        adv, score = batch_advantages(per_fn, self.rewards.weights,
                                      torch.tensor(trained, dtype=torch.float64), grpo, self.reduce)  # (N,)
        g = grpo.group_size
        for ex, i in zip(stats.examples, example_rows(len(s.texts), g, self.cfg.log.samples_per_step)):
            ex.update(advantage=float(adv[i]), group=i // g, finish_reason=s.reasons[i])  # the rollout table
        keep = signal_mask(score, g, grpo.min_reward_spread)                               # (groups,)
        if self.keep_all:
            keep = torch.ones_like(keep)
        if stats.refills is not None:  # dynamic sampling: the surplus past the batch is dropped, counted
            stats.groups_no_signal = int((~keep).sum())
            surplus = surplus_mask(keep, len(rows))                                        # (groups,) past it
            stats.groups_surplus = int(surplus.sum())
            keep &= ~surplus
        stats.groups_kept = int(keep.sum())
        if stats.groups_kept == 0:
            return None, stats
        return self._package(s, live, adv, keep, acc, version, stats)

    def _rounds(self, rows: list[dict], seed: int | None, version: int, more,
                stats: RolloutStats) -> list[_Round]:
        """The step's generation rounds: one, or with ``grpo.dynamic_sampling`` (and ``more``) refills while
        too few informative groups are kept on any rank (``stats.refills`` counts them)."""
        grpo = self.cfg.grpo
        rounds = [self._round(rows, seed, version)]
        if not (grpo.dynamic_sampling and more is not None):
            return rounds
        target = len(rows)
        informative = [self._informative(rounds[0])]
        while True:
            kept, made = int(sum(int(m.sum()) for m in informative)), sum(len(m) for m in informative)
            short, all_kept, all_made = self._sum([float(kept < target), float(kept), float(made)])
            if short == 0 or len(rounds) > grpo.max_refills:
                break
            n_total = self._sum([float(target)])[0]
            new_rows = more(refill_size(int(n_total), int(all_kept), int(all_made), int(n_total)))
            r_seed = None if seed is None else (seed + 1_000_003 * len(rounds)) % 2**31
            rnd = self._round(new_rows if kept < target else [], r_seed, version)
            rounds.append(rnd)
            informative.append(self._informative(rnd))
        stats.refills = len(rounds) - 1
        return rounds

    def _sum(self, values: list[float]) -> list[float]:
        return list(values) if self.reduce is None else list(self.reduce(values))

    def _params(self, seed: int | None, episodes: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, n=self.cfg.grpo.group_size, seed=seed,
                              logprob_temperature=r.logprob_temperature(),
                              support_logprobs=r.logprob_support() is not None,
                              **({"resume_after_eos": True} if episodes else {}))

    def _round(self, rows: list[dict], seed: int | None, version: int) -> _Round:
        """Encode, sample ``grpo.group_size`` completions per prompt, score them."""
        if self.env is not None:
            return self._episode_round(rows, seed, version)
        cfg, tok, g = self.cfg, self.tok, self.cfg.grpo.group_size
        spec = getattr(self.engine, "vision", None)
        images = None
        if spec is not None:  # a vision-language model: every prompt gets its images (maybe none)
            from nanogrpo.data.images import encode_with_images

            prompt_ids, skipped, images = encode_with_images(tok, rows, cfg.data, cfg.model.chat_template,
                                                             spec)
        else:  # ids of the kept rows only
            prompt_ids, skipped = encode_prompts(tok, rows, cfg.data, cfg.model.chat_template)
        skipped_set = set(skipped)
        kept_rows = [r for i, r in enumerate(rows) if i not in skipped_set]
        if not kept_rows:
            return _Round([], [], None, [], [], None, len(skipped))
        gen = generate(self.engine, tok, prompt_ids, kept_rows, self._params(seed), self.tools, images)
        if images is not None:
            gen.images = [v for v in images for _ in range(g)]  # one per completion
        texts = [tok.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
        sampled = [sum(m) for m in gen.loss_masks] if self.tools is not None else \
            [len(c) for c in gen.completion_ids]
        samples = completion_samples(kept_rows, g, gen.finish_reasons, sampled, cfg.rollout.max_new_tokens)
        if self.tools is not None:
            samples = [{**s, **info} for s, info in zip(samples, gen.infos, strict=True)]
        prompt_ids = [p for p in prompt_ids for _ in range(g)]  # one per completion
        return _Round(prompt_ids, kept_rows, gen, texts, samples, self.rewards.score(texts, samples),
                      len(skipped))

    def _episode_round(self, rows: list[dict], seed: int | None, version: int) -> _Round:
        """``grpo.group_size`` episodes per row with the environment, scored."""
        if not rows:
            return _Round([], [], None, [], [], None, 0)
        gen = self.env.generate(self.engine, self.tok, rows, self._params(seed, episodes=True),
                                version=version)
        kept_rows = [rows[i] for i in gen.kept]
        if not kept_rows:  # every group dropped: the generation stays for its env/… counts
            return _Round([], [], gen, [], [], None, len(rows))
        texts = [self.tok.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
        samples = completion_samples(kept_rows, self.cfg.grpo.group_size, gen.finish_reasons,
                                     [sum(m) for m in gen.loss_masks], self.cfg.rollout.max_new_tokens)
        samples = [{**s, **info} for s, info in zip(samples, gen.infos, strict=True)]
        return _Round(gen.prompt_ids, kept_rows, gen, texts, samples, self.rewards.score(texts, samples),
                      len(rows) - len(kept_rows))

    def _informative(self, rnd: _Round) -> torch.Tensor:
        """(groups,) bool: the round's groups whose scores (the reward aggregation's, as the advantages see
        them) do not all agree."""
        grpo = self.cfg.grpo
        if not rnd.rows:
            return torch.zeros(0, dtype=torch.bool)
        per_fn = torch.tensor([rnd.scored.per_function[s] for s in self.rewards.specs], dtype=torch.float64).T
        score = AGGREGATIONS[grpo.reward_aggregation](per_fn, torch.tensor(self.rewards.weights,
                                                                           dtype=torch.float64),
                                                      grpo.group_size, grpo.std_eps).float()  # (N,)
        return signal_mask(score, grpo.group_size, grpo.min_reward_spread)              # (groups,)

    def _describe(self, s: _Step, live: list[_Round], stats: RolloutStats) -> list[float]:
        """Fill ``stats`` with the step's figures; returns each completion's accuracy (> 0: correct)."""
        if self.env is not None:  # an episode's success (the environment's say, else a return above 0)
            acc = [1.0 if x["success"] else 0.0 for x in s.samples]
        else:
            acc = _metric_column("correctness", correctness, s.per_function, s.texts, s.samples)
        fmt_name = format_name(list(s.per_function))  # the run's own format reward (format_boxed, ...)
        fmt = _metric_column(fmt_name, BUILTIN[fmt_name], s.per_function, s.texts, s.samples) \
            if self.env is None or fmt_name in s.per_function else []
        r = torch.tensor(s.total, dtype=torch.float32)                                    # (N,)
        lens = [len(c) for c in s.comp]
        stats.reward_mean = float(r.mean())
        stats.reward_std = float(r.std()) if r.numel() > 1 else 0.0
        stats.accuracy = sum(a > 0 for a in acc) / len(acc)
        stats.format_rate = sum(f > 0 for f in fmt) / len(fmt) if fmt else float("nan")
        stats.completion_len_mean = statistics.fmean(lens)
        stats.completion_tokens = sum(lens)
        stats.num_completions = len(lens)
        stats.stop_rate = sum(f in ("stop", "done") for f in s.reasons) / len(lens)  # done: an episode's end
        stats.truncated_frac = sum(f == "length" for f in s.reasons) / len(lens)
        stats.distinct_ngrams = distinct_ngrams(s.comp, self.cfg.grpo.group_size)
        stats.sampled_nll = sampled_nll(s.lps, s.loss_masks)
        stats.reward_failures = sum(x.scored.failures for x in live)
        stats.reward_timeouts = sum(x.scored.timeouts for x in live)
        stats.reward_non_finite = sum(x.scored.non_finite for x in live)
        stats.reward_by_function = {k: statistics.fmean(v) for k, v in s.per_function.items()}
        fails: dict[str, int] = {}
        for x in live:
            for k, v in x.scored.failures_by_function.items():
                fails[k] = fails.get(k, 0) + v
        stats.reward_failures_by_function = fails
        stats.reward_model_metrics = dict(live[-1].scored.metrics)
        shown = example_rows(len(s.texts), self.cfg.grpo.group_size, self.cfg.log.samples_per_step)
        stats.examples = [{"question": s.samples[i].get("question", ""), "completion": s.texts[i],
                           "reward": s.total[i], **{k: v[i] for k, v in s.per_function.items()},
                           **_example_images(s.samples[i], self.cfg.data)} for i in shown]
        stats.groups_total = len(s.rows)
        return acc

    def _package(self, s: _Step, live: list[_Round], adv: torch.Tensor, keep: torch.Tensor, acc: list[float],
                 version: int, stats: RolloutStats) -> tuple[RolloutBatch | None, RolloutStats]:
        """The kept groups as a :class:`RolloutBatch` (agent programs that rewrote their history add rows)."""
        g = self.cfg.grpo.group_size
        idx = torch.nonzero(keep.repeat_interleave(g)).squeeze(1).tolist()
        prompts_b = [s.prompt_ids[i] for i in idx]
        comp_b, lps_b = [s.comp[i] for i in idx], [s.lps[i] for i in idx]
        masks_b = [s.loss_masks[i] for i in idx] if self.multi else None
        cut_b = [s.reasons[i] == "length" for i in idx]
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
        ids, am, cm, lp, p = pad_batch(prompts_b, comp_b, lps_b, self.tok.pad_token_id)
        lm = None
        if self.multi:
            lm = torch.zeros_like(cm)                                                  # (n, C)
            for j, m in enumerate(masks_b):
                lm[j, :len(m)] = torch.tensor(m, dtype=torch.bool)
        r = torch.tensor(s.total, dtype=torch.float32)                                 # (N,)
        batch = RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, loss_mask=lm,
                             **_images_of(live, rows_b), routes=_routes_of(live, rows_b, am, p),
                             rewards=r[rows_t], advantages=adv[rows_t],
                             group_ids=torch.tensor([i // g for i in rows_b], dtype=torch.int64),
                             old_logprobs=lp, prompt_len=p, group_size=size, policy_version=version,
                             truncated=torch.tensor(cut_b),
                             correct=torch.tensor([acc[i] > 0 for i in rows_b]),
                             meta={"ids": [str(s.rows[i // g].get("id", "")) for i in idx[::g]]})
        return batch, stats


def _routes_of(live: list[_Round], rows: list[int], am: torch.Tensor, prompt_len: int) -> torch.Tensor | None:
    """Mixture-of-experts models whose engine records routes: the experts each MoE layer chose for every
    prompt and completion token of completions ``rows``, aligned with the batch (:mod:`nanogrpo.moe.routes`);
    None otherwise."""
    if all(getattr(x.gen, "routes", None) is None for x in live):
        return None
    from nanogrpo.moe.routes import pad_routes

    per = [r for x in live for r in (x.gen.routes or [None] * len(x.gen.completion_ids))]  # per completion
    return pad_routes([per[i] for i in rows], am, prompt_len)


def _images_of(live: list[_Round], rows: list[int]) -> dict:
    """The batch's image fields for completions ``rows`` (vision-language rollouts), else nothing."""
    if live[0].gen is None or getattr(live[0].gen, "images", None) is None:
        return {}
    from nanogrpo.algo.vision import concat

    per = [v for x in live for v in x.gen.images]                              # one per completion
    pv, grid, counts = concat([(per[i].pixel_values, per[i].grid) for i in rows],
                              per[0].pixel_values.shape[1])
    return {"pixel_values": pv, "image_grid_thw": grid, "image_counts": counts}


def _example_images(sample: dict, data: DataConfig) -> dict:
    """``{"images": [PNG data URIs]}`` for a logged example whose prompt has images (``nanogrpo report``
    shows them beside the completion), else nothing."""
    imgs = sample.get(data.image_field)
    if not imgs or not isinstance(imgs, list) or not all(hasattr(x, "save") for x in imgs):
        return {}
    from nanogrpo.data.images import data_uri

    return {"images": [data_uri(x) for x in imgs]}


