"""Runs that go wrong on purpose, for ``nanogrpo bench watch`` and the tests of the run monitor.

Each fault is the embedded demo (``nanogrpo train`` with no arguments) made smaller (16 prompts a step,
100 held-out problems every 5 steps) plus one thing broken on purpose, and the rule of
:mod:`nanogrpo.watch` meant to catch it, within a stated number of steps of the fault's onset:

- ``length_bonus``: a reward that pays 0.5 per sampled token beside correctness and format (what a
  reward model that likes long answers pays): completions grow to the token limit;
- ``tag_format``: a format reward that any tag string satisfies, 0.5 for each ``<...>`` in the completion
  (up to 8), in place of the strict format check: the tags multiply, the answers do not improve;
- ``echo_judge``: a judge with a taste for a phrase (a local function standing in for an LLM judge): it
  prefers answers that echo the question's first number, which the warm start's careless habit writes
  half of the time; it is the only reward;
- ``high_lr``: the demo's learning rate x 40: the policy's entropy collapses;
- ``perturbed_engine``: the fast engine behind :class:`PerturbedLogprobs`, which from its 6th sampling
  call adds Gaussian noise (sigma 0.3 nats) to the log-probs it reports: the fault injection of the
  engine-drift test (the tokens are the engine's own; only the reported log-probs are off, as with a
  kernel or precision mismatch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

SMALL = ["rollout.prompts_per_step=16", "eval.every=5", "eval.n=100", "train.save_every=0",
         "log.samples_every=5"]
"""The demo made smaller, for every fault."""

_TAG = re.compile(r"<[^<>\s]{1,16}>")


def length_bonus(completion: str, sample: dict) -> float:
    """0.5 per token the model sampled: a reward that pays for length (it outweighs correctness and format,
    +-1 and +1.25 / -1, as a reward model's length bias can)."""
    return 0.5 * float(sample.get("completion_tokens", len(completion)))


def tag_format(completion: str, sample: dict) -> float:
    """0.5 per tag string (``<think>``, ``</answer>``, ``<x>``: any), up to 8: a format check any tag
    satisfies."""
    return 0.5 * min(len(_TAG.findall(completion)), 8)


def _answer(completion: str) -> str:
    m = re.search(r"<answer>(.*?)</answer>", completion, re.S)
    return (m.group(1) if m else completion).strip()


def echo_judge(completion: str, sample: dict) -> float:
    """A judge with a quirk: 1.0 when the answer echoes the question's first number (the phrase it was
    fooled into liking), else 0.0; it never checks the arithmetic."""
    first = re.search(r"\d+", str(sample.get("question", "")))
    return 1.0 if first and _answer(completion) == first.group(0) else 0.0


class PerturbedLogprobs:
    """An engine whose reported log-probs are off: the fault injection of the engine-drift test. Wraps a
    real engine; from its ``after``-th sampling call (``n > 1``: training rollouts, not greedy
    evaluation) on, each reported log-prob gets Gaussian noise of ``sigma`` nats (seeded). Everything
    else is the wrapped engine's."""

    def __init__(self, engine, sigma: float = 0.3, after: int = 6, seed: int = 0):
        self.inner, self.sigma, self.after = engine, sigma, after
        self.calls = 0
        self.gen = torch.Generator().manual_seed(seed)

    def generate(self, prompts, params, **kw):
        out = self.inner.generate(prompts, params, **kw)
        if params.n > 1:
            self.calls += 1
            if self.calls >= self.after:
                noise = [self.sigma * torch.randn(len(lp), generator=self.gen) for lp in out.logprobs]
                out.logprobs = [(torch.tensor(lp) + z).tolist() for lp, z in zip(out.logprobs, noise)]
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass(frozen=True)
class Fault:
    overrides: list[str]
    """Keys on top of the demo preset and :data:`SMALL`."""
    rule: str
    """The rule meant to catch it."""
    onset: int
    """The first step the fault acts on (1: from the start)."""
    within: int
    """The rule must fire by ``onset + within``."""
    steps: int = 30
    perturb: dict[str, float] = field(default_factory=dict)
    """:class:`PerturbedLogprobs`' arguments (the engine fault); empty: no wrapper."""


_HERE = "nanogrpo.bench.watch_faults"
FAULTS: dict[str, Fault] = {
    "length_bonus": Fault([f'rewards.functions=["correctness", "format", "{_HERE}:length_bonus"]'],
                          "length_limit", onset=1, within=20),
    "tag_format": Fault([f'rewards.functions=["correctness", "{_HERE}:tag_format"]'],
                        "one_component", onset=1, within=20),
    "echo_judge": Fault([f'rewards.functions=["{_HERE}:echo_judge"]'], "reward_hacking", onset=1, within=20),
    "high_lr": Fault(["train.lr=6e-3"], "entropy_collapse", onset=1, within=20),
    "perturbed_engine": Fault([], "engine_drift", onset=6, within=3, steps=12,
                              perturb={"sigma": 0.3, "after": 6}),
}
"""Fault name -> how it is made and what should catch it (the ``within`` bounds are what the tests hold
the monitor to; docs/figures.md has the steps measured)."""
