"""StarCoder 1 / SantaCoder / WizardCoder (GPTBigCodeForCausalLM) against `transformers`:
GPT-2's layers and learned positions, its projections Linear's, q, k and v fused in c_attn
(multi-query: one key/value head after the queries; else each head's q, k and v).
Logits (layer list and scanned), gradients through the fused projection, greedy
generation, export, the reward model, parameter counts, its defaults, what it refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_fused_qkv_peft, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=48,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
VARIANTS = {
    "starcoder": {},  # multi-query attention, tied
    "multi_head": dict(multi_query=False, tie_word_embeddings=False, n_inner=80),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="GPTBigCodeForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.GPTBigCodeConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["starcoder"][0]).cfg
  assert (cfg.num_kv_heads, cfg.learned_positions, cfg.rope_layers, cfg.qkv_bias,
          cfg.attn_out_bias, cfg.mlp_bias, cfg.mlp_activation, cfg.tie_embeddings) == (
      1, True, (0, 0, 0), True, True, True, "gelu_tanh_ungated", True)
  multi = models.from_pretrained(saved["multi_head"][0]).cfg
  assert (multi.num_kv_heads, multi.ffn_dim, multi.tie_embeddings) == (4, 80, False)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_gradients_through_the_fused_projection_match_transformers(saved):
  """Multi-query c_attn: [queries; the key head; the value head]."""
  folder, hf_model = saved["starcoder"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  for i in range(COMMON["n_layer"]):
    layer, hf = grads["layers"][i], hf_model.transformer.h[i]
    weight = hf.attn.c_attn.weight.grad.numpy()  # [64 + 16 + 16, 64]
    assert_close_to_scale(layer["attn"]["q_proj"][...], weight[:64].T.reshape(64, 4, 16))
    assert_close_to_scale(layer["attn"]["v_proj"][...], weight[80:].T.reshape(64, 1, 16))
    assert_close_to_scale(layer["attn"]["v_bias"][...],
                          hf.attn.c_attn.bias.grad.numpy()[80:].reshape(1, 16))


@pytest.mark.parametrize("variant,scan", [("starcoder", False), ("multi_head", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.GPTBigCodeForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert (written["model_type"], written["multi_query"]) == (
      "gpt_bigcode", variant == "starcoder")


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("starcoder", cls="GPTBigCodeForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.GPTBigCodeForSequenceClassification,
                                tmp_path)


def test_what_gpt_bigcode_refuses(saved):
  folder, hf = saved["starcoder"]
  with pytest.raises(ValueError, match="scale_attn_weights=false in a GPTBigCode"):
    models.hf_config_to_model_config({**hf.config.to_dict(), "scale_attn_weights": False})
  cfg = models.from_pretrained(saved["multi_head"][0]).cfg
  with pytest.raises(ValueError, match="num_kv_heads=2 cannot be written as GPTBigCode"):
    models.hf.model_config_to_hf(cfg.replace(num_kv_heads=2))


def test_defaults_are_transformers():
  default = transformers.GPTBigCodeConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["GPTBigCodeForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.max_position_embeddings, cfg.tie_embeddings) == (
      default.vocab_size, default.n_embd, 4 * default.n_embd, default.n_layer,
      default.n_head, 1, default.n_positions, default.tie_word_embeddings)


def test_peft_adapters_on_the_fused_projection_are_read(saved, tmp_path):
  """PEFT's one adapter on c_attn read as q, k and v's; ours on c_fc both ways."""
  folder, hf = saved["starcoder"]
  check_fused_qkv_peft(folder, hf, lambda: _hf_model("starcoder"), TOKENS, tmp_path,
                       "c_attn", "c_fc", ["up_proj"])
