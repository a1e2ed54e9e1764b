"""Each family's answers against an independent oracle computed from the prompt text."""

import ast
import json
import re

import numpy as np
import pytest

from posttrain.tasks import registry, train_seed
from posttrain.tasks.families.arithmetic import random_expression

SEEDS = [train_seed(i) for i in range(25)]


def _cases(pattern):
    for name in registry.names(pattern=pattern):
        domain = registry.get(name)
        for seed in SEEDS:
            task = domain.sample(seed)
            yield name, task.prompt.splitlines()[0], task.answer


def _between(text, start, end):
    return text[text.index(start) + len(start) : text.rindex(end)]


def test_arithmetic_matches_python_eval():
    for name, q, answer in _cases("arithmetic/*"):
        expr = _between(q, "What is ", "?")
        if "mod" in expr:
            a, b = map(int, expr.split(" mod "))
            expected = a % b
        elif "/" in expr:
            a, b = map(int, expr.split("/"))
            assert a % b == 0, (name, q)  # division tasks are exact
            expected = a // b
        else:
            expected = eval(expr, {"__builtins__": {}})  # our own generated text, test oracle only
        assert int(answer) == expected, (name, q)


def test_arithmetic_digit_counts_follow_level():
    for level in range(1, 6):
        for _, q, _ in _cases(f"arithmetic/add_d{level}"):
            a, b = _between(q, "What is ", "?").split("+")
            assert len(a) == len(b) == level


@pytest.mark.parametrize("n_ops", [0, 1, 3, 6])
@pytest.mark.parametrize("parens", [False, True])
def test_random_expression_value_matches_eval(n_ops, parens):
    import random

    rng = random.Random(n_ops * 2 + parens)
    for _ in range(200):
        text, value = random_expression(rng, n_ops, 30, parens)
        assert eval(text, {"__builtins__": {}}) == value, text
        assert text.count("+") + text.count("-") + text.count("*") == n_ops


STRING_OPS = {
    "copy": (r"Copy the string: (\S+)", lambda m: m[1]),
    "reverse": (r"Reverse the string: (\S+)", lambda m: m[1][::-1]),
    "rotate": (
        r"Rotate the string (\S+) left by (\d+)\.",
        lambda m: m[1][int(m[2]) :] + m[1][: int(m[2])],
    ),
    "upper": (r"Uppercase the string: (\S+)", lambda m: m[1].upper()),
    "lower": (r"Lowercase the string: (\S+)", lambda m: m[1].lower()),
    "swapcase": (
        r"Swap the case of each letter: (\S+)",
        lambda m: "".join(c.lower() if c.isupper() else c.upper() for c in m[1]),
    ),
    "dedupe": (
        r"keeping first occurrences: (\S+)",
        lambda m: "".join(c for i, c in enumerate(m[1]) if c not in m[1][:i]),
    ),
    "count": (
        r"How many times does (\S) occur in (\S+)\?",
        lambda m: str(len(re.findall(re.escape(m[1]), m[2]))),
    ),
    "sort": (r"Sort the letters of (\S+) alphabetically\.", lambda m: "".join(np.sort(list(m[1])))),
}


@pytest.mark.parametrize("op", sorted(STRING_OPS))
def test_strings(op):
    pattern, oracle = STRING_OPS[op]
    for name, q, answer in _cases(f"strings/{op}_l*"):
        m = re.fullmatch(pattern, q) or re.search(pattern, q)
        assert m, (name, q)
        assert answer == oracle(m), (name, q)


def _list_in(q):
    return ast.literal_eval(q[q.index("[") : q.index("]") + 1])


LIST_OPS = {
    "sort": lambda xs, q: np.sort(xs).tolist(),
    "reverse": lambda xs, q: xs[::-1],
    "max": lambda xs, q: int(np.max(xs)),
    "min": lambda xs, q: int(np.min(xs)),
    "sum": lambda xs, q: int(np.sum(xs)),
    "unique": lambda xs, q: [x for i, x in enumerate(xs) if x not in xs[:i]],
    "kth": lambda xs, q: int(np.sort(xs)[int(re.search(r"the (\d+)\w\w smallest", q)[1]) - 1]),
    "count_gt": lambda xs, q: int((np.array(xs) > int(_between(q, "greater than ", "?"))).sum()),
}


@pytest.mark.parametrize("op", sorted(LIST_OPS))
def test_lists(op):
    for name, q, answer in _cases(f"lists/{op}_l*"):
        expected = LIST_OPS[op](_list_in(q), q)
        got = ast.literal_eval(answer)
        assert got == expected, (name, q, answer)


