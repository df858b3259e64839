"""Endless, resumable batches of prompts.

Each epoch visits every row once, in an order drawn from ``random.Random``
seeded with ``(seed, epoch)`` alone, so any epoch's order can be recomputed
without replaying the ones before it. A batch that reaches the end of an epoch
continues into the next one (batches are always full). The position
(``epoch``, ``index``) is all the state: saving it with a checkpoint and
loading it back yields exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from nanogrpo.errors import DataError


class PromptSampler:
    """Yields ``batch_size`` rows at a time, epoch after epoch, reshuffled each epoch."""

    def __init__(self, rows: list[dict[str, Any]], batch_size: int, seed: int = 0, shuffle: bool = True):
        if not rows:
            raise DataError("cannot sample prompts from an empty dataset")
        if batch_size <= 0:
            raise DataError(f"prompt batch size must be positive, got {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"nanogrpo-sampler:{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self, n: int | None = None) -> list[dict[str, Any]]:
        """The next ``n`` rows (default ``batch_size``)."""
        n = self.batch_size if n is None else n
        batch = []
        while len(batch) < n:
            if self.index >= len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
            batch.append(self.rows[self._epoch_order()[self.index]])
            self.index += 1
        return batch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: ``epoch``, ``index``, ``seed``, ``shuffle``, ``num_rows``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (on the same rows)."""
        n = state.get("num_rows", len(self.rows))
        if n != len(self.rows):
            raise DataError(f"sampler state was saved on {n} rows but the dataset now has {len(self.rows)}; "
                            f"resume with the same data")
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self._order_epoch = None
