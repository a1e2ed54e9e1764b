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
   Then ALiBi's cost: chunked attention with BLOOM's slopes vs without, same shapes.
3. Packed rows: the block pairs the causal flash kernels compute for one 16k-token row
   holding 1-16 equal sequences, counted from the kernels' range functions (segment ids
   let a q block skip the other sequences' kv blocks).
4. Only on a GPU / TPU: flash (Pallas) forward + backward TFLOP/s vs
   `jax.nn.dot_product_attention` with implementation 'xla' and (GPU) 'cudnn', causal,
   head_dim 128, 16 heads, bf16, batch * length = 32k tokens. FLOPs count the causal
   half: forward 2 * 2 * b * h * T^2 * d / 2, backward 2.5x the forward ("flash alibi":
   the default flash kernels with ALiBi's slopes, BLOOM's for 16 heads). Then packed
   rows timed: one 16k row of 8 sequences without segment ids, with them, and as 16
   separate 2k sequences.
"""
from __future__ import annotations

import argparse
import functools
import importlib
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


def _inputs(length, batch, heads, kv_heads, head_dim, dtype=jnp.float32, key=None):
  ks = jax.random.split(jax.random.key(0) if key is None else key, 3)
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


def _side_by_side(arms, lengths, repeats, against: str) -> list[dict]:
  """Two arms (name, attention) at each length on CPU_SHAPE's inputs, the second's peak
  and time as fractions of the first's (memory_vs_`against`, time_vs_`against`)."""
  rows = []
  for length in lengths:
    args = _inputs(length, **CPU_SHAPE)
    first, second = [_measure(name, attention, args, repeats if length <= 4096 else 1,
                              benchmark="cpu fwd+bwd", length=length)
                     for name, attention in arms]
    second[f"memory_vs_{against}"] = round(second["peak_mib"] / first["peak_mib"], 3)
    if first["time_ms"] and second["time_ms"]:
      second[f"time_vs_{against}"] = round(second["time_ms"] / first["time_ms"], 2)
    rows += [first, second]
  return rows


def chunked_vs_reference(lengths, repeats) -> list[dict]:
  return _side_by_side(
      (("reference", kernels.reference_attention),
       ("chunked", lambda q, k, v: kernels.chunked_attention(q, k, v, chunk_size=512))),
      lengths, repeats, "reference")


def alibi_slopes(heads: int):
  """BLOOM's / MPT's ALiBi slopes for `heads` query heads, float32 [heads]."""
  p = 1 << (heads - 1).bit_length()
  slopes = [2.0 ** (-8.0 * (i + 1) / p) for i in range(p)]
  return jnp.asarray((slopes[1::2] + slopes[::2])[:heads] if p != heads else slopes,
                     jnp.float32)


def alibi_vs_plain(lengths, repeats) -> list[dict]:
  """Chunked attention with ALiBi's biases vs without, forward + backward on CPU."""
  slopes = alibi_slopes(CPU_SHAPE["heads"])
  return _side_by_side(
      [(name, lambda q, k, v, s=s: kernels.chunked_attention(q, k, v, chunk_size=512,
                                                             alibi_slopes=s))
       for name, s in (("chunked", None), ("chunked alibi", slopes))],
      lengths, repeats, "plain")


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
  # A causal sliding window of 1/16 of the length: the ring stops after the shards it
  # reaches (2 of 8 steps), against the same window on one device.
  window = length // 16
  ring_lib = importlib.import_module("kernels.ring_attention")
  windowed = lambda q, k, v: kernels.ring_attention_sharded(  # noqa: E731
      q, k, v, mesh=mesh, axis_name="sp", sliding_window=window, block_kernel="chunked",
      chunk_size=512)
  pair = [_measure(f"ring x8 window {window} (per device)", windowed, args, 1,
                   benchmark="ring fwd+bwd", length=length),
          _measure(f"chunked x1 window {window}", lambda q, k, v: kernels.chunked_attention(
              q, k, v, chunk_size=512, sliding_window=window), args, 1,
                   benchmark="ring fwd+bwd", length=length)]
  pair[0].update(ring_steps=ring_lib.window_steps(window, length // 8, 8),
                 ring_memory_ratio=round(pair[0]["peak_mib"] / pair[1]["peak_mib"], 3),
                 note="8 fake devices share the CPU")
  if pair[0]["time_ms"] and rows[0]["time_ms"]:
    pair[0]["time_vs_full_ring"] = round(pair[0]["time_ms"] / rows[0]["time_ms"], 2)
  return rows + pair


def _ring_rows(length: int) -> list[dict]:
  if len(jax.devices("cpu")) >= 8:
    return ring_memory(length)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"))
  out = subprocess.run([sys.executable, "-m", "benchmarks.attention", "--ring-only",
                        f"--ring-length={length}", "--json"], env=env, check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


# Flash launch options tried at one length before the table: forward (block_q, block_kv,
# num_warps, num_stages) timed alone, then backward options with the best forward. The
# first arm of each is the current default. Backward arms: the dk/dv kernel's blocks
# (block_q_bwd = q rows a step, block_kv_bwd = kv rows a program), the dq kernel's own
# blocks (q rows a program, kv rows a step; default the same), or dq by atomic adds.
# `python -m benchmarks.triton_static` screens arms without a GPU (registers, spills,
# shared memory of each kernel's machine code).
GPU_FWD_SWEEP = ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3))


