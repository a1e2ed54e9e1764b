"""paged_decode_attention against decode_attention on the gathered cache and against the
reference on each row's prefix; paged_cache_update against a numpy scatter."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_utils import assert_close, numpy_attention

import kernels

SLOTS = 48  # slots a row's table holds: 12 pages of 4, 6 of 8, 3 of 16
INT8_TOLERANCE = 0.03  # as test_decode_attention: max|x| / 254 per element


def _case(b=4, s=SLOTS, kvh=2, h=4, d=8, t=1, seed=0):
  # numpy draws: jax.random would compile a program for every new shape.
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  return normal(b, t, h, d), normal(b, s, kvh, d), normal(b, s, kvh, d)


def _paginate(k, v, lengths, page_size, *, hostile=True, spare=3, seed=0, fill=None):
  """Pools holding each row's cache [b, s, kvh, d] in shuffled pages, and the table.

  hostile: slots past each row's length hold inf keys and NaN values, so do the `spare`
  pages no row uses, and the table entries of pages wholly past a row's length are
  garbage ids (-1, num_pages, 2**30, or a spare page). fill: (key, value) instead of
  (inf, NaN) for all of those slots.
  """
  k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
  b, s, kvh, d = k.shape
  per_row = s // page_size
  n = b * per_row + spare
  ids = np.random.default_rng(seed).permutation(n)
  table = ids[:b * per_row].reshape(b, per_row).copy()
  kp = np.zeros((n, page_size, kvh, d), np.float32)
  vp = np.zeros_like(kp)
  if hostile:
    bad_k, bad_v = (np.inf, np.nan) if fill is None else fill
    past = (np.arange(s)[None] >= np.asarray(lengths)[:, None])[..., None, None]
    k, v = np.where(past, bad_k, k), np.where(past, bad_v, v)
    kp[:], vp[:] = bad_k, bad_v
  kp[table] = k.reshape(b, per_row, page_size, kvh, d)
  vp[table] = v.reshape(b, per_row, page_size, kvh, d)
  if hostile:
    garbage = [-1, n, 2**30, ids[-1]]
    first_unused = -(-np.asarray(lengths) // page_size)
    for row in range(b):
      for j in range(first_unused[row], per_row):
        table[row, j] = garbage[(row + j) % len(garbage)]
  return jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table, jnp.int32)


def _per_row_reference(q, k, v, lengths, **kw):
  """Each row attends to exactly its prefix: the independent numpy oracle."""
  return np.concatenate([
      numpy_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], **kw)
      for i, n in enumerate(lengths)])


_STATIC = ("causal", "sliding_window", "logits_soft_cap", "pages_per_block", "elementwise",
           "finite_tail")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _paged(q, kp, vp, table, lengths, k_scale=None, v_scale=None, **kw):
  """Traced lengths and table, as a sampler's step has them."""
  return kernels.paged_decode_attention(q, kp, vp, page_table=table, lengths=lengths,
                                        k_scale=k_scale, v_scale=v_scale, **kw)


@functools.partial(jax.jit, static_argnames=("causal", "sliding_window", "logits_soft_cap"))
def _contiguous(q, kp, vp, table, lengths, **kw):
  """decode_attention on the contiguous cache gather_pages makes of the same pool (one
  block: no loop, nothing skipped)."""
  return kernels.decode_attention(q, kernels.gather_pages(kp, table),
                                  kernels.gather_pages(vp, table), lengths=lengths,
                                  chunk_size=SLOTS, **kw)


def _lengths(t):
  # A row of exactly q_len tokens, one using every page, two in between (not on a page
  # boundary).
  return (t, SLOTS, 21, 9)


# (page_size, q_len, heads, kv_heads, kernel options, mask options)
CASES = [
    (4, 1, 4, 2, dict(pages_per_block=1), {}),  # 12 one-page blocks
    (16, 3, 4, 2, {}, {}),  # default: the whole 3-page table in one block
    (4, 3, 4, 1, dict(pages_per_block=3), dict(sliding_window=6, logits_soft_cap=5.0)),
    (4, 2, 4, 2, dict(pages_per_block=5, elementwise=False), dict(causal=False)),  # overlap
    (8, 1, 4, 1, dict(pages_per_block=1, elementwise=True), dict(sliding_window=20)),
]


