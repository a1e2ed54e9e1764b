"""decode_attention against the reference on each row's cached prefix."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_utils import assert_close, numpy_attention

import kernels

LENGTHS = (5, 37, 9)  # max_len 37 with 8-slot chunks: 5 chunks, the last one overlaps


def _case(b=3, s=37, kvh=2, h=6, d=8, t=1, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, h, d))
  k = jax.random.normal(ks[1], (b, s, kvh, d))
  v = jax.random.normal(ks[2], (b, s, kvh, d))
  return q, k, v


def _with_garbage(k, v, lengths):
  """Slots past a row's length hold anything; they must not matter."""
  slots = jnp.arange(k.shape[1])[None, :, None, None]
  past = slots >= jnp.asarray(lengths)[:, None, None, None]
  return jnp.where(past, 1e4, k), jnp.where(past, jnp.nan, v)


def _per_row_reference(q, k, v, lengths, **kw):
  """Each row attends to exactly its prefix: the independent numpy oracle."""
  return np.concatenate([
      numpy_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], **kw)
      for i, n in enumerate(lengths)])


# (kv_layout, elementwise, chunk_size): slot-major and heads-major caches; dots,
# multiply-reduces, and dot scores with a multiply-reduce over the values ("values");
# several blocks (the last one overlapping) and one whole block.
WAYS = [("bskh", None, 8), ("bksh", None, 8), ("bskh", False, 8), ("bksh", False, 8),
        ("bksh", True, 64), ("bskh", False, 64), ("bskh", True, 8), ("bskh", "values", 8),
        ("bksh", "values", 64)]


@functools.partial(jax.jit, static_argnames=("causal", "sliding_window", "logits_soft_cap",
                                             "way", "finite_tail", "ring"))
def _decode(q, k, v, lengths, k_scale=None, v_scale=None, way=WAYS[0], **kw):
  """decode_attention on a slot-major test cache, laid out and scored as `way` says."""
  layout, elementwise, chunk = way
  if layout == "bksh":
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    per_slot = lambda s: s if s is None or s.ndim == 1 else jnp.swapaxes(s, 1, 2)
    k_scale, v_scale = per_slot(k_scale), per_slot(v_scale)
  return kernels.decode_attention(q, k, v, lengths=lengths, k_scale=k_scale,
                                  v_scale=v_scale, chunk_size=chunk, kv_layout=layout,
                                  elementwise=elementwise, **kw)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("t,kw", [
    (1, {}),
    (3, dict(sliding_window=6, logits_soft_cap=5.0)),
    (2, dict(causal=False)),
])
def test_matches_reference_on_each_prefix(t, kw, way):
  q, k, v = _case(t=t)
  out = _decode(q, *_with_garbage(k, v, LENGTHS), jnp.array(LENGTHS), way=way, **kw)
  assert_close(out, _per_row_reference(q, k, v, LENGTHS, **kw), 2e-5)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("t,kw", [(1, {}), (3, dict(sliding_window=6, logits_soft_cap=5.0))])
def test_finite_tail_skips_zeroing_and_keeps_the_result(t, kw, way):
  """finite_tail=True: slots past each row's length hold large finite garbage (as a reused
  zero-initialised cache may); the result is the per-row reference all the same."""
  q, k, v = _case(t=t, seed=5)
  slots = jnp.arange(k.shape[1])[None, :, None, None]
  past = slots >= jnp.asarray(LENGTHS)[:, None, None, None]
  k_bad, v_bad = jnp.where(past, 1e4, k), jnp.where(past, -3e4, v)
  out = _decode(q, k_bad, v_bad, jnp.array(LENGTHS), way=way, finite_tail=True, **kw)
  assert_close(out, _per_row_reference(q, k, v, LENGTHS, **kw), 2e-5)


@pytest.mark.parametrize("way", WAYS[:2])
@pytest.mark.parametrize("kw", [{}, dict(causal=False), dict(sliding_window=20)])
def test_long_rows_see_every_chunk_of_their_prefix(kw, way):
  """Every row well past the first chunks: the early chunks still hold visible keys
  (only a sliding window may skip them)."""
  lengths = (30, 37, 25)
  q, k, v = _case(t=2, seed=3)
  out = _decode(q, *_with_garbage(k, v, lengths), jnp.array(lengths), way=way, **kw)
  assert_close(out, _per_row_reference(q, k, v, lengths, **kw), 2e-5)


