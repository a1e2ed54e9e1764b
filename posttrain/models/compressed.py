"""compressed-tensors integer and FP4 weights (`"quant_method": "compressed-tensors"`
whose weights are `"type": "int"`, or 4-bit floats in its NVFP4 / MXFP4 formats): the
W4A16 / W8A16 / W8A8 / NVFP4 / MXFP4 releases of llm-compressor, Kimi K2 Thinking's and
K2.5's INT4 experts.

config.json's quantization_config holds `config_groups`, each with `targets` (a module
class such as "Linear", a module name, or "re:" and a regular expression matched against
module names) and the quantization of their `weights` (num_bits, strategy, group_size,
block_structure, symmetric), `ignore` (modules left in the compute dtype) and the
`format` the files are in. For a quantized linear layer X of weight [out, in]:

  "pack-quantized" (1 to 8 bits)
    X.weight_packed      int32 [out, ceil(in * bits / 32)]: the codes, each shifted by
                         2^(bits - 1) to be unsigned, packed along the input dimension
    X.weight_shape       int64 [2]: [out, in]
    X.weight_scale       [out, in / group_size] (group), [out, 1] (channel), [1] (tensor)
                         or [ceil(out / rows), ceil(in / columns)] (block)
    X.weight_zero_point  asymmetric weights: the zero points, for group and channel
                         strategies packed likewise along the output dimension
    X.weight_g_idx       activation order (written before 0.18): input j's group
  "int-quantized", "naive-quantized"
    X.weight             int8 [out, in], X.weight_scale and X.weight_zero_point as above

Since compressed-tensors 0.18 the packing is dense: element i sits at bits
[i * bits, (i + 1) * bits) of the little-endian words, straddling a word boundary where it
must. Files written before (config.json's "version") put floor(32 / bits) elements in each
word and leave the rest of it empty; the two agree for 1, 2, 4 and 8 bits.

A value is (code - zero point) x scale, computed in float32 and rounded to the scale's
dtype, which is what compressed-tensors' dequantization gives (it multiplies in the
scale's dtype: the product of an 8-bit integer and a bfloat16 is exact in float32, so the
two round alike).

FP4 (E2M1: a sign bit and the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), for a weight X:

  "nvfp4-pack-quantized" (strategy tensor_group, groups of 16)
    X.weight_packed        uint8 [out, in / 2]: two codes a byte, the first in the low
                           nibble
    X.weight_scale         float8_e4m3fn [out, in / 16]
    X.weight_global_scale  float32 [1]: a value is code x (scale / global scale), in
                           float32, rounded to bfloat16
  "mxfp4-pack-quantized" (strategy group, groups of 32)
    X.weight_packed        as above
    X.weight_scale         uint8 [out, in / 32]: E8M0 exponents, 2^(e - 127); a value is
                           code x scale, rounded to bfloat16

(compressed-tensors decompresses FP4 weights to bfloat16 whatever the model's dtype.)
Static activation scales (X.input_scale, X.input_zero_point, X.input_global_scale) are
not read: activations stay in the compute dtype here. 8-bit float (FP8) groups are
`posttrain.models.fp8`'s; a checkpoint mixing them with integer or FP4 groups is refused.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# FP4 formats: their strategy and group size.
FP4_FORMATS = {"nvfp4-pack-quantized": ("tensor_group", 16),
               "mxfp4-pack-quantized": ("group", 32)}
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_STRATEGIES = ("tensor", "channel", "group", "block")
# The tensors beside a quantized layer's weight, read with it or not at all.
_PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
          "weight_g_idx", "weight_global_scale", "input_scale", "input_zero_point",
          "input_global_scale")
_DENSE_SINCE = (0, 18)


@dataclasses.dataclass(frozen=True)
class Args:
  """One config group's weight quantization."""
  num_bits: int
  strategy: str
  group_size: int | None = None
  block: tuple[int, int] | None = None
  symmetric: bool = True
  fp4: str | None = None  # the FP4 format ("nvfp4-pack-quantized", ...), None for integers


