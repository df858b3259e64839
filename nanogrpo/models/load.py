"""Loading policies and tokenizers: any HF causal LM by local path or hub id.

``embedded`` names nanogrpo's own tiny model: a Qwen2-architecture model with a
character-level tokenizer, warm-started by a short supervised stage on the
embedded arithmetic task (``nanogrpo/demos/arithmetic/build.py``), shipped with the package
(``nanogrpo/demos/arithmetic/weights``), so ``nanogrpo train`` works offline with no arguments;
``embedded-NAME`` is demo NAME's (found by name: :mod:`nanogrpo.entry_points`).
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from nanogrpo.config import ModelConfig
from nanogrpo.errors import ModelError
from nanogrpo.models.cpu_linear import apply_cpu_linear
from nanogrpo.models.source import (  # noqa: F401 - where a model comes from: re-exported here
    EMBEDDED,
    check_model_source,
    resolve_model_path,
)

log = logging.getLogger("nanogrpo.models")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ModelError(f"model.device {name!r} is not a device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"model.device is {name!r} but no CUDA device is available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


GENERIC_TOKENIZER_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def saved_tokenizer_class(path: str) -> str | None:
    """The ``tokenizer_class`` a model directory's ``tokenizer_config.json`` names (None: none)."""
    cfg = Path(path) / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("tokenizer_class")
    except (ValueError, OSError):
        return None


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model.

    A tokenizer saved as a generic fast tokenizer (like the embedded char-level
    one) is loaded as exactly that: ``AutoTokenizer`` would otherwise pick the
    model family's class from ``config.json`` (Qwen2Tokenizer for a Qwen2 model)
    and silently replace its pre-tokenizer.
    """
    try:
        if saved_tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES:
            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load tokenizer from {path!r}: {str(e).splitlines()[0][:300]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelError(f"tokenizer at {path!r} defines no EOS token")
    return tok


def _auto_class(path: str, trust_remote_code: bool):
    """``AutoModelForImageTextToText`` for a vision-language checkpoint (its config has a
    ``vision_config``), else ``AutoModelForCausalLM``."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return AutoModelForCausalLM  # its own load says what is wrong
    if getattr(cfg, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _from_pretrained(path: str, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool):
    kw = dict(attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    auto = _auto_class(path, trust_remote_code)
    try:
        return auto.from_pretrained(path, dtype=dtype, **kw)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        return auto.from_pretrained(path, torch_dtype=dtype, **kw)


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


def load_model(path: str, dtype: torch.dtype, device: torch.device, attn_implementation: str = "sdpa",
               trust_remote_code: bool = False, cpu_linear: str = "auto") -> PreTrainedModel:
    """An HF causal LM on ``device``, with dropout off (:func:`disable_dropout`); on the CPU its
    float32 linears go through oneDNN where ``cpu_linear`` says so (``auto``: where it is faster on
    this CPU; see :mod:`nanogrpo.models.cpu_linear`).

    A model that has no ``sdpa`` attention (Gemma2 in transformers 5) is loaded with ``eager``,
    saying so in one line; any other attention implementation the model refuses is an error
    that names ``model.attn_implementation``."""
    try:
        model = _from_pretrained(path, dtype, attn_implementation, trust_remote_code)
    except (ValueError, ImportError) as e:  # ImportError: e.g. flash_attention_2 without its package
        msg = _first_line(e)
        if attn_implementation == "sdpa" and re.search(r"sdpa|scaled_dot_product_attention", msg, re.I):
            log.info("%s has no sdpa attention in this transformers; loading it with "
                        "model.attn_implementation=eager", path)
            try:
                model = _from_pretrained(path, dtype, "eager", trust_remote_code)
            except (OSError, ValueError) as e2:
                raise ModelError(f"cannot load model from {path!r}: {_first_line(e2)}") from None
        elif re.search(r"attn|attention", msg, re.I):
            raise ModelError(f"cannot load model from {path!r} with model.attn_implementation="
                             f"{attn_implementation}: {msg}; set model.attn_implementation=sdpa or eager "
                             "(one it supports)") from None
        else:
            raise ModelError(f"cannot load model from {path!r}: {msg}") from None
    except OSError as e:
        raise ModelError(f"cannot load model from {path!r}: {_first_line(e)}") from None
    model = model.to(device)
    off = disable_dropout(model)
    if off:
        log.info("%s: dropout is off in every forward (%d modules had it; the saved config keeps "
                    "its values)", path, off)
    if device.type == "cpu":
        apply_cpu_linear(model, cpu_linear)
    return model


_DROPOUT_ATTRS = re.compile(r"dropout|layerdrop", re.I)


def disable_dropout(model: torch.nn.Module) -> int:
    """Dropout off in every forward of ``model``, its config left as it is; returns how many
    modules had some.

    RL forwards run without dropout: a perturbed log-prob is not the policy's (the KL to an
    identical reference at step 1 would not be 0, nor the ratio to the sampler's log-probs 1).
    ``eval()`` is not the way: the trainer keeps the policy in train mode because HF's
    gradient checkpointing acts only then (``self.gradient_checkpointing and self.training``).
    So every ``nn.Dropout`` gets ``p = 0`` and every numeric module attribute named like
    ``*dropout*`` / ``*layerdrop*`` becomes 0 (the ``attention_dropout`` that attention
    functions read off their module in train mode). These are module attributes, not
    ``model.config``: checkpoints keep the model's own settings, and wrappers that keep the
    modules (DDP, FSDP2, DeepSpeed, PEFT) keep them off. Call it before adding LoRA adapters:
    ``model.lora_dropout`` is the user's own choice."""
    changed = 0
    for m in model.modules():
        hit = False
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p:
            m.p, hit = 0.0, True
        for k, v in list(vars(m).items()):
            if (_DROPOUT_ATTRS.search(k) and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and v != 0):
                setattr(m, k, 0.0)
                hit = True
        changed += hit
    return changed


def load_policy(cfg: ModelConfig, path: str | None = None, cpu_linear: str | None = None
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.device]:
    """The trainable policy and its tokenizer, on the configured device and dtype; ``path``: where
    ``cfg.path`` was already resolved to (:func:`~nanogrpo.models.source.resolve_model_path`);
    ``cpu_linear``: in place of ``cfg.cpu_linear`` (a trainer loads with ``torch`` and settles it
    afterwards, :func:`~nanogrpo.models.cpu_linear.settle`)."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    path = path or resolve_model_path(cfg.path)
    tok = load_tokenizer(path, cfg.trust_remote_code)
    model = load_model(path, dtype, device, cfg.attn_implementation, cfg.trust_remote_code,
                       cpu_linear or cfg.cpu_linear)
    model.generation_config.pad_token_id = tok.pad_token_id
    from nanogrpo.models.vision import freeze_vision

    frozen = freeze_vision(model, cfg.train_vision)
    if frozen:
        log.info("%s: vision tower frozen (%d parameters; model.train_vision=true trains it)", path, frozen)
    return model, tok, device


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen reference model: same weights, no gradients, eval mode."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
