"""Images in the prompt: reading a row's images, resizing them as the model's processor does,
and turning them into the pixel inputs a vision-language model takes.

A row's images are in ``data.image_field`` (default ``images``; one image or a list): a file
path (relative to the dataset file, or absolute), a PIL image, raw bytes (PNG, JPEG, ...), or a
HF ``datasets`` Image feature's dict (``{"bytes": ..., "path": ...}``). A URL is refused (nanogrpo
reads no network for data). The row's text puts each image where ``data.image_placeholder``
(default ``<image>``) stands, in order; a row with images and no placeholder gets them all in
front of its question, as the processors' chat templates put them.

Resizing (:func:`smart_resize`) is Qwen2-VL's processor's: both sides rounded to multiples of
``patch_size * merge_size`` with the area kept within [``data.min_image_pixels``,
``data.max_image_pixels``], the aspect ratio kept as far as it can be; LLaVA-family models take a
fixed square size (``ImageSpec.fixed``). Then PIL's bicubic resize on the 8-bit image, scaling to
[0, 1], normalising by the processor's mean and std, and cutting into patches (:func:`render`):

- ``qwen`` layout (Qwen2-VL, Qwen2.5-VL): rows of ``C * temporal_patch_size * patch * patch``
  values, merge-window major (the processor's ``patchify``), grid ``(1, h / patch, w / patch)``;
- ``llava`` layout: the same row format with ``temporal_patch_size`` 1 and ``merge_size`` 1, so a
  batch carries every family as (patches, D) plus a grid; :mod:`nanogrpo.models.vision` folds them
  back into the (I, C, H, W) images LLaVA's tower takes.

Everything is checked at start (:func:`check_rows`): a missing or unreadable file, a corrupt
image, an image far over the pixel cap (more than ``OVER_CAP`` times its area), more
placeholders than images: one line naming the row. Nothing here needs torchvision.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanogrpo.errors import DataError

OVER_CAP = 64
"""An image with more than this many times ``data.max_image_pixels`` pixels is refused at start
(it would be resized down, but it is far more likely a wrong file than a picture meant for it)."""
MAX_ASPECT = 200
"""The processors refuse images whose long side is more than this many times the short one."""
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageSpec:
    """How a model takes images: what its processor would do, read off its config
    (:func:`nanogrpo.models.vision.image_spec`)."""

    layout: str
    """``qwen`` (patches + grid, M-RoPE) or ``llava`` (fixed-size images)."""
    patch_size: int
    merge_size: int = 1
    temporal_patch_size: int = 1
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    fixed: int | None = None
    """LLaVA: every image is resized to ``fixed`` x ``fixed``."""
    image_token: str = "<|image_pad|>"
    """The token the model's input ids hold once per image feature."""
    wrap: tuple[str, str] = ("", "")
    """Text around each image's tokens (Qwen: ``<|vision_start|>`` / ``<|vision_end|>``)."""

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def tokens_per_image(self, grid: torch.Tensor) -> int:
        """How many image tokens one image of ``grid`` (t, h, w) takes in the text."""
        return int(grid.prod()) // (self.merge_size ** 2)

    @property
    def row_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2


@dataclass
class VisionInputs:
    """One prompt's images as model input: ``pixel_values`` (P, D) float32 patches, ``grid`` (I, 3)
    int64 (t, h, w) in patches per image, P = sum of t*h*w."""

    pixel_values: torch.Tensor
    grid: torch.Tensor

    @property
    def num_images(self) -> int:
        return int(self.grid.shape[0])


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: (h, w) multiples of ``factor``, area in [min, max], aspect kept."""
    if min(height, width) < 1:
        raise ValueError(f"image of size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over {MAX_ASPECT}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is in the vision extra
        raise DataError("images need Pillow: pip install 'nanogrpo[vision]'") from None
    return Image


def open_image(value: Any, base: Path | None = None):
    """A row's image value as an RGB PIL image; :class:`ValueError` (one line) when it cannot be."""
    Image = _pil()
    if isinstance(value, Image.Image):
        img = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        img = _decode(io.BytesIO(bytes(value)))
    elif isinstance(value, dict) and ("bytes" in value or "path" in value):  # HF datasets Image feature
        if value.get("bytes"):
            img = _decode(io.BytesIO(value["bytes"]))
        elif value.get("path"):
            return open_image(str(value["path"]), base)
        else:
            raise ValueError("an image dict with neither bytes nor path")
    elif isinstance(value, (str, Path)):
        text = str(value)
        if "://" in text:
            raise ValueError(f"image {text[:80]!r} is a URL: nanogrpo reads no network for data; "
                             "download it and give the file's path")
        path = Path(text)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise ValueError(f"image file {str(path)!r} does not exist")
        img = _decode(path)
    else:
        raise ValueError(f"an image must be a path, bytes, a PIL image or an HF Image dict, "
                         f"not {type(value).__name__}")
    return img.convert("RGB")


