"""Pallas flash attention: both kernel families against the reference, block skipping,
and lowering for TPU (Mosaic) and GPU (Triton) without the hardware."""
import contextlib
import dataclasses
import functools
import importlib
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
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
  f32_reference,
  make_inputs,
  value_and_vjp,
)

import kernels

fa = importlib.import_module("kernels.flash_attention")  # the module, not the function
ON = jax.default_backend()


def _block_counts(cfg, x, seg=None):
  """The kernels' own counters (forward, dq, dk / dv) of one forward and backward, in one
  jit (eagerly, every op around the kernels compiles on its own)."""

  @jax.jit
  def run(q, k, v, dout, seg):
    out, lse, fwd_counts = fa._forward(cfg, q, k, v, seg, seg, counts=True)
    di = jnp.einsum("bqhd,bqhd->bhq", dout, out)
    _, (dq_counts, dkv_counts) = fa._backward(cfg.for_backward(), q, k, v, seg, seg, dout,
                                              lse, di, counts=True)
    return fwd_counts, dq_counts, dkv_counts

  return run(x["q"], x["k"], x["v"], x["dout"], seg)


class FlashAttentionTest:
  """Cases shared by every kernel family; subclasses pick the family and the mode."""
  BACKEND = "tpu"
  INTERPRET = False
  BLOCKS = (128, 128)  # the smallest TPU blocks: lengths 128-512 span 1-4 blocks
  CASES = CASES
  BF16_CASES = BF16_CASES[:1]

  @pytest.fixture(autouse=True)
  def _needs_hardware(self):
    if not self.INTERPRET and ON != self.BACKEND:
      pytest.skip(f"needs a {self.BACKEND} device")

  def flash(self, *args, **kwargs):
    return fa.flash_attention(*args, backend=self.BACKEND, interpret=self.INTERPRET,
                              block_q=self.BLOCKS[0], block_kv=self.BLOCKS[1], **kwargs)

  def test_matches_reference_f32(self, case):
    check_against_reference(self.flash, case, jnp.float32)

  def test_matches_reference_bf16(self, bf16_case):
    check_against_reference(self.flash, bf16_case, jnp.bfloat16)

  @pytest.mark.parametrize("window", [None, 100])
  def test_visits_only_visible_blocks(self, window):
    """The kernels' own counters: fully masked block pairs are never computed."""
    case = Case("count", batch=1, q_len=384, kv_len=512, heads=4, kv_heads=2)
    x = make_inputs(case)
    # The dq kernel runs on its own blocks (twice the others'), the dk / dv kernel on
    # the backward blocks.
    bq, bk = self.BLOCKS
    cfg = fa.make_config(x["q"], x["k"], causal=True, sliding_window=window,
                         backend=self.BACKEND, block_q=bq, block_kv=bk,
                         block_q_dq=2 * bq, block_kv_dq=2 * bk, interpret=self.INTERPRET)
    fwd_counts, dq_counts, dkv_counts = _block_counts(cfg, x)
    visible = brute_force_visible(cfg)
    total = cfg.num_q_blocks * cfg.num_kv_blocks
    assert visible.sum() < total  # the case does have blocks to skip
    per_q_block = np.broadcast_to(visible.sum(axis=1), (1, 4, cfg.num_q_blocks))
    np.testing.assert_array_equal(np.asarray(fwd_counts[..., 0]), per_q_block)
    dq_cfg = cfg.for_backward().for_dq()
    assert (dq_cfg.block_q, dq_cfg.block_kv) == (2 * bq, 2 * bk)
    dq_visible = brute_force_visible(dq_cfg)
    np.testing.assert_array_equal(
        np.asarray(dq_counts[..., 0]), np.broadcast_to(dq_visible.sum(axis=1),
                                                       (1, 4, dq_cfg.num_q_blocks)))
    # Each kv block is visited once per query head of its group (2 heads per kv head).
    per_kv_block = np.broadcast_to(2 * visible.sum(axis=0), (1, 2, cfg.num_kv_blocks))
    np.testing.assert_array_equal(np.asarray(dkv_counts[..., 0]), per_kv_block)
    # Only block pairs the mask cuts through pay for the element mask.
    masked = visible & ~brute_force_full(cfg)
    assert masked.any() and (window is not None or masked.sum() < visible.sum())
    np.testing.assert_array_equal(
        np.asarray(fwd_counts[..., 1]),
        np.broadcast_to(masked.sum(axis=1), (1, 4, cfg.num_q_blocks)))

  def test_packed_rows_skip_blocks_of_other_sequences(self):
    """Segment ids narrow the visited blocks to those holding a query and a key of one
    sequence (the kernels' counters equal a brute-force element mask), and the output
    and gradients still match the reference."""
    lengths = ([300, 150, 24], [260, 60, 100, 40])  # then padding (id 0)
    t = 512
    seg = np.zeros((2, t), np.int32)
    for row, parts in enumerate(lengths):
      seg[row, :sum(parts)] = np.repeat(np.arange(1, len(parts) + 1), parts)
    seg = jnp.asarray(seg)
    case = Case("packed", batch=2, q_len=t, kv_len=t, heads=4, kv_heads=2)
    x = make_inputs(case)
    cfg = fa.make_config(x["q"], x["k"], causal=True, segments=True, backend=self.BACKEND,
                         block_q=self.BLOCKS[0], block_kv=self.BLOCKS[1],
                         interpret=self.INTERPRET)
    fwd_counts, dq_counts, dkv_counts = _block_counts(cfg, x, seg)
    for row in range(2):
      ids = np.asarray(seg[row])
      visible = brute_force_visible(cfg, ids, ids)
      assert visible.sum() < brute_force_visible(cfg).sum()  # segments do skip blocks
      # Block pairs inside one sequence (and below the diagonal) skip the element mask.
      masked = visible & ~brute_force_full(cfg, ids, ids)
      assert 0 < masked.sum() < visible.sum()
      for counts, table in ((fwd_counts, visible), (fwd_counts, masked),
                            (dq_counts, visible), (dq_counts, masked)):
        column = 0 if table is visible else 1
        np.testing.assert_array_equal(
            np.asarray(counts[row, ..., column]),
            np.broadcast_to(table.sum(axis=1), (4, cfg.num_q_blocks)))
      for column, table in enumerate((visible, masked)):
        np.testing.assert_array_equal(
            np.asarray(dkv_counts[row, ..., column]),
            np.broadcast_to(2 * table.sum(axis=0), (2, cfg.num_kv_blocks)))
    kw = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    got, got_grads = value_and_vjp(self.flash, x, **kw)
    want, want_grads = f32_reference(x, **kw)
    assert_close(got, want, 2e-5, "packed out")
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
      assert_close(g, w, 1e-4, f"packed {name}")

  def test_fully_masked_rows_are_zero_with_finite_grads(self):
    case = Case("pad", segments=True, q_len=128, kv_len=128)
    x = make_inputs(case)
    kw = case.mask_kwargs(x)
    out, grads = value_and_vjp(self.flash, x, **kw)
    padded = np.asarray(x["q_seg"] == 0)
    np.testing.assert_array_equal(np.asarray(out)[padded], 0.0)
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_array_equal(np.asarray(grads[0])[padded], 0.0)


