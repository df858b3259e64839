"""The rollout batch: the one record that crosses every process boundary (DESIGN §4).

In process it is a dataclass of tensors; on the wire it is safetensors bytes
whose ``__metadata__`` carries a JSON header (never pickle, never ``torch.load``).

Layout (N sequences = groups * G, P prompt columns, C completion columns):

    input_ids        int64   (N, P + C)  prompt left-padded to P, completion right-padded to C
    attention_mask   int8    (N, P + C)  1 on real prompt tokens and on completion tokens in the mask
    completion_mask  bool    (N, C)      completion tokens up to and including the first EOS
    rewards          float32 (N,)
    advantages       float32 (N,)
    group_ids        int64   (N,)        consecutive runs of G equal ids
    old_logprobs     float32 (N, C)      behaviour log-probs (0 where masked)
    ref_logprobs     float32 (N, C)      reference log-probs, optional (absent when beta == 0)
    loss_mask        bool    (N, C)      tokens the loss trains on, optional (absent: = completion_mask);
                                         a subset of completion_mask: multi-turn rollouts leave tool
                                         output out (context the model reads, never trained on)
    truncated        bool    (N,)        the token limit cut the completion off (finish reason "length");
                                         optional (absent: unknown; grpo.mask_truncated then masks nothing)
    correct          bool    (N,)        the completion is right (the task's accuracy); optional
    teacher_logprobs float32 (N, C)      the distillation teacher's log-probs of the completion tokens
                                         (0 where masked), optional ([distill])
    teacher_topk_logprobs float32 (N, C, K)  the teacher's top-k log-probs at each completion position and
    teacher_topk_ids      int64   (N, C, K)  their token ids, optional, the two together (distill.top_k)
    pixel_values     float32 (P, D)      the prompts' images as patch rows (vision-language models);
    image_grid_thw   int64   (I, 3)      optional, the three together: (t, h, w) patches per image, and
    image_counts     int64   (N,)        images per sequence, sequence 0's first (``nanogrpo.algo.vision``)
    routes           uint8 | int16 (N, P + C, M, K)  mixture-of-experts models: the K experts each of the M
                                         MoE layers chose for each token, aligned with input_ids; 255 (uint8)
                                         / -1 (int16) where none (padding, the last token); optional
                                         (``nanogrpo.moe.routes``)

Header: prompt_len, policy_version, group_size, and free-form ``meta`` (reward
breakdown, question ids, ...), JSON-serialisable. Keys the split-mode trainer and server read:
``behaviour_logprobs`` (true: the engine's numerics are not the trainer's, take the clipped
ratio from the first update), ``logprob_temperature`` (the temperature the log-probs are of;
absent: 1.0, the seed's untempered convention), ``logprob_support`` (``[top_k, top_p]``: the
log-probs are over each position's top-k / top-p support, ``nanogrpo.algo.support``; absent: over
the vocabulary), ``worker``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from nanogrpo.algo.vision import check_images, select_rows

FORMAT = "nanogrpo.batch/1"

_SPEC: dict[str, tuple[torch.dtype, str]] = {
    # name: (dtype, shape kind)
    "input_ids": (torch.int64, "NL"),
    "attention_mask": (torch.int8, "NL"),
    "completion_mask": (torch.bool, "NC"),
    "rewards": (torch.float32, "N"),
    "advantages": (torch.float32, "N"),
    "group_ids": (torch.int64, "N"),
    "old_logprobs": (torch.float32, "NC"),
    "ref_logprobs": (torch.float32, "NC"),
    "loss_mask": (torch.bool, "NC"),
    "truncated": (torch.bool, "N"),
    "correct": (torch.bool, "N"),
    "teacher_logprobs": (torch.float32, "NC"),
    "teacher_topk_logprobs": (torch.float32, "NCK"),
    "teacher_topk_ids": (torch.int64, "NCK"),
}
_OPTIONAL = {"ref_logprobs", "loss_mask", "truncated", "correct", "teacher_logprobs", "teacher_topk_logprobs",
             "teacher_topk_ids"}
MAX_TOPK = 1000
"""The most teacher top-k entries per position on the wire."""
IMAGE_FIELDS = ("pixel_values", "image_grid_thw", "image_counts")
"""Optional as a set: a batch carries all three (its prompts have images) or none."""
MAX_IMAGES_PER_SEQ = 64
"""The most images one sequence may carry on the wire."""
ROUTES = "routes"
"""Optional: mixture-of-experts routes (``nanogrpo.moe.routes``), checked by :func:`_check_routes`."""
MAX_ROUTE_WIDTH = 1 << 16
"""The most (MoE layers x top_k) entries per token on the wire."""


class BatchError(ValueError):
    """A batch (in memory or on the wire) breaks the schema; the message is one line."""


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    old_logprobs: torch.Tensor
    prompt_len: int
    group_size: int
    policy_version: int = 0
    ref_logprobs: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_counts: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ shape helpers
    @property
    def num_seqs(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def trained_mask(self) -> torch.Tensor:
        """(N, C) bool: the tokens the loss, the KL and the length normalisation count."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def has_images(self) -> bool:
        return self.image_counts is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {k: getattr(self, k) for k in (*_SPEC, *IMAGE_FIELDS, ROUTES) if getattr(self, k) is not None}
        return out

    def images_of(self, rows: torch.Tensor | list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(pixel_values, grid, counts) of sequences ``rows``; None for a batch without images."""
        if not self.has_images:
            return None
        return select_rows(self.pixel_values, self.image_grid_thw, self.image_counts, rows)

    def to(self, device: torch.device | str) -> RolloutBatch:
        kw = {k: v.to(device) for k, v in self.tensors().items()}
        return RolloutBatch(**kw, prompt_len=self.prompt_len, group_size=self.group_size,
                            policy_version=self.policy_version, meta=self.meta)

    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """A new batch of the given row indices (same P and C); their images go with them."""
        kw = {k: v[rows] for k, v in self.tensors().items() if k not in IMAGE_FIELDS}
        if self.has_images:
            kw.update(zip(IMAGE_FIELDS, self.images_of(rows)))
        return RolloutBatch(**kw, prompt_len=self.prompt_len, group_size=self.group_size,
                            policy_version=self.policy_version, meta=self.meta)

    # ------------------------------------------------------------------ validation
    def validate(self, vocab_size: int | None = None, max_seqs: int | None = None,
                 max_len: int | None = None, num_experts: int | None = None) -> None:
        """Raise :class:`BatchError` (one line) unless every field agrees with the schema.
        ``num_experts``: the model's, bounding the expert ids of ``routes`` when it has them."""
        validate_tensors(self.tensors(), self.prompt_len, self.group_size, vocab_size, max_seqs, max_len,
                         num_experts)
        if not isinstance(self.policy_version, int) or self.policy_version < 0:
            raise BatchError(f"policy_version must be a non-negative int, got {self.policy_version!r}")

    # ------------------------------------------------------------------ wire format
    def to_bytes(self) -> bytes:
        header = {"format": FORMAT, "prompt_len": self.prompt_len, "group_size": self.group_size,
                  "policy_version": self.policy_version, "meta": self.meta}
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors().items()}
        return st_save(tensors, metadata={"nanogrpo": json.dumps(header, allow_nan=False)})

    @classmethod
    def from_bytes(cls, data: bytes, vocab_size: int | None = None, max_seqs: int | None = None,
                   max_len: int | None = None, num_experts: int | None = None) -> RolloutBatch:
        """Decode and validate; any defect raises :class:`BatchError`."""
        header = _read_header(data)
        try:
            tensors = st_load(data)
        except (SafetensorError, ValueError, RuntimeError, OverflowError) as e:
            raise BatchError(f"body is not valid safetensors: {str(e).splitlines()[0][:200]}") from None
        unknown = set(tensors) - set(_SPEC) - set(IMAGE_FIELDS) - {ROUTES}
        if unknown:
            raise BatchError(f"unknown tensor(s) {sorted(unknown)}")
        missing = set(_SPEC) - _OPTIONAL - set(tensors)
        if missing:
            raise BatchError(f"missing tensor(s) {sorted(missing)}")
        batch = cls(**tensors, prompt_len=header["prompt_len"], group_size=header["group_size"],
                    policy_version=header["policy_version"], meta=header["meta"])
        batch.validate(vocab_size, max_seqs, max_len, num_experts)
        return batch


