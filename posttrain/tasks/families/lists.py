"""List operations on integer lists: sort, reverse, max, min, sum, unique, k-th, count.

Level sets the length (3, 4, 6, 8, 12) and the value range (0..9 up to -999..999).
Lists are written ``[3, 1, 2]``; list answers may drop the brackets.
"""

from __future__ import annotations

from posttrain.tasks.procedural import INT, INT_LIST, ladder

_SHAPE = {1: (3, 0, 9), 2: (4, 0, 20), 3: (6, 0, 99), 4: (8, -99, 99), 5: (12, -999, 999)}


def _ints(rng, level) -> list[int]:
    n, lo, hi = _SHAPE[level]
    return [rng.randint(lo, hi) for _ in range(n)]


def _show(xs) -> str:
    return "[" + ", ".join(map(str, xs)) + "]"


def _sort(rng, level):
    xs = _ints(rng, level)
    return f"Sort in ascending order: {_show(xs)}", _show(sorted(xs)), {"xs": xs}


def _reverse(rng, level):
    xs = _ints(rng, level)
    return f"Reverse the list: {_show(xs)}", _show(xs[::-1]), {"xs": xs}


def _max(rng, level):
    xs = _ints(rng, level)
    return f"What is the largest number in {_show(xs)}?", str(max(xs)), {"xs": xs}


def _min(rng, level):
    xs = _ints(rng, level)
    return f"What is the smallest number in {_show(xs)}?", str(min(xs)), {"xs": xs}


def _sum(rng, level):
    xs = _ints(rng, level)
    return f"What is the sum of {_show(xs)}?", str(sum(xs)), {"xs": xs}


def _unique(rng, level):
    n, lo, hi = _SHAPE[level]
    # Draw from a narrow range so that duplicates are common.
    xs = [rng.randint(lo, min(hi, lo + n)) for _ in range(n + 1)]
    out = list(dict.fromkeys(xs))
    return f"Remove duplicates, keeping first occurrences: {_show(xs)}", _show(out), {"xs": xs}


def _kth(rng, level):
    xs = _ints(rng, level)
    k = rng.randint(1, len(xs))
    q = f"What is the {_ordinal(k)} smallest number in {_show(xs)}?"
    return q, str(sorted(xs)[k - 1]), {"xs": xs, "k": k}


def _count_gt(rng, level):
    xs = _ints(rng, level)
    t = rng.choice(xs)
    q = f"How many numbers in {_show(xs)} are greater than {t}?"
    return q, str(sum(x > t for x in xs)), {"xs": xs, "t": t}


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def domains():
    out = []
    for op, fn, kind in [
        ("sort", _sort, INT_LIST),
        ("reverse", _reverse, INT_LIST),
        ("max", _max, INT),
        ("min", _min, INT),
        ("sum", _sum, INT),
        ("unique", _unique, INT_LIST),
        ("kth", _kth, INT),
        ("count_gt", _count_gt, INT),
    ]:
        out.extend(ladder("lists", op, fn, kind))
    return out