BACKWARD_OPTIONS = (  # (backend, options, case names)
    ("gpu", dict(block_q=64, block_kv=32, block_q_bwd=32, block_kv_bwd=64, block_q_dq=64,
                 block_kv_dq=16), ("causal_gqa_ragged", "segments_q_shorter")),
    ("gpu", dict(block_q=64, block_kv=32, block_q_bwd=32, block_kv_bwd=48, dq_atomic=True),
     ("causal_gqa_ragged", "segments_q_shorter", "soft_cap_sliding")),
    ("tpu", dict(block_q=128, block_kv=128, block_q_dq=256, block_kv_dq=128),
     ("segments_q_shorter",)),
    ("tpu", dict(block_q=128, block_kv=128, fused_bwd=True),
     ("causal_gqa_ragged", "noncausal_mqa_segments", "segments_q_shorter",
      "soft_cap_sliding")),
)


@pytest.mark.parametrize("backend,options,case", [
    pytest.param(backend, options, case, id=f"{backend}-{sorted(options)[-1]}-{case.name}")
    for backend, options, names in BACKWARD_OPTIONS for case in CASES if case.name in names])
def test_backward_options_match_reference(backend, options, case):
  """dq kernel blocks other than the dk / dv kernel's (lengths padded to both), dq by
  atomic adds in the dk / dv kernel (GPU), and dq from per-kv-block partials of the
  dk / dv kernel (TPU's fused backward) keep the gradients exact."""
  fn = functools.partial(fa.flash_attention, backend=backend, interpret=True, **options)
  check_against_reference(fn, case, jnp.float32)


def _parametrize(cls):
  """Attaches each subclass's own case lists to the shared test methods."""
  ids = lambda c: c.name
  for name, cases, arg in (("test_matches_reference_f32", cls.CASES, "case"),
                           ("test_matches_reference_bf16", cls.BF16_CASES, "bf16_case")):
    method = getattr(FlashAttentionTest, name)

    @functools.wraps(method)
    def test(self, _m=method, **kw):
      return _m(self, **kw)

    setattr(cls, name, pytest.mark.parametrize(arg, cases, ids=ids)(test))
  return cls


@_parametrize
class TestFlashTPU(FlashAttentionTest):
  BACKEND = "tpu"


@_parametrize
class TestFlashTPUInterpret(TestFlashTPU):
  INTERPRET = True

  @pytest.mark.slow  # the GPU family runs it by default (the block logic is shared)
  def test_packed_rows_skip_blocks_of_other_sequences(self):
    super().test_packed_rows_skip_blocks_of_other_sequences()


