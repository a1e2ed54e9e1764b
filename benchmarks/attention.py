"""Attention kernels side by side: memory and time, forward + backward.

    python -m benchmarks.attention [--quick] [--lengths=4096,16384,32768] [--json]

1. CPU, one device: chunked vs reference attention (causal, batch 1, 4 heads, 1 kv head,
   head_dim 64). Peak memory is the compiled program's (arguments + outputs + temporaries,
   from `memory_analysis()`, i.e. what XLA must allocate), not the process RSS. A
   configuration whose peak exceeds half the memory available at the time is compiled
   but not run ("does not fit"). Times are medians of warm runs of the jitted loss + gradients.
2. Ring attention over 8 fake CPU devices (zig-zag layout, chunked inner kernel): the
   largest per-device peak vs the single-device chunked and reference programs at the
   same total length. The fake devices share this machine's cores, so only the memory
   column is meaningful there. Runs in a subprocess when jax is already initialised
   with fewer than 8 CPU devices.
3. Only on a GPU / TPU: flash (Pallas) forward + backward TFLOP/s vs
   `jax.nn.dot_product_attention` with implementation 'xla' and (GPU) 'cudnn', causal,
   head_dim 128, 16 heads, bf16, batch * length = 32k tokens. FLOPs count the causal
   half: forward 2 * 2 * b * h * T^2 * d / 2, backward 2.5x the forward.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

if "jax" not in sys.modules:  # fake devices for the ring section; must precede jax
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np

import kernels

CPU_SHAPE = dict(batch=1, heads=4, kv_heads=1, head_dim=64)
FULL_LENGTHS = (4096, 16384, 32768)
QUICK_LENGTHS = (1024, 4096)
FIT_FRACTION = 0.5  # of the memory available when the benchmark starts
MiB = 2**20


def _available_bytes() -> int:
  """MemAvailable from /proc/meminfo (other processes' memory is left alone), else RAM."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _inputs(length, batch, heads, kv_heads, head_dim, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (batch, length, heads, head_dim), dtype)
  k = jax.random.normal(ks[1], (batch, length, kv_heads, head_dim), dtype)
  v = jax.random.normal(ks[2], (batch, length, kv_heads, head_dim), dtype)
  return q, k, v


def _loss_and_grads(attention):
  def loss(q, k, v):
    return jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _peak_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def _median_seconds(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # warm (compiled already; first run allocates)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _measure(name, attention, args, repeats, **row):
  """Compiles, reads the peak memory, and times the run if it fits in RAM."""
  fn = _loss_and_grads(attention)
  compiled = fn.lower(*args).compile()
  peak = _peak_bytes(compiled)
  row = dict(benchmark=row.pop("benchmark"), implementation=name, **row,
             peak_mib=round(peak / MiB, 1))
  if peak > FIT_FRACTION * _available_bytes():
    row.update(time_ms=None, note=f"does not fit: needs {peak / 2**30:.1f} GiB")
  else:
    row.update(time_ms=round(1e3 * _median_seconds(compiled, args, repeats), 1), note="")
  print(f"  {row}", file=sys.stderr, flush=True)  # progress: long lengths take minutes
  return row


def chunked_vs_reference(lengths, repeats) -> list[dict]:
  rows = []
  for length in lengths:
    args = _inputs(length, **CPU_SHAPE)
    pair = []
    for name, attention in (
        ("reference", kernels.reference_attention),
        ("chunked", lambda q, k, v: kernels.chunked_attention(q, k, v, chunk_size=512))):
      pair.append(_measure(name, attention, args, repeats if length <= 4096 else 1,
                           benchmark="cpu fwd+bwd", length=length))
    ref, chunked = pair
    chunked["memory_vs_reference"] = round(chunked["peak_mib"] / ref["peak_mib"], 3)
    if ref["time_ms"] and chunked["time_ms"]:
      chunked["time_vs_reference"] = round(chunked["time_ms"] / ref["time_ms"], 2)
    rows += pair
  return rows


def ring_memory(length: int) -> list[dict]:
  """Per-device peak of ring attention on 8 CPU devices vs one device."""
  mesh = jax.make_mesh((8,), ("sp",))
  args = _inputs(length, **CPU_SHAPE)
  ring = lambda q, k, v: kernels.ring_attention_sharded(
      q, k, v, mesh=mesh, axis_name="sp", layout="zigzag", block_kernel="chunked",
      chunk_size=512)
  rows = [_measure("ring x8 (per device)", ring, args, 1, benchmark="ring fwd+bwd",
                   length=length)]
  for name, attention in (
      ("chunked x1", lambda q, k, v: kernels.chunked_attention(q, k, v, chunk_size=512)),
      ("reference x1", kernels.reference_attention)):
    rows.append(_measure(name, attention, args, 1, benchmark="ring fwd+bwd", length=length))
  for row in rows[1:]:
    row["ring_memory_ratio"] = round(rows[0]["peak_mib"] / row["peak_mib"], 3)
  rows[0]["note"] = (rows[0]["note"] + " 8 fake devices share the CPU").strip()
  return rows


def _ring_rows(length: int) -> list[dict]:
  if len(jax.devices("cpu")) >= 8:
    return ring_memory(length)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"))
  out = subprocess.run([sys.executable, "-m", "benchmarks.attention", "--ring-only",
                        f"--ring-length={length}", "--json"], env=env, check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def accelerator_flops(lengths, repeats, heads=16, head_dim=128, tokens=32768) -> list[dict]:
  """Flash vs jax.nn.dot_product_attention on the current GPU / TPU."""
  backend = jax.default_backend()
  impls = [("flash (pallas)", lambda q, k, v: kernels.flash_attention(q, k, v, causal=True)),
           ("jax xla", lambda q, k, v: jax.nn.dot_product_attention(
               q, k, v, is_causal=True, implementation="xla"))]
  if backend == "gpu":
    impls.append(("jax cudnn", lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")))
  rows = []
  for length in lengths:
    batch = max(1, tokens // length)
    args = _inputs(length, batch, heads, heads, head_dim, jnp.bfloat16)
    fwd_flops = 4 * batch * heads * length**2 * head_dim / 2
    flops = 3.5 * fwd_flops
    results = {}
    for name, attention in impls:
      try:
        fn = jax.jit(jax.grad(lambda q, k, v, f=attention: jnp.sum(f(q, k, v).astype(
            jnp.float32)), argnums=(0, 1, 2)))
        results[name] = _median_seconds(fn, args, repeats)
      except Exception as e:  # e.g. cuDNN without a supported configuration
        results[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    jax_times = [t for n, t in results.items() if n != "flash (pallas)" and
                 isinstance(t, float)]
    for name, seconds in results.items():
      row = dict(benchmark=f"{backend} fwd+bwd", implementation=name, length=length,
                 batch=batch, time_ms=None, tflops=None, note="")
      if isinstance(seconds, float):
        row.update(time_ms=round(1e3 * seconds, 2), tflops=round(flops / seconds / 1e12, 1))
        if name == "flash (pallas)" and jax_times:
          row["flash_vs_best_jax"] = round(min(jax_times) / seconds, 2)
      else:
        row["note"] = seconds
      rows.append(row)
  return rows


def run(quick: bool = False, lengths=None) -> list[dict]:
  """All sections; `quick` uses shorter lengths and fewer repeats."""
  lengths = tuple(lengths or (QUICK_LENGTHS if quick else FULL_LENGTHS))
  repeats = 2 if quick else 3
  rows = chunked_vs_reference(lengths, repeats)
  rows += _ring_rows(max(lengths))
  if jax.default_backend() in ("gpu", "tpu"):
    rows += accelerator_flops((4096, 8192) if quick else (4096, 8192, 16384, 32768),
                              repeats)
  return rows


def print_table(rows) -> None:
  columns = []
  for row in rows:
    columns += [c for c in row if c not in columns]
  columns = [c for c in columns if c != "note"] + ["note"]
  cells = [[("" if row.get(c) is None and c != "time_ms" else
             "n/a" if row.get(c) is None else str(row[c])) for c in columns]
           for row in rows]
  widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
  print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
  for r in cells:
    print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")])
  parser.add_argument("--ring-only", action="store_true")
  parser.add_argument("--ring-length", type=int, default=FULL_LENGTHS[-1])
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  rows = (ring_memory(args.ring_length) if args.ring_only
          else run(args.quick, args.lengths))
  if args.json:
    print(json.dumps(rows))
  else:
    print(f"jax {jax.__version__}, {jax.default_backend()}, {len(jax.devices())} devices")
    print_table(rows)


if __name__ == "__main__":
  main()
