"""StableLM 2 (StableLmForCausalLM) against `transformers`: LayerNorms with biases, a
quarter of each head rotated, q/k/v biases (use_qkv_bias), and in the 12B's layout q/k
LayerNorms per head (one tensor a head in the files) under parallel attention and MLP.
Logits (layer list and scanned), the per-head norms' gradients, greedy generation,
export, the reward model, PEFT adapters, parameter counts, its defaults."""

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
    "default": {},  # StableLM 2 1.6B's layout
    # StableLM 2 12B's: q/k norms per head, parallel layers; q/k/v biases, tied
    "twelve_b": dict(qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True,
                     tie_word_embeddings=True),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="StableLmForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.StableLmConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  assert (cfg.layer_norm, cfg.norm_bias, cfg.qk_norm, cfg.parallel_residual, cfg.qkv_bias,
          cfg.attn_out_bias, cfg.rope.partial_rotary_factor) == (
      True, True, False, False, False, False, 0.25)
  big = models.from_pretrained(saved["twelve_b"][0])
  assert (big.cfg.qk_norm, big.cfg.qk_norm_head_weights, big.cfg.parallel_residual,
          big.cfg.qkv_bias) == (True, True, True, True)
  assert big.layers[0].attn.q_norm.scale[...].shape == (4, 16)
  assert not hasattr(big.layers[0].attn.q_norm, "bias")  # the block norms' alone
  for variant, (_, hf) in saved.items():
    assert models.from_pretrained(saved[variant][0]).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_per_head_norm_and_bias_gradients_match_transformers(saved):
  folder, hf_model = saved["twelve_b"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    q = np.stack([n.weight.grad.numpy() for n in hf.self_attn.q_layernorm.norms])
    k = np.stack([n.weight.grad.numpy() for n in hf.self_attn.k_layernorm.norms])
    assert_close_to_scale(np.asarray(layer["attn"]["q_norm"]["scale"][...]), q)
    assert_close_to_scale(np.asarray(layer["attn"]["k_norm"]["scale"][...]), k)
    assert_close_to_scale(np.asarray(layer["input_norm"]["bias"][...]),
                          hf.input_layernorm.bias.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("default", False), ("twelve_b", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.StableLmForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "stablelm"
  assert (written["qk_layernorm"], written["use_parallel_residual"]) == (
      (variant == "twelve_b",) * 2)


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("twelve_b", cls="StableLmForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.StableLmForSequenceClassification, tmp_path)


def test_peft_adapters_both_ways(saved, tmp_path):
  folder, hf = saved["twelve_b"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("twelve_b"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"])


def test_defaults_are_transformers():
  default = transformers.StableLmConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["StableLmForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.norm_eps, cfg.rope.theta, cfg.rope.partial_rotary_factor,
          cfg.tie_embeddings, cfg.qk_norm, cfg.parallel_residual) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.layer_norm_eps, default.rope_parameters["rope_theta"],
      default.rope_parameters["partial_rotary_factor"], default.tie_word_embeddings,
      default.qk_layernorm, default.use_parallel_residual)
