"""bitsandbytes checkpoints (the *-bnb-4bit uploads, LLM.int8 folders): folders written by
transformers with bitsandbytes itself, read back against transformers' own dequantized
model and bitsandbytes' codes; a QLoRA base holds the file's NF4 codes where its blocks
are the file's; damaged or foreign quantized files are one-line errors."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import bnb, quant
from tests.models.test_quant import assert_same_codes

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
pytest.importorskip("bitsandbytes", reason="bitsandbytes checkpoints need bitsandbytes to write")

TOKENS = np.arange(16)[None] % 97
# name -> BitsAndBytesConfig arguments (compute dtype float32: the tiny models are float32)
SCHEMES = {
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                       bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "nf4-bf16-storage": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_quant_storage="bfloat16"),
    "int8": dict(load_in_8bit=True),
}


def _llama():
  cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=192,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, initializer_range=0.3)
  torch.manual_seed(0)
  return transformers.LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """scheme -> (a folder transformers saved quantized, its dequantized model's logits and
  state dict), from one float32 Llama."""
  root = tmp_path_factory.mktemp("bnb")
  _llama().save_pretrained(root / "plain")
  out = {}
  for name, kw in SCHEMES.items():
    kw = {k: getattr(torch, v) if k.endswith("storage") else v for k, v in kw.items()}
    q = transformers.LlamaForCausalLM.from_pretrained(
        root / "plain", device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
            bnb_4bit_compute_dtype=torch.float32, **kw))
    q.save_pretrained(root / name)
    ref = transformers.LlamaForCausalLM.from_pretrained(root / name, device_map="cpu")
    ref = ref.dequantize().float().eval()
    with torch.no_grad():
      logits = ref(torch.as_tensor(TOKENS)).logits.numpy()
    out[name] = (str(root / name), logits, {k: v.float().numpy() for k, v in
                                            ref.state_dict().items()})
  return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantized_folders_load_as_their_dequantized_weights(folders, scheme):
  """Every quantized weight, NF4 or FP4, double quantized or stored as bfloat16 bytes, or
  LLM.int8, reads as bitsandbytes dequantizes it: bit for bit, and the logits of
  transformers' dequantized model."""
  folder, want, state = folders[scheme]
  ours = models.from_pretrained(folder)
  np.testing.assert_allclose(np.asarray(ours(TOKENS)), want, atol=1e-4, rtol=0)
  layer = ours.layers[1]
  np.testing.assert_array_equal(np.asarray(layer.mlp.down_proj[...]),
                                state["model.layers.1.mlp.down_proj.weight"].T)
  np.testing.assert_array_equal(np.asarray(layer.attn.q_proj[...]),
                                state["model.layers.1.self_attn.q_proj.weight"].T.reshape(
                                    128, 4, 32))


def _file_state(folder, name):
  """(the file's NF4 codes [out, in], each block's absmax [out, in / 64]) of weight `name`,
  decoded with bitsandbytes."""
  import bitsandbytes.functional as F
  from safetensors.torch import load_file
  tensors = load_file(f"{folder}/model.safetensors")
  parts = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
  qs = F.QuantState.from_dict(parts, device=torch.device("cpu"))
  packed = tensors[name].view(torch.uint8).reshape(-1).numpy()
  codes = np.stack([packed >> 4, packed & 15], -1).reshape(qs.shape)
  absmax = qs.absmax
  if qs.nested:
    absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
  return codes, absmax.float().numpy().reshape(qs.shape[0], -1)


@pytest.mark.parametrize("scheme", ["nf4-double", "nf4-bf16-storage"])
@pytest.mark.parametrize("scan", [False, True])
def test_an_nf4_base_keeps_the_files_codes(folders, scheme, scan):
  """A QLoRA base in NF4 read from an NF4 folder holds the file's codes and (rounded to
  bfloat16) its absmax wherever its blocks are the file's (q, k, v, gate, up, down: 64
  inputs of one output): quantizing the dequantized weight in the same blocks gives them
  back. o_proj, whose blocks run across heads, is its dequantized weight quantized."""
  folder, _, state = folders[scheme]
  ours = models.from_pretrained(folder, lora_rank=4, base_quantization="nf4",
                                scan_layers=scan)
  for i in range(2):
    layer = ours.layers if scan else ours.layers[i]
    for module, hf_module, names in (("attn", "self_attn", ("q_proj", "k_proj", "v_proj")),
                                     ("mlp", "mlp", ("gate_proj", "up_proj", "down_proj"))):
      for name in names:
        q = getattr(getattr(layer, module), name).get_value()
        if scan:
          q = jax.tree.map(lambda x: x[i], q)  # noqa: B023
        codes, absmax = _file_state(folder, f"model.layers.{i}.{hf_module}.{name}.weight")
        out = codes.shape[0]
        # ours [in, *out]: blocks and pairs along `in`, the first axis
        got_codes = np.asarray(quant._unpacked(np.asarray(q.values), q.axis, np))
        np.testing.assert_array_equal(got_codes.reshape(-1, out), codes.T, err_msg=name)
        np.testing.assert_array_equal(
            np.asarray(q.scales).reshape(-1, out),
            absmax.T.astype(ml_dtypes.bfloat16), err_msg=name)
    o = layer.attn.o_proj.get_value()
    o_ref = quant.quantize(state[f"model.layers.{i}.self_attn.o_proj.weight"].T.reshape(
        4, 32, 128), "nf4", axis=-3)
    o = jax.tree.map(lambda x: x[i], o) if scan else o  # noqa: B023
    np.testing.assert_array_equal(np.asarray(o.values), o_ref.values)
    np.testing.assert_array_equal(np.asarray(o.scales), o_ref.scales)


