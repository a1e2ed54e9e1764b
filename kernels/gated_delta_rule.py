"""Gated delta rule (Gated DeltaNet, the linear-attention mixer of Qwen3-Next / Qwen3.5)
and the depthwise causal convolution in front of it, in plain JAX.

Per value head a state S [Dk, Dv] (f32) evolves token by token:

    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (scale q_t)

with q, k L2-normalised over Dk first (`qk_l2norm`). Key head h serves value heads
h*r .. h*r+r-1 (r = value_heads // key_heads, torch `repeat_interleave` order); q and k
are never repeated in memory, the value heads are viewed as [key_heads, r] instead.

`gated_delta_rule_reference` runs exactly that recurrence (a `lax.scan` over tokens: the
oracle, and the one-token decode step). `gated_delta_rule` runs the chunked form of
transformers' `torch_chunk_gated_delta_rule` (the WY / UT transform): within a chunk the
updates are one unit-lower-triangular inverse and a few matmuls, and a `lax.scan` carries
S from chunk to chunk. Its body is rematerialised in the backward pass, so only the
carried state per chunk is saved, never a chunk's [chunk, chunk] matrices.

Segment ids [batch, T] (int, None = all ones), shared by every op here:
  * id 0 is padding and transparent: no decay, no update, no conv input, output 0.
  * a token whose id differs from that of the last preceding non-padding token of its
    row starts a new sequence: the state (or the conv window) restarts from zeros.
  * the first non-padding token of a row continues `initial_state`: no reset there.
So [1, 1, 0, 0] ends in the state of [1, 1], and [1, 1, 2, 2] is [1, 1] and [2, 2] run
separately, the second from zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 64
L2NORM_EPS = 1e-6
# The chunked form solves a triangular system and chains matmuls whose rounding the
# recurrence never sees; reduced-precision f32 matmuls (TF32 on GPU, one bf16 pass on
# TPU) make the two drift apart, so the f32 products here ask for full precision.
_PRECISION = jax.lax.Precision.HIGHEST


def _einsum(spec, *operands):
  return jnp.einsum(spec, *operands, precision=_PRECISION,
                    preferred_element_type=jnp.float32)


def l2norm(x, eps: float = L2NORM_EPS):
  """x * rsqrt(sum(x^2, -1) + eps) in f32, as transformers' `l2norm` (and FLA)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def segment_resets(segment_ids, batch: int, length: int):
  """Which tokens are real and which restart the state.

  Returns:
    (valid, reset), both bool [batch, length]: valid = segment id != 0; reset = a valid
    token whose segment id differs from the last preceding valid token's in its row
    (never the first valid token of a row).
  """
  if segment_ids is None:
    return (jnp.ones((batch, length), jnp.bool_), jnp.zeros((batch, length), jnp.bool_))
  seg_BxT = segment_ids.astype(jnp.int32)
  valid_BxT = seg_BxT != 0
  t_1xT = jnp.arange(length, dtype=jnp.int32)[None]
  last_valid_BxT = jax.lax.cummax(jnp.where(valid_BxT, t_1xT, -1), axis=1)
  prev_valid_BxT = jnp.concatenate(
      [jnp.full((batch, 1), -1, jnp.int32), last_valid_BxT[:, :-1]], axis=1)
  prev_seg_BxT = jnp.take_along_axis(seg_BxT, jnp.maximum(prev_valid_BxT, 0), axis=1)
  reset_BxT = valid_BxT & (prev_valid_BxT >= 0) & (seg_BxT != prev_seg_BxT)
  return valid_BxT, reset_BxT


def _check_int(name, value, minimum):
  if isinstance(value, bool) or int(value) != value or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_segment_ids(segment_ids, batch, length):
  if segment_ids is not None and tuple(segment_ids.shape) != (batch, length):
    raise ValueError(f"segment_ids must be [batch, T] = {(batch, length)}, "
                     f"got shape {tuple(segment_ids.shape)}")


def _check_delta_rule_inputs(q, k, v, g, beta, segment_ids, initial_state, scale):
  """Raises ValueError naming the offending argument if the inputs break the contract."""
  check_linear_inputs(q, k, v, {"g": g, "beta": beta}, segment_ids, initial_state)
  if scale is not None and not scale > 0:
    raise ValueError(f"scale must be positive, got {scale}")