def _bwd_arm(bq, bk, warps, stages, dq=None, atomic=False):
  arm = dict(block_q_bwd=bq, block_kv_bwd=bk, num_warps_bwd=warps, num_stages_bwd=stages)
  if dq:
    arm.update(block_q_dq=dq[0], block_kv_dq=dq[1])
  return dict(arm, dq_atomic=True) if atomic else arm


GPU_BWD_SWEEP = (
    _bwd_arm(64, 64, 4, 2),
    _bwd_arm(64, 64, 4, 3),
    _bwd_arm(32, 64, 4, 2, dq=(64, 64)),
    _bwd_arm(64, 64, 8, 2),  # 2x slower than 4 warps before the kv-major dk/dv kernel
    _bwd_arm(32, 128, 8, 2, dq=(128, 32)),  # Triton's tutorial shapes (8 warps at d 128)
    _bwd_arm(32, 64, 4, 2, atomic=True),
    _bwd_arm(64, 64, 8, 3, atomic=True),
)
ACCEL_LENGTHS = (4096, 8192, 16384, 32768)
XLA_MAX_LENGTH = 16384  # beyond this the materialised scores take most of the card


def _attention_inputs(key, batch, length, heads, kv_heads, head_dim, dtype=jnp.bfloat16):
  """q, k, v and a random output cotangent (timing on ones or zeros flatters kernels)."""
  key, do_key = jax.random.split(key)
  q, k, v = _inputs(length, batch, heads, kv_heads, head_dim, dtype, key)
  return q, k, v, jax.random.normal(do_key, q.shape, dtype)


def _fwd_and_bwd(attention):
  """(jitted forward, jitted forward + backward with a given cotangent)."""
  fwd = jax.jit(lambda q, k, v, do: attention(q, k, v))

  def both(q, k, v, do):
    out, vjp = jax.vjp(attention, q, k, v)
    return out, vjp(do)
  return fwd, jax.jit(both)


def _time_or_error(fn, args, repeats: int):
  """Median seconds of warm runs, or a one-line failure (e.g. no cuDNN configuration)."""
  try:
    jax.block_until_ready(fn(*args))  # compiles
    return _median_seconds(fn, args, repeats)
  except Exception as e:  # pylint: disable=broad-except
    return f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


def _flash(**options):
  return lambda q, k, v: kernels.flash_attention(q, k, v, causal=True, **options)


def _rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


