"""MXFP4 expert weights (gpt-oss): dequantize against transformers' unpacking bit for bit,
the OCP MX quantizer's rounding, error bound and round trips, and input checks."""

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from posttrain.models import mxfp4

E = 3


def _random_packed(rng, rows, groups, low=118, high=130):
  blocks = rng.integers(0, 256, (E, rows, groups, 16), dtype=np.uint8)
  scales = rng.integers(low, high + 1, (E, rows, groups), dtype=np.uint8)
  return blocks, scales


def _transformers(blocks, scales):
  out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                   dtype=torch.float32)
  return out.numpy()


def test_lookup_table_is_transformers():
  np.testing.assert_array_equal(mxfp4.FP4_VALUES, np.array(FP4_VALUES, np.float32))
  np.testing.assert_array_equal(np.signbit(mxfp4.FP4_VALUES), np.arange(16) >= 8)


# (rows, groups): gate_up_proj-like (R = 2F = 16, D = 64) and down_proj-like (R = D = 64,
# F = 32), and one group of a single row.
@pytest.mark.parametrize("rows,groups", [(16, 2), (64, 1), (1, 1), (5, 3)])
def test_dequantize_matches_transformers(rows, groups):
  blocks, scales = _random_packed(np.random.default_rng(rows * 10 + groups), rows, groups)
  got = mxfp4.dequantize(blocks, scales)
  want = _transformers(blocks, scales)
  assert got.shape == want.shape == (E, groups * 32, rows)
  assert got.dtype == np.float32 and got.flags.c_contiguous
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0.0 too


def test_dequantize_full_scale_range_matches_transformers():
  # Every e8m0 byte: subnormal float32 results at the bottom, +-inf overflow at the top.
  rng = np.random.default_rng(1)
  blocks, _ = _random_packed(rng, 256, 2)
  scales = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :, None], (E, 256, 2)).copy()
  got = mxfp4.dequantize(blocks, scales)
  want = _transformers(blocks, scales)
  assert np.isinf(want).any() and (np.abs(want[want != 0]) < np.finfo(np.float32).tiny).any()
  np.testing.assert_array_equal(got, want)


def test_dequantize_nibble_order_and_scale():
  # Byte 0x71 holds code 1 (0.5) in the low nibble, the even value, and code 7 (6.0) high.
  blocks = np.zeros((1, 2, 1, 16), np.uint8)
  blocks[0, 0, 0, 0] = 0x71
  blocks[0, 1, 0, 15] = 0xA9  # low 9 (-0.5), high 10 (-1.0): values 30 and 31
  scales = np.array([[[127], [129]]], np.uint8)
  got = mxfp4.dequantize(blocks, scales)
  assert got.shape == (1, 32, 2)
  assert got[0, 0, 0] == 0.5 and got[0, 1, 0] == 6.0
  assert got[0, 30, 1] == -2.0 and got[0, 31, 1] == -4.0
  assert np.count_nonzero(got) == 4


def test_dequantize_chunks_and_dtypes(monkeypatch):
  blocks, scales = _random_packed(np.random.default_rng(2), 37, 3)
  want = _transformers(blocks, scales)
  monkeypatch.setattr(mxfp4, "_CHUNK_VALUES", 100)  # one row (96 values) per chunk
  np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), want)
  monkeypatch.setattr(mxfp4, "_CHUNK_VALUES", 96 * 10)  # 10 rows, the last chunk of 7
  np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), want)
  bf16 = mxfp4.dequantize(blocks, scales, dtype=ml_dtypes.bfloat16)
  assert bf16.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(bf16.astype(np.float32), want)  # exact in bfloat16
  f64 = mxfp4.dequantize(blocks, scales, dtype=np.float64)
  np.testing.assert_array_equal(f64, want.astype(np.float64))


