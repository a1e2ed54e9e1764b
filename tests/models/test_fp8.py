"""Block-scaled FP8 checkpoints (DeepSeek-V3's and Kimi K2's published files, Qwen3-*-FP8):
float8_e4m3fn weights beside float32 NAME_scale_inv blocks, read and dequantized on load.
Against torch's own float8 decoding and against transformers run on the dequantized
weights."""

import json
import shutil

import numpy as np
import pytest

from posttrain import models
from posttrain.models import fp8
from tests.models.parity import hf_logits, perturb

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

TOKENS = np.random.default_rng(0).integers(0, 97, (2, 16))
BLOCK = (16, 32)  # smaller than transformers' 128 x 128, and cutting through the shapes


def _quantized_folder(hf, folder, block=BLOCK):
  """Saves `hf` with every 2-D linear weight in its layers as float8 + scale_inv (as
  DeepSeek's files: routers, norms, embeddings and lm_head stay as they are), puts the
  dequantized weights back into `hf`, and returns it."""
  from safetensors.torch import save_file
  tensors = {}

  def quantized(name, w):  # writes NAME and NAME_scale_inv; returns the dequantized w
    w8, scale_inv = fp8.quantize(w, block)
    tensors[name] = torch.from_numpy(w8.astype(np.float32)).to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.from_numpy(scale_inv)
    return torch.from_numpy(fp8.dequantize(w8, scale_inv, block))

  with torch.no_grad():
    for name, p in hf.named_parameters():
      w = p.detach().numpy()
      if name.endswith("experts.gate_up_proj"):  # [E, 2F, D] in memory, per expert in files
        f = w.shape[1] // 2
        for j in range(w.shape[0]):
          p[j, :f] = quantized(f"{name[:-len('gate_up_proj')]}{j}.gate_proj.weight", w[j, :f])
          p[j, f:] = quantized(f"{name[:-len('gate_up_proj')]}{j}.up_proj.weight", w[j, f:])
      elif name.endswith("experts.down_proj"):
        for j in range(w.shape[0]):
          p[j] = quantized(f"{name[:-len('down_proj')]}{j}.down_proj.weight", w[j])
      elif ".layers." in name and name.endswith("proj.weight") and p.ndim == 2:
        p.copy_(quantized(name, w))
      else:
        tensors[name] = p.detach().contiguous()
    for name, b in hf.named_buffers():
      if name.endswith("e_score_correction_bias"):
        tensors[name] = b.detach().contiguous()
  hf.config.save_pretrained(folder)
  config = json.loads((folder / "config.json").read_text())
  config["architectures"] = [type(hf).__name__]
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic",
                                   "weight_block_size": list(block)}
  (folder / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(folder / "model.safetensors"))
  return hf


def test_read_tensor_decodes_float8_as_torch_does(tmp_path):
  from safetensors.torch import save_file
  x = (torch.randn(7, 9) * 30).to(torch.float8_e4m3fn)
  save_file({"a": torch.ones(3), "w": x}, str(tmp_path / "t.safetensors"))
  got = fp8.read_tensor(str(tmp_path / "t.safetensors"), "w")
  np.testing.assert_array_equal(got.astype(np.float32), x.float().numpy())
  with pytest.raises(ValueError, match="tensor a .* is F32, not a float8"):
    fp8.read_tensor(str(tmp_path / "t.safetensors"), "a")


def test_quantize_and_dequantize_blocks():
  w = np.random.default_rng(0).normal(size=(40, 70)).astype(np.float32)
  w[:16, :32] *= 100  # one block far larger: its own scale
  w8, scale_inv = fp8.quantize(w, BLOCK)
  assert scale_inv.shape == (3, 3)
  back = fp8.dequantize(w8, scale_inv, BLOCK)
  assert np.abs(back - w).max() <= np.abs(w).max() * 2 ** -4  # e4m3: 3 mantissa bits
  assert np.abs(back[16:, 32:] - w[16:, 32:]).max() < 0.2  # unharmed by the large block
  with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
    fp8.dequantize(w8, scale_inv[:2], BLOCK)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
