"""Reference attention: the oracle every kernel is tested against, plus shared pieces.

Layout everywhere: q [batch, q_len, heads, head_dim], k, v [batch, kv_len, kv_heads,
head_dim], heads a multiple of kv_heads. The log-sum-exp is [batch, q_len, heads], f32.

Mask semantics (shared by every kernel):
  * segment ids: query i sees key j only if q_seg[i] == kv_seg[j] and kv_seg[j] != 0,
    so id 0 is padding and a padding query sees nothing (output 0, lse -inf).
  * positions: by default queries are the LAST q_len positions of the kv sequence,
    q_pos = kv_len - q_len + arange(q_len), kv_pos = arange(kv_len).
  * causal: q_pos >= kv_pos.
  * sliding_window w: q_pos - kv_pos < w (and kv_pos - q_pos < w when not causal).
  * local_chunk c (Llama 4's chunked attention; `reference_attention` and
    `decode_attention` take it): q_pos // c == kv_pos // c, each query sees only keys of
    its own chunk of c positions. Every other kernel gets it by segment ids:
    `local_chunk_segment_ids`.
  * logits_soft_cap c: logits = c * tanh(logits / c), applied after sm_scale.
  * sinks [heads] (gpt-oss's attention sinks): each query's softmax also holds
    exp(sinks[h]), a key of logit sinks[h] (no scale, cap or mask) and value 0, so a
    query may attend to nothing; the lse includes it. Differentiable in the sinks.
  * alibi_slopes [heads] (ALiBi, attention with linear biases: BLOOM, MPT, Falcon-RW,
    Baichuan-13B), one slope per query head: each logit gains -slopes[h] * |q_pos -
    kv_pos| after sm_scale and logits_soft_cap, before the mask (flash-attn 2's
    convention; for causal attention it is slopes[h] * (kv_pos - q_pos), transformers'
    BLOOM / MPT bias slope * kv_pos less a per-query constant that the softmax cancels).
    Positions are the ones above (ring, windowed and decode blocks use their real ones),
    and the lse includes the bias. The slopes are constants: they get no gradient.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def check_attention_inputs(q, k, v, q_segment_ids=None, kv_segment_ids=None, *,
                           sm_scale=None, logits_soft_cap=None, sliding_window=None,
                           sinks=None, local_chunk=None, alibi_slopes=None):
  """Raises ValueError naming the offending argument if the inputs break the contract."""
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, q_len, heads, head_dim], got shape {q.shape}")
  if k.ndim != 4:
    raise ValueError(f"k must be [batch, kv_len, kv_heads, head_dim], got shape {k.shape}")
  if v.shape != k.shape:
    raise ValueError(f"v must have the shape of k {k.shape}, got shape {v.shape}")
  if k.shape[0] != q.shape[0]:
    raise ValueError(f"k batch {k.shape[0]} does not match q batch {q.shape[0]}")
  if k.shape[3] != q.shape[3]:
    raise ValueError(f"k head_dim {k.shape[3]} does not match q head_dim {q.shape[3]}")
  if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
    raise ValueError(
        f"q heads {q.shape[2]} must be a multiple of k kv_heads {k.shape[2]}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None:
    if tuple(q_segment_ids.shape) != q.shape[:2]:
      raise ValueError(
          f"q_segment_ids must be [batch, q_len] = {q.shape[:2]}, got {q_segment_ids.shape}")
    if tuple(kv_segment_ids.shape) != k.shape[:2]:
      raise ValueError(
          f"kv_segment_ids must be [batch, kv_len] = {k.shape[:2]}, got {kv_segment_ids.shape}")
  if sm_scale is not None and not sm_scale > 0:
    raise ValueError(f"sm_scale must be positive, got {sm_scale}")
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
  if sliding_window is not None and (int(sliding_window) != sliding_window
                                     or sliding_window < 1):
    raise ValueError(f"sliding_window must be a positive int, got {sliding_window}")
  if isinstance(local_chunk, (int, float)) and (isinstance(local_chunk, bool) or int(
      local_chunk) != local_chunk or local_chunk < 1):
    raise ValueError(f"local_chunk must be a positive int, got {local_chunk!r}")
  if sinks is not None and (tuple(sinks.shape) != (q.shape[2],)
                            or not jnp.issubdtype(sinks.dtype, jnp.floating)):
    raise ValueError(f"sinks must be float [heads] = ({q.shape[2]},), got "
                     f"{getattr(sinks, 'dtype', None)} {tuple(sinks.shape)}")
  if alibi_slopes is not None:
    shape = tuple(getattr(alibi_slopes, "shape", (None,)))
    dtype = getattr(alibi_slopes, "dtype", None)
    if shape != (q.shape[2],) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"alibi_slopes must be a float array [heads] = ({q.shape[2]},), got "
                       f"{type(alibi_slopes).__name__ if dtype is None else dtype} {shape}")


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
  return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def default_positions(q_len: int, kv_len: int):
  """Positions [1, q_len] and [1, kv_len]: queries are the last q_len positions."""
  q_pos = jnp.arange(q_len, dtype=jnp.int32)[None] + (kv_len - q_len)
  return q_pos, jnp.arange(kv_len, dtype=jnp.int32)[None]


def attention_mask(q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None, *,
                   causal: bool, sliding_window: int | None = None, local_chunk=None):
  """Boolean mask [batch or 1, q_len, kv_len]; positions are [batch or 1, len] int32.
  `local_chunk`: an int or an int32 scalar (traced: a layer's flag under a scan)."""
  q_pos = q_positions[:, :, None]
  kv_pos = kv_positions[:, None, :]
  mask = jnp.ones(jnp.broadcast_shapes(q_pos.shape, kv_pos.shape), dtype=bool)
  if causal:
    mask = mask & (q_pos >= kv_pos)
  if sliding_window is not None:
    mask = mask & (q_pos - kv_pos < sliding_window)
    if not causal:
      mask = mask & (kv_pos - q_pos < sliding_window)
  if local_chunk is not None:
    mask = mask & (q_pos // local_chunk == kv_pos // local_chunk)
  if q_segment_ids is not None:
    kv_seg = kv_segment_ids[:, None, :]
    mask = mask & (q_segment_ids[:, :, None] == kv_seg) & (kv_seg != 0)
  return mask


def soft_cap(logits, cap):
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def _grouped(q, kv_heads):
  b, t, h, d = q.shape
  return q.reshape(b, t, kv_heads, h // kv_heads, d)


def _per_key(scale):
  """Scale [b or 1, kv_len or 1, kv_heads] -> [b or 1, kv_heads, 1, 1, kv_len or 1]."""
  return jnp.moveaxis(scale.astype(jnp.float32), 2, 1)[:, :, None, None, :]


def alibi_bias(alibi_slopes, q_positions, kv_positions, kv_heads: int):
  """ALiBi's bias -slopes[h] * |q_pos - kv_pos| as f32 [b or 1, kv_heads, group, q_len,
  kv_len], the layout of the grouped scores, from slopes [heads] and positions [b or 1,
  len]. The slopes are constants (no gradient), so autodiff through a kernel built on it
  matches the custom backward passes, which give them none."""
  distance = jnp.abs(q_positions[:, :, None] - kv_positions[:, None, :])
  slopes = jax.lax.stop_gradient(jnp.asarray(alibi_slopes, jnp.float32))
  return -slopes.reshape(1, kv_heads, -1, 1, 1) * distance.astype(jnp.float32)[:, None, None]


def _logits(q, k, mask, sm_scale, logits_soft_cap, k_scale=None, bias=None):
  """Masked f32 logits [b, kv_heads, group, q_len, kv_len] (masked entries -inf); `bias`
  (ALiBi's, broadcastable to them) is added after the soft cap."""
  qg = _grouped(q, k.shape[2])
  # int8 values are exact in q's dtype; their scale is applied to the logits instead of
  # dequantising the keys.
  k = k.astype(q.dtype) if k.dtype != q.dtype else k
  s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
  if k_scale is not None:
    s = s * _per_key(k_scale)
  s = soft_cap(s * sm_scale, logits_soft_cap)
  if bias is not None:
    s = s + bias
  return jnp.where(mask[:, None, None], s, NEG_INF)


def attention_block(q, k, v, *, q_positions, kv_positions, q_segment_ids=None,
                    kv_segment_ids=None, causal: bool, sm_scale: float,
                    logits_soft_cap: float | None = None,
                    sliding_window: int | None = None, k_scale=None, v_scale=None,
                    local_chunk=None, alibi_slopes=None):
  """Attention of a query block against one key/value block.

  Args:
    k_scale, v_scale: optional dequantisation scales [b or 1, kv_len or 1, kv_heads]
      for integer k / v (value = int * scale).
    alibi_slopes: optional ALiBi slopes [heads], biasing by the given positions.

  Returns:
    (out, lse): out [batch, q_len, heads, head_dim] f32, normalised over this block only;
    lse [batch, q_len, heads] f32, -inf for rows with no visible key (their out is 0).
    Combine blocks with `merge_attention`.
  """
  mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                        causal=causal, sliding_window=sliding_window,
                        local_chunk=local_chunk)
  bias = (None if alibi_slopes is None else
          alibi_bias(alibi_slopes, q_positions, kv_positions, k.shape[2]))
  s = _logits(q, k, mask, sm_scale, logits_soft_cap, k_scale, bias)
  # The max only stabilises exp; stopping its gradient keeps fully masked rows NaN-free.
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  l_safe = jnp.where(l == 0.0, 1.0, l)
  pv = p if v_scale is None else p * _per_key(v_scale)
  dtype = q.dtype if v.dtype != q.dtype else v.dtype
  o = jnp.einsum("bkgqs,bskd->bqkgd", pv.astype(dtype), v.astype(dtype),
                 preferred_element_type=jnp.float32)
  b, tq, h, d = q.shape
  inv_l = jnp.moveaxis(1.0 / l_safe[..., 0], 3, 1)  # [b, tq, kvh, g]
  out = (o * inv_l[..., None]).reshape(b, tq, h, d)
  lse = jnp.where(l == 0.0, NEG_INF, m + jnp.log(l_safe))[..., 0]
  return out, jnp.moveaxis(lse, 3, 1).reshape(b, tq, h)


def attention_block_grad(q, k, v, dout, lse, delta, *, q_positions, kv_positions,
                         q_segment_ids=None, kv_segment_ids=None, causal: bool,
                         sm_scale: float, logits_soft_cap: float | None = None,
                         sliding_window: int | None = None, alibi_slopes=None):
  """Gradients of the full attention w.r.t. one block's q, k, v, in f32.

  `lse` [batch, q_len, heads] is the final log-sum-exp over ALL key blocks and
  `delta` = sum(dout * out, -1) [batch, q_len, heads] uses the final output, so the
  per-block results sum to the exact gradient (dq over kv blocks, dk/dv over q blocks).
  """
  kvh = k.shape[2]
  mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                        causal=causal, sliding_window=sliding_window)
  qg = _grouped(q, kvh)
  s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
  s = s * sm_scale
  capped = soft_cap(s, logits_soft_cap)
  lse_g = jnp.moveaxis(_grouped(lse[..., None], kvh)[..., 0], 1, 3)  # [b, kvh, g, tq]
  lse_g = jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)[..., None]
  logits = capped
  if alibi_slopes is not None:  # a constant: the soft cap's derivative is still capped's
    logits = capped + alibi_bias(alibi_slopes, q_positions, kv_positions, kvh)
  p = jnp.where(mask[:, None, None], jnp.exp(logits - lse_g), 0.0)
  dog = _grouped(dout, kvh)
  dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dout.dtype), dog,
                  preferred_element_type=jnp.float32)
  dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, v, preferred_element_type=jnp.float32)
  delta_g = jnp.moveaxis(_grouped(delta[..., None], kvh)[..., 0], 1, 3)[..., None]
  ds = p * (dp - delta_g)
  if logits_soft_cap is not None:
    ds = ds * (1.0 - jnp.square(capped / logits_soft_cap))
  ds = ds * sm_scale
  dq = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), k,
                  preferred_element_type=jnp.float32).reshape(q.shape)
  dk = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), qg,
                  preferred_element_type=jnp.float32)
  return dq, dk, dv


