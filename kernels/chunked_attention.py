"""Blockwise attention in plain JAX: O(length x chunk) memory on any backend.

A `lax.map` over query chunks runs a `lax.scan` over key/value chunks, merging the
partial results of `attention_block` by log-sum-exp (online softmax). Chunk pairs that
the causal / sliding-window mask hides entirely are skipped with `lax.cond`. The
backward pass is a `custom_vjp` that recomputes the probabilities chunk by chunk from
the saved log-sum-exp, so no [q_len, kv_len] array is ever stored.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import reference

DEFAULT_CHUNK_SIZE = 512


class MaskParams(NamedTuple):
  """Static (hashable) mask and logit options shared by the blockwise passes."""
  causal: bool
  sm_scale: float
  logits_soft_cap: float | None
  sliding_window: int | None


def _pad_to(x, multiple, axis, value):
  pad = (-x.shape[axis]) % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _chunks(x, size, axis=1):
  """[d0, n*size, ...] -> [n, d0, size, ...] with the chunk index leading."""
  shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unchunk(x):
  """Inverse of `_chunks` along axis 1."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[:1] + (x.shape[1] * x.shape[2],) + x.shape[3:])


def _chunk_visible(q_min, q_max, kv_min, kv_max, params: MaskParams):
  """False when the position mask hides every (query, key) pair of two chunks."""
  visible = jnp.array(True)
  if params.causal:
    visible &= kv_min <= q_max
  if params.sliding_window is not None:
    visible &= q_min - kv_max < params.sliding_window
    if not params.causal:
      visible &= kv_min - q_max < params.sliding_window
  return visible


class _Chunked(NamedTuple):
  q: jax.Array   # [nq, b, cq, h, d]
  q_seg: jax.Array | None
  q_pos: jax.Array  # [nq, b or 1, cq]
  k: jax.Array   # [nk, b, ck, kvh, d]
  v: jax.Array
  kv_seg: jax.Array | None
  kv_pos: jax.Array


