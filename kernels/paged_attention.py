"""Paged decode attention: the newest tokens of each row against a KV cache kept in pages.

The cache is one pool of fixed-size pages shared by every row, k_pages and v_pages
[num_pages, page_size, kv_heads, head_dim], and a page table int32 [batch, pages_per_row]:
row b's logical slot s lives in page page_table[b, s // page_size] at offset
s % page_size. Pages let a sampler allocate cache memory by the page a row actually
fills instead of by max_len, and let rows share pages: the G samples of one prompt point
their first table entries at the same prompt-prefix pages, held once. Nothing here
assumes the pages of a row, or of different rows, are distinct.

The attention itself is `decode_attention`'s: the cache holds the new tokens, row b's
valid keys are its slots [0, lengths[b]) and its q_len queries are the last q_len of them.
The table is read a block of pages at a time (the pages gathered into a contiguous block
of slots, scored by `decode_attention._block`, merged by log-sum-exp); blocks past the
longest row (or before every query's sliding window) are skipped with `lax.cond`, so a
step costs O(max(lengths)), not O(pages_per_row * page_size). Table entries past a row's
length may hold anything, even ids outside the pool (-1, num_pages): every id is clamped
into the pool before it is gathered, and what a clamped id reads is masked like any other
slot past the length. Optional int8 pages are never dequantised in memory: the key scale
multiplies the logits and the value scale the probabilities.

`paged_cache_update` writes new keys and values through the table; `gather_pages` gives
each row's contiguous view (for tests, export and debugging).
"""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax import lax

from kernels import reference
from kernels.decode_attention import (DEFAULT_CHUNK_SIZE, _block, _elementwise_default,
                                      merge_visible_blocks)

_PAGES = "[num_pages, page_size, kv_heads, head_dim]"


def _table(page_table, batch: int | None, name: str = "page_table"):
  """page_table as int32 [batch, pages_per_row] (any batch when `batch` is None)."""
  page_table = jnp.asarray(page_table)
  if not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise ValueError(f"{name} must be an int array, got dtype {page_table.dtype}")
  if (page_table.ndim != 2 or page_table.shape[1] < 1
      or (batch is not None and page_table.shape[0] != batch)):
    want = "[batch, pages_per_row]" + ("" if batch is None else f" with batch {batch}")
    raise ValueError(f"{name} must be {want} and at least one page a row, got shape "
                     f"{page_table.shape}")
  return page_table.astype(jnp.int32)


def _check_pages(k_pages, v_pages):
  if k_pages.ndim != 4:
    raise ValueError(f"k_pages must be {_PAGES}, got shape {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages must have the shape of k_pages {k_pages.shape}, got "
                     f"{v_pages.shape}")
  if k_pages.shape[0] < 1 or k_pages.shape[1] < 1:
    raise ValueError(f"k_pages must hold at least one page of at least one slot, got shape "
                     f"{k_pages.shape}")


def _check(q, k_pages, v_pages, page_table, lengths, k_scale, v_scale, **params):
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, q_len, heads, head_dim], got shape {q.shape}")
  _check_pages(k_pages, v_pages)
  # The shared checks (head_dim, head grouping, scalars) on an empty slot-major view.
  _, page_size, kvh, d = k_pages.shape
  no_slots = jax.ShapeDtypeStruct((q.shape[0], 0, kvh, d), k_pages.dtype)
  reference.check_attention_inputs(q, no_slots, no_slots, **params)
  if lengths.shape != (q.shape[0],):
    raise ValueError(f"lengths must be [batch] = ({q.shape[0]},), got {lengths.shape}")
  slots = page_table.shape[1] * page_size
  if q.shape[1] > slots:
    raise ValueError(f"q_len {q.shape[1]} exceeds the {slots} slots of a row's page table "
                     f"({page_table.shape[1]} pages of {page_size})")
  for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
    if jnp.issubdtype(k_pages.dtype, jnp.integer) and scale is None:
      raise ValueError(f"{name} is required for an integer ({k_pages.dtype}) cache")


