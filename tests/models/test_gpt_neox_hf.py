"""GPT-NeoX-20B and Pythia (GPTNeoXForCausalLM) against `transformers`: LayerNorms with
biases, a quarter of each head rotated, q, k and v fused head by head in one
query_key_value, biases on every projection, an MLP of no gate through the exact GELU,
attention and MLP side by side each under its own norm (use_parallel_residual), its own
tensor names. Logits (layer list and scanned), gradients through the fused projection,
greedy generation, export, the reward model, parameter counts, its defaults, what it
cannot hold."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_fused_qkv_peft, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=64, initializer_range=0.3,
              pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "pythia": {},  # Pythia's layout: parallel layers, exact GELU, a quarter rotated
    # sequential layers, tanh's GELU (GPT-NeoX-20B's gelu_fast), no attention biases,
    # half of each head rotated at another base, tied embeddings
    "sequential": dict(use_parallel_residual=False, hidden_act="gelu_fast",
                       attention_bias=False, rotary_pct=0.5, rotary_emb_base=5000,
                       tie_word_embeddings=True),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="GPTNeoXForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.GPTNeoXConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["pythia"][0]).cfg
  assert (cfg.layer_norm, cfg.norm_bias, cfg.mlp_bias, cfg.qkv_bias, cfg.attn_out_bias,
          cfg.parallel_residual, cfg.parallel_mlp_norm, cfg.mlp_activation, cfg.num_kv_heads,
          cfg.rope.partial_rotary_factor, cfg.rope.theta) == (
      True, True, True, True, True, True, True, "gelu_ungated", 4, 0.25, 10_000.0)
  seq = models.from_pretrained(saved["sequential"][0]).cfg
  assert (seq.parallel_residual, seq.parallel_mlp_norm, seq.mlp_activation, seq.qkv_bias,
          seq.attn_out_bias, seq.rope.partial_rotary_factor, seq.rope.theta,
          seq.tie_embeddings) == (False, False, "gelu_tanh_ungated", False, False, 0.5,
                                  5000.0, True)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


def test_published_config_keys_are_read():
  """Pythia's config.json says rotary_pct and rotary_emb_base at the top level (no
  rope_parameters), hidden_act gelu, and nothing of attention_bias (on by default)."""
  cfg = models.hf_config_to_model_config({
      "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
      "hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8,
      "num_hidden_layers": 6, "vocab_size": 50_304, "rotary_pct": 0.25,
      "rotary_emb_base": 10_000, "layer_norm_eps": 1e-5, "hidden_act": "gelu",
      "use_parallel_residual": True, "tie_word_embeddings": False, "rope_scaling": None,
      "max_position_embeddings": 2048})
  assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope.rotary_dim(cfg.head_dim), cfg.qkv_bias,
          cfg.attn_out_bias, cfg.norm_eps) == (64, 8, 16, True, True, 1e-5)
  assert cfg.num_params == 70_426_624  # Pythia-70M's


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for q, k and v (each head's slices of the fused
  query_key_value, weight and bias) and both layer norms, against torch autograd."""
  folder, hf_model = saved["pythia"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  d, n, h = 64, 4, 16
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.gpt_neox.layers[i]
    qkv = hf.attention.query_key_value
    weight = qkv.weight.grad.numpy().reshape(n, 3, h, d)
    bias = qkv.bias.grad.numpy().reshape(n, 3, h)
    for j, name in enumerate("qkv"):
      assert_close_to_scale(layer["attn"][f"{name}_proj"][...],
                            weight[:, j].transpose(2, 0, 1))
      assert_close_to_scale(layer["attn"][f"{name}_bias"][...], bias[:, j])
    for ours, theirs in (("input_norm", hf.input_layernorm),
                         ("post_attn_norm", hf.post_attention_layernorm)):
      assert_close_to_scale(layer[ours]["scale"][...], theirs.weight.grad.numpy())
      assert_close_to_scale(layer[ours]["bias"][...], theirs.bias.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("pythia", False), ("sequential", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  """save_pretrained fuses q, k and v again under GPT-NeoX's names, bit for bit."""
  written = check_export_round_trip(*saved[variant], transformers.GPTNeoXForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "gpt_neox"
  assert (written["use_parallel_residual"], written["hidden_act"]) == (
      (True, "gelu") if variant == "pythia" else (False, "gelu_fast"))
  back = transformers.GPTNeoXConfig(**{k: v for k, v in written.items()
                                       if k not in ("architectures", "model_type")})
  assert back.rope_parameters["partial_rotary_factor"] == (
      0.25 if variant == "pythia" else 0.5)


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("pythia", cls="GPTNeoXForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.GPTNeoXForSequenceClassification, tmp_path)


def test_reward_model_from_a_causal_folder_leaves_embed_out(saved):
  """A reward model started from Pythia's causal-LM folder reads its trunk and not its
  output projection (embed_out), which it has no place for."""
  rm = models.from_pretrained(saved["pythia"][0], lm_head=False, value_head=True,
                              architecture="GPTNeoXForSequenceClassification")
  causal = models.from_pretrained(saved["pythia"][0])
  np.testing.assert_array_equal(np.asarray(rm.embed[...]), np.asarray(causal.embed[...]))
  assert not hasattr(rm, "lm_head")


def test_what_gpt_neox_cannot_hold(saved):
  """Grouped keys, or attention biases on q/k/v alone: each a one-line error."""
  model = models.from_pretrained(saved["pythia"][0])
  for change, match in ((dict(num_kv_heads=2), "a head for each"),
                        (dict(attn_out_bias=False), "always has attn_out_bias=True")):
    with pytest.raises(ValueError, match=match):
      models.hf.model_config_to_hf(model.cfg.replace(**change))


def test_defaults_are_transformers():
  default = transformers.GPTNeoXConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["GPTNeoXForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.norm_eps, cfg.rope.theta, cfg.rope.partial_rotary_factor, cfg.tie_embeddings,
          cfg.parallel_residual, cfg.qkv_bias, cfg.max_position_embeddings,
          cfg.mlp_activation) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.layer_norm_eps,
      default.rope_parameters["rope_theta"], default.rope_parameters["partial_rotary_factor"],
      default.tie_word_embeddings, default.use_parallel_residual, default.attention_bias,
      default.max_position_embeddings, "gelu_ungated")


def test_peft_adapters_on_the_fused_projection_are_read(saved, tmp_path):
  """PEFT's one adapter on query_key_value read as q, k and v's; ours on dense both ways."""
  folder, hf = saved["pythia"]
  check_fused_qkv_peft(folder, hf, lambda: _hf_model("pythia"), TOKENS, tmp_path,
                       "query_key_value", "dense", ["o_proj"])
