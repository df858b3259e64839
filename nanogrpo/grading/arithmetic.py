"""Arithmetic over the numbers a text holds, exactly: ``6 × 7``, ``(1 + 2) ^ 2``, ``1,200 \\div 3``.

The numbers are those :func:`nanogrpo.grading.numbers.find_numbers` found; Python's own parser reads the
expression around them (``ast``), and only + - * / ** and brackets are evaluated, powers bounded.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

from nanogrpo.grading.numbers import Num

__all__ = ["evaluate"]

_OPERATORS = {"×": "*", "·": "*", "÷": "/", "^": "**", "{": "(", "}": ")", "[": "(", "]": ")", "$": " ",
              ".": " "}
_OPERATOR_RE = re.compile(r"\\times|\\cdot|\\div|[×·÷^{}\[\]$.]")
_LATEX_OP = {"\\times": "*", "\\cdot": "*", "\\div": "/"}
_MAX_EXPRESSION = 4000
_MAX_EXPONENT = 20


def evaluate(text: str, nums: list[Num]) -> Fraction | None:
    """Exact value of an arithmetic expression over the numbers ``nums`` found in ``text`` (``6 × 7``,
    ``(1 + 2) ^ 2``, ``1,200 \\div 3``), or None when it is not one. Python's own parser reads it
    (``ast``); only + - * / ** and brackets on the given numbers are evaluated, powers bounded."""
    parts, prev = [], 0
    for i, n in enumerate(nums):
        parts += [text[prev:n.start], f" _{i} "]
        prev = n.end
    parts.append(text[prev:])
    expr = "".join(p if i % 2 else _OPERATOR_RE.sub(_operator, p) for i, p in enumerate(parts))
    if len(expr) > _MAX_EXPRESSION:
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        return _eval(tree.body, [n.value for n in nums])
    except (SyntaxError, ValueError, RecursionError, ZeroDivisionError, OverflowError):
        return None


def _operator(m: re.Match) -> str:
    return _OPERATORS.get(m.group(0)) or _LATEX_OP[m.group(0)]


def _eval(node: ast.AST, values: list[Fraction]) -> Fraction | None:
    if isinstance(node, ast.Name) and node.id.startswith("_") and node.id[1:].isdigit():
        return values[int(node.id[1:])]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand, values)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if not isinstance(node, ast.BinOp):
        return None
    a, b = _eval(node.left, values), _eval(node.right, values)
    if a is None or b is None:
        return None
    if isinstance(node.op, ast.Add):
        return a + b
    if isinstance(node.op, ast.Sub):
        return a - b
    if isinstance(node.op, ast.Mult):
        return a * b
    if isinstance(node.op, ast.Div):
        return a / b
    if isinstance(node.op, ast.Pow) and b.denominator == 1 and abs(b) <= _MAX_EXPONENT and abs(a) < 10**9:
        return a ** int(b)
    return None