@_parametrize
class TestFlashGPU(FlashAttentionTest):
  BACKEND = "gpu"
  BLOCKS = (64, 32)


@_parametrize
class TestFlashGPUInterpret(TestFlashGPU):
  INTERPRET = True
  # The block logic is shared with the TPU family; a subset keeps the suite fast.
  CASES = tuple(c for c in CASES if c.name in (
      "causal_gqa_ragged", "segments_q_shorter", "soft_cap_sliding"))

  @pytest.mark.slow  # the TPU family runs it by default (the block logic is shared)
  def test_fully_masked_rows_are_zero_with_finite_grads(self):
    super().test_fully_masked_rows_are_zero_with_finite_grads()


def _padded_mask(cfg):
  """[nq * block_q, nk * block_kv] bool element mask over the padded blocks: True where
  a real query sees a real key."""
  offset = cfg.kv_len - cfg.q_len if cfg.q_offset is None else cfg.q_offset
  q_pos = np.arange(cfg.num_q_blocks * cfg.block_q) + offset
  kv_pos = np.arange(cfg.num_kv_blocks * cfg.block_kv)
  diff = q_pos[:, None] - kv_pos[None, :]
  mask = np.broadcast_to(kv_pos[None, :] < cfg.kv_len, diff.shape).copy()
  mask[cfg.q_len:] = False
  if cfg.causal:
    mask &= diff >= 0
  if cfg.sliding_window is not None:
    mask &= diff < cfg.sliding_window
    if not cfg.causal:
      mask &= -diff < cfg.sliding_window
  return mask


def _per_block(cfg, mask, reduce):
  nq, nk = cfg.num_q_blocks, cfg.num_kv_blocks
  return reduce(mask.reshape(nq, cfg.block_q, nk, cfg.block_kv), axis=(1, 3))


def brute_force_visible(cfg, q_seg=None, kv_seg=None):
  """[q blocks, kv blocks] bool: does any real (query, key) pair pass the mask (and,
  given one row's segment ids, share a non-zero id)."""
  mask = _padded_mask(cfg)
  if q_seg is not None:
    qs = np.zeros(mask.shape[0], np.int64)
    ks = np.zeros(mask.shape[1], np.int64)
    qs[:len(q_seg)], ks[:len(kv_seg)] = q_seg, kv_seg
    mask = mask & (qs[:, None] == ks[None, :]) & (ks[None, :] != 0)
  return _per_block(cfg, mask, np.any)


def brute_force_full(cfg, q_seg=None, kv_seg=None):
  """[q blocks, kv blocks] bool: no element of the block pair is masked (rows past
  q_len do not count without segment ids; with them, their id 0 masks them)."""
  mask = _padded_mask(cfg)
  if q_seg is None:
    mask[cfg.q_len:] = True
  else:
    qs = np.zeros(mask.shape[0], np.int64)
    ks = np.zeros(mask.shape[1], np.int64)
    qs[:len(q_seg)], ks[:len(kv_seg)] = q_seg, kv_seg
    mask = mask & (qs[:, None] == ks[None, :]) & (ks[None, :] != 0)
  return _per_block(cfg, mask, np.all)


def _block_hull(table):
  """[m, n] bool -> [m, 2] first / last true column, (n, -1) for an empty row."""
  n = table.shape[1]
  out = np.tile([n, -1], (table.shape[0], 1))
  for i, row in enumerate(table):
    cols = np.flatnonzero(row)
    if cols.size:
      out[i] = cols[0], cols[-1]
  return out


# One program per shape (the kernels call it inside theirs), not one dispatch per op.
_segment_block_ranges = jax.jit(fa.segment_block_ranges, static_argnums=(2, 3))


@pytest.mark.slow
@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(data=st.data(), block_q=st.sampled_from([16, 32, 48]),
                  block_kv=st.sampled_from([16, 32, 80]), packed=st.booleans())
