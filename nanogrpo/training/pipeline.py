"""The asynchronous pipeline (``rollout.max_staleness`` > 0 on the server tier): a producer thread that makes
the batches of the next steps on the vLLM servers while the trainer updates.

Batch ``s`` may start once step ``s - 1 - k`` is trained and synced, so when step ``s`` trains it was
sampled at most ``k`` syncs ago (a sample paused by a sync continues under the new weights: its tokens span
two versions, as vLLM's ``weight_versions`` spans record). The server engine refuses samples from outside
that window (:attr:`ServerEngine.min_version`). The update then anchors the PPO ratio on the trainer's own
log-probs and ``rollout.correction`` weighs them against the servers' behaviour log-probs
(``algo/corrections.py``). Each batch records the versions it was sampled under (``batch.policy_version``:
the oldest; ``meta["versions"]``); the loop logs ``pipeline/trainer_wait_s`` (the trainer waiting for its
batch) and ``pipeline/producer_wait_s`` (the producer held by the staleness bound: the servers waiting for
weights). The source that runs it is :class:`~nanogrpo.training.sources.AsyncRollout`.

The producer owns the prompt sampler; each batch carries the sampler's state after it was drawn, and a
checkpoint saves *that* state: a resumed run regenerates exactly the batches not yet trained (none lost,
none trained twice).

Several trainer ranks (torchrun DDP / FSDP2): each rank runs its own producer for its share of every
step's prompts (rows ``rank::world`` of the same global stream, as the on-policy loop). The producers'
batch-level sums (advantages over the whole batch, dynamic sampling's refills) go through a gloo group of
their own (:func:`producer_reduce`), so that they never interleave with the update's collectives on the
trainer threads; the trainers agree on whether a step is fresh and merge the staleness figures.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanogrpo.errors import ConfigError

log = logging.getLogger("nanogrpo.train")


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**31 - 1)


def producer_reduce() -> Callable[[list[float]], list[float]]:
    """Several ranks, called on every rank in the same order (a new process group): the producers' sums
    over the ranks, on a gloo group of their own, beside the trainer threads' collectives."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")

    def reduce(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=group)
        return t.tolist()

    return reduce


@dataclass
class Made:
    """One step's batch as the producer made it."""

    step: int
    batch: Any
    roll: dict
    sampler_state: dict
    versions: list[tuple[int, int]] = field(default_factory=list)
    error: BaseException | None = None


class Pipeline:
    """A producer thread that runs ``make(step)`` for steps ``first..last`` in order, at most ``k`` steps
    ahead of the trainer: step ``s`` starts once :meth:`trained` has been called for ``s - 1 - k``."""

    def __init__(self, make: Callable[[int], Made], first: int, last: int, k: int):
        if k < 1:
            raise ConfigError("Pipeline needs max_staleness >= 1 (0 is the loop without a producer)")
        self.make, self.first, self.last, self.k = make, first, last, k
        self._done = first - 1
        self._cv = threading.Condition()
        self._out: queue.Queue[Made] = queue.Queue()
        self._stop = False
        self.producer_wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="nanogrpo-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for step in range(self.first, self.last + 1):
            t0 = time.perf_counter()
            with self._cv:
                while not self._stop and self._done < step - 1 - self.k:
                    self._cv.wait(timeout=1.0)
                if self._stop:
                    return
                self.producer_wait_s += time.perf_counter() - t0
            try:
                made = self.make(step)
            except BaseException as e:  # noqa: BLE001 (handed to the trainer, which raises it)
                self._out.put(Made(step, None, {}, {}, error=e))
                return
            self._out.put(made)

    def get(self, step: int) -> tuple[Made, float]:
        """Step ``step``'s batch (made in order) and how long the trainer waited for it."""
        t0 = time.perf_counter()
        made = self._out.get()
        if made.error is not None:
            raise made.error
        if made.step != step:
            raise RuntimeError(f"the producer made step {made.step}'s batch where step {step} was due")
        return made, time.perf_counter() - t0

    def trained(self, step: int) -> None:
        """Step ``step`` is trained and its weights synced: the producer may run ``k`` steps past it."""
        with self._cv:
            self._done = step
            self._cv.notify_all()

    def take_producer_wait(self) -> float:
        with self._cv:
            w, self.producer_wait_s = self.producer_wait_s, 0.0
        return w

    def close(self, wait_s: float = 30.0) -> None:
        """Stop the producer; wait for it up to ``wait_s`` seconds (close the servers' pool first: a
        producer inside a rollout then ends at once). It is a daemon: one still running does not hold
        the process."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=wait_s)
