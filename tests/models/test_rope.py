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


def test_dynamic_tables_are_transformers_ntk_scaling():
  """Each packed sequence (and row) past the context of 16 turns at its own length's
  base, transformers' _compute_dynamic_ntk_parameters for that length; one within it
  (and padding) at the default frequencies."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters
  head_dim, theta, factor, original = 24, 5000.0, 4.0, 16
  hf = transformers.LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=head_dim,
                                max_position_embeddings=original,
                                rope_parameters={"rope_type": "dynamic", "factor": factor,
                                                 "rope_theta": theta})
  cfg = RopeConfig(theta=theta, type="dynamic", factor=factor)
  inv_freq, _ = rope.inverse_frequencies(cfg, head_dim, original)
  # a row of two packed sequences (lengths 20 and 10) and padding; a row of length 30
  positions = np.array([list(range(20)) + list(range(10)) + [0, 0],
                        list(range(30)) + [30, 31]], np.int32)[:, :32]
  segments = np.array([[1] * 20 + [2] * 10 + [0] * 2, [1] * 32], np.int32)
  cos, sin = rope.dynamic_tables(jnp.asarray(positions), jnp.asarray(segments), inv_freq,
                                 theta, head_dim, factor, original)

  def want(pos, length):
    freq = (np.asarray(_compute_dynamic_ntk_parameters(hf, seq_len=length)[0])
            if length > original else inv_freq)
    angle = np.float32(pos) * freq.astype(np.float32)
    return np.cos(angle), np.sin(angle)

  for row, (pos_row, seg_row) in enumerate(zip(positions, segments)):
    for t, (p, s) in enumerate(zip(pos_row, seg_row)):
      length = {0: 0, 1: 20 if row == 0 else 32, 2: 10}[int(s)]
      c, si = want(p, length)
      np.testing.assert_allclose(np.asarray(cos[row, t]), c, atol=2e-5, err_msg=(row, t))
      np.testing.assert_allclose(np.asarray(sin[row, t]), si, atol=2e-5, err_msg=(row, t))
  with pytest.raises(ValueError, match="dynamic rope needs a factor >= 1"):
    RopeConfig(type="dynamic", factor=0.5)
