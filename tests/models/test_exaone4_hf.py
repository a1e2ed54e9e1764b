"""EXAONE 4.0 (Exaone4ForCausalLM) against `transformers`: OLMo 2's layout (each sublayer's
output normed before its residual add, no input norms) with q/k norms per head; with a
sliding window three sliding rotary layers to each full NoPE one. Logits (layer list and
scanned), greedy generation through the sampler, export, the reward model, and what
other classes refuse."""

import json

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # the 32B's layout: a window of 5 keys (shorter than the rows), every fourth layer full
    # and NoPE; a llama3-scaled rotary embedding
    "hybrid": dict(sliding_window=5, sliding_window_pattern=4,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 10_000.0,
                                    "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
    # the 1.2B's: every layer full and rotating (transformers needs the layer_types
    # spelled out without a window)
    "global": dict(sliding_window=None, layer_types=["full_attention"] * 4),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="Exaone4ForCausalLM", **extra):
  cfg = transformers.Exaone4Config(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_layers_kinds(saved):
  hybrid = models.from_pretrained(saved["hybrid"][0]).cfg
  assert hybrid.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
  assert hybrid.rope_layers == (1, 1, 1, 0) and hybrid.sliding_window == 5
  assert hybrid.output_norms and hybrid.qk_norm and not hybrid.qk_norm_heads
  assert hybrid.rope.type == "llama3" and not hybrid.qkv_bias
  flat = models.from_pretrained(saved["global"][0]).cfg
  assert flat.sliding_window is None and all(flat.rope_layers or (1,))
  assert not any(flat.sliding_layers)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


# The scanned and the all-global variants with the slow tests.
@pytest.mark.parametrize("variant,scan", [
    ("hybrid", False), pytest.param("hybrid", True, marks=pytest.mark.slow),
    pytest.param("global", False, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Through the sampler's KV cache: the sliding layers' rings of keys, the NoPE layer's
  keys cached unrotated."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Exaone4ForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "exaone4"


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("hybrid", cls="Exaone4ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.Exaone4ForSequenceClassification, tmp_path)


def test_what_other_classes_refuse(saved):
  cfg = models.from_pretrained(saved["hybrid"][0]).cfg
  with pytest.raises(ValueError, match=r"rope_layers=\(1, 1, 1, 1\) cannot be written as "
                                       "Exaone4ForCausalLM, whose sliding layers rotate"):
    models.hf.check_exportable(cfg.replace(rope_layers=(1, 1, 1, 1)))
  with pytest.raises(ValueError, match="output_norms=True cannot be written as "
                                       "LlamaForCausalLM"):
    models.hf.check_exportable(cfg.replace(architecture="LlamaForCausalLM", qk_norm=False))
  config = json.loads(open(f"{saved['hybrid'][0]}/config.json").read())
  config.pop("layer_types")
  assert models.hf_config_to_model_config(config).layer_types == cfg.layer_types
