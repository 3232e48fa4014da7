"""Safe evaluation of arithmetic expressions, without ``eval`` or any process (§22).

:func:`safe_eval_arithmetic` walks the ``ast`` and allows only numbers,
``+ - * / // % **``, parentheses and unary signs; sizes are bounded so that no
expression can exhaust memory or time. :func:`count_operations` and
:func:`format_number` are the helpers the calculator task uses with it.
"""
from __future__ import annotations

import ast
import math
from typing import Union

__all__ = ["safe_eval_arithmetic", "format_number", "count_operations", "Number"]

Number = Union[int, float]
_MAX_EXPR_CHARS = 1000
_MAX_INT_BITS = 4096
_MAX_EXPONENT = 4096

_BINOPS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}


def _check_size(value: Number) -> Number:
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS:
            raise ValueError(f"expr: result too large (more than {_MAX_INT_BITS} bits)")
        return value
    if not math.isfinite(value):
        raise ValueError("expr: result is not finite")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, float) or isinstance(base, float):
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"expr: exponent too large (|exponent| > {_MAX_EXPONENT})")
        if base == 0 and exponent < 0:
            raise ValueError("expr: division by zero")
        if base < 0 and not float(exponent).is_integer():
            raise ValueError("expr: fractional power of a negative number")
        try:
            return _check_size(float(base) ** float(exponent))
        except OverflowError:
            raise ValueError("expr: result too large") from None
    if exponent < 0:
        if base == 0:
            raise ValueError("expr: division by zero")
        return _check_size(_exact_div(1, _power(base, -exponent)))
    if abs(base) > 1 and exponent * math.log2(abs(base)) > _MAX_INT_BITS:
        raise ValueError(f"expr: result too large (more than {_MAX_INT_BITS} bits)")
    return base**exponent


def _exact_div(a: Number, b: Number) -> Number:
    if b == 0:
        raise ValueError("expr: division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    try:
        return a / b
    except OverflowError:
        raise ValueError("expr: result too large") from None


def _binop(op: type, a: Number, b: Number) -> Number:
    if op is ast.Add:
        return _check_size(a + b)
    if op is ast.Sub:
        return _check_size(a - b)
    if op is ast.Mult:
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > _MAX_INT_BITS + 1:
            raise ValueError(f"expr: result too large (more than {_MAX_INT_BITS} bits)")
        return _check_size(a * b)
    if op is ast.Div:
        return _check_size(_exact_div(a, b))
    if op is ast.FloorDiv:
        if b == 0:
            raise ValueError("expr: division by zero")
        return _check_size(a // b)
    if op is ast.Mod:
        if b == 0:
            raise ValueError("expr: division by zero (modulo)")
        return _check_size(a % b)
    if op is ast.Pow:
        return _power(a, b)
    raise ValueError(f"expr: operator {op.__name__} is not allowed")  # pragma: no cover


def _eval_node(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expr: only numbers are allowed, got {value!r}")
        return _check_size(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _binop(type(node.op), _eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.Name):
        raise ValueError(f"expr: names are not allowed ({node.id!r})")
    if isinstance(node, ast.Call):
        raise ValueError("expr: function calls are not allowed")
    if isinstance(node, ast.Attribute):
        raise ValueError("expr: attribute access is not allowed")
    if isinstance(node, ast.BinOp):
        raise ValueError(f"expr: operator {type(node.op).__name__} is not allowed")
    raise ValueError(f"expr: {type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")


def _parse(expr: str) -> ast.Expression:
    if not isinstance(expr, str):
        raise ValueError(f"expr: expected a string, got {type(expr).__name__}")
    text = expr.strip()
    if not text:
        raise ValueError("expr: empty expression")
    if len(text) > _MAX_EXPR_CHARS:
        raise ValueError(f"expr: expression too long ({len(text)} > {_MAX_EXPR_CHARS} characters)")
    if "_" in text:  # rules out names and digit separators such as 1_000 alike
        raise ValueError("expr: '_' is not allowed")
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"expr: not a valid arithmetic expression: {text!r}") from None


def safe_eval_arithmetic(expr: str) -> Number:
    """Evaluate an arithmetic expression without ``eval``.

    Allowed: integer and decimal literals, ``+ - * / // % **``, parentheses, unary
    ``-``/``+``. ``/`` is exact on integers when the division is exact (``6 / 3 == 2``,
    an ``int``), else a float. Rejected with ``ValueError`` (message starting with
    ``"expr:"``): names, calls, attribute access, any other syntax, division by zero,
    integers beyond 4096 bits, exponents whose result would exceed that, non-finite
    floats, expressions longer than 1000 characters.
    """
    try:
        return _eval_node(_parse(expr))
    except RecursionError:
        raise ValueError("expr: expression nested too deeply") from None


def count_operations(expr: str) -> int:
    """Number of binary operators in ``expr`` (unary signs are not counted)."""
    tree = _parse(expr)
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))


def format_number(value: Number) -> str:
    """Integers as digits; floats with up to 12 significant digits (``3.5``, ``0.333333333333``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)
