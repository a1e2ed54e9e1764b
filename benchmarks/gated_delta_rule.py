"""Gated delta rule (Qwen3.5's linear attention): the chunked form against the per-token
recurrence, forward and forward + backward, on this CPU.

    python -m benchmarks.gated_delta_rule [--lengths=512,2048,8192] [--reps=5]
    python -m benchmarks.gated_delta_rule --mixer=mamba2   # gated linear attention
    python -m benchmarks.gated_delta_rule --mixer=mamba1   # Mamba 1's selective scan
    python -m benchmarks.gated_delta_rule --conv_tpu=v5p:2x2x1   # libtpu, no TPU

Both arms compute the same outputs (`kernels.gated_delta_rule` and
`kernels.gated_delta_rule_reference`, checked equal here) for one row of Qwen3.5-shaped
heads scaled down (4 key heads, 8 value heads, 64 features each). Prints the median wall
time of each and XLA's temporary bytes of the compiled forward + backward. With
--mixer=mamba2 the arms are `kernels.gated_linear_attention` (chunks of 64) and its
per-token reference over Mamba2-shaped heads (one group of B and C with a state of 64, 8
heads of 64), v = x dt and g = dt A as `Mamba2` gives them. With --mixer=mamba1 they are
`kernels.selective_scan` (chunks of 64, stepped through token by token: its CPU default),
the same with an associative scan within each chunk ("assoc", its accelerator default),
and its per-token reference over a Mamba 1 layer scaled down (512 channels, a state of
16, one B and C for all), as `Mamba1` gives them.
"""
from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from benchmarks.attention import _median_seconds

MIB = 1 << 20


def _inputs(length: int, hk: int = 4, hv: int = 8, d: int = 64):
  r = np.random.default_rng(0)
  q = jnp.asarray(r.normal(size=(1, length, hk, d)), jnp.float32)
  k = jnp.asarray(r.normal(size=(1, length, hk, d)), jnp.float32)
  v = jnp.asarray(r.normal(size=(1, length, hv, d)), jnp.float32)
  g = jnp.asarray(-np.abs(r.normal(size=(1, length, hv))) * 0.1, jnp.float32)
  beta = jnp.asarray(r.uniform(size=(1, length, hv)), jnp.float32)
  return q, k, v, g, beta


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--lengths", default="512,2048,8192")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--mixer", default="delta", choices=("delta", "mamba2", "mamba1"))
  parser.add_argument("--conv_tpu", default="", help="only compile the convolution's "
                      "forward + backward for one chip of this TPU topology (e.g. "
                      "v5p:2x2x1; needs libtpu) and print its temporaries, ours and naive")
  args = parser.parse_args()
  if args.conv_tpu:
    _conv_tpu(args.conv_tpu)
    return
  arms = {"chunked": kernels.gated_delta_rule, "recurrent": kernels.gated_delta_rule_reference}
  make = _inputs
  if args.mixer == "mamba2":
    arms = {"chunked": kernels.gated_linear_attention,
            "recurrent": kernels.gated_linear_attention_reference}
    make = _mamba2_inputs
  if args.mixer == "mamba1":  # chunks stepped through (CPU's default), or log-depth
    arms = {"chunked": functools.partial(kernels.selective_scan, inner="sequential"),
            "assoc": functools.partial(kernels.selective_scan, inner="associative"),
            "recurrent": kernels.selective_scan_reference}
    make = _mamba1_inputs
  print(f"{'T':>6} {'arm':>9} {'fwd ms':>9} {'fwd+bwd ms':>11} {'bwd temp MiB':>13}")
  for length in (int(n) for n in args.lengths.split(",")):
    inputs = make(length)
    outs, rows = {}, {}
    for name, fn in arms.items():
      forward = jax.jit(lambda *a, fn=fn: fn(*a))
      loss = lambda *a, fn=fn: jnp.sum(fn(*a) ** 2)  # noqa: E731
      grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(inputs)))))
      outs[name] = np.asarray(forward(*inputs))
      temp = grad.lower(*inputs).compile().memory_analysis().temp_size_in_bytes
      rows[name] = (_median_seconds(forward, inputs, args.reps),
                    _median_seconds(grad, inputs, args.reps), temp / MIB)
    np.testing.assert_allclose(outs["chunked"], outs["recurrent"], atol=2e-3, rtol=2e-3)
    for name, (fwd, both, temp) in rows.items():
      print(f"{length:>6} {name:>9} {1e3 * fwd:>9.1f} {1e3 * both:>11.1f} {temp:>13.1f}")
    for name in [n for n in rows if n not in ("chunked", "recurrent")] + ["recurrent"]:
      ratio = rows[name][1] / rows["chunked"][1]
      memory = rows[name][2] / rows["chunked"][2]
      print(f"{length:>6} {name} / chunked, forward + backward: {ratio:.1f}x time, "
            f"{memory:.1f}x temporaries")
  if args.mixer == "delta":
    _conv_residuals()


