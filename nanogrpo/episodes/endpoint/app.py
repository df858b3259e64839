"""The endpoint's HTTP side: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (OpenAI's
shapes, enough for the ``openai`` package and the libraries built on it), and vLLM's token route
``/inference/v1/generate`` (:mod:`.tokens`).

Every route needs ``Authorization: Bearer KEY`` with the key of an open episode
(:class:`~nanogrpo.episodes.endpoint.records.OpenEpisodes`); the key also says which episode a request
belongs to. Bodies are read in chunks and refused past ``max_body_bytes`` (413) or past a deadline
(408), before any JSON is parsed; a prompt whose text holds more bytes than the context has tokens
left for (times the tokenizer's longest token) is refused (400 ``context_length_exceeded``) before it
is tokenised. A request's ``temperature``, ``top_p``, ``top_k``, ``seed`` are not
used: the run's ``rollout.*`` settings sample every token, so that the log-probs trained on are the
behaviour policy's. ``max_tokens`` (or ``max_completion_tokens``) is honoured within the episode's
token budget (``rollout.max_new_tokens`` over all its requests); ``stop`` is honoured (the reply's
text ends before it, as OpenAI's; the tokens sampled are recorded as they are); ``n`` must be 1.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from nanogrpo.episodes.endpoint.records import EpisodeLog, Record, TooLong, encode_with_reuse
from nanogrpo.episodes.endpoint.tokens import SESSION_HEADER, TOKEN_ROUTE, TokenRequest, token_reply

MAX_STOPS = 8


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _error(e: ApiError):
    from starlette.responses import JSONResponse

    kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status, "invalid_request_error")
    return JSONResponse({"error": {"message": e.message, "type": kind, "param": None, "code": e.code}},
                        status_code=e.status)


async def read_json(request, cap: int, timeout_s: float) -> dict[str, Any]:
    """The request's JSON object, read in chunks: 413 past ``cap`` bytes (declared or streamed), 408
    past ``timeout_s``, 400 unless it is a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > cap):
        raise ApiError(413, f"request body over the endpoint's limit of {cap} bytes", "body_too_large")
    chunks: list[bytes] = []
    size = 0

    async def pull() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise ApiError(413, f"request body over the endpoint's limit of {cap} bytes",
                               "body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(pull(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout_s:g} s", "timeout") from None
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _int(body: dict, name: str, default: int, lo: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ApiError(400, f"'{name}' must be an integer >= {lo}, got {v!r}")
    return v


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOPS):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them")
    return tuple(stops)


def _text_content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts")


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them (content parts joined to a string)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'")
        out.append({**m, "content": _text_content(m.get("content"), i)})
    return out


