"""JetBrains' Mellum 2 (MellumForCausalLM) against `transformers`: Qwen3-MoE (q/k norms,
softmax routing) with a window on the layers layer_types names, the sliding layers
rotating at a base of their own, and leading dense layers (mlp_layer_types). Logits
(layer list and scanned), greedy generation, export, its multi-token-prediction layer
left unread, its defaults."""

import json

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens,
                                 hf_logits, perturb, save_families, spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, num_experts=6, num_experts_per_tok=2,
              sliding_window=5)
VARIANTS = {
    "default": {},  # every layer full and a mixture
    # sliding and full layers alternating, a dense first layer, biases, no renormalising
    "hybrid": dict(layer_types=["sliding_attention", "full_attention"] * 2,
                   mlp_layer_types=["dense"] + ["sparse"] * 3, attention_bias=True,
                   norm_topk_prob=False),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.MellumConfig(**{**COMMON, **VARIANTS[variant]})
  return spread_routers(perturb(transformers.MellumForCausalLM(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_layer_kinds(saved):
  cfg = models.from_pretrained(saved["hybrid"][0]).cfg
  assert cfg.sliding_layers == (True, False, True, False) and cfg.sliding_window == 5
  assert (cfg.rope.theta, cfg.rope_local.theta) == (500_000.0, 10_000.0)
  assert (cfg.dense_layers, cfg.dense_ffn_dim, cfg.ffn_dim, cfg.num_experts, cfg.qk_norm,
          cfg.qkv_bias, cfg.attn_out_bias, cfg.norm_topk_prob) == (
      1, 80, 24, 6, True, True, True, False)
  plain = models.from_pretrained(saved["default"][0]).cfg
  assert not any(plain.sliding_layers) and plain.dense_layers == 0
  assert cfg.num_params == sum(p.numel() for p in saved["hybrid"][1].parameters())


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["hybrid"], PROMPTS, 10, True)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.MellumForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "mellum"
  assert written["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0


def test_prediction_layer_in_the_files_is_not_read(saved, tmp_path):
  """The published files carry an mtp.* layer transformers does not read: nor do we."""
  from safetensors.numpy import load_file, save_file
  folder, hf = saved["hybrid"]
  tensors = load_file(f"{folder}/model.safetensors")
  tensors["mtp.layers.0.input_layernorm.weight"] = np.ones(48, np.float32)
  (tmp_path / "mtp").mkdir()
  save_file(tensors, str(tmp_path / "mtp" / "model.safetensors"))
  with open(f"{folder}/config.json") as f:
    c = json.load(f)
  with open(tmp_path / "mtp" / "config.json", "w") as f:
    json.dump({**c, "num_nextn_predict_layers": 1}, f)
  ours = models.from_pretrained(str(tmp_path / "mtp"))
  np.testing.assert_allclose(np.asarray(ours(TOKENS)), hf_logits(hf, TOKENS), atol=1e-4)


def test_defaults_are_transformers():
  default = transformers.MellumConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["MellumForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.ffn_dim, cfg.num_experts, cfg.num_experts_per_tok,
          cfg.norm_topk_prob, cfg.norm_eps, cfg.dense_layers) == (
      default.vocab_size, default.hidden_size, default.num_hidden_layers,
      default.num_attention_heads, default.num_key_value_heads, default.head_dim,
      default.moe_intermediate_size, default.num_experts, default.num_experts_per_tok,
      default.norm_topk_prob, default.rms_norm_eps, 0)
  assert (cfg.rope.theta, cfg.rope_local.theta) == (
      default.rope_parameters["full_attention"]["rope_theta"],
      default.rope_parameters["sliding_attention"]["rope_theta"])
  assert not any(cfg.sliding_layers)


def test_dense_layers_after_a_mixture_are_refused(saved):
  with open(f"{saved['hybrid'][0]}/config.json") as f:
    c = json.load(f)
  with pytest.raises(ValueError, match="dense layers in a Qwen MoE model other than the "
                                       "first few"):
    models.hf_config_to_model_config({**c, "mlp_layer_types": ["sparse", "dense"] * 2})
