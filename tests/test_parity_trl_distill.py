"""nanogrpo's distillation losses and gradients against TRL 1.16's own code, on identical tensors.

Over the whole vocabulary: a real ``DistillationTrainer`` is built around a tiny random-init Qwen2 student
and a wider teacher (same vocabulary) in float64, and its ``_compute_loss`` runs on fixed completions (the
student's and teacher's hidden states, the completion mask, the ``num_items_in_batch`` reduction: TRL's
code) followed by ``backward()``. As in ``tests/test_parity_trl.py``, TRL's chunked kernel
(``_chunked_divergence_loss``) projects and accumulates in float32 whatever the models' dtype, so the float64
comparisons give that one function a float64 body whose divergence is TRL's own ``_jsd_divergence`` (the
base trainer's formula, kept by ``ServerDistillationTrainer``) on the same hidden states and heads
(:func:`_exact_divergence`); one case runs TRL's kernel unchanged, within float32's precision. nanogrpo's
:func:`~nanogrpo.training.step.policy_update` then runs on a model with the same weights, the teacher
beside it and a batch holding the same tensors (in two micro-batches, where TRL takes one), with
``distill.signal=jsd``, ``weight=1`` and the token-mean reduction (TRL's): the loss and every parameter's
gradient must agree within 1e-6 relative, for beta 0, 0.5, 1 and temperatures 1 and 0.7.

On a sparse support (a teacher server's top-k): ``ServerDistillationTrainer``'s own loss methods
(``_compute_server_forward_kl_loss`` for beta 0 over the top-k,
``_compute_server_sparse_top_1_divergence_loss`` for beta > 0 over the top-1 and the sampled token), with
and without its tail bucket, against
:func:`nanogrpo.algo.distill.topk_divergence` through :func:`~nanogrpo.algo.losses.policy_loss`, on the same
student logits and teacher top-k, loss and the gradient of the student's logits.

Needs ``trl==1.16.0``; skipped without it unless ``NANOGRPO_REQUIRE_TRL=1`` (``.ci/run``).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("NANOGRPO_REQUIRE_TRL") == "1":
    import trl
else:
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[dev]' pins trl==1.16.0)")
if trl.__version__ != "1.16.0":
    pytest.skip(f"the parity tests check TRL 1.16.0's code, found trl {trl.__version__}",
                allow_module_level=True)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from trl import DistillationConfig, DistillationTrainer  # noqa: E402
from trl.experimental.server_distillation.server_distillation_trainer import (  # noqa: E402
    ServerDistillationTrainer,
    _jsd_divergence,
)

from nanogrpo.algo.distill import DistillSpec, distill_terms, divergence_fn  # noqa: E402
from nanogrpo.algo.losses import BatchTotals, LossSpec, policy_loss  # noqa: E402
from nanogrpo.batch import RolloutBatch  # noqa: E402
from nanogrpo.config import load_config  # noqa: E402
from nanogrpo.models.tiny import make_model, make_tokenizer  # noqa: E402
from nanogrpo.training.distill import Distill, LocalTeacher  # noqa: E402
from nanogrpo.training.distributed import Backend  # noqa: E402
from nanogrpo.training.step import policy_update  # noqa: E402

pytestmark = pytest.mark.slow

TOK = make_tokenizer()
C = 6
PROMPTS = [[5, 6, 7], [8, 9, 30], [10, 11, 12], [13, 14, 15]]   # equal lengths: TRL passes no positions
LENGTHS = [6, 3, 5, 1]


def _completions() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, len(TOK), (n,), generator=g).tolist() for n in LENGTHS]


COMPLETIONS = _completions()


def _rms_in_input_dtype(self, hidden_states):
    """Qwen2's RMSNorm in its input's dtype (it normalises in float32 whatever the model's)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module", autouse=True)
def _float64_norms():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Qwen2RMSNorm, "forward", _rms_in_input_dtype)
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill-parity")
    make_model("tiny", TOK, seed=1, dtype=torch.float64).save_pretrained(d / "student")
    make_model("demo", TOK, seed=2, dtype=torch.float64).save_pretrained(d / "teacher")  # wider, same vocab
    for k in ("student", "teacher"):
        TOK.save_pretrained(d / k)
    return d


