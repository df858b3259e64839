"""Typed configuration: one source of truth for every hyperparameter.

A config is built from (lowest to highest precedence) the defaults below, an
optional TOML/YAML file, and ``section.key=value`` overrides from the command
line. Unknown keys, wrong types and out-of-range values are errors raised once,
at start, as a :class:`ConfigError` with a one-line message naming the key.

The defaults are the seed's (Qwen2.5 on GSM8K: G=8, beta=0.03, lr=1e-6,
temperature 0.9, 512 new tokens, prompts of at most 400 tokens, save every 200
steps). The embedded CPU demo that ``nanogrpo train`` runs with no arguments is
the preset ``nanogrpo/presets/demo.toml`` layered on top of these.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nanogrpo.algo.presets import (
    ADVANTAGE_NAMES,
    AGGREGATION_NAMES,
    CORRECTION_NAMES,
    IMPORTANCE_NAMES,
    KL_NAMES,
    LOSS_NAMES,
    LOSS_PRESETS,
    REDUCTION_NAMES,
)
from nanogrpo.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SEED_SYSTEM_PROMPT = (
    "You are a helpful assistant. A conversation between User and Assistant. The user asks a question, "
    "and the Assistant solves it. The Assistant first thinks about the reasoning process in the mind and "
    "then provides the user with the answer.The reasoning process and answer are enclosed within "
    "<think> </think> and<answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think><answer> answer here </answer>."
)


R1_BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT_TEMPLATES: dict[str, dict[str, str]] = {
    "think_answer": {"system_prompt": SEED_SYSTEM_PROMPT, "user_template": "{question}"},
    "r1_boxed": {"system_prompt": "", "user_template": "{question}\n" + R1_BOXED_INSTRUCTION},
    "boxed_system": {"system_prompt": R1_BOXED_INSTRUCTION, "user_template": "{question}"},
}
"""Ready prompts (``data.prompt_template``): the seed's think/answer system prompt; DeepSeek-R1's
recommendation (no system prompt, the instruction after the question; reward with ``format_boxed``);
Qwen2.5-Math's (the same instruction as the system prompt)."""
RUN_CONFIG_FILE = "config.yaml"
"""A run directory's resolved config (written at start; ``--resume`` reads it back)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    path: str = "embedded"
    """Local directory or hub id of an HF causal LM; ``embedded`` is nanogrpo's shipped tiny model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """``auto``: bfloat16 on a GPU, float32 on the CPU."""
    attn_implementation: str = "sdpa"
    device: str = "auto"
    """``auto``: ``cuda`` when available, else ``cpu``."""
    trust_remote_code: bool = False
    cpu_linear: Literal["auto", "onednn", "torch"] = "auto"
    """On the CPU in float32, linear layers run through oneDNN (``nanogrpo.models.cpu_linear``: ~2x
    MKL's sgemm on AVX-512 AMD CPUs, slower than it on AVX2 ones; same accuracy) or through
    PyTorch's default (``torch``); ``auto`` times both on this CPU, once for the trainer's shapes
    and once for the rollout engine's decode, and takes oneDNN only where it is clearly (25%) faster.
    The two differ in the last bits of a float32 result: pin one for runs that must be bit-identical
    across machines."""
    chat_template: Literal["auto", "plain"] = "auto"
    """``auto`` uses the tokenizer's chat template and fails loudly if it has none;
    ``plain`` renders ``system\\n\\nuser\\n`` text for base models."""
    lora_r: int = Field(0, ge=0)
    """LoRA rank (needs ``peft``); 0 trains all weights. With LoRA the reference log-probs come
    from the same model with its adapters disabled: no second copy."""
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lora_save_merged: bool = False
    """Checkpoints also hold the merged model (``merged/``) besides the adapter."""


