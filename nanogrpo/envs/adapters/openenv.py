"""``env.source = "openenv:URL"``: an OpenEnv environment server (``openenv-core``) as an environment.

Each episode opens its own session on the server through OpenEnv's client (``GenericEnvClient``: a
WebSocket per episode, the server keeps one environment per session), ``reset`` with a seed from the
row, then one ``step`` per model turn. The model's text becomes the action ``{ACTION_FIELD: text}``:
``env.kwargs.action_field``, or the action schema's one required string field (read from the server's
``/schema`` when the run starts). The observation shown to the model is its
``env.kwargs.observation_field``, else its one string field, else its fields as JSON (``reward``,
``done`` and ``metadata`` left out). Each step's reward is the turn's reward; ``done`` ends the episode;
an episode succeeds when its return is above 0 (OpenEnv's wire format carries no success flag).

What is read from the server is bounded: every WebSocket message by ``env.kwargs.max_message_bytes``
(default 1 MiB) and by what an observation may hold (the rollout's ``max_observation_bytes``, six times
over for JSON's escapes, plus 64 KiB): OpenEnv's client stops reading a larger message and the episode
ends as ``too_long`` (a first observation: its group is dropped); the schema by :func:`read_bounded`.

A server at capacity (OpenEnv's ``max_concurrent_envs``: the template ``openenv init`` writes has 1)
refuses the sessions past its limit: each refused episode's group is dropped and counted
(``env/groups_dropped``), and the run says once, in one line, that the server's limit is below the
episodes in flight and that ``max_concurrent_envs`` in its ``create_app(...)`` raises it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nanogrpo.envs.adapters.common import require
from nanogrpo.envs.adapters.textarena import seed_of
from nanogrpo.envs.base import Environment, ObservationTooLong, SessionRefused, StepResult
from nanogrpo.errors import ConfigError

MAX_MESSAGE_BYTES = 1 << 20
SCHEMA_BYTES = 1 << 20
JSON_OVERHEAD = 65536
_AT_CAPACITY = re.compile(r"at capacity: (\d+)/(\d+) sessions|CAPACITY_REACHED", re.IGNORECASE)


def read_bounded(url: str, cap: int, timeout_s: float = 10.0) -> bytes:
    """GET ``url`` with its body read through :mod:`nanogrpo.http_limits`, at most ``cap`` bytes."""
    import httpx

    from nanogrpo import http_limits

    with httpx.Client(timeout=timeout_s) as client:
        try:
            r = http_limits.request(client, "GET", url, cap=cap)
        except http_limits.BodyError:
            raise ConfigError(f"{url}: answered more than {cap} bytes; is it an OpenEnv server?") from None
    r.raise_for_status()
    return r.content


def action_field(url: str) -> str:
    """The one required string field of the server's action schema."""
    try:
        schema = json.loads(read_bounded(url.rstrip("/") + "/schema", SCHEMA_BYTES))["action"]
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read it is one line at start
        raise ConfigError(f"env.source 'openenv:{url}': cannot read its action schema ({type(e).__name__}: "
                          f"{e}); is the server up? (or set env.kwargs.action_field)") from None
    props = schema.get("properties", {})
    fields = [k for k in schema.get("required", []) if props.get(k, {}).get("type") == "string"]
    if len(fields) != 1:
        raise ConfigError(f"env.source 'openenv:{url}': its action has {len(fields)} required string fields "
                          f"({', '.join(fields) or 'none'}); set env.kwargs.action_field to the one the "
                          "model writes")
    return fields[0]


