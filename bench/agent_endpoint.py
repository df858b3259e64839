"""The cost of the agent endpoint: the same two-turn task (an arithmetic question; a wrong answer gets
"Wrong, try again." and one more turn) rolled out as an environment (nanogrpo calls it per turn; the
fast engine keeps each episode's KV cache) and as an agent program written with the ``openai``
package (it calls nanogrpo's OpenAI-compatible endpoint; each request is prefilled again), side by
side, alternating, on the embedded demo model.

    OMP_NUM_THREADS=1 python -m bench.agent_endpoint --rows 16 --group 4 --repeats 5

Prints the median wall time of one rollout each way, sampled tokens per second, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanogrpo.config import Config
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.factory import make_engine
from nanogrpo.envs.base import Environment, StepResult
from nanogrpo.envs.program import agent
from nanogrpo.episodes.play import Episodes
from nanogrpo.models.load import load_policy
from tests.adapter_fixtures import _rows, answer_of, sdk_agent


class Retry(Environment):
    def reset(self, row):
        self.row, self.turns = row, 0
        return row["question"]

    def step(self, action):
        self.turns += 1
        if answer_of(action) == self.row["answer"]:
            return StepResult(reward=1.0, done=True)
        return StepResult(None, 0.0, True) if self.turns >= 2 else StepResult("Wrong, try again.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    over = {"rewards.functions": ["env"], "rollout.max_new_tokens": 80, "env.max_turns": 2,
            "env.workers": a.rows * a.group}  # every episode's program at once
    cfg = Config.load("demo", over)
    model, tok, _ = load_policy(cfg.model)
    engine = make_engine("fast", model.eval(), tok)
    rows = _rows(a.rows)
    ways = {"environment": Episodes.from_config(cfg, Retry),
            "agent+endpoint": Episodes.from_config(cfg, agent(sdk_agent))}
    times: dict[str, list[float]] = {k: [] for k in ways}
    toks: dict[str, list[int]] = {k: [] for k in ways}
    for r in range(a.repeats + 1):  # the first round warms up
        for name, eps in ways.items():
            params = SamplingParams(max_new_tokens=80, temperature=1.0, n=a.group, seed=r)
            t0 = time.perf_counter()
            gen = eps.generate(engine, tok, rows, params)
            if r:
                times[name].append(time.perf_counter() - t0)
                toks[name].append(sum(sum(m) for m in gen.loss_masks))
    med = {name: statistics.median(times[name]) for name in ways}
    for name, t in med.items():
        print(f"{name:16s} median {t:.2f} s per rollout of {a.rows}x{a.group} episodes, "
              f"{statistics.median(toks[name]) / t:.0f} sampled tok/s "
              f"(times {[round(x, 2) for x in times[name]]})")
    print(f"agent+endpoint / environment: {med['agent+endpoint'] / med['environment']:.2f}x")
    for eps in ways.values():
        eps.close()


if __name__ == "__main__":
    main()
