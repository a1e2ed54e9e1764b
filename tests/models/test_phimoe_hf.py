"""Phi-3.5-MoE (PhimoeForCausalLM) against `transformers`: Mixtral's mixture and files
routed by sparsemixer (each chosen expert weighted by the softmax over the logits within
its band), LayerNorms with biases, biases on every attention projection and on the
output projection, LongRoPE with its cos / sin scale (short_mscale, long_mscale). The
router against transformers' own sparsemixer, logits (layer list and scanned),
gradients through the router, greedy generation, export, the reward model, parameter
counts, its defaults, what it refuses."""

import numpy as np
import pytest

from posttrain import models
from posttrain.models.transformer import sparsemixer
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, check_reward_model_round_trip, greedy_tokens,
                                 perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
ROPE = dict(rope_type="longrope", rope_theta=10_000.0, original_max_position_embeddings=32,
            short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0],
            long_factor=[1.0, 1.5, 2.2, 3.0, 4.0, 5.5, 7.0, 9.0], short_mscale=1.2,
            long_mscale=1.2)
VARIANTS = {
    # Phi-3.5-MoE's: biases on the attention and the output, LongRoPE scaled
    "phimoe": dict(attention_bias=True, lm_head_bias=True, rope_parameters=ROPE),
    # a wide band (the softmax over several logits), no biases, the default rotation
    "wide": dict(router_jitter_noise=0.4),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 24))  # within the original 32
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="PhimoeForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.PhimoeConfig(**{**COMMON, **VARIANTS[variant], **extra})
  model = perturb(getattr(transformers, cls)(cfg).float().eval())
  with torch.no_grad():  # routers that prefer different experts for different tokens
    for name, p in model.named_parameters():
      if name.endswith("router.weight"):
        p.normal_(0.0, 0.5)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


@pytest.mark.parametrize("eps", [0.01, 0.4])
def test_sparsemixer_is_transformers(eps):
  """Weights and experts of random logits, ties and all-equal rows among them, and the
  gradient of the weights: transformers' own function (evaluation)."""
  from transformers.models.phimoe.modeling_phimoe import sparsemixer as theirs
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(64, 6)).astype(np.float32) * 2
  logits[0] = 1.0  # all tied
  logits[1, :3] = logits[1, 0]  # a tie at the top
  logits[2] = 0.0  # zero over zero: in the band, as transformers has it
  t = torch.tensor(logits, requires_grad=True)
  w_t, e_t = theirs(t, jitter_eps=eps, training=False, top_k=2)
  (w_t * torch.tensor([[1.0, -2.0]])).sum().backward()
  import jax
  import jax.numpy as jnp

  def loss(x):
    w, _ = sparsemixer(x, 2, eps)
    return jnp.sum(w * jnp.asarray([[1.0, -2.0]]))

  w, e = sparsemixer(jnp.asarray(logits), 2, eps)
  np.testing.assert_array_equal(np.asarray(e), e_t.numpy())
  np.testing.assert_allclose(np.asarray(w), w_t.detach().numpy(), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(jax.grad(loss)(jnp.asarray(logits))),
                             t.grad.numpy(), rtol=1e-5, atol=1e-6)
  # a replayed choice is weighted by its own band
  given = jnp.asarray(e_t.numpy()[:, ::-1].copy())
  w_given, e_given = sparsemixer(jnp.asarray(logits), 2, eps, given)
  np.testing.assert_array_equal(np.asarray(e_given), np.asarray(given))
  assert np.all(np.isfinite(np.asarray(w_given)))


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["phimoe"][0]).cfg
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.router_scoring, cfg.router_jitter_eps,
          cfg.norm_topk_prob, cfg.layer_norm, cfg.norm_bias, cfg.qkv_bias, cfg.attn_out_bias,
          cfg.lm_head_bias, cfg.rope.type, cfg.rope.attention_factor) == (
      4, 2, "sparsemixer", 0.01, False, True, True, True, True, True, "longrope", 1.2)
  wide = models.from_pretrained(saved["wide"][0]).cfg
  assert (wide.router_jitter_eps, wide.qkv_bias, wide.lm_head_bias, wide.rope.type) == (
      0.4, False, False, "default")
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_gradients_through_the_router_match_transformers(saved):
  folder, hf_model = saved["wide"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    assert_close_to_scale(layer["mlp"]["router"][...], hf.mlp.router.weight.grad.numpy().T)
    assert_close_to_scale(layer["input_norm"]["bias"][...],
                          hf.input_layernorm.bias.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("phimoe", False), ("wide", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.PhimoeForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["router_jitter_noise"]) == (
      "phimoe", VARIANTS[variant].get("router_jitter_noise", 0.01))


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("phimoe", cls="PhimoeForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.PhimoeForSequenceClassification, tmp_path)


def test_what_phimoe_refuses(saved):
  base = saved["phimoe"][1].config.to_dict()
  with pytest.raises(ValueError, match="short_mscale=1.2 and long_mscale=1.5"):
    models.hf_config_to_model_config(
        {**base, "rope_parameters": {**ROPE, "long_mscale": 1.5}})
  cfg = models.from_pretrained(saved["phimoe"][0]).cfg
  with pytest.raises(ValueError, match="router_scoring='softmax' cannot be written as Phimoe"):
    models.hf.model_config_to_hf(cfg.replace(router_scoring="softmax"))
  with pytest.raises(ValueError, match="sparsemixer' weighs each chosen expert itself"):
    cfg.replace(norm_topk_prob=True)


def test_defaults_are_transformers():
  default = transformers.PhimoeConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["PhimoeForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.num_experts, cfg.num_experts_per_tok, cfg.router_jitter_eps,
          cfg.norm_eps, cfg.rope.theta, cfg.max_position_embeddings, cfg.tie_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.num_local_experts, default.num_experts_per_tok, default.router_jitter_noise,
      default.rms_norm_eps, default.rope_parameters["rope_theta"],
      default.max_position_embeddings, default.tie_word_embeddings)
