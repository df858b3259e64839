"""A rollout's figures: what each step logs about the completions it sampled (rewards, accuracy, lengths,
finish reasons, diversity, the sampled tokens' log-probs), and which completions its rollout table shows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    ones of episodes (:func:`nanogrpo.episodes.play.env_metrics`)."""
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


def example_rows(n: int, group_size: int, count: int) -> list[int]:
    """Which of a step's ``n`` completions its rollout table shows: the first two of each group, group after
    group, ``count`` in all (two of one group show its advantages' contrast; several groups, several
    prompts)."""
    per = min(2, group_size)
    return [i * group_size + j for i in range(n // group_size) for j in range(per)][:count]


def merge_tool_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
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
