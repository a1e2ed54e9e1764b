"""Tencent's Youtu-LLM (YoutuForCausalLM) against `transformers`: DeepSeek-V3's latent
attention over a dense SwiGLU MLP in every layer. Logits (layer list and scanned, with
and without a compressed query), greedy generation through the latent cache, export,
its defaults; PEFT files of its latent attention refused."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens,
                                 perturb, save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {"q_lora": dict(q_lora_rank=24),  # a compressed query, as published; tied
            "plain_q": dict(q_lora_rank=None, tie_word_embeddings=False)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.YoutuConfig(**{**COMMON, **VARIANTS[variant]})
  return perturb(transformers.YoutuForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_latent_attention_over_dense_layers(saved):
  cfg = models.from_pretrained(saved["q_lora"][0]).cfg
  assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim,
          cfg.head_dim, cfg.num_experts, cfg.ffn_dim, cfg.tie_embeddings) == (
      16, 24, 8, 12, 24, 0, 96, True)
  assert models.from_pretrained(saved["plain_q"][0]).cfg.q_lora_rank == 0


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["q_lora"], PROMPTS, 12, True)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.YoutuForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "youtu" and "n_routed_experts" not in written


def test_peft_files_of_latent_attention_are_refused(saved, tmp_path):
  """As for DeepSeek: PEFT wraps the fused latent projections, ours are per projection;
  the adapters train, and the model exports merged."""
  lora = models.from_pretrained(saved["plain_q"][0], lora_rank=2)
  with pytest.raises(ValueError, match="PEFT adapter files of YoutuForCausalLM wrap its "
                                       "fused kv_a_proj_with_mqa"):
    models.save_lora_adapter(lora, str(tmp_path / "adapter"))


def test_defaults_are_transformers():
  default = transformers.YoutuConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["YoutuForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim,
          cfg.head_dim, cfg.norm_eps, cfg.tie_embeddings, cfg.rope.theta) == (
      default.vocab_size, default.hidden_size, default.intermediate_size,
      default.num_hidden_layers, default.num_attention_heads, default.kv_lora_rank,
      default.q_lora_rank, default.qk_rope_head_dim, default.v_head_dim,
      default.qk_head_dim, default.rms_norm_eps, default.tie_word_embeddings,
      default.rope_parameters["rope_theta"])
