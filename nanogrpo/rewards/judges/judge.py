"""``judge:URL``: an LLM behind an OpenAI-compatible chat-completions endpoint grades each completion.

``URL`` is the API base (``http://host:8000/v1``): requests go to ``URL/chat/completions``, and the
model is ``rewards.judge_model`` or, when unset, the first one ``URL/models`` lists (a local vLLM or
SGLang needs nothing more). Each row becomes one user message from the template
(:mod:`nanogrpo.rewards.judges.templates`), sent with ``temperature 0`` and ``max_tokens =
rewards.judge_max_tokens`` (``rewards.judge_request`` adds or, with null, removes body fields, e.g.
``{max_tokens = null, max_completion_tokens = 512}`` for models that want that), and the reply is
read as a score.

Per batch:

- requests run concurrently, at most ``rewards.judge_concurrency`` at once, on an event loop of the
  judge's own (one ``httpx.AsyncClient``, connections kept alive);
- a request answered 429 or 5xx, or that fails to connect or runs past ``rewards.judge_timeout_s``,
  is retried up to ``rewards.judge_retries`` times with exponential backoff and jitter (from 0.5 s,
  doubling, at most 8 s; a ``Retry-After`` header is honoured), never past the batch's deadline;
  other 4xx answers are not retried;
- the batch ends at ``rewards.judge_deadline_s``: requests still open are cancelled and their rows
  scored the penalty as timeouts; the step goes on;
- a malformed body (not JSON, no ``choices[0].message.content``) scores the penalty as an error; a
  reply without a readable score as unparseable (both counted, neither retried);
- a reply is read as it arrives and at most ``rewards.judge_max_reply_bytes`` of it (1 MiB; the same for
  ``/models``): past it the connection is closed and the row scores the penalty as an error, ``reply
  over N bytes`` (counted, not retried), so a judge that streams without end costs at most
  ``judge_concurrency x judge_max_reply_bytes`` of memory (:mod:`nanogrpo.http_limits`);
- identical requests (the same completion twice in a group, a resumed run's replayed steps) are sent
  once: the cache (:mod:`nanogrpo.rewards.judges.reply_cache`) answers repeats without a request.

The API key comes from the environment variable ``rewards.judge_api_key_env`` (default
``NANOGRPO_JUDGE_API_KEY``; unset: no ``Authorization`` header). It is never a flag or a config
value, never logged, and not part of the cache key. Why httpx and not the ``openai`` client: one POST
and one GET need no SDK, httpx is already a dependency of the server, and the retry rules above are
ours to state and test (the SDK retries on its own schedule, and its timeouts cover one request, not a
batch).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nanogrpo import http_limits
from nanogrpo.errors import RewardError
from nanogrpo.rewards.calls import BAD, ERROR, OK, TIMEOUT, Outcome, one_line
from nanogrpo.rewards.judges.reply_cache import Reply, ReplyCache, request_key
from nanogrpo.rewards.judges.templates import load_template, parse_score, render

__all__ = ["Judge"]

log = logging.getLogger("nanogrpo.rewards")

RETRY_STATUS = {408, 409, 425, 429}
"""Besides every 5xx: answers worth asking again."""


@dataclass
class _Failure:
    kind: str
    reason: str


@dataclass
class _Tally:
    """One batch's request figures."""

    attempts: int = 0
    retries: int = 0
    latencies: list[float] = field(default_factory=list)


