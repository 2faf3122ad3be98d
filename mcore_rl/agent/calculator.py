"""A calculator tool (the tool demo's, ``recipes/tool_demo_cpu.yaml``): arithmetic on numbers, read safely.

The expression is parsed (``ast``), never evaluated as Python: numbers, ``+ - * / // % **`` and parentheses
only; exponents and results are bounded so that a call cannot take minutes or gigabytes.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 100
"""Longest result (and exponent bound) the calculator computes."""


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * max(len(str(abs(left))), 1) > MAX_DIGITS:
            raise ValueError(f"the power has more than {MAX_DIGITS} digits")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.dump(node)[:40]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. 123*45
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value)
    if len(text) > MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return text
