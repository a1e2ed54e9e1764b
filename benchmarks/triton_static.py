"""Static check of the GPU flash kernels, no GPU needed: compile their Triton IR for
Hopper (sm_90) and read the machine code's resource use.

    python -m benchmarks.triton_static --triton-python=/path/to/venv/bin/python \
        [--arms=default,sweep] [--shape=4,8192,16,128]

Each arm's forward + backward is lowered for CUDA from this CPU host (as the lowering
tests do); Pallas prints each kernel's Triton IR, which a Python with the `triton`
package (`pip install triton` in its own venv: it is large, and not a dependency)
compiles to a cubin with the kernel's own num_warps / num_stages. The table gives per
kernel: registers per thread, spilled bytes of stack and the spill stores / loads
(STL / LDL) in the code, shared memory, the Hopper matmul instructions (HGMMA = wgmma;
HMMA = the older mma.sync, used when a block is too small for wgmma), MUFU (ex2, rcp:
the softmax's special-function work), shared-memory stores (STS + STSM: layout
conversions and transposes go through shared memory) and global atomics (ATOMG).

These are static counts from pip's Triton, not XLA's fork that compiles the kernels at
run time, so they predict rather than measure: a config that spills or needs more shared
memory than the 227 KiB an H100 / H200 block may use is worth dropping from a device
sweep, and a change that removes transposes shows up as fewer STS / BAR. Timing still
needs the device (`benchmarks/attention.py --accelerator-only`).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from kernels import gpu_target

SASS_OPS = ("HGMMA", "HMMA", "MUFU", "STS", "STSM", "LDS", "BAR", "ATOMG", "STL", "LDL")
HOPPER_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90

# Run by the Triton Python: compile one kernel's IR, print its resource use as JSON.
_COMPILE = r"""
import collections, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
path, warps, stages, arch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
kernel = triton_compile(path, target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=warps, num_stages=stages))
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
  f.write(kernel.asm["cubin"]); f.flush()
  usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name],
                         capture_output=True, text=True, check=True).stdout
  sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name],
                        capture_output=True, text=True, check=True).stdout
regs = re.search(r"REG:(\d+)", usage)
stack = re.search(r"STACK:(\d+)", usage)
ops = collections.Counter(
    m.split(".")[0] for m in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
print(json.dumps(dict(regs=int(regs.group(1)) if regs else None,
                      stack=int(stack.group(1)) if stack else None,
                      shared=int(kernel.metadata.shared), ops=dict(ops))))
"""


def clean_ir(text: str) -> str:
  """Pallas's debug print of a Triton module -> plain MLIR: drops the location
  annotations (`[unknown]`, `"name:"(#locN)`) and the location table after the module."""
  text = text[:text.rindex("\n}") + 2]
  lines = []
  for line in text.splitlines():
    line = re.sub(r'\s+\[unknown\]', "", line)
    line = re.sub(r'\s+"[^"]*"\(#loc\d*\)', "", line)
    lines.append(line)
  return "\n".join(lines) + "\n"


def kernel_ir(options: dict, shape=(4, 8192, 16, 128), causal: bool = True) -> list[dict]:
  """The GPU kernels of flash forward + backward with `options`: name, num_warps,
  num_stages and the Triton IR (plain MLIR), lowered for CUDA on this host."""
  fa = importlib.import_module("kernels.flash_attention")  # the module, not the function
  q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)

  def fwd_bwd(q, k, v):
    fn = lambda q, k, v: fa.flash_attention(  # noqa: E731
        q, k, v, backend="gpu", interpret=False, causal=causal,
        **{"gpu_forward": "triton", **options})  # the H200 target would take Mosaic
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(out)

  printed = io.StringIO()
  original = fa.pl.pallas_call
  fa.pl.pallas_call = functools.partial(original, debug=True)
  try:
    with contextlib.redirect_stdout(printed):
      with gpu_target("NVIDIA H200"):
        hlo = jax.jit(fwd_bwd).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    fa.pl.pallas_call = original
  launch = {m.group(1): (int(m.group(3)), int(m.group(2))) for m in re.finditer(
      r'name = "(flash_attention_\w+)".*?num_stages = (\d+).*?num_warps = (\d+)', hlo)}
  kernels = []
  for part in printed.getvalue().split("The Triton module for pallas_call")[1:]:
    module = part[part.index("module @"):].split("\nThe kernel jaxpr")[0]
    name = re.search(r"tt.func public @(\w+)", module).group(1)
    warps, stages = launch[name]
    kernels.append(dict(kernel=name, num_warps=warps, num_stages=stages,
                        ir=clean_ir(module)))
  return kernels


def compile_stats(kernel: dict, triton_python: str, arch: int = 90) -> dict:
  """Resource use of one kernel from `kernel_ir`, compiled by `triton_python`."""
  with tempfile.NamedTemporaryFile("w", suffix=".ttir") as f:
    f.write(kernel["ir"])
    f.flush()
    done = subprocess.run(
        [triton_python, "-c", _COMPILE, f.name, str(kernel["num_warps"]),
         str(kernel["num_stages"]), str(arch)],
        capture_output=True, text=True, env=dict(os.environ, TRITON_DEFAULT_FP_FUSION="1"))
  if done.returncode:
    return dict(note="failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:160])
  stats = json.loads(done.stdout.strip().splitlines()[-1])
  row = dict(regs=stats["regs"], stack_bytes=stats["stack"], shared_kib=stats["shared"] // 1024)
  row.update({op: stats["ops"].get(op, 0) for op in SASS_OPS})
  row["note"] = ("over the shared-memory limit" if stats["shared"] > HOPPER_SHARED_LIMIT
                 else "spills" if stats["ops"].get("STL", 0) else "")
  return row


def arms(names: str) -> list[tuple[str, dict]]:
  """default: the kernels' defaults; sweep: benchmarks/attention.py's backward arms."""
  attention = importlib.import_module("benchmarks.attention")
  out = []
  for name in names.split(","):
    if name == "default":
      out.append(("default", {}))
    elif name == "sweep":
      out += [(",".join(f"{k}={v}" for k, v in arm.items()), arm)
              for arm in attention.GPU_BWD_SWEEP]
    else:
      raise ValueError(f"unknown arm {name!r}: expected default or sweep")
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--triton-python", required=True,
                      help="a Python with the triton package (its own venv)")
  parser.add_argument("--arms", default="default,sweep")
  parser.add_argument("--shape", default="4,8192,16,128",
                      help="batch,length,heads,head_dim of q (and k, v)")
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  shape = tuple(int(x) for x in args.shape.split(","))
  rows = []
  for name, options in arms(args.arms):
    for kernel in kernel_ir(options, shape):
      if name != "default" and kernel["kernel"].endswith("_fwd"):
        continue  # the sweep's arms change only the backward kernels
      row = dict(arm=name, kernel=kernel["kernel"].removeprefix("flash_attention_"),
                 warps=kernel["num_warps"], stages=kernel["num_stages"])
      row.update(compile_stats(kernel, args.triton_python))
      print(f"  {row}", file=sys.stderr, flush=True)
      rows.append(row)
  if args.json:
    print(json.dumps(rows))
    return
  columns = list(collections.OrderedDict.fromkeys(k for r in rows for k in r))
  print("| " + " | ".join(columns) + " |")
  print("|" + "---|" * len(columns))
  for r in rows:
    print("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")


if __name__ == "__main__":
  main()
