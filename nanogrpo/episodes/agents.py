"""Episodes of agent programs (:mod:`nanogrpo.envs.program`): each runs once per episode and calls the
model through the OpenAI-compatible endpoint (:mod:`nanogrpo.episodes.endpoint`); the episode's training
sequences are assembled from what the endpoint recorded (:mod:`nanogrpo.episodes.trajectory`).

For ``len(rows) * n`` episodes (``n`` per row, a GRPO group), one rollout:

1. each episode gets a key of its own on the endpoint (started once, on 127.0.0.1, for the run) and
   its program is called, ``run(row, client)``, all of them at once (sync programs in the
   environment runner's worker threads, ``async def`` ones on its event loop) under ``env.timeout_s``
   for the whole episode;
2. meanwhile this thread runs the engine for the requests they make, batched;
3. each episode's key is closed (later requests with it are refused) and its records become
   sequences: the last one is the episode's row in the batch; earlier ones (the program rewrote its
   history) are extra rows with the same advantage (``agent/extra_sequences``).

Finish reasons: ``done`` (the program answered), ``max_turns`` / ``length`` / ``too_long`` (it
answered, after the endpoint refused a request past ``env.max_turns`` model calls, past the episode's
``rollout.max_new_tokens`` sampled tokens, or past the context), and, with ``env.error_penalty`` as
the return, ``env_error`` (it raised, answered no reward or a non-finite one), ``env_timeout`` and
``mismatch``: the program answered its own record of the tokens to train (``AgentResult.sequences``,
e.g. verifiers 0.4's traces) and a sampled span in it is not what the endpoint sampled (ids, the prompt
before them, log-probs); that episode trains nothing (``agent/mismatched_sequences``). A program's own
record that matches is what is trained, with the endpoint's log-probs.

Programs whose client is shared by many episodes (verifiers 0.4's train client) call the token route
with the endpoint's session key and name their episode in ``X-Session-ID``; the sessions an episode
claims (``AgentResult.sessions``) are its requests; those no episode claims when the rollout ends (a
failed episode's, a straggler's) are counted (``agent/unclaimed_requests``), never trained.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from nanogrpo.engines.base import Engine, MultiTurnGeneration, SamplingParams
from nanogrpo.envs.program import ModelClient, as_agent_result, episodes_at_once, is_program
from nanogrpo.envs.runner import Outcome
from nanogrpo.episodes.endpoint import Endpoint, EndpointSettings
from nanogrpo.episodes.settings import AgentSettings
from nanogrpo.episodes.trajectory import Sequence, assemble, check_claimed

log = logging.getLogger("nanogrpo.envs")

FINISH_REASONS = ("done", "length", "max_turns", "too_long", "env_error", "env_timeout", "mismatch")
BROKEN = ("env_error", "env_timeout", "mismatch")


@dataclass
class AgentGeneration(MultiTurnGeneration):
    """Agent episodes in the shape of the environment episodes' generation (one row per episode), plus
    the sequences of episodes whose program rewrote its history."""

    kept: list[int] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    env_metrics: dict[str, float] = field(default_factory=dict)
    extra_sequences: list[list[Sequence]] = field(default_factory=list)
    """Per episode, its sequences before the last (usually none)."""


@dataclass
class _Episode:
    seqs: list[Sequence]
    finish: str
    reward: float
    success: bool
    requests: int
    refused: int
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    mismatched: int = 0


class AgentEpisodes:
    """A run's agent programs: the environment runner that calls them, the endpoint they call."""

    def __init__(self, runner, settings: AgentSettings, limit: int | None = None):
        self.runner = runner
        """An :class:`~nanogrpo.envs.runner.EnvRunner` whose factory makes programs."""
        self.settings = settings
        self.limit = limit
        """Episodes running at once (``env.max_concurrent``, or what the program says); None: all."""
        self.endpoint: Endpoint | None = None
        self.probe: Any = None
        self.tokenizer_dir: str | None = None

    @classmethod
    def from_runner(cls, runner, cfg) -> AgentEpisodes | None:
        """Agent episodes when ``runner``'s factory makes agent programs, else None."""
        probe = runner.make(1)[0]
        if not probe.ok or not is_program(probe.value):
            if probe.ok:
                runner.close_envs([probe.value])
            return None
        limit = cfg.env.max_concurrent or episodes_at_once(probe.value)
        out = cls(runner, AgentSettings.from_config(cfg), limit)
        out.probe = probe.value
        if limit is not None:
            log.info("environment %s: at most %d episodes at once (%s), each under env.timeout_s=%g s from "
                     "its start", runner.source, limit, "env.max_concurrent" if cfg.env.max_concurrent
                     else "what this machine runs of them; env.max_concurrent sets it", cfg.env.timeout_s)
        return out

    def longest(self, max_new: int) -> int:
        return self.settings.max_len

    def metrics_of_nothing(self) -> dict[str, float]:
        """The step's metrics when it ran no episode (no row on this rank)."""
        return agent_metrics([], None, 0.0, 0)

    def close(self) -> None:
        """The endpoint stops; the first program made gets its ``close()`` (sync or async), if it has one:
        the adapters' programs are one object for every episode, holding what the run shares (an
        environment server)."""
        if self.endpoint is not None:
            self.endpoint.stop()
            self.endpoint = None
        if self.probe is not None:
            self.runner.close_envs([self.probe])
            self.probe = None
        self.runner.close()
        if self.tokenizer_dir is not None:
            import shutil

            shutil.rmtree(self.tokenizer_dir, ignore_errors=True)
            self.tokenizer_dir = None

    def _tokenizer_source(self, tokenizer) -> str:
        """Where a program loads the engine's tokenizer from (``ModelClient.tokenizer``): its name or
        directory; a generic fast tokenizer (the embedded char-level one) saved alone in a directory of
        the run's (``AutoTokenizer`` would take the model's family class from a ``config.json`` beside it
        and replace its pre-tokenizer: the same text, other ids)."""
        from nanogrpo.models.load import GENERIC_TOKENIZER_CLASSES

        if type(tokenizer).__name__ not in GENERIC_TOKENIZER_CLASSES:
            return str(getattr(tokenizer, "name_or_path", "") or "")
        if self.tokenizer_dir is None:
            import tempfile

            self.tokenizer_dir = tempfile.mkdtemp(prefix="nanogrpo-tokenizer-")
            tokenizer.save_pretrained(self.tokenizer_dir)
        return self.tokenizer_dir

    def _endpoint(self, engine: Engine, tokenizer, params: SamplingParams) -> Endpoint:
        s = self.settings
        if self.endpoint is None:
            self.endpoint = Endpoint(engine, tokenizer, params, EndpointSettings(
                max_len=s.max_len, max_new_tokens=params.max_new_tokens, vocab_size=len(tokenizer),
                max_turns=s.max_turns, max_body_bytes=s.max_body_bytes, model_name=s.model_name,
                template=s.template)).start()
        ep = self.endpoint
        ep.batcher.engine, ep.batcher.params = engine, replace(params, n=1)
        return ep

    def generate(self, engine: Engine, tokenizer, rows: list[dict],
                 params: SamplingParams, version: int = 0) -> AgentGeneration:
        """``params.n`` episodes per row (see the module docstring); ``version``: the policy version
        the engine samples under (the token route says it)."""
        n = params.n
        ep = self._endpoint(engine, tokenizer, params)
        ep.version = version
        t0 = time.perf_counter()
        made = self.runner.make(len(rows) * n)
        keys = [ep.open_episode() for _ in made]
        ep.open_sessions()
        fns, is_async = [], []
        live = _Live()
        source = self._tokenizer_source(tokenizer)
        for i, (o, key) in enumerate(zip(made, keys, strict=True)):
            client = ModelClient(ep.url, key, self.settings.model_name, ep.session_key, source,
                                 self.settings.max_turns, params.max_new_tokens)
            if o.ok and is_program(o.value):
                run = o.value.run
                asy = inspect.iscoroutinefunction(run)
                fns.append(live.wrap(lambda run=run, row=rows[i // n], c=client: run(row, c), asy))
                is_async.append(asy)
            else:
                why = o.error or f"the source made {type(o.value).__name__}, not an agent program"
                fns.append(live.wrap(lambda why=why: _raise(why), False))
                is_async.append(False)
        calls0, gen0 = ep.batcher.calls, ep.batcher.generate_s
        ep.batcher.live = live.count
        done: list = []
        worker = threading.Thread(
            target=lambda: done.append(self.runner.run_all(fns, "run", is_async, limit=self.limit)),
            name="nanogrpo-agents", daemon=True)
        worker.start()
        ep.serve(until=lambda: not worker.is_alive())
        worker.join()
        outcomes = done[0] if done else []
        eps = [self._episode(o, ep.close_episode(k), ep) for o, k in zip(outcomes, keys, strict=True)]
        unclaimed = ep.close_sessions()
        ep.batcher.fail_waiting()  # a program past its deadline still asking: not for the next rollout
        wall = time.perf_counter() - t0
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        rows_out = [e.seqs[-1] if e.seqs else Sequence([eos], finish_reason="stop") for e in eps]
        ep.batcher.live = None
        calls, gen_s = ep.batcher.calls - calls0, ep.batcher.generate_s - gen0
        out = AgentGeneration(
            completion_ids=[s.completion_ids for s in rows_out], logprobs=[s.logprobs for s in rows_out],
            finish_reasons=[e.finish for e in eps],
            stats={"generate_s": gen_s, "env_s": wall},
            loss_masks=[s.loss_mask for s in rows_out],
            infos=[{"env_reward": e.reward, "success": e.success, "num_turns": e.requests,
                    "turns": [{"action": tokenizer.decode(s.completion_ids, skip_special_tokens=True)}
                              for s in e.seqs],
                    "turn_rewards": [], "sequences": len(e.seqs), "agent_info": e.info} for e in eps],
            kept=list(range(len(rows))), prompt_ids=[s.prompt_ids for s in rows_out],
            extra_sequences=[e.seqs[:-1] for e in eps])
        out.env_metrics = agent_metrics(eps, ep, wall, calls)
        out.env_metrics["agent/unclaimed_requests"] = sum(len(g.records) for g in unclaimed)
        self.runner.say_if_all_failed(out.env_metrics, [e.error for e in eps])
        return out

    def _episode(self, o, log, ep) -> _Episode:
        base = dict(seqs=assemble(log.records), requests=len(log.records), refused=log.refused)
        penalty = self.settings.error_penalty
        if o.status == "timeout":
            return _Episode(finish="env_timeout", reward=penalty, success=False, error=o.error, **base)
        try:
            if not o.ok:
                raise ValueError(o.error)
            res = as_agent_result(o.value)
        except ValueError as e:
            if o.ok:
                self.runner.report("run", _bad(str(e)))
            return _Episode(finish="env_error", reward=penalty, success=False, error=str(e), **base)
        logs = [log] + [g for g in (ep.close_session(sid) for sid in res.sessions) if g is not None]
        records = [r for g in logs for r in g.records]
        limit = next((g.limit for g in logs if g.limit), None)
        base = dict(requests=len(records), refused=sum(g.refused for g in logs), info=res.info)
        if res.sequences is None:
            seqs = assemble(log.records)
        else:
            seqs = [check_claimed(q.ids, q.mask, q.logprobs, records) for q in res.sequences]
            bad = [x for x in seqs if isinstance(x, str)]
            if bad:
                self.runner.report("run", _bad(f"a claimed sequence is not what was sampled: {bad[0]}"))
                return _Episode(seqs=[], finish="mismatch", reward=penalty, success=False, error=bad[0],
                                mismatched=len(bad), **base)
        success = res.success if res.success is not None else res.reward > 0
        return _Episode(seqs=seqs, finish=limit or "done", reward=res.reward, success=success, **base)


class _Live:
    """How many programs of a rollout are running (started, not finished): the batcher waits for all of
    them to ask before it calls the engine."""

    def __init__(self):
        self.running = 0
        self._lock = threading.Lock()

    def count(self) -> int:
        return self.running

    def _add(self, k: int) -> None:
        with self._lock:
            self.running += k

    def wrap(self, fn, is_async: bool):
        if is_async:
            async def run_async():
                self._add(1)
                try:
                    return await fn()
                finally:
                    self._add(-1)
            return run_async

        def run():
            self._add(1)
            try:
                return fn()
            finally:
                self._add(-1)
        return run


def _raise(why: str):
    raise RuntimeError(why)


def _bad(error: str) -> Outcome:
    return Outcome("error", error=error)


def agent_metrics(eps: list[_Episode], ep: Endpoint | None, wall_s: float, calls: int) -> dict[str, float]:
    """The step's ``env/…`` metrics (as environment episodes'; no group is ever dropped: a program that
    fails is its episode's ``env_error``) and ``agent/…`` ones."""
    k = max(len(eps), 1)
    seqs = [s for e in eps for s in e.seqs]
    out = {"env/episodes": len(eps),
           "env/turns_mean": sum(e.requests for e in eps) / k,
           "env/episode_tokens_mean": sum(len(s.completion_ids) for s in seqs) / k,
           "env/sampled_tokens_mean": sum(s.sampled for s in seqs) / k,
           "env/observation_tokens_mean": sum(len(s.completion_ids) - s.sampled for s in seqs) / k,
           "env/return_mean": sum(e.reward for e in eps) / k if eps else float("nan"),
           "env/success_rate": sum(e.success for e in eps) / k if eps else float("nan"),
           "env/groups_dropped": 0, "env/prompts_too_long": 0,
           "env/failed": sum(e.finish in BROKEN for e in eps),
           "env/time_s": wall_s,
           "agent/requests": sum(e.requests for e in eps),
           "agent/sequences_per_episode": len(seqs) / k,
           "agent/rewritten_episodes": sum(len(e.seqs) > 1 for e in eps),
           "agent/extra_sequences": sum(max(len(e.seqs) - 1, 0) for e in eps),
           "agent/refused_requests": sum(e.refused for e in eps),
           "agent/mismatched_sequences": sum(e.mismatched for e in eps),
           "agent/unauthorized_requests": ep.unauthorized if ep is not None else 0,
           "agent/engine_calls": calls}
    for why in FINISH_REASONS:
        out[f"env/finish/{why}"] = sum(e.finish == why for e in eps)
    return out
