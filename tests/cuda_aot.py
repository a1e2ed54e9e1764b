"""Lowering the GPU kernels for CUDA with no GPU, as the tests do on a CPU host.

jax 0.10 lowers Triton kernels for CUDA from a CPU host as they are; jax 0.11 asks which
GPU it compiles for (Triton's launch limits depend on it) and reads it from the abstract
mesh's device. `cuda_target()` names one (an H100, the Hopper generation the Mosaic GPU
kernels need) where that API exists, and is a no-op before it.
"""
from __future__ import annotations

import contextlib

import jax


def cuda_target(device_kind: str = "NVIDIA H100 80GB HBM3"):
  """A context in which lowering for "cuda" targets `device_kind`."""
  abstract_device = getattr(jax.sharding, "AbstractDevice", None)
  if abstract_device is None or not hasattr(jax.sharding, "use_abstract_mesh"):
    return contextlib.nullcontext()
  device = abstract_device(device_kind=device_kind, num_cores=None, platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device))
