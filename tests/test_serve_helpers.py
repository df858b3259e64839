"""Shared pieces of the split-mode tests: a valid batch, malformed bodies, a real server process."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save as st_save

from nanogrpo.batch import FORMAT, RolloutBatch

VOCAB = 50
TOKEN = "test-token-0123456789abcdef"


def make_batch(groups: int = 2, g: int = 4, p: int = 5, c: int = 6, vocab: int = VOCAB, version: int = 0,
               worker: str = "w0", seed: int = 0) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    ids = torch.randint(0, vocab, (n, p + c), generator=gen)
    am = torch.ones(n, p + c, dtype=torch.int8)
    am[0, :2] = 0                                   # left padding
    cm = torch.ones(n, c, dtype=torch.bool)
    cm[1, 3:] = False                               # a short completion
    am[1, p + 3:] = 0
    old = -torch.rand(n, c, generator=gen) * cm
    return RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm,
                        rewards=torch.randn(n, generator=gen), advantages=torch.randn(n, generator=gen),
                        group_ids=torch.arange(groups).repeat_interleave(g), old_logprobs=old, prompt_len=p,
                        group_size=g, policy_version=version, meta={"worker": worker, "ids": ["a", "b"]})


def _encode(tensors: dict[str, torch.Tensor], header: dict | str | None) -> bytes:
    meta = None
    if header is not None:
        meta = {"nanogrpo": header if isinstance(header, str) else json.dumps(header)}
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


def _header(b: RolloutBatch) -> dict:
    return {"format": FORMAT, "prompt_len": b.prompt_len, "group_size": b.group_size,
            "policy_version": b.policy_version, "meta": b.meta}


_FLOATS = ("rewards", "advantages", "old_logprobs")
_DTYPES = (torch.float16, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool, torch.bfloat16,
           torch.int8, torch.float32)


def malformed_body(rng: random.Random, good: RolloutBatch) -> bytes:
    """A body that must be rejected: one structured defect chosen at random (never a valid batch)."""
    t = {k: v.clone() for k, v in good.tensors().items()}
    h = _header(good)
    raw = good.to_bytes()
    kind = rng.randrange(16)
    if kind == 0:                                                     # truncated
        return raw[:rng.randrange(len(raw))]
    if kind == 1:                                                     # random garbage
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400)))
    if kind == 2:                                                     # garbage after a plausible length
        n = rng.randrange(2, 300)
        return n.to_bytes(8, "little") + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400)))
    if kind == 3:                                                     # wrong dtype
        name = rng.choice(list(t))
        want = t[name].dtype
        dt = rng.choice([d for d in _DTYPES if d != want])
        t[name] = t[name].to(dt)
    elif kind == 4:                                                   # shape mismatch
        name = rng.choice(list(t))
        x = t[name]
        t[name] = x[:-1] if rng.random() < 0.5 or x.dim() == 1 else x[:, :-1]
    elif kind == 5:                                                   # NaN / inf
        name = rng.choice(_FLOATS)
        flat = t[name].view(-1)
        flat[rng.randrange(flat.numel())] = rng.choice([float("nan"), float("inf"), float("-inf")])
    elif kind == 6:                                                   # out-of-vocabulary id
        flat = t["input_ids"].view(-1)
        flat[rng.randrange(flat.numel())] = rng.choice([VOCAB + rng.randrange(10**6), -1 - rng.randrange(99)])
    elif kind == 7:                                                   # missing tensor
        del t[rng.choice([k for k in t if k != "ref_logprobs"])]
    elif kind == 8:                                                   # unknown tensor
        t[rng.choice(["x", "weights", "input_ids2"])] = torch.zeros(3)
    elif kind == 9:                                                   # bad header field
        key = rng.choice(["prompt_len", "group_size", "policy_version"])
        h[key] = rng.choice([-1, "3", None, 1.5, True, [1], -(10**30)]
                            + ([10**9, 0] if key != "policy_version" else []))
    elif kind == 10:                                                  # header not ours
        choice = rng.randrange(4)
        header = [None, "not json{", json.dumps({"format": "x"}), json.dumps([1, 2])][choice]
        return _encode(t, header)
    elif kind == 11:                                                  # group size does not divide / varies
        if rng.random() < 0.5:
            h["group_size"] = 3
        else:
            gids = t["group_ids"].clone()
            gids[rng.randrange(1, gids.numel())] += 100
            if bool((gids.view(-1, good.group_size) == gids.view(-1, good.group_size)[:, :1]).all()):
                gids[1] += 1
            t["group_ids"] = gids
    elif kind == 12:                                                  # masks inconsistent
        sub = rng.randrange(3)
        if sub == 0:
            t["attention_mask"][0, -1] = 2
        elif sub == 1:
            t["completion_mask"][1, -1] = True                        # not a prefix any more
            t["attention_mask"][1, -1] = 1
        else:
            t["attention_mask"][2, good.prompt_len] = 0               # disagrees with completion mask
    elif kind == 13:                                                  # positive "log-probs"
        t["old_logprobs"][0, 0] = 0.5 + rng.random()
    elif kind == 14:                                                  # meta not an object / NaN in header
        return _encode(t, rng.choice([json.dumps({**h, "meta": [1]}), json.dumps(h)[:-1] + ', "x": NaN}',
                                      json.dumps({**h, "meta": "m"})]))
    else:                                                             # empty batch / prompt_len at the end
        if rng.random() < 0.5:
            t = {k: v[:0] for k, v in t.items()}
        else:
            h["prompt_len"] = good.input_ids.shape[1]
    return _encode(t, h)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, state_file: Path, *extra: str, token: str | None = TOKEN,
                 log: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("NANOGRPO_TOKEN", None)
    if token:
        env["NANOGRPO_TOKEN"] = token
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "nanogrpo.cli", "serve", "--port", str(port),
                             "--state-file", str(state_file),
                             "--weights-dir", str(state_file.parent / "relay"), *extra], env=env, stdout=out,
                            stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("server did not become healthy")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_mb_of(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class LiveServer:
    """A server state's app on a real uvicorn server (real sockets, the connection guard and request caps
    of ``nanogrpo serve``) in a thread of this process."""

    def __init__(self, st, access_log: bool = False):
        import uvicorn

        from nanogrpo.serve.server import uvicorn_config

        self.st = st
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(st, "127.0.0.1", self.port, access_log)
        config.timeout_graceful_shutdown = 1
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
