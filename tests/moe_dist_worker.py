"""Routing replay under a distributed backend (run by tests/test_moe_dist.py through torchrun, 2 ranks):
each rank replays fixed routes over its rows of the MoE test batch, backward through the wrapped model;
rank r writes OUT/rank{r}.safetensors (its rows' log-probs, the routers' gradients, full tensors).

    torchrun --nproc_per_node 2 tests/moe_dist_worker.py --backend fsdp2 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanogrpo.algo.logprobs import token_logprobs  # noqa: E402
from nanogrpo.batch import RolloutBatch  # noqa: E402
from nanogrpo.config import Config  # noqa: E402
from nanogrpo.moe import moe_spec, replay_routes, trim_routes  # noqa: E402
from tests.moe_models import batch_tensors, build  # noqa: E402


def the_batch(routes_of) -> RolloutBatch:
    """The MoE test batch (3 groups of 2) with the routes ``routes_of(input_ids)``."""
    ids, am, cm, p = batch_tensors()
    n = ids.shape[0]
    return RolloutBatch(input_ids=ids, attention_mask=am.to(torch.int8), completion_mask=cm,
                        rewards=torch.zeros(n), advantages=torch.zeros(n), group_ids=torch.arange(n) // 2,
                        old_logprobs=torch.zeros(cm.shape), prompt_len=p, group_size=2, routes=routes_of(ids))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from safetensors.torch import save_file

    from nanogrpo.training.distributed import init_distributed, leave_launched_rank, make_backend
    from nanogrpo.training.micro import trim_rows
    from tests.test_moe import random_routes

    rank, world = init_distributed(a.backend)
    model = build("qwen3_moe")
    spec = moe_spec(model)
    batch = the_batch(lambda ids: random_routes(spec, *ids.shape, seed=11, prompt_len=batch_tensors()[3]))
    be = make_backend(Config.model_validate({"train": {"backend": a.backend}}), model)
    rows = torch.arange(batch.num_seqs)[rank::world]
    ids, am, p, lm, *_ = trim_rows(batch, rows)
    with replay_routes(be.model, trim_routes(batch, rows), ids, am) as trace:
        lp = token_logprobs(be.model, ids, am, p, lm, share_prefix=be.prefix_sharing)
        be.backward(lp.sum(), last=True)
    grads = {}
    for i, router in enumerate(moe_spec(be.model).routers):
        g = router.weight.grad
        grads[f"router{i}"] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    out = torch.zeros(batch.completion_mask.shape)
    out[rows, :lp.shape[1]] = lp.detach()
    save_file({"logprobs": out, "rows": rows.contiguous(), "flipped": torch.tensor(trace.stats.flipped),
               **grads}, str(Path(a.out) / f"rank{rank}.safetensors"))
    leave_launched_rank(0)


if __name__ == "__main__":
    main()
