"""Vision-language models: which ones, how they take images, what trains.

Any ``AutoModelForImageTextToText`` checkpoint loads (:func:`nanogrpo.models.load.load_model` falls
back to it when the config has a ``vision_config``); nanogrpo knows how to feed two layouts:

- ``qwen`` (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``): pixel patches (P, D) with ``image_grid_thw``
  (I, 3), and ``mm_token_type_ids`` (1 on image tokens) from which the model computes its M-RoPE positions
  (no ``position_ids`` passed: the model's own 3-D positions, left padding included);
- ``llava`` (``llava``): the patches folded back into (I, 3, H, W) images of the tower's fixed
  size; 1-D positions from the attention mask as for text models.

The processor's numbers (patch, merge and temporal sizes, mean and std, the pixel bounds) are read
off the model's config and its ``preprocessor_config.json`` (:func:`image_spec`); nanogrpo renders
the pixels itself with PIL and torch (:mod:`nanogrpo.data.images`), since the HF processors' fast
paths need torchvision. ``tests/test_vision.py`` checks the patches against HF's PIL processor.

``model.train_vision`` false (the default): the vision tower's parameters have ``requires_grad``
off; the projector into the language model still trains (LLaVA's ``multi_modal_projector``, outside
the tower; Qwen-VL's ``merger``, and Qwen3-VL's ``deepstack_merger_list``, inside it: :data:`PROJECTORS`),
as the field trains vision-language models (the encoder frozen, the connector tuned with the language
model). LoRA adapts the language model's linears only (:func:`lora_targets`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nanogrpo.data.images import CLIP_MEAN, CLIP_STD, ImageSpec
from nanogrpo.errors import ModelError

LAYOUTS = {"qwen2_vl": "qwen", "qwen2_5_vl": "qwen", "qwen3_vl": "qwen", "llava": "llava"}
"""Model types whose image inputs nanogrpo renders, and their layout."""


def _inner(model):
    from nanogrpo.algo.heads import unwrap

    inner = unwrap(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def is_vision_checkpoint(path: str | None) -> bool | None:
    """Whether the model directory ``path`` holds a vision-language model (its ``config.json`` has a
    ``vision_config``), read without loading it; None when ``path`` is no local directory with a readable
    ``config.json`` (a hub id: known once loaded)."""
    f = Path(path) / "config.json" if path else None
    if f is None or not f.is_file():
        return None
    try:
        return json.loads(f.read_text()).get("vision_config") is not None
    except (OSError, ValueError, AttributeError):
        return None


def check_run_images(cfg, parts: list[list[dict]], model_path: str | None, multi_turn: bool) -> None:
    """A run's rows with images it cannot take (:func:`nanogrpo.data.images.check_images_early`), said at
    once, naming the first: before vLLM's import check and any weights are read (a text model known by
    its ``config.json``). ``model_path``: where ``cfg.model.path`` resolved (None: a demo's weights)."""
    from nanogrpo.data.images import check_images_early
    from nanogrpo.models.source import resolve_model_path

    if not any(parts):
        return
    where = model_path if model_path is not None else resolve_model_path(cfg.model.path)
    vision = is_vision_checkpoint(where)
    for part in parts:
        check_images_early(part, cfg.data.image_field, engine=cfg.rollout.engine, vision=vision,
                           model=cfg.model.path, multi_turn=multi_turn)


def is_vision_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def is_vision(model) -> bool:
    """Whether ``model`` (possibly wrapped) is a vision-language model."""
    return is_vision_config(getattr(_inner(model), "config", None))


def layout(model) -> str:
    mtype = _inner(model).config.model_type
    if mtype not in LAYOUTS:
        raise ModelError(f"vision model type {mtype!r}: nanogrpo renders images for "
                         f"{', '.join(LAYOUTS)} only")
    return LAYOUTS[mtype]


def image_token_id(model) -> int:
    cfg = _inner(model).config
    tid = getattr(cfg, "image_token_id", None)
    if tid is None:
        tid = getattr(cfg, "image_token_index", None)
    if tid is None:
        raise ModelError(f"{cfg.model_type}: the config names no image token id")
    return int(tid)


def media_token_ids(model) -> list[int]:
    """The ids that stand for image / video features in the input: a sampler never emits them (a
    completion holding one would not match its images' features in the trainer's forward)."""
    cfg = _inner(model).config
    ids = [getattr(cfg, k, None) for k in ("image_token_id", "image_token_index", "video_token_id")]
    return sorted({int(i) for i in ids if i is not None})


def _preprocessor(path: str | None) -> dict:
    """The model's ``preprocessor_config.json`` (a directory's, or a hub id's from the HF cache / hub),
    or {} when it has none."""
    if not path:
        return {}
    f = Path(path) / "preprocessor_config.json"
    if not f.is_file() and not Path(path).is_dir():
        try:
            from transformers.utils import cached_file

            found = cached_file(path, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
        except (OSError, ValueError):
            found = None
        f = Path(found) if found else f
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError) as e:
        raise ModelError(f"{f}: unreadable ({e})") from None


def image_spec(model, tokenizer, path: str | None = None, min_pixels: int | None = None,
               max_pixels: int | None = None) -> ImageSpec:
    """How ``model`` takes images (its processor's numbers: the model's ``preprocessor_config.json``
    in ``path`` when there is one); ``min_pixels`` / ``max_pixels`` (``data.min_image_pixels`` /
    ``data.max_image_pixels``) override the processor's bounds."""
    cfg = _inner(model).config
    vc = cfg.vision_config
    pre = _preprocessor(path or getattr(cfg, "_name_or_path", None))
    mean = tuple(pre.get("image_mean", CLIP_MEAN))
    std = tuple(pre.get("image_std", CLIP_STD))
    token = tokenizer.convert_ids_to_tokens(image_token_id(model))
    if layout(model) == "llava":
        if getattr(cfg, "vision_feature_select_strategy", "default") != "default":
            raise ModelError("llava: only vision_feature_select_strategy='default' is supported")
        return ImageSpec("llava", patch_size=vc.patch_size, fixed=vc.image_size, mean=mean, std=std,
                         image_token=token)
    size = pre.get("size") or {}
    lo = min_pixels or pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56
    hi = max_pixels or pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    start = getattr(cfg, "vision_start_token_id", None)
    end = getattr(cfg, "vision_end_token_id", None)
    wrap = (tokenizer.convert_ids_to_tokens(start) if start is not None else "",
            tokenizer.convert_ids_to_tokens(end) if end is not None else "")
    return ImageSpec("qwen", patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                     temporal_patch_size=vc.temporal_patch_size, mean=mean, std=std, min_pixels=int(lo),
                     max_pixels=int(hi), image_token=token, wrap=wrap)


def llava_images(pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """LLaVA's (I, 3, H, W) images from the (P, 3*p*p) patch rows and (I, 3) grids of ``render``."""
    p = int(round((pixel_values.shape[1] // 3) ** 0.5))
    out, k = [], 0
    for t, gh, gw in grid.tolist():
        n = t * gh * gw
        x = pixel_values[k:k + n].reshape(gh, gw, 3, p, p).permute(2, 0, 3, 1, 4)   # (3, gh, p, gw, p)
        out.append(x.reshape(3, gh * p, gw * p))
        k += n
    return torch.stack(out)                                                         # (I, 3, H, W)


def forward_kwargs(model, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                   grid: torch.Tensor | None, groups: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None) -> dict:
    """The keyword arguments that carry ``input_ids``' images into ``model``'s forward (and
    ``generate``): their pixels in row order (every image of row 0, then row 1, ...). A
    ``position_ids`` key set to None means: let the model compute its own positions (M-RoPE).

    ``groups`` (N,) and ``counts`` (N,) (each row's group id and image count): rows of one group share
    their images, so the vision tower runs on one row's images per group and the others reuse its
    features (:func:`shared_features`; same values and gradients, the tower's work divided by the group
    size). Only for a model called as itself (not inside DDP / FSDP2, whose hooks need every parameter
    used inside their own forward)."""
    if pixel_values is None or grid is None or grid.shape[0] == 0:
        return {"position_ids": None} if layout(model) == "qwen" else {}
    dt = next(iter(_inner(model).parameters())).dtype
    kw: dict = {}
    shared = None
    if groups is not None and counts is not None and _plain(model):
        shared = shared_features(model, pixel_values.to(input_ids.device, dt), grid, counts, groups)
    if shared is not None:
        kw["mm_encoder_outputs"] = {"image": shared}
    elif layout(model) == "llava":
        kw["pixel_values"] = llava_images(pixel_values, grid).to(input_ids.device, dt)
    else:
        kw["pixel_values"] = pixel_values.to(input_ids.device, dt)
    if layout(model) == "llava":
        return kw
    tt = (input_ids == image_token_id(model)).int()
    return {**kw, "image_grid_thw": grid.to(input_ids.device), "mm_token_type_ids": tt, "position_ids": None}


def _plain(model) -> bool:
    """``model`` is the HF model itself (or a PEFT wrapper of it): no DDP / FSDP2 / DeepSpeed around it."""
    from nanogrpo.algo.heads import unwrap

    inner = unwrap(model)
    return inner is model and not any(c.__name__.startswith("FSDP") for c in type(model).__mro__)


def shared_features(model, pixel_values: torch.Tensor, grid: torch.Tensor, counts: torch.Tensor,
                    groups: torch.Tensor):
    """The image features of every row's images, the tower run once per group (its first row's
    images); None when no group has two rows. Returns the model's own output type, its
    ``pooler_output`` one (tokens, hidden) tensor per image in row order (Qwen3-VL's ``deepstack_features``
    likewise, per layer), for ``mm_encoder_outputs``."""
    from nanogrpo.algo.vision import distinct_rows, select_rows

    first, inv = distinct_rows(groups)
    if first.numel() == groups.numel():
        return None
    pv, g, c = select_rows(pixel_values, grid, counts, first)
    base = getattr(_inner(model), "model", _inner(model))
    if layout(model) == "llava":
        cfg = _inner(model).config
        out = base.get_image_features(pixel_values=llava_images(pv, g), return_dict=True,
                                      vision_feature_layer=cfg.vision_feature_layer,
                                      vision_feature_select_strategy=cfg.vision_feature_select_strategy)
    else:
        out = base.get_image_features(pv, g, return_dict=True)
    starts = [0] + c.cumsum(0).tolist()

    def every_row(per_image) -> tuple:  # one feature per image of the U rows -> of all N rows
        per_image = list(per_image)
        return tuple(f for u in inv.tolist() for f in per_image[starts[u]:starts[u + 1]])
    out.pooler_output = every_row(out.pooler_output)
    if getattr(out, "deepstack_features", None) is not None:  # Qwen3-VL: per layer, per image
        out.deepstack_features = [every_row(layer) for layer in out.deepstack_features]
    return out


def image_token_error(model, batch) -> str | None:
    """The first way a rollout batch's images disagree with its token ids under ``model``, as one line, or
    None: a sequence's prompt must hold exactly the image tokens its images' grids make, its completion
    none; a batch with images for a text model, or image tokens and no images, is refused too. (A batch
    from another process is checked so before any forward: a mismatch would fail inside the model.)"""
    vision = is_vision(model)
    if batch.has_images and not vision:
        return "the batch carries images but the model is a text model"
    if not vision:
        return None
    tid = image_token_id(model)
    merge = _inner(model).config.vision_config.spatial_merge_size if layout(model) == "qwen" else 1
    p = batch.prompt_len
    in_prompt = (batch.input_ids[:, :p] == tid).sum(1)                       # (N,)
    in_completion = (batch.input_ids[:, p:] == tid) & batch.completion_mask  # (N, C)
    if bool(in_completion.any()):
        return f"a completion holds the image token {tid} (only prompts may)"
    want = torch.zeros_like(in_prompt)
    if batch.has_images:
        from nanogrpo.algo.vision import row_offsets

        per_image = batch.image_grid_thw.prod(-1) // merge ** 2              # (I,)
        img, _ = row_offsets(batch.image_grid_thw, batch.image_counts)
        for r in range(batch.num_seqs):
            want[r] = per_image[int(img[r]):int(img[r + 1])].sum()
    bad = torch.nonzero(in_prompt != want)
    if bad.numel():
        r = int(bad[0, 0])
        return (f"sequence {r}'s prompt holds {int(in_prompt[r])} image tokens, its images make "
                f"{int(want[r])}")
    return None


def vision_tower(model) -> torch.nn.Module | None:
    inner = _inner(model)
    base = getattr(inner, "model", inner)
    for name in ("visual", "vision_tower", "vision_model"):
        mod = getattr(base, name, None) or getattr(inner, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


PROJECTORS = ("merger", "deepstack_merger_list")
"""Modules inside a vision tower that project its features into the language model (Qwen-VL's patch
merger, Qwen3-VL's deepstack mergers): they train with ``model.train_vision`` false."""


def freeze_vision(model, train_vision: bool) -> int:
    """``model.train_vision`` false: the vision tower's parameters stop taking gradients, its projector
    into the language model (:data:`PROJECTORS`) left trainable; returns how many parameters were frozen
    (0 for a text model or ``train_vision``)."""
    tower = vision_tower(model)
    if tower is None or train_vision:
        return 0
    n = 0
    for name, p in tower.named_parameters():
        if name.split(".", 1)[0] in PROJECTORS:
            continue
        if p.requires_grad:
            p.requires_grad_(False)
            n += p.numel()
    return n


def lora_targets(model, names: list[str]) -> list[str] | str:
    """LoRA on the language model only: a regex that matches ``names`` (``q_proj``, ...) outside the
    vision tower (and LLaVA's projector); ``names`` as given for a text model."""
    if not is_vision(model):
        return names
    alts = "|".join(names)
    return rf"^(?!.*(visual|vision_tower|vision_model|multi_modal_projector)).*\.({alts})$"
