"""Multi-turn episodes with an environment: the model plays, the environment answers, until it is done.

For ``len(rows) * n`` episodes at once (row-major, as ``Engine.generate``), ``n`` per row (a GRPO group):

1. each episode gets a fresh environment (:class:`~nanogrpo.envs.runner.EnvRunner`) and ``reset(row)``;
   its first observation, rendered with the chat template (:mod:`nanogrpo.episodes.render`), is the
   prompt. A group with an environment that fails to start, or a prompt over ``max_prompt_tokens``, is
   dropped whole (counted: ``env/groups_dropped``): GRPO needs its ``n`` episodes;
2. every live episode samples a turn through a :class:`~nanogrpo.engines.base.TurnSession` (the
   engine's own, keeping the KV cache across turns, or the generic re-prefill one) until EOS or its
   remaining token budget (``max_new_tokens`` over the whole episode);
3. each turn that ended at EOS goes to its environment's ``step`` (all episodes of the step
   concurrently, under the deadline); the answer's observation is rendered (the close of the model's
   message, the new message(s), the generation prompt: :meth:`ChatRenderer.after_turn`), fed to the
   episode as context (never trained on), and the episode samples its next turn.

An episode ends (``finish_reason``): ``done`` (the environment said so), ``length`` (its sampled tokens
reached ``max_new_tokens``), ``max_turns``, or, with ``error_penalty`` as its return, ``env_error``
(the environment raised, or answered something that is not a step result: None, a non-finite reward
included), ``env_timeout`` (past the deadline) or ``too_long`` (an observation over
``max_observation_tokens``). The run goes on in every case.

Observations are bounded by bytes before they are tokenised: one of more bytes of text than its token
limit times the tokenizer's longest token (:func:`~nanogrpo.episodes.render.token_bytes`) cannot fit and
is refused as it stands (``too_long``; a first observation so: its group is dropped and counted as
``env/prompts_too_long``), so a 10 MB observation costs a length check, not a tokenisation.

Its return: ``sum_t discount**t * r_t`` over the rewards of its turns. Out comes an
:class:`EpisodeGeneration`: per episode the completion tokens (sampled and fed, in order), log-probs
(0 for fed tokens), the loss mask (True for sampled tokens only), the finish reason, and what the
rewards see (``env_reward``, ``success``, ``turns``, ``turn_rewards``); the groups kept, their
prompts, and the step's ``env/…`` metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from nanogrpo.engines.base import Engine, MultiTurnGeneration, SamplingParams
from nanogrpo.engines.session import open_session
from nanogrpo.envs.base import EnvResultError, ObservationTooLong, as_step_result, text_bytes
from nanogrpo.envs.runner import Outcome
from nanogrpo.episodes.render import ChatRenderer, token_bytes
from nanogrpo.episodes.settings import EpisodeSettings, longest_episode

FINISH_REASONS = ("done", "length", "max_turns", "env_error", "env_timeout", "too_long")
BROKEN = ("env_error", "env_timeout", "too_long")


@dataclass
class Episodes:
    """A run's environment episodes: the runner and the settings; what ``rollout(env=...)`` and the
    evaluation take."""

    runner: Any
    """An :class:`~nanogrpo.envs.runner.EnvRunner`."""
    settings: EpisodeSettings

    @classmethod
    def from_config(cls, cfg, env: Any = None) -> Episodes | None:
        """From a :class:`~nanogrpo.config.Config` (``env``: an object from Python instead of
        ``env.source``); None when there is no environment."""
        from nanogrpo.envs.runner import EnvRunner

        runner = EnvRunner.from_config(cfg, env)
        if runner is None:
            return None
        from nanogrpo.episodes.agents import AgentEpisodes

        agents = AgentEpisodes.from_runner(runner, cfg)  # agent programs (verifiers too): the endpoint
        return agents if agents is not None else cls(runner, EpisodeSettings.from_config(cfg))

    def generate(
        self, engine: Engine, tokenizer, rows: list[dict], params: SamplingParams, version: int = 0
    ) -> EpisodeGeneration:
        return generate_episodes(engine, tokenizer, self.runner, rows, params, self.settings)

    def longest(self, max_new: int) -> int:
        return longest_episode(self.settings, max_new)

    def metrics_of_nothing(self) -> dict[str, float]:
        """The step's ``env/…`` metrics when it played no episode (no row on this rank)."""
        return env_metrics([], [], 0, 0, 0.0)

    def close(self) -> None:
        self.runner.close()


