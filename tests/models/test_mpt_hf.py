"""MPT (MptForCausalLM) against `transformers`: ALiBi (MPT's slope series for a power of
two heads and not), LayerNorms without biases, no biases anywhere, q, k and v in one Wqkv
([q; k; v]) clamped by clip_qkv, an MLP of no gate through the exact GELU, its nested
attn_config and tensor names. Logits (layer list and scanned), gradients, greedy
generation through the KV cache, export, the reward model, parameter counts, its
defaults, what it refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_fused_qkv_peft, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, n_layers=3, max_seq_len=48, initializer_range=0.3,
              pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "mpt": dict(d_model=96, n_heads=6),  # MPT-7B's attention: tied, unclamped
    # a clamp that cuts, untied
    "clipped": dict(d_model=64, n_heads=4, tie_word_embeddings=False,
                    attn_config=dict(clip_qkv=0.6)),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 24))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="MptForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.MptConfig(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  for variant, fields in VARIANTS.items():
    folder, hf = saved[variant]
    cfg = models.from_pretrained(folder).cfg
    attn = fields.get("attn_config", {})
    heads, d = fields["n_heads"], fields["d_model"]
    assert (cfg.alibi, cfg.alibi_scaled, cfg.alibi_bias_max, cfg.rope_layers, cfg.clip_qkv,
            cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.qkv_bias, cfg.mlp_bias,
            cfg.layer_norm, cfg.norm_bias, cfg.mlp_activation, cfg.tie_embeddings,
            cfg.max_position_embeddings) == (
        True, False, 8.0, (0, 0, 0), attn.get("clip_qkv"), heads,
        d // heads, 4 * d, False, False, True, False, "gelu_ungated", variant == "mpt",
        48), variant
    # transformers' build_mpt_alibi_tensor's slopes: its bias at key 0 for the last of n
    # queries is -(n - 1) * slope
    bias = transformers.models.mpt.modeling_mpt.build_mpt_alibi_tensor(heads, 2).numpy()
    np.testing.assert_allclose(cfg.alibi_slopes, -bias[:, 0, 0], rtol=1e-6)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_gradients_match_transformers(saved):
  """Through the clamped Wqkv ([q; k; v]) and the norms without biases."""
  folder, hf_model = saved["clipped"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  d, n, h = 64, 4, 16
  for i in range(COMMON["n_layers"]):
    layer, hf = grads["layers"][i], hf_model.transformer.blocks[i]
    weight = hf.attn.Wqkv.weight.grad.numpy().reshape(3, n, h, d)
    assert_close_to_scale(layer["attn"]["q_proj"][...], weight[0].transpose(2, 0, 1))
    assert_close_to_scale(layer["attn"]["v_proj"][...], weight[2].transpose(2, 0, 1))
    assert_close_to_scale(layer["input_norm"]["scale"][...], hf.norm_1.weight.grad.numpy())
    assert_close_to_scale(layer["mlp"]["up_proj"][...], hf.ffn.up_proj.weight.grad.numpy().T)


@pytest.mark.parametrize("variant,scan", [("mpt", False), ("clipped", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.MptForCausalLM, TOKENS,
                                    tmp_path / "out")
  attn = VARIANTS[variant].get("attn_config", {})
  assert (written["model_type"], written["attn_config"]["clip_qkv"]) == (
      "mpt", attn.get("clip_qkv"))


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("mpt", cls="MptForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.MptForSequenceClassification, tmp_path)


def test_what_mpt_refuses(saved):
  """The attention options transformers' MPT does not run (or ignores: alibi_bias_max),
  biases, and a wider MLP."""
  folder, hf = saved["mpt"]
  base = hf.config.to_dict()
  for attn, match in ((dict(alibi=False), "attn_config.alibi=false"),
                      (dict(qk_ln=True), "attn_config.qk_ln=true"),
                      (dict(prefix_lm=True), "attn_config.prefix_lm=true"),
                      (dict(softmax_scale=0.5), "attn_config.softmax_scale=0.5"),
                      (dict(alibi_bias_max=12), "attn_config.alibi_bias_max=12"),
                      (dict(attn_type="multiquery_attention"), "multiquery_attention")):
    with pytest.raises(ValueError, match=match):
      models.hf_config_to_model_config({**base, "attn_config": {**base["attn_config"],
                                                                **attn}})
  for change, match in ((dict(no_bias=False), "no_bias=false"),
                        (dict(expansion_ratio=2), "expansion_ratio=2")):
    with pytest.raises(ValueError, match=match):
      models.hf_config_to_model_config({**base, **change})


def test_defaults_are_transformers():
  default = transformers.MptConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["MptForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.norm_eps,
          cfg.max_position_embeddings, cfg.tie_embeddings, cfg.alibi_bias_max,
          cfg.clip_qkv) == (
      default.vocab_size, default.d_model, default.n_layers, default.n_heads,
      default.layer_norm_epsilon, default.max_seq_len, default.tie_word_embeddings,
      default.attn_config.alibi_bias_max, default.attn_config.clip_qkv)


def test_peft_adapters_on_the_fused_projection_are_read(saved, tmp_path):
  """PEFT's one adapter on Wqkv read as q, k and v's; ours on out_proj both ways."""
  folder, hf = saved["mpt"]
  check_fused_qkv_peft(folder, hf, lambda: _hf_model("mpt"), TOKENS, tmp_path,
                       "Wqkv", "out_proj", ["o_proj"])
