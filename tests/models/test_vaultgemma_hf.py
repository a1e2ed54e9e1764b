"""VaultGemma (VaultGemmaForCausalLM) against `transformers`: Gemma 2 without the norms of
its sublayers' outputs ((1 + w) RMS norms before the attention and the MLP alone), soft
caps, query_pre_attn_scalar, sliding layers alternating with full ones, scaled
embeddings. Logits (layer list and scanned), the norms' gradients, greedy generation
past the window, export, parameter counts, its defaults, and what Gemma 2 refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, greedy_tokens, perturb, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # a window of 6 (shorter than the rows) on layers 0 and 2, soft caps, its scalar
    "vaultgemma": dict(sliding_window=6, query_pre_attn_scalar=24,
                       attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
    "uncapped": dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                     tie_word_embeddings=False),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.VaultGemmaConfig(**{**COMMON, **VARIANTS[variant]})
  return perturb(transformers.VaultGemmaForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["vaultgemma"][0]).cfg
  assert (cfg.sandwich_norms, cfg.norm_unit_offset, cfg.embed_scale, cfg.mlp_activation,
          cfg.sliding_window, cfg.sliding_layers, cfg.query_pre_attn_scalar,
          cfg.attn_logit_softcap, cfg.final_logit_softcap) == (
      False, True, True, "gelu_tanh", 6, (True, False, True), 24.0, 5.0, 8.0)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_norm_gradients_match_transformers(saved):
  folder, hf_model = saved["vaultgemma"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    assert_close_to_scale(layer["input_norm"]["scale"][...],
                          hf.input_layernorm.weight.grad.numpy())
    assert_close_to_scale(layer["post_attn_norm"]["scale"][...],
                          hf.pre_feedforward_layernorm.weight.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("vaultgemma", False), ("uncapped", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.VaultGemmaForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "vaultgemma"


def test_gemma2_holds_its_sandwich_norms(saved):
  """Without the output norms a model cannot be written as Gemma 2, nor with them as
  VaultGemma."""
  cfg = models.from_pretrained(saved["vaultgemma"][0]).cfg
  with pytest.raises(ValueError, match="sandwich_norms=False cannot be written as Gemma2"):
    models.hf.model_config_to_hf(cfg.replace(architecture="Gemma2ForCausalLM"))
  with pytest.raises(ValueError, match="sandwich_norms=True cannot be written as VaultGemma"):
    models.hf.model_config_to_hf(cfg.replace(sandwich_norms=True))


def test_defaults_are_transformers():
  default = transformers.VaultGemmaConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["VaultGemmaForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window, cfg.query_pre_attn_scalar,
          cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.tie_embeddings,
          cfg.max_position_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.head_dim, default.sliding_window, default.query_pre_attn_scalar,
      default.attn_logit_softcapping, default.final_logit_softcapping,
      default.tie_word_embeddings, default.max_position_embeddings)