class Judge:
    """An LLM judge as a model reward of :class:`~nanogrpo.rewards.RewardRunner` (module docstring).

    ``cache``: a :class:`ReplyCache` (None: one in memory)."""

    scalable = False

    def __init__(self, url: str, *, model: str | None = None, template: str = "correct",
                 scoring: str = "auto", score_range: tuple[float, float] = (1.0, 10.0), concurrency: int = 16,
                 timeout_s: float = 60.0, deadline_s: float = 300.0, retries: int = 4, max_tokens: int = 64,
                 request: dict[str, Any] | None = None, api_key_env: str = "NANOGRPO_JUDGE_API_KEY",
                 cache: ReplyCache | None = None, name: str | None = None, metric_prefix: str = "judge",
                 backoff_s: tuple[float, float] = (0.5, 8.0), max_reply_bytes: int = 1 << 20):
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"reward 'judge:{url}': the URL must start with http:// or https:// "
                              "(the API base, e.g. http://localhost:8000/v1)")
        if concurrency < 1 or timeout_s <= 0 or deadline_s <= 0 or retries < 0 or max_tokens < 1 \
                or max_reply_bytes < 1024:
            raise RewardError(f"judge settings out of range: concurrency {concurrency}, timeout_s "
                              f"{timeout_s}, deadline_s {deadline_s}, retries {retries}, "
                              f"max_tokens {max_tokens}, max_reply_bytes {max_reply_bytes} (>= 1024)")
        lo, hi = score_range
        if not lo < hi:
            raise RewardError(f"rewards.judge_range {score_range}: the low end must be below the high end")
        self.url = url
        self.name = name or f"judge:{url}"
        self.template, default_scoring = load_template(template)
        self.scoring = default_scoring if scoring == "auto" else scoring
        if self.scoring not in ("yes_no", "number"):
            raise RewardError(f"rewards.judge_score {scoring!r}: auto, yes_no or number")
        self.range = (float(lo), float(hi))
        self.model = model
        self.concurrency = concurrency
        self.timeout_s, self.deadline_s = float(timeout_s), float(deadline_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_reply_bytes = int(max_reply_bytes)
        self.body = {"temperature": 0.0, "max_tokens": max_tokens}
        for k, v in (request or {}).items():
            if k in ("model", "messages"):
                raise RewardError(f"rewards.judge_request may not set {k!r} (the judge sets it)")
            if v is None:
                self.body.pop(k, None)
            else:
                self.body[k] = v
        self.api_key_env = api_key_env
        self.cache = cache if cache is not None else ReplyCache(None)
        self.prefix = metric_prefix
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._stats: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the judge's event loop (its thread) once."""
        if self._loop is not None:
            return
        try:
            import httpx  # noqa: F401 - fail here, clearly, when it is missing
        except ImportError:
            raise RewardError("judge: rewards need httpx: pip install 'nanogrpo[judge]'") from None

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True, name="nanogrpo-judge")
        thread.start()
        self._loop, self._thread = loop, thread

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            if self._client is not None:
                try:
                    asyncio.run_coroutine_threadsafe(self._client.aclose(), loop).result(timeout=5)
                except Exception:  # noqa: BLE001 - closing sockets at shutdown: nothing to do about it
                    pass
                self._client = None
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=5)
            loop.close()
        self.cache.close()

    def _run(self, coro: Any, wait_s: float) -> Any:
        self.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=wait_s)

    # ------------------------------------------------------------------ scoring

    def score(self, completions: list[str], samples: list[dict]) -> list[Outcome]:
        return self.submit(completions, samples)()

    def submit(self, completions: list[str], samples: list[dict]):
        """Start a batch; returns a function that waits for it and gives one outcome per row. The runner
        submits before its other rewards run, so the judge's requests overlap them."""
        self.start()
        t0 = time.monotonic()
        deadline = t0 + self.deadline_s
        out: list[Outcome | None] = [None] * len(completions)
        try:
            model = self._run(self._model_name(deadline), self.deadline_s + 5)
        except _JudgeDown as e:
            failed = [(e.kind, e.reason)] * len(completions)
            self._stats = {f"{self.prefix}/errors": float(len(completions))}
            return lambda: failed
        keys: list[str | None] = [None] * len(completions)
        bodies: dict[str, dict] = {}
        for i, (c, s) in enumerate(zip(completions, samples, strict=True)):
            try:
                prompt = render(self.template, c, s)
            except KeyError as e:
                out[i] = (ERROR, str(e.args[0]))
                continue
            body = {**self.body, "model": model, "messages": [{"role": "user", "content": prompt}]}
            keys[i] = request_key(body)
            bodies[keys[i]] = body
        hits = self.cache.get_many(list(bodies))
        todo = {k: b for k, b in bodies.items() if k not in hits}
        future = asyncio.run_coroutine_threadsafe(self._batch(todo, deadline), self._loop) if todo else None

        def wait() -> list[Outcome]:
            tally = _Tally()
            got: dict[str, Reply | _Failure] = dict(hits)
            if future is not None:
                fresh, tally = future.result(timeout=max(0.0, deadline - time.monotonic()) + 30)
                self.cache.put_many({k: r for k, r in fresh.items() if isinstance(r, Reply)})
                got.update(fresh)
            counts = {ERROR: 0, TIMEOUT: 0, BAD: 0}
            for i, key in enumerate(keys):
                if out[i] is not None:
                    counts[ERROR] += 1
                    continue
                reply = got[key]
                if isinstance(reply, _Failure):
                    out[i] = (reply.kind, reply.reason)
                    counts[reply.kind] += 1
                    continue
                value = parse_score(reply.content, self.scoring, *self.range)
                if value is None:
                    out[i] = (BAD, f"no {'yes/no' if self.scoring == 'yes_no' else 'score in range'} in the "
                                   f"judge's reply {reply.content[:120]!r}")
                    counts[BAD] += 1
                else:
                    out[i] = (OK, value)
            new = [r for k, r in got.items() if k in todo and isinstance(r, Reply)]
            p = self.prefix
            self._stats = {
                f"{p}/time_s": time.monotonic() - t0, f"{p}/requests": float(tally.attempts),
                f"{p}/retries": float(tally.retries),
                # rows answered without a request of their own: from the cache, or by an identical row
                f"{p}/cache_hits": float(sum(k is not None for k in keys) - len(todo)),
                f"{p}/latency_s": statistics.fmean(tally.latencies) if tally.latencies else float("nan"),
                f"{p}/latency_max_s": max(tally.latencies) if tally.latencies else float("nan"),
                f"{p}/prompt_tokens": float(sum(r.prompt_tokens for r in new)),
                f"{p}/completion_tokens": float(sum(r.completion_tokens for r in new)),
                f"{p}/unparseable": float(counts[BAD]), f"{p}/errors": float(counts[ERROR]),
                f"{p}/timeouts": float(counts[TIMEOUT])}
            return out  # type: ignore[return-value]

        return wait

    def metrics(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        return stats

    # ------------------------------------------------------------------ HTTP (on the judge's loop)

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env, "").strip()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(
                timeout=self.timeout_s, limits=httpx.Limits(max_connections=self.concurrency,
                                                             max_keepalive_connections=self.concurrency),
                verify=self.url.startswith("https://"))  # plain http: no TLS context to build (~0.2 s)
        return self._client

    async def _model_name(self, deadline: float) -> str:
        if self.model:
            return self.model
        res = await self._send("GET", f"{self.url}/models", None, deadline, _Tally())
        if isinstance(res, _Failure):
            raise _JudgeDown(res.kind, f"cannot list the judge's models at {self.url}/models: {res.reason} "
                                       "(or set rewards.judge_model)")
        try:
            self.model = str(res["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise _JudgeDown(ERROR, f"{self.url}/models lists no model (set rewards.judge_model)") from None
        log.warning("reward %r: judging with model %r (the first %s/models lists)", self.name, self.model,
                    self.url)
        return self.model

    async def _batch(self, bodies: dict[str, dict], deadline: float
                     ) -> tuple[dict[str, Reply | _Failure], _Tally]:
        tally = _Tally()
        gate = asyncio.Semaphore(self.concurrency)

        async def one(body: dict) -> Reply | _Failure:
            async with gate:
                res = await self._send("POST", f"{self.url}/chat/completions", body, deadline, tally)
            return res if isinstance(res, _Failure) else _reply(res)

        tasks = {k: asyncio.ensure_future(one(b)) for k, b in bodies.items()}
        await asyncio.wait(tasks.values(), timeout=max(0.0, deadline - time.monotonic()))
        out: dict[str, Reply | _Failure] = {}
        for k, t in tasks.items():
            if t.done() and not t.cancelled():
                out[k] = t.result()
            else:
                t.cancel()
                out[k] = _Failure(TIMEOUT, f"no reply before the batch deadline ({self.deadline_s:g} s)")
        return out, tally

    async def _send(self, method: str, url: str, body: dict | None, deadline: float, tally: _Tally) -> Any:
        """One request with retries; the parsed JSON answer, or a :class:`_Failure`."""
        import httpx

        attempt = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return _Failure(TIMEOUT, f"no reply before the batch deadline ({self.deadline_s:g} s)")
            tally.attempts += 1
            t0 = time.monotonic()
            retry_after = None
            try:
                resp = await asyncio.wait_for(
                    http_limits.arequest(self._http(), method, url, cap=self.max_reply_bytes, json=body,
                                         headers=self._headers()),
                    timeout=min(self.timeout_s, left))
            except (asyncio.TimeoutError, httpx.TimeoutException):
                kind, reason = TIMEOUT, f"no reply within {min(self.timeout_s, left):.3g} s"
            except http_limits.BodyError as e:  # a reply without end: asking again would get another
                return _Failure(ERROR, f"{e} (rewards.judge_max_reply_bytes)")
            except httpx.HTTPError as e:
                kind, reason = ERROR, f"request failed ({one_line(e)})"
            else:
                if resp.status_code == 200:
                    tally.latencies.append(time.monotonic() - t0)
                    try:
                        return resp.json()
                    except ValueError:
                        return _Failure(ERROR, f"malformed reply (not JSON): {resp.text[:120]!r}")
                kind, reason = ERROR, f"HTTP {resp.status_code}: {resp.text[:160]!r}"
                if resp.status_code < 500 and resp.status_code not in RETRY_STATUS:
                    return _Failure(ERROR, reason)
                retry_after = _retry_after(resp.headers.get("retry-after"))
            attempt += 1
            if attempt > self.retries:
                return _Failure(kind, f"{reason} (after {attempt} attempt{'s' if attempt > 1 else ''})")
            lo, hi = self.backoff_s
            wait = retry_after if retry_after is not None \
                else min(hi, lo * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            if time.monotonic() + wait >= deadline:
                return _Failure(TIMEOUT, f"{reason}; no time left to retry before the batch deadline")
            tally.retries += 1
            await asyncio.sleep(wait)


class _JudgeDown(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def _reply(data: Any) -> Reply | _Failure:
    """The reply text and token counts of a chat-completions answer."""
    try:
        content = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return _Failure(ERROR, f"malformed reply (no choices[0].message.content): {str(data)[:120]!r}")
    if not isinstance(content, str):
        return _Failure(ERROR, f"malformed reply (content is {type(content).__name__})")
    usage = data.get("usage") if isinstance(data, dict) else None
    usage = usage if isinstance(usage, dict) else {}

    def count(key: str) -> int:
        v = usage.get(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else 0

    return Reply(content, count("prompt_tokens"), count("completion_tokens"))


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header given in seconds (an HTTP date is ignored), at most 60."""
    try:
        return min(60.0, max(0.0, float(value))) if value is not None else None
    except ValueError:
        return None
