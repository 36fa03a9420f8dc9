"""The calculator tool (generator/tools/calculator.py): exact results, adversarial refusals."""

import time
from fractions import Fraction

import pytest

from generator.tools.calculator import CalcError, calculate, calculator_tool


@pytest.mark.parametrize(
    ("expr", "want"),
    [("1+2*3", Fraction(7)), ("(1+2)*3", Fraction(9)), ("0.1+0.2", Fraction(3, 10)),
     ("1/3*3", Fraction(1)), ("-2**2", Fraction(-4)), ("(-2)**3", Fraction(-8)),
     ("7//2", Fraction(3)), ("-7//2", Fraction(-4)), ("7%3", Fraction(1)),
     ("2**-2", Fraction(1, 4)), ("--+3", Fraction(3)), ("1e3/8", Fraction(125))],
)  # fmt: skip
def test_exact_arithmetic(expr: str, want: Fraction) -> None:
    assert calculate(expr).value == want


def test_tool_text() -> None:
    assert calculator_tool("3/4") == "3/4 (= 0.75)"
    assert calculator_tool("6*7") == "42"
    assert calculator_tool("1/0") == "error: division by zero"


@pytest.mark.parametrize(
    ("expr", "said"),
    [("__import__('os').system('true')", "Call is not allowed"),
     ("x + 1", "Name is not allowed"), ("(1).real", "Attribute is not allowed"),
     ("'a' * 3", "is not a number"), ("1 < 2", "Compare is not allowed"),
     ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("0**-1", "division by zero"),
     ("9**9**9", "exceeds the bound"), ("10**1000 * 10**1000 * 10**1000", "exceeds 4096 bits"),
     ("2**0.5", "not an integer"), ("(" * 200 + "1" + ")" * 200, "nested deeper than 50"),
     ("-" * 500 + "1", "nested deeper than 50"), ("1+" * 600 + "1", "at most 1000"),
     ("lambda: 1", "Lambda is not allowed"), ("1 +", "not an arithmetic expression")],
)  # fmt: skip
def test_refuses_adversarial_input_quickly(expr: str, said: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(CalcError, match=said.replace("(", r"\(")):
        calculate(expr)
    assert time.perf_counter() - t0 < 0.5  # refused before any huge computation
