"""On-policy distillation end to end: ``nanogrpo train`` with a teacher in the process (the demo) and with
a teacher behind ``nanogrpo serve --teacher`` (a real server process: its scores equal the teacher's in the
process; killed mid-run and restarted, the step waits and the run goes on; killed for good, the run stops in
one line), split mode (the trainer scores its batches), and a teacher server that answers garbage (each kind
refused in one line, never trained on); the demo's learning test (``test_demo_distill_learns``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from nanogrpo.batch import RolloutBatch
from nanogrpo.config import TrainConfig
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.rollout.collect import pad_batch
from nanogrpo.training.distill import LocalTeacher
from nanogrpo.training.distill.server import ServerTeacher, TeacherError
from nanogrpo.training.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TOK = make_tokenizer()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch() -> RolloutBatch:
    enc = [TOK(t, add_special_tokens=False).input_ids for t in
           ("Q: 12+34?", "<think>12+34=46</think>", "Q: 5+16?", "<think>5+16=21</think><answer>5</answer>")]
    zeros = [[0.0] * len(c) for c in enc[1::2]]
    ids, am, cm, lp, p = pad_batch(enc[0::2], enc[1::2], zeros, TOK.pad_token_id)
    return RolloutBatch(ids, am, cm, torch.zeros(2), torch.zeros(2), torch.tensor([0, 1]), lp, p, 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill-e2e")
    for name, seed in (("student", 0), ("teacher", 5)):
        make_model("tiny", TOK, seed=seed).save_pretrained(d / name)
        TOK.save_pretrained(d / name)
    return d


def _train(models: Path, out: Path, *extra: str, steps: int = 2, background: bool = False):
    cmd = [sys.executable, "-m", "nanogrpo.cli", "train", "--model", str(models / "student"), "--out",
           str(out), "--steps", str(steps), "rollout.prompts_per_step=2", "grpo.group_size=4",
           "rollout.max_new_tokens=12",
           "grpo.beta=0", "rewards.workers=0", "eval.every=1", "eval.n=4", "train.save_every=1",
           "model.cpu_linear=torch", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 (the child's output for its life)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if background:
        return proc
    rc = proc.wait(timeout=900)
    return rc, (out.parent / f"{out.name}.log").read_text()


class _Serve:
    """``nanogrpo serve --teacher`` as its own process."""

    def __init__(self, models: Path, tmp: Path):
        self.models, self.tmp, self.port = models, tmp, _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "NANOGRPO_CACHE": str(self.tmp)}
        log = open(self.tmp / "serve.log", "a")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "nanogrpo.cli", "serve", "--port", str(self.port),
                                      "--teacher", str(self.models / "teacher"), "grpo.beta=0",
                                      f"model.path={self.models / 'student'}"],
                                     cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            assert self.proc.poll() is None, (self.tmp / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("nanogrpo serve did not come up")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def serve(models, tmp_path_factory):
    """One ``nanogrpo serve --teacher`` for the module (its start is most of a test's cost); the kill test,
    which restarts it and then kills it for good, runs last."""
    s = _Serve(models, tmp_path_factory.mktemp("serve"))
    s.start()
    yield s
    s.stop()


def _rows(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []


def test_nanogrpo_serve_holds_the_teacher(models, serve, tmp_path):
    remote = ServerTeacher(serve.url, TOK)
    from nanogrpo.models.load import load_model

    local = LocalTeacher(load_model(str(models / "teacher"), torch.float32, torch.device("cpu")), TOK, "t")
    for k, temp in ((0, 1.0), (3, 0.7)):
        a = remote.score(_batch(), TrainConfig(), True, temp, None, k)
        b = local.score(_batch(), TrainConfig(), True, temp, None, k)
        for key in a:
            assert float((a[key].double() - b[key].double()).abs().max()) < 1e-5, key


def test_a_teacher_server_killed_mid_run(models, serve, tmp_path):
    """``nanogrpo train`` with ``distill.teacher`` = the server (jsd on its top-3, the JSD proper): killed and
    restarted within ``distill.retry_for_s``, the step waits and the run goes on (every step once, each with
    the teacher's divergence). Killed for good: the run stops with one line, its checkpoints kept for
    ``--resume``."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    # six steps: the pipeline may have scored the next step or two by the time step 1's row is seen, so the
    # kill after it still leaves steps that must ask the dead server (a 3-step run finished without asking)
    proc = _train(models, out, f"distill.teacher={serve.url}", "distill.retry_for_s=600", "eval.every=0",
                  "distill.top_k=3", "distill.beta=0.5", steps=6, background=True)
    while not _rows(out) and proc.poll() is None:
        time.sleep(0.05)
    serve.kill()
    t0 = time.monotonic()  # the server comes back only once the run has found it gone and waits
    while "retrying" not in log.read_text() and proc.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.2)
    assert "retrying" in log.read_text(), log.read_text()[-3000:]
    serve.start()
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4, 5, 6]
    assert all(r["distill/divergence"] > 0 and r["groups_kept"] == r["groups_total"] == 2 for r in _rows(out))

    out2 = tmp_path / "run2"
    proc = _train(models, out2, f"distill.teacher={serve.url}", "distill.retry_for_s=3", "eval.every=0",
                  steps=50, background=True)
    while not _rows(out2) and proc.poll() is None:
        time.sleep(0.2)
    serve.kill()
    assert proc.wait(timeout=600) == 2
    last = (tmp_path / "run2.log").read_text().strip().splitlines()[-1]
    assert last.startswith("nanogrpo: error: the teacher server") and "did not answer" in last, last
    assert (out2 / "checkpoints" / "step_1").is_dir()


