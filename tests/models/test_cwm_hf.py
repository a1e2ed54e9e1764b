"""Meta's Code World Model (CwmForCausalLM) against `transformers`: Llama with a window on
three of every four layers (the first of each four full), as layer_types says, and
llama3 rope. Logits (layer list and scanned, rows longer than the window), greedy
generation through the cache, export, its defaults."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens,
                                 perturb, save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, sliding_window=5)
VARIANTS = {
    "default": {},  # layers 0 and 4 full, 1-3 sliding; the default llama3 rope
    "types": dict(layer_types=["sliding_attention", "full_attention"] * 2
                  + ["sliding_attention"], tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.CwmConfig(**{**COMMON, **VARIANTS[variant]})
  return perturb(transformers.CwmForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_layer_kinds(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  assert cfg.sliding_layers == (False, True, True, True, False) and cfg.sliding_window == 5
  assert (cfg.rope.type, cfg.rope.factor, cfg.rope.theta) == ("llama3", 16.0, 1_000_000.0)
  other = models.from_pretrained(saved["types"][0]).cfg
  assert other.sliding_layers == (True, False, True, False, True)
  assert (other.rope.type, other.rope.theta) == ("default", 500_000.0)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["default"], PROMPTS, 12, True)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.CwmForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "cwm" and written["sliding_window"] == 5


def test_defaults_are_transformers():
  default = transformers.CwmConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["CwmForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window, cfg.norm_eps,
          cfg.tie_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.head_dim, default.sliding_window, default.rms_norm_eps,
      default.tie_word_embeddings)
  assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in default.layer_types)
  for key in ("factor", "high_freq_factor", "low_freq_factor",
              "original_max_position_embeddings"):
    assert getattr(cfg.rope, key) == default.rope_parameters[key], key
  assert cfg.rope.theta == default.rope_parameters["rope_theta"]


def test_biases_are_refused(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  with pytest.raises(ValueError, match="qkv_bias=True cannot be written as CwmForCausalLM"):
    models.hf.check_exportable(cfg.replace(qkv_bias=True))
