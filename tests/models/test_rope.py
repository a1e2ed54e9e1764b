"""Rotary embeddings against the rotate-half definition (HF Llama/Qwen) in numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import rope
from posttrain.models.config import RopeConfig


def _numpy_rope(x, positions, inv_freq, scaling):
  freqs = positions[..., None].astype(np.float32) * inv_freq[None, None]
  emb = np.concatenate([freqs, freqs], axis=-1)
  cos, sin = np.cos(emb) * scaling, np.sin(emb) * scaling
  half = x.shape[-1] // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None] + rotated * sin[:, :, None]


@pytest.mark.parametrize("cfg", [RopeConfig(), RopeConfig(type="llama3", factor=8.0),
                                 RopeConfig(type="yarn", factor=4.0,
                                            original_max_position_embeddings=64)])
def test_apply_rope_matches_rotate_half(cfg):
  rng = np.random.default_rng(0)
  head_dim = 16
  x = rng.standard_normal((2, 7, 3, head_dim)).astype(np.float32)
  positions = np.stack([np.arange(7), np.arange(100, 107)]).astype(np.int32)
  inv_freq, scaling = rope.inverse_frequencies(cfg, head_dim, 128)
  cos, sin = rope.rope_tables(jnp.asarray(positions), inv_freq, scaling)
  assert cos.shape == sin.shape == (2, 7, head_dim // 2)
  got = rope.apply_rope(jnp.asarray(x), cos, sin)
  np.testing.assert_allclose(got, _numpy_rope(x, positions, inv_freq, scaling),
                             rtol=1e-5, atol=1e-5)
  # Norms are preserved up to the attention scaling, and the input dtype is kept.
  np.testing.assert_allclose(np.linalg.norm(got, axis=-1),
                             scaling * np.linalg.norm(x, axis=-1), rtol=1e-5)
  assert rope.apply_rope(jnp.asarray(x, jnp.bfloat16), cos, sin).dtype == jnp.bfloat16


def test_apply_rope_rejects_full_width_tables():
  x = jnp.zeros((1, 4, 2, 8))
  full = jnp.zeros((1, 4, 8))
  with pytest.raises(ValueError, match=r"2K <= head_dim 8 \(the rotated features\)"):
    rope.apply_rope(x, full, full)


def test_partial_rotary_rotates_the_first_features_and_passes_the_rest():
  """Tables for 6 of 16 features (partial_rotary_factor 0.375): rotate-half over those 6,
  as transformers' Phi-3 applies it; the other 10 come back unchanged."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
  cfg = RopeConfig(theta=100.0, partial_rotary_factor=0.375)
  inv_freq, scaling = rope.inverse_frequencies(cfg, 16, 64)
  assert inv_freq.shape == (3,)  # frequencies of the 6 rotated features
  np.testing.assert_allclose(inv_freq, 1.0 / 100.0 ** (np.arange(0, 6, 2) / 6), rtol=1e-6)
  positions = np.tile(np.arange(5), (2, 1))
  cos, sin = rope.rope_tables(jnp.asarray(positions), inv_freq, scaling)
  got = np.asarray(rope.apply_rope(jnp.asarray(x), cos, sin))
  ang = positions[..., None, None] * np.concatenate([inv_freq, inv_freq])  # [B, T, 1, 6]
  rot = x[..., :6]
  half = np.concatenate([-rot[..., 3:], rot[..., :3]], axis=-1)
  np.testing.assert_allclose(got[..., :6], rot * np.cos(ang) + half * np.sin(ang), atol=1e-5)
  np.testing.assert_array_equal(got[..., 6:], x[..., 6:])