def _to_chunks(q, k, v, q_seg, kv_seg, q_pos, kv_pos, cq, ck):
  """Pads lengths to whole chunks (padded keys get segment 0) and splits them."""
  tq, tk = q.shape[1], k.shape[1]
  if q_seg is None and (tk % ck or tq % cq):
    q_seg = jnp.ones(q.shape[:2], jnp.int32)
    kv_seg = jnp.ones(k.shape[:2], jnp.int32)
  pad_q = lambda x, value=0: _pad_to(x, cq, 1, value)
  pad_kv = lambda x, value=0: _pad_to(x, ck, 1, value)
  return _Chunked(
      q=_chunks(pad_q(q), cq),
      q_seg=None if q_seg is None else _chunks(pad_q(q_seg), cq),
      q_pos=_chunks(pad_q(q_pos, jnp.iinfo(jnp.int32).min // 2), cq),
      k=_chunks(pad_kv(k), ck), v=_chunks(pad_kv(v), ck),
      kv_seg=None if kv_seg is None else _chunks(pad_kv(kv_seg), ck),
      kv_pos=_chunks(pad_kv(kv_pos, jnp.iinfo(jnp.int32).max // 2), ck))


def _extent(pos, valid_len, chunk):
  """Per-chunk min and max position [n], ignoring padded rows."""
  n = pos.shape[0]
  valid = (jnp.arange(n * chunk) < valid_len).reshape(n, 1, chunk)
  big = jnp.iinfo(jnp.int32).max
  lo = jnp.min(jnp.where(valid, pos, big), axis=(1, 2))
  hi = jnp.max(jnp.where(valid, pos, -big), axis=(1, 2))
  return lo, hi


def blockwise_attention_fwd(q, k, v, q_segment_ids, kv_segment_ids, q_positions,
                            kv_positions, params: MaskParams, q_chunk: int, kv_chunk: int,
                            alibi_slopes=None):
  """Forward pass. Returns out [b, q_len, h, d] f32 and lse [b, q_len, h] f32.
  `alibi_slopes` [heads]: ALiBi's bias by the given positions (None: none)."""
  b, tq, h, d = q.shape
  tk = k.shape[1]
  cq, ck = min(q_chunk, tq), min(kv_chunk, tk)
  c = _to_chunks(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, cq, ck)
  q_lo, q_hi = _extent(c.q_pos, tq, cq)
  kv_lo, kv_hi = _extent(c.kv_pos, tk, ck)

  def one_q_chunk(xs):
    qc, q_seg, q_pos, lo, hi = xs

    def kv_step(carry, ys):
      kc, vc, kv_seg, kv_pos, kv_lo_c, kv_hi_c = ys

      def attend(carry):
        o, lse = reference.attention_block(
            qc, kc, vc, q_positions=q_pos, kv_positions=kv_pos, q_segment_ids=q_seg,
            kv_segment_ids=kv_seg, causal=params.causal, sm_scale=params.sm_scale,
            logits_soft_cap=params.logits_soft_cap, sliding_window=params.sliding_window,
            alibi_slopes=alibi_slopes)
        return reference.merge_attention(*carry, o, lse)

      visible = _chunk_visible(lo, hi, kv_lo_c, kv_hi_c, params)
      return jax.lax.cond(visible, attend, lambda c_: c_, carry), None

    # full_like keeps q's shard_map axes, so the carry type matches under shard_map.
    init = (jax.lax.full_like(qc, 0.0, jnp.float32, (b, cq, h, d)),
            jax.lax.full_like(qc, reference.NEG_INF, jnp.float32, (b, cq, h)))
    (out, lse), _ = jax.lax.scan(kv_step, init, (c.k, c.v, c.kv_seg, c.kv_pos, kv_lo, kv_hi))
    return out, lse

  out, lse = jax.lax.map(one_q_chunk, (c.q, c.q_seg, c.q_pos, q_lo, q_hi))
  return _unchunk(out)[:, :tq], _unchunk(lse)[:, :tq]


def blockwise_attention_bwd(q, k, v, q_segment_ids, kv_segment_ids, q_positions,
                            kv_positions, dout, lse, delta, params: MaskParams,
                            q_chunk: int, kv_chunk: int, alibi_slopes=None):
  """Backward pass given the final lse and delta = sum(dout * out, -1); f32 grads."""
  tq, tk = q.shape[1], k.shape[1]
  cq, ck = min(q_chunk, tq), min(kv_chunk, tk)
  c = _to_chunks(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, cq, ck)
  dout_c = _chunks(_pad_to(dout, cq, 1, 0), cq)
  lse_c = _chunks(_pad_to(lse, cq, 1, reference.NEG_INF), cq)
  delta_c = _chunks(_pad_to(delta, cq, 1, 0), cq)
  q_lo, q_hi = _extent(c.q_pos, tq, cq)
  kv_lo, kv_hi = _extent(c.kv_pos, tk, ck)

  def q_step(dkv, xs):
    qc, q_seg, q_pos, do, lse_q, delta_q, lo, hi = xs

    def kv_step(dq, ys):
      kc, vc, kv_seg, kv_pos, kv_lo_c, kv_hi_c = ys

      def grads(_):
        return reference.attention_block_grad(
            qc, kc, vc, do, lse_q, delta_q, q_positions=q_pos, kv_positions=kv_pos,
            q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=params.causal,
            sm_scale=params.sm_scale, logits_soft_cap=params.logits_soft_cap,
            sliding_window=params.sliding_window, alibi_slopes=alibi_slopes)

      def skip(_):
        zeros_kv = jax.lax.full_like(kc, 0.0, jnp.float32)
        return jax.lax.full_like(qc, 0.0, jnp.float32), zeros_kv, zeros_kv

      visible = _chunk_visible(lo, hi, kv_lo_c, kv_hi_c, params)
      dq_c, dk_c, dv_c = jax.lax.cond(visible, grads, skip, None)
      return dq + dq_c, (dk_c, dv_c)

    dq, (dk, dv) = jax.lax.scan(kv_step, jax.lax.full_like(qc, 0.0, jnp.float32),
                                (c.k, c.v, c.kv_seg, c.kv_pos, kv_lo, kv_hi))
    return (dkv[0] + dk, dkv[1] + dv), dq

  zeros = jax.lax.full_like(c.k, 0.0, jnp.float32)
  (dk, dv), dq = jax.lax.scan(
      q_step, (zeros, zeros),
      (c.q, c.q_seg, c.q_pos, dout_c, lse_c, delta_c, q_lo, q_hi))
  return _unchunk(dq)[:, :tq], _unchunk(dk)[:, :tk], _unchunk(dv)[:, :tk]


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _chunked(q, k, v, q_seg, kv_seg, q_pos, kv_pos, sinks, slopes, params, q_chunk,
             kv_chunk):
  return _chunked_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, sinks, slopes, params,
                      q_chunk, kv_chunk)[0]


def _chunked_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, sinks, slopes, params, q_chunk,
                 kv_chunk):
  out, lse = blockwise_attention_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, params,
                                     q_chunk, kv_chunk, slopes)
  # With sinks the backward reads the lse and output with them (`add_sinks`).
  out, lse = reference.add_sinks(out, lse, sinks)
  out = out.astype(q.dtype)
  return out, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, sinks, slopes, out, lse)


def _chunked_bwd(params, q_chunk, kv_chunk, res, dout):
  q, k, v, q_seg, kv_seg, q_pos, kv_pos, sinks, slopes, out, lse = res
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  dq, dk, dv = blockwise_attention_bwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, dout, lse,
                                       delta, params, q_chunk, kv_chunk, slopes)
  dsinks = None if sinks is None else reference.sinks_grad(sinks, lse, delta)
  # ALiBi's slopes are constants: no gradient.
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None,
          None, dsinks, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q, k, v, *, causal: bool = True, q_segment_ids=None,
                      kv_segment_ids=None, sm_scale: float | None = None,
                      logits_soft_cap: float | None = None,
                      sliding_window: int | None = None, q_positions=None,
                      kv_positions=None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      q_chunk_size: int | None = None, sinks=None, alibi_slopes=None):
  """Memory-efficient attention in plain JAX (scan over chunks, online softmax).

  Args:
    q: [batch, q_len, heads, head_dim].
    k, v: [batch, kv_len, kv_heads, head_dim]; heads % kv_heads == 0.
    causal, q_segment_ids, kv_segment_ids, sm_scale, logits_soft_cap, sliding_window,
      q_positions, kv_positions, sinks, alibi_slopes: as in
      `kernels.reference_attention`.
    chunk_size: keys per chunk; lengths need not be multiples (padded and masked).
    q_chunk_size: queries per chunk, defaults to chunk_size.

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype. Peak memory is
    O(batch * heads * q_chunk_size * chunk_size) beyond the inputs.
  """
  reference.check_attention_inputs(
      q, k, v, q_segment_ids, kv_segment_ids, sm_scale=sm_scale,
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, sinks=sinks,
      alibi_slopes=alibi_slopes)
  q_chunk_size = chunk_size if q_chunk_size is None else q_chunk_size
  for name, value in (("chunk_size", chunk_size), ("q_chunk_size", q_chunk_size)):
    if int(value) != value or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value}")
  q_pos, kv_pos = reference.resolve_positions(q, k, q_positions, kv_positions)
  params = MaskParams(causal=bool(causal),
                      sm_scale=reference.default_sm_scale(q.shape[-1], sm_scale),
                      logits_soft_cap=logits_soft_cap,
                      sliding_window=None if sliding_window is None else int(sliding_window))
  return _chunked(q, k, v, q_segment_ids, kv_segment_ids, q_pos, kv_pos, sinks,
                  alibi_slopes, params, int(q_chunk_size), int(chunk_size))
