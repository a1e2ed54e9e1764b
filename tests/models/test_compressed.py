"""compressed-tensors integer and FP4 checkpoints (W4A16 / W8A8 / NVFP4 / MXFP4 releases,
Kimi K2's INT4 experts): folders written with compressed-tensors' own compressors, read
back against its own decompression and transformers on the decompressed weights; the bit
packing against its packer; damaged or foreign files are one-line errors."""

import json
import re
import shutil

import numpy as np
import pytest

from posttrain import models
from posttrain.models import compressed
from tests.models.parity import hf_logits, perturb

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the files")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from compressed_tensors.quantization.utils import generate_gparam  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from safetensors.torch import load_file as load_torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

TOKENS = np.arange(16)[None] % 97
LINEAR = r".*layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?\w+_proj\.weight$"
# name -> (weights' QuantizationArgs, format, scale dtype, input activations)
SCHEMES = {
    "w4-group": (dict(num_bits=4, strategy="group", group_size=32), "pack-quantized",
                 torch.float32, None),
    "w4-group-asym": (dict(num_bits=4, strategy="group", group_size=16, symmetric=False),
                      "pack-quantized", torch.bfloat16, None),
    "w3-channel-asym": (dict(num_bits=3, strategy="channel", symmetric=False),
                        "pack-quantized", torch.float32, None),
    "w2-tensor": (dict(num_bits=2, strategy="tensor"), "pack-quantized", torch.float32, None),
    "w4-block": (dict(num_bits=4, strategy="block", block_structure=[16, 32]),
                 "pack-quantized", torch.float16, None),
    "w8a8-channel": (dict(num_bits=8, strategy="channel"), "int-quantized", torch.bfloat16,
                     dict(num_bits=8, strategy="token", dynamic=True)),
    # compressed-tensors' NVFP4A16 and MXFP4A16 presets
    "nvfp4": (dict(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                   scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn),
              "nvfp4-pack-quantized", torch.float32, None),
    "mxfp4": (dict(num_bits=4, type="float", strategy="group", group_size=32,
                   scale_dtype=torch.uint8, zp_dtype=torch.uint8),
              "mxfp4-pack-quantized", torch.float32, None),
}


def _qparams(w: torch.Tensor, args: QuantizationArgs, dtype, global_scale=None):
  """compressed-tensors' scale and zero point of weight w from its range (as
  llm-compressor's min-max observer gives them), the scale in `dtype`."""
  rows, cols = w.shape
  if args.strategy in ("group", "tensor_group"):
    g = w.reshape(rows, cols // args.group_size, args.group_size)
    lo, hi = g.amin(-1), g.amax(-1)
  elif args.strategy == "channel":
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
  elif args.strategy == "tensor":
    lo, hi = w.min().reshape(1), w.max().reshape(1)
  else:
    br, bc = args.block_structure
    b = w.reshape(rows // br, br, cols // bc, bc)
    lo, hi = b.amin((1, 3)), b.amax((1, 3))
  scale, zp = calculate_qparams(lo, hi, args, global_scale=global_scale)
  if args.type == "float":  # FP4: the compressor casts the scale itself
    return scale, None
  return scale.to(dtype), zp.to(torch.int8)


def quantize_folder(src, dst, name, targets=LINEAR, version="0.20.1"):
  """`src`'s projections quantized as SCHEMES[name] with compressed-tensors' compressor
  into folder `dst`; returns the weights compressed-tensors decompresses from it."""
  weights, fmt, dtype, acts = SCHEMES[name]
  args = QuantizationArgs(**weights)
  scheme = QuantizationScheme(targets=["Linear"], weights=args,
                              input_activations=QuantizationArgs(**acts) if acts else None)
  compressor = BaseCompressor.get_value_from_registry(fmt)
  out, dequantized = {}, {}
  for key, w in load_torch(f"{src}/model.safetensors").items():
    if not re.match(targets, key):
      out[key] = w
      continue
    gs = (generate_gparam(w.float().min(), w.float().max())
          if args.strategy == "tensor_group" else None)
    scale, zp = _qparams(w.float(), args, dtype, gs)
    state = {"weight": w.float(), "weight_scale": scale}
    if gs is not None:
      state["weight_global_scale"] = gs
    if not args.symmetric:
      state["weight_zero_point"] = zp
    packed = compressor.compress(state, scheme)
    module = key[:-len("weight")]
    out.update({module + k: v.contiguous() for k, v in packed.items()})
    dequantized[key] = compressor.decompress(dict(packed), scheme)["weight"].float().numpy()
  shutil.copytree(src, dst, dirs_exist_ok=True)
  save_file(out, f"{dst}/model.safetensors")
  config = json.loads(open(f"{dst}/config.json").read())
  weights_json = json.loads(args.model_dump_json())  # its dtypes as compressed-tensors names them
  config["quantization_config"] = {
      "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt,
                                    "weights": weights_json,
                                    "input_activations": acts}},
      "ignore": ["lm_head"], "version": version}
  with open(f"{dst}/config.json", "w") as f:
    json.dump(config, f)
  return dequantized


