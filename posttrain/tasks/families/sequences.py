"""Sequence continuation: arithmetic, geometric, Fibonacci-like, quadratic and periodic.

Level widens the parameter ranges (steps, ratios, starting values, period length).
"""

from __future__ import annotations

from posttrain.tasks.procedural import INT, ladder


def _show(xs) -> str:
    return ", ".join(map(str, xs))


def _question(xs) -> str:
    return f"What number comes next: {_show(xs)}, ?"


def _arith(rng, level):
    span = (3, 9, 20, 50, 200)[level - 1]
    start = rng.randint(0 if level <= 2 else -span, span)
    step = rng.randint(1, span) * (1 if level <= 2 else rng.choice((-1, 1)))
    xs = [start + i * step for i in range(5)]
    return _question(xs[:4]), str(xs[4]), {"start": start, "step": step}


def _geom(rng, level):
    ratio = rng.randint(2, 2 + level) * (1 if level <= 3 else rng.choice((-1, 1)))
    start = rng.randint(1, 2 * level + 1)
    xs = [start * ratio**i for i in range(5)]
    return _question(xs[:4]), str(xs[4]), {"start": start, "ratio": ratio}


def _fib(rng, level):
    span = (3, 9, 30, 100, 1000)[level - 1]
    xs = [rng.randint(0, span), rng.randint(1, span)]
    while len(xs) < 6:
        xs.append(xs[-1] + xs[-2])
    return _question(xs[:5]), str(xs[5]), {"a": xs[0], "b": xs[1]}


def _quad(rng, level):
    span = (3, 3, 5, 9, 20)[level - 1]
    a = rng.randint(1, span)
    b = rng.randint(-span, span) if level > 1 else rng.randint(0, 2)
    c = rng.randint(-span, span) if level > 1 else 0
    xs = [a * n * n + b * n + c for n in range(1, 7)]
    return _question(xs[:5]), str(xs[5]), {"a": a, "b": b, "c": c}


def _periodic(rng, level):
    period = level + 1
    pattern = [rng.randint(0, 9) for _ in range(period)]
    n_shown = 2 * period + rng.randint(0, period - 1)
    xs = [pattern[i % period] for i in range(n_shown + 1)]
    return _question(xs[:-1]), str(xs[-1]), {"pattern": pattern}


def domains():
    return [
        *ladder("sequences", "arith", _arith, INT),
        *ladder("sequences", "geom", _geom, INT),
        *ladder("sequences", "fib", _fib, INT),
        *ladder("sequences", "quad", _quad, INT),
        *ladder("sequences", "periodic", _periodic, INT),
    ]
