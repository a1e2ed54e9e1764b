"""Shared cases, segment ids and cotangents of the linear-attention kernel tests
(test_gated_delta_rule.py, test_gated_linear_attention.py)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_utils import assert_close


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


def check_packing_and_padding(fn, x, names, padding_values, tol):
  """Row 0 packs a 13-token sequence (continuing x's first initial state) with an
  11-token one (from zeros); row 1 holds the same 13 tokens behind leading padding,
  split by interior padding, then trailing padding, its padding tokens set to
  `padding_values` (name -> value). Each row's outputs and final state equal the
  sequences run alone; padding outputs are 0. `fn(*inputs in names order, ...)`."""
  s0 = jnp.stack([x["initial_state"][0]] * 2)  # both rows continue one state
  packed = np.array([1] * 13 + [2] * 11)
  padded_at = np.array([3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16, 17, 18])
  padded = np.zeros(24, np.int32)
  padded[padded_at] = 5
  first = take_rows(x, names, np.arange(13), slice(0, 1))
  second = take_rows(x, names, np.arange(13, 24), slice(0, 1))
  inputs = {n: np.asarray(x[n]).copy() for n in names}
  for n in inputs:
    inputs[n][1, padded_at] = np.asarray(first[n])[0]
  for n, value in padding_values.items():
    inputs[n][1, padded == 0] = value
  out, state = fn(*(jnp.asarray(inputs[n]) for n in names),
                  segment_ids=jnp.asarray(np.stack([packed, padded])), initial_state=s0)
  out1, state1 = fn(*(first[n] for n in names), initial_state=s0[:1])
  out2, state2 = fn(*(second[n] for n in names), initial_state=None)
  assert_close(out[0], np.concatenate([out1[0], out2[0]]), tol, "packed out")
  assert_close(state[0], state2[0], tol, "packed final state")
  assert_close(out[1, padded_at], out1[0], tol, "padded out")
  assert np.all(np.asarray(out[1, padded == 0]) == 0)
  assert_close(state[1], state1[0], tol, "padded final state (from s0 via padding)")
