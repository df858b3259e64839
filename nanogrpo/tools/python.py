"""The built-in tool: run the model's Python code and return what it printed.

It runs inside the sandbox's child process (:mod:`nanogrpo.tools.sandbox`), where ``print``
writes to a capped buffer that becomes the tool's output. As in a notebook cell, when the last
statement is an expression its value is printed too (``37 * 48`` shows ``1776``). An exception
propagates: the sandbox shows the model the traceback of its own code and counts an error.
"""

from __future__ import annotations

import ast


def run_python(code: str, sample: dict) -> str:
    """Execute ``code`` in a fresh namespace; returns ``""`` (the output is what it printed)."""
    tree = ast.parse(code, filename="<tool>", mode="exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(tree, "<tool>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
        if value is not None:
            print(repr(value))
    return ""


run_python.hide_own_frames = True  # the sandbox shows the model its code's frames, not these
