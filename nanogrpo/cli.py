"""Command line: ``nanogrpo train | eval | serve | rollout | bench | report | vllm-serve``.

``train`` and ``eval`` are a thin layer over the public functions (:mod:`nanogrpo.api`): flags
become config overrides, the rest is :func:`nanogrpo.train` / :func:`nanogrpo.evaluate`. Each
sub-command imports its machinery lazily, so ``nanogrpo --help`` is fast and a GPU-less machine
never imports GPU-only code. Everything runs on nanogrpo's screen (:mod:`nanogrpo.console`):
third-party progress bars and retry chatter off unless ``-v``. Errors the user can fix
(:class:`~nanogrpo.errors.NanoGRPOError`) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

from nanogrpo.console import screen
from nanogrpo.errors import ConfigError, NanoGRPOError

# sub-commands owned by other modules: name -> "module:function(argv) -> int"
EXTERNAL = {
    "serve": "nanogrpo.serve.server:main",
    "rollout": "nanogrpo.serve.worker:main",
    "bench": "nanogrpo.bench:main",
    "report": "nanogrpo.report:main",
    "vllm-serve": "nanogrpo.launch:main",
}


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="run GRPO (single process, or consuming a server with --server)",
                       description="Run GRPO. With no --config, the embedded CPU demo preset is the base; "
                                   "flags and key=value overrides apply on top.")
    from nanogrpo import entry_points  # reads the demos' entry points only (no config, no torch)

    presets = ", ".join(entry_points.preset_names())
    p.add_argument("--config", help=f"TOML/YAML config file (e.g. configs/gsm8k-qwen2.5-0.5b.toml), or a "
                                    f"shipped preset: {presets}")
    p.add_argument("--model", help="local HF model directory or hub id (model.path)")
    p.add_argument("--data", help="dataset file, preset (gsm8k, math, arithmetic, ...) or hf:NAME "
                                  "(data.source)")
    p.add_argument("--out", help="run directory (train.out)")
    p.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    p.add_argument("--seed", type=int, help="random seed (train.seed)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run that the run directory already holds (its files removed first); "
                        "without it, a new run into a directory that holds one is refused, nothing touched")
    p.add_argument("--server", help="consume rollout batches from a nanogrpo server at this URL")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. grpo.beta=0.04 train.lr=1e-6")
    _verbose_flag(p)


VERBOSE_HELP = "debug lines, and third-party progress bars and retry warnings as their libraries print them"


def _verbose_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="greedy pass@1, or pass@k/maj@k, of a checkpoint", description=(
        "Greedy pass@1 with the training rewards, or with --k K sampled pass@K and maj@K (temperature: "
        "eval.temperature, else rollout.temperature). Prints one JSON object (accuracy, format_rate, n, "
        "pass@1, pass@k, maj@k, ...). The data, prompt format and rewards come from --config, else from the "
        "run the checkpoint belongs to, else from the embedded demo (held-out split of the arithmetic task); "
        "with a dataset preset (--data math500) and a model of your own, from the defaults (key=value "
        "overrides on top, e.g. data.prompt_template=r1_boxed rollout.max_new_tokens=4096)."))
    p.add_argument("--model", required=True, help="checkpoint directory (HF format) or hub id")
    p.add_argument("--config", help="config file or preset name")
    p.add_argument("--data", help="dataset file, preset (gsm8k, math, math500, aime24, ...) or hf:NAME "
                                  "(default: data.eval_source, else data.source)")
    p.add_argument("--split", help="split to evaluate (default: data.eval_split)")
    p.add_argument("--n", type=int, help="number of problems (default: eval.n)")
    p.add_argument("--k", type=int, help="samples per problem (default: eval.k; 1 = greedy)")
    p.add_argument("--out", type=Path,
                   help="also write the summary JSON here, and per-sample JSONL (question, completions, "
                        "rewards, extracted answers) beside it, its suffix replaced: --out ev/s.json writes "
                        "ev/s.samples.jsonl")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    _verbose_flag(p)


def _flag_overrides(a: argparse.Namespace) -> list[str]:
    pairs = {"model": "model.path", "data": "data.source", "out": "train.out", "steps": "train.steps",
             "seed": "train.seed"}
    out = []
    for attr, key in pairs.items():
        v = getattr(a, attr, None)
        if v is not None:
            out.append(f"{key}={json.dumps(v) if isinstance(v, str) else v}")
    return out


def cmd_train(a: argparse.Namespace) -> int:
    from nanogrpo.api import RunExistsError, claim_run_dir, run_config, train
    from nanogrpo.config import config_from

    if a.resume is not None and a.overwrite:
        raise ConfigError("--resume and --overwrite: continue the run or replace it, not both")
    overrides = _flag_overrides(a) + list(a.overrides)
    # a config mistake is reported before torch is imported
    cfg = run_config(a.resume, overrides) if a.resume is not None else config_from(a.config, overrides)
    root = Path(a.resume or cfg.train.out)
    try:
        if a.server:
            from nanogrpo.serve.feed import train_from_server

            if a.resume is None:
                claim_run_dir(cfg.train.out, overwrite=a.overwrite)
            train_from_server(cfg, a.server, resume_dir=a.resume)
        else:
            root = train(cfg, resume=a.resume, overwrite=a.overwrite).root
    except RunExistsError as e:
        raise e.for_cli() from None
    except KeyboardInterrupt:
        raise Interrupted(_resume_hint(root, a.server)) from None
    rc = 0
    if os.environ.get("RANK", "0") == "0":  # under a launcher, rank 0 speaks for the run
        rc = _stopped_status(root, a.server)
        print(f"run directory: {root}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A launched rank whose run is done (files written and closed): leave without interpreter
        # teardown, which aborted or deadlocked in gloo's process group now and then.
        from nanogrpo.training.distributed import leave_launched_rank

        leave_launched_rank(rc)
    return rc


STOPPED_BY_MONITOR = 3
"""The exit status of ``nanogrpo train`` when the run monitor ended the run before ``train.steps``: a
script or scheduler that chains commands on success learns the run did not run its steps."""


def _stopped_status(root: Path, server: str | None = None) -> int:
    """:data:`STOPPED_BY_MONITOR`, with one line saying why and how to go on (``--server`` for split mode),
    when the run monitor ended the run at ``root`` early; else 0."""
    from nanogrpo.api import Run

    stopped = Run(root).stopped
    if stopped is None:
        return 0
    import shlex

    print(f"nanogrpo: the run monitor stopped the run at step {stopped['step']} ({stopped['rule']}; "
          f"exit status {STOPPED_BY_MONITOR}): see {root / 'watch.jsonl'}; to go on regardless: "
          f"nanogrpo train --resume {shlex.quote(str(root))}"
          + (f" --server {shlex.quote(server)}" if server else ""), file=sys.stderr)
    return STOPPED_BY_MONITOR


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run: ``hint`` says how to continue it (empty when there is nothing to continue)."""

    def __init__(self, hint: str = ""):
        super().__init__(hint)
        self.hint = hint