def test_segment_block_ranges(data, block_q, block_kv, packed):
  """Every block pair holding a query and a key of one segment lies inside both ranges;
  for packed rows (ids non-decreasing, then padding) the ranges are exactly the hull of
  those pairs. The fully visible sub-ranges hold only pairs the ids mask nowhere."""
  nq, nk = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
  ids = st.integers(0, 4)
  if packed:
    t = nq * block_q
    cuts = sorted(data.draw(st.lists(st.integers(0, t), min_size=3, max_size=3)))
    row = np.zeros(t, np.int32)
    for i, (a, b) in enumerate(zip([0] + cuts[:2], cuts)):
      row[a:b] = i + 1
    q_seg = kv_seg = row[None]
    block_kv = block_q
    nk = nq
  else:
    q_seg = np.asarray([data.draw(st.lists(ids, min_size=nq * block_q,
                                           max_size=nq * block_q))], np.int32)
    kv_seg = np.asarray([data.draw(st.lists(ids, min_size=nk * block_kv,
                                            max_size=nk * block_kv))], np.int32)
  kv_ranges, q_ranges = (np.asarray(r[0]) for r in _segment_block_ranges(
      jnp.asarray(q_seg), jnp.asarray(kv_seg), block_q, block_kv))
  share = (q_seg[0][:, None] == kv_seg[0][None, :]) & (kv_seg[0][None, :] != 0)
  pairs = share.reshape(nq, block_q, nk, block_kv).any(axis=(1, 3))
  for qi, ki in zip(*np.nonzero(pairs)):
    assert kv_ranges[qi, 0] <= ki <= kv_ranges[qi, 1]
    assert q_ranges[ki, 0] <= qi <= q_ranges[ki, 1]
  # Columns 2-3: pairs the ids mask nowhere. Never a pair with a masked element (the
  # kernels skip the mask there), and for packed rows every such pair.
  full = share.reshape(nq, block_q, nk, block_kv).all(axis=(1, 3))
  for qi in range(nq):
    for ki in range(kv_ranges[qi, 2], kv_ranges[qi, 3] + 1):
      assert full[qi, ki]
  for ki in range(nk):
    for qi in range(q_ranges[ki, 2], q_ranges[ki, 3] + 1):
      assert full[qi, ki]
  if packed:
    np.testing.assert_array_equal(kv_ranges[:, :2], _block_hull(pairs))
    np.testing.assert_array_equal(q_ranges[:, :2], _block_hull(pairs.T))
    np.testing.assert_array_equal(kv_ranges[:, 2:], _block_hull(full))
    np.testing.assert_array_equal(q_ranges[:, 2:], _block_hull(full.T))


def _range_config(q_len, kv_len, block_q, block_kv, causal, window, q_offset=None):
  q = jax.ShapeDtypeStruct((1, q_len, 1, 8), jnp.float32)
  k = jax.ShapeDtypeStruct((1, kv_len, 1, 8), jnp.float32)
  return fa.make_config(q, k, causal=causal, sliding_window=window, backend="gpu",
                        block_q=block_q, block_kv=block_kv, q_offset=q_offset)


def _range_tables(cfg, kv_range, q_range):
  """[q blocks, kv blocks] bool tables of the pairs inside kv_range(qi) / q_range(ki)."""
  nq, nk = cfg.num_q_blocks, cfg.num_kv_blocks
  inside = lambda lo_hi, n: (np.arange(n) >= int(lo_hi[0])) & (np.arange(n) <= int(lo_hi[1]))
  by_kv = np.stack([inside(kv_range(cfg, qi), nk) for qi in range(nq)])
  by_q = np.stack([inside(q_range(cfg, ki), nq) for ki in range(nk)], axis=1)
  return by_kv, by_q


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(q_len=st.integers(1, 700), kv_len=st.integers(1, 700),
                  block_q=st.sampled_from([16, 32, 48, 128]),
                  block_kv=st.sampled_from([16, 64, 96]), causal=st.booleans(),
                  window=st.one_of(st.none(), st.integers(1, 300)),
                  q_offset=st.one_of(st.none(), st.integers(-200, 1500)))
def test_block_ranges_are_exact(q_len, kv_len, block_q, block_kv, causal, window, q_offset):
  """kv_block_range / q_block_range (used by the kernels' loops, pl.when and index
  maps) select exactly the block pairs with a visible (query, key) pair, whatever the
  queries' position (`q_offset`: ring attention's windowed blocks)."""
  cfg = _range_config(q_len, kv_len, block_q, block_kv, causal, window, q_offset)
  want = brute_force_visible(cfg)
  got_kv, got_q = _range_tables(cfg, fa.kv_block_range, fa.q_block_range)
  np.testing.assert_array_equal(got_kv, want)
  np.testing.assert_array_equal(got_q, want)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(q_len=st.integers(1, 700), kv_len=st.integers(1, 700),
                  block_q=st.sampled_from([16, 32, 48, 128]),
                  block_kv=st.sampled_from([16, 64, 96]), causal=st.booleans(),
                  window=st.one_of(st.none(), st.integers(1, 300)),
                  group=st.sampled_from([1, 3]))
# 63 steps of a 90-step rectangle: exactly the forward's 0.7 (0.7 * 90 rounds below 63)
@hypothesis.example(q_len=273, kv_len=402, block_q=16, block_kv=96, causal=True,
                    window=None, group=1)