def check_linear_inputs(q, k, v, per_head: dict, segment_ids, initial_state) -> None:
  """The shapes every linear-attention kernel here takes, a ValueError naming the
  argument that breaks them: q, k [batch, T, key_heads, Dk], v [batch, T, value_heads,
  Dv] (a multiple of key_heads), each of `per_head` (name -> array) [batch, T,
  value_heads], segment ids [batch, T], initial_state [batch, value_heads, Dk, Dv]."""
  for name, x in (("q", q), ("k", k)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be [batch, T, key_heads, Dk], got shape {x.shape}")
  if v.ndim != 4:
    raise ValueError(f"v must be [batch, T, value_heads, Dv], got shape {v.shape}")
  batch, length, key_heads, dk = q.shape
  if k.shape[:3] != q.shape[:3]:
    raise ValueError(f"k [batch, T, key_heads] {k.shape[:3]} does not match q's "
                     f"{q.shape[:3]}")
  if k.shape[3] != dk:
    raise ValueError(f"k Dk {k.shape[3]} does not match q Dk {dk}")
  if v.shape[:2] != (batch, length):
    raise ValueError(f"v [batch, T] {v.shape[:2]} does not match q's {(batch, length)}")
  value_heads, dv = v.shape[2:]
  if key_heads == 0 or value_heads % key_heads:
    raise ValueError(f"v value_heads {value_heads} must be a multiple of q/k key_heads "
                     f"{key_heads}")
  for name, x in per_head.items():
    if tuple(x.shape) != (batch, length, value_heads):
      raise ValueError(f"{name} must be [batch, T, value_heads] = "
                       f"{(batch, length, value_heads)}, got shape {tuple(x.shape)}")
  _check_segment_ids(segment_ids, batch, length)
  if initial_state is not None and tuple(initial_state.shape) != (batch, value_heads, dk,
                                                                   dv):
    raise ValueError(f"initial_state must be [batch, value_heads, Dk, Dv] = "
                     f"{(batch, value_heads, dk, dv)}, got shape "
                     f"{tuple(initial_state.shape)}")


def _prepare(q, k, v, g, beta, segment_ids, initial_state, scale, qk_l2norm):
  """f32 inputs with value heads split as [key_heads, r]; padding tokens zeroed.

  Zeroing a padding token's q, k, v, g and beta makes it transparent in both forms:
  exp(0) = 1 keeps the state, beta = 0 adds nothing, q = 0 reads 0.
  """
  batch, length, key_heads, dk = q.shape
  value_heads, dv = v.shape[2:]
  r = value_heads // key_heads
  valid_BxT, reset_BxT = segment_resets(segment_ids, batch, length)
  q_BxTxHxK = l2norm(q) if qk_l2norm else q.astype(jnp.float32)
  k_BxTxHxK = l2norm(k) if qk_l2norm else k.astype(jnp.float32)
  scale = dk ** -0.5 if scale is None else scale
  q_BxTxHxK = q_BxTxHxK * scale
  keep4 = valid_BxT[:, :, None, None]
  keep5 = valid_BxT[:, :, None, None, None]
  x = dict(
      q=jnp.where(keep4, q_BxTxHxK, 0.0),
      k=jnp.where(keep4, k_BxTxHxK, 0.0),
      v=jnp.where(keep5, v.astype(jnp.float32).reshape(batch, length, key_heads, r, dv),
                  0.0),
      g=jnp.where(keep4, g.astype(jnp.float32).reshape(batch, length, key_heads, r), 0.0),
      beta=jnp.where(keep4, beta.astype(jnp.float32).reshape(batch, length, key_heads, r),
                     0.0),
      reset=reset_BxT)
  if initial_state is None:
    state_BxHxRxKxV = jnp.zeros((batch, key_heads, r, dk, dv), jnp.float32)
  else:
    state_BxHxRxKxV = initial_state.astype(jnp.float32).reshape(batch, key_heads, r, dk,
                                                                 dv)
  return x, state_BxHxRxKxV


def _finish(out_BxTxHxRxV, state_BxHxRxKxV, v, return_final_state):
  batch, length, value_heads, dv = v.shape
  out = out_BxTxHxRxV.reshape(batch, length, value_heads, dv).astype(v.dtype)
  if not return_final_state:
    return out
  return out, state_BxHxRxKxV.reshape(batch, value_heads, *state_BxHxRxKxV.shape[3:])


def _token_step(state_BxHxRxKxV, x):
  """One token of the recurrence for every row and head."""
  q_BxHxK, k_BxHxK, v_BxHxRxV, g_BxHxR, beta_BxHxR, reset_B = x
  s = jnp.where(reset_B[:, None, None, None, None], 0.0, state_BxHxRxKxV)
  s = s * jnp.exp(g_BxHxR)[..., None, None]
  kv_mem_BxHxRxV = _einsum("bhd,bhrde->bhre", k_BxHxK, s)
  delta_BxHxRxV = (v_BxHxRxV - kv_mem_BxHxRxV) * beta_BxHxR[..., None]
  s = s + _einsum("bhd,bhre->bhrde", k_BxHxK, delta_BxHxRxV)
  return s, _einsum("bhd,bhrde->bhre", q_BxHxK, s)


def gated_delta_rule_reference(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                               scale: float | None = None, qk_l2norm: bool = True,
                               return_final_state: bool = False):
  """The gated delta rule token by token (`lax.scan`): the oracle and the decode step.

  Same arguments and results as `gated_delta_rule` (without chunk_size). Its backward
  pass keeps one state per token, so train through `gated_delta_rule` instead.
  """
  _check_delta_rule_inputs(q, k, v, g, beta, segment_ids, initial_state, scale)
  x, state = _prepare(q, k, v, g, beta, segment_ids, initial_state, scale, qk_l2norm)
  xs = tuple(jnp.moveaxis(x[name], 1, 0) for name in ("q", "k", "v", "g", "beta", "reset"))
  state, out_TxBxHxRxV = jax.lax.scan(_token_step, state, xs)
  return _finish(jnp.moveaxis(out_TxBxHxRxV, 0, 1), state, v, return_final_state)


def _unit_lower_inverse(a_XxCxC):
  """(I + A)^-1 for A strictly lower triangular [..., C, C], in matmuls alone.

  A is nilpotent (A^C = 0), so with N = -A, (I + A)^-1 = I + N + N^2 + ... + N^(C-1)
  = (I + N)(I + N^2)(I + N^4)...(I + N^(2^(m-1))), 2^m >= C: 2 log2(C) batched matmuls
  of [C, C]. LAPACK's batched trsm (jax.scipy.linalg.solve_triangular on CPU) waits on
  the host thread pool from inside it, which deadlocked XLA:CPU with several (fake)
  devices running the scan at once (jax 0.10.2); matmuls also suit TPU's matrix units."""
  chunk = a_XxCxC.shape[-1]
  power = -a_XxCxC
  inverse = jnp.broadcast_to(jnp.eye(chunk, dtype=a_XxCxC.dtype), power.shape) + power
  span = 2
  while span < chunk:
    power = _einsum("...ij,...jk->...ik", power, power)
    inverse = inverse + _einsum("...ij,...jk->...ik", inverse, power)
    span *= 2
  return inverse


def _chunk_step(state_BxHxRxKxV, x):
  """One chunk of C tokens: the UT transform, the outputs and the carried-out state.

  With G the in-chunk cumulative log decay, restricted to pairs j <= i of one sequence
  (no reset between them): A_ij = beta_i k_i.k_j exp(G_i - G_j) for j < i, and
  T = I + A. Then u = T^-1 (beta v) and w = T^-1 (beta k exp(G)) (w only for tokens
  before the chunk's first reset, the ones that read the carried state S), and
    v_new = u - w S
    o_i = exp(G_i) q_i S + sum_{j <= i} q_i.k_j exp(G_i - G_j) v_new_j
    S' = exp(G_C) S + sum_j exp(G_C - G_j) k_j v_new_j^T
  where the exp(G) S terms drop for tokens after a reset (S' too if the chunk holds
  one), and the sum in S' covers only the chunk's last sequence.
  """
  q_BxCxHxK, k_BxCxHxK, v_BxCxHxRxV, g_BxCxHxR, beta_BxCxHxR, reset_BxC = x
  chunk = q_BxCxHxK.shape[1]
  run_BxC = jnp.cumsum(reset_BxC.astype(jnp.int32), axis=1)  # resets so far in the chunk
  i_Cx1 = jnp.arange(chunk)[:, None]
  j_1xC = jnp.arange(chunk)[None]
  same_BxCxC = run_BxC[:, :, None] == run_BxC[:, None, :]
  causal_BxCxC = same_BxCxC & (i_Cx1 >= j_1xC)[None]
  strict_BxCxC = same_BxCxC & (i_Cx1 > j_1xC)[None]
  reads_state_BxC = run_BxC == 0

  cum_BxHxRxC = jnp.cumsum(jnp.moveaxis(g_BxCxHxR, 1, -1), axis=-1)
  beta_BxHxRxC = jnp.moveaxis(beta_BxCxHxR, 1, -1)
  # Mask before exp: the hidden pairs have G_i - G_j > 0, which could overflow.
  log_decay = cum_BxHxRxC[..., :, None] - cum_BxHxRxC[..., None, :]
  decay_BxHxRxCxC = jnp.exp(jnp.where(causal_BxCxC[:, None, None], log_decay, -jnp.inf))
  kk_BxHxCxC = _einsum("bihd,bjhd->bhij", k_BxCxHxK, k_BxCxHxK)
  qk_BxHxCxC = _einsum("bihd,bjhd->bhij", q_BxCxHxK, k_BxCxHxK)
  a_BxHxRxCxC = jnp.where(strict_BxCxC[:, None, None],
                          kk_BxHxCxC[:, :, None] * decay_BxHxRxCxC * beta_BxHxRxC[..., None],
                          0.0)

  decay_in_BxHxRxC = jnp.exp(cum_BxHxRxC) * reads_state_BxC[:, None, None]
  v_beta = jnp.moveaxis(v_BxCxHxRxV, 1, 3) * beta_BxHxRxC[..., None]
  k_BxHx1xCxK = jnp.moveaxis(k_BxCxHxK, 1, 2)[:, :, None]
  k_decay = k_BxHx1xCxK * (beta_BxHxRxC * decay_in_BxHxRxC)[..., None]
  dv = v_beta.shape[-1]
  # One solve for both right-hand sides: (I + A)^-1 by products (`_unit_lower_inverse`).
  uw = _einsum("bhrij,bhrje->bhrie", _unit_lower_inverse(a_BxHxRxCxC),
               jnp.concatenate([v_beta, k_decay], axis=-1))
  u_BxHxRxCxV, w_BxHxRxCxK = uw[..., :dv], uw[..., dv:]
  v_new_BxHxRxCxV = u_BxHxRxCxV - _einsum("bhrid,bhrde->bhrie", w_BxHxRxCxK,
                                          state_BxHxRxKxV)

  out = (_einsum("bihd,bhri,bhrde->bhrie", q_BxCxHxK, decay_in_BxHxRxC, state_BxHxRxKxV)
         + _einsum("bhrij,bhrje->bhrie", qk_BxHxCxC[:, :, None] * decay_BxHxRxCxC,
                   v_new_BxHxRxCxV))

  state = carried_state(state_BxHxRxKxV, k_BxCxHxK, v_new_BxHxRxCxV, cum_BxHxRxC, run_BxC)
  return state, jnp.moveaxis(out, 3, 1)


def carried_state(state_BxHxRxKxV, k_BxCxHxK, v_BxHxRxCxV, cum_BxHxRxC, run_BxC):
  """The state a chunk hands on: exp(G_C) S + sum_j exp(G_C - G_j) k_j v_j^T over the
  chunk's last sequence (G the in-chunk cumulative log decay, `run` the resets so far);
  S drops when the chunk holds a reset."""
  last_BxC = run_BxC == run_BxC[:, -1:]
  decay_out_BxHxRxC = (jnp.exp(cum_BxHxRxC[..., -1:] - cum_BxHxRxC)
                       * last_BxC[:, None, None])
  keep_Bx1x1 = (run_BxC[:, -1:] == 0)[:, :, None]
  chunk_decay_BxHxR = jnp.where(keep_Bx1x1, jnp.exp(cum_BxHxRxC[..., -1]), 0.0)
  return (state_BxHxRxKxV * chunk_decay_BxHxR[..., None, None]
          + _einsum("bjhd,bhrj,bhrje->bhrde", k_BxCxHxK, decay_out_BxHxRxC, v_BxHxRxCxV))


def _to_chunks(x, chunk):
  """[b, n*chunk, ...] -> [n, b, chunk, ...] after zero-padding the length."""
  pad = (-x.shape[1]) % chunk
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(x.shape[:1] + (x.shape[1] // chunk, chunk) + x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                     scale: float | None = None, qk_l2norm: bool = True,
                     chunk_size: int = DEFAULT_CHUNK_SIZE,
                     return_final_state: bool = False):
  """The gated delta rule over whole sequences, chunk by chunk.

  Args:
    q, k: [batch, T, key_heads, Dk].
    v: [batch, T, value_heads, Dv]; value_heads a multiple r of key_heads, key head h
      serving value heads h*r .. h*r+r-1.
    g: [batch, T, value_heads], the log decay (<= 0).
    beta: [batch, T, value_heads], the write strength (usually in (0, 1)).
    segment_ids: int [batch, T] or None (all ones); see the module docstring.
    initial_state: [batch, value_heads, Dk, Dv] (any float dtype) or None (zeros).
    scale: multiplies q after normalisation; default Dk ** -0.5.
    qk_l2norm: L2-normalise q and k over Dk (in f32) first.
    chunk_size: tokens per chunk (T need not be a multiple); T == 1 runs the reference.
    return_final_state: also return the state after each row's last non-padding token.

  Returns:
    out [batch, T, value_heads, Dv] in v's dtype (computed in f32; 0 at padding), and
    with return_final_state the final state [batch, value_heads, Dk, Dv] f32.
    Differentiable in q, k, v, g, beta and initial_state.
  """
  _check_delta_rule_inputs(q, k, v, g, beta, segment_ids, initial_state, scale)
  _check_int("chunk_size", chunk_size, 1)
  length = q.shape[1]
  if length == 1:
    return gated_delta_rule_reference(
        q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state,
        scale=scale, qk_l2norm=qk_l2norm, return_final_state=return_final_state)
  chunk = min(int(chunk_size), length)
  x, state = _prepare(q, k, v, g, beta, segment_ids, initial_state, scale, qk_l2norm)
  # Padded tokens are zeros with no reset: transparent, like segment id 0.
  xs = tuple(_to_chunks(x[name], chunk) for name in ("q", "k", "v", "g", "beta", "reset"))
  step = jax.checkpoint(_chunk_step, prevent_cse=False)
  state, out_NxBxCxHxRxV = jax.lax.scan(step, state, xs)
  out = jnp.moveaxis(out_NxBxCxHxRxV, 0, 1)
  out = out.reshape((out.shape[0], -1) + out.shape[3:])[:, :length]
  return _finish(out, state, v, return_final_state)


def _check_conv_inputs(x, w, bias, segment_ids, initial_state, activation):
  if x.ndim != 3:
    raise ValueError(f"x must be [batch, T, channels], got shape {x.shape}")
  batch, length, channels = x.shape
  if w.ndim != 2 or w.shape[0] != channels or w.shape[1] < 1:
    raise ValueError(f"w must be [channels, width] = [{channels}, >= 1], got shape "
                     f"{w.shape}")
  if bias is not None and tuple(bias.shape) != (channels,):
    raise ValueError(f"bias must be [channels] = [{channels}], got shape "
                     f"{tuple(bias.shape)}")
  _check_segment_ids(segment_ids, batch, length)
  history = w.shape[1] - 1
  if initial_state is not None and tuple(initial_state.shape) != (batch, history,
                                                                   channels):
    raise ValueError(f"initial_state must be [batch, width - 1, channels] = "
                     f"{(batch, history, channels)}, got shape "
                     f"{tuple(initial_state.shape)}")
  if activation not in ("silu", None):
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def causal_conv1d(x, w, *, bias=None, segment_ids=None, initial_state=None,
                  activation="silu", return_final_state: bool = False):
  """Depthwise causal convolution over time, padding skipped, restarting per sequence.

    out_t = act(sum_j w[:, j] * x_{t-K+1+j} + bias)

  where x_{t-s} is the s-th non-padding input before t of t's sequence (zeros before
  the sequence starts; the row's first sequence reads initial_state there instead).

  Args:
    x: [batch, T, channels].
    w: [channels, K], torch's conv1d weight [channels, 1, K] squeezed.
    bias: [channels] or None (Mamba2's conv1d has one; Gated DeltaNet's none).
    segment_ids: int [batch, T] or None (all ones); see the module docstring.
    initial_state: [batch, K-1, channels], the K-1 inputs before x, or None (zeros).
    activation: "silu" or None.
    return_final_state: also return the K-1 inputs a next token of the row's last
      sequence would see.

  Returns:
    out [batch, T, channels] in x's dtype (computed in f32; 0 at padding), and with
    return_final_state the state [batch, K-1, channels] in x's dtype: the last K-1
    non-padding inputs of the row's last sequence, oldest first (zeros before that
    sequence's start, or initial_state entries shifted in if it is the row's first).
  """
  _check_conv_inputs(x, w, bias, segment_ids, initial_state, activation)
  # Rematerialised: the backward pass keeps the inputs alone and rebuilds what it needs.
  conv = jax.checkpoint(_causal_conv1d, static_argnums=(5, 6), prevent_cse=False)
  return conv(x, w, bias, segment_ids, initial_state, activation, bool(return_final_state))


def _shifted(a, s: int, fill):
  """a[:, n - s] along axis 1, `fill` where n < s (s < 0: a[:, n + |s|], `fill` past
  the end): one pad, which fuses into its consumer."""
  config = [(0, 0, 0)] * a.ndim
  config[1] = (s, -s, 0)
  return jax.lax.pad(a, jnp.asarray(fill, a.dtype), config)


@jax.custom_vjp
def _packed_conv(packed_BxLxC, run_BxL, w_CxK):
  """The causal convolution over a row's valid inputs packed to its left: float32
  [B, L, C], slot n = sum_s w[:, K-1-s] packed[n - s], a slot of another sequence (run)
  or before the row's start reading zero. Its own backward sums the K shifts' gradients
  in float32 and casts them once to packed's dtype, with no float32 copy of packed."""
  width = w_CxK.shape[1]
  y_BxLxC = jnp.zeros(packed_BxLxC.shape, jnp.float32)
  for s in range(width):
    same_BxL = _shifted(run_BxL, s, -1) == run_BxL
    y_BxLxC = y_BxLxC + jnp.where(same_BxL[..., None],
                                  _shifted(packed_BxLxC, s, 0).astype(jnp.float32),
                                  0.0) * w_CxK[None, None, :, width - 1 - s]
  return y_BxLxC


def _packed_conv_fwd(packed_BxLxC, run_BxL, w_CxK):
  return _packed_conv(packed_BxLxC, run_BxL, w_CxK), (packed_BxLxC, run_BxL, w_CxK)


def _packed_conv_bwd(residuals, dy_BxLxC):
  packed_BxLxC, run_BxL, w_CxK = residuals
  width = w_CxK.shape[1]
  dy_BxLxC = dy_BxLxC.astype(jnp.float32)
  d_packed = jnp.zeros(packed_BxLxC.shape, jnp.float32)
  dw = []
  for s in range(width):
    same_BxL = _shifted(run_BxL, s, -1) == run_BxL
    g_BxLxC = jnp.where(same_BxL[..., None], dy_BxLxC, 0.0)
    # Slot n read slot n - s: its gradient goes back s slots.
    d_packed = d_packed + _shifted(g_BxLxC, -s, 0.0) * w_CxK[None, None, :, width - 1 - s]
    dw.append(jnp.einsum("BLC,BLC->C", g_BxLxC,
                         _shifted(packed_BxLxC, s, 0).astype(jnp.float32)))
  dw_CxK = jnp.stack(dw[::-1], axis=1)
  return d_packed.astype(packed_BxLxC.dtype), None, dw_CxK.astype(w_CxK.dtype)


_packed_conv.defvjp(_packed_conv_fwd, _packed_conv_bwd)


def _causal_conv1d(x, w, bias, segment_ids, initial_state, activation, return_final_state):
  batch, length, channels = x.shape
  width = w.shape[1]
  history = width - 1
  if initial_state is None:
    initial_state = jnp.zeros((batch, history, channels), x.dtype)
  # L = history + T, in x's dtype (or the state's, if wider).
  x_BxLxC = jnp.concatenate([initial_state, x], axis=1)
  total = history + length
  w_CxK = w.astype(jnp.float32)
  if segment_ids is None:  # one sequence a row, the state before it: nothing to pack
    y_BxTxC = _packed_conv(x_BxLxC, jnp.zeros((batch, total), jnp.int32),
                           w_CxK)[:, history:]
    if bias is not None:
      y_BxTxC = y_BxTxC + bias.astype(jnp.float32)[None, None]
    if activation == "silu":
      y_BxTxC = jax.nn.silu(y_BxTxC)
    out = y_BxTxC.astype(x.dtype)
    if not return_final_state:
      return out
    return out, x_BxLxC[:, length:].astype(x.dtype)
  # With segment ids the valid inputs are first packed to the left of each row (one
  # gather, in x's dtype): there each token's window is the K-1 slots before its own,
  # zero where a slot is of an earlier sequence; one gather takes the outputs back. Four
  # float32 windows gathered per token instead were 4 x 4 bytes a channel and token, all
  # live at once (1.3 GiB a chip in a Qwen3.5-27B layer at 16k tokens).
  valid_BxT, reset_BxT = segment_resets(segment_ids, batch, length)
  # The initial state is the first history inputs, valid and of the first sequence.
  valid_BxL = jnp.concatenate([jnp.ones((batch, history), jnp.bool_), valid_BxT], 1)
  run_BxL = jnp.concatenate([jnp.zeros((batch, history), jnp.int32),
                             jnp.cumsum(reset_BxT.astype(jnp.int32), axis=1)], 1)
  count_BxL = jnp.cumsum(valid_BxL.astype(jnp.int32), axis=1)
  # position_BxL[n] = where the n-th (0-based) valid input of the row sits (0 past the
  # last: those slots are never read as another slot's window).
  slot_BxL = jnp.where(valid_BxL, count_BxL - 1, total)
  rows_Bx1 = jnp.arange(batch)[:, None]
  position_BxL = jnp.zeros((batch, total), jnp.int32).at[rows_Bx1, slot_BxL].set(
      jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (batch, total)), mode="drop")
  packed_BxLxC = jnp.take_along_axis(x_BxLxC, position_BxL[..., None], axis=1)
  run_packed_BxL = jnp.take_along_axis(run_BxL, position_BxL, axis=1)
  y_BxLxC = _packed_conv(packed_BxLxC, run_packed_BxL, w_CxK)
  if bias is not None:
    y_BxLxC = y_BxLxC + bias.astype(jnp.float32)[None, None]
  if activation == "silu":
    y_BxLxC = jax.nn.silu(y_BxLxC)
  count_BxT = count_BxL[:, history:]
  out = jnp.take_along_axis(y_BxLxC.astype(x.dtype), (count_BxT - 1)[..., None], axis=1)
  out = jnp.where(valid_BxT[..., None], out, jnp.zeros((), x.dtype))
  if not return_final_state:
    return out
  if not history:
    return out, x_BxLxC[:, total:].astype(x.dtype)
  # The last K-1 valid inputs of the row's last sequence, oldest first; zeros for slots
  # before that sequence's start.
  wanted_BxH = count_BxL[:, -1:] - jnp.arange(history, 0, -1, dtype=jnp.int32)[None]
  n_BxH = jnp.maximum(wanted_BxH, 0)
  keep_BxH = (wanted_BxH >= 0) & (
      jnp.take_along_axis(run_packed_BxL, n_BxH, axis=1) == run_BxL[:, -1:])
  state_BxHxC = jnp.take_along_axis(packed_BxLxC, n_BxH[..., None], axis=1)
  return out, jnp.where(keep_BxH[..., None], state_BxHxC, 0).astype(x.dtype)