def _page_scale(scale, name, pages):
  """(scale, per_head): [kv_heads] -> (f32 [1, kv_heads, 1], True); per page slot and head
  [num_pages, page_size, kv_heads] -> (f32, False), gathered with the pages."""
  n, page_size, kvh, _ = pages.shape
  scale = jnp.asarray(scale, jnp.float32)
  if scale.shape == (kvh,):
    return scale[None, :, None], True
  if scale.shape == (n, page_size, kvh):
    return scale, False
  raise ValueError(f"{name} must be [kv_heads] = ({kvh},) or per page slot and head "
                   f"[num_pages, page_size, kv_heads] = {(n, page_size, kvh)}, got "
                   f"{scale.shape}")


def _pages_per_block(pages_per_block, page_size: int, pages_per_row: int) -> int:
  if pages_per_block is None:  # about DEFAULT_CHUNK_SIZE slots a block
    return max(1, min(pages_per_row, DEFAULT_CHUNK_SIZE // page_size))
  try:
    n = operator.index(pages_per_block)
  except TypeError:
    n = 0
  if isinstance(pages_per_block, bool) or n < 1:
    raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block!r}")
  return min(n, pages_per_row)


def _gather(pages, ids):
  """pages [num_pages, page_size, ...] at in-pool ids [batch, n] -> [batch, n * page_size,
  ...]: the slots of those pages, in table order."""
  g = jnp.take(pages, ids, axis=0, mode="clip")  # [batch, n, page_size, ...]
  return g.reshape(ids.shape[0], ids.shape[1] * pages.shape[1], *pages.shape[2:])


def gather_pages(pages, page_table):
  """Each row's contiguous view of a paged pool.

  Args:
    pages: [num_pages, page_size, ...] (keys, values, or per-slot scales
      [num_pages, page_size, kv_heads]).
    page_table: int [batch, pages_per_row]; ids outside [0, num_pages) are clamped into
      the pool (so the slots they give are some page's, not an error).

  Returns:
    [batch, pages_per_row * page_size, ...]: row b's slot s is page_table[b, s // page_size]
    at offset s % page_size, as `paged_decode_attention` reads it.
  """
  if pages.ndim < 2 or pages.shape[0] < 1:
    raise ValueError(f"pages must be [num_pages, page_size, ...] with at least one page, "
                     f"got shape {pages.shape}")
  page_table = _table(page_table, None)
  return _gather(pages, jnp.clip(page_table, 0, pages.shape[0] - 1))


def paged_decode_attention(q, k_pages, v_pages, *, page_table, lengths, k_scale=None,
                           v_scale=None, causal: bool = True, sm_scale: float | None = None,
                           logits_soft_cap: float | None = None,
                           sliding_window: int | None = None,
                           pages_per_block: int | None = None,
                           elementwise: bool | str | None = None, finite_tail: bool = False,
                           sinks=None, alibi_slopes=None):
  """Attention of the newest tokens of each row against its paged KV cache.

  Args:
    q: [batch, q_len, heads, head_dim], the last q_len tokens of each row (q_len is
      small: 1 for plain decoding, more for speculative or chunked prefill).
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim], one pool shared by all
      rows; float, or int8 with scales. heads % kv_heads == 0.
    page_table: int [batch, pages_per_row]: row b's slot s is page page_table[b, s //
      page_size] at offset s % page_size. Rows may share pages. Entries past a row's
      length are never attended and may hold any id, in the pool or not.
    lengths: int [batch], valid cache entries per row, INCLUDING the q_len new tokens;
      query i of row b sits at position lengths[b] - q_len + i.
    k_scale, v_scale: dequantisation scales for int8 pages, [kv_heads] (per head) or per
      page slot and head [num_pages, page_size, kv_heads] (`quantize_int8` of the pool).
    causal: queries see only keys at or before their position (False: the whole valid
      prefix [0, lengths[b])).
    sm_scale, logits_soft_cap, sliding_window: as in `kernels.reference_attention`.
    pages_per_block: table entries gathered per block (default: about
      DEFAULT_CHUNK_SIZE slots, at least 1; at most pages_per_row). A table of one block
      is read in one piece, a longer one block by block (the last block overlapping the
      previous one when the blocks do not divide the table), skipping blocks past the
      longest row (and, with a sliding window, before every query's window).
    elementwise: as in `decode_attention` (None: by backend).
    finite_tail: the caller guarantees that every slot a row reads past its length (its
      own pages' unused slots, and the pages its clamped table entries past the length
      name) holds a finite value, as a zero-initialised pool written only with finite
      keys and values does. Masked slots then contribute exactly 0 and the pass that
      zeroes their values is skipped. With False (the default) they may hold anything,
      NaN included.
    sinks: optional float [heads] attention-sink logits, as in
      `kernels.reference_attention`.
    alibi_slopes: optional float [heads], ALiBi's slopes, as in
      `kernels.reference_attention` (positions: the queries' above, a slot's its index
      in the row).

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype.
  """
  lengths = jnp.asarray(lengths, jnp.int32)
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, q_len, heads, head_dim], got shape {q.shape}")
  page_table = _table(page_table, q.shape[0])
  _check(q, k_pages, v_pages, page_table, lengths, k_scale, v_scale, sm_scale=sm_scale,
         logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, sinks=sinks,
         alibi_slopes=alibi_slopes)
  if not (elementwise is None or isinstance(elementwise, bool) or elementwise == "values"):
    raise ValueError(f"elementwise must be None, True, False or 'values', got {elementwise!r}")
  b, tq, h, d = q.shape
  num_pages, page_size = k_pages.shape[:2]
  pages_per_row = page_table.shape[1]
  per_block = _pages_per_block(pages_per_block, page_size, pages_per_row)
  ck = per_block * page_size
  # (scale, per head) pairs: [1, kvh, 1] per head, else the per-slot pool.
  scales = [(None, True) if s is None else _page_scale(s, n, k_pages)
            for n, s in (("k_scale", k_scale), ("v_scale", v_scale))]
  # Clamped once: a garbage id reads some page of the pool, masked past the length.
  page_table = jnp.clip(page_table, 0, num_pages - 1)
  q_pos = lengths[:, None] - tq + jnp.arange(tq, dtype=jnp.int32)[None]  # [b, tq]
  params = dict(sm_scale=reference.default_sm_scale(d, sm_scale),
                logits_soft_cap=logits_soft_cap, kv_layout="bskh",
                elementwise=_elementwise_default() if elementwise is None else elementwise)

  def attend_block(first_page, nominal):
    """The per_block table entries from `first_page`; slots before `nominal` belong to
    the previous block (the last block may overlap it) and are masked here."""
    ids = lax.dynamic_slice_in_dim(page_table, first_page, per_block, axis=1)
    kv_pos = first_page * page_size + jnp.arange(ck, dtype=jnp.int32)
    # Every query sees only its row's valid prefix, whether or not the mask is causal.
    slot_ok = (kv_pos[None] >= nominal) & (kv_pos[None] < lengths[:, None])  # [b, ck]
    valid = slot_ok[:, None] & reference.attention_mask(
        q_pos, kv_pos[None], causal=causal, sliding_window=sliding_window)
    # Slots past a row's length (and whole pages its garbage ids name) may hold anything,
    # NaN included, unless the caller vouches for them; p = 0 times NaN would still leak,
    # so zero the values there (and, always, their scales). Masked keys are harmless:
    # their logits are replaced by -inf.
    v = _gather(v_pages, ids)
    if not finite_tail:
      v = jnp.where(slot_ok[:, :, None, None], v, 0)
    k_s, v_s = [None if s is None else (s if per_head else jnp.swapaxes(_gather(s, ids), 1, 2))
                for s, per_head in scales]  # [b or 1, kvh, ck or 1]
    if v_s is not None:
      v_s = jnp.where(slot_ok[:, None, :], v_s, 0.0)
    bias = (None if alibi_slopes is None else
            reference.alibi_bias(alibi_slopes, q_pos, kv_pos[None], k_pages.shape[2]))
    return _block(q, _gather(k_pages, ids), v, valid, k_scale=k_s, v_scale=v_s, bias=bias,
                  **params)

  if per_block == pages_per_row:  # one block: no loop, no per-block branch
    out, lse = attend_block(0, 0)
    return reference.add_sinks(out, lse, sinks)[0].astype(q.dtype)

  # The last block may overlap the previous one.
  return merge_visible_blocks(
      q, q_pos, lengths, sliding_window, ck, -(-pages_per_row // per_block),
      lambda i, nominal: attend_block(
          jnp.minimum(i * per_block, pages_per_row - per_block), nominal), sinks=sinks)


def paged_cache_update(k_pages, v_pages, k_new, v_new, *, page_table, positions,
                       k_scale_pages=None, v_scale_pages=None, k_scale_new=None,
                       v_scale_new=None):
  """Writes new keys and values at logical positions of each row, through its page table.

  A scatter: jit it with the pools donated and they are updated in place. Rows that share
  a page must not write the same slot (which write wins is unspecified); copying a shared
  page before a row writes into it is the caller's business.

  Args:
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] pools.
    k_new, v_new: [batch, t, kv_heads, head_dim], cast to the pools' dtype; for an integer
      pool they must already be integer (`quantize_int8`) and come with their scales.
    page_table: int [batch, pages_per_row], as `paged_decode_attention` reads it.
    positions: int [batch, t], the logical slot of each new token. A position < 0
      (padding), one past the table (>= pages_per_row * page_size), or one whose table
      entry is not a page of the pool, is not written.
    k_scale_pages, v_scale_pages: optional per-slot scale pools [num_pages, page_size,
      kv_heads], updated with k_scale_new, v_scale_new [batch, t, kv_heads] (all four or
      none).

  Returns:
    (k_pages, v_pages), or (k_pages, v_pages, k_scale_pages, v_scale_pages) with scales.
  """
  _check_pages(k_pages, v_pages)
  num_pages, page_size, kvh, d = k_pages.shape
  if k_new.ndim != 4 or k_new.shape[2:] != (kvh, d):
    raise ValueError(f"k_new must be [batch, t, kv_heads, head_dim] with kv_heads, head_dim "
                     f"= {(kvh, d)}, got shape {k_new.shape}")
  if v_new.shape != k_new.shape:
    raise ValueError(f"v_new must have the shape of k_new {k_new.shape}, got {v_new.shape}")
  b, t = k_new.shape[:2]
  page_table = _table(page_table, b)
  positions = jnp.asarray(positions)
  if not jnp.issubdtype(positions.dtype, jnp.integer) or positions.shape != (b, t):
    raise ValueError(f"positions must be int [batch, t] = {(b, t)}, got {positions.dtype} "
                     f"{positions.shape}")
  scales = (k_scale_pages, v_scale_pages, k_scale_new, v_scale_new)
  with_scales = scales[0] is not None
  if any((s is not None) != with_scales for s in scales):
    raise ValueError("k_scale_pages, v_scale_pages, k_scale_new and v_scale_new must be "
                     "given together")
  for name, new, pool in (("k_new", k_new, k_pages), ("v_new", v_new, v_pages)):
    if jnp.issubdtype(pool.dtype, jnp.integer) and not (
        jnp.issubdtype(new.dtype, jnp.integer) and with_scales):
      raise ValueError(f"{name} must be integer, with k_scale_new / v_scale_new and scale "
                       f"pools, for an integer ({pool.dtype}) pool (see quantize_int8); got "
                       f"{new.dtype}{' with' if with_scales else ' without'} scales")
  if with_scales:
    for name, s, want in (("k_scale_pages", scales[0], (num_pages, page_size, kvh)),
                          ("v_scale_pages", scales[1], (num_pages, page_size, kvh)),
                          ("k_scale_new", scales[2], (b, t, kvh)),
                          ("v_scale_new", scales[3], (b, t, kvh))):
      if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape {want}, got {tuple(s.shape)}")
  positions = positions.astype(jnp.int32)
  pages_per_row = page_table.shape[1]
  in_table = (positions >= 0) & (positions < pages_per_row * page_size)
  page = jnp.take_along_axis(
      page_table, jnp.clip(positions // page_size, 0, pages_per_row - 1), axis=1)
  # Indices out of bounds are dropped by the scatter; negative ones would wrap around,
  # so everything not to write goes to page num_pages.
  page = jnp.where(in_table & (page >= 0) & (page < num_pages), page, num_pages)
  offset = positions % page_size

  def write(pool, new):
    return pool.at[page, offset].set(new.astype(pool.dtype), mode="drop")

  pools = (write(k_pages, k_new), write(v_pages, v_new))
  if with_scales:
    pools += (write(scales[0], scales[2]), write(scales[1], scales[3]))
  return pools
