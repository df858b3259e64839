"""Reward calls in this process, each bounded by a deadline.

For rewards that cannot go to the worker processes (a callable that does not pickle). The calls run
one after another on a helper thread while the caller waits, as the pool's parent does, at most a
call's timeout since the previous answer. A call past it is scored as a timeout and its thread is
abandoned: Python cannot kill a thread, so it runs on in the background until the function returns
(its result is dropped), and the remaining calls go to a fresh thread. The run goes on either way;
an abandoned thread that never returns keeps its CPU, which the one-line warning says.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from nanogrpo.rewards.calls import TIMEOUT, Outcome

__all__ = ["InlineCall", "run_inline"]

log = logging.getLogger("nanogrpo.rewards")

InlineCall = tuple[int, Callable[[], Any], float]
"""``(call id, a function of no arguments that returns the call's outcome(s), timeout in seconds)``."""


def run_inline(calls: Sequence[InlineCall]) -> tuple[dict[int, Any], int]:
    """Run ``calls`` in order on helper threads; ``({call id: result or a TIMEOUT outcome}, threads
    abandoned)``."""
    results: dict[int, Outcome | Any] = {}
    todo = list(calls)
    abandoned = 0
    while todo:
        answers: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()

        def work(batch: list[InlineCall] = todo, stop: threading.Event = stop,
                 answers: queue.SimpleQueue = answers) -> None:
            for call_id, thunk, _ in batch:
                if stop.is_set():
                    return
                out = thunk()
                if stop.is_set():
                    return  # abandoned while this call ran: its result no longer counts
                answers.put((call_id, out))

        threading.Thread(target=work, daemon=True, name="nanogrpo-reward-inline").start()
        done = 0
        while done < len(todo):
            call_id, _, timeout_s = todo[done]
            try:
                got, out = answers.get(timeout=timeout_s)
            except queue.Empty:
                stop.set()
                abandoned += 1
                results[call_id] = (TIMEOUT, f"no answer within {timeout_s:g} s; its thread was abandoned")
                log.warning("a reward call in this process ran past %g s: scored as a timeout; its thread "
                            "keeps running in the background until the function returns", timeout_s)
                todo = todo[done + 1:]
                break
            assert got == call_id, "inline reward answered out of order"
            results[got] = out
            done += 1
        else:
            todo = []
    return results, abandoned
