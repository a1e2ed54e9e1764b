"""Seed-OSS (SeedOssForCausalLM) against `transformers`: Llama with biases on q, k and v
and, set apart, on o_proj. Logits (layer list and scanned), greedy generation through
the sampler, export, the reward model, and what other classes refuse."""

import json

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "qkv_bias": {},  # the published configuration: biases on q, k, v, none on o_proj
    "all_biases": dict(attention_out_bias=True),
    "no_bias": dict(attention_bias=False, attention_out_bias=True),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="SeedOssForCausalLM", **extra):
  cfg = transformers.SeedOssConfig(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_biases(saved):
  for variant, (qkv, out) in {"qkv_bias": (True, False), "all_biases": (True, True),
                              "no_bias": (False, True)}.items():
    cfg = models.from_pretrained(saved[variant][0]).cfg
    assert (cfg.qkv_bias, cfg.attn_out_bias) == (qkv, out), variant
    assert cfg.head_dim == 24 and cfg.architecture == "SeedOssForCausalLM"


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


# The second variant (scanned) with the slow tests.
@pytest.mark.parametrize("variant,scan", [
    ("qkv_bias", False), pytest.param("all_biases", True, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  """save_pretrained writes the folder's tensors bit for bit and a config transformers
  reads back to the same model (no dropout: none was applied here)."""
  written = check_export_round_trip(*saved[variant], transformers.SeedOssForCausalLM, TOKENS,
                                    tmp_path / "out")
  cfg = models.hf_config_to_model_config(written)
  assert written["model_type"] == "seed_oss"
  assert (written["attention_bias"], written["attention_out_bias"]) == (
      cfg.qkv_bias, cfg.attn_out_bias)
  assert written["attention_dropout"] == written["residual_dropout"] == 0.0


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("all_biases", cls="SeedOssForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.SeedOssForSequenceClassification, tmp_path)


def test_what_other_classes_refuse():
  """An output bias apart from q/k/v biases is Seed-OSS's alone; Seed-OSS holds no MLP
  biases."""
  tiny = models.get_preset("tiny")
  with pytest.raises(ValueError, match="attn_out_bias=True cannot be written as "
                                       "LlamaForCausalLM, which always has "
                                       "attn_out_bias=False"):
    models.hf.check_exportable(tiny.replace(attn_out_bias=True))
  models.hf.check_exportable(tiny.replace(attn_out_bias=True,
                                          architecture="SeedOssForCausalLM"))
  config = json.loads(json.dumps(models.hf.model_config_to_hf(
      tiny.replace(architecture="SeedOssForCausalLM"))))
  with pytest.raises(ValueError, match="mlp_bias=true in config.json is not supported"):
    models.hf_config_to_model_config({**config, "mlp_bias": True})


def test_the_preset_is_a_config_transformers_reads():
  """seed_oss_36b written as a config.json: transformers builds its config from it and the
  reader maps it back to the preset (training-only fields aside)."""
  preset = models.get_preset("seed_oss_36b")
  written = json.loads(json.dumps(models.hf.model_config_to_hf(preset)))
  hf = transformers.SeedOssConfig(**{k: v for k, v in written.items()
                                     if k not in ("architectures", "model_type")})
  assert (hf.hidden_size, hf.num_attention_heads, hf.head_dim, hf.attention_bias,
          hf.attention_out_bias) == (5120, 80, 128, True, False)
  back = models.hf_config_to_model_config(written)
  assert back == preset.replace(remat=back.remat, scan_layers=back.scan_layers)