def test_split_mode_trainer_scores_its_batches_with_the_teacher(models, tmp_path, monkeypatch):
    """Split mode: the workers' batches reach the trainer unscored and its teacher scores each; here the
    teacher is the very server that brokers the batches (``nanogrpo serve --teacher``'s app, a real uvicorn
    server in a thread), jsd on its top-2. Every batch trains once with the teacher's divergence, and the
    reverse KL on the correct and on the wrong completions comes from the ``correct`` flags that crossed the
    wire."""
    from nanogrpo.config import load_config
    from nanogrpo.models.load import load_model
    from nanogrpo.serve.client import ServerClient
    from nanogrpo.serve.feed import train_from_server
    from nanogrpo.serve.server import ServerState, Settings
    from tests.test_serve_helpers import TOKEN, LiveServer, make_batch

    monkeypatch.setenv("NANOGRPO_TOKEN", TOKEN)
    teacher = LocalTeacher(load_model(str(models / "teacher"), torch.float32, torch.device("cpu")), TOK, "t")
    settings = Settings(vocab_size=len(TOK), max_weights_body=8 << 20, lease_s=30)
    st = ServerState(settings, TOKEN, teacher=teacher)
    out = tmp_path / "run"
    with LiveServer(st) as srv:
        cfg = load_config(overrides=[f"model.path={models / 'student'}", "grpo.beta=0", "train.steps=2",
                                     f"train.out={out}", "train.save_every=0", "log.tensorboard=false",
                                     "rewards.workers=0", "model.cpu_linear=torch", "distill.top_k=2",
                                     f"distill.teacher={srv.url}", "distill.beta=0.5"])
        with ServerClient(srv.url, TOKEN) as c:
            for i in range(2):
                b = make_batch(vocab=len(TOK), seed=i)
                b.correct = torch.arange(b.num_seqs) % 2 == 0
                c.upload(b, f"b{i}")
        assert train_from_server(cfg, srv.url) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["batch_ids"] for r in rows] == [["b0"], ["b1"]]
    for r in rows:
        assert r["distill/divergence"] > 0 and r["loss"] > 0
        assert r["distill/reverse_kl_correct"] != r["distill/reverse_kl_wrong"]


# ----------------------------------------------------------------------------- a server that answers garbage


