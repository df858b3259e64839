"""``[watch]``: the run monitor's rules, their thresholds and windows (:mod:`nanogrpo.watch`).

Each rule has a table of its own (``[watch.entropy_collapse]`` in a file; on the command line one key,
``watch.entropy_collapse.floor=0.005``, or a YAML mapping, ``watch.entropy_collapse='{fraction: 0.05}'``;
the keys not named keep their defaults).
Windows count training steps; "the start" is the run's first ``window`` steps. Why each rule signals
what it signals: docs/guides/watching-a-run.md.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from nanogrpo.config.base import _Strict


class RewardHackingRule(_Strict):
    """The reward climbs while the accuracy does not."""

    window: int = Field(5, ge=1)
    """Steps averaged at the start and at the end of the comparison."""
    min_gain: float = Field(0.3, gt=0)
    """Rise of the mean reward since the start that counts as climbing, in units of the start's reward
    spread (the mean of ``reward_std`` over the start window; the windows' means vary by about 0.05 of
    it from noise at 128 completions a step)."""
    max_accuracy_gain: float = Field(0.02, ge=0)
    """Rise of the accuracy (a share, 0.02 = 2 points) that counts as not climbing: the training completions'
    ``accuracy`` (graded by the correctness rule whatever the reward) and, once the run has evaluated twice
    since it started, held-out ``eval/accuracy`` (latest against first): neither may have risen more."""
    max_drop: float = Field(0.15, gt=0, le=1)
    """Also fires when held-out accuracy falls this far below its best evaluation while the reward rose
    ``min_gain`` start spreads since that evaluation (learned, then exploited)."""


class OneComponentRule(_Strict):
    """One reward component carries the whole gain, and it is not the task's."""

    window: int = Field(5, ge=1)
    """Steps averaged at the start and at the end of the comparison."""
    min_gain: float = Field(0.3, gt=0)
    """Rise of the weighted total reward since the start, in units of the start's reward spread, below
    which nothing is said."""
    share: float = Field(0.8, gt=0, le=1)
    """Share of that rise one component carries (its weight x its own rise)."""
    task_rewards: list[str] = Field(default_factory=lambda: ["correctness", "env"])
    """The components that measure the task itself: one of them carrying the gain is the run working."""


class LengthLimitRule(_Strict):
    """Completions grow to the length limit."""

    window: int = Field(3, ge=1)
    """Steps averaged."""
    max_share: float = Field(0.5, gt=0, le=1)
    """Share of a step's completions cut off at ``rollout.max_new_tokens`` (``truncated_frac``) that fires."""
    min_rise: float = Field(0.25, ge=0, le=1)
    """... and by how much that share must have risen since the start (a run that starts long is not
    growing)."""


class TemplateCollapseRule(_Strict):
    """Completions collapse to one template."""

    window: int = Field(3, ge=1)
    """Steps averaged."""
    fraction: float = Field(0.5, gt=0, lt=1)
    """Fires when the distinct 4-gram ratio of the step's completions (``distinct_ngrams``) falls below
    this fraction of its value at the start."""


class EntropyCollapseRule(_Strict):
    """The policy's entropy falls to nothing."""

    window: int = Field(3, ge=1)
    """Steps averaged."""
    fraction: float = Field(0.3, gt=0, lt=1)
    """Fires when the mean per-token entropy falls below this fraction of its value at the start (a 70%
    fall: the collapse Cui et al. 2025 measure, 73% of the entropy gone in the first twelfth of a run) ...
    (read from ``sampled_nll``, the sampled tokens' mean negative log-prob over every completion of the
    step, where the run logs it; else from the trainer's ``entropy``, which sees only the groups it trains
    on)"""
    floor: float = Field(0.1, ge=0)
    """... and below this many nats per token (a start far above it, a high temperature's, must fall to it,
    not only by the fraction) ..."""
    learned: float = Field(0.1, ge=0, le=1)
    """... unless the accuracy rose at least this much since the start (training completions' or held-out,
    the larger): entropy spent on answers that became right is learning, not collapse (the tool and vision
    demos lose 70-75% of their entropy while they go from 47% to 80% and from 68% to 94% right) ..."""
    solved_accuracy: float = Field(0.95, ge=0, le=1)
    """... or the training accuracy (over the window) is at least this: a policy sure of answers that are
    right has converged."""


class SpikeRule(_Strict):
    """A metric jumps: ``hold`` steps in a row at ``factor`` x the median of the ``window`` steps before."""

    window: int = Field(10, ge=1)
    """Steps before the jump whose median is the reference (the rule waits for them)."""
    hold: int = Field(2, ge=1)
    """Steps in a row the value must stay up (a single step of a small batch's estimate is noise)."""
    factor: float = Field(10.0, gt=1)
    """How many times the reference the step's value must be."""
    min_value: float = Field(0.1, ge=0)
    """... and the least value that counts (small values jump by large factors)."""


class KlSpikeRule(SpikeRule):
    """The KL to the reference jumps (the k3 estimate of a small batch is noisy: single steps of the dialogue
    demo read 3-5x the median of the steps before, one of the tool demo's 13x)."""

    min_value: float = Field(0.1, ge=0)
    """... and the least KL per token (k3) that counts (small values jump by large factors)."""


