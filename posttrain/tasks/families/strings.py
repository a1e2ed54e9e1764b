"""String transforms: copy, reverse, rotate, case changes, dedupe, count, sort.

Level sets the string length (3, 5, 8, 12, 20) and, from level 4, mixed case and digits.
Strings never contain spaces or quotes, so answers compare after stripping.
"""

from __future__ import annotations

import string

from posttrain.tasks.procedural import INT, STRING, ladder

_LENGTH = {1: 3, 2: 5, 3: 8, 4: 12, 5: 20}
_LOWER = string.ascii_lowercase
_MIXED = string.ascii_letters
_ALNUM = string.ascii_letters + string.digits


def _word(rng, level, alphabet=None) -> str:
    if alphabet is None:
        alphabet = _LOWER if level <= 3 else _ALNUM
    return "".join(rng.choice(alphabet) for _ in range(_LENGTH[level]))


def _copy(rng, level):
    s = _word(rng, level)
    return f"Copy the string: {s}", s, {"s": s}


def _reverse(rng, level):
    s = _word(rng, level)
    return f"Reverse the string: {s}", s[::-1], {"s": s}


def _rotate(rng, level):
    s = _word(rng, level)
    k = rng.randint(1, len(s) - 1)
    return f"Rotate the string {s} left by {k}.", s[k:] + s[:k], {"s": s, "k": k}


def _upper(rng, level):
    s = _word(rng, level, _LOWER if level <= 3 else _LOWER + string.digits)
    return f"Uppercase the string: {s}", s.upper(), {"s": s}


def _lower(rng, level):
    s = _word(rng, level, string.ascii_uppercase if level <= 2 else _MIXED)
    return f"Lowercase the string: {s}", s.lower(), {"s": s}


def _swapcase(rng, level):
    s = _word(rng, level, _MIXED)
    return f"Swap the case of each letter: {s}", s.swapcase(), {"s": s}


def _dedupe(rng, level):
    # A small alphabet guarantees repeats, so the task is not a copy in disguise.
    pool = _LOWER[: 2 + level]
    s = "".join(rng.choice(pool) for _ in range(_LENGTH[level] + 1))
    out = "".join(dict.fromkeys(s))
    return f"Remove repeated letters, keeping first occurrences: {s}", out, {"s": s}


def _count(rng, level):
    pool = _LOWER[: 2 + level]
    s = "".join(rng.choice(pool) for _ in range(_LENGTH[level]))
    c = rng.choice(pool)
    return f"How many times does {c} occur in {s}?", str(s.count(c)), {"s": s, "c": c}


def _sort(rng, level):
    s = _word(rng, level, _LOWER)
    return f"Sort the letters of {s} alphabetically.", "".join(sorted(s)), {"s": s}


def domains():
    out = []
    for op, fn, kind in [
        ("copy", _copy, STRING),
        ("reverse", _reverse, STRING),
        ("rotate", _rotate, STRING),
        ("upper", _upper, STRING),
        ("lower", _lower, STRING),
        ("swapcase", _swapcase, STRING),
        ("dedupe", _dedupe, STRING),
        ("count", _count, INT),
        ("sort", _sort, STRING),
    ]:
        out.extend(ladder("strings", op, fn, kind))
    return out