class DataConfig(_Strict):
    source: str = "gsm8k"
    """A preset (``gsm8k``, ``math``, ``math500``, ``aime24``, ``aime``, ``deepscaler``, ``arithmetic``,
    ``multidigit``), a file (.jsonl/.json/.parquet/.csv), or ``hf:NAME``."""
    split: str = "train"
    eval_split: str = "test"
    eval_source: str | None = None
    """Where held-out problems come from, as ``source`` (e.g. train on ``math``, evaluate on
    ``math500``); None: ``source``."""
    question_field: str = "question"
    answer_field: str = "answer"
    """Fields of files and ``hf:`` datasets (presets know their own)."""
    answer_from: Literal["auto", "column", "boxed", "delimiter"] = "auto"
    """Where the reference is in the answer field: ``column``: all of it (MATH-500's ``answer``,
    AIME's integer); ``boxed``: the last ``\\boxed{…}`` of a full solution (MATH's ``solution``);
    ``delimiter``: after the last ``answer_delimiter`` (GSM8K's ``####``); ``auto``: ``boxed`` when
    the field holds a ``\\boxed{``, else ``delimiter`` when it holds the delimiter, else ``column``.
    A row without what the mode needs is an error naming the row, at start."""
    answer_delimiter: str | None = None
    """The delimiter of ``answer_from=delimiter``; None: ``####``."""
    hf_config: str | None = None
    prompt_template: str | None = None
    """A ready prompt by name (``think_answer``, ``r1_boxed``, ``boxed_system``: see
    ``PROMPT_TEMPLATES``); it sets ``system_prompt`` and ``user_template``, which then are not set
    by hand."""
    system_prompt: str = SEED_SYSTEM_PROMPT
    user_template: str = "{question}"
    """The user turn: ``{question}`` is replaced by the question (``"{question}\\nPlease reason step by
    step, and put your final answer within \\boxed{}."``; other braces are kept as written)."""
    few_shot: list[dict[str, str]] = Field(default_factory=list)
    """Worked examples (``question``/``answer``) rendered as earlier chat turns."""
    max_prompt_tokens: int = Field(400, gt=0)
    shuffle: bool = True
    arithmetic_train_size: int = Field(20000, gt=0)
    arithmetic_eval_size: int = Field(500, gt=0)
    """Rows of the synthetic tasks (``arithmetic``, ``multidigit``): the train split and the held-out one."""

    @model_validator(mode="before")
    @classmethod
    def _expand_prompt_template(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("prompt_template") is None:
            return data
        name = data["prompt_template"]
        if name not in PROMPT_TEMPLATES:
            raise ValueError(f"unknown prompt template {name!r} (ready ones: {', '.join(PROMPT_TEMPLATES)})")
        data = dict(data)
        for key, value in PROMPT_TEMPLATES[name].items():
            if key in data and data[key] != value:
                raise ValueError(f"data.prompt_template={name} sets data.{key}; drop one of the two")
            data[key] = value
        return data

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if "{question}" not in self.user_template:
            raise ValueError("data.user_template must contain {question}, where the question goes")
        if self.answer_delimiter is not None and self.answer_from in ("column", "boxed"):
            raise ValueError(f"data.answer_delimiter is read with data.answer_from=delimiter (or auto), "
                             f"not {self.answer_from}")
        return self


class RolloutConfig(_Strict):
    engine: Literal["auto", "hf", "fast", "vllm"] = "auto"
    """``auto``: ``fast`` when it computes the model's configuration exactly (Llama, Qwen2/2.5, Qwen3,
    Mistral, Ministral, OLMo2, SmolLM3, Phi3 families; see ``nanogrpo.rollout.fast.families``), else
    ``hf``; the choice and its reason are logged."""
    prompts_per_step: int = Field(8, gt=0)
    max_new_tokens: int = Field(512, gt=0)
    temperature: float = Field(0.9, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    tempered_logprobs: bool = False
    """False: log-probs of the untempered model distribution (the seed's convention); True: of
    ``logits / temperature``, the distribution samples are drawn from (TRL's and verl's), and with
    ``top_k`` / ``top_p`` of that distribution restricted to each position's top-k / top-p support and
    renormalised, exactly what is sampled (``nanogrpo.algo.support``). Applies to the engine's behaviour
    log-probs and the policy and reference forwards alike."""

    correction: Literal[CORRECTION_NAMES] = "none"
    """Importance weights between the trainer's log-probs and the engine's behaviour log-probs (vLLM,
    split-mode workers, stale batches): none | token_truncate (TIS) | token_mask | sequence_truncate |
    sequence_mask (TRL's ``vllm_importance_sampling_mode``). With a correction the PPO ratio is anchored
    on the trainer's own log-probs before the update and the weight pi_old / mu multiplies each token's
    policy loss (``nanogrpo.algo.corrections``)."""
    correction_max: float | None = Field(3.0, gt=0)
    """Upper bound on the weight: truncate modes clamp to it, mask modes drop what exceeds it (TRL's
    ``vllm_importance_sampling_clip_max``). None: no upper bound (mask modes then need ``correction_min``)."""
    correction_min: float | None = Field(None, ge=0)
    """Optional lower bound (TRL's ``vllm_importance_sampling_clip_min``)."""

    @model_validator(mode="after")
    def _correction_bounds(self) -> RolloutConfig:
        lo, hi = self.correction_min, self.correction_max
        if self.correction != "none" and lo is None and hi is None:
            raise ValueError(f"rollout.correction={self.correction} needs a bound: set "
                             "rollout.correction_max (or correction_min)")
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"rollout.correction_min={lo} must be below rollout.correction_max={hi}")
        return self

    def logprob_temperature(self) -> float:
        """The temperature every log-prob of a run is computed at (see ``tempered_logprobs``)."""
        return self.temperature if self.tempered_logprobs else 1.0

    def logprob_support(self) -> tuple[int, float] | None:
        """``(top_k, top_p)`` when every log-prob of the run is over each position's top-k / top-p support
        (tempered log-probs with a truncated sampler: the distribution samples are drawn from,
        ``nanogrpo.algo.support``); None: over the whole vocabulary."""
        if self.tempered_logprobs and (self.top_k > 0 or self.top_p < 1.0):
            return self.top_k, self.top_p
        return None


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


class RewardsConfig(_Strict):
    functions: list[str] = Field(default_factory=lambda: ["correctness", "format"])
    """Built-in names (``correctness``, ``format``, ``format_strict``, ``format_boxed``, ``overlong``),
    ``module:function`` or
    ``path/to/file.py:function`` (per-completion or batched, ``nanogrpo.rewards.batching``). (Python's
    API also takes callables: ``nanogrpo.rewards.entries``.)"""
    weights: list[float] | None = None
    """One weight per function; None means all 1.0."""
    timeout_s: float = Field(5.0, gt=0)
    """A reward call taking longer than this is abandoned and scored ``penalty``."""
    penalty: float = -1.0
    workers: int = Field(1, ge=0)
    """Reward worker processes (isolate hangs and crashes); 0 runs rewards in-process."""
    chunk_size: int = Field(0, ge=0)
    """Rows per call of a batched reward that names no ``chunk_size`` of its own; 0: the whole rollout
    batch in one call. Chunks of one batch run in parallel over the workers."""
    batch_timeout_s: float = Field(60.0, gt=0)
    """A batched reward's call (one chunk) taking longer than this is abandoned and its rows scored
    ``penalty`` (a function may name its own: ``@batched(timeout_s=...)``)."""
    rm_device: str = "auto"
    """Where an ``rm:`` reward model runs: a torch device (``cuda:1``, ``cpu``); ``auto``: the
    trainer's device (``model.device``; in split mode the rollout worker's)."""
    rm_batch_tokens: int = Field(16384, gt=0)
    """Padded tokens per reward-model forward (rows x longest row, rows sorted by length)."""
    rm_scale: Literal["none", "zscore"] = "none"
    """``zscore``: a reward model's scores become ``(s - mean) / std`` over the rollout batch before the
    weights apply (puts an unbounded logit on the scale of the rule rewards beside it)."""
    judge_model: str | None = None
    """The model a ``judge:URL`` reward asks; None: the first one ``URL/models`` lists."""
    judge_template: str = "correct"
    """The judge's prompt: ``correct`` (is the answer right, given the reference? yes/no), ``rate`` (1-10),
    or a template file with ``{completion}``, ``{question}``, ``{answer}`` and any sample field
    (``nanogrpo.rewards.judge_prompts``)."""
    judge_score: Literal["auto", "yes_no", "number"] = "auto"
    """How a reply is read: ``yes_no`` (1 / 0) or ``number`` (in ``judge_range``); ``auto``: the
    template's own (a file: ``number``)."""
    judge_range: tuple[float, float] = (1.0, 10.0)
    """A ``number`` score outside it is unparseable (scored ``penalty``, counted)."""
    judge_concurrency: int = Field(16, ge=1)
    """Requests in flight at once."""
    judge_timeout_s: float = Field(60.0, gt=0)
    """One request; past it (or on 429 / 5xx / a failed connection) it is retried with backoff."""
    judge_retries: int = Field(4, ge=0)
    judge_deadline_s: float = Field(300.0, gt=0)
    """A batch's requests end here, retries included: rows without a reply score ``penalty``."""
    judge_max_tokens: int = Field(64, ge=1)
    judge_request: dict[str, Any] = Field(default_factory=dict)
    """Extra fields of the request body (``{top_p = 1}``); a null value removes a default field
    (``{max_tokens = null, max_completion_tokens = 512}``)."""
    judge_api_key_env: str = "NANOGRPO_JUDGE_API_KEY"
    """Environment variable holding the judge's API key (unset: no key is sent); never the key itself."""
    judge_cache: str = "auto"
    """``auto``: ``RUN/judge_cache.sqlite`` (a resumed run or a repeated completion is not asked twice;
    in memory where there is no run directory, e.g. a rollout worker); ``memory``; ``off``; or a file."""
    truncated_correct: bool = True
    """Whether the built-in ``correctness`` credits a completion the token limit cut off
    (``finish_reason == "length"``). True (the seed): it is read like any other. False: it scores
    -1 whatever it says (DAPO's overlong filtering), so answers that never finish earn nothing."""
    overlong_buffer: int | None = Field(None, gt=0)
    """The built-in ``overlong`` reward (DAPO's soft overlong punishment): its penalty ramps from 0 to
    -``overlong_penalty`` over the last this many tokens before ``rollout.max_new_tokens``. None: a fifth
    of the limit (DAPO: 4,096 of 20,480)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The built-in ``overlong``'s penalty at the token limit (verl's ``penalty_factor``)."""

    @model_validator(mode="after")
    def _weights_match(self) -> RewardsConfig:
        if not self.functions:
            raise ValueError("rewards.functions is empty: name at least one reward")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(
                f"rewards.weights has {len(self.weights)} entries but rewards.functions has "
                f"{len(self.functions)}"
            )
        return self

    def resolved_weights(self) -> list[float]:
        return list(self.weights) if self.weights is not None else [1.0] * len(self.functions)


DEFAULT_PRELOAD = ["math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools",
                   "collections", "random", "re", "string", "json", "datetime", "heapq", "bisect", "operator"]


class ToolsConfig(_Strict):
    """Multi-turn rollouts with a tool (``nanogrpo.tools``, ``nanogrpo.rollout.turns``): the model's
    turn ends when it closes a tool call, the sandbox runs it, the output is appended as context
    (never trained on) and the model continues."""

    enabled: bool = False
    protocol: Literal["code", "hermes"] = "code"
    """``code``: ``<code>…</code>`` answered by ``<output>…</output>``; ``hermes``: Qwen/Hermes
    ``<tool_call>{json}</tool_call>`` answered by a ``<tool_response>`` turn
    (``nanogrpo.tools.protocols``)."""
    function: str = "python"
    """The tool, ``fn(call: str, sample: dict) -> str``: ``python`` (the built-in interpreter) or
    ``module:function`` / ``path/to/file.py:function``. It runs in the sandbox either way."""
    name: str = "python"
    """``hermes``: the tool's name in the call's JSON."""
    argument: str = "code"
    """``hermes``: the argument whose (string) value the tool receives."""
    max_turns: int = Field(4, ge=1)
    """Tool calls a trajectory may make; a call past it ends the trajectory, not run
    (finish reason ``max_turns``). ``rollout.max_new_tokens`` bounds the tokens the model samples
    over all its turns."""
    max_output_tokens: int = Field(256, gt=0)
    """Tokens of tool output shown to the model per call (the rest is cut and marked)."""
    timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit per call (the CPU-time limit is about the same)."""
    memory_mb: int = Field(512, ge=64)
    """Address-space limit of a call's process."""
    file_mb: int = Field(8, ge=0)
    """Largest file a call may write (in its throwaway working directory)."""
    max_output_bytes: int = Field(16384, gt=0)
    """Bytes a call may print before it is stopped (its output cut, the status ``overflow``)."""
    workers: int = Field(2, ge=1)
    """Calls run at once."""
    preload: list[str] = Field(default_factory=lambda: list(DEFAULT_PRELOAD))
    """Modules the sandbox imports once, before forking the calls (a call imports others itself,
    which fails where the sandbox cannot read them: add e.g. ``numpy``, ``sympy``)."""
    sample_fields: list[str] = Field(default_factory=list)
    """Fields of the prompt's dataset row a custom tool receives as its ``sample`` (default none:
    the reference answer never enters the sandbox). The built-in ``python`` tool receives none. A
    tool that runs the model's code in its own process hands that code all it was given."""
    require_isolation: bool = False
    """Refuse to start unless the kernel gives the calls their own network and PID namespaces,
    Landlock and the seccomp filter (see ``nanogrpo.tools.sandbox`` for what each layer holds)."""

    @model_validator(mode="after")
    def _fields_for_custom_tools(self) -> ToolsConfig:
        if self.sample_fields and self.function.strip() == "python":
            raise ValueError("tools.sample_fields is for a custom tool: the built-in python tool runs the "
                             "model's code, which would read them (e.g. the answer); leave it empty")
        return self


class TrainConfig(_Strict):
    steps: int = Field(1000, ge=0)
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, gt=0)
    """Sequences per forward/backward; gradients accumulate over the step's micro-batches."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Token budget per micro-batch (rows x padded length), rows length-sorted; 0: by
    ``micro_batch_size`` only, which stays the cap on rows either way."""
    logprob_chunk: int = Field(1024, gt=0)
    """Completion tokens per chunk of the fused LM-head + log-softmax (one (chunk, vocab) float32 buffer)."""
    save_every: int = Field(200, ge=0)
    """0: only the final checkpoint (and step_0)."""
    save_every_updates: int = Field(0, ge=0)
    """Also checkpoint every this many optimizer steps (policy versions) inside a step, between the
    optimizer steps of one rollout batch (``grpo.mini_batches`` x ``updates_per_batch`` > 1), as
    ``step_N_update_U`` with the batch itself: a run killed there resumes at that update, exactly. Only
    the newest such checkpoint is kept. 0: checkpoints at step boundaries only (``save_every``)."""
    seed: int = 0
    out: str = "runs/nanogrpo"
    gradient_checkpointing: bool = False
    share_prefix: bool = True
    """Run each distinct prompt once per micro-batch in the policy and reference forwards (its G
    samples read its keys/values); same log-probs and gradients. Not applied under gradient
    checkpointing, nor on the fsdp2 and deepspeed backends (see ``nanogrpo.training.distributed``)."""
    autocast: bool = False
    """bf16 autocast for forward/backward while weights, gradients and optimizer state stay float32."""
    optimizer_offload: bool = False
    """Keep float32 master weights and AdamW moments in CPU memory (the seed's ZeRO CPU offload)."""
    backend: Literal["single", "ddp", "fsdp2", "deepspeed"] = "single"
    """``ddp``/``fsdp2`` under ``torchrun``, ``deepspeed`` under the ``deepspeed`` launcher."""
    zero_stage: int = Field(2, ge=1, le=3)
    """DeepSpeed ZeRO stage (backend ``deepspeed``)."""
    fsdp_cpu_offload: bool = False
    """FSDP2: sharded parameters, gradients and optimizer state on the CPU (``CPUOffloadPolicy``)."""