def test_fp8_checkpoints_load_as_their_dequantized_weights(tmp_path, family):
  common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                initializer_range=0.3)
  if family == "deepseek_v3":
    cfg = transformers.DeepseekV3Config(
        **common, moe_intermediate_size=24, n_shared_experts=1, n_routed_experts=8,
        kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
        first_k_dense_replace=1)
    cls = transformers.DeepseekV3ForCausalLM
  else:
    cfg = transformers.Qwen3Config(**common, head_dim=12)
    cls = transformers.Qwen3ForCausalLM
  torch.manual_seed(0)
  hf = _quantized_folder(perturb(cls(cfg).float().eval()), tmp_path)
  ours = models.from_pretrained(str(tmp_path))
  np.testing.assert_allclose(np.asarray(ours(TOKENS)), hf_logits(hf, TOKENS), atol=1e-4,
                             rtol=0)


def test_fp8_configs_we_cannot_read_are_refused(tmp_path):
  torch.manual_seed(0)
  cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=80,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=4, head_dim=12)
  _quantized_folder(transformers.Qwen3ForCausalLM(cfg).float().eval(), tmp_path / "a")
  config = json.loads((tmp_path / "a" / "config.json").read_text())
  for quant, match in [({"fmt": "e5m2"}, "fmt e4m3"), ({"weight_block_size": None},
                                                         "weight_block_size")]:
    shutil.copytree(tmp_path / "a", tmp_path / "b", dirs_exist_ok=True)
    bad = {**config, "quantization_config": {**config["quantization_config"], **quant}}
    (tmp_path / "b" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match):
      models.from_pretrained(str(tmp_path / "b"))


def _channel_quantized_folder(hf, folder, kind):
  """Saves `hf` with its layers' linear weights float8 beside a scale that broadcasts
  over each: `kind` fbgemm (FBGEMM's: the MLPs alone, float32 [out, 1]; Llama 4's
  stacked experts [E, 1, 2F] and [E, D, 1]), channel / tensor (compressed-tensors',
  every projection, bfloat16 [out, 1] or [1], with the input scales static
  quantization writes beside them). Puts the dequantized weights back into `hf`."""
  from safetensors.torch import save_file
  tensors = {}

  def quantized(name, w, axis, scale_shape=None):  # amax over `axis` -> 448
    if kind == "block":  # compressed-tensors' blocks: DeepSeek's, named weight_scale
      w8, scale = fp8.quantize(w, BLOCK)
      tensors[name] = torch.from_numpy(w8.astype(np.float32)).to(torch.float8_e4m3fn)
      tensors[name + "_scale"] = torch.from_numpy(scale)
      return torch.from_numpy(fp8.dequantize(w8, scale, BLOCK))
    amax = np.abs(w).max(axis=axis, keepdims=True) if axis is not None else np.abs(w).max()
    scale = np.where(amax > 0, amax / fp8.FP8_MAX, 1.0).astype(np.float32)
    if kind == "channel" or kind == "tensor":  # bfloat16, as llm-compressor writes them
      scale = torch.from_numpy(scale).to(torch.bfloat16).float().numpy()
    w8 = (w / scale).astype(fp8.ml_dtypes.float8_e4m3fn)
    tensors[name] = torch.from_numpy(w8.astype(np.float32)).to(torch.float8_e4m3fn)
    stored = torch.from_numpy(np.asarray(scale).reshape(scale_shape or np.shape(scale)))
    tensors[name + "_scale"] = stored.to(torch.float32 if kind == "fbgemm" else torch.bfloat16)
    if kind != "fbgemm":
      tensors[name.replace(".weight", ".input_scale")] = torch.ones(1)
    return torch.from_numpy(w8.astype(np.float32) * scale)

  with torch.no_grad():
    for name, p in hf.named_parameters():
      w = p.detach().numpy()
      mlp = ".mlp." in name or ".feed_forward." in name
      if name.endswith("experts.gate_up_proj"):  # [E, D, 2F]: a scale per output column
        p.copy_(quantized(name, w, axis=1))
      elif name.endswith("experts.down_proj"):  # [E, F, D]: held [E, D, 1] in the files
        e, _, d = w.shape
        p.copy_(quantized(name, w, axis=1, scale_shape=(e, d, 1)))
      elif (".layers." in name and name.endswith("proj.weight") and p.ndim == 2
            and (mlp or kind != "fbgemm")):
        p.copy_(quantized(name, w, axis=None if kind == "tensor" else 1,
                          scale_shape=(1,) if kind == "tensor" else None))
      else:
        tensors[name] = p.detach().contiguous()
  hf.config.save_pretrained(folder)
  config = json.loads((folder / "config.json").read_text())
  config["architectures"] = [type(hf).__name__]
  if kind == "fbgemm":
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                     "modules_to_not_convert": ["self_attn", "lm_head"]}
  else:
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float",
                                                         "strategy": "tensor"},
            "weights": {"num_bits": 8, "type": "float", "strategy": kind, "symmetric": True,
                        **({"block_structure": list(BLOCK)} if kind == "block" else {})}}},
        "ignore": ["lm_head"]}
  (folder / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(folder / "model.safetensors"))
  return hf