def _check_teacher(t: dict[str, torch.Tensor], vocab_size: int | None) -> None:
    """The teacher's top-k tensors come as a pair, at most :data:`MAX_TOPK` wide, ids in the vocabulary."""
    lp, ids = t.get("teacher_topk_logprobs"), t.get("teacher_topk_ids")
    if (lp is None) != (ids is None):
        raise BatchError("teacher_topk_logprobs and teacher_topk_ids come together")
    if ids is None:
        return
    if not 1 <= ids.shape[-1] <= MAX_TOPK:
        raise BatchError(f"teacher top-k of width {ids.shape[-1]}: must be 1..{MAX_TOPK}")
    if ids.numel() and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        raise BatchError(f"teacher_topk_ids outside the vocabulary [0, {vocab_size})")


def _read_header(data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise BatchError("body too short for safetensors")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or n > min(len(data) - 8, 1 << 20):
        raise BatchError(f"safetensors header length {n} is out of range")
    try:
        st_header = json.loads(data[8:8 + n])
        raw = st_header["__metadata__"]["nanogrpo"]
        header = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise BatchError(f"missing or malformed nanogrpo header ({type(e).__name__})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BatchError(f"header format must be {FORMAT!r}")
    for key in ("prompt_len", "group_size", "policy_version"):
        v = header.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise BatchError(f"header field {key!r} must be a non-negative int, got {v!r}")
    if not isinstance(header.get("meta", {}), dict):
        raise BatchError("header field 'meta' must be an object")
    header.setdefault("meta", {})
    return header


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name} in header")


def _check_routes(t: dict[str, torch.Tensor], n: int, seq: int, num_experts: int | None) -> None:
    """``routes``: (N, P + C, M, K) uint8 / int16, the none-value on padding, ids below ``num_experts``."""
    r = t.get(ROUTES)
    if r is None:
        return
    if not isinstance(r, torch.Tensor) or r.dtype not in (torch.uint8, torch.int16):
        got = getattr(r, "dtype", type(r).__name__)
        raise BatchError(f"routes must be a uint8 or int16 tensor, got {got}")
    if r.dim() != 4 or tuple(r.shape[:2]) != (n, seq) or r.shape[2] < 1 or r.shape[3] < 1:
        raise BatchError(f"routes has shape {tuple(r.shape)}, expected ({n}, {seq}, moe_layers, top_k)")
    if r.shape[2] * r.shape[3] > MAX_ROUTE_WIDTH:
        raise BatchError(f"routes of {r.shape[2]} layers x top {r.shape[3]}: over {MAX_ROUTE_WIDTH} a token")
    none = 255 if r.dtype == torch.uint8 else -1
    ids = r.long()
    if r.dtype == torch.int16 and bool((ids < -1).any()):
        raise BatchError("routes hold a negative expert id")
    pad = ~t["attention_mask"].bool()                                        # (N, L)
    if bool((ids[pad] != none).any()):
        raise BatchError("routes on padding must be the none-value (255 for uint8, -1 for int16): routes "
                         "not aligned with input_ids")
    if num_experts is not None:
        real = ids[ids != none]
        if real.numel() and int(real.max()) >= num_experts:
            raise BatchError(f"routes name expert {int(real.max())}; the model has {num_experts}")


def validate_tensors(t: dict[str, torch.Tensor], prompt_len: int, group_size: int,
                     vocab_size: int | None, max_seqs: int | None, max_len: int | None,
                     num_experts: int | None = None) -> None:
    for name, (dtype, _) in _SPEC.items():
        if name not in t:
            if name in _OPTIONAL:
                continue
            raise BatchError(f"missing tensor {name!r}")
        if not isinstance(t[name], torch.Tensor):
            raise BatchError(f"{name} must be a tensor")
        if t[name].dtype != dtype:
            raise BatchError(f"{name} must be {dtype}, got {t[name].dtype}")
    ids = t["input_ids"]
    if ids.dim() != 2:
        raise BatchError(f"input_ids must be 2-D, got shape {tuple(ids.shape)}")
    n, seq = ids.shape
    if n == 0:
        raise BatchError("batch has no sequences")
    if group_size < 1 or n % group_size:
        raise BatchError(f"{n} sequences is not a multiple of group_size {group_size}")
    if not 1 <= prompt_len < seq:
        raise BatchError(f"prompt_len {prompt_len} must be in [1, {seq})")
    c = seq - prompt_len
    if max_seqs is not None and n > max_seqs:
        raise BatchError(f"{n} sequences exceeds the limit {max_seqs}")
    if max_len is not None and seq > max_len:
        raise BatchError(f"sequence length {seq} exceeds the limit {max_len}")
    topk = t.get("teacher_topk_ids")
    k = int(topk.shape[-1]) if topk is not None and topk.dim() == 3 else 1
    shapes = {"NL": (n, seq), "NC": (n, c), "N": (n,), "NCK": (n, c, k)}
    for name, (_, kind) in _SPEC.items():
        if name in t and tuple(t[name].shape) != shapes[kind]:
            raise BatchError(f"{name} has shape {tuple(t[name].shape)}, expected {shapes[kind]}")
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise BatchError(f"input_ids outside the vocabulary [0, {vocab_size})")
    am = t["attention_mask"]
    if bool(((am != 0) & (am != 1)).any()):
        raise BatchError("attention_mask must hold only 0 and 1")
    cm = t["completion_mask"]
    if not bool(cm.any(dim=1).all()):
        raise BatchError("every sequence needs at least one completion token")
    # the completion mask is a prefix: no True after a False
    if bool((cm[:, 1:] & ~cm[:, :-1]).any()):
        raise BatchError("completion_mask must be a prefix (True then False) in every row")
    if not bool((am[:, prompt_len:].bool() == cm).all()):
        raise BatchError("attention_mask over the completion must equal completion_mask")
    if not bool(am[:, prompt_len - 1].bool().all()):
        raise BatchError("prompts must be left-padded: last prompt column must be a real token")
    lm = t.get("loss_mask")
    if lm is not None:
        if bool((lm & ~cm).any()):
            raise BatchError("loss_mask must be a subset of completion_mask")
        if not bool(lm.any(dim=1).all()):
            raise BatchError("every sequence needs at least one token in loss_mask")
    _check_teacher(t, vocab_size)
    _check_routes(t, n, seq, num_experts)
    for name in ("rewards", "advantages", "old_logprobs", "ref_logprobs", "teacher_logprobs",
                 "teacher_topk_logprobs"):
        if name in t and not bool(torch.isfinite(t[name]).all()):
            raise BatchError(f"{name} holds NaN or inf")
    for name in ("old_logprobs", "ref_logprobs", "teacher_logprobs", "teacher_topk_logprobs"):
        if name in t and bool((t[name] > 1e-3).any()):
            raise BatchError(f"{name} must be <= 0 (log-probabilities)")
    present = [k for k in IMAGE_FIELDS if k in t]
    if present:
        if len(present) != len(IMAGE_FIELDS):
            raise BatchError(f"image tensors come as a set: {', '.join(IMAGE_FIELDS)}; got only {present}")
        if any(not isinstance(t[k], torch.Tensor) for k in IMAGE_FIELDS):
            raise BatchError("image fields must be tensors")
        err = check_images(t["pixel_values"], t["image_grid_thw"], t["image_counts"], n,
                           max_patches=(1 << 31) // max(t["pixel_values"].shape[-1], 1),
                           max_images=MAX_IMAGES_PER_SEQ)
        if err:
            raise BatchError(err)
    g = t["group_ids"].view(-1, group_size)
    if not bool((g == g[:, :1]).all()):
        raise BatchError("group_ids must be constant within each run of group_size rows")
    if math.prod(ids.shape) > (1 << 31):
        raise BatchError("batch too large")
