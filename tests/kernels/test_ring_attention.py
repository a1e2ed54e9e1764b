"""Ring attention on 8 fake CPU devices against the reference on the gathered arrays."""
import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from kernel_test_utils import Case, assert_close, check_against_reference, make_inputs

import kernels

ring_lib = importlib.import_module("kernels.ring_attention")


def sharded(mesh, axis_name="sp", **options):
  return functools.partial(kernels.ring_attention_sharded, mesh=mesh, axis_name=axis_name,
                           **options)


@pytest.fixture(scope="module")
def mesh8():
  return jax.make_mesh((8,), ("sp",))


# 8 devices: local shards of 16 positions (zig-zag halves of 8).
RING_CASE = Case("ring", batch=2, q_len=128, kv_len=128, heads=4, kv_heads=2,
                 head_dim=16, segments=True)


@pytest.mark.parametrize("layout,block_kernel,options", [
    ("contiguous", "reference", {}),
    ("zigzag", "chunked", dict(chunk_size=8)),
])
def test_causal_ring_matches_reference(mesh8, layout, block_kernel, options):
  fn = sharded(mesh8, layout=layout, block_kernel=block_kernel, **options)
  check_against_reference(fn, RING_CASE, jnp.float32)


def test_noncausal_mqa_soft_cap(mesh8):
  case = Case("ring_mqa", batch=1, q_len=128, kv_len=128, heads=3, kv_heads=1,
              head_dim=16, causal=False, logits_soft_cap=3.0)
  check_against_reference(sharded(mesh8, layout="zigzag"), case, jnp.float32)


def test_zigzag_ring_with_flash_block_kernel(mesh8):
  fn = sharded(mesh8, layout="zigzag", block_kernel="flash", backend="gpu", block_q=16,
               block_kv=16, interpret=True)
  check_against_reference(fn, RING_CASE, jnp.float32)


@pytest.mark.slow
def test_bf16(mesh8):
  check_against_reference(sharded(mesh8, layout="zigzag", chunk_size=8), RING_CASE,
                          jnp.bfloat16)


def test_3d_mesh_with_batch_and_head_axes():
  mesh = jax.make_mesh((2, 2, 2), ("data", "heads", "sp"))
  fn = sharded(mesh, layout="zigzag", batch_axis="data", head_axis="heads",
               block_kernel="reference")
  check_against_reference(fn, RING_CASE, jnp.float32)


def test_ring_attention_inside_user_shard_map(mesh8):
  """The per-device API composes with the caller's own shard_map and zig-zag data."""
  x = make_inputs(RING_CASE)
  q, k, v = x["q"], x["k"], x["v"]
  spec = P(None, "sp", None, None)

  @functools.partial(jax.shard_map, mesh=mesh8, in_specs=(spec, spec, spec),
                     out_specs=spec)
  def local(q, k, v):
    return kernels.ring_attention(q, k, v, axis_name="sp", layout="zigzag",
                                  block_kernel="reference")

  zig = lambda a: jax.device_put(kernels.to_zigzag(a, 8),
                                 jax.sharding.NamedSharding(mesh8, spec))
  out = kernels.from_zigzag(jax.device_get(jax.jit(local)(zig(q), zig(k), zig(v))), 8)
  assert_close(out, kernels.reference_attention(q, k, v), 2e-5)


def test_zigzag_layout_helpers(mesh8):
  x = jnp.arange(2 * 32).reshape(2, 32)  # 8 devices -> 16 chunks of 2
  z = kernels.to_zigzag(x, 8)
  np.testing.assert_array_equal(np.asarray(kernels.from_zigzag(z, 8)), np.asarray(x))
  chunks = np.asarray(z[0]).reshape(8, 2, 2)[:, :, 0] // 2  # chunk ids per device
  np.testing.assert_array_equal(chunks, [[i, 15 - i] for i in range(8)])

  spec = P(None, "sp")
  to_zig = jax.shard_map(lambda a: kernels.shard_to_zigzag(a, "sp"), mesh=mesh8,
                         in_specs=spec, out_specs=spec)
  from_zig = jax.shard_map(lambda a: kernels.shard_from_zigzag(a, "sp"), mesh=mesh8,
                           in_specs=spec, out_specs=spec)
  put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh8, spec))
  np.testing.assert_array_equal(np.asarray(jax.jit(to_zig)(put(x))), np.asarray(z))
  np.testing.assert_array_equal(np.asarray(jax.jit(from_zig)(put(z))), np.asarray(x))


