"""A frozen base held quantized (QLoRA): int8 or NF4 weights with block-wise scales.

A LoRA run updates only its adapters, so the base weights it reads every step need not
sit in memory at full width. With `ModelConfig.base_quantization` "int8" or "nf4" every
projection of the layers (attention, MLP, routed and shared experts, linear mixers'
projections: `quantizable`) is held as a `QArray` and dequantized where a layer reads it,
inside that layer's step of the scan: the model never holds more than one layer's
weights at full width (and the backward pass, which rematerialises the layer, dequantizes
it again). Embeddings, the output head, norms, biases, routers and convolutions stay in
the parameter dtype, as in QLoRA (Dettmers et al., 2023) and bitsandbytes.

Blocks run along each weight's first axis past the layer and expert axes (`block_axis`:
D for q/k/v, gate and up, F for down, the heads for o_proj): `block` values (default 64;
the largest divisor of the axis at most that, for narrow axes) share one scale, their
absolute maximum, held in bfloat16 (the codes are computed against the rounded scale, so
the stored pair is what the model reads). Along that axis the scales and nf4's packed
codes keep the weight's other axes whole, which TPU tiles without padding (blocks and
pairs along a head's 128 values left q_proj's scales [..., heads, 2], a 64x padded
tile, and XLA relaid out every layer's codes, [..., heads, 64]).

- int8: round(w / scale * 127), clipped to [-127, 127]: 8.25 bits a weight at block 64
  (0.52x of bfloat16).
- nf4: each value's nearest of the 16 NormalFloat levels (QLoRA's NF4, bitsandbytes'
  table) of w / scale, two codes a byte along the block axis (the even position in the
  low nibble): 4.25 bits a weight at block 64 (0.27x of bfloat16).

`quantize` runs on numpy (the checkpoint reader quantizes each tensor as it reads it, so
a full-width copy of the model never exists) or jax.numpy with the same results.
`QuantizedParam` is the nnx.Param that holds a QArray: `param[...]` (what the layers read)
dequantizes, `param.get_value()` is the QArray (what nnx, the optimizer split,
checkpoints and the sampler's copies move around).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from posttrain.models.sharding import without_axes

KINDS = ("int8", "nf4")
# The NormalFloat4 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero
# (bitsandbytes' `get_4bit_type("nf4")`).
NF4_LEVELS = np.asarray([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
_NF4_EDGES = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
# The layer stacks whose projections are quantized; the names that are projections.
_STACKS = ("layers", "dense_layers", "linear_layers", "mlp_layers", "moe_layers",
           "global_layers", "shared_layers", "shared_global_layers", "linear_dense_layers")
_PROJECTIONS = ("q_gate", "latent_in", "latent_out")


def check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"base_quantization must be one of {KINDS} (or empty: none), got "
                     f"{kind!r}")


def quantizable(name: str) -> bool:
  """Whether a layer's parameter called `name` is a projection the base quantizes."""
  return name.endswith("_proj") or name in _PROJECTIONS


def block_width(n: int, block: int) -> int:
  """The values a scale covers along an axis of `n`: the largest divisor of n <= block."""
  return next(b for b in range(min(block, n), 0, -1) if n % b == 0)


