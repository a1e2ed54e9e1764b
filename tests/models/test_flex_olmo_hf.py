"""FlexOlmo (FlexOlmoForCausalLM) against `transformers`: OLMo 2's layers (no input norms,
each sublayer's output normed, q/k norms over every head at once) over OLMoE's softmax
mixture in every layer. Logits (layer list and scanned), greedy generation, export, its
defaults."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens,
                                 perturb, save_families, spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              num_experts=6, num_experts_per_tok=2)
VARIANTS = {"default": {},  # softmax over every expert, the top-k not renormalised
            "normed_biased": dict(norm_topk_prob=True, attention_bias=True)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.FlexOlmoConfig(**{**COMMON, **VARIANTS[variant]})
  return spread_routers(perturb(transformers.FlexOlmoForCausalLM(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_olmo_layers_over_a_mixture(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  assert (cfg.output_norms, cfg.qk_norm, cfg.qk_norm_heads, cfg.num_experts,
          cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.router_scoring,
          cfg.dense_layers, cfg.router_aux_loss_coef) == (
      True, True, True, 6, 2, False, "softmax", 0, 0.0)  # no output_router_logits: no loss
  other = models.from_pretrained(saved["normed_biased"][0]).cfg
  assert (other.norm_topk_prob, other.qkv_bias, other.attn_out_bias) == (True, True, True)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["default"], PROMPTS, 10, True)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.FlexOlmoForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "flex_olmo"
  assert written["norm_topk_prob"] == (variant == "normed_biased")


def test_defaults_are_transformers():
  default = transformers.FlexOlmoConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["FlexOlmoForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
          cfg.norm_eps, cfg.rope.theta, cfg.max_position_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.num_experts, default.num_experts_per_tok, default.norm_topk_prob,
      default.rms_norm_eps, default.rope_parameters["rope_theta"],
      default.max_position_embeddings)
