"""vLLM's token route, ``POST /inference/v1/generate``, in front of any rollout engine: token ids in;
the sampled ids, their log-probs and the weight version out. The shapes are vLLM 0.32's
(``vllm/entrypoints/scale_out/token_in_token_out``, ``output_mode="tokens"``), with each log-prob entry
also carrying ``"token": "token_id:N"``, which verifiers 0.4's train client (``renderers``) checks for;
so the same environment that calls ``vllm serve`` in training calls the endpoint on a laptop.

The request: ``token_ids`` (the prompt, ids in ``[0, vocab_size)``), ``sampling_params``: ``max_tokens``
(within the episode's budget), ``stop`` (strings), ``stop_token_ids`` (the sample ends after the first;
the engine's EOS always ends it), ``n`` (1 only); ``return_token_ids`` echoes the prompt. The run's
``rollout.*`` settings sample every token (temperature, top-p, top-k, seed of a request are not used:
the log-probs trained on are the behaviour policy's). Refused with a 400: ``stream``, multimodal input
(``features``, ``content_parts``), a malformed field. Who may call: an episode's key, or the session
key with an ``X-Session-ID`` header (:mod:`.episodes`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

TOKEN_ROUTE = "/inference/v1/generate"
SESSION_HEADER = "x-session-id"
"""verifiers' train client sends the rollout's trace id in it (``SESSION_ID_HEADER``)."""
MAX_STOP_IDS = 64
REFUSED = ("features", "content_parts", "prompt_embeds")


@dataclass(frozen=True)
class TokenRequest:
    token_ids: list[int]
    sampling: dict[str, Any]
    """What the endpoint's generation reads: ``n``, ``max_tokens``, ``stop``."""
    stop_token_ids: frozenset[int]
    echo_prompt: bool

    @classmethod
    def parse(cls, body: dict, vocab_size: int) -> TokenRequest:
        """The request in ``body``; ValueError (one line) for anything malformed or not supported."""
        if body.get("stream"):
            raise ValueError("'stream' is not supported on the token route")
        for k in REFUSED:
            if body.get(k) is not None:
                raise ValueError(f"'{k}': multimodal input is not supported on the token route")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"'token_ids' must be a non-empty list of token ids in [0, {vocab_size})")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ValueError("'sampling_params' must be an object")
        stop_ids = sp.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_IDS or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise ValueError(f"'sampling_params.stop_token_ids' must be a list of at most {MAX_STOP_IDS} ids")
        sampling = {k: sp[k] for k in ("n", "max_tokens", "stop") if sp.get(k) is not None}
        return cls(list(ids), sampling, frozenset(stop_ids), bool(body.get("return_token_ids")))


def token_reply(rec, req: TokenRequest, model: str, version: int | str) -> dict[str, Any]:
    """vLLM's answer for one sampled record (:class:`~nanogrpo.episodes.endpoint.records.Record`)."""
    ids = rec.completion_ids
    stop_reason = ids[-1] if rec.finish_reason == "stop" and ids and ids[-1] in req.stop_token_ids else None
    choice = {
        "index": 0,
        "token_ids": ids,
        "finish_reason": "length" if rec.finish_reason == "length" else "stop",
        "stop_reason": "stop_string" if rec.finish_reason == "stop_string" else stop_reason,
        "logprobs": {"content": [{"token": f"token_id:{t}", "token_id": t, "logprob": lp, "top_logprobs": []}
                                 for t, lp in zip(ids, rec.logprobs)]},
        "weight_versions": [{"version": str(version), "start": 0, "end": len(ids)}],
    }
    out: dict[str, Any] = {
        "request_id": f"generate-tokens-{uuid.uuid4().hex}", "model": model, "created": int(time.time()),
        "output_mode": "tokens", "choices": [choice],
        "usage": {"prompt_tokens": len(rec.prompt_ids), "completion_tokens": len(ids),
                  "total_tokens": len(rec.prompt_ids) + len(ids)},
    }
    if req.echo_prompt:
        out["prompt_token_ids"] = rec.prompt_ids
    return out