def test_other_bases_are_quantized_from_the_dequantized_weights(folders):
  """An int8 base (or an NF4 one from FP4 or LLM.int8 files) quantizes the weight the file
  dequantizes to, as from a plain folder holding it."""
  for scheme, kind in (("nf4-double", "int8"), ("fp4", "nf4"), ("int8", "nf4")):
    folder, _, state = folders[scheme]
    ours = models.from_pretrained(folder, lora_rank=4, base_quantization=kind)
    q = ours.layers[0].mlp.gate_proj.get_value()
    ref = quant.quantize(state["model.layers.0.mlp.gate_proj.weight"].T, kind, axis=-2)
    np.testing.assert_array_equal(np.asarray(q.values), ref.values, err_msg=scheme)
    np.testing.assert_array_equal(np.asarray(q.scales), ref.scales, err_msg=scheme)


def test_an_nf4_folder_reads_onto_a_mesh_as_on_one_device(folders):
  folder = folders["nf4-double"][0]
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  kw = dict(lora_rank=4, base_quantization="nf4", scan_layers=True)
  sharded, plain = (models.from_pretrained(folder, mesh=m, **kw) for m in (mesh, None))
  assert assert_same_codes(sharded, plain, mesh) == 7


def _copy(folders, scheme, tmp_path):
  shutil.copytree(folders[scheme][0], tmp_path / "f")
  return tmp_path / "f"


def _rewrite(folder, fn):
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(folder / "model.safetensors"))
  fn(tensors)
  save_file(tensors, str(folder / "model.safetensors"))


def test_damaged_or_foreign_quantized_folders_are_one_line_errors(folders, tmp_path):
  name = "model.layers.0.mlp.up_proj.weight"
  state = name + ".quant_state.bitsandbytes__nf4"
  cases = [
      (lambda t: t.__setitem__(name + ".absmax", t[name + ".absmax"][:-1]),
       f"{name}.absmax has 383 scales, expected 384"),
      (lambda t: t.__setitem__(state, np.frombuffer(b"{not json", np.uint8).copy()),
       f"{state} is not a bitsandbytes quantization state"),
      (lambda t: t.__setitem__(name, t[name][:-2]), f"{name} holds .* bytes of 4-bit codes"),
  ]
  for i, (damage, message) in enumerate(cases):
    folder = _copy(folders, "nf4-double", tmp_path / str(i))
    _rewrite(folder, damage)
    with pytest.raises(ValueError, match=message) as e:
      models.from_pretrained(str(folder))
    assert "\n" not in str(e.value)
  folder = _copy(folders, "int8", tmp_path / "int8")
  _rewrite(folder, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight_format",
                                           np.asarray(1, np.uint8)))
  with pytest.raises(ValueError, match="weight_format is 1: only row-major"):
    models.from_pretrained(str(folder))
  folder = _copy(folders, "fp4", tmp_path / "gptq")
  config = json.loads((folder / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
  (folder / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="quant_method 'gptq' is not read"):
    models.from_pretrained(str(folder))


def test_companions_are_read_with_their_weight():
  names = {"a.weight", "a.weight.absmax", "a.weight.quant_map",
           "a.weight.quant_state.bitsandbytes__nf4", "b.weight", "b.SCB", "b.weight_format",
           "c.weight"}
  assert bnb.packed4(names) == {"a.weight": "a.weight.quant_state.bitsandbytes__nf4"}
  assert bnb.companions(names, "4bit") == {"a.weight.absmax", "a.weight.quant_map",
                                           "a.weight.quant_state.bitsandbytes__nf4"}
  assert bnb.packed8(names) == {"b.weight"}
  assert bnb.companions(names, "8bit") == {"b.SCB", "b.weight_format"}
  assert bnb.method({"quantization_config": {"quant_method": "bitsandbytes",
                                             "load_in_4bit": True}}) == "4bit"
  assert bnb.method({"quantization_config": {"quant_method": "fp8"}}) is None
  with pytest.raises(ValueError, match="neither 4-bit nor 8-bit"):
    bnb.method({"quantization_config": {"quant_method": "bitsandbytes"}})


@pytest.mark.slow
def test_a_qlora_run_starts_from_a_bnb_4bit_folder(tmp_path):
  """RL through adapters on the NF4 base of a *-bnb-4bit folder: the run holds the file's
  own codes (as `from_pretrained` reads them), trains and finishes."""
  from posttrain import trainer
  from posttrain.metrics import read_metrics
  from posttrain.rl import state as state_lib
  from tests.test_trainer import LORA, _config
  plain = str(tmp_path / "plain")
  models.save_pretrained(models.create_model(trainer.model_config(_config()), seed=3), plain)
  q = transformers.AutoModelForCausalLM.from_pretrained(
      plain, device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
          load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
          bnb_4bit_compute_dtype=torch.float32))
  folder = str(tmp_path / "bnb")
  q.save_pretrained(folder)
  extra = {**LORA, "model.overrides.base_quantization": "nf4", "init_from": folder,
           "sft.steps": 0, "train.rl_steps": 2, "eval.seeds_per_domain": 0}
  run = str(tmp_path / "run")
  t = trainer.Trainer(_config(**extra), run)
  codes = [x for x in jax.tree.leaves(state_lib.split_trainable(t.state.params)[1])
           if x.dtype == np.uint8]
  read = models.from_pretrained(folder, lora_rank=4, lora_alpha=8.0, base_quantization="nf4")
  want = [x for x in jax.tree.leaves(nnx.state(read)) if x.dtype == np.uint8]
  assert len(codes) == len(want) == 7
  for a, b in zip(codes, want, strict=True):
    np.testing.assert_array_equal(a, b)
  t.writer.close()
  assert trainer.train(_config(**extra), run)["status"] == "done"
  rows = [r for r in read_metrics(run) if "reward/mean" in r]
  assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)