def _resume_hint(root: Path, server: str | None) -> str:
    """``continue it from step_N: nanogrpo train --resume ROOT``, when ``root`` holds a complete checkpoint
    and this process speaks for the run (rank 0); else ``""``."""
    if os.environ.get("RANK", "0") != "0" or not (root / "checkpoints").is_dir():
        return ""
    from nanogrpo.api import Run

    ckpt = Run(root).checkpoint
    if ckpt is None:
        return ""
    import shlex

    more = f" --server {shlex.quote(server)}" if server else ""
    return f"continue it from {ckpt.name}: nanogrpo train --resume {shlex.quote(str(root))}{more}"


def cmd_eval(a: argparse.Namespace) -> int:
    from nanogrpo.api import evaluate

    for flag in ("k", "n"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise ConfigError(f"--{flag} must be at least 1, got {getattr(a, flag)}")
    summary = evaluate(a.model, config=a.config, dataset=a.data, split=a.split, n=a.n, k=a.k, out=a.out,
                       overrides=list(a.overrides))
    print(json.dumps(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanogrpo", description="A small, fast GRPO trainer.")
    ap.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = ap.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _eval_parser(sub)
    for name in EXTERNAL:
        sub.add_parser(name, help=f"see `nanogrpo {name} --help`", add_help=False)
    return ap


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop ``--local_rank=N`` / ``--local_rank N``, which the ``deepspeed`` launcher puts before the
    subcommand; the rank is read from the environment (``LOCAL_RANK``, set from it when missing)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--local_rank" and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 2
            continue
        if arg.startswith("--local_rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
            i += 1
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    # third-party warnings (nanogrpo's own lines have the screen's handler)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    verbose = bool(argv) and argv[0] in ("-v", "--verbose")
    if not verbose:  # datasets reads this when it is imported (if ever)
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        if argv[verbose:] and argv[verbose] in EXTERNAL:
            mod, fn = EXTERNAL[argv[verbose]].split(":")
            with screen(verbose, own=True):
                return int(getattr(importlib.import_module(mod), fn)(argv[verbose + 1:]) or 0)
        a = build_parser().parse_args(argv)
        with screen(a.verbose, own=True):
            return {"train": cmd_train, "eval": cmd_eval}[a.command](a)
    except NanoGRPOError as e:
        print(f"nanogrpo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        hint = e.hint if isinstance(e, Interrupted) else ""
        print("nanogrpo: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 130


def run() -> int:
    """The ``nanogrpo`` command: :func:`main`, then the process's end, bounded. After an error (the one
    line printed) the threads still running are given ``LINGER_S`` seconds; any still alive then (a
    generation request, a weight-transfer group tearing down in C++, a library's worker) would hold the
    interpreter's exit for as long as its own timeout, so the process ends with ``os._exit`` once its
    output is flushed. A weight-transfer group dropped for a dead vLLM server may also still be tearing
    down after a run that succeeded: a normal exit would abort in that teardown, so it ends the same way."""
    try:
        rc = main()
    except SystemExit as e:  # argparse, a test stop: exit as Python would, but bounded
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:  # noqa: BLE001 (a bug: its traceback, then the same bounded end)
        import traceback

        traceback.print_exc()
        rc = 1
    gloo = sys.modules.get("nanogrpo.transfer.gloo")  # loaded only by the server tier's gloo transfer
    lingering = gloo is not None and gloo.groups_still_ending() > 0
    if rc != 0:
        lingering = lingering or bool(_lingering_threads(LINGER_S))
    if lingering:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    return rc


LINGER_S = 10.0
"""After an error, how long threads still running are waited for before the process ends regardless."""


def _lingering_threads(wait_s: float) -> list[str]:
    """Names of the non-daemon threads (those that hold the interpreter's exit) still alive after
    waiting up to ``wait_s`` seconds in all for them to end."""
    import threading
    import time

    deadline = time.monotonic() + wait_s
    main_thread = threading.main_thread()
    for t in threading.enumerate():
        if t is not main_thread and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threading.enumerate() if t is not main_thread and not t.daemon and t.is_alive()]


if __name__ == "__main__":
    raise SystemExit(run())
