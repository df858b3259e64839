"""The rules: each a pure function ``(History, settings) -> Finding | None`` in :data:`RULES`.

A rule reads the series a run already logs (plus ``truncated_frac``, ``distinct_ngrams``,
``sampled_nll`` and ``logprob_gap``, which rollouts and updates measure for it) and says, with numbers,
what went wrong and since which step; None while the run looks as it should. "The start" is a rule's first
``window`` training steps; relative rules say nothing before ``2 x window`` steps. Thresholds and
windows: :mod:`nanogrpo.config.watch`; why each rule signals what it signals:
docs/guides/watching-a-run.md.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanogrpo.config.watch import (
    ClipSpikeRule,
    EngineDriftRule,
    EntropyCollapseRule,
    EpisodesFailedRule,
    KlSpikeRule,
    LengthLimitRule,
    NoSignalRule,
    OneComponentRule,
    RewardHackingRule,
    SpikeRule,
    TemplateCollapseRule,
)
from nanogrpo.watch.episodes import failed_streak
from nanogrpo.watch.history import History, mean, median, streak_start


@dataclass
class Finding:
    """What a rule saw: at ``step``, going on ``since`` that step; ``message`` one line with the numbers."""

    rule: str
    step: int
    since: int
    message: str
    metrics: list[str]
    """The series that show it (``nanogrpo report`` plots them with the moment marked)."""
    values: dict[str, Any] = field(default_factory=dict)
    """The numbers compared (the record in ``RUN/watch.jsonl``)."""
    thresholds: dict[str, float] = field(default_factory=dict)
    """Lines worth drawing on the plot: metric -> the value the rule compared it with."""
    stop: bool = False
    """The rule's own settings end the run here (``watch.episodes_failed.stop_after``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "step": self.step, "since": self.since, "message": self.message,
                "metrics": self.metrics, "values": self.values, "thresholds": self.thresholds}


def _ends(h: History, key: str, w: int) -> tuple[float, float] | None:
    """(mean of the first ``w`` values, mean of the last ``w``) of ``key``; None before ``2 w`` values."""
    return (mean(h.first(key, w)), mean(h.last(key, w))) if h.count(key) >= 2 * w else None


def _spread(h: History, w: int) -> float:
    """The start's reward spread: the mean within-step standard deviation of the reward (never 0)."""
    return max(mean(h.first("reward_std", w)), 1e-6)


def _accuracy_change(h: History, w: int) -> tuple[float, str] | None:
    """(the accuracy's rise since the start, what it was read from): the larger of the training
    completions' ``accuracy`` (last ``w`` steps against the first ``w``) and, once the run has evaluated
    twice with the latest past the start, held-out ``eval/accuracy`` (latest against first). The larger:
    an accuracy that rose with the reward on either says the reward follows the task (held-out alone
    flat while the training prompts' accuracy rises is overfitting, and held-out is noisy)."""
    found = []
    ends = _ends(h, "accuracy", w)
    if ends is not None:
        found.append((ends[1] - ends[0], f"train accuracy {ends[0]:.1%} -> {ends[1]:.1%}"))
    ev = h.points("eval/accuracy")
    if len(ev) >= 2 and ev[-1][0] >= 2 * w:
        found.append((ev[-1][1] - ev[0][1], f"held-out accuracy {ev[0][1]:.1%} (step {ev[0][0]}) -> "
                                            f"{ev[-1][1]:.1%} (step {ev[-1][0]})"))
    if not found:
        return None
    return max(found)[0], " and ".join(text for _, text in found)


def reward_hacking(h: History, s: RewardHackingRule) -> Finding | None:
    """The mean reward rose ``min_gain`` start spreads while the accuracy rose at most ``max_accuracy_gain``:
    the policy is being paid for something that is not solving the task."""
    ends = _ends(h, "reward_mean", s.window)
    if ends is None:
        return None
    spread = _spread(h, s.window)
    gain = (ends[1] - ends[0]) / spread
    acc = _accuracy_change(h, s.window)
    if gain < s.min_gain or acc is None or acc[0] > s.max_accuracy_gain:
        return _fell_from_best(h, s, spread)
    level = ends[0] + s.min_gain * spread
    pts = h.points("reward_mean")
    return Finding("reward_hacking", pts[-1][0], streak_start(pts, lambda v: v >= level),
                   f"reward {ends[0]:.3f} -> {ends[1]:.3f} (+{gain:.1f} start spreads) while {acc[1]} "
                   f"({acc[0]:+.1%}; rule: reward +{s.min_gain:g} spreads, accuracy at most "
                   f"{s.max_accuracy_gain:+.0%})",
                   ["reward_mean", "accuracy", "eval/accuracy"],
                   {"reward_start": ends[0], "reward_now": ends[1], "gain_spreads": gain,
                    "accuracy_gain": acc[0]}, {"reward_mean": level})


