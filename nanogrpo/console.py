"""What a run shows on the screen: nanogrpo's own lines, and third-party chatter kept off it.

:func:`screen` is a context manager the CLI and the public functions (:mod:`nanogrpo.api`) run in:

- nanogrpo's log records go to stderr through ``tqdm.write`` (so a line never tears the
  progress bar): INFO as the plain message (``rollout engine: fast (…)``, one line per
  checkpoint), WARNING and above marked (``WARNING nanogrpo.rewards: …``): those need a person's
  attention. ``verbose`` adds nanogrpo's DEBUG lines;
- third-party progress bars (transformers' "Loading weights" / "Writing model shards",
  huggingface_hub's downloads, datasets') are off, and huggingface_hub's retry warnings too;
  ``verbose`` leaves them all as the libraries have them.

:func:`shared_cpu_line` is the line a run on the CPU starts with when torch's threads would fight other
busy processes for the cores (``OMP_NUM_THREADS=1`` the remedy).

Everything is put back on exit, so calling :func:`nanogrpo.train` changes nothing in the
caller's process for good. Where the caller set up logging (a handler on the root or the
``nanogrpo`` logger) nanogrpo's lines go to the caller's handlers, at INFO, and no handler is
added; a screen inside a screen (the CLI calling the public functions) changes nothing more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator

__all__ = ["LineHandler", "screen", "shared_cpu_line"]

_PLAIN = logging.Formatter("%(message)s")
_MARKED = logging.Formatter("%(levelname)s %(name)s: %(message)s")


class LineHandler(logging.Handler):
    """One record, one line on stderr (its traceback below it), written around tqdm's bars."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = (_PLAIN if record.levelno == logging.INFO else _MARKED).format(record)
            from tqdm import tqdm

            tqdm.write(text, file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def _quiet_third_party() -> list[Callable[[], None]]:
    """Turn off third-party progress bars and huggingface_hub's retry warnings; the undo steps."""
    import huggingface_hub  # noqa: F401 - first: importing it sets its logger's level (to WARNING)

    undo: list[Callable[[], None]] = []
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    undo.append(lambda: hub_log.setLevel(level))
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") is None:  # the user's setting wins
        from huggingface_hub.utils import (
            are_progress_bars_disabled,
            disable_progress_bars,
            enable_progress_bars,
        )

        hub_was_off = are_progress_bars_disabled()
        disable_progress_bars()  # transformers imported later reads this for its own bars
        tf_loaded = "transformers" in sys.modules
        tf_was_on = _transformers_bars(None) if tf_loaded else None

        def restore_bars() -> None:
            if not hub_was_off:
                enable_progress_bars()
            if "transformers" in sys.modules:  # as it was, or as it would be had we not been here
                _transformers_bars(tf_was_on if tf_loaded else not hub_was_off)
        undo.append(restore_bars)
        if tf_loaded:
            _transformers_bars(False)
    if "datasets" in sys.modules and os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS") is None:
        import datasets

        was_off = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        undo.append(lambda: None if was_off else datasets.enable_progress_bars())
    return undo


def _transformers_bars(on: bool | None) -> bool:
    """Set transformers' progress bars on or off (None: leave them); returns whether they were on."""
    from transformers.utils import logging as tf_logging

    was = tf_logging.is_progress_bar_enabled()
    if on is True:
        tf_logging.enable_progress_bar()
    elif on is False:
        tf_logging.disable_progress_bar()
    return was


@contextlib.contextmanager
def screen(verbose: bool = False, *, own: bool = False) -> Iterator[None]:
    """Run the body with nanogrpo's screen (module docstring). ``own``: the caller owns the process
    (the CLI): nanogrpo's lines get their handler even where the root logger has one."""
    logger = logging.getLogger("nanogrpo")
    if any(isinstance(h, LineHandler) for h in logger.handlers):
        yield  # inside a screen already
        return
    undo: list[Callable[[], None]] = []
    level, propagate = logger.level, logger.propagate
    undo.append(lambda: (logger.setLevel(level), setattr(logger, "propagate", propagate)))
    want = logging.DEBUG if verbose else logging.INFO
    if own or not (logger.handlers or logging.getLogger().handlers):
        handler = LineHandler()
        logger.addHandler(handler)
        logger.propagate = False  # not twice on the screen through a root handler
        undo.append(lambda: logger.removeHandler(handler))
        logger.setLevel(want)
    elif logger.level == logging.NOTSET:  # the caller's level, where set, stays
        logger.setLevel(want)
    try:
        if not verbose:
            undo.extend(_quiet_third_party())
        yield
    finally:
        for step in reversed(undo):
            step()


def oversubscribed(threads: int, load: float, cores: int) -> bool:
    """Whether ``threads`` torch threads, started beside ``load`` busy processes (the 1-minute load
    average, taken as the run starts: the others'), want more cores than there are. Each operation's
    threads wait for the slowest of them at its end; one that shares its core with another process makes
    the others spin there, so the same work costs several times the CPU (4.2x measured on a 2-core CPU at
    load 4-6, issue 50). One thread has nothing to wait for. Only whole busy cores count: the load a
    finished job leaves behind (0.7 a minute after ``pip install``) decays, and warning on it would cry
    wolf at every newcomer's first run."""
    return threads > 1 and threads + int(load) > cores


def shared_cpu_line(threads: int | None = None, load: float | None = None,
                    cores: int | None = None) -> str | None:
    """The line to print when :func:`oversubscribed` (None when not): this process's torch threads, the
    machine's load and cores read when not given."""
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average on this platform
            return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not oversubscribed(threads, load, cores):
        return None
    return (f"this CPU is busy (load {load:.1f} on {cores} cores) and torch runs {threads} threads per "
            "operation, which wait on each other when other processes hold the cores: the run may take twice "
            "the CPU it needs or more; start it with OMP_NUM_THREADS=1 (in Python: "
            "torch.set_num_threads(1))")
