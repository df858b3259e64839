"""Fast rollout engine: our own lean forward over the live HF model's weights.

Families: those :mod:`.families` implements (Llama, Qwen2, Qwen3, Mistral, Ministral, OLMo2,
SmolLM3, Phi3), decided from the model's configuration; anything else is refused with the
reason (``rollout.engine=auto`` then picks ``hf``). The forward is :mod:`.forward`, sampling
:mod:`.sampling`, the buffers and CUDA graphs :mod:`.cache`.

What makes it fast (on CUDA; on CPU the same code runs eagerly):

- one prefill per distinct prompt; its KV rows are copied to the prompt's ``n`` samples;
- a preallocated KV cache ``[layers, rows, kv_heads, length, head_dim]``, RoPE from
  cos/sin tables the model's own rotary module computed, GQA attention by viewing the
  query heads that share a KV head as a query block of that head (no K/V repeat);
- the whole decode step (embedding, layers, LM head, sampling, EOS bookkeeping)
  captured as one CUDA graph per (row bucket, cache length, sampling mode); the step
  index lives on the device and the graph advances it itself, so the host only
  replays and looks at the finished flags every ``check_every`` steps;
- optionally, ``torch.compile`` (no cudagraphs of its own) fuses the small
  elementwise ops of each layer before the capture;
- fused QKV and gate/up projections with no extra memory: the fused matrix owns the
  storage and the HF model's ``q_proj.weight`` etc. are re-pointed to row slices of
  it (``param.data = fused[rows]``). The trainer keeps updating the same tensors in
  place, so the engine sees every update with no copy; ``update_weights`` copies in
  place; nothing is ever re-captured or re-compiled for new weights. If someone
  swaps a parameter's storage (``param.data = ...``), the next ``generate`` copies
  the new values back into the engine's storage and re-points the parameter (so keep
  one FastEngine per model: two would keep taking the parameters from each other).
  Measured on CPU (float32, "small" shape) fusion is a wash; on the GPU it saves 3
  GEMM launches per layer: ``bench/gpu_rollout.sh`` times ``fast`` vs ``fast-nofuse``;
- rows that finished are compacted away into a smaller bucket when that halves the
  batch (finished rows otherwise keep decoding, their outputs masked);
- multi-turn (tool) rollouts keep each trajectory's KV cache across turns
  (:meth:`FastEngine.open_session`, :mod:`.session`): a turn prefills only the new tokens.

Sampling uses the engine's own ``torch.Generator``, seeded from ``params.seed``:
same seed, same engine settings and prompts -> same completions.
"""

from __future__ import annotations

import contextlib
import secrets
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanogrpo.engines.base import Generation, SamplingParams
from nanogrpo.engines.fast import cache
from nanogrpo.engines.fast.cached_session import FastSession
from nanogrpo.engines.fast.families import (
    fast_support,
    layer_parts,
    layer_rope,
    layer_windows,
    length_bound_reason,
    rope_limit,
)
from nanogrpo.engines.fast.forward import (
    Arch,
    decode_attention,
    decode_mask,
    head,
    post_attn,
    pre_attn,
    prefill_attention,
    prefill_mask,
)
from nanogrpo.engines.fast.sampling import sample
from nanogrpo.engines.hf import check_request, cut_at_eos, load_in_place, resolve_special_ids
from nanogrpo.errors import ModelError
from nanogrpo.models.cpu_linear import DECODE_ROWS, choose, model_dims, onednn_available
from nanogrpo.models.cpu_linear import linear as onednn_linear


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_w: tuple
    qkv_b: tuple
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gu_w: tuple
    gu_b: tuple
    down_w: torch.Tensor
    down_b: torch.Tensor | None
    rope: bool
    window: int | None