def test_default_chunking_and_bf16():
  q, k, v = (x.astype(jnp.bfloat16) for x in _case(t=2))
  out = kernels.decode_attention(q, k, v, lengths=jnp.array(LENGTHS))
  assert out.dtype == jnp.bfloat16
  assert_close(out, _per_row_reference(q, k, v, LENGTHS), 2e-2)


@pytest.mark.parametrize("way", [WAYS[0], WAYS[3]])
def test_gradients_match_reference(way):
  q, k, v = _case(t=2)
  lengths = jnp.array(LENGTHS)
  dout = jax.random.normal(jax.random.key(1), q.shape)
  got = jax.vjp(lambda q, k, v: _decode(q, k, v, lengths, way=way), q, k, v)[1](dout)
  per_row = jax.jit(lambda q, k, v: jnp.concatenate([
      kernels.reference_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n])
      for i, n in enumerate(LENGTHS)]))
  want = jax.vjp(per_row, q, k, v)[1](dout)
  assert_close(got[0], want[0], 1e-4, "dq")
  for name, g, w in (("dk", got[1], want[1]), ("dv", got[2], want[2])):
    for i, n in enumerate(LENGTHS):  # the reference only saw each row's prefix
      assert_close(g[i, :n], w[i, :n], 1e-4, name)
      np.testing.assert_array_equal(np.asarray(g[i, n:]), 0.0)


# Symmetric int8 with a scale per (row, slot, head): each element is off by at most
# max|x| / 254, which for unit-normal inputs keeps the output within 0.03 absolute.
INT8_TOLERANCE = 0.03


@pytest.mark.parametrize("way", WAYS)
def test_int8_cache_per_slot_scales_within_tolerance(way):
  q, k, v = _case(t=2)
  lengths = jnp.array(LENGTHS)
  k8, ks = kernels.quantize_int8(k)
  v8, vs = kernels.quantize_int8(v)
  # Garbage scales past each row's length must not leak either.
  past = jnp.arange(37)[None, :, None] >= lengths[:, None, None]
  vs = jnp.where(past, jnp.nan, vs)
  out = _decode(q, k8, v8, lengths, ks, vs, way=way)
  want = _per_row_reference(q, k, v, LENGTHS)
  assert float(np.max(np.abs(np.asarray(out) - want))) < INT8_TOLERANCE
  # And it is the quantised cache, exactly dequantised, that is attended.
  exact = _per_row_reference(q, k8 * ks[..., None], v8 * jnp.where(past, 0, vs)[..., None],
                             LENGTHS)
  assert_close(out, exact, 2e-5)


@pytest.mark.parametrize("way", [WAYS[1], WAYS[2]])
def test_int8_cache_per_head_scales(way):
  q, k, v = _case()
  k_scale = jnp.max(jnp.abs(k), axis=(0, 1, 3)) / 127  # [kv_heads]
  v_scale = jnp.max(jnp.abs(v), axis=(0, 1, 3)) / 127
  per_head = lambda s: s[None, None, :, None]
  k8 = jnp.round(k / per_head(k_scale)).astype(jnp.int8)
  v8 = jnp.round(v / per_head(v_scale)).astype(jnp.int8)
  out = _decode(q, k8, v8, jnp.array(LENGTHS), k_scale, v_scale, way=way)
  exact = _per_row_reference(q, k8 * per_head(k_scale), v8 * per_head(v_scale), LENGTHS)
  assert_close(out, exact, 2e-5)
  assert float(np.max(np.abs(np.asarray(out) - _per_row_reference(q, k, v, LENGTHS)))) < 0.05


