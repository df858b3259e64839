"""Vision-language GRPO on tiny random-init models of the real families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
LLaVA): the pixels nanogrpo renders equal HF's processor's, the hf engine's greedy tokens and
log-probs equal unbatched ``model.generate`` and a full forward with images of two sizes in one
batch, the trainer's log-probs (train mode, micro-batched) equal them too, two images in one
prompt, and the batch's images survive the wire."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

pytest.importorskip("PIL")

from nanogrpo.batch import BatchError, RolloutBatch  # noqa: E402
from nanogrpo.config import Config  # noqa: E402
from nanogrpo.data.images import encode_with_images, render, smart_resize  # noqa: E402
from nanogrpo.engines.base import SamplingParams  # noqa: E402
from nanogrpo.engines.hf import HFEngine  # noqa: E402
from nanogrpo.models.tiny_vision import FAMILIES, make_vlm  # noqa: E402
from nanogrpo.models.vision import forward_kwargs, image_spec  # noqa: E402
from nanogrpo.rewards import RewardRunner  # noqa: E402
from nanogrpo.rollout.collect import Collector  # noqa: E402
from nanogrpo.training.step import batch_logprobs  # noqa: E402
from tests.vision_fixtures import MAX_PIXELS, MIN_PIXELS, picture  # noqa: E402

TOL = 1e-4  # as tests/conformance.py's


def _cfg(**data) -> Config:
    return Config.model_validate({"data": {"system_prompt": "", "min_image_pixels": MIN_PIXELS,
                                           "max_image_pixels": MAX_PIXELS, **data},
                                  "grpo": {"group_size": 2, "beta": 0.04},
                                  "rollout": {"max_new_tokens": 6, "engine": "hf"}})


def _sampled(cfg: Config) -> Config:
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"temperature": 1.0})})


def _setup(family: str):
    model, tok = make_vlm(family, seed=1)
    engine = HFEngine(model, tokenizer=tok)
    engine.vision = image_spec(model, tok, None, MIN_PIXELS, MAX_PIXELS)
    return model, tok, engine


def _rows():
    """Two rows with one image each, of two sizes; one row with two images."""
    return [{"question": "<image>What is it?", "answer": "1",
             "images": [picture(16, 16, 1)]},
            {"question": "Look: <image> now", "answer": "2", "images": [picture(24, 40, 2)]},
            {"question": "<image> or <image>?", "answer": "3",
             "images": [picture(20, 12, 3), picture(8, 8, 4)]}]


_COUNTER = itertools.count()


def _spread(text: str, sample: dict) -> float:
    """A reward that differs between every two samples (so every group keeps its signal)."""
    return float(next(_COUNTER))


def _full_forward(model, prompt: list[int], completion: list[int], pv, grid) -> torch.Tensor:
    """Log-probs (C,) of ``completion`` from one unpadded forward of prompt + completion."""
    ids = torch.tensor([prompt + completion])
    kw = forward_kwargs(model, ids, pv, grid)
    kw.setdefault("position_ids", torch.arange(ids.shape[1])[None])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits[0].float()
    p = len(prompt)
    return logits[p - 1:-1].log_softmax(-1).gather(-1, ids[0, p:, None]).squeeze(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_pixels_equal_the_hf_processor(family):
    """nanogrpo's resize + normalise + patches equal the HF PIL processor's, for odd sizes too."""
    model, tok = make_vlm(family)
    spec = image_spec(model, tok, None, MIN_PIXELS, MAX_PIXELS)
    imgs = [picture(16, 16, 0), picture(23, 41, 1), picture(70, 9, 2)]
    ours = render(imgs, spec)
    if family == "llava":
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        from nanogrpo.models.vision import llava_images

        hf = LlavaImageProcessorPil(size={"height": 16, "width": 16}, crop_size={"height": 16, "width": 16},
                                    do_center_crop=False)(images=imgs, return_tensors="pt")
        assert torch.allclose(llava_images(ours.pixel_values, ours.grid), hf["pixel_values"], atol=1e-5)
        return
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=MIN_PIXELS,
                                  max_pixels=MAX_PIXELS)(images=imgs, return_tensors="pt")
    assert torch.equal(ours.grid, hf["image_grid_thw"])
    assert torch.allclose(ours.pixel_values, hf["pixel_values"], atol=1e-5)


def test_smart_resize_keeps_bounds_and_multiples():
    for h, w in [(10, 10), (100, 30), (3, 20), (224, 224)]:
        rh, rw = smart_resize(h, w, 8, MIN_PIXELS, MAX_PIXELS)
        assert rh % 8 == 0 and rw % 8 == 0 and MIN_PIXELS <= rh * rw <= MAX_PIXELS
    # a side never goes under one factor (the processor's rule): a thin image may then pass the cap
    assert smart_resize(1000, 30, 8, MIN_PIXELS, MAX_PIXELS) == (184, 8)
    with pytest.raises(ValueError, match="aspect"):
        smart_resize(1, 300, 8, MIN_PIXELS, MAX_PIXELS)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_and_trainer_agree_with_model_generate_and_a_full_forward(family):
    """Greedy: the engine's batched tokens (left-padded, images of several sizes, one prompt with two
    images) equal ``model.generate`` on each prompt alone; the engine's log-probs and the trainer's (train
    mode, micro-batches of one row and of all rows) equal a full unpadded forward."""
    model, tok, engine = _setup(family)
    cfg = _cfg()
    rows = _rows()
    ids, skipped, vis = encode_with_images(tok, rows, cfg.data, "auto", engine.vision)
    assert not skipped and [v.num_images for v in vis] == [1, 1, 2]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    gen = engine.generate(ids, params, images=vis)
    for i, (p, v) in enumerate(zip(ids, vis)):
        alone = HFEngine(model, tokenizer=tok)
        alone.vision = engine.vision
        one = alone.generate([p], params, images=[v])
        assert one.completion_ids[0] == gen.completion_ids[i]
        full = _full_forward(model, p, gen.completion_ids[i], v.pixel_values, v.grid)
        assert (full - torch.tensor(gen.logprobs[i])).abs().max() <= TOL
    # the trainer: a real rollout batch (sampled), in train mode, per row and all rows at once
    rewards = RewardRunner([_spread], workers=0)
    batch, _ = Collector(engine, tok, rewards, _sampled(cfg)).collect(rows, seed=3)
    assert batch is not None and batch.has_images and batch.num_seqs == 6  # every group kept
    assert batch.image_counts.tolist() == [1, 1, 1, 1, 2, 2]
    model.train()
    for mbs in (1, 64):
        train = cfg.train.model_copy(update={"micro_batch_size": mbs, "micro_batch_tokens": 0})
        lp, _ = batch_logprobs(model, batch, train, share_prefix=True)
        assert (lp - batch.old_logprobs).abs().max() <= TOL  # the engine's behaviour log-probs
    for r in range(batch.num_seqs):
        pv, grid, _ = batch.images_of([r])
        am = batch.attention_mask[r].bool()
        seq = batch.input_ids[r][am].tolist()
        n_c = int(batch.completion_mask[r].sum())
        full = _full_forward(model, seq[:-n_c], seq[-n_c:], pv, grid)
        assert (full - batch.old_logprobs[r, :n_c]).abs().max() <= TOL


def test_micro_batches_never_mix_rows_images_and_sum_to_the_full_batch_gradient():
    """Losses and gradients equal with and without micro-batching (rows' images selected with them)."""
    from nanogrpo.training.distributed import Backend
    from nanogrpo.training.step import policy_update

    class _Recording(Backend):
        def clip_and_step(self, max_norm: float) -> float:  # the accumulated gradient, before the step
            self.grads = torch.cat([p.grad.flatten() for p in self.module.parameters() if p.grad is not None])
            return super().clip_and_step(max_norm)

    model, tok, engine = _setup("qwen2_vl")
    cfg = _cfg()
    rewards = RewardRunner([_spread], workers=0)
    batch, _ = Collector(engine, tok, rewards, _sampled(cfg)).collect(_rows(), seed=5)
    batch.ref_logprobs = batch_logprobs(model, batch, cfg.train, True)[0].float()
    grads, losses = [], []
    for mbs in (1, 64):
        m = make_vlm("qwen2_vl", seed=1)[0].double()
        b = RolloutBatch(**batch.tensors(), prompt_len=batch.prompt_len, group_size=batch.group_size)
        be = _Recording(m, lr=0.0)
        train = cfg.train.model_copy(update={"micro_batch_size": mbs, "micro_batch_tokens": 0})
        res = policy_update(be, b, cfg.model_copy(update={"train": train}), on_policy=True)
        assert not res.skipped_nonfinite
        losses.append(res.loss)
        grads.append(be.grads)
    assert abs(losses[0] - losses[1]) < 1e-10
    assert torch.allclose(grads[0], grads[1], atol=1e-10, rtol=0)


def test_images_travel_on_the_wire_and_bad_ones_are_refused():
    model, tok, engine = _setup("qwen2_vl")
    cfg = _cfg()
    rewards = RewardRunner([_spread], workers=0)
    batch, _ = Collector(engine, tok, rewards, _sampled(cfg)).collect(_rows(), seed=7)
    back = RolloutBatch.from_bytes(batch.to_bytes(), vocab_size=len(tok))
    for k in ("pixel_values", "image_grid_thw", "image_counts"):
        assert torch.equal(getattr(back, k), getattr(batch, k))
    sub = batch.select(torch.tensor([batch.num_seqs - 1]))
    assert sub.image_counts.tolist() == [batch.image_counts.tolist()[-1]]
    bad = [("pixel_values", batch.pixel_values[:-1], "patch rows"),
           ("pixel_values", batch.pixel_values.double(), "float32"),
           ("image_counts", batch.image_counts + 1, "add up"),
           ("image_grid_thw", batch.image_grid_thw[:, :2], "(I, 3)")]
    for name, value, msg in bad:
        t = dict(batch.tensors(), **{name: value})
        b = RolloutBatch(**t, prompt_len=batch.prompt_len, group_size=batch.group_size)
        with pytest.raises(BatchError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            RolloutBatch.from_bytes(b.to_bytes())
    t = {k: v for k, v in batch.tensors().items() if k != "image_counts"}
    b = RolloutBatch(**t, prompt_len=batch.prompt_len, group_size=batch.group_size)
    with pytest.raises(BatchError, match="as a set"):
        RolloutBatch.from_bytes(b.to_bytes())


def test_fast_and_vllm_engines_refuse_a_vision_model_in_one_line():
    from nanogrpo.engines.factory import make_engine

    model, tok = make_vlm("qwen2_vl")
    for name in ("fast", "vllm"):
        with pytest.raises(ValueError, match="use rollout.engine=hf") as e:
            make_engine(name, model, tok)
        assert "\n" not in str(e.value)
    assert make_engine("auto", model, tok).name == "hf"


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_from_an_image_dataset_with_zero_first_step_kl(family, tmp_path):
    """``nanogrpo train`` on a checkpoint directory and a .jsonl of image paths: 2 steps, the reference
    equal to the policy at step 1 (KL exactly 0), the vision tower frozen (unchanged in the checkpoint),
    its projector into the language model trained (changed)."""
    from safetensors.torch import load_file

    from nanogrpo.cli import main as cli
    from nanogrpo.training.metrics import read_metrics
    from tests.vision_fixtures import checkpoint, image_dataset

    model_dir = checkpoint(family, tmp_path)
    data = image_dataset(tmp_path)
    code = cli(["train", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "run"),
                "--steps", "2", "rollout.prompts_per_step=2", "grpo.group_size=4", "rollout.max_new_tokens=8",
                "grpo.beta=0.04", 'rewards.functions=["tests.reward_fixtures:length","format"]',
                "rewards.workers=0", "train.save_every=0", "eval.every=0", "train.lr=1e-2",
                "log.samples_every=1"])
    assert code == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and rows[0]["kl"] == 0.0
    before = load_file(model_dir / "model.safetensors")
    after = load_file(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors")
    projector = [k for k in before
                 if any(part in k for part in (".merger.", "deepstack_merger", "multi_modal_projector"))]
    tower = [k for k in before if ("visual" in k or "vision_tower" in k) and k not in projector]
    lm = [k for k in before if k not in tower and "embed_tokens" in k]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert projector and any(not torch.equal(before[k], after[k]) for k in projector)  # it trains
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "preprocessor_config.json").is_file()
    assert any(not torch.equal(before[k], after[k]) for k in lm)
    # the logged samples carry their images; the report shows them beside the completions
    from nanogrpo.report import load_run, samples_html

    page = samples_html([load_run(tmp_path / "run")], tmp_path / "report").read_text()
    assert page.count('<img src="data:image/png;base64,') >= 2


@pytest.mark.parametrize("family, mergers", [("qwen2_vl", 6), ("qwen2_5_vl", 5)])
def test_train_vision_false_freezes_the_tower_and_trains_the_merger(family, mergers, tmp_path):
    """model.train_vision=false, through the real loading path: the tower's patch embedding and blocks
    take no gradient, its merger (the projector into the language model) does, as the guide and the
    demo's preset say (issue 44: 0 of 6 / 0 of 5 merger tensors were trainable)."""
    from nanogrpo.config import ModelConfig
    from nanogrpo.models.load import load_policy
    from nanogrpo.models.vision import vision_tower
    from tests.vision_fixtures import checkpoint

    model, tok, _ = load_policy(ModelConfig(path=str(checkpoint(family, tmp_path)), cpu_linear="torch"))
    tower = dict(vision_tower(model).named_parameters())
    merger = {k: p for k, p in tower.items() if k.startswith("merger.")}
    rest = {k: p for k, p in tower.items() if k not in merger}
    assert len(merger) == mergers and all(p.requires_grad for p in merger.values())
    assert rest and not any(p.requires_grad for p in rest.values())
    engine = HFEngine(model, tokenizer=tok)
    engine.vision = image_spec(model, tok, None, MIN_PIXELS, MAX_PIXELS)
    ids, _, vis = encode_with_images(tok, _rows()[:1], _cfg().data, "auto", engine.vision)
    x = torch.tensor(ids)
    out = model(input_ids=x, attention_mask=torch.ones_like(x),
                **forward_kwargs(model, x, vis[0].pixel_values, vis[0].grid))
    out.logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in merger.values())
    assert all(p.grad is None for p in rest.values())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava"])
