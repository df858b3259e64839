"""The fast rollout engine: our own forward over the live model's weights (see :mod:`.engine`).

``engine`` (FastEngine: weights, prefill, decode loop), ``families`` (what each model family
does differently, and which models the engine computes exactly), ``forward`` (the forward as
pure functions), ``sampling`` (on-device sampling), ``cache`` (KV cache, RoPE tables, decode
states, CUDA graphs), ``session`` (multi-turn rollouts: each trajectory's KV cache kept across
tool turns).
"""

from nanogrpo.engines.fast.engine import FastEngine
from nanogrpo.engines.fast.families import fast_support

__all__ = ["FastEngine", "fast_support"]
