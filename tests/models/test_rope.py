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
  with pytest.raises(ValueError, match=r"rope tables must be \[\.\.\., 4\]"):
    rope.apply_rope(x, full, full)
