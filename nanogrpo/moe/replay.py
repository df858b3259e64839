"""Routing replay in the Hugging Face forward: force recorded experts, record the model's own.

Hooks, not a patched model: a forward pre-hook on the transformers model (the outermost
``PreTrainedModel`` inside PEFT / DDP / FSDP2 / DeepSpeed wrappers) reads which tokens each forward
runs, and a forward hook on every ``*TopKRouter`` (:mod:`nanogrpo.moe.families`) rewrites its output
``(logits, weights, experts)``:

- replay (:func:`replay_routes`): the experts become the recorded ones, and the weights the family's
  gate function of the router's *own* logits over them (``GATES``), so the router's weight still gets a
  gradient; a token with no record (:data:`~nanogrpo.moe.routes.NO_ROUTE`: padding, the last token)
  keeps the router's own choice;
- record (:func:`record_routes`): the router's own experts are copied into a record laid out as the
  batch (for ``moe.routing_replay=policy``, R2, and the disagreement metric without replay);
- generation (:class:`GenerationRoutes`): every forward of ``model.generate`` is kept, prefill then one
  column per decode step, and cut into per-sample records (the hf engine).

Which tokens a forward runs: the record covers a batch (input_ids (n, L), attention_mask (n, L),
routes (n, L, moe_layers, top_k)), and ``nanogrpo.algo.logprobs.token_stats`` runs it as one forward
(input_ids[:, :L - 1]), or with ``share_prefix`` as a forward of the distinct prompts (U, p) followed by
one of every row's suffix (n, S) over that cache, or (models off the lean path) one row at a time.
A forward's first column is its attention mask's width less its own length (the cached tokens); its
rows are the batch's when there are n of them and their tokens are the batch's there (checked), else
each is matched by its tokens and mask to a batch row (a prompt shared by a group: any of its rows;
row-at-a-time: in order). A forward the record does not cover is a :class:`RouteError`. A prompt run
once for its group is replayed with its first row's record: exact when the engine routed the group's
prompt alike (it ran it once, or identically per row); :func:`~nanogrpo.moe.routes.prompts_share_routes`
says whether it did, and prefix sharing should be off for a batch where it did not.

Gradient checkpointing recomputes each layer's forward during the backward, routers included: keep
the context open until the backward is done (the hooks then replay the last forward's routes again).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from nanogrpo.moe.families import MoeSpec, RouteError, hf_model, moe_spec
from nanogrpo.moe.routes import NO_ROUTE, check_routes, empty_routes, pack, unpack


@dataclass
class RouteStats:
    """What a replay or record saw, summed over its forwards (first passes only, not recomputes)."""

    token_layers: int = 0
    """(token, MoE layer) pairs that had a record to compare with."""
    flipped: int = 0
    """Of those, pairs where the router's own top-k set was not the record's (router disagreement)."""
    tokens_without_record: int = 0
    """Tokens that ran without a record (padding and last tokens included): they routed themselves."""
    shared_prompt_conflicts: int = 0
    """Token-layers of a prompt run once for several rows (``share_prefix``) whose records differ between
    those rows: the first row's were replayed for all (:func:`~nanogrpo.moe.routes.prompts_share_routes`
    tells beforehand)."""

    @property
    def disagreement(self) -> float:
        return self.flipped / self.token_layers if self.token_layers else float("nan")


@dataclass
class RouteTrace:
    """The result of :func:`replay_routes` / :func:`record_routes`."""

    stats: RouteStats = field(default_factory=RouteStats)
    routes: torch.Tensor | None = None
    """record: the model's own routes (n, L, moe_layers, top_k) in the record dtype, NO_ROUTE on
    tokens no forward ran (the last column); filled when the context exits."""


def _in_backward() -> bool:
    """Inside an autograd backward (where gradient checkpointing recomputes layers)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is None or task() != -1


