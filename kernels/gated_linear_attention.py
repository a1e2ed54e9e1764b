"""Gated linear attention with a scalar decay per head and token (simple GLA), the
state-space duality form of Mamba2's SSD, in plain JAX.

Per value head a state S [Dk, Dv] (f32) evolves token by token:

    S <- exp(g_t) S + k_t v_t^T
    o_t = S^T (scale q_t)

Key head h serves value heads h*r .. h*r+r-1 (r = value_heads // key_heads); q and k are
never repeated in memory, the value heads are viewed as [key_heads, r] instead.

Mamba2's SSD with x [B, T, H, P], dt [B, T, H] (softplus(dt + dt_bias)), A [H]
(negative), B, C [B, T, G, N] and D [H] is this with

    q = C, k = B, v = x * dt[..., None], g = dt * A, scale = 1
    (key_heads = G, Dk = N, value_heads = H, Dv = P), then y = o + D[:, None] * x.

`gated_linear_attention_reference` runs the recurrence (a `lax.scan` over tokens: the
oracle, and the one-token decode step). `gated_linear_attention` runs the chunked form:
within a chunk the outputs are a decay-masked attention plus a read of the carried
state, and a `lax.scan` carries S from chunk to chunk. Its body is rematerialised in
the backward pass, so only the carried state per chunk is saved, never a chunk's
[chunk, chunk] matrices.

Segment ids [batch, T] (int, None = all ones) mean what they mean for
`kernels.gated_delta_rule`: id 0 is transparent padding (no decay, no update, output
0); a token whose id differs from that of the last preceding non-padding token of its
row restarts from a zero state; the first non-padding token of a row continues
`initial_state`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.gated_delta_rule import (
    _check_int,
    _einsum,
    _finish,
    _to_chunks,
    carried_state,
    check_linear_inputs,
    segment_resets,
)

DEFAULT_CHUNK_SIZE = 64


def _check_inputs(q, k, v, g, segment_ids, initial_state, scale):
  """Raises ValueError naming the offending argument if the inputs break the contract."""
  check_linear_inputs(q, k, v, {"g": g}, segment_ids, initial_state)
  if scale is None or not scale > 0:
    raise ValueError(f"scale must be positive, got {scale}")


def _prepare(q, k, v, g, segment_ids, initial_state, scale):
  """f32 inputs with value heads split as [key_heads, r]; padding tokens zeroed.

  Zeroing a padding token's q, k, v and g makes it transparent in both forms: exp(0) = 1
  keeps the state, k = 0 adds nothing, q = 0 reads 0.
  """
  batch, length, key_heads, dk = q.shape
  value_heads, dv = v.shape[2:]
  r = value_heads // key_heads
  valid_BxT, reset_BxT = segment_resets(segment_ids, batch, length)
  keep4 = valid_BxT[:, :, None, None]
  keep5 = valid_BxT[:, :, None, None, None]
  x = dict(
      q=jnp.where(keep4, q.astype(jnp.float32) * scale, 0.0),
      k=jnp.where(keep4, k.astype(jnp.float32), 0.0),
      v=jnp.where(keep5, v.astype(jnp.float32).reshape(batch, length, key_heads, r, dv),
                  0.0),
      g=jnp.where(keep4, g.astype(jnp.float32).reshape(batch, length, key_heads, r), 0.0),
      reset=reset_BxT)
  if initial_state is None:
    state_BxHxRxKxV = jnp.zeros((batch, key_heads, r, dk, dv), jnp.float32)
  else:
    state_BxHxRxKxV = initial_state.astype(jnp.float32).reshape(batch, key_heads, r, dk,
                                                                 dv)
  return x, state_BxHxRxKxV


def _token_step(state_BxHxRxKxV, x):
  """One token of the recurrence for every row and head."""
  q_BxHxK, k_BxHxK, v_BxHxRxV, g_BxHxR, reset_B = x
  s = jnp.where(reset_B[:, None, None, None, None], 0.0, state_BxHxRxKxV)
  s = (s * jnp.exp(g_BxHxR)[..., None, None]
       + _einsum("bhd,bhre->bhrde", k_BxHxK, v_BxHxRxV))
  return s, _einsum("bhd,bhrde->bhre", q_BxHxK, s)


def gated_linear_attention_reference(q, k, v, g, *, segment_ids=None, initial_state=None,
                                     scale: float = 1.0,
                                     return_final_state: bool = False):
  """Gated linear attention token by token (`lax.scan`): the oracle and the decode step.

  Same arguments and results as `gated_linear_attention` (without chunk_size). Its
  backward pass keeps one state per token, so train through `gated_linear_attention`.
  """
  _check_inputs(q, k, v, g, segment_ids, initial_state, scale)
  x, state = _prepare(q, k, v, g, segment_ids, initial_state, scale)
  xs = tuple(jnp.moveaxis(x[name], 1, 0) for name in ("q", "k", "v", "g", "reset"))
  state, out_TxBxHxRxV = jax.lax.scan(_token_step, state, xs)
  return _finish(jnp.moveaxis(out_TxBxHxRxV, 0, 1), state, v, return_final_state)


def _chunk_step(state_BxHxRxKxV, x):
  """One chunk of C tokens: the outputs and the carried-out state.

  With G the in-chunk cumulative log decay, restricted to pairs j <= i of one sequence
  (no reset between them):
    o_i = exp(G_i) q_i S + sum_{j <= i} q_i.k_j exp(G_i - G_j) v_j
    S' = exp(G_C) S + sum_j exp(G_C - G_j) k_j v_j^T
  where the exp(G) S terms drop for tokens after a reset (S' too if the chunk holds
  one), and the sum in S' covers only the chunk's last sequence.
  """
  q_BxCxHxK, k_BxCxHxK, v_BxCxHxRxV, g_BxCxHxR, reset_BxC = x
  chunk = q_BxCxHxK.shape[1]
  run_BxC = jnp.cumsum(reset_BxC.astype(jnp.int32), axis=1)  # resets so far in the chunk
  i_Cx1 = jnp.arange(chunk)[:, None]
  j_1xC = jnp.arange(chunk)[None]
  causal_BxCxC = (run_BxC[:, :, None] == run_BxC[:, None, :]) & (i_Cx1 >= j_1xC)[None]
  reads_state_BxC = run_BxC == 0

  cum_BxHxRxC = jnp.cumsum(jnp.moveaxis(g_BxCxHxR, 1, -1), axis=-1)
  # Mask before exp: the hidden pairs have G_i - G_j > 0, which could overflow, and a
  # where after an inf would turn its zero cotangent into nan.
  log_decay = cum_BxHxRxC[..., :, None] - cum_BxHxRxC[..., None, :]
  decay_BxHxRxCxC = jnp.exp(jnp.where(causal_BxCxC[:, None, None], log_decay, -jnp.inf))
  qk_BxHxCxC = _einsum("bihd,bjhd->bhij", q_BxCxHxK, k_BxCxHxK)
  decay_in_BxHxRxC = jnp.exp(cum_BxHxRxC) * reads_state_BxC[:, None, None]
  out_BxCxHxRxV = (
      _einsum("bihd,bhri,bhrde->bihre", q_BxCxHxK, decay_in_BxHxRxC, state_BxHxRxKxV)
      + _einsum("bhrij,bjhre->bihre", qk_BxHxCxC[:, :, None] * decay_BxHxRxCxC,
                v_BxCxHxRxV))

  state = carried_state(state_BxHxRxKxV, k_BxCxHxK, jnp.moveaxis(v_BxCxHxRxV, 1, 3),
                        cum_BxHxRxC, run_BxC)
  return state, out_BxCxHxRxV


def gated_linear_attention(q, k, v, g, *, segment_ids=None, initial_state=None,
                           scale: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                           return_final_state: bool = False):
  """Gated linear attention over whole sequences, chunk by chunk.

  Args:
    q, k: [batch, T, key_heads, Dk].
    v: [batch, T, value_heads, Dv]; value_heads a multiple r of key_heads, key head h
      serving value heads h*r .. h*r+r-1.
    g: [batch, T, value_heads], the log decay (<= 0).
    segment_ids: int [batch, T] or None (all ones); see the module docstring.
    initial_state: [batch, value_heads, Dk, Dv] (any float dtype) or None (zeros).
    scale: multiplies q; default 1 (Mamba2 scales nothing).
    chunk_size: tokens per chunk (T need not be a multiple); T == 1 runs the reference.
    return_final_state: also return the state after each row's last non-padding token.

  Returns:
    out [batch, T, value_heads, Dv] in v's dtype (computed in f32; 0 at padding), and
    with return_final_state the final state [batch, value_heads, Dk, Dv] f32.
    Differentiable in q, k, v, g and initial_state.
  """
  _check_inputs(q, k, v, g, segment_ids, initial_state, scale)
  _check_int("chunk_size", chunk_size, 1)
  length = q.shape[1]
  if length == 1:
    return gated_linear_attention_reference(
        q, k, v, g, segment_ids=segment_ids, initial_state=initial_state, scale=scale,
        return_final_state=return_final_state)
  chunk = min(int(chunk_size), length)
  x, state = _prepare(q, k, v, g, segment_ids, initial_state, scale)
  # Padded tokens are zeros with no reset: transparent, like segment id 0.
  xs = tuple(_to_chunks(x[name], chunk) for name in ("q", "k", "v", "g", "reset"))
  step = jax.checkpoint(_chunk_step, prevent_cse=False)
  state, out_NxBxCxHxRxV = jax.lax.scan(step, state, xs)
  out = jnp.moveaxis(out_NxBxCxHxRxV, 0, 1)
  out = out.reshape((out.shape[0], -1) + out.shape[3:])[:, :length]
  return _finish(out, state, v, return_final_state)