def _exact_divergence(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                      teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                      student_lm_head_bias=None, teacher_lm_head_bias=None, temperature=1.0, **_):
    """``_chunked_divergence_loss`` in float64: the same heads, TRL's ``_jsd_divergence``, its reduction."""
    s = F.linear(student_hidden_states, student_lm_head_weight, student_lm_head_bias) / temperature
    t = F.linear(teacher_hidden_states, teacher_lm_head_weight, teacher_lm_head_bias) / temperature
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    jsd = _jsd_divergence(ls, lt, beta).sum(-1)                                   # (B, K)
    m = completion_mask.bool()
    entropy = -(ls.exp() * ls).sum(-1)
    loss = jsd[m].sum() / (num_items_in_batch if num_items_in_batch is not None else m.sum())
    return loss, entropy[m].sum().detach(), m.sum()


def _trainer(models, beta: float, temperature: float) -> DistillationTrainer:
    args = dict(output_dir=str(models / "trl"), per_device_train_batch_size=len(PROMPTS), beta=beta,
                temperature=temperature, max_completion_length=C, report_to=[], use_cpu=True, bf16=False,
                gradient_checkpointing=False, save_strategy="no", logging_steps=1,
                model_init_kwargs={"dtype": torch.float64}, teacher_model_init_kwargs={"dtype": "float64"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DistillationTrainer(model=str(models / "student"), teacher_model=str(models / "teacher"),
                                 args=DistillationConfig(**args), processing_class=TOK,
                                 train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c", "d"]}))
    return tr


def _inputs() -> dict:
    cm = torch.tensor([[j < n for j in range(C)] for n in LENGTHS], dtype=torch.long)
    comp = torch.full((len(LENGTHS), C), TOK.pad_token_id)
    for i, c in enumerate(COMPLETIONS):
        comp[i, :len(c)] = torch.tensor(c)
    return {"prompt_ids": torch.tensor(PROMPTS), "prompt_mask": torch.ones(len(PROMPTS), 3, dtype=torch.long),
            "completion_ids": comp, "completion_mask": cm}


class _GradTap(Backend):
    """The single-process backend, but the step keeps the gradients instead of applying them."""

    def clip_and_step(self, max_norm: float) -> float:
        self.grads = {k: p.grad.clone() for k, p in self.module.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad()
        return 0.0


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str, rel: float) -> float:
    scale = float(theirs.abs().max())
    err = float((ours - theirs).abs().max())
    assert err <= rel * scale + 1e-14, f"{what}: max |ours - TRL| = {err:.3e} against max |TRL| = {scale:.3e}"
    return err / scale if scale > 0 else err


def _ours(models, weights: dict, beta: float, temperature: float, inputs: dict):
    """nanogrpo's update on the same weights and tensors: (loss, gradients by parameter name, metrics)."""
    from nanogrpo.models.load import load_model

    model = make_model("tiny", TOK, seed=1, dtype=torch.float64)
    model.load_state_dict(weights)
    t_model = load_model(str(models / "teacher"), torch.float64, torch.device("cpu"))
    teacher = LocalTeacher(t_model, TOK, "teacher")
    cfg = load_config(overrides=["grpo.group_size=2", "grpo.beta=0", "grpo.loss_reduction=token-mean",
                                 "train.micro_batch_size=2", "distill.teacher=teacher", "distill.signal=jsd",
                                 f"distill.beta={beta}", f"distill.temperature={temperature}",
                                 f"rollout.temperature={temperature}", f"rollout.max_new_tokens={C}"])
    distill = Distill.with_teacher(cfg, teacher, model)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    cm = inputs["completion_mask"].bool()
    am = torch.cat([inputs["prompt_mask"].bool(), cm], 1).to(torch.int8)
    batch = RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=torch.zeros(len(cm)),
                         advantages=torch.zeros(len(cm)), group_ids=torch.arange(len(cm)) // 2,
                         old_logprobs=torch.zeros(cm.shape), prompt_len=ids.shape[1] - C, group_size=2)
    be = _GradTap(model, lr=1e-3)
    res = policy_update(be, batch, cfg, on_policy=True, terms=distill)
    assert not res.skipped_nonfinite
    return res.loss, be.grads, res.metrics


def _whole_vocabulary(models, beta: float, temperature: float, exact: bool = True,
                      rel: float = 1e-10) -> tuple[float, float]:
    """(relative error of the loss, largest relative error of a parameter's gradient), each asserted within
    ``rel`` (the acceptance asks 1e-6; float64 agrees to rounding, ~1e-15). ``exact``: TRL's chunked kernel
    given its float64 body (module docstring); False: TRL's float32 kernel unchanged."""
    import trl.trainer.distillation_trainer as dt

    kernel = dt._chunked_divergence_loss
    if exact:
        dt._chunked_divergence_loss = _exact_divergence
    try:
        tr = _trainer(models, beta, temperature)
        weights = {k: v.clone() for k, v in tr.model.state_dict().items()}
        inputs = _inputs()
        tr.model.zero_grad()
        loss = tr._compute_loss(tr.model, inputs, inputs["completion_mask"].sum())[0]
        loss.backward()
    finally:
        dt._chunked_divergence_loss = kernel
    theirs = {k: p.grad.clone().double() for k, p in tr.model.named_parameters()}
    ours, grads, metrics = _ours(models, weights, beta, temperature, inputs)
    loss_err = _close(torch.tensor(ours, dtype=torch.float64), loss.detach().double(), "loss", rel)
    grad_err = max(_close(grads[k], g, f"grad {k}", rel) for k, g in theirs.items())
    assert loss.item() > 1e-3                                     # a teacher that differs: not a vacuous zero
    assert metrics["distill/divergence"] == pytest.approx(loss.item(), rel=max(rel, 1e-10))
    return loss_err, grad_err


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_whole_vocabulary_jsd_equals_trls(models, beta, temperature):
    _whole_vocabulary(models, beta, temperature)


def test_trls_own_float32_kernel_agrees_to_its_precision(models):
    """TRL's chunked kernel unchanged (it projects and accumulates in float32): within float32's precision."""
    _whole_vocabulary(models, 0.5, 1.0, exact=False, rel=1e-4)


# ----------------------------------------------------------------------------- sparse support (servers)

B, T, V = 3, 5, 23


def _sparse_case(k: int, temperature: float, seed: int = 0):
    """Student logits (B, T, V) with gradient, the sampled tokens, a teacher's top-k and its log-prob of each
    sampled token at ``temperature``, and a mask with a padded tail (TRL: labels -100)."""
    g = torch.Generator().manual_seed(seed)
    s_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64).requires_grad_()
    t_logits = 2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    tokens[0, :2] = (t_logits[0, :2]).argmax(-1)                 # some sampled tokens are the teacher's top-1
    lt = (t_logits / temperature).log_softmax(-1)
    top_v, top_i = lt.topk(k, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 1:] = False
    return s_logits, tokens, top_v, top_i, lt.gather(-1, tokens[..., None]).squeeze(-1), mask


def _trl_sparse(beta: float, tail: bool, temperature: float, s_logits, tokens, top_v, top_i, actual, mask):
    tr = ServerDistillationTrainer.__new__(ServerDistillationTrainer)   # its loss methods, without a server
    tr.beta, tr.loss_add_tail, tr.reverse_kl_top_1_mode, tr.temperature = beta, tail, "sampled", temperature
    labels = torch.where(mask, tokens, -100)
    student = (s_logits / temperature).log_softmax(-1)                  # as its compute_loss
    result = {"actual_logprobs": torch.where(mask, actual, -torch.inf), "topk_logprobs": top_v,
              "topk_token_ids": top_i}
    if beta > 0:
        return tr._compute_server_sparse_top_1_divergence_loss(result, student, tokens, labels)
    return tr._compute_server_forward_kl_loss(result, student, labels)


def _ours_sparse(beta: float, tail: bool, temperature: float, k: int, s_logits, tokens, top_v, top_i, actual,
                 mask):
    spec = DistillSpec(signal="jsd", beta=beta, temperature=temperature, top_k=k, add_tail=tail)
    fn = divergence_fn(spec)
    z = s_logits.reshape(-1, V)
    div = fn(z, tokens.reshape(-1), top_v.reshape(-1, k), top_i.reshape(-1, k), actual.reshape(-1))
    logp = (s_logits / temperature).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)   # (B, T)
    adv, extra, _ = distill_terms(spec, logp, None, div.reshape(B, T, 2), torch.zeros(B), mask)
    tot = BatchTotals(num_seqs=B, num_tokens=int(mask.sum()), max_new_tokens=T)
    loss, _ = policy_loss(LossSpec(reduction="token-mean"), logp, None, None, adv, mask, tot, extra=extra)
    return loss