def merge_attention(out_a, lse_a, out_b, lse_b):
  """Combines two partial attentions over disjoint key sets by log-sum-exp weighting.

  Args: out_* [..., heads, head_dim] f32, lse_* [..., heads] f32 (-inf = no keys).
  Returns: (out, lse) over the union of the key sets.
  """
  lse = jnp.logaddexp(lse_a, lse_b)
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.exp(lse_a - lse_safe)[..., None]
  w_b = jnp.exp(lse_b - lse_safe)[..., None]
  return out_a * w_a + out_b * w_b, lse


def add_sinks(out, lse, sinks):
  """(out, lse) of attention over the keys -> over the keys and the sinks: each query's
  softmax gains exp(sinks[h]) with value 0, so out shrinks by exp(lse) / (exp(lse) +
  exp(sink)). out [..., heads, head_dim] f32 (or any float: the result keeps its dtype),
  lse [..., heads] f32 (-inf = no key), sinks [heads] or None (returns the inputs).

  A kernel that saves the new lse and the new out for its backward pass needs no other
  change there: p = exp(s - lse) is then each key's probability beside the sinks, and
  delta = sum(dout * out) is that of the output it returned. The sinks' own gradient is
  `sinks_grad`."""
  if sinks is None:
    return out, lse
  new_lse = jnp.logaddexp(lse, _lead(sinks, lse))
  scale = jnp.exp(lse - new_lse)  # 0 for a row with no key
  return (out.astype(jnp.float32) * scale[..., None]).astype(out.dtype), new_lse


