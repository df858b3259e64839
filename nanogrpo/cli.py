"""Command line: ``nanogrpo train | eval | serve | rollout | bench | report``.

Each sub-command imports its machinery lazily, so ``nanogrpo --help`` is fast
and a GPU-less machine never imports GPU-only code. Errors the user can fix
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

from nanogrpo.errors import ConfigError, NanoGRPOError

# sub-commands owned by other modules: name -> "module:function(argv) -> int"
EXTERNAL = {
    "serve": "nanogrpo.serve.server:main",
    "rollout": "nanogrpo.serve.worker:main",
    "bench": "nanogrpo.bench:main",
    "report": "nanogrpo.report:main",
}


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="run GRPO (single process, or consuming a server with --server)",
                       description="Run GRPO. With no --config, the embedded CPU demo preset is the base; "
                                   "flags and key=value overrides apply on top.")
    p.add_argument("--config", help="TOML/YAML config file, or the name of a shipped preset (demo)")
    p.add_argument("--model", help="local HF model directory or hub id (model.path)")
    p.add_argument("--data", help="dataset file, preset (gsm8k, math, arithmetic, ...) or hf:NAME "
                                  "(data.source)")
    p.add_argument("--out", help="run directory (train.out)")
    p.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    p.add_argument("--seed", type=int, help="random seed (train.seed)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--server", help="consume rollout batches from a nanogrpo server at this URL")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. grpo.beta=0.04 train.lr=1e-6")


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
                        "rewards, extracted answers) beside it as OUT.samples.jsonl")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def _flag_overrides(a: argparse.Namespace) -> list[str]:
    pairs = {"model": "model.path", "data": "data.source", "out": "train.out", "steps": "train.steps",
             "seed": "train.seed"}
    out = []
    for attr, key in pairs.items():
        v = getattr(a, attr, None)
        if v is not None:
            out.append(f"{key}={json.dumps(v) if isinstance(v, str) else v}")
    return out


def _base_config(config: str | None, overrides: list[str]):
    from nanogrpo.config import load_config, preset_path

    if config is None:
        return load_config(preset="demo", overrides=overrides)
    if not Path(config).exists() and preset_path(config).is_file():
        return load_config(preset=config, overrides=overrides)
    return load_config(config, overrides)


def cmd_train(a: argparse.Namespace) -> int:
    overrides = _flag_overrides(a) + list(a.overrides)
    if a.resume is not None:
        from nanogrpo.train.trainer import load_resume_config

        cfg = load_resume_config(a.resume, overrides)
    else:
        cfg = _base_config(a.config, overrides)  # a config mistake is reported before torch is imported
    if a.server:
        from nanogrpo.serve.consumer import train_from_server

        train_from_server(cfg, a.server, resume_dir=a.resume)
    else:
        from nanogrpo.train.trainer import prepare, train

        root = train(prepare(cfg, a.resume))
        if os.environ.get("RANK", "0") == "0":  # under a launcher, rank 0 speaks for the run
            print(f"run directory: {root}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A launched rank whose run is done (files written and closed, every rank past the final
        # barrier). Leave without interpreter teardown: tearing down gloo's process group aborted
        # the process now and then (SIGABRT, "terminate called without an active exception", no
        # Python frame), or deadlocked when destroyed early, failing a finished run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from nanogrpo.data.sources import PRESETS
    from nanogrpo.evaluate import run_eval
    from nanogrpo.models.load import load_policy

    overrides = list(a.overrides) + [f"model.path={json.dumps(a.model)}"]
    if a.data:  # what to evaluate on: the held-out problems of this source
        overrides += [f"data.source={json.dumps(a.data)}", f"data.eval_source={json.dumps(a.data)}"]
    run_cfg = _run_config_of(Path(a.model))
    if a.config is None and run_cfg is not None:
        from nanogrpo.config import load_config

        cfg = load_config(run_cfg, overrides)
    elif a.config is None and a.data in PRESETS and a.model != "embedded":
        from nanogrpo.config import load_config

        cfg = load_config(None, overrides)  # your model, your data: the demo's lengths do not fit
    else:
        cfg = _base_config(a.config, overrides)
    from nanogrpo.data import load_eval_rows

    split = a.split or cfg.data.eval_split
    load_eval_rows(cfg.data, split)  # fail on bad data before loading weights
    model, tok, _ = load_policy(cfg.model)
    if a.k is not None and a.k < 1:
        raise ConfigError(f"--k must be at least 1, got {a.k}")
    summary = run_eval(cfg, model, tok, split, a.n or cfg.eval.n, a.out, k=a.k)
    print(json.dumps(summary))
    return 0


def _run_config_of(model_dir: Path) -> Path | None:
    """``RUN/config.yaml`` when ``model_dir`` is ``RUN/checkpoints/step_N``."""
    cand = model_dir.parent.parent / "config.yaml"
    return cand if model_dir.is_dir() and model_dir.parent.name == "checkpoints" and cand.is_file() else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanogrpo", description="A small, fast GRPO trainer.")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
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
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if argv and argv[0] in EXTERNAL:
            mod, fn = EXTERNAL[argv[0]].split(":")
            return int(getattr(importlib.import_module(mod), fn)(argv[1:]) or 0)
        a = build_parser().parse_args(argv)
        if a.verbose:
            logging.getLogger("nanogrpo").setLevel(logging.DEBUG)
        return {"train": cmd_train, "eval": cmd_eval}[a.command](a)
    except NanoGRPOError as e:
        print(f"nanogrpo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nanogrpo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
