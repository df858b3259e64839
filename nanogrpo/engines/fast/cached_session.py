"""The fast engine's multi-turn session: each trajectory's KV cache kept across turns.

:class:`FastSession` is :meth:`FastEngine.open_session`'s
:class:`~nanogrpo.engines.base.TurnSession`. Where the generic
:class:`~nanogrpo.engines.session.ReprefillSession` runs each trajectory's whole context again
every turn, this one runs only what is new:

- **turn 0** is the engine's own prefill: each distinct prompt once, its KV rows copied to its
  ``n`` samples;
- **a later turn** appends each row's new tokens (the last token it sampled, which the decode
  loop never fed, then the tool output) to its cache with one batched prefill-at-offset, and
  samples on from there. Rows keep one shared cache slot (the decode step, and its CUDA graph,
  feed every row at the same slot): every turn, each row's cache is re-aligned so that its
  context ends at the widest row's (a copy of the cached keys and values, no recomputation);
- **stop strings end a row while it samples** (:class:`~nanogrpo.engines.stops.StopScanner`,
  the same token rule as :mod:`nanogrpo.engines.stops`), as do EOS and the row's budget; the
  host looks at the new tokens every decode step on the CPU, every ``check_every`` steps on a
  GPU (a host sync each), and finished rows are compacted away when that halves the batch,
  as in ``generate``;
- **between turns** the keys and values of the rows that closed a tool call (and, with
  ``params.resume_after_eos``, of those that ended at EOS: an environment's chat turns) are copied
  aside ("parked", their real length only) and the others freed: a row left out of a step is
  finished. A row stepped again without a parked cache (one that stopped at its budget, or at
  EOS without ``resume_after_eos``) is prefilled from its token history: exact either way.

Exactness: the cached keys and values are those of the same tokens at the same positions (RoPE
from the model's own rotary module, sliding windows over real positions), so greedy trajectories
equal a turn-by-turn ``model.generate``, and the reported log-probs a forward over the final
trajectory, to float rounding. A length-bound RoPE type (dynamic, longrope) is exact only up to
its limit: a session whose ``max_len`` passes it is refused, as ``generate`` refuses such a request.

Randomness: the engine's generator is seeded from ``params.seed`` at the first step; later steps
draw on from it (same seed, same calls -> same trajectories). On a GPU the decode step replays
the engine's CUDA graphs (a graph per row bucket and cache length; capturing one keeps the
generator where it was); the prefill-at-offset runs eagerly.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from nanogrpo.engines.base import Generation, SamplingParams
from nanogrpo.engines.fast import cache
from nanogrpo.engines.fast.families import length_bound_reason
from nanogrpo.engines.fast.forward import head, post_attn, pre_attn, prefill_attention
from nanogrpo.engines.hf import check_request
from nanogrpo.engines.session import check_step
from nanogrpo.engines.stops import StopStrings
from nanogrpo.errors import ModelError


class FastSession:
    """A :class:`~nanogrpo.engines.base.TurnSession` over a :class:`FastEngine`'s KV cache (see the
    module docstring). Built by ``engine.open_session(prompts, params, max_len)``."""

    def __init__(self, engine, prompts: list[list[int]], params: SamplingParams, max_len: int):
        check_request(prompts, replace(params, max_new_tokens=1))
        limit = engine.rope_limit
        if limit is not None and max_len > limit:
            raise ModelError(f"the fast rollout engine cannot run this multi-turn request: "
                             f"{length_bound_reason(engine.model.config, limit, max_len)}; "
                             "use rollout.engine=hf (or auto)")
        self.e, self.params = engine, params
        self.stops = StopStrings(engine.tokenizer, params.stop)
        self.mode = ("greedy",) if params.greedy else ("sample", params.top_k, params.top_p < 1.0,
                                                       params.support_logprobs)
        self.prompts = [list(p) for p in prompts]
        self.contexts = [list(p) for p in prompts for _ in range(params.n)]
        """Each trajectory's tokens so far (prompt, sampled, fed), in order."""
        self.parked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Trajectory -> its cached keys and values [layers, kv, c, D] of its first c context tokens."""
        self.live = set(range(len(self.contexts)))
        self.turn = 0
        self.keep = ("stop_string", "stop") if params.resume_after_eos else ("stop_string",)
        """Finish reasons after which a row's cache is parked (the row may be stepped again)."""

    # ------------------------------------------------------------ one turn

    @torch.inference_mode()
    def step(self, rows: Sequence[int], feeds: Sequence[Sequence[int]], budgets: Sequence[int]) -> Generation:
        rows, budgets = [int(r) for r in rows], [int(b) for b in budgets]
        check_step(rows, feeds, budgets, self.live)
        e = self.e
        ctx = [len(self.contexts[r]) + len(f) for r, f in zip(rows, feeds, strict=True)]  # before sampling
        longest = max(c + b - 1 for c, b in zip(ctx, budgets, strict=True))
        if e.rope_limit is not None and longest > e.rope_limit:
            why = length_bound_reason(e.model.config, e.rope_limit, longest)
            raise ModelError(f"the fast rollout engine cannot run this turn: {why}; use rollout.engine=hf")
        for r, f in zip(rows, feeds, strict=True):
            self.contexts[r].extend(int(t) for t in f)
        for r in set(self.parked) - set(rows):  # left out: finished for good
            del self.parked[r]
        e._rebind()
        cuda = e.device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(e.device)) if cuda else (lambda: None)
        t0 = time.perf_counter()
        if self.turn == 0:
            e.gen.manual_seed(self.params.seed if self.params.seed is not None else secrets.randbits(63))
        width, n_new = max(ctx), max(budgets)
        length = width + n_new + 1  # +1: the scratch slot graphs are captured on
        if e.use_graphs:
            length = -(-length // 64) * 64
        shared = self.turn == 0 and rows == list(range(len(self.contexts))) and not any(feeds)
        bucket = e._bucket(len(rows))
        e._ensure_capacity(bucket, length)
        st = self._state(bucket, length)
        if e.use_graphs and e.compact:  # every smaller bucket now: a warm-up writes into the shared KV
            b = bucket // 2  # buffer, so none may run once the rows' caches are laid out
            while b >= e._bucket(1):
                self._state(b, length)
                b //= 2
        st.temp.fill_(max(self.params.temperature, 1e-6))
        st.top_p.fill_(self.params.top_p)
        st.lp_temp.fill_(self.params.logprob_temperature)
        if shared:
            e._prefill(st, self.prompts, self.params.n, width)
            fed = sum(map(len, self.prompts))
        else:
            fed = self._refill(st, rows, ctx, width)
        sync()
        t1 = time.perf_counter()
        tokens, lps, reasons, st, steps, compactions = self._decode(st, rows, ctx, width, budgets, length)
        sync()
        t2 = time.perf_counter()
        for r, t in zip(rows, tokens, strict=True):
            self.contexts[r].extend(t)
        self.live = set(rows)
        self.turn += 1
        n_tok = sum(map(len, tokens))
        return Generation(tokens, lps, reasons, stats={
            "prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_tokens": float(fed),
            "decode_steps": float(steps), "new_tokens": float(n_tok), "tok_per_s": n_tok / max(t2 - t0, 1e-9),
            "compactions": float(compactions), "cuda_graphs": float(st.graph is not None)})

    def _state(self, bucket: int, length: int) -> cache.State:
        """The engine's decode state of ``bucket`` rows; creating (capturing) one leaves the
        generator where it was, so the samples do not depend on which graphs existed before."""
        e = self.e
        if not e.use_graphs:
            return e._state(bucket, length, self.mode)
        kept = e.gen.get_state()
        st = e._state(bucket, length, self.mode)
        e.gen.set_state(kept)
        return st

    def _refill(self, st: cache.State, rows: list[int], ctx: list[int], width: int) -> int:
        """Lay the rows out in ``st`` (row j = ``rows[j]``, its context ending at slot ``width - 1``):
        put back each parked cache, prefill every token not cached yet, sample the first token.
        Returns the number of tokens prefilled."""
        e, m, dev = self.e, len(rows), self.e.device
        pad = [width - c for c in ctx]  # first real slot of each row
        new: list[list[int]] = []
        for j, r in enumerate(rows):
            k, v = self.parked.pop(r, (None, None))
            c = 0 if k is None else k.shape[2]
            if c:
                st.k[:, j, :, pad[j]:pad[j] + c] = k
                st.v[:, j, :, pad[j]:pad[j] + c] = v
            new.append(self.contexts[r][c:])  # never empty: at least the last sampled token
        p = max(map(len, new))
        ids = torch.full((m, p), e.pad_id, dtype=torch.long)
        is_new = torch.zeros((m, p), dtype=torch.bool)
        for j, t in enumerate(new):
            ids[j, p - len(t):] = torch.tensor(t)
            is_new[j, p - len(t):] = True
        ids, is_new, pad_t = ids.to(dev), is_new.to(dev), torch.tensor(pad, device=dev)
        chunk = max(1, cache.PREFILL_TOKENS // width)
        logits = torch.cat([self._prefill_at(st, c, ids[c:c + chunk], is_new[c:c + chunk], pad_t[c:c + chunk],
                                             width) for c in range(0, m, chunk)])  # [m, V]
        full = torch.zeros(st.rows, logits.shape[-1], device=dev)
        full[:m] = logits
        st.pad.zero_()
        st.pad[:m] = pad_t
        st.done.fill_(True)
        st.done[:m] = False
        st.tok.fill_(e.pad_id)
        st.slot.fill_(width - 1)
        e._sample_into(st, full)  # first token at column width
        st.row_ids = list(range(m)) + [-1] * (st.rows - m)
        return int(is_new.sum())

    def _prefill_at(self, st: cache.State, j0: int, ids: torch.Tensor, is_new: torch.Tensor,
                    pad: torch.Tensor, width: int) -> torch.Tensor:
        """Prefill at an offset: ids [b, P] are the last P context slots (``width - P`` ..
        ``width - 1``) of state rows j0 .. j0 + b; where ``is_new`` their keys and values go into
        the cache, the other columns (cached already, or before the row's start) leave it as it
        is. Queries attend to the cache up to themselves. Returns the last column's logits [b, V]."""
        e, a_ = self.e, self.e.arch
        (b, p), dev = ids.shape, e.device
        cols = torch.arange(width - p, width, device=dev)  # [P] slots of the block
        keys = torch.arange(width, device=dev)  # [W]
        pos = (cols[None] - pad[:, None]).clamp_min(0)  # [b, P]
        cos, sin = e._cos[pos], e._sin[pos]  # [b, P, R]
        keep = (keys[None, None] <= cols[None, :, None]) & (keys[None, None] >= pad[:, None, None])  # [b,P,W]
        self_ = (keys[None] == cols[:, None])[None]  # [1, P, W] a query always sees itself (no NaN)
        masks = {}
        for w in (None, *e.windows):
            k_ = keep if w is None else keep & (keys[None] > cols[:, None] - w)[None]
            masks[w] = torch.zeros(k_.shape, dtype=e.dtype, device=dev).masked_fill_(
                ~(k_ | self_), float("-inf"))[:, None]  # [b, 1, P, W]
        sel = is_new[:, None, :, None]  # [b, 1, P, 1]
        x = F.embedding(ids, e.embed)  # [b, P, hidden]
        for i, L in enumerate(e.layers):
            q, k, v = pre_attn(x, L.ln1, L.qkv_w, L.qkv_b, L.q_norm, L.k_norm, cos if L.rope else None, sin,
                               a_, e._lin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, P, D]
            for kv, t in ((st.k[i], k), (st.v[i], v)):
                dst = kv[j0:j0 + b, :, width - p:width]  # [b, kv, P, D]
                dst.copy_(torch.where(sel, t, dst))
            kc, vc = st.k[i][j0:j0 + b, :, :width], st.v[i][j0:j0 + b, :, :width]  # [b, kv, W, D]
            a = prefill_attention(q, kc, vc, masks[L.window])  # [b, nh, P, D]
            x = post_attn(x, a.transpose(1, 2).reshape(b, p, -1), L.o_w, L.o_b, L.ln1, L.ln2, L.gu_w, L.gu_b,
                          L.down_w, L.down_b, a_, e._lin)
        return head(x[:, -1], e.norm_w, e.lm_w, e.lm_b, a_, e._lin)

    # ------------------------------------------------------------ the decode loop

    def _decode(self, st: cache.State, rows: list[int], ctx: list[int], width: int, budgets: list[int],
                length: int):
        """Decode until every row has ended (EOS, stop string, budget); park the caches of the rows
        that closed a call. Returns (tokens, log-probs, reasons per row, final state, steps, compactions)."""
        e, m = self.e, len(rows)
        n_new = max(budgets)
        res_tok = torch.full((m, n_new), e.pad_id, dtype=torch.long, device=e.device)
        res_lp = torch.zeros((m, n_new), dtype=torch.float32, device=e.device)
        scanners = [self.stops.scanner() for _ in rows] if self.stops else None
        eos = set(e.eos_ids)
        ends: list[tuple[int, str] | None] = [None] * m  # (turn length, reason) once known
        every = e.check_every if e.device.type == "cuda" else 1  # a look costs a host sync on a GPU only
        seen = 0  # tokens of each live row examined so far

        def look(upto: int) -> None:
            """Examine tokens seen .. upto - 1 of the rows still sampling; mark those that ended."""
            nonlocal seen
            live = [jj for jj, j in enumerate(st.row_ids) if j >= 0 and ends[j] is None]
            if not live:
                return
            block = st.out_tok[live, width + seen:width + upto].tolist()
            for jj, toks in zip(live, block, strict=True):
                j = st.row_ids[jj]
                for k, t in enumerate(toks, start=seen):
                    why = ("stop_string" if scanners is not None and scanners[j].push(t)
                           else "stop" if t in eos and not e.ignore_eos
                           else "length" if k + 1 >= budgets[j] else None)
                    if why is not None:
                        ends[j] = (k + 1, why)
                        st.done[jj] = True
                        break
            seen = upto

        look(1)
        steps, compactions = 0, 0
        while steps < n_new - 1:
            if not any(ends[j] is None for j in st.row_ids if j >= 0):
                break
            if st.graph is not None:
                st.graph.replay()
            else:
                e._step(st, upto=width + steps + 1)
            steps += 1
            if steps % every and steps != n_new - 1:
                continue
            look(steps + 1)
            live = [jj for jj, j in enumerate(st.row_ids) if j >= 0 and ends[j] is None]
            if live and e.compact and e._bucket(len(live)) <= st.rows // 2:
                cache.harvest(st, res_tok, res_lp, width, n_new)
                self._park(st, rows, ctx, width, ends)
                new = self._state(e._bucket(len(live)), length)
                cache.move_rows(st, live, new, e.pad_id)
                st = new
                compactions += 1
        cache.harvest(st, res_tok, res_lp, width, n_new)
        self._park(st, rows, ctx, width, ends)
        toks, lps = res_tok.tolist(), res_lp.tolist()
        tokens, logprobs, reasons = [], [], []
        for j in range(m):
            k, why = ends[j] if ends[j] is not None else (budgets[j], "length")
            tokens.append(toks[j][:k])
            logprobs.append(lps[j][:k])
            reasons.append(why)
        return tokens, logprobs, reasons, st, steps + 1, compactions

    def _park(self, st: cache.State, rows: list[int], ctx: list[int], width: int,
              ends: list[tuple[int, str] | None]) -> None:
        """Copy aside the cache of each row of ``st`` that closed a call (it may be stepped again):
        its context before this turn and all its sampled tokens but the last (never fed)."""
        for jj, j in enumerate(st.row_ids):
            if j < 0 or ends[j] is None or ends[j][1] not in self.keep or rows[j] in self.parked:
                continue
            start, c = width - ctx[j], ctx[j] + ends[j][0] - 1
            self.parked[rows[j]] = tuple(t[:, jj, :, start:start + c].clone() for t in (st.k, st.v))

    def close(self) -> None:
        self.parked.clear()
        self.contexts = []
        self.live = set()

