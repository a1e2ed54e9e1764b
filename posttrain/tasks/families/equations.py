"""Linear equations in one unknown and 2x2 linear systems with integer solutions.

Level grows the coefficients and moves from ``x + b = c`` to ``a(x + b) = cx + d``.
"""

from __future__ import annotations

from posttrain.tasks.procedural import INT, INT_LIST, ladder


def _term(coef: int, var: str) -> str:
    if coef == 1:
        return var
    if coef == -1:
        return f"-{var}"
    return f"{coef}{var}"


def _plus(value: int) -> str:
    return f" + {value}" if value >= 0 else f" - {-value}"


def _nonzero(rng, lo, hi):
    v = 0
    while v == 0:
        v = rng.randint(lo, hi)
    return v


def _linear(rng, level):
    if level == 1:
        x, b = rng.randint(0, 9), rng.randint(0, 9)
        eq = f"x{_plus(b)} = {x + b}"
    elif level == 2:
        x, a = rng.randint(0, 9), rng.randint(2, 9)
        eq = f"{a}x = {a * x}"
    elif level == 3:
        x, a, b = rng.randint(-9, 9), rng.randint(2, 9), rng.randint(-20, 20)
        eq = f"{a}x{_plus(b)} = {a * x + b}"
    elif level == 4:
        x = rng.randint(-20, 20)
        a, c = rng.randint(-9, 9), rng.randint(-9, 9)
        while a == c:
            c = rng.randint(-9, 9)
        b = rng.randint(-30, 30)
        d = a * x + b - c * x
        eq = f"{_term(a, 'x') if a else '0'}{_plus(b)} = {_term(c, 'x') if c else '0'}{_plus(d)}"
    else:
        x = rng.randint(-50, 50)
        a, b = _nonzero(rng, -12, 12), rng.randint(-20, 20)
        c = rng.randint(-12, 12)
        while c == a:
            c = rng.randint(-12, 12)
        d = a * (x + b) - c * x
        eq = f"{a}(x{_plus(b)}) = {_term(c, 'x') if c else '0'}{_plus(d)}"
    return f"Solve for x: {eq}", str(x), {"equation": eq}


def _system(rng, level):
    span = (5, 9, 12, 20, 50)[level - 1]
    lo = 0 if level == 1 else -span
    while True:
        x, y = rng.randint(lo, span), rng.randint(lo, span)
        if level == 1:
            a, b, c, d = 1, 1, 1, -1
        else:
            cmax = (1, 3, 5, 9, 15)[level - 1]
            a, b, c, d = (_nonzero(rng, -cmax, cmax) for _ in range(4))
        if a * d - b * c != 0:
            break
    e1 = f"{_term(a, 'x')} {'+' if b > 0 else '-'} {_term(abs(b), 'y')} = {a * x + b * y}"
    e2 = f"{_term(c, 'x')} {'+' if d > 0 else '-'} {_term(abs(d), 'y')} = {c * x + d * y}"
    q = f"Solve: {e1}; {e2}. Answer as x, y"
    return q, f"{x}, {y}", {"equations": [e1, e2]}


def domains():
    return [
        *ladder("equations", "linear", _linear, INT),
        *ladder("equations", "system", _system, INT_LIST),
    ]
