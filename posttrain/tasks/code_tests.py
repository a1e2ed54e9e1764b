"""Code tasks whose ground truth is a set of test cases (APPS, TACO, CodeContests, ...).

Test formats accepted by ``parse_tests`` (a dict or list, or a str holding its JSON):

- ``{"inputs": [...], "outputs": [...]}`` (APPS, TACO, PRIME/veRL ``ground_truth``) or
  ``{"input": [...], "output": [...]}`` (CodeContests): standard-input tests, items
  strings; an item that is a list of strings is its lines, joined with newlines.
  With ``"fn_name"`` the tests are call-based: ``inputs[i]`` is the list of positional
  arguments of the i-th call and ``outputs[i]`` its expected value (APPS often wraps it
  in a one-element list, which is accepted either way).
- ``[{"input": str, "output": str, "testtype": "stdin"}, ...]`` (LiveCodeBench,
  DeepCoder; ``"type": "stdin_stdout"`` too): standard-input tests.

The completion's last ```python block is the solution. A fixed harness runs each test in
a forked child of its own, under a per-test time limit: a standard-input test execs the
program as ``__main__`` with the test's input as stdin (``input()``, ``sys.stdin`` and its
buffer, ``open(0)`` and fd 0 all see it) and its stdout captured; a call-based test calls
the function (top level, or a method of a top-level ``Solution`` class; the module runs
once) on its arguments. A test that runs over or crashes fails alone and the later tests
still run; ``exit()`` just ends a test. The harness prints one line per test, ``<marker>
<index> <json>``, on its own copy of the original stdout, so a solution that closes or
replaces its stdout cannot silence the report.

Security: test inputs enter the sandbox as files; expected outputs never do. Scoring
compares the reported outputs with the expected ones outside, so a solution that forges
report lines (it can read the marker, which only tells report lines from other output)
gains nothing it could not get by printing the same guesses as its answers. The marker
should still differ per task (e.g. a hash of the task): a fixed string is one a model
could learn to print.

Comparison: standard output matches when its whitespace-separated tokens equal the
expected ones, except that an expected decimal fraction (``0.5``, ``1e-9``) accepts any
number within 1e-6 (absolute or relative); integers compare exactly. Call results compare
as canonical JSON (tuples equal lists, ``True`` is not ``1``); an expected one-element
list also accepts its element.

Reward components: ``format`` and ``parses`` (a valid ```python block), ``runs`` (it
loaded and ran), ``tests_passed`` (fraction passed), ``exact`` (all passed). The value is
``tests_passed`` for partial credit, else 1 only when every test passes.
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import math
import re

from posttrain.sandbox.api import ExecRequest
from posttrain.tasks.base import Reward, zero_reward
from posttrain.tasks.families.code import _canonical, checked_code, report_lines

MAX_TESTS = 512
MAX_SUITE_CHARS = 32 << 20  # inputs and outputs together
PER_TEST_S = 2.0
MEMORY_MB = 1024
MAX_RUN_S = 60.0
OUTPUT_CAP_BYTES = 1 << 20  # per test; a longer output fails that test
MAX_RUN_OUTPUT_BYTES = 32 << 20

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


@dataclasses.dataclass(frozen=True)
class TestSuite:
    """Test cases of one problem.

    Attributes:
      kind: "stdio" (the program reads stdin and writes stdout) or "call" (a function).
      inputs: stdio: the stdin text of each test; call: the list of positional arguments.
      outputs: stdio: the expected stdout text; call: the expected (JSON) value.
      fn_name: the function called, for "call" only.
    """

    __test__ = False  # not a pytest test class, despite the name

    kind: str
    inputs: tuple
    outputs: tuple
    fn_name: str | None = None

    def to_json(self) -> str:
        """Canonical JSON in the APPS form; ``parse_tests(suite.to_json()) == suite``."""
        data = {"inputs": list(self.inputs), "outputs": list(self.outputs)}
        if self.kind == "call":
            data["fn_name"] = self.fn_name
        return json.dumps(data, sort_keys=True, separators=(",", ":"))


def parse_tests(gold, where: str = "tests") -> TestSuite:
    """The test suite in ``gold``; a one-line ValueError starting with ``where`` if malformed."""

    def fail(message: str):
        raise ValueError(f"{where}: {message}")

    if isinstance(gold, str):
        if len(gold) > MAX_SUITE_CHARS:
            fail(f"{len(gold)} characters of tests, more than {MAX_SUITE_CHARS}")
        try:
            gold = json.loads(gold, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            fail(f"not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    if isinstance(gold, dict):
        inputs, outputs, fn_name = _dict_form(gold, fail)
    elif isinstance(gold, list):
        inputs, outputs, fn_name = _list_form(gold, fail)
    else:
        fail(f"expected an object with inputs and outputs or a list of tests, got "
             f"{type(gold).__name__}")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        fail(f"inputs and outputs must be lists, got {type(inputs).__name__} and "
             f"{type(outputs).__name__}")
    if len(inputs) != len(outputs):
        fail(f"{len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        fail("no tests")
    if len(inputs) > MAX_TESTS:
        fail(f"{len(inputs)} tests, more than MAX_TESTS={MAX_TESTS}")
    if fn_name is None:
        inputs = [_stdio_text(v, f"input of test {i}", fail) for i, v in enumerate(inputs)]
        outputs = [_stdio_text(v, f"output of test {i}", fail) for i, v in enumerate(outputs)]
        size = sum(map(len, inputs)) + sum(map(len, outputs))
        kind = "stdio"
    else:
        if not (isinstance(fn_name, str) and fn_name.isidentifier()
                and not keyword.iskeyword(fn_name)):
            fail(f"fn_name must be a Python identifier, got {fn_name!r:.80}")
        for i, args in enumerate(inputs):
            if not isinstance(args, list):
                fail(f"input of test {i} must be the list of positional arguments of "
                     f"{fn_name}, got {type(args).__name__}")
        texts = [_json_text(v, f"input of test {i}", fail) for i, v in enumerate(inputs)]
        texts += [_json_text(v, f"output of test {i}", fail) for i, v in enumerate(outputs)]
        inputs = [json.loads(t) for t in texts[:len(inputs)]]
        outputs = [json.loads(t) for t in texts[len(inputs):]]
        size = sum(map(len, texts))
        kind = "call"
    if size > MAX_SUITE_CHARS:
        fail(f"{size} characters of tests, more than {MAX_SUITE_CHARS}")
    return TestSuite(kind, tuple(inputs), tuple(outputs), fn_name)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _dict_form(gold: dict, fail):
    if "inputs" in gold or "outputs" in gold:
        keys = ("inputs", "outputs")
    else:
        keys = ("input", "output")  # CodeContests
    allowed = set(keys) | {"fn_name"}
    missing = [k for k in keys if k not in gold]
    unknown = sorted(str(k) for k in gold if k not in allowed)
    if missing or unknown:
        fail(f"expected keys inputs, outputs and optionally fn_name, got {sorted(map(str, gold))}")
    return gold[keys[0]], gold[keys[1]], gold.get("fn_name")


def _list_form(gold: list, fail):
    inputs, outputs = [], []
    for i, test in enumerate(gold):
        if not isinstance(test, dict) or "input" not in test or "output" not in test:
            fail(f"test {i} must be an object with input and output, got "
                 f"{sorted(map(str, test)) if isinstance(test, dict) else type(test).__name__}")
        testtype = test.get("testtype", test.get("type", "stdin"))
        if testtype in ("functional", "function_call"):
            fail(f"test {i} is {testtype!r}; give call-based tests as "
                 f'{{"fn_name": ..., "inputs": [[args...], ...], "outputs": [...]}}')
        if testtype not in ("stdin", "stdin_stdout"):
            fail(f"test {i} has unknown testtype {testtype!r:.40}")
        inputs.append(test["input"])
        outputs.append(test["output"])
    return inputs, outputs, None


def _stdio_text(value, what: str, fail) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    fail(f"{what} must be a string or a list of lines, got {type(value).__name__}")


def _json_text(value, what: str, fail) -> str:
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        fail(f"{what} is not a JSON value ({type(e).__name__})")


def outputs_match(got: str, expected: str) -> bool:
    """Whether a program's stdout matches the expected one (token-wise, see module doc)."""
    got_tokens, want_tokens = got.split(), expected.split()
    if len(got_tokens) != len(want_tokens):
        return False
    return all(g == w or _close(g, w) for g, w in zip(got_tokens, want_tokens))