def _lead(sinks, like):
  """sinks [heads] as float32 [1, ..., heads], of like's rank."""
  return sinks.astype(jnp.float32).reshape((1,) * (like.ndim - 1) + (-1,))


def sinks_grad(sinks, lse, delta):
  """d loss / d sinks [heads] from the lse with the sinks (`add_sinks`) and delta =
  sum(dout * out, -1), both [..., heads]: each sink's probability exp(sink - lse) times
  its value (0) less delta, summed over the queries."""
  p = jnp.exp(_lead(sinks, lse) - lse)
  return -jnp.sum((p * delta).reshape(-1, lse.shape[-1]), axis=0).astype(sinks.dtype)


def resolve_positions(q, k, q_positions=None, kv_positions=None):
  """Explicit positions broadcast to [batch or 1, len] int32, or the defaults."""
  if q_positions is None and kv_positions is None:
    return default_positions(q.shape[1], k.shape[1])
  if q_positions is None or kv_positions is None:
    raise ValueError("q_positions and kv_positions must be given together")
  q_positions = jnp.asarray(q_positions, jnp.int32)
  kv_positions = jnp.asarray(kv_positions, jnp.int32)
  q_positions = q_positions[None] if q_positions.ndim == 1 else q_positions
  kv_positions = kv_positions[None] if kv_positions.ndim == 1 else kv_positions
  if q_positions.ndim != 2 or q_positions.shape[1] != q.shape[1]:
    raise ValueError(f"q_positions must be [batch, q_len] or [q_len], got {q_positions.shape}")
  if kv_positions.ndim != 2 or kv_positions.shape[1] != k.shape[1]:
    raise ValueError(
        f"kv_positions must be [batch, kv_len] or [kv_len], got {kv_positions.shape}")
  return q_positions, kv_positions


