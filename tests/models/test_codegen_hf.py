"""CodeGen (CodeGenForCausalLM) against `transformers`: GPT-J's layers with q, k and v in
one qkv_proj interleaved across the four model-parallel shards CodeGen was trained on
(each shard its quarter of the heads' q, then v, then k). Logits (layer list and
scanned), gradients through the fused projection, greedy generation, export, parameter
counts, its defaults, what it refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_fused_qkv_peft, check_logits, greedy_tokens, perturb,
                                 save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, n_embd=64, n_layer=3, n_head=8, n_positions=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {"codegen": dict(rotary_dim=4),  # half of each head rotated, two heads a shard
            "whole": dict(rotary_dim=8, tie_word_embeddings=True, n_inner=80)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.CodeGenConfig(**{**COMMON, **VARIANTS[variant]})
  return perturb(transformers.CodeGenForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["codegen"][0]).cfg
  assert (cfg.parallel_residual, cfg.lm_head_bias, cfg.qkv_bias, cfg.head_dim,
          cfg.rope.rotary_dim(cfg.head_dim), cfg.mlp_activation) == (
      True, True, False, 8, 4, "gelu_tanh_ungated")
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_gradients_through_the_sharded_projection_match_transformers(saved):
  """v's rows of qkv_proj: in each of the four shards, after that shard's queries."""
  folder, hf_model = saved["whole"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  for i in range(COMMON["n_layer"]):
    fused = hf_model.transformer.h[i].attn.qkv_proj.weight.grad.numpy()  # [192, 64]
    v = fused.reshape(4, 3, 16, 64)[:, 1].reshape(64, 64)  # 8 heads of 8, shard-major
    assert_close_to_scale(grads["layers"][i]["attn"]["v_proj"][...],
                          v.T.reshape(64, 8, 8))


@pytest.mark.parametrize("variant,scan", [("codegen", False), ("whole", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.CodeGenForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "codegen"


def test_what_codegen_refuses(saved):
  folder, hf = saved["codegen"]
  with pytest.raises(ValueError, match="n_head=6 in a CodeGen config.json"):
    models.hf_config_to_model_config({**hf.config.to_dict(), "n_head": 6, "n_embd": 48})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="num_heads=6 cannot be written as CodeGen"):
    models.hf.model_config_to_hf(cfg.replace(num_heads=6, num_kv_heads=6, d_model=48))


def test_defaults_are_transformers():
  default = transformers.CodeGenConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["CodeGenForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads,
          cfg.max_position_embeddings, cfg.rope.rotary_dim(cfg.head_dim)) == (
      default.vocab_size, default.n_embd, default.n_layer, default.n_head,
      default.n_positions, default.rotary_dim)


def test_peft_adapters_on_the_fused_projection_are_read(saved, tmp_path):
  """PEFT's one adapter on qkv_proj read as q, k and v's; ours on out_proj both ways."""
  folder, hf = saved["codegen"]
  check_fused_qkv_peft(folder, hf, lambda: _hf_model("codegen"), TOKENS, tmp_path,
                       "qkv_proj", "out_proj", ["o_proj"])
