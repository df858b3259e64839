"""What the loop shows of a run: held-out evaluation every ``eval.every`` steps (:class:`HeldOut`, rank 0),
and each step's row on its way out (:class:`RunLog`: the run monitor, ``metrics.jsonl`` and the other sinks,
the progress bar)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nanogrpo.config import Config


class HeldOut:
    """Greedy accuracy (or ``eval.k`` samples) on the held-out ``rows`` with the run's ``rewards``, by
    ``engine``; each evaluation written to ``RUN/eval/step_N.json``. ``model``: the policy (put in eval
    mode); ``policy``: a full-weight copy this rank may run alone, whose entropy over the evaluation's
    completions is reported (None: none); ``tools``, ``env``: the run's (multi-turn evaluation)."""

    def __init__(self, cfg: Config, root: Path, rows: list[dict], rewards, engine, tok, model, *, policy=None,
                 tools=None, env=None):
        self.cfg, self.root, self.rows, self.rewards = cfg, Path(root), rows, rewards
        self.engine, self.tok, self.model, self.policy = engine, tok, model, policy
        self.tools, self.env = tools, env

    def due(self, step: int) -> bool:
        return step % self.cfg.eval.every == 0 or step == self.cfg.train.steps

    def __call__(self, step: int) -> dict[str, Any]:
        """Evaluate now as step ``step``: the ``eval/<field>`` metrics."""
        from nanogrpo.evaluation import evaluate_rows, write_results

        cfg = self.cfg
        self.model.eval()
        with torch.no_grad():
            summary, records = evaluate_rows(self.engine, self.tok, self.rows, cfg, self.rewards,
                                             cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                                             cfg.eval.batch_size, k=cfg.eval.k,
                                             temperature=cfg.eval.temperature, seed=cfg.eval.seed,
                                             tools=self.tools, policy=self.policy, env=self.env)
        summary["split"] = cfg.data.eval_split
        write_results(summary, records, self.root / "eval" / f"step_{step}.json")
        return {f"eval/{k}": v for k, v in summary.items() if not isinstance(v, str)}


class RunLog:
    """Rank 0's sinks for each step's row: the run monitor (:class:`~nanogrpo.watch.Monitor`, None: no rule),
    the logger (``metrics.jsonl``, samples, TensorBoard / W&B: :class:`~nanogrpo.training.logging_sinks.
    RunLogger`) and the progress bar (``label``). Other ranks hold one with neither (the bar off)."""

    def __init__(self, logger, monitor, main: bool, label: str = "nanogrpo"):
        self.logger, self.monitor, self.main, self.label = logger, monitor, main, label
        self.bar: tqdm | None = None

    def steps(self, start_step: int, steps: int):
        self.bar = tqdm(range(start_step + 1, steps + 1), initial=start_step, total=steps, desc=self.label,
                        dynamic_ncols=True, disable=not self.main)
        return self.bar

    def record(self, row: dict[str, Any], examples: list[dict] | None = None) -> None:
        """``row`` checked by the monitor (its ``watch/…`` figures added), written, shown on the bar."""
        if self.monitor is not None:
            row.update(self.monitor.observe(row, examples))
        if self.logger is not None:
            self.logger.log_step(row, examples)
        if self.bar is not None:  # (none yet for the held-out baseline, before the first step)
            self.bar.set_postfix_str(postfix(row))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.logger is not None:
            self.logger.close()


def postfix(row: dict[str, Any]) -> str:
    """The progress bar's figures: reward, accuracy, loss (and split mode's staleness and drops)."""
    def num(k: str) -> float:
        v = row.get(k)
        return float(v) if isinstance(v, (int, float)) else math.nan

    loss = f"{num('loss'):.4f}" if math.isfinite(num("loss")) else "- (no group with signal)"
    out = f"reward {num('reward_mean'):.3f} acc {num('accuracy'):.3f} loss {loss}"
    if "dropped_stale" in row:
        out += f" stale {row.get('staleness')} dropped {row['dropped_stale']}"
    return out