def test_logic():
    for _name, q, answer in _cases("logic/boolexpr_*"):
        assert answer == str(eval(q.split("? ", 1)[1], {"__builtins__": {}})), q
    for _name, q, answer in _cases("logic/parity_*"):
        bits = re.search(r"in ([01]+) ", q)[1]
        assert answer == ("odd" if sum(map(int, bits)) % 2 else "even")
    for _name, q, answer in _cases("logic/majority_*"):
        bits = re.search(r"in ([01]+),", q)[1]
        assert answer == str(int(np.mean([int(b) for b in bits]) > 0.5))


def _reduce_balanced(s):
    while True:
        t = s.replace("()", "").replace("[]", "").replace("{}", "")
        if t == s:
            return s == ""
        s = t


def test_structure():
    answers = set()
    for _name, q, answer in _cases("structure/brackets_*"):
        s = q.rsplit(" ", 1)[1]
        assert answer == ("yes" if _reduce_balanced(s) else "no"), q
        answers.add(answer)
    assert answers == {"yes", "no"}
    for _name, q, answer in _cases("structure/depth_*"):
        s = _between(q, "depth of ", "?")
        depths = np.cumsum([1 if c in "([{" else -1 for c in s])
        assert _reduce_balanced(s) and int(answer) == depths.max()
    for _name, q, answer in _cases("structure/json_*"):
        obj = json.loads(_between(q, "In ", ", what"))
        for key in _between(q, "value of ", "?").split("."):
            obj = obj[key]
        assert str(obj) == answer


def test_bases():
    for _, q, a in _cases("bases/dec2bin_*"):
        assert a == bin(int(re.search(r"Write (\d+)", q)[1]))[2:]
    for _, q, a in _cases("bases/bin2dec_*"):
        assert int(a) == int(re.search(r"binary ([01]+)", q)[1], 2)
    for _, q, a in _cases("bases/dec2hex_*"):
        assert a == format(int(re.search(r"Write (\d+)", q)[1]), "x")
    for _, q, a in _cases("bases/hex2dec_*"):
        assert int(a) == int(re.search(r"hexadecimal ([0-9a-f]+)", q)[1], 16)
    for _, q, a in _cases("bases/dec2base_*"):
        m = re.search(r"Write (\d+) in base (\d)", q)
        assert a == np.base_repr(int(m[1]), int(m[2]))


def _terms(q):
    return [int(x) for x in _between(q, "next: ", ", ?").split(", ")]


def test_sequences():
    for _, q, a in _cases("sequences/arith_*"):
        xs = _terms(q)
        assert int(a) == xs[-1] + (xs[1] - xs[0]) and len(set(np.diff(xs))) == 1
    for _, q, a in _cases("sequences/geom_*"):
        xs = _terms(q)
        assert int(a) == xs[-1] * (xs[1] // xs[0])
    for _, q, a in _cases("sequences/fib_*"):
        xs = _terms(q)
        assert all(xs[i] == xs[i - 1] + xs[i - 2] for i in range(2, len(xs)))
        assert int(a) == xs[-1] + xs[-2]
    for _, q, a in _cases("sequences/quad_*"):
        xs = _terms(q)
        coeffs = np.polyfit(np.arange(1, len(xs) + 1), xs, 2)
        assert int(a) == round(np.polyval(coeffs, len(xs) + 1))
    for _, q, a in _cases("sequences/periodic_*"):
        xs = _terms(q)
        period = next(
            p for p in range(1, len(xs)) if all(xs[i] == xs[i - p] for i in range(p, len(xs)))
        )
        assert int(a) == xs[len(xs) - period]


def _sympy(side):
    from sympy.parsing import sympy_parser

    transformations = sympy_parser.standard_transformations + (
        sympy_parser.implicit_multiplication_application,
    )
    return sympy_parser.parse_expr(side, transformations=transformations)


def test_equations_against_sympy():
    sympy = pytest.importorskip("sympy")
    x, y = sympy.symbols("x y")
    for _, q, a in _cases("equations/linear_*"):
        lhs, rhs = q.split(": ", 1)[1].split(" = ")
        assert sympy.solve(sympy.Eq(_sympy(lhs), _sympy(rhs)), x) == [int(a)], q
    for _, q, a in _cases("equations/system_*"):
        eqs = [e.split(" = ") for e in _between(q, "Solve: ", ". Answer").split("; ")]
        sol = sympy.solve([sympy.Eq(_sympy(lhs), _sympy(rhs)) for lhs, rhs in eqs], [x, y])
        assert [sol[x], sol[y]] == [int(v) for v in a.split(", ")], q
