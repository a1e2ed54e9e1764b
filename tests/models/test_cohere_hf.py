"""Cohere Command R / R+ / Aya Expanse (CohereForCausalLM) against `transformers`: layers
of x + attn(norm(x)) + mlp(norm(x)) under one LayerNorm without bias, every layer rotated
by interleaved pairs (reordered on load), the logits times logit_scale; with use_qk_norm
(Command R+) q and k LayerNorm-ed per head with a weight per head. Logits (layer list and
scanned), gradients of the per-head norms, greedy generation, export, PEFT adapters."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, check_peft_round_trip, greedy_tokens,
                                 hf_logits, perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # Command R / Aya Expanse: no q/k norms, tied embeddings
    "default": dict(logit_scale=0.5),
    # Command R+: q/k norms per head, biases on all four attention projections, untied
    "qk_norm": dict(use_qk_norm=True, attention_bias=True, tie_word_embeddings=False,
                    logit_scale=2.0),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.CohereConfig(**{**COMMON, **VARIANTS[variant]})
  return perturb(transformers.CohereForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_each_variant(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  assert (cfg.layer_norm, cfg.parallel_residual, cfg.lm_head_multiplier, cfg.head_dim,
          cfg.qk_norm, cfg.tie_embeddings, cfg.sliding_window) == (
      True, True, 0.5, 12, False, True, None)
  plus = models.from_pretrained(saved["qk_norm"][0])
  assert (plus.cfg.qk_norm, plus.cfg.qk_norm_head_weights, plus.cfg.qkv_bias,
          plus.cfg.attn_out_bias) == (True, True, True, True)
  assert plus.layers[0].attn.q_norm.scale[...].shape == (4, 12)
  assert plus.layers[0].attn.k_norm.scale[...].shape == (2, 12)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_a_weight_per_head_moves_the_logits(saved):
  """Each head's norm weight set to the heads' mean (one shared weight), the logits move
  by far more than the tolerance: the weights per head are read and used."""
  folder, hf = saved["qk_norm"]
  model = models.from_pretrained(folder)
  want = hf_logits(hf, TOKENS)
  for layer in model.layers:
    w = layer.attn.q_norm.scale[...]
    layer.attn.q_norm.scale[...] = np.broadcast_to(np.asarray(w).mean(0, keepdims=True),
                                                   w.shape)
  assert np.abs(np.asarray(model(TOKENS)) - want).max() > 1e-2


def test_per_head_norm_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) of the q/k norms' weights, back in HF's
  interleaved order."""
  folder, hf_model = saved["qk_norm"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  back = np.argsort(list(range(0, 12, 2)) + list(range(1, 12, 2)))
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i].self_attn
    for ours, theirs in ((layer["attn"]["q_norm"]["scale"][...], hf.q_norm.weight.grad),
                         (layer["attn"]["k_norm"]["scale"][...], hf.k_norm.weight.grad)):
      assert_close_to_scale(np.asarray(ours)[:, back], theirs.numpy())


@pytest.mark.parametrize("variant,scan", [("default", False), ("qk_norm", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, scan)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.CohereForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["logit_scale"], written["use_qk_norm"]) == (
      "cohere", VARIANTS[variant]["logit_scale"], variant == "qk_norm")


def test_peft_adapters_both_ways(saved, tmp_path):
  folder, hf = saved["qk_norm"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("qk_norm"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])


def test_refusals(saved):
  cfg = models.from_pretrained(saved["qk_norm"][0]).cfg
  with pytest.raises(ValueError, match="qk_norm_head_weights=True cannot be written as "
                                       "Qwen3ForCausalLM"):
    models.hf.check_exportable(cfg.replace(
        architecture="Qwen3ForCausalLM", layer_norm=False, parallel_residual=False,
        lm_head_multiplier=1.0))
  with pytest.raises(ValueError, match="sliding_window"):
    models.hf.check_exportable(cfg.replace(sliding_window=8))
  with pytest.raises(ValueError, match="qk_norm_head_weights=True needs qk_norm=True"):
    cfg.replace(qk_norm=False)
  with pytest.raises(ValueError, match="two layouts of the q/k norms"):
    cfg.replace(qk_norm_heads=True)