@pytest.mark.parametrize("page_size,t,h,kvh,opts,kw", CASES)
def test_matches_contiguous_decode_and_reference(page_size, t, h, kvh, opts, kw):
  """Shuffled pages, inf / NaN past each row's length and in unused pages, garbage ids
  past each row's length: the result is decode_attention's on the gathered cache and the
  reference's on each row's prefix."""
  lengths = _lengths(t)
  q, k, v = _case(t=t, h=h, kvh=kvh, seed=page_size + t)
  kp, vp, table = _paginate(k, v, lengths, page_size)
  assert int(jnp.min(table)) == -1 and int(jnp.max(table)) == 2**30  # really hostile
  out = _paged(q, kp, vp, table, jnp.array(lengths), **opts, **kw)
  assert_close(out, _per_row_reference(q, k, v, lengths, **kw), 2e-5, "vs reference")
  assert_close(out, _contiguous(q, kp, vp, table, jnp.array(lengths), **kw), 2e-5,
               "vs decode_attention")


@pytest.mark.parametrize("lengths,kw", [
    ((1, 13, 7, 16), {}),
    # The earliest window starts at slot 23, the last slot of block 5: blocks 0-4 skipped.
    ((28, 41, 33, 47), dict(sliding_window=5)),
])
def test_blocks_are_skipped_past_the_rows_and_before_the_window(lengths, kw):
  """Every row ends in the first 4 of 12 one-page blocks (the rest skipped), or, with a
  window, every query's window starts past the first blocks (skipped): still the
  reference. The loop really branches per block."""
  q, k, v = _case(t=1, seed=7)
  kp, vp, table = _paginate(k, v, lengths, 4)
  out = _paged(q, kp, vp, table, jnp.array(lengths), pages_per_block=1, **kw)
  assert_close(out, _per_row_reference(q, k, v, lengths, **kw), 2e-5)
  jaxpr = jax.make_jaxpr(lambda *a: kernels.paged_decode_attention(
      *a[:3], page_table=a[3], lengths=a[4], pages_per_block=1))(q, kp, vp, table,
                                                                 jnp.array(lengths))
  scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
  assert any(e.primitive.name == "cond" for e in scan.params["jaxpr"].jaxpr.eqns)


def test_hostile_pool_gives_the_clean_result():
  """inf / NaN past the lengths and in unused pages, garbage ids past the lengths: the
  same finite output as a clean pool in the same pages."""
  lengths = _lengths(1)
  q, k, v = _case(t=1, seed=11)
  clean = _paginate(k, v, lengths, 4, hostile=False)
  hostile = _paginate(k, v, lengths, 4)
  got = _paged(q, *hostile, jnp.array(lengths), pages_per_block=1)
  assert np.all(np.isfinite(np.asarray(got)))
  assert_close(got, _paged(q, *clean, jnp.array(lengths), pages_per_block=1), 1e-6)


def test_finite_tail_skips_zeroing_and_keeps_the_result():
  """finite_tail=True: large finite garbage past the lengths and in unused pages, which
  garbage ids past the lengths (clamped into the pool) read; the result is the reference
  all the same."""
  lengths = _lengths(2)
  q, k, v = _case(t=2, seed=5)
  kp, vp, table = _paginate(k, v, lengths, 4, fill=(1e4, -3e4))
  out = _paged(q, kp, vp, table, jnp.array(lengths), pages_per_block=5, finite_tail=True)
  assert_close(out, _per_row_reference(q, k, v, lengths), 2e-5)


