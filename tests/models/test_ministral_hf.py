"""Ministral 8B (MinistralForCausalLM, Ministral-8B-Instruct-2410) against `transformers`:
Mistral with its sliding window on the layers layer_types names. Logits (layer list and
scanned), greedy generation through the sampler's window, export, and the reward model
(MinistralForSequenceClassification)."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # windows of 8 on the first and last layers, the middle one full (rows of 20)
    "interleaved": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention",
                                                       "sliding_attention"]),
    # every layer full (transformers builds the window's mask whatever the layers say)
    "full": dict(sliding_window=8, layer_types=["full_attention"] * 3),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls=None, **extra):
  cfg = transformers.MinistralConfig(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb((cls or transformers.MinistralForCausalLM)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_layers_windows(saved):
  cfg = models.from_pretrained(saved["interleaved"][0]).cfg
  assert (cfg.sliding_window, cfg.sliding_layers, cfg.qkv_bias) == (
      8, (True, False, True), False)
  assert not any(models.from_pretrained(saved["full"][0]).cfg.sliding_layers)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  """Past the window of 8, through the sliding layers' ring caches."""
  for i, (got, want) in enumerate(greedy_tokens(*saved["interleaved"], PROMPTS, 12, False)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.MinistralForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "ministral"
  assert written["layer_types"] == transformers.MinistralConfig(
      **{**COMMON, **VARIANTS[variant]}).layer_types


def test_reward_model_round_trip(tmp_path):
  check_reward_model_round_trip(
      _hf_model("interleaved", transformers.MinistralForSequenceClassification,
                num_labels=1),
      transformers.MinistralForSequenceClassification, tmp_path)
