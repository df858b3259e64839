"""Route records: compact storage, their place in a batch, and the engines' formats.

A *route* is, for one token and one MoE layer, the ``top_k`` experts the router chose (in the router's
order). Records are small integers: ``uint8`` for models of fewer than 255 experts, ``int16`` up to
32767 (:func:`route_dtype`), with one value reserved for "no record" (:data:`NO_ROUTE`: 255 in uint8,
-1 in int16; -1 once unpacked to int64): the last token of a sequence (sampled, never fed back through
the model), padding, or a token an engine did not report. Replay lets the model route those tokens
itself (:mod:`nanogrpo.moe.replay`).

Shapes:

- per sample, from an engine (``Generation.routes[i]``): (prompt tokens + completion tokens, moe_layers,
  top_k), one row per token of the prompt (no padding) then of the completion;
- in a batch (``RolloutBatch.routes``): (N, P + C, moe_layers, top_k), aligned with ``input_ids``:
  prompts left-padded, completions right-padded, :data:`NO_ROUTE` on padding (:func:`batch_routes`);
- per micro-batch: the rows and columns ``training/micro.py``'s ``trim_rows`` keeps (:func:`trim_routes`).

vLLM returns ``(tokens - 1, decoder layers, top_k)`` (uint8 for <= 256 experts, else uint16 / int32):
in process as ``CompletionOutput.routed_experts`` (numpy), on its token route
``/inference/v1/generate`` as base64 of the ``.npy`` bytes (``choices[i].routed_experts``);
:func:`from_vllm` and :func:`decode_npy_base64` turn them into a sample's record.

Memory: ``moe_layers x top_k`` bytes per token in uint8 (Qwen3-30B-A3B: 48 x 8 = 384 B, 1.5 MiB for a
4096-token sample); :func:`route_bytes`.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence

import torch

from nanogrpo.moe.families import MoeSpec, RouteError

NO_ROUTE = -1
"""No record for this token (unpacked value; stored as 255 in uint8, -1 in int16)."""
ROUTE_DTYPES = (torch.uint8, torch.int16)
MAX_NPY_BYTES = 1 << 30
"""The largest base64-decoded route array accepted from a server."""


def _sentinel(dtype: torch.dtype) -> int:
    return 255 if dtype == torch.uint8 else -1


def pack(idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 expert ids (any shape, :data:`NO_ROUTE` where unknown) -> the compact ``dtype``."""
    if dtype not in ROUTE_DTYPES:
        raise RouteError(f"route dtype must be uint8 or int16, got {dtype}")
    return torch.where(idx < 0, _sentinel(dtype), idx).to(dtype)


def unpack(routes: torch.Tensor) -> torch.Tensor:
    """Compact records -> int64 expert ids, :data:`NO_ROUTE` (-1) where there is none."""
    if routes.dtype == torch.uint8:
        r = routes.long()
        return torch.where(r == 255, NO_ROUTE, r)
    return routes.long()


def has_route(routes: torch.Tensor) -> torch.Tensor:
    """(..., layers, k) records -> (...) bool: the token has a record in every layer."""
    return (unpack(routes) >= 0).flatten(-2).all(-1)


def route_bytes(spec: MoeSpec, tokens: int) -> int:
    """Bytes the routes of ``tokens`` tokens take (prompt + completion of a sample, or a batch's N x L)."""
    return tokens * spec.bytes_per_token


def empty_routes(spec: MoeSpec, *lead: int, device=None) -> torch.Tensor:
    """(*lead, moe_layers, top_k) records holding :data:`NO_ROUTE` everywhere."""
    dt = spec.route_dtype
    return torch.full((*lead, spec.moe_layers, spec.top_k), _sentinel(dt), dtype=dt, device=device)


def check_routes(routes: torch.Tensor, spec: MoeSpec, what: str = "routes") -> None:
    """A record fits the model: dtype, (..., moe_layers, top_k), ids below the expert count (one line)."""
    if not isinstance(routes, torch.Tensor) or routes.dtype not in ROUTE_DTYPES:
        raise RouteError(f"{what} must be a uint8 or int16 tensor, got "
                         f"{getattr(routes, 'dtype', type(routes).__name__)}")
    if routes.dim() < 2 or tuple(routes.shape[-2:]) != (spec.moe_layers, spec.top_k):
        raise RouteError(f"{what} of shape {tuple(routes.shape)} do not fit {spec.model_type}'s "
                         f"{spec.moe_layers} MoE layers x top {spec.top_k}: routes of another model?")
    ids = unpack(routes)
    if ids.numel() and int(ids.max()) >= spec.num_experts:
        raise RouteError(f"{what} name expert {int(ids.max())}; {spec.model_type} has {spec.num_experts} "
                         "experts: routes of another model?")
    if ids.numel() and int(ids.min()) < NO_ROUTE:
        raise RouteError(f"{what} hold a negative expert id {int(ids.min())}")


