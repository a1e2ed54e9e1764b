"""K-EXAONE (ExaoneMoeForCausalLM) against `transformers`: EXAONE 4.0's attention (q/k
norms, sliding layers rotating, full ones NoPE) in pre-norm layers over DeepSeek-V3's
mixture (sigmoid group routing with a correction bias on the block, shared experts,
leading dense layers). Logits (layer list and scanned), greedy generation, export, its
mtp.* tensors left unread."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens,
                                 hf_logits, perturb, randomize_correction_biases,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              num_experts=8, num_experts_per_tok=3, routed_scaling_factor=1.5,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # windows of 8 on every other layer (the rows are longer), the full layers NoPE;
    # groups of experts, a shared expert, one dense layer
    "windowed": dict(sliding_window=8, sliding_window_pattern=2, n_group=4, topk_group=2,
                     num_shared_experts=1, first_k_dense_replace=1),
    # layer_types all full: every layer full (and, its window set, NoPE, as transformers
    # runs it); two dense layers named by mlp_layer_types, two shared experts, weights
    # as they are
    "full": dict(layer_types=["full_attention"] * 4,
                 mlp_layer_types=["dense", "dense", "sparse", "sparse"], num_shared_experts=2,
                 norm_topk_prob=False),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  cfg = transformers.ExaoneMoeConfig(**{**COMMON, **VARIANTS[variant]})
  torch.manual_seed(0)
  return randomize_correction_biases(perturb(
      transformers.ExaoneMoeForCausalLM(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_attention_and_the_mixture(saved):
  cfg = models.from_pretrained(saved["windowed"][0]).cfg
  assert (cfg.sliding_window, cfg.rope_layers, cfg.output_norms, cfg.qk_norm) == (
      8, (1, 0, 1, 0), False, True)
  assert (cfg.router_scoring, cfg.router_groups, cfg.dense_layers, cfg.shared_expert_dim) == (
      "sigmoid", 4, 1, 24)
  full = models.from_pretrained(saved["full"][0]).cfg
  assert (any(full.sliding_layers), full.rope_layers, full.dense_layers,
          full.shared_expert_dim, full.norm_topk_prob) == (False, (0,) * 4, 2, 48, False)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["windowed"], PROMPTS, 10, False)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.ExaoneMoeForCausalLM,
                                    TOKENS, tmp_path / "out")
  want = transformers.ExaoneMoeConfig(**{**COMMON, **VARIANTS[variant]})
  assert written["mlp_layer_types"] == want.mlp_layer_types
  assert written["model_type"] == "exaone_moe"


def test_the_prediction_tensors_are_not_read(saved, tmp_path):
  """The published files hold a multi-token-prediction block under mtp.*, which neither
  transformers nor we read."""
  folder, hf = saved["windowed"]
  tensors = load_file(f"{folder}/model.safetensors")
  extra = {"mtp." + name[len("model.layers.1."):]: value for name, value in tensors.items()
           if name.startswith("model.layers.1.")}
  (tmp_path / "mtp").mkdir()
  save_file({**tensors, **extra}, str(tmp_path / "mtp" / "model.safetensors"),
            metadata={"format": "pt"})
  config = json.loads(open(f"{folder}/config.json").read())
  (tmp_path / "mtp" / "config.json").write_text(json.dumps(config))
  m = models.from_pretrained(str(tmp_path / "mtp"))
  np.testing.assert_allclose(np.asarray(m(TOKENS)), hf_logits(hf, TOKENS), atol=1e-4, rtol=0)
