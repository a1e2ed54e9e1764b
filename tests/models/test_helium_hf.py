"""Kyutai's Helium (HeliumForCausalLM) against `transformers`: Llama whose rotary embedding
pairs features (2i, 2i + 1), held here as rotate-half over q's and k's reordered
features. Logits (layer list and scanned), greedy generation, export, the reward model,
its defaults, and the heads' width it fixes."""

import numpy as np
import pytest

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
VARIANTS = {"default": {}, "qkv_bias": dict(attention_bias=True, tie_word_embeddings=True)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="HeliumForCausalLM", **extra):
  cfg = transformers.HeliumConfig(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["qkv_bias"], PROMPTS, 12, False)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.HeliumForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "helium"
  assert written["attention_bias"] == (variant == "qkv_bias")


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("default", cls="HeliumForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.HeliumForSequenceClassification, tmp_path)


def test_defaults_are_transformers():
  default = transformers.HeliumConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["HeliumForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps, cfg.rope.theta, cfg.tie_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.head_dim, default.rms_norm_eps, default.rope_parameters["rope_theta"],
      default.tie_word_embeddings)


def test_heads_split_the_width(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  with pytest.raises(ValueError, match="head_dim=8 cannot be written as HeliumForCausalLM"):
    models.hf.check_exportable(cfg.replace(head_dim=8))