def test_bad_inputs_name_the_argument():
  q, k, v = _case()
  with pytest.raises(ValueError, match="lengths must be \\[batch\\]"):
    kernels.decode_attention(q, k, v, lengths=jnp.array([1, 2]))
  with pytest.raises(ValueError, match="k_scale is required"):
    kernels.decode_attention(q, k.astype(jnp.int8), v.astype(jnp.int8), lengths=jnp.ones(3))
  with pytest.raises(ValueError, match="v_scale must be"):
    kernels.decode_attention(q, k.astype(jnp.int8), v.astype(jnp.int8), lengths=jnp.ones(3),
                             k_scale=jnp.ones(2), v_scale=jnp.ones(5))
  with pytest.raises(ValueError, match="v_cache must have the shape of k_cache"):
    kernels.decode_attention(q, k, v[:, :5], lengths=jnp.ones(3))
  with pytest.raises(ValueError, match="q heads 6 must be a multiple of k kv_heads 4"):
    kernels.decode_attention(q, jnp.zeros((3, 37, 4, 8)), jnp.zeros((3, 37, 4, 8)),
                             lengths=jnp.ones(3))
  with pytest.raises(ValueError, match="q heads 6 must be a multiple of k kv_heads 4"):
    kernels.decode_attention(q, jnp.zeros((3, 4, 37, 8)), jnp.zeros((3, 4, 37, 8)),
                             lengths=jnp.ones(3), kv_layout="bksh")
  with pytest.raises(ValueError, match="kv_layout must be one of"):
    kernels.decode_attention(q, k, v, lengths=jnp.ones(3), kv_layout="sbkh")
  with pytest.raises(ValueError, match="elementwise must be None, True, False or 'values'"):
    kernels.decode_attention(q, k, v, lengths=jnp.ones(3), elementwise="scores")
  with pytest.raises(ValueError, match="k_scale must be .* per slot and head \\(3, 2, 37\\)"):
    kernels.decode_attention(q, jnp.swapaxes(k, 1, 2).astype(jnp.int8),
                             jnp.swapaxes(v, 1, 2).astype(jnp.int8), lengths=jnp.ones(3),
                             k_scale=jnp.ones((3, 37, 2)), v_scale=jnp.ones(2),
                             kv_layout="bksh")


@pytest.mark.parametrize("layout,chunk", [("bksh", 8), ("bskh", 8), ("bksh", 64)])
@pytest.mark.parametrize("int8", [False, True])
def test_stacked_cache_attends_over_the_layer_it_is_told(layout, chunk, int8):
  """A cache stacking three layers, read at a traced layer index (as inside a scan over
  layers): each layer's result is that of its own unstacked cache (to float32 rounding:
  one jitted program against eager calls)."""
  q, _, _ = _case(t=2)
  lengths = jnp.array(LENGTHS)
  caches = [_case(seed=s)[1:] for s in (1, 2, 3)]
  if int8:
    caches = [(*kernels.quantize_int8(k), *kernels.quantize_int8(v)) for k, v in caches]
  else:
    caches = [(k, None, v, None) for k, v in caches]
  if layout == "bksh":
    caches = [tuple(None if x is None else jnp.swapaxes(x, 1, 2) for x in c) for c in caches]
  stack = [None if caches[0][i] is None else jnp.stack([c[i] for c in caches])
           for i in range(4)]

  @jax.jit
  def at(layer):
    return kernels.decode_attention(q, stack[0], stack[2], lengths=lengths,
                                    k_scale=stack[1], v_scale=stack[3], chunk_size=chunk,
                                    kv_layout=layout, layer=layer)

  for i, (k, ks, v, vs) in enumerate(caches):
    alone = kernels.decode_attention(q, k, v, lengths=lengths, k_scale=ks, v_scale=vs,
                                     chunk_size=chunk, kv_layout=layout)
    assert_close(at(jnp.int32(i)), alone, 1e-6)


def test_stacked_cache_shapes_are_checked():
  q, k, v = _case()
  with pytest.raises(ValueError, match=r"k_cache must be \[layers, batch, max_len"):
    kernels.decode_attention(q, k, v, lengths=jnp.ones(3), layer=0)
  k8 = jnp.stack([k, k]).astype(jnp.int8)
  with pytest.raises(ValueError, match=r"k_scale must be .* \(2, 3, 37, 2\)"):
    kernels.decode_attention(q, k8, k8, lengths=jnp.ones(3), layer=1,
                             k_scale=jnp.ones((3, 37, 2)), v_scale=jnp.ones(2))


