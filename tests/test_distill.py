"""On-policy distillation (``[distill]``): the ``sampled`` signal against a hand computation, the update's
divergence path against plain autograd (prefix sharing, micro-batches, the non-lean head, LoRA), the teacher's
refusals (another vocabulary, another head size) and the config's. TRL parity: test_parity_trl_distill.py;
teachers behind HTTP and the demo: test_distill_e2e.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanogrpo.algo.distill import DistillSpec, distill_metrics, distill_terms, generalized_jsd
from nanogrpo.algo.losses import BatchTotals, LossSpec, policy_loss
from nanogrpo.batch import RolloutBatch
from nanogrpo.config import ConfigError, load_config
from nanogrpo.errors import ModelError
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.training.distill import Distill, LocalTeacher
from nanogrpo.training.distributed import Backend
from nanogrpo.training.step import policy_update

TOK = make_tokenizer()


# ----------------------------------------------------------------------------- the sampled signal by hand


def test_sampled_signal_is_the_teachers_minus_the_students_log_prob_by_hand():
    """Two completions of 3 and 2 tokens, on-policy (ratio 1), seq-mean-token-mean: A_t = t_t - s_t, the loss
    -(1/2) sum_i mean_t A_it and d loss / d s_it = -A_it / (2 |i|), worked out here by hand."""
    s = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -9.0]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[-0.5, -4.0, -0.5], [-1.25, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # A = t - s: [[0.5, -2, 0], [-1, 2, (masked)]]; means [-0.5, 0.5]; loss = -(-0.5 + 0.5) / 2 = 0
    spec = DistillSpec(signal="sampled", weight=1.0)
    adv, extra, stats = distill_terms(spec, s, t, None, torch.tensor([7.0, -7.0]), mask,
                                      correct=torch.tensor([True, False]))
    assert extra is None
    assert adv.tolist() == [[0.5, -2.0, 0.0], [-1.0, 2.0, 0.0]]
    tot = BatchTotals(num_seqs=2, num_tokens=5, max_new_tokens=3)
    loss, _ = policy_loss(LossSpec(), s, None, None, adv, mask, tot)
    loss.backward()
    assert loss.item() == 0.0
    assert s.grad.tolist() == [[-0.5 / 6, 2 / 6, 0.0], [1.0 / 4, -2.0 / 4, 0.0]]
    # reverse KL to the teacher, estimated on the samples: mean of s - t = (-0.5 + 2 + 0 + 1 - 2) / 5
    m = distill_metrics({k: float(v) for k, v in stats.items()}, spec)
    assert m["distill/reverse_kl"] == pytest.approx(0.5 / 5)
    assert m["distill/reverse_kl_correct"] == pytest.approx(1.5 / 3)
    assert m["distill/reverse_kl_wrong"] == pytest.approx(-1.0 / 2)


def test_mixed_with_the_grpo_advantage_by_weight():
    s = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    t = torch.tensor([[-0.5, -4.0]], dtype=torch.float64)
    spec = DistillSpec(signal="sampled", weight=0.25)
    adv, _, _ = distill_terms(spec, s, t, None, torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool))
    assert adv.tolist() == [[0.75 * 2 + 0.25 * 0.5, 0.75 * 2 + 0.25 * -2.0]]


def test_generalized_jsd_special_cases_by_hand():
    p_s = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    p_t = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    ls, lt = p_s.log(), p_t.log()
    kl_ts = float((p_t * (lt - ls)).sum())
    kl_st = float((p_s * (ls - lt)).sum())
    assert generalized_jsd(ls, lt, 0.0).item() == pytest.approx(kl_ts)
    assert generalized_jsd(ls, lt, 1.0).item() == pytest.approx(kl_st)
    m = 0.5 * (p_s + p_t)
    js = 0.5 * float((p_t * (lt - m.log())).sum()) + 0.5 * float((p_s * (ls - m.log())).sum())
    assert generalized_jsd(ls, lt, 0.5).item() == pytest.approx(js)
    assert generalized_jsd(ls, ls, 0.5).item() == pytest.approx(0.0, abs=1e-15)


# ----------------------------------------------------------------------------- the update's divergence path


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-6) -> bool:
    """max |a - b| within ``rel`` of max |b| (Qwen2's RMSNorm normalises in float32: ~1e-8 between shapes)."""
    return float((a - b).abs().max()) <= rel * float(b.abs().max()) + 1e-15


class _GradTap(Backend):
    def clip_and_step(self, max_norm: float) -> float:
        self.grads = {k: p.grad.clone() for k, p in self.module.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad()
        return 0.0


def _batch() -> RolloutBatch:
    """Two groups of three completions, each group sharing its prompt (prefix sharing applies)."""
    g = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    lengths = [5, 2, 4, 3, 5, 1]
    c = max(lengths)
    ids = torch.full((6, 4 + c), TOK.pad_token_id)
    cm = torch.zeros(6, c, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :4] = torch.tensor(prompts[i // 3])
        ids[i, 4:4 + n] = torch.randint(3, len(TOK), (n,), generator=g)
        cm[i, :n] = True
    am = torch.cat([torch.ones(6, 4, dtype=torch.bool), cm], 1).to(torch.int8)
    return RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=torch.zeros(6),
                        advantages=torch.tensor([1.0, -1.0, 0.0, 0.5, -0.5, 0.0]),
                        group_ids=torch.arange(6) // 3, old_logprobs=torch.zeros(6, c), prompt_len=4,
                        group_size=3, correct=torch.tensor([True, False, False, True, True, False]))


def _update(model, teacher, batch, overrides, lora: bool = False):
    cfg = load_config(overrides=["grpo.group_size=3", "grpo.beta=0", "distill.teacher=x",
                                 "rollout.max_new_tokens=5", *overrides])
    d = Distill.with_teacher(cfg, teacher, model)
    d.annotate(batch, cfg.train, cfg.train.share_prefix)
    if lora:
        from nanogrpo.models.lora import apply_lora

        model = apply_lora(model, load_config(overrides=["model.lora_r=4"]).model)
    be = _GradTap(model, lr=1e-3)
    res = policy_update(be, batch, cfg, on_policy=True, terms=d)
    return res, be.grads


def _by_hand(model, teacher, batch, spec: DistillSpec, weight: float):
    """The same loss from the two models' full logits, plain autograd (seq-mean-token-mean)."""
    ids, am, p = batch.input_ids, batch.attention_mask.long(), batch.prompt_len
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    s = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, p - 1:-1].double()
    with torch.no_grad():
        t = teacher.model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, p - 1:-1].double()
    ls, lt = (s / spec.temperature).log_softmax(-1), (t / spec.temperature).log_softmax(-1)
    div = generalized_jsd(ls, lt, spec.beta)                                  # (N, C)
    logp = s.log_softmax(-1).gather(-1, ids[:, p:, None]).squeeze(-1)
    m = batch.completion_mask.double()
    a = (1 - weight) * batch.advantages.double()[:, None]                     # (N, 1)
    per = -(a * torch.exp(logp - logp.detach())) + weight * div               # (N, C)
    loss = ((per * m).sum(1) / m.sum(1)).sum() / len(m)
    loss.backward()
    return loss.item(), {k: q.grad.clone() for k, q in model.named_parameters()}


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_update_with_jsd_equals_plain_autograd(share_prefix, weight):
    model = make_model("tiny", TOK, seed=1, dtype=torch.float64)
    teacher = LocalTeacher(make_model("tiny", TOK, seed=2, dtype=torch.float64), TOK, "t")
    ours, grads = _update(model, teacher, _batch(),
                          ["distill.signal=jsd", "distill.beta=0.5", "distill.temperature=0.8",
                           f"distill.weight={weight}", "train.micro_batch_size=4", "train.logprob_chunk=3",
                           f"train.share_prefix={str(share_prefix).lower()}"])
    ref = make_model("tiny", TOK, seed=1, dtype=torch.float64)
    loss, theirs = _by_hand(ref, teacher, _batch(), DistillSpec("jsd", weight, 0.5, 0.8), weight)
    assert ours.loss == pytest.approx(loss, rel=1e-8)
    for k, g in theirs.items():
        assert _close(grads[k], g), k
    assert ours.metrics["distill/divergence"] > 0


def test_update_without_the_lean_head_equals_the_lean_one(monkeypatch):
    """A model whose head is not a plain projection takes the row-by-row path: the same divergence."""
    import nanogrpo.algo.logprobs as lp

    teacher = LocalTeacher(make_model("tiny", TOK, seed=2, dtype=torch.float64), TOK, "t")
    ov = ["distill.signal=jsd", "distill.beta=0.0", "distill.top_k=3", "train.micro_batch_size=4"]
    lean, g1 = _update(make_model("tiny", TOK, seed=1, dtype=torch.float64), teacher, _batch(), ov)
    monkeypatch.setattr(lp, "lean_head", lambda model: None)
    full, g2 = _update(make_model("tiny", TOK, seed=1, dtype=torch.float64), teacher, _batch(), ov)
    assert full.loss == pytest.approx(lean.loss, rel=1e-8)
    for k in g1:
        assert _close(g2[k], g1[k]), k


@pytest.mark.slow  # peft's import
def test_lora_student_learns_from_the_teacher():
    """LoRA: the adapters are zero at first, so the loss is the full model's; the gradient reaches them."""
    teacher = LocalTeacher(make_model("tiny", TOK, seed=2, dtype=torch.float64), TOK, "t")
    full, _ = _update(make_model("tiny", TOK, seed=1, dtype=torch.float64), teacher, _batch(), [])
    lora, grads = _update(make_model("tiny", TOK, seed=1, dtype=torch.float64), teacher, _batch(), [],
                          lora=True)
    assert lora.loss == pytest.approx(full.loss, rel=1e-8)
    assert grads and all("lora" in k for k in grads)
    assert max(float(g.abs().max()) for g in grads.values()) > 0


def test_topk_annotation_is_the_teachers_distribution():
    teacher = LocalTeacher(make_model("tiny", TOK, seed=2, dtype=torch.float64), TOK, "t")
    b = _batch()
    cfg = load_config(overrides=["train.micro_batch_size=4"])
    got = teacher.score(b, cfg.train, True, 0.7, None, 4)
    ids, am = b.input_ids, b.attention_mask.long()
    z = teacher.model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    lt = (z[:, b.prompt_len - 1:-1] / 0.7).double().log_softmax(-1)
    m = b.completion_mask
    own = lt.gather(-1, ids[:, b.prompt_len:, None]).squeeze(-1)
    assert torch.allclose(got["teacher_logprobs"][m].double(), own[m], atol=1e-6)
    v, i = lt.topk(4, -1)
    assert torch.equal(got["teacher_topk_ids"][m], i[m])
    assert torch.allclose(got["teacher_topk_logprobs"][m].double(), v[m], atol=1e-6)


# ----------------------------------------------------------------------------- refusals


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(tmp_path):
    from tokenizers import Tokenizer

    make_model("tiny", TOK, seed=2).save_pretrained(tmp_path / "t")
    TOK.save_pretrained(tmp_path / "t")
    raw = Tokenizer.from_file(str(tmp_path / "t" / "tokenizer.json")).to_str()
    import json

    data = json.loads(raw)
    v = data["model"]["vocab"]
    v["a"], v["b"] = v["b"], v["a"]                       # two tokens swap ids
    (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelError) as e:
        LocalTeacher.load(str(tmp_path / "t"), TOK, torch.float32, torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and "another vocabulary" in msg and "2 of" in msg


def test_a_teacher_head_wider_than_the_students():
    import transformers

    cfg = make_model("tiny", TOK).config
    cfg.vocab_size = len(TOK) + 64                        # padded head rows (Qwen2.5-7B against 1.5B)
    teacher = LocalTeacher(transformers.Qwen2ForCausalLM(cfg), TOK, "wide")
    with pytest.raises(ModelError, match="outputs, the student's"):
        teacher.check_vocab_size(make_model("tiny", TOK))
    # its top-k (distill.top_k) is taken among the student's ids, even where the padded rows would win it
    with torch.no_grad():
        teacher.model.get_output_embeddings().weight[len(TOK):] = 5.0
    b = _batch()
    train = load_config().train
    assert int(teacher.score(b, train, True, 1.0, None, 3)["teacher_topk_ids"].max()) >= len(TOK)
    teacher.rows = len(TOK)
    got = teacher.score(b, train, True, 1.0, None, 3)
    m = b.completion_mask
    assert int(got["teacher_topk_ids"].max()) < len(TOK)
    assert float(got["teacher_topk_logprobs"][m].exp().sum(-1).max()) < 0.5  # normalised over the whole head


@pytest.mark.parametrize("overrides,match", [
    (["distill.teachr=x"], "did you mean 'teacher'"),
    (["distill.teacher=x", "distill.signal=sampled", "distill.beta=0.5"], "setting of distill.signal=jsd"),
    (["distill.teacher=http://h:1", "distill.top_k=0"], "needs the teacher in the process"),
    (["distill.teacher=http://h:1", "distill.beta=0", "distill.add_tail=false"], "the loss is 0"),
    (["distill.teacher=x", "distill.signal=jsd", "distill.top_k=1", "distill.beta=0",
      "distill.add_tail=false"],
     "the loss is 0"),
    (["distill.teacher=x", "grpo.loss=gspo"], "per token"),
    (["distill.teacher=x", "grpo.dynamic_sampling=true"], "every group carries"),
    (["distill.teacher=x", "distill.weight=0"], "greater than 0"),
])
def test_config_refuses_what_means_nothing(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


def test_an_empty_teacher_on_the_command_line_turns_distillation_off():
    """``distill.teacher=`` (an empty value, which the override parser reads as null) is the default, off:
    a run of the distillation preset as plain GRPO, not a type error."""
    from nanogrpo.config import Config

    assert Config.load("demo-distill", ["distill.teacher="]).distill.teacher == ""
    assert load_config(overrides=["distill.teacher="]).distill.teacher == ""


def test_top_k_defaults_as_trl_does():
    """Unset: the whole vocabulary for a teacher in the process (DistillationTrainer), the top-1 for a server
    (ServerDistillationTrainer's ``loss_top_k``); jsd with beta 1 (reverse KL) by default, as TRL."""
    local = load_config(overrides=["distill.teacher=x"]).distill
    remote = load_config(overrides=["distill.teacher=http://h:1"]).distill
    assert (local.signal, local.beta, local.support_size(), remote.support_size()) == ("jsd", 1.0, 0, 1)
    sampled = load_config(overrides=["distill.teacher=http://h:1", "distill.signal=sampled"]).distill
    assert sampled.support_size() == 0


def test_the_full_divergence_has_gradient_through_the_chunks_only():
    """The chunked, checkpointed divergence equals the unchunked one (values and gradient)."""
    from nanogrpo.algo.distill import chunked_divergence, full_divergence

    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(7, 6, generator=g, dtype=torch.float64)
    wt = torch.randn(11, 6, generator=g, dtype=torch.float64)
    tg = torch.randint(0, 11, (7,), generator=g)
    fn = full_divergence(DistillSpec("jsd", 1.0, 0.3, 1.3), wt, None)
    a = chunked_divergence(fn, h, w, None, tg, [ht], chunk=3)
    ga = torch.autograd.grad(a[:, 0].sum(), (h, w))
    b = fn(F.linear(h, w), tg, ht)
    gb = torch.autograd.grad(b[:, 0].sum(), (h, w))
    assert torch.allclose(a, b, rtol=1e-12)
    assert all(torch.allclose(x, y, rtol=1e-10) for x, y in zip(ga, gb))
