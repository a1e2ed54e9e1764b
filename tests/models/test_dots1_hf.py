"""dots.llm1 (Dots1ForCausalLM) against `transformers`: Qwen3's attention (q/k norms per
head) over DeepSeek-V3's mixture (sigmoid group routing with a correction bias, shared
experts, a leading dense layer), sliding windows from max_window_layers on. Logits
(layer list and scanned), greedy generation, export, and what we refuse."""

import json

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens,
                                 perturb, randomize_correction_biases, save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=1.5,
              first_k_dense_replace=1, max_position_embeddings=64, initializer_range=0.3,
              pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # groups of experts, a shared expert, renormalised weights; windows of 8 on the
    # layers from the second on (the rows are longer)
    "windowed": dict(n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                     sliding_window=8, max_window_layers=1),
    # transformers' defaults: no window (max_window_layers past the layers), weights as
    # they are; two shared experts
    "plain": dict(n_shared_experts=2, max_window_layers=62),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  cfg = transformers.Dots1Config(**{**COMMON, **VARIANTS[variant]})
  torch.manual_seed(0)
  return randomize_correction_biases(perturb(transformers.Dots1ForCausalLM(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_attention_and_the_mixture(saved):
  cfg = models.from_pretrained(saved["windowed"][0]).cfg
  assert (cfg.qk_norm, cfg.sliding_window, cfg.layer_types) == (
      True, 8, ("full_attention", "sliding_attention", "sliding_attention"))
  assert (cfg.router_scoring, cfg.router_groups, cfg.router_group_topk, cfg.dense_layers,
          cfg.shared_expert_dim, cfg.routed_scaling_factor) == ("sigmoid", 4, 2, 1, 24, 1.5)
  plain = models.from_pretrained(saved["plain"][0]).cfg
  assert (plain.sliding_window, plain.shared_expert_dim, plain.norm_topk_prob) == (
      None, 48, False)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_transformers(saved, variant):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, False)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Dots1ForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "dots1"
  assert written["layer_types"] == transformers.Dots1Config(
      **{**COMMON, **VARIANTS[variant]}).layer_types


def test_what_we_refuse(saved):
  config = json.loads(open(f"{saved['windowed'][0]}/config.json").read())
  cfg = models.hf_config_to_model_config(config)
  with pytest.raises(ValueError, match="qk_norm=False cannot be written as Dots1ForCausalLM"):
    models.hf.check_exportable(cfg.replace(qk_norm=False))
  with pytest.raises(ValueError, match="router_scoring='softmax' cannot be written as "
                                       "Dots1ForCausalLM"):
    models.hf.check_exportable(cfg.replace(router_scoring="softmax"))