def _mamba2_inputs(length: int, groups: int = 1, heads: int = 8, state: int = 64,
                   width: int = 64):
  """(C, B, x dt, dt A) of one row as `Mamba2` hands them to the scan."""
  r = np.random.default_rng(0)
  c = jnp.asarray(r.normal(size=(1, length, groups, state)), jnp.float32)
  b = jnp.asarray(r.normal(size=(1, length, groups, state)), jnp.float32)
  dt = np.log1p(np.exp(r.normal(size=(1, length, heads)) - 2.0))  # softplus
  x = r.normal(size=(1, length, heads, width))
  a = -np.arange(1, heads + 1)
  return (c, b, jnp.asarray(x * dt[..., None], jnp.float32),
          jnp.asarray(dt * a, jnp.float32))


def _mamba1_inputs(length: int, channels: int = 512, state: int = 16):
  """(x, dt, A, B, C) of one row as `Mamba1` hands them to the scan."""
  r = np.random.default_rng(0)
  x = jnp.asarray(r.normal(size=(1, length, channels)), jnp.float32)
  dt = jnp.asarray(np.log1p(np.exp(r.normal(size=(1, length, channels)) - 2.0)), jnp.float32)
  a = jnp.asarray(-np.broadcast_to(np.arange(1, state + 1), (channels, state)), jnp.float32)
  b, c = (jnp.asarray(r.normal(size=(1, length, 1, state)), jnp.float32) for _ in range(2))
  return x, dt, a, b, c


def _two_sequences(rows: int, length: int):
  """Segment ids of rows holding two sequences (a third and the rest) and padding."""
  seg = np.ones((rows, length), np.int32)
  seg[:, length // 3:] = 2
  seg[:, length - length // 16:] = 0
  return jnp.asarray(seg)


def _conv_residuals(length: int = 4096, channels: int = 8192, width: int = 4,
                    reps: int = 5) -> None:
  """`kernels.causal_conv1d` (bf16) over Qwen3.5's q, k and v channels (16 key heads
  and 32 value heads of 128), segment ids given as the model gives them: the bytes a
  token its backward pass keeps, rematerialised (ours) against the body differentiated
  as it is, and, compiled, the forward + backward's time and temporaries against the
  naive path (`_windows_conv`: each window gathered per token in float32)."""
  module = sys.modules["kernels.gated_delta_rule"]
  seg = _two_sequences(1, length)
  inputs = [jax.ShapeDtypeStruct((1, length, channels), jnp.bfloat16),
            jax.ShapeDtypeStruct((channels, width), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, width - 1, channels), jnp.bfloat16)]
  arms = {"remat": lambda x, w, s0: kernels.causal_conv1d(x, w, segment_ids=seg,
                                                          initial_state=s0),
          "plain": lambda x, w, s0: module._causal_conv1d(x, w, None, seg, s0, "silu", False)}
  for name, fn in arms.items():
    residuals = jax.tree.leaves(jax.eval_shape(lambda *a, fn=fn: jax.vjp(fn, *a)[1],
                                               *inputs))
    kept = sum(np.prod(r.shape) * np.dtype(r.dtype).itemsize for r in residuals)
    print(f"causal_conv1d {name:>5}: {kept / length / 1024:.1f} KiB a token kept for the "
          f"backward pass ({channels} channels)")
  r = np.random.default_rng(1)
  values = [jnp.asarray(r.normal(size=a.shape), a.dtype) for a in inputs]
  rows, grads = {}, {}
  for name, fn in (("packed", kernels.causal_conv1d), ("windows", _windows_conv)):
    def loss(x, w, s0, fn=fn):
      out = fn(x, w, segment_ids=seg, initial_state=s0)
      return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    temp = grad.lower(*values).compile().memory_analysis().temp_size_in_bytes
    grads[name] = grad(*values)
    rows[name] = _median_seconds(grad, values, reps), temp / MIB
    print(f"causal_conv1d fwd+bwd, {name:>7}: {1e3 * rows[name][0]:.1f} ms, "
          f"{rows[name][1]:.1f} MiB temporaries ({length} tokens)")
  for a, b in zip(grads["packed"], grads["windows"]):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(b))))
  print(f"causal_conv1d windows / packed: time {rows['windows'][0] / rows['packed'][0]:.2f}x, "
        f"temporaries {rows['windows'][1] / rows['packed'][1]:.2f}x")


