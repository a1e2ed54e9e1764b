"""local_chunk (Llama 4's chunked attention): a query sees only the keys of its own chunk
of positions. The reference and decode attention take it as a mask; every other kernel
takes it as segment ids (`kernels.local_chunk_segment_ids`)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_utils import assert_close, numpy_attention

import kernels


def _qkv(b=2, t=24, kvh=2, h=4, d=8, tq=None, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, tq or t, h, d))
  k = jax.random.normal(ks[1], (b, t, kvh, d))
  v = jax.random.normal(ks[2], (b, t, kvh, d))
  return q, k, v


@pytest.mark.parametrize("chunk", [1, 5, 8, 24, 40])
def test_reference_equals_attention_within_each_chunk(chunk):
  """With local_chunk c, a sequence's output is that of each chunk attended alone."""
  q, k, v = _qkv()
  out = kernels.reference_attention(q, k, v, local_chunk=chunk)
  assert_close(out, numpy_attention(q, k, v, local_chunk=chunk), 1e-5)
  pieces = [numpy_attention(q[:, s:s + chunk], k[:, s:s + chunk], v[:, s:s + chunk])
            for s in range(0, q.shape[1], chunk)]
  assert_close(out, np.concatenate(pieces, axis=1), 1e-5)


def test_segment_ids_split_every_segment_at_chunk_boundaries():
  seg = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 0, 0],
                   [3, 3, 3, 3, 3, 3, 3, 3, 3, 3]])
  pos = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0],
                   [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
  got = kernels.local_chunk_segment_ids(seg, pos, 3)
  np.testing.assert_array_equal(got, [[1, 1, 1, 2, 2, 3, 3, 3, 0, 0],
                                      [1, 1, 2, 2, 2, 3, 3, 3, 4, 4]])
  # A traced chunk (a scanned layer's) gives the same ids.
  traced = jax.jit(kernels.local_chunk_segment_ids)(seg, pos, jnp.int32(3))
  np.testing.assert_array_equal(traced, got)


@pytest.mark.parametrize("impl,kw", [("chunked", dict(chunk_size=8)),
                                     ("flash", dict(backend="gpu", block_q=16, block_kv=16)),
                                     ("reference", {})])
def test_kernels_with_the_derived_segment_ids_match_the_mask(impl, kw):
  """Packed rows (positions restart per segment, padding at the end): any kernel with
  the derived ids computes the local_chunk mask within segments, forward and gradients."""
  q, k, v = _qkv(t=32)
  seg = jnp.array([[1] * 13 + [2] * 15 + [0] * 4, [5] * 32])
  pos = jnp.array([list(range(13)) + list(range(15)) + [0] * 4, list(range(32))])
  chunk = 6
  ids = kernels.local_chunk_segment_ids(seg, pos, chunk)
  # The oracle: the reference's own mask on the given positions and segments.
  want_fn = lambda q, k, v: kernels.reference_attention(  # noqa: E731
      q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos,
      local_chunk=chunk)
  if impl == "flash":
    fn = lambda q, k, v: kernels.flash_attention(  # noqa: E731
        q, k, v, q_segment_ids=ids, kv_segment_ids=ids, interpret=True, **kw)
  else:
    fn = lambda q, k, v: kernels.dot_product_attention(  # noqa: E731
        q, k, v, implementation=impl, q_segment_ids=ids, kv_segment_ids=ids, **kw)
  keep = (seg > 0)[:, :, None, None]
  assert_close(jnp.where(keep, fn(q, k, v), 0), jnp.where(keep, want_fn(q, k, v), 0), 2e-5)
  loss = lambda f: lambda *a: jnp.sum(jnp.where(keep, f(*a), 0) ** 2)  # noqa: E731
  got = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(want_fn), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    assert_close(g, w, 1e-4)


@functools.partial(jax.jit, static_argnames=("chunk_size", "layout"))
def _decode(q, k, v, lengths, local_chunk, chunk_size=4, layout="bskh"):
  if layout == "bksh":
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  return kernels.decode_attention(q, k, v, lengths=lengths, chunk_size=chunk_size,
                                  kv_layout=layout, local_chunk=local_chunk)


@pytest.mark.parametrize("layout", ["bskh", "bksh"])
@pytest.mark.parametrize("tq", [1, 3])
def test_decode_attention_sees_only_the_query_chunk(layout, tq):
  """Rows at different lengths, queries straddling a chunk boundary, the cache read in
  blocks (the blocks before every query's chunk skipped): the per-row oracle."""
  q, k, v = _qkv(b=3, t=29, tq=tq)
  lengths = (7, 29, 13)
  chunk = 6
  want = np.concatenate([numpy_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n],
                                         local_chunk=chunk)
                         for i, n in enumerate(lengths)])
  # Slots past a row's length hold garbage that must not matter.
  past = jnp.arange(29)[None, :, None, None] >= jnp.asarray(lengths)[:, None, None, None]
  k_bad, v_bad = jnp.where(past, 1e4, k), jnp.where(past, jnp.nan, v)
  for local in (chunk, jnp.int32(chunk)):  # static, and traced as a scan's flag would be
    out = _decode(q, k_bad, v_bad, jnp.array(lengths), local, layout=layout)
    assert_close(out, want, 2e-5)
  # A chunk longer than every row is no mask at all.
  out = _decode(q, k_bad, v_bad, jnp.array(lengths), jnp.int32(1 << 30), layout=layout)
  full = np.concatenate([numpy_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n])
                         for i, n in enumerate(lengths)])
  assert_close(out, full, 2e-5)


def test_bad_local_chunk_is_refused():
  q, k, v = _qkv()
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match="local_chunk"):
      kernels.reference_attention(q, k, v, local_chunk=bad)
  with pytest.raises(ValueError, match="local_chunk"):
    kernels.decode_attention(q[:, -1:], k, v, lengths=jnp.array([24, 24]), local_chunk=0)


@pytest.mark.parametrize("tq", [1, 2])
def test_a_ring_of_one_window_holds_every_chunk(tq):
  """A chunked layer's cache as a ring of sliding_window = local_chunk slots (+ q_len -
  1): position p in slot p % slots. Its chunk lies within the window, so the ring gives
  what the whole rows give."""
  chunk, slots = 6, 8
  q, k, v = _qkv(b=3, t=29, tq=tq)
  lengths = jnp.array([7, 29, 13])
  whole = kernels.decode_attention(q, k, v, lengths=lengths, chunk_size=4, local_chunk=chunk)
  # Each row's ring: slot s holds the newest position p < length with p % slots == s.
  last = lengths[:, None] - 1
  pos = last - jnp.mod(last - jnp.arange(slots)[None], slots)  # [b, slots]
  take = lambda x: jnp.take_along_axis(  # noqa: E731
      x, jnp.maximum(pos, 0)[:, :, None, None], axis=1)
  out = kernels.decode_attention(q, take(k), take(v), lengths=lengths, chunk_size=4,
                                 ring=True, sliding_window=chunk, local_chunk=chunk)
  assert_close(out, whole, 2e-5)
