"""bitsandbytes checkpoints (`"quant_method": "bitsandbytes"`): 4-bit and 8-bit weights.

Folders saved from a model loaded with transformers' `BitsAndBytesConfig` (the
`*-bnb-4bit` uploads, QLoRA's bases) hold each quantized linear layer's weight packed
beside its quantization state; other tensors (embeddings, norms, the head, modules in
`llm_int8_skip_modules`) are plain.

4-bit (`load_in_4bit`, NF4 or FP4), for a weight NAME of torch shape [out, in]:

  NAME                                  the codes of the row-major flattened weight, two a
                                        byte, the first in the high nibble (uint8 [n/2, 1];
                                        `bnb_4bit_quant_storage` may store the same bytes
                                        as another dtype)
  NAME.absmax                           each block's absolute maximum: float32, or with
                                        double quantization uint8 codes of it
  NAME.quant_map                        the 16 levels (float32)
  NAME.nested_absmax, .nested_quant_map double quantization: absmax is
                                        nested_quant_map[code] * nested_absmax[code's block
                                        of nested_blocksize] + nested_offset
  NAME.quant_state.bitsandbytes__nf4    a JSON object in bytes: quant_type, blocksize,
                                        dtype, shape, nested_blocksize, nested_offset

A value is level x absmax, in float32 (bitsandbytes' `dequantize_4bit`); every weight is
read so. Blocks run over the flattened weight, so for an [out, in] weight with `in` a
multiple of the block they are `blocksize` consecutive inputs of one output: the blocks
of an "nf4" QLoRA base (`posttrain.models.quant`, whose blocks run along a projection's
input). Quantizing such a weight again in those blocks gives back the file's codes, with
its absmax (rounded to bfloat16, 2^-9 relative at most) as the scales: each block's
largest value sits at level +-1, so its absmax is the block's maximum again, and every
other value lands on its own level. Where the blocks differ (o_proj, whose base blocks run
across heads) the weight is quantized twice.

8-bit (`load_in_8bit`, LLM.int8): NAME (int8 [out, in]) beside MODULE.SCB (float32 [out],
each row's absolute maximum) and MODULE.weight_format (0: row-major); a value is
code x SCB x (1 / 127), in float32 (bitsandbytes' `int8_vectorwise_dequant`). It is read
dequantized (and quantized anew for a quantized base).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

import numpy as np


_STATE = ".quant_state.bitsandbytes__"
_PARTS4 = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
_PARTS8 = (".SCB", ".weight_format")
_TYPES = ("nf4", "fp4")


def method(config: Mapping) -> str | None:
  """"4bit" or "8bit" for a config.json of a bitsandbytes checkpoint, else None."""
  q = config.get("quantization_config")
  if not isinstance(q, Mapping) or q.get("quant_method") != "bitsandbytes":
    return None
  if q.get("load_in_4bit") or q.get("_load_in_4bit"):
    return "4bit"
  if q.get("load_in_8bit") or q.get("_load_in_8bit"):
    return "8bit"
  raise ValueError(f"bitsandbytes quantization_config {dict(q)!r} loads neither 4-bit nor "
                   "8-bit weights")


def packed4(files: Iterable[str]) -> dict[str, str]:
  """The 4-bit weights among a checkpoint's tensor names: NAME -> its state's name."""
  return {n.split(_STATE)[0]: n for n in files
          if _STATE in n and n.rsplit("__", 1)[-1] in _TYPES}


def packed8(files: Iterable[str]) -> set[str]:
  """The 8-bit weights among a checkpoint's tensor names (MODULE.weight beside MODULE.SCB)."""
  files = set(files)
  return {n[:-len(".SCB")] + ".weight" for n in files
          if n.endswith(".SCB") and n[:-len(".SCB")] + ".weight" in files}