@pytest.mark.parametrize("family,kind", [("llama", "fbgemm"), ("llama4", "fbgemm"),
                                         ("qwen3", "channel"), ("qwen3", "tensor"),
                                         ("qwen3", "block")])
def test_channel_scaled_fp8_checkpoints_load_as_their_dequantized_weights(tmp_path, family,
                                                                          kind):
  """FBGEMM's FP8 (Llama 3.1 405B FP8's MLPs; Llama 4 Maverick FP8's stacked experts,
  their down projection's scale held transposed, in its vision-language files) and
  compressed-tensors' (every projection, per channel, per tensor or per block; the
  input scales beside them not read): ours from the files equals transformers on the
  dequantized weights."""
  common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                initializer_range=0.3)
  if family == "llama4":
    cfg = transformers.Llama4TextConfig(**{**common, "intermediate_size": 24},
                                        intermediate_size_mlp=40, head_dim=12,
                                        num_local_experts=3, num_experts_per_tok=1,
                                        attention_chunk_size=4)
    cls = transformers.Llama4ForCausalLM
  elif family == "llama":
    cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
  else:
    cfg = transformers.Qwen3Config(**common, head_dim=12)
    cls = transformers.Qwen3ForCausalLM
  torch.manual_seed(0)
  hf = _channel_quantized_folder(perturb(cls(cfg).float().eval()), tmp_path, kind)
  if family == "llama4":  # as Maverick FP8 is published: Llama4ForConditionalGeneration's
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({"language_model." + k: v for k, v in tensors.items()},
              str(tmp_path / "model.safetensors"))
    text = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {k: v for k, v in text.items() if k != "quantization_config"},
        "quantization_config": text["quantization_config"], "tie_word_embeddings": False}))
  ours = models.from_pretrained(str(tmp_path))
  np.testing.assert_allclose(np.asarray(ours(TOKENS)), hf_logits(hf, TOKENS), atol=1e-4,
                             rtol=0)


def test_channel_scaled_fp8_we_cannot_read_is_refused(tmp_path):
  """Packed or 4-bit float compressed-tensors weights, and a scale that does not
  broadcast over its weight, each a one-line error. (Integer weights are
  tests/models/test_compressed.py's.)"""
  torch.manual_seed(0)
  cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=80,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=4, head_dim=12)
  _channel_quantized_folder(transformers.Qwen3ForCausalLM(cfg).float().eval(),
                            tmp_path / "a", "channel")
  config = json.loads((tmp_path / "a" / "config.json").read_text())
  quant = config["quantization_config"]
  weights = quant["config_groups"]["group_0"]["weights"]
  for bad in ({**quant, "format": "pack-quantized"},
              {**quant, "config_groups": {"group_0": {"weights": {**weights, "num_bits": 4}}}}):
    shutil.copytree(tmp_path / "a", tmp_path / "b", dirs_exist_ok=True)
    (tmp_path / "b" / "config.json").write_text(json.dumps({**config,
                                                             "quantization_config": bad}))
    with pytest.raises(ValueError, match="only 8-bit float weights"):
      models.from_pretrained(str(tmp_path / "b"))
  with pytest.raises(ValueError, match=r"the scale of w, of shape \(3, 1\), does not "
                                       r"broadcast over its weight of shape \(4, 5\)"):
    fp8.dequantize_broadcast("w", np.zeros((4, 5), fp8.ml_dtypes.float8_e4m3fn),
                             np.ones((3, 1)))
