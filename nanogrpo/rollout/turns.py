"""Multi-turn rollouts: sample, run the tool the model called, feed its output back, continue.

For ``len(prompts) * n`` trajectories at once (prompt-major, as ``Engine.generate``):

1. every live trajectory samples a turn through a :class:`~nanogrpo.engines.base.TurnSession`
   (the engine's own, keeping its KV cache, or the generic re-prefill one), which ends it at EOS,
   at the protocol's stop string (``</code>``, ``</tool_call>``) or at the trajectory's remaining
   token budget;
2. a turn that closed a call: the protocol pulls the call out of the turn's text; all calls of
   the step go to the sandbox together (``tools.workers`` at a time);
3. each output, cut to ``tools.max_output_tokens`` (first by bytes, to what that many tokens can hold
   at most, :func:`~nanogrpo.episodes.render.token_bytes`, so a flood is never tokenised whole; then by
   tokens), is tokenised on its own, between the
   protocol's text before and after it (each piece tokenised separately, the ids appended: the
   context is never re-tokenised, so the tokens trained on are exactly those the model saw; the
   output's special-token text stays plain text, so a tool cannot forge ``<|im_end|>``), and
   fed to the trajectory, which samples its next turn;
4. a trajectory ends at EOS (``stop``), when its sampled tokens reach ``max_new_tokens``
   (``length``; a call closed on the last token is not run), or when it closes a call beyond
   ``tools.max_turns`` (``max_turns``; not run). Each group's trajectories go their own ways:
   one may answer at once while another calls three times.

Out comes a :class:`MultiTurnGeneration`: per trajectory, every completion token (sampled and
fed, in order), log-probs (0 for fed tokens), the loss mask (True for sampled tokens only), the
finish reason, and per-turn details for the rewards (``turns``, ``tool_calls``); and the step's
tool metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from nanogrpo.engines.base import Engine, MultiTurnGeneration, SamplingParams
from nanogrpo.engines.session import open_session
from nanogrpo.tools.protocols import Call

TRUNCATED = "\n[output cut]"
ERROR_STATUSES = ("error", "denied", "crash", "overflow", "invalid")


@dataclass
class _Trajectory:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    sampled: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    denied: int = 0
    fed: int = 0
    finish: str = "length"


class _Wrapper:
    """Token ids of the protocol's text around an output, and of an output cut to size."""

    def __init__(self, tokenizer, protocol, max_output_tokens: int):
        from nanogrpo.episodes.render import token_bytes

        self.tok = tokenizer
        self.before = self.encode(protocol.before_output)
        self.after = self.encode(protocol.after_output)
        self.cut_mark = self.encode(TRUNCATED)
        self.limit = max_output_tokens
        self.max_chars = max_output_tokens * token_bytes(tokenizer)
        """More characters (each at least a byte) cannot fit in ``limit`` tokens: cut before tokenising."""

    def encode(self, text: str, plain: bool = False) -> list[int]:
        """``plain``: special-token text (``<|im_end|>``) in it stays text: a tool's output cannot
        forge the chat template's control tokens."""
        if not text:
            return []
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"])

    def feed(self, output: str) -> tuple[list[int], str]:
        clipped = len(output) > self.max_chars  # its first max_chars already hold >= limit tokens
        body = self.encode(output[:self.max_chars] if clipped else output, plain=True)
        if len(body) > self.limit or clipped:
            body = body[:self.limit] + self.cut_mark
        return self.before + body + self.after, self.tok.decode(body, skip_special_tokens=False)

    def longest(self) -> int:
        return len(self.before) + self.limit + len(self.cut_mark) + len(self.after)


def longest_context(cfg, tokenizer, max_new: int) -> int:
    """The longest sequence a run (a :class:`~nanogrpo.config.Config`) asks an engine for: the
    longest prompt, ``max_new`` sampled tokens and, with tools on, ``tools.max_turns`` tool outputs
    (each at most ``tools.max_output_tokens``, the cut mark and the protocol's text around it)."""
    longest = cfg.data.max_prompt_tokens + max_new
    if cfg.tools.enabled:
        from nanogrpo.tools.protocols import make_protocol

        t = cfg.tools
        longest += t.max_turns * _Wrapper(tokenizer, make_protocol(t.protocol, t.name, t.argument),
                                          t.max_output_tokens).longest()
    return longest


