"""Fast rollout engine for HF Llama / Qwen2-family models: our own lean forward.

What makes it fast (on CUDA; on CPU the same code runs eagerly):

- one prefill per distinct prompt; its KV rows are copied to the prompt's ``n`` samples;
- a preallocated KV cache ``[layers, rows, kv_heads, length, head_dim]``, RoPE from
  precomputed cos/sin tables, GQA attention by viewing the query heads that share a
  KV head as a query block of that head (no K/V repeat);
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
  batch (finished rows otherwise keep decoding, their outputs masked).

Sampling uses the engine's own ``torch.Generator``, seeded from ``params.seed``:
same seed, same engine settings and prompts -> same completions.
"""

from __future__ import annotations

import contextlib
import secrets
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanogrpo.errors import ModelError
from nanogrpo.models.cpu_linear import OneDnnLinear
from nanogrpo.models.cpu_linear import linear as onednn_linear
from nanogrpo.rollout.engine import Generation, SamplingParams
from nanogrpo.rollout.hf import check_request, cut_at_eos, load_in_place, resolve_special_ids

SUPPORTED = ("Qwen2ForCausalLM", "LlamaForCausalLM")
NEG_INF = float("-inf")
PREFILL_TOKENS = 16384
"""Prompt tokens per prefill chunk: bounds the activations of long prompts x many prompts."""


# ---------------------------------------------------------------- the forward, as pure functions

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm exactly: normalise in float32, round to the input dtype, then scale."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D]; cos/sin [..., 1, D] (HF's rotate_half convention)."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def pre_attn(x, ln, qkv_w, qkv_b, cos, sin, eps: float, nh: int, nkv: int, hd: int, lin=F.linear):
    """x [..., hidden] -> q [..., nh, D], k [..., nkv, D] (both rotated), v [..., nkv, D].
    ``lin``: the linear function (``F.linear``, or oneDNN's on the CPU)."""
    h = rms_norm(x, ln, eps)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., 1, D]
    if len(qkv_w) == 1:  # fused: one GEMM, RoPE on q and k together
        out = lin(h, qkv_w[0], qkv_b[0])  # [..., (nh + 2 nkv) D]
        qk = rope(out[..., :(nh + nkv) * hd].unflatten(-1, (nh + nkv, hd)), cos, sin)
        return qk[..., :nh, :], qk[..., nh:, :], out[..., (nh + nkv) * hd:].unflatten(-1, (nkv, hd))
    q, k, v = [lin(h, w, b) for w, b in zip(qkv_w, qkv_b, strict=True)]
    return (rope(q.unflatten(-1, (nh, hd)), cos, sin), rope(k.unflatten(-1, (nkv, hd)), cos, sin),
            v.unflatten(-1, (nkv, hd)))


def post_attn(x, a, o_w, o_b, ln, gu_w, gu_b, down_w, down_b, eps: float, lin=F.linear):
    """Residual + output projection, then the SwiGLU MLP block. x, a [..., hidden]."""
    x = x + lin(a, o_w, o_b)
    h = rms_norm(x, ln, eps)
    if len(gu_w) == 1:
        g, u = lin(h, gu_w[0], gu_b[0]).chunk(2, -1)  # [..., inter] each
    else:
        g, u = [lin(h, w, b) for w, b in zip(gu_w, gu_b, strict=True)]
    return x + lin(F.silu(g) * u, down_w, down_b)


def head(x, norm_w, lm_w, eps: float, lin=F.linear) -> torch.Tensor:
    """Final norm + LM head; float32 logits [..., vocab] from the model-dtype GEMM (as HF)."""
    return lin(rms_norm(x, norm_w, eps), lm_w).float()


# ---------------------------------------------------------------- weights

@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_w: tuple
    qkv_b: tuple
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gu_w: tuple
    gu_b: tuple
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def _fuse(linears: list, attr: str, fuse: bool) -> tuple:
    """Weights (or biases) of ``linears``: one concatenated tensor that the modules' parameters
    are re-pointed into (``fuse``), or the parameters' own tensors."""
    ps = [getattr(m, attr) for m in linears]
    if any(p is None for p in ps):
        if fuse and not all(p is None for p in ps):
            raise ModelError(f"cannot fuse {attr}: some projections have one and some do not")
        return tuple(None if p is None else p.data for p in ps) if not fuse else (None,)
    if not fuse:
        return tuple(p.data for p in ps)
    with torch.no_grad():  # not inference mode: the trainer still runs autograd through these
        whole = torch.cat([p.data for p in ps])  # [sum(out), in] or [sum(out)]
    start = 0
    for p in ps:
        p.data = whole[start:start + p.shape[0]]  # row slice: contiguous, same values
        start += p.shape[0]
    return (whole,)