def test_the_vision_tower_runs_once_per_group(family):
    """The G samples of a group share their images: the trainer's forward runs the tower on one row's
    images per group (the log-probs and gradients are those of the plain forward: the tests above)."""
    from nanogrpo.models.vision import vision_tower

    model, tok, engine = _setup(family)
    cfg = _cfg()
    rewards = RewardRunner([_spread], workers=0)
    batch, _ = Collector(engine, tok, rewards, _sampled(cfg)).collect(_rows(), seed=4)
    seen = []
    hook = vision_tower(model).register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        lp_shared, _ = batch_logprobs(model, batch, cfg.train.model_copy(update={"micro_batch_size": 64}),
                                      True)
        per_group = sum(seen)
        seen.clear()
        lp_rows, _ = batch_logprobs(model, batch, cfg.train.model_copy(update={"micro_batch_size": 1}), True)
    finally:
        hook.remove()
    assert per_group * cfg.grpo.group_size == sum(seen)   # rows alone: every row runs its own images
    assert torch.allclose(lp_shared, lp_rows, atol=1e-6, rtol=0)


@pytest.mark.slow  # (over 1.3 s: the fast suite stays under a minute)
def test_lora_and_gradient_checkpointing_with_images(tmp_path):
    """LoRA adapts the language model only; gradient checkpointing and micro-batches of one row run the
    images through; the adapter checkpoint resumes."""
    from nanogrpo.cli import main as cli
    from nanogrpo.training.metrics import read_metrics
    from tests.vision_fixtures import checkpoint, image_dataset

    model_dir = checkpoint("qwen2_vl", tmp_path)
    data = image_dataset(tmp_path)
    head = ["train", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "run")]
    keys = ["rollout.prompts_per_step=2", "grpo.group_size=4", "rollout.max_new_tokens=8", "grpo.beta=0.04",
            'rewards.functions=["tests.reward_fixtures:length","format"]', "rewards.workers=0",
            "eval.every=0", "model.lora_r=4", "train.gradient_checkpointing=true", "train.micro_batch_size=1",
            "train.lr=1e-2", "train.save_every=1"]
    assert cli([*head, "--steps", "1", *keys]) == 0
    adapter = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "adapter_config.json").read_text())
    assert "visual" in adapter["target_modules"]  # the regex that leaves the tower out
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "run" / "checkpoints" / "step_1" / "adapter_model.safetensors")
    assert saved and not [k for k in saved if "visual" in k] and any("language_model" in k for k in saved)
    assert cli([*head, "--steps", "2", "--resume", str(tmp_path / "run"), *keys]) == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["kl"] == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_without_images_beside_rows_with_them(family):
    """A batch mixing text-only prompts (of two lengths: left padding) with a prompt with an image: the
    trainer's log-probs equal the engine's, micro-batch by micro-batch or all at once."""
    model, tok, engine = _setup(family)
    cfg = _cfg()
    rows = [{"question": "What is it?", "answer": "1"}, {"question": "Look: now, longer", "answer": "2"},
            {"question": "<image>x", "answer": "3", "images": [picture(16, 16, 1)]}]
    rewards = RewardRunner([_spread], workers=0)
    batch, _ = Collector(engine, tok, rewards, _sampled(cfg)).collect(rows, seed=3)
    assert batch.image_counts.tolist() == [0, 0, 0, 0, 1, 1]
    for mbs in (1, 64):
        lp, _ = batch_logprobs(model, batch, cfg.train.model_copy(update={"micro_batch_size": mbs}), True)
        assert (lp - batch.old_logprobs).abs().max() <= TOL


def test_a_batch_whose_images_disagree_with_its_tokens_is_named():
    from nanogrpo.models.tiny import make_model, make_tokenizer
    from nanogrpo.models.vision import image_token_error

    model, tok, engine = _setup("qwen2_vl")
    cfg = _cfg()
    rewards = RewardRunner([_spread], workers=0)
    batch, _ = Collector(engine, tok, rewards, _sampled(cfg)).collect(_rows(), seed=6)
    assert image_token_error(model, batch) is None
    two = batch.select(torch.tensor([4, 0]))  # the two-image row first: its images go with it
    assert image_token_error(model, two) is None and two.image_counts.tolist() == [2, 1]
    swapped = RolloutBatch(**dict(two.tensors(), image_counts=two.image_counts.flip(0)),
                           prompt_len=two.prompt_len, group_size=1)  # counts that add up, rows mixed
    assert "image tokens, its images make" in image_token_error(model, swapped)
    text = make_model("tiny", make_tokenizer())
    assert "text model" in image_token_error(text, batch)
