"""First contact with the servers of ``rollout.servers``, before the first weight sync.

- **Reachable** within ``vllm_server.connect_wait_s`` (default 15 s): each server's ``/health`` is asked
  once a second until it answers. None answering: the run stops with one line naming each URL and why
  (``connection refused (nothing listens there)``, a timeout, an HTTP error). Some answering: the run
  starts on those and says which are missing (they are probed and taken back, synced, when they answer).
  Servers still loading a large model take minutes: give them ``vllm_server.connect_wait_s=900`` (or start
  the trainer once ``nanogrpo vllm-serve`` prints its ``train with:`` line).
- **The trainer's model**: each server reports its model's shape through nanogrpo's worker extension
  (:mod:`nanogrpo.transfer.worker`, which ``nanogrpo vllm-serve`` loads); a server with another model
  (vocabulary, depth or widths differ) stops the run with one line before any weights move. A server
  started without the extension cannot say: a warning says the check was skipped.
- **Routes**, where the run replays the engine's (``moe.routing_replay=rollout``): each server answering at
  the start samples one token, and one that sends no ``routed_experts`` with it (started without
  ``--enable-return-routed-experts``, which ``nanogrpo vllm-serve`` adds for a MoE model under that mode)
  stops the run with one line before the model loads (:func:`preflight`). A server that joins later
  unchecked and sends none costs the groups it sampled (dropped and counted, ``routes_groups_dropped``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nanogrpo.engines.vllm_server.http import ServerFault
from nanogrpo.engines.vllm_server.pool import ServerPool
from nanogrpo.errors import NanoGRPOError

log = logging.getLogger("nanogrpo.engines.vllm_server")


class ServerUnreachable(NanoGRPOError):
    """No server of ``rollout.servers`` answered at the start of the run."""


class ServerModelMismatch(NanoGRPOError):
    """A server serves another model than the trainer's."""


class ServerWithoutRoutes(NanoGRPOError):
    """A server returns no mixture-of-experts routes to a run that replays them."""


def connect(pool: ServerPool, wait_s: float, facts: dict[str, Any] | None = None,
            lora: tuple[int, int] | None = None, clock=time.monotonic, sleep=time.sleep) -> list[str]:
    """Wait up to ``wait_s`` seconds for every server to answer ``/health``; check the model of those
    that do against ``facts`` (:func:`~nanogrpo.transfer.worker.model_facts` of the trainer's) and, for a
    LoRA run serving its adapter, ``lora`` = (rank, adapters held at once) against the server's LoRA
    settings. Returns the URLs that did not answer (taken out of the pool, to be taken back when they
    do)."""
    deadline = clock() + wait_s
    waiting = list(pool.slots)
    why: dict[str, str] = {}
    while True:
        for slot in list(waiting):
            reason = slot.client.health(timeout=max(1.0, min(5.0, deadline - clock())))
            if reason is None:
                waiting.remove(slot)
                check_model(slot, facts, lora)
            else:
                why[slot.url] = reason.split(": ", 1)[-1]
        if not waiting or clock() >= deadline:
            break
        sleep(1.0)
    if len(waiting) == len(pool.slots):
        raise ServerUnreachable(
            "no vLLM server of rollout.servers answers after " + f"{wait_s:.0f} s: "
            + "; ".join(f"{s.url}: {why.get(s.url, '?')}" for s in waiting)
            + ". Start them first (nanogrpo vllm-serve), or give them longer: vllm_server.connect_wait_s=900")
    for slot in waiting:
        pool.mark_out(slot, f"does not answer after {wait_s:.0f} s ({why.get(slot.url, '?')}); "
                            "taken back once it answers and is synced")
    return [s.url for s in waiting]


