"""A ready-made tool: arithmetic on numbers, for maths tasks (``examples/gsm8k-tools-gpu.yaml``).

``calculate`` evaluates + - * / // % ** and parentheses on integer and decimal numbers, parsed with
``ast`` and nothing else: no names, calls, attributes or strings, so no expression the model writes
reaches Python's ``eval``. Powers are bounded (an exponent over 100, or a result over 10**100, is an
error), so no call can hang its worker on a huge integer. Every mistake is a ValueError whose message
the model reads back as the tool's error.
"""

from __future__ import annotations

import ast
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
LIMIT = 10**100


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(48 / 2) * 3 + 1.5".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError(f"the exponent {right} is over 100")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if abs(value) > LIMIT:
            raise ValueError("the result is over 10**100")
        return value
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")
