"""Code: write a Python function that passes hidden tests run in the sandbox.

The completion's last ```python fenced block is the solution. A harness execs it in the
sandbox, calls the function on each hidden input and prints one line per test, tagged
with a per-task marker. Expected outputs never enter the sandbox: the scorer compares the
printed results outside, so forging a pass means computing the right output.

Reward components: ``parses`` (the block exists and is valid Python), ``runs`` (it loaded
and the function was called), ``tests_passed`` (fraction of hidden tests passed; this is
the reward value). Results are compared as canonical JSON, so ``True`` is not ``1`` and
tuples equal lists. Tests printed before a timeout still count.

Problems are parameterised from the seed (constants, characters, moduli) and come with a
reference solution, which doubles as the demonstration.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import string
from collections.abc import Callable

from posttrain.tasks import execution
from posttrain.tasks.base import Domain, Reward, Task, zero_reward

MAX_CODE_CHARS = 20_000
TIMEOUT_S = 5.0
MEMORY_MB = 512
_FENCE = "```python"


@dataclasses.dataclass(frozen=True)
class Problem:
    """A problem template: ``make(rng) -> (function name, description, reference, test args)``."""

    op: str
    level: int
    make: Callable


def extract_code(completion: str) -> str | None:
    """The last ```python block (an unclosed final block runs to the end), or None."""
    start = completion.rfind(_FENCE)
    if start < 0:
        return None
    start += len(_FENCE)
    end = completion.find("```", start)
    return completion[start:] if end < 0 else completion[start:end]


def checked_code(completion: str) -> tuple[Reward | None, str | None]:
    """The completion's solution, or the zero reward it gets without running: no block,
    a block too long, or one that is not valid Python."""
    code = extract_code(completion)
    verdict = None
    if code is None:
        verdict = "no_code"
    elif len(code) > MAX_CODE_CHARS:
        verdict = "code_too_long"
    else:
        try:
            ast.parse(code)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            verdict = "syntax_error"
    if verdict is not None:
        return zero_reward(verdict, parses=0.0, runs=0.0, tests_passed=0.0), None
    return None, code


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


def run_reference(source: str, func: str, tests: list[list]) -> list:
    """Outputs of our own reference solution (trusted code, run in-process)."""
    namespace: dict = {}
    exec(compile(source, f"<reference {func}>", "exec"), namespace)  # noqa: S102 - trusted
    return [json.loads(json.dumps(namespace[func](*args))) for args in tests]


_HARNESS = """\
import json as _json, sys as _sys
_src = {src!r}
_ns = {{"__name__": "__solution__"}}
try:
    exec(compile(_src, "<solution>", "exec"), _ns)
    _f = _ns[{func!r}]
except BaseException as _e:
    print({marker!r}, "load", _json.dumps(type(_e).__name__), flush=True)
    raise SystemExit(0)
for _i, _args in enumerate(_json.loads({tests!r})):
    try:
        _line = _json.dumps({{"ok": _f(*_args)}})
    except BaseException as _e:
        _line = _json.dumps({{"err": type(_e).__name__}})
    print({marker!r}, _i, _line, flush=True)
"""


def harness(code: str, func: str, tests: list[list], marker: str) -> str:
    return _HARNESS.format(src=code, func=func, tests=json.dumps(tests), marker=marker)


def report_lines(stdout: str, marker: str, n_tests: int):
    """A harness's report in ``stdout``: ``None`` for a solution that failed to load, else
    ``(test index, payload object)``, the first well-formed line of each index only.
    Foreign lines, malformed payloads and out-of-range indexes are skipped."""
    seen = set()
    for line in stdout.splitlines():
        if not line.startswith(marker + " "):
            continue
        _, index, payload = (line.split(" ", 2) + ["", ""])[:3]
        if index == "load":
            yield None
            continue
        if not (index.isascii() and index.isdigit()) or int(index) >= n_tests:
            continue
        if int(index) in seen:
            continue
        try:
            result = json.loads(payload)
        except (ValueError, RecursionError):
            continue
        if isinstance(result, dict):
            seen.add(int(index))
            yield int(index), result


def parse_results(stdout: str, marker: str, n_tests: int) -> tuple[bool, dict[int, str]]:
    """(loaded, {test index: canonical output}) from the harness output."""
    loaded, outputs = True, {}
    for item in report_lines(stdout, marker, n_tests):
        if item is None:
            loaded = False
        elif "ok" in item[1]:
            outputs[item[0]] = _canonical(item[1]["ok"])
    return loaded, outputs


