"""The weight relay: policy weights published by the trainer, fetched by rollout workers.

Every publish is validated in full before it replaces anything (:func:`check_weights`), with
the same rules the receiving side applies before loading (:func:`nanogrpo.serve.client.
load_published`), so weights the server relays are weights a worker can load:

- the safetensors header is strict UTF-8 JSON (no duplicate keys, no NaN),
  ``__metadata__`` maps strings to strings, every tensor entry has exactly ``dtype``, ``shape``
  and ``data_offsets``;
- dtypes are floating (F32, F16, BF16, F64); shapes are lists of non-negative integers
  (not ``"1"``, ``-1``, ``1.0`` or ``true``); each tensor's byte range is exactly
  shape x itemsize, and the ranges tile the data with no gap or overlap to the last byte;
- names and shapes are the model's (:class:`WeightLayout`): from the reference model, else
  (``beta = 0``) from the model's config on the meta device, else pinned by the first accepted
  publish. Tied weights (e.g. ``lm_head.weight`` = ``model.embed_tokens.weight``) may be sent once.

Versions only move forward, and by at most ``max_step`` per publish once the server holds a
version (the trainer moves it by ``publish_every x updates_per_batch``); the first publish
on a fresh server may set any version below 2**53 (a resumed trainer starts where it was).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

MAX_VERSION = 2**53 - 1
"""Versions stay exact as JSON numbers and floats."""
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_MAX_HEADER = 64 << 20
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


class WeightsError(ValueError):
    """Published weights break a rule; the message is one line."""


@dataclass
class WeightLayout:
    """The names and shapes a publish must have. ``groups`` lists names that are one tensor (tied
    weights): at least one name of each group must be sent; any name sent must be the model's."""

    shapes: dict[str, tuple[int, ...]]
    groups: list[list[str]] = field(default_factory=list)

    @classmethod
    def of_model(cls, model) -> WeightLayout:
        """From a model's state dict; parameters shared by several names (tied) form one group."""
        sd = model.state_dict(keep_vars=True)
        by_tensor: dict[int, list[str]] = {}
        for name, t in sd.items():
            by_tensor.setdefault(id(t), []).append(name)
        return cls({k: tuple(v.shape) for k, v in sd.items()}, list(by_tensor.values()))

    @classmethod
    def of_published(cls, shapes: dict[str, tuple[int, ...]]) -> WeightLayout:
        return cls(dict(shapes), [[k] for k in shapes])

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        for name, shape in shapes.items():
            want = self.shapes.get(name)
            if want is None:
                raise WeightsError(f"tensor {name[:80]!r} is not in the model")
            if shape != want:
                raise WeightsError(f"tensor {name[:80]!r} has shape {shape}, the model's is {want}")
        for group in self.groups:
            if not any(n in shapes for n in group):
                raise WeightsError(f"tensor {group[0][:80]!r} is missing ({len(self.shapes)} expected)")


def weights_cap(layout: WeightLayout) -> int:
    """The most bytes a publish of ``layout`` can take: every name's tensor at 8 bytes an element (F64,
    the widest dtype :func:`check_weights` accepts; tied names counted each) plus the safetensors header
    (its length, 256 bytes and the name per entry, 64 KiB for the metadata and padding). What a client
    reads of ``GET /weights`` at most (:mod:`nanogrpo.http_limits`)."""
    data = sum(math.prod(shape) * 8 for shape in layout.shapes.values())
    header = 8 + (64 << 10) + sum(len(name.encode()) + 256 for name in layout.shapes)
    return data + header