def _reference(src, dequantized, cls, tmp_path):
  """transformers' model from folder `src` with the decompressed weights in its files."""
  shutil.copytree(src, tmp_path / "reference")
  tensors = load_torch(f"{src}/model.safetensors")
  save_file({**tensors, **{k: torch.from_numpy(v) for k, v in dequantized.items()}},
            str(tmp_path / "reference" / "model.safetensors"))
  return cls.from_pretrained(tmp_path / "reference").float().eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  root = tmp_path_factory.mktemp("ct")
  cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
  torch.manual_seed(0)
  perturb(transformers.LlamaForCausalLM(cfg).float().eval()).save_pretrained(root / "plain")
  return root


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpacking_inverts_compressed_tensors_packing(bits):
  """Every width from 1 to 8 bits, lengths that end mid-word (codes straddle words where
  32 is not a multiple of the width), along either dimension, and stacked [E, out, in]."""
  rng = np.random.default_rng(bits)
  half = 1 << (bits - 1)
  for shape in ((3, 1), (5, 31), (4, 33), (2, 100), (3, 4, 45)):
    v = rng.integers(-half, half, size=shape).astype(np.int8)
    words = pack_to_int32(torch.from_numpy(v), bits).numpy()
    np.testing.assert_array_equal(compressed.unpack(words, bits, shape[-1]), v)
    if len(shape) == 2:  # zero points: packed along the output dimension
      words = pack_to_int32(torch.from_numpy(v), bits, packed_dim=0).numpy()
      np.testing.assert_array_equal(
          compressed.unpack(words.T, bits, shape[0]).T, v)


