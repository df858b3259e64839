"""The trainer's side of exactly-once delivery: its inbox, and a split-mode run against a real server."""

from __future__ import annotations

import json

import httpx
import pytest

from nanogrpo.serve.inbox import Inbox
from nanogrpo.training.metrics import read_metrics
from tests.test_serve_helpers import TOKEN, LiveServer, make_batch


class AckScript:
    """The server's answers to acknowledgements, in order (the inbox is what is under test)."""

    def __init__(self, *answers: str):
        self.answers = list(answers)
        self.leases: list[str] = []

    def ack(self, lease: str) -> str:
        self.leases.append(lease)
        return self.answers.pop(0)


def test_inbox_keeps_what_was_acked_drops_what_was_lost_and_settles_a_half_done_hand_off(tmp_path):
    inbox = Inbox(tmp_path, rank=0, fresh=True)
    e = {"id": "a", "step": 1, "n": 0, "action": "train", "lag": 0}
    assert inbox.hand_off(AckScript("acked"), e, "L1", b"bytes-a")
    lost = {"id": "b", "step": 2, "n": 0, "action": "train", "lag": 0}
    assert not inbox.hand_off(AckScript("lost"), lost, "L2", b"bytes-b")
    stale = {"id": "c", "step": 2, "n": 1, "action": "stale", "lag": 9}
    assert inbox.hand_off(AckScript("gone"), stale, "L3", None)      # a restarted server: nobody else has it
    assert inbox.entries(1) == [{**e, "lease": "L1"}] and inbox.read(e) == b"bytes-a"
    assert [x["id"] for x in inbox.entries(2)] == ["c"] and inbox.next_n(2) == 2
    # killed after writing a hand-off, before the server's answer: the next start settles it
    d = inbox.dir
    (d / "000000003-0000.batch").write_bytes(b"bytes-d")
    (d / "000000003-0000.pending").write_text(json.dumps({"id": "d", "step": 3, "n": 0, "action": "train",
                                                          "lag": 1, "lease": "L4"}))
    (d / "000000003-0001.pending").write_text(json.dumps({"id": "e", "step": 3, "n": 1, "action": "train",
                                                          "lag": 1, "lease": "L5"}))
    (d / "000000003-0001.batch").write_bytes(b"bytes-e")
    again = Inbox(tmp_path, rank=0, fresh=False)
    client = AckScript("acked", "lost")
    assert again.settle_pending(client) == 1 and client.leases == ["L4", "L5"]
    assert [x["id"] for x in again.entries(3)] == ["d"] and not (d / "000000003-0001.batch").exists()
    again.prune(2)                                                         # a checkpoint at step 2
    assert again.entries(1) == [] and again.entries(2) == [] and again.last_step() == 3
    assert Inbox(tmp_path, rank=0, fresh=True).last_step() == 0            # a new run starts empty


@pytest.fixture()
def tiny_model(tmp_path):
    from nanogrpo.models.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    make_model("tiny", tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    return tmp_path / "model", len(tok)


@pytest.mark.slow
def test_split_trainer_trains_each_batch_once_acks_it_and_drops_what_it_cannot_use(tmp_path, tiny_model,
                                                                                    monkeypatch):
    from nanogrpo.config import load_config
    from nanogrpo.serve.client import ServerClient
    from nanogrpo.serve.feed import train_from_server
    from nanogrpo.serve.server import ServerState, Settings

    model_dir, vocab = tiny_model
    monkeypatch.setenv("NANOGRPO_TOKEN", TOKEN)
    st = ServerState(Settings(vocab_size=vocab, max_weights_body=8 << 20, lease_s=30), TOKEN)
    out = tmp_path / "run"
    cfg = load_config(overrides=[f"model.path={model_dir}", "grpo.beta=0", "train.steps=3",
                                 f"train.out={out}", "train.save_every=0", "server.max_staleness=4",
                                 "log.tensorboard=false", "rewards.workers=0", "train.lr=1e-3"])
    with LiveServer(st) as srv:
        with ServerClient(srv.url, TOKEN) as c:
            c.upload(make_batch(vocab=vocab, version=7, seed=9), "future")    # from a version never reached
            for i in range(3):
                c.upload(make_batch(vocab=vocab, seed=i), f"b{i}")
            c.upload(make_batch(vocab=vocab, seed=5), "b0")                       # a retry: not a second copy
        assert train_from_server(cfg, srv.url) == 0
        stats = httpx.get(srv.url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["batch_ids"] for r in rows] == [["b0"], ["b1"], ["b2"]]
    assert rows[0]["dropped_ids"] == ["future"] and rows[-1]["dropped_stale"] == 1
    assert [r["policy_version"] for r in rows] == [1, 2, 3] and all(r["loss"] is not None for r in rows)
    assert stats["batches_in"] == 4 and stats["batches_out"] == 4 and stats["duplicates"] == 1
    assert stats["queue_ready"] == stats["queue_leased"] == 0 and stats["weights_version"] == 3
    assert not list((out / "inbox" / "rank0").iterdir())                   # the last checkpoint covers all


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_split_trainer_refuses_a_batch_at_another_logprob_temperature_and_leaves_it_queued(
        tmp_path, tiny_model, monkeypatch):
    """Workers and trainer must take log-probs alike (``rollout.tempered_logprobs``): a batch whose
    log-probs are tempered reaching an untempered trainer stops it with one line naming the keys,
    before any update, and the batch is not acked (it goes back to the queue)."""
    from nanogrpo.config import load_config
    from nanogrpo.errors import ConfigError
    from nanogrpo.serve.client import ServerClient
    from nanogrpo.serve.feed import train_from_server
    from nanogrpo.serve.server import ServerState, Settings

    model_dir, vocab = tiny_model
    monkeypatch.setenv("NANOGRPO_TOKEN", TOKEN)
    st = ServerState(Settings(vocab_size=vocab, max_weights_body=8 << 20, lease_s=30), TOKEN)
    cfg = load_config(overrides=[f"model.path={model_dir}", "grpo.beta=0", "train.steps=1",
                                 f"train.out={tmp_path / 'run'}", "train.save_every=0",
                                 "log.tensorboard=false", "rewards.workers=0"])
    b = make_batch(vocab=vocab)
    b.meta["logprob_temperature"] = 0.9
    with LiveServer(st) as srv:
        with ServerClient(srv.url, TOKEN) as c:
            c.upload(b, "hot")
        with pytest.raises(ConfigError, match="rollout.tempered_logprobs"):
            train_from_server(cfg, srv.url)
        stats = httpx.get(srv.url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert stats["queue_leased"] + stats["queue_ready"] == 1
