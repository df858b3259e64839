"""Reward worker processes that bound every call by a deadline.

Each worker is a ``spawn`` process (the trainer has torch and its threads loaded,
so forking it is unsafe) that loads the rewards again (a spec is resolved by name,
a callable unpickled) and then scores chunks of calls, answering one message per
call. A call is one completion, or for a batched reward a list of them (answered
with one outcome per row, or one for them all). The parent tracks a deadline per
call (each function has its own timeout): a worker silent past it since its last
answer is killed, the call it was on is scored as a timeout, the rest of its chunk
goes back to the queue, and a replacement starts in the background. A worker that
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
from nanogrpo.rewards.calls import ERROR, TIMEOUT, Outcome, call_batch, call_reward, one_line

__all__ = ["Call", "WorkerPool"]

Call = tuple[int, int, Any, Any]
"""``(call id, function index, completion, sample)``; for a batched function
``(call id, function index, completions, samples)``."""

Source = str | bytes
"""What a worker loads: a reward spec (resolved by name) or a pickled callable."""


def _load(source: Source, truncated_correct: bool, overlong_settings: tuple = (None, 1.0),
          truncated_last_number: bool = False) -> Any:
    from nanogrpo.rewards.resolve import resolve

    if isinstance(source, str):
        return resolve(source, truncated_correct, overlong_settings,
                       truncated_last_number=truncated_last_number)
    import pickle

    try:
        return pickle.loads(source)  # cloudpickle's output loads with plain pickle (cloudpickle installed)
    except Exception as e:  # noqa: BLE001 - whatever unpickling a user object raises
        raise RewardError(f"a reward callable could not be loaded in the worker process ({one_line(e)}); "
                          "define it in an importable module, or set rewards.workers=0") from None


def _worker_main(conn: Connection, sources: list[Source], truncated_correct: bool = True,
                 batched: list[bool] | None = None, overlong_settings: tuple = (None, 1.0),
                 truncated_last_number: bool = False) -> None:
    """Worker process body: load the rewards, say ready, then score chunks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    batched = batched or [False] * len(sources)
    try:
        fns = [_load(s, truncated_correct, overlong_settings, truncated_last_number) for s in sources]
    except RewardError as e:
        conn.send(("init_error", str(e)))
        return
    if "correctness" in sources:
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
            if batched[k]:
                conn.send((call_id, call_batch(fns[k], completion, sample)))
            else:
                conn.send((call_id, call_reward(fns[k], completion, sample)))


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    started: float
    ready: bool = False
    calls: deque[Call] = field(default_factory=deque)
    deadline: float = math.inf


class WorkerPool:
    """``n`` reward worker processes; :meth:`run` scores calls with a per-call deadline.

    ``sources[k]`` is function ``k`` (a spec or a pickled callable); ``timeout_s`` one deadline for every
    function or one per function; ``batched[k]``: function ``k`` takes lists."""

    def __init__(self, sources: Sequence[Source], n: int, timeout_s: float | Sequence[float],
                 startup_timeout_s: float = 120.0, truncated_correct: bool = True,
                 overlong_settings: tuple = (None, 1.0),
                 batched: Sequence[bool] | None = None, truncated_last_number: bool = False):
        if n < 1:
            raise ValueError(f"a worker pool needs at least 1 worker, got {n}")
        self.sources = list(sources)
        self.specs = [s if isinstance(s, str) else "<callable>" for s in self.sources]  # for messages
        self.batched = list(batched) if batched is not None else [False] * len(self.sources)
        self.truncated_correct = truncated_correct
        self.truncated_last_number = truncated_last_number
        self.overlong_settings = tuple(overlong_settings)
        self.n = n
        self.timeouts = [float(timeout_s)] * len(self.sources) if isinstance(timeout_s, (int, float)) \
            else [float(t) for t in timeout_s]
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
                target=_worker_main, args=(child_conn, self.sources, self.truncated_correct, self.batched,
                                           self.overlong_settings, self.truncated_last_number),
                daemon=True,
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

    def run(self, calls: Sequence[Call]) -> dict[int, Outcome | list[Outcome]]:
        """Score every call; returns ``{call id: outcome}`` (a batched call's: one outcome per row, or one
        for them all). Hung or crashed calls get TIMEOUT/ERROR."""
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
            w.deadline = time.monotonic() + self.timeouts[chunk[0][1]]

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
                call_id, outcome = msg
                done = w.calls.popleft()
                assert done[0] == call_id, "reward worker answered out of order"
                results[call_id] = outcome
                w.deadline = time.monotonic() + self.timeouts[w.calls[0][1]] if w.calls else math.inf
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
                results[hung[0]] = (TIMEOUT, f"no answer within {self.timeouts[hung[1]]:g} s; worker killed")
                pending.extendleft(reversed(w.calls))
                self._kill(w)
                self.restarts += 1
                self.start()
