"""The server tier on the CPU: weight-sync time and MB/s beside ``nanogrpo serve``'s HTTP relay on the same
model (two servers synced at once, and one after another, A B A B), and the demo with
``rollout.max_staleness`` 0, 1, 2 side by side.

    python bench/server_tier_cpu.py sync --shape demo              # the demo model (0.8M parameters)
    python bench/server_tier_cpu.py sync --shape qwen2.5-0.5b      # Qwen2.5-0.5B's shape, random init
    python bench/server_tier_cpu.py staleness --steps 40           # the demo, k = 0, 1, 2 (same servers)
    python bench/server_tier_cpu.py sync-ab --other ../old-checkout  # this checkout's sync vs another's
    python bench/server_tier_cpu.py lora --shape qwen2.5-0.5b --r 16   # LoRA: adapter-only sync vs merged

Run in the vLLM environment (docs/guides/scaling-out.md). ``sync``: two ``vllm serve`` processes of the
model (started by ``nanogrpo.launch``, gloo transfer), ``--repeats`` syncs of the trainer's weights to both
(pause, bucketed gloo broadcast, version read back, resume); then ``nanogrpo serve`` on the same model and
the relay of the same weights: one publish (trainer -> relay) and two concurrent fetches (relay -> each of
two workers, as two split-mode workers would download them), decoded and checked. ``staleness``: the demo
preset trained ``--steps`` steps with each ``max_staleness`` (``correction=token_truncate`` for k > 0) on the
same two servers: wall time, staleness, held-out accuracy. ``sync-ab``: this checkout's weight sync beside
another checkout's (``--other``, e.g. a git worktree of an earlier commit), each trainer in a process of its
own with two servers of its own (started from its own checkout: its launcher and vLLM plugin), syncs taken
in turn A B A B, the ratio pair by pair. ``lora``: a LoRA policy of rank ``--r`` on every linear layer, two
servers started for it (LoRA on): the adapter-only sync (``vllm_server.lora_sync=adapter``) and the merged
sync (``merged``) in turn A B A B on the same servers, MB and seconds per sync, and, with ``--steps``, the
training step of ``nanogrpo train`` on each path. One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(shape: str, tmp: Path) -> str:
    if shape == "demo":
        from nanogrpo.demos.arithmetic.build import embedded_path

        return str(embedded_path())
    from nanogrpo.models.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    d = tmp / shape
    make_model(shape, tok, seed=0).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _servers(model: str, tmp: Path, n: int = 2, extra: list[str] = ()):
    from nanogrpo.config import Config
    from nanogrpo.launch import start, wait_healthy

    ports = [_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    over = [f"model.path={model}", "rollout.engine=vllm_server", "rollout.servers=" + json.dumps(urls),
            *extra]
    cfg = Config.load(None, over)
    procs = [start(cfg, p, state_dir=tmp, log=tmp / f"server-{p}.log") for p in ports]
    t = max(wait_healthy(u, pr, log=tmp / f"server-{p}.log")
            for u, pr, p in zip(urls, procs, ports, strict=True))
    return urls, procs, over, t


def _stop(procs) -> None:
    from nanogrpo.launch import end

    for p in procs:
        end(p)


def bench_sync(shape: str, repeats: int, parts: str = "tier,relay") -> None:
    from transformers import AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="nanogrpo-bench-tier-"))
    model_dir = _model_dir(shape, tmp)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if "tier" in parts.split(","):
        _bench_tier(shape, repeats, model, model_dir, tmp)
    if "relay" in parts.split(","):
        _bench_relay(shape, repeats, model, model_dir)


def _bench_tier(shape: str, repeats: int, model, model_dir: str, tmp: Path) -> None:
    """Weight syncs to two ``vllm serve`` processes (the vLLM environment)."""
    from nanogrpo.engines.vllm_server import state_source
    from nanogrpo.engines.vllm_server.http import ServerClient
    from nanogrpo.engines.vllm_server.pool import ServerPool
    from nanogrpo.engines.vllm_server.sync import WeightSync

    urls, procs, _, up = _servers(model_dir, tmp)
    try:
        pool = ServerPool([ServerClient(u) for u in urls])
        source = state_source(model, torch.float32)
        sync = WeightSync(pool, source)
        times: dict[str, list[dict]] = {"parallel": [], "sequential": []}
        v = 0
        for r in range(repeats + 1):  # A B A B on the same servers; the first pair sets up the groups
            for mode in times:
                v += 1
                with torch.no_grad():
                    next(model.parameters()).add_(1e-3)
                sync.parallel = mode == "parallel"
                out = sync.sync(v)
                if r > 0:
                    times[mode].append(out)
        for mode, ts in times.items():
            mb = ts[0]["sync/mb"]
            med = sorted(t["sync/time_s"] for t in ts)[len(ts) // 2]
            print(json.dumps({"bench": "server_tier_sync", "mode": mode, "shape": shape, "servers": 2,
                              "mb_total": round(mb, 1), "sync_s_median": round(med, 3),
                              "send_s_median": round(sorted(t["sync/send_s"] for t in ts)[len(ts) // 2], 3),
                              "mb_per_s": round(mb / med, 1), "repeats": repeats,
                              "servers_up_s": round(up, 1)}), flush=True)
        ratio = sorted(a["sync/time_s"] / b["sync/time_s"]
                       for a, b in zip(times["sequential"], times["parallel"], strict=True))
        print(json.dumps({"bench": "server_tier_sync_ratio", "shape": shape,
                          "sequential_over_parallel_median": round(ratio[len(ratio) // 2], 2),
                          "pairs": [round(x, 2) for x in ratio]}), flush=True)
    finally:
        _stop(procs)


def _bench_relay(shape: str, repeats: int, model, model_dir: str) -> None:
    """The HTTP relay of split mode on the same model: a publish, then two workers fetching at once; the
    relay's peak memory beside the bytes it moved."""
    from nanogrpo.serve.client import ServerClient as RelayClient
    from nanogrpo.serve.weights import WeightLayout

    port = _port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    relay = subprocess.Popen([sys.executable, "-m", "nanogrpo.cli", "serve", "--port", str(port),
                              "--weights-dir", str(Path(model_dir).parent / "relay"),
                              f"model.path={model_dir}", "grpo.beta=0"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        from nanogrpo.launch import wait_healthy

        wait_healthy(url, relay)
        layout = WeightLayout.of_model(model)
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
        times = []
        with RelayClient(url, timeout_s=600) as pub, RelayClient(url, timeout_s=600) as w1, \
                RelayClient(url, timeout_s=600) as w2, ThreadPoolExecutor(2) as exe:
            for v in range(1, repeats + 1):
                t0 = time.perf_counter()
                pub.publish(v, sd)
                got = list(exe.map(lambda c, v=v: c.fetch_weights(v - 1, layout), (w1, w2)))
                times.append(time.perf_counter() - t0)
                assert all(g is not None and g[0] == v for g in got)
        med = sorted(times)[len(times) // 2]
        print(json.dumps({"bench": "http_relay", "shape": shape, "workers": 2,
                          "mb_published": round(nbytes, 1),
                          "relay_s_median": round(med, 3), "mb_per_s": round(2 * nbytes / med, 1),
                          "relay_peak_rss_mb": round(_peak_mb(relay.pid)), "repeats": repeats}), flush=True)
    finally:
        relay.terminate()
        relay.wait(timeout=60)


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_staleness(steps: int, ks: list[int]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="nanogrpo-bench-stale-"))
    from nanogrpo.demos.arithmetic.build import embedded_path

    urls, procs, over, _ = _servers(str(embedded_path()), tmp)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        for k in ks:
            out = tmp / f"k{k}"
            cmd = [sys.executable, "-m", "nanogrpo.cli", "train", "--out", str(out), "--steps", str(steps),
                   *over, f"rollout.max_staleness={k}", f"eval.every={steps // 2}"]
            if k:
                cmd.append("rollout.correction=token_truncate")
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in rows if "loss" in r]
            evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}

            def mean(key: str, train=train) -> float:
                return sum(r.get(key, 0.0) for r in train) / len(train)

            print(json.dumps({"bench": "max_staleness", "k": k, "steps": steps, "wall_s": round(wall, 1),
                              "step_s_mean": round(mean("step_time_s"), 2),
                              "staleness_mean": round(mean("staleness/mean"), 3),
                              "staleness_max": max(r.get("staleness/max", 0) for r in train),
                              "trainer_wait_s_mean": round(mean("pipeline/trainer_wait_s"), 2),
                              "sync_s_mean": round(mean("sync/time_s"), 3), "held_out": evals}), flush=True)
    finally:
        _stop(procs)


