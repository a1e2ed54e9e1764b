"""Phi-1 / Phi-1.5 / Phi-2 (PhiForCausalLM) against `transformers`: attention and MLP side
by side under one LayerNorm with a bias, part of each head rotated, biases on every
projection, an MLP of no gate through gelu_new, and a bias on the output projection
(`lm_head_bias`) in the logits, the chunked log-probs, the sampler and the gradients.
Logits (layer list and scanned), log-probs, gradients, greedy generation, export, the
reward model, PEFT adapters, parameter counts, its defaults."""

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, check_peft_round_trip,
                                 check_reward_model_round_trip, greedy_tokens, hf_logits,
                                 perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=64, initializer_range=0.3,
              pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "phi2": dict(partial_rotary_factor=0.4),  # Phi-2's layout: 0.4 of each head rotated
    # grouped keys, the exact GELU, half of each head rotated, tied embeddings (the
    # output projection's bias its own)
    "grouped": dict(num_key_value_heads=2, hidden_act="gelu", tie_word_embeddings=True),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="PhiForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.PhiConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["phi2"][0]).cfg
  assert (cfg.layer_norm, cfg.norm_bias, cfg.mlp_bias, cfg.qkv_bias, cfg.attn_out_bias,
          cfg.parallel_residual, cfg.parallel_mlp_norm, cfg.lm_head_bias, cfg.mlp_activation,
          cfg.rope.rotary_dim(cfg.head_dim)) == (
      True, True, True, True, True, True, False, True, "gelu_tanh_ungated", 6)
  grouped = models.from_pretrained(saved["grouped"][0])
  assert (grouped.cfg.num_kv_heads, grouped.cfg.mlp_activation, grouped.cfg.tie_embeddings,
          grouped.cfg.rope.partial_rotary_factor) == (2, "gelu_ungated", True, 0.5)
  assert grouped.lm_head_bias[...].shape == (97,)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_chunked_log_probs_add_the_output_bias(saved):
  """token_logprobs (the train step's chunked head) adds lm_head's bias as the logits do:
  transformers' log-softmax at each target, in chunks that do not divide the length."""
  folder, hf = saved["grouped"]
  model = models.from_pretrained(folder, logprob_chunk=7)
  targets = np.roll(TOKENS, -1, axis=1)
  got = nnx.jit(lambda m, t, y: m.token_logprobs(t, y))(model, TOKENS, targets)
  want = jax.nn.log_softmax(hf_logits(hf, TOKENS), -1)
  np.testing.assert_allclose(np.asarray(got),
                             np.take_along_axis(np.asarray(want), targets[..., None], -1)[..., 0],
                             atol=1e-4, rtol=0)


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for the output projection's bias, the attention's
  dense (o_proj) and the MLP's biases, and the one norm of each layer."""
  folder, hf_model = saved["phi2"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  assert_close_to_scale(grads["lm_head_bias"][...], hf_model.lm_head.bias.grad.numpy())
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    for ours, theirs in ((layer["attn"]["o_bias"], hf.self_attn.dense.bias),
                         (layer["mlp"]["up_bias"], hf.mlp.fc1.bias),
                         (layer["mlp"]["down_bias"], hf.mlp.fc2.bias),
                         (layer["input_norm"]["bias"], hf.input_layernorm.bias),
                         (layer["input_norm"]["scale"], hf.input_layernorm.weight)):
      assert_close_to_scale(ours[...], theirs.grad.numpy())
    assert_close_to_scale(layer["attn"]["o_proj"][...],
                          hf.self_attn.dense.weight.grad.numpy().T.reshape(4, 16, 64))


@pytest.mark.parametrize("variant,scan", [("phi2", False), ("grouped", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.PhiForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["hidden_act"]) == (
      "phi", "gelu_new" if variant == "phi2" else "gelu")
  back = transformers.PhiConfig(**{k: v for k, v in written.items()
                                   if k not in ("architectures", "model_type")})
  assert back.rope_parameters["partial_rotary_factor"] == (0.4 if variant == "phi2" else 0.5)


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("phi2", cls="PhiForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.PhiForSequenceClassification, tmp_path)


def test_reward_model_from_a_causal_folder_leaves_the_output_projection(saved):
  """A reward model started from Phi's causal-LM folder reads neither lm_head's weight
  nor its bias, and has no parameter for either."""
  rm = models.from_pretrained(saved["phi2"][0], lm_head=False, value_head=True,
                              architecture="PhiForSequenceClassification")
  assert not hasattr(rm, "lm_head") and not hasattr(rm, "lm_head_bias")
  assert rm.cfg.num_params == models.from_pretrained(saved["phi2"][0]).cfg.num_params - (
      97 * 64 + 97) + 64 + 1


def test_peft_adapters_both_ways(saved, tmp_path):
  """PEFT's names for Phi's modules: dense for o_proj, fc1 and fc2 for the MLP's."""
  folder, hf = saved["phi2"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("phi2"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                        peft_targets=["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"])


def test_what_phi_cannot_hold(saved):
  """q/k LayerNorms (qk_layernorm) are refused on reading; an output bias, on a class
  without one, and q/k/v without biases, on writing."""
  folder, hf = saved["phi2"]
  with pytest.raises(ValueError, match="qk_layernorm=true in a Phi config.json"):
    models.hf_config_to_model_config({**hf.config.to_dict(), "qk_layernorm": True})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="always has qkv_bias=True|always have biases"):
    models.hf.model_config_to_hf(cfg.replace(qkv_bias=False, attn_out_bias=False))
  llama = cfg.replace(architecture="LlamaForCausalLM", layer_norm=False, norm_bias=False,
                      mlp_bias=False, parallel_residual=False, mlp_activation="silu",
                      qkv_bias=False, attn_out_bias=False,
                      rope=models.RopeConfig(theta=cfg.rope.theta))
  with pytest.raises(ValueError, match="lm_head_bias=True cannot be written as Llama"):
    models.hf.model_config_to_hf(llama)
  models.hf.model_config_to_hf(llama.replace(lm_head_bias=False))  # the rest is Llama's


def test_defaults_are_transformers():
  default = transformers.PhiConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["PhiForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.norm_eps, cfg.rope.theta, cfg.rope.partial_rotary_factor,
          cfg.tie_embeddings, cfg.max_position_embeddings, cfg.mlp_activation) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.layer_norm_eps, default.rope_parameters["rope_theta"],
      default.rope_parameters["partial_rotary_factor"], default.tie_word_embeddings,
      default.max_position_embeddings, "gelu_tanh_ungated")