def companions(files: Iterable[str], kind: str) -> set[str]:
  """The tensors that hold the quantization state of `kind`'s ("4bit", "8bit") weights:
  read with their weight, never on their own."""
  files = set(files)
  if kind == "4bit":
    out = set()
    for name, state in packed4(files).items():
      out |= {state} | {name + p for p in _PARTS4 if name + p in files}
    return out
  return {w[:-len(".weight")] + p for w in packed8(files) for p in _PARTS8
          if w[:-len(".weight")] + p in files}


def read4(name: str, get: Callable[[str], np.ndarray], state_name: str) -> np.ndarray:
  """Weight `name` of a 4-bit checkpoint (its state in `state_name`), dequantized to
  float32 as bitsandbytes computes it: level x absmax. `get(tensor name)` reads a
  tensor."""
  try:
    state = json.loads(bytes(np.asarray(get(state_name)).view(np.uint8)).decode("utf-8"))
    quant_type, blocksize = state["quant_type"], int(state["blocksize"])
    shape = tuple(int(s) for s in state["shape"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{state_name} is not a bitsandbytes quantization state: {e}") from None
  if quant_type not in _TYPES or blocksize <= 0 or len(shape) != 2:
    raise ValueError(f"{state_name}: unsupported 4-bit state {state}")
  packed = np.ascontiguousarray(get(name)).reshape(-1).view(np.uint8)
  n = int(np.prod(shape))
  blocks = -(-n // blocksize)
  if packed.size != (n + 1) // 2:
    raise ValueError(f"{name} holds {packed.size} bytes of 4-bit codes, expected {(n + 1) // 2}"
                     f" for shape {list(shape)}")
  absmax = np.asarray(get(name + ".absmax"))
  if "nested_blocksize" in state:  # double quantization: absmax is itself 8-bit codes
    nested, table = get(name + ".nested_absmax"), get(name + ".nested_quant_map")
    nb = int(state["nested_blocksize"])
    if absmax.dtype != np.uint8 or nb <= 0 or nested.size != -(-absmax.size // nb):
      raise ValueError(f"{name}.absmax: a double-quantized absmax of {absmax.size} "
                       f"{absmax.dtype} codes with {nested.size} nested scales in blocks of "
                       f"{nb} does not fit")
    absmax = (np.asarray(table, np.float32)[absmax] * np.repeat(
        np.asarray(nested, np.float32), nb)[:absmax.size] + np.float32(state["nested_offset"]))
  absmax = absmax.astype(np.float32).reshape(-1)
  if absmax.size != blocks:
    raise ValueError(f"{name}.absmax has {absmax.size} scales, expected {blocks} (blocks of "
                     f"{blocksize} over shape {list(shape)})")
  levels = np.asarray(get(name + ".quant_map"), np.float32).reshape(-1)
  if levels.size != 16:
    raise ValueError(f"{name}.quant_map has {levels.size} levels, expected 16")
  codes = np.empty(2 * packed.size, np.uint8)  # the first value of a byte in its high nibble
  codes[0::2], codes[1::2] = packed >> 4, packed & 15
  values = levels[codes[:n]] * np.repeat(absmax, blocksize)[:n]
  return values.reshape(shape)


def read8(name: str, get: Callable[[str], np.ndarray]) -> np.ndarray:
  """Weight `name` of an 8-bit (LLM.int8) checkpoint, dequantized to float32."""
  module = name[:-len(".weight")]
  weight, scb = np.asarray(get(name)), np.asarray(get(module + ".SCB"), np.float32)
  try:
    layout = int(np.asarray(get(module + ".weight_format")).reshape(-1)[0])
  except KeyError:
    layout = 0
  if layout != 0:
    raise ValueError(f"{module}.weight_format is {layout}: only row-major (0) 8-bit weights "
                     "are read")
  if weight.dtype != np.int8 or weight.ndim != 2 or scb.shape != (weight.shape[0],):
    raise ValueError(f"{name}: an 8-bit weight {weight.dtype} {list(weight.shape)} with "
                     f"SCB {list(scb.shape)} does not fit")
  return weight.astype(np.float32) * scb[:, None] * np.float32(1 / 127)