@dataclass
class EpisodeGeneration(MultiTurnGeneration):
    """A :class:`MultiTurnGeneration` of environment episodes, for the groups kept."""

    kept: list[int] = field(default_factory=list)
    """Indices (into the rows given) of the groups kept, in order."""
    prompt_ids: list[list[int]] = field(default_factory=list)
    """Per episode (of the kept groups), its prompt: the first observation rendered."""
    env_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Episode:
    env: Any = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    sampled: int = 0
    fed: int = 0
    finish: str = "length"
    success: bool | None = None
    error: str = ""


def episode_return(rewards: list[float], discount: float) -> float:
    return sum(r * discount**t for t, r in enumerate(rewards))


@dataclass
class _Started:
    """The step's episodes once their environments were made and reset: the groups kept (every episode's
    first observation rendered within ``max_prompt_tokens``) and what was dropped."""

    eps: list[_Episode]
    """The kept groups' episodes, in order."""
    kept: list[int]
    prompts: list[list[list[int]]]
    """Per kept group, its episodes' prompts."""
    dropped: int
    long_prompts: int
    dropped_envs: list[Any]
    """The environments of the dropped groups (closed with the others)."""


def generate_episodes(
    engine: Engine, tokenizer, runner, rows: list[dict], params: SamplingParams, settings: EpisodeSettings
) -> EpisodeGeneration:
    """``params.n`` episodes per row (see the module docstring)."""
    render = ChatRenderer(tokenizer, settings.template, settings.system_prompt)
    per_token = token_bytes(tokenizer)
    prompt_cap = settings.max_prompt_tokens * per_token
    obs_cap = settings.max_observation_tokens * per_token
    t0 = time.perf_counter()
    st = _start(runner, render, rows, params.n, settings, prompt_cap, obs_cap)
    t_env = time.perf_counter() - t0
    t_gen = 0.0
    if st.eps:
        t_gen, t_step = _run(engine, tokenizer, runner, render, st, params, settings, obs_cap)
        t_env += t_step
    elif st.dropped_envs:
        runner.close_envs(st.dropped_envs)
    returns = _returns(st.eps, settings)
    out = _generation(st, returns, t_gen, t_env)
    runner.say_if_all_failed(out.env_metrics, [e.error for e in st.eps])
    return out


