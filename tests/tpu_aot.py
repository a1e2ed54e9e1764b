"""Compiling for a TPU with no TPU: libtpu's compiler on a described topology.

`pip install -e '.[tpu]'` brings libtpu, whose compiler lowers and compiles programs for
any TPU generation on a CPU host (Mosaic kernels included), as TPU pods compile ahead
of time. The tests use it to prove that the TPU kernels and the sharded model compile
for real TPUs, which CPU interpret mode cannot show.
"""
from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Without TPUs there is nothing to guard: let test workers (pytest -n) load libtpu at once
# instead of failing on its one-process lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Host layouts libtpu accepts for a 4-chip description of each generation.
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def have_libtpu() -> bool:
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return False
  return True


requires_libtpu = pytest.mark.skipif(
    not have_libtpu(), reason="needs libtpu (pip install -e '.[tpu]')")


@functools.cache
def tpu_devices(chip: str) -> tuple:
  from jax.experimental import topologies
  return tuple(topologies.get_topology_desc(TOPOLOGIES[chip], "tpu").devices)


def tpu_mesh(chip: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  devices = tpu_devices(chip)[:int(np.prod(shape))]
  return Mesh(np.array(devices).reshape(shape), names)


def spec(mesh: Mesh, shape, dtype, partition=P()):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, partition))


def compile_for(mesh: Mesh, fn, *args, **jit_kwargs):
  """fn compiled for the mesh's TPU devices (args: ShapeDtypeStructs with shardings)."""
  with jax.set_mesh(mesh):  # Pallas reads the TPU generation from the abstract mesh
    return jax.jit(fn, **jit_kwargs).lower(*args).compile()


def sharded_state(cfg, mesh: Mesh):
  """(graphdef, the model's state as ShapeDtypeStructs sharded by the default rules)."""
  from posttrain import models
  graphdef, state = models.abstract_model(cfg)
  shardings = models.state_shardings(state, mesh)
  return graphdef, jax.tree.map(
      lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), state, shardings)


def sharded_cache(cfg, ctx, batch: int, max_len: int, dtype=None):
  """`models.init_cache`'s arrays as ShapeDtypeStructs sharded by their logical axes."""
  from posttrain import models
  from posttrain.models.transformer import map_cache
  cache = jax.eval_shape(lambda: models.init_cache(cfg, batch, max_len, dtype))
  # Each array's own logical axes ("layers" first in a stacked cache).
  return map_cache(lambda x, axes: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ctx.sharding(
      axes, x.shape)), cache)


def cache_programs(graphdef, ctx, decode_position: int):
  """The sampler's two steps as functions of (state, tokens, cache): a prefill from
  position 0 into the cache, and a decode step at `decode_position`."""
  import jax.numpy as jnp
  from flax import nnx

  def prefill(state, tokens, cache):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model.hidden_states(tokens, positions, jnp.ones_like(tokens), cache=cache,
                               ctx=ctx, prefill=True)

  def decode(state, tokens, cache):
    model = nnx.merge(graphdef, state)
    positions = jnp.full(tokens.shape, decode_position)
    return model.hidden_states(tokens, positions, jnp.ones_like(tokens), cache=cache,
                               ctx=ctx)
  return prefill, decode
