"""``[tools]``: the tool protocol and the sandbox the model's code runs in."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nanogrpo.config.base import _Strict

DEFAULT_PRELOAD = ["math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools",
                   "collections", "random", "re", "string", "json", "datetime", "heapq", "bisect", "operator"]


class ToolsConfig(_Strict):
    """Multi-turn rollouts with a tool (``nanogrpo.tools``, ``nanogrpo.rollout.turns``): the model's
    turn ends when it closes a tool call, the sandbox runs it, the output is appended as context
    (never trained on) and the model continues."""

    enabled: bool = False
    """Multi-turn rollouts with the tool below; False: single-turn generation."""
    protocol: Literal["code", "hermes"] = "code"
    """``code``: ``<code>…</code>`` answered by ``<output>…</output>``; ``hermes``: Qwen/Hermes
    ``<tool_call>{json}</tool_call>`` answered by a ``<tool_response>`` turn
    (``nanogrpo.tools.protocols``)."""
    function: str = "python"
    """The tool, ``fn(call: str, sample: dict) -> str``: ``python`` (the built-in interpreter) or
    ``module:function`` / ``path/to/file.py:function``. It runs in the sandbox either way."""
    name: str = "python"
    """``hermes``: the tool's name in the call's JSON."""
    argument: str = "code"
    """``hermes``: the argument whose (string) value the tool receives."""
    max_turns: int = Field(4, ge=1)
    """Tool calls a trajectory may make; a call past it ends the trajectory, not run
    (finish reason ``max_turns``). ``rollout.max_new_tokens`` bounds the tokens the model samples
    over all its turns."""
    max_output_tokens: int = Field(256, gt=0)
    """Tokens of tool output shown to the model per call (the rest is cut and marked)."""
    timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit per call (the CPU-time limit is about the same)."""
    memory_mb: int = Field(512, ge=64)
    """Address-space limit of a call's process."""
    file_mb: int = Field(8, ge=0)
    """Largest file a call may write (in its throwaway working directory)."""
    max_output_bytes: int = Field(16384, gt=0)
    """Bytes a call may print before it is stopped (its output cut, the status ``overflow``)."""
    workers: int = Field(2, ge=1)
    """Calls run at once."""
    preload: list[str] = Field(default_factory=lambda: list(DEFAULT_PRELOAD))
    """Modules the sandbox imports once, before forking the calls (a call imports others itself,
    which fails where the sandbox cannot read them: add e.g. ``numpy``, ``sympy``)."""
    sample_fields: list[str] = Field(default_factory=list)
    """Fields of the prompt's dataset row a custom tool receives as its ``sample`` (default none:
    the reference answer never enters the sandbox). The built-in ``python`` tool receives none. A
    tool that runs the model's code in its own process hands that code all it was given."""
    require_isolation: bool = False
    """Refuse to start unless the kernel gives the calls their own network and PID namespaces,
    Landlock and the seccomp filter (see ``nanogrpo.tools.sandbox`` for what each layer holds)."""

    @model_validator(mode="after")
    def _fields_for_custom_tools(self) -> ToolsConfig:
        if self.sample_fields and self.function.strip() == "python":
            raise ValueError("tools.sample_fields is for a custom tool: the built-in python tool runs the "
                             "model's code, which would read them (e.g. the answer); leave it empty")
        return self
