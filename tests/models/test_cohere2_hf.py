"""Cohere Command R7B / Command A (Cohere2ForCausalLM) against `transformers`: layers of
x + attn(norm(x)) + mlp(norm(x)) under one LayerNorm without bias, sliding layers rotated
by interleaved pairs (reordered on load) beside full layers with no position embedding,
the logits times logit_scale; and Cohere2-MoE (Cohere2MoeForCausalLM): those layers over
a mixture (softmax over the top-k logits, or sigmoids), a leading dense layer whose full
attention rotates, shared experts averaged with or added to the routed ones, an RMSNorm
where the file says so. Logits (layer list and scanned), what each piece does, greedy
generation, export and PEFT adapters."""

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_peft_round_trip, greedy_tokens, hf_logits, perturb,
                                 save_families, spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              sliding_window=5)
VARIANTS = {
    # three sliding layers (window 5, shorter than the rows) to a full one
    "default": dict(logit_scale=0.5),
    # biases on all four attention projections, two layers of each kind, untied
    "biased": dict(attention_bias=True, tie_word_embeddings=False, logit_scale=2.0,
                   layer_types=["sliding_attention", "full_attention"] * 2),
}
MOE = dict(vocab_size=97, hidden_size=48, intermediate_size=24, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=12,
           max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
           bos_token_id=2, eos_token_id=1, sliding_window=5, num_experts=6,
           num_experts_per_tok=2, logit_scale=1.0)
MOE_VARIANTS = {
    # a dense first layer (full, rotating), one shared expert averaged in, LayerNorms
    "softmax": dict(num_shared_experts=1, first_k_dense_replace=1,
                    prefix_dense_intermediate_size=56),
    # sigmoid scores not renormalised, two shared experts summed, RMSNorms
    "sigmoid_rms": dict(expert_selection_fn="sigmoid", norm_topk_prob=False,
                        rms_norm_eps=1e-6, num_shared_experts=2,
                        shared_expert_combination_strategy="sum"),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.Cohere2Config(**{**COMMON, **VARIANTS[variant]})
  return perturb(transformers.Cohere2ForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def _hf_moe(variant):
  torch.manual_seed(0)
  cfg = transformers.Cohere2MoeConfig(**{**MOE, **MOE_VARIANTS[variant]})
  return spread_routers(perturb(transformers.Cohere2MoeForCausalLM(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
  return save_families(tmp_path_factory, MOE_VARIANTS, _hf_moe)


def test_config_reads_the_parallel_layers(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  assert (cfg.layer_norm, cfg.parallel_residual, cfg.lm_head_multiplier, cfg.head_dim) == (
      True, True, 0.5, 12)
  assert cfg.sliding_layers == (True, True, True, False)
  assert cfg.rope_layers == (1, 1, 1, 0)
  model = models.from_pretrained(saved["default"][0])
  assert not hasattr(model.layers[0], "post_attn_norm")


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_each_piece_moves_the_logits(saved):
  """Read with RMSNorms, or with the full layers rotating, the logits move by far more
  than the tolerance."""
  folder, hf = saved["default"]
  model = models.from_pretrained(folder)
  want = hf_logits(hf, TOKENS)
  for change in (dict(layer_norm=False), dict(rope_layers=())):
    other = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda c=change: models.Transformer(
        model.cfg.replace(**c), rngs=nnx.Rngs(0)))), nnx.state(model))
    assert np.abs(np.asarray(other(TOKENS)) - want).max() > 1e-2, change


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved["default"], PROMPTS, 10, scan)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Cohere2ForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["logit_scale"]) == (
      "cohere2", VARIANTS[variant]["logit_scale"])


def test_peft_adapters_both_ways(saved, tmp_path):
  """q_proj's and k_proj's B rows in the files' interleaved order, as their weights'."""
  folder, hf = saved["biased"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("biased"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"])


def test_refusals(saved):
  cfg = models.from_pretrained(saved["default"][0]).cfg
  with pytest.raises(ValueError, match="parallel_residual=True cannot be written as "
                                       "LlamaForCausalLM"):
    models.hf.check_exportable(cfg.replace(architecture="LlamaForCausalLM", layer_norm=False,
                                           lm_head_multiplier=1.0, sliding_window=None,
                                           layer_types=(), rope_layers=()))
  with pytest.raises(ValueError, match="rope_layers=.* cannot be written as Cohere2"):
    models.hf.check_exportable(cfg.replace(rope_layers=()))
  with pytest.raises(ValueError, match="head_dim=8 cannot be written as Cohere2ForCausalLM"):
    models.hf.check_exportable(cfg.replace(head_dim=8))
  with pytest.raises(ValueError, match="parallel_residual=True .* with sandwich_norms"):
    cfg.replace(sandwich_norms=True)


def test_the_mixture_config(saved_moe):
  cfg = models.from_pretrained(saved_moe["softmax"][0]).cfg
  assert (cfg.num_experts, cfg.ffn_dim, cfg.shared_expert_dim, cfg.shared_expert_average,
          cfg.dense_layers, cfg.dense_ffn_dim, cfg.router_scoring, cfg.layer_norm) == (
      6, 24, 24, True, 1, 56, "softmax", True)
  assert cfg.rope_layers == (1, 1, 1, 1)  # the dense prefix's full layer rotates
  other = models.from_pretrained(saved_moe["sigmoid_rms"][0]).cfg
  assert (other.router_scoring, other.norm_topk_prob, other.router_correction_bias,
          other.shared_expert_dim, other.shared_expert_average, other.layer_norm) == (
      "sigmoid", False, False, 48, False, False)
  assert other.rope_layers == (1, 1, 1, 0)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_mixture_logits_match_transformers(saved_moe, variant, scan):
  check_logits(*saved_moe[variant], TOKENS, scan)


def test_mixture_greedy_generation_matches_transformers(saved_moe):
  for i, (got, want) in enumerate(greedy_tokens(*saved_moe["softmax"], PROMPTS, 10, True)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_mixture_export_round_trip_is_exact(saved_moe, variant, tmp_path):
  written = check_export_round_trip(*saved_moe[variant], transformers.Cohere2MoeForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "cohere2_moe"


def test_mixture_refusals(saved_moe):
  cfg = models.from_pretrained(saved_moe["softmax"][0]).cfg
  with pytest.raises(ValueError, match="shared_expert_average=True cannot be written as "
                                       "Qwen3MoeForCausalLM"):
    models.hf._check_mixture_options(cfg.replace(architecture="Qwen3MoeForCausalLM"),
                                     "Qwen3MoeForCausalLM")
  with pytest.raises(ValueError, match="norm_topk_prob=False cannot be written as "
                                       "Cohere2MoeForCausalLM"):
    models.hf.check_exportable(cfg.replace(norm_topk_prob=False))
  with pytest.raises(ValueError, match="rope_layers=.* cannot be written as Cohere2Moe"):
    models.hf.check_exportable(cfg.replace(rope_layers=(1, 0, 1, 1)))
  written = models.hf.model_config_to_hf(cfg)
  with pytest.raises(ValueError, match="dense layers other than the first few"):
    models.hf_config_to_model_config({**written, "mlp_layer_types": ["sparse", "dense"] * 2})
  with pytest.raises(ValueError, match="expert_selection_fn='relu'"):
    models.hf_config_to_model_config({**written, "expert_selection_fn": "relu"})