class CodeDomain(Domain):
    """A code-writing domain for one problem template."""

    def __init__(self, problem: Problem):
        super().__init__(f"code/{problem.op}_l{problem.level}", "code", problem.level)
        self.problem = problem

    def _sample(self, rng, seed):
        func, description, source, tests = self.problem.make(rng)
        expected = run_reference(source, func, tests)
        example = f"{func}({', '.join(map(repr, tests[0]))}) == {expected[0]!r}"
        prompt = (
            f"Write a Python function {description}\n"
            f"Example: {example}\n"
            f"Reply with the function in a {_FENCE} block."
        )
        metadata = {"func": func, "tests": tests, "expected": expected, "reference": source}
        return Task(self.name, seed, prompt, source, metadata, self.level, self.family)

    def demonstration(self, task):
        return f"{_FENCE}\n{task.metadata['reference']}```"

    def _marker(self, task: Task) -> str:
        return "@@" + hashlib.sha256(f"{task.domain}:{task.seed}:harness".encode()).hexdigest()[:24]

    def _prepare(self, task: Task, completion: str) -> tuple[Reward | None, object]:
        """Either a final reward (no sandbox needed) or the request to run."""
        final, code = checked_code(completion)
        if final is not None:
            return final, None
        from posttrain.sandbox import ExecRequest

        program = harness(code, task.metadata["func"], task.metadata["tests"], self._marker(task))
        return None, ExecRequest(
            code=program, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB, max_output_bytes=1 << 20
        )

    def _finish(self, task: Task, result) -> Reward:
        expected = [_canonical(v) for v in task.metadata["expected"]]
        loaded, outputs = parse_results(result.stdout, self._marker(task), len(expected))
        status = str(result.status)
        if status == "sandbox_error":
            return zero_reward(
                f"sandbox_error: {result.detail[:200]}",
                format=1.0,
                parses=1.0,
                runs=0.0,
                tests_passed=0.0,
            )
        runs = float(loaded and (bool(outputs) or status == "ok"))
        n_passed = sum(outputs.get(i) == e for i, e in enumerate(expected))
        passed = n_passed / len(expected)
        if n_passed == len(expected):
            verdict = "correct"
        elif not loaded:
            verdict = "load_error"
        else:
            verdict = f"{'wrong' if status == 'ok' else status} ({n_passed}/{len(expected)} passed)"
        components = {
            "format": 1.0,
            "parses": 1.0,
            "runs": runs,
            "tests_passed": passed,
            "exact": float(passed == 1.0),
        }
        return Reward(passed, components, verdict)

    def _score(self, task, completion):
        final, request = self._prepare(task, completion)
        if final is not None:
            return final
        return self._finish(task, execution.get_sandbox().run(request))

    def score_many(self, tasks, completions):
        """Scores a batch with one ``run_many`` call; never raises."""
        if len(tasks) != len(completions):
            raise ValueError(f"got {len(tasks)} tasks but {len(completions)} completions")
        rewards: list[Reward | None] = [None] * len(tasks)
        pending = []
        for i, (task, completion) in enumerate(zip(tasks, completions)):
            if not (
                isinstance(task, Task) and task.domain == self.name and isinstance(completion, str)
            ):
                rewards[i] = self.score(task, completion)
                continue
            try:
                final, request = self._prepare(task, completion)
            except Exception as e:  # noqa: BLE001
                final = zero_reward(f"error: {type(e).__name__}: {str(e)[:200]}")
            if final is not None:
                rewards[i] = final
            else:
                pending.append((i, request))
        if pending:
            try:
                results = execution.get_sandbox().run_many([r for _, r in pending])
                for (i, _), result in zip(pending, results):
                    rewards[i] = self._finish(tasks[i], result)
            except Exception as e:  # noqa: BLE001 - e.g. no sandbox on this host
                for i, _ in pending:
                    rewards[i] = zero_reward(
                        f"sandbox_error: {type(e).__name__}: {str(e)[:200]}", format=1.0, parses=1.0
                    )
        return rewards


# -- problems ---------------------------------------------------------------------------


def _ints(rng, n, lo, hi):
    return [rng.randint(lo, hi) for _ in range(n)]


def _word(rng, n, alphabet=string.ascii_lowercase):
    return "".join(rng.choice(alphabet) for _ in range(n))


def _affine(rng):
    a, b = rng.randint(2, 9), rng.randint(0, 9)
    src = f"def f(x):\n    return {a} * x + {b}\n"
    return "f", f"f(x) that returns {a}*x + {b}.", src, [[x] for x in _ints(rng, 6, -20, 20)]


