"""kernels.grouped_matmul: forward and gradients against numpy per group, the TPU weight-
gradient kernel in interpret mode, its schedule inside shard_map, and its TPU compile."""

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kernels
from tests.tpu_aot import compile_for, requires_libtpu, spec, tpu_mesh

# The module: `kernels.grouped_matmul` is the function of the same name.
gm = importlib.import_module("kernels.grouped_matmul")


def _sizes(rng, m, g, empty=()):
  """Random group sizes summing to m, the groups in `empty` given no rows."""
  cuts = np.sort(rng.integers(0, m + 1, g - 1))
  sizes = np.diff(np.r_[0, cuts, m]).astype(np.int32)
  for e in empty:
    nxt = (e + 1) % g
    sizes[nxt] += sizes[e]
    sizes[e] = 0
  return sizes


def _per_group(x, g, sizes):
  off = np.r_[0, np.cumsum(sizes)]
  return np.stack([np.asarray(x, np.float64)[off[e]:off[e + 1]].T
                   @ np.asarray(g, np.float64)[off[e]:off[e + 1]] for e in range(len(sizes))])


@pytest.mark.parametrize("m,k,n,groups,empty", [
    (256, 48, 40, 5, (0, 3)),    # groups cut 128-row tiles anywhere; two empty
    (512, 640, 130, 3, ()),      # K split into 128 blocks, N whole
    (1024, 256, 384, 9, (8,)),   # the last group empty
    (384, 32, 128, 4, (1, 2, 3)),  # every row in one group
    (256, 1440, 2880, 3, ()),    # gpt-oss's widths: no 128-multiple divides them, blocks
                                 # of 512 reach past the array's edge
])
@pytest.mark.parametrize("backend", ["tpu", "cpu"])
def test_weight_gradient_sums_each_groups_rows(m, k, n, groups, empty, backend):
  rng = np.random.default_rng(m + k)
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
  sizes = _sizes(rng, m, groups, empty)
  w = jnp.zeros((groups, k, n), jnp.float32)
  got = jax.jit(functools.partial(kernels.grouped_weight_grad, backend=backend))(
      x, g, jnp.asarray(sizes), w)
  np.testing.assert_allclose(got, _per_group(x, g, sizes), atol=1e-4, rtol=1e-5)


def test_blocks_stay_bounded_when_no_tile_divides():
  """A long dim no tile divides gets blocks that pad it by at most an eighth, not the
  whole dim (whose float32 accumulator overflowed a v5p core's VMEM at gpt-oss's
  widths); a short one stays whole."""
  from kernels.grouped_matmul import _tile
  assert [_tile(d) for d in (1024, 640, 130, 96, 1000, 1440, 2880, 4100)] == [
      512, 128, 130, 96, 1000, 512, 512, 512]


def test_bfloat16_weight_gradient_accumulates_in_float32():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(512, 128)), jnp.bfloat16)
  g = jnp.asarray(rng.normal(size=(512, 128)), jnp.bfloat16)
  sizes = _sizes(rng, 512, 3)
  got = kernels.grouped_weight_grad(x, g, jnp.asarray(sizes), jnp.zeros((3, 128, 128),
                                                                       jnp.bfloat16),
                                    backend="tpu")
  assert got.dtype == jnp.bfloat16
  want = _per_group(x.astype(jnp.float32), g.astype(jnp.float32), sizes)
  np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=2e-2, atol=0.3)


def test_schedule_visits_every_row_once_and_each_group_in_order():
  rng = np.random.default_rng(5)
  visits = jax.jit(gm._visits, static_argnums=(1, 2))  # one program, not one per op
  for m, tm, groups in [(1024, 128, 16), (512, 256, 7), (256, 128, 40)]:
    sizes = _sizes(rng, m, groups, empty=(0, groups - 1))
    offsets, group, tile, real = (np.asarray(a) for a in visits(jnp.asarray(sizes), m, tm))
    assert len(group) == m // tm + groups and real[0] <= len(group)
    assert (np.diff(group) >= 0).all() and set(group[:real[0]]) == set(range(groups))
    counts = np.zeros(m, int)
    for i in range(real[0]):
      rows = np.arange(tile[i] * tm, tile[i] * tm + tm)
      counts[rows[(rows >= offsets[group[i]]) & (rows < offsets[group[i] + 1])]] += 1
    assert (counts == 1).all()
    assert (group[real[0]:] == groups - 1).all()  # padding steps add to the last group


def test_row_tile_follows_the_rows_per_group():
  assert gm.row_tile(8192, 128) == 128   # 64 rows an expert: small tiles waste less
  assert gm.row_tile(8192, 8) == 512
  assert gm.row_tile(8192, 32) == 256
  assert gm.row_tile(4096 + 64, 8) is None  # no tile divides: the ragged_dot transpose


def _dense(x, w, sizes):
  """Each row times its group's matrix, by a one-hot selection of w (a plain einsum)."""
  owner = jnp.repeat(jnp.arange(w.shape[0]), sizes, total_repeat_length=x.shape[0])
  return jnp.einsum("MK,MG,GKN->MN", x, jax.nn.one_hot(owner, w.shape[0]), w)


@pytest.mark.parametrize("backend,transpose_rhs", [("tpu", False), ("cpu", False),
                                                   ("tpu", True), ("cpu", True)])
