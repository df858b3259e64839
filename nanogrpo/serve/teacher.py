"""``nanogrpo serve --teacher MODEL``: the server holds a distillation teacher and scores prompts with it, on
the routes a vLLM server answers, so that ``distill.teacher = http://HOST:PORT`` takes either
(:mod:`nanogrpo.training.distill.server` is the client)::

    GET  /v1/models        {"object": "list", "data": [{"id": NAME, "owned_by": "nanogrpo", ...}]}
    POST /tokenize         {"prompt": TEXT, "add_special_tokens": false} -> {"tokens": [...], "count": n}
    POST /v1/completions   {"prompt": [[ids], ...], "max_tokens": 1, "prompt_logprobs": K, "temperature": T}
                           -> {"choices": [{"index": i, "text": "", "prompt_logprobs": [null, {ID: {"logprob",
                              "rank"}, ...}, ...]}, ...]}: each position's actual token and the top K

Unlike vLLM's, the prompt log-probs are those of ``logits / T`` (vLLM's are untempered). Nothing is
generated (``text`` is empty). Requests are checked before any forward (token ids in the vocabulary, at most
``max_seqs`` prompts of at most ``max_len`` tokens, K at most 1000, T > 0): a bad one is a 400 with one line.
The forwards run one at a time on the server's model thread (the reference model's), off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nanogrpo.batch import MAX_TOPK
from nanogrpo.serve.state import Reject, ServerState

REQUEST_CAP = 16 << 20
"""The most bytes a scoring request may take (its token ids as JSON)."""


async def _json(request: Request, read_body, cap: int, timeout_s: float) -> dict:
    body = await read_body(request, cap, timeout_s)
    try:
        data = json.loads(body)
    except ValueError:
        raise Reject(400, "bad_json", "the body is not JSON") from None
    if not isinstance(data, dict):
        raise Reject(400, "bad_json", "the body must be a JSON object")
    return data


def _prompts(data: dict, st: ServerState) -> list[list[int]]:
    p = data.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        p = [p]
    if not isinstance(p, list) or not p or not all(isinstance(s, list) and s for s in p):
        raise Reject(400, "bad_prompt", "prompt must be a list of token ids or a list of such lists")
    if st.s.max_seqs is not None and len(p) > st.s.max_seqs:
        raise Reject(400, "too_many", f"{len(p)} prompts exceeds the limit {st.s.max_seqs}")
    vocab = st.s.vocab_size
    for s in p:
        if st.s.max_len is not None and len(s) > st.s.max_len:
            raise Reject(400, "too_long", f"a prompt of {len(s)} tokens exceeds the limit {st.s.max_len}")
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab for x in s):
            raise Reject(400, "bad_prompt", f"prompt token ids must be ints in [0, {vocab})")
    return p


def _choice(i: int, seq: list[int], lp: list[float], rank: list[int], top_v: list, top_i: list) -> dict:
    """One choice of the answer: vLLM's layout of ``seq``'s prompt log-probs (None for its first token)."""
    entries: list = [None]
    for t in range(len(lp)):
        e = {str(j): {"logprob": v, "rank": r + 1} for r, (v, j) in enumerate(zip(top_v[t], top_i[t]))}
        e.setdefault(str(seq[t + 1]), {"logprob": lp[t], "rank": rank[t]})
        entries.append(e)
    return {"index": i, "text": "", "finish_reason": "length", "prompt_logprobs": entries}


def teacher_routes(st: ServerState, guarded, read_body) -> list[Route]:
    """The routes of the teacher ``st.teacher`` (a :class:`~nanogrpo.training.distill.local.LocalTeacher`);
    ``guarded`` wraps a handler in the server's auth and refusals, ``read_body`` reads a body with a cap
    (:mod:`nanogrpo.serve.routes`')."""
    teacher = st.teacher

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": teacher.name, "object": "model",
                                                         "owned_by": "nanogrpo"}]})

    async def tokenize(request: Request) -> Response:
        data = await _json(request, read_body, 1 << 20, st.s.body_timeout_s)
        text = data.get("prompt")
        if not isinstance(text, str):
            raise Reject(400, "bad_prompt", "prompt must be a string")
        ids = teacher.tokenizer(text, add_special_tokens=bool(data.get("add_special_tokens", True))).input_ids
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": st.s.max_len})

    async def completions(request: Request) -> Response:
        data = await _json(request, read_body, REQUEST_CAP, st.s.body_timeout_s)
        seqs = _prompts(data, st)
        k = data.get("prompt_logprobs")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOPK:
            raise Reject(400, "bad_param", f"prompt_logprobs must be an int in [0, {MAX_TOPK}] (this server "
                         "only scores prompts)")
        temp = data.get("temperature", 1.0)
        number = isinstance(temp, (int, float)) and not isinstance(temp, bool)
        if not number or not math.isfinite(temp) or temp <= 0:
            raise Reject(400, "bad_param", "temperature must be a number > 0")
        try:
            scored = await asyncio.get_running_loop().run_in_executor(
                st._ref_pool, teacher.prompt_logprobs, seqs, float(temp), k)
        except Exception as e:  # noqa: BLE001 - the server's own failure: the client retries
            st.log.exception("teacher scoring failed")
            raise Reject(503, "teacher_failed", f"teacher scoring failed ({type(e).__name__}); retry later") \
                from None
        choices = [_choice(i, s, lp.tolist(), rank.tolist(), tv.tolist(), ti.tolist())
                   for i, (s, (lp, rank, tv, ti)) in enumerate(zip(seqs, scored))]
        return JSONResponse({"object": "text_completion", "model": teacher.name, "choices": choices})

    return [Route("/v1/models", guarded(models), methods=["GET"]),
            Route("/tokenize", guarded(tokenize), methods=["POST"]),
            Route("/v1/completions", guarded(completions), methods=["POST"])]