def _work_per_device(layout, n):
  """Fraction of a full block each device computes over the ring, from the very
  step-mode function the ring uses."""
  cost = {ring_lib._SKIP: 0, ring_lib._FULL: 1, ring_lib._DIAG: 0.5,
          ring_lib._KV_FIRST: 0.5, ring_lib._Q_SECOND: 0.5}
  ring = ring_lib._Ring(axis_name="sp", causal=True, layout=layout, kernel=None)
  modes = ring_lib._MODES[layout]
  return [sum(cost[modes[int(ring_lib._step_mode(ring, me, (me - s) % n))]]
              for s in range(n)) for me in range(n)]


def test_zigzag_balances_causal_work():
  n = 8
  zigzag, contiguous = _work_per_device("zigzag", n), _work_per_device("contiguous", n)
  # Both do the causal half of the n x n block matrix in total...
  assert sum(zigzag) == sum(contiguous) == n * n / 2
  # ...but zig-zag splits it evenly while contiguous leaves device 0 nearly idle.
  assert zigzag == [n / 2] * n
  assert contiguous == [i + 0.5 for i in range(n)]


# Windows over 8 shards of 16: 5 reaches 1 shard back (2 steps), 40 reaches 3 back (4
# steps), 200 every shard (8 steps: the full ring, whose dk / dv go home by the shift).
@pytest.mark.parametrize("window,steps,block_kernel,options", [
    (5, 2, "reference", {}),
    (40, 4, "chunked", dict(chunk_size=8)),
    (200, 8, "reference", {}),
    (40, 4, "flash", dict(backend="gpu", block_q=16, block_kv=16, interpret=True)),
])
def test_sliding_window_ring_matches_reference(mesh8, window, steps, block_kernel,
                                               options):
  """A causal window runs only the steps whose kv shards it reaches (the forward's
  ppermutes count them) and equals the reference, gradients included."""
  assert ring_lib.window_steps(window, 16, 8) == steps
  case = dataclasses.replace(RING_CASE, name=f"ring_window_{window}",
                             sliding_window=window, logits_soft_cap=4.0)
  fn = sharded(mesh8, block_kernel=block_kernel, **options)  # contiguous by default
  check_against_reference(fn, case, jnp.float32)
  x = make_inputs(case)
  text = jax.jit(lambda q, k, v: fn(q, k, v, **case.mask_kwargs(x))).lower(
      x["q"], x["k"], x["v"]).as_text()
  # k, v and the kv segment ids travel steps - 1 hops (a hop is a ppermute each).
  assert text.count("collective_permute") == 3 * (steps - 1)


def test_sliding_window_ring_with_tpu_flash_blocks():
  """TPU flash blocks at the kv shard's distance (q_offset), the fused backward too."""
  mesh = jax.make_mesh((4,), ("sp",))
  case = Case("ring_window_tpu", batch=1, q_len=1024, kv_len=1024, heads=2, kv_heads=1,
              head_dim=16, segments=True, sliding_window=300)
  fn = sharded(mesh, block_kernel="flash", backend="tpu", block_q=128, block_kv=128,
               fused_bwd=True, interpret=True)
  check_against_reference(fn, case, jnp.float32)


@pytest.mark.parametrize("kwargs,message", [
    (dict(sliding_window=8, causal=False), r"sliding_window \(8\) only with causal=True"),
    (dict(sliding_window=8, layout="zigzag"), "runs the contiguous layout"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(layout="striped"), "layout must be one of"),
    (dict(block_kernel="splash"), "block_kernel must be"),
])
def test_bad_options(mesh8, kwargs, message):
  x = jnp.zeros((1, 64, 2, 8))
  with pytest.raises(ValueError, match=message):
    kernels.ring_attention_sharded(x, x, x, mesh=mesh8, axis_name="sp", **kwargs)


def test_bad_lengths(mesh8):
  q, k = jnp.zeros((1, 64, 2, 8)), jnp.zeros((1, 128, 2, 8))
  with pytest.raises(ValueError, match="q_len == kv_len, got 64 and 128"):
    kernels.ring_attention_sharded(q, k, k, mesh=mesh8, axis_name="sp")
  x = jnp.zeros((1, 72, 2, 8))
  with pytest.raises(ValueError, match="sequence length 72 must be divisible by 2 \\* "):
    kernels.ring_attention_sharded(x, x, x, mesh=mesh8, axis_name="sp")


@pytest.mark.slow
def test_ring_with_tpu_flash_blocks_and_the_fused_backward():
  """Ring's flash blocks take the kernel options, the TPU fused backward included."""
  mesh = jax.make_mesh((2,), ("sp",))
  case = Case("ring_fused", batch=1, q_len=256, kv_len=256, heads=2, kv_heads=1,
              head_dim=16, segments=True)
  fn = sharded(mesh, layout="contiguous", block_kernel="flash", backend="tpu",
               block_q=128, block_kv=128, fused_bwd=True, interpret=True)
  check_against_reference(fn, case, jnp.float32)
