"""Where a run's numbers go: ``metrics.jsonl`` always, TensorBoard by default, W&B on request.

:class:`RunLogger` fans one metrics row per step out to every sink:

- ``RUN/metrics.jsonl``: one JSON object per step (the source of truth; ``nanogrpo report`` reads it);
- ``RUN/tb/``: TensorBoard event files (``log.tensorboard``); scalar tags are ``train/<key>``, keys
  that already hold a ``/`` (``eval/accuracy``, ``reward/<fn>``) keep their name;
- Weights & Biases (``log.wandb=true``; ``wandb`` is imported only then, and a clear error says
  how to install it when it is missing);
- ``RUN/samples.jsonl``: sample completions with their reward breakdown every ``log.samples_every``
  steps (also as TensorBoard text).

On resume every sink drops what was logged after the checkpoint being resumed
(``metrics.jsonl``/``samples.jsonl`` are truncated, TensorBoard events purged), so a
resumed run's logs read like an uninterrupted one's.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from nanogrpo.config import Config
from nanogrpo.errors import ConfigError
from nanogrpo.training.metrics import MetricsWriter, read_metrics, truncate_jsonl
from nanogrpo.watch import WATCH_FILE, read_events
from nanogrpo.watch import summary as watch_summary

TIMING_KEYS = ("rollout_time_s", "train_time_s", "step_time_s", "tokens_per_s", "gpu_mem_gib", "eval/time_s")
"""Fields that differ between identical runs (wall-clock and memory)."""


def _tag(key: str) -> str:
    return key if "/" in key else f"train/{key}"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


class RunLogger:
    """All of a run's logging; ``resume_step`` is the step of the checkpoint resumed (None: fresh run);
    ``fields``: facts of the run every metrics row carries (``cpu_linear/trainer``: "onednn" or
    "torch", what its float32 CPU linears run on), also in the W&B run's config."""

    def __init__(self, root: Path, cfg: Config, resume_step: int | None = None,
                 fields: dict[str, Any] | None = None):
        self.root = Path(root)
        self.cfg = cfg
        self.fields = dict(fields or {})
        self.metrics = MetricsWriter(self.root / "metrics.jsonl", resume_step=resume_step)
        self.samples_path = self.root / "samples.jsonl"
        truncate_jsonl(self.samples_path, resume_step)
        self.tb = None
        self.wandb = None
        self.t0 = time.perf_counter()
        if cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events from the killed run after the checkpoint are discarded
            self.tb = SummaryWriter(str(self.root / "tb"),
                                    purge_step=resume_step + 1 if resume_step is not None else None)
        if cfg.log.wandb:
            self.wandb = _start_wandb(self.root, cfg, resumed=resume_step is not None, extra=self.fields)

    def log_step(self, row: dict[str, Any], examples: list[dict[str, Any]] | None = None) -> None:
        step = int(row["step"])
        row = {**row, **self.fields}
        self.metrics.write(row)
        scalars = {k: x for k, v in row.items() if k != "step" and (x := _number(v)) is not None}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(_tag(k), v, step)
        if self.wandb is not None:
            self.wandb.log({_tag(k): v for k, v in scalars.items()}, step=step)
        every = self.cfg.log.samples_every
        if examples and every and step % every == 0:
            self.log_samples(step, examples)
        if self.tb is not None:
            self.tb.flush()

    def log_samples(self, step: int, examples: list[dict[str, Any]]) -> None:
        """The step's rollout table: ``samples.jsonl`` rows, a TensorBoard text table (tag ``samples``) and
        a W&B table (key ``samples``), one row per completion in :func:`table_columns`' order."""
        with open(self.samples_path, "a") as f:
            for ex in examples:
                f.write(json.dumps({"step": step, **ex}) + "\n")
        cols = table_columns(examples)
        if self.tb is not None:
            self.tb.add_text("samples", _markdown_table(cols, examples), step)
        if self.wandb is not None:
            import wandb

            table = wandb.Table(columns=cols, data=[[_cell(ex.get(c)) for c in cols] for ex in examples])
            self.wandb.log({"samples": table}, step=step)

    def close(self) -> None:
        self.metrics.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


FIRST_COLUMNS = ("group", "question", "completion")
LAST_COLUMNS = ("reward", "advantage", "finish_reason")


def table_columns(examples: list[dict[str, Any]]) -> list[str]:
    """A rollout table's columns: group, question, completion, each reward component (by name), the total
    reward, the advantage, the finish reason (what the examples have of these; images left out)."""
    keys = {k for ex in examples for k in ex if k != "images"}
    middle = sorted(keys - set(FIRST_COLUMNS) - set(LAST_COLUMNS))
    return [k for k in FIRST_COLUMNS if k in keys] + middle + [k for k in LAST_COLUMNS if k in keys]


def _cell(v: Any) -> Any:
    return v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v)


def _markdown_table(cols: list[str], examples: list[dict[str, Any]]) -> str:
    def show(v: Any) -> str:
        text = f"{v:.3g}" if isinstance(v, float) else str(_cell(v) if v is not None else "")
        return text.replace("|", "\\|").replace("\n", "<br>")

    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)
    return head + "".join("\n| " + " | ".join(show(ex.get(c)) for c in cols) + " |" for ex in examples)