def _count_char(rng):
    c = rng.choice("abcde")
    src = f"def count(s):\n    return s.count({c!r})\n"
    tests = [[_word(rng, rng.randint(0, 12), "abcde")] for _ in range(6)]
    return (
        "count",
        f"count(s) that returns how many times {c!r} occurs in the string s.",
        src,
        tests,
    )


def _extreme(rng):
    which = rng.choice(["largest", "smallest"])
    fn = "max" if which == "largest" else "min"
    src = f"def pick(a, b, c):\n    return {fn}(a, b, c)\n"
    return (
        "pick",
        f"pick(a, b, c) that returns the {which} of three numbers.",
        src,
        [_ints(rng, 3, -50, 50) for _ in range(6)],
    )


def _sum_gt(rng):
    k = rng.randint(-5, 10)
    src = f"def sum_gt(xs):\n    return sum(x for x in xs if x > {k})\n"
    tests = [[_ints(rng, rng.randint(0, 10), -20, 20)] for _ in range(8)]
    return (
        "sum_gt",
        f"sum_gt(xs) that returns the sum of the numbers in list xs greater than {k}.",
        src,
        tests,
    )


def _join_words(rng):
    sep = rng.choice(["-", "+", "_", ", "])
    src = f"def join_words(s):\n    return {sep!r}.join(reversed(s.split()))\n"
    tests = [
        [" ".join(_word(rng, rng.randint(1, 5)) for _ in range(rng.randint(1, 5)))]
        for _ in range(6)
    ]
    return (
        "join_words",
        f"join_words(s) that reverses the order of the words of s and joins them with {sep!r}.",
        src,
        tests,
    )


def _fizzbuzz(rng):
    a, b = rng.sample([2, 3, 4, 5, 7], 2)
    src = (
        "def fizzbuzz(n):\n"
        f"    if n % {a * b} == 0:\n        return 'FizzBuzz'\n"
        f"    if n % {a} == 0:\n        return 'Fizz'\n"
        f"    if n % {b} == 0:\n        return 'Buzz'\n"
        "    return str(n)\n"
    )
    tests = [[n] for n in [a * b, a, b, 1] + _ints(rng, 6, 1, 200)]
    desc = (
        f"fizzbuzz(n) that returns 'FizzBuzz' if n is divisible by both {a} and {b}, 'Fizz' if only by {a}, "
        f"'Buzz' if only by {b}, else str(n)."
    )
    return "fizzbuzz", desc, src, tests


def _digit_sum(rng):
    m = rng.randint(3, 11)
    src = f"def digit_sum(n):\n    return sum(int(d) for d in str(n)) % {m}\n"
    tests = [[n] for n in _ints(rng, 8, 0, 10**9)]
    return (
        "digit_sum",
        f"digit_sum(n) that returns the sum of the decimal digits of n >= 0, modulo {m}.",
        src,
        tests,
    )


def _running_max(rng):
    src = (
        "def running_max(xs):\n    out = []\n    for x in xs:\n"
        "        out.append(x if not out else max(out[-1], x))\n    return out\n"
    )
    tests = [[_ints(rng, rng.randint(0, 12), -99, 99)] for _ in range(8)]
    return (
        "running_max",
        "running_max(xs) that returns the list of running maxima of list xs.",
        src,
        tests,
    )


def _gcd(rng):
    which = rng.choice(["gcd", "lcm"])
    body = "math.gcd(a, b)" if which == "gcd" else "a * b // math.gcd(a, b)"
    src = f"import math\n\ndef {which}(a, b):\n    return {body}\n"
    tests = [_ints(rng, 2, 1, 10**6) for _ in range(8)]
    label = "greatest common divisor" if which == "gcd" else "least common multiple"
    return (
        which,
        f"{which}(a, b) that returns the {label} of positive integers a and b.",
        src,
        tests,
    )


def _caesar(rng):
    k = rng.randint(1, 25)
    src = (
        "def shift(s):\n    return ''.join(\n"
        f"        chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s\n    )\n"
    )
    tests = [[_word(rng, rng.randint(0, 15), string.ascii_lowercase + " .")] for _ in range(8)]
    return (
        "shift",
        f"shift(s) that shifts each lowercase letter of s forward by {k} in the alphabet (z wraps to a).",
        src,
        tests,
    )


