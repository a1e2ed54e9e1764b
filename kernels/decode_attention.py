"""Decode attention: a few new query tokens against a KV cache with per-row lengths.

The cache already holds the new tokens: row b's valid keys are positions
[0, lengths[b]) and its q_len queries are the last q_len of them. The cache is read in
chunks; chunks past the longest row (or before every query's sliding window) are
skipped with `lax.cond`, so a step costs O(max(lengths)), not O(max_len). Optional
int8 K / V are never dequantised in memory: the key scale multiplies the logits and the
value scale the probabilities.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels import reference

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


def _normalise_scale(scale, name, cache):
  """Accepts [kv_heads] (per head) or [batch, max_len, kv_heads] (per token and head)."""
  b, t, kvh, _ = cache.shape
  scale = jnp.asarray(scale, jnp.float32)
  if scale.shape == (kvh,):
    return scale[None, None, :]
  if scale.shape == (b, t, kvh):
    return scale
  raise ValueError(f"{name} must be [kv_heads] = ({kvh},) or [batch, max_len, kv_heads] = "
                   f"{(b, t, kvh)}, got {scale.shape}")


def _check(q, k_cache, v_cache, lengths, k_scale, v_scale):
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, q_len, heads, head_dim], got shape {q.shape}")
  if k_cache.ndim != 4:
    raise ValueError(
        f"k_cache must be [batch, max_len, kv_heads, head_dim], got shape {k_cache.shape}")
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"v_cache must have the shape of k_cache {k_cache.shape}, got "
                     f"{v_cache.shape}")
  reference.check_attention_inputs(q, k_cache, v_cache)
  if q.shape[1] > k_cache.shape[1]:
    raise ValueError(f"q_len {q.shape[1]} exceeds the cache length {k_cache.shape[1]}")
  if lengths.shape != (q.shape[0],):
    raise ValueError(f"lengths must be [batch] = ({q.shape[0]},), got {lengths.shape}")
  for name, cache, scale in (("k_scale", k_cache, k_scale), ("v_scale", v_cache, v_scale)):
    if jnp.issubdtype(cache.dtype, jnp.integer) and scale is None:
      raise ValueError(f"{name} is required for an integer ({cache.dtype}) cache")


def decode_attention(q, k_cache, v_cache, *, lengths, k_scale=None, v_scale=None,
                     causal: bool = True, sm_scale: float | None = None,
                     logits_soft_cap: float | None = None,
                     sliding_window: int | None = None,
                     chunk_size: int = DEFAULT_CHUNK_SIZE):
  """Attention of the newest tokens of each row against its KV cache.

  Args:
    q: [batch, q_len, heads, head_dim], the last q_len tokens of each row (q_len is
      small: 1 for plain decoding, more for speculative or chunked prefill).
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim]; float, or int8 with scales.
      heads % kv_heads == 0.
    lengths: int [batch], valid cache entries per row, INCLUDING the q_len new tokens;
      query i of row b sits at position lengths[b] - q_len + i.
    k_scale, v_scale: dequantisation scales for int8 caches, [kv_heads] (per head) or
      [batch, max_len, kv_heads] (per slot and head, see `quantize_int8`).
    causal: queries see only keys at or before their position (False: the whole valid
      prefix [0, lengths[b])).
    sm_scale, logits_soft_cap, sliding_window: as in `kernels.reference_attention`.
    chunk_size: cache entries per chunk.

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype.
  """
  lengths = jnp.asarray(lengths, jnp.int32)
  _check(q, k_cache, v_cache, lengths, k_scale, v_scale)
  reference.check_attention_inputs(q[:, :0], k_cache[:, :0], v_cache[:, :0],
                                   sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                                   sliding_window=sliding_window)
  if int(chunk_size) != chunk_size or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
  b, tq, h, d = q.shape
  max_len = k_cache.shape[1]
  ck = min(int(chunk_size), max_len)
  scales = [None if s is None else _normalise_scale(s, n, k_cache)
            for n, s in (("k_scale", k_scale), ("v_scale", v_scale))]
  q_pos = lengths[:, None] - tq + jnp.arange(tq, dtype=jnp.int32)[None]  # [b, tq]
  # Every query sees only its row's valid prefix; a segment mask says so even when
  # the causal mask is off.
  q_seg = jnp.ones((b, tq), jnp.int32)
  params = dict(causal=causal, sm_scale=reference.default_sm_scale(d, sm_scale),
                logits_soft_cap=logits_soft_cap, sliding_window=sliding_window)
  newest = jnp.max(lengths) - 1
  # Without a sliding window every query sees the whole prefix from slot 0; with one,
  # nothing before the earliest query's window.
  oldest = jnp.min(q_pos) - (sliding_window - 1) if sliding_window else jnp.int32(0)

  def step(carry, i):
    nominal = i * ck
    start = jnp.minimum(nominal, max_len - ck)  # the last chunk may overlap the previous

    def attend(carry):
      cut = lambda x: lax.dynamic_slice_in_dim(x, start, ck, axis=1)
      kv_pos = start + jnp.arange(ck, dtype=jnp.int32)[None]
      valid = (kv_pos >= nominal) & (kv_pos < lengths[:, None])  # [b, ck]
      kv_seg = valid.astype(jnp.int32)
      # Slots past a row's length may hold anything, NaN included; p = 0 times NaN
      # would still leak, so zero the values (and their scales) there.
      v = jnp.where(valid[:, :, None, None], cut(v_cache), 0)
      chunk_scales = [None if s is None else (cut(s) if s.shape[1] > 1 else s)
                      for s in scales]
      if chunk_scales[1] is not None:
        chunk_scales[1] = jnp.where(valid[:, :, None], chunk_scales[1], 0.0)
      out, lse = reference.attention_block(
          q, cut(k_cache), v, q_positions=q_pos, kv_positions=kv_pos,
          q_segment_ids=q_seg, kv_segment_ids=kv_seg, k_scale=chunk_scales[0],
          v_scale=chunk_scales[1], **params)
      return reference.merge_attention(*carry, out, lse)

    visible = (nominal <= newest) & (nominal + ck - 1 >= oldest)
    return lax.cond(visible, attend, lambda c: c, carry), None

  init = (lax.full_like(q, 0.0, jnp.float32),
          lax.full_like(q, reference.NEG_INF, jnp.float32, (b, tq, h)))
  (out, _), _ = lax.scan(step, init, jnp.arange(-(-max_len // ck), dtype=jnp.int32))
  return out.astype(q.dtype)
