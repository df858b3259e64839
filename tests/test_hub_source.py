"""A hub id without network ends with nanogrpo's own line in seconds, never huggingface_hub's retries.

"No network" comes in three kinds, and each is tested through the real client (huggingface_hub,
sent to a local address by ``HF_ENDPOINT``, the variable a user's hub mirror is set with):

- **no name resolution** (no DNS, as on this machine for huggingface.co): a host under
  ``.invalid``, a name that never resolves (RFC 2606);
- **nothing listening** (the connection is refused at once): a closed local port;
- **a black hole** (a firewall drops the packets and the connection hangs): a local listener
  whose accept queue is full, so the kernel drops new connection requests; only our timeout
  ends the wait.

When the hub answers, its answers come from a local stand-in that answers as the hub does
(``X-Error-Code`` headers), so the client's own error mapping is what is tested.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nanogrpo.errors import ModelError
from nanogrpo.hub import TIMEOUT_S
from nanogrpo.models.source import hub_source, resolve_model_path

REPO = "Qwen/Qwen2.5-0.5B"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


SAID_WITHIN_S = 20.0
"""A whole ``nanogrpo train`` process that cannot reach the hub ends within this. What it must exclude:
huggingface_hub's retries (waits of 1 + 2 + 4 + 8 + 8 s: 23.6 s measured against a refused port) and
a wait without a deadline (a black hole: until the subprocess's own timeout). What it must allow: the
hub's deadline (``TIMEOUT_S``, 5 s, the black hole) plus starting Python and importing nanogrpo
(0.3-0.8 s of CPU, but several seconds of wall clock when the shared machine's cores are busy)."""


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class _BlackHole:
    """A listening socket whose accept queue is full: further connection requests are dropped."""

    def __enter__(self) -> str:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(0)
        port = self.srv.getsockname()[1]
        self.fill = []
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            self.fill.append(c)
        time.sleep(0.1)
        probe = socket.socket()
        probe.settimeout(0.5)
        try:
            probe.connect(("127.0.0.1", port))
            hangs = False
        except TimeoutError:
            hangs = True
        finally:
            probe.close()
        if not hangs:
            pytest.skip("this kernel accepts connections past a full accept queue: no black hole to make")
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        for c in self.fill:
            c.close()
        self.srv.close()


def _env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(tmp_path / "hub-cache"), HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return env


def _train_offline(tmp_path: Path, endpoint: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "nanogrpo.cli", "train", "--model", REPO, "--out", str(tmp_path / "run")]
    out = subprocess.run(cmd, env=_env(tmp_path, endpoint), capture_output=True, text=True, timeout=60)
    return out, time.perf_counter() - t0


def _assert_offline_line(out: subprocess.CompletedProcess, elapsed: float, tmp_path: Path) -> None:
    said = out.stdout + out.stderr
    assert out.returncode == 2, said
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"nanogrpo: error: model '{REPO}': the HF hub (http"), said
    assert "cannot be reached" in last and "local model directory" in last and "HF_HUB_OFFLINE=1" in last
    assert len(out.stderr.strip().splitlines()) == 1, said  # that line alone: no retries, no warnings
    assert "Retry" not in said and "WARNING" not in said
    assert elapsed < SAID_WITHIN_S, f"{elapsed:.1f} s"
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_no_dns_is_said_in_seconds(tmp_path):
    out, elapsed = _train_offline(tmp_path, "http://hub.nanogrpo-test.invalid")
    _assert_offline_line(out, elapsed, tmp_path)


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_refused_connection_is_said_in_seconds(tmp_path):
    out, elapsed = _train_offline(tmp_path, f"http://127.0.0.1:{_closed_port()}")
    _assert_offline_line(out, elapsed, tmp_path)


@pytest.mark.slow  # imports datasets (twice)
def test_an_hf_dataset_without_network_is_said_in_seconds(tmp_path):
    pytest.importorskip("datasets")
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    cmd = [sys.executable, "-m", "nanogrpo.cli", "train", "--data", "gsm8k", "--out", str(tmp_path / "run")]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=_env(tmp_path, endpoint), capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    said = out.stdout + out.stderr
    assert out.returncode == 2, said
    assert out.stderr.strip().splitlines() == [
        f"nanogrpo: error: HF dataset openai/gsm8k: the HF hub ({endpoint}) cannot be reached ([Errno 111] "
        "Connection refused): point data.source at a local .jsonl/.parquet copy, or set HF_HUB_OFFLINE=1 to "
        "read the datasets cache"], said
    assert "Retry" not in said and "WARNING" not in said
    assert elapsed < SAID_WITHIN_S, f"{elapsed:.1f} s"


@pytest.mark.slow
def test_black_hole_is_said_in_seconds(tmp_path):
    with _BlackHole() as endpoint:
        out, elapsed = _train_offline(tmp_path, endpoint)
    _assert_offline_line(out, elapsed, tmp_path)
    assert "cannot be reached (no answer within 5 s)" in out.stderr


# ----------------------------------------------------------------------------- in-process, hub answers


class _Hub(http.server.BaseHTTPRequestHandler):
    """Answers HEAD .../resolve/main/config.json as the hub does for the repo named in ANSWERS."""

    ANSWERS: dict[str, tuple[int, str | None]] = {}

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        repo = self.path.split("/resolve/")[0].lstrip("/")
        status, code = self.ANSWERS.get(repo, (404, "RepoNotFound"))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if status == 200:
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", '"abc"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty HF cache in ``tmp_path`` (what HF_HUB_CACHE sets), not in offline mode."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "hub-cache"


@pytest.fixture
def hub(cache):
    """A local stand-in for the hub: its address, and the answers it gives per repo."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    _Hub.ANSWERS = {}
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Hub.ANSWERS
    srv.shutdown()
    srv.server_close()


def _cache(tmp_path: Path, repo: str, weights: bool = True) -> Path:
    """``repo`` in the HF cache layout (``models--org--name/refs/main``, ``snapshots/COMMIT``), with a
    tiny model (or its config alone)."""
    from nanogrpo.models.tiny import make_model, make_tokenizer

    base = tmp_path / "hub-cache" / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / COMMIT
    tok = make_tokenizer()
    make_model("tiny", tok).save_pretrained(snap)
    tok.save_pretrained(snap)
    if not weights:
        (snap / "model.safetensors").unlink()
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(COMMIT)
    return snap


def test_a_hub_id_the_hub_has_passes_through(hub):
    endpoint, answers = hub
    answers["org/tiny"] = (200, None)
    assert hub_source("org/tiny", endpoint=endpoint) == "org/tiny"


@pytest.mark.parametrize("status,code,says", [
    (404, "RepoNotFound", "is not on the HF hub"),
    (401, "RepoNotFound", "or is private"),
    (403, "GatedRepo", "is gated on the HF hub"),
    (404, "EntryNotFound", "has no config.json"),
    (500, None, "the HF hub answered 500"),
])
def test_the_hubs_refusals_are_one_clear_line(hub, status, code, says):
    endpoint, answers = hub
    answers["org/tiny"] = (status, code)
    with pytest.raises(ModelError, match=says) as e:
        hub_source("org/tiny", endpoint=endpoint)
    assert "\n" not in str(e.value)


def test_a_hub_error_falls_back_to_the_cached_copy(hub, tmp_path):
    endpoint, answers = hub
    answers["org/tiny"] = (500, None)
    snap = _cache(tmp_path, "org/tiny")
    assert hub_source("org/tiny", endpoint=endpoint) == str(snap)
    answers["org/tiny"] = (404, "RepoNotFound")  # the hub's "no such model" wins over a stale copy
    with pytest.raises(ModelError, match="is not on the HF hub"):
        hub_source("org/tiny", endpoint=endpoint)


def test_without_network_the_cached_copy_is_used(cache, tmp_path, caplog):
    import logging

    from nanogrpo.config import ModelConfig
    from nanogrpo.models.load import load_policy

    snap = _cache(tmp_path, "org/tiny")
    cfg = ModelConfig(path="org/tiny", cpu_linear="torch")
    with caplog.at_level(logging.INFO, logger="nanogrpo.models"):
        t0 = time.perf_counter()
        where = hub_source(cfg.path, endpoint=f"http://127.0.0.1:{_closed_port()}")
        assert time.perf_counter() - t0 < 5
    assert where == str(snap)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "cannot be reached" in caplog.text and "using the copy of org/tiny in the HF cache" in caplog.text
    model, tok, _ = load_policy(cfg, where)  # transformers reads the local snapshot: no network asked
    assert model.config.vocab_size == len(tok)


def test_a_cached_config_without_weights_is_not_a_copy(cache, tmp_path):
    _cache(tmp_path, "org/tiny", weights=False)
    with pytest.raises(ModelError, match="has no weights of it"):
        hub_source("org/tiny", endpoint=f"http://127.0.0.1:{_closed_port()}")


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_hf_hub_offline_reads_the_cache_and_never_the_hub(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # were the hub asked, each call would wait its whole deadline (TIMEOUT_S) on the black hole; not
    # asking, a call costs milliseconds. Each call is timed alone (writing the cached copy between them
    # takes seconds on a busy machine, and is not the hub's business).
    with _BlackHole() as endpoint:
        t0 = time.perf_counter()
        with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set and the HF cache .* does not hold it"):
            hub_source("org/tiny", endpoint=endpoint)
        assert time.perf_counter() - t0 < TIMEOUT_S
        snap = _cache(tmp_path, "org/tiny")
        t0 = time.perf_counter()
        assert hub_source("org/tiny", endpoint=endpoint) == str(snap)
        assert time.perf_counter() - t0 < TIMEOUT_S


def test_paths_are_not_hub_ids(tmp_path):
    with pytest.raises(ModelError, match="model path not found"):
        resolve_model_path("./nope/model")
    with pytest.raises(ModelError, match="model path not found"):
        resolve_model_path("/abs/nope")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_path(str(tmp_path))
