"""What a verifiers 0.4 episode is to nanogrpo: a dataset row made into a ``vf.Task``, and a finished
``vf.Episode`` made into the episode's result (reward, success, metrics, and the trainable traces'
token sequences; :mod:`.program`'s docstring says which)."""

from __future__ import annotations

import math
from typing import Any

from nanogrpo.envs.program import AgentResult, TokenSequence

METRIC_PREFIX = "v1/"


class EpisodeFailed(RuntimeError):
    """verifiers reported the episode failed."""


def task_of(env, row: dict[str, Any]):
    """The ``vf.Task`` of a dataset row: ``row["task"]`` (a dict: the task's data, as the taskset's own
    rows carry it), else the row's fields that the taskset's ``TaskData`` has, ``prompt`` from the row's
    ``prompt`` (chat messages) or ``question``."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    if isinstance(row.get("task"), dict):
        data = dict(row["task"])
    else:
        data = {k: v for k, v in row.items() if k in data_cls.model_fields and k not in ("idx", "task")}
        if data.get("prompt") is None and row.get("question") is not None:
            data["prompt"] = str(row["question"])
        if isinstance(row.get("id"), str) and "id" in data_cls.model_fields:
            data["id"] = row["id"]
    return task_cls(data_cls.model_validate(data), env.config.taskset.task)


def result_of(episode, penalty_note: str = "") -> AgentResult:
    """The :class:`AgentResult` of a finished ``vf.Episode`` (module docstring); raises
    :class:`EpisodeFailed` when verifiers reports it failed."""
    sessions = [t.id for t in episode.traces]
    if not episode.ok:
        errs = [e for e in episode.errors] + [e for t in episode.traces for e in t.errors]
        why = f"{errs[-1].type}: {(errs[-1].message.splitlines() or [''])[0][:200]}" if errs else "no trace"
        raise EpisodeFailed(f"verifiers episode failed ({why}){penalty_note}")
    trained = [t for t in episode.traces if t.agent.trainable]
    if not trained:
        raise EpisodeFailed("the episode has no trainable trace (no agent of the policy ran)")
    rewards = [t.reward for t in trained]
    unscored = any(v is None for t in trained for v in t.rewards.values())
    if unscored or not all(math.isfinite(r) for r in rewards):
        raise EpisodeFailed(f"the episode's rewards are not all scored: {[dict(t.rewards) for t in trained]}")
    reward = sum(rewards) / len(rewards)
    flags = [t.metrics.get("success") for t in trained if t.metrics.get("success") is not None]
    success = all(bool(x) for x in flags) if flags else None
    sequences = [TokenSequence(list(b.token_ids), list(b.sampled_mask), list(b.logprobs))
                 for t in trained for b in t.branches if b.trainable and any(b.sampled_mask)]
    info: dict[str, Any] = {}
    for t in trained:
        for k, v in t.metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                info[METRIC_PREFIX + k] = float(v)
        for k, r in t.rewards.items():
            info[f"{METRIC_PREFIX}reward/{k}"] = float(r.score)
    info["v1/traces"] = len(episode.traces)
    info["v1/branches"] = len(sequences)
    stops = [t.stop_condition for t in trained if t.stop_condition]
    if stops:
        info["stop"] = stops[-1]
    return AgentResult(reward, success, info, sequences, sessions)


__all__ = ["EpisodeFailed", "result_of", "task_of"]