@dataclasses.dataclass(frozen=True)
class Scheme:
  """A checkpoint's integer or FP4 quantization: its format, its groups' targets and
  arguments, and whether sub-byte integer codes are packed densely. (Modules it leaves
  alone have no scale beside their weight.)"""
  format: str
  groups: tuple[tuple[tuple[str, ...], Args], ...]
  dense: bool = True

  def args(self, module: str) -> Args:
    """The quantization of `module`'s weight (compressed-tensors' precedence: a target
    naming the module, then a matching "re:" pattern, then a module class, which here
    only resolves when every class-targeted group quantizes alike)."""
    named = [a for t, a in self.groups if module in t]
    if not named:
      named = [a for t, a in self.groups
               if any(x.startswith("re:") and re.match(x[3:], module) for x in t)]
    if not named:
      named = [a for t, a in self.groups if any(_is_class(x) for x in t)]
    if len(set(named)) != 1:
      raise ValueError(f"compressed-tensors: {len(set(named))} config groups could quantize "
                       f"{module}'s weight, which has quantized tensors: cannot tell its "
                       "quantization")
    return named[0]


def _is_class(target: str) -> bool:
  return not target.startswith("re:") and "." not in target


def _version(text) -> tuple[int, ...]:
  parts = re.match(r"(\d+)\.(\d+)", str(text or ""))
  return tuple(int(p) for p in parts.groups()) if parts else ()


def is_fp4(group: Mapping, quant: Mapping) -> bool:
  """Whether a config group's weights are FP4 in one of `FP4_FORMATS`."""
  w = group.get("weights") or {}
  return (w.get("type") == "float" and w.get("num_bits") == 4
          and (group.get("format") or quant.get("format")) in FP4_FORMATS)


def scheme(config: Mapping) -> Scheme | None:
  """The integer or FP4 quantization of a config.json, or None when it has none (not
  compressed-tensors, or its weights are 8-bit floats). Raises ValueError for
  quantization this reader cannot dequantize."""
  quant = config.get("quantization_config")
  if not isinstance(quant, Mapping) or quant.get("quant_method") != "compressed-tensors":
    return None
  groups = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, Mapping)]
  ours = [(g.get("weights") or {}).get("type") == "int" or is_fp4(g, quant) for g in groups]
  if not any(ours):
    return None
  if not all(ours):
    kinds = sorted({"fp4" if is_fp4(g, quant) else str((g.get("weights") or {}).get("type"))
                    + str((g.get("weights") or {}).get("num_bits") or "") for g in groups})
    raise ValueError(f"compressed-tensors quantization_config mixes {kinds} weights: only "
                     "checkpoints whose groups are all integer or FP4 (or all 8-bit float) "
                     "are read")
  parsed = []
  for g in groups:
    w = g["weights"]
    fmt = g.get("format") or quant.get("format")
    targets = g.get("targets") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if is_fp4(g, quant):
      strategy, size = FP4_FORMATS[fmt]
      if w.get("strategy") != strategy or w.get("group_size") != size or not w.get(
          "symmetric", True):
        raise ValueError(f"compressed-tensors {fmt} weights {dict(w)!r} are not supported: "
                         f"read is strategy {strategy}, symmetric, group_size {size}")
      parsed.append((targets, Args(4, strategy, size, fp4=fmt)))
      continue
    strategy, bits = w.get("strategy"), w.get("num_bits")
    block = tuple(w.get("block_structure") or ())
    if (fmt not in _FORMATS or strategy not in _STRATEGIES
        or not isinstance(bits, int) or not 1 <= bits <= 8
        or (fmt != "pack-quantized" and bits != 8)
        or (strategy == "group" and not (isinstance(w.get("group_size"), int)
                                         and w["group_size"] > 0))
        or (strategy == "block" and not (len(block) == 2
                                         and all(isinstance(b, int) and b > 0 for b in block)))):
      raise ValueError(f"compressed-tensors integer weights {dict(w)!r} in format {fmt!r} are "
                       f"not supported: read are 1- to 8-bit codes in {_FORMATS[0]} (8-bit in "
                       f"{', '.join(_FORMATS[1:])}) of strategy {', '.join(_STRATEGIES)}")
    parsed.append((targets, Args(bits, strategy, w.get("group_size"),
                                 block if strategy == "block" else None,
                                 bool(w.get("symmetric", True)))))
  formats = {g.get("format") or quant.get("format") for g in groups}
  version = _version(quant.get("version"))
  return Scheme(formats.pop() if len(formats) == 1 else "mixed-precision", tuple(parsed),
                dense=not version or version >= _DENSE_SINCE)