def _primes_below(rng):
    src = (
        "def primes_below(n):\n    if n < 3:\n        return 0\n    sieve = bytearray([1]) * n\n"
        "    sieve[0] = sieve[1] = 0\n    for i in range(2, int(n ** 0.5) + 1):\n"
        "        if sieve[i]:\n            sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))\n"
        "    return sum(sieve)\n"
    )
    tests = [
        [n] for n in [0, 2, 3, 10] + _ints(rng, 3, 10, 10**4) + [rng.randint(10**5, 2 * 10**5)]
    ]
    return (
        "primes_below",
        "primes_below(n) that returns how many primes are smaller than n.",
        src,
        tests,
    )


def _rle(rng):
    count_first = rng.random() < 0.5
    piece = "f'{len(run)}{run[0]}'" if count_first else "f'{run[0]}{len(run)}'"
    src = (
        "import itertools\n\ndef rle(s):\n    return ''.join(\n"
        f"        {piece} for run in (''.join(g) for _, g in itertools.groupby(s))\n    )\n"
    )
    tests = [[_word(rng, rng.randint(0, 14), "aab")] for _ in range(8)]
    form = "count then character" if count_first else "character then count"
    return (
        "rle",
        f"rle(s) that run-length encodes s, each run written as {form} (e.g. for 'aab').",
        src,
        tests,
    )


def _balanced(rng):
    pairs = rng.choice(["()", "()[]", "()[]{}"])
    src = (
        "def balanced(s):\n"
        f"    closer = {dict(zip(pairs[0::2], pairs[1::2]))!r}\n"
        "    stack = []\n    for c in s:\n        if c in closer:\n            stack.append(closer[c])\n"
        "        elif not stack or stack.pop() != c:\n            return False\n    return not stack\n"
    )
    tests = [[_word(rng, rng.randint(0, 10), pairs)] for _ in range(7)] + [[pairs[0] + pairs[1]]]
    return (
        "balanced",
        f"balanced(s) that returns True if the brackets {pairs} in s are balanced, else False.",
        src,
        tests,
    )


def _fib_mod(rng):
    m = rng.choice([97, 1000, 10007, 10**9 + 7])
    src = (
        "def fib_mod(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
        f"        a, b = b, (a + b) % {m}\n    return a\n"
    )
    tests = [[n] for n in [0, 1, 2, 10] + _ints(rng, 3, 50, 5000) + [rng.randint(10**5, 3 * 10**5)]]
    return (
        "fib_mod",
        f"fib_mod(n) that returns the n-th Fibonacci number (F(0)=0, F(1)=1) modulo {m}.",
        src,
        tests,
    )


def _lis(rng):
    src = (
        "import bisect\n\ndef lis(xs):\n    tails = []\n    for x in xs:\n"
        "        i = bisect.bisect_left(tails, x)\n        tails[i:i + 1] = [x]\n    return len(tails)\n"
    )
    tests = [[_ints(rng, n, 0, 50)] for n in [0, 1, 5, 9, 12, 20]] + [[_ints(rng, 3000, 0, 10**6)]]
    return (
        "lis",
        "lis(xs) that returns the length of the longest strictly increasing subsequence of xs.",
        src,
        tests,
    )


def _edit_distance(rng):
    src = (
        "def edit_distance(a, b):\n    prev = list(range(len(b) + 1))\n    for i, ca in enumerate(a, 1):\n"
        "        cur = [i]\n        for j, cb in enumerate(b, 1):\n"
        "            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))\n"
        "        prev = cur\n    return prev[-1]\n"
    )
    tests = [
        [_word(rng, rng.randint(0, 8), "abc"), _word(rng, rng.randint(0, 8), "abc")]
        for _ in range(7)
    ]
    tests.append([_word(rng, 300, "abcd"), _word(rng, 300, "abcd")])
    return (
        "edit_distance",
        "edit_distance(a, b) that returns the Levenshtein distance between strings a and b.",
        src,
        tests,
    )


PROBLEMS = [
    Problem("affine", 1, _affine),
    Problem("count_char", 1, _count_char),
    Problem("extreme", 1, _extreme),
    Problem("sum_gt", 2, _sum_gt),
    Problem("join_words", 2, _join_words),
    Problem("fizzbuzz", 2, _fizzbuzz),
    Problem("digit_sum", 2, _digit_sum),
    Problem("running_max", 3, _running_max),
    Problem("gcd", 3, _gcd),
    Problem("caesar", 3, _caesar),
    Problem("primes_below", 4, _primes_below),
    Problem("rle", 4, _rle),
    Problem("balanced", 4, _balanced),
    Problem("fib_mod", 5, _fib_mod),
    Problem("lis", 5, _lis),
    Problem("edit_distance", 5, _edit_distance),
]


def domains():
    return [CodeDomain(p) for p in PROBLEMS]