def strip_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to its first stop string (OpenAI's replies leave the stop string out)."""
    cut = min((k for k in (text.find(s) for s in stops) if k >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def tool_calls(text: str, index: int) -> tuple[str, list[dict]] | None:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes / Qwen) in a reply as
    OpenAI ``tool_calls``, with the text before them; None when there is none or one is malformed."""
    if "<tool_call>" not in text:
        return None
    head, _, rest = text.partition("<tool_call>")
    blocks = rest.split("<tool_call>")
    calls = []
    for k, block in enumerate(blocks):
        body, closed, _ = block.partition("</tool_call>")
        if not closed and k < len(blocks) - 1:  # only the last may be open (a stop string cut it)
            return None
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{index}_{k}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return head.strip(), calls


def create_app(ep):
    """The ASGI app over an :class:`~nanogrpo.episodes.endpoint.server.Endpoint` (its episodes,
    batcher, tokenizer and settings)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from nanogrpo.episodes.render import token_bytes

    s = ep.settings
    tok = ep.tokenizer
    per_token = token_bytes(tok)

    def encode_prompt(log: EpisodeLog, text: str) -> tuple[list[int], int]:
        try:
            return encode_with_reuse(tok, text, log.records, s.max_len, per_token)
        except TooLong as e:
            ep.episodes.refuse(log, "too_long")
            raise ApiError(400, str(e), "context_length_exceeded") from None

    def episode_of(request) -> EpisodeLog:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        log = ep.episodes.get(key)
        if log is None:
            ep.unauthorized += 1
            raise ApiError(401, "missing or unknown API key: each episode has its own key (its "
                                "api_key), valid while the episode runs", "invalid_api_key")
        return log

    async def generate(log: EpisodeLog, kind: str, prompt: list[int], text: str | None, reused: int,
                       body: dict, stop_ids: frozenset[int] = frozenset()) -> Record:
        """Sample for one request of ``log`` (``body``: its ``n``, ``max_tokens``, ``stop``); ``text``
        None: not kept for reuse (token prompts); ``stop_ids``: the sample is cut after the first of
        them (finish ``stop``)."""
        if _int(body, "n", 1, 1) != 1:
            raise ApiError(400, "'n' must be 1 (each episode samples its own turns)")
        max_tokens = _int(body, "max_completion_tokens", _int(body, "max_tokens", s.max_new_tokens, 1), 1)
        stop = _stops(body)
        if len(prompt) >= s.max_len:
            ep.episodes.refuse(log, "too_long")
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; this run's context holds {s.max_len}",
                           "context_length_exceeded")
        granted = ep.episodes.reserve(log, s.max_turns, min(max_tokens, s.max_len - len(prompt)))
        if granted == "max_turns":
            ep.episodes.refuse(log, "max_turns")
            raise ApiError(400, f"this episode reached its limit of {s.max_turns} model calls", "max_turns")
        if granted == "length":
            ep.episodes.refuse(log, "length")
            raise ApiError(400, f"this episode sampled its budget of {s.max_new_tokens} tokens", "max_tokens")
        try:
            c, lp, why = await asyncio.wrap_future(ep.batcher.submit(prompt, granted, stop))
        except Exception as e:
            ep.episodes.add(log, None, granted)
            raise ApiError(503, str(e), "unavailable") from None
        cut = next((k for k, t in enumerate(c) if t in stop_ids), None)
        if cut is not None:  # sampling is causal: the same as stopping there
            c, lp, why = c[:cut + 1], lp[:cut + 1], "stop"
        rec = Record(0, kind, prompt, c, lp, why, reused,
                     text="" if text is None else text + tok.decode(c, skip_special_tokens=False))
        ep.episodes.add(log, rec, granted)
        return rec

    def reply_text(rec: Record, body: dict) -> str:
        text = tok.decode(rec.completion_ids, skip_special_tokens=True)
        return strip_stop(text, _stops(body)) if rec.finish_reason == "stop_string" else text

    def finish(rec: Record) -> str:
        return "length" if rec.finish_reason == "length" else "stop"

    def usage(rec: Record) -> dict[str, int]:
        return {"prompt_tokens": len(rec.prompt_ids), "completion_tokens": len(rec.completion_ids),
                "total_tokens": len(rec.ids)}

    def token_texts(rec: Record) -> list[str]:
        return [tok.decode([t], skip_special_tokens=False) for t in rec.completion_ids]

    def extras(rec: Record, body: dict) -> dict:
        if body.get("return_token_ids"):  # vLLM's name for it
            return {"prompt_token_ids": rec.prompt_ids, "token_ids": rec.completion_ids}
        return {}

    def stream(chunks: list[dict]):
        async def gen():
            for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    def guarded(handler):
        async def route(request):
            try:
                return await handler(request)
            except ApiError as e:
                return _error(e)
        return route

    async def chat(request):
        log = episode_of(request)
        body = await read_json(request, s.max_body_bytes, s.body_timeout_s)
        messages = chat_messages(body)
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list")
        try:
            text = ep.render(messages, tools)
        except Exception as e:
            raise ApiError(400, f"the chat template cannot render these messages: {e}") from None
        prompt, reused = encode_prompt(log, text)
        rec = await generate(log, "chat", prompt, text, reused, body)
        content, fr = reply_text(rec, body), finish(rec)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls = tool_calls(content, rec.index) if tools else None
        if calls is not None:
            message = {"role": "assistant", "content": calls[0] or None, "tool_calls": calls[1]}
            fr = "tool_calls" if fr == "stop" else fr
        lps = None
        if body.get("logprobs"):
            lps = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                               for t, lp in zip(token_texts(rec), rec.logprobs)]}
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": body.get("model") or s.model_name}
        if body.get("stream"):
            return stream([{**head, "object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": message, "logprobs": lps,
                                         "finish_reason": None}]},
                           {**head, "object": "chat.completion.chunk", "usage": usage(rec),
                            "choices": [{"index": 0, "delta": {}, "finish_reason": fr}]}])
        return JSONResponse({**head, "object": "chat.completion", "usage": usage(rec),
                             "choices": [{"index": 0, "message": message, "logprobs": lps,
                                          "finish_reason": fr, **extras(rec, body)}]})

    async def completions(request):
        log = episode_of(request)
        body = await read_json(request, s.max_body_bytes, s.body_timeout_s)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if body.get("echo") or body.get("suffix"):
            raise ApiError(400, "'echo' and 'suffix' are not supported")
        if isinstance(prompt, str) and prompt:
            text = prompt
            ids, reused = encode_prompt(log, text)
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < s.vocab_size for t in prompt):
            ids, reused = list(prompt), 0
            text = tok.decode(ids, skip_special_tokens=False)
        else:
            raise ApiError(400, f"'prompt' must be one non-empty string or one list of token ids "
                                f"in [0, {s.vocab_size})")
        rec = await generate(log, "completions", ids, text, reused, body)
        content, fr = reply_text(rec, body), finish(rec)
        lps = None
        if body.get("logprobs") is not None and body.get("logprobs") is not False:
            texts = token_texts(rec)
            offsets = [len(text) + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
            lps = {"tokens": texts, "token_logprobs": rec.logprobs, "top_logprobs": None,
                   "text_offset": offsets}
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": body.get("model") or s.model_name}
        choice = {"index": 0, "text": content, "logprobs": lps, "finish_reason": fr, **extras(rec, body)}
        if body.get("stream"):
            return stream([{**head, "choices": [choice]}])
        return JSONResponse({**head, "choices": [choice], "usage": usage(rec)})

    def bearer(request) -> str | None:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else None

    def session_of(request) -> EpisodeLog:
        """An episode's key, or the session key with the request's session (``X-Session-ID``)."""
        if bearer(request) != ep.episodes.session_key:
            return episode_of(request)
        sid = request.headers.get(SESSION_HEADER, "").strip()
        if not sid or len(sid) > 200:
            raise ApiError(400, f"the session key needs a {SESSION_HEADER} header naming the episode")
        log = ep.episodes.session(sid)
        if log is None:
            ep.unauthorized += 1
            raise ApiError(401, f"session {sid[:40]!r} is closed, or no rollout is running",
                           "invalid_api_key")
        return log

    async def tokens(request):
        log = session_of(request)
        body = await read_json(request, s.max_body_bytes, s.body_timeout_s)
        try:
            req = TokenRequest.parse(body, s.vocab_size)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        rec = await generate(log, "tokens", req.token_ids, None, 0, req.sampling, req.stop_token_ids)
        return JSONResponse(token_reply(rec, req, body.get("model") or s.model_name, ep.version))

    async def models(request):
        if bearer(request) != ep.episodes.session_key:
            episode_of(request)
        card = {"id": s.model_name, "object": "model", "created": 0, "owned_by": "nanogrpo",
                "max_model_len": s.max_len}
        return JSONResponse({"object": "list", "data": [card]})

    return Starlette(routes=[Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
                             Route("/v1/completions", guarded(completions), methods=["POST"]),
                             Route("/v1/models", guarded(models), methods=["GET"]),
                             Route(TOKEN_ROUTE, guarded(tokens), methods=["POST"])])
