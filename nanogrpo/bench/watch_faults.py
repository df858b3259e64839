"""Runs that go wrong on purpose, for ``nanogrpo bench watch`` and the tests of the run monitor.

Each fault is the embedded demo (``nanogrpo train`` with no arguments) made smaller (16 prompts a step,
100 held-out problems every 5 steps) plus one thing broken on purpose, and the rule of
:mod:`nanogrpo.watch` meant to catch it, within a stated number of steps of the fault's onset:

- ``echo_judge``: a judge with a taste for a phrase (a local function standing in for an LLM judge): it
  prefers answers that echo the question's first number, which the warm start's careless habit writes
  half of the time; it is the only reward. The reward climbs, the accuracy falls: ``reward_hacking``;
- ``majority_vote``: the reward is the group's agreement (1.0 for the answer most of the prompt's completions
  give; no reference read: test-time RL's label-free reward), which pays the warm start's careless habit,
  the majority of its answers: the reward climbs while the accuracy falls: ``reward_hacking``;
- ``tag_spam``: a format reward that any tag string satisfies, 0.25 per ``<x>`` or ``</x>`` of any name,
  beside correctness (sampled at temperature 1.5, three times the demo's learning rate, no KL term): the
  policy learns to write tags, then little but tags (``<think>14<ank><answer><answer>...`` to the token
  limit), its answers gone: ``one_component`` (the tag reward carries the gain);
- ``length_bonus``: a reward that pays 0.5 per sampled token beside correctness and format (what a reward
  model that likes long answers pays), sampled at temperature 1.5 with a 48-token limit and twice the
  demo's learning rate: the warm start ends its answers at EOS with probability ~0.999, so at the demo's
  own settings it never tries a longer one in 30 steps (measured); at these, the control run (the same
  without the bonus) keeps 5-9% of its completions at the limit, the faulty one grows to all of them:
  ``length_limit``;
- ``high_lr``: the demo's learning rate x 40: one update scrambles the policy (on these models a high
  learning rate raises the entropy, 0.04 -> 1.25 nats per sampled token here, rather than collapsing it),
  every completion is wrong from step 3 on and no group carries signal: ``no_signal``;
- ``lr_collapse``: ten times the demo's learning rate (5 warm-up steps), sampled at temperature 1.5 (its
  log-probs tempered too) with no KL term: the policy sharpens onto what the format reward pays for,
  whatever the text inside the tags, until it writes one template for every question
  (``<think>===4</think><answer>=</answer>``); the sampled tokens' entropy falls to 27-29% of the start's
  while the accuracy falls (8% -> 1%): ``entropy_collapse``. The same run at the demo's own learning rate
  keeps 63% or more of its entropy over 60 steps (measured; ``one_component`` fires there too: at
  temperature 1.5 the format reward carries the gain at any learning rate);
- ``perturbed_engine``: the fast engine behind :class:`PerturbedLogprobs`, which from its 6th sampling
  call adds Gaussian noise (sigma 0.3 nats) to the log-probs it reports: the fault injection of the
  engine-drift test (the tokens are the engine's own; only the reported log-probs are off, as with a
  kernel or precision mismatch): ``engine_drift``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from nanogrpo.rewards import batched

SMALL = ["rollout.prompts_per_step=16", "eval.every=5", "eval.n=100", "train.save_every=0",
         "log.samples_every=5"]
"""The demo made smaller, for every fault."""

def length_bonus(completion: str, sample: dict) -> float:
    """0.5 per token the model sampled: a reward that pays for length (it outweighs correctness and format,
    +-1 and +1.25 / -1, as a reward model's length bias can)."""
    return 0.5 * float(sample.get("completion_tokens", len(completion)))


_TAG = re.compile(r"</?[A-Za-z]+>")


def tag_count(completion: str, sample: dict) -> float:
    """0.25 per tag string of any name (``<x>`` or ``</x>``): a format reward that checks for tags, not for
    the answer's format, so any tags satisfy it and more tags pay more."""
    return 0.25 * len(_TAG.findall(completion))


def _answer(completion: str) -> str:
    m = re.search(r"<answer>(.*?)</answer>", completion, re.S)
    return (m.group(1) if m else completion).strip()


def echo_judge(completion: str, sample: dict) -> float:
    """A judge with a quirk: 1.0 when the answer echoes the question's first number (the phrase it was
    fooled into liking), else 0.0; it never checks the arithmetic."""
    first = re.search(r"\d+", str(sample.get("question", "")))
    return 1.0 if first and _answer(completion) == first.group(0) else 0.0


@batched
def majority_vote(completions: list[str], samples: list[dict]) -> list[float]:
    """Self-consistency as the reward, no reference answer read (test-time RL's label: TTRL, Zuo et al. 2025):
    1.0 when the completion's answer is the most common answer among its prompt's completions, else 0.0.
    It pays the policy for agreeing with itself, so whatever it answers most often is reinforced."""
    answers = [_answer(c) for c in completions]
    by_prompt: dict[str, Counter] = {}
    for a, s in zip(answers, samples):
        by_prompt.setdefault(str(s.get("question", "")), Counter())[a] += 1
    top = {q: c.most_common(1)[0][0] for q, c in by_prompt.items()}
    return [1.0 if a == top[str(s.get("question", ""))] else 0.0 for a, s in zip(answers, samples)]


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
    "echo_judge": Fault([f'rewards.functions=["{_HERE}:echo_judge"]'], "reward_hacking", onset=1, within=14,
                        steps=20),
    "majority_vote": Fault([f'rewards.functions=["{_HERE}:majority_vote"]'], "reward_hacking", onset=1,
                           within=14, steps=20),
    "tag_spam": Fault([f'rewards.functions=["correctness", "{_HERE}:tag_count"]', "rollout.temperature=1.5",
                       "grpo.beta=0", "train.lr=4.5e-4"], "one_component", onset=1, within=24, steps=30),
    "length_bonus": Fault([f'rewards.functions=["correctness", "format", "{_HERE}:length_bonus"]',
                           "rollout.temperature=1.5", "rollout.max_new_tokens=48", "train.lr=3e-4"],
                          "length_limit", onset=1, within=19, steps=25),
    "high_lr": Fault(["train.lr=6e-3"], "no_signal", onset=1, within=6, steps=12),
    "lr_collapse": Fault(["rollout.temperature=1.5", "rollout.tempered_logprobs=true", "grpo.beta=0",
                          "train.lr=1.5e-3", "train.warmup_steps=5"], "entropy_collapse", onset=1, within=54,
                         steps=60),
    "perturbed_engine": Fault([], "engine_drift", onset=6, within=2, steps=12,
                              perturb={"sigma": 0.3, "after": 6}),
}
"""Fault name -> how it is made and what should catch it (the ``within`` bounds are what the tests hold
the monitor to; docs/figures.md has the steps measured)."""