class EvalConfig(_Strict):
    n: int = Field(200, gt=0)
    max_new_tokens: int | None = None
    """None: same as rollout.max_new_tokens."""
    batch_size: int = Field(64, gt=0)
    """Prompts per generation call."""
    every: int = Field(0, ge=0)
    """Evaluate on ``data.eval_split`` every this many training steps (and at the last step); 0: never."""
    k: int = Field(1, ge=1)
    """Samples per problem: 1 is greedy pass@1; >1 samples at ``temperature`` for pass@k and maj@k."""
    temperature: float | None = Field(None, gt=0)
    """Sampling temperature when ``k > 1``; None: same as rollout.temperature."""
    seed: int = 1234
    """Sampling seed for ``k > 1`` (fixed, so that evaluations of different steps compare)."""


class LogConfig(_Strict):
    tensorboard: bool = True
    """TensorBoard event files in ``RUN/tb``."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``pip install wandb``)."""
    wandb_project: str = "nanogrpo"
    wandb_run_name: str | None = None
    samples_every: int = Field(10, ge=0)
    """Log sample completions (text + reward breakdown) every this many steps; 0: never."""


class ServerConfig(_Strict):
    """Split mode: ``nanogrpo serve`` / ``nanogrpo rollout`` / ``nanogrpo train --server``."""

    publish_every: int = Field(1, ge=1)
    """The trainer publishes its weights to the server every this many optimizer steps (policy versions;
    between the mini-batches of one batch too)."""
    max_staleness: int = Field(4, ge=0)
    """Batches generated more than this many policy versions ago are dropped (and counted)."""
    queue_size: int = Field(16, gt=0)
    """Batches the server holds (awaiting reference log-probs, ready, or delivered and not yet
    acknowledged); beyond it uploads get 503."""
    token_file: str | None = None
    """File holding the shared token (else the NANOGRPO_TOKEN environment variable; never a flag)."""
    timeout_s: float = Field(60.0, gt=0)
    """Clients: per-request timeout; retries with backoff give up after ``retry_for_s``."""
    retry_for_s: float = Field(600.0, gt=0)
    lease_s: float = Field(60.0, gt=0)
    """Server: a batch delivered to a trainer rank goes back in the queue (same id, delivered again) if the
    rank does not acknowledge it within this many seconds after receiving it (the rank died, or its
    connection did); the rank acknowledges as soon as the batch is safe in its run directory."""
    max_version_step: int = Field(1000, ge=1)
    """Server: how far one publish may move the policy version forward (the trainer moves it by
    ``publish_every`` optimizer steps); a larger jump is refused."""