def _data(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.data


def _fuse(linears: list, attr: str, fuse: bool) -> tuple:
    """Weights (or biases) of ``linears``: one concatenated tensor that the modules' parameters
    are re-pointed into (``fuse``), or the parameters' own tensors."""
    ps = [getattr(m, attr) for m in linears]
    if len(ps) == 1:  # already one module (Phi3's qkv_proj, gate_up_proj)
        return (_data(ps[0]),)
    if any(p is None for p in ps):
        if fuse and not all(p is None for p in ps):
            raise ModelError(f"cannot fuse {attr}: some projections have one and some do not")
        return tuple(_data(p) for p in ps) if not fuse else (None,)
    if not fuse:
        return tuple(p.data for p in ps)
    with torch.no_grad():  # not inference mode: the trainer still runs autograd through these
        whole = torch.cat([p.data for p in ps])  # [sum(out), in] or [sum(out)]
    start = 0
    for p in ps:
        p.data = whole[start:start + p.shape[0]]  # row slice: contiguous, same values
        start += p.shape[0]
    return (whole,)


class FastEngine:
    """Generation with its own forward for the families of :mod:`nanogrpo.engines.fast.families`.

    Args:
        model: the live HF model (its weights are shared, see the module docstring).
        eos_token_id, pad_token_id, tokenizer: special ids, as for :class:`HFEngine`; the tokenizer
            also finds stop strings in multi-turn sessions (:meth:`open_session`).
        ignore_eos: never stop at EOS (benchmarks): every row makes ``max_new_tokens``.
        fuse: fuse QKV and gate/up (re-points the model's parameters into fused storage).
        cuda_graphs: capture decode steps as CUDA graphs (default: on for CUDA).
        compile: ``torch.compile`` the per-layer pieces of the decode step (default: on for
            CUDA). Any failure of compile or capture warns and falls back to eager.
        compact: move unfinished rows to a smaller batch when that halves it.
        check_every: decode steps between looks at the finished flags (one host sync each).
        cpu_linear: run float32 CPU GEMMs through oneDNN (:mod:`nanogrpo.models.cpu_linear`):
            True / False, or a ``model.cpu_linear`` setting; ``auto`` (the default) times both for
            a decode step's shape on this CPU and takes the faster.
        max_len: the longest prompt + completion the caller will ask for, if known: a model the
            engine is exact for only up to a shorter length (dynamic / longrope RoPE) is refused
            when the engine is built rather than at the first request that long.

    A model the engine cannot compute exactly (see :func:`.families.fast_support`) is a
    :class:`ModelError` naming the reason. With a sharded trainer (FSDP, ZeRO-3) build the
    engine over a separate, full copy of the model and push weights with
    ``update_weights(full_state_dict)``.
    """

    name = "fast"

    def __init__(self, model, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, *, tokenizer=None, ignore_eos: bool = False,
                 fuse: bool = True, cuda_graphs: bool | None = None, compile: bool | None = None,
                 compact: bool = True, check_every: int = 16, cpu_linear: bool | str = "auto",
                 max_len: int | None = None):
        fam, why = fast_support(model, max_len)
        if fam is None:
            raise ModelError(f"the fast rollout engine cannot run this model: {why}; "
                             "use rollout.engine=hf (or auto)")
        cfg = model.config
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids, self.pad_id = resolve_special_ids(model, tokenizer, eos_token_id, pad_token_id)
        self.ignore_eos, self.compact, self.check_every = ignore_eos, compact, max(1, check_every)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if cuda_graphs is None else (cuda_graphs and cuda)
        self.use_compile = cuda if compile is None else compile
        base = model.model
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        parts = [layer_parts(fam, lyr) for lyr in base.layers]
        q_out = sum(m.weight.shape[0] for m in parts[0].qkv)  # (nh + 2 nkv) * D
        self.arch = Arch(nh=nh, nkv=nkv, hd=q_out // (nh + 2 * nkv), eps=float(cfg.rms_norm_eps),
                         qk_norm=fam.qk_norm, post_norm=fam.post_norm, scale_then_round=fam.scale_then_round)
        self.rope_limit = rope_limit(cfg)[0]
        windows, ropes = layer_windows(fam, cfg), layer_rope(fam, cfg)
        self.windows = sorted({w for w in windows if w is not None})
        self.layers = []
        for lp, window, use_rope in zip(parts, windows, ropes, strict=True):
            self.layers.append(_Layer(
                lp.norm1.weight.data, lp.norm2.weight.data, _fuse(lp.qkv, "weight", fuse),
                _fuse(lp.qkv, "bias", fuse), _data(getattr(lp.q_norm, "weight", None)),
                _data(getattr(lp.k_norm, "weight", None)), lp.o.weight.data, _data(lp.o.bias),
                _fuse(lp.gate_up, "weight", fuse), _fuse(lp.gate_up, "bias", fuse), lp.down.weight.data,
                _data(lp.down.bias), use_rope, window))
        lm = model.get_output_embeddings()
        self.embed, self.norm_w = base.embed_tokens.weight.data, base.norm.weight.data
        self.lm_w, self.lm_b = lm.weight.data, _data(lm.bias)
        # every (module, attr, tensor the engine reads) to keep the model's parameters on our storage
        self._bound = [(mod, name, getattr(mod, name).data) for mod in model.modules()
                       for name, prm in mod.named_parameters(recurse=False) if prm is not None]
        self._rotary = base.rotary_emb
        if isinstance(cpu_linear, str):
            cpu_linear = (self.device.type == "cpu" and self.dtype == torch.float32
                          and choose(cpu_linear, DECODE_ROWS, *model_dims(model)))
        self._lin = onednn_linear if cpu_linear and self.device.type == "cpu" else F.linear
        # what its float32 CPU GEMMs run on ("onednn" / "torch"; None: not float32 on the CPU)
        self.cpu_linear = (("onednn" if self._lin is onednn_linear and onednn_available() else "torch")
                           if self.device.type == "cpu" and self.dtype == torch.float32 else None)
        self._pre, self._post, self._head = pre_attn, post_attn, head
        if self.use_compile:
            self._pre, self._post, self._head = (torch.compile(f, fullgraph=True)
                                                 for f in (pre_attn, post_attn, head))
        self._attn_backends = contextlib.nullcontext
        if cuda:  # masked decode attention: the memory-efficient kernel (math as the fallback)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
            self._attn_backends = lambda: sdpa_kernel(backends)
        self.gen = torch.Generator(device=self.device)
        self.eos_t = torch.tensor(self.eos_ids, device=self.device)
        self._states: dict[tuple, cache.State] = {}
        self._kv_flat: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cos = self._sin = None
        self._pool = None

    # ------------------------------------------------------------ weights

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new weights in place (into the model's parameters, i.e. the engine's storage)."""
        self._rebind()
        load_in_place(self.model, state_dict)

    def _rebind(self) -> None:
        """Put back any parameter whose storage was swapped since the engine was built."""
        with torch.no_grad():
            for mod, name, t in self._bound:
                p = getattr(mod, name)
                if p.data_ptr() == t.data_ptr():
                    continue
                if p.shape != t.shape or p.dtype != t.dtype or p.device != t.device:
                    raise ModelError(f"parameter {name} of {type(mod).__name__} changed shape, dtype or "
                                     "device after the FastEngine was built; build a new engine")
                t.copy_(p.data)
                p.data = t

    # ------------------------------------------------------------ buffers, graphs

    def _bucket(self, rows: int) -> int:
        return cache.bucket(rows, self.use_graphs)

    def _ensure_capacity(self, rows: int, length: int) -> None:
        """KV buffers and RoPE tables big enough; growing them drops every captured graph."""
        per = len(self.layers) * self.arch.nkv * self.arch.hd
        if self._kv_flat is None or self._kv_flat[0].numel() < per * rows * length:
            self._states.clear()
            self._kv_flat = None  # free before allocating
            self._kv_flat = cache.kv_buffers(per * rows * length, self.dtype, self.device)
        if self._cos is None or self._cos.shape[0] < length:
            self._states.clear()
            n = -(-length // 256) * 256  # some room, so that most requests reuse the table
            self._cos, self._sin = cache.rope_table(self._rotary, n, self.rope_limit, self.dtype, self.device)

    def _state(self, rows: int, length: int, mode: tuple) -> cache.State:
        key = (rows, length, mode)
        st = self._states.get(key)
        if st is None:
            st = cache.new_state(rows, length, mode, self._kv_flat, len(self.layers), self.arch.nkv,
                                 self.arch.hd)
            if not self.use_graphs:
                return st  # eager: buffers are cheap, keep none between calls
            self._capture(st)
            self._states[key] = st
        return st

    def _capture(self, st: cache.State) -> None:
        """Warm up (compiles) and record one decode step as a CUDA graph; compile or capture
        failures fall back, loudly. (Off CUDA only the warm-up runs: tests use that to check
        the bucketed layout on CPU.)"""
        try:
            cache.warm_up(st, self._step, self.device)
        except Exception as e:
            if not self.use_compile:
                raise
            warnings.warn(f"FastEngine: torch.compile failed ({e!r:.300}); decode step runs uncompiled",
                          stacklevel=3)
            self.use_compile = False
            self._pre, self._post, self._head = pre_attn, post_attn, head
            cache.warm_up(st, self._step, self.device)
        if self.device.type != "cuda":
            return
        try:
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            st.graph = cache.capture(st, self._step, self.gen, self._pool)
        except Exception as e:  # a capture that fails must not stop the rollout
            warnings.warn(f"FastEngine: CUDA graph capture failed ({e!r:.300}); decoding eagerly",
                          stacklevel=3)
            self.use_graphs = False
            st.graph = None

    # ------------------------------------------------------------ one decode step

    def _step(self, st: cache.State, upto: int | None = None) -> None:
        """Feed ``st.tok`` at ``st.slot``, sample the next token into the state; ``slot += 1``.
        ``upto`` (eager runs, where the host knows it): ``slot + 1``, so attention reads only the
        filled part of the cache; graphs read all of it, masked."""
        pos = st.slot - st.pad  # [rows]
        cos, sin = self._cos[pos], self._sin[pos]  # [rows, R]
        n_kv = st.length if upto is None else upto
        masks = {w: decode_mask(st.slot, st.pad, n_kv, w, self.dtype) for w in (None, *self.windows)}
        x = F.embedding(st.tok, self.embed)  # [rows, hidden]
        a_ = self.arch
        r, g = st.rows, a_.nh // a_.nkv
        cpu = self.device.type == "cpu"
        for i, L in enumerate(self.layers):
            q, k, v = self._pre(x, L.ln1, L.qkv_w, L.qkv_b, L.q_norm, L.k_norm, cos if L.rope else None,
                                sin, a_, self._lin)
            st.k[i].index_copy_(2, st.slot, k.unsqueeze(2))  # cache [rows, kv, length, D]
            st.v[i].index_copy_(2, st.slot, v.unsqueeze(2))
            kc, vc = st.k[i][:, :, :n_kv], st.v[i][:, :, :n_kv]  # [rows, kv, n_kv, D]
            with self._attn_backends():  # the g query heads of a KV head act as its query block
                a = decode_attention(q.reshape(r, a_.nkv, g, a_.hd), kc, vc, masks[L.window], cpu)
            x = self._post(x, a.reshape(r, a_.nh * a_.hd), L.o_w, L.o_b, L.ln1, L.ln2, L.gu_w, L.gu_b,
                           L.down_w, L.down_b, a_, self._lin)
        self._sample_into(st, self._head(x, self.norm_w, self.lm_w, self.lm_b, a_, self._lin))

    def _sample_into(self, st: cache.State, logits: torch.Tensor) -> None:
        """logits [rows, vocab] float32 -> token, log-prob, EOS flag into the state; advances the slot."""
        tok, lp = sample(logits, st.mode, st.temp, st.top_p, st.lp_temp, self.gen)
        col = st.slot + 1
        st.out_tok.index_copy_(1, col, tok[:, None])
        st.out_lp.index_copy_(1, col, lp[:, None])
        if not self.ignore_eos:
            st.done |= (tok[:, None] == self.eos_t).any(-1)
        st.tok.copy_(tok)
        st.slot.add_(1)

    # ------------------------------------------------------------ generate

    def open_session(self, prompts: list[list[int]], params: SamplingParams, max_len: int):
        """A multi-turn :class:`~nanogrpo.engines.base.TurnSession` that keeps each trajectory's KV
        cache across turns (:class:`~nanogrpo.engines.fast.cached_session.FastSession`)."""
        return FastSession(self, prompts, params, max_len)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        check_request(prompts, params)
        self._rebind()
        cuda = self.device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(self.device)) if cuda else (lambda: None)
        t0 = time.perf_counter()
        n, n_new, n_prompts = params.n, params.max_new_tokens, len(prompts)
        rows = n_prompts * n
        width = max(len(p) for p in prompts)
        if self.rope_limit is not None and width + n_new - 1 > self.rope_limit:
            raise ModelError(f"the fast rollout engine cannot run this request: "
                             f"{length_bound_reason(self.model.config, self.rope_limit, width + n_new - 1)}; "
                             "use rollout.engine=hf (or auto)")
        length = width + n_new + 1  # +1: the scratch slot graphs are captured on
        if self.use_graphs:
            length = -(-length // 64) * 64
        mode = ("greedy",) if params.greedy else ("sample", params.top_k, params.top_p < 1.0,
                                                  params.support_logprobs)
        bucket = self._bucket(rows)
        self._ensure_capacity(bucket, length)
        st = self._state(bucket, length, mode)
        if self.compact and not self.ignore_eos:  # capture the smaller buckets now, before seeding
            b = bucket // 2
            while b >= self._bucket(1) and self.use_graphs:
                self._state(b, length, mode)
                b //= 2
        sync()
        t1 = time.perf_counter()
        self.gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        st.temp.fill_(max(params.temperature, 1e-6))
        st.top_p.fill_(params.top_p)
        st.lp_temp.fill_(params.logprob_temperature)
        self._prefill(st, prompts, n, width)
        sync()
        t2 = time.perf_counter()
        res_tok = torch.full((rows, n_new), self.pad_id, dtype=torch.long, device=self.device)
        res_lp = torch.zeros((rows, n_new), dtype=torch.float32, device=self.device)
        compactions, steps = 0, 0
        while steps < n_new - 1:
            if st.graph is not None:
                st.graph.replay()
            else:
                self._step(st, upto=width + steps + 1)
            steps += 1
            if steps % self.check_every or self.ignore_eos or steps == n_new - 1:
                continue
            live = (~st.done).nonzero()[:, 0].tolist()  # host sync, every check_every steps
            if not live:
                break
            if self.compact and self._bucket(len(live)) <= st.rows // 2:
                cache.harvest(st, res_tok, res_lp, width, n_new)
                new = self._state(self._bucket(len(live)), length, mode)
                cache.move_rows(st, live, new, self.pad_id)
                st = new
                compactions += 1
        cache.harvest(st, res_tok, res_lp, width, n_new)
        sync()
        t3 = time.perf_counter()
        comp, lps, reasons = cut_at_eos(res_tok, res_lp, self.eos_ids, self.ignore_eos)
        n_tok = sum(len(c) for c in comp)
        return Generation(comp, lps, reasons, stats={
            "setup_s": t1 - t0, "prefill_s": t2 - t1, "decode_s": t3 - t2, "decode_steps": float(steps + 1),
            "new_tokens": float(n_tok), "tok_per_s": n_tok / max(t3 - t1, 1e-9),
            "prefill_rows": float(n_prompts), "compactions": float(compactions),
            "cuda_graphs": float(st.graph is not None)})

    def _prefill(self, st: cache.State, prompts: list[list[int]], n: int, width: int) -> None:
        """Run each distinct prompt once (in chunks of about ``cache.PREFILL_TOKENS`` tokens), copy its KV
        rows to its n samples, and sample every row's first token."""
        b, rows, dev = len(prompts), len(prompts) * n, self.device
        pad = torch.tensor([width - len(p) for p in prompts])
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
        ids, pad = ids.to(dev), pad.to(dev)
        chunk = max(1, cache.PREFILL_TOKENS // width)
        logits = torch.cat([self._prefill_chunk(st, ids[c:c + chunk], pad[c:c + chunk], c * n, n)
                            for c in range(0, b, chunk)])  # [b, V]
        full = torch.zeros(st.rows, logits.shape[-1], device=dev)
        full[:rows] = logits.repeat_interleave(n, 0)
        st.pad.zero_()
        st.pad[:rows] = pad.repeat_interleave(n)
        st.done.fill_(True)
        st.done[:rows] = False
        st.slot.fill_(width - 1)
        self._sample_into(st, full)  # first token at column width
        st.row_ids = list(range(rows)) + [-1] * (st.rows - rows)

    def _prefill_chunk(self, st: cache.State, ids, pad, row0: int, n: int) -> torch.Tensor:
        """ids [b, P] left-padded, pad [b]: fill cache rows row0 .. row0 + b*n, return last logits [b, V]."""
        (b, width), a_ = ids.shape, self.arch
        pos = (torch.arange(width, device=self.device)[None] - pad[:, None]).clamp_min(0)  # [b, P]
        cos, sin = self._cos[pos], self._sin[pos]  # [b, P, R]
        masks = {w: prefill_mask(pad, width, w, self.dtype) for w in (None, *self.windows)}
        x = F.embedding(ids, self.embed)  # [b, P, hidden]
        for i, L in enumerate(self.layers):
            q, k, v = pre_attn(x, L.ln1, L.qkv_w, L.qkv_b, L.q_norm, L.k_norm, cos if L.rope else None, sin,
                               a_, self._lin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, P, D]
            for kv_cache, t in ((st.k[i], k), (st.v[i], v)):  # row row0 + b_i*n + j <- prompt b_i
                dst = kv_cache[row0:row0 + b * n].view(b, n, a_.nkv, st.length, a_.hd)[:, :, :, :width]
                dst.copy_(t[:, None].expand(b, n, a_.nkv, width, a_.hd))
            a = prefill_attention(q, k, v, masks[L.window])  # [b, nh, P, D]
            x = post_attn(x, a.transpose(1, 2).reshape(b, width, -1), L.o_w, L.o_b, L.ln1, L.ln2, L.gu_w,
                          L.gu_b, L.down_w, L.down_b, a_, self._lin)
        return head(x[:, -1], self.norm_w, self.lm_w, self.lm_b, a_, self._lin)
