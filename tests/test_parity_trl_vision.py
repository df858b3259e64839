"""The GRPO loss and its gradients on a tiny vision-language model equal TRL 1.16's ``GRPOTrainer``'s,
with the same images (Qwen2-VL: patches, grids, M-RoPE; LLaVA: fixed-size images).

A real ``GRPOTrainer`` is built around the checkpoint (float64) and runs its own ``_compute_loss``:
its per-sample slicing of the pixel values by image grid / image count, its loss, its backward. One
substitution, as in ``tests/test_parity_trl.py``: TRL's fused log-prob kernel accumulates in float32,
so its model call goes through :class:`_Exact`, the model's own logits and a float64 log-softmax (the
slicing of the images, built by TRL's ``_get_per_token_logps_and_entropies``, is TRL's). The batch is
a real nanogrpo rollout (the hf engine, images of two sizes); nanogrpo's
:func:`~nanogrpo.training.step.policy_update` runs on a model with the same weights, in micro-batches
of two rows where TRL takes all eight. Off-policy: the weights move after generation, the ratio leaves
1. Asserted: every parameter's gradient within ``REL`` = 1e-8 relative, the loss within 1e-10 of its
terms' size.
"""

from __future__ import annotations

import itertools
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("PIL")
if os.environ.get("NANOGRPO_REQUIRE_TRL") == "1":
    import trl
else:
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[dev]' pins trl==1.16.0)")
if trl.__version__ != "1.16.0":
    pytest.skip(f"the parity tests check TRL 1.16.0's code, found trl {trl.__version__}",
                allow_module_level=True)

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from nanogrpo.batch import RolloutBatch  # noqa: E402
from nanogrpo.config import load_config  # noqa: E402
from nanogrpo.engines.hf import HFEngine  # noqa: E402
from nanogrpo.models.tiny_vision import make_vlm, save_vlm  # noqa: E402
from nanogrpo.models.vision import forward_kwargs, image_spec, llava_images  # noqa: E402
from nanogrpo.rewards import RewardRunner  # noqa: E402
from nanogrpo.rollout.collect import Collector  # noqa: E402
from nanogrpo.training.distributed import Backend  # noqa: E402
from nanogrpo.training.step import batch_logprobs, policy_update  # noqa: E402
from tests.vision_fixtures import picture  # noqa: E402

G, C, BETA = 4, 6, 0.04
REL = 1e-8
"""Per parameter, relative to its largest gradient (the text parity asks 1e-6 and asserts 1e-10): nanogrpo
runs the vision tower once per group and sums the features' gradients over the group's rows, TRL once
per row: float64 sums in another order, up to ~1.2e-9 apart on the tower's smallest gradients (the
language model's agree to ~1e-15)."""


