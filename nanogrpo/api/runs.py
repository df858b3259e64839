"""Runs and checkpoints as the public functions see them: :class:`Run`, a config from what the functions
accept, the checkpoint a run or path means."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanogrpo.config import RUN_CONFIG_FILE as CONFIG_FILE
from nanogrpo.config import Config, Overrides, config_from
from nanogrpo.errors import ConfigError

log = logging.getLogger("nanogrpo")


@dataclass(frozen=True)
class Run:
    """A run directory and what it holds; :func:`train` returns one, ``Run("runs/demo")`` opens any."""

    root: Path
    rewards: tuple = field(default=(), repr=False, compare=False)
    """The rewards :func:`train` was given (names and callables), which :func:`evaluate` reuses; a
    run opened from its directory has its config's names only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Config:
        """The run's resolved config (``RUN/config.yaml``)."""
        return run_config(self.root)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """One dict per logged step (``RUN/metrics.jsonl``): loss, reward_mean, accuracy, kl, ...
        (step 0 holds the held-out baseline only, when the run evaluates)."""
        from nanogrpo.training.metrics import read_metrics

        path = self.root / "metrics.jsonl"
        return read_metrics(path) if path.is_file() else []

    @property
    def alarms(self) -> list[dict[str, Any]]:
        """What the run monitor flagged (``RUN/watch.jsonl``, :mod:`nanogrpo.watch`), oldest first: one dict
        per alarm (``rule``, ``step``, ``since``, ``message``, the numbers, completions); [] when quiet."""
        from nanogrpo.watch import read_events

        return read_events(self.root)

    @property
    def checkpoints(self) -> list[Path]:
        """The complete checkpoints (``RUN/checkpoints/step_N``), oldest first."""
        from nanogrpo.training.checkpoint import STATE_FILE

        found = [p for p in (self.root / "checkpoints").glob("step_*")
                 if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: int(p.name[5:]))

    @property
    def checkpoint(self) -> Path | None:
        """The newest complete checkpoint (an HF model directory), or None."""
        from nanogrpo.training.checkpoint import latest_checkpoint

        return latest_checkpoint(self.root / "checkpoints")

    @property
    def stopped(self) -> dict[str, Any] | None:
        """The run monitor's event that ended the run before ``train.steps`` (a rule in ``watch.stop_on``,
        or one that ends a run by its own settings: ``episodes_failed``), while the run's newest checkpoint
        is that step's; None for a run that ran its steps, or was continued past the stop."""
        ckpt = self.checkpoint
        if ckpt is None or not (self.root / CONFIG_FILE).is_file():
            return None
        step = int(ckpt.name[5:])
        if step >= self.config.train.steps:
            return None
        return next((e for e in reversed(self.alarms) if e.get("stop") and e.get("step") == step), None)

    def summary(self) -> str:
        """One line: steps, time, reward and accuracy first -> last, held-out accuracy, tokens/s."""
        from nanogrpo.training.logging_sinks import run_summary

        return run_summary(self.root)

    def __fspath__(self) -> str:
        return str(self.root)


RUN_MARKS = (CONFIG_FILE, "metrics.jsonl", "checkpoints")
"""What makes a directory a run's: any of these in it (the trainer writes the config first)."""

RUN_ENTRIES = (*RUN_MARKS, "samples.jsonl", "watch.jsonl", "eval", "tb", "wandb", "wandb_id", "data", "inbox",
               "vllm-adapters", "report")
"""Everything a run (and ``nanogrpo report``) writes into its directory; with ``judge_cache.sqlite*``
and half-written ``.NAME.PID.tmp`` files, what an overwrite removes. Anything else there is left."""


class RunExistsError(ConfigError):
    """A new run was started into a directory that already holds one, without asking to continue it
    (``--resume``) or to replace it (``--overwrite``): nothing in it was touched."""

    def __init__(self, root: Path, held: list[str], cli: bool = False):
        self.root, self.held = Path(root), held
        found = ", ".join(held)
        if cli:
            ways = (f"continue it with `nanogrpo train --resume {root}`, train into a new directory with "
                    f"--out DIR, or replace it with --overwrite")
        else:
            ways = (f"continue it with nanogrpo.train(resume={str(root)!r}), give a new train.out, or "
                    "replace it with nanogrpo.train(..., overwrite=True)")
        super().__init__(f"{root} already holds a run ({found}): {ways}")

    def for_cli(self) -> RunExistsError:
        """The same refusal, in the command line's words."""
        return RunExistsError(self.root, self.held, cli=True)


