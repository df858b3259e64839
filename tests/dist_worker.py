"""One GRPO update step under a distributed backend (run by tests/test_distributed.py through a launcher).

    torchrun --nproc_per_node 2 tests/dist_worker.py --backend ddp --out DIR
    deepspeed --num_gpus 2 tests/dist_worker.py --backend deepspeed --stage 2 --out DIR

Rank 0 writes DIR/weights.safetensors (the gathered weights after the step), DIR/result.json
and a checkpoint DIR/ckpt/step_1 (HF format, saved by the backend from all ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanogrpo.batch import RolloutBatch  # noqa: E402
from nanogrpo.config import Config  # noqa: E402
from nanogrpo.models.tiny import make_model, make_tokenizer  # noqa: E402


def make_batch(vocab: int, n: int = 8, p: int = 6, c: int = 9, seed: int = 1) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, p + c), generator=g)
    am = torch.ones(n, p + c, dtype=torch.int8)
    cm = torch.zeros(n, c, dtype=torch.bool)
    for i in range(n):
        pad = int(torch.randint(0, 3, (1,), generator=g))
        clen = int(torch.randint(1, c + 1, (1,), generator=g))
        am[i, :pad] = 0
        ids[i, :pad] = 0
        cm[i, :clen] = True
        am[i, p + clen:] = 0
        ids[i, p + clen:] = 0
    for i in range(n):  # each group of 4 shares its first row's prompt (prefix sharing is exercised)
        ids[i, :p], am[i, :p] = ids[i - i % 4, :p], am[i - i % 4, :p]
    adv = torch.randn(n, generator=g)
    ref = -torch.rand(n, c, generator=g) * 3 * cm
    return RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=adv.clone(),
                        advantages=adv, group_ids=torch.arange(n) // 4, old_logprobs=torch.zeros(n, c),
                        prompt_len=p, group_size=4, ref_logprobs=ref)


def make_cfg(backend: str = "single", stage: int = 2, lora: int = 0) -> Config:
    """``NANOGRPO_TEST_ALGO`` (JSON): ``grpo`` / ``rollout`` keys on top (the loss variants under ranks)."""
    extra = json.loads(os.environ.get("NANOGRPO_TEST_ALGO", "{}"))
    return Config.model_validate({
        "model": {"lora_r": lora},
        "distill": extra.get("distill", {}),
        "grpo": {"beta": 0.04, **extra.get("grpo", {})},
        "train": {"lr": 1e-3, "backend": backend, "zero_stage": stage, "micro_batch_size": 3,
                  "micro_batch_tokens": 40, "optimizer_offload": backend == "deepspeed"},
        "rollout": {"max_new_tokens": 9, **extra.get("rollout", {})},
    })


def make_distill(cfg: Config, tok, batch: RolloutBatch | None, share_prefix: bool = True):
    """``distill`` in ``NANOGRPO_TEST_ALGO``: a teacher in the process (a tiny model of another seed) scoring
    ``batch`` (this rank's share), as the trainer does; None without it."""
    if not cfg.distill.teacher:
        return None
    from nanogrpo.training.distill import Distill, LocalTeacher

    d = Distill.with_teacher(cfg, LocalTeacher(make_model("tiny", tok, seed=7), tok, "teacher"))
    if batch is not None:
        d.annotate(batch, cfg.train, share_prefix)
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--out", required=True)
    a, _ = ap.parse_known_args()  # the deepspeed launcher adds --local_rank
    if os.environ.get("NANOGRPO_HANG_DUMP"):  # debugging a hung collective: dump stacks and exit
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["NANOGRPO_HANG_DUMP"]), exit=True)
    from nanogrpo.training.distributed import init_distributed, leave_launched_rank, make_backend
    from nanogrpo.training.step import policy_update

    cfg = make_cfg(a.backend, a.stage)
    rank, world = init_distributed(a.backend)
    tok = make_tokenizer()
    model = make_model("tiny", tok, seed=0)
    be = make_backend(cfg, model)
    batch = make_batch(len(tok))
    mine = batch.select(torch.arange(batch.num_seqs)[rank::world])
    res = policy_update(be, mine, cfg, on_policy=True,
                        terms=make_distill(cfg, tok, mine, cfg.train.share_prefix and be.prefix_sharing))
    sd = be.full_state_dict()
    out = Path(a.out)
    be.save(out / "ckpt", 1, tok, {"policy_version": 1})
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(out / "weights.safetensors"))
        (out / "result.json").write_text(json.dumps({"loss": res.loss, "grad_norm": res.grad_norm,
                                                     "skipped": res.skipped_nonfinite, "world": world,
                                                     "metrics": res.metrics}))
    leave_launched_rank(0)  # as the CLI ends a launched rank: gloo's teardown at exit can abort


if __name__ == "__main__":
    main()