def preflight(cfg) -> None:
    """Before any model is loaded: at least one server of ``cfg.rollout.servers`` answers within
    ``vllm_server.connect_wait_s`` (else :class:`ServerUnreachable`, one line naming each URL and why), so
    that a dead port is said in seconds, not after the model has loaded. The model check comes later,
    with the trainer's model (:func:`connect`). Under ``moe.routing_replay=rollout`` each answering server
    must return routes (:func:`check_routes`)."""
    from nanogrpo.engines.vllm_server.http import ServerClient

    pool = ServerPool([ServerClient(u) for u in cfg.rollout.servers])
    try:
        missing = connect(pool, cfg.vllm_server.connect_wait_s)
        if cfg.moe.routing_replay == "rollout":
            for slot in pool.slots:
                if slot.url not in missing:
                    check_routes(slot)
    finally:
        for s in pool.slots:
            s.client.close()


def check_model(slot, facts: dict[str, Any] | None, lora: tuple[int, int] | None = None) -> None:
    """Raise :class:`ServerModelMismatch` when the server's model differs from ``facts``, or (``lora``)
    it cannot serve the run's adapter."""
    from nanogrpo.transfer.worker import differences

    if not facts and lora is None:
        return
    try:
        info = slot.client.model_info()
    except ServerFault as e:
        log.warning("could not ask %s for its model (%s); not checked before the first sync", slot.url, e)
        return
    if info is None:
        log.warning("%s was started without nanogrpo's worker extension (--worker-extension-cls "
                    "nanogrpo.transfer.worker.NanoGRPOWorkerExtension, as nanogrpo vllm-serve starts it): "
                    "its model is not checked against the trainer's before the first sync", slot.url)
        return
    if lora is not None:
        check_lora(slot.url, info.get("lora"), *lora)
    diff = differences(facts or {}, info.get("facts") or {})
    if diff:
        raise ServerModelMismatch(
            f"the vLLM server at {slot.url} serves another model than the trainer's ({'; '.join(diff)}; "
            f"it serves {info.get('model', '?')}): start it with the run's model "
            "(nanogrpo vllm-serve --config <the run's config>)")


def check_lora(url: str, got: dict[str, Any] | None, rank: int, held: int) -> None:
    """A server that serves the run's adapter: LoRA on, its rank at least the adapter's, room for
    ``held`` adapters at once (the staleness window, plus the one loading), runtime loading allowed."""
    from nanogrpo.models.lora import vllm_max_lora_rank

    fix = ("start it with nanogrpo vllm-serve (the run's config: LoRA on at its rank), or send merged "
           "weights: vllm_server.lora_sync=merged")
    if got is None:
        raise ServerModelMismatch(f"the vLLM server at {url} has LoRA off, but this LoRA run serves its "
                                  f"adapter there: {fix}")
    why = []
    if got.get("max_lora_rank", 0) < rank:
        why.append(f"--max-lora-rank {got.get('max_lora_rank')} < the adapter's rank {rank} "
                   f"(use {vllm_max_lora_rank(rank)})")
    if got.get("max_loras", 0) < held:
        why.append(f"--max-loras {got.get('max_loras')} < {held} (max_staleness + 2 adapters at once)")
    if not got.get("runtime_updating"):
        why.append("VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set (adapters cannot be loaded at run time)")
    if why:
        raise ServerModelMismatch(f"the vLLM server at {url} cannot serve this run's adapter: "
                                  f"{'; '.join(why)}: {fix}")


def check_routes(slot) -> None:
    """Raise :class:`ServerWithoutRoutes` when the server sends no ``routed_experts`` with a sample (one
    greedy token after a one-token prompt); a server that cannot be asked is left to the first batch."""
    body = {"token_ids": [0], "sampling_params": {"n": 1, "max_tokens": 1, "temperature": 0.0}}
    try:
        out = slot.client.generate(body, 1)
    except ServerFault as e:
        log.warning("could not ask %s for a sample (%s); whether it returns MoE routes is not checked before "
                    "the first batch", slot.url, e)
        return
    choices = out["choices"]
    if not choices or not isinstance(choices[0], dict) or choices[0].get("routed_experts") is None:
        raise ServerWithoutRoutes(
            f"moe.routing_replay=rollout: the vLLM server at {slot.url} returns no MoE routes (started "
            "without --enable-return-routed-experts, or its model is dense): start it with nanogrpo "
            "vllm-serve --config <the run's config>, or set moe.routing_replay=policy")