class _Garbage(BaseHTTPRequestHandler):
    """A teacher server whose scoring answers are broken as ``self.server.mode`` says (the model list and the
    tokenizer are right, so the client gets as far as scoring)."""

    def log_message(self, *a):
        pass

    def _send(self, code: int, body) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"data": [{"id": "g", "owned_by": "nanogrpo"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self._send(200, {"tokens": TOK(req["prompt"], add_special_tokens=False).input_ids})
        mode, k = self.server.mode, req["prompt_logprobs"]
        if mode in ("400", "500"):
            return self._send(int(mode), b"nope\n")
        if mode == "not_json":
            return self._send(200, b"hello")
        choices = []
        for i, seq in enumerate(req["prompt"]):
            pl = [None]
            for t in range(1, len(seq)):
                e = {str(j + 3): {"logprob": -0.5 - j, "rank": j + 1} for j in range(k)}
                e.setdefault(str(seq[t]), {"logprob": -9.0, "rank": k + 1})
                pl.append(e)
            choices.append({"index": i, "prompt_logprobs": pl})
        last = choices[-1]["prompt_logprobs"][-1]
        tok = str(req["prompt"][-1][-1])
        if mode == "nan":
            last[tok]["logprob"] = float("nan")
        elif mode == "positive":
            last[tok]["logprob"] = 0.5
        elif mode == "missing":
            del last[tok]
        elif mode == "positions":
            choices[-1]["prompt_logprobs"].pop()
        elif mode == "choices":
            choices.pop()
        elif mode == "topk_short":
            for key in [key for key, v in last.items() if v["rank"] == 1]:
                del last[key]
        elif mode == "oov":
            last["1000000"] = last.pop(next(key for key, v in last.items() if v["rank"] == 1))
        self._send(200, {"choices": choices})


@pytest.fixture
def garbage():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    srv.mode = "ok"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


@pytest.mark.parametrize("mode,match", [
    ("nan", "log-prob nan"), ("positive", "log-prob 0.5"), ("missing", "no entry for token"),
    ("positions", "prompt_logprobs of"), ("choices", "1 choices for 2 prompts"),
    ("topk_short", "for the top 3"),
    ("oov", "outside the vocabulary"), ("not_json", "not JSON"), ("400", "refused /v1/completions: HTTP 400"),
])
def test_a_teacher_server_answering_garbage_stops_in_one_line(garbage, mode, match):
    teacher = ServerTeacher(f"http://127.0.0.1:{garbage.server_port}", TOK, retry_for_s=0.5)
    teacher.score(_batch(), TrainConfig(), True, 1.0, None, 3)  # the well-formed answer is taken
    garbage.mode = mode
    with pytest.raises(TeacherError) as e:
        teacher.score(_batch(), TrainConfig(), True, 1.0, None, 3)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_a_teacher_server_that_stays_away_stops_in_one_line(garbage):
    teacher = ServerTeacher(f"http://127.0.0.1:{garbage.server_port}", TOK, retry_for_s=0.5)
    garbage.mode = "500"
    t0 = time.monotonic()
    with pytest.raises(TeacherError, match=r"did not answer /v1/completions for 0 s \(HTTP 500 nope\)"):
        teacher.score(_batch(), TrainConfig(), True, 1.0, None, 0)
    assert time.monotonic() - t0 < 5


def test_a_teacher_with_another_tokenizer_is_refused_at_start(garbage):
    other = make_tokenizer()
    other.add_tokens(["12+34"])  # one more token: the probe text comes out as other ids
    with pytest.raises(TeacherError, match="tokenizes text differently"):
        ServerTeacher(f"http://127.0.0.1:{garbage.server_port}", other)


def test_demo_distill_learns(tmp_path):
    """``nanogrpo train --config demo-distill`` (its teacher ``embedded-distill`` in the process, jsd over the
    whole vocabulary) cut to 5 steps and 100 held-out problems for CI (bench/distill_demo.py runs the whole
    demo; docs/figures.md): the teacher's accuracy is reported beside the student's, no group is dropped (the
    teacher's signal is in every one), the reverse KL is logged on the correct and on the wrong completions,
    and the held-out accuracy beats step 0 by 10 points (the shipped demo's step 5: +18 on 200 problems)."""
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "nanogrpo.cli", "train", "--config", "demo-distill", "--out",
                        str(out), "--steps", "5", "eval.every=5", "eval.n=100", "train.save_every=0",
                        "rewards.workers=0", "model.cpu_linear=torch"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out)
    held = [x["eval/accuracy"] for x in rows if "eval/accuracy" in x]
    assert rows[0]["eval/teacher/accuracy"] > 0.85 and held[0] < 0.2
    assert held[-1] >= held[0] + 0.10, held
    for x in rows[1:]:
        assert x["groups_kept"] == x["groups_total"] == 16
        assert "distill/reverse_kl_correct" in x and "distill/reverse_kl_wrong" in x
    kl = [x["distill/reverse_kl"] for x in rows[1:]]
    assert sum(kl[-2:]) < sum(kl[:2]), kl