def test_grouped_matmul_and_its_gradients_equal_the_dense_product(monkeypatch, backend,
                                                                  transpose_rhs):
  """And with `transpose_rhs` (w [G, N, K]), against the dense product of w transposed."""
  monkeypatch.setattr(gm, "grouped_weight_grad",
                      functools.partial(gm.grouped_weight_grad, backend=backend))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(256, 24)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 16, 24) if transpose_rhs else (6, 24, 16)), jnp.float32)
  sizes = jnp.asarray(_sizes(rng, 256, 6, empty=(2,)))

  def ours(x, w, sizes):
    return kernels.grouped_matmul(x, w, sizes, None, transpose_rhs)

  def dense(x, w, sizes):
    return _dense(x, w.swapaxes(1, 2) if transpose_rhs else w, sizes)

  np.testing.assert_allclose(ours(x, w, sizes), dense(x, w, sizes), atol=1e-4)

  def loss(fn):
    return lambda x, w: jnp.sum(jnp.sin(fn(x, w, sizes)))

  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, w)
  want = jax.grad(loss(dense), argnums=(0, 1))(x, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  assert float(jnp.abs(got[1][2]).max()) == 0.0  # the empty group's matrix gets nothing


def test_tpu_path_inside_shard_map_sums_the_devices_gradients(monkeypatch):
  """Inside shard_map each device's weight gradient covers its own rows; the kernel's
  result is summed over the devices the weights are replicated on. Interpret mode cannot
  run under shard_map(check_vma=True), so the kernel is replaced by the same schedule in
  plain jnp (the kernel itself is checked against it above)."""
  def schedule_in_jnp(x, g, sizes, out_dtype, tm, interpret):
    offsets, group, tile, real = gm._visits(sizes, x.shape[0], tm)
    out = jnp.zeros((sizes.shape[0], x.shape[1], g.shape[1]), jnp.float32)
    out = jax.lax.pcast(out, tuple(sorted(gm._vma(x))), to="varying")
    for i in range(group.shape[0]):
      rows = tile[i] * tm + jnp.arange(tm)[:, None]
      keep = (rows >= offsets[group[i]]) & (rows < offsets[group[i] + 1]) & (i < real[0])
      xt = jnp.where(keep, jax.lax.dynamic_slice_in_dim(x, tile[i] * tm, tm), 0.0)
      gt = jnp.where(keep, jax.lax.dynamic_slice_in_dim(g, tile[i] * tm, tm), 0.0)
      out = out.at[group[i]].add(xt.T @ gt)
    return out.astype(out_dtype)

  monkeypatch.setattr(gm, "_weight_grad_tpu", schedule_in_jnp)
  monkeypatch.setattr(gm, "grouped_weight_grad",
                      functools.partial(gm.grouped_weight_grad, backend="tpu"))
  rng = np.random.default_rng(2)
  mesh = jax.make_mesh((4,), ("rows",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jnp.asarray(rng.normal(size=(4 * 256, 24)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(5, 24, 16)), jnp.float32)
  sizes = jnp.asarray(np.stack([_sizes(rng, 256, 5, empty=(i,)) for i in range(4)]))

  def loss(x, w, sizes):
    def local(x, w, sizes):
      return jnp.sum(jnp.sin(kernels.grouped_matmul(x, w, sizes[0])))[None]
    per_device = jax.shard_map(local, mesh=mesh, in_specs=(P("rows"), P(), P("rows")),
                               out_specs=P("rows"))(x, w, sizes)
    return jnp.sum(per_device)

  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jax.device_put(x, P("rows")), w, jax.device_put(sizes, P("rows")))
  want_x, want_w = [], 0.0
  for i in range(4):
    part = x[i * 256:(i + 1) * 256]
    gx, gw = jax.grad(lambda a, b: jnp.sum(jnp.sin(_dense(a, b, sizes[i]))),
                      argnums=(0, 1))(part, w)
    want_x.append(gx)
    want_w = want_w + gw
  np.testing.assert_allclose(got[0], jnp.concatenate(want_x), atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(got[1], want_w, atol=1e-3, rtol=1e-4)


@requires_libtpu
def test_mixture_gradient_compiles_to_grouped_kernels_for_tpu():
  """For a TPU the forward and input gradients are XLA's grouped-matmul kernel and the
  weight gradients this module's Pallas kernel: no product over every expert's rows."""
  mesh = tpu_mesh("v5e", (2, 2), ("fsdp", "tensor"))
  e, m, k, n = 16, 2048, 256, 512

  def loss(x, w, sizes):
    def local(x, w, sizes):
      y = kernels.grouped_matmul(x, w, sizes[0], jnp.float32)
      return jax.lax.psum(jnp.sum(y), ("fsdp", "tensor"))
    return jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), P(None, None, "tensor"),
                                                     P("fsdp")), out_specs=P())(x, w, sizes)

  compiled = compile_for(mesh, jax.grad(loss, argnums=(0, 1)),
                         spec(mesh, (2 * m, k), jnp.bfloat16, P("fsdp")),
                         spec(mesh, (e, k, n), jnp.bfloat16, P(None, None, "tensor")),
                         spec(mesh, (2, e), jnp.int32, P("fsdp")))
  text = compiled.as_text()
  assert "ragged-dot" in text
  kernels_called = re.findall(r"custom_call_target=\"tpu_custom_call\"", text)
  assert len(kernels_called) >= 3  # forward, input gradient, weight gradient
  assert not re.search(rf"\[{e},{m},", text)  # no [experts, rows, ...] dense expansion
