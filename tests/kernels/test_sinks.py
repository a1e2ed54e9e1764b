"""Attention sinks (gpt-oss): every kernel against the independent numpy oracle, forward
and gradients (the sinks' own included), and the hostile rows: a query with no visible key
attends to its sink alone (output 0, finite gradients)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from kernel_test_utils import assert_close, numpy_attention

import kernels

B, T, H, KVH, D = 2, 96, 4, 2, 16


def _inputs(dtype=jnp.float32, t=T):
  ks = jax.random.split(jax.random.key(3), 5)
  q = jax.random.normal(ks[0], (B, t, H, D)).astype(dtype)
  k = jax.random.normal(ks[1], (B, t, KVH, D)).astype(dtype)
  v = jax.random.normal(ks[2], (B, t, KVH, D)).astype(dtype)
  # Sinks from well below to well above the logits, so each one matters differently.
  sinks = jnp.array([-4.0, 0.0, 1.5, 4.0])
  seg = np.ones((B, t), np.int32)
  seg[0, :5] = 0  # leading padding: those queries see no key
  seg[1, 60:] = 2
  seg[1, 80:] = 0
  return q, k, v, sinks, jnp.asarray(seg)


IMPLEMENTATIONS = {
    "reference": dict(implementation="reference"),
    "chunked": dict(implementation="chunked", chunk_size=32),
    "flash_tpu": dict(implementation="pallas_tpu", block_q=128, block_kv=128, interpret=True),
    "flash_gpu": dict(implementation="pallas_gpu", interpret=True),
}
MASKS = {
    "causal": dict(causal=True),
    "window_cap_segments": dict(causal=True, sliding_window=24, logits_soft_cap=3.0,
                                segments=True),
    "bidirectional": dict(causal=False),
}


def _oracle_and_grads(q, k, v, sinks, dout, kw):
  """The numpy oracle's output, and the reference's gradients (autodiff of its plain
  softmax, checked against the oracle's forward here and in test_reference)."""
  out = numpy_attention(q, k, v, sinks=sinks, **kw)
  _, vjp = jax.vjp(lambda *a: kernels.reference_attention(*a[:3], sinks=a[3], **kw),
                   q, k, v, sinks)
  return out, vjp(dout)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_every_kernel_equals_the_oracle_with_sinks(impl, mask):
  q, k, v, sinks, seg = _inputs()
  kw = dict(MASKS[mask])
  if kw.pop("segments", False):
    kw.update(q_segment_ids=seg, kv_segment_ids=seg)
  dout = jax.random.normal(jax.random.key(9), q.shape)

  @jax.jit
  def run(q, k, v, sinks, dout):
    out, vjp = jax.vjp(lambda *a: kernels.dot_product_attention(
        *a[:3], sinks=a[3], **kw, **IMPLEMENTATIONS[impl]), q, k, v, sinks)
    return out, vjp(dout)

  out, grads = run(q, k, v, sinks, dout)
  want, want_grads = _oracle_and_grads(q, k, v, sinks, dout, kw)
  assert_close(out, want, 2e-5, "out")
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
    assert_close(g, w, 1e-4, name)
  # The sinks matter: without them the output differs, and every sink has a gradient.
  assert np.abs(np.asarray(out) - numpy_attention(q, k, v, **kw)).max() > 1e-2
  assert np.all(np.abs(np.asarray(grads[3])) > 1e-4)


def test_a_row_with_no_key_attends_to_its_sink_alone():
  """Padding queries: output 0 and lse = the sink, with finite gradients everywhere."""
  q, k, v, sinks, seg = _inputs()
  kw = dict(q_segment_ids=seg, kv_segment_ids=seg)
  out, lse = kernels.reference_attention(q, k, v, sinks=sinks, return_lse=True, **kw)
  np.testing.assert_array_equal(np.asarray(out[0, :5]), 0.0)
  np.testing.assert_allclose(np.asarray(lse[0, :5]), np.broadcast_to(sinks, (5, H)))
  for impl in ("chunked", "flash_tpu"):
    grads = jax.grad(lambda *a: jnp.sum(kernels.dot_product_attention(
        *a[:3], sinks=a[3], **kw, **IMPLEMENTATIONS[impl]) ** 2), argnums=(0, 1, 2, 3))(
            q, k, v, sinks)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads), impl


