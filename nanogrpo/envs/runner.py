"""Calling environments: many episodes at once, each call under a deadline, failures caught and counted.

The line with :mod:`nanogrpo.episodes`: this module calls an environment's (or agent program's)
methods and says what each call came to; it never sees a token. The episodes (what the model samples,
how an observation is rendered and fed, what ends an episode and what it is worth) are played there,
every call going through an :class:`EnvRunner`.

:class:`EnvRunner` owns what a run's environments need: the factory (:mod:`nanogrpo.envs.load`), a
pool of daemon worker threads for sync methods, one event loop (in a thread of its own) for
``async def`` methods, and the sandbox handle for environments that run model-written code. It is
built at start (a bad ``env.source`` fails then, in one line) and closed at the end of the run.

:meth:`EnvRunner.call` runs one method on many environments concurrently and answers an
:class:`Outcome` per environment: ``ok`` and the value, ``error`` (it raised, or answered something
that is not a step result), ``too_long`` (it raised :class:`~nanogrpo.envs.base.ObservationTooLong`:
an adapter refused an observation over its byte bound), ``refused`` (it raised
:class:`~nanogrpo.envs.base.SessionRefused`: the environment's server is at capacity) or ``timeout`` (it
ran past ``env.timeout_s``). Failures are counted by ``method/status`` and the first few of each kind
logged; refused sessions get one line of their own, once a run: the server's limit is below the
episodes in flight, and how to raise it.
A timed-out sync call cannot be stopped: its worker thread is abandoned (a daemon: it never blocks the
process's exit) and replaced; an async one is cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from nanogrpo.envs.base import ObservationTooLong, SessionRefused
from nanogrpo.envs.load import Factory, resolve
from nanogrpo.watch.episodes import all_failed

log = logging.getLogger("nanogrpo.envs")
_WARN_LIMIT = 3


@dataclass
class Outcome:
    """What one call of an environment method came to."""

    status: str = "ok"
    """``ok``, ``error``, ``too_long``, ``refused`` or ``timeout``."""
    value: Any = None
    """``ok``: what the call answered; ``refused``: the :class:`~nanogrpo.envs.base.SessionRefused`."""
    error: str = ""
    """``error`` / ``too_long`` / ``refused`` / ``timeout``: one line saying what happened."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Job:
    __slots__ = ("fn", "future", "started", "abandoned", "inner")

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.future = fn, Future()
        self.started: float | None = None
        self.abandoned = False
        self.inner: Future | None = None  # an awaitable's future on the event loop