def _conv_tpu(topology: str, rows: int = 8, length: int = 2048, channels: int = 5120,
              width: int = 4) -> None:
  """XLA:TPU's temporaries for `jax.grad` of the convolution (bf16, two sequences and
  padding a row) compiled for one chip: one Qwen3.5-27B layer's q, k and v channels at
  tensor 2, 8 rows of 2,048 tokens."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from posttrain import aot
  mesh = Mesh(np.array(aot.tpu_devices(topology)[:1]), ("x",))
  seg = _two_sequences(rows, length)

  def arg(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

  args = (arg((rows, length, channels), jnp.bfloat16), arg((channels, width), jnp.bfloat16),
          arg((rows, width - 1, channels), jnp.bfloat16))
  temps = {}
  for name, fn in (("packed", kernels.causal_conv1d), ("windows", _windows_conv)):
    def loss(x, w, s0, fn=fn):
      return jnp.sum(fn(x, w, segment_ids=seg, initial_state=s0).astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
      compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    temps[name] = compiled.memory_analysis().temp_size_in_bytes / MIB
    print(f"causal_conv1d fwd+bwd on {topology.split(':')[0]}, {name:>7}: "
          f"{temps[name]:.1f} MiB temporaries")
  print(f"causal_conv1d windows / packed on {topology.split(':')[0]}: "
        f"{temps['windows'] / temps['packed']:.2f}x")


def _windows_conv(x, w, segment_ids, initial_state):
  """The naive path: each of the K windows gathered per token in float32 (the s-th
  valid input before it, zero across a sequence start), rematerialised; SiLU."""

  def body(x, w, segment_ids, initial_state):
    batch, length, _ = x.shape
    width = w.shape[1]
    history = width - 1
    x_BxLxC = jnp.concatenate([initial_state, x], axis=1).astype(jnp.float32)
    total = history + length
    valid_BxT, reset_BxT = sys.modules["kernels.gated_delta_rule"].segment_resets(
        segment_ids, batch, length)
    valid_BxL = jnp.concatenate([jnp.ones((batch, history), jnp.bool_), valid_BxT], 1)
    run_BxL = jnp.concatenate([jnp.zeros((batch, history), jnp.int32),
                               jnp.cumsum(reset_BxT.astype(jnp.int32), axis=1)], 1)
    count_BxL = jnp.cumsum(valid_BxL.astype(jnp.int32), axis=1)
    slot_BxL = jnp.where(valid_BxL, count_BxL - 1, total)
    position_BxL = jnp.zeros((batch, total), jnp.int32).at[
        jnp.arange(batch)[:, None], slot_BxL].set(
            jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (batch, total)),
            mode="drop")
    count_BxT, run_BxT = count_BxL[:, history:], run_BxL[:, history:]
    y = 0.0
    for s in range(width):
      n_BxT = count_BxT - 1 - s
      where_BxT = jnp.take_along_axis(position_BxL, jnp.maximum(n_BxT, 0), axis=1)
      ok_BxT = (n_BxT >= 0) & (jnp.take_along_axis(run_BxL, where_BxT, axis=1) == run_BxT)
      window = jnp.take_along_axis(x_BxLxC, where_BxT[..., None], axis=1)
      y = y + jnp.where(ok_BxT[..., None], window, 0.0) * w.astype(jnp.float32)[
          None, None, :, width - 1 - s]
    y = jnp.where(valid_BxT[..., None], jax.nn.silu(y), 0.0)
    return y.astype(x.dtype)

  return jax.checkpoint(body, prevent_cse=False)(x, w, segment_ids, initial_state)


if __name__ == "__main__":
  main()
