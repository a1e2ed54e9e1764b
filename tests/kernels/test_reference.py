"""reference.py against an independent numpy oracle; block primitive and lse merge."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_utils import CASES, Case, assert_close, make_inputs, numpy_attention

import kernels
from kernels import reference


# One compiled program per configuration instead of many eagerly dispatched ops.
reference_attention = jax.jit(kernels.reference_attention, static_argnames=(
    "causal", "sm_scale", "logits_soft_cap", "sliding_window", "return_lse"))

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_numpy(case):
  inputs = make_inputs(case)
  kw = case.mask_kwargs(inputs)
  out = reference_attention(inputs["q"], inputs["k"], inputs["v"], **kw)
  assert out.shape == inputs["q"].shape and out.dtype == jnp.float32
  assert_close(out, numpy_attention(inputs["q"], inputs["k"], inputs["v"], **kw), 1e-5)


def test_reference_bf16_returns_bf16_computed_in_f32():
  inputs = make_inputs(CASES[0], jnp.bfloat16)
  out = reference_attention(inputs["q"], inputs["k"], inputs["v"])
  assert out.dtype == jnp.bfloat16
  assert_close(out, numpy_attention(inputs["q"], inputs["k"], inputs["v"]), 1e-2)


def test_sm_scale_is_applied():
  inputs = make_inputs(Case("s", q_len=32, kv_len=32))
  out = reference_attention(inputs["q"], inputs["k"], inputs["v"], sm_scale=0.3)
  assert_close(out, numpy_attention(inputs["q"], inputs["k"], inputs["v"], sm_scale=0.3),
               1e-5)


def test_lse_and_fully_masked_rows():
  case = Case("seg", segments=True, q_len=64, kv_len=64)
  inputs = make_inputs(case)
  q, k, v = inputs["q"], inputs["k"], inputs["v"]
  kw = case.mask_kwargs(inputs)
  out, lse = reference_attention(q, k, v, return_lse=True, **kw)
  padded = np.asarray(inputs["q_seg"] == 0)
  assert padded.any()
  np.testing.assert_array_equal(np.asarray(out)[padded], 0.0)
  assert np.all(np.isneginf(np.asarray(lse)[padded]))
  # lse of the valid rows: log sum_j exp(s_ij) over visible keys, from numpy.
  kk = np.repeat(np.asarray(k, np.float64), 2, axis=2)
  s = np.einsum("bqhd,bkhd->bqhk", np.asarray(q, np.float64), kk) / np.sqrt(q.shape[-1])
  mask = np.asarray(reference.attention_mask(*reference.default_positions(64, 64),
                                             inputs["q_seg"], inputs["kv_seg"], causal=True))
  s = np.where(mask[:, :, None, :], s, -np.inf)
  with np.errstate(divide="ignore"):
    expected = np.log(np.exp(s).sum(-1))
  np.testing.assert_allclose(np.asarray(lse)[~padded], expected[~padded], rtol=1e-5)
  # Gradients through fully masked rows stay finite.
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      kernels.reference_attention(q, k, v, **kw) ** 2), (0, 1, 2)))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  np.testing.assert_array_equal(np.asarray(grads[0])[padded], 0.0)


def test_reference_gradients_match_naive_autodiff():
  case = Case("g", q_len=48, kv_len=80, heads=6, kv_heads=2, head_dim=8)
  inputs = make_inputs(case)
  q, k, v, dout = inputs["q"], inputs["k"], inputs["v"], inputs["dout"]

  def naive(q, k, v):
    kk, vv = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(8)
    s = 5.0 * jnp.tanh(s / 5.0)
    qp = jnp.arange(48)[:, None] + 32
    kp = jnp.arange(80)[None, :]
    s = jnp.where((qp >= kp) & (qp - kp < 20), s, -1e30)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), vv)

  kw = dict(logits_soft_cap=5.0, sliding_window=20)
  got = jax.jit(lambda *a: jax.vjp(
      lambda *a: kernels.reference_attention(*a, **kw), *a)[1](dout))(q, k, v)
  want = jax.jit(lambda *a: jax.vjp(naive, *a)[1](dout))(q, k, v)
  for name, g, w in zip("qkv", got, want):
    assert_close(g, w, 1e-5, "d" + name)


def test_merge_of_blocks_equals_full_attention():
  case = Case("m", q_len=64, kv_len=96, segments=True, logits_soft_cap=4.0)
  inputs = make_inputs(case)
  q, k, v = inputs["q"], inputs["k"], inputs["v"]
  q_pos, kv_pos = reference.default_positions(64, 96)
  kw = dict(causal=True, sm_scale=0.25, logits_soft_cap=4.0)

  @jax.jit
  def full_and_merged(q, k, v, q_seg, kv_seg):
    full = reference.attention_block(q, k, v, q_positions=q_pos, kv_positions=kv_pos,
                                     q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kw)
    parts = [reference.attention_block(
        q, k[:, sl], v[:, sl], q_positions=q_pos, kv_positions=kv_pos[:, sl],
        q_segment_ids=q_seg, kv_segment_ids=kv_seg[:, sl], **kw)
        for sl in (slice(0, 40), slice(40, 96))]
    return full, reference.merge_attention(*parts[0], *parts[1])

  full, (out, lse) = full_and_merged(q, k, v, inputs["q_seg"], inputs["kv_seg"])
  assert_close(out, full[0], 1e-5, "out")
  finite = np.isfinite(np.asarray(full[1]))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(full[1])[finite],
                             rtol=1e-5)


def test_merge_with_empty_parts():
  out = jnp.ones((1, 2, 1, 3))
  lse = jnp.array([[[0.5], [-jnp.inf]]])
  empty_out, empty_lse = jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf)
  merged, merged_lse = reference.merge_attention(out, lse, empty_out, empty_lse)
  np.testing.assert_array_equal(np.asarray(merged), [[[[1, 1, 1]], [[0, 0, 0]]]])
  np.testing.assert_array_equal(np.asarray(merged_lse), np.asarray(lse))


def test_block_grads_sum_to_full_gradient():
  case = Case("bg", q_len=64, kv_len=64, segments=True, sliding_window=30)
  inputs = make_inputs(case)
  q, k, v, dout = inputs["q"], inputs["k"], inputs["v"], inputs["dout"]
  q_seg, kv_seg = inputs["q_seg"], inputs["kv_seg"]
  q_pos, kv_pos = reference.default_positions(64, 64)

  @jax.jit
  def blockwise_and_autodiff(q, k, v, dout):
    attention = lambda q, k, v: kernels.reference_attention(
        q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, sliding_window=30)
    out, lse = kernels.reference_attention(q, k, v, q_segment_ids=q_seg,
                                           kv_segment_ids=kv_seg, sliding_window=30,
                                           return_lse=True)
    delta = jnp.sum(dout * out, -1)
    blocks = [reference.attention_block_grad(
        q, k[:, sl], v[:, sl], dout, lse, delta, q_positions=q_pos,
        kv_positions=kv_pos[:, sl], q_segment_ids=q_seg, kv_segment_ids=kv_seg[:, sl],
        causal=True, sm_scale=32 ** -0.5, sliding_window=30)
        for sl in (slice(0, 24), slice(24, 64))]
    got = (blocks[0][0] + blocks[1][0], jnp.concatenate([b[1] for b in blocks], 1),
           jnp.concatenate([b[2] for b in blocks], 1))
    return got, jax.vjp(attention, q, k, v)[1](dout)

  got, want = blockwise_and_autodiff(q, k, v, dout)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert_close(g, w, 1e-5, name)


BAD_INPUTS = [
    (dict(q=(2, 8, 4)), "q must be"),
    (dict(k=(2, 8, 2)), "k must be"),
    (dict(v=(2, 8, 2, 7)), "v must have"),
    (dict(k=(3, 8, 2, 8), v=(3, 8, 2, 8)), "k batch"),
    (dict(k=(2, 8, 2, 4), v=(2, 8, 2, 4)), "k head_dim"),
    (dict(k=(2, 8, 3, 8), v=(2, 8, 3, 8)), "q heads 4 must be a multiple of k kv_heads 3"),
]


@pytest.mark.parametrize("shapes,message", BAD_INPUTS)
def test_bad_shapes_raise_value_error_naming_argument(shapes, message):
  dims = dict(q=(2, 8, 4, 8), k=(2, 8, 2, 8), v=(2, 8, 2, 8)) | shapes
  args = [jnp.zeros(dims[n]) for n in "qkv"]
  with pytest.raises(ValueError, match=message):
    kernels.reference_attention(*args)


@pytest.mark.parametrize("kwargs,message", [
    (dict(q_segment_ids=jnp.ones((2, 8), jnp.int32)), "given together"),
    (dict(q_segment_ids=jnp.ones((2, 7), jnp.int32),
          kv_segment_ids=jnp.ones((2, 8), jnp.int32)), "q_segment_ids must be"),
    (dict(q_segment_ids=jnp.ones((2, 8), jnp.int32),
          kv_segment_ids=jnp.ones((8,), jnp.int32)), "kv_segment_ids must be"),
    (dict(sliding_window=0), "sliding_window must be a positive int, got 0"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap must be positive, got -1.0"),
    (dict(sm_scale=0.0), "sm_scale must be positive"),
])
def test_bad_options_raise_value_error(kwargs, message):
  q = jnp.zeros((2, 8, 4, 8))
  k = jnp.zeros((2, 8, 2, 8))
  with pytest.raises(ValueError, match=message):
    kernels.reference_attention(q, k, k, **kwargs)
