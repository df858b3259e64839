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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nanogrpo.api.inputs import (
    _callables_in,
    _config_rows,
    _data,
    _env,
    _held_out_apart,
    _is_rows,
    _not_in_a_spawned_copy,
    _rewards,
    _split_rows,
    _tools,
)
from nanogrpo.api.runs import (
    Run,
    RunExistsError,
    _checkpoint_path,
    _is_preset,
    _override_list,
    _run_of,
    as_config,
    claim_run_dir,
    run_config,
)
from nanogrpo.config import Config, Overrides
from nanogrpo.console import screen
from nanogrpo.errors import ConfigError, DataError

__all__ = ["Config", "Run", "RunExistsError", "evaluate", "load_checkpoint", "train"]

log = logging.getLogger("nanogrpo")


# ----------------------------------------------------------------------------- the functions


def train(config: Config | str | os.PathLike | Mapping[str, Any] | None = None, *,
          rewards: Sequence[str | Callable] | str | Callable | None = None, dataset: Any = None,
          eval_dataset: Any = None, tools: str | Mapping[str, Any] | bool | None = None,
          env: Any = None, resume: str | os.PathLike | None = None, overwrite: bool = False,
          verbose: bool = False) -> Run:
    """Run GRPO as ``nanogrpo train`` does; returns the :class:`Run` (its directory, metrics,
    checkpoints). ``config``: a :class:`Config`, a file or preset name, a dict (None: the demo,
    or with ``resume`` the run's own config). ``resume``: a run directory to continue from its last
    checkpoint (with the same ``rewards`` and ``dataset`` as it started with). A new run into a
    ``train.out`` that already holds a run is refused (:class:`~nanogrpo.api.runs.RunExistsError`,
    nothing touched) unless ``overwrite``, which removes that run's files first. See the module
    docstring for ``rewards``, ``dataset``, ``eval_dataset``, ``tools`` and ``env``."""
    _not_in_a_spawned_copy("train")
    with screen(verbose):
        if resume is not None and overwrite:
            raise ConfigError("resume and overwrite: continue the run or replace it, not both")
        cfg = run_config(resume) if config is None and resume is not None else as_config(config)
        cfg = _env(_tools(cfg, tools), env)
        root = Path(resume or cfg.train.out)
        if resume is None:
            claim_run_dir(root, overwrite=overwrite)  # before anything is written there
        data = _data(cfg, dataset, eval_dataset, root)
        if rewards is None and _callables_in(data.cfg):
            raise ConfigError(f"rewards {', '.join(_callables_in(data.cfg))} of this run were Python "
                              "callables given to nanogrpo.train: give them again (rewards=[...])")
        # a new run only: a resumed one evaluates as it started (its config says)
        cfg, held_out = (data.cfg, None) if resume is not None else _held_out_apart(data.cfg)
        cfg, runner = _rewards(cfg, rewards, root)
        try:
            from nanogrpo.models.source import check_model_source

            model_path = check_model_source(cfg.model)  # a missing model or network: said before torch loads
            given = _config_rows(cfg, data.given)  # a dataset's mistakes too
            if held_out:
                log.info(held_out)
            _say_if_the_cpu_is_shared(cfg)
            from nanogrpo.training.loop import train as run_training
            from nanogrpo.training.prepare import prepare

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


def _say_if_the_cpu_is_shared(cfg: Config) -> None:
    """One line, at the start of a run on the CPU, when torch's threads would fight other busy processes for
    the cores (:func:`nanogrpo.console.shared_cpu_line`); rank 0's, under a launcher."""
    if os.environ.get("RANK", "0") != "0" or cfg.model.device.startswith("cuda"):
        return
    import torch

    if cfg.model.device == "auto" and torch.cuda.is_available():
        return
    from nanogrpo.console import shared_cpu_line

    line = shared_cpu_line()
    if line:
        log.info(line)


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
        from nanogrpo.models.source import check_model_source

        model_path = check_model_source(cfg.model)  # a model that is not there: said before anything loads
        if isinstance(dataset, (str, os.PathLike)):  # the held-out problems of that source
            cfg = cfg.with_overrides({"data.source": str(dataset), "data.eval_source": str(dataset)})
            dataset = None
        if rewards is None and isinstance(model, Run) and model.rewards:
            rewards = list(model.rewards)
        if rewards is None and _callables_in(cfg):
            marks = _callables_in(cfg)
            kept = [(f, w) for f, w in zip(cfg.rewards.functions, cfg.rewards.resolved_weights())
                    if f not in marks] or [("correctness", 1.0)]
            log.info("reward_mean here is over %s only: the run's other rewards (%s) were Python "
                     "functions given to nanogrpo.train, which its directory cannot hold; to score with them "
                     "too, give them again (rewards=[...] in Python; on the command line, rewards.functions "
                     "naming them as 'file.py:function')", " and ".join(f for f, _ in kept), ", ".join(marks))
            cfg = cfg.with_overrides({"rewards.functions": [f for f, _ in kept],
                                      "rewards.weights": [w for _, w in kept]})
        cfg, runner = _rewards(cfg, rewards)
        if runner is None:  # built now: a reward that does not resolve fails before any weights are read
            from nanogrpo.rewards import reward_runner

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
