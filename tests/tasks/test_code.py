"""Code domains: hidden tests in the sandbox, partial credit, forging and hostile code."""

import pytest

from posttrain.tasks import execution, registry, train_seed
from posttrain.tasks.families.code import extract_code, harness, parse_results

try:
    from posttrain.sandbox import Sandbox
except ImportError:  # the sandbox package has not landed in this checkout
    Sandbox = None

needs_sandbox = pytest.mark.skipif(Sandbox is None, reason="posttrain.sandbox not available")
AFFINE = registry.get("code/affine_l1")


def _fence(code):
    return f"Here you go:\n```python\n{code}\n```\n"


def test_extract_code_takes_the_last_block():
    assert extract_code("```python\na = 1\n``` and ```python\nb = 2\n```") == "\nb = 2\n"
    assert extract_code("```python\nc = 3") == "\nc = 3"
    assert extract_code("no code") is None


def test_parse_results_ignores_foreign_lines():
    out = 'noise\n@@m 0 {"ok": 1}\n@@m 0 {"ok": 2}\n@@x 1 {"ok": 5}\n@@m 1 {"err": "E"}\n@@m 9 {"ok": 0}\n'
    loaded, outputs = parse_results(out, "@@m", 2)
    assert loaded and outputs == {0: "1"}


@pytest.mark.parametrize(
    "completion, verdict", [("", "no_code"), ("```python\ndef f(x) return x\n```", "syntax_error")]
)
def test_no_code_or_bad_syntax_never_reaches_the_sandbox(completion, verdict, monkeypatch):
    monkeypatch.setattr(execution, "get_sandbox", lambda: pytest.fail("sandbox used"))
    task = AFFINE.sample(0)
    r = AFFINE.score(task, completion)
    assert r.value == 0.0 and r.verdict == verdict and r.components["parses"] == 0.0


class FakeSandbox:
    """Records requests; answers with a fixed status."""

    def __init__(self, status="sandbox_error"):
        self.status, self.requests = status, []

    def run(self, request):
        return self.run_many([request])[0]

    def run_many(self, requests):
        from types import SimpleNamespace

        self.requests.extend(requests)
        return [
            SimpleNamespace(
                status=self.status, stdout="", stderr="", detail="no namespaces", exit_code=None
            )
            for _ in requests
        ]


def test_injected_sandbox_is_used_and_its_failure_scores_zero():
    fake = FakeSandbox()
    execution.set_sandbox(fake)
    try:
        task = AFFINE.sample(1)
        r = AFFINE.score(task, AFFINE.demonstration(task))
        assert r.value == 0.0 and r.verdict.startswith("sandbox_error")
        assert len(fake.requests) == 1
        assert repr(extract_code(AFFINE.demonstration(task))) in fake.requests[0].code
        # Expected outputs stay outside the sandbox.
        tests_part = fake.requests[0].code.split("_json.loads(")[1]
        for e in task.metadata["expected"]:
            if [e] not in task.metadata["tests"]:
                assert str(e) not in tests_part
    finally:
        execution.set_sandbox(None)


def test_set_sandbox_rejects_non_sandboxes():
    with pytest.raises(TypeError, match="run"):
        execution.set_sandbox(object())


@pytest.fixture
def sandbox(module_sandbox, monkeypatch):
    # Shorter deadline so the timeout cases finish quickly; references need milliseconds.
    monkeypatch.setattr("posttrain.tasks.families.code.TIMEOUT_S", 1.5)
    return module_sandbox


@needs_sandbox
def test_partial_credit_is_the_fraction_of_hidden_tests(sandbox):
    task = AFFINE.sample(train_seed(4))
    tests, expected = task.metadata["tests"], task.metadata["expected"]
    # Right only for positive inputs: the oracle count comes from the stored expectations.
    a_b = task.answer.split("return ")[1].strip()
    code = f"def f(x):\n    return ({a_b}) if x > 0 else 0\n"
    want = sum(1 for (x,), e in zip(tests, expected) if (e if x > 0 else 0) == e) / len(tests)
    r = AFFINE.score(task, _fence(code))
    assert r.value == pytest.approx(want) and r.components["tests_passed"] == pytest.approx(want)
    assert r.components["parses"] == r.components["runs"] == 1.0


