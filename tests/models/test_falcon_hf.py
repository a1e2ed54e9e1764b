"""Falcon (FalconForCausalLM) against `transformers`, in each of its layouts: Falcon-7B's
(multi-query attention, attention and MLP side by side under one LayerNorm), Falcon-40B /
180B's new decoder architecture (grouped keys, a LayerNorm each for the attention and the
MLP), Falcon 2's (the new architecture under one norm), sequential layers, and
Falcon-RW's (sequential, ALiBi's biases scaled with the logits); q, k and v fused by
key/value group, biases with `bias`, an MLP of no gate through the exact GELU.
Logits (layer list and scanned), gradients through the fused projection, greedy
generation, export, the reward model, parameter counts, its defaults, what it refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_fused_qkv_peft, check_logits,
                                 check_reward_model_round_trip, greedy_tokens,
                                 perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {  # name -> (config fields, our num_kv_heads, parallel_residual, parallel_mlp_norm)
    "falcon7b": ({}, 1, True, False),  # multi-query, one norm, no biases, tied
    "falcon40b": (dict(new_decoder_architecture=True, num_kv_heads=2, bias=True,
                       tie_word_embeddings=False, ffn_hidden_size=80), 2, True, True),
    "falcon2": (dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1,
                     num_kv_heads=4), 4, True, False),
    "sequential": (dict(parallel_attn=False, multi_query=False, bias=True), 4, False, False),
    "falcon_rw": (dict(parallel_attn=False, multi_query=False, bias=True, alibi=True), 4,
                  False, False),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="FalconForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.FalconConfig(**{**COMMON, **VARIANTS[variant][0], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  for variant, (fields, kv, parallel, two_norms) in VARIANTS.items():
    folder, hf = saved[variant]
    cfg = models.from_pretrained(folder).cfg
    biased = bool(fields.get("bias"))
    assert (cfg.num_kv_heads, cfg.parallel_residual, cfg.parallel_mlp_norm, cfg.qkv_bias,
            cfg.attn_out_bias, cfg.mlp_bias, cfg.layer_norm, cfg.norm_bias,
            cfg.mlp_activation, cfg.ffn_dim) == (
        kv, parallel, two_norms, biased, biased, biased, True, True, "gelu_ungated",
        fields.get("ffn_hidden_size", 256)), variant
    alibi = bool(fields.get("alibi"))
    assert (cfg.alibi, cfg.alibi_scaled, all(cfg.nope_layers)) == (alibi, alibi, alibi)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_gradients_through_the_grouped_projection_match_transformers(saved):
  """Falcon-40B's query_key_value: per key/value group its two query heads, its key, its
  value; weight and bias."""
  folder, hf_model = saved["falcon40b"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  d, groups, h = 64, 2, 16
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.transformer.h[i]
    fused = hf.self_attention.query_key_value
    weight = fused.weight.grad.numpy().reshape(groups, 4, h, d)
    bias = fused.bias.grad.numpy().reshape(groups, 4, h)
    assert_close_to_scale(layer["attn"]["q_proj"][...],
                          weight[:, :2].reshape(4, h, d).transpose(2, 0, 1))
    assert_close_to_scale(layer["attn"]["v_proj"][...], weight[:, 3].transpose(2, 0, 1))
    assert_close_to_scale(layer["attn"]["q_bias"][...], bias[:, :2].reshape(4, h))
    assert_close_to_scale(layer["post_attn_norm"]["scale"][...], hf.ln_mlp.weight.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("falcon7b", False), ("falcon40b", True),
                                          ("sequential", False), ("falcon_rw", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  """Each layout written back bit for bit; Falcon 2's grouped keys (a group a query
  head) are written in the older layout that holds the same bytes."""
  written = check_export_round_trip(*saved[variant], transformers.FalconForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert (written["model_type"], written["new_decoder_architecture"], written["alibi"]) == (
      "falcon", variant == "falcon40b", variant == "falcon_rw")


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("falcon40b", cls="FalconForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.FalconForSequenceClassification, tmp_path)


def test_what_falcon_refuses(saved):
  """The new architecture's sequential layers (which transformers cannot run), grouped
  keys in sequential layers."""
  folder, hf = saved["falcon7b"]
  base = hf.config.to_dict()
  with pytest.raises(ValueError, match="new_decoder_architecture=true with parallel_attn"):
    models.hf_config_to_model_config({**base, "new_decoder_architecture": True,
                                      "parallel_attn": False})
  cfg = models.from_pretrained(saved["sequential"][0]).cfg
  with pytest.raises(ValueError, match="num_kv_heads=2 cannot be written as Falcon"):
    models.hf.model_config_to_hf(cfg.replace(num_kv_heads=2))


@pytest.mark.parametrize("variant", ["falcon7b", "falcon40b"])
def test_peft_adapters_on_the_fused_projection_are_read(saved, variant, tmp_path):
  """PEFT's one adapter on query_key_value (multi-query, grouped) read as q, k and v's."""
  folder, hf = saved[variant]
  check_fused_qkv_peft(folder, hf, lambda: _hf_model(variant), TOKENS, tmp_path,
                       "query_key_value", "dense", ["o_proj"])


def test_defaults_are_transformers():
  default = transformers.FalconConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["FalconForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.norm_eps, cfg.rope.theta, cfg.tie_embeddings,
          cfg.parallel_residual, cfg.qkv_bias, cfg.max_position_embeddings) == (
      default.vocab_size, default.hidden_size, default.ffn_hidden_size,
      default.num_hidden_layers, default.num_attention_heads, 1, default.layer_norm_epsilon,
      default.rope_parameters["rope_theta"], default.tie_word_embeddings,
      default.parallel_attn, default.bias, default.max_position_embeddings)