ACCEL_CHECKS = (  # name, shape (batch, length, heads, kv_heads, head_dim[, kv_length]),
    # mask options[, flash options]. On an H200 the forward runs the Mosaic GPU kernel
    # by default wherever it can (no segment ids), the backward the Triton kernels; the
    # Mosaic backward and Mosaic with segment ids where asked.
    ("causal gqa ragged", (2, 1000, 8, 2, 128), dict(causal=True)),
    ("causal gqa ragged, triton forward", (2, 1000, 8, 2, 128), dict(causal=True),
     dict(gpu_forward="triton")),
    ("causal gqa ragged, triton backward", (2, 1000, 8, 2, 128), dict(causal=True),
     dict(gpu_backward="triton")),
    ("segments, triton", (2, 640, 8, 2, 128), dict(causal=True, segments=True),
     dict(gpu_forward="triton", gpu_backward="triton")),
    ("causal, q shorter than kv", (2, 300, 4, 2, 128, 1000), dict(causal=True)),
    ("causal, q longer than kv (rows with no key)", (1, 1000, 4, 2, 128, 300),
     dict(causal=True)),
    ("non-causal window", (1, 1100, 4, 4, 128), dict(causal=False, sliding_window=200)),
    ("causal d256", (1, 640, 4, 2, 256), dict(causal=True)),
    ("causal gqa ragged, mosaic backward", (2, 1000, 8, 2, 128), dict(causal=True),
     dict(gpu_backward="mosaic")),
    ("q shorter than kv, window + soft cap, mosaic backward", (1, 700, 4, 2, 128, 1500),
     dict(causal=True, sliding_window=300, logits_soft_cap=30.0),
     dict(gpu_backward="mosaic")),
    ("non-causal mqa d64, mosaic backward", (1, 777, 4, 1, 64), dict(causal=False),
     dict(gpu_backward="mosaic")),
    ("segments, mosaic forward + backward", (2, 640, 8, 2, 128),
     dict(causal=True, segments=True), dict(gpu_forward="mosaic", gpu_backward="mosaic")),
    ("non-causal mqa d64", (1, 777, 4, 1, 64), dict(causal=False)),
    ("segments", (2, 640, 4, 4, 128), dict(causal=True, segments=True)),
    ("segments, mosaic forward", (2, 640, 4, 4, 128), dict(causal=True, segments=True),
     dict(gpu_forward="mosaic")),
    ("segments + window, mosaic forward", (1, 1100, 4, 2, 128),
     dict(causal=True, segments=True, sliding_window=150), dict(gpu_forward="mosaic")),
    ("window + soft cap", (1, 1536, 4, 2, 128),
     dict(causal=True, sliding_window=300, logits_soft_cap=30.0)),
    # ALiBi (BLOOM's slopes): the forward then runs the Triton kernel.
    ("causal gqa ragged, alibi", (2, 1000, 8, 2, 128), dict(causal=True, alibi=True)),
    ("segments + window + soft cap, alibi", (2, 1100, 6, 2, 128),
     dict(causal=True, segments=True, sliding_window=300, logits_soft_cap=30.0, alibi=True)),
    ("non-causal mqa d64, alibi, dq atomic", (1, 777, 4, 1, 64),
     dict(causal=False, alibi=True), dict(dq_atomic=True)),
    # The backward variants the sweep may pick (flash-only options after the mask's).
    ("causal gqa ragged, dq atomic", (2, 1000, 8, 2, 128), dict(causal=True),
     dict(dq_atomic=True)),
    ("segments, dq blocks 128x32", (2, 640, 4, 4, 128), dict(causal=True, segments=True),
     dict(block_q_bwd=32, block_kv_bwd=128, block_q_dq=128, block_kv_dq=32)),
)


