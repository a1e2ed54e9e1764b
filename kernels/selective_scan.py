"""Mamba 1's selective scan (the S6 recurrence) in plain JAX.

Per channel c a state h [N] (f32) evolves token by token, discretised with the token's
own time step:

    h_t[c, n] = exp(dt_t[c] A[c, n]) h_{t-1}[c, n] + dt_t[c] B_t[g(c), n] x_t[c]
    y_t[c]    = sum_n C_t[g(c), n] h_t[c, n] + D[c] x_t[c]

with channel c reading group g(c) = c // (channels // groups) of B and C; B and C are
never repeated over the channels in memory, the channels are viewed as [groups, r]
instead (r = channels // groups).

Mamba 1's mixer (transformers' `MambaMixer`, mamba_ssm's `selective_scan_fn`) is this
with groups = 1 and channels = intermediate; from in_proj(u) = (x_in, gate):

    x = causal_conv1d(x_in, w, bias=b)       [batch, T, channels] (silu included)
    dt_low, B, C = split(x_proj(x))          B, C [batch, T, N], passed as [.., T, 1, N]
    dt = softplus(dt_proj(dt_low))           [batch, T, channels] (dt_proj has the bias)
    A = -exp(A_log)                          [channels, N]
    out = out_proj(selective_scan(x, dt, A, B, C, D=D) * silu(gate))

`selective_scan_reference` runs the recurrence (a `lax.scan` over tokens: the oracle,
and the one-token decode step). `selective_scan` runs it chunk by chunk: a `lax.scan`
carries h [batch, channels, N] from chunk to chunk, and within a chunk either a
`lax.associative_scan` composes the tokens' affine maps h -> a h + b (`inner=
"associative"`, log-depth: for TPU and GPU) or the recurrence steps through the chunk's
tokens (`inner="sequential"`, the default on CPU, where it is 2.2-2.6x faster than the
associative form and as fast as the plain recurrence: `python -m
benchmarks.gated_delta_rule --mixer=mamba1`). Either way the body is rematerialised in
the backward pass, so only the carried state per chunk is saved, never a [batch, T,
channels, N] tensor; a chunk holds batch * chunk * channels * N floats (a few such
buffers) at a time.

Segment ids [batch, T] (int, None = all ones) mean what they mean for
`kernels.gated_delta_rule`: id 0 is transparent padding (no decay, no update, output
0, the D term included); a token whose id differs from that of the last preceding
non-padding token of its row restarts from a zero state; the first non-padding token
of a row continues `initial_state`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.gated_delta_rule import (
    _check_int,
    _check_segment_ids,
    _einsum,
    _to_chunks,
    segment_resets,
)

DEFAULT_CHUNK_SIZE = 64


def _check_inputs(x, dt, A, B, C, D, segment_ids, initial_state):
  """Raises ValueError naming the offending argument if the inputs break the contract."""
  if x.ndim != 3:
    raise ValueError(f"x must be [batch, T, channels], got shape {x.shape}")
  batch, length, channels = x.shape
  if tuple(dt.shape) != (batch, length, channels):
    raise ValueError(f"dt must be [batch, T, channels] = {(batch, length, channels)}, "
                     f"got shape {tuple(dt.shape)}")
  if B.ndim != 4:
    raise ValueError(f"B must be [batch, T, groups, N], got shape {B.shape}")
  if B.shape[:2] != (batch, length):
    raise ValueError(f"B [batch, T] {B.shape[:2]} does not match x's {(batch, length)}")
  groups, state_size = B.shape[2:]
  if groups == 0 or channels % groups:
    raise ValueError(f"B groups {groups} must divide x's channels {channels}")
  if tuple(C.shape) != tuple(B.shape):
    raise ValueError(f"C must be [batch, T, groups, N] = {tuple(B.shape)} (B's shape), "
                     f"got shape {tuple(C.shape)}")
  if tuple(A.shape) != (channels, state_size):
    raise ValueError(f"A must be [channels, N] = {(channels, state_size)}, got shape "
                     f"{tuple(A.shape)}")
  if D is not None and tuple(D.shape) != (channels,):
    raise ValueError(f"D must be [channels] = {(channels,)}, got shape {tuple(D.shape)}")
  _check_segment_ids(segment_ids, batch, length)
  if initial_state is not None and tuple(initial_state.shape) != (batch, channels,
                                                                   state_size):
    raise ValueError(f"initial_state must be [batch, channels, N] = "
                     f"{(batch, channels, state_size)}, got shape "
                     f"{tuple(initial_state.shape)}")


def _prepare(x, dt, A, B, C, D, segment_ids, initial_state):
  """f32 inputs with channels split as [groups, r]; padding tokens zeroed.

  Zeroing a padding token's x, dt, B and C makes it transparent in both forms:
  exp(0 A) = 1 keeps the state, dt x B = 0 adds nothing, C = 0 and x = 0 read 0.
  Returns (per-token inputs, A [G, R, N], D [G, R], initial state [B, G, R, N]).
  """
  batch, length, channels = x.shape
  groups, state_size = B.shape[2:]
  r = channels // groups
  valid_BxT, reset_BxT = segment_resets(segment_ids, batch, length)
  keep3 = valid_BxT[:, :, None, None]
  per_token = dict(
      x=jnp.where(keep3, x.astype(jnp.float32).reshape(batch, length, groups, r), 0.0),
      dt=jnp.where(keep3, dt.astype(jnp.float32).reshape(batch, length, groups, r), 0.0),
      B=jnp.where(keep3, B.astype(jnp.float32), 0.0),
      C=jnp.where(keep3, C.astype(jnp.float32), 0.0),
      reset=reset_BxT)
  a_GxRxN = A.astype(jnp.float32).reshape(groups, r, state_size)
  d_GxR = (jnp.zeros((groups, r), jnp.float32) if D is None
           else D.astype(jnp.float32).reshape(groups, r))
  if initial_state is None:
    state_BxGxRxN = jnp.zeros((batch, groups, r, state_size), jnp.float32)
  else:
    state_BxGxRxN = initial_state.astype(jnp.float32).reshape(batch, groups, r,
                                                               state_size)
  return per_token, a_GxRxN, d_GxR, state_BxGxRxN


def _finish(y_BxTxGxR, state_BxGxRxN, x, return_final_state):
  batch, length, channels = x.shape
  y = y_BxTxGxR.reshape(batch, length, channels).astype(x.dtype)
  if not return_final_state:
    return y
  return y, state_BxGxRxN.reshape(batch, channels, state_BxGxRxN.shape[-1])


def _token_step(a_GxRxN, d_GxR, state_BxGxRxN, inputs):
  """One token of the recurrence for every row and channel."""
  x_BxGxR, dt_BxGxR, b_BxGxN, c_BxGxN, reset_B = inputs
  h = jnp.where(reset_B[:, None, None, None], 0.0, state_BxGxRxN)
  h = (jnp.exp(dt_BxGxR[..., None] * a_GxRxN[None]) * h
       + (dt_BxGxR * x_BxGxR)[..., None] * b_BxGxN[:, :, None, :])
  y_BxGxR = _einsum("bgn,bgrn->bgr", c_BxGxN, h) + d_GxR[None] * x_BxGxR
  return h, y_BxGxR


def selective_scan_reference(x, dt, A, B, C, *, D=None, segment_ids=None,
                             initial_state=None, return_final_state: bool = False):
  """The selective scan token by token (`lax.scan`): the oracle and the decode step.

  Same arguments and results as `selective_scan` (without chunk_size). Its backward
  pass keeps one [batch, channels, N] state per token, so train through
  `selective_scan` instead.
  """
  _check_inputs(x, dt, A, B, C, D, segment_ids, initial_state)
  per_token, a_GxRxN, d_GxR, state = _prepare(x, dt, A, B, C, D, segment_ids,
                                              initial_state)
  xs = tuple(jnp.moveaxis(per_token[name], 1, 0) for name in ("x", "dt", "B", "C", "reset"))
  step = functools.partial(_token_step, a_GxRxN, d_GxR)
  state, y_TxBxGxR = jax.lax.scan(step, state, xs)
  return _finish(jnp.moveaxis(y_TxBxGxR, 0, 1), state, x, return_final_state)


def _compose(first, second):
  """The affine map h -> a h + b of `first` then `second`."""
  a1, b1 = first
  a2, b2 = second
  return a1 * a2, a2 * b1 + b2


def _chunk_step(a_GxRxN, d_GxR, state_BxGxRxN, inputs):
  """One chunk of L tokens: the outputs and the carried-out state.

  Token t is the map h -> a_t h + b_t with a_t = exp(dt_t A) (0 at a reset, 1 at
  padding, where dt = 0) and b_t = dt_t x_t B_t; their prefix compositions
  (a_cum, b_cum) give every state of the chunk from the carried-in one at once,
  h_t = a_cum_t h_in + b_cum_t.
  """
  x_BxLxGxR, dt_BxLxGxR, b_BxLxGxN, c_BxLxGxN, reset_BxL = inputs
  decay_BxLxGxRxN = jnp.where(reset_BxL[:, :, None, None, None], 0.0,
                              jnp.exp(dt_BxLxGxR[..., None] * a_GxRxN[None, None]))
  write_BxLxGxRxN = ((dt_BxLxGxR * x_BxLxGxR)[..., None]
                     * b_BxLxGxN[:, :, :, None, :])
  decay_cum, write_cum = jax.lax.associative_scan(
      _compose, (decay_BxLxGxRxN, write_BxLxGxRxN), axis=1)
  h_BxLxGxRxN = decay_cum * state_BxGxRxN[:, None] + write_cum
  y_BxLxGxR = (_einsum("blgn,blgrn->blgr", c_BxLxGxN, h_BxLxGxRxN)
               + d_GxR[None, None] * x_BxLxGxR)
  return h_BxLxGxRxN[:, -1], y_BxLxGxR


def _sequential_chunk_step(a_GxRxN, d_GxR, state_BxGxRxN, inputs):
  """One chunk of L tokens stepped through in order (`_token_step`): the outputs and the
  carried-out state, as `_chunk_step` gives them."""
  per_token = tuple(jnp.moveaxis(v, 1, 0) for v in inputs)
  state, y_LxBxGxR = jax.lax.scan(functools.partial(_token_step, a_GxRxN, d_GxR),
                                  state_BxGxRxN, per_token)
  return state, jnp.moveaxis(y_LxBxGxR, 0, 1)


# selective_scan's ways through a chunk.
INNER = ("associative", "sequential")


def selective_scan(x, dt, A, B, C, *, D=None, segment_ids=None, initial_state=None,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, return_final_state: bool = False,
                   inner: str | None = None):
  """Mamba 1's selective scan over whole sequences, chunk by chunk.

  Args:
    x: [batch, T, channels], the input (Mamba 1: the conv's activated output).
    dt: [batch, T, channels], the time step, already positive (the caller applies
      softplus, the dt bias and any clipping).
    A: [channels, N], the continuous-time state matrix (diagonal per channel; normally
      negative, -exp(A_log)).
    B, C: [batch, T, groups, N], the input and output projections; channels a multiple
      r of groups, channel c reading group c // r (Mamba 1: groups = 1).
    D: [channels], the skip connection y += D x, or None (none).
    segment_ids: int [batch, T] or None (all ones); see the module docstring.
    initial_state: [batch, channels, N] (any float dtype) or None (zeros).
    chunk_size: tokens per chunk (T need not be a multiple); T == 1 runs the reference.
      A chunk holds batch * chunk_size * channels * N f32 values (a few such buffers).
    return_final_state: also return the state after each row's last non-padding token.
    inner: how a chunk is run: "associative" (`lax.associative_scan`, log-depth) or
      "sequential" (token by token); None picks at call time, "sequential" on the CPU
      backend and "associative" on others. Both give the same results.

  Returns:
    y [batch, T, channels] in x's dtype (computed in f32; 0 at padding), and with
    return_final_state the final state [batch, channels, N] f32.
    Differentiable in x, dt, A, B, C, D and initial_state.
  """
  _check_inputs(x, dt, A, B, C, D, segment_ids, initial_state)
  _check_int("chunk_size", chunk_size, 1)
  if inner is None:
    inner = "sequential" if jax.default_backend() == "cpu" else "associative"
  if inner not in INNER:
    raise ValueError(f"inner must be one of {INNER} or None, got {inner!r}")
  length = x.shape[1]
  if length == 1:
    return selective_scan_reference(
        x, dt, A, B, C, D=D, segment_ids=segment_ids, initial_state=initial_state,
        return_final_state=return_final_state)
  chunk = min(int(chunk_size), length)
  per_token, a_GxRxN, d_GxR, state = _prepare(x, dt, A, B, C, D, segment_ids,
                                              initial_state)
  # Padded tokens are zeros with no reset: transparent, like segment id 0.
  xs = tuple(_to_chunks(per_token[name], chunk) for name in ("x", "dt", "B", "C", "reset"))
  # Rematerialised: the backward pass keeps the carried state per chunk, and rebuilds a
  # chunk's [batch, chunk, channels, N] maps from its inputs.
  body = _chunk_step if inner == "associative" else _sequential_chunk_step
  step = functools.partial(jax.checkpoint(body, prevent_cse=False), a_GxRxN, d_GxR)
  state, y_NxBxLxGxR = jax.lax.scan(step, state, xs)
  y = jnp.moveaxis(y_NxBxLxGxR, 0, 1)
  y = y.reshape((y.shape[0], -1) + y.shape[3:])[:, :length]
  return _finish(y, state, x, return_final_state)