def test_rows_sharing_prefix_pages_match_private_copies():
  """Rows 0-2 share their first 3 pages (a 12-token prompt) in the same pool slots; the
  result is that of private copies, and the reference's."""
  lengths = (14, 20, 12, 9)  # row 2 is the prompt alone; row 3 shares nothing
  q, k, v = _case(t=1, seed=2)
  k, v = np.array(k), np.array(v)
  k[1:3, :12], v[1:3, :12] = k[0, :12], v[0, :12]  # a 12-token prompt: 3 pages
  kp, vp, private = _paginate(k, v, lengths, 4, hostile=False)
  shared = np.array(private)
  shared[1:3, :3] = shared[0, :3]
  assert len(set(shared[:3, :3].ravel())) == 3
  # The freed copies now hold garbage: only the shared pages may be read.
  freed = np.asarray(private[1:3, :3]).ravel()
  kp_s, vp_s = np.array(kp), np.array(vp)
  kp_s[freed], vp_s[freed] = np.nan, np.nan
  got = _paged(q, jnp.asarray(kp_s), jnp.asarray(vp_s), jnp.asarray(shared),
               jnp.array(lengths), pages_per_block=1)
  want = _paged(q, kp, vp, private, jnp.array(lengths), pages_per_block=1)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert_close(got, _per_row_reference(q, k, v, lengths), 2e-5)


_quantize = jax.jit(kernels.quantize_int8)
_gather = jax.jit(kernels.gather_pages)


