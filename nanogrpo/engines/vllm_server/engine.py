"""``rollout.engine=vllm_server``: generation on running ``vllm serve`` processes (``rollout.servers``).

Token ids in and out: every sample is one ``POST /inference/v1/generate`` (vLLM's token-in-token-out
route; ``vllm serve --enable-scale-out``) with the prompt's token ids, and the answer holds the sampled
token ids, each token's log-prob and the **weight versions** it was sampled under (vLLM's
``weight_versions`` spans: a sample whose generation was paused for a weight update spans two). Nothing
is detokenised and tokenised again.

The same rules as the in-process engine (:mod:`nanogrpo.engines.vllm_inprocess`, whose helpers this
reuses): the log-prob convention is the server's ``--logprobs-mode`` (``raw_logprobs``: untempered;
``processed_logprobs``: tempered, over the top-k/top-p support) and a request the server would not
report exactly is refused (:func:`~nanogrpo.engines.vllm_inprocess.check_convention`); behaviour
log-probs (``behaviour_logprobs = True``: the trainer takes the clipped ratio against them); stop
strings stopped by the server (it has the tokenizer) and cut by nanogrpo's rule
(:func:`~nanogrpo.engines.vllm_inprocess.sample_on`); multi-turn tool sessions through the generic
re-prefill session (:mod:`nanogrpo.engines.session`; the server's prefix cache makes a turn cost its
new tokens). G samples of a prompt are G requests seeded ``request_seeds`` (one seed each), spread
over the servers by :class:`~nanogrpo.engines.vllm_server.pool.ServerPool`.

Versions: the engine accepts a sample only if every span's version is an integer in
``[min_version, max_version]`` (set by the trainer: the current policy version and the staleness
bound); a sample from outside (a restarted server with its launch weights says ``"default"``) takes
its server out of the pool and is sampled again elsewhere. :meth:`ServerEngine.recording` collects
each sample's (first, last) version for the batch being built in this thread.

Routes (mixture-of-experts models, ``moe.routing_replay``): an engine over a model nanogrpo records routes
of has a ``record_routes`` attribute, set by the run's routing replay; each choice's ``routed_experts``
(base64 ``.npy``, sent by a server started with ``--enable-return-routed-experts``: ``nanogrpo vllm-serve``
adds it under ``moe.routing_replay=rollout``) is then that sample's record
(:func:`~nanogrpo.moe.routes.from_server_choice`), and a sample from a server that sends none has None:
replay drops its group and counts it (``routes_groups_dropped``). Routes that do not fit the model (another
model on that server) stop the run in one line (:class:`~nanogrpo.moe.RouteError`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nanogrpo.engines.base import Generation, SamplingParams
from nanogrpo.engines.hf import check_request
from nanogrpo.engines.stops import StopStrings
from nanogrpo.engines.vllm_inprocess import check_convention, request_seeds, sample_on
from nanogrpo.engines.vllm_server.http import ServerDown, ServerFault, ServerMissing
from nanogrpo.engines.vllm_server.pool import ServerPool
from nanogrpo.moe.families import MoeSpec
from nanogrpo.moe.routes import from_server_choice

log = logging.getLogger("nanogrpo.engines.vllm_server")


class StaleSample(ServerDown):
    """A sample came back under a weight version outside the accepted window: its server is out of sync."""


class ServerEngine:
    """The :class:`~nanogrpo.engines.base.Engine` over a :class:`ServerPool` of vLLM servers."""

    name = "vllm_server"
    owns_weights = True
    remote = True
    """The servers hold their own copy, which the trainer's loop syncs after each step
    (:mod:`~nanogrpo.engines.vllm_server.sync`), not ``load_from``."""
    behaviour_logprobs = True

    def __init__(self, pool: ServerPool, eos_ids: list[int], *, tokenizer=None,
                 tempered_logprobs: bool = False, stop_strings: bool = False, concurrency: int = 64,
                 ignore_eos: bool = False, adapters: bool = False, route_spec: MoeSpec | None = None):
        self.pool = pool
        self.adapters = adapters
        """LoRA served as an adapter (:mod:`~nanogrpo.engines.vllm_server.adapters`): each request names the
        newest version's adapter, and a sample's version is the adapter that served it."""
        self.eos_ids = list(eos_ids)
        self.tempered, self.ignore_eos = tempered_logprobs, ignore_eos
        self.tokenizer = tokenizer if stop_strings else None
        self._exe = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="vllm-server")
        self.min_version = 0
        self.max_version = 0
        self._local = threading.local()
        self._route_spec = route_spec
        """The model's routing (a mixture of experts nanogrpo records): what the servers' routes are read
        against."""
        if route_spec is not None:
            self.record_routes = False
            """Fill ``Generation.routes`` from the choices (set by the run's routing replay)."""

    # ------------------------------------------------------------------ versions

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[int, int]]]:
        """Collect (first, last) weight version of every sample this thread generates inside the block."""
        out: list[tuple[int, int]] = []
        self._local.rec = out
        try:
            yield out
        finally:
            self._local.rec = None

    def _versions(self, choice: dict, url: str, served: Any = None) -> tuple[int, int]:
        if self.adapters:
            from nanogrpo.engines.vllm_server.adapters import adapter_version

            v = adapter_version(served)
            if v is None or not self.min_version <= v <= self.max_version:
                raise StaleSample(f"{url} served adapter {served!r}, outside versions [{self.min_version}, "
                                  f"{self.max_version}]: out of sync")
            return v, v
        spans = choice.get("weight_versions") or []
        try:
            vs = [int(s["version"]) for s in spans]
        except (KeyError, TypeError, ValueError):
            vs = []
        if not vs or min(vs) < self.min_version or max(vs) > self.max_version:
            got = [s.get("version") for s in spans if isinstance(s, dict)]
            raise StaleSample(f"{url} sampled under weight version(s) {got}, outside [{self.min_version}, "
                              f"{self.max_version}]: out of sync")
        return min(vs), max(vs)

    # ------------------------------------------------------------------ generation

    def _body(self, prompt: list[int], params: SamplingParams, seed: int | None,
              stops: StopStrings | None) -> dict:
        sp: dict[str, Any] = dict(n=1, max_tokens=params.max_new_tokens, logprobs=0,
                                  skip_special_tokens=False, detokenize=bool(stops),
                                  ignore_eos=self.ignore_eos,
                                  stop_token_ids=[] if self.ignore_eos else self.eos_ids)
        if params.greedy:
            sp["temperature"] = 0.0
        else:
            sp.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1, seed=seed)
        if stops:
            sp.update(stop=list(stops.strings), include_stop_str_in_output=True,
                      spaces_between_special_tokens=False)
        return {"token_ids": list(prompt), "sampling_params": sp}

    def _one(self, body: dict, max_tokens: int, routes: bool = False) -> tuple:
        """One sample: token ids, log-probs, finish reason, (first, last) version, and its routes (None
        unless ``routes``, or none came)."""
        def ask(client):
            out = self._ask(client, body, max_tokens)
            parsed = self._parse(client, out)
            spec = self._route_spec if routes else None
            return (*parsed, None if spec is None else
                    from_server_choice(out["choices"][0], len(body["token_ids"]), spec))

        return self.pool.call(ask)

    def _ask(self, client, body: dict, max_tokens: int) -> dict:
        if not self.adapters:
            return client.generate(body, max_tokens)
        from nanogrpo.engines.vllm_server.adapters import adapter_name

        body = {**body, "model": adapter_name(self.max_version)}  # the newest adapter, named now
        try:
            return client.generate(body, max_tokens)
        except ServerMissing as e:  # it does not hold that adapter: out of sync, like a stale sample
            raise StaleSample(f"{client.url} does not serve {body['model']}: {e}") from None

    def _parse(self, client, out: dict) -> tuple[list[int], list[float], str, tuple[int, int]]:
        """One sample's token ids, log-probs, finish reason and (first, last) weight version."""
        c = out["choices"][0]
        ids = [int(t) for t in c.get("token_ids") or []]
        content = (c.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids) or \
                any(int(e["token_id"]) != t for e, t in zip(content, ids, strict=True)):
            raise ServerFault(f"{client.url}: log-probs do not match the sampled tokens")
        lps = [float(e["logprob"]) for e in content]
        ver = self._versions(c, client.url, out.get("model"))
        why = c.get("finish_reason")
        reason = "stop_string" if isinstance(c.get("stop_reason"), str) else \
            "stop" if why == "stop" and not self.ignore_eos else "length"
        return ids, lps, reason, ver

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        check_request(prompts, params)
        check_convention(params, self.tempered)
        stops = StopStrings(self.tokenizer, params.stop) \
            if self.tokenizer is not None and params.stop else None
        seeds = request_seeds(params, len(prompts) * params.n) if not params.greedy else \
            [None] * (len(prompts) * params.n)
        bodies = [self._body(prompts[i // params.n], params, seeds[i], stops)
                  for i in range(len(prompts) * params.n)]
        routes = bool(getattr(self, "record_routes", False) and not stops)  # (rows sampled on: no fit)
        t0 = time.perf_counter()
        results = list(self._exe.map(lambda b: self._one(b, params.max_new_tokens, routes), bodies))
        gen_s = time.perf_counter() - t0
        comp = [r[0] for r in results]
        lps = [r[1] for r in results]
        reasons = [r[2] for r in results]
        rec = getattr(self._local, "rec", None)
        if rec is not None:
            rec.extend(r[3] for r in results)
        if stops:
            sample_on(self.generate, prompts, params, stops, comp, lps, reasons)
        n_tok = sum(len(c) for c in comp)
        return Generation(comp, lps, reasons, stats={"generate_s": gen_s, "new_tokens": float(n_tok),
                                                     "tok_per_s": n_tok / max(gen_s, 1e-9)},
                          routes=[r[4] for r in results] if routes else None)

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict) -> None:
        raise NotImplementedError("a vLLM server gets its weights through the weight-transfer protocol: "
                                  "nanogrpo.engines.vllm_server.sync.WeightSync")

    def sample_on_server(self, slot, prompt: list[int],
                         params: SamplingParams) -> tuple[list[int], list[float]]:
        """One sample of ``prompt`` on that server (``slot`` of the pool), not spread: the sync's probe."""
        body = self._body(prompt, params, request_seeds(params, 1)[0], None)
        ids, lps, _, _ = self._parse(slot.client, self._ask(slot.client, body, params.max_new_tokens))
        return ids, lps

    def close(self) -> None:
        self._exe.shutdown(wait=False)
