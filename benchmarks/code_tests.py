"""Scoring code rows' test cases: one sandbox run per completion against one per test.

    python -m benchmarks.code_tests [--quick]

A task file's code row (APPS-style standard-input tests) is scored by
`posttrain.tasks.code_tests`: one sandbox run per completion, whose harness forks a child
per test (its own stdin, time limit and crash). The naive way, one sandbox run per test
with the test's input on stdin (each a fresh fork of the sandbox's warm interpreter plus
its namespaces), is what it is set against. Both score the same completions (a correct
program and a wrong one, alternating) against the same tests through one `run_many` per
batch on the same sandbox, and must agree on every verdict. Figures: tests checked per
second (median over repeats) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from posttrain.sandbox import ExecRequest, Sandbox, SandboxConfig
from posttrain.tasks import code_tests

RIGHT = "```python\nn = int(input())\nprint(n * n)\n```"
WRONG = "```python\nn = int(input())\nprint(n + n)\n```"


def _suite(n_tests: int) -> code_tests.TestSuite:
  inputs = [f"{i + 3}\n" for i in range(n_tests)]
  outputs = [f"{(i + 3) ** 2}\n" for i in range(n_tests)]
  return code_tests.parse_tests({"inputs": inputs, "outputs": outputs})


def _ours(sandbox, suite, completions) -> list[float]:
  marker = "@@bench"
  requests = [code_tests.prepare(c, suite, marker)[1] for c in completions]
  results = sandbox.run_many(requests)
  return [code_tests.score(suite, r, marker, partial=True).value for r in results]


def _per_test(sandbox, suite, completions) -> list[float]:
  requests = []
  for completion in completions:
    code = completion.split("```python\n", 1)[1].rsplit("```", 1)[0]
    requests += [ExecRequest(code=code, stdin=x, timeout_s=2.0, memory_mb=1024)
                 for x in suite.inputs]
  results = sandbox.run_many(requests)
  n = len(suite.inputs)
  out = []
  for k in range(len(completions)):
    passed = sum(str(r.status) == "ok" and code_tests.outputs_match(r.stdout, want)
                 for r, want in zip(results[k * n:(k + 1) * n], suite.outputs))
    out.append(passed / n)
  return out


def run(quick: bool = False) -> list[dict]:
  rows = []
  completions = [RIGHT, WRONG] * (4 if quick else 8)
  repeats = 3 if quick else 5
  with Sandbox(SandboxConfig(concurrency=8)) as sandbox:
    for n_tests in ((10,) if quick else (5, 20)):
      suite = _suite(n_tests)
      times = {"per completion (ours)": [], "per test (naive)": []}
      verdicts = {}
      for _ in range(repeats):
        for name, fn in (("per completion (ours)", _ours), ("per test (naive)", _per_test)):
          start = time.perf_counter()
          verdicts[name] = fn(sandbox, suite, completions)
          times[name].append(time.perf_counter() - start)
      if verdicts["per completion (ours)"] != verdicts["per test (naive)"]:
        raise AssertionError(f"the two ways disagree: {verdicts}")
      checked = len(completions) * n_tests
      base = statistics.median(times["per test (naive)"])
      for name, t in times.items():
        med = statistics.median(t)
        rows.append({"tests per completion": n_tests, "sandbox runs": name,
                     "completions": len(completions),
                     "tests checked/s": f"{checked / med:,.0f}",
                     "median s": f"{med:.3f}", "speed vs per test": f"{base / med:.2f}x"})
  return rows


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  for row in run(args.quick):
    print(row)


if __name__ == "__main__":
  main()