def _fell_from_best(h: History, s: RewardHackingRule, spread: float) -> Finding | None:
    """The other half of :func:`reward_hacking`: held-out accuracy ``max_drop`` below its best evaluation
    while the reward rose ``min_gain`` start spreads since that evaluation (learned, then exploited)."""
    ev = [(st, v) for st, v in h.points("eval/accuracy") if st > 0]
    if len(ev) < 2:
        return None
    best_step, best = max(ev, key=lambda p: p[1])
    step, now = ev[-1]
    if best - now < s.max_drop:
        return None
    rew = h.points("reward_mean")
    at = bisect.bisect_right(rew, (best_step, math.inf))  # the reward's points up to the best evaluation
    at_best = mean([v for _, v in rew[max(at - s.window, 0):at]])
    later = mean([v for _, v in rew[-s.window:]])
    if not (later - at_best) / spread >= s.min_gain:
        return None
    return Finding("reward_hacking", rew[-1][0], best_step,
                   f"held-out accuracy fell {best:.1%} (step {best_step}) -> {now:.1%} (step {step}) while "
                   f"the reward rose {at_best:.3f} -> {later:.3f} (rule: a fall >= {s.max_drop:.0%} from the "
                   f"best with the reward +{s.min_gain:g} start spreads)",
                   ["reward_mean", "accuracy", "eval/accuracy"],
                   {"best": best, "best_step": best_step, "now": now, "reward_at_best": at_best,
                    "reward_now": later})


def one_component(h: History, s: OneComponentRule) -> Finding | None:
    """One reward component other than the task's carries ``share`` of a gain of ``min_gain`` start
    spreads: the total rises because of format, length or a judge's taste, not the task."""
    names = [n for n in h.components() if n in h.weights]
    if len(names) < 2:
        return None
    gains = {}
    for n in names:
        ends = _ends(h, f"reward/{n}", s.window)
        if ends is None:
            return None
        gains[n] = h.weights[n] * (ends[1] - ends[0])
    total = sum(gains.values())
    spread = _spread(h, s.window)
    if total < s.min_gain * spread:
        return None
    top = max(gains, key=lambda n: gains[n])
    if top in s.task_rewards or gains[top] < s.share * total:
        return None
    pts = h.points(f"reward/{top}")
    rise = gains[top] / h.weights[top]  # the component's own rise (negative under a negative weight)
    level = mean([v for _, v in pts[:s.window]]) + 0.5 * rise
    rest = ", ".join(f"{n} {g:+.3f}" for n, g in gains.items() if n != top)
    return Finding("one_component", pts[-1][0], streak_start(pts, lambda v: (v - level) * rise >= 0),
                   f"{top} carries {gains[top] / total:.0%} of the reward's gain (+{gains[top]:.3f} of "
                   f"+{total:.3f}; {rest}; rule: one component >= {s.share:.0%} of a gain >= "
                   f"{s.min_gain:g} start spreads, not one of {', '.join(s.task_rewards)})",
                   ["reward_mean"] + [f"reward/{n}" for n in names],
                   {"component": top, "gains": gains, "total_gain": total})


def length_limit(h: History, s: LengthLimitRule) -> Finding | None:
    """A share ``max_share`` of the completions are cut off at the token limit, up ``min_rise`` since the
    start: the completions grow until the limit stops them (a reward that pays for length, or lost
    stopping)."""
    ends = _ends(h, "truncated_frac", s.window)
    if ends is None or ends[1] < s.max_share or ends[1] - ends[0] < s.min_rise:
        return None
    pts = h.points("truncated_frac")
    lens = _ends(h, "completion_len_mean", s.window)
    grew = f"; mean length {lens[0]:.0f} -> {lens[1]:.0f} tokens" if lens else ""
    return Finding("length_limit", pts[-1][0], streak_start(pts, lambda v: v >= s.max_share),
                   f"{ends[1]:.0%} of completions cut off at the token limit (start {ends[0]:.0%}){grew} "
                   f"(rule: >= {s.max_share:.0%}, up >= {s.min_rise:.0%})",
                   ["truncated_frac", "completion_len_mean"],
                   {"start": ends[0], "now": ends[1]}, {"truncated_frac": s.max_share})