def test_per_expert_4bit_weights_read_into_a_mixture(tmp_path):
  """A mixture whose expert weights are each a 4-bit tensor (the per-expert linear layers
  transformers 4 quantized, as the *-bnb-4bit MoE uploads hold them; written here with
  bitsandbytes' own quantize_4bit): read plain, each expert is the weight bitsandbytes
  dequantizes; into an NF4 base, each expert's codes are the file's, and its weights
  those but for the scales rounded to bfloat16."""
  import bitsandbytes.functional as F
  from safetensors.torch import load_file, save_file
  cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=128, intermediate_size=192,
                                    moe_intermediate_size=64, num_experts=4,
                                    num_experts_per_tok=2, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    initializer_range=0.3)
  torch.manual_seed(0)
  transformers.Qwen3MoeForCausalLM(cfg).float().save_pretrained(tmp_path / "plain")
  tensors, dequantized = load_file(str(tmp_path / "plain" / "model.safetensors")), {}
  for name in [n for n in tensors if ".experts." in n]:
    q, state = F.quantize_4bit(tensors[name], blocksize=64, quant_type="nf4",
                               compress_statistics=True)
    dequantized[name] = F.dequantize_4bit(q, state)
    tensors[name] = q
    tensors.update({f"{name}.{k}": v for k, v in state.as_dict(packed=True).items()})
  (tmp_path / "bnb").mkdir()
  save_file(tensors, str(tmp_path / "bnb" / "model.safetensors"))
  config = json.loads((tmp_path / "plain" / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                   "bnb_4bit_quant_type": "nf4",
                                   "bnb_4bit_use_double_quant": True}
  (tmp_path / "bnb" / "config.json").write_text(json.dumps(config))
  plain = models.from_pretrained(str(tmp_path / "bnb"))  # dequantized, as bitsandbytes does
  up = np.asarray(plain.layers[1].mlp.up_proj[...])
  for j in range(4):
    np.testing.assert_array_equal(
        up[j], dequantized[f"model.layers.1.mlp.experts.{j}.up_proj.weight"].numpy().T)
  ours = models.from_pretrained(str(tmp_path / "bnb"), lora_rank=4, base_quantization="nf4")
  q = ours.layers[1].mlp.up_proj.get_value()  # [E, D, F], blocks along D
  got_codes = np.asarray(quant._unpacked(np.asarray(q.values), q.axis, np))
  for j in range(4):
    packed = tensors[f"model.layers.1.mlp.experts.{j}.up_proj.weight"].view(
        torch.uint8).reshape(-1).numpy()
    codes = np.stack([packed >> 4, packed & 15], -1).reshape(64, 128)  # [F, D]
    np.testing.assert_array_equal(got_codes[j], codes.T, err_msg=str(j))
  # what the base computes with: bitsandbytes' weights but for the scales' bfloat16
  np.testing.assert_allclose(quant.dequantize_numpy(jax.tree.map(np.asarray, q)), up,
                             rtol=2.0 ** -8, atol=0)