def batch_routes(per_row: Sequence[torch.Tensor | None], attention_mask: torch.Tensor, prompt_len: int,
                 spec: MoeSpec) -> torch.Tensor:
    """Per-sample records -> the batch's (N, P + C, moe_layers, top_k), aligned with ``input_ids``.

    ``per_row[i]``: row i's (prompt tokens + completion tokens, moe_layers, top_k), in the batch's row
    order, or None (the engine returned none for it: the row holds NO_ROUTE, :func:`rows_without_routes`
    finds it); attention_mask (N, P + C): prompts left-padded to ``prompt_len``, completions
    right-padded (``rollout.collect.pad_batch``). Padding gets :data:`NO_ROUTE`."""
    n, width = attention_mask.shape
    if len(per_row) != n:
        raise RouteError(f"{len(per_row)} route records for a batch of {n} rows")
    am = attention_mask.bool().cpu()
    out = empty_routes(spec, n, width)                                       # (N, L, layers, k)
    for i, r in enumerate(per_row):
        if r is None:
            continue
        check_routes(r, spec, f"row {i}'s routes")
        plen, clen = int(am[i, :prompt_len].sum()), int(am[i, prompt_len:].sum())
        if r.shape[0] != plen + clen:
            raise RouteError(f"row {i}: routes for {r.shape[0]} tokens, the row has {plen} prompt + {clen} "
                             "completion tokens")
        out[i, prompt_len - plen:prompt_len + clen] = pack(unpack(r.cpu()), spec.route_dtype)
    return out


def pad_routes(per_row: Sequence[torch.Tensor | None], attention_mask: torch.Tensor,
               prompt_len: int) -> torch.Tensor | None:
    """The rollout's side of :func:`batch_routes`, before the model is known: per-sample records -> the
    batch's (N, P + C, moe_layers, top_k) in the records' own shape and dtype, :data:`NO_ROUTE` on padding
    and on rows without a record; None when no row has one. Whether they fit the model is checked where
    they are used (:func:`check_routes`)."""
    known = [r for r in per_row if r is not None]
    if not known:
        return None
    tail, dtype = tuple(known[0].shape[1:]), known[0].dtype
    if len(tail) != 2 or dtype not in ROUTE_DTYPES:
        raise RouteError(f"route records of shape {tuple(known[0].shape)} and dtype {dtype}: expected "
                         "(tokens, moe_layers, top_k) uint8 / int16")
    n, width = attention_mask.shape
    am = attention_mask.bool().cpu()
    out = torch.full((n, width, *tail), _sentinel(dtype), dtype=dtype)        # (N, L, layers, k)
    for i, r in enumerate(per_row):
        if r is None:
            continue
        if tuple(r.shape[1:]) != tail:
            raise RouteError(f"row {i}'s routes {tuple(r.shape)} differ in shape from row 0's {tail}")
        plen, clen = int(am[i, :prompt_len].sum()), int(am[i, prompt_len:].sum())
        if r.shape[0] != plen + clen:
            raise RouteError(f"row {i}: routes for {r.shape[0]} tokens, the row has {plen} prompt + {clen} "
                             "completion tokens")
        out[i, prompt_len - plen:prompt_len + clen] = pack(unpack(r.cpu()), dtype)
    return out


def routes_defect(batch, spec: MoeSpec) -> str | None:
    """Why ``batch.routes`` cannot be a record of ``spec``'s model (one line), or None (fits, or none)."""
    if batch.routes is None:
        return None
    try:
        check_routes(batch.routes, spec, "the batch's routes")
    except RouteError as e:
        return str(e)
    return None