def test_compact_steps_list_the_visible_pairs(q_len, kv_len, block_q, block_kv, causal,
                                              window, group):
  """A compact grid's steps: each row's visible pairs in order (kv-major: for each head
  of the group), and one step at an invisible block for a row that sees none, so its
  init and finish run; none at all when it would not be shorter than the rectangle, and
  by default (compact_grid=None) unless it drops most of the rectangle's steps."""
  cfg = dataclasses.replace(_range_config(q_len, kv_len, block_q, block_kv, causal, window),
                            group=group, compact_grid=True)
  visible = brute_force_visible(cfg)
  nq, nk = visible.shape
  for kernel, table, heads in (("fwd", visible, [0]), ("dq", visible, [0]),
                                ("dkv", visible.T, range(group))):
    kv_major = kernel == "dkv"
    steps = fa.compact_steps(cfg, kernel)
    if not causal and window is None:
      assert steps is None
      continue
    want = [(row, gi, col) for row, hits in enumerate(table) for gi in heads
            for col in (list(np.flatnonzero(hits)) or [None])]
    auto = fa.compact_steps(dataclasses.replace(cfg, compact_grid=None), kernel)
    fraction = fa.COMPACT_AUTO_FRACTION[kernel]
    assert auto == (steps if len(want) <= fraction * nq * nk * len(heads) else None)
    if len(want) >= nq * nk * len(heads):
      assert steps is None
      continue
    got = [s if kv_major else (s[0], 0, s[1]) for s in steps]
    assert len(got) == len(want)
    for (row, gi, col), (want_row, want_gi, want_col) in zip(got, want):
      assert (row, gi) == (want_row, want_gi)
      if want_col is None:
        assert 0 <= col < table.shape[1] and not table[row, col]
      else:
        assert col == want_col
  assert fa.compact_steps(dataclasses.replace(cfg, compact_grid=False)) is None


def test_compact_grid_falls_back_to_the_rectangle_past_its_smem_budget(monkeypatch):
  q = jax.ShapeDtypeStruct((1, 2048, 2, 8), jnp.float32)
  cfg = fa.make_config(q, q, causal=True, backend="tpu", block_q=128, block_kv=128,
                       compact_grid=True)
  assert len(fa.compact_steps(cfg)) == 136 and fa._TpuGrid.make(cfg, "fwd").dims == (136,)
  monkeypatch.setattr(fa, "MAX_COMPACT_STEPS", 135)
  fa.compact_steps.cache_clear()
  try:
    assert fa.compact_steps(cfg) is None and fa._TpuGrid.make(cfg, "fwd").dims == (16, 16)
  finally:
    fa.compact_steps.cache_clear()


