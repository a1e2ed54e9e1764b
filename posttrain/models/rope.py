"""Rotary position embeddings: default, linear, Llama 3, YaRN, LongRoPE and proportional
(Gemma 4) frequency schedules, over all of head_dim or its first part (partial rotary).

The frequency formulas follow the Hugging Face definitions so imported checkpoints see the
same rotations they were trained with. Rotation uses the "rotate half" layout (first and
second halves of the rotated features pair up), which is the layout of HF Llama/Qwen/Phi
weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                        long: bool = False) -> tuple[np.ndarray, float]:
  """Returns (inv_freq [rotary_dim // 2] float32, attention scaling of cos/sin); `long`:
  LongRoPE's long-context frequencies (its short ones otherwise)."""
  dim = rope.rotary_dim(head_dim)
  inv_freq = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  scaling = 1.0
  original = rope.original_max_position_embeddings or max_position_embeddings
  if rope.type == "longrope":
    # transformers: the factor defaults to max_position_embeddings / original (a config
    # read here states it), the attention factor to sqrt(1 + ln(factor) / ln(original)).
    factor = rope.factor
    scaling = (rope.attention_factor if rope.attention_factor is not None else
               1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
    ext = np.asarray(rope.long_factor if long else rope.short_factor, np.float32)
    inv_freq = 1.0 / (ext * rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  elif rope.type == "linear":
    inv_freq = inv_freq / rope.factor
  elif rope.type == "proportional":  # Gemma 4: the first pairs turn, the rest are still
    turning = int(rope.partial_rotary_factor * head_dim // 2)
    inv_freq = np.where(np.arange(dim // 2) < turning, inv_freq, 0.0) / rope.factor
  elif rope.type == "llama3":
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    span = rope.high_freq_factor - rope.low_freq_factor  # 0 (Llama 4): no medium band
    smooth = ((original / wavelen - rope.low_freq_factor) / span if span else
              np.zeros_like(wavelen))
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  elif rope.type == "yarn":
    factor = rope.factor

    def mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
      scaling = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
      scaling = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
      scaling = mscale(factor)

    def correction_dim(rotations):
      return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
  return inv_freq.astype(np.float32), float(scaling)


def rope_tables(positions_BxT: jnp.ndarray, inv_freq: np.ndarray,
                scaling: float) -> tuple[jnp.ndarray, jnp.ndarray]:
  """cos and sin [B, T, rotary_dim // 2] in float32 for integer positions [B, T].

  Rotate-half pairs dimension i with i + rotary_dim // 2 under the same frequency, so one
  half-width table serves both halves.
  """
  freqs = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
  return jnp.cos(freqs) * scaling, jnp.sin(freqs) * scaling


def longrope_tables(positions_BxT: jnp.ndarray, segment_ids_BxT: jnp.ndarray,
                    short: np.ndarray, long: np.ndarray, scaling: float,
                    original: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """LongRoPE's tables: a sequence (a row, or a packed segment of one) whose positions in
  this call reach `original` rotates every token of the call by the long frequencies,
  one that stays below it by the short ones. transformers' rule
  (max(position_ids) + 1 > original_max_position_embeddings) applied to each sequence
  alone, as it computes a batch of one: the result never depends on which other rows
  share the batch. Padding (segment id 0) takes the short tables.

  With a KV cache, a call's keys are written under that call's tables: a row that passes
  the original context while decoding keeps the keys of its earlier tokens as they were
  cached (short), as vLLM does; transformers' Phi-3 generate instead drops its cache
  there and recomputes every layer over the whole sequence with the long factors (what a
  forward over the whole row, as the train step runs it, gives)."""
  use_long = (_sequence_lengths(positions_BxT, segment_ids_BxT) > original) & (
      segment_ids_BxT > 0)
  cos_s, sin_s = rope_tables(positions_BxT, short, scaling)
  cos_l, sin_l = rope_tables(positions_BxT, long, scaling)
  pick = use_long[..., None]
  return jnp.where(pick, cos_l, cos_s), jnp.where(pick, sin_l, sin_s)


def dynamic_tables(positions_BxT: jnp.ndarray, segment_ids_BxT: jnp.ndarray,
                   inv_freq: np.ndarray, theta: float, dim: int, factor: float,
                   original: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Dynamic NTK scaling's tables (transformers' rope type "dynamic"): a sequence (a row,
  or a packed segment of one) whose positions in this call reach past `original` (the
  model's max_position_embeddings) turns every token at base
  theta * (factor L / original - (factor - 1))^(dim / (dim - 2)), L its length (its
  largest position + 1) in the call; one within it at the default frequencies
  `inv_freq`. transformers takes L over the whole batch it is given, and keeps the largest
  base it reached between calls until one stays within the original context: the same
  for a fresh model's batch of one. With a KV cache, a call's keys are written under that
  call's base, as transformers' generate writes them step by step; a prompt prefilled in
  chunks past the original context rotates each chunk by its own length."""
  length = _sequence_lengths(positions_BxT, segment_ids_BxT)
  scaled = (length > original) & (segment_ids_BxT > 0)
  ratio = factor * jnp.maximum(length, original).astype(jnp.float32) / original - (factor - 1)
  base = theta * ratio ** (dim / (dim - 2))
  exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  inv = 1.0 / base[..., None] ** exponents[None, None]  # [B, T, dim / 2]
  freqs = positions_BxT.astype(jnp.float32)[..., None] * inv
  cos_d, sin_d = rope_tables(positions_BxT, inv_freq, 1.0)
  pick = scaled[..., None]
  return jnp.where(pick, jnp.cos(freqs), cos_d), jnp.where(pick, jnp.sin(freqs), sin_d)


def _sequence_lengths(positions_BxT: jnp.ndarray, segment_ids_BxT: jnp.ndarray
                      ) -> jnp.ndarray:
  """[B, T] int: each token's sequence's length in this call, its largest position + 1
  (a sequence: a row, or a packed segment of one; padding, segment id 0, apart)."""
  b, t = positions_BxT.shape
  ids = jnp.where(segment_ids_BxT > 0, segment_ids_BxT, 0).astype(jnp.int32)
  ids = jnp.minimum(ids, t) + (t + 1) * jnp.arange(b, dtype=jnp.int32)[:, None]
  top = jax.ops.segment_max(positions_BxT.reshape(-1), ids.reshape(-1),
                            num_segments=b * (t + 1))
  return top[ids] + 1


def apply_rope(x_BxTxNxH: jnp.ndarray, cos_BxTxK: jnp.ndarray,
               sin_BxTxK: jnp.ndarray) -> jnp.ndarray:
  """Rotates q or k by the half-width tables of `rope_tables` (K = head_dim // 2).

      out[:K] = x[:K] cos - x[K:] sin,    out[K:] = x[K:] cos + x[:K] sin

  in float32, returned in x's dtype. Written on the two halves rather than as
  x cos + rotate_half(x) sin over full-width tables: the same values, and one fused
  pass fewer per call on XLA:CPU (about 2.5% of a GRPO train step). Tables narrower than
  head_dim // 2 (partial rotary) rotate the first 2K features and pass the rest.
  """
  head_dim, half = x_BxTxNxH.shape[-1], cos_BxTxK.shape[-1]
  if half < 1 or 2 * half > head_dim or sin_BxTxK.shape[-1] != half:
    raise ValueError(f"rope tables must be [..., K] with 2K <= head_dim {head_dim} (the "
                     f"rotated features), got {cos_BxTxK.shape} and {sin_BxTxK.shape}")
  x = x_BxTxNxH.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:2 * half]
  c, s = cos_BxTxK[:, :, None, :], sin_BxTxK[:, :, None, :]
  parts = [x1 * c - x2 * s, x2 * c + x1 * s]
  if 2 * half < head_dim:  # partial rotary: the rest of each head passes through
    parts.append(x[..., 2 * half:])
  out = jnp.concatenate(parts, axis=-1)
  return out.astype(x_BxTxNxH.dtype)
