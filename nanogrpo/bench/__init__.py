"""Benchmarks shipped in the package (``nanogrpo bench ...``): each module exposes ``main(argv) -> int``.

``nanogrpo bench rollout ...`` (generation speed of the engines),
``nanogrpo bench step ...`` (a full GRPO step of the trainer, optionally beside TRL's) and
``nanogrpo bench rewards ...`` (the built-in rewards against hand labels, beside the seed's rules;
their speed), ``nanogrpo bench turns ...`` (multi-turn tool rollouts of the engines),
``nanogrpo bench variants ...`` (the demo under each policy-optimisation setting: does it learn),
``nanogrpo bench watch ...`` (runs that go wrong on purpose, and the demos: does the run monitor catch
the first and stay quiet on the second), ``nanogrpo bench moe ...`` (the MoE demo in bfloat16 with and
without routing replay: the train-inference mismatch).

These are what any install runs on its own machine, tested with the package. The repository's
``bench/`` folder is the other kind: one-shot scripts, not shipped, run from a checkout (GPU checks,
backends under their launchers, the server tier, memory and cost measurements); its README says which.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {"rollout": "nanogrpo.bench.rollout", "step": "nanogrpo.bench.step",
               "rewards": "nanogrpo.bench.rewards", "turns": "nanogrpo.bench.turns",
               "variants": "nanogrpo.bench.variants", "watch": "nanogrpo.bench.watch",
               "moe": "nanogrpo.bench.moe"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        names = " | ".join(SUBCOMMANDS)
        msg = f"usage: nanogrpo bench {{{names}}} [options]   (nanogrpo bench <name> --help for options)"
        if argv and argv[0] not in ("-h", "--help"):
            print(f"nanogrpo bench: unknown benchmark {argv[0]!r}\n{msg}", file=sys.stderr)
            return 2
        print(msg, file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    return int(importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:]) or 0)


__all__ = ["SUBCOMMANDS", "main"]
