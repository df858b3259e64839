"""Per-token log-probabilities of completion tokens, without a (N, L, V) tensor.

The seed runs ``log_softmax`` over the full vocabulary at every position of
every row, and autograd keeps that (N, L, V) result for the backward pass. Here
only the hidden states at completion positions (mask True) are projected
through the LM head, ``chunk`` tokens at a time, by :class:`LinearLogprob`, a
custom autograd function: its forward keeps only the hidden states, the head
weight and one log-sum-exp per token; its backward recomputes each chunk's
logits and turns them in place into the gradient of the logits
(``g * (onehot - softmax)``), from which the chunk's hidden-state gradient and
its share of the head-weight gradient follow. Peak extra memory is one chunk's
(chunk, V) float32 logits in either pass, whatever the batch or vocabulary.

The projection runs *inside the model's own forward*: the LM head (a plain
``nn.Linear``) has its class switched to :class:`LeanHead`, which behaves as
the linear layer except while :func:`token_logprobs` has armed it, when it
returns the selected tokens' log-probs instead of logits. Going through the
model's forward keeps the hooks of DDP, FSDP2, DeepSpeed ZeRO-3 and PEFT in
play (they gather and reduce parameters around module forwards), so the lean
path works under every training backend.

Shared prompts: the G completions of a group share one prompt, so by default
(``share_prefix``) each distinct prompt of a call runs through the model once
(all its tokens but the last, with the KV cache on), its keys and values are
indexed out to its rows, and the rows then run only their last prompt token and
completion against that cache. Autograd goes through the cache, so gradients
equal the plain forward's; the prompt's share of the FLOPs drops by the group
size. It falls back to the plain forward when no prompt repeats, when gradient
checkpointing is on (HF turns the cache off then) and on the ``full`` path.

Models whose head is not a plain linear projection of the last hidden state
(logit soft-capping, scaled heads: :data:`LOGIT_MAPS`) take the ``full`` path: the
model's own logits, row by row (their forward maps the head's output, which the lean
head, returning log-probs, cannot stand in for).

``temperature``: the log-probs of ``logits / temperature`` on every path (1.0, the
default, is the model's own distribution; see ``rollout.tempered_logprobs``). ``support``
(``(top_k, top_p)``, :mod:`nanogrpo.algo.support`): of that distribution restricted to each position's
top-k / top-p support and renormalised, the distribution a sampler with those settings draws from
(entropies too); the support's threshold is saved per token for the backward, never a (T, V) mask.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from nanogrpo.algo.distill import chunked_divergence
from nanogrpo.algo.heads import PLAIN_HEAD_TYPES, VISION_WRAPPERS, unwrap
from nanogrpo.algo.support import MASKED, Support, active, keep_mask, support_threshold


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)                # (N, L)


def _mm_dtype(t: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def acc_dtype(dt: torch.dtype) -> torch.dtype:
    """The dtype log-softmax runs in: float32, or float64 for a float64 model (exact parity tests)."""
    return torch.float64 if dt == torch.float64 else torch.float32


ENTROPY_MODES = {"none": 0, "value": 1, "grad": 2}
"""``token_stats(entropy=...)``: no entropy; its value only (no gradient: logging, the top-ρ mask);
with its gradient (the entropy bonus)."""


def _backward_rows(chunk: int, entropy: int) -> int:
    """Rows per chunk of :class:`LinearLogprob`'s backward: half chunks with the entropy's gradient."""
    return max(1, chunk // 2) if entropy == 2 else chunk


def _block_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, block: int,
                  dt: torch.dtype) -> torch.Tensor:
    """``F.linear(x.to(dt), w, b)`` as one product per ``block`` rows of x (c, H) -> (c, V). The row
    count of a GEMM can change the last bits of its rows (MKL, float32 and float64, 8 rows against 4,
    on an AMX Xeon and with MKL held to AVX2): a pass that recomputes the logits in blocks of ``block``
    rows starting where these do gets these bits."""
    if x.shape[0] <= block:
        return F.linear(x.to(dt), w, b)
    return torch.cat([F.linear(x[j:j + block].to(dt), w, b) for j in range(0, x.shape[0], block)])


class LinearLogprob(torch.autograd.Function):
    """logp[t] = log_softmax((h[t] @ W.T + b) / temperature)[targets[t]], chunk by chunk, in float32,
    and optionally the entropy H[t] = -sum_v p log p of the same distribution in the same pass.

    h: (T, H); weight: (V, H); bias: (V,) or None; targets: (T,) int64 -> (T,) float32, or with
    ``entropy`` > 0 (T, 2) float32: [:, 0] the log-probs, [:, 1] the entropies.
    Saved for backward: h, weight, targets, lse (T,) and with ``entropy`` == 2 H (T,); never (T, V).

    The entropy costs two more elementwise passes over each chunk's logits (the log-sum-exp is
    computed by hand so that its exp(z - max) serves both): H = log s - sum_v e_v (z_v - m) / s with
    m = max_v z_v, e = exp(z - m), s = sum_v e. Its gradient is dH/dz = -p (log p + H), folded into
    the same backward pass as the log-prob's g (onehot - p), over half chunks (softmax and logits are
    needed at once), so the peak stays that of the plain pass: one (chunk, V) buffer and its
    ``torch.logsumexp`` temporary in the forward, one (chunk, V) buffer in the backward.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk, temperature=1.0, entropy=0, support=None):
        dt = _mm_dtype(h)
        acc = acc_dtype(dt)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dt)                                                 # (V, H)
            b = None if bias is None else bias.to(dt)                         # (V,)
            out = torch.empty(h.shape[0], dtype=acc, device=h.device)         # (T,)
            lse = torch.empty_like(out)                                       # (T,)
            ent = torch.empty_like(out) if entropy else None                  # (T,)
            thr = torch.empty_like(out) if support is not None else None      # (T,) the support's threshold
            # with a support the backward compares its own logits with thr, so both passes multiply the
            # same row blocks (the backward's): a GEMM's last bits can depend on its row count
            block = _backward_rows(chunk, entropy) if support is not None else chunk
            step = max(1, chunk // block) * block                             # whole blocks per chunk
            for i in range(0, h.shape[0], step):
                logits = _block_linear(h[i:i + step], w, b, block, dt).to(acc)  # (c, V)
                if temperature != 1.0:
                    logits = logits / temperature                             # (c, V)
                picked = logits.gather(-1, targets[i:i + step, None]).squeeze(-1)  # (c,)
                if support is not None:  # the sort of top-p in quarter chunks: peak ~2 (c, V) buffers
                    q = max(1, logits.shape[0] // 4)
                    for j in range(0, logits.shape[0], q):
                        thr[i + j:i + j + q] = support_threshold(logits[j:j + q], support)  # (q,)
                    keep = keep_mask(logits, thr[i:i + step], targets[i:i + step])  # (c, V)
                    logits.masked_fill_(~keep, MASKED)                        # (c, V) the support only
                    del keep
                if entropy:
                    m = logits.amax(-1, keepdim=True)                         # (c, 1)
                    m.masked_fill_(torch.isinf(m), 0.0)
                    logits.sub_(m)                                            # (c, V) z - m
                    e = logits.exp()                                          # (c, V)
                    s = e.sum(-1)                                             # (c,)
                    lse[i:i + step] = s.log() + m.squeeze(-1)                 # (c,) as torch.logsumexp
                    ent[i:i + step] = s.log() - e.mul_(logits).sum(-1) / s    # (c,) H
                    del e
                else:
                    lse[i:i + step] = torch.logsumexp(logits, -1)             # (c,)
                out[i:i + step] = picked - lse[i:i + step]
                del logits
        ctx.save_for_backward(h, weight, bias, targets, lse, ent if entropy == 2 else None, thr)
        ctx.chunk, ctx.dt, ctx.temperature, ctx.entropy = chunk, dt, temperature, entropy
        if not entropy:
            return out
        res = torch.stack([out, ent], -1)                                     # (T, 2)
        return res

    @staticmethod
    def backward(ctx, g):                                                      # g: (T,) or (T, 2)
        h, weight, bias, targets, lse, ent, thr = ctx.saved_tensors
        dt, chunk, temp = ctx.dt, ctx.chunk, ctx.temperature
        acc = acc_dtype(dt)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.to(acc)
        g_h = g[:, 1] if ctx.entropy == 2 else None                           # (T,) dL/dH
        g = g[:, 0] if ctx.entropy else g                                     # (T,) dL/dlogp
        w = weight.to(dt)                                                     # (V, H)
        b = None if bias is None else bias.to(dt)
        gh = torch.empty_like(h) if need_h else None                          # (T, H)
        acc_w = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        gw = torch.zeros(weight.shape, dtype=acc_w, device=weight.device) if need_w else None  # (V, H)
        gb = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        # with the entropy's gradient each chunk needs softmax and logits at once: half chunks keep the
        # peak at two (chunk / 2, V) buffers, what the plain backward's one (chunk, V) plus logsumexp hold
        chunk = _backward_rows(chunk, ctx.entropy)
        with torch.autocast(h.device.type, enabled=False):
            for i in range(0, h.shape[0], chunk):
                hc = h[i:i + chunk].to(dt)                                    # (c, H)
                gl = F.linear(hc, w, b).to(acc)                               # (c, V) logits
                if temp != 1.0:
                    gl.div_(temp)                                             # (c, V) logits / T
                keep = None if thr is None else keep_mask(gl, thr[i:i + chunk], targets[i:i + chunk])
                if keep is not None:
                    gl.masked_fill_(~keep, MASKED)                            # (c, V) the support only
                gc = g[i:i + chunk, None]                                     # (c, 1)
                if g_h is None:
                    gl.sub_(lse[i:i + chunk, None]).exp_()                    # (c, V) softmax
                    gl.mul_(-gc)                                              # (c, V) -g * p
                else:
                    gl.sub_(lse[i:i + chunk, None])                           # (c, V) log p
                    p = gl.exp()                                              # (c, V) softmax
                    # d/dz [g logp_target + g_h H] = g onehot - p (g + g_h (log p + H))
                    gl.add_(ent[i:i + chunk, None]).mul_(-g_h[i:i + chunk, None]).sub_(gc).mul_(p)
                    del p
                if keep is not None:
                    gl.masked_fill_(~keep, 0.0)                               # (c, V) nothing outside it
                    del keep
                gl.scatter_add_(-1, targets[i:i + chunk, None], gc)           # + g * onehot
                if temp != 1.0:
                    gl.div_(temp)                                             # (c, V) d/d(logits)
                glc = gl.to(dt)                                               # (c, V)
                if need_h:
                    gh[i:i + chunk] = (glc @ w).to(h.dtype)                   # (c, H)
                if need_w:
                    gw.addmm_(glc.t().to(acc_w), hc.to(acc_w))                # (V, H)
                if need_b:
                    gb += gl.sum(0)                                           # (V,)
                del gl, glc
        gw = None if gw is None else gw.to(weight.dtype)
        gb = None if gb is None else gb.to(bias.dtype)
        return gh, gw, gb, None, None, None, None, None


def linear_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    chunk: int = 1024, temperature: float = 1.0, entropy: str = "none",
                    support: Support | None = None) -> torch.Tensor:
    """Log-probs (T,) of ``targets`` under ``(h @ weight.T + bias) / temperature``, never holding (T, V);
    with ``entropy`` "value" or "grad" (T, 2): the log-probs and the entropies (float32; float64 for
    a float64 model). ``support``: over each position's top-k / top-p support (module docstring)."""
    out = LinearLogprob.apply(h, weight, bias, targets, max(1, int(chunk)), float(temperature),
                              ENTROPY_MODES[entropy], support if active(support) else None)
    if entropy == "value":  # the entropy column carries no gradient
        out = torch.stack([out[:, 0], out[:, 1].detach()], -1)
    return out


Divergence = tuple
"""``(fn, [teacher tensors (N, C, ...)])``: a per-token divergence the head computes beside the log-probs
(:func:`nanogrpo.algo.distill.chunked_divergence`)."""


class LeanHead(torch.nn.Linear):
    """An ``nn.Linear`` LM head that, while armed, returns completion-token log-probs instead of logits.

    Armed (by :func:`token_stats`) with ``start``, the completion mask (N, C) and
    the targets (N, C); its input is then the hidden states (N, start + C, H), of
    which positions ``start ..`` predict the targets, and its output the selected
    tokens' log-probs (T,) float32, T = mask.sum() (with an entropy mode (T, 2): log-probs and
    entropies). Armed with ``sel=None`` it returns an empty tensor (a pass that only fills the KV cache).
    """

    _lean: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.__dict__.get("_lean")
        if spec is None:
            return super().forward(x)
        start, sel, targets, chunk, temperature, entropy, support, divergence = spec
        if sel is None:                                                       # a prefix pass: no output
            return x.new_zeros(0)
        h = x[:, start:]                                                      # (N, C, H) predicts targets
        if h.shape[1] != sel.shape[1]:
            raise ValueError(f"LeanHead: {h.shape[1]} positions after {start} for {sel.shape[1]} targets")
        out = linear_logprobs(h[sel], self.weight, self.bias, targets[sel], chunk, temperature,
                              entropy, support)                               # (T,) or (T, 2)
        if divergence is None:
            return out
        fn, extra = divergence
        div = chunked_divergence(fn, h[sel], self.weight, self.bias, targets[sel],
                                 [e[sel] for e in extra], chunk)              # (T,)
        return torch.cat([out.reshape(out.shape[0], -1), div.to(out.dtype)], -1)  # (T, 3 | 4)

    @contextmanager
    def armed(self, start: int, sel: torch.Tensor | None, targets: torch.Tensor | None, chunk: int,
              temperature: float = 1.0, entropy: str = "none", support: Support | None = None,
              divergence: Divergence | None = None):
        self.__dict__["_lean"] = (start, sel, targets, chunk, temperature, entropy, support, divergence)
        try:
            yield
        finally:
            self.__dict__.pop("_lean", None)


def lean_head(model) -> LeanHead | None:
    """The model's LM head switched to :class:`LeanHead`, or None when the lean path does not apply."""
    inner = unwrap(model)
    cfg = getattr(inner, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype in VISION_WRAPPERS:
        mtype = getattr(getattr(cfg, "text_config", None), "model_type", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if mtype not in PLAIN_HEAD_TYPES or head is None:
        return None
    if isinstance(head, LeanHead):
        return head
    if type(head) is torch.nn.Linear:
        head.__class__ = LeanHead  # same parameters and state-dict keys; plain Linear while unarmed
        return head
    # FSDP2 swaps the class to FSDP<cls>: accept a Linear subclass only if it already derives from LeanHead
    return None


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   prompt_len: int, completion_mask: torch.Tensor, chunk: int = 1024,
                   share_prefix: bool = True, temperature: float = 1.0,
                   support: Support | None = None, mm=None) -> torch.Tensor:
    """Log-probs (N, C) float32 of ``input_ids[:, prompt_len:]`` under ``model``; 0 where masked.
    (:func:`token_stats` without the entropy.)"""
    return token_stats(model, input_ids, attention_mask, prompt_len, completion_mask, chunk, share_prefix,
                       temperature, support=support, mm=mm)[0]


def token_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                prompt_len: int, completion_mask: torch.Tensor, chunk: int = 1024,
                share_prefix: bool = True, temperature: float = 1.0, entropy: str = "none",
                support: Support | None = None, mm=None, divergence: Divergence | None = None):
    """Log-probs (N, C) float32 of ``input_ids[:, prompt_len:]`` under ``model`` and, unless ``entropy``
    is "none", the policy's entropy (N, C) at the same positions ("value": no gradient; "grad": with
    it); 0 where masked (float64 for a float64 model). With ``divergence`` = (fn, teacher tensors
    (N, C, ...)) a third (N, C, 2): ``fn`` of each position's logits (:func:`chunked_divergence`; the
    distillation's per-token divergence with its gradient, and the sampled token's log-prob gap).

    input_ids/attention_mask: (N, P + C), prompts left-padded to P, completions
    right-padded to C. completion_mask: (N, C) bool. ``model`` may be wrapped
    (DDP, DeepSpeed engine, FSDP2 module, PEFT model): it is called as a whole.
    ``share_prefix``: run each distinct prompt once (see the module docstring).
    ``temperature``: log-probs (and entropies) of ``logits / temperature`` (gradients included);
    ``support`` (top_k, top_p): restricted to each position's support (:mod:`nanogrpo.algo.support`).
    ``mm``: the rows' images, a function of the input ids the forward runs on that returns the keyword
    arguments carrying them (:func:`nanogrpo.models.vision.forward_kwargs`; a ``position_ids`` entry
    replaces the mask's positions, None: the model's own, M-RoPE); the rows then run in one plain
    forward (no prefix sharing: the prompt's KV cache would need the images' positions too).
    """
    support = support if active(support) else None
    pos = position_ids_from_mask(attention_mask)                              # (N, L)
    targets = input_ids[:, prompt_len:]                                       # (N, C)
    head = lean_head(model)
    if head is None:
        if mm is not None:
            raise ValueError("images need a model whose logits are its linear head's (PLAIN_HEAD_TYPES)")
        return _full_logprobs(model, input_ids, attention_mask, pos, prompt_len, temperature, entropy,
                              support, divergence)
    sel = completion_mask.bool()                                              # (N, C)
    if sel.shape[1] == 0:
        z = torch.zeros(sel.shape, dtype=torch.float32, device=input_ids.device)
        return (z, (z if entropy != "none" else None)) + ((z[..., None].expand(*z.shape, 2),)
                                                          if divergence is not None else ())
    # the last token predicts nothing: every forward below stops one short of it
    ids, am, pos = input_ids[:, :-1], attention_mask[:, :-1], pos[:, :-1]     # (N, L - 1)
    flat = None
    if share_prefix and prompt_len > 1 and not _checkpointing(model) and mm is None:
        flat = _prefix_shared(model, head, ids, am, pos, prompt_len, sel, targets, chunk, temperature,
                              entropy, support, divergence)
    if flat is None:
        kw = {"position_ids": pos, **(mm(ids) if mm is not None else {})}
        with head.armed(prompt_len - 1, sel, targets, chunk, temperature, entropy, support, divergence):
            flat = model(input_ids=ids, attention_mask=am, use_cache=False, **kw).logits  # (T,) or (T, k)
    res = torch.zeros(sel.shape, dtype=flat.dtype, device=flat.device)        # (N, C)
    div = ()
    if divergence is not None:
        d = torch.zeros(*sel.shape, 2, dtype=flat.dtype, device=flat.device)  # (N, C, 2)
        div = (d.masked_scatter(sel[..., None].expand_as(d), flat[:, -2:]),)
        flat = flat[:, 0] if entropy == "none" else flat[:, :2]
    if entropy == "none":
        return (res.masked_scatter(sel, flat), None) + div
    return (res.masked_scatter(sel, flat[:, 0]), res.masked_scatter(sel, flat[:, 1])) + div  # (N, C) each


def _checkpointing(model) -> bool:
    """Gradient checkpointing on (HF layers then drop the KV cache that prefix sharing needs)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in unwrap(model).modules())


def _prefix_shared(model, head: LeanHead, input_ids, attention_mask, pos, prompt_len: int, sel, targets,
                   chunk: int, temperature: float, entropy: str = "none",
                   support: Support | None = None, divergence: Divergence | None = None
                   ) -> torch.Tensor | None:
    """The selected log-probs (T,) (or (T, 2) with entropies) with each distinct prompt run once; None if
    no prompt repeats.
    input_ids, attention_mask, pos: (N, P + C - 1), the sequences without their last token."""
    p = prompt_len - 1                                                        # the prefix: all but the last
    key = torch.cat([input_ids[:, :p], attention_mask[:, :p].to(input_ids.dtype)], 1)  # (N, 2p)
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)                 # (U, 2p), (N,)
    if uniq.shape[0] == input_ids.shape[0]:
        return None
    u_ids, u_mask = uniq[:, :p], uniq[:, p:]                                  # (U, p) each
    with head.armed(prompt_len, None, None, chunk):
        out = model(input_ids=u_ids, attention_mask=u_mask, position_ids=position_ids_from_mask(u_mask),
                    use_cache=True)
    cache = out.get("cache") if "cache" in out else out.get("past_key_values")  # (U, p) keys/values
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    cache.batch_select_indices(inv)                                           # (N, p), differentiable gather
    # suffix position 0 predicts c_0
    with head.armed(0, sel, targets, chunk, temperature, entropy, support, divergence):
        return model(input_ids=input_ids[:, p:], attention_mask=attention_mask, position_ids=pos[:, p:],
                     use_cache=True, **{_cache_kwarg(model): cache}).logits   # (T,) float32


def _cache_kwarg(model) -> str:
    """The forward's name for the KV cache: ``cache`` (recent transformers) or ``past_key_values``."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner   # PEFT
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def _full_logprobs(model, input_ids, attention_mask, pos, prompt_len, temperature: float = 1.0,
                   entropy: str = "none", support: Support | None = None,
                   divergence: Divergence | None = None):
    rows, ents, divs = [], [], []
    for i in range(input_ids.shape[0]):  # one row at a time bounds the (L, V) logits
        logits = model(input_ids=input_ids[i:i + 1], attention_mask=attention_mask[i:i + 1],
                       position_ids=pos[i:i + 1], use_cache=False).logits[0, prompt_len - 1:-1]  # (C, V)
        logits = logits.to(acc_dtype(logits.dtype))
        if divergence is not None:
            fn, extra = divergence
            divs.append(fn(logits, input_ids[i, prompt_len:], *[e[i] for e in extra]))  # (C,)
        z = logits if temperature == 1.0 else logits / temperature                     # (C, V)
        if support is not None:
            with torch.no_grad():
                keep = keep_mask(z, support_threshold(z, support), input_ids[i, prompt_len:])  # (C, V)
            z = z.masked_fill(~keep, MASKED)                                            # (C, V)
        lp = z.log_softmax(-1)                                                          # (C, V)
        rows.append(lp.gather(-1, input_ids[i, prompt_len:, None]).squeeze(-1))       # (C,)
        if entropy != "none":
            h = -(lp.exp() * lp).sum(-1)                                              # (C,)
            ents.append(h if entropy == "grad" else h.detach())
    out = (torch.stack(rows), (torch.stack(ents) if entropy != "none" else None))     # (N, C) each
    return out + ((torch.stack(divs),) if divergence is not None else ())


@torch.no_grad()
def batch_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         prompt_len: int, completion_mask: torch.Tensor, micro_batch_size: int = 16,
                         chunk: int = 1024, share_prefix: bool = True,
                         temperature: float = 1.0, support: Support | None = None) -> torch.Tensor:
    """``token_logprobs`` without gradients, ``micro_batch_size`` rows at a time (reference model)."""
    out = []
    for i in range(0, input_ids.shape[0], micro_batch_size):
        sl = slice(i, i + micro_batch_size)
        out.append(token_logprobs(model, input_ids[sl], attention_mask[sl], prompt_len,
                                  completion_mask[sl], chunk, share_prefix, temperature, support))
    return torch.cat(out)                                                     # (N, C)
