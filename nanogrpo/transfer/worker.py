"""nanogrpo's vLLM worker extension (``vllm serve --worker-extension-cls
nanogrpo.transfer.worker.NanoGRPOWorkerExtension``, added by ``nanogrpo vllm-serve``): methods the trainer
calls through vLLM's ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``).

- ``nanogrpo_model_info``: the server's model as :func:`model_facts` describes it, so that the trainer
  refuses a server with another model (vocabulary, depth, widths) in one line *before* any weights move,
  instead of a transfer failing half-way with "Worker failed with error ''".

Light on purpose: vLLM imports it in every worker process.
"""

from __future__ import annotations

from typing import Any

FACTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "head_dim")
"""The fields of a model's (text) config that fix its weights' names and shapes."""


def model_facts(config: Any) -> dict[str, Any]:
    """The :data:`FACTS` of a transformers config (its text part for a vision-language model), the absent
    ones left out."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {}
    for k in FACTS:
        v = getattr(text, k, None)
        if isinstance(v, (int, float, str, bool)):
            out[k] = v
    return out


def differences(trainer: dict[str, Any], server: dict[str, Any]) -> list[str]:
    """``"name: trainer X, server Y"`` for each fact both sides state and disagree on."""
    return [f"{k} {trainer[k]} here, {server[k]} there" for k in FACTS
            if k in trainer and k in server and trainer[k] != server[k]]


class NanoGRPOWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def nanogrpo_model_info(self) -> dict[str, Any]:
        cfg = self.model_config.hf_config  # type: ignore[attr-defined]  (the worker's)
        return {"facts": model_facts(cfg), "model": str(self.model_config.model)}  # type: ignore[attr-defined]
