"""LoRA: only adapters train, the reference is the same model with adapters disabled, checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from nanogrpo.algo.logprobs import batch_token_logprobs  # noqa: E402
from nanogrpo.models.lora import apply_lora, load_adapter, reference_for  # noqa: E402
from nanogrpo.models.tiny import make_model, make_tokenizer  # noqa: E402
from nanogrpo.training.distributed import Backend  # noqa: E402
from nanogrpo.training.step import policy_update  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import make_batch, make_cfg  # noqa: E402


def test_lora_step_reference_and_checkpoint(tmp_path):
    tok = make_tokenizer()
    base = make_model("tiny", tok, seed=0)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = make_cfg("single", lora=4)
    model = apply_lora(base, cfg.model)
    ref = reference_for(model)
    batch = make_batch(len(tok))
    ref_lp = batch_token_logprobs(ref, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                  batch.completion_mask)
    be = Backend(model, lr=1e-2)
    res = policy_update(be, batch, cfg, on_policy=True)
    assert not res.skipped_nonfinite
    # base weights untouched; the reference (adapters off) still equals the original model
    plain = make_model("tiny", tok, seed=0)
    want = batch_token_logprobs(plain, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                batch.completion_mask)
    again = batch_token_logprobs(ref, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                 batch.completion_mask)
    assert torch.allclose(ref_lp, want, atol=1e-5) and torch.allclose(again, want, atol=1e-5)
    policy_lp = batch_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                     batch.completion_mask)
    assert not torch.allclose(policy_lp, want, atol=1e-4)  # the adapters moved the policy
    merged_sd = model.get_base_model().state_dict()
    assert all(torch.equal(before[k], merged_sd[k]) for k in before if k in merged_sd)
    # checkpoint: adapter + merged model
    path = be.save(tmp_path / "ckpt", 1, tok, {}, save_merged=True)
    assert (path / "adapter_config.json").is_file()
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(path / "merged")
    reloaded = load_adapter(make_model("tiny", tok, seed=0), path)
    ids = batch.input_ids[:2]
    with torch.no_grad():
        want_logits = model(input_ids=ids).logits
        assert torch.allclose(merged(ids).logits, want_logits, atol=1e-4)
        assert torch.allclose(reloaded(input_ids=ids).logits, want_logits, atol=1e-4)


def _lora_run_args(assets: Path, out: Path, steps: int) -> list[str]:
    from tests.run_fixtures import evaluated_on

    return ["train", "--model", str(assets / "model"), "--data", str(assets / "data.jsonl"),
            "--out", str(out), "--steps", str(steps), "--seed", "5", "model.lora_r=4",
            "data.answer_delimiter=####", "data.system_prompt=''", "rollout.max_new_tokens=8",
            "rollout.prompts_per_step=2", "grpo.group_size=4", "rewards.workers=0",
            "rewards.functions=['tests.reward_fixtures:length']", "train.lr=1e-2", "train.save_every=2",
            "grpo.beta=0.04", "log.tensorboard=false", evaluated_on(assets / "data.jsonl")]


@pytest.mark.slow
def test_lora_run_resumes_from_its_adapter_checkpoint_exactly(tmp_path):
    from nanogrpo.cli import main
    from tests.run_fixtures import comparable_metrics, write_tiny_run_assets

    write_tiny_run_assets(tmp_path, rows=8)

    def metrics(run):  # the halves run also evaluates at its own last step (2)
        return comparable_metrics(run, drop_eval=True)

    assert main(_lora_run_args(tmp_path, tmp_path / "straight", 4)) == 0
    assert main(_lora_run_args(tmp_path, tmp_path / "halves", 2)) == 0
    assert (tmp_path / "halves/checkpoints/step_2/adapter_config.json").is_file()
    assert main(["train", "--resume", str(tmp_path / "halves"), "--steps", "4"]) == 0
    straight = metrics(tmp_path / "straight")
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4]  # step 0: the held-out baseline
    assert sum(r.get("loss") is not None for r in straight) >= 2, "the test needs steps updating the adapter"
    assert metrics(tmp_path / "halves") == straight


def test_resume_kind_must_fit_the_config(tmp_path):
    from nanogrpo.errors import ConfigError
    from nanogrpo.training.setup import check_resume_kind

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter/adapter_config.json").write_text("{}")
    (tmp_path / "full").mkdir()
    assert check_resume_kind(None, 4) is False
    assert check_resume_kind(tmp_path / "adapter", 4) is True
    with pytest.raises(ConfigError, match="lora_r is 0"):
        check_resume_kind(tmp_path / "adapter", 0)
    with pytest.raises(ConfigError, match="not a LoRA adapter"):
        check_resume_kind(tmp_path / "full", 4)