def _rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module", autouse=True)
def _float64_norms():
    """Qwen2's RMSNorm (LLaVA's language model here) normalises in float32 whatever its input: in this
    module it keeps its input's dtype, as in ``tests/test_parity_trl.py``."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Qwen2RMSNorm, "forward", _rms_norm_in_input_dtype)
        yield


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    """TRL's accelerate reads a launcher's variables: a ``LOCAL_RANK`` another test left behind
    (``tests/test_train.py``'s launcher-argument test sets it) would make it start torch.distributed."""
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


class _Exact(torch.nn.Module):
    """The model as TRL calls it (``labels``, ``fused_lm_head``), its log-probs from the logits in float64."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, labels=None, fused_lm_head=None, **kw):
        lp = self.model(**kw).logits[:, :-1].log_softmax(-1)                  # (B, L - 1, V)
        out = torch.zeros(labels.shape, dtype=lp.dtype)                       # (B, L)
        ent = torch.zeros(labels.shape, dtype=lp.dtype)
        out[:, 1:] = lp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
        ent[:, 1:] = -(lp.exp() * lp).sum(-1)
        return SimpleNamespace(log_probs=out, entropy=ent)


class _GradTap(Backend):
    def clip_and_step(self, max_norm: float) -> float:  # keep the gradient, apply nothing
        self.grads = {k: p.grad.clone() for k, p in self.module.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad()
        return 0.0


def _perturb(model, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _trainer(path, tok, num_iterations: int) -> GRPOTrainer:
    args = dict(output_dir=str(path / "trl"), per_device_train_batch_size=2 * G, num_generations=G,
                max_completion_length=C, report_to=[], use_cpu=True, bf16=False, beta=BETA, loss_type="grpo",
                use_bias_correction_kl=False, gradient_checkpointing=False, save_strategy="no",
                num_iterations=num_iterations, model_init_kwargs={"dtype": torch.float64})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = GRPOTrainer(model=str(path / "model"), args=GRPOConfig(**args),
                         reward_funcs=[lambda prompts, completions, **k: [0.0] * len(prompts)],
                         train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tok)
    tr.current_gradient_accumulation_steps = 1
    orig = tr._get_per_token_logps_and_entropies
    tr._get_per_token_logps_and_entropies = lambda model, *a, **k: orig(_Exact(model), *a, **k)
    return tr


@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "off_policy"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava"])
def test_vision_loss_and_gradients_equal_trls(tmp_path, family, off_policy):
    model, tok = make_vlm(family, seed=1, dtype=torch.float64)
    save_vlm(model, tok, tmp_path / "model")
    tr = _trainer(tmp_path, tok, 2 if off_policy else 1)
    cfg = load_config(overrides=[f"grpo.group_size={G}", f"grpo.beta={BETA}", "train.micro_batch_size=2",
                                 f"rollout.max_new_tokens={C}", "data.system_prompt=''",
                                 "data.min_image_pixels=64", "data.max_image_pixels=1024"])
    engine = HFEngine(tr.model, tokenizer=tok)
    engine.vision = image_spec(tr.model, tok, None, 64, 1024)
    count = itertools.count()
    rewards = RewardRunner([lambda t, s: float(next(count) % 5)], workers=0)
    # LLaVA: TRL's forward passes no position ids (its language model then ignores left padding), so its
    # prompts have equal lengths, as in the text parity; Qwen2-VL computes its M-RoPE positions from the mask
    second = "<image>Where is it" if family == "llava" else "Look: <image> now"
    rows = [{"question": "<image>What is it?", "answer": "1", "images": [picture(16, 16, 1)]},
            {"question": second, "answer": "2", "images": [picture(24, 40, 2)]}]
    batch, _ = Collector(engine, tok, rewards, cfg).collect(rows, seed=3)
    assert batch is not None and batch.num_seqs == 2 * G
    ref = make_vlm(family, seed=1, dtype=torch.float64)[0]
    ref.load_state_dict(tr.model.state_dict())
    _perturb(ref, seed=11, scale=0.05)                                       # KL > 0
    batch.ref_logprobs = batch_logprobs(ref, batch, cfg.train, True)[0]
    behaviour = batch_logprobs(tr.model, batch, cfg.train, True)[0]          # the generating policy's
    if off_policy:
        _perturb(tr.model, seed=7, scale=0.05)
    p = batch.prompt_len
    ids = batch.input_ids
    mm = forward_kwargs(tr.model, ids, batch.pixel_values, batch.image_grid_thw)
    inputs = {"prompt_ids": ids[:, :p], "prompt_mask": batch.attention_mask[:, :p].long(),
              "completion_ids": ids[:, p:], "completion_mask": batch.completion_mask.long(),
              "advantages": batch.advantages.double(), "ref_per_token_logps": batch.ref_logprobs,
              "old_per_token_logps": behaviour if off_policy else None,
              "num_images": batch.image_counts.tolist(), "num_items_in_batch": batch.completion_mask.sum()}
    if family == "llava":
        inputs["pixel_values"] = llava_images(batch.pixel_values, batch.image_grid_thw).double()
    else:
        inputs.update(pixel_values=batch.pixel_values.double(), image_grid_thw=batch.image_grid_thw,
                      mm_token_type_ids=mm["mm_token_type_ids"])
    weights = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.model.train()
    tr.model.zero_grad()
    loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    theirs = {k: p.grad.clone() for k, p in tr.model.named_parameters() if p.grad is not None}

    ours = make_vlm(family, seed=1, dtype=torch.float64)[0]
    ours.load_state_dict(weights)
    b = RolloutBatch(**dict(batch.tensors(), old_logprobs=behaviour), prompt_len=p, group_size=G)
    be = _GradTap(ours, lr=1e-3)
    res = policy_update(be, b, cfg, on_policy=not off_policy)
    assert not res.skipped_nonfinite
    # the loss is a small difference of O(1) terms (each group's advantages sum to zero): within 1e-10 of
    # the terms' size, its advantages'
    assert abs(res.loss - float(loss.detach())) <= 1e-10 * float(batch.advantages.abs().mean())
    assert set(theirs) == set(be.grads)
    for k, g in theirs.items():
        err = float((be.grads[k] - g).abs().max())
        assert err <= REL * float(g.abs().max()) + 1e-14, f"{k}: {err:.3e}"  # (a key bias's is 0)
    if off_policy:
        assert res.metrics["ratio_min"] < 1.0 < res.metrics["ratio_max"]
