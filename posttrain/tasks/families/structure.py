"""Structure: bracket balance, nesting depth, and field extraction from JSON.

Level sets the bracket-string length and bracket kinds, or the JSON nesting depth.
"""

from __future__ import annotations

import json

from posttrain.tasks.procedural import INT, YES_NO, ladder

_LENGTH = {1: 4, 2: 6, 3: 8, 4: 12, 5: 16}
_PAIRS = {1: "()", 2: "()[]", 3: "()[]", 4: "()[]{}", 5: "()[]{}"}
_CLOSER = {"(": ")", "[": "]", "{": "}"}


def balanced_brackets(rng, n_pairs: int, pairs: str) -> str:
    """A uniformly shaped random balanced string with ``n_pairs`` bracket pairs."""
    out, stack = [], []
    opens_left = n_pairs
    while opens_left or stack:
        if opens_left and (not stack or rng.random() < 0.5):
            b = rng.choice(pairs[0::2])
            stack.append(b)
            out.append(b)
            opens_left -= 1
        else:
            out.append(_CLOSER[stack.pop()])
    return "".join(out)


def is_balanced(s: str) -> bool:
    stack = []
    for ch in s:
        if ch in _CLOSER:
            stack.append(_CLOSER[ch])
        elif not stack or stack.pop() != ch:
            return False
    return not stack


def _brackets(rng, level):
    pairs = _PAIRS[level]
    s = list(balanced_brackets(rng, _LENGTH[level] // 2, pairs))
    if rng.random() < 0.5:
        # Corrupt one position; the check below decides the answer, not the intent.
        i = rng.randrange(len(s))
        s[i] = rng.choice([c for c in pairs if c != s[i]])
    s = "".join(s)
    answer = "yes" if is_balanced(s) else "no"
    return f"Are the brackets balanced (yes or no)? {s}", answer, {"s": s}


def _depth(rng, level):
    s = balanced_brackets(rng, level + 2, _PAIRS[level])
    depth = best = 0
    for ch in s:
        depth += 1 if ch in _CLOSER else -1
        best = max(best, depth)
    return f"What is the maximum nesting depth of {s}?", str(best), {"s": s}


_KEYS = ("a", "b", "c", "d", "e", "id", "x", "y", "name", "size", "cost", "age")


def _json(rng, level):
    # One branch nests `level - 1` times; siblings are leaves, so size grows linearly.
    path = []
    obj: dict = {}
    node = obj
    for depth in range(level):
        keys = rng.sample(_KEYS, 2 if level <= 2 else 3)
        for k in keys:
            node[k] = rng.randint(0, 99 if level <= 2 else 999)
        key = rng.choice(keys)
        path.append(key)
        if depth < level - 1:
            node[key] = {}
            node = node[key]
    value = node[path[-1]]
    dotted = ".".join(path)
    text = json.dumps(obj)
    return f"In {text}, what is the value of {dotted}?", str(value), {"path": dotted}


def domains():
    return [
        *ladder("structure", "brackets", _brackets, YES_NO),
        *ladder("structure", "depth", _depth, INT),
        *ladder("structure", "json", _json, INT),
    ]
