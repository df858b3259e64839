"""``[grpo]``: the algorithm (``nanogrpo.algo``) and the refusals of combinations that mean nothing."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from nanogrpo.algo.presets import (
    ADVANTAGE_NAMES,
    AGGREGATION_NAMES,
    IMPORTANCE_NAMES,
    KL_NAMES,
    LOSS_NAMES,
    LOSS_PRESETS,
    REDUCTION_NAMES,
)
from nanogrpo.config.base import _Strict

LossName = Literal[LOSS_NAMES]
AdvantageName = Literal[ADVANTAGE_NAMES]


class GrpoConfig(_Strict):
    """The algorithm (``nanogrpo.algo``; README "Policy-optimisation variants"). ``loss`` names a preset
    (``nanogrpo.algo.presets``) that fills every key below left unset (None); a key set explicitly
    overrides the preset. A combination that means nothing is refused at start."""

    group_size: int = Field(8, ge=2)
    beta: float = Field(0.03, ge=0)
    """KL coefficient; 0 loads no reference model at all."""
    loss: LossName = "grpo"
    """grpo | dapo | dr_grpo | bnpo | gspo | cispo | sapo."""
    advantage: AdvantageName | None = None
    """group | group_mean (Dr. GRPO) | batch_std (TRL scale_rewards="batch") | rloo | reinforce_pp
    (REINFORCE++-baseline). None: the preset's (``group_mean`` for dr_grpo; ``batch_std`` under
    ``normalize_then_sum``, which is then GDPO as TRL computes it; else ``group``)."""
    reward_aggregation: Literal[AGGREGATION_NAMES] = "sum_then_normalize"
    """Several reward functions: the weighted sum is normalised (the seed's), or each function is
    normalised within its group before the weighted sum (``normalize_then_sum``, GDPO)."""
    importance_sampling: Literal[IMPORTANCE_NAMES] | None = None
    """token (PPO / GRPO) | sequence (GSPO: the sequence's mean log-ratio). None: the preset's."""
    loss_reduction: Literal[REDUCTION_NAMES] | None = None
    """seq-mean-token-mean (grpo) | token-mean (dapo) | seq-mean-token-sum | constant (dr_grpo:
    / (completions x max_new_tokens)). None: the preset's."""
    clip_eps_low: float | None = Field(None, ge=0, lt=1)
    """None: the preset's (0.2; gspo 3e-4). Not for cispo or sapo."""
    clip_eps_high: float | None = Field(None, ge=0)
    """None: the preset's (0.2; dapo 0.28; gspo 4e-4; cispo: 5.0, its ε_max, the bound on the weight
    itself). Not for sapo."""
    clip_ratio_c: float | None = Field(None, gt=1)
    """Dual-clip PPO (verl ``clip_ratio_c``, e.g. 3): the loss of a negative-advantage token stops growing
    once its ratio passes c. None: off."""
    clip_delta: float | None = Field(None, gt=1)
    """Two-sided clipping (INTELLECT-2, TRL ``delta``): the unclipped ratio is capped at δ
    (> 1 + clip_eps_high). For negative advantages this is the same bound as ``clip_ratio_c``: set one."""
    kl_estimator: Literal[KL_NAMES] = "k3"
    """k1 | k2 | k3 (Schulman's estimators of KL(pi || ref); the seed's and TRL's k3)."""
    kl_is_weighted: bool = False
    """Multiply each token's KL by its importance ratio (DeepSeek-V3.2; TRL ``use_bias_correction_kl``)."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """sapo: the gate's temperature for positive / non-positive advantages (the paper's and TRL's)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts this times the mean per-token entropy (adaptive: its start value)."""
    entropy_target: float | None = Field(None, gt=0)
    """Adaptive entropy control (Skywork-OR1, as TRL): the bonus applies while the entropy is at or below
    this (nats), and its coefficient moves by ``entropy_coef_step`` each optimizer step within
    [``entropy_coef_min``, ``entropy_coef_max``]. None: a constant ``entropy_coef``."""
    entropy_coef_step: float = Field(0.005, gt=0)
    entropy_coef_min: float = Field(0.0, ge=0)
    entropy_coef_max: float = Field(1.0, ge=0)
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)
    """ρ < 1: the policy loss keeps only the batch's top-ρ highest-entropy tokens ("Beyond the 80/20
    rule"; the paper's 0.2). Costs one forward without gradients over the batch."""
    mask_truncated: bool = False
    """Completions the token limit cut off (finish reason ``length``) get no loss, KL or entropy (DAPO's
    overlong filtering; TRL ``mask_truncated_completions``); they still count as sequences."""
    off_policy_mask_kl: float | None = Field(None, gt=0)
    """DeepSeek-V3.2's off-policy sequence mask (TRL ``off_policy_mask_threshold``): a sequence with a
    negative advantage whose mean log(behaviour / policy) exceeds this gets no policy loss."""
    turn_reward_discount: float = Field(1.0, gt=0, le=1)
    """Multi-turn episodes (``[env]``): the episode's return is ``sum_t discount**t * r_t`` over its turns'
    rewards (t = 0 for the first turn); 1.0 sums them, below 1 an early reward counts more (an episode that
    succeeds in fewer turns scores higher). The return is one reward column; advantages are group-relative
    over episodes as for completions."""
    std_eps: float = Field(1e-4, gt=0)
    min_reward_spread: float = Field(0.01, ge=0)
    """Groups whose rewards span less than this carry no signal and are dropped."""
    updates_per_batch: int = Field(1, ge=1)
    """Passes (epochs, μ) over each rollout batch; each pass takes ``mini_batches`` optimizer steps (later
    ones are off-policy: clipped ratio). TRL ``num_iterations``, verl ``ppo_epochs``."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass over a rollout batch: its groups are cut into this many mini-batches, each
    one optimizer step normalised by its own totals (TRL ``steps_per_generation``; verl's PPO mini-batch,
    ``ppo_mini_batch_size`` = the batch / this). Each optimizer step is one policy version
    (``nanogrpo.training.schedule``)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards all agree are dropped and more prompts are generated,
    up to ``max_refills`` more rounds, until ``rollout.prompts_per_step`` informative groups are kept (the
    surplus of the last round is dropped too, and counted). False: the step trains on what is kept."""
    max_refills: int = Field(4, ge=0)
    """``dynamic_sampling``: extra generation rounds per step at most (verl ``max_num_gen_batches`` - 1); a
    step that has not filled its batch by then trains on the groups it has."""

    @model_validator(mode="after")
    def _combinations(self) -> GrpoConfig:
        _check_loss_combination(self)
        return self

    def resolved(self) -> dict[str, Any]:
        """The effective value of every preset-filled key (explicit keys win)."""
        p = LOSS_PRESETS[self.loss]
        default_adv = "batch_std" if self.reward_aggregation == "normalize_then_sum" else p.advantage
        return {"advantage": self.advantage or default_adv,
                "importance_sampling": self.importance_sampling or p.importance_sampling,
                "loss_reduction": self.loss_reduction or p.reduction,
                "clip_eps_low": p.eps_low if self.clip_eps_low is None else self.clip_eps_low,
                "clip_eps_high": p.eps_high if self.clip_eps_high is None else self.clip_eps_high}

    def eps_high(self) -> float | None:
        return self.resolved()["clip_eps_high"]


def _check_loss_combination(g: GrpoConfig) -> None:
    """One-line refusals of settings that mean nothing together (ValueError -> ConfigError)."""
    p = LOSS_PRESETS[g.loss]
    r = g.resolved()
    if p.objective != "clip":
        keys = ["clip_ratio_c", "clip_delta", "clip_eps_low"]
        keys += ["clip_eps_high"] if p.objective == "sapo" else []
        bad = [k for k in keys if getattr(g, k) is not None]
        if bad:
            what = "a soft gate, no clip" if p.objective == "sapo" else "only an upper bound on its weight " \
                "(clip_eps_high, its ε_max)"
            raise ValueError(f"grpo.{bad[0]} means nothing for grpo.loss={g.loss} ({what})")
    if r["importance_sampling"] == "sequence" and r["loss_reduction"] != "seq-mean-token-mean":
        raise ValueError(f"grpo.importance_sampling=sequence with grpo.loss_reduction={r['loss_reduction']}: "
                         "the sequence ratio is one value per completion; only seq-mean-token-mean optimises "
                         "the per-sequence objective (TRL warns likewise)")
    if g.clip_delta is not None and g.clip_ratio_c is not None:
        raise ValueError("grpo.clip_delta and grpo.clip_ratio_c are the same bound for negative advantages; "
                         "set one")
    if g.clip_delta is not None and g.clip_delta <= 1 + r["clip_eps_high"]:
        raise ValueError(f"grpo.clip_delta={g.clip_delta} must exceed 1 + clip_eps_high = "
                         f"{1 + r['clip_eps_high']:g}, or it cuts inside the clip range")
    if g.clip_ratio_c is not None and g.clip_ratio_c <= 1 + r["clip_eps_high"]:
        raise ValueError(f"grpo.clip_ratio_c={g.clip_ratio_c} must exceed 1 + clip_eps_high = "
                         f"{1 + r['clip_eps_high']:g} (dual-clip bounds ratios beyond the clip range)")
    if g.kl_is_weighted and g.beta == 0:
        raise ValueError("grpo.kl_is_weighted weighs the KL term, but grpo.beta = 0 has none")
    if g.entropy_coef_min > g.entropy_coef_max:
        raise ValueError(f"grpo.entropy_coef_min={g.entropy_coef_min} exceeds grpo.entropy_coef_max="
                         f"{g.entropy_coef_max}")
    if g.entropy_target is not None and not g.entropy_coef_min <= g.entropy_coef <= g.entropy_coef_max:
        raise ValueError(f"grpo.entropy_coef={g.entropy_coef} (the adaptive start) is outside "
                         f"[{g.entropy_coef_min}, {g.entropy_coef_max}]")
