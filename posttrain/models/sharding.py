"""Logical-axis sharding: one rules table maps logical names to mesh axes.

Model code names dimensions logically (`batch, length, embed, heads, kv_heads, head_dim,
mlp, vocab`); only this module knows the mesh axes (`data, fsdp, tensor, sequence`).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import jax
from jax.experimental import mesh_utils
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "sequence")

# (logical name, mesh axes it may shard over, in order of preference).
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", ("sequence",)),
    ("embed", ("fsdp",)),
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    # A mixture's expert axis: whole on each device by default (the experts' D splits over
    # fsdp as a dense MLP's does, gathered a layer at a time). Mapped to ("fsdp",) (or
    # ("data", "fsdp")) it is expert parallelism: each device holds E / ep experts, the
    # tokens all-gathered and the outputs reduce-scattered (`MoE._expert_parallel`).
    ("experts", ()),
    ("norm", ()),
    # Multi-head latent attention's latent width (kv_lora_rank, q_lora_rank).
    ("latent", ()),
    # A Gated DeltaNet layer's key and value heads (its recurrent state's too).
    ("linear_heads", ("tensor",)),
    ("layers", ()),
    # LoRA's rank axis: FSDP-sharded where the other axis of the adapter leaves fsdp free
    # (B [r, out], and A of o_proj / down_proj), so no adapter is replicated whole.
    ("lora", ("fsdp",)),
    ("cache_length", ()),
)

Rules = Sequence[tuple[str, Sequence[str]]]


def make_mesh(shape: Sequence[int], axis_names: Sequence[str] = MESH_AXES,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a mesh; one `-1` entry takes the devices that remain.

  Args:
    shape: sizes per axis, e.g. (1, -1, 1, 1) for pure FSDP.
    axis_names: mesh axis names, by default (data, fsdp, tensor, sequence).
    devices: devices to use (default: all).

  Raises:
    ValueError: if the product of the sizes does not equal the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = [int(s) for s in shape]
  if len(shape) != len(axis_names):
    raise ValueError(f"mesh shape {tuple(shape)} has {len(shape)} entries but axis names "
                     f"{tuple(axis_names)} have {len(axis_names)}")
  if shape.count(-1) > 1:
    raise ValueError(f"mesh shape {tuple(shape)} has more than one -1")
  known = math.prod(s for s in shape if s != -1)
  if any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh shape {tuple(shape)} has a non-positive size")
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"mesh shape {tuple(shape)} does not divide {len(devices)} devices")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, "
                     f"but {len(devices)} are available")
  try:
    device_array = mesh_utils.create_device_mesh(shape, devices)
  except Exception:  # Non-TPU topologies or odd shapes: plain row-major order is fine.
    device_array = np.asarray(devices).reshape(shape)
  return Mesh(device_array, tuple(axis_names))


def logical_to_spec(names: Iterable[str | None], rules: Rules = DEFAULT_RULES,
                    mesh: Mesh | None = None, shape: Sequence[int] | None = None) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec.

  A mesh axis is used at most once per array. When `mesh` and `shape` are given, mesh axes
  of size 1 are dropped and an axis that does not divide the dimension is skipped, so a
  small model (2 kv heads on a 4-way tensor axis) replicates instead of failing.
  """
  table = {name: tuple(axes) for name, axes in rules}
  used: set[str] = set()
  spec = []
  names = tuple(names)
  for i, name in enumerate(names):
    axes = []
    for axis in table.get(name, ()) if name is not None else ():
      if axis in used:
        continue
      if mesh is not None:
        if axis not in mesh.shape:
          continue
        size = mesh.shape[axis]
        if size == 1:
          continue
        if shape is not None:
          done = math.prod(mesh.shape[a] for a in axes)
          if shape[i] % (done * size):
            continue
      axes.append(axis)
      used.add(axis)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, names: Iterable[str | None], rules: Rules = DEFAULT_RULES,
                   shape: Sequence[int] | None = None) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(names, rules, mesh, shape))


