"""A run checked before any weights are read: :func:`prepare` validates everything cheap that can fail
on user input (rewards import, data fields, model path, tools, environments, vLLM servers, split mode's
server) and returns the :class:`PreparedRun` that :func:`~nanogrpo.training.loop.train` runs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanogrpo.config import Config
from nanogrpo.data import load_eval_rows, load_rows
from nanogrpo.episodes.play import Episodes
from nanogrpo.models.load import check_model_source
from nanogrpo.rewards import RewardRunner, reward_runner
from nanogrpo.tools.runner import ToolRunner
from nanogrpo.training.checkpoint import latest_checkpoint

log = logging.getLogger("nanogrpo.train")


@dataclass
class PreparedRun:
    """A run checked and ready to start (:func:`prepare`); :func:`~nanogrpo.training.loop.train` runs
    it."""

    cfg: Config
    root: Path
    rewards: RewardRunner | None
    """The run's rewards (None: split mode's trainer without held-out evaluation, which scores nothing)."""
    rows: list[dict]
    resume_from: Path | None
    eval_rows: list[dict] | None = None
    """Held-out problems for evaluation during training (``eval.every > 0``)."""
    tools: ToolRunner | None = None
    """The run's tool (``tools.enabled``); built from ``cfg.tools`` when not given (its sandbox
    starts on first use and stops at :meth:`ToolRunner.close` or when the object goes)."""
    env: Episodes | None = None
    """The run's environment episodes (``env.source``, or an object given to ``nanogrpo.train(env=...)``);
    None: plain completions (or ``[tools]``)."""
    model_path: str | None = None
    """Where ``cfg.model.path`` loads from (:func:`~nanogrpo.models.source.check_model_source`:
    a hub id, a local directory, the HF cache's copy offline); None: resolved at load."""
    feed: object = None
    """Where the batches come from when this process makes none: split mode's (``nanogrpo train --server
    URL``, :class:`nanogrpo.serve.feed.SplitMode`): its ``source(cfg, backend, model, root, fresh)`` is the
    run's source, its ``close()`` ends it; None: this process rolls out."""
    started: float = field(default_factory=time.perf_counter)
    """When the run's preparation began (``time.perf_counter()``): the run's end line counts from there."""

    def __post_init__(self) -> None:
        if self.tools is None:
            self.tools = ToolRunner.from_config(self.cfg.tools)

    def close(self) -> None:
        """End what the run holds besides its model: reward workers, the tool's sandbox, environments, the
        server's client."""
        for thing in (self.rewards, self.tools, self.env, self.feed):
            if thing is not None:
                thing.close()


_UNSET: Any = object()


def prepare(cfg: Config, resume_dir: Path | None = None, *, rewards: RewardRunner | None = None,
            rows: list[dict] | None = None, eval_rows: list[dict] | None = _UNSET,
            tools: ToolRunner | None = _UNSET, model_path: str | None = None, env=None,
            feed=None) -> PreparedRun:
    """Validate everything cheap first: rewards import, data fields, model path, run directory.

    The keywords stand in for what the config would build (the public :func:`nanogrpo.train`
    passes the caller's own): ``rewards`` a runner, ``rows`` / ``eval_rows`` samples already
    normalised (``eval_rows=None``: no held-out evaluation), ``tools`` a runner or None,
    ``model_path`` the model's resolved source, ``env`` an environment object (class, factory or
    instance; else ``cfg.env.source``'s). ``feed``: where the batches come from when this process makes
    none (:attr:`PreparedRun.feed`: split mode's; its workers sample and score, rank 0 alone evaluates)."""
    started = time.perf_counter()
    scores = True
    if feed is not None:
        rows, scores = [], bool(cfg.eval.every) and _rank() == 0
        if not scores:
            eval_rows = None
    # the reward model (rm:) goes on the trainer's device; a judge's cache lives in the run directory
    if rewards is None and scores:
        rewards = reward_runner(cfg, run_dir=Path(resume_dir or cfg.train.out))
    try:
        if tools is _UNSET:
            tools = ToolRunner.from_config(cfg.tools)  # a tool that does not import fails here
        # an environment that does not import fails here (split mode's evaluation: none, as its workers')
        episodes = Episodes.from_config(cfg, env) if feed is None else None
        if rows is None:
            rows = load_rows(cfg.data, cfg.data.split)
        if eval_rows is _UNSET:
            eval_rows = load_eval_rows(cfg.data)[:cfg.eval.n] if cfg.eval.every else None
        if model_path is None:
            model_path = check_model_source(cfg.model)
        if cfg.distill.teacher and not cfg.distill.teacher.startswith(("http://", "https://")):
            from nanogrpo.models.source import resolve_model_path

            resolve_model_path(cfg.distill.teacher)  # a teacher that is not there: one line, no weights read
        from nanogrpo.models.vision import check_run_images

        check_run_images(cfg, [rows, eval_rows or []], model_path, tools is not None or episodes is not None)
        if cfg.rollout.engine in ("vllm", "vllm_server") and scores:
            from nanogrpo.engines.vllm_inprocess import import_vllm

            import_vllm()  # installed? (a one-line error before any weights are read)
        if cfg.rollout.engine == "vllm_server" and feed is None:
            from nanogrpo.engines.vllm_server.contact import preflight

            preflight(cfg)  # a server answers? (a dead port said before the model loads)
    except Exception:
        for thing in (rewards, feed):
            if thing is not None:
                thing.close()
        raise
    root = Path(resume_dir or cfg.train.out)
    resume_from = latest_checkpoint(root / "checkpoints") if resume_dir else None
    if resume_dir is not None and resume_from is None:
        # killed before its first checkpoint was complete: nothing to continue, so start over
        log.info("--resume %s: no complete checkpoint yet; starting the run from the beginning", resume_dir)
    return PreparedRun(cfg, root, rewards, rows, resume_from, eval_rows or None, tools, episodes, model_path,
                       feed, started)


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))