def _decode(src):
    Image = _pil()
    try:
        img = Image.open(src)
        img.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"unreadable image ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})"
                         ) from None
    return img


def row_images(row: dict[str, Any], field: str) -> list[Any]:
    """The raw image values of a row (a list; empty when it has none)."""
    v = row.get(field)
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def target_size(img, spec: ImageSpec) -> tuple[int, int]:
    """(height, width) the image is resized to."""
    if spec.fixed is not None:
        return spec.fixed, spec.fixed
    return smart_resize(img.height, img.width, spec.factor, spec.min_pixels, spec.max_pixels)


def render(images: list, spec: ImageSpec) -> VisionInputs:
    """Pixel patches and grids of RGB PIL images (see the module docstring)."""
    Image = _pil()
    mean = torch.tensor(spec.mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(spec.std, dtype=torch.float32)[:, None, None]
    rows, grids = [], []
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    for img in images:
        h, w = target_size(img, spec)
        if (img.height, img.width) != (h, w):
            img = img.resize((w, h), resample=Image.BICUBIC)
        x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(h, w, 3)
        x = (x.permute(2, 0, 1).float() / 255.0 - mean) / std                  # (C, H, W)
        gh, gw = h // p, w // p
        x = x.reshape(3, gh // m, m, p, gw // m, m, p)
        x = x.permute(1, 4, 2, 5, 0, 3, 6)                                    # (gh/m, gw/m, m, m, C, p, p)
        x = x.unsqueeze(5).expand(*x.shape[:5], tp, p, p)                      # temporal copies
        rows.append(x.reshape(gh * gw, 3 * tp * p * p))
        grids.append([1, gh, gw])
    if not rows:
        return VisionInputs(torch.zeros(0, spec.row_dim), torch.zeros(0, 3, dtype=torch.int64))
    return VisionInputs(torch.cat(rows).contiguous(), torch.tensor(grids, dtype=torch.int64))


def image_text(spec: ImageSpec, grid: torch.Tensor) -> str:
    """The text one image takes in the prompt: its tokens, wrapped."""
    return spec.wrap[0] + spec.image_token * spec.tokens_per_image(grid) + spec.wrap[1]


def place_images(text: str, placeholder: str, grids: torch.Tensor, spec: ImageSpec) -> str:
    """``text`` with each placeholder replaced by its image's tokens, in order; images without a
    placeholder go in front of the text. More placeholders than images: :class:`ValueError`."""
    parts = text.split(placeholder)
    n = grids.shape[0]
    if len(parts) - 1 > n:
        raise ValueError(f"{len(parts) - 1} image placeholder(s) {placeholder!r} but {n} image(s)")
    if len(parts) == 1:
        return "".join(image_text(spec, g) for g in grids) + text
    if len(parts) - 1 < n:
        raise ValueError(f"{n} image(s) but only {len(parts) - 1} placeholder(s) {placeholder!r}")
    out = [parts[0]]
    for g, rest in zip(grids, parts[1:]):
        out.append(image_text(spec, g) + rest)
    return "".join(out)


def count_placeholders(row: dict[str, Any], placeholder: str) -> int:
    texts = [row.get("question") or ""]
    for m in row.get("messages") or []:
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            texts.append(m["content"])
    return sum(t.count(placeholder) for t in texts if isinstance(t, str))


def check_rows(rows: list[dict[str, Any]], field: str, placeholder: str, max_pixels: int,
               origin: str, base: Path | None = None) -> int:
    """Read every row's images once, at start: each must open, fit ``OVER_CAP`` x the pixel cap, and the
    row's placeholders must not outnumber its images. Each image value is replaced by the opened
    RGB image (read once, kept in memory). Returns how many images there are; :class:`DataError`
    naming the row otherwise."""
    total = 0
    for i, row in enumerate(rows):
        raw = row_images(row, field)
        rid = row.get("id", i)
        try:
            imgs = [open_image(v, base) for v in raw]
            for img in imgs:
                if img.width * img.height > OVER_CAP * max_pixels:
                    raise ValueError(f"image of {img.width}x{img.height} pixels is far over "
                                     f"data.max_image_pixels={max_pixels} (more than {OVER_CAP}x)")
                if max(img.width, img.height) / min(img.width, img.height) > MAX_ASPECT:
                    raise ValueError(f"image of {img.width}x{img.height} has an aspect ratio over "
                                     f"{MAX_ASPECT}")
            n_ph = count_placeholders(row, placeholder)
            if n_ph > len(imgs):
                raise ValueError(f"{n_ph} placeholder(s) {placeholder!r} but {len(imgs)} image(s)")
            if 0 < n_ph < len(imgs):
                raise ValueError(f"{len(imgs)} image(s) but only {n_ph} placeholder(s) {placeholder!r}")
        except ValueError as e:
            raise DataError(f"{origin}, row {i} (id {rid!r}): {e}") from None
        if raw:
            row[field] = imgs
        total += len(imgs)
    return total


IMAGE_ENGINES = ("auto", "hf")
"""The rollout engines that take images (``auto`` picks ``hf`` for a vision-language model)."""


def _first_with_images(rows: list[dict[str, Any]], field: str) -> str | None:
    """``row 3 (id 'x')``: the first row with images, or None when no row has any (the scan stops at
    the first)."""
    for i, r in enumerate(rows):
        if row_images(r, field):
            rid = r.get("id")
            return f"row {i}" + (f" (id {rid!r})" if rid not in (None, "") else "")
    return None


def check_images_early(rows: list[dict[str, Any]], field: str, *, engine: str, vision: bool | None,
                       model: str, multi_turn: bool = False) -> None:
    """Before any weights are read: :class:`DataError` (one line, naming the first row with images) when
    rows have images but the run cannot take them: multi-turn (``[tools]``, an environment), a rollout
    engine other than ``hf`` / ``auto`` (``fast`` and vLLM are not given images), or a text model
    (``vision`` False: its ``config.json`` has no ``vision_config``; None: not known yet, checked once the
    model is loaded, :func:`check_model_takes_images`)."""
    first = _first_with_images(rows, field)
    if first is None:
        return
    head = f"{first} has images (data.image_field={field!r})"
    if multi_turn:
        raise DataError(f"{head}: multi-turn rollouts (tools, environments) take no images; drop the images "
                        "or the tools / environment")
    if engine not in IMAGE_ENGINES:
        raise DataError(f"{head} but rollout.engine={engine} takes no images (nanogrpo passes images to the "
                        "hf engine only): use rollout.engine=hf (auto picks it for a vision-language model)")
    if vision is False:
        raise DataError(f"{head} but the model {model!r} is a text model: use a vision-language model, or "
                        "drop the images")


def check_model_takes_images(rows: list[dict[str, Any]], field: str, spec: ImageSpec | None,
                             model: str, multi_turn: bool = False) -> None:
    """:class:`DataError` (one line, naming the first row with images) when rows have images but the
    model takes none (a text model: ``spec`` None), or the run is multi-turn (``[tools]``, an environment:
    their turns carry no images)."""
    check_images_early(rows, field, engine="hf", vision=spec is not None, model=model, multi_turn=multi_turn)


def data_uri(img, max_side: int = 256) -> str:
    """A PNG ``data:`` URI of an image (shrunk to ``max_side`` at most), for sample logs and reports."""
    import base64

    img = img.copy()
    img.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def encode_with_images(tokenizer, samples: list[dict[str, Any]], cfg, template: str, spec: ImageSpec
                       ) -> tuple[list[list[int]], list[int], list[VisionInputs]]:
    """:func:`nanogrpo.data.prompts.encode_prompts` for rows with images: each row's prompt rendered
    through the chat template with its images' tokens where its placeholders stand (before its question
    when it has none), and its pixel inputs. Returns (ids, skipped, inputs) for the kept rows; a prompt
    over ``data.max_prompt_tokens`` (image tokens count) is skipped."""
    from nanogrpo.data.prompts import render_samples

    if not samples:
        return [], [], []
    ph = cfg.image_placeholder
    prepared, inputs = [], []
    for s in samples:
        imgs = [open_image(v) for v in row_images(s, cfg.image_field)]
        if imgs and count_placeholders(s, ph) == 0:
            if s.get("messages"):
                raise DataError(f"row {s.get('id', '?')!r}: chat turns with images need a placeholder "
                                f"{ph!r} per image")
            s = dict(s, question=ph * len(imgs) + s["question"])
        prepared.append(s)
        inputs.append(render(imgs, spec))
    texts = render_samples(tokenizer, prepared, cfg, template)
    texts = [place_images(t, ph, v.grid, spec) if v.num_images else t for t, v in zip(texts, inputs)]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids, skipped, kept = [], [], []
    for i, seq in enumerate(encoded):
        if len(seq) > cfg.max_prompt_tokens:
            skipped.append(i)
        else:
            ids.append(list(seq))
            kept.append(inputs[i])
    return ids, skipped, kept
