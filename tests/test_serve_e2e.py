"""Split mode as real processes on CPU: server + 2 rollout workers + trainer; kill -9 of the server; a
smaller fuzz against the real uvicorn process. All marked slow except the uvicorn sample."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from nanogrpo.training.metrics import read_metrics
from tests.test_serve_faults import HOLDER
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
    p = _spawn(["serve", "--port", str(port), "--state-file", str(tmp / "serve-state.json"),
                "--weights-dir", str(tmp / "relay"), *ov], log)
    wait_healthy(f"http://127.0.0.1:{port}", p, timeout=120)
    return p


# --------------------------------------------------------------------------- real uvicorn: bad input sample


@pytest.mark.slow
def test_real_server_rejects_bad_input(tmp_path):
    """A few hundred malformed requests, raw garbage and a stalled body against the real uvicorn process."""
    port = free_port()
    proc = start_server(port, tmp_path / "state.json", "--vocab-size", "50", "--max-body-mb", "1",
                        "--access-log", "grpo.beta=0", log=tmp_path / "server.log")
    url = f"http://127.0.0.1:{port}"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), "300"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert int(holder.stdout.readline()) >= 290   # 300 idle sockets of another process, then:
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
        holder.kill()
        holder.wait()
        _stop(proc)
    text = (tmp_path / "server.log").read_text()
    assert '"GET /health HTTP/1.1" 200' in text and '"POST /upload HTTP/1.1" 401' in text, text[-2000:]


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


def _launch(backend: str, args: list[str], log: Path) -> subprocess.Popen:
    """A 2-rank trainer under its launcher, in its own process group (killed as a whole)."""
    env = {**_env(), "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "DS_ACCELERATOR": "cpu", "PYTHONFAULTHANDLER": "1"}
    if backend == "deepspeed":
        launch = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
                  str(free_port()), "--module", "nanogrpo.cli"]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                  str(free_port()), "-m", "nanogrpo.cli"]
    return subprocess.Popen(launch + args, cwd=REPO, env=env, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and everything under it (torchrun starts each rank in a session of its own, so
    killing the launcher's process group leaves the ranks running)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _build_deepspeed_ops() -> None:
    """DeepSpeed's CPU ops built once, in one process, before a launcher runs (see test_distributed)."""
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "from deepspeed.ops.op_builder import CPUAdamBuilder\n"
            "CPUAdamBuilder().load()\n"
            "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
            "b is not None and b.is_compatible() and b.load()\n")
    env = {**_env(), "DS_ACCELERATOR": "cpu",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]


def _uploaded_ids(log: Path) -> list[str]:
    return re.findall(r"uploaded batch (\S+) ", log.read_text())


def _drain(url: str) -> list[str]:
    """Take (and acknowledge) every batch still queued, leases of dead consumers included."""
    from nanogrpo.serve.client import ServerClient

    ids = []
    with ServerClient(url, TOKEN, timeout_s=30) as c:
        while True:
            got = c.get(wait_s=1.0)
            if got is None:
                s = c.stats()
                if s["queue_leased"] == 0 and s["queue_pending_ref"] == 0 and s["queue_ready"] == 0:
                    return ids
                time.sleep(1.0)
                continue
            assert c.ack(got.lease) == "acked"
            ids.append(got.batch_id)


def _check_each_batch_once(rows: list[dict], worker_logs: list[Path], drained: list[str], stats: dict) -> int:
    """Counted by id on both sides: every batch a worker uploaded was trained on, dropped or still queued,
    exactly once; every id the trainer saw was uploaded. Returns the number of batches trained on."""
    trained = [i for r in rows for i in r["batch_ids"]]
    dropped = [i for r in rows for i in r["dropped_ids"]]
    seen = trained + dropped + drained
    assert len(seen) == len(set(seen)), "a batch was taken twice"
    uploaded = [i for log in worker_logs for i in _uploaded_ids(log)]
    assert set(uploaded) <= set(seen), f"lost: {sorted(set(uploaded) - set(seen))}"
    # a worker stopped between the server's answer and its log line leaves one unlogged id in the queue
    assert len(set(seen) - set(uploaded)) <= len(worker_logs)
    assert set(seen) - set(uploaded) <= set(drained)
    assert stats["batches_in"] == len(seen) + stats["expired_stale"]
    return len(trained)


