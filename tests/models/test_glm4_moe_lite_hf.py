"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM) against `transformers`: DeepSeek-V3's
multi-head latent attention and mixture (sigmoid group routing with a correction bias,
shared experts) under GLM's config, its dense layers named by mlp_layer_types. Logits
(layer list and scanned), greedy generation, export, the multi-token-prediction layer
left in the files, and what we refuse."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_preset_is_default_config, greedy_tokens, hf_logits,
                                 perturb, randomize_correction_biases, save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.8,
              kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
              num_experts_per_tok=3, max_position_embeddings=64, initializer_range=0.3,
              pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # transformers' default layout: the first layer dense; groups of experts
    "grouped": dict(q_lora_rank=12, n_group=4, topk_group=2),
    # one q_proj, two dense layers, YaRN
    "two_dense": dict(q_lora_rank=None, mlp_layer_types=["dense", "dense", "sparse"],
                      rope_parameters=dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0,
                                           original_max_position_embeddings=16, mscale=1.0,
                                           mscale_all_dim=0.7, beta_fast=32.0,
                                           beta_slow=1.0)),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  cfg = transformers.Glm4MoeLiteConfig(**{**COMMON, **VARIANTS[variant]})
  torch.manual_seed(0)
  return randomize_correction_biases(perturb(
      transformers.Glm4MoeLiteForCausalLM(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_latent_attention_and_the_mixture(saved):
  cfg = models.from_pretrained(saved["grouped"][0]).cfg
  assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim,
          cfg.head_dim) == (16, 12, 8, 12, 24)
  assert (cfg.router_scoring, cfg.router_groups, cfg.router_group_topk, cfg.dense_layers,
          cfg.shared_expert_dim, cfg.routed_scaling_factor) == ("sigmoid", 4, 2, 1, 24, 1.8)
  two = models.from_pretrained(saved["two_dense"][0]).cfg
  assert (two.dense_layers, two.q_lora_rank, two.rope.type) == (2, 0, "yarn")


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


# The second variant (scanned) with the slow tests.
@pytest.mark.parametrize("variant,scan", [
    ("grouped", False), pytest.param("two_dense", True, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Glm4MoeLiteForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "glm4_moe_lite" and written["rope_interleave"]
  assert written["mlp_layer_types"] == transformers.Glm4MoeLiteConfig(
      **{**COMMON, **VARIANTS[variant]}).mlp_layer_types
  assert "first_k_dense_replace" not in written


def test_the_prediction_layer_in_the_files_is_not_read(saved, tmp_path):
  """GLM-4.7-Flash's files hold a multi-token-prediction layer after the last one
  (model.layers.{num_hidden_layers}), which neither transformers nor we read."""
  folder, hf = saved["grouped"]
  tensors = load_file(f"{folder}/model.safetensors")
  extra = {name.replace("model.layers.2.", "model.layers.3."): value
           for name, value in tensors.items() if name.startswith("model.layers.2.")}
  (tmp_path / "mtp").mkdir()
  save_file({**tensors, **extra}, str(tmp_path / "mtp" / "model.safetensors"),
            metadata={"format": "pt"})
  config = json.loads(open(f"{folder}/config.json").read())
  (tmp_path / "mtp" / "config.json").write_text(json.dumps(
      {**config, "num_nextn_predict_layers": 1}))
  m = models.from_pretrained(str(tmp_path / "mtp"))
  np.testing.assert_allclose(np.asarray(m(TOKENS)), hf_logits(hf, TOKENS), atol=1e-4, rtol=0)


def test_what_we_refuse(saved):
  config = json.loads(open(f"{saved['grouped'][0]}/config.json").read())
  for kinds in (["sparse", "dense", "sparse"], ["dense", "sparse"]):
    with pytest.raises(ValueError, match=r"mlp_layer_types=\[.*\] is not supported: 3 "
                                         "entries, the dense layers first"):
      models.hf_config_to_model_config({**config, "mlp_layer_types": kinds})
  with pytest.raises(ValueError, match="attention_bias=true"):
    models.hf_config_to_model_config({**config, "attention_bias": True})
  cfg = models.hf_config_to_model_config(config)
  with pytest.raises(ValueError, match="router_scoring='softmax' cannot be written as "
                                       "Glm4MoeLiteForCausalLM"):
    models.hf.check_exportable(cfg.replace(router_scoring="softmax"))


def test_the_preset_is_transformers_default_config():
  """glm4_7_flash written as a config.json is transformers' Glm4MoeLiteConfig
  (GLM-4.7-Flash's), and reads back as the preset (training-only fields aside)."""
  check_preset_is_default_config("glm4_7_flash", transformers.Glm4MoeLiteConfig, (
      "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
      "num_hidden_layers", "num_attention_heads", "n_shared_experts", "n_routed_experts",
      "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
      "v_head_dim", "qk_nope_head_dim", "num_experts_per_tok", "n_group", "topk_group",
      "norm_topk_prob", "rms_norm_eps", "mlp_layer_types", "max_position_embeddings",
      "tie_word_embeddings"))
