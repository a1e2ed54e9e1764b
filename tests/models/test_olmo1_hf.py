"""OLMo 1 / OLMo 1.7 (OlmoForCausalLM) against `transformers`: LayerNorms with neither
weight nor bias, q, k and v clamped to [-clip_qkv, clip_qkv] (OLMo 1.7's), attention
biases with attention_bias. Logits (layer list and scanned), gradients through the clamp,
greedy generation, export, the reward model, PEFT adapters, parameter counts, its
defaults."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, check_peft_round_trip,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=64, initializer_range=0.3,
              pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "olmo": dict(tie_word_embeddings=True),  # OLMo-1B's layout
    # OLMo 1.7's clamp (tight enough to cut many of q, k and v), grouped keys, biases
    "clipped": dict(clip_qkv=1.5, num_key_value_heads=2, attention_bias=True),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="OlmoForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.OlmoConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["olmo"][0]).cfg
  assert (cfg.layer_norm, cfg.norm_weightless, cfg.norm_eps, cfg.clip_qkv, cfg.qkv_bias,
          cfg.tie_embeddings) == (True, True, 1e-5, None, False, True)
  clipped = models.from_pretrained(saved["clipped"][0]).cfg
  assert (clipped.clip_qkv, clipped.qkv_bias, clipped.attn_out_bias,
          clipped.num_kv_heads) == (1.5, True, True, 2)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


def test_the_clamp_cuts(saved):
  """The clamp matters here: without it the logits move."""
  folder, hf = saved["clipped"]
  unclamped = models.from_pretrained(folder, clip_qkv=None)
  clamped = models.from_pretrained(folder)
  assert np.abs(np.asarray(unclamped(TOKENS)) - np.asarray(clamped(TOKENS))).max() > 0.1


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_gradients_through_the_clamp_match_transformers(saved):
  folder, hf_model = saved["clipped"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    q = hf.self_attn.q_proj.weight.grad.numpy().T.reshape(64, 4, 16)
    assert_close_to_scale(layer["attn"]["q_proj"][...], q)
    assert_close_to_scale(layer["attn"]["v_bias"][...],
                          hf.self_attn.v_proj.bias.grad.numpy().reshape(2, 16))


@pytest.mark.parametrize("variant,scan", [("olmo", False), ("clipped", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.OlmoForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["clip_qkv"]) == (
      "olmo", None if variant == "olmo" else 1.5)


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("clipped", cls="OlmoForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.OlmoForSequenceClassification, tmp_path)


def test_peft_adapters_both_ways(saved, tmp_path):
  folder, hf = saved["clipped"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("clipped"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"])


def test_what_olmo_refuses(saved):
  cfg = models.from_pretrained(saved["olmo"][0]).cfg
  with pytest.raises(ValueError, match="LayerNorms' eps is 1e-5"):
    models.hf.model_config_to_hf(cfg.replace(norm_eps=1e-6))
  with pytest.raises(ValueError, match="clip_qkv must be a positive number"):
    cfg.replace(clip_qkv=0.0)
  with pytest.raises(ValueError, match="clip_qkv=1.0 cannot be written as Llama"):
    models.hf.model_config_to_hf(models.get_preset("tiny").replace(clip_qkv=1.0))


def test_defaults_are_transformers():
  default = transformers.OlmoConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["OlmoForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.rope.theta, cfg.tie_embeddings, cfg.clip_qkv, cfg.qkv_bias,
          cfg.max_position_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.rope_parameters["rope_theta"], default.tie_word_embeddings, default.clip_qkv,
      default.attention_bias, default.max_position_embeddings)
