"""Cohere Command R7B / Command A (Cohere2ForCausalLM) against `transformers`: layers of
x + attn(norm(x)) + mlp(norm(x)) under one LayerNorm without bias, sliding layers rotated
by interleaved pairs (reordered on load) beside full layers with no position embedding,
the logits times logit_scale. Logits (layer list and scanned), what each piece does,
greedy generation, export and PEFT adapters."""

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_peft_round_trip, greedy_tokens, hf_logits, perturb,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              sliding_window=5)
VARIANTS = {
    # three sliding layers (window 5, shorter than the rows) to a full one
    "default": dict(logit_scale=0.5),
    # biases on all four attention projections, two layers of each kind, untied
    "biased": dict(attention_bias=True, tie_word_embeddings=False, logit_scale=2.0,
                   layer_types=["sliding_attention", "full_attention"] * 2),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.Cohere2Config(**{**COMMON, **VARIANTS[variant]})
  return perturb(transformers.Cohere2ForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_parallel_layers(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  assert (cfg.layer_norm, cfg.parallel_residual, cfg.lm_head_multiplier, cfg.head_dim) == (
      True, True, 0.5, 12)
  assert cfg.sliding_layers == (True, True, True, False)
  assert cfg.rope_layers == (1, 1, 1, 0)
  model = models.from_pretrained(saved["default"][0])
  assert not hasattr(model.layers[0], "post_attn_norm")


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_each_piece_moves_the_logits(saved):
  """Read with RMSNorms, or with the full layers rotating, the logits move by far more
  than the tolerance."""
  folder, hf = saved["default"]
  model = models.from_pretrained(folder)
  want = hf_logits(hf, TOKENS)
  for change in (dict(layer_norm=False), dict(rope_layers=())):
    other = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda c=change: models.Transformer(
        model.cfg.replace(**c), rngs=nnx.Rngs(0)))), nnx.state(model))
    assert np.abs(np.asarray(other(TOKENS)) - want).max() > 1e-2, change


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved["default"], PROMPTS, 10, scan)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Cohere2ForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["logit_scale"]) == (
      "cohere2", VARIANTS[variant]["logit_scale"])


def test_peft_adapters_both_ways(saved, tmp_path):
  """q_proj's and k_proj's B rows in the files' interleaved order, as their weights'."""
  folder, hf = saved["biased"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("biased"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"])


def test_refusals(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  with pytest.raises(ValueError, match="parallel_residual=True cannot be written as "
                                       "LlamaForCausalLM"):
    models.hf.check_exportable(cfg.replace(architecture="LlamaForCausalLM", layer_norm=False,
                                           lm_head_multiplier=1.0, sliding_window=None,
                                           layer_types=(), rope_layers=()))
  with pytest.raises(ValueError, match="rope_layers=.* cannot be written as Cohere2"):
    models.hf.check_exportable(cfg.replace(rope_layers=()))
  with pytest.raises(ValueError, match="head_dim=8 cannot be written as Cohere2ForCausalLM"):
    models.hf.check_exportable(cfg.replace(head_dim=8))
  with pytest.raises(ValueError, match="parallel_residual=True .* with sandwich_norms"):
    cfg.replace(sandwich_norms=True)