def observation_text(obs: dict[str, Any], field: str | None) -> str:
    if field is not None:
        return str(obs.get(field, ""))
    rest = {k: v for k, v in obs.items() if k not in ("reward", "done", "metadata")}
    texts = [v for v in rest.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(rest, ensure_ascii=False)


class OpenEnvEnv(Environment):
    def __init__(self, url: str, action_field: str, observation_field: str | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, timeout_s: float = 60.0):
        self.url, self.action_field, self.observation_field = url, action_field, observation_field
        self.max_message_bytes, self.timeout_s = max_message_bytes, timeout_s
        self.client = None

    def message_cap(self) -> int:
        """The most bytes one WebSocket message may hold: ``max_message_bytes``, and no more than an
        observation the rollout could show (``max_observation_bytes``, JSON-escaped, plus the rest)."""
        if self.max_observation_bytes is None:
            return self.max_message_bytes
        return min(self.max_message_bytes, 6 * self.max_observation_bytes + JSON_OVERHEAD)

    async def _call(self, coro, what: str):
        """``coro`` (a client call), with the server's refusals and oversized messages as nanogrpo's."""
        from websockets.exceptions import ConnectionClosed

        try:
            return await coro
        except ConnectionClosed as e:
            codes = [getattr(getattr(e, side, None), "code", None) for side in ("sent", "rcvd")]
            if 1009 in codes:  # the client stopped reading a message over its max_size
                raise ObservationTooLong(f"{self.url}: its {what} answer is over {self.message_cap()} bytes, "
                                         "more than an observation may hold (not read)") from None
            said = await self._last_word()  # a server at capacity says so, then closes, before we ask
            if said is None or _AT_CAPACITY.search(said) is None:
                raise
            self._refused(said)
        except RuntimeError as e:
            if _AT_CAPACITY.search(str(e)) is None:
                raise
            self._refused(str(e))

    async def _last_word(self) -> str | None:
        """The message the server sent before it closed the connection, if one is waiting (read from the
        client's WebSocket, at most ``max_size`` bytes), else None."""
        import asyncio

        ws = getattr(self.client, "_ws", None)
        if ws is None:
            return None
        try:
            msg = await asyncio.wait_for(ws.recv(), 1.0)
        except Exception:  # noqa: BLE001 - nothing waiting: the caller re-raises the close
            return None
        return msg if isinstance(msg, str) else None

    def _refused(self, said: str):
        m = _AT_CAPACITY.search(said)
        limit = int(m.group(2)) if m is not None and m.group(2) else None
        try:
            said = json.loads(said)["data"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise SessionRefused(f"{self.url}: session refused ({said.splitlines()[0][:200]})", limit,
                             "raise max_concurrent_envs in the server's create_app(...)") from None

    async def reset(self, row: dict[str, Any]) -> str:
        core = require("openenv.core", "openenv-core", "env.source 'openenv:...'")
        self.client = core.GenericEnvClient(base_url=self.url, message_timeout_s=self.timeout_s,
                                            max_message_size_mb=self.message_cap() / 2**20)
        await self.client.connect()
        res = await self._call(self.client.reset(seed=seed_of(row)), "reset")
        return observation_text(res.observation, self.observation_field)

    async def step(self, action: str) -> StepResult:
        res = await self._call(self.client.step({self.action_field: action}), "step")
        obs = res.observation if isinstance(res.observation, dict) else {}
        text = None if res.done else observation_text(obs, self.observation_field)
        return StepResult(text, 0.0 if res.reward is None else res.reward, bool(res.done))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None


def load(rest: str, kwargs: dict):
    """The factory for ``openenv:URL`` (``http://host:port``)."""
    if not rest.startswith(("http://", "https://", "ws://", "wss://")):  # said before a 2 s import
        raise ConfigError(f"env.source 'openenv:{rest}': expected a URL, e.g. openenv:http://127.0.0.1:8000")
    require("openenv.core", "openenv-core", "env.source 'openenv:...'")
    kw = dict(kwargs)
    field = kw.pop("action_field", None) or action_field(rest.replace("ws", "http", 1)
                                                          if rest.startswith("ws") else rest)
    unknown = set(kw) - {"observation_field", "max_message_bytes", "timeout_s"}
    if unknown:
        raise ConfigError(f"env.kwargs for openenv: unknown {sorted(unknown)}; known: action_field, "
                          "observation_field, max_message_bytes, timeout_s")
    return lambda: OpenEnvEnv(rest, field, **kw)
