"""Real ``vllm serve`` processes for the server-tier tests (vLLM environment): two servers of the
embedded demo model, kept up by ``nanogrpo vllm-serve --count 2`` (the launcher users run: nanogrpo's
gloo transfer engine and worker extension, a dead server restarted while the other keeps serving), one
session's worth, shared by tests/test_vllm_server.py and tests/test_vllm_server_faults.py (each server
start costs 30-90 s on a 2-core CPU).

:class:`Servers` can kill (SIGKILL), stall (SIGSTOP) and continue (SIGCONT) a server: each runs in a
process group of its own, and the signal goes to the whole group, as when its machine fails or hangs.
A killed server is restarted by the launcher (:meth:`Servers.restart` waits for it); a test that stalls
a server continues it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from nanogrpo.config import Config
from nanogrpo.launch import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
RUN = ["rollout.prompts_per_step=8", "grpo.group_size=4", "eval.every=0", "train.save_every=2",
       "vllm_server.probe=true", "rewards.workers=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports (the launcher takes consecutive ports)."""
    for _ in range(200):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class Servers:
    """Two servers under one launcher; :meth:`kill`, :meth:`stall`, :meth:`cont` and :meth:`restart` one."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        base = free_ports(2)
        self.ports = [base, base + 1]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.cfg = Config.load(None, self.overrides() + RUN)
        self.launcher: subprocess.Popen | None = None
        self.stopped = [False, False]

    def overrides(self) -> list[str]:
        return ["rollout.engine=vllm_server", "rollout.servers=" + json.dumps(self.urls)]

    def log(self, i: int) -> Path:
        return self.tmp / f"server-{self.ports[i]}.log"

    def launch(self) -> None:
        cmd = [sys.executable, "-m", "nanogrpo.cli", "vllm-serve", "--count", "2",
               "--port", str(self.ports[0]), "--state-dir", str(self.tmp), "--restarts", "100",
               *self.overrides(), *RUN]
        out = open(self.tmp / "launcher.log", "a")  # noqa: SIM115 (the launcher's, for its life)
        self.launcher = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)

    def launcher_log(self) -> str:
        f = self.tmp / "launcher.log"
        return f.read_text() if f.is_file() else ""

    def pid(self, i: int) -> int | None:
        """The API server process of server ``i`` (the leader of its process group), None while none runs."""
        import psutil

        for c in psutil.Process(self.launcher.pid).children():
            try:
                if c.status() != psutil.STATUS_ZOMBIE and str(self.ports[i]) in c.cmdline():
                    return c.pid
            except psutil.NoSuchProcess:
                continue
        return None

    def wait(self, i: int, timeout: float = 900.0) -> float:
        t0 = time.monotonic()
        while self.pid(i) is None:
            assert self.launcher.poll() is None, self.launcher_log()[-3000:]
            assert time.monotonic() - t0 < timeout, self.launcher_log()[-3000:]
            time.sleep(0.2)
        left = timeout - (time.monotonic() - t0)
        return time.monotonic() - t0 + wait_healthy(self.urls[i], self.launcher, timeout_s=left,
                                                     log=self.tmp / "launcher.log")

    def kill(self, i: int) -> None:
        """SIGKILL server ``i``'s whole process group (vLLM's engine would outlive its API server)."""
        pid = self.pid(i)
        self.cont(i)
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 30
            while self.pid(i) == pid and time.monotonic() < deadline:
                time.sleep(0.05)

    def stall(self, i: int) -> None:
        """SIGSTOP server ``i``'s process group: it neither answers nor closes its connections."""
        os.killpg(self.pid(i), signal.SIGSTOP)
        self.stopped[i] = True

    def cont(self, i: int) -> None:
        if self.stopped[i]:
            os.killpg(self.pid(i), signal.SIGCONT)
            self.stopped[i] = False

    def restart(self, i: int) -> None:
        """After :meth:`kill`: wait until the launcher has restarted it and it answers."""
        self.wait(i)

    def stop(self) -> list[int]:
        """End the launcher with SIGTERM (what ``kill``, a job scheduler or systemd sends) and return the
        server processes that outlived it (none should: it ends its servers as on Ctrl-C)."""
        import psutil

        for i in range(2):
            if self.pid(i) is not None:
                self.cont(i)
        if self.launcher is None or self.launcher.poll() is not None:
            return []
        group = [p for p in psutil.Process(self.launcher.pid).children(recursive=True)]
        self.launcher.send_signal(signal.SIGTERM)
        try:
            self.launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
        _, alive = psutil.wait_procs(group, timeout=15)
        for proc in alive:  # (not left running after the tests, whatever the verdict)
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        return [proc.pid for proc in alive]


def two_servers(tmp: Path):
    """The session fixture ``servers`` (tests/conftest.py): two servers up, stopped at the end."""
    s = Servers(tmp)
    try:
        s.launch()
        print(f"vllm serve x2 up in {max(s.wait(0), s.wait(1)):.0f} s")
        yield s
    finally:
        left = s.stop()
    assert not left, f"SIGTERM to the launcher left server processes running: {left}"


def train(servers: Servers, out: Path, *args: str, resume: bool = False, launch: list[str] | None = None,
          background: bool = False):
    """``nanogrpo train`` on the servers (a subprocess, its log beside ``out``)."""
    cmd = (launch or [sys.executable, "-m", "nanogrpo.cli"]) + ["train"]
    cmd += ["--resume", str(out)] if resume else ["--out", str(out)]
    cmd += servers.overrides() + RUN + list(args)
    log = open(out.parent / f"{out.name}.log", "a")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    if background:
        return proc
    rc = proc.wait(timeout=900)
    assert rc == 0, (out.parent / f"{out.name}.log").read_text()[-4000:]
    return proc


def rows(out: Path) -> list[dict]:
    f = out / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


def demo_model(seed: int | None = None):
    """The embedded demo model (float32, eval mode); ``seed``: its weights moved by seeded noise."""
    from transformers import AutoModelForCausalLM

    from nanogrpo.demos.arithmetic.build import embedded_path

    m = AutoModelForCausalLM.from_pretrained(str(embedded_path()), dtype=torch.float32).eval()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def tier(servers: Servers, model, clients=None, **sync_kw):
    """A pool, engine and weight sync over the servers, for ``model`` (in this process)."""
    from nanogrpo.engines.vllm_server import state_source
    from nanogrpo.engines.vllm_server.engine import ServerEngine
    from nanogrpo.engines.vllm_server.http import ServerClient
    from nanogrpo.engines.vllm_server.pool import ServerPool
    from nanogrpo.engines.vllm_server.sync import WeightSync

    pool = ServerPool(clients or [ServerClient(u) for u in servers.urls], wait_s=20.0)
    sync_kw.setdefault("timeout_s", 60)
    return ServerEngine(pool, [2]), WeightSync(pool, state_source(model, torch.float32), **sync_kw)


def probe_diff(engine, model, prompt: list[int]) -> dict[str, float]:
    """Each usable server's largest log-prob difference from ``model`` on a sample of ``prompt``."""
    from nanogrpo.engines.base import SamplingParams

    out = {}
    for slot in engine.pool.usable():
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
        ids, lps = engine.sample_on_server(slot, prompt, params)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        out[slot.url] = float((mine - torch.tensor(lps)).abs().max())
    return out


def wait_rows(out: Path, n: int, proc, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while len(rows(out)) < n:
        assert proc.poll() is None, (out.parent / f"{out.name}.log").read_text()[-4000:]
        assert time.monotonic() < deadline, f"fewer than {n} rows after {timeout:.0f} s"
        time.sleep(0.5)
