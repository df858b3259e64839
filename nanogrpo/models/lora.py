"""LoRA through ``peft`` (optional): adapters on the policy, the reference from the same weights.

With ``model.lora_r > 0`` only the adapters train. The reference policy of the
KL term is the base model, i.e. the same module with its adapters disabled
(:class:`AdapterDisabledRef`), so beta > 0 costs no second copy of the weights.
Checkpoints hold the adapter (``adapter_config.json``, ``adapter_model.safetensors``:
``PeftModel.from_pretrained`` loads it onto the base) and, with
``model.lora_save_merged``, the merged model under ``merged/`` (plain HF format).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from nanogrpo.config import ModelConfig
from nanogrpo.errors import ConfigError


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora_r > 0 needs peft: pip install 'nanogrpo[lora]' (or pip install peft)") \
            from None
    return peft


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def apply_lora(model: torch.nn.Module, cfg: ModelConfig, gradient_checkpointing: bool = False):
    """Wrap ``model`` with fresh LoRA adapters (base weights frozen); returns the PEFT model. A
    vision-language model gets them on its language model only
    (:func:`nanogrpo.models.vision.lora_targets`)."""
    from nanogrpo.models.vision import lora_targets

    peft = _peft()
    lcfg = peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                           target_modules=lora_targets(model, list(cfg.lora_target_modules)), bias="none",
                           task_type="CAUSAL_LM")
    if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    return peft.get_peft_model(model, lcfg)


def load_adapter(model: torch.nn.Module, path: str | Path, trainable: bool = True,
                 cfg: ModelConfig | None = None, gradient_checkpointing: bool = False):
    """The base ``model`` with the adapter saved at ``path`` (a checkpoint directory). With ``cfg``,
    the saved adapter must have the configured rank and target modules (a resumed run continues
    the same adapter, not another one)."""
    peft = _peft()
    if cfg is not None:
        saved = peft.PeftConfig.from_pretrained(str(path))
        from nanogrpo.models.vision import lora_targets

        def norm(t):  # a list of names, or (vision-language models) one regex
            return t if isinstance(t, str) else sorted(t or [])
        want = (cfg.lora_r, norm(lora_targets(model, list(cfg.lora_target_modules))))
        got = (getattr(saved, "r", None), norm(getattr(saved, "target_modules", None)))
        if got != want:
            raise ConfigError(f"the adapter at {path} has rank/targets {got}, the config asks for {want}")
    if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return peft.PeftModel.from_pretrained(model, str(path), is_trainable=trainable)


class AdapterDisabledRef:
    """The reference policy as a view of a PEFT model: forwards run with the adapters disabled."""

    def __init__(self, peft_model):
        self.peft_model = peft_model
        self.config = peft_model.config

    def __call__(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def get_output_embeddings(self):
        return self.peft_model.get_output_embeddings()

    def parameters(self):
        return self.peft_model.parameters()

    def modules(self):
        return self.peft_model.modules()

    def get_base_model(self):
        return self.peft_model.get_base_model()

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self


def reference_for(model: torch.nn.Module):
    """The reference model for beta > 0: the adapter-disabled view for PEFT, else a frozen copy."""
    if is_peft(model):
        return AdapterDisabledRef(model)
    from nanogrpo.models.load import frozen_copy

    return frozen_copy(model)


@torch.no_grad()
def save_merged(model: torch.nn.Module, out: Path) -> None:
    """Save base + adapters merged into plain weights (a copy is merged; ``model`` keeps its adapters)."""
    if not is_peft(model):
        model.save_pretrained(out, safe_serialization=True)
        return
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    del merged


# ---------------------------------------------------------------------- adapters for vLLM

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM serves (``--max-lora-rank``): an adapter of rank r needs the smallest one >= r."""


def vllm_max_lora_rank(r: int) -> int:
    """The ``max_lora_rank`` vLLM must be started with to serve an adapter of rank ``r``."""
    for allowed in VLLM_LORA_RANKS:
        if r <= allowed:
            return allowed
    raise ConfigError(f"model.lora_r={r}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; use "
                      "lora_sync=merged ([vllm] or [vllm_server]) to send merged weights instead")


def check_adapter_servable(model) -> None:
    """vLLM serves a plain LoRA adapter: one adapter, no DoRA, no bias, no ``modules_to_save``. Anything
    else is refused in one line (the merged sync takes it)."""
    cfg = model.peft_config[model.active_adapter]
    bad = [what for what, on in (("DoRA", getattr(cfg, "use_dora", False)),
                                 (f"bias={cfg.bias!r}", getattr(cfg, "bias", "none") != "none"),
                                 ("modules_to_save", bool(getattr(cfg, "modules_to_save", None))),
                                 ("several adapters", len(model.peft_config) > 1)) if on]
    if bad:
        raise ConfigError(f"vLLM cannot serve this LoRA adapter as one ({', '.join(bad)}): use "
                          "lora_sync=merged")


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A PEFT model's frozen base weights under their plain HF names (the adapters left out, nothing
    merged): what a vLLM engine serving the adapter on top holds."""
    base = model.get_base_model()
    return {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The active adapter's tensors under PEFT's saved names (``...q_proj.lora_A.weight``), full tensors
    (an FSDP2 shard is gathered: every rank must call it, in the same order)."""
    from torch.distributed.tensor import DTensor

    peft = _peft()
    out = {}
    for k, v in peft.get_peft_model_state_dict(model).items():
        v = v.detach()
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def write_adapter(model: torch.nn.Module, out: Path, tensors: dict[str, torch.Tensor] | None = None) -> int:
    """Write the active adapter to ``out`` as PEFT saves it (``adapter_model.safetensors``,
    ``adapter_config.json``: what vLLM loads); returns its bytes. ``tensors``: already gathered."""
    from safetensors.torch import save_file

    tensors = adapter_state_dict(model) if tensors is None else tensors
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    model.peft_config[model.active_adapter].save_pretrained(str(out))
    return sum(v.numel() * v.element_size() for v in tensors.values())
