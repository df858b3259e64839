"""How a model calls a tool and how the answer comes back: the call protocols.

A protocol names the stop strings that close a call, pulls the call out of the turn's text, and
gives the text that goes around the tool's output. The driver (:mod:`nanogrpo.rollout.turns`)
tokenises that text in three pieces (before, output, after) and appends the ids: the context is
never re-tokenised, so the trainer sees exactly the tokens the model saw.

- ``code``: the model writes ``<code>print(37 * 48)</code>``; the output comes back as
  ``<output>\\n1776\\n</output>\\n``. For base models and the embedded demo (the system prompt says
  how to call it).
- ``hermes``: Qwen2.5 / Qwen3 / Hermes-style ``<tool_call>{"name": "python", "arguments": {"code":
  "..."}}</tool_call>``; the answer comes back as Qwen's chat template renders a ``tool`` message
  after an assistant turn (``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n…\\n</tool_response>
  <|im_end|>\\n<|im_start|>assistant\\n``); the turn is cut at ``</tool_call>``, so the template's
  ``<|im_end|>`` that closes the assistant turn is part of the fed context. ``name`` must be
  ``tools.name``; the tool receives ``arguments[tools.argument]`` (a string). Arguments given as a
  JSON string (some models do) are decoded first.

``parse(turn, before)`` reads the turn's text; ``before`` is the prompt's text for a first turn
(a prompt may end inside a call: ``…<think><code>``), empty after a tool output.

A malformed call (no opening tag, invalid JSON, an unknown tool, a missing argument) is not run:
the model is shown why (status ``invalid``, counted with the tool errors).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    """A tool call found in a turn: the text the tool receives, or why there is none."""

    text: str | None
    error: str | None = None


def _block(turn: str, open_tag: str, close_tag: str, before: str = "") -> tuple[str | None, str | None]:
    """The text between the opening tag and the turn's first closing tag. The opening tag may sit
    in ``before`` (the prompt, when it ends inside a call) after its last closing tag."""
    end = turn.find(close_tag)
    if end < 0:
        return None, f"no {close_tag} in the turn"
    start = turn.rfind(open_tag, 0, end)
    if start >= 0:
        return turn[start + len(open_tag):end], None
    tail = before[before.rfind(close_tag) + len(close_tag):] if close_tag in before else before
    start = tail.rfind(open_tag)
    if start >= 0:
        return tail[start + len(open_tag):] + turn[:end], None
    return None, f"{close_tag} without an opening {open_tag}"


class CodeProtocol:
    name = "code"
    stop = ("</code>",)
    before_output = "<output>\n"
    after_output = "\n</output>\n"

    def parse(self, turn: str, before: str = "") -> Call:
        body, err = _block(turn, "<code>", "</code>", before)
        if body is None:
            return Call(None, err)
        code = textwrap.dedent(body.strip("\n"))
        if code.startswith("python\n"):          # ```python habits
            code = code[len("python\n"):]
        if not code.strip():
            return Call(None, "empty <code> block")
        return Call(code)


class HermesProtocol:
    name = "hermes"
    stop = ("</tool_call>",)
    before_output = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    after_output = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

    def __init__(self, tool_name: str = "python", argument: str = "code"):
        self.tool_name, self.argument = tool_name, argument

    def parse(self, turn: str, before: str = "") -> Call:
        body, err = _block(turn, "<tool_call>", "</tool_call>", before)
        if body is None:
            return Call(None, err)
        try:
            obj = json.loads(body.strip())
            args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
            if isinstance(args, str):
                args = json.loads(args)
        except ValueError as e:
            return Call(None, f"the tool call is not valid JSON ({str(e).splitlines()[0][:120]})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return Call(None, 'a tool call is {"name": ..., "arguments": {...}}')
        if obj["name"] != self.tool_name:
            return Call(None, f"unknown tool {obj['name'][:60]!r}; the tool is {self.tool_name!r}")
        value = args.get(self.argument)
        if not isinstance(value, str) or not value.strip():
            return Call(None, f"tool {self.tool_name!r} needs a non-empty string argument {self.argument!r}")
        return Call(value)


PROTOCOLS = {"code": CodeProtocol, "hermes": HermesProtocol}


def make_protocol(name: str, tool_name: str = "python", argument: str = "code"):
    if name == "code":
        return CodeProtocol()
    if name == "hermes":
        return HermesProtocol(tool_name, argument)
    raise ValueError(f"unknown tool protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
