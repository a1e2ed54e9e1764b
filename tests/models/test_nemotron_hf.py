"""Nemotron-4 / Minitron (NemotronForCausalLM) against `transformers`: LayerNorm1P (a
LayerNorm with a bias whose weight is held less one), half of each head rotated, an MLP
of no gate down(relu(up(x))^2), attention_bias on all four projections and mlp_bias on
both of the MLP's, heads wider than hidden_size / heads (Minitron's). Logits (layer list
and scanned), the norms' gradients, greedy generation, export, the reward model, PEFT
adapters, parameter counts, its defaults."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, check_peft_round_trip,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "minitron": dict(head_dim=24),  # no biases, heads wider than 64 / 4, half rotated
    # biases on the attention's and the MLP's projections, every feature rotated, tied
    "biased": dict(attention_bias=True, mlp_bias=True, partial_rotary_factor=1.0,
                   tie_word_embeddings=True),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="NemotronForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.NemotronConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["minitron"][0]).cfg
  assert (cfg.layer_norm, cfg.norm_bias, cfg.norm_unit_offset, cfg.mlp_activation,
          cfg.qkv_bias, cfg.attn_out_bias, cfg.mlp_bias, cfg.head_dim,
          cfg.rope.rotary_dim(cfg.head_dim)) == (
      True, True, True, "relu2", False, False, False, 24, 12)
  biased = models.from_pretrained(saved["biased"][0]).cfg
  assert (biased.qkv_bias, biased.attn_out_bias, biased.mlp_bias, biased.tie_embeddings,
          biased.rope.partial_rotary_factor) == (True, True, True, True, 1.0)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


def test_layer_norm_1p_is_torchs_layer_norm_of_weight_plus_one():
  """Held as its files hold it (w, applied as 1 + w), with its bias."""
  norm = models.transformer.RMSNorm(8, 1e-5, np.float32, unit_offset=True, center=True,
                                    bias=True)
  rng = np.random.default_rng(0)
  w, b, x = rng.normal(size=8), rng.normal(size=8), rng.normal(size=(3, 8)) * 4 + 1
  norm.scale[...], norm.bias[...] = w.astype(np.float32), b.astype(np.float32)
  want = torch.nn.functional.layer_norm(torch.tensor(x), (8,), torch.tensor(w + 1.0),
                                        torch.tensor(b), 1e-5).numpy()
  np.testing.assert_allclose(np.asarray(norm(x.astype(np.float32))), want, atol=1e-5)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_norm_gradients_match_transformers(saved):
  folder, hf_model = saved["biased"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  assert_close_to_scale(grads["final_norm"]["scale"][...],
                        hf_model.model.norm.weight.grad.numpy())
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    for ours, theirs in (("input_norm", hf.input_layernorm),
                         ("post_attn_norm", hf.post_attention_layernorm)):
      assert_close_to_scale(layer[ours]["scale"][...], theirs.weight.grad.numpy())
      assert_close_to_scale(layer[ours]["bias"][...], theirs.bias.grad.numpy())
    assert_close_to_scale(layer["mlp"]["up_bias"][...], hf.mlp.up_proj.bias.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("minitron", False), ("biased", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.NemotronForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert (written["model_type"], written["hidden_act"]) == ("nemotron", "relu2")
  back = transformers.NemotronConfig(**{k: v for k, v in written.items()
                                        if k not in ("architectures", "model_type")})
  assert (back.head_dim, back.rope_parameters["partial_rotary_factor"]) == (
      (24, 0.5) if variant == "minitron" else (16, 1.0))


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("minitron", cls="NemotronForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.NemotronForSequenceClassification, tmp_path)


def test_peft_adapters_both_ways(saved, tmp_path):
  folder, hf = saved["biased"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("biased"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])


def test_what_other_classes_refuse(saved):
  """LayerNorm1P is Nemotron's: a Jais 2 (plain LayerNorms) does not hold it."""
  cfg = models.from_pretrained(saved["biased"][0]).cfg
  with pytest.raises(ValueError, match="norm_unit_offset=True cannot be written as Jais2"):
    models.hf.model_config_to_hf(cfg.replace(architecture="Jais2ForCausalLM",
                                             rope=models.RopeConfig(theta=cfg.rope.theta)))


def test_defaults_are_transformers():
  default = transformers.NemotronConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["NemotronForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps, cfg.rope.theta,
          cfg.rope.partial_rotary_factor, cfg.tie_embeddings, cfg.qkv_bias, cfg.mlp_bias,
          cfg.max_position_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads,
      default.num_key_value_heads or default.num_attention_heads, default.head_dim,
      default.norm_eps, default.rope_parameters["rope_theta"],
      default.rope_parameters["partial_rotary_factor"], default.tie_word_embeddings,
      default.attention_bias, default.mlp_bias, default.max_position_embeddings)
