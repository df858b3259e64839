"""Families whose logits are their head's output scaled or soft-capped (Cohere's ``logit_scale``, Gemma's
``final_logit_softcapping``, Granite's ``logits_scaling``, ...): what nanogrpo computes from their hidden
states equals what their own ``forward().logits`` give, for the policy's log-probs and for a distillation
teacher (its top-k, its log-probs, the whole-vocabulary divergence, ``nanogrpo serve --teacher``'s
prompt log-probs). Tiny random-init models of each family, built offline from transformers' config classes,
the cap or scale set where it bites (random logits of a few nats against a cap of 1.5)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from nanogrpo.algo.distill import DistillSpec
from nanogrpo.algo.heads import LOGIT_MAPS, LogitMap, logit_map
from nanogrpo.algo.logprobs import lean_head, token_logprobs
from nanogrpo.config import load_config
from nanogrpo.errors import ModelError
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.training.distill import Distill, LocalTeacher
from tests.test_distill import _batch, _by_hand, _close, _update

TOK = make_tokenizer()
V = len(TOK)
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=V, eos_token_id=TOK.eos_token_id,
              pad_token_id=TOK.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
              initializer_range=0.1)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

FAMILIES = {  # model_type: (config class, model class, what makes its map bite)
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, dict(logit_scale=0.25)),
    "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM, dict(logit_scale=0.25, head_dim=16)),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(final_logit_softcapping=1.5, head_dim=16)),
    "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(final_logit_softcapping=1.5,
                                                                     head_dim=16)),
    "vaultgemma": (tf.VaultGemmaConfig, tf.VaultGemmaForCausalLM, dict(final_logit_softcapping=1.5,
                                                                        head_dim=16)),
    "nanochat": (tf.NanoChatConfig, tf.NanoChatForCausalLM, dict(final_logit_softcapping=1.5)),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(logits_scaling=4.0)),
    "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM, dict(logits_scaling=4.0, **MOE)),
    "granitemoeshared": (tf.GraniteMoeSharedConfig, tf.GraniteMoeSharedForCausalLM,
                         dict(logits_scaling=4.0, shared_intermediate_size=32, **MOE)),
    "granitemoehybrid": (tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM,
                         dict(logits_scaling=4.0, shared_intermediate_size=32,
                              layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=32,
                              mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8, **MOE)),
    "hyperclovax": (tf.HyperCLOVAXConfig, tf.HyperCLOVAXForCausalLM, dict(logits_scaling=0.5)),
    "falcon_h1": (tf.FalconH1Config, tf.FalconH1ForCausalLM, dict(lm_head_multiplier=0.5)),
}
DOUBLE = ["cohere", "gemma2", "gemma3_text", "granite"]
"""The families the distillation tests run in float64 (one of each kind of map; MoE layers refuse float64)."""


def build(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    cfg_cls, cls, extra = FAMILIES[kind]
    cfg = cfg_cls(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.to(dtype).eval()


def _forward_logits(model, batch) -> torch.Tensor:
    """(N, C, V) the model's own logits at the positions that predict the completion tokens."""
    ids, am = batch.input_ids, batch.attention_mask.long()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=am, position_ids=pos).logits
    return z[:, batch.prompt_len - 1:-1]


def test_every_family_of_the_table_is_tested():
    assert set(LOGIT_MAPS) - set(FAMILIES) <= {"granite_swa", "granitemoe_swa", "cohere2_moe"}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "falcon_h1" else k
                                  for k in FAMILIES])  # falcon_h1: 3 s to build, the full suite runs it
def test_the_map_of_each_family_gives_its_forward_logits(kind):
    """map(head(last hidden state)) is the family's ``forward().logits`` (exactly: the same operations)."""
    model = build(kind)
    assert model.config.model_type == kind
    fmap = logit_map(model)
    assert isinstance(fmap, LogitMap) and not fmap.identity
    assert lean_head(model) is None  # the model's forward maps the head's output: never the lean head
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        h = model.base_model(input_ids=ids).last_hidden_state
        raw = model.get_output_embeddings()(h)
        ours = fmap(raw)
    assert torch.equal(ours, own)
    assert float((raw - own).abs().max()) > 0.1  # the map changes the logits: the test would see it missing


def test_plain_heads_map_to_the_identity_and_unknown_ones_to_none():
    assert logit_map(make_model("tiny", TOK)).identity
    odd = make_model("tiny", TOK)
    odd.config.model_type = "mystery"
    assert logit_map(odd) is None


@pytest.mark.parametrize("kind", ["cohere", "gemma2", "granite", "granitemoe"])
def test_the_policys_log_probs_of_each_family_are_its_forwards(kind):
    """The policy's log-probs (every path the update and the reference take: prefix sharing or not, a
    temperature) are those of the model's own logits, the map included."""
    model = build(kind)
    b = _batch()
    want = (_forward_logits(model, b).double() / 0.7).log_softmax(-1)
    want = want.gather(-1, b.input_ids[:, b.prompt_len:, None]).squeeze(-1)
    m = b.completion_mask
    for share in (True, False):
        got = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, m, chunk=3,
                             share_prefix=share, temperature=0.7)
        assert torch.allclose(got[m].double(), want[m], atol=1e-5), share


