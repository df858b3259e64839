"""Episodes through a verifiers environment server (``env.server``): verifiers' own ``EnvServer`` in
another process, driven with verifiers' ``EnvClient`` (ZeroMQ + msgpack; the episode's traces stream
back as it runs).

- ``env.server = "start"``: nanogrpo starts one (``python -m nanogrpo.envs.adapters.verifiers_v1.server``,
  on a loopback port it picks) that builds the environment from the same ``env.source`` and
  ``env.kwargs``, and stops it at the end of the run. If it dies, the episodes it was playing end as
  environment errors and the next episode starts a new one (logged).
- ``env.server = "tcp://HOST:PORT"``: a server someone else runs (``vf.EnvServer``); nanogrpo only
  connects. One that stops answering health checks (twice, 2 s apart) ends the episodes waiting on it.

The model is still nanogrpo's endpoint: the episode's train-client config (its URL and session key)
travels in the request, and the server's harnesses call the endpoint's token route directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from typing import Any

from nanogrpo.envs.adapters.verifiers_v1 import source
from nanogrpo.envs.adapters.verifiers_v1.traces import result_of, task_of
from nanogrpo.envs.program import AgentResult, ModelClient
from nanogrpo.errors import ConfigError

log = logging.getLogger("nanogrpo.envs")
START = "start"
STARTUP_S = 180.0
HEALTH_EVERY_S = 2.0


class ServerGone(RuntimeError):
    """The environment server stopped answering during an episode."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_address(server: str) -> str:
    """``server`` if it is ``"start"`` or a ZeroMQ TCP address; a one-line ConfigError otherwise."""
    if server == START or (server.startswith("tcp://") and ":" in server[6:]):
        return server
    raise ConfigError(f"env.server {server!r}: use \"start\" (nanogrpo starts one) or a ZeroMQ address "
                      "such as tcp://127.0.0.1:5000 (a running vf.EnvServer)")


class Remote:
    """The run's connection to its environment server (and the server, when nanogrpo started it)."""

    def __init__(self, program, client: ModelClient):
        self.program = program
        self.own = program.server == START
        self.address = program.server
        self.limits = (client.max_turns, client.max_tokens)
        self.proc: subprocess.Popen | None = None
        self.client = None
        self.restarts = 0
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ the server

    def _start(self) -> None:
        rest, kwargs = self.program.source
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        args = json.dumps({"rest": rest, "kwargs": kwargs, "limits": list(self.limits),
                           "address": self.address})
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, args], stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

    async def _connect(self) -> None:
        from verifiers.v1.serve.client import EnvClient

        async with self._lock:
            if self.client is not None and (not self.own or self.proc.poll() is None):
                return
            if self.client is not None:  # our server died: a new one
                self.restarts += 1
                log.warning("the verifiers environment server (%s) died (exit %s); starting another (%d)",
                            self.address, self.proc.returncode, self.restarts)
                await self.client.close()
                self.client = None
            if self.own:
                self._start()
            client = EnvClient(self.address)
            try:
                await client.wait_for_server_startup(timeout=STARTUP_S)
            except TimeoutError:
                await client.close()
                raise ServerGone(f"the verifiers environment server at {self.address} did not answer within "
                                 f"{STARTUP_S:g} s") from None
            self.client = client

    async def _alive(self, client) -> None:
        """Returns when the server is gone (our process exited, or two health checks failed)."""
        misses = 0
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            if self.own:
                if self.proc is not None and self.proc.poll() is not None:
                    return
                continue
            misses = 0 if await client.health(timeout=HEALTH_EVERY_S) else misses + 1
            if misses >= 2:
                return

    # ------------------------------------------------------------------ episodes

    async def run(self, row: dict[str, Any], client: ModelClient) -> AgentResult:
        await self._connect()
        env_client = self.client
        if isinstance(row.get("task"), dict):
            data = dict(row["task"])
        else:
            data = task_of(self.program.env(client), row).data.model_dump(mode="json")
        ctx = self.program.context(client)
        run = asyncio.ensure_future(env_client.run(ctx.client, ctx.model, ctx.sampling, data))
        watch = asyncio.ensure_future(self._alive(env_client))
        try:
            done, _ = await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not run.done():
                run.cancel()
        if run not in done:
            raise ServerGone(f"the verifiers environment server at {self.address} stopped answering")
        return result_of(run.result())

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def remote(program, client: ModelClient) -> Remote:
    return Remote(program, client)


def main(argv: list[str]) -> None:
    """The server nanogrpo starts: the environment of ``env.source`` / ``env.kwargs`` (resolved, pinned
    and registered as in the trainer) served at the address given."""
    args = json.loads(argv[0])
    spec, _ = source.resolve(args["rest"], args["kwargs"])
    if not isinstance(spec, dict):
        raise SystemExit("env.server=start needs an environment verifiers can build from its config "
                         "(a taskset or env id or class), not an Env built in Python")
    config = source.pin(spec, *args["limits"])
    from verifiers.v1.serve.server import EnvServer

    EnvServer.run_server(config=config, address=args["address"])


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["Remote", "ServerGone", "check_address", "remote"]
