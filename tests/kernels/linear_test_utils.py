"""Shared cases, segment ids and cotangents of the linear-attention kernel tests
(test_gated_delta_rule.py, test_gated_linear_attention.py)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  batch: int = 2
  length: int = 37
  key_heads: int = 2
  value_heads: int = 4
  dk: int = 7
  dv: int = 5
  chunk_size: int = 16
  initial_state: bool = True
  segments: bool = False


def hostile_segments(batch, length):
  """Resets inside a chunk and on a chunk boundary (8), padding at the start, inside a
  sequence, between sequences and at the end, and a row with one valid token."""
  seg = np.ones((batch, length), np.int32)
  seg[0, :3] = 0
  seg[0, 11:16] = 2
  seg[0, 16:29] = 3
  seg[0, 20:22] = 0
  seg[0, 29:31] = 0
  seg[0, 31:] = 4
  seg[0, 35:] = 0
  seg[1, :] = 0
  seg[1, 6] = 7
  return seg


def take_rows(x, names, t, rows=slice(None)):
  """The inputs `names` restricted to batch rows and token positions t."""
  return {n: jnp.asarray(np.asarray(x[n])[rows][:, t]) for n in names}


def cotangents(case, seed=2):
  """Random cotangents of the output [B, T, Hv, Dv] and the final state [B, Hv, Dk, Dv]."""
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(case.batch, case.length, case.value_heads, case.dv)),
                      jnp.float32),
          jnp.asarray(rng.normal(size=(case.batch, case.value_heads, case.dk, case.dv)),
                      jnp.float32))


def assert_bad_argument_raises(chunked, reference, good, name, change):
  """Both forms (the reference takes no chunk_size) raise a ValueError starting with
  `name` when `change` (name -> shape, or a value) is applied to the `good` call."""
  call = {n: np.zeros(s, np.int32 if n == "segment_ids" else np.float32) if
          isinstance(s, tuple) else s for n, s in {**good, **change}.items()}
  for fn in [chunked] + ([reference] if name != "chunk_size" else []):
    with pytest.raises(ValueError, match=rf"^{name} "):
      fn(**call)
