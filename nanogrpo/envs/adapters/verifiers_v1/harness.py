"""``nanogrpo-chat``: verifiers' ``null`` harness (a chat loop with no tools: the task's prompt in, the
model's reply out) run inside the trainer's event loop instead of as a program.

verifiers' ``null`` harness is a uv script: each segment (each turn of a multi-turn game, which
verifiers plays by relaunching the harness on the conversation so far) is a new Python process that
imports ``openai`` and ``mcp`` first, about 5 s of CPU on a 2-core machine before the model is asked
anything. This harness sends the same request (the system prompt, the task's prompt or the
conversation so far) through the same interception endpoint with the rollout's key, and returns what
verifiers' contract asks of a harness that runs in process: every model call went through the
endpoint, the trace is the record (``vf.Harness.launch``). No tools, no MCP servers, no code run.
``harness = {id = "nanogrpo-chat"}`` in a seat's config (``env.kwargs``) picks it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

HARNESS_ID = "nanogrpo-chat"
MODULE = "nanogrpo_chat"
"""The module verifiers imports for the id (registered by :func:`register_chat`)."""
EXIT_MODEL_ERROR = 97
"""verifiers' exit status for "the model connection failed" (``MODEL_TRANSPORT_ERROR_EXIT_CODE``)."""


def _classes():
    import verifiers.v1 as v1

    class ChatHarnessConfig(v1.HarnessConfig):
        """The in-process chat loop's config (nothing of its own)."""

    class ChatHarness(v1.Harness[ChatHarnessConfig]):
        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                         tool_interception_url=None):
            from verifiers.v1.dialects.chat import message_to_wire
            from verifiers.v1.runtimes import ProgramResult

            system, prompt = self.resolve_prompt(data)
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            elif prompt is not None:
                messages += [message_to_wire(m) for m in prompt]
            url = endpoint.rstrip("/") + "/chat/completions"
            try:  # loopback HTTP: no TLS context to build (0.16 s of CPU a client), no proxy from the env
                async with httpx.AsyncClient(timeout=None, verify=False, trust_env=False) as client:
                    r = await client.post(url, headers={"Authorization": f"Bearer {secret}"},
                                          json={"model": ctx.model, "messages": messages})
            except httpx.HTTPError as e:
                return ProgramResult(EXIT_MODEL_ERROR, "", f"{type(e).__name__}: {e}")
            if r.status_code >= 400:
                return ProgramResult(1, "", f"the model call answered {r.status_code}: {r.text[:500]}")
            reply = r.json()["choices"][0]["message"].get("content") or ""
            return ProgramResult(0, json.dumps({"reply": reply}), "")

    ChatHarness.__module__ = ChatHarnessConfig.__module__ = MODULE
    return ChatHarness, ChatHarnessConfig


def register_chat() -> None:
    """Register the ``nanogrpo-chat`` harness with verifiers (a module ``nanogrpo_chat`` exporting it)."""
    import sys
    import types

    if MODULE in sys.modules:
        return
    harness, config = _classes()
    mod = types.ModuleType(MODULE, "nanogrpo's in-process chat harness (nanogrpo.envs.adapters.verifiers_v1"
                                   ".harness)")
    mod.ChatHarness, mod.ChatHarnessConfig = harness, config
    mod.__all__ = ["ChatHarness", "ChatHarnessConfig"]
    sys.modules[MODULE] = mod


__all__ = ["HARNESS_ID", "register_chat"]
