"""Multi-turn sessions over any engine: the generic path of :class:`~nanogrpo.engines.base.TurnSession`.

:func:`open_session` returns the engine's own session when it implements the hook
(``open_session``, keeping its KV cache across turns), else a :class:`ReprefillSession`: every
turn, each live trajectory's whole context (prompt + all it sampled and was fed) goes back to
``engine.generate`` as a prompt. Correct for every engine, and what it costs is the prefill of
the context again each turn.

Exactness: the context is kept as token ids, never as text, so the next turn reads exactly the
tokens sampled and fed so far. Whatever the engine returns is cut again here at the first stop
string (:mod:`nanogrpo.engines.stops`) and at each row's budget, so an engine that ignores stop
strings or samples past a row's budget (one ``generate`` call serves rows with different budgets)
gives the same tokens, only later: sampling is causal, tokens after the cut never influence those
before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from nanogrpo.engines.base import Engine, Generation, SamplingParams, TurnSession
from nanogrpo.engines.stops import StopStrings


def open_session(engine: Engine, tokenizer, prompts: list[list[int]], params: SamplingParams,
                 max_len: int) -> TurnSession:
    """The engine's native session if it has one, else a :class:`ReprefillSession`."""
    native = getattr(engine, "open_session", None)
    if callable(native):
        return native(prompts, params, max_len)
    return ReprefillSession(engine, tokenizer, prompts, params)


def check_step(rows: list[int], feeds: Sequence[Sequence[int]], budgets: Sequence[int],
               live: set[int]) -> None:
    """The arguments of :meth:`TurnSession.step`: one feed and one budget (>= 1) per row, rows distinct
    and still live; ValueError otherwise (every session checks this before changing anything)."""
    if not rows or len(rows) != len(feeds) or len(rows) != len(budgets):
        raise ValueError(f"step needs one feed and one budget per row: {len(rows)} rows, {len(feeds)} "
                         f"feeds, {len(budgets)} budgets")
    if len(set(rows)) != len(rows) or not set(rows) <= live:
        raise ValueError("step rows must be distinct trajectories still live in the session")
    if min(budgets) < 1:
        raise ValueError(f"every budget must be >= 1, got {min(budgets)}")


def _turn_seed(seed: int | None, turn: int) -> int | None:
    if seed is None or turn == 0:
        return seed
    return (seed * 1_000_003 + turn * 7919) % (2**31 - 1)


class ReprefillSession:
    """A :class:`TurnSession` made of ``engine.generate`` calls: one per step, each trajectory's
    whole context as its prompt. The first step samples ``params.n`` per prompt in one call (the
    engine's shared prefill applies); later steps one sample per context, seeded from
    ``params.seed`` and the step number."""

    def __init__(self, engine: Engine, tokenizer, prompts: list[list[int]], params: SamplingParams):
        self.engine = engine
        self.params = params
        self.stops = StopStrings(tokenizer, params.stop)
        self.prompts = [list(p) for p in prompts]
        self.contexts = [list(p) for p in prompts for _ in range(params.n)]
        self.live = set(range(len(self.contexts)))
        self.turn = 0

    def step(self, rows: Sequence[int], feeds: Sequence[Sequence[int]], budgets: Sequence[int]) -> Generation:
        rows = [int(r) for r in rows]
        check_step(rows, feeds, budgets, self.live)
        for r, f in zip(rows, feeds, strict=True):
            self.contexts[r].extend(int(t) for t in f)
        whole = self.turn == 0 and rows == list(range(len(self.contexts))) and not any(feeds)
        params = replace(self.params, max_new_tokens=max(budgets),
                         seed=_turn_seed(self.params.seed, self.turn))
        if whole:
            gen = self.engine.generate(self.prompts, params)
        else:
            gen = self.engine.generate([self.contexts[r] for r in rows], replace(params, n=1))
        comp, lps, reasons = [], [], []
        for r, b, c, lp, why in zip(rows, budgets, gen.completion_ids, gen.logprobs, gen.finish_reasons,
                                    strict=True):
            k = self.stops.find(c) if self.stops else None
            if k is not None:
                c, lp, why = c[:k], lp[:k], "stop_string"
            if len(c) > b:
                c, lp, why = c[:b], lp[:b], "length"
            self.contexts[r].extend(c)
            comp.append(list(c))
            lps.append(list(lp))
            reasons.append(why)
        self.live = set(rows)
        self.turn += 1
        return Generation(comp, lps, reasons, stats=dict(gen.stats))

    def close(self) -> None:
        self.contexts = []
        self.live = set()


class WithoutSession:
    """``engine`` seen without its native session: :func:`open_session` then gives a
    :class:`ReprefillSession` over it (to compare the two paths: benchmarks, tests)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.name = f"{engine.name}-reprefill"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        return self.engine.generate(prompts, params)

    def update_weights(self, state_dict) -> None:
        self.engine.update_weights(state_dict)