def _slots_in_use(table, lengths, num_pages, page_size):
  """[num_pages, page_size] bool: the pool slots some row reads within its length."""
  used = np.zeros((num_pages, page_size), bool)
  for row, n in enumerate(lengths):
    for s in range(n):
      used[table[row, s // page_size], s % page_size] = True
  return used


def test_int8_pages_per_slot_scales_within_tolerance():
  """quantize_int8 of the pool gives per page slot scales; NaN scales past the lengths
  and in unused pages must not leak."""
  lengths = _lengths(2)
  q, k, v = _case(t=2, seed=3)
  kp, vp, table = _paginate(k, v, lengths, 4, hostile=False)
  (k8, ks), (v8, vs) = _quantize(kp), _quantize(vp)
  assert ks.shape == (kp.shape[0], 4, 2)
  used = _slots_in_use(np.asarray(table), lengths, kp.shape[0], 4)[..., None]
  ks_bad, vs_bad = np.where(used, ks, np.nan), np.where(used, vs, np.nan)
  out = _paged(q, k8, v8, table, jnp.array(lengths), jnp.asarray(ks_bad), jnp.asarray(vs_bad),
               pages_per_block=5)
  assert float(np.max(np.abs(np.asarray(out) - _per_row_reference(q, k, v, lengths)))) \
      < INT8_TOLERANCE
  # And it is the quantised pool, exactly dequantised, that is attended.
  deq = lambda x8, s: _gather(np.asarray(x8) * np.asarray(s)[..., None], table)
  assert_close(out, _per_row_reference(q, deq(k8, ks), deq(v8, vs), lengths), 2e-5)


def test_int8_pages_per_head_scales():
  lengths = _lengths(2)
  q, k, v = _case(t=2, seed=4)
  kp, vp, table = (np.asarray(x) for x in _paginate(k, v, lengths, 4, hostile=False))
  k_scale = np.max(np.abs(kp), axis=(0, 1, 3)) / 127  # [kv_heads]
  v_scale = np.max(np.abs(vp), axis=(0, 1, 3)) / 127
  k8 = np.round(kp / k_scale[:, None]).astype(np.int8)
  v8 = np.round(vp / v_scale[:, None]).astype(np.int8)
  out = _paged(q, jnp.asarray(k8), jnp.asarray(v8), jnp.asarray(table), jnp.array(lengths),
               jnp.asarray(k_scale), jnp.asarray(v_scale), pages_per_block=5)
  deq = lambda x8, s: _gather(x8 * s[:, None], table)
  assert_close(out, _per_row_reference(q, deq(k8, k_scale), deq(v8, v_scale), lengths), 2e-5)
  assert float(np.max(np.abs(np.asarray(out) - _per_row_reference(q, k, v, lengths)))) < 0.05


def test_default_blocking_and_bf16():
  lengths = _lengths(2)
  q, k, v = (x.astype(jnp.bfloat16) for x in _case(t=2, seed=6))
  kp, vp, table = _paginate(k, v, lengths, 4)
  out = _paged(q, kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16), table, jnp.array(lengths))
  assert out.dtype == jnp.bfloat16
  assert_close(out, _per_row_reference(q, k, v, lengths), 2e-2)


def test_jit_compiles_once_for_any_lengths_and_table():
  traces = []

  @jax.jit
  def step(q, kp, vp, table, lengths):
    traces.append(1)
    return kernels.paged_decode_attention(q, kp, vp, page_table=table, lengths=lengths,
                                          pages_per_block=4)

  q, k, v = _case(seed=8)
  for seed, lengths in enumerate([(1, 48, 21, 9), (5, 6, 7, 8), (30, 2, 47, 12)]):
    kp, vp, table = _paginate(k, v, lengths, 4, seed=seed)
    out = step(q, kp, vp, table, jnp.array(lengths))
    assert_close(out, _per_row_reference(q, k, v, lengths), 2e-5, str(lengths))
  assert len(traces) == 1


def test_gather_pages_is_the_contiguous_view():
  p = np.arange(5 * 2 * 3, dtype=np.float32).reshape(5, 2, 3)
  table = np.array([[4, 0], [-1, 7]], np.int32)  # -1 and 7 clamp to pages 0 and 4
  got = np.asarray(kernels.gather_pages(jnp.asarray(p), jnp.asarray(table)))
  np.testing.assert_array_equal(got, np.stack([np.concatenate([p[4], p[0]]),
                                               np.concatenate([p[0], p[4]])]))


def _numpy_update(pool, new, table, positions):
  pool = np.array(pool)
  page_size = pool.shape[1]
  for row in range(positions.shape[0]):
    for i, pos in enumerate(positions[row]):
      if 0 <= pos < table.shape[1] * page_size and 0 <= table[row, pos // page_size] < len(pool):
        pool[table[row, pos // page_size], pos % page_size] = new[row, i]
  return pool


_update = jax.jit(kernels.paged_cache_update, donate_argnums=(0, 1))


def test_cache_update_writes_where_the_table_says():
  """Positions -1 (padding), past the table, or behind a garbage id write nothing; the
  rest land in the page and offset the table gives, as a numpy scatter."""
  rng = np.random.default_rng(0)
  n, page_size = 9, 4
  before = rng.standard_normal((n, page_size, 2, 3), np.float32)
  table = np.array([[3, 7, 0], [5, -1, 6]], np.int32)
  positions = np.array([[0, 5, 11, -1, 6], [2, -1, 4, 9, 12]], np.int32)  # 4: id -1
  k_new = rng.standard_normal((2, 5, 2, 3), np.float32)
  kp, vp = jnp.array(before), jnp.array(before + 100)  # copies: donatable
  got_k, got_v = _update(kp, vp, jnp.asarray(k_new), jnp.asarray(k_new - 100),
                         page_table=jnp.asarray(table), positions=jnp.asarray(positions))
  assert kp.is_deleted() and vp.is_deleted()  # donated: updated in place
  np.testing.assert_array_equal(np.asarray(got_k),
                                _numpy_update(before, k_new, table, positions))
  np.testing.assert_array_equal(np.asarray(got_v),
                                _numpy_update(before + 100, k_new - 100, table, positions))
  # 6 of the 10 positions are written; page 8 (the last), where a wrapped -1 would land,
  # is not.
  assert int(np.sum(np.any(np.asarray(got_k) != before, axis=(2, 3)))) == 6
  np.testing.assert_array_equal(np.asarray(got_k)[8], before[8])


def test_prefill_then_decode_through_pages_matches_reference():
  """Prompts of different lengths prefilled into a NaN-initialised pool (padding
  positions -1 hold NaN and must not be written), then three decode tokens appended one
  at a time: each step's attention is the reference on the full sequences."""
  b, page_size, per_row = 4, 4, SLOTS // 4
  prompt = np.array([5, 11, 2, 8])
  steps = int(prompt.max())
  q, k, v = _case(b=b, s=steps + 3, t=3, seed=9)
  n = b * per_row + 3
  table = jnp.asarray(np.random.default_rng(1).permutation(n)[:b * per_row]
                      .reshape(b, per_row), jnp.int32)
  kp = jnp.full((n, page_size, 2, 8), jnp.nan)
  vp = jnp.full((n, page_size, 2, 8), jnp.nan)
  pad = np.arange(steps)[None] >= prompt[:, None]
  positions = np.where(pad, -1, np.arange(steps)[None]).astype(np.int32)
  nan_pad = lambda x: jnp.asarray(np.where(pad[..., None, None], np.nan, x[:, :steps]))
  kp, vp = _update(kp, vp, nan_pad(k), nan_pad(v), page_table=table,
                   positions=jnp.asarray(positions))
  rows = np.arange(b)
  for j in range(3):
    pos = prompt + j
    kp, vp = _update(kp, vp, jnp.asarray(np.asarray(k)[rows, pos][:, None]),
                     jnp.asarray(np.asarray(v)[rows, pos][:, None]), page_table=table,
                     positions=jnp.asarray(pos[:, None], jnp.int32))
    lengths = pos + 1
    out = _paged(q[:, j:j + 1], kp, vp, table, jnp.asarray(lengths), pages_per_block=1)
    assert_close(out, _per_row_reference(q[:, j:j + 1], k, v, lengths), 2e-5, f"step {j}")


def test_cache_update_int8_with_scale_pools():
  """Quantised tokens and their scales written through the table: the pools then hold
  exactly quantize_int8 of the tokens, and decoding over them is within tolerance."""
  lengths = np.array(_lengths(2))
  q, k, v = _case(t=2, seed=12)
  n = 4 * (SLOTS // 4) + 3
  table = jnp.asarray(np.random.default_rng(2).permutation(n)[:SLOTS]
                      .reshape(4, SLOTS // 4), jnp.int32)
  int8_pool = lambda: jnp.zeros((n, 4, 2, 8), jnp.int8)
  (k8, ks), (v8, vs) = _quantize(k), _quantize(v)
  slots = np.arange(SLOTS)[None]
  positions = np.where(slots < lengths[:, None], slots, -1).astype(np.int32)
  kp, vp, ksp, vsp = jax.jit(kernels.paged_cache_update)(
      int8_pool(), int8_pool(), k8, v8, page_table=table, positions=jnp.asarray(positions),
      k_scale_pages=jnp.full((n, 4, 2), jnp.nan), v_scale_pages=jnp.full((n, 4, 2), jnp.nan),
      k_scale_new=ks, v_scale_new=vs)
  for got, want in ((kp, k8), (vp, v8), (ksp, ks), (vsp, vs)):
    view = np.asarray(_gather(got, table))
    for row, n_row in enumerate(lengths):
      np.testing.assert_array_equal(view[row, :n_row], np.asarray(want)[row, :n_row])
  # The same program as the per-slot test above (int8 pools, per-slot scales).
  out = _paged(q, kp, vp, table, jnp.asarray(lengths), ksp, vsp, pages_per_block=5)
  assert float(np.max(np.abs(np.asarray(out) - _per_row_reference(q, k, v, lengths)))) \
      < INT8_TOLERANCE


def _bad_calls():
  # numpy inputs: the checks read shapes only, and slicing them compiles nothing.
  q, k, v = _case(b=3, t=1, h=6)
  q, kp, vp, table = (np.asarray(x) for x in (q, *_paginate(k, v, (1, 2, 3), 4,
                                                                hostile=False)))
  lengths = np.ones(3, np.int32)
  attend = functools.partial(kernels.paged_decode_attention, page_table=table,
                             lengths=lengths)
  i8 = lambda x: x.astype(np.int8)
  new = np.zeros((3, 2, 2, 8))
  update = functools.partial(kernels.paged_cache_update, page_table=table,
                             positions=np.zeros((3, 2), np.int32))
  return [
      (lambda: attend(q[0], kp, vp), r"q must be \[batch, q_len, heads, head_dim\]"),
      (lambda: attend(q, kp[0], vp[0]), r"k_pages must be \[num_pages, page_size, kv_heads"),
      (lambda: attend(q, kp, vp[:, :2]), "v_pages must have the shape of k_pages"),
      (lambda: attend(q, kp[:0], vp[:0]), "k_pages must hold at least one page"),
      (lambda: kernels.paged_decode_attention(q, kp, vp, page_table=table.astype(float),
                                              lengths=lengths), "page_table must be an int"),
      (lambda: kernels.paged_decode_attention(q, kp, vp, page_table=table[:2],
                                              lengths=lengths),
       r"page_table must be \[batch, pages_per_row\] with batch 3"),
      (lambda: kernels.paged_decode_attention(q, kp, vp, page_table=table[0],
                                              lengths=lengths), "page_table must be"),
      (lambda: kernels.paged_decode_attention(q, kp, vp, page_table=table,
                                              lengths=np.ones(2)),
       r"lengths must be \[batch\] = \(3,\)"),
      (lambda: kernels.paged_decode_attention(
          np.zeros((3, 9, 6, 8)), kp, vp, page_table=table[:, :2], lengths=lengths),
       "q_len 9 exceeds the 8 slots of a row's page table"),
      (lambda: attend(q, i8(kp), i8(vp)), r"k_scale is required for an integer \(int8\)"),
      (lambda: attend(q, i8(kp), i8(vp), k_scale=np.ones(2), v_scale=np.ones((3, 4, 2))),
       r"v_scale must be \[kv_heads\] = \(2,\) or per page slot and head .* \(39, 4, 2\)"),
      (lambda: attend(q, kp, vp, pages_per_block=0), "pages_per_block must be a positive int"),
      (lambda: attend(q, kp, vp, pages_per_block=1.5), "pages_per_block must be a positive"),
      (lambda: attend(q, kp, vp, pages_per_block=True), "pages_per_block must be a positive"),
      (lambda: attend(q, np.zeros((5, 4, 4, 8)), np.zeros((5, 4, 4, 8))),
       "q heads 6 must be a multiple of k kv_heads 4"),
      (lambda: attend(q, kp[..., :4], vp[..., :4]), "head_dim 4 does not match q head_dim 8"),
      (lambda: attend(q, kp, vp, sliding_window=0), "sliding_window must be a positive int"),
      (lambda: attend(q, kp, vp, elementwise="scores"), "elementwise must be None, True"),
      (lambda: update(kp, vp, new[..., :4], new[..., :4]), r"k_new must be \[batch, t,"),
      (lambda: update(kp, vp, new, new[:, :1]), "v_new must have the shape of k_new"),
      (lambda: kernels.paged_cache_update(kp, vp, new, new, page_table=table,
                                          positions=np.zeros((3, 1), np.int32)),
       r"positions must be int \[batch, t\] = \(3, 2\)"),
      (lambda: update(i8(kp), i8(vp), new, new), "k_new must be integer, with k_scale_new"),
      (lambda: update(kp, vp, new, new, k_scale_pages=np.ones((39, 4, 2))),
       "must be given together"),
      (lambda: update(i8(kp), i8(vp), i8(new), i8(new), k_scale_pages=np.ones((39, 4, 2)),
                      v_scale_pages=np.ones((39, 4, 2)), k_scale_new=np.ones((3, 2, 2)),
                      v_scale_new=np.ones((3, 2))),
       r"v_scale_new must have shape \(3, 2, 2\)"),
      (lambda: kernels.gather_pages(np.zeros(4), table), r"pages must be \[num_pages"),
  ]


def test_bad_inputs_raise_one_line_errors_naming_the_argument():
  for call, pattern in _bad_calls():
    with pytest.raises(ValueError, match=pattern) as err:
      call()
    assert "\n" not in str(err.value), str(err.value)
