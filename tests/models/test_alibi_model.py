"""ALiBi in the model (`ModelConfig.alibi`): its slopes, what the config refuses, and the
same logits through every attention implementation on a mesh (the slopes split with the
heads they belong to), with grouped keys and a LayerNorm on the embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models

CFG = models.get_preset("tiny").replace(
    vocab_size=263, d_model=48, num_heads=6, num_kv_heads=3, head_dim=8, ffn_dim=80,
    num_layers=2, tie_embeddings=False, qkv_bias=True, alibi=True, rope_layers=(0, 0),
    layer_norm=True, norm_bias=True, embed_norm=True, init_std=0.3)


def test_slopes_are_the_geometric_series_of_the_heads():
  """A power of two's 2^(-8 (h + 1) / n); six heads take eight's odd slopes, then its
  even ones; Falcon's scaled by 1 / sqrt(head_dim) with the logits."""
  four = CFG.replace(num_heads=4, num_kv_heads=2)
  np.testing.assert_allclose(four.alibi_slopes, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8])
  eight = [2.0 ** -(i + 1) for i in range(8)]
  np.testing.assert_allclose(CFG.alibi_slopes, eight[1::2] + eight[::2][:2])
  scaled = CFG.replace(alibi_scaled=True)
  np.testing.assert_allclose(scaled.alibi_slopes, np.array(CFG.alibi_slopes) / np.sqrt(8))
  assert CFG.replace(alibi=False, embed_norm=False).alibi_slopes is None


def test_config_refuses_what_alibi_cannot_hold():
  with pytest.raises(ValueError, match="needs rope_layers all 0"):
    CFG.replace(rope_layers=(1, 0))
  with pytest.raises(ValueError, match="alibi_scaled=True needs alibi=True"):
    CFG.replace(alibi=False, alibi_scaled=True)
  with pytest.raises(ValueError, match="alibi_bias_max must be a positive number"):
    CFG.replace(alibi_bias_max=0.0)


def test_embed_norm_has_parameters_of_its_own_unless_weightless():
  model = models.create_model(CFG, seed=0)
  assert model.embed_norm.scale[...].shape == (48,) and model.embed_norm.bias[...].shape == (48,)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == CFG.num_params


def _logits(model, tokens, mesh=None):
  if mesh is None:
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
  ctx = models.ShardingContext(mesh)
  return np.asarray(nnx.jit(lambda m, t: m(t, ctx=ctx))(model, tokens))


@pytest.fixture(scope="module")
def reference():
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 263, (2, 16)))
  return tokens, _logits(models.create_model(CFG, seed=1), tokens)


@pytest.mark.parametrize("impl,shape", [
    ("chunked", (1, 8, 1, 1)), ("ring", (1, 2, 1, 4)),
    # heads over tensor: each device's slopes are its own heads'
    ("flash", (1, 2, 3, 1)), ("flash", (2, 1, 1, 1))])
def test_attention_impls_match_reference(reference, impl, shape):
  tokens, want = reference
  mesh = models.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])
  model = models.create_model(CFG.replace(attention_impl=impl, attention_chunk=8),
                              mesh=mesh, seed=1)
  np.testing.assert_allclose(_logits(model, tokens, mesh), want, atol=2e-5)


def test_the_biases_change_the_logits(reference):
  """Without its biases (a NoPE model) the same weights compute other logits."""
  tokens, want = reference
  plain = models.create_model(CFG.replace(alibi=False), seed=1)
  assert np.abs(_logits(plain, tokens) - want).max() > 0.1 * np.abs(want).max()
