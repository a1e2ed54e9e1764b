"""Arithmetic: +, -, x, exact division and mod on n-digit numbers; multi-step expressions.

Level = number of digits for the binary operations (``add_d1`` is one-digit addition) and
roughly the number of operators for ``expr_l*`` (parentheses from level 3).
"""

from __future__ import annotations

from posttrain.tasks.procedural import INT, ladder


def _number(rng, digits: int, lowest: int = 0) -> int:
    lo = 10 ** (digits - 1) if digits > 1 else lowest
    return rng.randrange(lo, 10**digits)


def _add(rng, level):
    a, b = _number(rng, level), _number(rng, level)
    return f"What is {a}+{b}?", str(a + b), {"a": a, "b": b}


def _sub(rng, level):
    a, b = _number(rng, level), _number(rng, level)
    if level <= 2 and a < b:  # keep the first levels free of negative numbers
        a, b = b, a
    return f"What is {a}-{b}?", str(a - b), {"a": a, "b": b}


def _mul(rng, level):
    a, b = _number(rng, level), _number(rng, level)
    return f"What is {a}*{b}?", str(a * b), {"a": a, "b": b}


def _div(rng, level):
    divisor, quotient = _number(rng, level, lowest=1), _number(rng, level)
    dividend = divisor * quotient
    return f"What is {dividend}/{divisor}?", str(quotient), {"a": dividend, "b": divisor}


def _mod(rng, level):
    a, b = _number(rng, level + 1), _number(rng, level, lowest=2)
    return f"What is {a} mod {b}?", str(a % b), {"a": a, "b": b}


_PRECEDENCE = {"+": 1, "-": 1, "*": 2}


def random_expression(rng, n_ops: int, max_operand: int, parens: bool) -> tuple[str, int]:
    """A random +,-,* expression with ``n_ops`` operators, rendered minimally, and its value."""

    def build(n):
        if n == 0:
            v = rng.randint(0, max_operand)
            return str(v), v, 3
        left_n = rng.randint(0, n - 1)
        op = rng.choice("+-*")
        ltext, lval, lprec = build(left_n)
        rtext, rval, rprec = build(n - 1 - left_n)
        prec = _PRECEDENCE[op]
        if lprec < prec:
            ltext = f"({ltext})"
        # a-(b+c) != a-b+c: the right operand of '-' at equal precedence keeps its parentheses.
        if rprec < prec or (rprec == prec and op == "-"):
            rtext = f"({rtext})"
        value = lval + rval if op == "+" else lval - rval if op == "-" else lval * rval
        return f"{ltext}{op}{rtext}", value, prec

    if not parens:
        # Without parentheses the tree must be a left chain whose rendering needs none.
        value = rng.randint(0, max_operand)
        text = str(value)
        terms = [[value]]  # products grouped into sums, to evaluate with precedence
        signs = [1]
        for _ in range(n_ops):
            op = rng.choice("+-*")
            v = rng.randint(0, max_operand)
            text += f"{op}{v}"
            if op == "*":
                terms[-1].append(v)
            else:
                terms.append([v])
                signs.append(1 if op == "+" else -1)
        total = 0
        for sign, factors in zip(signs, terms):
            prod = 1
            for f in factors:
                prod *= f
            total += sign * prod
        return text, total
    text, value, _ = build(n_ops)
    return text, value


_EXPR_SHAPE = {
    1: (2, 9, False),
    2: (3, 9, False),
    3: (3, 9, True),
    4: (4, 20, True),
    5: (6, 50, True),
}


def _expr(rng, level):
    n_ops, max_operand, parens = _EXPR_SHAPE[level]
    text, value = random_expression(rng, n_ops, max_operand, parens)
    return f"What is {text}?", str(value), {"expression": text}


def domains():
    return [
        *ladder("arithmetic", "add", _add, INT, suffix="d"),
        *ladder("arithmetic", "sub", _sub, INT, suffix="d"),
        *ladder("arithmetic", "mul", _mul, INT, suffix="d"),
        *ladder("arithmetic", "div", _div, INT, suffix="d"),
        *ladder("arithmetic", "mod", _mod, INT, suffix="d"),
        *ladder("arithmetic", "expr", _expr, INT),
    ]
