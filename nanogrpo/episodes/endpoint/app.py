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
from nanogrpo.http_limits import BodyRefused, receive_capped

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


_BODY_CODES = {"too_large": "body_too_large", "slow_client": "timeout"}
"""The OpenAI error code of a body refused while it was read (by its reason); others: invalid request."""


async def read_json(request, cap: int, timeout_s: float) -> dict[str, Any]:
    """The request's JSON object, read as it arrives (:func:`nanogrpo.http_limits.receive_capped`): 413
    past ``cap`` bytes (declared or streamed), 408 past ``timeout_s``, 400 for a body shorter than
    declared or a client that left, and unless it is a JSON object."""
    buf = bytearray()
    try:
        await receive_capped(request, cap, timeout_s, buf.extend)
    except BodyRefused as e:
        raise ApiError(e.status, e.message, _BODY_CODES.get(e.reason, "invalid_request_error")) from None
    try:
        body = json.loads(bytes(buf))
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


def _bearer(request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def _finish(rec: Record) -> str:
    return "length" if rec.finish_reason == "length" else "stop"


def _usage(rec: Record) -> dict[str, int]:
    return {"prompt_tokens": len(rec.prompt_ids), "completion_tokens": len(rec.completion_ids),
            "total_tokens": len(rec.ids)}


def _extras(rec: Record, body: dict) -> dict:
    if body.get("return_token_ids"):  # vLLM's name for it
        return {"prompt_token_ids": rec.prompt_ids, "token_ids": rec.completion_ids}
    return {}


def _stream(chunks: list[dict]):
    from starlette.responses import StreamingResponse

    async def gen():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(gen(), media_type="text/event-stream")


def _guarded(handler):
    async def route(request):
        try:
            return await handler(request)
        except ApiError as e:
            return _error(e)
    return route


class Routes:
    """The routes' handlers over one :class:`~nanogrpo.episodes.endpoint.server.Endpoint` (its episodes,
    batcher, tokenizer and settings), and what they share: who a request belongs to, its prompt's ids,
    one sample for it."""

    def __init__(self, ep):
        from nanogrpo.episodes.render import token_bytes

        self.ep, self.s, self.tok = ep, ep.settings, ep.tokenizer
        self.per_token = token_bytes(self.tok)

    # ------------------------------------------------------------------ what the routes share

    def encode_prompt(self, log: EpisodeLog, text: str) -> tuple[list[int], int]:
        try:
            return encode_with_reuse(self.tok, text, log.records, self.s.max_len, self.per_token)
        except TooLong as e:
            self.ep.episodes.refuse(log, "too_long")
            raise ApiError(400, str(e), "context_length_exceeded") from None

    def episode_of(self, request) -> EpisodeLog:
        log = self.ep.episodes.get(_bearer(request))
        if log is None:
            self.ep.unauthorized += 1
            raise ApiError(401, "missing or unknown API key: each episode has its own key (its "
                                "api_key), valid while the episode runs", "invalid_api_key")
        return log

    def session_of(self, request) -> EpisodeLog:
        """An episode's key, or the session key with the request's session (``X-Session-ID``)."""
        if _bearer(request) != self.ep.episodes.session_key:
            return self.episode_of(request)
        sid = request.headers.get(SESSION_HEADER, "").strip()
        if not sid or len(sid) > 200:
            raise ApiError(400, f"the session key needs a {SESSION_HEADER} header naming the episode")
        log = self.ep.episodes.session(sid)
        if log is None:
            self.ep.unauthorized += 1
            raise ApiError(401, f"session {sid[:40]!r} is closed, or no rollout is running",
                           "invalid_api_key")
        return log

    def _grant(self, log: EpisodeLog, prompt: list[int], max_tokens: int) -> int:
        """The tokens this request may sample: within the context and the episode's budget and turns."""
        s, episodes = self.s, self.ep.episodes
        if len(prompt) >= s.max_len:
            episodes.refuse(log, "too_long")
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; this run's context holds {s.max_len}",
                           "context_length_exceeded")
        granted = episodes.reserve(log, s.max_turns, min(max_tokens, s.max_len - len(prompt)))
        if granted == "max_turns":
            episodes.refuse(log, "max_turns")
            raise ApiError(400, f"this episode reached its limit of {s.max_turns} model calls", "max_turns")
        if granted == "length":
            episodes.refuse(log, "length")
            raise ApiError(400, f"this episode sampled its budget of {s.max_new_tokens} tokens", "max_tokens")
        return granted

    async def generate(self, log: EpisodeLog, kind: str, prompt: list[int], text: str | None, reused: int,
                       body: dict, stop_ids: frozenset[int] = frozenset()) -> Record:
        """Sample for one request of ``log`` (``body``: its ``n``, ``max_tokens``, ``stop``); ``text``
        None: not kept for reuse (token prompts); ``stop_ids``: the sample is cut after the first of
        them (finish ``stop``)."""
        if _int(body, "n", 1, 1) != 1:
            raise ApiError(400, "'n' must be 1 (each episode samples its own turns)")
        max_tokens = _int(body, "max_tokens", self.s.max_new_tokens, 1)
        max_tokens = _int(body, "max_completion_tokens", max_tokens, 1)
        stop = _stops(body)
        granted = self._grant(log, prompt, max_tokens)
        try:
            c, lp, why = await asyncio.wrap_future(self.ep.batcher.submit(prompt, granted, stop))
        except Exception as e:
            self.ep.episodes.add(log, None, granted)
            raise ApiError(503, str(e), "unavailable") from None
        cut = next((k for k, t in enumerate(c) if t in stop_ids), None)
        if cut is not None:  # sampling is causal: the same as stopping there
            c, lp, why = c[:cut + 1], lp[:cut + 1], "stop"
        rec = Record(0, kind, prompt, c, lp, why, reused,
                     text="" if text is None else text + self.tok.decode(c, skip_special_tokens=False))
        self.ep.episodes.add(log, rec, granted)
        return rec

    def reply_text(self, rec: Record, body: dict) -> str:
        text = self.tok.decode(rec.completion_ids, skip_special_tokens=True)
        return strip_stop(text, _stops(body)) if rec.finish_reason == "stop_string" else text

    def token_texts(self, rec: Record) -> list[str]:
        return [self.tok.decode([t], skip_special_tokens=False) for t in rec.completion_ids]

    # ------------------------------------------------------------------ the routes

    async def chat(self, request):
        log = self.episode_of(request)
        body = await read_json(request, self.s.max_body_bytes, self.s.body_timeout_s)
        messages = chat_messages(body)
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list")
        try:
            text = self.ep.render(messages, tools)
        except Exception as e:
            raise ApiError(400, f"the chat template cannot render these messages: {e}") from None
        prompt, reused = self.encode_prompt(log, text)
        rec = await self.generate(log, "chat", prompt, text, reused, body)
        return self._chat_reply(rec, body, bool(tools))

    def _chat_reply(self, rec: Record, body: dict, tools: bool):
        from starlette.responses import JSONResponse

        content, fr = self.reply_text(rec, body), _finish(rec)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls = tool_calls(content, rec.index) if tools else None
        if calls is not None:
            message = {"role": "assistant", "content": calls[0] or None, "tool_calls": calls[1]}
            fr = "tool_calls" if fr == "stop" else fr
        lps = None
        if body.get("logprobs"):
            lps = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                               for t, lp in zip(self.token_texts(rec), rec.logprobs)]}
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": body.get("model") or self.s.model_name}
        if body.get("stream"):
            return _stream([{**head, "object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": message, "logprobs": lps,
                                          "finish_reason": None}]},
                            {**head, "object": "chat.completion.chunk", "usage": _usage(rec),
                             "choices": [{"index": 0, "delta": {}, "finish_reason": fr}]}])
        return JSONResponse({**head, "object": "chat.completion", "usage": _usage(rec),
                             "choices": [{"index": 0, "message": message, "logprobs": lps,
                                          "finish_reason": fr, **_extras(rec, body)}]})

    async def completions(self, request):
        log = self.episode_of(request)
        body = await read_json(request, self.s.max_body_bytes, self.s.body_timeout_s)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if body.get("echo") or body.get("suffix"):
            raise ApiError(400, "'echo' and 'suffix' are not supported")
        if isinstance(prompt, str) and prompt:
            text = prompt
            ids, reused = self.encode_prompt(log, text)
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.s.vocab_size
                for t in prompt):
            ids, reused = list(prompt), 0
            text = self.tok.decode(ids, skip_special_tokens=False)
        else:
            raise ApiError(400, f"'prompt' must be one non-empty string or one list of token ids "
                                f"in [0, {self.s.vocab_size})")
        rec = await self.generate(log, "completions", ids, text, reused, body)
        return self._completion_reply(rec, body, text)

    def _completion_reply(self, rec: Record, body: dict, text: str):
        from starlette.responses import JSONResponse

        lps = None
        if body.get("logprobs") is not None and body.get("logprobs") is not False:
            texts = self.token_texts(rec)
            offsets = [len(text) + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
            lps = {"tokens": texts, "token_logprobs": rec.logprobs, "top_logprobs": None,
                   "text_offset": offsets}
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": body.get("model") or self.s.model_name}
        choice = {"index": 0, "text": self.reply_text(rec, body), "logprobs": lps,
                  "finish_reason": _finish(rec), **_extras(rec, body)}
        if body.get("stream"):
            return _stream([{**head, "choices": [choice]}])
        return JSONResponse({**head, "choices": [choice], "usage": _usage(rec)})

    async def tokens(self, request):
        from starlette.responses import JSONResponse

        log = self.session_of(request)
        body = await read_json(request, self.s.max_body_bytes, self.s.body_timeout_s)
        try:
            req = TokenRequest.parse(body, self.s.vocab_size)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        rec = await self.generate(log, "tokens", req.token_ids, None, 0, req.sampling, req.stop_token_ids)
        return JSONResponse(token_reply(rec, req, body.get("model") or self.s.model_name, self.ep.version))

    async def models(self, request):
        from starlette.responses import JSONResponse

        if _bearer(request) != self.ep.episodes.session_key:
            self.episode_of(request)
        card = {"id": self.s.model_name, "object": "model", "created": 0, "owned_by": "nanogrpo",
                "max_model_len": self.s.max_len}
        return JSONResponse({"object": "list", "data": [card]})


def create_app(ep):
    """The ASGI app over an :class:`~nanogrpo.episodes.endpoint.server.Endpoint`: :class:`Routes`' handlers,
    each turning an :class:`ApiError` into OpenAI's error answer."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    r = Routes(ep)
    return Starlette(routes=[Route("/v1/chat/completions", _guarded(r.chat), methods=["POST"]),
                             Route("/v1/completions", _guarded(r.completions), methods=["POST"]),
                             Route("/v1/models", _guarded(r.models), methods=["GET"]),
                             Route(TOKEN_ROUTE, _guarded(r.tokens), methods=["POST"])])