def rows_without_routes(routes: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows with a real token that has no record, the row's last token apart (never fed back
    through the model, it has none from any engine). routes (N, L, layers, k), attention_mask (N, L)."""
    real = attention_mask.bool().to(routes.device)                           # (N, L)
    last = real.long().cumsum(1) == real.long().sum(1, keepdim=True)         # (N, L) the last real and after
    need = real & ~(last & real)                                             # (N, L) all real but the last
    return (need & ~has_route(routes)).any(1)                                # (N,)


def trim_columns(attention_mask: torch.Tensor, completion_mask: torch.Tensor, prompt_len: int,
                 rows: torch.Tensor) -> tuple[int, int]:
    """The columns ``training/micro.py``'s ``trim_rows`` keeps for ``rows``: [lead, prompt_len + c), lead the
    leading all-padding prompt columns, c the longest completion (at least 1)."""
    am, cm = attention_mask[rows], completion_mask[rows]
    lead = int(torch.nonzero(am[:, :prompt_len].bool().any(0))[0])
    c = max(int(cm.sum(1).max()), 1)
    return lead, prompt_len + c


def trim_routes(batch, rows: torch.Tensor) -> torch.Tensor:
    """``batch.routes`` of a micro-batch: rows ``rows``, the columns ``trim_rows`` keeps, so that they line up
    with the ``input_ids`` the forward receives. (n, lead.. P + c, moe_layers, top_k)."""
    if batch.routes is None:
        raise RouteError("the batch carries no routes (moe.routing_replay=rollout needs an engine that "
                         "records them)")
    a, b = trim_columns(batch.attention_mask, batch.completion_mask, batch.prompt_len, rows)
    return batch.routes[rows.to(batch.routes.device)][:, a:b]


def prompts_share_routes(routes: torch.Tensor, input_ids: torch.Tensor, prompt_len: int) -> bool:
    """Rows with the same prompt have the same record for it, but for its last token: what
    ``token_stats(share_prefix=True)`` assumes when it runs each distinct prompt once (all its tokens but
    the last; the last runs with each row). False: run the batch without prefix sharing for exact replay.
    routes (N, P + C, moe_layers, top_k), input_ids (N, P + C)."""
    p = prompt_len - 1
    if p < 1:
        return True
    _, inv = torch.unique(input_ids[:, :p], dim=0, return_inverse=True)     # (N,) prompt of each row
    head = routes[:, :p]                                                     # (N, p, layers, k)
    first = torch.zeros(int(inv.max()) + 1, dtype=torch.long, device=inv.device)
    first.scatter_reduce_(0, inv, torch.arange(inv.shape[0], device=inv.device), "amin", include_self=False)
    return bool((head == head[first[inv]]).all())


def from_vllm(arr, n_tokens: int, spec: MoeSpec, what: str = "routed_experts") -> torch.Tensor:
    """vLLM's routes of one sample -> its record (n_tokens, moe_layers, top_k).

    ``arr``: (n_tokens - 1, decoder layers or MoE layers, top_k) integers (numpy or torch), the last
    token having none (it was never forwarded); ``n_tokens`` = prompt + completion tokens. The layer
    axis keeps the MoE layers (:attr:`MoeSpec.layer_ids`) when it counts every decoder layer."""
    t = torch.as_tensor(arr)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 3:
        raise RouteError(f"{what}: expected a 3-D integer array (tokens, layers, top_k), got "
                         f"{t.dtype} of shape {tuple(t.shape)}")
    if t.shape[0] not in (n_tokens - 1, n_tokens):
        raise RouteError(f"{what}: routes for {t.shape[0]} tokens, the sample has {n_tokens} "
                         f"(expected {n_tokens - 1}: every token but the last)")
    if t.shape[2] != spec.top_k:
        raise RouteError(f"{what}: top {t.shape[2]} experts per token, {spec.model_type} routes to "
                         f"{spec.top_k}: routes of another model?")
    if t.shape[1] == spec.num_layers and spec.num_layers != spec.moe_layers:
        t = t[:, list(spec.layer_ids)]
    elif t.shape[1] != spec.moe_layers:
        raise RouteError(f"{what}: {t.shape[1]} layers, {spec.model_type} has {spec.moe_layers} MoE layers "
                         f"of {spec.num_layers}: routes of another model?")
    t = t.long()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= spec.num_experts):
        raise RouteError(f"{what}: expert ids in [{int(t.min())}, {int(t.max())}], {spec.model_type} has "
                         f"{spec.num_experts} experts: routes of another model?")
    out = empty_routes(spec, n_tokens)
    out[:t.shape[0]] = pack(t, spec.route_dtype)
    return out


def decode_npy_base64(text: str, what: str = "routed_experts"):
    """The base64 ``.npy`` bytes vLLM's server sends -> a numpy array (no pickle; size-limited)."""
    import numpy as np

    if not isinstance(text, str):
        raise RouteError(f"{what} must be a base64 string, got {type(text).__name__}")
    if len(text) > MAX_NPY_BYTES * 4 // 3 + 4:
        raise RouteError(f"{what}: {len(text)} characters is over the {MAX_NPY_BYTES}-byte limit")
    try:
        raw = base64.b64decode(text, validate=True)
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise RouteError(f"{what} is not base64 of a .npy array: {str(e).splitlines()[0][:120]}") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        got = getattr(arr, "dtype", type(arr).__name__)
        raise RouteError(f"{what}: expected an integer array, got {got}")
    return arr


def from_server_choice(choice: dict, prompt_len: int, spec: MoeSpec) -> torch.Tensor | None:
    """One choice of ``/inference/v1/generate`` -> its sample's record, or None when the server sent no
    routes (started without ``--enable-return-routed-experts``, or the request was aborted)."""
    text = choice.get("routed_experts")
    if text is None:
        return None
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise RouteError("a choice with routed_experts but no token_ids")
    return from_vllm(decode_npy_base64(text), prompt_len + len(ids), spec)


def from_completion_output(output, prompt_len: int, spec: MoeSpec) -> torch.Tensor | None:
    """vLLM's in-process ``CompletionOutput`` -> its sample's record (``routed_experts``), or None when the
    engine was built without ``enable_return_routed_experts``."""
    arr = getattr(output, "routed_experts", None)
    if arr is None:
        return None
    return from_vllm(arr, prompt_len + len(output.token_ids), spec)
