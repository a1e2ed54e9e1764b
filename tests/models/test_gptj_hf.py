"""GPT-J (GPTJForCausalLM) against `transformers`: attention and MLP side by side under one
LayerNorm with a bias, the first rotary_dim features of each head rotated by interleaved
pairs, no attention biases, an MLP of no gate through gelu_new with biases, a bias on the
output projection, GPT-2's config keys and its own tensor names. Logits (layer list and
scanned), gradients, greedy generation, export, the reward model, PEFT adapters,
parameter counts, its defaults, what it refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, check_peft_round_trip,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "gptj": dict(rotary_dim=8),  # GPT-J 6B's layout: a quarter of each head rotated
    "whole": dict(rotary_dim=16, tie_word_embeddings=True, activation_function="gelu",
                  n_inner=80),  # every feature rotated, tied, the exact GELU
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="GPTJForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.GPTJConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["gptj"][0]).cfg
  assert (cfg.parallel_residual, cfg.parallel_mlp_norm, cfg.layer_norm, cfg.norm_bias,
          cfg.mlp_bias, cfg.qkv_bias, cfg.attn_out_bias, cfg.lm_head_bias, cfg.mlp_activation,
          cfg.rope.rotary_dim(cfg.head_dim), cfg.rope.theta, cfg.ffn_dim) == (
      True, False, True, True, True, False, False, True, "gelu_tanh_ungated", 8, 10_000.0,
      256)
  whole = models.from_pretrained(saved["whole"][0]).cfg
  assert (whole.rope.partial_rotary_factor, whole.tie_embeddings, whole.mlp_activation,
          whole.ffn_dim) == (1.0, True, "gelu_ungated", 80)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_gradients_match_transformers(saved):
  """q and k (their rotated features reordered from interleaved pairs), the output
  projection's bias and the MLP's."""
  folder, hf_model = saved["gptj"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  assert_close_to_scale(grads["lm_head_bias"][...], hf_model.lm_head.bias.grad.numpy())
  order = np.r_[0:8:2, 1:8:2, 8:16]  # ours: the rotated evens, odds, then the rest
  for i in range(COMMON["n_layer"]):
    layer, hf = grads["layers"][i], hf_model.transformer.h[i]
    q = hf.attn.q_proj.weight.grad.numpy().reshape(4, 16, 64)[:, order]
    assert_close_to_scale(layer["attn"]["q_proj"][...], q.transpose(2, 0, 1))
    assert_close_to_scale(layer["mlp"]["up_bias"][...], hf.mlp.fc_in.bias.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("gptj", False), ("whole", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.GPTJForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["rotary_dim"]) == (
      "gptj", 8 if variant == "gptj" else 16)


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("gptj", cls="GPTJForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.GPTJForSequenceClassification, tmp_path)


def test_peft_adapters_both_ways(saved, tmp_path):
  """PEFT's names: the attention under attn (out_proj for o_proj), fc_in and fc_out."""
  folder, hf = saved["gptj"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("gptj"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                        peft_targets=["q_proj", "k_proj", "v_proj", "out_proj", "fc_in",
                                      "fc_out"])


def test_what_gptj_refuses(saved):
  folder, hf = saved["gptj"]
  with pytest.raises(ValueError, match="rotary_dim=null in a GPT-J config.json"):
    models.hf_config_to_model_config({**hf.config.to_dict(), "rotary_dim": None})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="default one at base 10000"):
    models.hf.model_config_to_hf(cfg.replace(rope=models.RopeConfig(
        theta=5000.0, partial_rotary_factor=0.5)))
  with pytest.raises(ValueError, match="attention projections have no biases"):
    models.hf.model_config_to_hf(cfg.replace(qkv_bias=True))


def test_defaults_are_transformers():
  default = transformers.GPTJConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["GPTJForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.norm_eps, cfg.max_position_embeddings, cfg.tie_embeddings,
          cfg.rope.rotary_dim(cfg.head_dim)) == (
      default.vocab_size, default.n_embd, 4 * default.n_embd, default.n_layer,
      default.n_head, default.layer_norm_epsilon, default.n_positions,
      default.tie_word_embeddings, default.rotary_dim)