def _start(runner, render: ChatRenderer, rows: list[dict], n: int, settings: EpisodeSettings,
           prompt_cap: int, obs_cap: int) -> _Started:
    """An environment per episode, made and reset with its row; the groups whose ``n`` first
    observations all render within ``max_prompt_tokens`` are kept."""
    made = runner.make(len(rows) * n, {"max_observation_bytes": max(prompt_cap, obs_cap)})
    eps = [_Episode(env=o.value if o.ok else None) for o in made]
    live_idx = [i for i, e in enumerate(eps) if e.env is not None]
    answers = runner.call([eps[i].env for i in live_idx], "reset", [rows[i // n] for i in live_idx])
    starts = dict(zip(live_idx, answers, strict=True))
    kept, prompts, dropped, long_prompts = [], [], 0, 0
    for g in range(len(rows)):
        ids, too_long = _group_prompts(runner, render, [starts.get(i) for i in range(g * n, (g + 1) * n)],
                                       prompt_cap)
        if too_long or (len(ids) == n and max(map(len, ids)) > settings.max_prompt_tokens):
            long_prompts += 1
        elif len(ids) < n:
            dropped += 1
        else:
            kept.append(g)
            prompts.append(ids)
    kept_set = set(kept)
    dropped_envs = [e.env for i, e in enumerate(eps) if e.env is not None and i // n not in kept_set]
    return _Started([eps[i] for g in kept for i in range(g * n, (g + 1) * n)], kept, prompts, dropped,
                    long_prompts, dropped_envs)


def _group_prompts(runner, render: ChatRenderer, starts: list, prompt_cap: int
                   ) -> tuple[list[list[int]], bool]:
    """A group's prompts, its episodes' first observations rendered, up to the first episode that did not
    start (its environment failed, or answered no observation); True when one cannot fit in
    ``max_prompt_tokens`` (refused before it is tokenised)."""
    ids: list[list[int]] = []
    for o in starts:
        if o is not None and o.status == "too_long":  # an adapter refused it before reading it whole
            return ids, True
        if o is None or not o.ok:
            break
        try:
            obs = _observation(o.value)
            if text_bytes(render.messages(obs), prompt_cap) > prompt_cap:
                return ids, True  # cannot fit in max_prompt_tokens: not tokenised
            ids.append(render.prompt(obs))
        except EnvResultError as e:
            runner.report("reset", _bad(e))
            break
    return ids, False


def _run(engine: Engine, tokenizer, runner, render: ChatRenderer, st: _Started, params: SamplingParams,
         settings: EpisodeSettings, obs_cap: int) -> tuple[float, float]:
    """The kept episodes played to their end through one turn session, then every environment closed;
    returns (generation seconds, environment seconds)."""
    longest = longest_episode(settings, params.max_new_tokens)
    if all(all(p == grp[0] for p in grp) for grp in st.prompts):  # the engine prefills each prompt once
        session = open_session(engine, tokenizer, [grp[0] for grp in st.prompts], params, longest)
    else:
        session = open_session(
            engine, tokenizer, [p for grp in st.prompts for p in grp], replace(params, n=1), longest
        )
    t_env = 0.0
    try:
        t_gen, t_env = _play(session, runner, render, tokenizer, st.eps, params.max_new_tokens, settings,
                             obs_cap)
    finally:
        session.close()
        t1 = time.perf_counter()
        runner.close_envs([e.env for e in st.eps] + st.dropped_envs)
        t_env += time.perf_counter() - t1
    return t_gen, t_env


def _returns(eps: list[_Episode], settings: EpisodeSettings) -> list[float]:
    """Each episode's return (``error_penalty`` for a broken one); its success settled (a broken one
    failed; else what the environment said, or a positive return)."""
    returns = [
        settings.error_penalty if e.finish in BROKEN else episode_return(e.rewards, settings.discount)
        for e in eps
    ]
    for e, ret in zip(eps, returns, strict=True):
        if e.finish in BROKEN:
            e.success = False
        elif e.success is None:
            e.success = ret > 0
    return returns


def _generation(st: _Started, returns: list[float], t_gen: float, t_env: float) -> EpisodeGeneration:
    eps = st.eps
    out = EpisodeGeneration(
        completion_ids=[e.ids for e in eps],
        logprobs=[e.logprobs for e in eps],
        finish_reasons=[e.finish for e in eps],
        stats={"generate_s": t_gen, "env_s": t_env},
        loss_masks=[e.mask for e in eps],
        infos=[
            {
                "env_reward": r,
                "success": bool(e.success),
                "turns": e.turns,
                "turn_rewards": list(e.rewards),
                "num_turns": len(e.turns),
                "env_error": e.error or None,
            }
            for e, r in zip(eps, returns, strict=True)
        ],
        kept=st.kept,
        prompt_ids=[p for grp in st.prompts for p in grp],
    )
    out.env_metrics = env_metrics(eps, returns, st.dropped, st.long_prompts, t_env)
    return out


def _observation(value: Any):
    from nanogrpo.envs.base import check_observation

    obs = check_observation(value, "reset")
    if obs is None:
        raise EnvResultError("reset answered None: answer the first observation (the prompt)")
    return obs


def _bad(e: Exception) -> Outcome:
    return Outcome("error", error=str(e))


def _play(
    session, runner, render: ChatRenderer, tokenizer, eps: list[_Episode], budget: int, s: EpisodeSettings,
    obs_cap: int,
) -> tuple[float, float]:
    """Turns until every episode has ended; returns (generation seconds, environment seconds).
    ``obs_cap``: the most bytes of text an observation may hold (more cannot fit: refused untokenised)."""
    rows, feeds, budgets = list(range(len(eps))), [[] for _ in eps], [budget] * len(eps)
    t_gen = t_env = 0.0
    while rows:
        t0 = time.perf_counter()
        gen = session.step(rows, feeds, budgets)
        t_gen += time.perf_counter() - t0
        acting: list[int] = []
        for r, ids, lps, why in zip(rows, gen.completion_ids, gen.logprobs, gen.finish_reasons, strict=True):
            e = eps[r]
            e.ids += ids
            e.logprobs += [float(x) for x in lps]
            e.mask += [True] * len(ids)
            e.sampled += len(ids)
            e.turns.append(
                {
                    "action": tokenizer.decode(ids, skip_special_tokens=True),
                    "observation": None,
                    "reward": None,
                }
            )
            if why == "length":
                e.finish = "length"
            else:
                acting.append(r)
        t0 = time.perf_counter()
        answers = runner.call(
            [eps[r].env for r in acting], "step", [eps[r].turns[-1]["action"] for r in acting]
        )
        t_env += time.perf_counter() - t0
        rows, feeds, budgets = [], [], []
        for r, o in zip(acting, answers, strict=True):
            e = eps[r]
            if not o.ok:
                e.finish = {"timeout": "env_timeout", "too_long": "too_long"}.get(o.status, "env_error")
                e.error = o.error
                continue
            try:
                res = as_step_result(o.value)
            except EnvResultError as err:
                runner.report("step", _bad(err))
                e.finish, e.error = "env_error", str(err)
                continue
            e.rewards.append(res.reward)
            e.turns[-1].update(reward=res.reward, info=res.info)
            if isinstance(res.info.get("success"), bool):
                e.success = res.info["success"]
            if res.done:
                e.finish = "done"
                continue
            if len(e.turns) >= s.max_turns:
                e.finish = "max_turns"
                continue
            if e.sampled >= budget:
                e.finish = "length"
                continue
            obs = res.observation if res.observation is not None else ""
            size = text_bytes(obs, obs_cap)
            if size > obs_cap:  # cannot fit in max_observation_tokens: refused without tokenising it
                err = ObservationTooLong(
                    f"an observation of {'at least ' if size > obs_cap + 1 else ''}{size} bytes, over "
                    f"env.max_observation_tokens={s.max_observation_tokens} (at most {obs_cap} bytes of "
                    "text with this tokenizer): not tokenised")
                runner.report("step", _too_long_outcome(str(err)))
                e.finish, e.error = "too_long", str(err)
                e.turns[-1]["observation"] = _preview(obs)
                continue
            try:
                fed = render.after_turn(obs)
            except EnvResultError as err:
                runner.report("step", _bad(err))
                e.finish, e.error = "env_error", str(err)
                continue
            e.turns[-1]["observation"] = obs
            if len(fed) > s.max_observation_tokens:
                msg = (f"an observation of {len(fed)} tokens, over "
                       f"env.max_observation_tokens={s.max_observation_tokens}")
                runner.report("step", _too_long_outcome(msg))
                e.finish, e.error = "too_long", msg
                continue
            e.ids += fed
            e.logprobs += [0.0] * len(fed)
            e.mask += [False] * len(fed)
            e.fed += len(fed)
            rows.append(r)
            feeds.append(fed)
            budgets.append(budget - e.sampled)
    return t_gen, t_env


def _too_long_outcome(error: str) -> Outcome:
    return Outcome("too_long", error=error)


def _preview(obs, chars: int = 200) -> str:
    """The head of an observation refused as too long (what the rewards' ``turns`` keep of it)."""
    parts = [obs] if isinstance(obs, str) else [str(m.get("content", "")) for m in obs[:4]]
    text = "".join(p[:chars] for p in parts)
    return text[:chars] + "… [not shown: over env.max_observation_tokens]"


def env_metrics(
    eps: list[_Episode], returns: list[float], dropped: int, long_prompts: int, env_s: float
) -> dict[str, float]:
    """The step's ``env/…`` metrics (metrics.jsonl)."""
    k = max(len(eps), 1)
    rewards = [r for e in eps for r in e.rewards]
    out = {
        "env/episodes": len(eps),
        "env/turns_mean": sum(len(e.turns) for e in eps) / k,
        "env/episode_tokens_mean": sum(len(e.ids) for e in eps) / k,
        "env/sampled_tokens_mean": sum(e.sampled for e in eps) / k,
        "env/observation_tokens_mean": sum(e.fed for e in eps) / k,
        "env/turn_reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "env/return_mean": sum(returns) / k if eps else float("nan"),
        "env/success_rate": sum(bool(e.success) for e in eps) / k if eps else float("nan"),
        "env/groups_dropped": dropped,
        "env/prompts_too_long": long_prompts,
        "env/failed": sum(e.finish in BROKEN for e in eps),
        "env/time_s": env_s,
    }
    for why in FINISH_REASONS:
        out[f"env/finish/{why}"] = sum(e.finish == why for e in eps)
    return out
