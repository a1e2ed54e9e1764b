"""Ministral 3 (Ministral3ForCausalLM, and the language model of a
Mistral3ForConditionalGeneration folder: Ministral 3, Mistral Small 3.1 / 3.2) against
`transformers`: Mistral with YaRN and every layer's queries scaled up by position past
the pre-training context (attn_position_scale). Logits (layer list and scanned), greedy
generation through the sampler, export, the reward model, and what other classes
refuse."""

import json

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
# A pre-training context of 6 positions: the rows below cross it three times, so the
# queries' scale steps up (by 0.5 log 2, log 3, log 4).
_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
         "original_max_position_embeddings": 6, "beta_fast": 32.0, "beta_slow": 1.0,
         "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
VARIANTS = {
    "yarn": dict(rope_parameters=_YARN),
    # the default rotary embedding, every layer sliding over 5 keys
    "window": dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                    "original_max_position_embeddings": 6,
                                    "llama_4_scaling_beta": 0.5}, sliding_window=5),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(variant, cls="Ministral3ForCausalLM", **extra):
  cfg = transformers.Ministral3Config(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, cls)(cfg).float().eval())


def _logits(model, tokens=TOKENS):
  return np.asarray(_jitted_logits(model, tokens))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_query_scaling_and_the_rope(saved):
  cfg = models.from_pretrained(saved["yarn"][0]).cfg
  assert (cfg.attn_position_scale, cfg.attn_position_scale_length) == (0.5, 6)
  assert cfg.rope.type == "yarn" and cfg.rope.factor == 4.0 and cfg.sliding_window is None
  assert not cfg.qkv_bias and not cfg.attn_out_bias
  window = models.from_pretrained(saved["window"][0]).cfg
  assert window.rope.type == "default" and window.sliding_window == 5
  assert all(window.sliding_layers)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_the_query_scaling_moves_the_logits(saved):
  """Without the scaling the logits past position 6 move by far more than the tolerance,
  and those before it not at all."""
  model = models.from_pretrained(saved["yarn"][0])
  off = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
      model.cfg.replace(attn_position_scale=0.0), rngs=nnx.Rngs(0)))), nnx.state(model))
  moved = np.abs(_logits(off) - _logits(model))
  assert moved[:, :6].max() == 0 and moved[:, 6:].max() > 1e-2


# The second variant (scanned) with the slow tests.
@pytest.mark.parametrize("variant,scan", [
    ("yarn", False), pytest.param("window", True, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Through the sampler's KV cache, decoding past the pre-training context."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Ministral3ForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "ministral3"
  assert written["rope_parameters"]["llama_4_scaling_beta"] == 0.5


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("yarn", cls="Ministral3ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.Ministral3ForSequenceClassification, tmp_path)


@pytest.mark.parametrize("text", ["ministral3", "mistral"])
def test_a_vision_language_folder_reads_its_language_model(text, tmp_path):
  """Mistral3ForConditionalGeneration (Ministral 3, Mistral Small 3.1 / 3.2): the
  language model is read alone, its logits transformers' on text."""
  if text == "ministral3":
    text_config = transformers.Ministral3Config(**COMMON, **VARIANTS["yarn"])
  else:
    text_config = transformers.MistralConfig(**COMMON, sliding_window=None)
  vision = transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2,
                                            head_dim=8, image_size=16, patch_size=8)
  cfg = transformers.Mistral3Config(text_config=text_config, vision_config=vision,
                                    spatial_merge_size=1)
  torch.manual_seed(0)
  hf = perturb(transformers.Mistral3ForConditionalGeneration(cfg).float().eval())
  hf.save_pretrained(tmp_path / "vlm")
  ours = models.from_pretrained(str(tmp_path / "vlm"))
  assert ours.cfg.architecture == {"ministral3": "Ministral3ForCausalLM",
                                   "mistral": "MistralForCausalLM"}[text]
  with torch.no_grad():
    want = hf(input_ids=torch.as_tensor(TOKENS)).logits.numpy()
  np.testing.assert_allclose(_logits(ours), want, atol=1e-4, rtol=0)
  config = json.loads((tmp_path / "vlm" / "config.json").read_text())
  config["text_config"]["model_type"] = "llama"
  (tmp_path / "vlm" / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="Mistral3ForConditionalGeneration with a 'llama' text "
                                       "model is not read"):
    models.from_pretrained(str(tmp_path / "vlm"))


def test_what_other_classes_refuse():
  tiny = models.get_preset("tiny")
  scaled = tiny.replace(attn_position_scale=0.1, attn_position_scale_length=16)
  with pytest.raises(ValueError, match="attn_position_scale cannot be written as "
                                       "LlamaForCausalLM; Ministral3ForCausalLM and "
                                       "Mistral4ForCausalLM hold it"):
    models.hf.check_exportable(scaled)
  models.hf.check_exportable(scaled.replace(architecture="Ministral3ForCausalLM"))
  with pytest.raises(ValueError, match="attn_position_scale_length must be an int > 0"):
    tiny.replace(attn_position_scale=0.1)
  with pytest.raises(ValueError, match="attn_position_scale must be a number >= 0"):
    tiny.replace(attn_position_scale=-1.0, attn_position_scale_length=16)
  config = models.hf.model_config_to_hf(scaled.replace(architecture="Ministral3ForCausalLM"))
  config["rope_parameters"].pop("llama_4_scaling_beta")
  with pytest.raises(ValueError, match="needs rope_parameters llama_4_scaling_beta"):
    models.hf_config_to_model_config(config)


def test_the_preset_is_transformers_default_config():
  """ministral3_8b written as a config.json is transformers' Ministral3Config (the 8B's),
  and reads back as the preset (training-only fields aside)."""
  preset = models.get_preset("ministral3_8b")
  written = json.loads(json.dumps(models.hf.model_config_to_hf(preset)))
  default = transformers.Ministral3Config()
  hf = transformers.Ministral3Config(**{k: v for k, v in written.items()
                                        if k not in ("architectures", "model_type")})
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "sliding_window"):
    assert getattr(hf, key) == getattr(default, key), key
  for key, value in default.rope_parameters.items():
    if key not in ("type", "max_position_embeddings"):
      assert hf.rope_parameters[key] == value, key
  back = models.hf_config_to_model_config(written)
  assert back == preset.replace(remat=back.remat, scan_layers=back.scan_layers)
