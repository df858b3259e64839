"""nanogrpo's vLLM worker extension (``vllm serve --worker-extension-cls
nanogrpo.transfer.worker.NanoGRPOWorkerExtension``, added by ``nanogrpo vllm-serve``): methods the trainer
calls through vLLM's ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``).

- ``nanogrpo_model_info``: the server's model as :func:`model_facts` describes it, so that the trainer
  refuses a server with another model (vocabulary, depth, widths) in one line *before* any weights move,
  instead of a transfer failing half-way with "Worker failed with error ''"; and its LoRA settings (a
  LoRA run serving its adapter needs them: rank, adapters held, runtime loading).

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
        import os

        cfg = self.model_config.hf_config  # type: ignore[attr-defined]  (the worker's)
        lora = getattr(self.vllm_config, "lora_config", None)  # type: ignore[attr-defined]
        return {"facts": model_facts(cfg), "model": str(self.model_config.model),  # type: ignore[attr-defined]
                "lora": None if lora is None else {
                    "max_lora_rank": int(lora.max_lora_rank), "max_loras": int(lora.max_loras),
                    "max_cpu_loras": int(lora.max_cpu_loras or lora.max_loras),
                    "runtime_updating": os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
                    in ("1", "true")}}