def _start_wandb(root: Path, cfg: Config, resumed: bool, extra: dict[str, Any] | None = None):
    try:
        import wandb
    except ImportError:
        raise ConfigError("log.wandb=true but wandb is not installed: pip install wandb "
                          "(or set log.wandb=false; TensorBoard logs are in RUN/tb)") from None
    id_file = root / "wandb_id"
    # a fresh run takes the id W&B gives it (wandb.util.generate_id is gone from wandb 0.2x on); a resumed
    # one continues its W&B run
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
    run = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_run_name or root.name, id=run_id,
                     dir=str(root), config={**cfg.to_dict(), **(extra or {})}, resume="allow")
    id_file.write_text(run.id + "\n")
    return run


def _fmt(v: Any, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def _pct(v: Any) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def _held_out(first: dict[str, Any], last: dict[str, Any]) -> str:
    """``held-out accuracy 7.0% (step 0) -> 53.5% (step 80), +46.5 points``: the gain a run exists to
    show, from its first held-out evaluation (step 0, the starting policy) to its last."""
    a, b = first["eval/accuracy"], last["eval/accuracy"]
    if first is last:
        return f"held-out accuracy {_pct(b)} (step {last['step']})"
    gain = 100 * (b - a) if all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)) else None
    return (f"held-out accuracy {_pct(a)} (step {first['step']}) -> {_pct(b)} (step {last['step']})"
            + (f", {gain:+.1f} points" if gain is not None else ""))


def _minutes(rows: list[dict[str, Any]], key: str) -> float:
    return sum(v for r in rows if isinstance(v := r.get(key), (int, float)) and math.isfinite(v)) / 60


def _time_part(rows: list[dict[str, Any]], clock: dict[str, float] | None, start_step: int) -> str:
    """``80 steps in 56.6 min (47.1 in steps, 6.0 in held-out evaluation, 0.4 in checkpoints, 3.1 loading
    and the rest)`` (in seconds under ten minutes): with ``clock`` (the loop's own measures of this session,
    one wall clock on its thread: ``total``, ``steps``, ``eval``, ``save``, ``rest``, seconds) the whole time
    and parts that add up to it;
    from the metrics alone (a run opened later), the steps' and evaluations' minutes, the rest said left out
    (a step's time there may overlap another's: the async pipeline's rollouts run beside the updates)."""
    last = rows[-1]["step"]
    if clock is None:
        mine = [r for r in rows if r["step"] > start_step] if start_step else rows
        steps, evals = _minutes(mine, "step_time_s"), _minutes(mine, "eval/time_s")
        plus = f" + {evals:.1f} min in held-out evaluation" if evals else ""
        return f"{last} steps: {steps:.1f} min in steps{plus} (loading and checkpoints not counted)"
    what = f"steps {start_step + 1}-{last} (resumed)" if start_step else f"{last} steps"
    short = clock["total"] < 600  # seconds under ten minutes, else minutes
    f = (lambda v: f"{v:.1f}") if short else (lambda v: f"{v / 60:.1f}")
    unit = "s" if short else "min"
    held = f", {f(clock['eval'])} in held-out evaluation" if clock.get("eval") else ""
    return (f"{what} in {f(clock['total'])} {unit} ({f(clock['steps'])} in steps{held}, "
            f"{f(clock['save'])} in checkpoints, {f(clock['rest'])} loading and the rest)")


def run_summary(root: Path, start_step: int = 0, clock: dict[str, float] | None = None) -> str:
    """One line: steps and time, reward and accuracy first -> last, held-out accuracy at the first
    evaluation (step 0) and the last with the gain in points, throughput, the run monitor's alarms.
    ``clock``: where this session's time went (:meth:`nanogrpo.training.run.Clock.parts`; the trainer's end
    line), ``start_step``: the step it resumed at; without them the time is the steps' and the evaluations',
    from the metrics."""
    path = Path(root) / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    if not rows:
        return f"nanogrpo: {root}: no steps logged"
    first = next((r for r in rows if "reward_mean" in r), rows[0])  # step 0 holds the baseline eval only
    last = rows[-1]
    secs = sum(r.get("step_time_s") or 0.0 for r in rows)
    toks = sum(r.get("completion_tokens") or 0 for r in rows)
    parts = [f"nanogrpo: {_time_part(rows, clock, start_step)}",
             f"reward {_fmt(first.get('reward_mean'))} -> {_fmt(last.get('reward_mean'))}",
             f"train acc {_fmt(first.get('accuracy'))} -> {_fmt(last.get('accuracy'))}"]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    if evals:
        parts.append(_held_out(evals[0], evals[-1]))
    parts.append(f"{_fmt(toks / secs if secs else float('nan'), '.0f')} tok/s")
    if (Path(root) / WATCH_FILE).is_file():  # the run monitor's alarms (none: "watch: no alarm")
        parts.append(watch_summary(read_events(root)))
    parts.append(str(root))
    return " | ".join(parts)
