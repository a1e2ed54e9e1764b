"""Code tasks with given test cases: formats, comparison, the harness in the real sandbox."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain.tasks import code_tests
from posttrain.tasks.code_tests import (
    TestSuite,
    outputs_match,
    parse_tests,
    prepare,
    read_report,
    score,
)
from posttrain.tasks.families.code import MAX_CODE_CHARS

try:
    from posttrain.sandbox import Sandbox
except ImportError:  # the sandbox package has not landed in this checkout
    Sandbox = None

needs_sandbox = pytest.mark.skipif(Sandbox is None, reason="posttrain.sandbox not available")
MARKER = "@@" + "5e1f" * 6

# Sum of the numbers on the second line. Outputs appear nowhere in the inputs, so finding
# one in a request would mean it leaked into the sandbox.
SUM = parse_tests({
    "inputs": ["3\n1000001 2000002 3000003\n", "2\n-5 123456789\n", "2\n40000000 2424242\n"],
    "outputs": ["6000006\n", "123456784", "42424242\n"],
})
MUL = parse_tests({
    "fn_name": "mul",
    "inputs": [[1234, 5678], [-3, 1111111], [4321, 2]],
    "outputs": [[7006652], -3333333, [8642]],  # APPS wraps some outputs in a list
})
EVEN = parse_tests({"fn_name": "is_even", "inputs": [[2], [3]], "outputs": [True, False]})
PAIR = parse_tests({"fn_name": "pair", "inputs": [[7]], "outputs": [[[7, 49]]]})


def _fence(code):
    return f"Here you go:\n```python\n{code}\n```\n"


# -- formats -----------------------------------------------------------------------------


@pytest.mark.parametrize("gold, want", [
    ({"inputs": ["1 2\n"], "outputs": ["3\n"]}, TestSuite("stdio", ("1 2\n",), ("3\n",))),
    ('{"inputs": ["1"], "outputs": ["2"]}', TestSuite("stdio", ("1",), ("2",))),
    ({"inputs": [["2", "1 2"]], "outputs": [["3", "ok"]], "fn_name": None},
     TestSuite("stdio", ("2\n1 2",), ("3\nok",))),
    ({"input": ["a\n", "b\n"], "output": ["A\n", "B\n"]},  # CodeContests
     TestSuite("stdio", ("a\n", "b\n"), ("A\n", "B\n"))),
    ('[{"input": "1\\n", "output": "2\\n", "testtype": "stdin"}, {"input": "", "output": ""}]',
     TestSuite("stdio", ("1\n", ""), ("2\n", ""))),
    ([{"type": "stdin_stdout", "input": "x", "output": "y"}], TestSuite("stdio", ("x",), ("y",))),
    ({"fn_name": "f", "inputs": [[1, [2, 3]], []], "outputs": [[4], {"k": (1, 2)}]},
     TestSuite("call", ([1, [2, 3]], []), ([4], {"k": [1, 2]}), "f")),
])
def test_parse_tests_accepts_each_form_and_round_trips(gold, want):
    suite = parse_tests(gold)
    assert suite == want
    assert parse_tests(suite.to_json()) == suite
    assert json.loads(suite.to_json()) == json.loads(parse_tests(suite.to_json()).to_json())


_MALFORMED = [
    ("not json", "not valid JSON"),
    ("[" * 100_000, "not valid JSON"),
    ('{"fn_name": "f", "inputs": [[NaN]], "outputs": [1]}', "not valid JSON"),
    (5, "expected an object"),
    ([], "no tests"),
    ({"inputs": [], "outputs": []}, "no tests"),
    ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
    ({"inputs": "1", "outputs": "2"}, "must be lists"),
    ({"inputs": ["1"], "outputs": ["2"], "fn": "f"}, "expected keys"),
    ({"inputs": ["1"]}, "expected keys"),
    ({"inputs": [1], "outputs": ["2"]}, "input of test 0 must be a string"),
    ({"inputs": ["1", "2"], "outputs": ["2", ["a", 3]]}, "output of test 1 must be a string"),
    ({"inputs": [[1]], "outputs": [2], "fn_name": "1f"}, "Python identifier"),
    ({"inputs": [[1]], "outputs": [2], "fn_name": "class"}, "Python identifier"),
    ({"inputs": [[1]], "outputs": [2], "fn_name": 3}, "Python identifier"),
    ({"inputs": [1], "outputs": [2], "fn_name": "f"}, "list of positional arguments"),
    ({"inputs": [[math.nan]], "outputs": [2], "fn_name": "f"}, "not a JSON value"),
    ({"inputs": [[1]], "outputs": [{1, 2}], "fn_name": "f"}, "not a JSON value"),
    ([{"input": "1", "output": "2", "testtype": "functional"}], '{"fn_name"'),
    ([{"type": "function_call", "input": "1", "output": "2"}], '{"fn_name"'),
    ([{"input": "1", "output": "2", "testtype": "weird"}], "unknown testtype"),
    ([{"input": "1"}], "test 0 must be an object with input and output"),
    (["1"], "test 0 must be an object with input and output"),
    ({"inputs": ["1"] * (code_tests.MAX_TESTS + 1), "outputs": ["2"] * (code_tests.MAX_TESTS + 1)},
     "more than MAX_TESTS"),
]


@pytest.mark.parametrize("gold, message", _MALFORMED, ids=range(len(_MALFORMED)))
def test_malformed_tests_raise_one_line_naming_where(gold, message):
    with pytest.raises(ValueError) as info:
        parse_tests(gold, where="row 7 answer")
    text = str(info.value)
    assert text.startswith("row 7 answer: ") and "\n" not in text
    assert message in text


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@given(st.lists(st.tuples(st.text(), st.text()), min_size=1, max_size=5))
def test_stdio_suites_round_trip(pairs):
    suite = parse_tests({"inputs": [a for a, _ in pairs], "outputs": [b for _, b in pairs]})
    assert parse_tests(suite.to_json()) == suite


@given(st.lists(st.tuples(st.lists(_JSON, max_size=3), _JSON), min_size=1, max_size=4))
def test_call_suites_round_trip(pairs):
    gold = {"fn_name": "f", "inputs": [a for a, _ in pairs], "outputs": [b for _, b in pairs]}
    suite = parse_tests(gold)
    assert parse_tests(suite.to_json()) == suite
    assert json.dumps(list(suite.outputs)) == json.dumps([b for _, b in pairs])


# -- comparison --------------------------------------------------------------------------


@pytest.mark.parametrize("got, expected, match", [
    ("3\n", "3", True),
    ("1 2  \n\n\n", "\n1 2\n", True),  # trailing spaces and blank lines
    ("1\n2", "1 2", True),  # token-wise
    ("0.3333333", "0.333333333", True),
    ("1e-9", "0.0", True),  # absolute tolerance
    ("-2.5000004", "-2.5", True),
    ("1.1", "1.0", False),
    ("1 2 3", "1 2", False),  # an extra token
    ("1", "1 2", False),
    ("1000000008", "1000000007", False),  # integers compare exactly
    ("5.0", "5", False),
    ("nan", "nan", True),
    ("nan", "1.5", False),
    ("1e999", "1e999", True),
    ("1e998", "1e999", False),  # both infinite as floats
    ("1_0.0", "10.0", False),
    ("YES", "yes", False),
])
def test_outputs_match(got, expected, match):
    assert outputs_match(got, expected) is match


@given(st.lists(st.text("abc019.-", min_size=1), max_size=6),
       st.lists(st.sampled_from([" ", "\n", "\t", "  \n"]), min_size=6, max_size=6))
def test_outputs_match_ignores_layout_but_not_tokens(tokens, seps):
    laid_out = "".join(t + s for t, s in zip(tokens, seps))
    assert outputs_match(laid_out, " ".join(tokens))
    assert not outputs_match(laid_out + " extra", " ".join(tokens))


def test_read_report_ignores_foreign_duplicate_and_out_of_range_lines():
    m = MARKER
    out = "\n".join([
        "noise", f'{m} 0 {{"out": "a"}}', f'{m} 0 {{"out": "b"}}', '@@other 1 {"out": 1}',
        f"{m} 1 not json", f"{m} 1 [1]", f'{m} \u0661 {{"out": "c"}}', f'{m} 9 {{"out": 0}}',
        f' {m} 2 {{"out": "d"}}', f'{m} 2 {{"err": "timeout"}}',
    ])
    assert read_report(out, m, 3) == (True, {0: {"out": "a"}, 2: {"err": "timeout"}})
    assert read_report(f'{m} load {{"err": "SyntaxError"}}', m, 3) == (False, {})


def test_score_counts_results_printed_before_a_whole_run_timeout():
    stdout = f'{MARKER} 0 {{"out": "6000006"}}\n{MARKER} 1 {{"out": "123456784"}}\n'
    result = SimpleNamespace(status="timeout", stdout=stdout, detail="deadline")
    partial = score(SUM, result, MARKER, partial=True)
    assert partial.value == pytest.approx(2 / 3) and partial.verdict == "timeout (2/3 passed)"
    strict = score(SUM, result, MARKER, partial=False)
    assert strict.value == 0.0 and strict.components["tests_passed"] == pytest.approx(2 / 3)


def test_sandbox_failure_scores_zero():
    result = SimpleNamespace(status="sandbox_error", stdout="", detail="no namespaces")
    r = score(SUM, result, MARKER, partial=True)
    assert r.value == 0.0 and r.verdict == "sandbox_error: no namespaces"
    assert r.components["format"] == r.components["parses"] == 1.0


# -- prepare -----------------------------------------------------------------------------


@pytest.mark.parametrize("completion, verdict", [
    ("no fence here", "no_code"),
    ("```python\ndef f(x) return x\n```", "syntax_error"),
    (_fence("x = 1\n" * MAX_CODE_CHARS), "code_too_long"),
])
def test_no_code_or_bad_syntax_never_reaches_the_sandbox(completion, verdict):
    final, request = prepare(completion, SUM, MARKER)
    assert request is None
    assert final.value == 0.0 and final.verdict == verdict
    assert final.components["parses"] == final.components["tests_passed"] == 0.0


@pytest.mark.parametrize("suite", [SUM, MUL, EVEN, PAIR], ids=["stdio", "mul", "even", "pair"])
def test_expected_outputs_never_enter_the_sandbox(suite):
    _, request = prepare(_fence("print(1)"), suite, MARKER)
    shipped = [request.code, *request.files.values()]
    for expected in suite.outputs:
        forms = {expected.strip()} if suite.kind == "stdio" else {json.dumps(expected)}
        if isinstance(expected, list) and len(expected) == 1:
            forms.add(json.dumps(expected[0]))
        for form in forms - {"true", "false"}:
            assert not any(form in text for text in shipped), form
    if suite.kind == "stdio":
        assert [request.files[f"tests/{i}.in"] for i in range(3)] == list(suite.inputs)


def test_run_deadline_grows_with_the_tests_and_is_capped():
    _, request = prepare(_fence("print(1)"), SUM, MARKER, per_test_s=1.5)
    assert request.timeout_s == pytest.approx(3 * 1.5 + 2)
    many = parse_tests({"inputs": ["1"] * 200, "outputs": ["1"] * 200})
    assert prepare(_fence("print(1)"), many, MARKER)[1].timeout_s == code_tests.MAX_RUN_S


@pytest.mark.parametrize("marker", ["", "@@a b", "@@a\n"])
def test_marker_must_be_one_word(marker):
    with pytest.raises(ValueError, match="marker"):
        prepare(_fence("print(1)"), SUM, marker)


# -- the harness in the sandbox ----------------------------------------------------------

_READ = "input()\nxs = list(map(int, input().split()))\n"
_SUM_FORGER = r'''
import json, os
marker = json.load(open("tests.json"))["marker"]
lines = "".join("\n%s %d %s\n" % (marker, i, json.dumps({"out": "0"})) for i in range(3))
parent = "/proc/%d/fd" % os.getppid()
for fd in os.listdir(parent):  # every stream the harness could report on
    try:
        with open(os.path.join(parent, fd), "w") as f:
            f.write(lines)
    except OSError:
        pass
print(0)
'''

# id: (suite, code, partial, value, verdict, tests_passed)
CASES = {
    "input": (SUM, "input()\nprint(sum(map(int, input().split())))", False, 1.0, "correct", 1),
    "stdin_read": (SUM, "import sys\nprint(sum(map(int, sys.stdin.read().split()[1:])))",
                   False, 1.0, "correct", 1),
    "stdin_buffer": (
        SUM,
        "import sys\nsys.stdin.buffer.readline()\nxs = sys.stdin.buffer.readline().split()\n"
        "sys.stdout.buffer.write(b'%d\\n' % sum(map(int, xs)))",
        False, 1.0, "correct", 1),
    "stdout_write": (
        SUM,
        "import sys\nsys.stdin.readline()\n"
        "sys.stdout.write(str(sum(map(int, sys.stdin.readline().split()))))",
        False, 1.0, "correct", 1),
    "open_fd0": (SUM, "print(sum(map(int, open(0).read().split()[1:])))", False, 1.0,
                 "correct", 1),
    "fast_io": (
        SUM,
        "import io, os\ninput = io.BytesIO(os.read(0, os.fstat(0).st_size)).readline\n"
        "input()\nos.write(1, b'%d\\n' % sum(map(int, input().split())))",
        False, 1.0, "correct", 1),
    "main_guard_and_exit": (
        SUM,
        "import sys\ndef main():\n    " + _READ.replace("\n", "\n    ")
        + "print(sum(xs))\n    sys.exit(0)\n    print(1)\nif __name__ == '__main__':\n    main()",
        False, 1.0, "correct", 1),
    "thread": (
        SUM,
        "import sys, threading\ndef main():\n    " + _READ.replace("\n", "\n    ")
        + "print(sum(xs))\nsys.setrecursionlimit(10**5)\nthreading.Thread(target=main).start()",
        False, 1.0, "correct", 1),
    "closes_stdout": (SUM, _READ + "import sys\nprint(sum(xs))\nsys.stdout.close()", False, 1.0,
                      "correct", 1),
    "closes_fd1": (SUM, _READ + "import os\nprint(sum(xs), flush=True)\nos.close(1)", False,
                   1.0, "correct", 1),
    "stderr_noise": (SUM, _READ + "import sys\nprint('debug' * 99, file=sys.stderr)\n"
                     "print(sum(xs))", False, 1.0, "correct", 1),
    "float_and_whitespace": (
        parse_tests({"inputs": ["3", "7"], "outputs": ["0.333333333\n", "0.142857143"]}),
        "n = int(input())\nprint(f'  {1 / n:.7f}  \\n\\n')", False, 1.0, "correct", 1),
    "extra_token": (parse_tests({"inputs": ["3"], "outputs": ["3"]}), "print(3, 0)", False, 0.0,
                    "wrong (0/1 passed)", 0),
    "wrong": (SUM, "print(0)", False, 0.0, "wrong (0/3 passed)", 0),
    "partial": (SUM, _READ + "print(sum(xs) if xs[0] > 0 else 0)", True, 2 / 3,
                "wrong (2/3 passed)", 2 / 3),
    "partial_off": (SUM, _READ + "print(sum(xs) if xs[0] > 0 else 0)", False, 0.0,
                    "wrong (2/3 passed)", 2 / 3),
    "stdio_load_error": (SUM, "return 5", True, 0.0, "load_error", 0),
    # Hostile: the middle test misbehaves; the last one must still pass.
    "infinite_loop": (SUM, _READ + "while xs[0] < 0:\n    pass\nprint(sum(xs))", True, 2 / 3,
                      "timeout (2/3 passed)", 2 / 3),
    "swallows_timer": (
        SUM,
        _READ + "while xs[0] < 0:\n    try:\n        while True:\n            pass\n"
        "    except BaseException:\n        pass\nprint(sum(xs))",
        True, 2 / 3, "timeout (2/3 passed)", 2 / 3),
    "c_loop": (SUM, _READ + "if xs[0] < 0:\n    sum(range(10**15))\nprint(sum(xs))", True, 2 / 3,
               "timeout (2/3 passed)", 2 / 3),
    "segfault": (SUM, _READ + "import os, signal\nif xs[0] < 0:\n"
                 "    os.kill(os.getpid(), signal.SIGSEGV)\nprint(sum(xs))", True, 2 / 3,
                 "wrong (2/3 passed)", 2 / 3),
    "forger": (SUM, _SUM_FORGER, True, 0.0, "wrong (0/3 passed)", 0),
    # Call-based.
    "top_level": (MUL, "def mul(a, b):\n    return a * b", False, 1.0, "correct", 1),
    "solution_class": (MUL, "class Solution:\n    def mul(self, a, b):\n        return a * b",
                       False, 1.0, "correct", 1),
    "load_prints": (MUL, "def mul(a, b):\n    return a * b\nprint(mul(2, 3))\nprint(input)",
                    False, 1.0, "correct", 1),
    "wrapped_tuple": (PAIR, "def pair(x):\n    return (x, x * x)", False, 1.0, "correct", 1),
    "bool": (EVEN, "def is_even(n):\n    return n % 2 == 0", False, 1.0, "correct", 1),
    "bool_is_not_int": (EVEN, "def is_even(n):\n    return int(n % 2 == 0)", True, 0.0,
                        "wrong (0/2 passed)", 0),
    "not_json": (MUL, "def mul(a, b):\n    return {a * b}", True, 0.0, "wrong (0/3 passed)", 0),
    "missing_function": (MUL, "def multiply(a, b):\n    return a * b", True, 0.0, "load_error",
                         0),
    "call_loop": (MUL, "def mul(a, b):\n    while a < 0:\n        pass\n    return a * b", True,
                  2 / 3, "timeout (2/3 passed)", 2 / 3),
    "call_exit": (MUL, "import sys\ndef mul(a, b):\n    if a < 0:\n        sys.exit(0)\n"
                  "    return a * b", True, 2 / 3, "wrong (2/3 passed)", 2 / 3),
}


@pytest.fixture(scope="module")
def graded(module_sandbox):
    """{case id: (reward, result)}, all cases run in one batch."""
    requests = {}
    for case, (suite, code, partial, *_) in CASES.items():
        final, request = prepare(_fence(code), suite, MARKER, per_test_s=0.5)
        assert final is None, (case, final)
        requests[case] = request
    results = module_sandbox.run_many(list(requests.values()))
    return {
        case: (score(CASES[case][0], result, MARKER, partial=CASES[case][2]), result)
        for case, result in zip(requests, results)
    }


@needs_sandbox
@pytest.mark.parametrize("case", list(CASES))
def test_harness_verdicts(graded, case):
    _, _, _, value, verdict, passed = CASES[case]
    reward, result = graded[case]
    assert reward.verdict == verdict, (reward, result.stderr[-500:])
    assert reward.value == pytest.approx(value)
    assert reward.components["tests_passed"] == pytest.approx(passed)
    assert reward.components["exact"] == float(passed == 1)
    assert reward.components["runs"] == float(verdict != "load_error")


@needs_sandbox
def test_forged_report_lines_arrive_first_yet_earn_only_their_guesses(graded):
    reward, result = graded["forger"]
    # The forger reached the report stream before the harness with the real marker for
    # every test; having no expected output to copy, it could only claim its guess "0".
    first = [line for line in result.stdout.splitlines() if line.startswith(MARKER)][:3]
    assert first == [f'{MARKER} {i} {{"out": "0"}}' for i in range(3)]
    assert reward.value == 0.0