class VllmConfig(_Strict):
    """``rollout.engine=vllm``: vLLM in the trainer's (or a rollout worker's) own process, its weights
    pushed in place after every update (``nanogrpo.rollout.vllm_engine``). Needs the ``vllm`` extra."""

    max_model_len: int = Field(0, ge=0)
    """Longest prompt + completion vLLM holds; 0: ``data.max_prompt_tokens`` + the longest of
    ``rollout.max_new_tokens`` and ``eval.max_new_tokens``, + with tools on ``tools.max_turns`` tool
    outputs with their wrapping (at most the model's positions)."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """GPU: share of the device's memory vLLM takes for weights and KV cache. Beside the trainer it
    must leave room for the update; a ``nanogrpo rollout`` worker alone on its GPU can take ~0.9.
    Not used when ``kv_cache_gib`` is set, nor on the CPU."""
    kv_cache_gib: float = Field(0.0, ge=0)
    """KV cache size; 0: on a GPU from ``gpu_memory_utilization``, on the CPU room for one rollout
    (``rollout.prompts_per_step`` x ``grpo.group_size`` sequences of ``max_model_len`` tokens)."""
    enforce_eager: bool | None = None
    """None: eager on the CPU (vLLM compiles nothing there), CUDA graphs on a GPU."""
    sleep_mode: bool = False
    """GPU only: between generate calls vLLM moves its weights to CPU memory and frees its KV cache
    (vLLM sleep level 1), leaving the GPU to the update; it wakes for the next rollout."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine spans. Only 1 is supported in-process (vLLM runs tensor-parallel workers as
    separate processes, which the in-memory weight sync does not reach): use split mode instead."""
    max_num_seqs: int = Field(0, ge=0)
    """Sequences decoded at once; 0: vLLM's default."""
    enable_prefix_caching: bool = True
    """Reuse the keys and values of a prompt across its samples (reset at every weight load); in
    multi-turn (tool) rollouts each turn re-sends the trajectory's whole context, and the cache makes
    that cost the new tokens only."""
    llm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further ``vllm.LLM`` arguments, passed as given (e.g. ``{quantization = "fp8"}``)."""


class Config(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        g, r = self.grpo, self.rollout
        if g.mini_batches > r.prompts_per_step:
            raise ValueError(f"grpo.mini_batches={g.mini_batches} cuts a batch of rollout.prompts_per_step="
                             f"{r.prompts_per_step} groups into more mini-batches than it has groups")
        buf = self.rewards.overlong_buffer
        if buf is not None and buf > r.max_new_tokens:
            raise ValueError(f"rewards.overlong_buffer={buf} is longer than rollout.max_new_tokens="
                             f"{r.max_new_tokens}: the punishment would start before the first token")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def load(cls, source: str | Path | None = None, overrides: Overrides = ()) -> Config:
        """From a TOML/YAML/JSON file or the name of a shipped preset (``demo``, ``demo-tools``);
        None: the demo preset, as ``nanogrpo train`` with no ``--config``. ``overrides`` as on the
        command line (``["train.steps=2"]``) or as a dict (``{"train.steps": 2}``)."""
        return config_from(source, overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], overrides: Overrides = ()) -> Config:
        """From nested sections (``{"train": {"steps": 2}}``; dotted keys, ``{"train.steps": 2}``, too)
        over the defaults (the seed's), then ``overrides``; checked like a file (unknown keys and bad
        values are a :class:`ConfigError`)."""
        sections = _copy_sections({k: v for k, v in data.items() if "." not in str(k)}, "the dict")
        _apply_overrides(sections, {k: v for k, v in data.items() if "." in str(k)})
        return _validate(_apply_overrides(sections, overrides),
                         "a dict" + (" + overrides" if overrides else ""))

    def with_overrides(self, overrides: Overrides) -> Config:
        """A new config: this one with ``overrides`` applied (this one is left as it is)."""
        return Config.from_dict(self.to_dict(), overrides)


# --------------------------------------------------------------------------- loading


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown extension {path.suffix!r} "
                              "(use .toml, .yaml or .json)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        first = str(e).splitlines()[0]
        raise ConfigError(f"config file {path} is malformed: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a table of sections, "
                          f"got {type(data).__name__}")
    return data


def preset_path(name: str) -> Path:
    """Path of a config shipped inside the package (``nanogrpo/presets/NAME.toml``)."""
    return Path(str(resources.files("nanogrpo") / "presets" / f"{name}.toml"))


def _parse_value(raw: str) -> Any:
    if raw.lstrip().startswith("#"):  # YAML would read it as a comment (None): e.g. answer_delimiter=####
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _known_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``section.key=value`` override to a nested dict, in place."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    key, raw = item.split("=", 1)
    set_key(data, key, _parse_value(raw), item)


def set_key(data: dict[str, Any], key: str, value: Any, item: str | None = None) -> None:
    """Set ``section.key`` of a nested dict to ``value``, in place (``item`` names it in errors)."""
    item = item if item is not None else f"{key}={value!r}"
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key {key!r} must be section.key (e.g. grpo.beta=0.04)")
    section, name = parts
    fields = Config.model_fields
    if section not in fields:
        hint = difflib.get_close_matches(section, list(fields), n=1)
        raise ConfigError(
            f"unknown config section {section!r} in override {item!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    data.setdefault(section, {})
    if not isinstance(data[section], dict):
        raise ConfigError(f"config section {section!r} must be a table")
    data[section][name] = value


Overrides = Union[Sequence[str], Mapping[str, Any]]
"""``["section.key=value", ...]`` (values read as YAML, as on the command line) or
``{"section.key": value}`` (values taken as they are)."""


def _apply_overrides(data: dict[str, Any], overrides: Overrides | None) -> dict[str, Any]:
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_key(data, str(key), value)
    elif isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'section.key=value' strings or a dict, not the "
                          f"string {overrides!r}")
    else:
        for item in overrides or ():
            apply_override(data, item)
    return data


def _copy_sections(data: Any, origin: str) -> dict[str, Any]:
    """A copy of ``data`` deep enough that overrides do not write into the caller's dicts."""
    if isinstance(data, Config):
        return data.to_dict()
    if not isinstance(data, Mapping):
        raise ConfigError(f"config from {origin}: expected a mapping of sections, got {type(data).__name__}")
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _format_validation_error(e: ValidationError, origin: str) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        parts = [str(x) for x in err["loc"]]
        model: type[BaseModel] = Config
        for p in parts[:-1]:
            ann = model.model_fields.get(p)
            sub = getattr(ann, "annotation", None)
            if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
                break
            model = sub
        hint = difflib.get_close_matches(parts[-1], _known_keys(model), n=1)
        return f"unknown config key {loc!r} in {origin}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    msg = err["msg"]
    if err["type"] == "value_error":  # our own validators: their message names the key already
        return f"{msg.removeprefix('Value error, ')} (in {origin})"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"bad config value for {loc!r} in {origin}: {msg}{more}"


