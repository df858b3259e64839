"""The endpoint's generation queue: requests from any number of agent programs, batched into
``engine.generate`` calls made by the thread that owns the engine.

HTTP handlers (uvicorn's thread) :meth:`Batcher.submit` a prompt and wait for its future; the
rollout's own thread calls :meth:`Batcher.serve`, which gathers requests and answers them with one
``generate`` per distinct set of stop strings. It gathers until every program still running has a
request waiting (``live()``, when the caller knows it: then no program is left for the next call),
or no new request came for ``linger_s`` (``wait_s`` when ``live`` is known: a program may be busy
with its own work), or ``max_wait_s`` passed since the first. Each answer is cut again at its own
budget and its first stop string (:mod:`nanogrpo.engines.stops`' rule): one call serves requests
with different budgets, and sampling is causal, so the tokens before a cut are those a call with that
budget would give.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from nanogrpo.engines.base import Engine, SamplingParams
from nanogrpo.engines.stops import StopStrings


@dataclass
class Job:
    prompt: list[int]
    budget: int
    stop: tuple[str, ...]
    future: Future
    """Resolves to ``(completion_ids, logprobs, finish_reason)``."""


class Batcher:
    def __init__(self, engine: Engine, tokenizer, params: SamplingParams, *, linger_s: float = 0.01,
                 wait_s: float = 0.25, max_wait_s: float = 1.0, max_batch: int = 256):
        self.engine = engine
        self.tokenizer = tokenizer
        self.params = params
        self.linger_s, self.wait_s, self.max_wait_s = linger_s, wait_s, max_wait_s
        self.max_batch = max_batch
        self.live: Callable[[], int] | None = None
        """The number of programs still running, when known (set by the rollout)."""
        self.q: queue.Queue[Job] = queue.Queue()
        self._stops: dict[tuple[str, ...], StopStrings] = {}
        self.calls = 0
        self.requests = 0
        self.generate_s = 0.0
        self.open = True

    def submit(self, prompt: list[int], budget: int, stop: tuple[str, ...]) -> Future:
        fut: Future = Future()
        if not self.open:
            fut.set_exception(RuntimeError("the rollout is over: no more generation"))
            return fut
        self.q.put(Job(prompt, budget, stop, fut))
        return fut

    def serve(self, until: Callable[[], bool], poll_s: float = 0.02) -> None:
        """Answer requests on this thread until ``until()`` is true and none is waiting."""
        while True:
            try:
                first = self.q.get(timeout=poll_s)
            except queue.Empty:
                if until():
                    return
                continue
            jobs, t0 = [first], time.monotonic()
            while len(jobs) < self.max_batch:
                live = self.live() if self.live is not None else None
                if live is not None and len(jobs) + self.q.qsize() >= live:
                    while len(jobs) < self.max_batch and not self.q.empty():
                        jobs.append(self.q.get_nowait())
                    break  # every running program waits for an answer
                gap = self.linger_s if live is None else self.wait_s
                left = max(0.0, t0 + self.max_wait_s - time.monotonic())
                try:
                    jobs.append(self.q.get(timeout=min(gap, left)))
                except queue.Empty:
                    break
            self._run(jobs)

    def close(self) -> None:
        """Refuse new requests; fail those still waiting."""
        self.open = False
        self.fail_waiting()

    def fail_waiting(self) -> None:
        """Fail the requests waiting (a program past its deadline asking after its rollout ended)."""
        while True:
            try:
                job = self.q.get_nowait()
            except queue.Empty:
                return
            job.future.set_exception(RuntimeError("the rollout is over: no more generation"))

    def _seed(self) -> int | None:
        s = self.params.seed
        return None if s is None else (s * 1_000_003 + self.calls * 7919) % (2**31 - 1)

    def _run(self, jobs: list[Job]) -> None:
        by_stop: dict[tuple[str, ...], list[Job]] = {}
        for j in jobs:
            by_stop.setdefault(j.stop, []).append(j)
        for stop, group in by_stop.items():
            params = replace(self.params, n=1, stop=stop, max_new_tokens=max(j.budget for j in group),
                             seed=self._seed())
            self.calls += 1
            self.requests += len(group)
            t0 = time.perf_counter()
            try:
                gen = self.engine.generate([j.prompt for j in group], params)
            except BaseException as e:
                for j in group:
                    j.future.set_exception(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))
                raise
            finally:
                self.generate_s += time.perf_counter() - t0
            stops = self._stops.get(stop)
            if stops is None:
                stops = self._stops[stop] = StopStrings(self.tokenizer, stop)
            answers = zip(group, gen.completion_ids, gen.logprobs, gen.finish_reasons, strict=True)
            for j, c, lp, why in answers:
                c, lp = list(c), [float(x) for x in lp]
                k = stops.find(c) if stops else None
                if k is not None:
                    c, lp, why = c[:k], lp[:k], "stop_string"
                if len(c) > j.budget:
                    c, lp, why = c[:j.budget], lp[:j.budget], "length"
                j.future.set_result((c, lp, why))
