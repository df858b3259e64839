"""Generation engines: token ids in, completion ids + log-probs out. Nothing here knows training.

- :mod:`.base`: the interface every engine implements (:class:`Engine`, :class:`SamplingParams`,
  :class:`Generation`, the multi-turn :class:`~nanogrpo.engines.base.TurnSession`);
- :mod:`.factory`: ``rollout.engine`` by name (``auto`` picks ``fast`` where it computes the model exactly);
- :mod:`.hf`: ``model.generate``; :mod:`.fast`: our own forward over the live weights, KV cache kept
  across turns; :mod:`.vllm_inprocess`: vLLM in this process over a copy of the weights;
  :mod:`.vllm_server`: running vLLM servers, weights synced by the trainer;
- :mod:`.session`: multi-turn sessions over any engine (each turn's whole context prefilled again);
- :mod:`.stops`: where a stop string ends a sequence, the one rule every engine follows.
"""

from nanogrpo.engines.base import Engine, Generation, SamplingParams
from nanogrpo.engines.factory import make_engine
from nanogrpo.engines.fast import FastEngine
from nanogrpo.engines.hf import HFEngine

__all__ = ["Engine", "Generation", "SamplingParams", "HFEngine", "FastEngine", "make_engine"]