def claim_run_dir(root: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Make ``root`` ready for a new run, before anything is written: a directory that holds no run
    (:data:`RUN_MARKS`) is used as it is; one that holds a run is refused (:class:`RunExistsError`, every
    file left as it was) unless ``overwrite``, which removes the old run's files first (:data:`RUN_ENTRIES`:
    no stale ``step_N``, ``latest`` or metrics line survives) and leaves anything else. Under a launcher
    only rank 0 decides (the others start while rank 0 writes the new run's first files)."""
    if os.environ.get("RANK", "0") != "0":
        return
    root = Path(root)
    _check_run_dir(root)
    held = [name + ("/" if (root / name).is_dir() else "") for name in RUN_MARKS if (root / name).exists()]
    if not held:
        return
    if not overwrite:
        raise RunExistsError(root, held)
    removed, kept = [], []
    for entry in sorted(root.iterdir()):
        name = entry.name
        if (name in RUN_ENTRIES or name.startswith("judge_cache.sqlite")
                or (name.startswith(".") and name.endswith(".tmp"))):
            tree = entry.is_dir() and not entry.is_symlink()
            shutil.rmtree(entry) if tree else entry.unlink()
            removed.append(name + ("/" if tree else ""))
        else:
            kept.append(name)
    log.info("overwrite: removed the run that was in %s (%s)%s", root, ", ".join(removed),
             f"; left as they were: {', '.join(kept)}" if kept else "")


def _check_run_dir(root: Path) -> None:
    """Say in one line why ``root`` cannot be a run directory (a file there or on its way, no permission, a
    read-only disk), before any weights are read; nothing is created here (a later refusal of other input
    leaves no directory behind)."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"train.out={str(root)!r} is a file, not a directory: give --out (train.out) a "
                          "directory, new or empty")
    there = root.absolute()
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        raise ConfigError(f"train.out={str(root)!r}: cannot create the run directory ({str(there)!r} is a "
                          "file): give --out (train.out) a directory you can write")
    if not os.access(there, os.W_OK | os.X_OK):
        raise ConfigError(f"train.out={str(root)!r}: {str(there)!r} is not writable by this user (or its "
                          "disk is read-only): give --out (train.out) a directory you can write")


def as_config(config: Config | str | os.PathLike | Mapping[str, Any] | None,
              overrides: Overrides = ()) -> Config:
    """A :class:`Config` from what the functions accept: a Config, a file or preset name (None: the
    demo preset), or a dict of sections (``{"train": {"steps": 2}}``, over the seed's defaults, as a
    file is); then ``overrides``."""
    if isinstance(config, Config):
        return config.with_overrides(overrides) if overrides else config
    if config is None or isinstance(config, (str, os.PathLike)):
        return config_from(config, overrides)
    if isinstance(config, Mapping):
        return Config.from_dict(config, overrides)
    raise ConfigError(f"config must be a Config, a file, a preset name or a dict, not "
                      f"{type(config).__name__}")


def run_config(run_dir: str | os.PathLike, overrides: Overrides = ()) -> Config:
    """The config a run directory was made with (``RUN/config.yaml``), with ``overrides``."""
    from nanogrpo.config import load_config

    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no {CONFIG_FILE})")
    return load_config(path, overrides)


def _is_preset(dataset: Any) -> bool:
    from nanogrpo.data.sources import PRESETS

    return isinstance(dataset, str) and dataset in PRESETS


def _checkpoint_path(model: str | os.PathLike | Run) -> Path | str:
    """A run (directory) means its newest checkpoint; anything else is as given."""
    root = model.root if isinstance(model, Run) else Path(model)
    if (root / "checkpoints").is_dir() and (root / CONFIG_FILE).is_file():
        ckpt = Run(root).checkpoint
        if ckpt is None:
            raise ConfigError(f"run {root} has no complete checkpoint yet")
        return ckpt
    return root if isinstance(model, Run) or root.exists() else str(model)


def _run_of(path: Path | str) -> Path | None:
    """``RUN`` when ``path`` is ``RUN/checkpoints/step_N`` (or its ``merged/``) of a run directory."""
    p = Path(path)
    if p.name == "merged":
        p = p.parent
    run = p.parent.parent
    return run if p.is_dir() and p.parent.name == "checkpoints" and (run / CONFIG_FILE).is_file() else None


def _override_list(overrides: Overrides) -> list[str]:
    if isinstance(overrides, Mapping):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'section.key=value' strings or a dict, not the "
                          f"string {overrides!r}")
    return list(overrides)