def test_bf16_flash_with_sinks_within_the_bf16_tolerance():
  q, k, v, sinks, _ = _inputs(jnp.bfloat16)
  out = kernels.dot_product_attention(q, k, v, sinks=sinks, **IMPLEMENTATIONS["flash_tpu"])
  assert out.dtype == jnp.bfloat16
  assert_close(out, numpy_attention(q, k, v, sinks=sinks), 3e-2)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_attention_with_sinks_split_over_heads(layout):
  """Sequence over 4 devices, heads over 2: the sinks split with the heads, their
  gradient summed over the ring."""
  q, k, v, sinks, _ = _inputs(t=64)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("seq", "heads"))
  dout = jax.random.normal(jax.random.key(9), q.shape)

  @jax.jit
  def run(q, k, v, sinks, dout):
    out, vjp = jax.vjp(lambda *a: kernels.ring_attention_sharded(
        *a[:3], sinks=a[3], mesh=mesh, axis_name="seq", head_axis="heads", layout=layout,
        block_kernel="chunked", chunk_size=8), q, k, v, sinks)
    return out, vjp(dout)

  out, grads = run(q, k, v, sinks, dout)
  want, want_grads = _oracle_and_grads(q, k, v, sinks, dout, dict(causal=True))
  assert_close(out, want, 2e-5, "out")
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
    assert_close(g, w, 1e-4, name)


@pytest.mark.parametrize("check_vma", [True, False])
def test_ring_attention_inside_a_users_shard_map(check_vma):
  """Called in one's own shard_map (replication checked or not), the sinks' gradient is
  the whole sequence's, counted once."""
  q, k, v, sinks, _ = _inputs(t=64)
  mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))

  def loss(q, k, v, sinks):
    local = functools.partial(kernels.ring_attention, axis_name="seq",
                              block_kernel="chunked", chunk_size=8)
    out = jax.shard_map(lambda q, k, v, s: local(q, k, v, sinks=s), mesh=mesh,
                        in_specs=(P(None, "seq"),) * 3 + (P(),), out_specs=P(None, "seq"),
                        check_vma=check_vma)(q, k, v, sinks)
    return jnp.sum(out * jnp.cos(out))

  got = jax.jit(jax.grad(loss, argnums=3))(q, k, v, sinks)
  want = jax.grad(lambda s: jnp.sum(
      (o := kernels.reference_attention(q, k, v, sinks=s)) * jnp.cos(o)))(sinks)
  assert_close(got, want, 1e-4, "dsinks")


@pytest.mark.parametrize("ring", [False, True])
def test_decode_and_paged_decode_with_sinks(ring):
  """The newest tokens of each row against its cache (contiguous, a sliding window's
  ring, or pages) equal the oracle on the row's prefix."""
  q, k, v, sinks, _ = _inputs(t=40)
  lengths = (13, 40)
  q_new = q[:, :2]
  window = 8 if ring else None
  want = np.concatenate([numpy_attention(q_new[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n],
                                         sinks=sinks, sliding_window=window)
                         for i, n in enumerate(lengths)])
  if ring:  # 16 slots: position p in slot p % 16
    slots = 16
    idx = np.stack([np.array([n - 1 - ((n - 1 - s) % slots) for s in range(slots)])
                    for n in lengths]).clip(0)
    kc, vc = (jnp.take_along_axis(x, jnp.asarray(idx)[:, :, None, None], axis=1)
              for x in (k, v))
  else:
    kc, vc = k, v
  out = kernels.decode_attention(q_new, kc, vc, lengths=jnp.array(lengths), chunk_size=8,
                                 sinks=sinks, sliding_window=window, ring=ring)
  assert_close(out, want, 2e-5, "decode")
  if not ring:
    page_size, pages = 8, 5
    table = jnp.arange(B * pages).reshape(B, pages)
    k_pages, v_pages = (x.reshape(B * pages, page_size, KVH, D) for x in (k, v))
    for per_block in (1, 5):  # merged block by block, and one block
      paged = kernels.paged_decode_attention(q_new, k_pages, v_pages, page_table=table,
                                             lengths=jnp.array(lengths), sinks=sinks,
                                             pages_per_block=per_block)
      assert_close(paged, want, 2e-5, f"paged, {per_block} pages a block")


def test_bad_sinks_name_the_argument():
  q, k, v, _, _ = _inputs(t=16)
  for bad in (jnp.zeros((KVH,)), jnp.zeros((H, 1)), jnp.zeros((H,), jnp.int32)):
    with pytest.raises(ValueError, match=r"sinks must be float \[heads\] = \(4,\)"):
      kernels.dot_product_attention(q, k, v, sinks=bad, implementation="chunked")
  with pytest.raises(ValueError, match="sinks must be float"):
    kernels.decode_attention(q[:, :1], k, v, lengths=jnp.ones(B), sinks=jnp.zeros(3))
