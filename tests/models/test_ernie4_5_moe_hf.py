"""ERNIE 4.5's mixtures (Ernie4_5_MoeForCausalLM, ERNIE-4.5-21B-A3B) against `transformers`:
a leading dense layer, then mixtures whose softmax router chooses on the probabilities
plus the moe_statics' correction bias and weighs by the probabilities, renormalised, beside
ungated shared experts; interleaved rotary pairs. Logits (layer list and scanned), greedy
generation through the sampler, export, and the refusals."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, greedy_tokens, hf_logits, perturb,
                                 spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(folder with the HF files, the HF model): 3 layers, the first dense; 6 experts of 24,
  2 per token, 2 shared; correction biases large enough to change the choice."""
  cfg = transformers.Ernie4_5_MoeConfig(
      vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
      initializer_range=0.3, moe_intermediate_size=24, moe_k=2, moe_num_experts=6,
      moe_num_shared_experts=2, moe_layer_start_index=1, tie_word_embeddings=False,
      pad_token_id=0, bos_token_id=2, eos_token_id=1)
  torch.manual_seed(0)
  hf = spread_routers(perturb(transformers.Ernie4_5_MoeForCausalLM(cfg).float().eval()))
  with torch.no_grad():  # a parameter here, not a buffer
    for name, p in hf.named_parameters():
      if name.endswith("e_score_correction_bias"):
        p.copy_(torch.randn_like(p) * 0.2)
  folder = tmp_path_factory.mktemp("ernie4_5_moe") / "model"
  hf.save_pretrained(folder)
  return str(folder), hf


def test_config_reads_the_mixture(saved):
  cfg = models.from_pretrained(saved[0]).cfg
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.ffn_dim) == (6, 2, 24)
  assert (cfg.dense_layers, cfg.dense_ffn_dim, cfg.shared_expert_dim) == (1, 96, 48)
  assert cfg.softmax_correction_bias and cfg.norm_topk_prob and cfg.router_scoring == "softmax"
  assert cfg.has_correction_bias and not cfg.shared_expert_gate


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, scan):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4,
                             rtol=0)
  assert np.abs(want).max() > 3
  # The correction bias matters: without it the experts chosen, and the logits, move.
  stack = ours.layers if scan else ours.layers[0]
  bias = stack.mlp.score_correction_bias
  bias.value = jnp.zeros_like(bias[...])
  assert np.abs(np.asarray(_jitted_logits(ours, TOKENS)) - want).max() > 1e-3


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])  # scanned with the slow tests
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 12, scan)):
    assert got == want, i


def test_export_round_trip_is_exact(saved, tmp_path):
  written = check_export_round_trip(*saved, transformers.Ernie4_5_MoeForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "ernie4_5_moe"
  assert (written["moe_layer_start_index"], written["moe_num_shared_experts"]) == (1, 2)


def test_what_cannot_be_read_or_written_is_refused(saved):
  config = json.loads(open(f"{saved[0]}/config.json").read())
  with pytest.raises(ValueError, match="moe_layer_interval=2, moe_layer_end_index=2 in an "
                                       "ERNIE 4.5 config.json"):
    models.hf_config_to_model_config({**config, "moe_layer_interval": 2})
  with pytest.raises(ValueError, match="use_bias=true in an ERNIE 4.5 config.json"):
    models.hf_config_to_model_config({**config, "use_bias": True})
  cfg = models.hf_config_to_model_config(config)
  with pytest.raises(ValueError, match="softmax_correction_bias=False cannot be written as "
                                       "Ernie4_5_MoeForCausalLM"):
    models.hf.check_exportable(cfg.replace(softmax_correction_bias=False))
  with pytest.raises(ValueError, match="softmax_correction_bias=True cannot be written as "
                                       "Qwen3MoeForCausalLM"):
    models.hf.check_exportable(cfg.replace(architecture="Qwen3MoeForCausalLM",
                                           qk_norm=True))
  with pytest.raises(ValueError, match="softmax_correction_bias=True needs a mixture"):
    models.get_preset("tiny").replace(softmax_correction_bias=True)
