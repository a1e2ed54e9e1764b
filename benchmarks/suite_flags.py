"""Test suite: wall time of test files with XLA's default LLVM passes and with the cheap
ones the suite uses (`tests/xla_flags.py`).

    python -m benchmarks.suite_flags [--quick] [--repeats=2] [target ...]

Each target (a pytest node or file) runs in its own `python -m pytest` process, once per
arm per repeat, the arms interleaved so load drifts hit both alike, with the persistent
compilation cache off so every program compiles. "default": XLA's own passes
(`--xla_backend_optimization_level=3 --xla_llvm_disable_expensive_passes=false`, which
override the suite's, tests/conftest.py). "fast": the suite's. Prints each target's
median seconds per arm and default / fast (higher: the cheap passes save more).
`--quick`: the first two targets, once.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARMS = {"default": "--xla_backend_optimization_level=3 --xla_llvm_disable_expensive_passes=false",
        "fast": ""}
# Compile-bound files of each kind: train steps, the sampler, plain-JAX and interpreted
# Pallas kernels. None launches processes (those get the suite's flags either way).
TARGETS = ("tests/rl/test_losses.py", "tests/kernels/test_chunked_attention.py",
           "tests/models/test_lora.py", "tests/sampling/test_sampler.py::"
           "test_greedy_equals_argmax_by_full_recomputation",
           "tests/kernels/test_flash_attention.py::TestFlashTPUInterpret")


def pytest_seconds(target: str, xla_flags: str) -> float:
  env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_COMPILATION_CACHE_DIR": ""}
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         target], cwd=ROOT, env=env, capture_output=True, text=True,
                        check=False)
  seconds = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"pytest {target} failed ({proc.returncode}):\n{proc.stdout[-2000:]}")
  return seconds


def run(quick: bool = False, targets=TARGETS, repeats: int | None = None) -> list[dict]:
  targets, repeats = (targets[:2], 1) if quick else (targets, repeats or 2)
  rows = []
  for target in targets:
    times = {arm: [] for arm in ARMS}
    for _ in range(repeats):
      for arm, flags in ARMS.items():
        times[arm].append(pytest_seconds(target, flags))
    med = {arm: statistics.median(ts) for arm, ts in times.items()}
    rows.append(dict(target=target, runs=repeats, default_s=round(med["default"], 1),
                     fast_s=round(med["fast"], 1),
                     default_over_fast=round(med["default"] / med["fast"], 2)))
  total = {arm: sum(r[f"{arm}_s"] for r in rows) for arm in ARMS}
  rows.append(dict(target="all", runs=repeats, default_s=round(total["default"], 1),
                   fast_s=round(total["fast"], 1),
                   default_over_fast=round(total["default"] / total["fast"], 2)))
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--repeats", type=int)
  parser.add_argument("targets", nargs="*")
  args = parser.parse_args(argv)
  for row in run(args.quick, tuple(args.targets) or TARGETS, args.repeats):
    print(row, flush=True)


if __name__ == "__main__":
  main()