def quantized(files: Iterable[str]) -> dict[str, str]:
  """The quantized weights among a checkpoint's tensor names: X.weight -> the tensor that
  holds its codes (X.weight_packed, or X.weight itself in int8 formats)."""
  files = set(files)
  out = {}
  for n in files:
    if n.endswith(".weight_packed"):
      out[n[:-len("_packed")]] = n
    elif n.endswith(".weight_scale") and n[:-len("_scale")] in files:
      out[n[:-len("_scale")]] = n[:-len("_scale")]
  return out


def companions(files: Iterable[str]) -> set[str]:
  """The tensors beside the quantized weights (packed codes, shapes, scales, zero points,
  group indices, activation scales): read with their weight or not at all."""
  files = set(files)
  out = set()
  for weight in quantized(files):
    module = weight[:-len(".weight")]
    out |= {module + "." + p for p in _PARTS if module + "." + p in files}
  return out


def unpack(words: np.ndarray, bits: int, count: int, dense: bool = True) -> np.ndarray:
  """The first `count` codes (int32, shifted back to signed) packed along the last axis
  of int32 `words`, `bits` each: densely (element i at bit i * bits of the little-endian
  stream) or, with `dense=False`, floor(32 / bits) to a word. Where bits divides 32 the
  two agree, and the codes come out of each word by shifts (no bit-per-byte copy)."""
  words = np.ascontiguousarray(words).astype("<i4", copy=False)
  lead = words.shape[:-1]
  per = 32 // bits
  want = -(-count * bits // 32) if dense else -(-count // per)
  if words.shape[-1] != want:
    raise ValueError(f"{words.shape[-1]} packed words hold {count} codes of {bits} bits in "
                     f"{'dense' if dense else 'word-aligned'} packing: expected {want}")
  mask = np.uint32((1 << bits) - 1)
  if 32 % bits == 0 or not dense:  # per codes in each word's low per * bits bits
    shifts = (np.arange(per) * bits).astype(np.uint32)
    codes = (words.view(np.uint32)[..., None] >> shifts) & mask
    value = codes.reshape(*lead, -1)[..., :count].astype(np.int32)
  else:  # codes straddle words: read each from the 64 bits of its word and the next
    start = np.arange(count, dtype=np.int64) * bits
    wide = np.concatenate([words.view(np.uint32), np.zeros((*lead, 1), np.uint32)], -1)
    pair = (wide[..., start // 32].astype(np.uint64)
            | (wide[..., start // 32 + 1].astype(np.uint64) << np.uint64(32)))
    value = ((pair >> (start % 32).astype(np.uint64)) & np.uint64(mask)).astype(np.int32)
  return value - (1 << (bits - 1))


def read(name: str, get: Callable[[str], np.ndarray], scheme: Scheme) -> np.ndarray:
  """Quantized weight `name` (X.weight) dequantized: (code - zero point) x scale, rounded
  to the scale's dtype and returned in float32. `get(tensor name)` reads a tensor."""
  module = name[:-len(".weight")]
  args = scheme.args(module)

  def part(p):
    try:
      return np.asarray(get(f"{module}.{p}"))
    except KeyError:
      return None

  scale = part("weight_scale")
  if scale is None:
    raise ValueError(f"{module} has no weight_scale beside its quantized weight")
  if args.fp4:
    return _read_fp4(module, args, part("weight_packed"), scale,
                     part("weight_global_scale"))
  packed = part("weight_packed")
  if packed is not None:
    shape = part("weight_shape")
    if shape is None or packed.dtype != np.int32:
      raise ValueError(f"{module}.weight_packed ({packed.dtype}) needs int32 words and a "
                       "weight_shape beside it")
    shape = tuple(int(s) for s in shape.reshape(-1))
    if len(shape) != packed.ndim or shape[:-1] != packed.shape[:-1]:
      raise ValueError(f"{module}.weight_packed {list(packed.shape)} does not hold a weight "
                       f"of weight_shape {list(shape)}")
    try:
      q = unpack(packed, args.num_bits, shape[-1], scheme.dense)
    except ValueError as e:
      raise ValueError(f"{module}.weight_packed: {e}") from None
  else:
    q = np.asarray(get(name))
    if q.dtype != np.int8:
      raise ValueError(f"{name} is {q.dtype}: {scheme.format} integer weights are int8")
    q = q.astype(np.int32)
  rows, cols = q.shape[-2:]
  f32 = _as_float32(scale, module)
  zp = part("weight_zero_point")
  if zp is not None:
    zp = np.asarray(zp)
    if packed is not None and zp.dtype == np.int32 and args.strategy in ("group", "channel"):
      # packed along the output dimension, each column of zero points on its own
      zp = np.swapaxes(unpack(np.swapaxes(zp, -1, -2), args.num_bits, rows, scheme.dense),
                       -1, -2)
    zp = zp.astype(np.float32)
  g_idx = part("weight_g_idx")
  expand = _expander(module, args, f32.shape, rows, cols, g_idx)
  value = q.astype(np.float32)
  if zp is not None:
    if zp.shape != f32.shape and zp.size != 1:
      raise ValueError(f"{module}.weight_zero_point of shape {list(zp.shape)} does not match "
                       f"its weight_scale {list(f32.shape)}")
    value = value - expand(np.broadcast_to(zp, f32.shape))
  return (value * expand(f32)).astype(scale.dtype).astype(np.float32)


def _read_fp4(module: str, args: Args, packed, scale, global_scale) -> np.ndarray:
  """An NVFP4 / MXFP4 weight dequantized as compressed-tensors does it (float32 products
  rounded to bfloat16), returned in float32."""
  if packed is None or packed.dtype != np.uint8 or packed.ndim < 2:
    raise ValueError(f"{module}.weight_packed must be uint8 [out, in / 2] FP4 codes, got "
                     f"{None if packed is None else (packed.dtype, list(packed.shape))}")
  codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
  values = _E2M1[codes & 7] * np.where(codes & 8, np.float32(-1), np.float32(1))
  if args.fp4 == "mxfp4-pack-quantized":
    if scale.dtype != np.uint8:
      raise ValueError(f"{module}.weight_scale is {scale.dtype}: MXFP4 scales are uint8 "
                       "E8M0 exponents")
    f32 = np.ldexp(np.float32(1), scale.astype(np.int32) - 127).astype(np.float32)
  else:
    if global_scale is None:
      raise ValueError(f"{module} has no weight_global_scale beside its NVFP4 weight")
    f32 = (_as_float32(scale, module)
           / np.asarray(global_scale, np.float32).reshape(-1)[0]).astype(np.float32)
  rows, cols = values.shape[-2:]
  expand = _expander(module, dataclasses.replace(args, strategy="group"), f32.shape, rows,
                     cols, None)
  return (values * expand(f32)).astype(ml_dtypes.bfloat16).astype(np.float32)


def _as_float32(scale: np.ndarray, module: str) -> np.ndarray:
  if scale.dtype.kind == "f" or scale.dtype in (ml_dtypes.bfloat16,
                                                ml_dtypes.float8_e4m3fn):
    return scale.astype(np.float32)
  raise ValueError(f"{module}.weight_scale is {scale.dtype}, not a float")


def _expander(module: str, args: Args, shape: tuple[int, ...], rows: int, cols: int,
              g_idx: np.ndarray | None) -> Callable[[np.ndarray], np.ndarray]:
  """A function laying a per-group array of `shape` (scales, zero points) over the
  [..., rows, cols] weight."""
  if args.strategy == "tensor" or int(np.prod(shape)) == 1:
    return lambda a: a  # broadcasts
  if args.strategy == "channel":
    if tuple(shape[-2:]) != (rows, 1):
      raise ValueError(f"{module}.weight_scale of shape {list(shape)}: a channel scale of a "
                       f"[{rows}, {cols}] weight is [{rows}, 1]")
    return lambda a: a
  if args.strategy == "group":
    gs = args.group_size
    groups = -(-cols // gs)
    if tuple(shape[-2:]) != (rows, groups):
      raise ValueError(f"{module}.weight_scale of shape {list(shape)}: groups of {gs} over a "
                       f"[{rows}, {cols}] weight take [{rows}, {groups}]")
    if g_idx is not None and g_idx.size == cols and not (g_idx < 0).any():
      index = g_idx.astype(np.int64).reshape(-1)  # activation order: input j's group
      if index.max() >= groups:
        raise ValueError(f"{module}.weight_g_idx names group {index.max()} of {groups}")
    else:
      index = np.arange(cols) // gs
    return lambda a: np.take(a, index, axis=-1)
  br, bc = args.block
  want = (-(-rows // br), -(-cols // bc))
  if tuple(shape[-2:]) != want:
    raise ValueError(f"{module}.weight_scale of shape {list(shape)}: blocks of {[br, bc]} "
                     f"over a [{rows}, {cols}] weight take {list(want)}")
  return lambda a: np.repeat(np.repeat(a, br, -2), bc, -1)[..., :rows, :cols]