def reference_attention(q, k, v, *, causal: bool = True, q_segment_ids=None,
                        kv_segment_ids=None, sm_scale: float | None = None,
                        logits_soft_cap: float | None = None,
                        sliding_window: int | None = None, q_positions=None,
                        kv_positions=None, return_lse: bool = False, sinks=None,
                        local_chunk=None, alibi_slopes=None):
  """Plain softmax attention in f32 that materialises the [q_len, kv_len] scores.

  Args:
    q: [batch, q_len, heads, head_dim].
    k, v: [batch, kv_len, kv_heads, head_dim]; heads % kv_heads == 0.
    causal, q_segment_ids, kv_segment_ids, sm_scale, logits_soft_cap, sliding_window:
      the mask and logit options described in the module docstring; sm_scale defaults
      to 1/sqrt(head_dim).
    q_positions, kv_positions: optional explicit int positions [batch or 1, len].
    return_lse: also return the log-sum-exp [batch, q_len, heads] in f32.
    sinks: optional float [heads], attention-sink logits (see the module docstring).
    local_chunk: each query sees only the keys of its own chunk of this many positions
      (Llama 4's chunked attention; see the module docstring).
    alibi_slopes: optional float [heads], ALiBi's slopes (see the module docstring).

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype (and the lse if asked).
  """
  check_attention_inputs(q, k, v, q_segment_ids, kv_segment_ids, sm_scale=sm_scale,
                         logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                         sinks=sinks, local_chunk=local_chunk, alibi_slopes=alibi_slopes)
  q_pos, kv_pos = resolve_positions(q, k, q_positions, kv_positions)
  f32 = jnp.float32
  out, lse = attention_block(
      q.astype(f32), k.astype(f32), v.astype(f32), q_positions=q_pos,
      kv_positions=kv_pos, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      causal=causal, sm_scale=default_sm_scale(q.shape[-1], sm_scale),
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
      local_chunk=local_chunk, alibi_slopes=alibi_slopes)
  out, lse = add_sinks(out, lse, sinks)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


def local_chunk_segment_ids(segment_ids, positions, local_chunk):
  """Segment ids [batch, len] that also split each segment where its positions cross a
  multiple of `local_chunk`: with them as both q and kv segment ids, any kernel computes
  self-attention of one sequence layout (training, a prefill) under the `local_chunk`
  mask (Llama 4's chunked attention). 0 (padding) stays 0; the others become 1, 2, ...
  along each row. `local_chunk` may be a traced int32 scalar.

  Args:
    segment_ids: int [batch, len], 0 = padding, each segment's tokens contiguous.
    positions: int [batch, len], each token's position in its segment.
  """
  segment_ids = jnp.asarray(segment_ids, jnp.int32)
  chunk = jnp.asarray(positions, jnp.int32) // local_chunk
  first = jnp.ones_like(segment_ids[:, :1], dtype=bool)
  starts = jnp.concatenate([first, (segment_ids[:, 1:] != segment_ids[:, :-1])
                            | (chunk[:, 1:] != chunk[:, :-1])], axis=1)
  return jnp.where(segment_ids == 0, 0, jnp.cumsum(starts, axis=1, dtype=jnp.int32))
