"""OPT (OPTForCausalLM) against `transformers`: learned positions from the third row of
their table on, no rotary embedding, LayerNorms with biases (or with neither weight nor
bias), enable_bias on every projection, an MLP of no gate fc2(relu(fc1(x))), tied
embeddings, its own tensor names. Logits (layer list and scanned), packed rows,
gradients of the position table, greedy generation, export, the reward model, PEFT
adapters, parameter counts, its defaults, and OPT-350m's layout refused."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, check_packed_rows_run_apart,
                                 check_peft_round_trip, check_reward_model_round_trip,
                                 greedy_tokens, perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              ffn_dim=96, max_position_embeddings=48, init_std=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, dropout=0.0)
VARIANTS = {
    "opt": {},  # OPT-125m's layout: biases everywhere, tied
    # no biases, norms of neither weight nor bias, untied
    "plain": dict(enable_bias=False, layer_norm_elementwise_affine=False,
                  tie_word_embeddings=False),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="OPTForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.OPTConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["opt"][0]).cfg
  assert (cfg.learned_positions, cfg.position_offset, cfg.rope_layers, cfg.layer_norm,
          cfg.norm_bias, cfg.norm_weightless, cfg.qkv_bias, cfg.attn_out_bias, cfg.mlp_bias,
          cfg.mlp_activation, cfg.tie_embeddings) == (
      True, 2, (0, 0, 0), True, True, False, True, True, True, "relu_ungated", True)
  model = models.from_pretrained(saved["opt"][0])
  assert model.pos_embed[...].shape == (50, 64)  # 48 positions past two unread rows
  plain = models.from_pretrained(saved["plain"][0]).cfg
  assert (plain.norm_bias, plain.norm_weightless, plain.qkv_bias, plain.mlp_bias,
          plain.tie_embeddings) == (False, True, False, False, False)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_packed_rows_read_their_own_positions(saved):
  check_packed_rows_run_apart(models.from_pretrained(saved["opt"][0]), TOKENS)


def test_gradients_match_transformers(saved):
  """The position table's (its two unread rows without any) and the MLP's."""
  folder, hf_model = saved["opt"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  table = hf_model.model.decoder.embed_positions.weight.grad.numpy()
  assert not np.any(table[:2])
  assert_close_to_scale(grads["pos_embed"][...], table)
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.decoder.layers[i]
    assert_close_to_scale(layer["mlp"]["up_proj"][...], hf.fc1.weight.grad.numpy().T)
    assert_close_to_scale(layer["post_attn_norm"]["bias"][...],
                          hf.final_layer_norm.bias.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("opt", False), ("plain", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  """The position table with its two unread rows, bit for bit."""
  written = check_export_round_trip(*saved[variant], transformers.OPTForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["enable_bias"]) == ("opt", variant == "opt")


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("opt", cls="OPTForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.OPTForSequenceClassification, tmp_path)


def test_peft_adapters_both_ways(saved, tmp_path):
  """PEFT's names: out_proj, and fc1 / fc2 on the layer itself."""
  folder, hf = saved["opt"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("opt"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                        peft_targets=["q_proj", "k_proj", "v_proj", "out_proj", "fc1",
                                      "fc2"])


def test_opt_350m_layouts_are_refused(saved):
  base = saved["opt"][1].config.to_dict()
  for change, match in ((dict(do_layer_norm_before=False), "do_layer_norm_before=false"),
                        (dict(word_embed_proj_dim=32), "word_embed_proj_dim=32"),
                        (dict(_remove_final_layer_norm=True), "_remove_final_layer_norm"),
                        (dict(activation_function="gelu"), "activation_function='gelu'")):
    with pytest.raises(ValueError, match=match):
      models.hf_config_to_model_config({**base, **change})


def test_defaults_are_transformers():
  default = transformers.OPTConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["OPTForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.max_position_embeddings, cfg.tie_embeddings, cfg.qkv_bias) == (
      default.vocab_size, default.hidden_size, default.ffn_dim, default.num_hidden_layers,
      default.num_attention_heads, default.max_position_embeddings,
      default.tie_word_embeddings, default.enable_bias)
