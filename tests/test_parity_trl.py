"""nanogrpo's advantages, loss and gradients against TRL 1.16's own ``GRPOTrainer``, on identical tensors.

For every variant TRL has, a real ``GRPOTrainer`` is built around a tiny random-init Qwen2 in
float64 and runs its own code: ``_generate_and_score_completions`` (with generation replaced by
fixed completions and, for the vLLM importance-sampling modes, fixed sampling log-probs: that
function then computes the advantages, the truncation mask, the old and reference log-probs and
the importance weights exactly as in training) and ``_compute_loss`` followed by ``backward()``.

One substitution: TRL's fused log-prob kernel accumulates in float32 whatever the model's dtype,
so its log-probs carry ~1e-7 errors that the loss's cancellations (advantages summing to zero)
magnify past 1e-6. The float64 comparisons therefore give the trainer's
``_get_per_token_logps_and_entropies`` a plain float64 log-softmax of the same model's logits
(:func:`_exact_logps`); everything downstream (advantages, masks, importance weights, the loss
and its gradient) is TRL's code. One case runs TRL's own kernel unchanged, within float32's
precision (:func:`test_trls_own_float32_kernel_agrees_to_its_precision`). Likewise Qwen2's RMSNorm
normalises in float32 whatever its input, which would leave every forward (TRL's and nanogrpo's, on
different batch shapes) at float32 rounding: in this module it keeps its input's dtype.
nanogrpo's :func:`~nanogrpo.training.step.policy_update` then runs on a model with the same weights
and a batch holding the same tensors (in two micro-batches, where TRL takes one); the loss and every
parameter's gradient must agree within 1e-6 relative. Off-policy cases perturb the weights between
generation and the update, so the ratio moves off 1 and the clip binds both ways (checked); one
group has zero reward variance; three completions are cut by the token limit.

Needs ``trl==1.16.0`` (the ``dev`` extra installs it). Where it is absent the module skips, except
when ``NANOGRPO_REQUIRE_TRL=1`` (set by ``.ci/run``): then its absence is a failure.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch

if os.environ.get("NANOGRPO_REQUIRE_TRL") == "1":
    import trl  # CI installed the dev extra: a missing trl is a failure
else:
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[dev]' pins trl==1.16.0)")
if trl.__version__ != "1.16.0":
    pytest.skip(f"the parity tests check TRL 1.16.0's code, found trl {trl.__version__}",
                allow_module_level=True)

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from nanogrpo.algo.advantages import advantages  # noqa: E402
from nanogrpo.batch import RolloutBatch  # noqa: E402
from nanogrpo.config import load_config  # noqa: E402
from nanogrpo.models.tiny import make_model, make_tokenizer  # noqa: E402
from nanogrpo.rollout.collect import batch_advantages  # noqa: E402
from nanogrpo.training.distributed import Backend  # noqa: E402
from nanogrpo.training.step import batch_logprobs, policy_update  # noqa: E402

pytestmark = pytest.mark.slow

TOK = make_tokenizer()
G, C = 4, 6                                   # group size, max_completion_length
PROMPTS = [[5, 6, 7], [8, 9, 30], [10, 11, 12]]  # equal lengths: TRL's forward takes no position ids
LENGTHS = [6, 3, 6, 2, 4, 6, 1, 5, 6, 6, 3, 2]   # rows 2, 5, 8 end without EOS at the limit: truncated
# per-function rewards (N, 2); group 1 has zero variance; dyadic: exact in float32, as TRL holds rewards
R = [[1.0, 0.5], [0.0, 0.5], [1.0, -1.0], [0.0, 0.0],
     [0.25, 0.125], [0.25, 0.125], [0.25, 0.125], [0.25, 0.125],
     [2.0, 1.0], [-1.0, 0.0], [0.5, 1.0], [1.5, -0.5]]
WEIGHTS = [1.0, 0.5]


def _completions() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(3, len(TOK), (n,), generator=g).tolist()
        if n < C or i % 3 == 0:
            ids[-1] = TOK.eos_token_id
        out.append(ids)
    return out


COMPLETIONS = _completions()
TRUNCATED = [ids[-1] != TOK.eos_token_id for ids in COMPLETIONS]
assert sum(TRUNCATED) == 3


def _reward(k: int):
    def fn(prompts, completions, **kw):
        return [R[i][k] for i in range(len(prompts))]
    fn.__name__ = f"reward_{k}"
    return fn


@contextmanager
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # TRL's rewards and advantages are built in the default dtype
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module", autouse=True)
def _float64_norms():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Qwen2RMSNorm, "forward", _rms_norm_in_input_dtype)
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    make_model("tiny", TOK, seed=1, dtype=torch.float64).save_pretrained(d / "model")
    TOK.save_pretrained(d / "model")
    return d


def _exact_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                 compute_entropy=False, compute_aux_loss=False, **kw):
    """``GRPOTrainer._get_per_token_logps_and_entropies`` in float64: the model's own logits, log-softmax."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits          # (B, L, V)
    lp = (logits[:, -logits_to_keep - 1:-1] / self.temperature).log_softmax(-1)         # (B, C, V)
    logps = lp.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)            # (B, C)
    return logps, (-(lp.exp() * lp).sum(-1) if compute_entropy else None), None