def _same_set(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(T, k) expert ids each -> (T,) bool: the same set of experts."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def _forward_ids(args, kwargs) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, int]]:
    """(input_ids, attention_mask, (B, S)) of a transformers forward call."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    am = kwargs.get("attention_mask")
    if ids is not None:
        return ids, am, (int(ids.shape[0]), int(ids.shape[1]))
    emb = kwargs.get("inputs_embeds")
    if emb is None:
        raise RouteError("a forward without input_ids or inputs_embeds: cannot tell its tokens")
    return None, am, (int(emb.shape[0]), int(emb.shape[1]))


class _Hooks:
    """The hooks of one replay / record / generation context (see the module docstring)."""

    def __init__(self, model, spec: MoeSpec, *, replay: torch.Tensor | None = None,
                 input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 record: bool = False, compare: torch.Tensor | None = None, generation: bool = False):
        self.spec = spec
        self.trace = RouteTrace()
        self.replay = replay                # (n, L, layers, k) int64 or None
        self.compare = compare              # (n, L, layers, k) int64: disagreement without replay
        self.ids, self.am = input_ids, attention_mask
        self.record = record
        self.generation = generation
        self.chunks: list[torch.Tensor] = []   # generation: per forward (B, S, layers, k) compact
        self.cursor = 0                     # row-at-a-time forwards: the next row
        self.current: dict | None = None   # the forward being run
        self.handles = []
        top = hf_model(model)
        self.handles.append(top.register_forward_pre_hook(self._pre, with_kwargs=True))
        self.handles.append(top.register_forward_hook(self._post, with_kwargs=True))
        for i, r in enumerate(spec.routers):
            self.handles.append(r.register_forward_hook(self._router_hook(i)))
        if record:
            self.trace.routes = empty_routes(spec, *input_ids.shape, device=input_ids.device)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ which tokens a forward runs
    def _locate(self, ids_f: torch.Tensor | None, am_f: torch.Tensor | None, b: int, s: int
                ) -> tuple[list[list[int]], int]:
        """For each of the forward's B rows, the batch rows it stands for (replay reads the first; record
        writes them all), and the batch column of its first token."""
        if ids_f is None:
            raise RouteError("routing replay matches a forward's tokens by their ids: the forward got "
                             "inputs_embeds only")
        n, width = self.ids.shape
        m = int(am_f.shape[1]) if am_f is not None else s
        col0 = m - s
        if col0 < 0 or m > width:
            raise RouteError(f"a forward of {s} tokens after {col0} cached ones does not fit the record's "
                             f"{width} columns: wrong routes for this batch")
        ids_f = ids_f.to(self.ids.device)
        window = self.ids[:, col0:m]                                         # (n, S)
        am = self.am[:, :m].bool() if self.am is not None else None
        am_f = am_f.to(self.ids.device).bool() if am_f is not None else None
        if (b == n and torch.equal(window, ids_f)
                and (am is None or am_f is None or torch.equal(am, am_f))):
            return [[r] for r in range(n)], col0
        eq = (ids_f[:, None, :] == window[None]).all(-1)                     # (B, n)
        if am is not None and am_f is not None:
            eq &= (am_f[:, None, :] == am[None]).all(-1)
        rows = [torch.nonzero(e).flatten().tolist() for e in eq]
        if not all(rows):
            raise RouteError(f"a forward of {b} x {s} tokens at column {col0} that the record's batch does "
                             "not hold: replay/record was armed with another batch than the forward runs")
        if b == 1:  # row at a time: rows in order, identical rows included
            later = [r for r in rows[0] if r >= self.cursor]
            rows = [later or rows[0]]
            self.cursor = rows[0][0] + 1
        return rows, col0

    def _pre(self, module, args, kwargs):
        ids_f, am_f, (b, s) = _forward_ids(args, kwargs)
        cur = {"b": b, "s": s, "seen": set()}
        if self.generation:
            dev = (ids_f if ids_f is not None else kwargs["inputs_embeds"]).device
            cur["own"] = torch.full((b * s, self.spec.moe_layers, self.spec.top_k), NO_ROUTE,
                                    dtype=torch.long, device=dev)
        else:
            rows, col0 = self._locate(ids_f, am_f, b, s)
            cur["rows"], cur["col0"] = rows, col0
            first = torch.tensor([r[0] for r in rows], device=self.ids.device)
            for name, src in (("forced", self.replay), ("compare", self.compare)):
                if src is not None:
                    cur[name] = src[first, col0:col0 + s].reshape(b * s, *src.shape[2:])  # (B*S, layers, k)
            if self.replay is not None and any(len(r) > 1 for r in rows):
                win = self.replay[:, col0:col0 + s]                          # (n, S, layers, k)
                self.trace.stats.shared_prompt_conflicts += sum(
                    int((win[r[1:]] != win[r[0]]).any(-1).sum()) for r in rows if len(r) > 1)
            if self.record:
                cur["own"] = torch.full((b * s, self.spec.moe_layers, self.spec.top_k), NO_ROUTE,
                                        dtype=torch.long, device=self.ids.device)
        self.current = cur

    def _post(self, module, args, kwargs, output):
        cur = self.current
        if cur is None:
            return
        cur["done"] = True                  # its layers now run again only in a backward's recompute
        if "own" not in cur:
            return
        own = cur.pop("own").view(cur["b"], cur["s"], self.spec.moe_layers, self.spec.top_k)
        if self.generation:
            self.chunks.append(pack(own, self.spec.route_dtype))
            return
        dst = self.trace.routes
        packed = pack(own, dst.dtype).to(dst.device)
        col0, s = cur["col0"], cur["s"]
        for j, rows in enumerate(cur["rows"]):
            dst[rows, col0:col0 + s] = packed[j]

    # ------------------------------------------------------------------ the routers
    def _router_hook(self, layer: int):
        spec = self.spec

        def hook(module, args, output):
            cur = self.current
            if cur is None or (cur.get("done") and not _in_backward()):
                raise RouteError(f"MoE layer {spec.names[layer]} ran outside a forward of the model the "
                                 "routes were armed on (a call to .forward() that skips its hooks?): "
                                 "refusing to route it unseen")
            logits, weights, own = output
            t = int(own.shape[0])
            if t != cur["b"] * cur["s"]:
                raise RouteError(f"MoE layer {spec.names[layer]} routed {t} tokens in a forward of "
                                 f"{cur['b']} x {cur['s']}: a forward the replay did not see (gradient "
                                 "checkpointing recomputes layers in the backward: keep the context open)")
            first = layer not in cur["seen"]     # a recompute in the backward repeats the layer
            cur["seen"].add(layer)
            if first and "own" in cur:
                cur["own"][:, layer] = own.detach().to(cur["own"].device)
            ref = cur.get("forced", cur.get("compare"))
            if ref is None:
                return None
            rec = ref[:, layer].to(own.device)                               # (T, k)
            have = (rec >= 0).all(-1)                                        # (T,)
            if first:
                st = self.trace.stats
                st.token_layers += int(have.sum())
                st.flipped += int((have & ~_same_set(own, rec.clamp(min=0))).sum())
                if layer == 0:
                    st.tokens_without_record += int((~have).sum())
            if "forced" not in cur:
                return None
            experts = torch.where(have[:, None], rec, own)                   # (T, k)
            return logits, spec.gate(module, logits, experts), experts

        return hook


def _unpacked(routes: torch.Tensor, spec: MoeSpec, like: torch.Tensor, what: str) -> torch.Tensor:
    check_routes(routes, spec, what)
    if routes.dim() != 4 or tuple(routes.shape[:2]) != tuple(like.shape):
        raise RouteError(f"{what} of shape {tuple(routes.shape)} do not line up with input_ids "
                         f"{tuple(like.shape)}")
    return unpack(routes).to(like.device)


@contextmanager
def replay_routes(model, routes: torch.Tensor, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, spec: MoeSpec | None = None):
    """Forwards of ``model`` over (rows of) ``input_ids`` use the experts ``routes`` records.

    routes: (n, L, moe_layers, top_k) uint8 / int16, aligned with ``input_ids`` (n, L) and
    ``attention_mask`` (n, L): the tensors the forward is given (a micro-batch: :func:`~nanogrpo.moe.
    routes.trim_routes`). Yields a :class:`RouteTrace` whose stats count the token-layers where the
    model's own top-k differs from the record (the router disagreement)."""
    spec = spec or moe_spec(model)
    if spec is None:
        raise RouteError("routing replay needs a mixture-of-experts model; this one is dense")
    hooks = _Hooks(model, spec, replay=_unpacked(routes, spec, input_ids, "routes"), input_ids=input_ids,
                   attention_mask=attention_mask)
    try:
        yield hooks.trace
    finally:
        hooks.remove()