def layout_from_config(path: str, trust_remote_code: bool = False) -> WeightLayout | None:
    """The model's layout built on the meta device from its config (no weights read); None if the
    config cannot be read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None
    return WeightLayout.of_model(model)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise WeightsError(f"safetensors header repeats the key {k[:80]!r}")
        out[k] = v
    return out


def _no_constants(name: str):
    raise WeightsError(f"safetensors header holds {name}")


def _int(x) -> bool:
    return type(x) is int  # not bool, not float


def read_header(body: bytes, total: int | None = None) -> tuple[dict, int]:
    """The safetensors header as a dict, and where the data starts; :class:`WeightsError` if malformed.
    ``total``: the whole body's size when ``body`` is only its start (a body on disk)."""
    total = len(body) if total is None else total
    if total < 10:
        raise WeightsError("body too short for safetensors")
    n = int.from_bytes(body[:8], "little")
    if n < 2 or n > min(total - 8, len(body) - 8, _MAX_HEADER):
        raise WeightsError("safetensors header length out of range")
    try:
        text = body[8:8 + n].decode("utf-8")
    except UnicodeDecodeError:
        raise WeightsError("safetensors header is not UTF-8") from None
    if not text.startswith("{"):
        raise WeightsError("safetensors header must be a JSON object")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except RecursionError:
        raise WeightsError("safetensors header is nested too deeply") from None
    except ValueError as e:
        if isinstance(e, WeightsError):
            raise
        raise WeightsError("safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise WeightsError("safetensors header must be a JSON object")
    return header, 8 + n


def check_weights(body: bytes, layout: WeightLayout | None = None) -> dict[str, tuple[int, ...]]:
    """Validate a published state dict without materialising a tensor; return its names and shapes."""
    return _check(body, len(body), layout)


def check_weights_file(path, layout: WeightLayout | None = None) -> dict[str, tuple[int, ...]]:
    """:func:`check_weights` of a body on disk, reading only its header."""
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        head += f.read(min(n, _MAX_HEADER + 1))
    return _check(head, total, layout)


def _check(body: bytes, total: int, layout: WeightLayout | None) -> dict[str, tuple[int, ...]]:
    header, start = read_header(body, total)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise WeightsError("safetensors __metadata__ must map strings to strings")
    if not header:
        raise WeightsError("state dict holds no tensors")
    spans: list[tuple[int, int]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for name, info in header.items():
        label = repr(name[:80])
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise WeightsError(f"tensor name {label} is not valid UTF-8") from None
        if not isinstance(info, dict) or set(info) != _ENTRY_KEYS:
            raise WeightsError(f"tensor {label}: entry must hold exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise WeightsError(f"tensor {label}: dtype {str(dtype)[:10]!r} is not F32, F16, BF16 or F64")
        if not isinstance(shape, list) or not all(_int(d) and 0 <= d < 2**40 for d in shape):
            raise WeightsError(f"tensor {label}: shape must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) and o >= 0 for o in offsets)):
            raise WeightsError(f"tensor {label}: data_offsets must be two non-negative integers")
        a, b = offsets
        if b - a != math.prod(shape) * _ITEMSIZE[dtype]:
            raise WeightsError(f"tensor {label}: byte range {a}..{b} is not shape {tuple(shape)} x "
                               f"{_ITEMSIZE[dtype]} bytes")
        spans.append((a, b))
        shapes[name] = tuple(shape)
    spans.sort()
    end = 0
    for a, b in spans:
        if a != end:
            raise WeightsError("tensor data ranges overlap or leave gaps")
        end = b
    if end != total - start:
        raise WeightsError(f"tensor data ends at byte {end} but the body holds {total - start}")
    if layout is not None:
        layout.check(shapes)
    return shapes


class WeightRelay:
    """The latest accepted weights (a file in ``directory``, never held in memory: give it one on a disk,
    not a tmpfs), their version and the id of the publish that sent them. A publish is spooled to
    :meth:`spool_path` as it arrives and checked there; :meth:`accept` makes it the served file and
    removes the one before (a fetch still reading it keeps its open descriptor)."""

    def __init__(self, layout: WeightLayout | None = None, max_step: int = 1000, directory=None):
        self.layout = layout
        self.max_step = max_step
        self._own_dir = directory is None
        self._directory = None if directory is None else Path(directory)
        self.path: Path | None = None
        self.size = 0
        self.version = -1
        self.publish_id = ""
        self.busy = False
        self._spools = 0
        self._ready = False

    @property
    def directory(self) -> Path:
        """Where the weights are spooled and served from, made at the first publish: the given one (files a
        killed server left there removed first), else a private temporary directory."""
        if self._directory is None:
            import tempfile

            self._directory = Path(tempfile.mkdtemp(prefix="nanogrpo-relay-"))
        elif not self._ready:
            self._directory.mkdir(parents=True, exist_ok=True)
            self._remove_ours()
        self._ready = True
        return self._directory

    def _remove_ours(self) -> None:
        for pattern in ("weights-*.safetensors", "incoming-*.safetensors"):
            for f in self._directory.glob(pattern):
                f.unlink(missing_ok=True)

    def spool_path(self) -> Path:
        """A fresh file name for an incoming publish (removed by the caller if it is not accepted)."""
        self._spools += 1
        return self.directory / f"incoming-{os.getpid()}-{self._spools}.safetensors"

    def open(self):
        """The served weights, opened for reading (None when none were published)."""
        return None if self.path is None else open(self.path, "rb")  # noqa: SIM115 (closed by the sender)

    def close(self) -> None:
        """Remove the served file (and the directory, when the relay made it)."""
        import shutil

        if self._own_dir:
            if self._directory is not None:
                shutil.rmtree(self._directory, ignore_errors=True)
                self._directory = None
        elif self._ready:
            self._remove_ours()
        self.path = None

    def check_version(self, version: int) -> str | None:
        """None if ``version`` may be published now, else why not ("old" or a too-large step)."""
        if version <= self.version:
            return "old"
        if self.version >= 0 and version - self.version > self.max_step:
            return (f"version {version} jumps {version - self.version} past the server's {self.version} "
                    f"(at most {self.max_step} per publish: server.max_version_step)")
        if version > MAX_VERSION:
            return f"version must be at most {MAX_VERSION}"
        return None

    def accept(self, spooled: Path, version: int, publish_id: str,
               shapes: dict[str, tuple[int, ...]]) -> None:
        if self.layout is None:  # beta = 0 without a readable model config: the first publish sets it
            self.layout = WeightLayout.of_published(shapes)
        served = self.directory / f"weights-{version}.safetensors"
        os.replace(spooled, served)
        old, self.path = self.path, served
        if old is not None and old != served:
            old.unlink(missing_ok=True)
        self.size = served.stat().st_size
        self.version, self.publish_id = version, publish_id
