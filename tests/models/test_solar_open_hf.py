"""Upstage's Solar Open (SolarOpenForCausalLM) against `transformers`: GLM-4.5's mixture
(sigmoid routing with a score-correction bias, groups, a routed scaling factor, shared
experts) in every layer, under Llama's attention. Logits (layer list and scanned),
greedy generation, export, its defaults, and what it cannot hold."""

import json

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens,
                                 perturb, randomize_correction_biases, save_families,
                                 spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              num_experts_per_tok=3, moe_intermediate_size=24, n_routed_experts=8)
VARIANTS = {
    # one group, one shared expert, no biases
    "default": {},
    # 4 groups of which 2 are searched, scaling 2.5, two shared experts, q/k/v biases
    "grouped": dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2,
                    attention_bias=True, norm_topk_prob=False),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.SolarOpenConfig(**{**COMMON, **VARIANTS[variant]})
  hf = perturb(transformers.SolarOpenForCausalLM(cfg).float().eval())
  return randomize_correction_biases(spread_routers(hf))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_a_mixture_in_every_layer(saved):
  cfg = models.from_pretrained(saved["grouped"][0]).cfg
  assert (cfg.num_experts, cfg.dense_layers, cfg.shared_expert_dim, cfg.router_scoring,
          cfg.router_correction_bias, cfg.router_groups, cfg.router_group_topk,
          cfg.routed_scaling_factor, cfg.qk_norm, cfg.qkv_bias, cfg.attn_out_bias) == (
      8, 0, 48, "sigmoid", True, 4, 2, 2.5, False, True, False)
  assert cfg.rope.partial_rotary_factor == 1.0


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["grouped"], PROMPTS, 10, True)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.SolarOpenForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "solar_open"
  assert "first_k_dense_replace" not in written and "intermediate_size" not in written


def test_defaults_are_transformers():
  default = transformers.SolarOpenConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["SolarOpenForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.ffn_dim, cfg.num_experts, cfg.num_experts_per_tok,
          cfg.shared_expert_dim, cfg.rope.theta, cfg.norm_eps) == (
      default.vocab_size, default.hidden_size, default.num_hidden_layers,
      default.num_attention_heads, default.num_key_value_heads, default.head_dim,
      default.moe_intermediate_size, default.n_routed_experts, default.num_experts_per_tok,
      default.n_shared_experts * default.moe_intermediate_size,
      default.rope_parameters["rope_theta"], default.rms_norm_eps)


def test_dense_layers_are_not_written(saved):
  """Its mixture runs in every layer: a file's first_k_dense_replace is not read, and a
  model with dense layers is not written as Solar Open."""
  folder = saved["default"][0]
  with open(f"{folder}/config.json") as f:
    c = json.load(f)
  assert models.hf_config_to_model_config({**c, "first_k_dense_replace": 2,
                                           "intermediate_size": 64}).dense_layers == 0
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="dense_layers=1 cannot be written as SolarOpen"):
    models.hf.check_exportable(cfg.replace(dense_layers=1, dense_ffn_dim=64))