@contextmanager
def record_routes(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  compare: torch.Tensor | None = None, spec: MoeSpec | None = None):
    """Record the experts the model itself chooses in forwards over (rows of) ``input_ids`` (n, L).

    Yields a :class:`RouteTrace`; its ``routes`` (n, L, moe_layers, top_k) hold them (NO_ROUTE on padding
    and where no forward ran a token). ``compare``: a record (rollout routes) to count the disagreement
    with, while the model routes itself (replay off)."""
    spec = spec or moe_spec(model)
    if spec is None:
        raise RouteError("recording routes needs a mixture-of-experts model; this one is dense")
    cmp = None if compare is None else _unpacked(compare, spec, input_ids, "compare routes")
    hooks = _Hooks(model, spec, input_ids=input_ids, attention_mask=attention_mask, record=True, compare=cmp)
    try:
        yield hooks.trace
    finally:
        hooks.remove()
        if attention_mask is not None:  # padding ran through the model but is no token of the batch
            hooks.trace.routes[~attention_mask.bool().to(hooks.trace.routes.device)] = \
                pack(torch.tensor(NO_ROUTE), hooks.trace.routes.dtype)


@contextmanager
def compare_routes(model, routes: torch.Tensor, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, spec: MoeSpec | None = None):
    """The model routes itself; its top-k is compared with the record ``routes`` (the router disagreement
    with replay off). Yields a :class:`RouteTrace` (stats only). Shapes as :func:`replay_routes`."""
    spec = spec or moe_spec(model)
    if spec is None:
        raise RouteError("comparing routes needs a mixture-of-experts model; this one is dense")
    hooks = _Hooks(model, spec, input_ids=input_ids, attention_mask=attention_mask,
                   compare=_unpacked(routes, spec, input_ids, "routes"))
    try:
        yield hooks.trace
    finally:
        hooks.remove()


