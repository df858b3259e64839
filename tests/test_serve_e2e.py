"""Split mode as real processes on CPU: server + 2 rollout workers + trainer; kill -9 of the server; a
smaller fuzz against the real uvicorn process. All marked slow except the uvicorn sample."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from nanogrpo.train.metrics import read_metrics
from tests.test_serve_helpers import (
    TOKEN,
    free_port,
    make_batch,
    malformed_body,
    rss_mb_of,
    start_server,
    wait_healthy,
)

REPO = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from nanogrpo.models.tiny import make_model, make_tokenizer

    d = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    make_model("tiny", tok).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _overrides(model_dir: Path, out: Path, steps: int, beta: float = 0.04) -> list[str]:
    return [f"model.path={model_dir}", "data.source=arithmetic", "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=8", "grpo.group_size=4", f"grpo.beta={beta}",
            'rewards.functions=["tests.reward_fixtures:length"]', "rewards.workers=0",
            "train.micro_batch_size=8", "train.save_every=0", f"train.steps={steps}", f"train.out={out}",
            "train.lr=1e-3", "server.max_staleness=3", "server.publish_every=2", "server.retry_for_s=120",
            "server.timeout_s=20"]


def _env() -> dict[str, str]:
    env = {**os.environ, "NANOGRPO_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return env


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanogrpo.cli", *args], cwd=REPO, env=_env(),
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _server(port: int, tmp: Path, ov: list[str], log: Path) -> subprocess.Popen:
    p = _spawn(["serve", "--port", str(port), "--state-file", str(tmp / "serve-state.json"), *ov], log)
    wait_healthy(f"http://127.0.0.1:{port}", p, timeout=120)
    return p


# --------------------------------------------------------------------------- real uvicorn: bad input sample


@pytest.mark.slow
def test_real_server_rejects_bad_input(tmp_path):
    """A few hundred malformed requests, raw garbage and a stalled body against the real uvicorn process."""
    port = free_port()
    proc = start_server(port, tmp_path / "state.json", "--vocab-size", "50", "--max-body-mb", "1",
                        "grpo.beta=0", log=tmp_path / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        good = make_batch()
        rng = random.Random(7)
        stall = socket.create_connection(("127.0.0.1", port))   # a slow client: headers, then nothing
        stall.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                      + b"\r\nContent-Length: 100000\r\n\r\nabc")
        with httpx.Client(base_url=url, timeout=10) as c:
            rss0 = rss_mb_of(proc.pid)
            t0 = time.perf_counter()
            for _ in range(300):
                r = c.post("/upload", content=malformed_body(rng, good), headers=AUTH)
                assert 400 <= r.status_code < 500, r.text
            rate = 300 / (time.perf_counter() - t0)
            assert c.post("/upload", content=b"x" * (2 << 20), headers=AUTH).status_code == 413
            assert c.post("/upload", content=good.to_bytes()).status_code == 401
            for raw in (b"GARBAGE\r\n\r\n", b"POST /upload HTTP/1.1\r\nContent-Length: zz\r\n\r\n",
                        b"GET /health HTTP/1.1\r\n" + b"X: " + b"a" * 100_000 + b"\r\n\r\n"):
                with socket.create_connection(("127.0.0.1", port)) as s:
                    s.sendall(raw)
                    s.settimeout(10)
                    answer = s.recv(100)
                    assert answer == b"" or answer.split()[1].startswith(b"4"), answer
            assert c.get("/health").status_code == 200          # the stalled client blocks nobody
            # an uploader killed mid-body (the socket closes half way): nothing is queued
            body = good.to_bytes()
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                          + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
            time.sleep(0.5)
            stats = c.get("/stats", headers=AUTH).json()
            assert stats["queue_ready"] == 0 and stats["rejected"].get("disconnect", 0) + \
                stats["rejected"].get("truncated", 0) == 1, stats
            r = c.post("/upload", content=good.to_bytes(), headers=AUTH)
            assert r.status_code == 200
            assert c.get("/get", headers=AUTH).content == good.to_bytes()
            stats = c.get("/stats", headers=AUTH).json()
            assert stats["rejected_total"] >= 302
            rss1 = rss_mb_of(proc.pid)
            print(f"real server: {rate:.0f} malformed uploads/s, rss {rss0:.0f} -> {rss1:.0f} MB")
            assert rss1 - rss0 < 64
        stall.close()
    finally:
        _stop(proc)


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_server_two_workers_trainer(tmp_path, tiny_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    # each worker uploads exactly 4 batches and nothing expires, so the trainer's 8 steps must take
    # batches from both, however the two happen to race on a loaded machine
    ov = _overrides(tiny_dir, out, steps=8) + ["eval.every=4", "eval.n=8", "server.queue_size=8",
                                               "server.max_staleness=8"]
    server = _server(port, tmp_path, ov, tmp_path / "server.log")
    workers = [_spawn(["rollout", "--server", url, "--worker-id", f"w{i}", "--batches", "4", *ov],
                      tmp_path / f"w{i}.log") for i in (1, 2)]
    trainer = _spawn(["train", "--server", url, *ov], tmp_path / "trainer.log")
    try:
        assert trainer.wait(timeout=600) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        stats = httpx.get(url + "/stats", headers=AUTH, timeout=10).json()
    finally:
        _stop(*workers, trainer, server)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {r["worker"] for r in rows} == {"w1", "w2"}, [r["worker"] for r in rows]
    assert all(r["loss"] is not None and r["kl"] is not None for r in rows)
    assert max(r["policy_version"] for r in rows) == 8
    assert "eval/accuracy" in rows[3] and "eval/accuracy" in rows[7]
    assert (out / "samples.jsonl").is_file()
    assert set(stats["workers"]) >= {"w1", "w2"} and stats["ref_tokens_per_s"] > 0
    assert stats["weights_version"] >= 6
    assert (out / "checkpoints" / "step_8" / "model.safetensors").is_file()
    print("e2e stats:", json.dumps({k: stats[k] for k in ("batches_in", "batches_out", "ref_tokens_per_s",
                                                          "workers", "weights_version")}))


@pytest.mark.slow
def test_server_kill9_and_restart_trainer_carries_on(tmp_path, tiny_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    steps = 40                                            # more than the queue holds: needs the new server
    ov = _overrides(tiny_dir, out, steps=steps, beta=0.0)
    slog = tmp_path / "server.log"
    server = _server(port, tmp_path, ov, slog)
    worker = _spawn(["rollout", "--server", url, "--worker-id", "w1", *ov], tmp_path / "w1.log")
    trainer = _spawn(["train", "--server", url, *ov], tmp_path / "trainer.log")
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or len(read_metrics(out / "metrics.jsonl")) < 3:
            alive = time.monotonic() < deadline and trainer.poll() is None
            assert alive, (tmp_path / "trainer.log").read_text()[-3000:]
            time.sleep(0.2)
        server.send_signal(signal.SIGKILL)                # mid-run, queue (probably) not empty
        server.wait()
        time.sleep(3.0)                                   # trainer and worker retry with backoff meanwhile
        server = _server(port, tmp_path, ov, slog)
        assert trainer.wait(timeout=300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        _stop(worker, trainer, server)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    text = slog.read_text()
    assert "the previous server" in text, text
    tlog = (tmp_path / "trainer.log").read_text()
    assert rows[-1]["client_retries"] > 0 and "answered again" in tlog, tlog[-3000:]


@pytest.mark.slow
def test_embedded_model_accuracy_rises_in_split_mode(tmp_path):
    """The acceptance run: server (reference model) + 2 workers + trainer on the embedded demo; the
    held-out greedy accuracy of the last checkpoint beats the warm start's, as in single-process mode."""
    import torch

    from nanogrpo.config import load_config
    from nanogrpo.evaluate import run_eval
    from nanogrpo.models.load import load_policy

    steps = 40
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    ov = [f"train.steps={steps}", f"train.out={out}", "train.save_every=0", "server.max_staleness=2",
          "server.retry_for_s=300"]
    server = _server(port, tmp_path, ov, tmp_path / "server.log")
    workers = [_spawn(["rollout", "--server", url, "--worker-id", f"w{i}", *ov], tmp_path / f"w{i}.log")
               for i in (1, 2)]
    trainer = _spawn(["train", "--server", url, *ov], tmp_path / "trainer.log")
    try:
        assert trainer.wait(timeout=1800) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        _stop(*workers, trainer, server)
    rows = read_metrics(out / "metrics.jsonl")
    assert {r["worker"] for r in rows} == {"w1", "w2"}
    accs = {}
    for step in (0, steps):
        cfg = load_config(preset="demo", overrides=[f"model.path={out / 'checkpoints' / f'step_{step}'}"])
        model, tok, _ = load_policy(cfg.model)
        torch.manual_seed(0)
        accs[step] = run_eval(cfg, model, tok, cfg.data.eval_split, 100)["accuracy"]
    print(f"held-out accuracy: step 0 {accs[0]:.2f} -> step {steps} {accs[steps]:.2f}; "
          f"dropped stale {rows[-1]['dropped_stale']}")
    assert accs[steps] >= accs[0] + 0.1, accs
