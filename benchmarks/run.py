"""Runs every side-by-side benchmark in one process and rewrites BENCHMARKS.md.

    python -m benchmarks.run [--quick] [--only=sampler,train_step] [--output=BENCHMARKS.md]

Each module benchmarks/<name>.py exposes `run(quick: bool) -> list[dict]`; its rows become
one table (the dict keys are the columns). A module that does not exist yet, or that
fails, is reported in the output and in BENCHMARKS.md instead of stopping the run. The
page also records the machine (cores, memory, jax version, the float32 matmul peak
measured here, in this process), the date, and the command that reproduces each table;
it holds exactly one run's figures (with --only, only those benchmarks). The exit status
is 1 when a benchmark failed (after the page is written).
Benchmarks that compare with Tunix get its venv (/tmp/tunix-venv, google-tunix 0.1.7)
created first if it is missing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The side-by-side benchmarks, in the order BENCHMARKS.md shows them; any other module in
# benchmarks/ with a `run` function is appended after them.
KNOWN = ("attention", "sampler", "train_step", "preference", "sandbox", "tasks",
         "async_overlap")
TUNIX_USERS = ("sampler", "train_step", "preference")
TUNIX_VENV = "/tmp/tunix-venv"
TUNIX_PACKAGES = ("google-tunix==0.1.7", "sentencepiece")
_NOT_BENCHMARKS = ("__init__", "run")


def discover(directory: pathlib.Path = ROOT / "benchmarks") -> list[str]:
  """Benchmark names: the known ones first (present or not), then any other module."""
  present = sorted(p.stem for p in directory.glob("*.py") if p.stem not in _NOT_BENCHMARKS)
  return list(KNOWN) + [n for n in present if n not in KNOWN]


def ensure_tunix_venv(venv: str = TUNIX_VENV) -> str:
  """The venv's python with tunix importable; creates the venv when missing."""
  python = os.path.join(venv, "bin", "python")
  if os.path.exists(python) and subprocess.run([python, "-c", "import tunix"],
                                               capture_output=True, check=False).returncode == 0:
    return python
  print(f"creating {venv} with {' '.join(TUNIX_PACKAGES)} ...", file=sys.stderr, flush=True)
  subprocess.run(["python3", "-m", "venv", venv], check=True)
  subprocess.run([python, "-m", "pip", "install", "-q", *TUNIX_PACKAGES], check=True)
  return python


def matmul_peak_gflops(n: int = 2048, reps: int = 5) -> float:
  """Float32 GFLOP/s of one large jitted matmul on the default device (median of reps)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / float(np.median(times)) / 1e9


def machine(peak_fn: Callable[[], float]) -> dict[str, Any]:
  """Cores, memory, CPU model, jax version and devices, load, measured matmul peak."""
  import jax

  mem_gib = None
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/meminfo") as fh:
      kib = next(int(line.split()[1]) for line in fh if line.startswith("MemTotal:"))
      mem_gib = round(kib / 2**20, 1)
    with open("/proc/cpuinfo") as fh:
      cpu = next((line.split(":", 1)[1].strip() for line in fh
                  if line.startswith("model name")), cpu)
  except (OSError, StopIteration):
    pass
  devices = jax.devices()
  return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
          else os.cpu_count(), "memory_gib": mem_gib, "python": platform.python_version(),
          "jax": jax.__version__, "devices": f"{len(devices)} x {devices[0].device_kind}",
          "load_avg": round(os.getloadavg()[0], 1), "matmul_gflops": round(peak_fn(), 1)}


def run_all(names: Sequence[str], quick: bool, *,
            peak_fn: Callable[[], float] | None = None,
            tunix_fn: Callable[[], str] | None = None) -> dict[str, Any]:
  """Imports and runs each benchmark; never raises for a missing or failing one.

  Args:
    names: benchmark module names under benchmarks/.
    quick: passed to each `run`.
    peak_fn, tunix_fn: default `matmul_peak_gflops` and `ensure_tunix_venv`.

  Returns:
    {"machine": ..., "date": ..., "quick": ..., "results": [{"name", "status" ("ok" |
    "missing" | "failed"), "rows", "error", "seconds", "doc"}]}
  """
  results, modules = [], {}
  # Import everything before jax starts its backends: a module may set XLA flags.
  for name in names:
    try:
      modules[name] = importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"benchmarks.{name}":
        modules[name] = e
    except Exception as e:  # noqa: BLE001 - reported, not fatal
      modules[name] = e
  tunix_error = None
  if any(n in TUNIX_USERS and not isinstance(modules.get(n), Exception | None)
         for n in names):
    try:
      (tunix_fn or ensure_tunix_venv)()
    except Exception as e:  # noqa: BLE001 - the benchmark itself will say what it lacks
      tunix_error = f"Tunix venv set-up failed: {_one_line(e)}"
  info = machine(peak_fn or matmul_peak_gflops)
  for name in names:
    mod = modules.get(name)
    doc = (getattr(mod, "__doc__", None) or "").strip().splitlines()
    entry: dict[str, Any] = {"name": name, "doc": doc[0] if doc else "", "rows": [],
                             "error": None, "seconds": 0.0}
    if mod is None:
      entry.update(status="missing", error=f"benchmarks/{name}.py does not exist yet")
    elif isinstance(mod, Exception):
      entry.update(status="failed", error=f"import failed: {_one_line(mod)}")
    elif not callable(getattr(mod, "run", None)):
      entry.update(status="failed", error="the module has no run(quick) function")
    else:
      print(f"== {name}{' (quick)' if quick else ''}", file=sys.stderr, flush=True)
      start = time.perf_counter()
      try:
        rows = mod.run(quick)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
          raise TypeError(f"run() returned {type(rows).__name__}, not a list of dicts")
        entry.update(status="ok", rows=rows)
      except Exception as e:  # noqa: BLE001 - one failure must not lose the other tables
        traceback.print_exc()
        entry.update(status="failed", error=_one_line(e))
        if name in TUNIX_USERS and tunix_error:
          entry["error"] += f" ({tunix_error})"
      entry["seconds"] = round(time.perf_counter() - start, 1)
    results.append(entry)
  return {"machine": info, "date": datetime.datetime.now().astimezone().isoformat(
      timespec="seconds"), "quick": quick, "results": results}


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  return f"{type(e).__name__}: {text[:300]}"


def _cell(v: Any) -> str:
  if v is None:
    return ""
  if isinstance(v, bool):
    return str(v)
  if isinstance(v, float):
    if math.isnan(v):
      return "nan"
    return f"{v:,.0f}" if abs(v) >= 10_000 else f"{v:.4g}"
  return str(v).replace("|", "\\|").replace("\n", " ")


def table(rows: Sequence[dict]) -> str:
  """A markdown table; columns are the rows' keys in order of first appearance."""
  columns: list[str] = []
  for row in rows:
    columns += [k for k in row if k not in columns]
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