# Rows that see no key at all (the compact grid's one-step rows): q rows before the
# first key (q_len > kv_len, causal), kv blocks no query reaches (a window, q shorter).
EMPTY_ROW_CASES = [
    Case("causal_q_longer", q_len=400, kv_len=200, heads=2, kv_heads=1),
    Case("window_q_shorter", q_len=130, kv_len=600, heads=4, kv_heads=2, causal=False,
         sliding_window=100),
    Case("window_segments", q_len=384, kv_len=384, heads=2, kv_heads=1, segments=True,
         sliding_window=90, logits_soft_cap=5.0),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", EMPTY_ROW_CASES, ids=lambda c: c.name)
def test_compact_and_rectangular_grids_agree_bitwise(case, fused):
  """Both grids run the same steps in the same order: identical outputs and gradients,
  and both match the reference (rows that see no key: zero output, zero gradients)."""
  x = make_inputs(case)
  kw = case.mask_kwargs(x)
  results = []
  for compact in (True, False):
    fn = functools.partial(fa.flash_attention, backend="tpu", interpret=True,
                           block_q=128, block_kv=128, fused_bwd=fused,
                           compact_grid=compact)
    q = jax.ShapeDtypeStruct(x["q"].shape, x["q"].dtype)
    k = jax.ShapeDtypeStruct(x["k"].shape, x["k"].dtype)
    cfg = fa.make_config(q, k, causal=case.causal, segments=case.segments,
                         sliding_window=case.sliding_window, backend="tpu",
                         block_q=128, block_kv=128, compact_grid=compact)
    assert (fa.compact_steps(cfg) is not None) == compact
    results.append(value_and_vjp(fn, x, **kw))
  (out, grads), (rect_out, rect_grads) = results
  np.testing.assert_array_equal(np.asarray(out), np.asarray(rect_out))
  for g, r in zip(grads, rect_grads):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  want, want_grads = f32_reference(x, **kw)
  assert_close(out, want, 2e-5, f"{case.name} out")
  for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
    assert_close(g, w, 1e-4, f"{case.name} {name}")


def brute_force_fully_visible(cfg):
  """[q blocks, kv blocks] bool: every real query of the q block sees every key slot
  of the kv block (slots past kv_len count as masked; padding rows of q are
  discarded, so they never mask)."""
  mask = _padded_mask(cfg)
  mask[cfg.q_len:] = True
  return _per_block(cfg, mask, np.all)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(q_len=st.integers(1, 700), kv_len=st.integers(1, 700),
                  block_q=st.sampled_from([16, 32, 48, 128]),
                  block_kv=st.sampled_from([16, 64, 96]), causal=st.booleans(),
                  window=st.one_of(st.none(), st.integers(1, 300)),
                  q_offset=st.one_of(st.none(), st.integers(-200, 1500)))
def test_full_ranges_never_skip_a_mask(q_len, kv_len, block_q, block_kv, causal, window,
                                       q_offset):
  """The GPU loops run kv_full_range / q_full_range without the element mask: those
  ranges hold only fully visible block pairs. The kv range is exact, and so is the q
  range without a sliding window (a loose range would only cost speed)."""
  cfg = _range_config(q_len, kv_len, block_q, block_kv, causal, window, q_offset)
  want = brute_force_fully_visible(cfg) & brute_force_visible(cfg)
  got_kv, got_q = _range_tables(cfg, fa.kv_full_range, fa.q_full_range)
  np.testing.assert_array_equal(got_kv, want)
  assert not (got_q & ~want).any(), "an unmasked q range holds a masked block"
  if window is None:
    np.testing.assert_array_equal(got_q, want)


def test_full_ranges_ignore_segments():
  q = jax.ShapeDtypeStruct((1, 256, 1, 8), jnp.float32)
  cfg = fa.make_config(q, q, causal=True, segments=True, backend="gpu", block_q=64,
                       block_kv=64)
  for i in range(4):
    lo, hi = (int(x) for x in fa.kv_full_range(cfg, i))
    assert lo > hi
    lo, hi = (int(x) for x in fa.q_full_range(cfg, i))
    assert lo > hi


@pytest.mark.slow
@pytest.mark.parametrize("case,compact", [
    (Case("sim", batch=1, q_len=256, kv_len=256, heads=2, kv_heads=1, segments=True),
     None),
    # A compact grid with one-step rows: kv blocks no query reaches.
    (Case("sim_window", batch=1, q_len=130, kv_len=600, heads=2, kv_heads=1,
          causal=False, sliding_window=100), True),
], ids=lambda c: getattr(c, "name", str(c)))
def test_tpu_simulator_checks_scratch_and_dma(case, compact):
  """The TPU interpreter models VMEM scratch, DMAs and the grid's semantics (an output
  block is written back when the next step maps elsewhere)."""
  from jax.experimental.pallas import tpu as pltpu
  fn = functools.partial(fa.flash_attention, backend="tpu", block_q=128, block_kv=128,
                         compact_grid=compact, interpret=pltpu.InterpretParams())
  check_against_reference(fn, case, jnp.float32)


FUSED_SIM_CASES = [  # (case, compact_grid)
    (Case("fused_sim", batch=2, q_len=384, kv_len=384, heads=2, kv_heads=1, segments=True),
     None),
    (Case("fused_sim", batch=2, q_len=384, kv_len=384, heads=2, kv_heads=1, segments=True),
     True),
    # A window: pair (qi, ki) writes slot ki - lo(qi) of 2 (+ the spare), not 6.
    (Case("fused_sim_window", batch=2, q_len=768, kv_len=768, heads=2, kv_heads=1,
          segments=True, sliding_window=100), None),
    # Kv block 0 is out of every query's window: its steps write its spare block (the
    # spare slot has a block per kv block: 8, more than the 6 q blocks).
    (Case("fused_sim_window_q_shorter", batch=2, q_len=768, kv_len=1024, heads=2,
          kv_heads=1, causal=False, sliding_window=100), None),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,compact", FUSED_SIM_CASES,
                         ids=lambda c: getattr(c, "name", str(c)))
def test_fused_backward_masks_the_partials_no_step_wrote(monkeypatch, case, compact):
  """The fused backward's dq partials are written at visited block pairs only; the TPU
  simulator starts the buffer as NaN (uninitialised memory), and the sum must mask the
  rest out: every slot `fused_visited` names holds a written value, others do hold NaN
  garbage, and dq is exact. (A skipped step maps to a neighbour's block or to the spare
  slot, so a block outside the visited pairs may also receive a copy of values.)"""
  from jax.experimental.pallas import tpu as pltpu
  seen = {}
  fused_dq = fa._fused_dq

  def spy(cfg, parts, q_seg, kv_seg):
    ranges = fa._segment_ranges(cfg, q_seg, kv_seg)[1] if cfg.segments else None
    seen["cfg"] = cfg
    jax.debug.callback(lambda p, v: seen.update(parts=np.asarray(p), visited=np.asarray(v)),
                       parts, fa.fused_visited(cfg, ranges))
    return fused_dq(cfg, parts, q_seg, kv_seg)

  monkeypatch.setattr(fa, "_fused_dq", spy)
  fn = functools.partial(fa.flash_attention, backend="tpu", block_q=128, block_kv=128,
                         fused_bwd=True, compact_grid=compact,
                         interpret=pltpu.InterpretParams())
  check_against_reference(fn, case, jnp.float32)
  cfg, visited = seen["cfg"], np.asarray(seen["visited"])
  slots, windowed = fa.fused_dq_slots(cfg)
  assert windowed == (case.sliding_window is not None)
  assert slots == ({"fused_sim_window": 3, "fused_sim_window_q_shorter": 4}[case.name]
                   if windowed else cfg.num_kv_blocks)
  assert seen["parts"].shape[0] == slots
  parts = np.asarray(seen["parts"])[:visited.shape[0], :, :, :cfg.q_len].reshape(
      visited.shape[0], 2, 2, cfg.num_q_blocks, -1)
  written = ~np.isnan(parts).any(axis=-1)  # [slots, b, h, q blocks]
  visited = np.broadcast_to(visited[:, :, None], written.shape)
  assert visited.any() and (~visited).any()  # the case skips pairs and computes some
  assert written[visited].all()
  assert not written.all()  # garbage the sum had to mask


def _lower(backend, platform, segments=True, **kwargs):
  if backend == "gpu":  # the Triton kernels, whichever GPU `gpu_target` names
    kwargs.setdefault("gpu_forward", "triton")

  def f(q, k, v, seg):
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
    fn = lambda q, k, v: fa.flash_attention(
        q, k, v, backend=backend, interpret=False, logits_soft_cap=30.0,
        sliding_window=300, **ids, **kwargs)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(out)

  q = jax.ShapeDtypeStruct((1, 1000, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 1000), jnp.int32)
  with kernels.gpu_target() if platform == "cuda" else contextlib.nullcontext():
    return jax.jit(f).trace(q, k, k, seg).lower(lowering_platforms=(platform,)).as_text()


def test_lowers_for_gpu_with_triton():
  for segments in (True, False):
    text = _lower("gpu", "cuda", segments=segments)
    assert text.count("__gpu$xla.gpu.triton") == 3
    # The softmax runs in base 2: one ex2 instruction, not libdevice's exact expf.
    assert "__nv_exp2f" in text and "__nv_expf" not in text


def _triton_ops(monkeypatch, capsys, **kwargs):
  """{kernel name: {op: count}} of the Triton IR each GPU kernel lowers to."""
  import collections
  import re
  monkeypatch.setattr(fa.pl, "pallas_call",
                      functools.partial(fa.pl.pallas_call, debug=True))
  capsys.readouterr()
  _lower("gpu", "cuda", segments=False, **kwargs)
  kernels_ir = capsys.readouterr().out.split("The Triton module for pallas_call")[1:]
  return {re.search(r"tt.func public @(\w+)", ir).group(1):
          collections.Counter(re.findall(r"= \"?(tt\.\w+)", ir)) for ir in kernels_ir}


def test_dkv_kernel_transposes_only_loaded_tiles(monkeypatch, capsys):
  """The dk / dv kernel works kv-major (k @ q.T): its only transposes are of the q and
  do tiles fed to a matmul, one per two matmuls, never of a computed p or ds tile (a
  round trip through shared memory each)."""
  ops = _triton_ops(monkeypatch, capsys)
  dkv = ops["flash_attention_dkv"]
  assert dkv["tt.dot"] == 12 and dkv["tt.trans"] == 6, dkv  # 3 loops x (4 dots, 2 trans)
  atomic = _triton_ops(monkeypatch, capsys, dq_atomic=True)["flash_attention_dkv"]
  assert atomic["tt.atomic_rmw"] == 3 and atomic["tt.trans"] == 9, atomic  # + ds.T for dq


def test_dq_atomic_lowers_to_one_backward_kernel():
  """dq_atomic: no dq kernel; the dk / dv kernel adds to dq with atomics, in place of a
  zero-filled buffer it aliases."""
  text = _lower("gpu", "cuda", dq_atomic=True)
  calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == 2, calls
  assert "flash_attention_dq" not in text and "atomic_rmw" in text
  assert "output_operand_alias" in text


def test_gpu_launch_options_reach_the_kernels():
  """num_warps / num_stages (and their _bwd forms) become the Triton launch options."""
  text = _lower("gpu", "cuda", num_warps=4, num_stages=3, num_warps_bwd=8,
                num_stages_bwd=1)
  calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == 3, calls
  fwd = [c for c in calls if "flash_attention_fwd" in c]
  bwd = [c for c in calls if "flash_attention_d" in c]
  assert len(fwd) == 1 and len(bwd) == 2
  assert "num_warps = 4" in fwd[0] and "num_stages = 3" in fwd[0]
  assert all("num_warps = 8" in c and "num_stages = 1" in c for c in bwd)


def _describe_a_tpu(monkeypatch):
  from jax._src.pallas.mosaic import tpu_info
  if not hasattr(tpu_info, "registry") or ON == "tpu":
    pytest.skip("needs jax's TPU info registry to describe a TPU from a CPU host")
  # Lowering asks the (absent) device for its generation; describe a v5p (jax 0.11 has
  # the describing function public).
  describe = getattr(tpu_info, "_get_tpu_info_impl", None) or tpu_info.get_tpu_info_for_chip
  monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                      lambda: describe(tpu_info.ChipVersion.TPU_V5P, 1))


