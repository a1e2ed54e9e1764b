"""nanochat (NanoChatForCausalLM) against `transformers`: weightless RMS norms (the
embeddings normed too), q and k normed after a rotation that turns the other way (held
as ours over each head's halves swapped), an MLP of no gate through relu^2, soft-capped
logits. Logits (layer list and scanned), greedy generation, export, PEFT adapters,
parameter counts, its defaults, refusals."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_peft_round_trip, greedy_tokens, hf_logits,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {"default": dict(final_logit_softcapping=6.0),  # a cap the logits reach
            "uncapped": dict(final_logit_softcapping=None, tie_word_embeddings=True)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.NanoChatConfig(**{**COMMON, **VARIANTS[variant]})
  return transformers.NanoChatForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_every_piece(saved):
  model = models.from_pretrained(saved["default"][0])
  cfg = model.cfg
  assert (cfg.norm_weightless, cfg.embed_norm, cfg.qk_l2_norm, cfg.mlp_activation,
          cfg.final_logit_softcap, cfg.qk_norm) == (True, True, True, "relu2", 6.0, False)
  assert not hasattr(model.final_norm, "scale")
  assert cfg.num_params == sum(p.numel() for p in saved["default"][1].parameters())


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_the_halves_swap_and_the_embedding_norm_matter(saved):
  """Read without the halves swapped (the rotation turning our way), or without the
  embeddings' norm, the logits move by far more than the tolerance."""
  folder, hf = saved["uncapped"]
  want = hf_logits(hf, TOKENS)
  model = models.from_pretrained(folder)
  h = model.cfg.head_dim
  order = np.r_[h // 2:h, 0:h // 2]
  for layer in model.layers:
    for name in ("q_proj", "k_proj"):
      w = getattr(layer.attn, name)
      w[...] = np.asarray(w[...])[:, :, order]
  assert np.abs(np.asarray(model(TOKENS)) - want).max() > 1e-2
  other = models.from_pretrained(folder, embed_norm=False)
  assert np.abs(np.asarray(other(TOKENS)) - want).max() > 1e-2


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["default"], PROMPTS, 12, True)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.NanoChatForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "nanochat"
  assert written["final_logit_softcapping"] == VARIANTS[variant]["final_logit_softcapping"]


def test_peft_adapters_both_ways(saved, tmp_path):
  """q_proj's and k_proj's B rows swapped back to the files' halves, fc1 / fc2 named."""
  folder, hf = saved["default"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("default"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                        peft_targets=["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"])


def test_defaults_are_transformers():
  default = transformers.NanoChatConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["NanoChatForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.norm_eps, cfg.final_logit_softcap, cfg.rope.theta,
          cfg.tie_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.rms_norm_eps, default.final_logit_softcapping,
      default.rope_parameters["rope_theta"], default.tie_word_embeddings)


def test_refusals(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  with pytest.raises(ValueError, match="qk_l2_norm=False cannot be written as NanoChat"):
    models.hf.check_exportable(cfg.replace(qk_l2_norm=False))
  with pytest.raises(ValueError, match="norm_weightless=False cannot be written as NanoChat"):
    models.hf.check_exportable(cfg.replace(norm_weightless=False, embed_norm=False))
  # with weights, its embeddings' norm would be one of their own (BLOOM's)
  with pytest.raises(ValueError, match="norm_weightless=False cannot be written as NanoChat"):
    models.hf.check_exportable(cfg.replace(norm_weightless=False))
  with pytest.raises(ValueError, match="norm_weightless=True .* is not supported"):
    models.get_preset("tiny").replace(norm_weightless=True, qk_norm=True)