class _Workers:
    """Daemon threads taking jobs from a queue; a thread whose job was abandoned exits after it."""

    def __init__(self, n: int, loop: Callable[[], asyncio.AbstractEventLoop]):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.loop = loop
        self.n = 0
        for _ in range(n):
            self.spawn()

    def spawn(self) -> None:
        self.n += 1
        threading.Thread(target=self._work, name=f"nanogrpo-env-{self.n}", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job.started = time.monotonic()
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                value = job.fn()
                if inspect.isawaitable(value):  # a sync method that answered a coroutine: run it on the loop
                    job.inner = asyncio.run_coroutine_threadsafe(_awaited(value), self.loop())
                    job.inner.add_done_callback(lambda f, j=job: _copy_result(f, j.future))
                else:
                    job.future.set_result(value)
            except BaseException as e:  # noqa: BLE001 - the environment's failure, reported as an Outcome
                job.future.set_exception(e)
            if job.abandoned:
                return

    def stop(self) -> None:
        for _ in range(self.n):
            self.jobs.put(None)


async def _awaited(value: Any) -> Any:
    return await value


def _copy_result(src: Future, dst: Future) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.set_exception(TimeoutError("cancelled"))
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


def _outcome(f: Future) -> Outcome:
    """What a finished call came to."""
    e = f.exception()
    if e is None:
        return Outcome(value=f.result())
    if isinstance(e, SessionRefused):
        return Outcome("refused", value=e, error=first_line(e))
    return Outcome("too_long" if isinstance(e, ObservationTooLong) else "error", error=first_line(e))


def first_line(e: BaseException) -> str:
    """``Type: the first line of the message that says something`` (a line of letters or digits: a
    banner of ``*****`` or ``-----`` above the message, as nltk's missing-data error has, is skipped)."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    text = next((ln for ln in lines if any(c.isalnum() for c in ln)), "")[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class EnvSandbox:
    """The :class:`~nanogrpo.envs.base.SandboxHandle` an environment's ``sandbox`` attribute is set to:
    the built-in Python tool's sandbox (:mod:`nanogrpo.tools.sandbox`) under the ``[tools]`` limits,
    started on first use. Calls from many episodes' threads go through one lock."""

    def __init__(self, tools_cfg):
        self.cfg = tools_cfg.model_copy(update={"function": "python", "sample_fields": []})
        self._runner = None
        self._lock = threading.Lock()
        self.calls: Counter = Counter()

    def run(self, code: str) -> tuple[str, str]:
        from nanogrpo.tools.protocols import Call
        from nanogrpo.tools.runner import ToolRunner

        if not isinstance(code, str):
            raise TypeError(f"sandbox.run takes the code as a string, not {type(code).__name__}")
        with self._lock:
            if self._runner is None:
                self._runner = ToolRunner(self.cfg)
            res = self._runner.run([Call(code)], [{}])[0]
            self.calls[res.status] += 1
        return res.status, res.output

    def close(self) -> None:
        with self._lock:
            if self._runner is not None:
                self._runner.close()
                self._runner = None


class EnvRunner:
    """A run's environments (``[env]``): the factory, the workers, the deadline, the sandbox."""

    def __init__(self, factory: Factory, cfg, tools_cfg=None, source: str = "env"):
        """``cfg``: the ``[env]`` section (:class:`nanogrpo.config.EnvConfig`); ``tools_cfg``: the
        ``[tools]`` section, whose limits the sandbox handle uses."""
        self.factory, self.cfg, self.source = factory, cfg, source
        self.timeout_s = cfg.timeout_s
        self.sandbox = EnvSandbox(tools_cfg) if tools_cfg is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._workers: _Workers | None = None
        self.counts: Counter = Counter()
        """Failed calls over the run, by ``method/status``."""
        self._capacity_said = False

    @classmethod
    def from_config(cls, cfg, env: Any = None) -> EnvRunner | None:
        """The runner of a :class:`~nanogrpo.config.Config`: ``env`` (an object from Python) or
        ``cfg.env.source``; None when neither is set."""
        if env is None and not cfg.env.source:
            return None
        source = cfg.env.source if env is None else env
        name = source if isinstance(source, str) else type(source).__name__
        return cls(resolve(source, cfg.env.kwargs, cfg.env.server), cfg.env, cfg.tools, source=name)

    # ------------------------------------------------------------------ plumbing

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="nanogrpo-env-loop", daemon=True).start()
            return self._loop

    def _submit(self, fn: Callable[[], Any], is_async: bool) -> _Job:
        job = _Job(fn)
        if is_async:
            job.started = time.monotonic()
            job.future.set_running_or_notify_cancel()
            job.inner = asyncio.run_coroutine_threadsafe(_awaited(fn()), self.loop())
            job.inner.add_done_callback(lambda f: _copy_result(f, job.future))
        else:
            if self._workers is None:
                self._workers = _Workers(self.cfg.workers, self.loop)
            self._workers.jobs.put(job)
        return job

    def run_all(
        self, fns: Sequence[Callable[[], Any]], what: str, is_async: Sequence[bool] | None = None,
        limit: int | None = None,
    ) -> list[Outcome]:
        """Run ``fns`` concurrently, each under the deadline counted from when it starts; ``limit``: at
        most that many running at once (the rest start as earlier ones end: their deadlines too)."""
        waiting = list(range(len(fns)))[::-1]
        jobs: dict[int, _Job] = {}
        out: dict[int, Outcome] = {}
        pending: dict[Future, int] = {}

        def start_more() -> None:
            while waiting and (limit is None or len(pending) < limit):
                i = waiting.pop()
                jobs[i] = self._submit(fns[i], bool(is_async and is_async[i]))
                pending[jobs[i].future] = i

        start_more()
        while pending:
            now = time.monotonic()
            started = [jobs[i].started for i in pending.values() if jobs[i].started is not None]
            wait_s = max(0.0, min(started) + self.timeout_s - now) if started else 0.05
            done, _ = wait(list(pending), timeout=min(wait_s, 0.5) + 1e-3, return_when=FIRST_COMPLETED)
            for f in done:
                out[pending.pop(f)] = _outcome(f)
            self._expire(jobs, pending, out, what)
            start_more()
        results = [out[i] for i in range(len(fns))]
        for r in results:
            if not r.ok:
                self.report(what, r)
        refused = [r for r in results if r.status == "refused"]
        if refused and not self._capacity_said:
            self._capacity_said = True
            e = refused[0].value
            limit_said = f" (its limit: {e.limit})" if e.limit is not None else ""
            log.warning("environment %s: the server refused %d of the %d sessions opened at once%s: its "
                        "concurrency limit is below the episodes in flight (rollout.prompts_per_step x "
                        "grpo.group_size), and each group with a refused session is dropped "
                        "(env/groups_dropped); %s, or lower rollout.prompts_per_step", self.source,
                        len(refused), len(results), limit_said,
                        (e.hint or "raise the server's limit") + f" to at least {len(results)}")
        return results

    def _expire(self, jobs: dict[int, _Job], pending: dict[Future, int], out: dict[int, Outcome],
                what: str) -> None:
        """The calls past their deadline end as ``timeout``: an async one cancelled, a sync one's thread
        left to its call and replaced."""
        now = time.monotonic()
        for f, i in list(pending.items()):
            j = jobs[i]
            if j.started is not None and now - j.started > self.timeout_s:
                del pending[f]
                out[i] = Outcome("timeout", error=f"{what} ran past env.timeout_s={self.timeout_s:g} s")
                if j.inner is not None:
                    j.inner.cancel()
                if not j.abandoned and j.inner is None and self._workers is not None:
                    j.abandoned = True  # its thread is stuck in the call: leave it, start another
                    self._workers.spawn()

    def say_if_all_failed(self, metrics: dict[str, Any], errors: Sequence[str]) -> str | None:
        """One warning when every episode of a step failed (or none started): how many, the cause, the key
        to change (:func:`nanogrpo.watch.episodes.all_failed`) and the first error; the line, else None."""
        line = all_failed(metrics, self.timeout_s)
        if line is None:
            return None
        first = next((e for e in errors if e), "")
        log.warning("environment %s: %s%s", self.source, line,
                    f" (first error: {first[:300]})" if first else "")
        return line

    def report(self, what: str, r: Outcome) -> None:
        key = f"{what}/{r.status}"
        self.counts[key] += 1
        if r.status == "refused":
            return  # counted; said once a run, in run_all
        if self.counts[key] <= _WARN_LIMIT:
            log.warning(
                "environment %s: %s %s (%s)%s",
                self.source,
                what,
                r.status,
                r.error,
                "; further ones are counted, not logged" if self.counts[key] == _WARN_LIMIT else "",
            )

    # ------------------------------------------------------------------ episodes

    def make(self, n: int, attrs: dict[str, Any] | None = None) -> list[Outcome]:
        """``n`` fresh environments (each made by the factory under the deadline), sandbox handle set;
        ``attrs``: attributes set on each environment that declares them (``max_observation_bytes``)."""

        def one():
            env = self.factory()
            if self.sandbox is not None and hasattr(env, "sandbox"):
                env.sandbox = self.sandbox
            for k, v in (attrs or {}).items():
                if hasattr(env, k):
                    setattr(env, k, v)
            return env

        return self.run_all([one] * n, "create")

    def call(self, envs: Sequence[Any], method: str, args: Sequence[Any]) -> list[Outcome]:
        """``env.method(arg)`` for each pair, concurrently (sync methods in the workers, ``async def``
        ones on the loop), under the deadline."""
        fns, asy = [], []
        for env, arg in zip(envs, args, strict=True):
            m = getattr(env, method)
            fns.append(lambda m=m, a=arg: m(a))
            asy.append(inspect.iscoroutinefunction(m))
        return self.run_all(fns, method, asy)

    def close_envs(self, envs: Sequence[Any]) -> None:
        """``close()`` each environment that has one (failures logged, never raised)."""
        todo = [e for e in envs if callable(getattr(e, "close", None))]
        if todo:
            self.run_all(
                [e.close for e in todo], "close", [inspect.iscoroutinefunction(e.close) for e in todo]
            )

    def close(self) -> None:
        if self._workers is not None:
            self._workers.stop()
            self._workers = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        if self.sandbox is not None:
            self.sandbox.close()
        for key, n in sorted(self.counts.items()):
            if n > _WARN_LIMIT:
                log.warning("environment calls over the run: %d %s", n, key)


__all__ = ["EnvRunner", "EnvSandbox", "Outcome"]