@pytest.mark.slow
def test_two_rank_split_training_learns_and_hands_over_each_batch_once_across_a_kill9(tmp_path):
    """The acceptance run: server (reference model) + one rollout worker + a 2-rank DDP trainer (torchrun,
    gloo) on the embedded demo, the trainer killed (-9) mid-run and resumed once. Every batch is trained on
    (or dropped, or left queued) exactly once, counted by id on both sides; the resumed run replays the
    steps after its checkpoint with the same batches and losses; the last checkpoint's held-out greedy
    accuracy beats the warm start's by 10 points."""
    import shutil

    import torch

    from nanogrpo.config import load_config
    from nanogrpo.evaluation import run_eval
    from nanogrpo.models.load import load_policy

    steps, save_every, kill_after = 24, 8, 11
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    # each rank trains on 16 prompts x 8 samples: 32 prompts per step, as `nanogrpo train`'s demo
    ov = [f"train.steps={steps}", f"train.out={out}", f"train.save_every={save_every}", "train.backend=ddp",
          "rollout.prompts_per_step=16", "eval.every=0", "log.tensorboard=false", "server.max_staleness=4",
          "server.queue_size=6", "server.lease_s=20", "server.retry_for_s=300"]
    server = _server(port, tmp_path, ov, tmp_path / "server.log")
    worker = _spawn(["rollout", "--server", url, "--worker-id", "w1", *ov], tmp_path / "w1.log")
    trainer = _launch("ddp", ["train", "--server", url, *ov], tmp_path / "trainer.log")
    resumed = None
    try:
        deadline = time.monotonic() + 1200
        metrics = out / "metrics.jsonl"
        while not metrics.is_file() or len(read_metrics(metrics)) < kill_after:
            assert time.monotonic() < deadline and trainer.poll() is None, \
                (tmp_path / "trainer.log").read_text()[-3000:]
            time.sleep(0.2)
        _kill_tree(trainer.pid)                                # launcher and both ranks, mid-step
        trainer.wait()
        shutil.copy(metrics, tmp_path / "before_kill.jsonl")
        resumed = _launch("ddp", ["train", "--resume", str(out), "--server", url], tmp_path / "resumed.log")
        assert resumed.wait(timeout=1800) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
        _stop(worker)
        drained = _drain(url)
        stats = httpx.get(url + "/stats", headers=AUTH, timeout=10).json()
    finally:
        for p in (trainer, resumed):
            if p is not None and p.poll() is None:              # (a reaped pid may belong to anyone now)
                _kill_tree(p.pid)
        _stop(worker, server)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert _check_each_batch_once(rows, [tmp_path / "w1.log"], drained, stats) == 2 * steps
    before = {r["step"]: r for r in read_metrics(tmp_path / "before_kill.jsonl")}
    replayed = [r for r in rows if save_every < r["step"] <= max(before)]
    assert replayed and "replaying steps" in (tmp_path / "resumed.log").read_text()
    for r in replayed:                                         # the same batches, the same update
        assert r["batch_ids"] == before[r["step"]]["batch_ids"]
        assert r["loss"] == pytest.approx(before[r["step"]]["loss"], rel=1e-5, abs=1e-7)
    assert not any((out / "inbox").rglob("*.json"))           # the last checkpoint covers everything
    # model.cpu_linear=auto: decided once (rank 0), recorded, and reused by the resumed ranks
    assert len({r["cpu_linear/trainer"] for r in rows}) == 1
    assert "as the checkpoint recorded" in (tmp_path / "resumed.log").read_text()
    accs = {}
    for step in (0, steps):
        cfg = load_config(preset="demo", overrides=[f"model.path={out / 'checkpoints' / f'step_{step}'}"])
        model, tok, _ = load_policy(cfg.model)
        torch.manual_seed(0)
        accs[step] = run_eval(cfg, model, tok, cfg.data.eval_split, 100)["accuracy"]
    print(f"held-out accuracy: step 0 {accs[0]:.2f} -> step {steps} {accs[steps]:.2f}; killed after step "
          f"{max(before)}, replayed {len(replayed)} step(s); dropped stale {rows[-1]['dropped_stale']}; "
          f"server: {stats['batches_in']} in, {stats['redelivered']} redelivered")
    assert accs[steps] >= accs[0] + 0.1, accs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_sharded_trainers_behind_the_server(tmp_path, tiny_dir, backend):
    """FSDP2 and DeepSpeed ZeRO-3 (CPU optimizer offload) ranks behind the server: each takes its own
    batch, rank 0 publishes the gathered weights, logs and saves once."""
    if backend == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed not installed")
        _build_deepspeed_ops()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    ov = _overrides(tiny_dir, out, steps=3) + [f"train.backend={backend}", "train.zero_stage=3",
                                               f"train.optimizer_offload={backend == 'deepspeed'}",
                                               "server.publish_every=1", "log.tensorboard=false"]
    server = _server(port, tmp_path, ov, tmp_path / "server.log")
    worker = _spawn(["rollout", "--server", url, "--worker-id", "w1", *ov], tmp_path / "w1.log")
    trainer = _launch(backend, ["train", "--server", url, *ov], tmp_path / "trainer.log")
    try:
        assert trainer.wait(timeout=900) == 0, (tmp_path / "trainer.log").read_text()[-4000:]
        _stop(worker)
        drained = _drain(url)
        stats = httpx.get(url + "/stats", headers=AUTH, timeout=10).json()
    finally:
        if trainer.poll() is None:
            _kill_tree(trainer.pid)
        _stop(worker, server)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert _check_each_batch_once(rows, [tmp_path / "w1.log"], drained, stats) == 6
    assert all(len(r["batch_ids"]) == 2 and r["loss"] is not None for r in rows)
    assert stats["weights_version"] == 3                       # published by rank 0 from gathered shards
    assert (out / "checkpoints" / "step_3" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- the weight relay's memory


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow  # ~15 s: 234 MB through the real server, twice
def test_the_relay_streams_weights_through_disk_not_memory(tmp_path):
    """Weights go through ``nanogrpo serve`` on disk: a 234 MB publish raises the server's peak memory by
    a small part of it (the body is spooled as it arrives and sent from the file; before, +670 MB), and
    each fetch gets the version just published, whole (tests/test_serve_weights.py: the files)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nanogrpo.serve.client import ServerClient
    from nanogrpo.serve.weights import WeightLayout

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    config.save_pretrained(tmp_path / "model")  # the server reads the layout from the config (beta = 0)
    with torch.device("meta"):
        layout = WeightLayout.of_model(AutoModelForCausalLM.from_config(config))
    port = free_port()
    proc = start_server(port, tmp_path / "state.json", "--vocab-size", "32000", "grpo.beta=0",
                        f"model.path={tmp_path / 'model'}", log=tmp_path / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        peak0 = _peak_mb(proc.pid)
        with ServerClient(url, TOKEN) as c:
            for version in (1, 2):  # ~234 MB of float32 each
                sd = {k: torch.full(shape, float(version)) for k, shape in layout.shapes.items()
                      if k != "lm_head.weight"}
                c.publish(version, sd)
                got_version, got = c.fetch_weights(version - 1, layout)
                assert got_version == version and got.keys() == sd.keys()
                assert all(torch.equal(got[k], v) for k, v in sd.items())
                del got, sd
            stats = c.stats()
        grew = _peak_mb(proc.pid) - peak0
        print(f"server peak memory +{grew:.0f} MB")
        assert grew < 64, f"server peak memory grew by {grew:.0f} MB for a 234 MB publish"
        assert stats["weights_version"] == 2 and stats["weights_bytes"] > 200 << 20
    finally:
        _stop(proc)
    assert proc.returncode == 0  # SIGTERM: shut down through st.close(), not killed by the signal
    assert list((tmp_path / "relay").iterdir()) == []  # the served weights removed with the server
    assert "policy version 2 published" in (tmp_path / "server.log").read_text()