def test_quantize_layout_inverts_transformers():
  # Random packed tensors whose blocks reach magnitude 4 or 6 are quantize's own output.
  blocks, scales = _random_packed(np.random.default_rng(3), 16, 2)
  blocks[..., 0] |= 0x70  # value 1 of every block is +-6: the scale is recovered as is
  weight = _transformers(blocks, scales)
  got_blocks, got_scales = mxfp4.quantize(weight)
  np.testing.assert_array_equal(got_scales, scales)
  np.testing.assert_array_equal(got_blocks, blocks)  # -0.0 keeps its code 8


def _brute_force_nearest(weight):
  """Per block of 32 along axis 1: OCP MX shared exponent, nearest e2m1, ties to even."""
  x = np.swapaxes(weight.astype(np.float64), 1, 2).reshape(*weight.shape[::2], -1, 32)
  amax = np.abs(x).max(-1, keepdims=True)
  shared = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
  shared = np.where(amax > 0, shared, -127)
  y = x / 2.0 ** shared
  grid = mxfp4.FP4_VALUES[:8].astype(np.float64)
  dist = np.abs(np.abs(y)[..., None] - grid)
  best = dist.min(-1, keepdims=True)
  # Among the nearest codes pick the even one (ties: lowest even index).
  tied = dist == best
  code = np.where(tied & (np.arange(8) % 2 == 0), np.arange(8), 99).min(-1)
  code = np.where(tied.sum(-1) == 1, np.argmin(dist, -1), code)
  q = np.copysign(grid[code], x) * 2.0 ** shared
  return np.swapaxes(q.reshape(weight.shape[0], weight.shape[2], -1), 1, 2), shared[..., 0]


@pytest.mark.parametrize("std", [0.02, 1.0, 300.0])
def test_quantize_random_normal_nearest_and_bounded(std):
  rng = np.random.default_rng(4)
  weight = (rng.standard_normal((E, 64, 16)) * std).astype(np.float32)
  blocks, scales = mxfp4.quantize(weight)
  assert blocks.shape == (E, 16, 2, 16) and scales.shape == (E, 16, 2)
  assert blocks.dtype == scales.dtype == np.uint8
  got = mxfp4.dequantize(blocks, scales)
  want, shared = _brute_force_nearest(weight)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(scales.astype(np.int32) - 127, shared)
  # Error bound: 2**s times 1/4, 1/2, 1 (|x| / 2**s <= 2, 4, 6) or |x| / 2**s - 6 beyond,
  # so at most 2**(s + 1) <= max|block| / 2.
  step = np.swapaxes(np.repeat(2.0 ** shared, 32, axis=-1), 1, 2)
  u = np.abs(weight) / step
  bound = np.where(u <= 2, 0.25, np.where(u <= 4, 0.5, np.where(u <= 6, 1.0, u - 6))) * step
  err = np.abs(weight.astype(np.float64) - got)
  assert (err <= bound).all() and (err <= 2 * step).all()
  amax = np.abs(weight.reshape(E, 2, 32, 16)).max(2)  # [E, 2, 16] per block
  assert (err.reshape(E, 2, 32, 16) <= amax[:, :, None] / 2).all()
  # Idempotent: quantizing the dequantized weight reproduces it exactly.
  np.testing.assert_array_equal(mxfp4.dequantize(*mxfp4.quantize(got)), got)


def test_quantize_rounding_ties_saturation_and_zeros():
  # One block with max |x| = 7 (s = 0): ties go to the even code, (6, 8) saturates to 6.
  row = np.zeros(32)
  row[:12] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -7.0, -0.1, 6.9, 0.26]
  want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -6.0, -0.0, 6.0, 0.5]
  weight = np.zeros((2, 32, 1), np.float32)
  weight[0, :, 0] = row  # expert 1 stays all zero
  blocks, scales = mxfp4.quantize(weight)
  got = mxfp4.dequantize(blocks, scales)
  np.testing.assert_array_equal(got[0, :12, 0], want)
  assert np.signbit(got[0, 9, 0])  # -0.1 rounds to -0.0
  assert scales[0, 0, 0] == 127 and scales[1, 0, 0] == 0
  assert not got[1].any()