def _word_aligned(v: np.ndarray, bits: int) -> np.ndarray:
  """compressed-tensors' packing before 0.18: floor(32 / bits) codes to a word, from the
  low bits up, the rest of the word empty (its pack_to_int32's pseudocode)."""
  per = 32 // bits
  u = v.astype(np.int64) + (1 << (bits - 1))
  pad = np.zeros((*v.shape[:-1], -(-v.shape[-1] // per) * per), np.int64)
  pad[..., :v.shape[-1]] = u
  words = (pad.reshape(*v.shape[:-1], -1, per) << (np.arange(per) * bits)).sum(-1)
  return (words & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("bits", [3, 4, 5, 7])
def test_unpacking_reads_word_aligned_files(bits):
  """Files written before compressed-tensors 0.18 (config.json's version) put
  floor(32 / bits) codes in a word; 4-bit codes sit alike in both layouts."""
  v = np.random.default_rng(0).integers(-(1 << (bits - 1)), 1 << (bits - 1),
                                        size=(6, 77)).astype(np.int8)
  words = _word_aligned(v, bits)
  np.testing.assert_array_equal(compressed.unpack(words, bits, 77, dense=False), v)
  if bits == 4:
    np.testing.assert_array_equal(compressed.unpack(words, bits, 77), v)
  elif words.shape[-1] == -(-77 * bits // 32):  # as many words, the codes elsewhere
    assert not np.array_equal(compressed.unpack(words, bits, 77), v)
  else:
    with pytest.raises(ValueError, match="packed words hold 77 codes of"):
      compressed.unpack(words, bits, 77)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_integer_checkpoints_load_as_compressed_tensors_decompresses_them(llama, tmp_path,
                                                                          name):
  """Each scheme's weights come out bit for bit as compressed-tensors decompresses them
  (rounded to the scale's dtype: bfloat16, float16, float32), and the logits are
  transformers' on those weights; activation settings (W8A8's dynamic tokens) are not
  read."""
  dequantized = quantize_folder(llama / "plain", tmp_path / "q", name)
  ref = _reference(llama / "plain", dequantized, transformers.LlamaForCausalLM, tmp_path)
  ours = models.from_pretrained(str(tmp_path / "q"))
  np.testing.assert_allclose(np.asarray(ours(TOKENS)), hf_logits(ref, TOKENS), atol=1e-4,
                             rtol=0)
  models.save_pretrained(ours, str(tmp_path / "out"))
  written = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert set(dequantized) <= set(written)
  for k, v in dequantized.items():
    np.testing.assert_array_equal(written[k], v, err_msg=k)
  assert not any("weight_packed" in k or "weight_scale" in k for k in written)


def test_transformers_reads_the_same_model_from_the_folder(llama, tmp_path):
  """The folder transformers itself loads (decompressing with compressed-tensors) gives
  the logits ours does. (transformers casts the scales to the model's dtype before it
  dequantizes, float32 here: the scales are float32 so that both round alike.)"""
  quantize_folder(llama / "plain", tmp_path / "q", "w4-group")
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
  ours = models.from_pretrained(str(tmp_path / "q"))
  np.testing.assert_allclose(np.asarray(ours(TOKENS)), hf_logits(theirs, TOKENS), atol=1e-4,
                             rtol=0)


def test_experts_alone_quantized_as_kimi_k2_publishes_them(tmp_path):
  """A mixture whose per-expert projections alone are INT4 (groups of 32, symmetric; the
  attention and router left in bfloat16, as in Kimi K2 Thinking's files) reads as
  transformers on the decompressed experts."""
  cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                    moe_intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    norm_topk_prob=True, tie_word_embeddings=False)
  torch.manual_seed(0)
  perturb(transformers.Qwen3MoeForCausalLM(cfg).float().eval()).save_pretrained(
      tmp_path / "plain")
  dequantized = quantize_folder(tmp_path / "plain", tmp_path / "q", "w4-group",
                                targets=r".*mlp\.experts\.\d+\.\w+_proj\.weight$")
  assert len(dequantized) == 2 * 4 * 3
  files = load_file(str(tmp_path / "q" / "model.safetensors"))
  assert "model.layers.0.self_attn.q_proj.weight" in files
  assert files["model.layers.0.mlp.experts.3.down_proj.weight_packed"].dtype == np.int32
  ref = _reference(tmp_path / "plain", dequantized, transformers.Qwen3MoeForCausalLM,
                   tmp_path)
  ours = models.from_pretrained(str(tmp_path / "q"))
  np.testing.assert_allclose(np.asarray(ours(TOKENS)), hf_logits(ref, TOKENS), atol=1e-4,
                             rtol=0)


def _getter(tensors):
  def get(n):
    if n not in tensors:
      raise KeyError(n)
    return tensors[n]
  return get


def test_word_aligned_files_and_activation_order(llama, tmp_path):
  """A file written before 0.18 (its version says so) holds 3-bit codes word-aligned and
  reads as the dense file does; with activation order (weight_g_idx: input j's group),
  permuting the columns of codes and groups alike permutes the weight's columns."""
  dequantized = quantize_folder(llama / "plain", tmp_path / "q", "w3-channel-asym")
  files = load_file(str(tmp_path / "q" / "model.safetensors"))
  config = json.loads((tmp_path / "q" / "config.json").read_text())
  old = dict(files)
  for k in [k for k in files if k.endswith(".weight_packed")]:
    module = k[:-len(".weight_packed")]
    rows, cols = files[module + ".weight_shape"]
    old[k] = _word_aligned(compressed.unpack(files[k], 3, int(cols)), 3)
    old[module + ".weight_zero_point"] = _word_aligned(
        compressed.unpack(files[module + ".weight_zero_point"].T, 3, int(rows)), 3).T.copy()
  assert old["model.layers.0.self_attn.q_proj.weight_packed"].shape[-1] == -(-64 // 10)
  shutil.copytree(tmp_path / "q", tmp_path / "old")
  from safetensors.numpy import save_file as save_np
  save_np(old, str(tmp_path / "old" / "model.safetensors"))
  config["quantization_config"]["version"] = "0.12.2"
  (tmp_path / "old" / "config.json").write_text(json.dumps(config))
  scheme = compressed.scheme(config)
  assert not scheme.dense
  name = "model.layers.1.mlp.down_proj.weight"
  np.testing.assert_array_equal(compressed.read(name, _getter(old), scheme), dequantized[name])
  ours = models.from_pretrained(str(tmp_path / "old"))
  ref = _reference(llama / "plain", dequantized, transformers.LlamaForCausalLM, tmp_path)
  np.testing.assert_allclose(np.asarray(ours(TOKENS)), hf_logits(ref, TOKENS), atol=1e-4,
                             rtol=0)

  # Activation order, on a group-quantized weight.
  quantize_folder(llama / "plain", tmp_path / "g", "w4-group-asym")
  files = load_file(str(tmp_path / "g" / "model.safetensors"))
  group_cfg = json.loads((tmp_path / "g" / "config.json").read_text())
  scheme = compressed.scheme(group_cfg)
  module = "model.layers.0.mlp.gate_proj"
  plain = compressed.read(module + ".weight", _getter(files), scheme)
  perm = np.random.default_rng(0).permutation(64)
  codes = compressed.unpack(files[module + ".weight_packed"], 4, 64)[:, perm]
  permuted = {**files, module + ".weight_packed": pack_to_int32(
                  torch.from_numpy(codes.astype(np.int8)), 4).numpy(),
              module + ".weight_g_idx": (np.arange(64) // 16)[perm].astype(np.int32)}
  np.testing.assert_array_equal(compressed.read(module + ".weight", _getter(permuted), scheme),
                                plain[:, perm])
  # -1 throughout (an unset index, as older files hold it) is plain column order
  unset = {**files, module + ".weight_g_idx": np.full(64, -1, np.int32)}
  np.testing.assert_array_equal(compressed.read(module + ".weight", _getter(unset), scheme),
                                plain)


def test_damaged_or_foreign_integer_files_are_refused(llama, tmp_path):
  """Mixed float and integer groups, FP4 groups of another size, MXFP8, unknown formats
  and widths, ambiguous groups, a truncated packed weight and a scale of the wrong
  shape: each a one-line error."""
  quantize_folder(llama / "plain", tmp_path / "q", "w4-group")
  config = json.loads((tmp_path / "q" / "config.json").read_text())
  quant = config["quantization_config"]
  group = quant["config_groups"]["group_0"]
  w = group["weights"]
  float8 = {"targets": ["re:.*mlp.*"], "weights": {**w, "type": "float", "num_bits": 8,
                                                     "strategy": "channel"}}
  cases = [
      ({"group_1": float8, "group_0": group}, None, "mixes"),
      ({"group_0": {**group, "format": "marlin-24"}}, None, "are not supported"),
      ({"group_0": {**group, "weights": {**w, "num_bits": 16}}}, None, "are not supported"),
      ({"group_0": {**group, "format": "int-quantized"}}, None, "are not supported"),
      ({"group_0": {**group, "weights": {**w, "group_size": None}}}, None, "not supported"),
      ({"group_0": {**group, "format": "nvfp4-pack-quantized",
                    "weights": {**w, "type": "float"}}}, "nvfp4-pack-quantized",
       "read is strategy tensor_group, symmetric, group_size 16"),
      ({"group_0": {**group, "format": "mxfp8-quantized",
                    "weights": {**w, "type": "float", "num_bits": 8}}}, "mxfp8-quantized",
       "only 8-bit float weights"),
  ]
  for groups, fmt, message in cases:
    bad = {**config, "quantization_config": {**quant, "config_groups": groups,
                                             "format": fmt or quant["format"]}}
    shutil.copytree(tmp_path / "q", tmp_path / "b", dirs_exist_ok=True)
    (tmp_path / "b" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=message):
      models.from_pretrained(str(tmp_path / "b"))

  # two groups quantizing the same modules differently
  scheme = compressed.scheme({"quantization_config": {
      **quant, "config_groups": {"a": group, "b": {**group, "weights": {**w, "num_bits": 8}}}}})
  with pytest.raises(ValueError, match="2 config groups could quantize m"):
    scheme.args("m")
  # a named target wins over a class, a pattern over a class
  scheme = compressed.scheme({"quantization_config": {**quant, "config_groups": {
      "a": group, "b": {**group, "targets": ["re:.*down_proj$"],
                        "weights": {**w, "num_bits": 8, "strategy": "channel"}}}}})
  assert scheme.args("model.layers.0.mlp.down_proj").num_bits == 8
  assert scheme.args("model.layers.0.mlp.up_proj").num_bits == 4

  files = load_file(str(tmp_path / "q" / "model.safetensors"))
  module = "model.layers.0.self_attn.k_proj"
  scheme = compressed.scheme(config)
  short = {**files, module + ".weight_packed": files[module + ".weight_packed"][:, :-1]}
  with pytest.raises(ValueError, match=rf"{module}.weight_packed: 7 packed words hold 64 "
                                       "codes of 4 bits in dense packing: expected 8"):
    compressed.read(module + ".weight", _getter(short), scheme)
  wrong = {**files, module + ".weight_scale": files[module + ".weight_scale"][:, :1]}
  with pytest.raises(ValueError, match=r"weight_scale of shape \[32, 1\]: groups of 32 over "
                                       r"a \[32, 64\] weight take \[32, 2\]"):
    compressed.read(module + ".weight", _getter(wrong), scheme)
  shutil.copytree(tmp_path / "q", tmp_path / "d", dirs_exist_ok=True)
  from safetensors.numpy import save_file as save_np
  save_np(short, str(tmp_path / "d" / "model.safetensors"))
  with pytest.raises(ValueError, match="weight_packed: 7 packed words"):
    models.from_pretrained(str(tmp_path / "d"))
