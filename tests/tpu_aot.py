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