def _trainer(model_dir, exact: bool = True, **kw) -> GRPOTrainer:
    base = dict(output_dir=str(model_dir / "trl"), per_device_train_batch_size=len(LENGTHS),
                num_generations=G, max_completion_length=C, report_to=[], use_cpu=True, bf16=False, beta=0.04,
                use_bias_correction_kl=False, loss_type="grpo", gradient_checkpointing=False,
                save_strategy="no", logging_steps=1, reward_weights=WEIGHTS,
                model_init_kwargs={"dtype": torch.float64})
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(**base)
        tr = GRPOTrainer(model=str(model_dir / "model"), reward_funcs=[_reward(0), _reward(1)], args=args,
                         train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c"]}), processing_class=TOK)
    tr.current_gradient_accumulation_steps = 1
    if exact:
        tr._get_per_token_logps_and_entropies = _exact_logps.__get__(tr)
    return tr


def _perturb(model, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _sampling_logprobs() -> list[list[float]]:
    """The "vLLM" log-probs: the old policy's, moved by up to ±0.6 nats per token (set per case below)."""
    g = torch.Generator().manual_seed(5)
    return [(torch.rand(len(c), generator=g, dtype=torch.float64) * 1.2 - 0.6).tolist() for c in COMPLETIONS]


def _generate_and_score(tr: GRPOTrainer, vllm: bool, old_model=None) -> dict:
    """TRL's own ``_generate_and_score_completions`` with generation replaced by the fixed completions."""
    sampling = None
    if vllm:  # behaviour log-probs = the generating policy's plus a known mismatch
        tr.use_vllm = True
        with torch.no_grad():
            ids = torch.tensor([PROMPTS[i // G] + c + [TOK.pad_token_id] * (C - len(c))
                                for i, c in enumerate(COMPLETIONS)])
            logits = old_model(input_ids=ids).logits[:, len(PROMPTS[0]) - 1:-1].log_softmax(-1)
            lp = logits.gather(-1, ids[:, len(PROMPTS[0]):, None])[..., 0]
        sampling = [(lp[i, :len(c)] + torch.tensor(d)).tolist()
                    for i, (c, d) in enumerate(zip(COMPLETIONS, _sampling_logprobs()))]

    def generate(prompts):
        n = len(COMPLETIONS)
        return [PROMPTS[i // G] for i in range(n)], COMPLETIONS, None, ["x"] * n, sampling, {}, None, []

    tr._generate = generate
    tr.model.train()
    with _float64():
        rows = [{"prompt": "abc"[i // G]} for i in range(len(COMPLETIONS))]
        return tr._generate_and_score_completions(rows)


class _GradTap(Backend):
    """The single-process backend, but the step keeps the gradients instead of applying them."""

    grads: dict[str, torch.Tensor]

    def clip_and_step(self, max_norm: float) -> float:
        self.grads = {k: p.grad.clone() for k, p in self.module.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad()
        return 0.0


def _batch(inputs: dict, behaviour: torch.Tensor) -> RolloutBatch:
    p = inputs["prompt_ids"].shape[1]
    cm = torch.tensor([[j < len(c) for j in range(C)] for c in COMPLETIONS])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"].bool(), cm], 1).to(torch.int8)
    return RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=torch.zeros(len(cm)),
                        advantages=inputs["advantages"], group_ids=torch.arange(len(cm)) // G,
                        old_logprobs=behaviour, prompt_len=p, group_size=G,
                        ref_logprobs=inputs.get("ref_per_token_logps"), truncated=torch.tensor(TRUNCATED))


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str, rel: float = 1e-6) -> float:
    """max |ours - TRL| / max |TRL| (asserted <= ``rel``), returned."""
    scale = float(theirs.abs().max())
    err = float((ours - theirs).abs().max())
    assert err <= rel * scale + 1e-14, f"{what}: max |ours - TRL| = {err:.3e} against max |TRL| = {scale:.3e}"
    return err / scale if scale > 0 else err


@dataclass
class Case:
    trl: dict
    ours: list[str]
    vllm: bool = False
    clips: tuple[str, ...] = ("low", "high")
    """Off-policy: TRL's clip metrics that must be non-zero (the clip binds both ways)."""
    extra: dict = field(default_factory=dict)


IS = {"vllm_importance_sampling_clip_max": 1.5, "vllm_importance_sampling_clip_min": 0.7}
IS_OURS = ["rollout.correction_max=1.5", "rollout.correction_min=0.7"]
CASES = {
    "grpo": Case({"loss_type": "grpo"}, ["grpo.loss=grpo"]),
    "bnpo": Case({"loss_type": "bnpo"}, ["grpo.loss=bnpo"]),
    "dr_grpo": Case({"loss_type": "dr_grpo"}, ["grpo.loss=dr_grpo"]),
    "dapo": Case({"loss_type": "dapo", "epsilon_high": 0.28}, ["grpo.loss=dapo"]),
    "cispo": Case({"loss_type": "cispo", "epsilon_high": 1.25},
                  ["grpo.loss=cispo", "grpo.clip_eps_high=1.25"], clips=("cispo",)),
    "sapo": Case({"loss_type": "sapo"}, ["grpo.loss=sapo"], clips=()),
    "gspo": Case({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4,
                  "epsilon_high": 4e-4}, ["grpo.loss=gspo"]),
    "delta": Case({"loss_type": "grpo", "delta": 1.3}, ["grpo.clip_delta=1.3"]),
    "mask_truncated": Case({"mask_truncated_completions": True}, ["grpo.mask_truncated=true"]),
    "top_entropy_quantile": Case({"top_entropy_quantile": 0.3}, ["grpo.top_entropy_quantile=0.3"]),
    "entropy_coef": Case({"entropy_coef": 0.05}, ["grpo.entropy_coef=0.05"]),
    "token_truncate": Case({"vllm_importance_sampling_mode": "token_truncate", **IS},
                           ["rollout.correction=token_truncate", *IS_OURS], vllm=True),
    "token_mask": Case({"vllm_importance_sampling_mode": "token_mask", **IS},
                       ["rollout.correction=token_mask", *IS_OURS], vllm=True),
    "sequence_truncate": Case({"vllm_importance_sampling_mode": "sequence_truncate", **IS},
                              ["rollout.correction=sequence_truncate", *IS_OURS], vllm=True),
    "sequence_mask": Case({"vllm_importance_sampling_mode": "sequence_mask",
                           "vllm_importance_sampling_clip_max": 3.0,
                           "vllm_importance_sampling_clip_min": 0.3},
                          ["rollout.correction=sequence_mask", "rollout.correction_max=3",
                           "rollout.correction_min=0.3"], vllm=True),
    "off_policy_mask": Case({"off_policy_mask_threshold": 0.02}, ["grpo.off_policy_mask_kl=0.02"]),
    "off_policy_mask_vllm": Case({"off_policy_mask_threshold": 0.05,
                                  "vllm_importance_sampling_mode": "token_truncate", **IS},
                                 ["grpo.off_policy_mask_kl=0.05", "rollout.correction=token_truncate",
                                  *IS_OURS], vllm=True),
    "bias_correction_kl": Case({"use_bias_correction_kl": True}, ["grpo.kl_is_weighted=true"]),
    "gspo_bias_correction_kl": Case({"loss_type": "grpo", "importance_sampling_level": "sequence",
                                     "epsilon": 3e-4, "epsilon_high": 4e-4, "use_bias_correction_kl": True},
                                    ["grpo.loss=gspo", "grpo.kl_is_weighted=true"]),
    "sapo_sequence": Case({"loss_type": "sapo", "importance_sampling_level": "sequence"},
                          ["grpo.loss=sapo", "grpo.importance_sampling=sequence"], clips=()),
    "dapo_everything": Case({"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True,
                             "top_entropy_quantile": 0.5, "entropy_coef": 0.02,
                             "use_bias_correction_kl": True,
                             "vllm_importance_sampling_mode": "token_mask", **IS},
                            ["grpo.loss=dapo", "grpo.mask_truncated=true", "grpo.top_entropy_quantile=0.5",
                             "grpo.entropy_coef=0.02", "grpo.kl_is_weighted=true",
                             "rollout.correction=token_mask", *IS_OURS], vllm=True),
}


@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "off_policy"])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_equal_trls(model_dir, name, off_policy):
    _compare(model_dir, name, off_policy)


def test_trls_own_float32_kernel_agrees_to_its_precision(model_dir):
    """The same comparison with TRL's fused float32 log-prob kernel left in place."""
    _compare(model_dir, "dapo_everything", True, exact=False, rel=1e-4)


def _compare(model_dir, name: str, off_policy: bool, exact: bool = True,
             rel: float = 1e-10) -> tuple[float, float]:
    """(relative error of the loss, largest relative error of a parameter's gradient), each asserted within
    ``rel``: the acceptance asks 1e-6; in float64 they agree to rounding (~1e-15), so 1e-10 is asserted."""
    case = CASES[name]
    tr = _trainer(model_dir, exact, num_iterations=2 if off_policy else 1, **case.trl)
    _perturb(tr.ref_model, seed=11, scale=0.05)                   # a reference that differs: KL > 0
    gen_model = make_model("tiny", TOK, seed=1, dtype=torch.float64)
    gen_model.load_state_dict(tr.model.state_dict())
    inputs = _generate_and_score(tr, case.vllm, gen_model)
    if off_policy:
        _perturb(tr.model, seed=7, scale=0.05)              # the update's weights moved since generation
    weights = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.model.zero_grad()
    with _float64():
        loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    theirs = {k: p.grad.clone() for k, p in tr.model.named_parameters()}
    metrics = {k: v[-1] for k, v in tr._metrics["train"].items() if v}

    model = make_model("tiny", TOK, seed=1, dtype=torch.float64)
    model.load_state_dict(weights)
    cfg = load_config(overrides=["grpo.group_size=4", "grpo.beta=0.04", "train.micro_batch_size=5",
                                 f"rollout.max_new_tokens={C}", *case.ours])
    if case.vllm:       # the engine's log-probs; the ratio is anchored on the trainer's before the update
        behaviour = inputs["sampling_per_token_logps"]
        anchor = inputs["old_per_token_logps"] if off_policy else None
    elif off_policy:    # no correction: the recorded log-probs are the anchor (TRL: its old_per_token_logps)
        behaviour, anchor = inputs["old_per_token_logps"], None
    else:               # on-policy: the engine's log-probs equal the trainer's
        batch0 = _batch(inputs, torch.zeros(len(LENGTHS), C))
        behaviour, anchor = batch_logprobs(model, batch0, cfg.train, True)[0].double(), None
    be = _GradTap(model, lr=1e-3)
    res = policy_update(be, _batch(inputs, behaviour), cfg, on_policy=not off_policy, old_logprobs=anchor)
    assert not res.skipped_nonfinite
    loss_err = _close(_t(res.loss), loss.detach(), f"{name} loss", rel)
    grad_err = max(_close(be.grads[k], g, f"{name} grad {k}", rel) for k, g in theirs.items())
    _close(_t(res.metrics["entropy"]), _t(metrics["entropy"]), f"{name} entropy", rel)
    if not cfg.grpo.kl_is_weighted:
        _close(_t(res.kl), _t(metrics["kl"]), f"{name} kl", rel)
    assert metrics["kl"] > 0
    if "clip_ratio/low_mean" in metrics:
        for ours, theirs in (("clip_frac_low", "clip_ratio/low_mean"),
                             ("clip_frac_high", "clip_ratio/high_mean")):
            _close(_t(res.metrics[ours]), _t(metrics[theirs]), f"{name} {ours}")
    if off_policy:      # not a vacuous comparison: the ratio moved and the clip bound both ways
        assert res.metrics["ratio_min"] < 0.9 and res.metrics["ratio_max"] > 1.1
        for kind in case.clips:
            key = "cispo_clip_ratio" if kind == "cispo" else f"clip_ratio/{kind}_mean"
            assert metrics[key] > 0, f"{name}: TRL's {key} is 0: the clip never bound"
    else:
        assert res.metrics["ratio_min"] == res.metrics["ratio_max"] == 1.0
    return loss_err, grad_err


@pytest.mark.parametrize("target", [9.0, 1.0], ids=["below_target", "above_target"])
def test_adaptive_entropy_control_equals_trls(model_dir, target):
    """TRL's use_adaptive_entropy over three optimizer steps on the same batch (weights not stepped): the
    coefficient each step applies, its update, and the loss, against nanogrpo's EntropyControl."""
    from nanogrpo.algo.entropy import EntropyControl

    kw = dict(use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=target, entropy_coef_delta=0.01,
              entropy_coef_min=0.0, entropy_coef_max=0.035)
    tr = _trainer(model_dir, **kw)
    _perturb(tr.ref_model, seed=11, scale=0.05)
    inputs = _generate_and_score(tr, False)
    model = make_model("tiny", TOK, seed=1, dtype=torch.float64)
    model.load_state_dict(tr.model.state_dict())
    over = ["grpo.group_size=4", "grpo.beta=0.04", "grpo.entropy_coef=0.02", f"grpo.entropy_target={target}",
            "grpo.entropy_coef_step=0.01", "grpo.entropy_coef_max=0.035", "train.micro_batch_size=5",
            f"rollout.max_new_tokens={C}"]
    cfg = load_config(overrides=over)
    control = EntropyControl.from_config(cfg.grpo)
    be = _GradTap(model, lr=1e-3)
    behaviour = batch_logprobs(model, _batch(inputs, torch.zeros(len(LENGTHS), C)), cfg.train, True)[0]
    for step in range(3):
        tr.model.zero_grad()
        with _float64():
            theirs = tr._compute_loss(tr.model, inputs)
        applied = control.applied()
        res = policy_update(be, _batch(inputs, behaviour.double()), cfg, on_policy=True, entropy_coef=applied)
        control.update(res.bonus_entropy)
        _close(_t(res.loss), theirs.detach(), f"adaptive step {step} loss", 1e-10)
        assert control.coef == pytest.approx(tr.entropy_coef, rel=1e-12), step
        assert control.last_entropy == pytest.approx(tr._last_world_entropy, rel=1e-10), step
    assert (applied > 0) == (target > res.bonus_entropy)          # below the target the bonus applies


ADVANTAGE_CASES = [
    ({"scale_rewards": "group"}, "group", "sum_then_normalize"),
    ({"scale_rewards": "batch"}, "batch_std", "sum_then_normalize"),
    ({"scale_rewards": "none"}, "group_mean", "sum_then_normalize"),
    ({"multi_objective_aggregation": "normalize_then_sum"}, "batch_std", "normalize_then_sum"),
]


@pytest.mark.parametrize("trl_kw,estimator,aggregation", ADVANTAGE_CASES,
                         ids=["group", "batch", "none", "gdpo"])
def test_advantages_equal_trls(model_dir, trl_kw, estimator, aggregation):
    tr = _trainer(model_dir, **trl_kw)
    theirs = _generate_and_score(tr, False)["advantages"]
    per_fn = torch.tensor(R, dtype=torch.float64)
    ours, _ = advantages(per_fn, torch.tensor(WEIGHTS, dtype=torch.float64), G, estimator=estimator,
                         aggregation=aggregation, eps=1e-4)
    _close(ours, theirs, f"advantages {trl_kw}", rel=1e-12)
    assert theirs[4:8].abs().max() < 1e-9                    # the zero-variance group
    # the trainer's path (float32 advantages, the estimator named by the config's preset)
    over = ["grpo.group_size=4", f"grpo.reward_aggregation={aggregation}"]
    if aggregation == "sum_then_normalize":
        over.append(f"grpo.advantage={estimator}")          # normalize_then_sum: batch_std is its preset
    cfg = load_config(overrides=over)
    adv, _ = batch_advantages(per_fn, WEIGHTS, torch.tensor([float(n) for n in LENGTHS]), cfg.grpo)
    assert adv.dtype == torch.float32
    _close(adv.double(), theirs, f"trainer advantages {trl_kw}")


def main() -> None:
    """``python -m tests.test_parity_trl``: every case, its measured relative errors, as a markdown table."""
    import datetime
    import platform
    import tempfile
    from pathlib import Path

    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    Qwen2RMSNorm.forward = _rms_norm_in_input_dtype
    d = Path(tempfile.mkdtemp())
    make_model("tiny", TOK, seed=1, dtype=torch.float64).save_pretrained(d / "model")
    TOK.save_pretrained(d / "model")
    print(f"TRL {trl.__version__}, torch {torch.__version__}, {platform.machine()}, "
          f"{datetime.date.today().isoformat()}; float64; relative error = max |ours - TRL| / max |TRL|")
    print("| case | TRL setting | on-policy loss / grad | off-policy loss / grad |")
    print("|---|---|---|---|")
    for name, case in CASES.items():
        on, off = _compare(d, name, False), _compare(d, name, True)
        setting = ", ".join(f"{k}={v}" for k, v in case.trl.items()
                            if not k.startswith("vllm_importance_sampling_c"))
        print(f"| {name} | {setting} | {on[0]:.1e} / {on[1]:.1e} | {off[0]:.1e} / {off[1]:.1e} |")
    f32 = _compare(d, "dapo_everything", True, exact=False, rel=1e-4)
    print(f"| dapo_everything, TRL's float32 kernel | | | {f32[0]:.1e} / {f32[1]:.1e} |")
    for trl_kw, est, agg in ADVANTAGE_CASES:
        tr = _trainer(d, **trl_kw)
        theirs = _generate_and_score(tr, False)["advantages"]
        ours, _ = advantages(torch.tensor(R, dtype=torch.float64), torch.tensor(WEIGHTS, dtype=torch.float64),
                             G, estimator=est, aggregation=agg, eps=1e-4)
        print(f"| advantages {est} / {agg} | {trl_kw} | {_close(ours, theirs, est, 1e-12):.1e} | |")


if __name__ == "__main__":
    main()
