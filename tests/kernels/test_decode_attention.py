"""decode_attention against the reference on each row's cached prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels


def _case(b=3, s=17, kvh=2, h=6, d=8, t=1, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, h, d))
  k = jax.random.normal(ks[1], (b, s, kvh, d))
  v = jax.random.normal(ks[2], (b, s, kvh, d))
  return q, k, v


@pytest.mark.parametrize("t", [1, 3])
def test_matches_reference_on_each_prefix(t):
  q, k, v = _case(t=t)
  lengths = jnp.array([5, 17, 9])
  # Garbage past each row's length must not matter.
  k = k.at[0, 5:].set(1e4)
  v = v.at[2, 9:].set(jnp.nan)
  out = kernels.decode_attention(q, k, v, lengths=lengths)
  for i, n in enumerate(lengths.tolist()):
    want = kernels.reference_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=True)
    np.testing.assert_allclose(out[i:i + 1], want, atol=1e-5)


def test_int8_cache_within_tolerance():
  q, k, v = _case()
  lengths = jnp.array([4, 17, 11])
  k8, ks = kernels.quantize_int8(k)
  v8, vs = kernels.quantize_int8(v)
  out = kernels.decode_attention(q, k8, v8, lengths=lengths, k_scale=ks, v_scale=vs)
  want = kernels.decode_attention(q, k, v, lengths=lengths)
  # Per-slot symmetric int8: relative error ~ 1/254 per element.
  assert float(jnp.max(jnp.abs(out - want))) < 0.03


def test_bad_shapes_name_the_argument():
  q, k, v = _case()
  with pytest.raises(ValueError, match="lengths"):
    kernels.decode_attention(q, k, v, lengths=jnp.array([1, 2]))
  with pytest.raises(ValueError, match="k_scale"):
    kernels.decode_attention(q, k.astype(jnp.int8), v.astype(jnp.int8), lengths=jnp.ones(3))
