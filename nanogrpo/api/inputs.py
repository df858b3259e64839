"""What the public functions take besides a config: in-memory datasets, reward callables, tools and
environment objects, turned into the config and the trainer's arguments."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogrpo.config import Config
from nanogrpo.errors import ConfigError, DataError, ToolError

log = logging.getLogger("nanogrpo")


def _is_rows(value: Any) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))


def _raw_rows(data: Any, what: str) -> list[dict]:
    """The rows of an in-memory dataset, as a list (a DataFrame by records)."""
    if type(data).__module__.startswith("pandas") and hasattr(data, "to_dict"):  # a DataFrame: by rows
        data = data.to_dict("records")
    if not _is_rows(data):
        raise DataError(f"{what}: expected rows (a list of dicts, an HF Dataset), a dict of splits or a data "
                        f"source, got {type(data).__name__}")
    return list(data)


def _split_rows(dataset: Any, split: str, what: str) -> list[dict] | None:
    """``dataset``'s rows for ``split``: all of it when it is rows, its ``split`` when it is a
    mapping of splits (None when it has no such split)."""
    if isinstance(dataset, Mapping):
        if not all(_is_rows(v) or hasattr(v, "to_dict") for v in dataset.values()):
            raise DataError(f"{what} is a single dict: pass a list of dicts (rows), or a dict of splits "
                            f"({{'train': rows, 'test': rows}})")
        return _raw_rows(dataset[split], f"{what}[{split!r}]") if split in dataset else None
    return _raw_rows(dataset, what)


def _write_rows(rows: list[dict], path: Path) -> None:
    """``rows`` as JSONL at ``path`` (atomically; values JSON cannot hold are written as text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


@dataclass
class _Data:
    cfg: Config
    given: dict[str, Any]
    """The trainer's ``rows`` / ``eval_rows`` where the caller's data stands in for the config's."""
    files: list[tuple[list[dict], Path]]
    """The caller's rows and where in the run directory they go (once the run starts)."""

    def write(self) -> None:
        for rows, path in self.files:
            _write_rows(rows, path)


def _data(cfg: Config, dataset: Any, eval_dataset: Any, root: Path) -> _Data:
    """Samples from ``dataset`` / ``eval_dataset`` (see the module docstring); the config then names
    their copies in ``root/data``."""
    from nanogrpo.data.sources import samples_from

    if isinstance(dataset, (str, os.PathLike)):
        cfg = cfg.with_overrides({"data.source": str(dataset)})
        dataset = None
    if dataset is None:
        if eval_dataset is not None:
            raise DataError("eval_dataset without dataset: pass the training rows too (or neither)")
        return _Data(cfg, {}, [])
    d = cfg.data
    raw_train = _split_rows(dataset, d.split, "dataset")
    if raw_train is None:
        raise DataError(f"dataset has no split {d.split!r} (data.split); its splits: "
                        f"{', '.join(map(str, dataset))}")
    if eval_dataset is not None:
        raw_eval = _split_rows(eval_dataset, d.eval_split, "eval_dataset")
        if raw_eval is None:
            raise DataError(f"eval_dataset has no split {d.eval_split!r} (data.eval_split)")
    else:
        raw_eval = _split_rows(dataset, d.eval_split, "dataset") if isinstance(dataset, Mapping) else None
    given: dict[str, Any] = {"rows": samples_from(raw_train, d, "dataset")}
    files = [(raw_train, root / "data" / f"{d.split}.jsonl")]
    source = {"data.source": str((root / "data").resolve() / "{split}.jsonl")}
    if raw_eval is not None:
        eval_rows = samples_from(raw_eval, d, "eval_dataset")
        given["eval_rows"] = eval_rows[:cfg.eval.n] if cfg.eval.every else None
        files.append((raw_eval, root / "data" / f"{d.eval_split}.jsonl"))
        source["data.eval_source"] = None  # held out beside the training rows
    elif d.eval_source is None:
        if cfg.eval.every:
            log.info("no held-out rows (eval_dataset, a %r split of dataset, or data.eval_source): no "
                     "evaluation during training (eval.every=%d set to 0)", d.eval_split, cfg.eval.every)
            cfg = cfg.with_overrides({"eval.every": 0})
        given["eval_rows"] = None
    # else: held out from data.eval_source, loaded with the config's own rows (_config_rows)
    return _Data(cfg.with_overrides(source), given, files)


def _held_out_apart(cfg: Config) -> tuple[Config, str | None]:
    """No "held-out" figures measured on the training rows: a config whose held-out problems would come
    from its training file (one file, no ``{split}`` in its path, no ``data.eval_source``) evaluates
    nothing during training (as rows given without held-out ones, :func:`_data`); a ``data.eval_source``
    that names the training file on purpose is kept. Returns the config and the line that says so, for
    the caller to print once the rows have loaded (a file that is not there is said alone)."""
    from nanogrpo.data.sources import held_out_file_is_training_file

    if not cfg.eval.every:
        return cfg, None
    same = held_out_file_is_training_file(cfg.data)
    if same is None:
        return cfg, None
    if cfg.data.eval_source is not None:
        return cfg, f"data.eval_source is the training file {same}: the held-out figures are on training rows"
    return cfg.with_overrides({"eval.every": 0}), (
        f"no held-out evaluation: {same} is one file, whose held-out split would be its training rows "
        f"(eval.every={cfg.eval.every} set to 0); for one, set data.eval_source=FILE, or a data path with "
        "{split} (e.g. my_{split}.jsonl)")


def _config_rows(cfg: Config, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the config's own rows loaded where the caller gave none (before torch loads)."""
    from nanogrpo.data import load_eval_rows, load_rows

    out = dict(given)
    if "rows" not in out:
        out["rows"] = load_rows(cfg.data, cfg.data.split)
    if "eval_rows" not in out:
        out["eval_rows"] = load_eval_rows(cfg.data)[:cfg.eval.n] if cfg.eval.every else None
    return out


# ----------------------------------------------------------------------------- rewards and tools


def _rewards(cfg: Config, rewards: Any, run_dir: Path | None = None) -> tuple[Config, Any]:
    """The config's ``rewards.functions`` replaced by ``rewards`` (names and callables); the runner
    to use when callables are among them (None: the trainer builds it from the config). The config
    records a callable as ``<name>`` (its ``__name__``; ``<lambda>``): a run's record, which no
    command line can load, said so when one tries (:func:`_callables_in`)."""
    if rewards is None:
        return cfg, None
    items = [rewards] if isinstance(rewards, str) or callable(rewards) else list(rewards)
    if all(isinstance(r, str) for r in items):
        return cfg.with_overrides({"rewards.functions": items}), None
    from nanogrpo.rewards import reward_runner

    runner = reward_runner(cfg, items, run_dir=run_dir)  # one line per callable
    names = [item if isinstance(item, str) else f"<{name}>" for item, name in zip(items, runner.specs)]
    return cfg.with_overrides({"rewards.functions": names}), runner


def _callables_in(cfg: Config) -> list[str]:
    """The rewards a run's config records as Python callables (``<name>``)."""
    return [f for f in cfg.rewards.functions if f.startswith("<") and f.endswith(">")]


def _not_in_a_spawned_copy(what: str) -> None:
    """Refuse to run from the top level of a script that a spawned process (a reward worker) is
    running again: without ``if __name__ == "__main__":`` every worker would start a run of its own."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise SystemExit(f"nanogrpo: error: nanogrpo.{what}() called again in a process started by "
                             "spawn (a reward worker): the script that calls it re-runs in each one; put the "
                             "call under `if __name__ == \"__main__\":`")
        frame = frame.f_back


def _tools(cfg: Config, tools: Any) -> Config:
    """The config's ``tools`` section for ``tools``: a name, a dict of settings, or False (off)."""
    if tools is None:
        return cfg
    if tools is False:
        return cfg.with_overrides({"tools.enabled": False})
    if isinstance(tools, str):
        return cfg.with_overrides({"tools.enabled": True, "tools.function": tools})
    if isinstance(tools, Mapping):
        return cfg.with_overrides({"tools.enabled": True, **{f"tools.{k}": v for k, v in tools.items()}})
    if callable(tools):
        raise ToolError("tools: a tool runs in the sandbox, which imports it by name: put the function in a "
                        "module or file and pass 'module:function' or 'path/to/file.py:function'")
    raise ConfigError(f"tools must be a tool name, a dict of tools settings or False, not "
                      f"{type(tools).__name__}")


def _env(cfg: Config, env: Any) -> Config:
    """The config for an environment object given in Python: its episodes are scored by their return."""
    if env is None:
        return cfg
    if isinstance(env, str):
        return cfg.with_overrides({"env.source": env})
    if cfg.tools.enabled:
        raise ConfigError("env and tools both make multi-turn rollouts; use one (an environment runs "
                          "model-written code through its sandbox handle)")
    from nanogrpo.config.root import with_env

    cfg = cfg.model_copy(deep=True)
    with_env(cfg.rewards)
    return cfg
