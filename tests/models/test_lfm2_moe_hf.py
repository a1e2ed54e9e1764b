"""LFM2-MoE (Lfm2MoeForCausalLM) against `transformers`: LFM2's short-convolution and
attention layers, the first num_dense_layers with a dense feed_forward, the rest a
mixture (sigmoid scores, chosen by score + expert_bias, renormalised, scaled). The dense
layers of both kinds sit in stacks of their own (`linear_dense_layers`,
`dense_layers`). Logits (layer list and scanned), greedy generation through the caches
of both layouts, export, PEFT adapters, parameter counts, its defaults."""

import numpy as np
import pytest

from posttrain import models
from posttrain.models.transformer import layer_stacks
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_peft_round_trip, greedy_tokens, hf_logits, perturb,
                                 save_families, spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, num_experts=6, num_experts_per_tok=2,
              layer_types=["conv", "full_attention", "conv"] * 2)
VARIANTS = {
    # two dense layers (a conv and an attention one); the correction bias; renormalised
    "default": dict(num_dense_layers=2),
    # three dense layers; no correction bias, not renormalised, scaled; untied
    "plain_router": dict(num_dense_layers=3, use_expert_bias=False, norm_topk_prob=False,
                         routed_scaling_factor=2.0, tie_word_embeddings=False),
}
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.Lfm2MoeConfig(**{**COMMON, **VARIANTS[variant]})
  hf = spread_routers(perturb(transformers.Lfm2MoeForCausalLM(cfg).float().eval()))
  with torch.no_grad():  # the correction bias away from zero, so that it picks experts
    for name, buf in hf.named_buffers():
      if name.endswith("expert_bias"):
        buf.normal_(0.0, 0.5)
  return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_and_stacks(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  assert (cfg.num_experts, cfg.ffn_dim, cfg.dense_layers, cfg.dense_ffn_dim,
          cfg.router_scoring, cfg.router_correction_bias, cfg.norm_topk_prob) == (
      6, 24, 2, 80, "sigmoid", True, True)
  assert dict(layer_stacks(cfg)) == {"linear_dense_layers": (0,), "dense_layers": (1,),
                                     "linear_layers": (2, 3, 5), "layers": (4,)}
  other = models.from_pretrained(saved["plain_router"][0]).cfg
  assert (other.router_correction_bias, other.norm_topk_prob, other.routed_scaling_factor,
          other.dense_layers) == (False, False, 2.0, 3)
  for variant, (folder, hf) in saved.items():  # the correction bias: a buffer in theirs
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()) + sum(
        b.numel() for name, b in hf.named_buffers() if name.endswith("expert_bias")), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_the_correction_bias_picks_experts(saved):
  """Read with the correction bias zeroed, the logits move by far more than the
  tolerance: it is read and it chooses experts."""
  folder, hf = saved["default"]
  model = models.from_pretrained(folder)
  for stack in ("linear_layers", "layers"):
    for block in getattr(model, stack):
      bias = block.mlp.score_correction_bias
      bias[...] = np.zeros(bias.shape, np.float32)
  assert np.abs(np.asarray(model(TOKENS)) - hf_logits(hf, TOKENS)).max() > 1e-2


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved["default"], PROMPTS, 10, scan)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Lfm2MoeForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert (written["model_type"], written["num_dense_layers"]) == (
      "lfm2_moe", VARIANTS[variant]["num_dense_layers"])


def test_peft_adapters_both_ways(saved, tmp_path):
  """Adapters on the attention, the convolutions and the dense layers' feed_forward."""
  folder, hf = saved["default"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("default"), TOKENS, tmp_path,
                        ["q_proj", "o_proj", "in_proj", "out_proj", "gate_proj",
                         "down_proj"],
                        peft_targets=["q_proj", "out_proj", "in_proj", "w1", "w2"])


def test_defaults_are_transformers():
  default = transformers.Lfm2MoeConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["Lfm2MoeForCausalLM"]})
  assert (cfg.d_model, cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok,
          cfg.ffn_dim, cfg.dense_layers, cfg.dense_ffn_dim, cfg.router_correction_bias,
          cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.vocab_size) == (
      default.hidden_size, default.num_hidden_layers, default.num_experts,
      default.num_experts_per_tok, default.moe_intermediate_size, default.num_dense_layers,
      default.intermediate_size, default.use_expert_bias, default.norm_topk_prob,
      default.routed_scaling_factor, default.vocab_size)
