"""Base conversion between decimal and binary, hexadecimal and bases 3..9.

Level sets the size of the number. Binary and hex answers may carry a 0b/0x prefix.
"""

from __future__ import annotations

from posttrain.tasks.procedural import INT, AnswerKind, BaseIntAnswer, ladder

_MAX = {1: 7, 2: 31, 3: 255, 4: 4095, 5: 65535}
_HEX_MAX = {1: 15, 2: 255, 3: 4095, 4: 65535, 5: 2**24 - 1}
_DIGITS = "0123456789abcdef"


def to_base(n: int, base: int) -> str:
    if n == 0:
        return "0"
    out = []
    while n:
        n, r = divmod(n, base)
        out.append(_DIGITS[r])
    return "".join(reversed(out))


def _dec2bin(rng, level):
    n = rng.randint(0, _MAX[level])
    return f"Write {n} in binary.", to_base(n, 2), {"n": n}


def _bin2dec(rng, level):
    n = rng.randint(0, _MAX[level])
    return f"What is binary {to_base(n, 2)} in decimal?", str(n), {"n": n}


def _dec2hex(rng, level):
    n = rng.randint(0, _HEX_MAX[level])
    return f"Write {n} in hexadecimal.", to_base(n, 16), {"n": n}


def _hex2dec(rng, level):
    n = rng.randint(0, _HEX_MAX[level])
    return f"What is hexadecimal {to_base(n, 16)} in decimal?", str(n), {"n": n}


def _dec2base(rng, level):
    base = rng.randint(3, 9)
    n = rng.randint(0, _MAX[level] * 4)
    return f"Write {n} in base {base}.", to_base(n, base), {"n": n, "base": base}


class _DigitsAnswer(AnswerKind):
    """A digit string compared without leading zeros (the base lives in the gold string)."""

    def parse(self, text):
        t = text.strip()
        if not t or len(t) > 400 or not t.isascii() or not t.isdigit():
            return None
        return t.lstrip("0") or "0"


def domains():
    return [
        *ladder("bases", "dec2bin", _dec2bin, BaseIntAnswer(2)),
        *ladder("bases", "bin2dec", _bin2dec, INT),
        *ladder("bases", "dec2hex", _dec2hex, BaseIntAnswer(16)),
        *ladder("bases", "hex2dec", _hex2dec, INT),
        *ladder("bases", "dec2base", _dec2base, _DigitsAnswer()),
    ]
