"""Split mode with images: a batch's pixels travel to the reference server, which computes its
reference log-probs with them; a malformed image field is a 4xx and nothing is queued."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("httpx")

from nanogrpo.batch import RolloutBatch  # noqa: E402
from nanogrpo.rewards import RewardRunner  # noqa: E402
from nanogrpo.rollout.collect import rollout  # noqa: E402
from nanogrpo.serve.server import (  # noqa: E402
    ServerState,
    Settings,
    make_ref_fn,  # noqa: E402
)
from nanogrpo.training.step import batch_logprobs  # noqa: E402
from tests.test_serve import AUTH, run  # noqa: E402
from tests.test_serve_helpers import TOKEN  # noqa: E402
from tests.test_vision import _cfg, _rows, _sampled, _setup  # noqa: E402

_COUNT = itertools.count()


def test_reference_server_uses_the_images_and_refuses_malformed_ones():
    model, tok, engine = _setup("qwen2_vl")
    cfg = _cfg()
    rewards = RewardRunner([lambda t, s: float(next(_COUNT))], workers=0)
    batch, _ = rollout(engine, tok, _rows(), rewards, cfg.data, _sampled(cfg), cfg.grpo, template="auto",
                       seed=9)
    st = ServerState(Settings(vocab_size=len(tok), max_seqs=64, max_len=64, max_body=1 << 20,  # pixels
                              max_weights_body=1 << 20), TOKEN, make_ref_fn(model, torch.device("cpu"), 2, 7))
    bad = RolloutBatch(**dict(batch.tensors(), image_counts=batch.image_counts + 1),
                       prompt_len=batch.prompt_len, group_size=batch.group_size)

    async def fn(c):
        r = await c.post("/upload", content=bad.to_bytes(), headers=AUTH)
        assert 400 <= r.status_code < 500 and "add up" in r.text
        assert (await c.get("/get", headers=AUTH)).status_code == 204  # nothing queued
        assert (await c.post("/upload", content=batch.to_bytes(), headers=AUTH)).status_code == 200
        return RolloutBatch.from_bytes((await c.get("/get", headers=AUTH)).content)
    got = run(st, fn)
    want = batch_logprobs(model, batch, cfg.train, True)[0]
    assert torch.equal(got.pixel_values, batch.pixel_values)
    torch.testing.assert_close(got.ref_logprobs, want.float(), atol=1e-5, rtol=0)
    # without its images the same tokens score otherwise: the server did use them
    plain = RolloutBatch(**{k: v for k, v in batch.tensors().items() if k not in
                            ("pixel_values", "image_grid_thw", "image_counts")},
                         prompt_len=batch.prompt_len, group_size=batch.group_size)
    blind = batch_logprobs(model, plain, cfg.train, True)[0]
    assert (blind - want).abs().max() > 1e-3