def block_axis(names) -> int:
  """The axis a weight's blocks run along, counted from its end: its first axis past a
  stack's layer axis and a mixture's experts axis (`names`, its logical axes), the input
  of most projections. The same for one layer's (one expert's) tensor as for the stack."""
  return -sum(1 for n in names if n not in ("layers", "experts"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
  """A quantized weight: `values` (int8, the weight's shape; nf4's uint8, two codes a
  byte along axis `axis`, which it halves) and `scales` (bfloat16, the weight's shape
  with `axis` divided by the block); `dtype` the dtype it dequantizes to. The leaves may
  be arrays, ShapeDtypeStructs (an abstract model) or shardings (its layout)."""
  values: Any
  scales: Any
  kind: str = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(default=-1, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    shape = list(self.values.shape)
    if self.kind == "nf4":
      shape[self.axis] *= 2
    return tuple(shape)

  @property
  def ndim(self) -> int:
    return len(self.values.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  @property
  def block(self) -> int:
    return self.shape[self.axis] // self.scales.shape[self.axis]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.values.shape)) * np.dtype(self.values.dtype).itemsize + int(
        np.prod(self.scales.shape)) * 2


def _blocked(shape, axis: int, blocks: int) -> tuple[tuple, tuple]:
  """(the weight's shape with axis split into [blocks, width], the scales' with [blocks,
  1]): the two broadcast against each other."""
  k = len(shape) + axis
  head, tail = tuple(shape[:k]), tuple(shape[k + 1:])
  return head + (blocks, shape[k] // blocks) + tail, head + (blocks, 1) + tail


def quantize(w, kind: str, block: int = 64, *, axis: int = -1, dtype=None) -> QArray:
  """`w` (numpy or jax) quantized in blocks of `block_width(n, block)` consecutive values
  along `axis` (negative, from the end; n its size); it dequantizes to `dtype` (default
  w's). numpy in, numpy out."""
  check_kind(kind)
  xp = np if isinstance(w, np.ndarray) else jnp
  dtype = np.dtype(dtype or w.dtype)
  shape = tuple(w.shape)
  if not -len(shape) <= axis < 0:
    raise ValueError(f"axis={axis} is not a negative axis of a weight of shape {shape}")
  if kind == "nf4" and shape[axis] % 2:
    raise ValueError(f"nf4 packs two values a byte along axis {axis}: it must be even, got "
                     f"shape {shape}")
  b = block_width(shape[axis], block)
  split, scale_shape = _blocked(shape, axis, shape[axis] // b)
  k = len(split) + axis  # the width axis of `split`
  x = w.astype(np.float32).reshape(split)
  top = xp.max(xp.abs(x), axis=k, keepdims=True)
  scales = (top / 127.0 if kind == "int8" else top).astype(ml_dtypes.bfloat16)
  s = scales.astype(np.float32)
  y = (x / xp.where(s == 0, np.float32(1), s)).reshape(shape)
  scales = scales.reshape(scale_shape[:k] + scale_shape[k + 1:])
  if kind == "int8":
    values = xp.clip(xp.round(y), -127, 127).astype(np.int8)
  else:
    codes = xp.searchsorted(xp.asarray(_NF4_EDGES), y.reshape(-1)).astype(np.uint8)
    kk = len(shape) + axis
    codes = codes.reshape(*shape[:kk], shape[kk] // 2, 2, *shape[kk + 1:])
    even, odd = (xp.take(codes, i, axis=kk + 1) for i in (0, 1))
    values = even | (odd << 4)
  return QArray(values, scales, kind, dtype, axis)


def dequantize(q: QArray):
  """The weight a QArray holds (jax): level x scale, computed in q.dtype, no wider (no
  float32 copy of a layer's weights twice their size). int8's levels and the bfloat16
  scales are exact in any float dtype, and their product is rounded once; NF4's levels
  are rounded to q.dtype first."""
  values, scales = (_flat_barrier(jnp.asarray(x)) for x in (q.values, q.scales))
  dtype = jnp.dtype(q.dtype)
  shape = q.shape
  if q.kind == "nf4":
    x = _nf4_levels(_unpacked(values, q.axis, jnp), dtype)
  else:
    x = values.astype(dtype)
  split, scale_shape = _blocked(shape, q.axis, q.scales.shape[q.axis])
  return (x.reshape(split) * scales.astype(dtype).reshape(scale_shape)).reshape(shape)


def dequantize_numpy(q: QArray) -> np.ndarray:
  """`dequantize` on the host, for exports and tests: the same values (each product of
  two values exact in float32, rounded once to q.dtype)."""
  values = np.asarray(q.values)
  dtype = np.dtype(q.dtype)
  shape = q.shape
  if q.kind == "nf4":
    levels = NF4_LEVELS.astype(dtype).astype(np.float32)
    x = levels[_unpacked(values, q.axis, np)]
  else:
    x = values.astype(np.float32)
  split, scale_shape = _blocked(shape, q.axis, q.scales.shape[q.axis])
  x = x.reshape(split) * np.asarray(q.scales).astype(np.float32).reshape(scale_shape)
  return x.reshape(shape).astype(dtype)


def _unpacked(values, axis: int, xp):
  """nf4's codes, each byte's two (low nibble first) side by side along `axis`."""
  k = values.ndim + axis
  shape = list(values.shape)
  shape[k] *= 2
  return xp.stack([values & 15, values >> 4], axis=k + 1).reshape(shape)


def _nf4_levels(codes, dtype):
  """The NF4 level of each code (uint8, 0..15) in `dtype`: a tree of 15 selects on the
  code's bits, which fuses with the rest of the dequantization (a gather from the table
  would first widen the codes of a whole layer to int32 indices, 8x their bytes)."""
  layer = [jnp.asarray(level, dtype) for level in NF4_LEVELS]
  for bit in range(4):
    on = (codes & (1 << bit)) != 0
    layer = [jnp.where(on, hi, lo) for lo, hi in zip(layer[0::2], layer[1::2])]
  return jnp.broadcast_to(layer[0], codes.shape)


def _flat_barrier(x):
  """`x` through a flat view behind an optimization barrier: the layout a matmul wants
  for the dequantized weight (its contracting axis minor, on TPU) is made where a layer
  dequantizes its slice, rather than by XLA relaying out the whole stacked codes of
  every layer once, outside the layer loop (for Llama 3.3 70B in NF4 on a v5e-8, a
  copy of 3.9 GiB of 4.3 a chip)."""
  return jax.lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


def is_quantized(x) -> bool:
  return isinstance(x, QArray)


_GATHERING: contextvars.ContextVar = contextvars.ContextVar("quant_gathering", default=None)


@contextlib.contextmanager
def gathering(ctx):
  """While a decode step is traced under `ctx` (a ShardingContext with a mesh; None:
  off), the quantized weights its layers read are gathered as codes: constrained to the
  layout their matmuls read them in (without the batch mesh axes, data and fsdp; a
  mixture's experts keep E split for expert parallelism) before they are dequantized.
  Left to itself, XLA:TPU dequantizes most of each device's shard and gathers the
  full-width weights: for Llama 3.3 70B in NF4 on a v5e-8 (fsdp 8, weights left
  sharded) 4.7x the all-gathered bytes a decode step, for 0.21 GiB less peak memory.
  Only for one-token steps: on the update and on prefill XLA already gathers codes for
  most weights, and the constraint there once made it relay out copies of every layer's
  codes (BENCHMARKS.md)."""
  token = _GATHERING.set(ctx)
  try:
    yield
  finally:
    _GATHERING.reset(token)


def _gathered(q: QArray, names, ctx) -> QArray:
  """`q`'s codes and scales constrained to the layout of `gathering`."""
  names = tuple(names)[len(names) - q.ndim:]  # a scanned stack's slice has no layer axis
  batch = set(dict(ctx.rules).get("batch", ()))

  def layout(x):
    spec = tuple(ctx.sharding(names, x.shape).spec)
    spec += (None,) * (len(names) - len(spec))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(
        ctx.mesh, jax.sharding.PartitionSpec(*(
            entry if name == "experts" else without_axes(entry, batch)
            for name, entry in zip(names, spec)))))

  return dataclasses.replace(q, values=layout(q.values), scales=layout(q.scales))


class QuantizedParam(nnx.Param):
  """A frozen base weight held as a QArray: `param[...]` dequantizes it (every layer reads
  its weights so; a decode step gathers the codes first, `gathering`), `get_value()`
  returns the QArray itself."""

  def __getitem__(self, key):
    raw = self.get_raw_value()
    if isinstance(raw, QArray):
      ctx = _GATHERING.get()
      if ctx is not None and ctx.mesh is not None:
        raw = _gathered(raw, self.get_metadata().get("logical_axes", ()), ctx)
      w = dequantize(raw)
    else:
      w = raw
    return w if key is ... else w[key]

  def __jax_array__(self):
    return self[...]


def map_quantized(fn, tree):
  """`tree` with `fn` applied to each QArray in it (other leaves kept)."""
  return jax.tree.map(lambda x: fn(x) if isinstance(x, QArray) else x, tree,
                      is_leaf=is_quantized)


def quantize_model(model, kind: str, block: int) -> None:
  """Replaces, in place, each projection of `model`'s layer stacks (`quantizable`, two
  or more axes besides a stack's layer axis) by a QuantizedParam of it."""
  check_kind(kind)
  for path, module in model.iter_modules():
    if not path or path[0] not in _STACKS:
      continue
    for name, var in list(vars(module).items()):
      if (type(var) is not nnx.Param or not quantizable(name)
          or isinstance(var.get_raw_value(), QArray)):
        continue
      w = var.get_raw_value()
      axes = var.get_metadata().get("logical_axes", ())
      if w.ndim - (1 if axes and axes[0] == "layers" else 0) < 2:
        continue
      setattr(module, name, QuantizedParam(quantize(w, kind, block, axis=block_axis(axes)),
                                           **var.get_metadata()))
