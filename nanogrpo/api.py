"""nanogrpo from Python: the functions the CLI runs, for notebooks and scripts.

    import nanogrpo

    cfg = nanogrpo.Config.load("demo", {"train.steps": 20, "train.out": "runs/nb"})
    run = nanogrpo.train(cfg, rewards=["correctness", my_reward], dataset=rows)
    run.metrics[-1]["reward_mean"], run.checkpoint
    nanogrpo.evaluate(run, dataset=held_out)             # {"accuracy": ..., "pass@1": ..., ...}
    model, tokenizer = nanogrpo.load_checkpoint(run)     # a plain transformers model

- :class:`Config` (:mod:`nanogrpo.config`): from a file or a shipped preset (``Config.load``), a
  dict (``Config.from_dict``), with overrides as on the command line (``["train.steps=2"]``) or as a
  dict (``{"train.steps": 2}``). The functions also take a path, a preset name or a dict directly.
- ``dataset``: any iterable of dicts (a list, an HF ``Dataset``, a pandas ``DataFrame``), checked
  row by row as a file's rows are (``data.question_field`` / ``data.answer_field`` name the
  columns); a mapping of split names to those (an HF ``DatasetDict``) gives the train split
  (``data.split``) and the held-out one (``data.eval_split``); a string is a ``data.source``.
  The rows are written into the run directory (``RUN/data/``) and ``data.source`` points there,
  so the run resumes, and evaluates, from the command line too.
- ``rewards``: reward names (built-ins, ``module:function``) and Python callables
  ``fn(completion, sample) -> float`` (lambdas and closures too, batched ones too:
  :mod:`nanogrpo.rewards.entries`): sent to the reward worker processes pickled, or, when they
  cannot be pickled, run in this process with the same timeout and penalty, said in one line.
  A script (not a notebook) puts its calls under ``if __name__ == "__main__":``: the workers
  start by spawn, which runs the script again in each.
- ``tools``: a tool (``"python"``, ``module:function``) or a dict of ``tools`` settings.
- ``env``: an environment (:mod:`nanogrpo.envs`): a class or zero-argument factory (one call per
  episode), or an instance (each episode gets its ``fork()``, else a deep copy); the dataset's rows start
  its episodes, scored by their return (the ``env`` reward). Like a callable reward it is not in the
  run's config: give it again to resume or evaluate the run (``env.source`` names one by import path).

Nothing here imports torch until a function runs (``import nanogrpo`` stays cheap), and a model
that cannot be found (a typo, a hub id without network) is reported before torch loads. The
functions run on nanogrpo's screen (:func:`nanogrpo.console.screen`): third-party progress bars
off unless ``verbose``; nothing of it outlasts the call.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanogrpo.config import RUN_CONFIG_FILE as CONFIG_FILE
from nanogrpo.config import Config, Overrides, config_from
from nanogrpo.console import screen
from nanogrpo.errors import ConfigError, DataError, ToolError

__all__ = ["Config", "Run", "evaluate", "load_checkpoint", "train"]

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

    def summary(self) -> str:
        """One line: steps, time, reward and accuracy first -> last, held-out accuracy, tokens/s."""
        from nanogrpo.training.logging_sinks import run_summary

        return run_summary(self.root)

    def __fspath__(self) -> str:
        return str(self.root)


# ----------------------------------------------------------------------------- config


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


# ----------------------------------------------------------------------------- data


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
    from nanogrpo.models.reward import reward_runner

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


# ----------------------------------------------------------------------------- the functions


def train(config: Config | str | os.PathLike | Mapping[str, Any] | None = None, *,
          rewards: Sequence[str | Callable] | str | Callable | None = None, dataset: Any = None,
          eval_dataset: Any = None, tools: str | Mapping[str, Any] | bool | None = None,
          env: Any = None, resume: str | os.PathLike | None = None, verbose: bool = False) -> Run:
    """Run GRPO as ``nanogrpo train`` does; returns the :class:`Run` (its directory, metrics,
    checkpoints). ``config``: a :class:`Config`, a file or preset name, a dict (None: the demo,
    or with ``resume`` the run's own config). ``resume``: a run directory to continue from its last
    checkpoint (with the same ``rewards`` and ``dataset`` as it started with). See the module
    docstring for ``rewards``, ``dataset``, ``eval_dataset``, ``tools`` and ``env``."""
    _not_in_a_spawned_copy("train")
    with screen(verbose):
        cfg = run_config(resume) if config is None and resume is not None else as_config(config)
        cfg = _env(_tools(cfg, tools), env)
        root = Path(resume or cfg.train.out)
        data = _data(cfg, dataset, eval_dataset, root)
        if rewards is None and _callables_in(data.cfg):
            raise ConfigError(f"rewards {', '.join(_callables_in(data.cfg))} of this run were Python "
                              "callables given to nanogrpo.train: give them again (rewards=[...])")
        cfg, runner = _rewards(data.cfg, rewards, root)
        try:
            from nanogrpo.models.source import check_model_source

            model_path = check_model_source(cfg.model)  # a missing model or network: said before torch loads
            given = _config_rows(cfg, data.given)  # a dataset's mistakes too
            from nanogrpo.training.trainer import prepare
            from nanogrpo.training.trainer import train as run_training

            prepared = prepare(cfg, Path(resume) if resume is not None else None, rewards=runner,
                               model_path=model_path, env=None if isinstance(env, str) else env, **given)
        except BaseException:
            if runner is not None:
                runner.close()
            raise
        if os.environ.get("RANK", "0") == "0":  # under a launcher, rank 0 writes the run's files
            data.write()
        return Run(run_training(prepared), tuple(rewards) if _is_rows(rewards) else
                   (rewards,) if rewards is not None else ())


def evaluate(model: str | os.PathLike | Run, *,
             config: Config | str | os.PathLike | Mapping[str, Any] | None = None, dataset: Any = None,
             split: str | None = None, n: int | None = None, k: int | None = None,
             rewards: Sequence[str | Callable] | str | Callable | None = None,
             out: str | os.PathLike | None = None, overrides: Overrides = (), env: Any = None,
             verbose: bool = False) -> dict[str, Any]:
    """Greedy pass@1 (``k`` 1) or sampled pass@k and maj@k of a model, with the training rewards, as
    ``nanogrpo eval`` does; returns its summary (``accuracy``, ``format_rate``, ``reward_mean``,
    ``pass@k``, ``maj@k``, ``n``, ...).

    ``model``: a checkpoint directory, a run (directory or :class:`Run`: its newest checkpoint), a
    model directory or hub id. ``config``: as for :func:`train`; None: the config of the run the
    checkpoint belongs to, else the demo preset (the seed's defaults for a model of your own on a
    dataset preset such as ``math500``). ``dataset``: problems to evaluate (rows, or a ``data.source``:
    its held-out split), else the config's ``split`` (default ``data.eval_split``) of ``data.eval_source``
    (else ``data.source``); the first ``n`` of
    them (default: all the rows given, else ``eval.n``). ``out``: also write the summary JSON there,
    and per-sample records beside it. ``env``: an environment object (else the config's ``env.source``):
    each row starts an episode and ``accuracy`` is their success rate, with ``turns_mean``.
    """
    _not_in_a_spawned_copy("evaluate")
    with screen(verbose):
        path = _checkpoint_path(model)
        overrides = _override_list(overrides) + [f"model.path={json.dumps(str(path))}"]
        run_cfg = _run_of(path)
        if config is None and run_cfg is not None:
            cfg = run_config(run_cfg, overrides)
        elif config is None and _is_preset(dataset) and str(path) != "embedded":
            cfg = as_config({}, overrides)  # your model on a dataset preset: the demo's lengths do not fit
        else:
            cfg = as_config(config, overrides)
        cfg = _env(cfg, env)
        if k is not None and k < 1:
            raise ConfigError(f"k must be at least 1, got {k}")
        if n is not None and n < 1:
            raise ConfigError(f"n must be at least 1, got {n}")
        split = split or cfg.data.eval_split
        if isinstance(dataset, (str, os.PathLike)):  # the held-out problems of that source
            cfg = cfg.with_overrides({"data.source": str(dataset), "data.eval_source": str(dataset)})
            dataset = None
        if rewards is None and isinstance(model, Run) and model.rewards:
            rewards = list(model.rewards)
        if rewards is None and _callables_in(cfg):
            marks = _callables_in(cfg)
            kept = [(f, w) for f, w in zip(cfg.rewards.functions, cfg.rewards.resolved_weights())
                    if f not in marks] or [("correctness", 1.0)]
            log.info("rewards %s of the run were Python callables: reward_mean is over %s (pass "
                     "rewards=[...] for them all)", ", ".join(marks), ", ".join(f for f, _ in kept))
            cfg = cfg.with_overrides({"rewards.functions": [f for f, _ in kept],
                                      "rewards.weights": [w for _, w in kept]})
        cfg, runner = _rewards(cfg, rewards)
        if runner is None:  # built now: a reward that does not resolve fails before any weights are read
            from nanogrpo.models.reward import reward_runner

            runner = reward_runner(cfg)
        try:
            if dataset is not None:
                from nanogrpo.data.sources import samples_from

                raw = _split_rows(dataset, split, "dataset")
                if raw is None:
                    raise DataError(f"dataset has no split {split!r}")
                rows = samples_from(raw, cfg.data, "dataset")
            else:
                from nanogrpo.data import load_eval_rows

                rows = load_eval_rows(cfg.data, split)  # bad data fails before any weights are read
            from nanogrpo.models.source import check_model_source

            model_path = check_model_source(cfg.model)
            from nanogrpo.evaluation import run_eval
            from nanogrpo.models.load import load_policy

            policy, tok, _ = load_policy(cfg.model, model_path)
            n = n or (len(rows) if dataset is not None else cfg.eval.n)
            label = split if dataset is None or isinstance(dataset, Mapping) else "dataset"
            return run_eval(cfg, policy, tok, label, n, Path(out) if out is not None else None, k=k,
                            rows=rows, rewards=runner, env=None if isinstance(env, str) else env)
        finally:
            if runner is not None:
                runner.close()


def load_checkpoint(path: str | os.PathLike | Run, *, device: str = "cpu", dtype: str = "auto"):
    """``(model, tokenizer)`` of a checkpoint as plain transformers objects: a checkpoint directory,
    a run (its newest checkpoint), a model directory or hub id. A LoRA checkpoint comes merged
    (its ``merged/`` copy, or the run's base model with the adapter merged in). ``device`` as
    ``model.device`` (``auto``: cuda when there is one), ``dtype`` as ``model.dtype``."""
    from nanogrpo.config import ModelConfig
    from nanogrpo.models.load import load_policy
    from nanogrpo.models.source import check_model_source

    with screen():
        where = _checkpoint_path(path)
        if (where / "adapter_config.json").is_file():
            return _load_adapter_checkpoint(where, device, dtype)
        cfg = ModelConfig(path=str(where), device=device, dtype=dtype, cpu_linear="torch")
        model, tok, _ = load_policy(cfg, check_model_source(cfg))
        return model.eval(), tok


def _load_adapter_checkpoint(where: Path, device: str, dtype: str):
    from nanogrpo.config import ModelConfig
    from nanogrpo.models.load import load_policy
    from nanogrpo.models.lora import load_adapter

    if (where / "merged" / "config.json").is_file():
        model, tok, _ = load_policy(ModelConfig(path=str(where / "merged"), device=device, dtype=dtype,
                                                cpu_linear="torch"))
        return model.eval(), tok
    run_dir = _run_of(where)
    if run_dir is None:
        adapter = json.loads((where / "adapter_config.json").read_text())
        base = adapter.get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"{where}: a LoRA adapter whose base model is unknown (no run config, no "
                              "base_model_name_or_path)")
        base_cfg = ModelConfig(path=base, device=device, dtype=dtype, cpu_linear="torch")
    else:
        base_cfg = run_config(run_dir).model.model_copy(update={"device": device, "dtype": dtype,
                                                                "cpu_linear": "torch"})
    model, tok, _ = load_policy(base_cfg)
    return load_adapter(model, where, trainable=False).merge_and_unload().eval(), tok


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