@needs_sandbox
@pytest.mark.parametrize(
    "code, verdict_start, runs",
    [
        ("def g(x):\n    return x", "load_error", 0.0),
        ("raise SystemExit(3)", "load_error", 0.0),
        ("import sys\ndef f(x):\n    sys.exit(0)", "wrong", 1.0),
        ("def f(x):\n    while True:\n        pass", "timeout", 1.0),
        ("def f(x):\n    return True", "wrong", 1.0),
    ],
)
def test_hostile_or_wrong_code_scores_zero(sandbox, code, verdict_start, runs):
    task = AFFINE.sample(train_seed(2))
    r = AFFINE.score(task, _fence(code))
    assert r.value == 0.0
    assert r.verdict.startswith(verdict_start), r.verdict
    if verdict_start != "timeout":
        assert r.components["runs"] == runs


@needs_sandbox
def test_forging_result_lines_with_the_real_marker_gains_nothing(sandbox):
    task = AFFINE.sample(train_seed(3))
    # The solution digs the marker out of the harness's constants and prints a "result"
    # for every test before the harness runs. Expected outputs never enter the sandbox,
    # so the forger can only print guesses: the score is what those guesses earn.
    code = (
        "import sys\n"
        "for _m in [c for c in sys._getframe(1).f_code.co_consts\n"
        "           if isinstance(c, str) and c.startswith('@@')]:\n"
        "    for _i in range(20):\n"
        "        print(_m, _i, '{\"ok\": 0}')\n"
        "def f(x):\n    return 0\n"
    )
    marker = AFFINE._marker(task)
    program = harness(code, "f", task.metadata["tests"], marker)
    from posttrain.sandbox import ExecRequest

    out = sandbox.run(ExecRequest(code=program)).stdout
    assert f"{marker} 0 " in out.splitlines()[0]  # the forger did find the real marker
    expected = task.metadata["expected"]
    r = AFFINE.score(task, _fence(code))
    assert r.value == pytest.approx(sum(e == 0 for e in expected) / len(expected))
    assert r.value < 1.0


@needs_sandbox
def test_bool_is_not_int(sandbox):
    task = registry.get("code/balanced_l4").sample(train_seed(1))
    code = task.answer.replace("return False", "return 0").replace(
        "return not stack", "return int(not stack)"
    )
    r = registry.get("code/balanced_l4").score(task, _fence(code))
    assert r.value == 0.0


@needs_sandbox
def test_score_many_matches_score(sandbox):
    domain = registry.get("code/running_max_l3")
    tasks = [domain.sample(train_seed(i)) for i in range(4)]
    completions = [
        domain.demonstration(tasks[0]),
        "",
        _fence("def running_max(xs):\n    return xs"),
        domain.demonstration(tasks[3]),
    ]
    batch = domain.score_many(tasks, completions)
    single = [domain.score(t, c) for t, c in zip(tasks, completions)]
    assert batch == single
    assert [r.value for r in batch][::3] == [1.0, 1.0]


@needs_sandbox
def test_slow_quadratic_blowup_fails_top_level_but_reference_passes(sandbox):
    domain = registry.get("code/lis_l5")
    task = domain.sample(train_seed(0))
    brute = (
        "import itertools\n"
        "def lis(xs):\n    best = 0\n"
        "    for r in range(len(xs) + 1):\n"
        "        for c in itertools.combinations(xs, r):\n"
        "            if all(a < b for a, b in zip(c, c[1:])):\n                best = r\n"
        "    return best\n"
    )
    r = domain.score(task, _fence(brute))
    assert r.value < 1.0
    assert domain.score(task, domain.demonstration(task)).value == 1.0


def test_harness_embeds_code_safely():
    code = 's = \'"""\'\ndef f(x):\n    return x  # {braces}'
    program = harness(code, "f", [[1]], "@@m")
    compile(program, "<harness>", "exec")
    assert repr(code) in program