SPARSE = [(beta, k, tail) for beta, k in [(0.0, 5), (0.0, 1), (0.5, 1), (1.0, 1)] for tail in (True, False)
          if tail or not (beta == 1.0 or k == 1 and beta == 0.0)]
"""A one-token support renormalised is a certain event (loss 0 in TRL and here): config refuses it."""


def _sparse(beta: float, k: int, temperature: float, tail: bool, rel: float = 1e-10) -> tuple[float, float]:
    case = _sparse_case(k, temperature)
    theirs = _trl_sparse(beta, tail, temperature, *case)
    g_theirs, = torch.autograd.grad(theirs, case[0])
    ours = _ours_sparse(beta, tail, temperature, k, *case)
    g_ours, = torch.autograd.grad(ours, case[0])
    assert theirs.item() > 1e-3 and g_theirs.abs().max() > 1e-6
    return (_close(ours.detach(), theirs.detach(), "loss", rel),
            _close(g_ours, g_theirs, "grad of the student's logits", rel))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta,k,tail", SPARSE)
def test_sparse_support_jsd_equals_trls_server_loss(beta, k, temperature, tail):
    _sparse(beta, k, temperature, tail)


def main() -> None:
    """Print the figures page's table: ``python -m tests.test_parity_trl_distill``."""
    import tempfile
    from pathlib import Path

    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    d = Path(tempfile.mkdtemp())
    make_model("tiny", TOK, seed=1, dtype=torch.float64).save_pretrained(d / "student")
    make_model("demo", TOK, seed=2, dtype=torch.float64).save_pretrained(d / "teacher")
    for k in ("student", "teacher"):
        TOK.save_pretrained(d / k)
    print("| TRL 1.16 code | setting | nanogrpo | loss / gradient |\n|---|---|---|---|")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Qwen2RMSNorm, "forward", _rms_in_input_dtype)
        for beta in (0.0, 0.5, 1.0):
            for temp in (1.0, 0.7):
                le, ge = _whole_vocabulary(d, beta, temp)
                print(f"| `DistillationTrainer._compute_loss` | beta={beta}, temperature={temp} | "
                      f"`distill.signal=jsd distill.beta={beta}` | {le:.1e} / {ge:.1e} |")
        le, ge = _whole_vocabulary(d, 0.5, 1.0, exact=False, rel=1e-4)
        print(f"| the same, TRL's float32 kernel | beta=0.5 | float64 | {le:.1e} / {ge:.1e} |")
    for beta, k, tail in SPARSE:
        for temp in (1.0, 0.7):
            le, ge = _sparse(beta, k, temp, tail)
            fn = ("_compute_server_forward_kl_loss" if beta == 0
                  else "_compute_server_sparse_top_1_divergence_loss")
            print(f"| `ServerDistillationTrainer.{fn}` | beta={beta}, loss_top_k={k}, loss_add_tail={tail}, "
                  f"temperature={temp} | `distill.top_k={k} distill.add_tail={str(tail).lower()}` | "
                  f"{le:.1e} / {ge:.1e} |")


if __name__ == "__main__":
    main()
