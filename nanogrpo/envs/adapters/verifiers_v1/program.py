"""A verifiers 0.4 environment as an agent program (:mod:`nanogrpo.envs.program`): one
``run(row, client)`` per episode, which plays it with verifiers and answers its reward and its traces.

- **The model.** Each episode's context (``vf.ModelContext``) names verifiers' train client
  (``vf.TrainClientConfig``) pointed at nanogrpo's endpoint: verifiers renders each prompt to token ids
  with the model's own tokenizer (``renderers``) and calls the token route ``/inference/v1/generate``
  with the endpoint's session key, the trace id in ``X-Session-ID``; the endpoint records every
  request (:mod:`nanogrpo.episodes.endpoint`).
- **In process** (``env.server`` empty): ``env.run_episode(task, ctx)`` on the environment runner's
  event loop, inside ``env.serving()`` (the interception server, shared tool servers), which is held
  while any episode of the rollout runs.
- **Through an environment server** (``env.server``: ``"start"``, or a ZeroMQ address):
  :mod:`.server`.
- **What comes back**: every trace of the episode; the trainable ones (their agent is the policy:
  ``trace.agent.trainable``) give one training sequence per trainable branch (its ``token_ids``,
  ``sampled_mask``, ``logprobs``), which the rollout checks against the endpoint's record. The reward:
  the mean of the trainable traces' rewards (their weighted ``@vf.reward`` sum); success: their
  ``success`` metric when the task records one, else a reward above 0; the traces' metrics go to the
  episode's info. An episode verifiers reports failed (``episode.ok`` false: a hook raised, a
  deadline passed, the harness crashed) raises here: the run counts it (``env_error``) and trains
  nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from nanogrpo.envs.adapters.verifiers_v1 import source
from nanogrpo.envs.adapters.verifiers_v1.traces import result_of, task_of
from nanogrpo.envs.program import AgentResult, ModelClient


def unbind_renderers_lock() -> None:
    """A fresh ``renderers.client._max_prompt_len_lock`` when the one there is bound to another event loop.

    renderers 0.1 keeps that ``asyncio.Lock`` once per process (it guards the first ``GET /v1/models``
    of each endpoint); contended once, it belongs to that loop, and every contended model call from another
    loop (the next run in the process: ``nanogrpo.train`` called twice, a notebook, the tests) fails with
    "bound to a different event loop" (a 502 to the harness, the episode lost)."""
    try:
        from renderers import client as rc
    except ImportError:
        return
    lock = getattr(rc, "_max_prompt_len_lock", None)
    bound = getattr(lock, "_loop", None)
    if isinstance(lock, asyncio.Lock) and bound is not None and bound is not asyncio.get_running_loop():
        rc._max_prompt_len_lock = asyncio.Lock()


PER_CORE = 2
"""Episodes at once per CPU core when each turn starts a harness process here
(:meth:`V1Program.episodes_at_once`)."""


class V1Program:
    """One verifiers environment for every episode of a run (the adapters' programs are shared)."""

    def __init__(self, spec, options: dict[str, Any], server: str = "",
                 source_args: tuple[str, dict] = ("", {})):
        self.spec = spec
        """The raw EnvConfig (a dict) or an Env built from Python."""
        self.options = options
        self.server = server
        self.source = source_args
        """``(rest, kwargs)`` of ``verifiers:REST``: what a server nanogrpo starts resolves again."""
        self._envs: dict[tuple[int, int], Any] = {}
        self._serving: contextlib.AsyncExitStack | None = None
        self._users = 0
        self._lock: asyncio.Lock | None = None
        self._remote = None
        self.episodes = 0

    # ------------------------------------------------------------------ the env

    def env(self, client: ModelClient):
        """The env for the run's limits (built once per pair of limits)."""
        key = (client.max_turns, client.max_tokens)
        if key not in self._envs:
            if not isinstance(self.spec, dict):
                self._envs[key] = self.spec
            else:
                self._envs[key] = source.build(source.pin(self.spec, *key))
        return self._envs[key]

    def context(self, client: ModelClient):
        v1 = source.vf()
        cfg = v1.TrainClientConfig(base_url=client.base_url, api_key_var="NANOGRPO_UNUSED_KEY",
                                   headers={"Authorization": f"Bearer {client.session_key}"},
                                   renderer_model_name=client.tokenizer or client.model,
                                   renderer=self.options.get("renderer"))
        return v1.ModelContext(model=client.model, client=cfg, sampling=v1.SamplingConfig())

    @contextlib.asynccontextmanager
    async def serving(self, env):
        """``env.serving()`` held while any episode runs (entered by the first, left by the last)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._users == 0:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(env.serving())
                self._serving = stack
            self._users += 1
        try:
            yield
        finally:
            async with self._lock:
                self._users -= 1
                if self._users == 0 and self._serving is not None:
                    stack, self._serving = self._serving, None
                    await stack.aclose()

    def episodes_at_once(self) -> int | None:
        """How many episodes this machine can run at once (:func:`nanogrpo.envs.program.episodes_at_once`):
        two per CPU core this process may use when a seat's harness is a program started on this machine
        for each turn (a runtime on this machine, ``subprocess`` or a container, and a harness that is not
        the in-process ``nanogrpo-chat``): each start is seconds of CPU, and a harness waits on the model
        between starts (one per core left the cores idle then; docs/figures.md). None (no bound)
        otherwise, and for an environment server elsewhere (``env.server`` an address)."""
        if self.server and self.server != "start":
            return None
        try:
            local = source.local_harness_seats(self.spec)
        except Exception:  # noqa: BLE001 - a config verifiers reads differently: no bound, as without this
            return None
        return PER_CORE * source.usable_cpus() if local else None

    # ------------------------------------------------------------------ episodes

    async def run(self, row: dict[str, Any], client: ModelClient) -> AgentResult:
        self.episodes += 1
        unbind_renderers_lock()
        if self.server:
            from nanogrpo.envs.adapters.verifiers_v1.server import remote

            if self._remote is None:
                self._remote = remote(self, client)
            return await self._remote.run(row, client)
        env = self.env(client)
        task = task_of(env, row)
        async with self.serving(env):
            episode = await env.run_episode(task, self.context(client))
        return result_of(episode)

    async def close(self) -> None:
        if self._remote is not None:
            remote, self._remote = self._remote, None
            await remote.close()

    def __repr__(self) -> str:
        what = self.spec.get("taskset", {}).get("id") if isinstance(self.spec, dict) else repr(self.spec)
        return f"verifiers-v1({what}, {f'server {self.server}' if self.server else 'in process'})"


__all__ = ["V1Program"]
