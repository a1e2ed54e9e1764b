"""Compilation cache: a restarted run's wall time with and without `compile_cache_dir`.

    python -m benchmarks.compile_cache [--quick] [--repeats=3]

Each arm launches `python -m launch.train` (configs/default.py, a short SFT + GRPO run on
8 fake CPU devices) in a fresh work directory, as a restarted job would, and times the
whole process. "no cache": every launch compiles every program. "cache, warm": the same
command with `--config.compile_cache_dir` pointing at a cache an earlier launch filled, so
its programs load from disk. The ratio column is no cache / warm (higher: the cache
saves more). The first launch with a cache (cold, which also writes it) is reported too.
Medians over `repeats` launches per arm, interleaved so load drifts hit both arms alike.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
OVERRIDES = {"sft.steps": 2, "sft.batch_size": 8, "train.rl_steps": 2,
             "rollout.prompts_per_step": 4, "rollout.max_new_tokens": 8,
             "eval.seeds_per_domain": 0, "checkpoint.async_save": False}


def launch_seconds(workdir: str, cache: str | None = None, quick: bool = False) -> float:
  """Wall seconds of one `launch.train` process (raises with its output if it fails)."""
  overrides = dict(OVERRIDES, **({"train.rl_steps": 1} if quick else {}))
  if cache:
    overrides["compile_cache_dir"] = cache
  cmd = [sys.executable, "-m", "launch.train", f"--config={ROOT}/configs/default.py",
         f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  seconds = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"launch.train failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                       f"{proc.stderr[-2000:]}")
  return seconds


def run(quick: bool = False, repeats: int | None = None) -> list[dict]:
  repeats = repeats or (1 if quick else 3)
  times: dict[str, list[float]] = {"no cache": [], "cache, cold (writes it)": [],
                                   "cache, warm": []}
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(repeats):
      cache = os.path.join(tmp, f"cache{i}")
      times["no cache"].append(launch_seconds(os.path.join(tmp, f"plain{i}"), quick=quick))
      times["cache, cold (writes it)"].append(
          launch_seconds(os.path.join(tmp, f"cold{i}"), cache, quick))
      times["cache, warm"].append(launch_seconds(os.path.join(tmp, f"warm{i}"), cache, quick))
      entries = len(os.listdir(cache))
  base = statistics.median(times["no cache"])
  return [dict(arm=arm, launches=len(ts), median_s=round(statistics.median(ts), 2),
               no_cache_over_arm=round(base / statistics.median(ts), 2),
               cache_entries=entries if arm != "no cache" else None)
          for arm, ts in times.items()]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--repeats", type=int)
  args = parser.parse_args(argv)
  for row in run(args.quick, args.repeats):
    print(row)


if __name__ == "__main__":
  main()
