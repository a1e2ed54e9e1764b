"""MXFP4 (OCP Microscaling, e2m1 elements) expert weights of gpt-oss checkpoints, in numpy.

gpt-oss checkpoints (openai/gpt-oss-20b, -120b) carry
`"quantization_config": {"quant_method": "mxfp4", ...}` in config.json and store each
layer's MoE expert matrices packed, as two uint8 tensors per projection:

  model.layers.{i}.mlp.experts.gate_up_proj_blocks  uint8 [E, 2F, D // 32, 16]
  model.layers.{i}.mlp.experts.gate_up_proj_scales  uint8 [E, 2F, D // 32]
  model.layers.{i}.mlp.experts.down_proj_blocks     uint8 [E, D, F // 32, 16]
  model.layers.{i}.mlp.experts.down_proj_scales     uint8 [E, D, F // 32]

(E experts, D hidden_size, F intermediate_size; 20b: E=32, D=F=2880, so gate_up blocks are
[32, 5760, 90, 16].) Axis 1 is the matmul's output axis and the packed axes 2-3 its input
(contraction) axis, cut into MX blocks of 32 values: 16 bytes of blocks and one byte of
scales per block. Each byte holds two e2m1 codes, the low nibble the even value (2j) and
the high nibble the odd one (2j + 1); a code is sign (bit 3), exponent (bits 2-1) and
mantissa (bit 0), values `FP4_VALUES`. A scale byte is an e8m0 exponent with bias 127: the
block's values are multiplied by 2 ** (scale - 127).

transformers (`transformers.integrations.mxfp4.convert_moe_packed_tensors`, run by
`Mxfp4Dequantize` when `quantizer_mxfp4` dequantizes: the serialized names
`{proj}_blocks` and `{proj}_scales` load into the parameter `{proj}`) unpacks
[E, R, G, 16] to [E, R, G * 32] and transposes axes 1 and 2, giving `GptOssExperts`'s
`x @ W` layout: gate_up_proj [E, D, 2F] and down_proj [E, F, D]. `dequantize` returns that
same array; `quantize` is its inverse for writing test checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# e2m1 value of each 4-bit code (transformers' FP4_VALUES): codes 8-15 are the negatives.
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
BLOCK_SIZE = 32  # values per MX block (and per scale byte)
SCALE_BIAS = 127  # e8m0 exponent bias
EMAX_ELEM = 2  # floor(log2(6.0)), the largest e2m1 exponent (OCP MX spec's emax_elem)
PROJECTIONS = ("gate_up_proj", "down_proj")

# Midpoints between consecutive non-negative e2m1 magnitudes FP4_VALUES[0:8].
_MIDPOINTS = (FP4_VALUES[1:8] + FP4_VALUES[0:7]) / 2
# Values per dequantized chunk: bounds dequantize's temporaries to a few tens of MB.
_CHUNK_VALUES = 1 << 22
_OUT_DTYPES = ("float32", "float64", "bfloat16")


def is_mxfp4(config: Mapping) -> bool:
  """Whether an HF config.json dict declares MXFP4 weights (quant_method "mxfp4")."""
  quant = config.get("quantization_config")
  return isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4"


def packed_names(prefix: str) -> dict[str, tuple[str, str]]:
  """Checkpoint keys of the packed expert tensors under a module prefix.

  Args:
    prefix: the experts module, e.g. "model.layers.0.mlp.experts".

  Returns:
    {"gate_up_proj": (blocks key, scales key), "down_proj": (blocks key, scales key)}, e.g.
    "model.layers.0.mlp.experts.gate_up_proj_blocks".
  """
  return {proj: (f"{prefix}.{proj}_blocks", f"{prefix}.{proj}_scales") for proj in PROJECTIONS}


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
  """Unpacks MXFP4 expert weights exactly as transformers' `convert_moe_packed_tensors`.

  Every MXFP4 value (an e2m1 value times a power of two) is exact in float32, float64 and
  bfloat16, so the result equals transformers' bit for bit, its axes 1 and 2 swapped the
  same way. Scale byte 255 (NaN in e8m0) is not special-cased, as in transformers: its
  block's nonzero values overflow to +-inf. Works in chunks of rows, writing straight into
  the transposed output, so the only full-size array is the result.

  Args:
    blocks: uint8 [E, R, G, 16], two e2m1 codes a byte (low nibble first).
    scales: uint8 [E, R, G], e8m0 exponents biased by 127, one per 32 values.
    dtype: the result's dtype: float32 (default), float64 or bfloat16.

  Returns:
    [E, G * 32, R] of `dtype`: gate_up_proj [E, D, 2F] or down_proj [E, F, D].

  Raises:
    ValueError: wrong dtypes, or shapes that are not [E, R, G, 16] and [E, R, G].
  """
  blocks, scales = np.asarray(blocks), np.asarray(scales)
  dtype = np.dtype(dtype)
  if blocks.dtype != np.uint8:
    raise ValueError(f"blocks must be uint8, got {blocks.dtype}")
  if scales.dtype != np.uint8:
    raise ValueError(f"scales must be uint8, got {scales.dtype}")
  if blocks.ndim != 4 or blocks.shape[-1] != BLOCK_SIZE // 2:
    raise ValueError(f"blocks must be [E, R, G, {BLOCK_SIZE // 2}], got shape {blocks.shape}")
  if scales.shape != blocks.shape[:3]:
    raise ValueError(f"scales shape {scales.shape} must equal blocks.shape[:3] "
                     f"{blocks.shape[:3]}")
  if dtype.name not in _OUT_DTYPES:
    raise ValueError(f"dtype must be one of {_OUT_DTYPES}, got {dtype}")
  num_experts, rows, groups, _ = blocks.shape
  cols = groups * BLOCK_SIZE
  out = np.empty((num_experts, cols, rows), dtype)
  step = max(1, _CHUNK_VALUES // max(cols, 1))
  with np.errstate(over="ignore"):
    for e in range(num_experts):
      for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        packed = blocks[e, r0:r1]
        values = np.empty((r1 - r0, groups, BLOCK_SIZE), np.float32)
        values[..., 0::2] = FP4_VALUES[packed & 0x0F]
        values[..., 1::2] = FP4_VALUES[packed >> 4]
        exponents = scales[e, r0:r1].astype(np.int32) - SCALE_BIAS
        np.ldexp(values, exponents[..., None], out=values)
        out[e, :, r0:r1] = values.reshape(r1 - r0, cols).T
  return out


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Packs expert weights to MXFP4 blocks and scales, the inverse layout of `dequantize`.

  Follows the OCP MX spec: a block of 32 values (along weight's axis 1) shares the exponent
  s = floor(log2(max |x|)) - 2 (emax_elem = 2 for e2m1), clamped to e8m0's [-127, 127]
  (an all-zero block gets -127); each x / 2**s is rounded to the nearest e2m1 value,
  ties to even (the code whose mantissa bit is 0: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4),
  and saturates at +-6 (x / 2**s lies in [4, 8), so (6, 8) clamps to 6). Negative values
  that round to zero keep their sign (code 8, -0.0).

  Error: with u = |x| / 2**s, |x - dequantize(quantize(x))| <= 2**s times 0.25 (u <= 2),
  0.5 (u <= 4), 1 (u <= 6) or u - 6 < 2 (u > 6); so at most 2**(s + 1) <= max |x| / 2 of
  the block. Values of the form e2m1 value * 2**k (any block of dequantize's output) come
  back exactly, so dequantize(quantize(.)) is idempotent.

  Args:
    weight: finite floats [E, X, Y] in `dequantize`'s layout (gate_up_proj [E, D, 2F] or
      down_proj [E, F, D]); X must be a multiple of 32. Rounded in float64.

  Returns:
    (blocks uint8 [E, Y, X // 32, 16], scales uint8 [E, Y, X // 32]).

  Raises:
    ValueError: non-float or non-finite weight, or a shape that is not [E, X, Y] with X a
      multiple of 32.
  """
  weight = np.asarray(weight)
  if not (np.issubdtype(weight.dtype, np.floating) or weight.dtype.name == "bfloat16"):
    raise ValueError(f"weight must be a float array, got {weight.dtype}")
  if weight.ndim != 3 or weight.shape[1] % BLOCK_SIZE:
    raise ValueError(f"weight must be [E, X, Y] with X a multiple of {BLOCK_SIZE}, "
                     f"got shape {weight.shape}")
  num_experts, cols, rows = weight.shape
  groups = cols // BLOCK_SIZE
  blocks = np.empty((num_experts, rows, groups, BLOCK_SIZE // 2), np.uint8)
  scales = np.empty((num_experts, rows, groups), np.uint8)
  for e in range(num_experts):
    x = weight[e].T.astype(np.float64).reshape(rows, groups, BLOCK_SIZE)
    if not np.isfinite(x).all():
      raise ValueError("weight must be finite")
    amax = np.abs(x).max(axis=-1)
    _, exp = np.frexp(amax)  # amax = m * 2**exp with m in [0.5, 1): floor(log2) = exp - 1
    shared = np.where(amax > 0, exp - 1 - EMAX_ELEM, -SCALE_BIAS)
    shared = np.clip(shared, -SCALE_BIAS, SCALE_BIAS).astype(np.int32)
    scaled = np.abs(np.ldexp(x, -shared[..., None]))
    codes = np.searchsorted(_MIDPOINTS, scaled, side="left")  # ties round down here...
    at_mid = _MIDPOINTS[np.minimum(codes, len(_MIDPOINTS) - 1)] == scaled
    codes = codes + (at_mid & (codes % 2 == 1))  # ...except to the even code
    codes = (codes | (np.signbit(x) << 3)).astype(np.uint8)
    blocks[e] = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales[e] = (shared + SCALE_BIAS).astype(np.uint8)
  return blocks, scales
