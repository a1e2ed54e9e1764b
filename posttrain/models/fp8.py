"""Block-scaled FP8 weights (DeepSeek-V3 / R1, Kimi K2, Qwen3-*-FP8), in numpy.

Such checkpoints carry `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}` in config.json and store each quantized linear
layer's weight [out, in] as float8_e4m3fn beside a float32 `NAME_scale_inv`
[ceil(out / bo), ceil(in / bi)]: the weight is w[i, j] * scale_inv[i // bo, j // bi]
(transformers' FineGrainedFP8 dequantization). Embeddings, norms, routers and lm_head stay
in bfloat16. `dequantize` returns the weight in float32; `quantize` is its inverse up to
float8 rounding, for writing test checkpoints.

safetensors' numpy reader has no float8 dtype: `read_tensor` reads a tensor's bytes from
the file at the offsets its header gives and views them as ml_dtypes' float8_e4m3fn.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}


def block_size(config: Mapping) -> tuple[int, int] | None:
  """(rows, columns) of a block-scaled FP8 config.json's blocks, or None when its weights
  are not FP8. Raises ValueError for FP8 this reader cannot dequantize."""
  quant = config.get("quantization_config")
  if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
    return None
  block = quant.get("weight_block_size")
  fmt = quant.get("fmt", "e4m3")
  # MiniMax-M2's files name the same format by its dtype.
  if fmt not in ("e4m3", "float8_e4m3fn") or not (
      isinstance(block, (list, tuple)) and len(block) == 2
      and all(isinstance(b, int) and b > 0 for b in block)):
    raise ValueError(f"FP8 quantization_config {dict(quant)!r} is not supported: expected "
                     "fmt e4m3 with weight_block_size [rows, columns] (per-tensor scales "
                     "are not read)")
  return int(block[0]), int(block[1])


def read_tensor(path: str, name: str) -> np.ndarray:
  """Tensor `name` of the safetensors file at `path`, float8 included."""
  with open(path, "rb") as fh:
    (length,) = struct.unpack("<Q", fh.read(8))
    header = json.loads(fh.read(length))
  info = header.get(name)
  if info is None:
    raise ValueError(f"{path} has no tensor {name}")
  dtype = _DTYPES.get(info["dtype"])
  if dtype is None:
    raise ValueError(f"tensor {name} in {path} is {info['dtype']}, not a float8 this reader "
                     f"knows ({sorted(_DTYPES)})")
  start, end = info["data_offsets"]
  raw = np.fromfile(path, dtype=np.uint8, count=end - start, offset=8 + length + start)
  return raw.view(dtype).reshape(info["shape"])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """weight [out, in] (float8) times its block's scale_inv, in float32."""
  rows, cols = weight.shape
  br, bc = block
  want = (-(-rows // br), -(-cols // bc))
  if tuple(scale_inv.shape) != want:
    raise ValueError(f"scale_inv of shape {tuple(scale_inv.shape)} for a weight {weight.shape} "
                     f"in blocks {block}: expected {want}")
  scales = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), br, 0), bc, 1)
  return weight.astype(np.float32) * scales[:rows, :cols]


def quantize(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
  """(float8 weight, float32 scale_inv): each block scaled so its largest magnitude is
  FP8_MAX."""
  w = np.asarray(weight, np.float32)
  rows, cols = w.shape
  br, bc = block
  nr, nc = -(-rows // br), -(-cols // bc)
  padded = np.zeros((nr * br, nc * bc), np.float32)
  padded[:rows, :cols] = w
  amax = np.abs(padded.reshape(nr, br, nc, bc)).max(axis=(1, 3))
  scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
  scales = np.repeat(np.repeat(scale_inv, br, 0), bc, 1)[:rows, :cols]
  return (w / scales).astype(ml_dtypes.float8_e4m3fn), scale_inv