# ---------------------------------------------------------------- decode state

@dataclass
class _State:
    """Static buffers of one (rows, length, mode) decode configuration; a CUDA graph reads them."""

    rows: int
    length: int  # cache slots
    mode: tuple
    k: torch.Tensor  # [layers, rows, kv, length, D], a view of the engine's flat KV buffer
    v: torch.Tensor
    tok: torch.Tensor  # [rows] next input token
    pad: torch.Tensor  # [rows] left-pad of each row (first real slot)
    done: torch.Tensor  # [rows] bool, emitted EOS
    slot: torch.Tensor  # [1] slot of the input token; the step advances it
    out_tok: torch.Tensor  # [rows, length + 1] sampled token at column slot + 1
    out_lp: torch.Tensor  # [rows, length + 1] its log-prob
    temp: torch.Tensor  # [1]
    top_p: torch.Tensor  # [1]
    graph: object | None = None
    row_ids: list = field(default_factory=list)  # original row of each state row, -1 = filler


class FastEngine:
    """Generation for HF ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` with its own forward.

    Args:
        model: the live HF model (its weights are shared, see the module docstring).
        eos_token_id, pad_token_id, tokenizer: special ids, as for :class:`HFEngine`.
        ignore_eos: never stop at EOS (benchmarks): every row makes ``max_new_tokens``.
        fuse: fuse QKV and gate/up (re-points the model's parameters into fused storage).
        cuda_graphs: capture decode steps as CUDA graphs (default: on for CUDA).
        compile: ``torch.compile`` the per-layer pieces of the decode step (default: on for
            CUDA). Any failure of compile or capture warns and falls back to eager.
        compact: move unfinished rows to a smaller batch when that halves it.
        check_every: decode steps between looks at the finished flags (one host sync each).
        cpu_linear: run float32 CPU GEMMs through oneDNN (:mod:`nanogrpo.models.cpu_linear`);
            default: when the model's own linear layers do (``model.cpu_linear``).

    With a sharded trainer (FSDP, ZeRO-3) build the engine over a separate, full copy of
    the model and push weights with ``update_weights(full_state_dict)``.
    """

    name = "fast"

    def __init__(self, model, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, *, tokenizer=None, ignore_eos: bool = False,
                 fuse: bool = True, cuda_graphs: bool | None = None, compile: bool | None = None,
                 compact: bool = True, check_every: int = 16, cpu_linear: bool | None = None):
        kind = type(model).__name__
        if kind not in SUPPORTED:
            raise ModelError(f"FastEngine supports {', '.join(SUPPORTED)}, not {kind}; "
                             "use the 'hf' rollout engine for this model")
        cfg = model.config
        if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "hidden_act", "silu") != "silu":
            raise ModelError("FastEngine needs full attention and a SiLU MLP; use the 'hf' engine")
        self.model = model
        self.eos_ids, self.pad_id = resolve_special_ids(model, tokenizer, eos_token_id, pad_token_id)
        self.ignore_eos, self.compact, self.check_every = ignore_eos, compact, max(1, check_every)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if cuda_graphs is None else (cuda_graphs and cuda)
        self.use_compile = cuda if compile is None else compile
        base = model.model
        att = base.layers[0].self_attn
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = att.q_proj.weight.shape[0] // self.nh
        self.eps = float(cfg.rms_norm_eps)
        self.layers = []
        for lyr in base.layers:
            a, m = lyr.self_attn, lyr.mlp
            qkv, gu = [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]
            self.layers.append(_Layer(
                lyr.input_layernorm.weight.data, lyr.post_attention_layernorm.weight.data,
                _fuse(qkv, "weight", fuse), _fuse(qkv, "bias", fuse), a.o_proj.weight.data,
                None if a.o_proj.bias is None else a.o_proj.bias.data,
                _fuse(gu, "weight", fuse), _fuse(gu, "bias", fuse), m.down_proj.weight.data,
                None if m.down_proj.bias is None else m.down_proj.bias.data))
        self.embed, self.norm_w = base.embed_tokens.weight.data, base.norm.weight.data
        self.lm_w = model.lm_head.weight.data
        # every (module, attr, tensor the engine reads) to keep the model's parameters on our storage
        self._bound = [(mod, name, getattr(mod, name).data) for mod in model.modules()
                       for name, prm in mod.named_parameters(recurse=False) if prm is not None]
        self._rotary = base.rotary_emb
        if cpu_linear is None:
            cpu_linear = any(isinstance(m, OneDnnLinear) for m in model.modules())
        self._lin = onednn_linear if cpu_linear and self.device.type == "cpu" else F.linear
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
        self._states: dict[tuple, _State] = {}
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
        """Graph buckets are powers of two >= 8; eager runs use the exact row count."""
        return max(8, 1 << (rows - 1).bit_length()) if self.use_graphs else rows

    def _ensure_capacity(self, rows: int, length: int) -> None:
        """KV buffers and RoPE tables big enough; growing them drops every captured graph."""
        per = len(self.layers) * self.nkv * self.hd
        if self._kv_flat is None or self._kv_flat[0].numel() < per * rows * length:
            self._states.clear()
            self._kv_flat = None  # free before allocating
            self._kv_flat = tuple(torch.zeros(per * rows * length, dtype=self.dtype, device=self.device)
                                  for _ in range(2))
        if self._cos is None or self._cos.shape[0] < length:
            self._states.clear()
            pos = torch.arange(max(length, 1024), device=self.device)[None]
            cos, sin = self._rotary(torch.empty(1, dtype=self.dtype, device=self.device), pos)
            self._cos, self._sin = cos[0], sin[0]  # [positions, D], model dtype (as HF)

    def _state(self, rows: int, length: int, mode: tuple) -> _State:
        key = (rows, length, mode)
        st = self._states.get(key)
        if st is None:
            shape = (len(self.layers), rows, self.nkv, length, self.hd)
            n = rows * length * len(self.layers) * self.nkv * self.hd
            dev, z = self.device, lambda *s, **k: torch.zeros(*s, device=self.device, **k)
            kv = [flat[:n].view(shape) for flat in self._kv_flat]
            st = _State(rows, length, mode, kv[0], kv[1],
                        z(rows, dtype=torch.long), z(rows, dtype=torch.long), z(rows, dtype=torch.bool),
                        z(1, dtype=torch.long), z(rows, length + 1, dtype=torch.long),
                        z(rows, length + 1, dtype=torch.float32), torch.ones(1, device=dev),
                        torch.ones(1, device=dev))
            if not self.use_graphs:
                return st  # eager: buffers are cheap, keep none between calls
            self._capture(st)
            self._states[key] = st
        return st

    def _warm_up(self, st: _State) -> None:
        """Run the step a few times on a side stream (compiles on first use). Writes only the
        scratch slot ``length - 1``: the cache is one slot longer than any sequence needs."""
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            for _ in range(3):
                st.slot.fill_(st.length - 1)
                self._step(st)
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(side)
        st.slot.fill_(st.length - 1)

    def _capture(self, st: _State) -> None:
        """Record one decode step as a CUDA graph; compile or capture failures fall back, loudly.
        (Off CUDA, only the warm-up runs: tests use that to check the bucketed layout on CPU.)"""
        try:
            self._warm_up(st)
        except Exception as e:
            if not self.use_compile:
                raise
            warnings.warn(f"FastEngine: torch.compile failed ({e!r:.300}); decode step runs uncompiled",
                          stacklevel=3)
            self.use_compile = False
            self._pre, self._post, self._head = pre_attn, post_attn, head
            self._warm_up(st)
        if self.device.type != "cuda":
            return
        try:
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            graph.register_generator_state(self.gen)  # replays draw from self.gen, seeded per call
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(st)
            st.graph = graph
        except Exception as e:  # a capture that fails must not stop the rollout
            warnings.warn(f"FastEngine: CUDA graph capture failed ({e!r:.300}); decoding eagerly",
                          stacklevel=3)
            self.use_graphs = False
            st.graph = None

    # ------------------------------------------------------------ one decode step

    def _step(self, st: _State, upto: int | None = None) -> None:
        """Feed ``st.tok`` at ``st.slot``, sample the next token into the state; ``slot += 1``.
        ``upto`` (eager runs, where the host knows it): ``slot + 1``, so attention reads only the
        filled part of the cache; graphs read all of it, masked."""
        pos = st.slot - st.pad  # [rows]
        cos, sin = self._cos[pos], self._sin[pos]  # [rows, D]
        n_kv = st.length if upto is None else upto
        ar = torch.arange(n_kv, device=self.device)
        valid = (ar >= st.pad[:, None]) & (ar <= st.slot)  # [rows, n_kv]
        mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(~valid, NEG_INF)
        mask = mask[:, None, None]  # [rows, 1, 1, length]
        x = F.embedding(st.tok, self.embed)  # [rows, hidden]
        r, g = st.rows, self.nh // self.nkv
        for i, L in enumerate(self.layers):
            q, k, v = self._pre(x, L.ln1, L.qkv_w, L.qkv_b, cos, sin, self.eps, self.nh, self.nkv, self.hd,
                                self._lin)
            st.k[i].index_copy_(2, st.slot, k.unsqueeze(2))  # cache [rows, kv, length, D]
            st.v[i].index_copy_(2, st.slot, v.unsqueeze(2))
            a = self._attend(q.reshape(r, self.nkv, g, self.hd), st.k[i][:, :, :n_kv], st.v[i][:, :, :n_kv],
                             mask)  # [rows, kv, g, D]: the g query heads of a KV head act as its query block
            x = self._post(x, a.reshape(r, self.nh * self.hd), L.o_w, L.o_b, L.ln2, L.gu_w, L.gu_b,
                           L.down_w, L.down_b, self.eps, self._lin)
        self._sample_into(st, self._head(x, self.norm_w, self.lm_w, self.eps, self._lin))

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """One decode step's attention: q [rows, kv, g, D], k/v [rows, kv, n, D], mask [rows, 1, 1, n]."""
        if self.device.type == "cpu":  # a few queries per row: two batched matmuls beat the SDPA kernel here
            s = torch.matmul(q, k.transpose(-1, -2)).mul_(self.hd ** -0.5).add_(mask)  # [rows, kv, g, n]
            return torch.matmul(s.softmax(-1), v)
        with self._attn_backends():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _sample_into(self, st: _State, logits: torch.Tensor) -> None:
        """logits [rows, vocab] float32 -> token, untempered log-prob, EOS flag; advances the slot."""
        lse = torch.logsumexp(logits, -1)  # [rows]
        if st.mode[0] == "greedy":
            tok = logits.argmax(-1)
        else:
            s = logits / st.temp
            top_k, use_top_p = st.mode[1], st.mode[2]
            if top_k:
                kth = s.topk(min(top_k, s.shape[-1]), -1).values[:, -1:]
                s = s.masked_fill(s < kth, NEG_INF)
            if use_top_p:  # keep the smallest head of the sorted distribution with mass >= top_p
                srt, idx = s.sort(-1, descending=True)
                p = srt.softmax(-1)
                srt = srt.masked_fill(p.cumsum(-1) - p >= st.top_p, NEG_INF)
                s = torch.full_like(s, NEG_INF).scatter(-1, idx, srt)
            noise = torch.empty_like(s).exponential_(generator=self.gen).clamp_min_(1e-20)
            tok = (s - noise.log()).argmax(-1)  # Gumbel-max: a draw from softmax(s)
        lp = logits.gather(-1, tok[:, None])[:, 0] - lse
        col = st.slot + 1
        st.out_tok.index_copy_(1, col, tok[:, None])
        st.out_lp.index_copy_(1, col, lp[:, None])
        if not self.ignore_eos:
            st.done |= (tok[:, None] == self.eos_t).any(-1)
        st.tok.copy_(tok)
        st.slot.add_(1)

    # ------------------------------------------------------------ generate

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
        length = width + n_new + 1  # +1: the scratch slot graphs are captured on
        if self.use_graphs:
            length = -(-length // 64) * 64
        mode = ("greedy",) if params.greedy else ("sample", params.top_k, params.top_p < 1.0)
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
                self._harvest(st, res_tok, res_lp, width, n_new)
                st = self._compacted(st, live, length, mode)
                compactions += 1
        self._harvest(st, res_tok, res_lp, width, n_new)
        sync()
        t3 = time.perf_counter()
        comp, lps, reasons = cut_at_eos(res_tok, res_lp, self.eos_ids, self.ignore_eos)
        n_tok = sum(len(c) for c in comp)
        return Generation(comp, lps, reasons, stats={
            "setup_s": t1 - t0, "prefill_s": t2 - t1, "decode_s": t3 - t2, "decode_steps": float(steps + 1),
            "new_tokens": float(n_tok), "tok_per_s": n_tok / max(t3 - t1, 1e-9),
            "prefill_rows": float(n_prompts), "compactions": float(compactions),
            "cuda_graphs": float(st.graph is not None)})

    def _prefill(self, st: _State, prompts: list[list[int]], n: int, width: int) -> None:
        """Run each distinct prompt once (in chunks of about ``PREFILL_TOKENS`` tokens), copy its KV
        rows to its n samples, and sample every row's first token."""
        b, rows, dev = len(prompts), len(prompts) * n, self.device
        pad = torch.tensor([width - len(p) for p in prompts])
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
        ids, pad = ids.to(dev), pad.to(dev)
        chunk = max(1, PREFILL_TOKENS // width)
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

    def _prefill_chunk(self, st: _State, ids, pad, row0: int, n: int) -> torch.Tensor:
        """ids [b, P] left-padded, pad [b]: fill cache rows row0 .. row0 + b*n, return last logits [b, V]."""
        (b, width), dev = ids.shape, self.device
        ar = torch.arange(width, device=dev)
        pos = (ar[None] - pad[:, None]).clamp_min(0)  # [b, P]
        cos, sin = self._cos[pos], self._sin[pos]  # [b, P, D]
        keep = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] >= pad[:, None, None])
        keep |= torch.eye(width, dtype=torch.bool, device=dev)[None]  # pad queries see themselves: no NaN
        mask = torch.zeros(keep.shape, dtype=self.dtype, device=dev).masked_fill_(~keep, NEG_INF)[:, None]
        x = F.embedding(ids, self.embed)  # [b, P, hidden]
        g = self.nh // self.nkv
        for i, L in enumerate(self.layers):
            q, k, v = pre_attn(x, L.ln1, L.qkv_w, L.qkv_b, cos, sin, self.eps, self.nh, self.nkv, self.hd,
                               self._lin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, P, D]
            for cache, t in ((st.k[i], k), (st.v[i], v)):  # row row0 + b_i*n + j <- prompt b_i
                dst = cache[row0:row0 + b * n].view(b, n, self.nkv, st.length, self.hd)[:, :, :, :width]
                dst.copy_(t[:, None].expand(b, n, self.nkv, width, self.hd))
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                               attn_mask=mask)  # [b, nh, P, D]
            x = post_attn(x, a.transpose(1, 2).reshape(b, width, -1), L.o_w, L.o_b, L.ln2, L.gu_w, L.gu_b,
                          L.down_w, L.down_b, self.eps, self._lin)
        return head(x[:, -1], self.norm_w, self.lm_w, self.eps, self._lin)

    def _harvest(self, st: _State, res_tok, res_lp, width: int, n_new: int) -> None:
        """Copy the state's real rows' outputs (columns width .. width + n_new) to the results."""
        real = [j for j, r in enumerate(st.row_ids) if r >= 0]
        src = torch.tensor(real, device=self.device)
        dst = torch.tensor([st.row_ids[j] for j in real], device=self.device)
        res_tok[dst] = st.out_tok[src, width:width + n_new]
        res_lp[dst] = st.out_lp[src, width:width + n_new]

    def _compacted(self, st: _State, live: list[int], length: int, mode: tuple) -> _State:
        """A smaller-bucket state holding only the ``live`` rows of ``st`` (same cache storage)."""
        m = len(live)
        idx = torch.tensor(live, device=self.device)
        saved = [t[idx].clone() for t in (st.tok, st.pad, st.done, st.out_tok, st.out_lp)]
        k, v = st.k[:, idx], st.v[:, idx]  # gathered copies [layers, m, kv, length, D]
        slot = st.slot.clone()
        temp, top_p = st.temp.clone(), st.top_p.clone()
        new = self._state(self._bucket(m), length, mode)
        new.k[:, :m], new.v[:, :m] = k, v
        for dst, src in zip((new.tok, new.pad, new.done, new.out_tok, new.out_lp), saved, strict=True):
            dst[:m] = src
        new.done[m:], new.pad[m:], new.tok[m:] = True, 0, self.pad_id
        new.slot.copy_(slot)
        new.temp.copy_(temp)
        new.top_p.copy_(top_p)
        new.row_ids = [st.row_ids[j] for j in live] + [-1] * (new.rows - m)
        return new
