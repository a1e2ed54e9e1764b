"""A safe arithmetic evaluator for the calculator tool: ``ast`` walking, never ``eval``.

Accepts integers, decimals, ``+ - * / // % **``, unary signs and parentheses. Arithmetic is
exact (``fractions.Fraction``); results are printed as integers when whole, otherwise with
12 significant digits. Inputs over ``MAX_EXPRESSION_CHARS``, exponents over ``MAX_EXPONENT``
and intermediate values over ``MAX_DIGITS`` digits are errors, so every call is cheap.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 256
MAX_DIGITS = 200
_LIMIT = 10**MAX_DIGITS


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated."""


def _check(value: Fraction) -> Fraction:
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise CalculatorError("result too large")
    return value


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float):
            if not math.isfinite(node.value):
                raise CalculatorError("number out of range")
            return _check(Fraction(str(node.value)))
        return _check(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        op = node.op
        if isinstance(op, ast.Add):
            return _check(left + right)
        if isinstance(op, ast.Sub):
            return _check(left - right)
        if isinstance(op, ast.Mult):
            return _check(left * right)
        if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)):
            if right == 0:
                raise CalculatorError("division by zero")
            if isinstance(op, ast.Div):
                return _check(left / right)
            if isinstance(op, ast.FloorDiv):
                return _check(Fraction(left // right))
            return _check(left % right)
        if isinstance(op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(
                    f"exponent must be an integer in [-{MAX_EXPONENT}, {MAX_EXPONENT}]"
                )
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
            # b**e has at least (digits(b) - 1) * e + 1 digits: refuse before computing, so
            # what is computed has at most ~2 * MAX_DIGITS digits.
            digits = max(len(str(abs(left.numerator))), len(str(left.denominator)))
            if (digits - 1) * abs(int(right)) > MAX_DIGITS:
                raise CalculatorError("result too large")
            return _check(left ** int(right))
        if isinstance(op, ast.BitXor):
            raise CalculatorError("'^' is not a power; use **")
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``; raises CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("syntax error") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_value(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".12g")


def calculate(expression: str) -> str:
    """The calculator tool: the formatted result, or ``error: <reason>``."""
    try:
        return format_value(evaluate(expression))
    except CalculatorError as e:
        return f"error: {e}"
