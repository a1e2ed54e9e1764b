"""Grouped matrix multiplication for mixtures of experts, differentiable in both operands.

    y = grouped_matmul(x, w, group_sizes)   # x [M, K], w [G, K, N], group_sizes [G]
    y = grouped_matmul(x, w_t, group_sizes, None, True)   # w_t [G, N, K]: x w_g^T

Rows of x come in G groups of consecutive rows (group_sizes sum to M); each group is
multiplied by its own matrix. The forward and the input gradient are `jax.lax.ragged_dot`
(XLA:TPU lowers it to a grouped-matmul kernel). The weight gradient, one [K, N] sum per
group, is `grouped_weight_grad`: on TPU a Pallas kernel that steps through the row tiles
group by group, at most M / tm + G tiles (XLA:TPU expands the transpose of `ragged_dot`
into a dense product over every group, G times the work); elsewhere that transpose.
Works inside `shard_map` (check_vma=True).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention import target_platform

TILES = (512, 256, 128)  # block sizes of the weight-gradient kernel, largest first


def row_tile(m: int, groups: int) -> int | None:
  """The weight-gradient kernel's row tile: the largest of TILES that divides M and
  is at most a group's mean rows (128 at least), or None when none divides M. A group
  ending mid-tile costs a tile more, so M / tm + G steps at most: large tiles pay off
  only when groups are long (128 experts over 8192 rows: 64 rows each, 128-row tiles,
  192 steps of 128 rows at most against 144 of 512)."""
  cap = max(128, m // max(groups, 1))
  return next((t for t in TILES if m % t == 0 and t <= cap), None)


def _vma(x) -> frozenset:
  """The shard_map axes x varies over (empty outside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _like_vma(value, like):
  """`value` with `like`'s varying manual axes (inside shard_map): summed over the axes
  only it varies over, marked varying over those only `like` does."""
  extra = tuple(sorted(_vma(value) - _vma(like)))
  if extra:
    value = lax.psum(value, extra)
  missing = tuple(sorted(_vma(like) - _vma(value)))
  return lax.pcast(value, missing, to="varying") if missing else value


def _tile(dim: int) -> int:
  """A block along K or N: the largest of TILES dividing it; else all of it up to twice
  the largest tile; else the largest tile that pads it by at most an eighth (the last
  block then reaches past the array: its extra rows and columns are read as padding and
  never written), so that no block grows with the dim (gpt-oss's 1440 x 2880 whole: a
  16 MiB float32 accumulator, past a v5p core's scoped VMEM)."""
  dividing = next((t for t in TILES if dim % t == 0), None)
  if dividing is not None or dim <= 2 * TILES[0]:
    return dividing or dim
  return next((t for t in TILES if -(-dim // t) * t - dim <= dim // 8), TILES[-1])


def _visits(group_sizes, m: int, tm: int):
  """The weight-gradient kernel's schedule: (row offsets [G+1], group of each step [V],
  row tile of each step [V], number of real steps [1]), V = M / tm + G a static bound.

  Each group visits the row tiles it overlaps, in order, and an empty group one tile (to
  write its zeros); steps past the real ones repeat the last group's last tile with
  nothing selected, so they add nothing and write nothing new."""
  g = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first = starts // tm
  last = jnp.where(sizes > 0, (ends - 1) // tm, first)
  visits = last - first + 1
  cum = jnp.cumsum(visits)
  steps = m // tm + g
  step = jnp.arange(steps, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(cum, step, side="right"), g - 1).astype(jnp.int32)
  tile = jnp.minimum(first[group] + step - (cum - visits)[group], last[group])
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  return offsets, group, tile.astype(jnp.int32), cum[-1:]


def _weight_grad_kernel(offsets, group, tile, real, x_ref, g_ref, out_ref, acc_ref, *, tm):
  i, steps = pl.program_id(2), pl.num_programs(2)
  gid = group[i]

  @pl.when(jnp.logical_or(i == 0, group[jnp.maximum(i - 1, 0)] != gid))
  def _start():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def rows(shape):
    r = tile[i] * tm + lax.broadcasted_iota(jnp.int32, shape, 0)
    return (r >= offsets[gid]) & (r < offsets[gid + 1]) & (i < real[0])

  x = x_ref[...]
  g = g_ref[...]
  x = jnp.where(rows(x.shape), x, jnp.zeros_like(x))
  g = jnp.where(rows(g.shape), g, jnp.zeros_like(g))
  acc_ref[...] += jnp.dot(x.T, g, preferred_element_type=jnp.float32)

  @pl.when(jnp.logical_or(i == steps - 1, group[jnp.minimum(i + 1, steps - 1)] != gid))
  def _store():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _weight_grad_tpu(x_MxK, g_MxN, group_sizes, out_dtype, tm: int, interpret: bool):
  from jax.experimental.pallas import tpu as pltpu  # deferred: TPU lowering only
  m, k = x_MxK.shape
  n = g_MxN.shape[1]
  num_groups = group_sizes.shape[0]
  tk, tn = _tile(k), _tile(n)
  schedule = _visits(group_sizes, m, tm)
  steps = schedule[1].shape[0]
  mat = getattr(jax.typeof(x_MxK), "manual_axis_type", None)
  out_shape = (jax.ShapeDtypeStruct((num_groups, k, n), out_dtype) if mat is None else
               jax.ShapeDtypeStruct((num_groups, k, n), out_dtype, manual_axis_type=mat))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(pl.cdiv(n, tn), pl.cdiv(k, tk), steps),
      in_specs=[pl.BlockSpec((tm, tk), lambda ni, ki, i, off, grp, til, real: (til[i], ki)),
                pl.BlockSpec((tm, tn), lambda ni, ki, i, off, grp, til, real: (til[i], ni))],
      out_specs=pl.BlockSpec((None, tk, tn),
                             lambda ni, ki, i, off, grp, til, real: (grp[i], ki, ni)),
      scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)])
  return pl.pallas_call(
      functools.partial(_weight_grad_kernel, tm=tm), out_shape=out_shape,
      grid_spec=grid_spec, interpret=interpret,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=pl.CostEstimate(flops=2 * (m + num_groups * tm) * k * n,
                                    transcendentals=0,
                                    bytes_accessed=(x_MxK.size * pl.cdiv(n, tn) + g_MxN.size
                                                    * pl.cdiv(k, tk)) * x_MxK.dtype.itemsize),
  )(*schedule, x_MxK, g_MxN.astype(x_MxK.dtype))


def grouped_weight_grad(x_MxK, g_MxN, group_sizes, w_GxKxN, *, backend: str | None = None,
                        interpret: bool | None = None):
  """[G, K, N] like w: group e's x rows transposed times its g rows, the weight gradient
  of `grouped_matmul(x, w, group_sizes)` with output cotangent g.

  backend "tpu" (default: the target platform's) runs the Pallas kernel when a row tile
  divides M (`row_tile`; `interpret`: default unless compiling for a TPU), each step one
  tile's [tk, tm] x [tm, tn] product, masked to its group, accumulated in float32 until
  the group changes: M / tm + G steps at most. Otherwise the transpose of `ragged_dot`.
  """
  backend = target_platform() if backend is None else backend
  tm = row_tile(x_MxK.shape[0], group_sizes.shape[0])
  if backend != "tpu" or tm is None:
    _, vjp = jax.vjp(lambda w: lax.ragged_dot(x_MxK, w, group_sizes,
                                              preferred_element_type=g_MxN.dtype), w_GxKxN)
    return vjp(g_MxN)[0].astype(w_GxKxN.dtype)
  interpret = target_platform() != "tpu" if interpret is None else interpret
  dw = _weight_grad_tpu(x_MxK, g_MxN, group_sizes, w_GxKxN.dtype, tm, interpret)
  return _like_vma(dw, w_GxKxN)


# x [M, K] times each group's w [N, K] transposed: contract x's K with w's last axis.
_RHS_TRANSPOSED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_matmul(x_MxK, w_GxKxN, group_sizes, out_dtype=None, transpose_rhs=False):
  """[M, N]: each group of `group_sizes` consecutive rows of x times its matrix of w
  (`jax.lax.ragged_dot`), in `out_dtype` (default x's). With `transpose_rhs` w is
  [G, N, K], each group's matrix transposed (`jax.lax.ragged_dot_general`): a small N
  (a LoRA rank) then sits off the minor axis, which TPU pads to 128 lanes. Gradients in
  x and w; the weight gradient is `grouped_weight_grad`'s."""
  if transpose_rhs:
    return lax.ragged_dot_general(x_MxK, w_GxKxN, group_sizes, _RHS_TRANSPOSED,
                                  preferred_element_type=out_dtype)
  return lax.ragged_dot(x_MxK, w_GxKxN, group_sizes, preferred_element_type=out_dtype)


def _grouped_matmul_fwd(x_MxK, w_GxKxN, group_sizes, out_dtype, transpose_rhs):
  return (grouped_matmul(x_MxK, w_GxKxN, group_sizes, out_dtype, transpose_rhs),
          (x_MxK, w_GxKxN, group_sizes))


def _grouped_matmul_bwd(out_dtype, transpose_rhs, res, g_MxN):
  del out_dtype
  x, w, group_sizes = res
  g = g_MxN.astype(w.dtype)
  if transpose_rhs:  # w [G, N, K]: dx = g w_g, dw_g = g_g^T x_g
    dx = lax.ragged_dot(g, w, group_sizes, preferred_element_type=x.dtype)
    dw = grouped_weight_grad(g_MxN.astype(x.dtype), x, group_sizes, w)
  else:
    dx = lax.ragged_dot(g, w.swapaxes(1, 2), group_sizes, preferred_element_type=x.dtype)
    dw = grouped_weight_grad(x, g_MxN, group_sizes, w)
  return (_like_vma(dx, x), dw, None)


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
