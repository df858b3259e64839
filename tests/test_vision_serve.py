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
from nanogrpo.rollout.collect import Collector  # noqa: E402
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
    batch, _ = Collector(engine, tok, rewards, _sampled(cfg)).collect(_rows(), seed=9)
    st = ServerState(Settings(vocab_size=len(tok), max_seqs=64, max_len=64, max_body=1 << 20,  # pixels
                              max_weights_body=1 << 20), TOKEN, make_ref_fn(model, torch.device("cpu"), 2, 7))
    bad = RolloutBatch(**dict(batch.tensors(), image_counts=batch.image_counts + 1),
                       prompt_len=batch.prompt_len, group_size=batch.group_size)

    # well-formed tensors that disagree with the model: a completion holding the image token
    tid = model.config.image_token_id
    ids = batch.input_ids.clone()
    ids[0, batch.prompt_len] = tid
    wrong = RolloutBatch(**dict(batch.tensors(), input_ids=ids), prompt_len=batch.prompt_len,
                         group_size=batch.group_size)

    async def fn(c):
        r = await c.post("/upload", content=bad.to_bytes(), headers=AUTH)
        assert 400 <= r.status_code < 500 and "add up" in r.text
        r = await c.post("/upload", content=wrong.to_bytes(), headers=AUTH)
        assert r.status_code == 400 and "holds the image token" in r.text
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


@pytest.mark.slow
def test_split_mode_trains_the_vision_demo(tmp_path):
    """``nanogrpo serve`` (the reference model), a ``nanogrpo rollout`` worker and ``nanogrpo train
    --server`` on the vision demo: batches with images cross both HTTP hops; the trainer takes 4 steps."""
    import httpx

    from nanogrpo.training.metrics import read_metrics
    from tests.test_serve_e2e import AUTH as E2E_AUTH
    from tests.test_serve_e2e import _server, _spawn, _stop
    from tests.test_serve_helpers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    ov = ["--config", "demo-vision", "rollout.prompts_per_step=4", "train.save_every=0", "train.steps=4",
          f"train.out={out}", "eval.every=0", "rewards.workers=0", "server.max_staleness=4",
          "server.retry_for_s=120", "server.timeout_s=20"]
    server = _server(port, tmp_path, ov, tmp_path / "server.log")
    worker = _spawn(["rollout", "--server", url, "--worker-id", "w1", "--batches", "6", *ov],
                    tmp_path / "w1.log")
    trainer = _spawn(["train", "--server", url, *ov], tmp_path / "trainer.log")
    try:
        assert trainer.wait(timeout=600) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        stats = httpx.get(url + "/stats", headers=E2E_AUTH, timeout=10).json()
    finally:
        _stop(worker, trainer, server)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["loss"] is not None and r["kl"] is not None for r in rows)
    assert stats["ref_tokens_per_s"] > 0
