"""A calculator tool: safe, exact evaluation of an arithmetic expression.

``calculate(expr)`` parses ``expr`` with :mod:`ast` and evaluates only numbers, parentheses,
unary + and -, and the binary operators + - * / // % **, exactly: integers and decimals become
:class:`fractions.Fraction`, so ``0.1 + 0.2`` is ``3/10`` and ``1/3 * 3`` is ``1``. Names,
calls, attributes, subscripts, comparisons and everything else are refused with
:class:`CalcError`, as are powers whose result would be too large, too-long input, too-deep
nesting and division by zero. Never evaluates Python code (no ``eval``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fractions import Fraction

MAX_CHARS = 1000
"""Longest expression accepted (characters)."""
MAX_DEPTH = 50
"""Deepest nesting of operations accepted."""
MAX_EXPONENT = 1024
"""Largest |exponent| of ``**``."""
MAX_BITS = 4096
"""Largest size (bits of numerator or denominator) of any intermediate result."""


class CalcError(ValueError):
    """An expression the calculator refuses; the message says what and what is allowed."""


@dataclass(frozen=True)
class CalcResult:
    """value: the exact result; text: "7", "-3/4" (a fraction in lowest terms) or, for a
    non-integer, also its decimal in ``decimal`` ("0.75"; 12 significant digits)."""

    value: Fraction
    text: str
    decimal: str


_ALLOWED = "numbers, parentheses, unary + -, and + - * / // % **"


def _num(node: ast.Constant) -> Fraction:
    v = node.value
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise CalcError(f"constant {v!r} is not a number; allowed: {_ALLOWED}")
    if isinstance(v, float) and v != v or v in (float("inf"), float("-inf")):
        raise CalcError(f"number {v!r} is not finite")
    return Fraction(v) if isinstance(v, int) else Fraction(repr(v))


def _check_size(x: Fraction) -> Fraction:
    if max(x.numerator.bit_length(), x.denominator.bit_length()) > MAX_BITS:
        raise CalcError(f"an intermediate result exceeds {MAX_BITS} bits")
    return x


def _pow(a: Fraction, b: Fraction) -> Fraction:
    if b.denominator != 1:
        raise CalcError(f"exponent {b} is not an integer (only integer powers are exact)")
    e = b.numerator
    if abs(e) > MAX_EXPONENT:
        raise CalcError(f"exponent {e} exceeds the bound |exponent| <= {MAX_EXPONENT}")
    bits = max(a.numerator.bit_length(), a.denominator.bit_length())
    if bits * abs(e) > MAX_BITS:
        raise CalcError(f"power result would exceed {MAX_BITS} bits")
    if a == 0 and e < 0:
        raise CalcError("division by zero (0 to a negative power)")
    return a**e


def _eval(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise CalcError(f"expression nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant):
        return _num(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        x = _eval(node.operand, depth + 1)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        op = node.op
        if isinstance(op, ast.Add):
            return _check_size(a + b)
        if isinstance(op, ast.Sub):
            return _check_size(a - b)
        if isinstance(op, ast.Mult):
            return _check_size(a * b)
        if isinstance(op, ast.Pow):
            return _check_size(_pow(a, b))
        if isinstance(op, ast.Div | ast.FloorDiv | ast.Mod):
            if b == 0:
                raise CalcError("division by zero")
            if isinstance(op, ast.Div):
                return _check_size(a / b)
            return Fraction(a // b) if isinstance(op, ast.FloorDiv) else _check_size(a % b)
        raise CalcError(f"operator {type(op).__name__} is not allowed; allowed: {_ALLOWED}")
    raise CalcError(f"{type(node).__name__} is not allowed (no names, calls or attributes); "
                    f"allowed: {_ALLOWED}")  # fmt: skip


def calculate(expr: str) -> CalcResult:
    """The exact value of the arithmetic expression ``expr`` (see the module docstring)."""
    if not isinstance(expr, str):
        raise CalcError(f"expression must be a string, got {type(expr).__name__}")
    if len(expr) > MAX_CHARS:
        raise CalcError(f"expression has {len(expr)} characters, at most {MAX_CHARS} allowed")
    if expr.count("(") > MAX_DEPTH:
        raise CalcError(f"expression nested deeper than {MAX_DEPTH}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcError(f"not an arithmetic expression ({type(e).__name__}); "
                        f"allowed: {_ALLOWED}") from None  # fmt: skip
    value = _eval(tree.body, 0)
    text = str(value)
    decimal = text if value.denominator == 1 else f"{float(value):.12g}"
    return CalcResult(value, text, decimal)


def calculator_tool(expr: str) -> str:
    """What an environment shows the model: the result's text (with its decimal when not an
    integer), or "error: <message>"; never raises CalcError."""
    try:
        r = calculate(expr)
    except CalcError as e:
        return f"error: {e}"
    return r.text if r.text == r.decimal else f"{r.text} (= {r.decimal})"
