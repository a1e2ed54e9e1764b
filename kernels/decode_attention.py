"""Decode attention: a few new query tokens against a KV cache with per-row lengths.

The cache already holds the new tokens: row b's valid keys are positions
[0, lengths[b]) and its q_len queries are the last q_len of them. With `ring=True` a
sliding-window layer's cache is a ring buffer of slots >= window + q_len - 1: position p
sits in slot p % slots, so the cache holds only the newest keys, not the whole row. A
cache longer than one block is read block by block; blocks past the longest row (or
before every query's sliding window) are skipped with `lax.cond`, so a step costs
O(max(lengths)), not O(max_len).
The cache may be slot-major [batch, max_len, kv_heads, head_dim] (the kernels' contract)
or heads-major [batch, kv_heads, max_len, head_dim], which a decode step reads without
transposing it. Optional int8 K / V are never dequantised in memory: the key scale
multiplies the logits and the value scale the probabilities.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels import reference
from kernels.attention import target_platform

DEFAULT_CHUNK_SIZE = 512


def quantize_int8(x):
  """Symmetric int8 quantisation with one scale per (batch, slot, kv head).

  Args:
    x: [batch, len, kv_heads, head_dim] float keys or values.

  Returns:
    (int8 values, f32 scales [batch, len, kv_heads]); x ~= values * scales[..., None],
    with an absolute error of at most scale / 2 = max|x| / 254 per element.
  """
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
  scale = jnp.where(scale == 0.0, 1.0, scale)
  values = jnp.clip(jnp.round(x / scale[..., None]), -127, 127)
  return values.astype(jnp.int8), scale


KV_LAYOUTS = ("bskh", "bksh")


def _slot_axis(kv_layout: str) -> int:
  return 1 if kv_layout == "bskh" else 2


def _normalise_scale(scale, name, cache, kv_layout, stacked=False):
  """[kv_heads] (per head) or per slot and head -> f32 [b or 1, kv_heads, slots or 1]
  (with a leading layer axis for a per-slot scale of a stacked cache)."""
  layers, shape = (cache.shape[:1], cache.shape[1:]) if stacked else ((), cache.shape)
  b = shape[0]
  kvh, slots = (shape[2], shape[1]) if kv_layout == "bskh" else shape[1:3]
  per_slot = (*layers, b, slots, kvh) if kv_layout == "bskh" else (*layers, b, kvh, slots)
  scale = jnp.asarray(scale, jnp.float32)
  if scale.shape == (kvh,):
    return scale[None, :, None]
  if scale.shape == per_slot:
    return jnp.swapaxes(scale, -1, -2) if kv_layout == "bskh" else scale
  raise ValueError(f"{name} must be [kv_heads] = ({kvh},) or per slot and head {per_slot}, "
                   f"got {scale.shape}")


def _check(q, k_cache, v_cache, lengths, k_scale, v_scale, kv_layout, stacked, ring=False,
           **params):
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, q_len, heads, head_dim], got shape {q.shape}")
  dims = ("[batch, max_len, kv_heads, head_dim]" if kv_layout == "bskh"
          else "[batch, kv_heads, max_len, head_dim]")
  if stacked:
    dims = "[layers, " + dims[1:] + " (with layer=)"
  if k_cache.ndim != 4 + int(stacked):
    raise ValueError(f"k_cache must be {dims}, got shape {k_cache.shape}")
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"v_cache must have the shape of k_cache {k_cache.shape}, got "
                     f"{v_cache.shape}")
  # The shared checks (batch, head_dim, head grouping, scalars) on empty slot-major views.
  b, a1, a2, d = k_cache.shape[int(stacked):]
  no_slots = jax.ShapeDtypeStruct((b, 0, a2 if kv_layout == "bskh" else a1, d), k_cache.dtype)
  reference.check_attention_inputs(q, no_slots, no_slots, **params)
  max_len = k_cache.shape[_slot_axis(kv_layout) + int(stacked)]
  if q.shape[1] > max_len:
    raise ValueError(f"q_len {q.shape[1]} exceeds the cache length {max_len}")
  if ring:
    window = params.get("sliding_window")
    if window is None:
      raise ValueError("ring=True needs a sliding_window: a ring buffer keeps only the "
                       "newest keys")
    if max_len < window + q.shape[1] - 1:
      raise ValueError(f"a ring cache of {max_len} slots cannot hold sliding_window "
                       f"{window} + q_len {q.shape[1]} - 1 keys")
  if lengths.shape != (q.shape[0],):
    raise ValueError(f"lengths must be [batch] = ({q.shape[0]},), got {lengths.shape}")
  for name, cache, scale in (("k_scale", k_cache, k_scale), ("v_scale", v_cache, v_scale)):
    if jnp.issubdtype(cache.dtype, jnp.integer) and scale is None:
      raise ValueError(f"{name} is required for an integer ({cache.dtype}) cache")


def _elementwise_default() -> bool | str:
  # Measured on CPU, one 16-row block of 96-160 slots: 64-81 us with "values", 96-125 us
  # with multiply-reduces for both (a horizontal sum over head_dim per slot scores slowly),
  # 137-187 us with dots for both (per-(batch, kv head) GEMM calls of 1-8 query rows); in
  # the sampler "values" is 9-13% faster than True. Accelerators take dots (MXU / tensor
  # cores).
  return "values" if target_platform() == "cpu" else False


def _block(q, k, v, valid, *, sm_scale, logits_soft_cap, k_scale, v_scale, kv_layout,
           elementwise, bias=None):
  """One cache block: q [b, tq, h, d] against k, v in `kv_layout` with `ck` slots.

  valid [b, tq, ck] says which (query, slot) pairs attend; scales are f32
  [b or 1, kv_heads, ck or 1] or None; bias (ALiBi's, `reference.alibi_bias`) is f32
  [b or 1, kv_heads, group, tq, ck] or None. Returns (out [b, tq, h, d] f32 normalised
  over this block, lse [b, tq, h] f32, -inf where a query sees no slot of the block).
  """
  b, tq, h, d = q.shape
  heads_major = kv_layout == "bksh"
  kvh = k.shape[1] if heads_major else k.shape[2]
  g = h // kvh
  # int8 values are exact in q's dtype; their scales multiply the logits and the
  # probabilities instead of dequantising the block.
  dtype = q.dtype if jnp.issubdtype(k.dtype, jnp.integer) else jnp.promote_types(q.dtype, k.dtype)
  qg = q.reshape(b, tq, kvh, g, d).astype(dtype)
  k = k.astype(dtype)
  if elementwise is True:
    qf, kf = qg.astype(jnp.float32), k.astype(jnp.float32)
    if heads_major:  # scores [b, kvh, g, tq, ck]
      s = jnp.sum(jnp.moveaxis(qf, 1, 3)[:, :, :, :, None, :] * kf[:, :, None, None], -1)
    else:
      s = jnp.sum(qf[:, :, None] * kf[:, None, :, :, None, :], -1)  # [b, tq, ck, kvh, g]
      s = jnp.transpose(s, (0, 3, 4, 1, 2))
  else:
    spec = "bqkgd,bksd->bkgqs" if heads_major else "bqkgd,bskd->bkgqs"
    s = jnp.einsum(spec, qg, k, preferred_element_type=jnp.float32)
  if k_scale is not None:
    s = s * k_scale[:, :, None, None, :]
  s = reference.soft_cap(s * sm_scale, logits_soft_cap)
  if bias is not None:
    s = s + bias
  s = jnp.where(valid[:, None, None], s, reference.NEG_INF)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)  # [b, kvh, g, tq]
  if v_scale is not None:
    p = p * v_scale[:, :, None, None, :]
  if elementwise:
    vf = v.astype(jnp.float32)
    if heads_major:
      o = jnp.sum(p[..., None] * vf[:, :, None, None], axis=-2)  # [b, kvh, g, tq, d]
      o = jnp.moveaxis(o, 3, 1)
    else:
      pt = jnp.transpose(p, (0, 3, 4, 1, 2))  # [b, tq, ck, kvh, g]
      o = jnp.sum(pt[..., None] * vf[:, None, :, :, None, :], axis=2)  # [b, tq, kvh, g, d]
  else:
    spec = "bkgqs,bksd->bqkgd" if heads_major else "bkgqs,bskd->bqkgd"
    pv_dtype = q.dtype if jnp.issubdtype(v.dtype, jnp.integer) else v.dtype
    o = jnp.einsum(spec, p.astype(pv_dtype), v.astype(pv_dtype),
                   preferred_element_type=jnp.float32)
  l = jnp.moveaxis(l, 3, 1)  # [b, tq, kvh, g]
  l_safe = jnp.where(l == 0.0, 1.0, l)
  out = (o / l_safe[..., None]).reshape(b, tq, h, d)
  lse = jnp.where(l == 0.0, reference.NEG_INF, jnp.moveaxis(m[..., 0], 3, 1) + jnp.log(l_safe))
  return out, lse.reshape(b, tq, h)


def decode_attention(q, k_cache, v_cache, *, lengths, k_scale=None, v_scale=None,
                     causal: bool = True, sm_scale: float | None = None,
                     logits_soft_cap: float | None = None,
                     sliding_window: int | None = None,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, kv_layout: str = "bskh",
                     elementwise: bool | str | None = None, finite_tail: bool = False,
                     layer=None, ring: bool = False, sinks=None, local_chunk=None,
                     alibi_slopes=None):
  """Attention of the newest tokens of each row against its KV cache.

  Args:
    q: [batch, q_len, heads, head_dim], the last q_len tokens of each row (q_len is
      small: 1 for plain decoding, more for speculative or chunked prefill).
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim] (kv_layout "bskh", the
      contract of every kernel here) or [batch, kv_heads, max_len, head_dim] ("bksh":
      each head's slots contiguous, which a decode step reads without a transpose);
      float, or int8 with scales. heads % kv_heads == 0.
    lengths: int [batch], valid cache entries per row, INCLUDING the q_len new tokens;
      query i of row b sits at position lengths[b] - q_len + i.
    k_scale, v_scale: dequantisation scales for int8 caches, [kv_heads] (per head) or per
      slot and head in the cache's order without head_dim ([batch, max_len, kv_heads] for
      "bskh", [batch, kv_heads, max_len] for "bksh"; see `quantize_int8`).
    causal: queries see only keys at or before their position (False: the whole valid
      prefix [0, lengths[b])).
    sm_scale, logits_soft_cap, sliding_window, local_chunk: as in
      `kernels.reference_attention` (local_chunk may be a traced int32 scalar: a scan
      over layers of both kinds passes each layer's).
    chunk_size: cache entries per block; a cache no longer than one block is read in one
      piece, a longer one block by block, skipping blocks past the longest row (and, with a
      sliding window, before every query's window).
    elementwise: True: scores and the weighted sum of values as multiply-reduces instead
      of dots; "values": only the weighted sum of values; False: dots for both; None: by
      backend ("values" on CPU, False on accelerators).
    finite_tail: the caller guarantees that every slot past a row's length holds a finite
      value (a zero-initialised cache written only with finite keys and values, as the
      sampler's). Masked slots then get probability exactly 0 and contribute exactly 0,
      so the pass that zeroes their values is skipped. With False (the default) those
      slots may hold anything, NaN included.
    layer: an int (or int32 scalar) when k_cache, v_cache and per-slot scales stack the
      caches of several layers on a leading axis ([layers, ...] of the shapes above): the
      layer to attend over. Each block is sliced from the stacked arrays, so a model
      that scans over its layers never copies a layer's whole cache out of the stack.
    ring: the cache is a ring buffer (needs `sliding_window`, and max_len >= window +
      q_len - 1): position p of a row was written to slot p % max_len, so slot s holds
      its newest position below lengths[b], lengths[b] - 1 - ((lengths[b] - 1 - s) %
      max_len), or nothing when that is negative. Rows may be longer than the cache.
      While lengths[b] <= max_len it reads as the plain cache.
    sinks: optional float [heads] attention-sink logits, as in
      `kernels.reference_attention`.
    alibi_slopes: optional float [heads], ALiBi's slopes, as in
      `kernels.reference_attention`: the bias is by the queries' positions above and
      each slot's position (a ring's newest position in the slot).

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype.
  """
  lengths = jnp.asarray(lengths, jnp.int32)
  stacked = layer is not None
  _check(q, k_cache, v_cache, lengths, k_scale, v_scale, kv_layout, stacked, ring=ring,
         sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
         sinks=sinks, local_chunk=local_chunk, alibi_slopes=alibi_slopes)
  if int(chunk_size) != chunk_size or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
  if not (elementwise is None or isinstance(elementwise, bool) or elementwise == "values"):
    raise ValueError(f"elementwise must be None, True, False or 'values', got {elementwise!r}")
  b, tq, h, d = q.shape
  axis = _slot_axis(kv_layout)
  max_len = k_cache.shape[axis + int(stacked)]
  kv_heads = k_cache.shape[int(stacked) + (2 if kv_layout == "bskh" else 1)]
  ck = min(int(chunk_size), max_len)
  scales = [None if s is None else _normalise_scale(s, n, k_cache, kv_layout, stacked)
            for n, s in (("k_scale", k_scale), ("v_scale", v_scale))]

  def cut(x, start, size, axis):
    """x[..., start:start + size, ...] on `axis` of one layer's array (of layer `layer`
    of a stacked one, sliced in one piece)."""
    if not stacked or x.ndim < 4:  # A per-head scale is shared by the layers.
      return lax.dynamic_slice_in_dim(x, start, size, axis=axis)
    starts = [jnp.int32(0)] * x.ndim
    starts[0], starts[axis + 1] = jnp.asarray(layer, jnp.int32), start
    sizes = list(x.shape)
    sizes[0], sizes[axis + 1] = 1, size
    return lax.dynamic_slice(x, starts, sizes)[0]
  q_pos = lengths[:, None] - tq + jnp.arange(tq, dtype=jnp.int32)[None]  # [b, tq]
  params = dict(sm_scale=reference.default_sm_scale(d, sm_scale),
                logits_soft_cap=logits_soft_cap, kv_layout=kv_layout,
                elementwise=_elementwise_default() if elementwise is None else elementwise)

  def attend_block(start, nominal):
    """The block of ck slots from `start`; slots before `nominal` belong to the previous
    block (the last block may overlap it) and are masked here."""
    slot = start + jnp.arange(ck, dtype=jnp.int32)
    if ring:  # each slot's newest position below the row's length; < 0: never written
      last = lengths[:, None] - 1
      kv_pos = last - jnp.mod(last - slot[None], max_len)  # [b, ck]
      slot_ok = (slot[None] >= nominal) & (kv_pos >= 0)
    else:
      kv_pos = slot[None]
      # Every query sees only its row's valid prefix, whether or not the mask is causal.
      slot_ok = (slot[None] >= nominal) & (slot[None] < lengths[:, None])  # [b, ck]
    valid = slot_ok[:, None] & reference.attention_mask(
        q_pos, kv_pos, causal=causal, sliding_window=sliding_window,
        local_chunk=local_chunk)
    # Unless the caller vouches for a finite tail, slots past a row's length may hold
    # anything, NaN included; p = 0 times NaN would still leak, so zero the values there
    # (and, always, their scales).
    v = cut(v_cache, start, ck, axis)
    if not finite_tail:
      slot_ok_v = slot_ok[:, :, None, None] if kv_layout == "bskh" else slot_ok[:, None, :, None]
      v = jnp.where(slot_ok_v, v, 0)
    k_s, v_s = [None if s is None else (cut(s, start, ck, 2) if s.shape[-1] > 1 else s)
                for s in scales]
    if v_s is not None:
      v_s = jnp.where(slot_ok[:, None, :], v_s, 0.0)
    bias = (None if alibi_slopes is None else
            reference.alibi_bias(alibi_slopes, q_pos, kv_pos, kv_heads))
    return _block(q, cut(k_cache, start, ck, axis), v, valid, k_scale=k_s, v_scale=v_s,
                  bias=bias, **params)

  if ck == max_len:  # one block: no loop, no per-block branch
    out, lse = attend_block(0, 0)
    return reference.add_sinks(out, lse, sinks)[0].astype(q.dtype)
  # The last block may overlap the previous one.
  # A ring's blocks are skipped unless they hold a slot of some row's window (a cyclic
  # range of slots once the row wrapped the ring).
  return merge_visible_blocks(
      q, q_pos, lengths, sliding_window, ck, -(-max_len // ck),
      lambda i, nominal: attend_block(jnp.minimum(nominal, max_len - ck), nominal),
      sinks=sinks, ring_slots=max_len if ring else None, local_chunk=local_chunk)


def merge_visible_blocks(q, q_pos, lengths, sliding_window, block_len: int, num_blocks: int,
                         attend_block, sinks=None, ring_slots: int | None = None,
                         local_chunk=None):
  """Block i of `block_len` slots from slot i * block_len, merged by log-sum-exp; blocks
  past the longest row, or (with a sliding window) before every query's window, are
  skipped with `lax.cond`.

  Args:
    q: [b, tq, h, d]; q_pos [b, tq] the queries' positions; lengths [b].
    attend_block: `(i, nominal) -> (out, lse)` of block i, whose slots start at `nominal`
      (`_block`'s outputs).
    sinks: optional [heads] attention-sink logits, added to the merged result.
    ring_slots: the cache is a ring of this many slots (position p in slot p % slots):
      a block is read when it holds a slot of some row's window, [oldest, newest]
      modulo the ring.
    local_chunk: blocks before every query's chunk are skipped too.

  Returns:
    [b, tq, h, d] in q's dtype.
  """
  b, tq, h, _ = q.shape
  newest = jnp.max(lengths) - 1
  # Without a sliding window every query sees the whole prefix from slot 0; with one,
  # nothing before the earliest query's window.
  oldest = jnp.min(q_pos) - (sliding_window - 1) if sliding_window else jnp.int32(0)
  if local_chunk is not None:  # and nothing before the earliest query's chunk
    oldest = jnp.maximum(oldest, jnp.min(q_pos - q_pos % local_chunk))

  def visible(nominal):
    if ring_slots is None:
      return (nominal <= newest) & (nominal + block_len - 1 >= oldest)
    # Row b's window holds positions [first_b, last_b]: the cyclic range of `span` slots
    # from first_b % slots. The block [nominal, nominal + block_len) meets it when the
    # range starts in the block or the block's first slot lies within the range.
    first = jnp.maximum(q_pos[:, 0] - (sliding_window - 1), 0)
    last = lengths - 1
    start, span = jnp.mod(first, ring_slots), last - first + 1
    meets = ((jnp.mod(nominal - start, ring_slots) < span)
             | (jnp.mod(start - nominal, ring_slots) < block_len))
    return jnp.any(meets & (span > 0))

  def step(carry, i):
    nominal = i * block_len
    attend = lambda c: reference.merge_attention(*c, *attend_block(i, nominal))
    return lax.cond(visible(nominal), attend, lambda c: c, carry), None

  init = (lax.full_like(q, 0.0, jnp.float32),
          lax.full_like(q, reference.NEG_INF, jnp.float32, (b, tq, h)))
  (out, lse), _ = lax.scan(step, init, jnp.arange(num_blocks, dtype=jnp.int32))
  return reference.add_sinks(out, lse, sinks)[0].astype(q.dtype)
