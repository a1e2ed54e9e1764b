"""chunked_attention and the dot_product_attention front door against the reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_utils import (
  BF16_CASES,
  CASES,
  Case,
  assert_close,
  check_against_reference,
  make_inputs,
)

import kernels

# Chunks of 64 keys and 48 queries: neither divides 200 or 320, and causal cases skip
# whole chunk pairs.
chunked = functools.partial(kernels.chunked_attention, chunk_size=64, q_chunk_size=48)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_chunked_matches_reference_f32(case):
  check_against_reference(chunked, case, jnp.float32)


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.name)
def test_chunked_matches_reference_bf16(case):
  check_against_reference(chunked, case, jnp.bfloat16)


def test_explicit_positions_match_default_and_shift_invariant():
  case = Case("pos", q_len=96, kv_len=160, sliding_window=40)
  x = make_inputs(case)

  @jax.jit  # one program for both calls: eagerly every op compiles on its own
  def default_and_shifted(q, k, v):
    return (chunked(q, k, v, sliding_window=40),
            chunked(q, k, v, sliding_window=40, q_positions=jnp.arange(64, 160) + 1000,
                    kv_positions=jnp.arange(160) + 1000))

  default, shifted = default_and_shifted(x["q"], x["k"], x["v"])
  assert_close(shifted, default, 1e-6)


@pytest.mark.slow
def test_per_row_positions_match_reference():
  # Decode-style: each row's queries sit at a different offset.
  case = Case("rows", q_len=8, kv_len=128, batch=2)
  x = make_inputs(case)
  q_pos = jnp.stack([jnp.arange(8) + 50, jnp.arange(8) + 120])
  kv_pos = jnp.arange(128)
  got = chunked(x["q"], x["k"], x["v"], q_positions=q_pos, kv_positions=kv_pos)
  want = kernels.reference_attention(x["q"], x["k"], x["v"], q_positions=q_pos,
                                     kv_positions=kv_pos)
  assert_close(got, want, 2e-5)


def _temp_bytes(fn, *shapes):
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_not_quadratically():
  """Forward + backward scratch memory at 4x the length: chunked ~4x, reference ~16x."""
  def loss(attention):
    return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)), (0, 1, 2))

  chunked_512 = functools.partial(kernels.chunked_attention, chunk_size=128)
  ratios = {}
  for name, fn in (("chunked", chunked_512), ("reference", kernels.reference_attention)):
    small, large = (_temp_bytes(loss(fn), (1, t, 2, 32), (1, t, 1, 32), (1, t, 1, 32))
                    for t in (1024, 4096))
    ratios[name] = large / small
  assert ratios["chunked"] < 6, ratios
  assert ratios["reference"] > 12, ratios


def test_bad_chunk_size():
  x = jnp.zeros((1, 8, 1, 4))
  with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
    kernels.chunked_attention(x, x, x, chunk_size=0)


def test_front_door_dispatch():
  x = make_inputs(Case("door", q_len=64, kv_len=64))
  q, k, v = x["q"], x["k"], x["v"]
  want = kernels.reference_attention(q, k, v, causal=False)
  assert kernels.default_implementation("cpu") == "chunked"
  assert kernels.default_implementation("tpu") == "pallas_tpu"
  assert kernels.default_implementation("gpu") == "pallas_gpu"
  impls = (None, "chunked", "reference")

  @jax.jit  # one program for every implementation: compile time dominates here
  def every_implementation(q, k, v):
    outs = [kernels.dot_product_attention(q, k, v, causal=False, implementation=impl)
            for impl in impls]
    return outs + [kernels.dot_product_attention(q, k, v, causal=False,
                                                 implementation="chunked", chunk_size=16)]

  for name, got in zip((*impls, "chunk_size option"), every_implementation(q, k, v)):
    assert_close(got, want, 2e-5, str(name))
  with pytest.raises(ValueError, match="'flash'"):
    kernels.dot_product_attention(q, k, v, implementation="flash")


def test_jit_and_grad_through_front_door():
  x = make_inputs(Case("jit", q_len=64, kv_len=64, segments=True))
  f = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(kernels.dot_product_attention(
      q, k, v, q_segment_ids=s, kv_segment_ids=s, implementation="chunked",
      chunk_size=32)), (0, 1, 2)))
  grads = f(x["q"], x["k"], x["v"], x["kv_seg"])
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
