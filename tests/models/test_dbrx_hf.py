"""DBRX (DbrxForCausalLM) against `transformers`: LayerNorms without biases, q, k and v in
one Wqkv clamped to [-clip_qkv, clip_qkv], grouped keys, a mixture of experts in every
layer (softmax routing over the top-k, renormalised; the experts' gate, up and down
projections each one tensor for all of them), its nested config.json (attn_config,
ffn_config) and its own tensor names. Logits (layer list and scanned), gradients of the
stacked experts, greedy generation, export, parameter counts, its defaults and what it
refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_fused_qkv_peft, check_logits, greedy_tokens, perturb,
                                 save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, d_model=64, n_heads=4, n_layers=3, max_seq_len=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    # DBRX's layout: a clamp tight enough to cut, grouped keys, top-2 of 4 experts
    "dbrx": dict(attn_config=dict(kv_n_heads=2, clip_qkv=1.5, rope_theta=5000.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    # a clamp that never cuts (transformers' DBRX cannot run without one), one key head,
    # the top expert's weight unnormalised
    "plain": dict(attn_config=dict(kv_n_heads=1, clip_qkv=1e4, rope_theta=10_000.0),
                  ffn_config=dict(ffn_hidden_size=48, moe_num_experts=3, moe_top_k=1,
                                  moe_normalize_expert_weights=None)),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, **extra):
  torch.manual_seed(0)
  cfg = transformers.DbrxConfig(**{**COMMON, **VARIANTS[variant], **extra})
  hf = perturb(transformers.DbrxForCausalLM(cfg).float().eval())
  with torch.no_grad():  # routers that spread the tokens over the experts
    for layer in hf.transformer.blocks:
      layer.ffn.router.layer.weight.normal_(0.0, 0.5)
  return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["dbrx"][0]).cfg
  assert (cfg.num_kv_heads, cfg.clip_qkv, cfg.num_experts, cfg.num_experts_per_tok,
          cfg.norm_topk_prob, cfg.ffn_dim, cfg.layer_norm, cfg.norm_bias, cfg.qkv_bias,
          cfg.rope.theta, cfg.tie_embeddings) == (
      2, 1.5, 4, 2, True, 32, True, False, False, 5000.0, False)
  plain = models.from_pretrained(saved["plain"][0]).cfg
  assert (plain.num_kv_heads, plain.clip_qkv, plain.num_experts, plain.num_experts_per_tok,
          plain.norm_topk_prob) == (1, 1e4, 3, 1, False)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  # "plain": unnormalised top-1 weights of wide experts leave hidden states near 60
  # before the final norm, where float32's rounding reaches 2e-4 in the logits.
  check_logits(*saved[variant], TOKENS, scan, atol=1e-4 if variant == "dbrx" else 5e-4)


def test_expert_gradients_match_transformers(saved):
  """The stacked experts' (w1: gate, v1: up, [E F, D]; w2: down, [E F, D]) and the
  router's."""
  folder, hf_model = saved["dbrx"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  e, f, d = 4, 32, 64
  for i in range(COMMON["n_layers"]):
    mlp, hf = grads["layers"][i]["mlp"], hf_model.transformer.blocks[i].ffn
    experts = hf.experts.mlp
    assert_close_to_scale(mlp["gate_proj"][...],
                          experts.w1.grad.numpy().reshape(e, f, d).transpose(0, 2, 1))
    assert_close_to_scale(mlp["up_proj"][...],
                          experts.v1.grad.numpy().reshape(e, f, d).transpose(0, 2, 1))
    assert_close_to_scale(mlp["down_proj"][...], experts.w2.grad.numpy().reshape(e, f, d))
    assert_close_to_scale(mlp["router"][...], hf.router.layer.weight.grad.numpy().T)


@pytest.mark.parametrize("variant,scan", [("dbrx", False), ("plain", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.DbrxForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "dbrx"
  assert written["attn_config"]["clip_qkv"] == (1.5 if variant == "dbrx" else 1e4)


def test_published_rope_theta_is_read():
  """The published config.json says attn_config.rope_theta (500000), nothing else."""
  cfg = models.hf_config_to_model_config({
      "architectures": ["DbrxForCausalLM"], "model_type": "dbrx",
      "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500_000}})
  assert (cfg.rope.theta, cfg.clip_qkv, cfg.num_kv_heads) == (500_000.0, 8.0, 8)


def test_what_dbrx_refuses(saved):
  folder, hf = saved["dbrx"]
  base = hf.config.to_dict()
  with pytest.raises(ValueError, match="moe_normalize_expert_weights=2.0"):
    models.hf_config_to_model_config(
        {**base, "ffn_config": {**base["ffn_config"], "moe_normalize_expert_weights": 2.0}})
  with pytest.raises(ValueError, match="ffn_act_fn"):
    models.hf_config_to_model_config(
        {**base, "ffn_config": {**base["ffn_config"], "ffn_act_fn": {"name": "gelu"}}})


def test_defaults_are_transformers():
  default = transformers.DbrxConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["DbrxForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.ffn_dim, cfg.num_experts, cfg.num_experts_per_tok,
          cfg.max_position_embeddings, cfg.clip_qkv) == (
      default.vocab_size, default.d_model, default.n_layers, default.n_heads,
      default.attn_config.kv_n_heads, default.ffn_config.ffn_hidden_size,
      default.ffn_config.moe_num_experts, default.ffn_config.moe_top_k,
      default.max_seq_len, default.attn_config.clip_qkv)


def test_peft_adapters_on_the_fused_projection_are_read(saved, tmp_path):
  """PEFT's one adapter on Wqkv read as q, k and v's; ours on out_proj both ways."""
  folder, hf = saved["dbrx"]
  check_fused_qkv_peft(folder, hf, lambda: _hf_model("dbrx"), TOKENS, tmp_path,
                       "Wqkv", "out_proj", ["o_proj"])