def template_collapse(h: History, s: TemplateCollapseRule) -> Finding | None:
    """The distinct 4-gram ratio of a step's completions fell below ``fraction`` of the start's: different
    prompts get the same text."""
    ends = _ends(h, "distinct_ngrams", s.window)
    if ends is None or ends[1] >= s.fraction * ends[0]:
        return None
    level = s.fraction * ends[0]
    pts = h.points("distinct_ngrams")
    return Finding("template_collapse", pts[-1][0], streak_start(pts, lambda v: v < level),
                   f"distinct 4-gram ratio {ends[1]:.3f}, {ends[1] / ends[0]:.0%} of the start's "
                   f"{ends[0]:.3f} (rule: below {s.fraction:.0%})",
                   ["distinct_ngrams"], {"start": ends[0], "now": ends[1]}, {"distinct_ngrams": level})


def entropy_collapse(h: History, s: EntropyCollapseRule) -> Finding | None:
    """The policy's per-token entropy fell below ``fraction`` of the start's and below ``floor`` while the
    accuracy rose less than ``learned`` and is below ``solved_accuracy``: the policy grew sure of itself
    without growing right (it samples one answer, one template; its groups stop differing and exploration
    ends). Entropy spent on answers that became right is learning (Cui et al. 2025's R = -a exp(H) + b),
    not this. Read from ``sampled_nll`` (every completion of the step) where the run logs it, else from
    the trainer's ``entropy`` (the groups it trained on: a collapsing policy leaves fewer and fewer of them,
    and none once every group agrees, when ``entropy`` is not measured at all)."""
    key = "sampled_nll" if h.count("sampled_nll") >= 2 * s.window else "entropy"
    ends = _ends(h, key, s.window)
    if ends is None:
        return None
    level = min(s.fraction * ends[0], s.floor)
    acc = mean(h.last("accuracy", s.window))
    rose = _accuracy_change(h, s.window)
    if ends[1] >= level or (acc == acc and acc >= s.solved_accuracy) or (rose is not None
                                                                        and rose[0] >= s.learned):
        return None
    pts = h.points(key)
    what = "entropy (estimated from the sampled tokens' log-probs)" if key == "sampled_nll" else "entropy"
    said = rose[1] if rose is not None and rose[0] == rose[0] else "no accuracy logged"
    return Finding("entropy_collapse", pts[-1][0], streak_start(pts, lambda v: v < level),
                   f"{what} {ends[1]:.4f} nats/token, {ends[1] / ends[0]:.0%} of the start's {ends[0]:.4f}, "
                   f"{said} (rule: below {s.fraction:.0%} of the start and {s.floor:g}, the accuracy up less "
                   f"than {s.learned:.0%} and below {s.solved_accuracy:.0%})",
                   [key, "accuracy"], {"start": ends[0], "now": ends[1], "read": key, "accuracy": acc},
                   {key: level})


def _spike(rule: str, key: str, what: str, h: History, s: SpikeRule) -> Finding | None:
    pts = h.points(key)
    if len(pts) < s.window + s.hold:
        return None
    ref = median([v for _, v in pts[-s.window - s.hold:-s.hold]])
    level = max(s.factor * ref, s.min_value)
    up = pts[-s.hold:]
    if any(v < level for _, v in up):
        return None
    now = min(v for _, v in up)
    said = f"{now / ref:.1f}x the median {ref:.4f}" if ref > 0 else f"up from {ref:.4f}, the median"
    return Finding(rule, up[-1][0], up[0][0],
                   f"{what} at least {now:.4f} for {s.hold} step(s), {said} of the {s.window} steps before "
                   f"(rule: {s.factor:g}x and at least {s.min_value:g})",
                   [key], {"reference": ref, "now": now}, {key: level})


def kl_spike(h: History, s: KlSpikeRule) -> Finding | None:
    """The KL to the reference is ``factor`` x its recent median (and at least ``min_value``): one update
    moved the policy far (a bad batch, a learning-rate spike, an engine glitch)."""
    return _spike("kl_spike", "kl", "KL to the reference", h, s)


def clip_spike(h: History, s: ClipSpikeRule) -> Finding | None:
    """The clipped share of the ratio is ``factor`` x its recent median (and at least ``min_value``): the
    update is far off-policy (stale samples, an engine that samples from another distribution)."""
    return _spike("clip_spike", "clip_frac", "clipped share", h, s)