def _close(got: str, want: str) -> bool:
    if not (any(c in want for c in ".eE") and _NUMBER.fullmatch(want)
            and _NUMBER.fullmatch(got)):
        return False
    a, b = float(got), float(want)
    return math.isfinite(a) and math.isfinite(b) and math.isclose(
        a, b, rel_tol=1e-6, abs_tol=1e-6)


def _call_matches(got, expected) -> bool:
    canonical = _canonical(got)
    if canonical == _canonical(expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and (
        canonical == _canonical(expected[0]))


# The harness reads everything from files (no formatting, so neither the source nor the
# tests can change what it does). Each test runs in a forked child whose fd 0 is the test's
# input file and fd 1 a capture file; the parent, which runs no solution code in stdio mode
# and only the module's top level in call mode, waits under a timer, kills the child's
# process group at the limit and reports on its own copy of stdout. A crash, a swallowed
# timer or a C loop that never checks signals thus costs one test, never the later ones.
_HARNESS = r'''
import io, json, os, signal, sys

with open("tests.json", encoding="utf-8") as _f:
    CONFIG = json.load(_f)
MARK, LIMIT, CAP = CONFIG["marker"], CONFIG["per_test_s"], CONFIG["cap"]
HOME = os.getcwd()
REPORT = os.fdopen(os.dup(1), "w", encoding="utf-8")


def report(index, payload):
    REPORT.write("\n%s %s %s\n" % (MARK, index, payload))
    REPORT.flush()


def finish():
    REPORT.flush()
    os._exit(0)


class TimeLimit(BaseException):
    pass


def on_alarm(signum, frame):
    raise TimeLimit


class Discard(io.TextIOBase):
    def write(self, text):
        return len(text)


def redirect(fd, path, flags):
    new = os.open(path, flags)
    if new != fd:
        os.dup2(new, fd)
        os.close(new)


def read(path, size):
    try:
        with open(path, "rb") as f:
            return f.read(size)
    finally:
        os.unlink(path)


def child(body, stdin_path, out_path, status_path):
    # Runs one test in the forked child and never returns.
    status = b""
    try:
        os.setpgid(0, 0)
        os.close(REPORT.fileno())
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        redirect(0, stdin_path or os.devnull, os.O_RDONLY)
        redirect(1, out_path, os.O_WRONLY)
        redirect(2, os.devnull, os.O_WRONLY)
        sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
        stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stdout = sys.__stdout__ = stdout
        sys.stderr = sys.__stderr__ = open(2, "w", errors="replace", closefd=False)
        result = body()
        threading = sys.modules.get("threading")
        if threading is not None:  # as at interpreter exit: wait for non-daemon threads
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
        for stream in (sys.stdout, stdout):
            if not getattr(stream, "closed", False):
                stream.flush()
        if result is not None:
            status = ('{"ok": %s}' % result).encode()
    except BaseException as e:
        status = json.dumps({"err": type(e).__name__}).encode()
    try:
        fd = os.open(status_path, os.O_WRONLY)
        while status:
            status = status[os.write(fd, status):]
    finally:
        os._exit(0)


def run_test(index, body, stdin_path):
    out_path = os.path.join(HOME, ".out%d" % index)
    status_path = os.path.join(HOME, ".status%d" % index)
    for path in (out_path, status_path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    signal.signal(signal.SIGALRM, on_alarm)
    pid = os.fork()
    if pid == 0:
        child(body, stdin_path, out_path, status_path)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    wait = None
    try:
        signal.setitimer(signal.ITIMER_REAL, LIMIT)
        try:
            wait = os.waitpid(pid, 0)[1]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except TimeLimit:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    status, out = read(status_path, CAP + 1), read(out_path, CAP + 1)
    if wait is None:
        payload = {"err": "timeout"}
    elif len(status) > CAP or len(out) > CAP:
        payload = {"err": "OutputLimit"}
    elif status:
        try:
            payload = json.loads(status)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            payload = {"err": "BadStatus"}
    elif os.WIFSIGNALED(wait):
        payload = {"err": "signal %d" % os.WTERMSIG(wait)}
    elif os.WEXITSTATUS(wait):
        payload = {"err": "exit %d" % os.WEXITSTATUS(wait)}
    elif CONFIG["kind"] == "call":
        payload = {"err": "NoResult"}
    else:
        payload = {"out": out.decode("utf-8", "replace")}
    report(index, json.dumps(payload))


try:
    with open("solution.py", encoding="utf-8") as _f:
        CODE = compile(_f.read(), "<solution>", "exec")
except BaseException as _e:
    report("load", json.dumps({"err": type(_e).__name__}))
    finish()

if CONFIG["kind"] == "stdio":
    def program():
        try:
            exec(CODE, {"__name__": "__main__"})
        except SystemExit:
            pass

    for _i in range(CONFIG["n"]):
        run_test(_i, program, os.path.join(HOME, "tests", "%d.in" % _i))
    finish()

# Call-based: the module's top level runs once, here, with its own stdio discarded.
NAMESPACE, FN = {"__name__": "__solution__"}, CONFIG["fn_name"]
_saved = sys.stdin, sys.stdout, sys.stderr
try:
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(), Discard(), Discard()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT)
    try:
        exec(CODE, NAMESPACE)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if callable(NAMESPACE.get(FN)):
        call = NAMESPACE[FN]
    elif isinstance(NAMESPACE.get("Solution"), type) and callable(
            getattr(NAMESPACE["Solution"], FN, None)):
        def call(*args):
            return getattr(NAMESPACE["Solution"](), FN)(*args)
    else:
        raise NameError(FN)
except BaseException as _e:
    report("load", json.dumps({"err": "timeout" if isinstance(_e, TimeLimit) else
                                      type(_e).__name__}))
    finish()
sys.stdin, sys.stdout, sys.stderr = _saved

for _i, _args in enumerate(CONFIG["args"]):
    run_test(_i, lambda args=_args: json.dumps(call(*args)), None)
finish()
'''


def prepare(completion: str, suite: TestSuite, marker: str, *, per_test_s: float = PER_TEST_S,
            memory_mb: int = MEMORY_MB) -> tuple[Reward | None, ExecRequest | None]:
    """Either a final zero reward (no sandbox needed) or the ExecRequest to run.

    The request's program is the fixed harness; its files are the solution, the inputs
    (one file per standard-input test) and the settings. ``marker`` tags the harness's
    report lines: one word, different per task. ``per_test_s`` bounds each test and
    ``memory_mb`` each process; the whole run gets ``per_test_s`` per test + 2 s, at most
    ``MAX_RUN_S``.
    """
    if not isinstance(marker, str) or not marker or any(c.isspace() for c in marker):
        raise ValueError(f"marker must be a non-empty string without whitespace, got "
                         f"{marker!r:.80}")
    if isinstance(per_test_s, bool) or not isinstance(per_test_s, (int, float)) or not (
            0 < per_test_s < math.inf):
        raise ValueError(f"per_test_s must be a positive number, got {per_test_s!r}")
    final, code = checked_code(completion)
    if final is not None:
        return final, None
    n = len(suite.inputs)
    config = {
        "marker": marker,
        "kind": suite.kind,
        "fn_name": suite.fn_name,
        "per_test_s": float(per_test_s),
        "cap": OUTPUT_CAP_BYTES,
        "n": n,
        "args": list(suite.inputs) if suite.kind == "call" else [],
    }
    files = {"tests.json": json.dumps(config), "solution.py": code}  # what the harness reads
    if suite.kind == "stdio":
        files.update((f"tests/{i}.in", text) for i, text in enumerate(suite.inputs))
    return None, ExecRequest(
        code=_HARNESS,
        files=files,
        timeout_s=min(per_test_s * n + 2.0, MAX_RUN_S),
        memory_mb=memory_mb,
        max_output_bytes=MAX_RUN_OUTPUT_BYTES,
    )


def read_report(stdout: str, marker: str, n_tests: int) -> tuple[bool, dict[int, dict]]:
    """(loaded, {test index: payload}) from the harness output.

    Foreign lines, malformed payloads, out-of-range and repeated indexes are ignored (the
    first line for an index counts).
    """
    loaded, results = True, {}
    for item in report_lines(stdout, marker, n_tests):
        if item is None:
            loaded = False
        else:
            results[item[0]] = item[1]
    return loaded, results


def _passes(suite: TestSuite, index: int, result: dict) -> bool:
    if suite.kind == "stdio":
        out = result.get("out")
        return isinstance(out, str) and outputs_match(out, suite.outputs[index])
    return "ok" in result and _call_matches(result["ok"], suite.outputs[index])


def score(suite: TestSuite, result, marker: str, *, partial: bool) -> Reward:
    """The reward of one sandbox run of ``prepare``'s request."""
    status = str(result.status)
    if status == "sandbox_error":
        return zero_reward(f"sandbox_error: {result.detail[:200]}", format=1.0, parses=1.0,
                           runs=0.0, tests_passed=0.0)
    n = len(suite.outputs)
    loaded, results = read_report(result.stdout, marker, n)
    n_passed = sum(_passes(suite, i, r) for i, r in results.items()) if loaded else 0
    timed_out = status == "timeout" or any(r.get("err") == "timeout" for r in results.values())
    if n_passed == n:
        verdict = "correct"
    elif not loaded:
        verdict = "load_error"
    elif timed_out:
        verdict = f"timeout ({n_passed}/{n} passed)"
    else:
        verdict = f"{'wrong' if status == 'ok' else status} ({n_passed}/{n} passed)"
    fraction = n_passed / n
    components = {
        "format": 1.0,
        "parses": 1.0,
        "runs": float(loaded and (bool(results) or status == "ok")),
        "tests_passed": fraction,
        "exact": float(n_passed == n),
    }
    return Reward(fraction if partial else float(n_passed == n), components, verdict)
