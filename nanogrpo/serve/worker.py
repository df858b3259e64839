"""``nanogrpo rollout --server URL``: a generation-only worker (the seed's ``genonly`` mode).

Loop: pick up newer policy weights if the trainer published some (copied in
place into the engine), sample prompts, generate G completions each, score
them, build the batch with :class:`nanogrpo.rollout.collect.Collector` (what the
single-process trainer uses) and upload it. Each batch carries the
policy version that generated it and, in ``meta``, the worker's id and its
rollout statistics, and travels under an id of its own (``WORKER-SESSION-N``,
logged with each upload). Any number of workers may feed one server; each samples
prompts with its own seed. The server being away stalls the worker (retries
with backoff) rather than killing it; published weights it cannot load (they do not
fit its model, or are damaged) leave it generating with the weights it has while it
retries with backoff (:class:`WeightFollower`).

On the CPU a worker times ``model.cpu_linear=auto`` itself, at each start (its start line says what
it picked): it keeps no checkpoint, and nothing it decides needs reproducing, as a trainer's resume
does: the batches it uploaded carry their own log-probs, and a resumed trainer replays them from its
inbox as they were.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import secrets
import socket
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("nanogrpo.rollout.worker")


class WeightFollower:
    """Keeps an engine on the newest published weights. Weights that fail to fetch, validate or load
    are logged; the engine keeps the weights it has and the fetch is retried after a backoff that
    doubles from ``backoff_s[0]`` to ``backoff_s[1]`` (a fault on the server's side is never fatal here;
    a server away longer than the client's retry budget still is)."""

    def __init__(self, client, engine, layout, name: str = "worker",
                 backoff_s: tuple[float, float] = (5.0, 300.0), clock: Callable[[], float] = time.monotonic):
        self.client, self.engine, self.layout, self.name = client, engine, layout, name
        self.backoff_s = backoff_s
        self.clock = clock
        self.version = 0
        self.failures = 0
        self._next = 0.0

    def poll(self) -> bool:
        """Load newer weights if there are any and it is time to look; True when the engine changed."""
        from nanogrpo.serve.client import ServerError

        if self.clock() < self._next:
            return False
        try:
            got = self.client.fetch_weights(self.version, self.layout)
            if got is None:
                return False
            version, state_dict = got
            self.engine.update_weights(state_dict)
        except ServerError:
            raise
        except Exception as e:  # noqa: BLE001 - anything the published bytes can cause
            self.failures += 1
            wait = min(self.backoff_s[0] * 2 ** (self.failures - 1), self.backoff_s[1])
            self._next = self.clock() + wait
            log.warning("%s: cannot load the published weights (%s: %s); still generating with policy "
                        "version %d, trying again in %.0f s", self.name, type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "", self.version, wait)
            return False
        self.failures = 0
        self.version = version
        log.info("%s: now generating with policy version %d", self.name, version)
        return True


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanogrpo rollout", description=(
        "Generation-only worker: samples, scores and uploads rollout batches to a nanogrpo server, and "
        "loads the policy weights the trainer publishes. Token: $NANOGRPO_TOKEN or --token-file."))
    p.add_argument("--server", required=True, help="server URL, e.g. http://10.0.0.5:8471")
    p.add_argument("--config", help="config file or preset (the same one the trainer uses)")
    p.add_argument("--batches", type=int, default=0, help="stop after uploading N batches (0: run forever)")
    p.add_argument("--worker-id", help="name in batch metadata (default: HOST-PID)")
    p.add_argument("--token-file", help="file holding the shared token")
    p.add_argument("--device", help="generation device (model.device)")
    p.add_argument("--seed", type=int,
                   help="prompt sampling seed (default: train.seed mixed with the worker id)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p


def main(argv: list[str] | None = None) -> int:
    from nanogrpo.config import config_from
    from nanogrpo.data import PromptSampler, load_rows
    from nanogrpo.engines.factory import engine_for
    from nanogrpo.episodes.play import Episodes
    from nanogrpo.models.load import check_model_source, load_policy
    from nanogrpo.rewards import reward_runner
    from nanogrpo.rollout.collect import Collector
    from nanogrpo.rollout.turns import longest_context
    from nanogrpo.serve.auth import load_token
    from nanogrpo.serve.client import ServerClient
    from nanogrpo.serve.weights import WeightLayout
    from nanogrpo.tools.runner import ToolRunner

    a = build_parser().parse_args(argv)
    logging.getLogger("nanogrpo").setLevel(logging.INFO)
    overrides = list(a.overrides) + ([f"model.device={json.dumps(a.device)}"] if a.device else [])
    cfg = config_from(a.config, overrides)
    worker_id = a.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    token = load_token(a.token_file or cfg.server.token_file)
    rows = load_rows(cfg.data, cfg.data.split)
    check_model_source(cfg.model)
    seed = a.seed if a.seed is not None else \
        (cfg.train.seed * 1_000_003 + zlib.crc32(worker_id.encode())) % 2**31
    client = ServerClient(a.server, token, timeout_s=cfg.server.timeout_s, retry_for_s=cfg.server.retry_for_s)
    client.health()
    rewards = reward_runner(cfg)  # rm: reward models on this worker's device, where generation happens
    tools = ToolRunner.from_config(cfg.tools)
    episodes = Episodes.from_config(cfg)  # env.source: episodes with an environment
    try:
        model, tok, _ = load_policy(cfg.model)
        model.eval().requires_grad_(False)
        max_new = cfg.rollout.max_new_tokens
        engine = engine_for(cfg, model, tok, max_len=longest_context(cfg, tok, max_new) if episodes is None
                            else episodes.longest(max_new))
        from nanogrpo.moe import is_moe

        if is_moe(model) and hasattr(engine, "record_routes"):  # the trainer replays or measures them
            engine.record_routes = True
        follower = WeightFollower(client, engine, WeightLayout.of_model(model), f"worker {worker_id}")
        if getattr(engine, "owns_weights", False):
            del model  # vllm holds its own copy of the weights; new ones come from the relay
        sampler = PromptSampler(rows, cfg.rollout.prompts_per_step, seed=seed, shuffle=cfg.data.shuffle)
        # batch ids: unique across workers and restarts of one, the same over an upload's retries
        id_prefix = f"{re.sub(r'[^A-Za-z0-9._:-]', '_', worker_id)[:40]}-{secrets.token_hex(3)}"
        uploaded = attempts = 0
        collector = Collector(engine, tok, rewards, cfg, tools=tools, env=episodes)
        linears = getattr(engine, "cpu_linear", None)  # the fast engine's float32 CPU GEMMs
        log.info("worker %s: feeding %s (engine %s%s, %d prompts x %d samples per batch)", worker_id,
                 a.server, engine.name, f", float32 CPU linears on {linears}" if linears else "",
                 cfg.rollout.prompts_per_step, cfg.grpo.group_size)
        with torch.no_grad():
            while a.batches <= 0 or uploaded < a.batches:
                follower.poll()
                version = follower.version
                t0 = time.perf_counter()
                batch, stats = collector.collect(sampler.next_batch(), seed=(seed + attempts) % 2**31,
                                                 version=version,
                                                 more=sampler.next_batch)  # dynamic sampling's refills
                attempts += 1
                if batch is None:
                    log.info("worker %s: no group carried signal; sampling again", worker_id)
                    continue
                # behaviour_logprobs: the trainer takes the clipped ratio against our log-probs (vllm)
                batch.meta.update(worker=worker_id, worker_seq=uploaded, rollout=_clean(stats.metrics()),
                                  behaviour_logprobs=bool(getattr(engine, "behaviour_logprobs", False)),
                                  logprob_temperature=cfg.rollout.logprob_temperature(),
                                  logprob_support=list(cfg.rollout.logprob_support() or []) or None,
                                  rollout_time_s=time.perf_counter() - t0,
                                  examples=[_clean(ex) for ex in stats.examples])
                batch_id = f"{id_prefix}-{uploaded}"
                answer = client.upload(batch, batch_id)
                uploaded += 1
                log.info("worker %s: uploaded batch %s (v%d, %d seqs, reward %.3f) -> queue %s", worker_id,
                         batch_id, version, batch.num_seqs, stats.reward_mean, answer.get("depth"))
    finally:
        rewards.close()
        if tools is not None:
            tools.close()
        if episodes is not None:
            episodes.close()
        client.close()
    log.info("worker %s: done, %d batch(es) uploaded", worker_id, uploaded)
    return 0
