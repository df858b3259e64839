"""The fast engine's buffers: KV cache, RoPE tables, decode states and their CUDA graphs.

A decode *state* is one (row bucket, cache length, sampling mode) configuration: static
buffers (cache views, next token, pads, finished flags, outputs, sampling parameters) that
one decode step reads and writes in place, so the step can be captured once as a CUDA graph
and replayed. Every state is a view of one flat KV buffer per K and V, grown (and every
graph dropped) only when a request needs more. Rows are padded to power-of-two buckets when
graphs are on; the engine moves the live rows to a smaller bucket when that halves the batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PREFILL_TOKENS = 16384
"""Prompt tokens per prefill chunk: bounds the activations of long prompts x many prompts."""


@dataclass
class State:
    """Static buffers of one (rows, length, mode) decode configuration; a CUDA graph reads them."""

    rows: int
    length: int  # cache slots
    mode: tuple
    k: torch.Tensor  # [layers, rows, kv, length, D], a view of the flat KV buffer
    v: torch.Tensor
    tok: torch.Tensor  # [rows] next input token
    pad: torch.Tensor  # [rows] left-pad of each row (first real slot)
    done: torch.Tensor  # [rows] bool, emitted EOS
    slot: torch.Tensor  # [1] slot of the input token; the step advances it
    out_tok: torch.Tensor  # [rows, length + 1] sampled token at column slot + 1
    out_lp: torch.Tensor  # [rows, length + 1] its log-prob
    temp: torch.Tensor  # [1]
    top_p: torch.Tensor  # [1]
    lp_temp: torch.Tensor  # [1] temperature of the reported log-probs
    graph: object | None = None
    row_ids: list = field(default_factory=list)  # original row of each state row, -1 = filler


def bucket(rows: int, graphs: bool) -> int:
    """Graph buckets are powers of two >= 8; eager runs use the exact row count."""
    return max(8, 1 << (rows - 1).bit_length()) if graphs else rows


def new_state(rows: int, length: int, mode: tuple, kv_flat: tuple[torch.Tensor, torch.Tensor],
              layers: int, nkv: int, hd: int) -> State:
    """A state whose cache is the first ``rows x length`` slots of ``kv_flat`` (shared by all states)."""
    dev = kv_flat[0].device
    shape = (layers, rows, nkv, length, hd)
    n = rows * length * layers * nkv * hd
    z = lambda *s, **k: torch.zeros(*s, device=dev, **k)  # noqa: E731
    k, v = (flat[:n].view(shape) for flat in kv_flat)
    one = lambda: torch.ones(1, device=dev)  # noqa: E731
    return State(rows, length, mode, k, v, z(rows, dtype=torch.long), z(rows, dtype=torch.long),
                 z(rows, dtype=torch.bool), z(1, dtype=torch.long), z(rows, length + 1, dtype=torch.long),
                 z(rows, length + 1, dtype=torch.float32), one(), one(), one())


def kv_buffers(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.zeros(numel, dtype=dtype, device=device) for _ in range(2))


@torch.no_grad()
def rope_table(rotary: torch.nn.Module, n: int, limit: int | None, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, R] of positions 0 .. n-1, from the model's own rotary module.

    With a length-bound rope type (``limit``: dynamic, longrope) the module is called as the
    model calls it for a sequence of at most ``limit`` tokens: first with one position (a
    dynamic module that was rescaled by a longer call returns to its original frequencies),
    then over ``min(n, limit)`` positions; rows past ``limit`` are zero (the engine refuses
    sequences that long: no real token reads them). Never called over more positions than the
    sequence has: transformers' dynamic RoPE would rescale every angle."""
    x = torch.empty(1, dtype=dtype, device=device)
    m = n if limit is None else min(n, limit)
    with torch.inference_mode(False):  # the module may update its buffers: keep them normal tensors
        if limit is not None:
            rotary(x, torch.zeros(1, 1, dtype=torch.long, device=device))
        cos, sin = rotary(x, torch.arange(m, device=device)[None])
    cos, sin = cos[0].clone(), sin[0].clone()  # [m, R], model dtype (as HF)
    if m < n:
        cos, sin = (torch.cat([t, t.new_zeros(n - m, t.shape[-1])]) for t in (cos, sin))
    return cos, sin


def warm_up(st: State, step: Callable[[State], None], device: torch.device) -> None:
    """Run the step a few times on a side stream (compiles on first use). Writes only the
    scratch slot ``length - 1``: the cache is one slot longer than any sequence needs."""
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None
    if cuda:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
        for _ in range(3):
            st.slot.fill_(st.length - 1)
            step(st)
    if cuda:
        torch.cuda.current_stream(device).wait_stream(side)
    st.slot.fill_(st.length - 1)


def capture(st: State, step: Callable[[State], None], gen: torch.Generator, pool) -> object:
    """Record one decode step as a CUDA graph whose replays draw from ``gen`` (seeded per call)."""
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    with torch.cuda.graph(graph, pool=pool):
        step(st)
    return graph


def harvest(st: State, res_tok: torch.Tensor, res_lp: torch.Tensor, width: int, n_new: int) -> None:
    """Copy the state's real rows' outputs (columns width .. width + n_new) to the results."""
    real = [j for j, r in enumerate(st.row_ids) if r >= 0]
    src = torch.tensor(real, device=res_tok.device)
    dst = torch.tensor([st.row_ids[j] for j in real], device=res_tok.device)
    res_tok[dst] = st.out_tok[src, width:width + n_new]
    res_lp[dst] = st.out_lp[src, width:width + n_new]


def move_rows(st: State, live: list[int], new: State, pad_id: int) -> None:
    """Copy the ``live`` rows of ``st`` into the first rows of ``new`` (same cache storage: the
    rows are gathered first); the rest of ``new`` becomes finished filler."""
    m = len(live)
    idx = torch.tensor(live, device=st.tok.device)
    saved = [t[idx].clone() for t in (st.tok, st.pad, st.done, st.out_tok, st.out_lp)]
    k, v = st.k[:, idx], st.v[:, idx]  # gathered copies [layers, m, kv, length, D]
    scalars = [t.clone() for t in (st.slot, st.temp, st.top_p, st.lp_temp)]
    new.k[:, :m], new.v[:, :m] = k, v
    for dst, src in zip((new.tok, new.pad, new.done, new.out_tok, new.out_lp), saved, strict=True):
        dst[:m] = src
    new.done[m:], new.pad[m:], new.tok[m:] = True, 0, pad_id
    for dst, src in zip((new.slot, new.temp, new.top_p, new.lp_temp), scalars, strict=True):
        dst.copy_(src)
    new.row_ids = [st.row_ids[j] for j in live] + [-1] * (new.rows - m)