def generate_with_tools(engine: Engine, tokenizer, tools, prompts: list[list[int]], samples: list[dict],
                        params: SamplingParams, max_turns: int, max_output_tokens: int
                        ) -> MultiTurnGeneration:
    """Multi-turn generation for ``prompts`` (``samples[i]`` is prompt i's row, given to the tool)."""
    n, budget = params.n, params.max_new_tokens
    wrap = _Wrapper(tokenizer, tools.protocol, max_output_tokens)
    trajs = [_Trajectory() for _ in range(len(prompts) * n)]
    max_len = max(len(p) for p in prompts) + budget + max_turns * wrap.longest()
    session = open_session(engine, tokenizer, prompts, replace(params, stop=tuple(tools.stop)), max_len)
    t_gen = t_tool = 0.0
    texts: dict[int, str] = {}

    def prompt_text(i: int) -> str:
        if i not in texts:
            texts[i] = tokenizer.decode(prompts[i], skip_special_tokens=False)
        return texts[i]

    rows, feeds, budgets = list(range(len(trajs))), [[] for _ in trajs], [budget] * len(trajs)
    try:
        while rows:
            t0 = time.perf_counter()
            gen = session.step(rows, feeds, budgets)
            t_gen += time.perf_counter() - t0
            pending: list[tuple[int, Call]] = []
            for r, ids, lps, why in zip(rows, gen.completion_ids, gen.logprobs, gen.finish_reasons,
                                        strict=True):
                t = trajs[r]
                t.ids += ids
                t.logprobs += [float(x) for x in lps]
                t.mask += [True] * len(ids)
                t.sampled += len(ids)
                text = tokenizer.decode(ids, skip_special_tokens=False)
                t.turns.append({"text": text, "tool_call": None, "tool_output": None, "tool_status": None})
                if why != "stop_string":
                    t.finish = why
                elif t.sampled >= budget:
                    t.finish = "length"
                elif t.calls >= max_turns:
                    t.finish = "max_turns"
                else:
                    before = prompt_text(r // n) if len(t.turns) == 1 else ""
                    pending.append((r, tools.protocol.parse(text, before)))
            t0 = time.perf_counter()
            results = tools.run([c for _, c in pending], [samples[r // n] for r, _ in pending])
            t_tool += time.perf_counter() - t0
            rows, feeds, budgets = [], [], []
            for (r, call), res in zip(pending, results, strict=True):
                t = trajs[r]
                ids, shown = wrap.feed(res.output)
                t.ids += ids
                t.logprobs += [0.0] * len(ids)
                t.mask += [False] * len(ids)
                t.fed += len(ids)
                t.calls += 1
                t.errors += res.status in ERROR_STATUSES
                t.timeouts += res.status == "timeout"
                t.denied += res.status == "denied"
                t.turns[-1].update(tool_call=call.text if call.text is not None else call.error,
                                   tool_output=shown, tool_status=res.status)
                rows.append(r)
                feeds.append(ids)
                budgets.append(budget - t.sampled)
    finally:
        session.close()
    out = MultiTurnGeneration(
        completion_ids=[t.ids for t in trajs], logprobs=[t.logprobs for t in trajs],
        finish_reasons=[t.finish for t in trajs], stats={"generate_s": t_gen, "tool_s": t_tool},
        loss_masks=[t.mask for t in trajs],
        infos=[{"turns": t.turns, "tool_calls": t.calls, "tool_errors": t.errors + t.timeouts}
               for t in trajs])
    out.tool_metrics = tool_metrics(trajs, t_tool)
    return out


def tool_metrics(trajs: list[_Trajectory], tool_s: float) -> dict[str, float]:
    """The step's tool metrics (``tools/…`` in metrics.jsonl)."""
    n = max(len(trajs), 1)
    calls = sum(t.calls for t in trajs)
    return {"tools/calls_per_completion": calls / n,
            "tools/use_rate": sum(t.calls > 0 for t in trajs) / n,
            "tools/calls": calls,
            "tools/errors": sum(t.errors for t in trajs),
            "tools/timeouts": sum(t.timeouts for t in trajs),
            "tools/denied": sum(t.denied for t in trajs),
            "tools/turns_mean": sum(len(t.turns) for t in trajs) / n,
            "tools/max_turns_hit": sum(t.finish == "max_turns" for t in trajs),
            "tools/generated_tokens": sum(t.sampled for t in trajs),
            "tools/tool_tokens": sum(t.fed for t in trajs),
            "tools/time_s": tool_s}