@pytest.mark.parametrize("kind", ["cohere", "gemma2", "gemma3_text", "granite", "granitemoe", "hyperclovax"])
def test_a_teachers_top_k_and_log_probs_are_its_forwards(kind):
    """``distill.top_k`` (the teacher's top-k annotation) with a scaled or soft-capped teacher: its
    top-k and its log-probs of the sampled tokens are those of its own logits."""
    dt = torch.float64 if kind in DOUBLE else torch.float32
    teacher = LocalTeacher(build(kind, seed=2, dtype=dt), TOK, kind)
    b = _batch()
    got = teacher.score(b, load_config(overrides=["train.micro_batch_size=4"]).train, True, 0.7, None, 4)
    lt = (_forward_logits(teacher.model, b).double() / 0.7).log_softmax(-1)
    m = b.completion_mask
    own = lt.gather(-1, b.input_ids[:, b.prompt_len:, None]).squeeze(-1)
    tol = 1e-6 if dt == torch.float64 else 1e-5
    assert torch.allclose(got["teacher_logprobs"][m].double(), own[m], atol=tol)
    v, i = lt.topk(4, -1)
    assert torch.equal(got["teacher_topk_ids"][m], i[m])
    assert torch.allclose(got["teacher_topk_logprobs"][m].double(), v[m], atol=tol)


@pytest.mark.parametrize("kind", DOUBLE)
def test_jsd_with_a_mapped_teacher_equals_plain_autograd(kind):
    """The whole-vocabulary divergence (the teacher's head projected chunk by chunk in the update) with a
    scaled or soft-capped teacher: loss and gradients of the model's own logits, by plain autograd."""
    model = make_model("tiny", TOK, seed=1, dtype=torch.float64)
    teacher = LocalTeacher(build(kind, seed=2, dtype=torch.float64), TOK, kind)
    ov = ["distill.signal=jsd", "distill.beta=0.5", "distill.temperature=0.8", "distill.weight=0.5",
          "train.micro_batch_size=4", "train.logprob_chunk=3"]
    ours, grads = _update(model, teacher, _batch(), ov)
    ref = make_model("tiny", TOK, seed=1, dtype=torch.float64)
    loss, theirs = _by_hand(ref, teacher, _batch(), DistillSpec("jsd", 0.5, 0.5, 0.8), 0.5)
    assert ours.loss == pytest.approx(loss, rel=1e-8)
    for k, g in theirs.items():
        assert _close(grads[k], g), k


@pytest.mark.parametrize("kind", ["gemma2", "cohere"])
def test_jsd_between_a_mapped_student_and_a_mapped_teacher_equals_plain_autograd(kind):
    """Both sides mapped: the student's divergence is taken on its own logits (its forward), the teacher's
    on its head's output mapped."""
    model = build(kind, seed=1, dtype=torch.float64).train()
    teacher = LocalTeacher(build("granite" if kind == "gemma2" else "gemma2", seed=2, dtype=torch.float64),
                           TOK, "t")
    ov = ["distill.signal=jsd", "distill.beta=0.3", "distill.temperature=1.3", "distill.weight=1.0",
          "train.micro_batch_size=4"]
    ours, grads = _update(model, teacher, _batch(), ov)
    ref = build(kind, seed=1, dtype=torch.float64).train()
    loss, theirs = _by_hand(ref, teacher, _batch(), DistillSpec("jsd", 1.0, 0.3, 1.3), 1.0)
    assert ours.loss == pytest.approx(loss, rel=1e-8)
    for k, g in theirs.items():
        assert _close(grads[k], g), k


def test_a_mapped_teachers_prompt_log_probs_are_its_forwards():
    """``nanogrpo serve --teacher`` answers prompt log-probs, ranks and top-k from the head projection
    (float32: transformers' eager attention, Gemma2's, gives NaN on a left-padded float64 row)."""
    teacher = LocalTeacher(build("gemma2", seed=2), TOK, "t")
    seqs = [[5, 6, 7, 8, 9, 10], [20, 21, 22]]
    got = teacher.prompt_logprobs(seqs, temperature=0.9, k=3, chunk=2)
    for s, (lp, rank, tv, ti) in zip(seqs, got, strict=True):
        with torch.no_grad():
            z = teacher.model(input_ids=torch.tensor([s])).logits[0, :-1]
        lt = (z / 0.9).log_softmax(-1)
        own = lt.gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1)
        assert torch.allclose(lp, own, atol=1e-5)
        assert torch.equal(rank, (lt > own[:, None]).sum(-1) + 1)
        v, i = lt.topk(3, -1)
        assert torch.equal(ti, i) and torch.allclose(tv, v, atol=1e-5)


def test_a_teacher_of_an_unknown_head_is_refused_in_one_line():
    odd = make_model("tiny", TOK, seed=2)
    odd.config.model_type = "mystery"
    teacher = LocalTeacher(odd, TOK, "odd")
    cfg = load_config(overrides=["grpo.group_size=3", "distill.teacher=x", "distill.signal=jsd"])
    with pytest.raises(ModelError) as e:
        Distill.with_teacher(cfg, teacher, make_model("tiny", TOK, seed=1))
    assert "\n" not in str(e.value) and "distill.signal=sampled" in str(e.value)