def accelerator_check(options=None, only=None) -> list[dict]:
  """Flash (bf16) vs the f32 reference on the device: ||x - ref|| / ||ref|| of the
  output and of dq, dk, dv, on fresh random inputs. bf16 lands near 1e-2 at most.
  `only`: substrings; the checks whose names contain none of them are left out."""
  rows = []
  for i, (name, (b, t, h, kvh, d, *tk), opts, *flash_opts) in enumerate(ACCEL_CHECKS):
    if only is not None and not any(part in name for part in only):
      continue
    opts = dict(opts)
    flash_opts = dict(options or {}, **(flash_opts[0] if flash_opts else {}))
    q, k, v, do = _attention_inputs(jax.random.key(100 + i), b, t, h, kvh, d)
    if tk:  # another kv length
      _, k, v, _ = _attention_inputs(jax.random.key(200 + i), b, tk[0], h, kvh, d)
    seg = None
    if opts.pop("segments", False):
      seg = jnp.asarray(np.repeat(np.arange(1, 6), -(-t // 5))[:t][None].repeat(b, 0))
      seg = seg.at[:, -37:].set(0)
      opts.update(q_segment_ids=seg, kv_segment_ids=seg)
    if opts.pop("alibi", False):
      opts["alibi_slopes"] = alibi_slopes(h)

    def run(fn, *args):
      out, vjp = jax.vjp(fn, *args)
      return (out, *vjp(do.astype(out.dtype)))
    flash = lambda q, k, v: kernels.flash_attention(q, k, v, **opts, **flash_opts)
    ref = lambda q, k, v: kernels.reference_attention(q, k, v, **opts)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    try:
      got = jax.jit(functools.partial(run, flash))(q, k, v)
      want = jax.jit(functools.partial(run, ref))(*f32)
      errs = [_rel_err(g, w) for g, w in zip(got, want)]
      ok = all(np.isfinite(errs)) and max(errs) < 2e-2
      row = dict(benchmark="accuracy bf16 vs f32 reference", implementation=name,
                 out=round(errs[0], 5), dq=round(errs[1], 5), dk=round(errs[2], 5),
                 dv=round(errs[3], 5), note="ok" if ok else "FAIL")
    except Exception as e:  # pylint: disable=broad-except
      row = dict(benchmark="accuracy bf16 vs f32 reference", implementation=name,
                 note=f"failed: {type(e).__name__}: {' | '.join(str(e).splitlines())[:600]}")
    print(f"  {row}", file=sys.stderr, flush=True)
    rows.append(row)
  return rows


def _flops(batch, heads, length, head_dim) -> tuple[float, float]:
  """Causal (forward, forward + backward) FLOPs: 2 matmuls forward, 5 backward."""
  fwd = 4 * batch * heads * length**2 * head_dim / 2
  return fwd, 3.5 * fwd


def accelerator_sweep(repeats: int, length: int = 8192, heads: int = 16,
                      head_dim: int = 128, tokens: int = 32768, fwd_sweep=GPU_FWD_SWEEP,
                      bwd_sweep=GPU_BWD_SWEEP):
  """Times flash's launch options at one length; returns (rows, best options)."""
  batch = max(1, tokens // length)
  args = _attention_inputs(jax.random.key(1), batch, length, heads, heads, head_dim)
  fwd_flops, all_flops = _flops(batch, heads, length, head_dim)
  rows, best_fwd, best = [], None, None
  for bq, bk, warps, stages in fwd_sweep:
    opts = dict(block_q=bq, block_kv=bk, num_warps=warps, num_stages=stages)
    seconds = _time_or_error(_fwd_and_bwd(_flash(**opts))[0], args, repeats)
    rows.append(_sweep_row("sweep fwd", opts, length, batch, seconds, fwd_flops))
    if isinstance(seconds, float) and (best_fwd is None or seconds < best_fwd[0]):
      best_fwd = (seconds, opts)
  fwd_opts = best_fwd[1] if best_fwd else {}
  for arm in bwd_sweep:
    opts = dict(fwd_opts, **arm)
    seconds = _time_or_error(_fwd_and_bwd(_flash(**opts))[1], args, repeats)
    rows.append(_sweep_row("sweep fwd+bwd", opts, length, batch, seconds, all_flops))
    if isinstance(seconds, float) and (best is None or seconds < best[0]):
      best = (seconds, opts)
  return rows, (best[1] if best else fwd_opts)


def _sweep_row(benchmark, opts, length, batch, seconds, flops) -> dict:
  row = dict(benchmark=benchmark, implementation="flash " + ",".join(
      f"{k}={v}" for k, v in opts.items()), length=length, batch=batch)
  if isinstance(seconds, float):
    row.update(time_ms=round(1e3 * seconds, 2), tflops=round(flops / seconds / 1e12, 1),
               note="")
  else:
    row.update(time_ms=None, tflops=None, note=seconds)
  print(f"  {row}", file=sys.stderr, flush=True)
  return row


ARMS = ("flash (pallas)", "flash mosaic", "flash triton", "flash alibi", "jax xla",
        "jax cudnn")


def accelerator_flops(lengths, repeats, heads=16, head_dim=128, tokens=32768,
                      flash_options=None, kv_heads=None, arms=ARMS) -> list[dict]:
  """Flash vs jax.nn.dot_product_attention ('xla', and 'cudnn' on GPU), causal, bf16,
  forward alone and forward + backward, batch * length = `tokens`. `arms`: the names
  (of ARMS) to time; the GPU-only ones are left out elsewhere."""
  backend = jax.default_backend()
  kv_heads = heads if kv_heads is None else kv_heads
  impls = [("flash (pallas)", _flash(**(flash_options or {})))]
  if backend == "gpu":  # the default (on Hopper: the Mosaic forward, the Triton
    # backward) against all-Mosaic and all-Triton
    impls.append(("flash mosaic", _flash(**dict(flash_options or {}, gpu_forward="mosaic",
                                                gpu_backward="mosaic", dq_atomic=False))))
    impls.append(("flash triton", _flash(**dict(flash_options or {}, gpu_forward="triton",
                                                gpu_backward="triton"))))
  slopes = alibi_slopes(heads)
  impls.append(("flash alibi", _flash(**dict(flash_options or {}, alibi_slopes=slopes))))
  impls.append(("jax xla", lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla")))
  if backend == "gpu":
    impls.append(("jax cudnn", lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")))
  impls = [(name, fn) for name, fn in impls if name in arms]
  rows = []
  for length in lengths:
    batch = max(1, tokens // length)
    args = _attention_inputs(jax.random.key(length), batch, length, heads, kv_heads,
                             head_dim)
    fwd_flops, all_flops = _flops(batch, heads, length, head_dim)
    results = {}
    for name, attention in impls:
      if name == "jax xla" and length > XLA_MAX_LENGTH:
        results[name] = (f"skipped: materialises {batch * heads * length**2 * 4 / 2**30:.0f}"
                         " GiB of f32 scores",) * 2
        continue
      fwd, both = _fwd_and_bwd(attention)
      results[name] = (_time_or_error(fwd, args, repeats), _time_or_error(both, args, repeats))
    for mode, idx, flops in (("fwd", 0, fwd_flops), ("fwd+bwd", 1, all_flops)):
      others = {n: r[idx] for n, r in results.items() if n != "flash (pallas)"}
      for name, res in results.items():
        seconds = res[idx]
        row = dict(benchmark=f"{backend} {mode}" + (f" gqa {heads}:{kv_heads}"
                                                    if kv_heads != heads else ""),
                   implementation=name, length=length, batch=batch, time_ms=None,
                   tflops=None, note="")
        if isinstance(seconds, float):
          row.update(time_ms=round(1e3 * seconds, 2), tflops=round(flops / seconds / 1e12, 1))
          for other, t in others.items():  # the default against every other arm,
            # each flash arm against the peers
            if isinstance(t, float) and (name == "flash (pallas)" or (
                name.startswith("flash") and other.startswith("jax"))):
              row[f"flash_vs_{other.split()[-1]}"] = round(t / seconds, 2)
        else:
          row["note"] = seconds
        print(f"  {row}", file=sys.stderr, flush=True)
        rows.append(row)
  return rows


def _packed_segments(rows: int, length: int, sequences: int):
  """[rows, length] int32 ids: `sequences` equal sequences per row, as packing lays them."""
  ids = np.repeat(np.arange(1, sequences + 1, dtype=np.int32), length // sequences)
  return jnp.asarray(np.broadcast_to(np.pad(ids, (0, length - ids.size)), (rows, length)))


def packed_blocks(length: int = 16384, sequences=(1, 2, 4, 8, 16)) -> list[dict]:
  """Block pairs the causal flash kernels compute for one packed row (counted from the
  kernels' own range functions, no kernel run): with segment ids each q block visits
  only the kv blocks of its own sequences, and only the pairs a sequence boundary or
  the diagonal cuts through apply the element mask (before, every visited pair did)."""
  fa = importlib.import_module("kernels.flash_attention")  # the module, not the function
  rows = []
  for backend in ("tpu", "gpu"):
    q = jax.ShapeDtypeStruct((1, length, 1, 128), jnp.bfloat16)
    cfg = fa.make_config(q, q, causal=True, segments=True, backend=backend, interpret=True)
    causal = sum(int(hi) - int(lo) + 1 for lo, hi in
                 (fa.kv_block_range(cfg, qi) for qi in range(cfg.num_q_blocks)))
    for n in sequences:
      seg = _packed_segments(1, length, n)
      ranges = np.asarray(fa.segment_block_ranges(seg, seg, cfg.block_q, cfg.block_kv)[0][0])
      visited = unmasked = 0
      for qi in range(cfg.num_q_blocks):
        lo, hi = (int(x) for x in fa.kv_block_range(cfg, qi))
        visited += max(0, min(hi, ranges[qi, 1]) - max(lo, ranges[qi, 0]) + 1)
        lo, hi = (int(x) for x in fa.kv_full_range(cfg, qi, tuple(ranges[qi, 2:])))
        unmasked += max(0, hi - lo + 1)
      rows.append(dict(benchmark=f"packed row, {backend} blocks {cfg.block_q}x{cfg.block_kv}",
                       length=length, sequences=n, causal_blocks=causal,
                       visited_blocks=int(visited), fraction=round(float(visited / causal), 3),
                       masked_blocks=int(visited - unmasked)))
  return rows


def accelerator_packed(repeats: int, length: int = 16384, sequences: int = 8, heads=16,
                       head_dim=128, flash_options=None) -> list[dict]:
  """Causal flash forward + backward on rows packing `sequences` sequences each: without
  segment ids (attends across sequences, every causal block), with them (skips the
  other sequences' blocks), and the same tokens as separate unpadded sequences (the
  work segment skipping can at best match)."""
  opts = flash_options or {}
  seg = _packed_segments(2, length, sequences)
  with_ids = lambda q, k, v: kernels.flash_attention(  # noqa: E731
      q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, **opts)
  arms = (("one row, no segment ids", 2, length, _flash(**opts)),
          (f"{sequences} packed sequences per row", 2, length, with_ids),
          (f"{2 * sequences} separate sequences", 2 * sequences, length // sequences,
           _flash(**opts)))
  if jax.default_backend() == "gpu":  # the Mosaic GPU kernels on the same packed rows
    mosaic = dict(opts, gpu_forward="mosaic", gpu_backward="mosaic")
    arms += ((f"{sequences} packed sequences per row, mosaic", 2, length,
              lambda q, k, v: kernels.flash_attention(
                  q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, **mosaic)),)
  rows = []
  for name, batch, seq_len, attention in arms:
    args = _attention_inputs(jax.random.key(seq_len), batch, seq_len, heads, heads, head_dim)
    seconds = _time_or_error(_fwd_and_bwd(attention)[1], args, repeats)
    row = dict(benchmark=f"{jax.default_backend()} packed fwd+bwd", implementation=name,
               length=seq_len, batch=batch, time_ms=None, note="")
    if isinstance(seconds, float):
      row["time_ms"] = round(1e3 * seconds, 2)
    else:
      row["note"] = seconds
    print(f"  {row}", file=sys.stderr, flush=True)
    rows.append(row)
  return rows


def accelerator(quick: bool = False, sweep: bool = True, out: str | None = None,
                repeats: int = 5, lengths=None, fwd_sweep=GPU_FWD_SWEEP,
                bwd_sweep=GPU_BWD_SWEEP, checks=None, arms=ARMS) -> list[dict]:
  """The accelerator section: accuracy on the device, the launch-option sweep (GPU),
  then the TFLOP/s table with the best options. `out`: a JSON file rewritten after
  each part, so a run cut short keeps what it measured."""
  rows: list[dict] = []

  def save(new):
    rows.extend(new)
    if out:
      with open(out, "w") as f:
        json.dump(rows, f)

  gpu = jax.default_backend() == "gpu"
  save(accelerator_check(only=checks))
  options = None
  if gpu and sweep:
    sweep_rows, options = accelerator_sweep(repeats, length=1024 if quick else 8192,
                                            fwd_sweep=fwd_sweep, bwd_sweep=bwd_sweep)
    save(sweep_rows)
    save([dict(benchmark="chosen flash options", implementation=str(options))])
  lengths = tuple(lengths or ((512, 1024) if quick else ACCEL_LENGTHS))
  save(accelerator_flops(lengths, repeats, flash_options=options, arms=arms))
  save(accelerator_flops(lengths[1:2], repeats, flash_options=options, kv_heads=4,
                         arms=arms))
  save(accelerator_packed(repeats, length=2048 if quick else 16384, flash_options=options))
  return rows


def run(quick: bool = False, lengths=None) -> list[dict]:
  """All sections; `quick` uses shorter lengths and fewer repeats."""
  lengths = tuple(lengths or (QUICK_LENGTHS if quick else FULL_LENGTHS))
  repeats = 2 if quick else 3
  rows = chunked_vs_reference(lengths, repeats)
  rows += alibi_vs_plain(lengths[:2], repeats)
  rows += _ring_rows(max(lengths))
  rows += packed_blocks()
  if jax.default_backend() in ("gpu", "tpu"):
    rows += accelerator(quick)
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


def _bwd_arms(text: str) -> tuple[dict, ...]:
  """--bwd-sweep items: 4 or 6 numbers joined by x, optionally ending in x atomic."""
  arms = []
  for item in text.split(","):
    parts = item.split("x")
    atomic = parts[-1] == "atomic"
    numbers = [int(x) for x in (parts[:-1] if atomic else parts)]
    if len(numbers) not in (4, 6):
      raise argparse.ArgumentTypeError(f"bad backward arm {item!r}: want 4 or 6 numbers")
    arms.append(_bwd_arm(*numbers[:4], dq=numbers[4:] or None, atomic=atomic))
  return tuple(arms)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")])
  parser.add_argument("--ring-only", action="store_true")
  parser.add_argument("--ring-length", type=int, default=FULL_LENGTHS[-1])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--accelerator-only", action="store_true",
                      help="only the device section: accuracy, option sweep, TFLOP/s")
  parser.add_argument("--no-sweep", action="store_true")
  options = lambda text: tuple(tuple(int(x) for x in item.split("x"))  # noqa: E731
                               for item in text.split(","))
  parser.add_argument("--fwd-sweep", type=options, default=GPU_FWD_SWEEP,
                      help="forward options to try, e.g. 128x64x8x3,128x128x8x2 "
                      "(block_q x block_kv x num_warps x num_stages)")
  parser.add_argument("--bwd-sweep", type=_bwd_arms, default=GPU_BWD_SWEEP,
                      help="backward options to try, e.g. 64x64x4x2,32x128x4x2x128x32,"
                      "64x64x4x2xatomic (block_q_bwd x block_kv_bwd x num_warps_bwd x "
                      "num_stages_bwd [x block_q_dq x block_kv_dq] [x atomic: dq_atomic])")
  parser.add_argument("--checks", type=lambda s: [x for x in s.split(",") if x],
                      help="only the accuracy checks whose names contain one of these "
                      "comma-separated substrings ('' for none)")
  parser.add_argument("--arms", type=lambda s: s.split(","), default=ARMS,
                      help=f"TFLOP/s table arms, comma-separated, of {', '.join(ARMS)}")
  parser.add_argument("--out", help="JSON file for the accelerator rows (rewritten as "
                      "each part finishes)")
  args = parser.parse_args(argv)
  if set(args.arms) - set(ARMS):
    parser.error(f"--arms: unknown {sorted(set(args.arms) - set(ARMS))}; known: {ARMS}")
  if args.ring_only:
    rows = ring_memory(args.ring_length)
  elif args.accelerator_only:
    rows = accelerator(args.quick, sweep=not args.no_sweep, out=args.out,
                       lengths=args.lengths, fwd_sweep=args.fwd_sweep,
                       bwd_sweep=args.bwd_sweep, checks=args.checks, arms=args.arms)
  else:
    rows = run(args.quick, args.lengths)
  if args.json:
    print(json.dumps(rows))
  else:
    print(f"jax {jax.__version__}, {jax.default_backend()}, {len(jax.devices())} devices")
    print_table(rows)


if __name__ == "__main__":
  main()