class GenerationRoutes:
    """Routes of a ``model.generate`` call (the hf engine): use as a context around it, then
    :meth:`samples` cuts per-sample records.

    ``generate`` runs a prefill over the left-padded prompts (R, P) and one forward per later token
    (R, 1): token t's route comes from the forward that feeds it; the last sampled token is never fed."""

    def __init__(self, model, spec: MoeSpec | None = None):
        self.model = model
        self.spec = spec or moe_spec(model)
        if self.spec is None:
            raise RouteError("recording routes needs a mixture-of-experts model; this one is dense")
        self.hooks: _Hooks | None = None
        self.chunks: list[torch.Tensor] = []

    def __enter__(self) -> GenerationRoutes:
        self.hooks = _Hooks(self.model, self.spec, generation=True)
        return self

    def __exit__(self, *exc) -> None:
        self.chunks = self.hooks.chunks
        self.hooks.remove()

    def sequence(self) -> torch.Tensor:
        """(R, P + T, moe_layers, top_k) on the CPU: prompt columns, then one per generated token, the last
        NO_ROUTE."""
        if not self.chunks:
            raise RouteError("no forward ran under the route recorder")
        r = self.chunks[0].shape[0]
        if any(c.shape[0] != r for c in self.chunks):
            raise RouteError("generate's forwards changed their row count: routes cannot be laid out")
        tail = empty_routes(self.spec, r, 1, device=self.chunks[0].device)
        return torch.cat([*self.chunks, tail], 1).cpu()

    def samples(self, prompt_lens: list[int], completion_lens: list[int], prompt_width: int
                ) -> list[torch.Tensor]:
        """Per row r: (prompt_lens[r] + completion_lens[r], moe_layers, top_k), the prompt left-padded to
        ``prompt_width`` in the forwards."""
        seq = self.sequence()
        if seq.shape[1] < prompt_width + max(completion_lens, default=0):
            raise RouteError(f"routes for {seq.shape[1]} columns, the longest sample needs "
                             f"{prompt_width + max(completion_lens)}")
        return [seq[i, prompt_width - p:prompt_width + c].clone()
                for i, (p, c) in enumerate(zip(prompt_lens, completion_lens, strict=True))]