class ClipSpikeRule(SpikeRule):
    """The clipped share of the ratio jumps."""

    factor: float = Field(4.0, gt=1)
    """How many times the reference the step's value must be."""
    min_value: float = Field(0.2, ge=0)
    """... and the least clipped share (``clip_frac``) that counts."""


class EngineDriftRule(_Strict):
    """The engine's log-probs drift from the trainer's."""

    window: int = Field(3, ge=1)
    """Steps averaged (steps with stale samples, ``staleness/max`` > 0, are left out)."""
    max_gap: float = Field(0.05, gt=0)
    """Mean |trainer log-prob - engine log-prob| per token (``logprob_gap``, nats) that fires ..."""
    factor: float = Field(3.0, ge=1)
    """... when it is also this many times the gap at the start (an engine in lower precision starts with
    a gap of its own)."""


class NoSignalRule(_Strict):
    """Every group has zero variance: nothing to learn from."""

    window: int = Field(3, ge=1)
    """Consecutive steps in which no group carried signal (``groups_kept`` = 0)."""
    solved_accuracy: float = Field(0.99, ge=0, le=1)
    """Not flagged when the accuracy is at least this: every completion right is a task solved, not a
    broken run."""


class EpisodesFailedRule(_Strict):
    """Every episode of a step failed: nothing from the environment to train on."""

    stop_after: int = Field(3, ge=0)
    """Steps in a row whose every episode failed (or none of whose groups started) that end the run, a
    checkpoint saved, its summary saying why, ``nanogrpo train`` with exit status 3 (0: the rule only flags
    them)."""


RULE_NAMES = ("reward_hacking", "one_component", "length_limit", "template_collapse", "entropy_collapse",
              "kl_spike", "clip_spike", "engine_drift", "no_signal", "episodes_failed")
"""The rules, in the order they are checked and listed (:data:`nanogrpo.watch.RULES`)."""


class WatchConfig(_Strict):
    enabled: bool = True
    """Check the rules after every step (on by default: a few list operations per step)."""
    stop_on: list[str] = Field(default_factory=list)
    """Rules that stop the run when they fire: a checkpoint of that step is saved and the run ends
    cleanly, its summary saying why, ``nanogrpo train`` with exit status 3 (e.g.
    ``watch.stop_on='["engine_drift", "entropy_collapse"]'``)."""
    off: list[str] = Field(default_factory=list)
    """Rules not checked at all (``watch.off='["template_collapse"]'``)."""
    reward_hacking: RewardHackingRule = Field(default_factory=RewardHackingRule)
    """The reward climbs while the accuracy does not: the policy found a hole in the reward."""
    one_component: OneComponentRule = Field(default_factory=OneComponentRule)
    """One reward component that is not the task's (``task_rewards``) carries the whole gain."""
    length_limit: LengthLimitRule = Field(default_factory=LengthLimitRule)
    """Completions grow to ``rollout.max_new_tokens``."""
    template_collapse: TemplateCollapseRule = Field(default_factory=TemplateCollapseRule)
    """Completions collapse to one template, whatever the prompt."""
    entropy_collapse: EntropyCollapseRule = Field(default_factory=EntropyCollapseRule)
    """The policy's entropy falls to nothing (no exploration left)."""
    kl_spike: KlSpikeRule = Field(default_factory=KlSpikeRule)
    """The KL to the reference jumps from one step to the next."""
    clip_spike: ClipSpikeRule = Field(default_factory=ClipSpikeRule)
    """The share of clipped ratios jumps (off-policy updates: several per batch, vLLM, stale batches)."""
    engine_drift: EngineDriftRule = Field(default_factory=EngineDriftRule)
    """The engine's behaviour log-probs drift from the trainer's log-probs of the same policy."""
    no_signal: NoSignalRule = Field(default_factory=NoSignalRule)
    """Every group has zero reward variance, step after step: no gradient."""
    episodes_failed: EpisodesFailedRule = Field(default_factory=EpisodesFailedRule)
    """Every episode of a step failed (timed out, raised, ...): said in one line with the key to change;
    ``stop_after`` such steps in a row end the run."""

    @model_validator(mode="after")
    def _known_rules(self) -> WatchConfig:
        for key in ("stop_on", "off"):
            bad = [n for n in getattr(self, key) if n not in RULE_NAMES]
            if bad:
                raise ValueError(f"watch.{key}: unknown rule {bad[0]!r}; the rules are "
                                 f"{', '.join(RULE_NAMES)}")
        both = sorted(set(self.stop_on) & set(self.off))
        if both:
            raise ValueError(f"watch.stop_on names {both[0]!r}, which watch.off turns off")
        return self

    def active(self) -> list[str]:
        """The rules checked: all but ``off``; none when ``enabled`` is false."""
        return [n for n in RULE_NAMES if self.enabled and n not in self.off]

    def may_stop(self) -> bool:
        """Whether a rule may end the run: one in ``stop_on``, or ``episodes_failed`` with ``stop_after``."""
        stops = "episodes_failed" in self.active() and self.episodes_failed.stop_after > 0
        return bool(self.stop_on) or stops