def load_config(path: str | Path | None = None, overrides: Overrides | None = None,
                preset: str | None = None) -> Config:
    """Build a validated :class:`Config` from an optional preset, file and overrides."""
    data: dict[str, Any] = {}
    origins = []
    if preset is not None:
        data = _read_file(preset_path(preset))
        origins.append(f"preset {preset}")
    if path is not None:
        file_data = _read_file(Path(path))
        for section, values in file_data.items():
            if isinstance(values, dict) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
        origins.append(str(path))
    _apply_overrides(data, overrides)
    if overrides:
        origins.append("overrides")
    return _validate(data, " + ".join(origins) or "defaults")


def _validate(data: dict[str, Any], origin: str) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, origin)) from None


def presets() -> list[str]:
    """Names of the configs shipped inside the package."""
    return sorted(p.name[:-5] for p in resources.files("nanogrpo").joinpath("presets").iterdir()
                  if p.name.endswith(".toml"))


def config_from(source: str | Path | None = None, overrides: Overrides = ()) -> Config:
    """The config a command starts from: ``source`` is a TOML/YAML/JSON file or, when no such file
    exists, the name of a shipped preset; None is the demo preset. ``overrides`` apply on top."""
    if source is None:
        return load_config(preset="demo", overrides=overrides)
    if not Path(source).exists() and preset_path(str(source)).is_file():
        return load_config(preset=str(source), overrides=overrides)
    return load_config(source, overrides)


def save_config(cfg: Config, path: Path) -> None:
    """Write atomically (a temporary file renamed over ``path``): a reader, e.g. another rank
    resuming the run, sees the old file or the new one, never a half-written one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)
