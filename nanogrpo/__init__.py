"""nanogrpo: a small, fast GRPO trainer. From Python (docs/guides/python.md)::

    import nanogrpo

    run = nanogrpo.train("demo", rewards=["correctness", my_reward], dataset=rows)
    run.metrics[-1]["reward_mean"], run.checkpoint
    model, tokenizer = nanogrpo.load_checkpoint(run)

The names below load on first use (:mod:`nanogrpo.api`): ``import nanogrpo`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Config", "ConfigError", "NanoGRPOError", "Run", "evaluate", "load_checkpoint", "train"]
__version__ = "0.1.0"

_WHERE = {"Config": "nanogrpo.config", "Run": "nanogrpo.api", "evaluate": "nanogrpo.api",
          "load_checkpoint": "nanogrpo.api", "train": "nanogrpo.api", "ConfigError": "nanogrpo.errors",
          "NanoGRPOError": "nanogrpo.errors"}

if TYPE_CHECKING:
    from nanogrpo.api import Run, evaluate, load_checkpoint, train
    from nanogrpo.config import Config
    from nanogrpo.errors import ConfigError, NanoGRPOError


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nanogrpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
