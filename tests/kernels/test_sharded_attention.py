"""sharded_attention: a Pallas kernel run per shard under shard_map, on 8 fake devices."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kernels
from tests.kernels.kernel_test_utils import (
    TOLERANCES,
    Case,
    assert_close,
    f32_reference,
    make_inputs,
    value_and_vjp,
)


def _mesh(shape, names):
  return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])


def _interpret_flash(q, k, v, **kw):
  return kernels.flash_attention(q, k, v, interpret=True, **kw)


# (mesh shape, batch axis, head axis, heads, kv_heads): kv heads split with the queries,
# replicated and sliced per device (one or several kv heads a device), heads kept whole
# when a device's query heads would straddle two kv groups, and a tuple of batch axes.
LAYOUTS = [
    ((2, 4), "data", "tensor", 8, 4),
    ((2, 4), "data", "tensor", 8, 2),
    ((2, 4), "data", "tensor", 8, 1),
    ((1, 4), "data", "tensor", 12, 4),
    ((2, 2), ("data", "tensor"), None, 6, 3),
    ((2, 2), "data", "tensor", 6, 3),
]


@pytest.mark.parametrize("mesh_shape,batch_axis,head_axis,heads,kv_heads", LAYOUTS)
def test_sharded_flash_matches_reference(mesh_shape, batch_axis, head_axis, heads,
                                         kv_heads):
  mesh = _mesh(mesh_shape, ("data", "tensor"))
  case = Case("sharded", batch=4, q_len=128, kv_len=128, heads=heads, kv_heads=kv_heads,
              head_dim=16, segments=True)
  x = make_inputs(case, seed=3)
  kw = case.mask_kwargs(x)
  fn = functools.partial(kernels.sharded_attention, mesh=mesh, batch_axis=batch_axis,
                         head_axis=head_axis, attention=_interpret_flash)
  out, grads = value_and_vjp(fn, x, **kw)
  ref_out, ref_grads = f32_reference(x, **kw)
  fwd_tol, grad_tol = TOLERANCES[np.float32]
  assert_close(out, ref_out, fwd_tol, "out")
  for name, got, want in zip("dq dk dv".split(), grads, ref_grads):
    assert_close(got, want, grad_tol, name)


def test_each_device_runs_its_own_shard():
  """The kernel sees local shapes: batch / data and heads / tensor, k sliced to the kv
  heads of the device's query heads (MQA here: one kv head everywhere)."""
  mesh = _mesh((2, 4), ("data", "tensor"))
  seen = []

  def spy(q, k, v, **kw):
    seen.append((q.shape, k.shape))
    return kernels.reference_attention(q, k, v, **kw)

  x = make_inputs(Case("spy", batch=4, q_len=32, kv_len=32, heads=8, kv_heads=2))
  jax.jit(functools.partial(kernels.sharded_attention, mesh=mesh, batch_axis="data",
                            head_axis="tensor", attention=spy))(x["q"], x["k"], x["v"])
  assert seen == [((2, 32, 2, 32), (2, 32, 1, 32))]


def test_output_stays_sharded_like_q():
  mesh = _mesh((2, 4), ("data", "tensor"))
  x = make_inputs(Case("layout", batch=4, q_len=32, kv_len=32, heads=8, kv_heads=4))
  out = jax.jit(functools.partial(kernels.sharded_attention, mesh=mesh, batch_axis="data",
                                  head_axis="tensor"))(x["q"], x["k"], x["v"])
  assert out.sharding.is_equivalent_to(
      NamedSharding(mesh, P("data", None, "tensor", None)), out.ndim)


def test_one_device_mesh_calls_the_kernel_directly():
  x = make_inputs(Case("one", batch=1, q_len=32, kv_len=32, heads=2, kv_heads=1))
  out = kernels.sharded_attention(x["q"], x["k"], x["v"], mesh=_mesh((1,), ("data",)),
                                  batch_axis="data", attention=kernels.reference_attention)
  np.testing.assert_allclose(out, kernels.reference_attention(x["q"], x["k"], x["v"]))


@pytest.mark.parametrize("batch,heads,match", [
    (3, 8, "batch 3 is not divisible by the 'data' axes"),
    (4, 6, "heads 6 is not divisible by the 'tensor' axes"),
])
def test_shapes_the_mesh_cannot_split_are_refused(batch, heads, match):
  mesh = _mesh((2, 4), ("data", "tensor"))
  x = make_inputs(Case("bad", batch=batch, q_len=16, kv_len=16, heads=heads, kv_heads=2))
  with pytest.raises(ValueError, match=match):
    kernels.sharded_attention(x["q"], x["k"], x["v"], mesh=mesh, batch_axis="data",
                              head_axis="tensor")
