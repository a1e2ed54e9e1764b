"""BLOOM (BloomForCausalLM) against `transformers`: ALiBi in place of any position
embedding (a non-power-of-two head count's slopes and a power of two's), a LayerNorm on
the embeddings, q, k and v fused head by head in query_key_value, biases everywhere, an
MLP of no gate through tanh's GELU, Falcon's tensor names. Logits (layer list and
scanned), packed rows, gradients, greedy generation through the KV cache, export, the
reward model, parameter counts, its defaults, what it refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_fused_qkv_peft, check_logits,
                                 check_packed_rows_run_apart, check_reward_model_round_trip,
                                 greedy_tokens, perturb, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, n_layer=3, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # six heads: four slopes of a power of two, two between them; tied
    "bloom": dict(hidden_size=96, n_head=6),
    "untied": dict(hidden_size=64, n_head=8, tie_word_embeddings=False,
                   layer_norm_epsilon=1e-6),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 24))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="BloomForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.BloomConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def _bloom_slopes(n):
  """transformers' build_alibi_tensor's slopes, written out as BLOOM's paper has them."""
  p = 1 << (n.bit_length() - 1)
  slopes = [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]
  return slopes + [2.0 ** (-4.0 * i / p) for i in range(1, 2 * (n - p), 2)]


def test_configs_read_each_layout(saved):
  for variant, fields in VARIANTS.items():
    folder, hf = saved[variant]
    cfg = models.from_pretrained(folder).cfg
    heads = fields["n_head"]
    assert (cfg.alibi, cfg.alibi_scaled, cfg.rope_layers, cfg.embed_norm, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.qkv_bias, cfg.attn_out_bias,
            cfg.mlp_bias, cfg.layer_norm, cfg.norm_bias, cfg.mlp_activation,
            cfg.tie_embeddings) == (
        True, False, (0, 0, 0), True, heads, heads, fields["hidden_size"] // heads,
        4 * fields["hidden_size"], True, True, True, True, True, "gelu_tanh_ungated",
        variant == "bloom"), variant
    np.testing.assert_allclose(cfg.alibi_slopes, _bloom_slopes(heads), rtol=1e-12)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_logits_match_through_the_chunked_kernel(saved):
  """ALiBi through the chunked kernel's blocks (keys 8 at a time), as through the
  reference's one matrix."""
  folder, hf = saved["bloom"]
  check_logits(folder, hf, TOKENS, False, overrides=dict(attention_impl="chunked",
                                                         attention_chunk=8))


def test_packed_rows_read_their_own_positions(saved):
  """ALiBi's distances restart with each sequence as a rotary embedding's would."""
  check_packed_rows_run_apart(models.from_pretrained(saved["bloom"][0]), TOKENS)


def test_gradients_match_transformers(saved):
  """Through the per-head query_key_value and the embeddings' LayerNorm."""
  folder, hf_model = saved["bloom"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  trunk = hf_model.transformer
  assert_close_to_scale(grads["embed_norm"]["scale"][...],
                        trunk.word_embeddings_layernorm.weight.grad.numpy())
  assert_close_to_scale(grads["embed_norm"]["bias"][...],
                        trunk.word_embeddings_layernorm.bias.grad.numpy())
  d, n, h = 96, 6, 16
  for i in range(COMMON["n_layer"]):
    layer, hf = grads["layers"][i], trunk.h[i]
    fused = hf.self_attention.query_key_value
    weight = fused.weight.grad.numpy().reshape(n, 3, h, d)
    assert_close_to_scale(layer["attn"]["k_proj"][...], weight[:, 1].transpose(2, 0, 1))
    assert_close_to_scale(layer["attn"]["q_bias"][...],
                          fused.bias.grad.numpy().reshape(n, 3, h)[:, 0])
    assert_close_to_scale(layer["mlp"]["down_proj"][...],
                          hf.mlp.dense_4h_to_h.weight.grad.numpy().T)


@pytest.mark.parametrize("variant,scan", [("bloom", False), ("untied", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Decoding through the KV cache: each new query's biases by its distance to every
  cached key."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.BloomForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["n_head"]) == ("bloom",
                                                        VARIANTS[variant]["n_head"])


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("bloom", cls="BloomForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.BloomForSequenceClassification, tmp_path)


def test_what_bloom_refuses(saved):
  """Residuals taken after the norms, and a model it cannot hold written as BLOOM."""
  folder, hf = saved["bloom"]
  base = hf.config.to_dict()
  with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm=true"):
    models.hf_config_to_model_config({**base,
                                      "apply_residual_connection_post_layernorm": True})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="ffn_dim=100 cannot be written as BloomForCausalLM"):
    models.hf.model_config_to_hf(cfg.replace(ffn_dim=100))
  with pytest.raises(ValueError, match="embed_norm=False cannot be written as Bloom"):
    models.hf.model_config_to_hf(cfg.replace(embed_norm=False))


def test_defaults_are_transformers():
  default = transformers.BloomConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["BloomForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.norm_eps,
          cfg.tie_embeddings) == (
      default.vocab_size, default.hidden_size, default.n_layer, default.n_head,
      default.layer_norm_epsilon, default.tie_word_embeddings)


def test_peft_adapters_on_the_fused_projection_are_read(saved, tmp_path):
  """PEFT's one adapter on query_key_value read as q, k and v's; ours on dense both ways."""
  folder, hf = saved["bloom"]
  check_fused_qkv_peft(folder, hf, lambda: _hf_model("bloom"), TOKENS, tmp_path,
                       "query_key_value", "dense", ["o_proj"])
