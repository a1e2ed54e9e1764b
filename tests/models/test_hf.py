"""Hugging Face import/export: logits parity with `transformers`, round trips, bad files."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
              num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=256,
              rms_norm_eps=1e-6)


def _hf_model(family, tie=False, rope=None, **extra):
  kw = dict(COMMON, tie_word_embeddings=tie, **extra)
  if rope is not None:
    kw["rope_parameters"] = rope
  if family == "llama":
    cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
  elif family == "mistral":
    cfg, cls = transformers.MistralConfig(**kw), transformers.MistralForCausalLM
  elif family == "qwen2":
    cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
  else:
    cfg, cls = transformers.Qwen3Config(head_dim=12, **kw), transformers.Qwen3ForCausalLM
  torch.manual_seed(0)
  model = cls(cfg).float().eval()
  with torch.no_grad():  # Random (non-unit) norms and biases so every tensor matters.
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(torch.randn_like(p) * 0.1)
  return model


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


TOKENS = np.random.default_rng(0).integers(0, 97, (2, 19))

# Our logits in one compiled call per model; an eager call runs op by op and takes seconds.
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _our_logits(model, tokens=TOKENS):
  return np.asarray(_jitted_logits(model, jnp.asarray(tokens)))


CASES = [
    ("llama", False, None),
    ("llama", True, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16}),
    ("llama", False, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ("qwen2", False, None),
    ("qwen2", True, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                     "original_max_position_embeddings": 32}),
    ("qwen3", False, None),
    ("qwen3", True, None),
]
# attention_bias: Llama's and Qwen3's covers the output projection too.
BIASED = [("llama", False, None), ("qwen3", False, None)]


@pytest.mark.parametrize("family,tie,rope", CASES)
def test_logits_match_transformers(tmp_path, family, tie, rope):
  hf = _hf_model(family, tie, rope)
  hf.save_pretrained(tmp_path, safe_serialization=True)
  ours = models.from_pretrained(str(tmp_path))
  got = _our_logits(ours)
  want = _hf_logits(hf, TOKENS)
  assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("family,tie,rope", BIASED)
def test_attention_bias_on_every_projection_in_and_out(tmp_path, family, tie, rope):
  hf = _hf_model(family, tie, rope, attention_bias=True)
  assert hf.model.layers[0].self_attn.o_proj.bias is not None
  hf.save_pretrained(tmp_path / "a")
  ours = models.from_pretrained(str(tmp_path / "a"))
  assert ours.cfg.qkv_bias and ours.cfg.attn_out_bias
  assert np.abs(_our_logits(ours) - _hf_logits(hf, TOKENS)).max() <= 1e-4
  models.save_pretrained(ours, str(tmp_path / "b"))
  back = type(hf).from_pretrained(tmp_path / "b").float().eval()
  assert np.abs(_hf_logits(back, TOKENS) - _hf_logits(hf, TOKENS)).max() <= 1e-6


def test_mistral_ignores_attention_bias_as_transformers_does(tmp_path):
  """transformers' Mistral has no attention biases whatever config.json's attention_bias
  says: such a folder loads without them, and a model with them is not written as one."""
  hf = _hf_model("mistral", attention_bias=True)
  assert hf.model.layers[0].self_attn.q_proj.bias is None
  hf.save_pretrained(tmp_path)
  ours = models.from_pretrained(str(tmp_path))
  assert not ours.cfg.qkv_bias and not ours.cfg.attn_out_bias
  assert np.abs(_our_logits(ours) - _hf_logits(hf, TOKENS)).max() <= 1e-4
  with pytest.raises(ValueError, match="qkv_bias=True cannot be written as MistralForCausalLM"):
    models.hf.check_exportable(ours.cfg.replace(qkv_bias=True))


def test_legacy_rope_scaling_form_is_read(tmp_path):
  hf = _hf_model("llama", rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16})
  hf.save_pretrained(tmp_path)
  cfg_file = tmp_path / "config.json"
  c = json.loads(cfg_file.read_text())
  params = c.pop("rope_parameters")
  c["rope_theta"] = params.pop("rope_theta")
  c["rope_scaling"] = {**params, "type": params.pop("rope_type")}  # hub-style, old key name
  cfg_file.write_text(json.dumps(c))
  ours = models.from_pretrained(str(tmp_path))
  assert ours.cfg.rope.type == "llama3" and ours.cfg.rope.theta == 500000.0
  assert np.abs(_our_logits(ours) - _hf_logits(hf, TOKENS)).max() <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_save_pretrained_round_trip_loads_in_transformers(tmp_path, family):
  hf = _hf_model(family)
  hf.save_pretrained(tmp_path / "a")
  ours = models.from_pretrained(str(tmp_path / "a"))
  models.save_pretrained(ours, str(tmp_path / "b"), max_shard_bytes=20_000)  # sharded + index
  assert (tmp_path / "b" / "model.safetensors.index.json").exists()
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").float().eval()
  assert np.abs(_hf_logits(back, TOKENS) - _hf_logits(hf, TOKENS)).max() <= 1e-5
  again = models.from_pretrained(str(tmp_path / "b"))
  assert np.abs(_our_logits(again) - _our_logits(ours)).max() == 0


@pytest.mark.slow
def test_load_onto_a_mesh_shards_each_tensor(tmp_path):
  hf = _hf_model("qwen3", num_key_value_heads=5)
  hf.save_pretrained(tmp_path)
  mesh = models.make_mesh((1, 2, 1, 1), devices=jax.devices()[:2])
  m = models.from_pretrained(str(tmp_path), mesh=mesh, dtype="float32")
  assert m.layers[0].mlp.up_proj[...].sharding.spec[0] == "fsdp"
  got = _our_logits(m)
  assert np.abs(got - _hf_logits(hf, TOKENS)).max() <= 1e-4


def test_bad_checkpoints_name_the_problem(tmp_path):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path)
  from safetensors.numpy import load_file, save_file
  path = tmp_path / "model.safetensors"
  tensors = load_file(path)

  c = json.loads((tmp_path / "config.json").read_text())
  c["architectures"] = ["RwkvForCausalLM"]
  (tmp_path / "config.json").write_text(json.dumps(c))
  with pytest.raises(ValueError, match="unsupported architecture.*RwkvForCausalLM"):
    models.from_pretrained(str(tmp_path))
  c["architectures"] = ["LlamaForCausalLM"]
  (tmp_path / "config.json").write_text(json.dumps(c))

  broken = dict(tensors)
  del broken["model.layers.1.mlp.up_proj.weight"]
  save_file(broken, path)
  with pytest.raises(ValueError, match="missing tensors.*layers.1.mlp.up_proj"):
    models.from_pretrained(str(tmp_path))

  save_file({**tensors, "model.layers.9.extra.weight": np.zeros(3, np.float32)}, path)
  with pytest.raises(ValueError, match="unexpected tensors.*layers.9.extra"):
    models.from_pretrained(str(tmp_path))

  wrong = dict(tensors)
  wrong["model.norm.weight"] = np.zeros(41, np.float32)
  save_file(wrong, path)
  with pytest.raises(ValueError, match=r"model.norm.weight has shape \(41,\)"):
    models.from_pretrained(str(tmp_path))
  # A truncated download: cut in the header, then in the data.
  save_file(tensors, path)
  whole = path.read_bytes()
  for cut in (100, len(whole) - 64):
    path.write_bytes(whole[:cut])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors "
                       "file") as info:
      models.from_pretrained(str(tmp_path))
    assert "\n" not in str(info.value)
  # A sharded folder whose index names a file that is not there.
  path.write_bytes(whole)
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {name: "model-00002.safetensors" for name in tensors}}))
  with pytest.raises(FileNotFoundError, match="model-00002.safetensors does not exist"):
    models.from_pretrained(str(tmp_path))
  os.remove(tmp_path / "model.safetensors.index.json")
  os.remove(path)
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    models.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_window_layers_are_read_and_written(tmp_path, family):
  """use_sliding_window: the layers from max_window_layers on attend over the window
  (shorter than the rows here); read, computed and written back as transformers does."""
  hf = _hf_model(family, num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                 max_window_layers=1)
  hf.save_pretrained(tmp_path / "a")
  ours = models.from_pretrained(str(tmp_path / "a"))
  assert ours.cfg.sliding_window == 4 and ours.cfg.sliding_layers == (False, True, True)
  want = _hf_logits(hf, TOKENS)
  assert np.abs(_our_logits(ours) - want).max() <= 1e-4
  unwindowed = models.from_pretrained(str(tmp_path / "a"), sliding_window=None, layer_types=())
  assert np.abs(_our_logits(unwindowed) - want).max() > 1e-2  # the window matters here
  models.save_pretrained(ours, str(tmp_path / "b"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").float().eval()
  assert back.config.use_sliding_window and back.config.layer_types == [
      "full_attention", "sliding_attention", "sliding_attention"]
  assert np.abs(_hf_logits(back, TOKENS) - want).max() <= 1e-5
  c = json.loads((tmp_path / "a" / "config.json").read_text())
  c["use_sliding_window"] = False  # the window is off, whatever else the file says
  assert models.hf_config_to_model_config(c).sliding_window is None


@pytest.mark.parametrize("window", [4, None])
def test_mistral_with_and_without_its_window(tmp_path, window):
  """MistralForCausalLM: Llama's layers with, in v0.1, a window over every layer (shorter
  than the rows here; v0.2 on write null)."""
  hf = _hf_model("mistral", sliding_window=window)
  hf.save_pretrained(tmp_path / "a")
  ours = models.from_pretrained(str(tmp_path / "a"))
  assert ours.cfg.architecture == "MistralForCausalLM" and ours.cfg.sliding_window == window
  want = _hf_logits(hf, TOKENS)
  assert np.abs(_our_logits(ours) - want).max() <= 1e-4
  models.save_pretrained(ours, str(tmp_path / "b"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").float().eval()
  assert back.__class__.__name__ == "MistralForCausalLM"
  assert back.config.sliding_window == window
  assert np.abs(_hf_logits(back, TOKENS) - want).max() <= 1e-5
  if window:
    c = json.loads((tmp_path / "a" / "config.json").read_text())
    del c["sliding_window"]  # absent: transformers' default, 4096
    assert models.hf_config_to_model_config(c).sliding_window == 4096
    with pytest.raises(ValueError, match="whose window applies to every layer"):
      models.hf.check_exportable(ours.cfg.replace(layer_types=("full_attention",
                                                               "sliding_attention")))
