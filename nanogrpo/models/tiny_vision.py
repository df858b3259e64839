"""Tiny random-init vision-language models of the real families, built offline from configs:
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA (a CLIP tower, a projector, a Qwen2 language model), with a
character-level tokenizer that knows each family's image tokens and a chat template.

Nothing is downloaded. :func:`make_vlm` returns (model, tokenizer); ``save_pretrained`` on both
gives a directory ``nanogrpo`` loads like any checkpoint (``model.path``), a
``preprocessor_config.json`` included (:func:`save_vlm`), so tests run every path on the real
model classes. The image tokens each family uses are special tokens of the tokenizer.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nanogrpo.data.images import CLIP_MEAN, CLIP_STD
from nanogrpo.errors import ModelError
from nanogrpo.models.tiny import CHAT_TEMPLATE

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
LLAVA_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]


def make_vision_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with ``family``'s image tokens as special tokens (EOS ``<|im_end|>``,
    PAD ``<|endoftext|>``) and the tiny models' chat template."""
    special = LLAVA_SPECIAL if family == "llava" else QWEN_SPECIAL
    vocab = {tok: i for i, tok in enumerate(special + list(string.printable))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(special)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def vlm_config(family: str, tok: PreTrainedTokenizerFast, hidden: int = 32, layers: int = 2,
               vision_hidden: int = 32, vision_layers: int = 1, patch: int = 4, image_size: int = 16):
    """The config of a tiny ``family`` model (every id read off ``tok``)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in (LLAVA_SPECIAL if family == "llava" else QWEN_SPECIAL)}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=True)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        head = hidden // 4
        half = head // 2
        t = max(1, half // 4)
        sections = [t, (half - t) // 2, half - t - (half - t) // 2]
        text.pop("rope_theta")
        text.update(head_dim=head, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                                    "mrope_section": sections, "mrope_interleaved": True})
        vision = dict(depth=vision_layers, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                      num_heads=2, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2,
                      out_hidden_size=hidden, num_position_embeddings=16, deepstack_visual_indexes=[0])
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                             image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                             vision_start_token_id=ids["<|vision_start|>"],
                             vision_end_token_id=ids["<|vision_end|>"])
    if family in ("qwen2_vl", "qwen2_5_vl"):
        half = hidden // 4 // 2                                      # head_dim / 2 rotary pairs
        t = max(1, half // 4)
        sections = [t, (half - t) // 2, half - t - (half - t) // 2]
        text["rope_scaling"] = {"type": "mrope", "mrope_section": sections}
        ids_kw = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                      vision_start_token_id=ids["<|vision_start|>"],
                      vision_end_token_id=ids["<|vision_end|>"])
        if family == "qwen2_vl":
            from transformers import Qwen2VLConfig

            vision = dict(depth=vision_layers, embed_dim=vision_hidden, hidden_size=hidden, num_heads=2,
                          mlp_ratio=2, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2,
                          in_channels=3)
            return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids_kw)
        from transformers import Qwen2_5_VLConfig

        vision = dict(depth=vision_layers, hidden_size=vision_hidden, out_hidden_size=hidden, num_heads=2,
                      intermediate_size=2 * vision_hidden, patch_size=patch, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3, window_size=4 * patch, fullatt_block_indexes=[0])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids_kw)
    if family == "llava":
        from transformers import CLIPVisionConfig, LlavaConfig, Qwen2Config

        vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                                  num_hidden_layers=max(vision_layers, 1) + 1, num_attention_heads=2,
                                  image_size=image_size, patch_size=patch, projection_dim=vision_hidden)
        text.pop("rope_theta")
        return LlavaConfig(vision_config=vision, text_config=Qwen2Config(**text),
                           image_token_index=ids["<image>"], image_seq_length=(image_size // patch) ** 2,
                           vision_feature_layer=-2, vision_feature_select_strategy="default",
                           tie_word_embeddings=True)
    raise ModelError(f"unknown vision family {family!r}; known: {', '.join(FAMILIES)}")


def make_vlm(family: str = "qwen2_vl", *, seed: int = 0, dtype: torch.dtype | None = None, **shape):
    """(model, tokenizer): a random-init tiny ``family`` model (deterministic for ``seed``)."""
    from transformers import AutoModelForImageTextToText

    tok = make_vision_tokenizer(family)
    cfg = vlm_config(family, tok, **shape)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    return model.eval(), tok


def preprocessor_config(model, min_pixels: int = 8 * 8, max_pixels: int = 64 * 64) -> dict:
    """The ``preprocessor_config.json`` the HF processor of ``model``'s family reads."""
    vc = model.config.vision_config
    if model.config.model_type == "llava":
        return {"image_processor_type": "LlavaImageProcessor", "size": {"height": vc.image_size,
                                                                     "width": vc.image_size},
                "crop_size": {"height": vc.image_size, "width": vc.image_size}, "do_center_crop": False,
                "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
                "resample": 3, "do_resize": True, "do_normalize": True, "do_rescale": True,
                "rescale_factor": 1 / 255}
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": vc.patch_size,
            "merge_size": vc.spatial_merge_size, "temporal_patch_size": vc.temporal_patch_size,
            "min_pixels": min_pixels, "max_pixels": max_pixels,
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
            "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)}


def save_vlm(model, tok, path: str | Path, **pixels) -> Path:
    """Save ``model`` and ``tok`` as a checkpoint directory, with its ``preprocessor_config.json``."""
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(model, **pixels), indent=1))
    return path
