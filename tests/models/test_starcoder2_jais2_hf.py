"""StarCoder2 (Starcoder2ForCausalLM) and Jais 2 (Jais2ForCausalLM) against
`transformers`: LayerNorms with biases, MLPs of no gate (StarCoder2's c_proj(gelu_tanh(
c_fc(x))), Jais 2's down(relu(up(x))^2)) with biases; StarCoder2's use_bias on every
projection and its window on every layer. Logits (layer list and scanned), the biases'
gradients, greedy generation, export, the reward model, PEFT adapters, parameter counts,
defaults, and what other classes refuse."""

import json

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
VARIANTS = {  # name -> (family, its config's fields here)
    "starcoder2": ("Starcoder2", dict(sliding_window=5)),  # biases everywhere, a window
    "starcoder2_plain": ("Starcoder2", dict(use_bias=False, tie_word_embeddings=False)),
    "jais2": ("Jais2", dict(head_dim=16)),  # attention and MLP biases
    "jais2_plain": ("Jais2", dict(head_dim=16, attention_bias=False, mlp_bias=False)),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, head="ForCausalLM", **extra):
  family, fields = VARIANTS[variant]
  cfg = getattr(transformers, family + "Config")(**{**COMMON, **fields, **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, family + head)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_variant(saved):
  want = {"starcoder2": ("gelu_tanh_ungated", True, True, True, 5),
          "starcoder2_plain": ("gelu_tanh_ungated", False, False, False, None),
          "jais2": ("relu2", True, True, True, None),
          "jais2_plain": ("relu2", False, False, False, None)}
  for variant, (act, qkv, out, mlp, window) in want.items():
    cfg = models.from_pretrained(saved[variant][0]).cfg
    assert (cfg.mlp_activation, cfg.qkv_bias, cfg.attn_out_bias, cfg.mlp_bias,
            cfg.sliding_window, cfg.layer_norm, cfg.norm_bias) == (
        act, qkv, out, mlp, window, True, True), variant
    assert cfg.num_params == sum(p.numel() for p in saved[variant][1].parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


@pytest.mark.parametrize("variant", ["starcoder2", "jais2"])
def test_bias_gradients_match_transformers(saved, variant):
  """d(sum of the targets' log-probs) of the norms' biases and the MLP's biases."""
  folder, hf_model = saved[variant]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  up, down = ("c_fc", "c_proj") if variant == "starcoder2" else ("up_proj", "down_proj")
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    pairs = [(layer["input_norm"]["bias"][...], hf.input_layernorm.bias.grad),
             (layer["post_attn_norm"]["bias"][...], hf.post_attention_layernorm.bias.grad),
             (layer["mlp"]["up_bias"][...], getattr(hf.mlp, up).bias.grad),
             (layer["mlp"]["down_bias"][...], getattr(hf.mlp, down).bias.grad)]
    for ours, theirs in pairs:
      assert_close_to_scale(np.asarray(ours), theirs.numpy())
  assert_close_to_scale(np.asarray(grads["final_norm"]["bias"][...]),
                        hf_model.model.norm.bias.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("starcoder2", False), ("jais2", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  family = VARIANTS[variant][0]
  written = check_export_round_trip(*saved[variant],
                                    getattr(transformers, family + "ForCausalLM"), TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == family.lower()
  if family == "Starcoder2":
    assert written["use_bias"] == (variant == "starcoder2")
    assert written["hidden_act"] == "gelu_pytorch_tanh"
  else:
    assert (written["attention_bias"], written["mlp_bias"]) == ((variant == "jais2",) * 2)


def test_starcoder2_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("starcoder2", head="ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.Starcoder2ForSequenceClassification,
                                tmp_path)


@pytest.mark.parametrize("variant", ["starcoder2", "jais2"])
def test_peft_adapters_both_ways(saved, variant, tmp_path):
  """Adapters on the attention and on the MLP's two projections (c_fc / c_proj,
  up_proj / down_proj), written for PEFT and read from it."""
  folder, hf = saved[variant]
  mlp = ["c_fc", "c_proj"] if variant == "starcoder2" else ["up_proj", "down_proj"]
  check_peft_round_trip(folder, hf, lambda: _hf_model(variant), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                        peft_targets=["q_proj", "k_proj", "v_proj", "o_proj"] + mlp)


@pytest.mark.parametrize("variant", ["starcoder2", "jais2"])
def test_defaults_are_transformers(variant):
  family = VARIANTS[variant][0]
  default = getattr(transformers, family + "Config")()
  cfg = models.hf_config_to_model_config({"architectures": [family + "ForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.rope.theta, cfg.tie_embeddings, cfg.qkv_bias,
          cfg.max_position_embeddings) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.num_key_value_heads,
      default.rope_parameters["rope_theta"], default.tie_word_embeddings,
      getattr(default, "use_bias", getattr(default, "attention_bias", None)),
      default.max_position_embeddings)
  assert cfg.norm_eps == getattr(default, "norm_epsilon", getattr(default, "layer_norm_eps", 0))


def test_refusals(saved):
  sc2 = models.from_pretrained(saved["starcoder2"][0]).cfg
  with pytest.raises(ValueError, match="mlp_bias=False cannot be written as Starcoder2"):
    models.hf.check_exportable(sc2.replace(mlp_bias=False))
  with pytest.raises(ValueError, match="norm_bias=True cannot be written as "
                                       "CohereForCausalLM"):
    models.hf.check_exportable(sc2.replace(
        architecture="CohereForCausalLM", sliding_window=None, mlp_bias=False,
        parallel_residual=True, mlp_activation="silu"))
  with pytest.raises(ValueError, match="norm_bias=True needs layer_norm=True"):
    sc2.replace(layer_norm=False)
  with pytest.raises(ValueError, match="mlp_bias=True .* no mixture of experts form"):
    models.get_preset("tiny").replace(mlp_bias=True, num_experts=4, num_experts_per_tok=2)
  with pytest.raises(ValueError, match="gelu_tanh_ungated.* no mixture of experts form"):
    models.get_preset("tiny").replace(mlp_activation="gelu_tanh_ungated", num_experts=4,
                                      num_experts_per_tok=2)
  with open(f"{saved['starcoder2'][0]}/config.json") as f:
    written = json.load(f)
  with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
    models.hf_config_to_model_config({**written, "hidden_act": "gelu"})
