"""Reward worker processes that bound every call by a deadline.

Each worker is a ``spawn`` process (the trainer has torch and its threads loaded,
so forking it is unsafe) that re-resolves the reward specs by name and then
scores chunks of calls, answering one message per call. The parent tracks a
deadline per call: a worker silent for ``timeout_s`` since its last answer is
killed, the call it was on is scored as a timeout, the rest of its chunk goes
back to the queue, and a replacement starts in the background. A worker that
dies mid-call costs that call only.

Workers are daemons (they die with the parent) and exit when their pipe closes.
As with any ``spawn`` process, a script that creates a pool must guard its entry
point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from nanogrpo.errors import RewardError
from nanogrpo.rewards.calls import ERROR, TIMEOUT, Outcome, call_reward

__all__ = ["Call", "WorkerPool"]

Call = tuple[int, int, str, dict]
"""``(call id, function index, completion, sample)``."""


def _worker_main(conn: Connection, specs: list[str], truncated_correct: bool = True) -> None:
    """Worker process body: resolve the rewards, say ready, then score chunks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from nanogrpo.rewards.registry import resolve_all

    try:
        fns = [fn for _, fn in resolve_all(specs, truncated_correct)]
    except RewardError as e:
        conn.send(("init_error", str(e)))
        return
    if "correctness" in specs:
        # Import sympy/math_verify before saying ready, so the first call's deadline is not spent on it.
        from nanogrpo.rewards.builtin import warm_up

        warm_up()
    conn.send(("ready", None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for call_id, k, completion, sample in chunk:
            conn.send((call_id, *call_reward(fns[k], completion, sample)))


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    started: float
    ready: bool = False
    calls: deque[Call] = field(default_factory=deque)
    deadline: float = math.inf


class WorkerPool:
    """``n`` reward worker processes; :meth:`run` scores calls with a per-call deadline."""

    def __init__(self, specs: Sequence[str], n: int, timeout_s: float, startup_timeout_s: float = 120.0,
                 truncated_correct: bool = True):
        if n < 1:
            raise ValueError(f"a worker pool needs at least 1 worker, got {n}")
        self.specs = list(specs)
        self.truncated_correct = truncated_correct
        self.n = n
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._serial = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start missing workers without waiting for them (they import in the background)."""
        while len(self._workers) < self.n:
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main, args=(child_conn, self.specs, self.truncated_correct), daemon=True,
                name=f"nanogrpo-reward-{self._serial}",
            )
            self._serial += 1
            proc.start()
            child_conn.close()  # so the parent sees EOF when the child exits
            self._workers.append(_Worker(proc, parent_conn, time.monotonic()))

    def _kill(self, w: _Worker) -> None:
        self._workers.remove(w)
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5)
        w.conn.close()

    def close(self) -> None:
        """Stop every worker: ask politely, then kill what is left."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass  # already gone
        deadline = time.monotonic() + 1.0
        for w in list(self._workers):
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(w)

    # ------------------------------------------------------------------ scoring

    def run(self, calls: Sequence[Call]) -> dict[int, Outcome]:
        """Score every call; returns ``{call id: outcome}``. Hung or crashed calls get TIMEOUT/ERROR."""
        results: dict[int, Outcome] = {}
        pending: deque[Call] = deque(calls)
        self.start()
        while len(results) < len(calls):
            self._dispatch(pending)
            busy = [w.deadline for w in self._workers if w.calls]
            starting = [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
            wake = min(busy + starting, default=time.monotonic() + 1.0)
            for conn in wait([w.conn for w in self._workers], timeout=max(0.0, wake - time.monotonic())):
                w = next(x for x in self._workers if x.conn is conn)
                self._drain(w, results, pending)
            self._enforce_deadlines(results, pending)
        return results

    def _dispatch(self, pending: deque[Call]) -> None:
        idle = [w for w in self._workers if w.ready and not w.calls]
        free = self.n - sum(1 for w in self._workers if w.calls)  # workers (ready or starting) with no work
        for i, w in enumerate(idle):
            if not pending:
                return
            size = math.ceil(len(pending) / max(1, free - i))  # leave a share for workers still starting
            chunk = [pending.popleft() for _ in range(size)]
            w.calls.extend(chunk)
            w.conn.send(chunk)
            w.deadline = time.monotonic() + self.timeout_s

    def _drain(self, w: _Worker, results: dict[int, Outcome], pending: deque[Call]) -> None:
        """Read every message waiting from ``w``; handle its death or a failed start."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if not w.ready:
                    kind, detail = msg
                    if kind == "init_error":
                        self._kill(w)
                        raise RewardError(f"reward worker could not start: {detail}")
                    w.ready = True
                    continue
                call_id, kind, value = msg
                done = w.calls.popleft()
                assert done[0] == call_id, "reward worker answered out of order"
                results[call_id] = (kind, value)
                w.deadline = time.monotonic() + self.timeout_s if w.calls else math.inf
        except (EOFError, OSError):
            self._on_death(w, results, pending)

    def _on_death(self, w: _Worker, results: dict[int, Outcome], pending: deque[Call]) -> None:
        w.proc.join(timeout=5)
        code = w.proc.exitcode
        self._kill(w)
        if not w.ready:
            raise RewardError(f"reward worker exited with code {code} while starting (specs {self.specs})")
        if w.calls:
            dead = w.calls.popleft()
            results[dead[0]] = (ERROR, f"reward worker process died (exit code {code})")
            pending.extendleft(reversed(w.calls))
        self.restarts += 1
        self.start()

    def _enforce_deadlines(self, results: dict[int, Outcome], pending: deque[Call]) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now - w.started > self.startup_timeout_s:
                self._kill(w)
                raise RewardError(
                    f"reward worker did not start within {self.startup_timeout_s:.0f} s (specs {self.specs})"
                )
            if w.calls and now > w.deadline:
                hung = w.calls.popleft()
                results[hung[0]] = (TIMEOUT, f"no answer within {self.timeout_s:g} s; worker killed")
                pending.extendleft(reversed(w.calls))
                self._kill(w)
                self.restarts += 1
                self.start()
