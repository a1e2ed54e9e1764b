"""FP8 weights, in numpy: block-scaled (DeepSeek-V3 / R1, Kimi K2, Qwen3-*-FP8) and
scaled per output channel or per tensor (FBGEMM's: Llama 3.1 405B FP8, Llama 4 Maverick
FP8; compressed-tensors' float8: the FP8-dynamic / FP8 releases of llm-compressor).

Block-scaled checkpoints carry `"quantization_config": {"quant_method": "fp8", "fmt":
"e4m3", "weight_block_size": [128, 128], ...}` in config.json and store each quantized
linear layer's weight [out, in] as float8_e4m3fn beside a float32 `NAME_scale_inv`
[ceil(out / bo), ceil(in / bi)]: the weight is w[i, j] * scale_inv[i // bo, j // bi]
(transformers' FineGrainedFP8 dequantization). Embeddings, norms, routers and lm_head stay
in bfloat16. `dequantize` returns the weight in float32; `quantize` is its inverse up to
float8 rounding, for writing test checkpoints.

Channel-scaled checkpoints (`"quant_method": "fbgemm_fp8"`, or `"compressed-tensors"`
whose weights are 8-bit floats of strategy channel, tensor or block) store beside each
quantized weight `NAME_scale` (a Linear's `X.weight_scale`), which multiplies it after
broadcasting: [out, 1] per output row, [1] per tensor, or for Llama 4's stacked experts
[E, 1, 2F] over gate_up_proj [E, D, 2F] and [E, D, 1] over down_proj [E, F, D] (held
with its output channels on the middle axis, as FBGEMM quantizes it; `Scheme`).
compressed-tensors' static input scales (`X.input_scale`) are not read: activations stay
in the compute dtype here.

safetensors' numpy reader has no float8 dtype: `read_tensor` reads a tensor's bytes from
the file at the offsets its header gives and views them as ml_dtypes' float8_e4m3fn.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Scheme:
  """How a checkpoint's FP8 weights are stored: the suffix of each weight's scale
  tensor, its blocks (None: a scale that broadcasts over the weight), and the suffixes
  of tensors that are not read."""
  suffix: str
  block: tuple[int, int] | None = None
  ignored: tuple[str, ...] = ()

  def dequantize(self, name: str, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Tensor `name`'s float8 `weight` times its `scale`, in float32."""
    if self.block is not None:
      return dequantize(weight, scale, self.block)
    return dequantize_broadcast(name, weight, scale)


def scheme(config: Mapping) -> Scheme | None:
  """The FP8 storage of a config.json, or None when its weights are not FP8. Raises
  ValueError for a quantization this reader cannot dequantize."""
  quant = config.get("quantization_config")
  if not isinstance(quant, Mapping):
    return None
  method = quant.get("quant_method")
  if method == "fbgemm_fp8":
    return Scheme("_scale")
  if method == "compressed-tensors":
    return _compressed_tensors(quant)
  block = block_size(config)
  return None if block is None else Scheme(SCALE_SUFFIX, block)


def _compressed_tensors(quant: Mapping) -> Scheme | None:
  """compressed-tensors' float8 weights (its "float-quantized" / "naive-quantized"
  formats): a scale per output channel, per tensor, or per block. None for integer and
  FP4 weights (`posttrain.models.compressed` reads them)."""
  groups = quant.get("config_groups") or {}
  weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, Mapping)]
  from posttrain.models import compressed  # its integer and FP4 weights
  if any(w.get("type") == "int" or compressed.is_fp4(g, quant)
         for w, g in zip(weights, [g for g in groups.values() if isinstance(g, Mapping)])):
    return None
  strategies = {w.get("strategy") for w in weights}
  blocks = {tuple(w.get("block_structure") or ()) for w in weights}
  if (not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights)
      or not strategies <= {"channel", "tensor", "block"} or len(blocks) > 1
      or quant.get("format") not in (None, "float-quantized", "naive-quantized")):
    raise ValueError(f"compressed-tensors quantization_config {dict(quant)!r} is not "
                     "supported: only 8-bit float weights (strategy channel, tensor or "
                     "block; format float-quantized) and integer weights are read")
  (block,) = blocks
  if "block" in strategies:
    if len(block) != 2 or len(strategies) > 1:
      raise ValueError(f"compressed-tensors block strategy without a block_structure of "
                       f"[rows, columns]: {dict(quant)!r}")
    return Scheme("_scale", (int(block[0]), int(block[1])), ("input_scale",))
  return Scheme("_scale", None, ("input_scale",))


def dequantize_broadcast(name: str, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """weight (float8) times a scale that broadcasts over it (per output row, per tensor,
  per stacked expert's column), in float32; a stacked experts' down_proj's [E, D, 1]
  scale is laid over its [E, F, D] as [E, 1, D] (FBGEMM's Llama 4 layout)."""
  scale = np.asarray(scale, np.float32)
  if name.endswith("experts.down_proj") and scale.ndim == 3:
    scale = np.swapaxes(scale, 1, 2)
  if scale.ndim > weight.ndim or any(
      s not in (1, w) for s, w in zip(scale.shape[::-1], weight.shape[::-1])):
    raise ValueError(f"the scale of {name}, of shape {tuple(scale.shape)}, does not "
                     f"broadcast over its weight of shape {tuple(weight.shape)}")
  return weight.astype(np.float32) * scale


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