def test_lowers_for_tpu_with_mosaic(monkeypatch):
  _describe_a_tpu(monkeypatch)
  # With segment ids the block ranges are scalar-prefetched; without, a plain grid.
  assert _lower("tpu", "tpu").count("tpu_custom_call") == 3
  assert _lower("tpu", "tpu", segments=False).count("tpu_custom_call") == 3


@pytest.mark.parametrize("fused", [False, True])
def test_tpu_kernels_transpose_nothing(monkeypatch, capsys, fused):
  """In the Mosaic IR, no kernel transposes a tile (an XLU pass over [block, block]):
  the dk/dv kernel works kv-major, as splash attention's does, and the MXU takes the
  transposed operands of q @ k.T and k @ q.T itself (and, fused, of ds.T @ k)."""
  import collections
  import re
  _describe_a_tpu(monkeypatch)
  monkeypatch.setattr(fa.pl, "pallas_call",
                      functools.partial(fa.pl.pallas_call, debug=True))
  capsys.readouterr()
  _lower("tpu", "tpu", fused_bwd=fused)
  modules = capsys.readouterr().out.split("The Mosaic module for pallas_call")[1:]
  ops = {re.search(r"func.func @(\w+)", m).group(1):
         collections.Counter(re.findall(r"= (tpu\.\w+)", m)) for m in modules}
  want = ["flash_attention_dkv", "flash_attention_dq", "flash_attention_fwd"]
  assert sorted(ops) == [n for n in want if not (fused and n.endswith("_dq"))]
  for name, counts in ops.items():
    assert counts["tpu.matmul"] > 0 and counts["tpu.transpose"] == 0, (name, counts)


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_q=100), "block_q must be a positive multiple of 128 for the tpu kernel"),
    (dict(block_kv_bwd=0), "block_kv_bwd must be a positive multiple of 128"),
    (dict(backend="cuda"), "backend must be 'tpu' or 'gpu', got 'cuda'"),
    (dict(num_warps=0), "num_warps must be a positive integer, got 0"),
    (dict(num_stages_bwd=2.5), "num_stages_bwd must be a positive integer, got 2.5"),
    (dict(block_kv_dq=64), "block_kv_dq must be a positive multiple of 128"),
    (dict(dq_atomic=True), "dq_atomic is an option of the gpu"),
    (dict(backend="gpu", fused_bwd=True), "fused_bwd is an option of the tpu"),
])
def test_bad_options(kwargs, message):
  x = jnp.zeros((1, 128, 2, 16))
  with pytest.raises(ValueError, match=message):
    fa.flash_attention(x, x, x, **({"backend": "tpu"} | kwargs))


