"""Granite "swash" (GraniteSWAForCausalLM, and its mixture GraniteMoeSWAForCausalLM)
against `transformers`: Granite's four scalars, a learnable attention sink per head,
windows on the layers layer_types names and a rope base per layer (one for the full
layers, one for the sliding ones, 0 a NoPE layer); the mixture's experts stacked as
transformers 5 saves them. Logits (layer list and scanned), the sinks' effect, greedy
generation past the window, export, and what we refuse."""

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens,
                                 hf_logits, perturb, save_families, spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              sliding_window=8, embedding_multiplier=2.0, residual_multiplier=0.5,
              logits_scaling=1.5, attention_multiplier=0.2)
VARIANTS = {
    # transformers' defaults: the first layer full, the others sliding, one base
    "default": {},
    # a base of its own for the sliding layers, and a NoPE one among them
    "bases": dict(layer_rope_theta=[10_000.0, 500.0, 0.0, 500.0]),
    # the mixture (granite-swash-3b-a600m's layout): 4 experts, 2 a token, a shared MLP
    "moe": dict(layer_rope_theta=[10_000.0, 500.0, 0.0, 500.0], intermediate_size=24,
                shared_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2),
}
CLASSES = {"moe": (transformers.GraniteMoeSWAConfig, transformers.GraniteMoeSWAForCausalLM)}
DENSE = (transformers.GraniteSWAConfig, transformers.GraniteSWAForCausalLM)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  config_cls, cls = CLASSES.get(variant, DENSE)
  torch.manual_seed(0)
  model = spread_routers(perturb(cls(config_cls(**{**COMMON, **VARIANTS[variant]}))
                                 .float().eval()))
  with torch.no_grad():  # the sinks start at zero: move them
    for layer in model.model.layers:
      layer.self_attn.sinks.normal_(0.0, 1.0)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_sinks_windows_and_bases(saved):
  cfg = models.from_pretrained(saved["bases"][0]).cfg
  assert (cfg.attention_sinks, cfg.sliding_window, cfg.sliding_layers) == (
      True, 8, (False, True, True, True))
  assert (cfg.rope.theta, cfg.rope_local.theta, cfg.rope_layers) == (
      10_000.0, 500.0, (1, 1, 0, 1))
  assert models.from_pretrained(saved["default"][0]).cfg.rope_local is None
  moe = models.from_pretrained(saved["moe"][0]).cfg
  assert (moe.num_experts, moe.num_experts_per_tok, moe.ffn_dim, moe.shared_expert_dim,
          moe.attention_sinks, moe.rope_local.theta) == (4, 2, 24, 40, True, 500.0)
  written = models.hf.model_config_to_hf(cfg)
  with pytest.raises(ValueError, match="layers of one kind with different bases"):
    models.hf_config_to_model_config({**written,
                                      "layer_rope_theta": [10_000.0, 500.0, 0.0, 600.0]})


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_the_sinks_move_the_logits(saved):
  """Without the sinks (attention_sinks off) the logits move by far more than the
  tolerance."""
  folder, hf = saved["default"]
  model = models.from_pretrained(folder)
  kept = nnx.state(model).filter(lambda path, _: "sinks" not in path)
  off = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
      model.cfg.replace(attention_sinks=False), rngs=nnx.Rngs(0)))), kept)
  assert np.abs(np.asarray(off(TOKENS)) - hf_logits(hf, TOKENS)).max() > 1e-2


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_transformers(saved, variant):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, False)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  config_cls, cls = CLASSES.get(variant, DENSE)
  written = check_export_round_trip(*saved[variant], cls, TOKENS, tmp_path / "out")
  want = config_cls(**{**COMMON, **VARIANTS[variant]})
  assert written["layer_types"] == want.layer_types
  assert written["layer_rope_theta"] == want.layer_rope_theta
