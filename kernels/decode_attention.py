"""Decode attention: a few new query tokens against a KV cache with per-row lengths.

    out = decode_attention(q, k_cache, v_cache, lengths=lengths)

q [batch, q_len, heads, head_dim] holds the newest q_len tokens of each row; the cache
[batch, max_len, kv_heads, head_dim] holds keys/values at slot = position, valid below
`lengths` [batch]. Query t of row b sits at position lengths[b] - q_len + t and sees cache
slots <= its position (so slots past a row's length are never read, whatever they hold).
Optional int8 caches carry per-slot, per-head float scales [batch, max_len, kv_heads].
"""
from __future__ import annotations

import jax.numpy as jnp

from kernels.reference import attention_block, default_sm_scale


def quantize_int8(x):
  """Symmetric int8 per (batch, slot, head): returns (int8 values, float32 scales)."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127)
  return q.astype(jnp.int8), scale


def _dequantize(x, scale, dtype):
  if scale is None:
    return x
  return (x.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


def decode_attention(q, k_cache, v_cache, *, lengths, k_scale=None, v_scale=None,
                     sm_scale=None, logits_soft_cap=None, sliding_window=None):
  """Attention of the newest q_len tokens of each row over its cached prefix.

  Args:
    q: [batch, q_len, heads, head_dim].
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim], float or int8.
    lengths: [batch] int, tokens valid in each row's cache (the new ones included).
    k_scale, v_scale: [batch, max_len, kv_heads] scales when the cache is int8.
    sm_scale, logits_soft_cap, sliding_window: as in `reference_attention`.

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype.
  """
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, q_len, heads, head_dim], got shape {q.shape}")
  if k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
    raise ValueError(f"k_cache and v_cache must both be [batch, max_len, kv_heads, head_dim], "
                     f"got {k_cache.shape} and {v_cache.shape}")
  b, t, h, d = q.shape
  if k_cache.shape[0] != b or k_cache.shape[3] != d:
    raise ValueError(f"k_cache {k_cache.shape} does not match q {q.shape} in batch/head_dim")
  if h % k_cache.shape[2]:
    raise ValueError(f"q heads {h} must be a multiple of k_cache kv_heads {k_cache.shape[2]}")
  if jnp.shape(lengths) != (b,):
    raise ValueError(f"lengths must be [batch] = ({b},), got {jnp.shape(lengths)}")
  if (k_cache.dtype == jnp.int8) != (k_scale is not None):
    raise ValueError("k_scale must be given exactly when k_cache is int8")
  k = _dequantize(k_cache, k_scale, q.dtype)
  v = _dequantize(v_cache, v_scale, q.dtype)
  lengths = jnp.asarray(lengths, jnp.int32)
  q_pos = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None]
  kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None]
  # Slots past a row's length may hold anything (NaN included); 0 * NaN would leak.
  valid = (kv_pos < lengths[:, None])[:, :, None, None]
  k, v = jnp.where(valid, k, 0), jnp.where(valid, v, 0)
  out, _ = attention_block(q, k, v, q_positions=q_pos, kv_positions=kv_pos, causal=True,
                           sm_scale=default_sm_scale(d, sm_scale),
                           logits_soft_cap=logits_soft_cap, sliding_window=sliding_window)
  return out.astype(q.dtype)