def test_wrong_accelerator_family_is_a_clear_error(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  x = jnp.zeros((1, 128, 2, 16))
  with pytest.raises(ValueError, match="backend 'tpu' kernels cannot be compiled on a gpu"):
    fa.flash_attention(x, x, x, backend="tpu", interpret=False)


def test_front_door_runs_both_pallas_implementations():
  x = make_inputs(Case("door", batch=1, q_len=128, kv_len=128, heads=2, kv_heads=1))
  want = kernels.reference_attention(x["q"], x["k"], x["v"])
  for impl in ("pallas_tpu", "pallas_gpu"):
    got = kernels.dot_product_attention(x["q"], x["k"], x["v"], implementation=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_import_is_cheap():
  """`import kernels` initialises no backend and imports no TPU / GPU lowering."""
  code = (
      "import sys, kernels\n"
      "from jax._src import xla_bridge\n"
      "assert not xla_bridge._backends, 'a backend was initialised'\n"
      "bad = [m for m in sys.modules if m.startswith(("
      "'jax.experimental.pallas.triton', 'jax.experimental.pallas.tpu',"
      " 'jax.experimental.pallas.mosaic_gpu', 'jax._src.pallas.triton',"
      " 'jax._src.pallas.mosaic.lowering', 'jax._src.pallas.mosaic_gpu.lowering',"
      " 'jaxlib.triton'))]\n"
      "assert not bad, bad\n")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_tpu_kernels_take_float16_in_float32_and_default_blocks_follow_the_dtype():
  """TPUs have no float16 vectors (Mosaic refuses them; tests/kernels/test_tpu_compile.py
  compiles it): float16 runs in float32 and comes back as float16. 16-bit inputs with
  head_dim <= 128 take 1024 blocks; float32 or wider heads 512 (VMEM)."""
  x = make_inputs(Case("f16", batch=1, q_len=128, kv_len=128, heads=2, kv_heads=1))
  q, k, v = (x[n].astype(jnp.float16) for n in "qkv")
  out = kernels.flash_attention(q, k, v, backend="tpu", interpret=True)
  assert out.dtype == jnp.float16
  want = kernels.reference_attention(*(a.astype(jnp.float32) for a in (q, k, v)))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-3)
  long = lambda dtype, d: jnp.zeros((1, 4096, 2, d), dtype)
  blocks = lambda q: fa.make_config(q, q, backend="tpu").block_q
  assert blocks(long(jnp.bfloat16, 128)) == 1024
  assert blocks(long(jnp.float32, 128)) == blocks(long(jnp.bfloat16, 256)) == 512
