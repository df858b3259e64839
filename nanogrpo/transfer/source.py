"""The trainer's weights as vLLM's :class:`~vllm.distributed.weight_transfer.base.WeightSource`: what every
trainer-side engine (nccl, ipc, gloo) iterates and sends.

``StateSource(state)`` takes a callable returning the model's state dict under its HF names (the caller
merges LoRA adapters, adds ``lm_head.weight`` of a tied model: vLLM's CPU build keeps its own copy) and
materialises one tensor at a time: an FSDP2 ``DTensor`` is gathered (``full_tensor()``, a collective
every trainer rank runs in the same order) only when its bucket is packed, and cast to ``dtype`` (the
servers' weights' dtype; FSDP2 keeps float32 masters) there, so no rank ever holds the whole model
gathered at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor


class StateSource(WeightSource):
    """A re-iterable :class:`WeightSource` over ``state()`` (a fresh state dict view per pass)."""

    def __init__(self, state: Callable[[], dict[str, torch.Tensor]], dtype: torch.dtype | None = None):
        self._state = state
        self.dtype = dtype
        self.passes = 0
        """Passes started (each ``iter()``)."""
        self._live: Iterator | None = None
        self._pinned: dict[str, torch.Tensor] | None = None

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """Every pass inside takes one state dict, taken on entry (several servers sent to at once,
        one pass each: a LoRA merge made once, not once per pass)."""
        self._pinned = self._state()
        try:
            yield
        finally:
            self._pinned = None

    def _current(self) -> dict[str, torch.Tensor]:
        return self._pinned if self._pinned is not None else self._state()

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(k, self._dtype(v), tuple(v.shape)) for k, v in self._current().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.passes += 1
        self._live = live = self._pass()  # returned from the local: another thread may start a pass meanwhile
        return live

    def finish_pass(self, started: bool) -> None:
        """After a send failed on this rank: run the rest of the pass it started (``started``), else a whole
        pass, so that the other ranks' collectives (FSDP2 gathers) of this pass all take place."""
        it = self._live if started else iter(self)
        for _ in it or ():
            pass

    def _pass(self) -> Iterator[tuple[str, torch.Tensor]]:
        # no ``torch.no_grad()`` here: a generator left suspended inside it (a sender stops at the last
        # tensor it needs) would leave gradients off in the caller's thread; detached tensors need none
        for k, v in self._current().items():
            full = materialize_full_tensor(v.detach())
            yield k, full.detach().to(dtype=self._dtype(v))

    def total_bytes(self) -> int:
        return sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in self.metadata())