KEPT_BEGIN = "<!-- kept by benchmarks.run: accelerator figures -->"
KEPT_END = "<!-- end of kept figures -->"


def kept_sections(text: str) -> list[str]:
  """The blocks of an existing page between KEPT_BEGIN and KEPT_END (markers included):
  figures measured on a lent accelerator, which a CPU run cannot reproduce."""
  blocks, rest = [], text
  while KEPT_BEGIN in rest and KEPT_END in rest.split(KEPT_BEGIN, 1)[1]:
    rest = rest.split(KEPT_BEGIN, 1)[1]
    body, rest = rest.split(KEPT_END, 1)
    blocks.append(KEPT_BEGIN + body + KEPT_END)
  return blocks


def render(outcome: dict[str, Any], kept: Sequence[str] = ()) -> str:
  """BENCHMARKS.md from run_all's outcome, then the `kept` blocks of the old page."""
  m, flag = outcome["machine"], " --quick" if outcome["quick"] else ""
  names = ",".join(r["name"] for r in outcome["results"])
  out = ["# Benchmarks", "",
         (f"Measured {outcome['date']} with `python -m benchmarks.run{flag} --only={names}` "
          "(all tables in one run, on one machine). Ratios compare sides measured in the "
          "same run; absolute figures depend on the machine and its load."), "",
         "## Machine", "",
         table([{"cpu": m["cpu"], "cores": m["cores"], "memory GiB": m["memory_gib"],
                 "python": m["python"], "jax": m["jax"], "devices": m["devices"],
                 "load avg (1 min)": m["load_avg"],
                 "float32 matmul GFLOP/s (measured)": m["matmul_gflops"]}])]
  for r in outcome["results"]:
    out += ["", f"## {r['name']}", ""]
    if r["doc"]:
      out += [r["doc"], ""]
    out.append(f"Reproduce: `python -m benchmarks.{r['name']}{flag}`")
    if r["status"] == "ok":
      out += ["", table(r["rows"]) if r["rows"] else "(no rows)", "",
              f"({r['seconds']:.0f} s)"]
    else:
      out += ["", f"**{r['status']}**: {r['error']}"]
  for block in kept:
    out += ["", block]
  return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
  parser.add_argument("--only", default="", help="comma-separated benchmark names")
  parser.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
  args = parser.parse_args(argv)
  names = discover()
  if args.only:
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
      parser.error(f"unknown benchmark {unknown[0]!r}; known: {', '.join(names)}")
    names = wanted
  output = pathlib.Path(args.output)
  kept = kept_sections(output.read_text()) if output.exists() else []
  outcome = run_all(names, args.quick)
  text = render(outcome, kept)
  pathlib.Path(args.output).write_text(text)
  print(text)
  failed = [r["name"] for r in outcome["results"] if r["status"] == "failed"]
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