_SYNC_WORKER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
from nanogrpo.engines.vllm_server import state_source
from nanogrpo.engines.vllm_server.http import ServerClient
from nanogrpo.engines.vllm_server.pool import ServerPool
from nanogrpo.engines.vllm_server.sync import WeightSync
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
pool = ServerPool([ServerClient(u) for u in json.loads(sys.argv[2])])
sync = WeightSync(pool, state_source(model, torch.float32))
sync.sync(0)  # the transfer groups built
print("ready", flush=True)
for line in sys.stdin:
    v = int(line)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    t0 = time.perf_counter()
    out = sync.sync(v)
    print(json.dumps({"wall_s": time.perf_counter() - t0, "servers": out["sync/servers"]}), flush=True)
"""


def bench_sync_ab(other: Path, shape: str, repeats: int) -> None:
    """This checkout (B) against ``other`` (A): two servers each, started by each checkout's launcher; one
    trainer process each; syncs in turn A B A B; median seconds and the A/B ratio pair by pair."""
    tmp = Path(tempfile.mkdtemp(prefix="nanogrpo-bench-ab-"))
    model_dir = _model_dir(shape, tmp)
    sides = {"A": Path(other).resolve(), "B": ROOT}
    launchers, workers = {}, {}
    try:
        for name, root in sides.items():
            base = _port()
            while True:  # two consecutive free ports
                try:
                    with socket.socket() as s2:
                        s2.bind(("127.0.0.1", base + 1))
                    break
                except OSError:
                    base = _port()
            urls = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
            env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
            launchers[name] = subprocess.Popen(
                [sys.executable, "-m", "nanogrpo.cli", "vllm-serve", "--count", "2", "--port", str(base),
                 "--state-dir", str(tmp / name), f"model.path={model_dir}", "rollout.engine=vllm_server",
                 "rollout.servers=" + json.dumps(urls)], cwd=root, env=env,
                stdout=open(tmp / f"{name}-launcher.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
            from nanogrpo.launch import wait_healthy

            for u in urls:
                wait_healthy(u, launchers[name])
            workers[name] = subprocess.Popen([sys.executable, "-c", _SYNC_WORKER, model_dir,
                                              json.dumps(urls)], cwd=root, env=env, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True)
            assert workers[name].stdout.readline().strip() == "ready"
        times: dict[str, list[float]] = {"A": [], "B": []}
        for v in range(1, repeats + 1):
            for name in ("A", "B"):
                w = workers[name]
                w.stdin.write(f"{v}\n")
                w.stdin.flush()
                got = json.loads(w.stdout.readline())
                assert got["servers"] == 2, got
                times[name].append(got["wall_s"])
        ratio = sorted(a / b for a, b in zip(times["A"], times["B"], strict=True))
        med = {k: sorted(t)[len(t) // 2] for k, t in times.items()}
        print(json.dumps({"bench": "server_tier_sync_ab", "shape": shape, "a": str(sides["A"]),
                          "b": str(sides["B"]), "a_sync_s_median": round(med["A"], 4),
                          "b_sync_s_median": round(med["B"], 4),
                          "a_over_b_median": round(ratio[len(ratio) // 2], 3),
                          "pairs_min_max": [round(ratio[0], 3), round(ratio[-1], 3)], "repeats": repeats}),
              flush=True)
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait(timeout=60)
        for launcher in launchers.values():
            launcher.terminate()  # SIGTERM: the launcher ends its servers
            launcher.wait(timeout=120)


def bench_lora(shape: str, r: int, repeats: int, steps: int) -> None:
    """Adapter-only vs merged LoRA sync to two LoRA-enabled servers, A B A B; then (``steps``) the step."""
    from transformers import AutoModelForCausalLM

    from nanogrpo.config import ModelConfig
    from nanogrpo.engines.vllm_server import base_source, state_source
    from nanogrpo.engines.vllm_server.adapters import AdapterSync
    from nanogrpo.engines.vllm_server.http import ServerClient
    from nanogrpo.engines.vllm_server.pool import ServerPool
    from nanogrpo.engines.vllm_server.sync import WeightSync
    from nanogrpo.models.lora import apply_lora

    tmp = Path(tempfile.mkdtemp(prefix="nanogrpo-bench-lora-"))
    model_dir = _model_dir(shape, tmp)
    lora = [f"model.lora_r={r}", f"model.lora_alpha={2 * r}"]
    urls, procs, over, up = _servers(model_dir, tmp, extra=lora)
    try:
        model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           ModelConfig(lora_r=r, lora_alpha=2.0 * r)).eval()
        pool = ServerPool([ServerClient(u, transfer_timeout_s=1800) for u in urls])
        adapter = AdapterSync(WeightSync(pool, base_source(model, torch.float32), timeout_s=1800), model,
                              tmp / "adapters", keep=2)
        merged = WeightSync(pool, state_source(model, torch.float32), timeout_s=1800)
        v = 1
        adapter.sync(v)  # the base weights once, the groups built
        merged.sync(v + 1)
        times: dict[str, list[dict]] = {"adapter": [], "merged": []}
        for _ in range(repeats):
            for name, driver in (("adapter", adapter), ("merged", merged)):
                v += 2 if name == "adapter" else 0
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if "lora_B" in n:
                            p.add_(1e-3)
                t0 = time.perf_counter()
                out = driver.sync(v if name == "adapter" else v + 1)
                out["wall_s"] = time.perf_counter() - t0
                times[name].append(out)
        for name, ts in times.items():
            med = sorted(t["wall_s"] for t in ts)[len(ts) // 2]
            print(json.dumps({"bench": "lora_sync", "path": name, "shape": shape, "r": r, "servers": 2,
                              "mb_per_server": round(ts[0]["sync/mb"] / 2, 2),
                              "sync_s_median": round(med, 3), "repeats": repeats,
                              "servers_up_s": round(up, 1)}), flush=True)
        pairs = zip(times["adapter"], times["merged"], strict=True)
        ratio = sorted(m["wall_s"] / a["wall_s"] for a, m in pairs)
        print(json.dumps({"bench": "lora_sync_ratio", "shape": shape,
                          "merged_over_adapter_median": round(ratio[len(ratio) // 2], 1),
                          "pairs": [round(x, 1) for x in ratio]}), flush=True)
        pool.close()
        adapter.close()
        merged.close()
        env = {**os.environ, "PYTHONPATH": str(ROOT),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        for how in ("adapter", "merged") if steps else ():
            out = tmp / f"run-{how}"
            cmd = [sys.executable, "-m", "nanogrpo.cli", "train", "--out", str(out), "--steps", str(steps),
                   *over, *lora, f"vllm_server.lora_sync={how}", "rollout.prompts_per_step=2",
                   "grpo.group_size=4", "rollout.max_new_tokens=16", "eval.every=0", "train.save_every=0"]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            train = [x for x in rows if "loss" in x]
            def med(key: str, train=train) -> float:  # (a run's last step has no sync after it)
                vals = sorted(x[key] for x in train if key in x)
                return vals[len(vals) // 2] if vals else float("nan")

            print(json.dumps({"bench": "lora_step", "path": how, "shape": shape, "steps": len(train),
                              "step_s_median": round(med("step_time_s"), 2),
                              "sync_s_median": round(med("sync/time_s"), 3),
                              "mb_per_sync": round(med("sync/mb"), 2)}), flush=True)
    finally:
        _stop(procs)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sync")
    s.add_argument("--shape", default="demo", help="demo, or a shape of nanogrpo.models.tiny (qwen2.5-0.5b)")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--parts", default="tier,relay", help="tier (vLLM servers), relay (nanogrpo serve)")
    ab = sub.add_parser("sync-ab")
    ab.add_argument("--other", type=Path, required=True, help="the other checkout (side A)")
    ab.add_argument("--shape", default="demo")
    ab.add_argument("--repeats", type=int, default=15)
    lo = sub.add_parser("lora")
    lo.add_argument("--shape", default="qwen2.5-0.5b")
    lo.add_argument("--r", type=int, default=16)
    lo.add_argument("--repeats", type=int, default=5)
    lo.add_argument("--steps", type=int, default=0, help="also train this many steps on each path")
    k = sub.add_parser("staleness")
    k.add_argument("--steps", type=int, default=40)
    k.add_argument("--ks", default="0,1,2")
    a = ap.parse_args(argv)
    # SIGTERM / SIGHUP (a `timeout`, a closed terminal, CI's kill) end the bench through its finally
    # blocks, which end the servers it started (each in a process group of its own: they outlived it before)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    if a.what == "sync":
        bench_sync(a.shape, a.repeats, a.parts)
    elif a.what == "sync-ab":
        bench_sync_ab(a.other, a.shape, a.repeats)
    elif a.what == "lora":
        bench_lora(a.shape, a.r, a.repeats, a.steps)
    else:
        bench_staleness(a.steps, [int(x) for x in a.ks.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
