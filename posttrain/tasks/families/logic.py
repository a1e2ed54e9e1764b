"""Logic: boolean expressions, parity and majority of bit strings.

Level sets the expression depth (1..5) or the bit-string length.
"""

from __future__ import annotations

from posttrain.tasks.procedural import BOOL, INT, ChoiceAnswer, ladder

_EVEN_ODD = ChoiceAnswer("even", "odd")


def random_bool_expression(rng, depth: int) -> tuple[str, bool]:
    """A fully parenthesised and/or/not expression over True/False, and its value."""
    if depth == 0:
        v = rng.random() < 0.5
        return str(v), v
    kind = rng.random()
    if kind < 0.2:
        text, v = random_bool_expression(rng, depth - 1)
        return f"not {text}" if depth == 1 else f"not ({text})", not v
    ltext, lv = random_bool_expression(rng, rng.randint(0, depth - 1))
    rtext, rv = random_bool_expression(rng, depth - 1)
    if rng.random() < 0.5:
        ltext, lv, rtext, rv = rtext, rv, ltext, lv
    op = "and" if kind < 0.6 else "or"
    value = (lv and rv) if op == "and" else (lv or rv)
    return f"({ltext} {op} {rtext})", value


def _boolexpr(rng, level):
    text, value = random_bool_expression(rng, level)
    return f"Is this True or False? {text}", str(value), {"expression": text}


_BITS = {1: 3, 2: 5, 3: 8, 4: 12, 5: 16}


def _parity(rng, level):
    bits = "".join(rng.choice("01") for _ in range(_BITS[level]))
    answer = "odd" if bits.count("1") % 2 else "even"
    return f"Is the number of 1s in {bits} even or odd?", answer, {"bits": bits}


_ODD_BITS = {1: 3, 2: 5, 3: 7, 4: 11, 5: 15}


def _majority(rng, level):
    bits = "".join(rng.choice("01") for _ in range(_ODD_BITS[level]))  # odd length: no ties
    answer = "1" if bits.count("1") * 2 > len(bits) else "0"
    return f"Which digit occurs more often in {bits}, 0 or 1?", answer, {"bits": bits}


def domains():
    return [
        *ladder("logic", "boolexpr", _boolexpr, BOOL),
        *ladder("logic", "parity", _parity, _EVEN_ODD),
        *ladder("logic", "majority", _majority, INT),
    ]
