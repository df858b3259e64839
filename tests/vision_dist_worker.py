"""One GRPO update on a batch with images under DDP or FSDP2 (2 ranks, gloo), run by
tests/test_vision_distributed.py through torchrun; rank 0 writes DIR/weights.safetensors (the gathered
weights after the step) and DIR/result.json.

    torchrun --nproc_per_node 2 tests/vision_dist_worker.py --backend ddp --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanogrpo.batch import RolloutBatch  # noqa: E402
from nanogrpo.config import Config  # noqa: E402


def make_cfg(backend: str) -> Config:
    return Config.model_validate({
        "data": {"system_prompt": "", "min_image_pixels": 64, "max_image_pixels": 1024},
        "grpo": {"beta": 0.04, "group_size": 2},
        "train": {"lr": 1e-3, "backend": backend, "micro_batch_size": 2},
        "rollout": {"max_new_tokens": 5},
    })


def make_batch(cfg: Config) -> tuple:
    """(model, a batch of 3 prompts x 2 samples with images of three sizes, one prompt with two images)."""
    from nanogrpo.algo.vision import concat
    from nanogrpo.data.images import encode_with_images
    from nanogrpo.models.tiny_vision import make_vlm
    from nanogrpo.models.vision import image_spec, media_token_ids
    from nanogrpo.rollout.collect import pad_batch
    from tests.vision_fixtures import picture

    model, tok = make_vlm("qwen2_vl", seed=1)
    rows = [{"question": "<image>What is it?", "answer": "1", "images": [picture(16, 16, 1)]},
            {"question": "Look: <image> now", "answer": "2", "images": [picture(24, 40, 2)]},
            {"question": "<image> or <image>?", "answer": "3",
             "images": [picture(20, 12, 3), picture(8, 8, 4)]}]
    spec = image_spec(model, tok, None, 64, 1024)
    prompts, _, vis = encode_with_images(tok, rows, cfg.data, "auto", spec)
    g = torch.Generator().manual_seed(0)
    banned = set(media_token_ids(model))
    prompts2, comps, per = [], [], []
    for p, v in zip(prompts, vis):
        for _ in range(2):
            n = int(torch.randint(1, 6, (1,), generator=g))
            c = [t for t in torch.randint(3, len(tok), (n + 3,), generator=g).tolist() if t not in banned][:n]
            prompts2.append(p)
            comps.append(c or [5])
            per.append((v.pixel_values, v.grid))
    ids, am, cm, lp, plen = pad_batch(prompts2, comps, [[0.0] * len(c) for c in comps], tok.pad_token_id)
    pv, grid, counts = concat(per, per[0][0].shape[1])
    adv = torch.randn(len(comps), generator=g)
    ref = -torch.rand(cm.shape, generator=g) * 2 * cm
    batch = RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=adv.clone(),
                         advantages=adv, group_ids=torch.arange(len(comps)) // 2, old_logprobs=lp,
                         prompt_len=plen, group_size=2, ref_logprobs=ref, pixel_values=pv,
                         image_grid_thw=grid, image_counts=counts)
    batch.validate(len(tok))
    return model, batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", required=True)
    a, _ = ap.parse_known_args()
    from nanogrpo.training.distributed import init_distributed, leave_launched_rank, make_backend
    from nanogrpo.training.step import policy_update

    cfg = make_cfg(a.backend)
    rank, world = init_distributed(a.backend)
    model, batch = make_batch(cfg)
    be = make_backend(cfg, model)
    mine = batch.select(torch.arange(batch.num_seqs)[rank::world])  # each rank's rows, their images with them
    res = policy_update(be, mine, cfg, on_policy=True)
    sd = be.full_state_dict()
    if rank == 0:
        from safetensors.torch import save_file

        out = Path(a.out)
        save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(out / "weights.safetensors"))
        (out / "result.json").write_text(json.dumps({"loss": res.loss, "grad_norm": res.grad_norm,
                                                     "skipped": res.skipped_nonfinite, "world": world}))
    leave_launched_rank(0)  # as the CLI ends a launched rank: gloo's teardown at exit can abort


if __name__ == "__main__":
    main()