class ShardingContext:
  """A mesh plus a rules table; constrains activations by logical names inside jit."""

  def __init__(self, mesh: Mesh | None, rules: Rules = DEFAULT_RULES):
    self.mesh = mesh
    self.rules = tuple((n, tuple(a)) for n, a in rules)

  def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(
        x, named_sharding(self.mesh, names, self.rules, x.shape))

  def sharding(self, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    assert self.mesh is not None
    return named_sharding(self.mesh, names, self.rules, shape)

  def vocab_parallel_head(self, rows: int, positions: int, d_model: int,
                          vocab: int) -> tuple[PartitionSpec, PartitionSpec] | None:
    """Specs for a log-prob head that splits the vocabulary where the rules split D.

    The output projection [D, V] is stored with D over the embed axes (fsdp). A head that
    kept that layout would gather all of [D, V] on every device (and, when trained, sum
    its whole float32 gradient there). Instead the projection moves to [D, V / (vocab
    axes x embed axes)] and each chunk's hidden states [rows, positions, D] gather over
    the embed axes, Megatron's vocab-parallel cross-entropy: each device scores every
    row against its slice of the vocabulary, and the log-sum-exp is reduced across the
    slices.

    Returns (projection spec [D, V], logits spec [rows, positions, V]), or None for the
    plain layout: when D is whole on each device (nothing to gather), when the
    vocabulary does not divide over the embed axes, or when a chunk's rows x positions
    outnumber the vocabulary a device holds (gathering the projection then holds less).
    """
    if self.mesh is None:
      return None
    embed = _spec_axes(logical_to_spec(("embed",), self.rules, self.mesh, (d_model,))[0])
    if not embed:
      return None
    table = dict(self.rules)
    head_vocab = tuple(table.get("vocab", ())) + tuple(a for a in embed
                                                      if a not in table.get("vocab", ()))
    rules = self.rules + (("head_vocab", head_vocab),)
    vocab_spec, rows_spec = logical_to_spec(("head_vocab", "batch"), rules, self.mesh,
                                            (vocab, rows))
    if not set(embed) <= set(_spec_axes(vocab_spec)):
      return None
    plain = _spec_axes(logical_to_spec(("vocab",), self.rules, self.mesh, (vocab,))[0])
    if rows * positions > vocab // math.prod(self.mesh.shape[a] for a in plain):
      return None
    return (PartitionSpec(None, vocab_spec),
            PartitionSpec(rows_spec, PartitionSpec.UNCONSTRAINED, vocab_spec))


def _spec_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def without_axes(entry, axes):
  """One PartitionSpec entry without the mesh axes in `axes` (None when none are left)."""
  names = tuple(n for n in _spec_axes(entry) if n not in axes)
  return None if not names else names[0] if len(names) == 1 else names


def rules_from_config(rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """The rules table a run's `sharding_rules` gives: DEFAULT_RULES with each entry given
  (a list of (name, axes) pairs or a mapping, ConfigDict-friendly) in place of the
  default of that name, new names appended; None or empty: the defaults. E.g.
  (("experts", ("fsdp",)),) is expert parallelism with everything else as by default;
  () as a name's axes leaves that axis whole on every device."""
  if not rules:
    return DEFAULT_RULES
  items = rules.items() if hasattr(rules, "items") else rules
  given = {}
  for entry in items:
    if isinstance(entry, str) or len(entry) != 2:
      raise ValueError(f"sharding rule {entry!r} is not a (name, mesh axes) pair")
    name, axes = entry
    if isinstance(axes, str):
      axes = (axes,)
    axes = tuple(axes or ())
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
      raise ValueError(f"sharding rule for {name!r} names unknown mesh axes {bad}; "
                       f"mesh axes are {MESH_AXES}")
    given[str(name)] = axes
  out = tuple((name, given.pop(name, axes)) for name, axes in DEFAULT_RULES)
  return out + tuple(given.items())