def test_quantize_exact_on_representable_values():
  # e2m1 value * 2**k per block, k from e8m0's bottom (float32 subnormals) to near its top,
  # block maxima of every magnitude (so quantize picks a smaller exponent than k for some).
  rng = np.random.default_rng(5)
  limit = np.repeat(rng.integers(0, 8, (E, 3, 8)), 32, axis=1)  # largest magnitude code
  codes = rng.integers(0, 8, (E, 96, 8)) % (limit + 1) | rng.integers(0, 2, (E, 96, 8)) * 8
  k = np.repeat(rng.integers(-127, 126, (E, 3, 8)), 32, axis=1)
  k[0, :32] = -127
  weight = (mxfp4.FP4_VALUES[codes] * 2.0 ** k).astype(np.float32)
  assert (np.abs(weight[weight != 0]) < np.finfo(np.float32).tiny).any()
  np.testing.assert_array_equal(mxfp4.dequantize(*mxfp4.quantize(weight)), weight)
  bf16 = weight.astype(ml_dtypes.bfloat16)  # bfloat16 input, the same values
  np.testing.assert_array_equal(bf16.astype(np.float32), weight)
  np.testing.assert_array_equal(mxfp4.dequantize(*mxfp4.quantize(bf16)), weight)


def test_config_and_names():
  assert mxfp4.is_mxfp4({"quantization_config": {"quant_method": "mxfp4"}})
  assert not mxfp4.is_mxfp4({"quantization_config": {"quant_method": "fp8"}})
  assert not mxfp4.is_mxfp4({"quantization_config": None})
  assert not mxfp4.is_mxfp4({})
  names = mxfp4.packed_names("model.layers.3.mlp.experts")
  assert names == {
      "gate_up_proj": ("model.layers.3.mlp.experts.gate_up_proj_blocks",
                       "model.layers.3.mlp.experts.gate_up_proj_scales"),
      "down_proj": ("model.layers.3.mlp.experts.down_proj_blocks",
                    "model.layers.3.mlp.experts.down_proj_scales"),
  }


@pytest.mark.parametrize("blocks,scales,dtype,match", [
    (np.zeros((1, 2, 3, 16), np.int8), np.zeros((1, 2, 3), np.uint8), np.float32,
     "blocks must be uint8"),
    (np.zeros((1, 2, 3, 16), np.uint8), np.zeros((1, 2, 3), np.int32), np.float32,
     "scales must be uint8"),
    (np.zeros((2, 3, 16), np.uint8), np.zeros((2, 3), np.uint8), np.float32,
     r"blocks must be \[E, R, G, 16\]"),
    (np.zeros((1, 2, 3, 8), np.uint8), np.zeros((1, 2, 3), np.uint8), np.float32,
     r"blocks must be \[E, R, G, 16\]"),
    (np.zeros((1, 2, 3, 16), np.uint8), np.zeros((1, 3, 2), np.uint8), np.float32,
     r"scales shape \(1, 3, 2\) must equal blocks.shape\[:3\]"),
    (np.zeros((1, 2, 3, 16), np.uint8), np.zeros((1, 2, 3), np.uint8), np.float16,
     "dtype must be one of"),
])
def test_dequantize_rejects_bad_inputs(blocks, scales, dtype, match):
  with pytest.raises(ValueError, match=match):
    mxfp4.dequantize(blocks, scales, dtype=dtype)


@pytest.mark.parametrize("weight,match", [
    (np.zeros((1, 32, 4), np.int32), "weight must be a float array"),
    (np.zeros((32, 4), np.float32), r"weight must be \[E, X, Y\]"),
    (np.zeros((1, 48, 4), np.float32), "X a multiple of 32"),
    (np.full((1, 32, 4), np.inf, np.float32), "weight must be finite"),
    (np.full((1, 32, 4), np.nan, np.float32), "weight must be finite"),
])
def test_quantize_rejects_bad_inputs(weight, match):
  with pytest.raises(ValueError, match=match):
    mxfp4.quantize(weight)