def _ring(x, lengths, slots):
  """A ring cache of `slots` built from the whole rows x [b, len, ...]: slot s of row b
  holds the newest position p = s (mod slots) below lengths[b]; never-written slots hold
  large finite garbage, as a reused cache's do."""
  out = np.full((x.shape[0], slots, *x.shape[2:]), 1e4, np.asarray(x).dtype)
  for b, n in enumerate(lengths):
    for p in range(max(0, n - slots), n):
      out[b, p % slots] = np.asarray(x[b, p])
  return jnp.asarray(out)


# Rows shorter than the ring (slot = position), just wrapped, and wrapped several times.
RING_LENGTHS = (9, 21, 58)


@pytest.mark.parametrize("way", [WAYS[0], WAYS[1], WAYS[4], WAYS[7]])
@pytest.mark.parametrize("t,window,slots,lengths", [
    (1, 6, 6, RING_LENGTHS), (3, 6, 8, RING_LENGTHS), (2, 11, 16, RING_LENGTHS),
    (2, 11, 16, (40, 58, 45)), (2, 3, 32, (5, 30, 17))])
def test_ring_cache_matches_the_whole_rows(t, window, slots, lengths, way):
  """A sliding layer's ring buffer (position p in slot p % slots) attends as the whole
  row's cache would, for rows shorter than it and rows that wrapped it many times; with
  the smallest ring a window allows (window + q_len - 1 slots) too. Once every row has
  wrapped it, every block is read, though each row's positions lie past the ring's
  slots; while none has (the last case), blocks before the window are skipped as in a
  plain cache."""
  q, k, v = _case(t=t, s=max(lengths), seed=7)
  kw = dict(sliding_window=window, logits_soft_cap=5.0)
  out = _decode(q, _ring(k, lengths, slots), _ring(v, lengths, slots),
                jnp.array(lengths), way=way, ring=True, finite_tail=True, **kw)
  assert_close(out, _per_row_reference(q, k, v, lengths, **kw), 2e-5)


@pytest.mark.parametrize("layout", ["bskh", "bksh"])
def test_ring_cache_int8_and_stacked(layout):
  """An int8 ring with per-slot scales, stacked with another layer and read at a traced
  layer index, equals the dequantised rows' reference."""
  q, k, v = _case(t=2, s=max(RING_LENGTHS), seed=8)
  lengths, slots = jnp.array(RING_LENGTHS), 16
  (k8, ks), (v8, vs) = kernels.quantize_int8(k), kernels.quantize_int8(v)
  ring = [_ring(x, RING_LENGTHS, slots) for x in (k8, ks, v8, vs)]
  ring[1], ring[3] = (jnp.where(s > 1e3, 1.0, s) for s in (ring[1], ring[3]))
  if layout == "bksh":
    ring = [jnp.swapaxes(x, 1, 2) for x in ring]
  stack = [jnp.stack([jnp.zeros_like(x), x]) for x in ring]
  out = jax.jit(lambda layer: kernels.decode_attention(
      q, stack[0], stack[2], lengths=lengths, k_scale=stack[1], v_scale=stack[3],
      chunk_size=8, kv_layout=layout, layer=layer, ring=True, sliding_window=9))(
          jnp.int32(1))
  per_head = lambda s: s[..., None]  # noqa: E731
  exact = _per_row_reference(q, k8 * per_head(ks), v8 * per_head(vs), RING_LENGTHS,
                             sliding_window=9)
  assert_close(out, exact, 2e-5)


def test_ring_cache_needs_a_window_that_fits():
  q, k, v = _case(t=3)
  with pytest.raises(ValueError, match="ring=True needs a sliding_window"):
    kernels.decode_attention(q, k, v, lengths=jnp.ones(3), ring=True)
  with pytest.raises(ValueError, match="a ring cache of 37 slots cannot hold sliding_window "
                                       "36 \\+ q_len 3 - 1"):
    kernels.decode_attention(q, k, v, lengths=jnp.ones(3), ring=True, sliding_window=36)