def engine_drift(h: History, s: EngineDriftRule) -> Finding | None:
    """The mean |trainer - engine| log-prob gap per token is above ``max_gap`` (and ``factor`` x the start's):
    the tokens were sampled from a distribution the trainer does not compute (kernels, precision, a
    weight sync that did not land): the run trains off-policy without knowing it."""
    recent = 4 * s.window  # the steps looked at (a run's length costs nothing)
    stale = {step for key in ("staleness/max", "staleness") for step, v in h.points(key)[-recent:] if v > 0}
    pts = [(st, v) for st, v in h.points("logprob_gap")[-recent:] if st not in stale]
    if len(pts) < s.window:
        return None
    now = mean([v for _, v in pts[-s.window:]])
    first = _fresh_start(h, s.window)
    start = mean(first) if len(first) == s.window and h.count("logprob_gap") >= 2 * s.window else None
    level = max(s.max_gap, s.factor * start) if start is not None else s.max_gap
    if now <= level:
        return None
    tail = f", {now / start:.0f}x the start's {start:.2g}" if start else ""
    return Finding("engine_drift", pts[-1][0], streak_start(pts, lambda v: v > level),
                   f"trainer vs engine log-probs differ by {now:.3f} nats/token{tail} (rule: above "
                   f"{s.max_gap:g} and {s.factor:g}x the start)",
                   ["logprob_gap", "logprob_gap_max"], {"start": start, "now": now}, {"logprob_gap": level})


def _fresh_start(h: History, w: int) -> list[float]:
    """The first ``w`` gaps of steps without stale samples."""
    stale = {step for key in ("staleness/max", "staleness") for step, v in h.points(key) if v > 0} \
        if h.count("staleness/max") or h.count("staleness") else set()
    out = []
    for st, v in h.points("logprob_gap"):
        if st not in stale:
            out.append(v)
            if len(out) == w:
                break
    return out


def no_signal(h: History, s: NoSignalRule) -> Finding | None:
    """No group carried signal (all its rewards equal) for ``window`` steps in a row, the task unsolved:
    every advantage is 0 and the updates do nothing (a reward that no longer tells answers apart, or a
    policy that answers every prompt the same way)."""
    pts = h.points("groups_kept")
    if len(pts) < s.window or any(v > 0 for _, v in pts[-s.window:]):
        return None
    acc = mean(h.last("accuracy", s.window))
    if acc == acc and acc >= s.solved_accuracy:
        return None
    return Finding("no_signal", pts[-1][0], streak_start(pts, lambda v: v == 0),
                   f"no group with reward variance for {s.window}+ steps (accuracy {acc:.1%}; rule: "
                   f"{s.window} steps, unless accuracy >= {s.solved_accuracy:.0%})",
                   ["groups_kept", "reward_std"], {"accuracy": acc})


def episodes_failed(h: History, s: EpisodesFailedRule) -> Finding | None:
    """Every episode of the latest step failed (or none of its groups could start): nothing from the
    environment to train on (:func:`nanogrpo.watch.episodes.all_failed` says why). Fires at the first
    such step; ``stop_after`` of them in a row end the run."""
    found = failed_streak(h)
    if found is None:
        return None
    line, since, streak = found
    tail = f" ({streak} step(s) in a row; rule: {s.stop_after} in a row end the run)" if s.stop_after else ""
    return Finding("episodes_failed", h.last_step, since, line + tail, ["env/failed", "env/episodes"],
                   {"steps_in_a_row": streak}, stop=0 < s.stop_after <= streak)


READS = ("reward_mean", "reward_std", "accuracy", "eval/accuracy", "truncated_frac", "completion_len_mean",
         "distinct_ngrams", "sampled_nll", "entropy", "kl", "clip_frac", "logprob_gap", "logprob_gap_max",
         "staleness/max", "staleness", "groups_kept", "env/episodes", "env/failed", "env/groups_dropped",
         "env/prompts_too_long")
"""The metrics the rules read, besides each reward component's ``reward/<name>`` and ``env/finish/<why>``."""

Rule = Callable[[History, Any], "Finding | None"]

RULES: dict[str, Rule] = {
    "reward_hacking": reward_hacking, "one_component": one_component, "length_limit": length_limit,
    "template_collapse": template_collapse, "entropy_collapse": entropy_collapse, "kl_spike": kl_spike,
    "clip_spike": clip_spike, "engine_drift": engine_drift, "no_signal": no_signal,
    "episodes_failed": episodes_failed,
}
"""Rule name (``watch.<name>`` holds its settings) -> its function."""
