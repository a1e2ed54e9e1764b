"""Gemma, Gemma 2 and Gemma 3 (text) across the Hugging Face boundary: logits parity with
`transformers` (both layer layouts, every attention kernel), the config forms published
and written, export that loads back there, published sizes, and what we refuse."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import hf as hf_io
from posttrain.models.transformer import _rebuild

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=256, rms_norm_eps=1e-6)
# Three layers of both kinds; a window shorter than the rows, so that it cuts.
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=5, query_pre_attn_scalar=16, attn_logit_softcapping=4.0,
                    final_logit_softcapping=3.0, layer_types=LAYER_TYPES)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=5, query_pre_attn_scalar=16, layer_types=LAYER_TYPES,
                    rope_parameters={
                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                           "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 19))
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(family, **extra):
  config_class, model_class, fields = FAMILIES[family]
  cfg = getattr(transformers, config_class)(**{**COMMON, **fields, **extra})
  torch.manual_seed(0)
  model = getattr(transformers, model_class)(cfg).float().eval()
  with torch.no_grad():  # Norms away from zero (w is an offset from 1); larger weights,
    for name, p in model.named_parameters():  # so that the soft caps bite.
      if "norm" in name:
        p.add_(torch.randn_like(p) * 0.3)
      else:
        p.mul_(5.0)
  return model


def _hf_logits(model, tokens=TOKENS):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _our_logits(model, tokens=TOKENS):
  return np.asarray(_jitted_logits(model, jnp.asarray(tokens)))


def _close(got, want, tol=1e-4):
  scale = max(1.0, float(np.abs(want).max()))
  err = float(np.abs(np.asarray(got) - want).max())
  assert err <= tol * scale, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """family -> (folder with the HF files, HF logits)."""
  out = {}
  for family in FAMILIES:
    folder = tmp_path_factory.mktemp(family)
    hf = _hf_model(family)
    hf.save_pretrained(folder)
    out[family] = (folder, _hf_logits(hf))
  return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scan_layers", [False, True])
def test_logits_match_transformers(saved, family, scan_layers):
  folder, want = saved[family]
  ours = models.from_pretrained(str(folder), scan_layers=scan_layers)
  cfg = ours.cfg
  assert cfg.architecture == FAMILIES[family][1]
  assert cfg.norm_unit_offset and cfg.embed_scale and cfg.mlp_activation == "gelu_tanh"
  assert cfg.sandwich_norms == (family != "gemma") and cfg.qk_norm == (family == "gemma3")
  if family != "gemma":
    assert cfg.sliding_layers == (True, False, True) and cfg.sliding_window == 5
    assert cfg.query_pre_attn_scalar == 16.0
  if family == "gemma2":
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (4.0, 3.0)
  if family == "gemma3":
    assert (cfg.rope.type, cfg.rope.theta, cfg.rope.factor) == ("linear", 1e6, 8.0)
    assert (cfg.rope_local.type, cfg.rope_local.theta) == ("default", 100.0)
  _close(_our_logits(ours), want)


def test_the_window_the_caps_and_the_local_rope_each_change_the_logits(saved):
  """So that the parity above covers them: without each, the logits move."""
  for family, change in [("gemma2", dict(sliding_window=None, layer_types=())),
                         ("gemma2", dict(attn_logit_softcap=None)),
                         ("gemma2", dict(final_logit_softcap=None)),
                         ("gemma2", dict(query_pre_attn_scalar=None)),
                         ("gemma3", dict(rope_local=None)),
                         ("gemma3", dict(sandwich_norms=False))]:
    folder, want = saved[family]
    ours = models.from_pretrained(str(folder))
    if "sandwich_norms" in change:
      cfg = ours.cfg.replace(**change)
      pure = nnx.to_pure_dict(nnx.state(ours))
      for layer in pure["layers"].values():
        layer.pop("attn_out_norm"), layer.pop("mlp_out_norm")
      other = _rebuild(cfg, pure)
    else:
      other = _rebuild(ours.cfg.replace(**change), nnx.to_pure_dict(nnx.state(ours)))
    assert np.abs(_our_logits(other) - want).max() > 1e-2, change


@pytest.mark.parametrize("impl,extra", [("chunked", dict(attention_chunk=8)),
                                        ("flash", {})])
def test_every_attention_kernel_gives_the_same_logits(saved, impl, extra):
  folder, want = saved["gemma2"]
  ours = models.from_pretrained(str(folder), attention_impl=impl, **extra)
  _close(_our_logits(ours), want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_and_round_trips(saved, tmp_path, family):
  folder, want = saved[family]
  ours = models.from_pretrained(str(folder))
  models.save_pretrained(ours, str(tmp_path / "out"))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == {"gemma": "gemma", "gemma2": "gemma2",
                                   "gemma3": "gemma3_text"}[family]
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
  assert back.__class__.__name__ == FAMILIES[family][1]
  _close(_hf_logits(back), want, tol=1e-5)
  again = models.from_pretrained(str(tmp_path / "out"))
  assert again.cfg == ours.cfg
  np.testing.assert_array_equal(_our_logits(again), _our_logits(ours))


def test_published_gemma3_config_form_is_read(tmp_path):
  """The hub's Gemma 3 files: rope_theta / rope_scaling (full layers),
  rope_local_base_freq and sliding_window_pattern, no layer_types."""
  hf = _hf_model("gemma3", num_hidden_layers=4, layer_types=None, rope_parameters=None,
                 sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 4.0},
                 rope_theta=5e5, rope_local_base_freq=50.0)
  assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
  hf.save_pretrained(tmp_path)
  c = json.loads((tmp_path / "config.json").read_text())
  for key in ("layer_types", "rope_parameters"):
    c.pop(key)
  c.update(sliding_window_pattern=2, rope_theta=5e5, rope_local_base_freq=50.0,
           rope_scaling={"rope_type": "linear", "factor": 4.0})
  (tmp_path / "config.json").write_text(json.dumps(c))
  ours = models.from_pretrained(str(tmp_path))
  assert ours.cfg.sliding_layers == (True, False, True, False)
  assert (ours.cfg.rope.theta, ours.cfg.rope.type, ours.cfg.rope.factor) == (5e5, "linear", 4.0)
  assert ours.cfg.rope_local.theta == 50.0
  _close(_our_logits(ours), _hf_logits(hf))


def test_gemma_legacy_hidden_act_gelu_means_tanh(tmp_path):
  hf = _hf_model("gemma")
  hf.save_pretrained(tmp_path)
  c = json.loads((tmp_path / "config.json").read_text())
  c["hidden_act"] = "gelu"  # as the first Gemma releases wrote it
  (tmp_path / "config.json").write_text(json.dumps(c))
  ours = models.from_pretrained(str(tmp_path))
  assert ours.cfg.mlp_activation == "gelu_tanh"
  _close(_our_logits(ours), _hf_logits(hf))


@pytest.mark.parametrize("preset,config_class,model_class", [
    ("gemma2_2b", "Gemma2Config", "Gemma2ForCausalLM"),
    ("gemma3_1b", "Gemma3TextConfig", "Gemma3ForCausalLM"),
    ("gemma3_12b", "Gemma3TextConfig", "Gemma3ForCausalLM"),
])
def test_presets_have_the_published_shape(preset, config_class, model_class):
  cfg = models.get_preset(preset)
  c = hf_io.model_config_to_hf(cfg)
  c.pop("architectures"), c.pop("model_type")
  hf_cfg = getattr(transformers, config_class)(**c)
  with torch.device("meta"):
    hf = getattr(transformers, model_class)(hf_cfg)
  assert cfg.num_params == sum(p.numel() for p in hf.parameters())
  published = {"gemma2_2b": 2_614_341_888, "gemma3_1b": 999_885_952}
  assert cfg.num_params == published.get(preset, cfg.num_params)
  assert hf_io.hf_config_to_model_config({**c, "architectures": [model_class]}).replace(
      dtype=cfg.dtype, param_dtype=cfg.param_dtype, remat=cfg.remat,
      scan_layers=cfg.scan_layers) == cfg


def test_configs_we_cannot_hold_or_write_are_refused(tmp_path):
  c = hf_io.model_config_to_hf(models.get_preset("gemma2_2b"))
  with pytest.raises(ValueError, match="use_bidirectional_attention"):
    hf_io.hf_config_to_model_config({**c, "use_bidirectional_attention": True})
  with pytest.raises(ValueError, match="hidden_act='relu'"):
    hf_io.hf_config_to_model_config({**c, "hidden_activation": "relu"})
  gemma2 = models.get_preset("gemma2_2b")
  with pytest.raises(ValueError, match="cannot be written as LlamaForCausalLM"):
    hf_io.check_exportable(gemma2.replace(architecture="LlamaForCausalLM"))
  with pytest.raises(ValueError, match=r"\['attn_logit_softcap', 'final_logit_softcap', "
                                       r"'query_pre_attn_scalar', 'sliding_window'\]"):
    hf_io.check_exportable(gemma2.replace(architecture="GemmaForCausalLM", sandwich_norms=False))
  with pytest.raises(ValueError, match="rope_local cannot be written as Gemma2ForCausalLM"):
    hf_io.check_exportable(gemma2.replace(rope_local=models.RopeConfig(theta=1.0)))
  with pytest.raises(ValueError, match="layer_types has 2 entries for num_layers=26"):
    gemma2.replace(layer_types=("full_attention",) * 2)
  with pytest.raises(ValueError, match="expected entries in"):
    gemma2.replace(layer_types=("global",) * 26)
  with pytest.raises(ValueError, match="sliding_window is None"):
    gemma2.replace(sliding_window=None)
  with pytest.raises(ValueError, match="mlp_activation='relu'"):
    gemma2.replace(mlp_activation="relu")
  with pytest.raises(ValueError, match="final_logit_softcap must be a positive number"):
    gemma2.replace(final_logit_softcap=0.0)
  # GeGLU experts are a model's (Gemma 4's), but not Mixtral's files'.
  with pytest.raises(ValueError, match="mlp_activation='gelu_tanh' cannot be written as "
                                       "MixtralForCausalLM"):
    models.hf.check_exportable(
        models.get_preset("mixtral_8x7b").replace(mlp_activation="gelu_tanh"))


def test_layer_types_survive_a_json_round_trip_of_the_config():
  cfg = models.get_preset("gemma3_1b")
  back = models.ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
  assert back == cfg and hash(back) == hash(cfg)
  assert isinstance(back.layer_types, tuple) and isinstance(back.rope_local, models.RopeConfig)
  assert cfg.replace(layer_types="sliding_attention," * 25 + "full_attention").sliding_layers \
      == (True,) * 25 + (False,)


def test_fewer_layers_keep_the_pattern_of_layer_kinds():
  """A shrunk preset (a run's num_layers override) keeps its kinds' period."""
  from posttrain import experiment
  assert models.get_preset("gemma2_2b", num_layers=3).sliding_layers == (True, False, True)
  assert models.get_preset("gemma3_1b", num_layers=7).sliding_layers == (True,) * 5 + (
      False, True)
  assert models.get_preset("gemma3_1b", num_layers=2, layer_types=()).sliding_layers == (
      True, True)  # given explicitly: empty, so every layer slides (sliding_window is set)
  assert experiment.reward_architecture("Gemma3ForCausalLM") == \
      "Gemma3TextForSequenceClassification"
  assert experiment.reward_architecture("Gemma2ForCausalLM") == \
      "Gemma2ForSequenceClassification"


def test_gemma3_vision_language_checkpoint_loads_its_language_model(tmp_path):
  """Gemma 3 4B / 12B / 27B are Gemma3ForConditionalGeneration files: the language model
  is read alone (text_config, language_model.* tensors; the vision tower left), computes
  what transformers' model does on text, and exports as a Gemma3ForCausalLM."""
  from safetensors.numpy import load_file, save_file
  text = {**COMMON, **FAMILIES["gemma3"][2]}
  cfg = transformers.Gemma3Config(
      text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=28, patch_size=14),
      mm_tokens_per_image=4, image_token_index=96, boi_token_index=94, eoi_token_index=95)
  torch.manual_seed(0)
  hf = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "language_model" in name:
        p.add_(torch.randn_like(p) * 0.3) if "norm" in name else p.mul_(5.0)
  hf.save_pretrained(tmp_path / "vl")
  tokens = TOKENS % 94  # text only: no image tokens
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(tokens)).logits.numpy()
  ours = models.from_pretrained(str(tmp_path / "vl"))
  assert ours.cfg.architecture == "Gemma3ForCausalLM" and ours.cfg.qk_norm
  assert ours.cfg.rope_local.theta == 100.0 and ours.cfg.sliding_layers == (True, False, True)
  _close(_our_logits(ours, tokens), want)

  # The other naming of the same tensors (model.language_model.X).
  (tmp_path / "vl2").mkdir()
  tensors = load_file(str(tmp_path / "vl" / "model.safetensors"))
  save_file({k.replace("language_model.model.", "model.language_model.", 1): v
             for k, v in tensors.items()}, str(tmp_path / "vl2" / "model.safetensors"))
  (tmp_path / "vl2" / "config.json").write_text((tmp_path / "vl" / "config.json").read_text())
  again = models.from_pretrained(str(tmp_path / "vl2"))
  np.testing.assert_array_equal(_our_logits(again, tokens), _our_logits(ours, tokens))

  models.save_pretrained(ours, str(tmp_path / "text"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").float().eval()
  assert back.__class__.__name__ == "Gemma3ForCausalLM"
  _close(_hf_logits(back, tokens), want, tol=1e-5)
  with pytest.raises(ValueError, match="adapters on a vision-language checkpoint"):
    models.from_pretrained(str(tmp_path / "vl"), adapter=str(tmp_path))
  # A sparse text_config (as published) takes Gemma 3's defaults for what it leaves out.
  c = json.loads((tmp_path / "vl" / "config.json").read_text())
  c["text_config"] = {"hidden_size": 2560, "intermediate_size": 10240,
                      "num_hidden_layers": 34, "sliding_window": 1024,
                      "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                      "model_type": "gemma3_text"}
  c.pop("dtype", None)
  c["torch_dtype"] = "bfloat16"  # as published
  four_b = hf_io.hf_config_to_model_config(c)
  assert (four_b.vocab_size, four_b.num_heads, four_b.num_kv_heads, four_b.head_dim) == (
      262_208, 8, 4, 256)
  assert four_b.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(34))
  assert (four_b.rope.theta, four_b.rope.type, four_b.rope.factor) == (1e6, "linear", 8.0)
  assert four_b.rope_local.theta == 10_000.0 and four_b.param_dtype == "bfloat16"
  assert four_b.query_pre_attn_scalar == 256.0 and four_b.tie_embeddings


def test_lora_adapters_on_gemma_load_in_peft(saved, tmp_path):
  """Adapters trained here on a scanned Gemma 2 (every projection) are a PEFT adapter
  that computes the same logits on transformers' model."""
  peft = pytest.importorskip("peft", reason="adapter tests need peft (pip install '.[parity]')")
  folder, _ = saved["gemma2"]
  ours = models.from_pretrained(str(folder), lora_rank=3, lora_alpha=5.0, scan_layers=True)
  rng = np.random.default_rng(1)
  for path, v in nnx.iter_graph(ours):  # nonzero B: fresh adapters change nothing
    if isinstance(v, nnx.LoRAParam) and str(path[-1]).endswith("_lora_b"):
      v[...] = jnp.asarray(rng.normal(size=v.shape) * 0.1, v.dtype)
  want = _our_logits(ours)
  models.save_lora_adapter(ours, str(tmp_path / "adapter"), base_model_name_or_path="tiny")
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
  assert np.abs(_hf_logits(hf) - want).max() > 1e-2  # the adapters matter
  pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
  _close(_hf_logits(pm), want)
