"""Mistral Small 4 (Mistral4ForCausalLM) against `transformers`: DeepSeek's multi-head
latent attention with every layer's queries scaled up by position past the pre-training
context (attn_position_scale, Ministral 3's), a softmax router (top-k renormalised, times
routed_scaling_factor) over experts stored stacked, shared experts, a leading dense
layer. Logits (layer list and scanned), the latent cache against the full forward,
greedy generation, export, the reward model, and what we refuse."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_preset_is_default_config,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families, spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

# moe_intermediate_size 20: the stacked gate_up_proj [E, 40, 48] has one reading only.
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=20,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.5,
              kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
              num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
# YaRN x4 past a pre-training context of 6 positions (mscale_all_dim scaling the
# softmax); the rows below cross it three times, so the queries' scale steps up.
YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
        "original_max_position_embeddings": 6, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.7, "llama_4_scaling_beta": 0.5}
VARIANTS = {
    "q_latent": dict(q_lora_rank=12, rope_parameters=YARN),
    # one q_proj, YaRN without mscale_all_dim, the weights not renormalised
    "q_proj": dict(q_lora_rank=None, norm_topk_prob=False, rope_parameters={
        **YARN, "factor": 2.0, "mscale_all_dim": None, "llama_4_scaling_beta": 0.3}),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))
_prefill = nnx.jit(lambda m, t, c: m(t, cache=c, prefill=True))
_extend = nnx.jit(lambda m, t, p, c: m(t, p, cache=c))


def _hf_model(variant, cls="Mistral4ForCausalLM", **extra):
  cfg = transformers.Mistral4Config(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return spread_routers(perturb(getattr(transformers, cls)(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_attention_and_the_routing(saved):
  folder = saved["q_latent"][0]
  with open(f"{folder}/config.json") as f:
    assert "n_group" in json.load(f)
  cfg = models.from_pretrained(folder).cfg
  assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim,
          cfg.head_dim) == (16, 12, 8, 12, 24)
  assert (cfg.attn_position_scale, cfg.attn_position_scale_length) == (0.5, 6)
  assert (cfg.router_scoring, cfg.router_groups, cfg.norm_topk_prob,
          cfg.routed_scaling_factor, cfg.dense_layers, cfg.shared_expert_dim) == (
              "softmax", 1, True, 1.5, 1, 20)
  m = 0.1 * 0.7 * np.log(4.0) + 1.0
  assert cfg.attention_scale == pytest.approx(24 ** -0.5 * m * m)
  q_proj = models.from_pretrained(saved["q_proj"][0]).cfg
  assert q_proj.q_lora_rank == 0 and not q_proj.norm_topk_prob
  assert q_proj.attn_position_scale == 0.3


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_the_query_scaling_moves_the_logits(saved):
  """Without the scaling the logits past position 6 move by far more than the tolerance,
  and those before it not at all."""
  model = models.from_pretrained(saved["q_latent"][0])
  off = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
      model.cfg.replace(attn_position_scale=0.0), rngs=nnx.Rngs(0)))), nnx.state(model))
  moved = np.abs(np.asarray(_jitted_logits(off, TOKENS)) -
                 np.asarray(_jitted_logits(model, TOKENS)))
  assert moved[:, :6].max() == 0 and moved[:, 6:].max() > 1e-2


def test_cached_decoding_equals_the_full_forward(saved):
  """Prefill 5 positions (expanded attention), then 5 at a time against the latent cache
  (absorbed), across the steps of the query scaling: the logits of one forward."""
  m = models.from_pretrained(saved["q_latent"][0], scan_layers=True)
  want = np.asarray(_jitted_logits(m, jnp.asarray(TOKENS)))
  got, cache = _prefill(m, jnp.asarray(TOKENS[:, :5]), models.init_cache(m.cfg, 2, 24))
  parts = [np.asarray(got)]
  for start in (5, 10, 15):
    positions = jnp.broadcast_to(jnp.arange(start, start + 5), (2, 5))
    got, cache = _extend(m, jnp.asarray(TOKENS[:, start:start + 5]), positions, cache)
    parts.append(np.asarray(got))
  np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=1e-4, rtol=0)


# The second variant (scanned) with the slow tests.
@pytest.mark.parametrize("variant,scan", [
    ("q_latent", False), pytest.param("q_proj", True, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Through the sampler's latent cache, decoding past the pre-training context."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  """The experts written stacked, as transformers holds and reads them."""
  written = check_export_round_trip(*saved[variant], transformers.Mistral4ForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "mistral4" and written["rope_interleave"]
  assert written["rope_parameters"]["llama_4_scaling_beta"] == VARIANTS[variant][
      "rope_parameters"]["llama_4_scaling_beta"]
  assert written["n_group"] == 1 and "topk_method" not in written


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("q_latent", cls="Mistral4ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.Mistral4ForSequenceClassification, tmp_path)


def test_what_we_refuse(saved):
  config = json.loads(open(f"{saved['q_latent'][0]}/config.json").read())
  with pytest.raises(ValueError, match="n_group=2 in a Mistral 4 config.json"):
    models.hf_config_to_model_config({**config, "n_group": 2, "topk_group": 1})
  params = {k: v for k, v in config["rope_parameters"].items()
            if k != "llama_4_scaling_beta"}
  with pytest.raises(ValueError, match="Mistral4ForCausalLM config.json needs rope_parameters "
                                       "llama_4_scaling_beta"):
    models.hf_config_to_model_config({**config, "rope_parameters": params})
  cfg = models.hf_config_to_model_config(config)
  for change, match in [
      (dict(attn_position_scale=0.0), "attn_position_scale=0 cannot be written as "
                                      "Mistral4ForCausalLM"),
      (dict(router_groups=2, router_group_topk=1), "router_groups=2 cannot be written as "
                                                   "Mistral4ForCausalLM"),
      (dict(router_scoring="sigmoid"), "router_scoring='sigmoid' cannot be written as "
                                       "Mistral4ForCausalLM"),
      (dict(rope=dataclasses.replace(cfg.rope, type="default")), "rope type 'default' cannot be written "
                                                    "as Mistral4ForCausalLM"),
  ]:
    with pytest.raises(ValueError, match=match):
      models.hf.check_exportable(cfg.replace(**change))


def test_a_config_without_rope_parameters_reads_transformers_default():
  """Mistral4Config's YaRN (x128 past 8192, beta 0.1) where a config.json says nothing."""
  written = models.hf.model_config_to_hf(models.get_preset("mistral_small4"))
  written.pop("rope_parameters")
  cfg = models.hf_config_to_model_config(written)
  want = transformers.Mistral4Config().rope_parameters
  assert (cfg.rope.type, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (
      "yarn", want["factor"], want["original_max_position_embeddings"])
  assert cfg.attn_position_scale == want["llama_4_scaling_beta"]


def test_the_preset_is_transformers_default_config():
  """mistral_small4 written as a config.json is transformers' Mistral4Config (Mistral Small
  4's), and reads back as the preset (training-only fields aside). intermediate_size
  (12288) sizes dense layers, of which it has none."""
  check_preset_is_default_config("mistral_small4", transformers.Mistral4Config, (
      "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
      "num_attention_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
      "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
      "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "rms_norm_eps",
      "max_position_embeddings", "tie_word_embeddings", "pad_token_id"), rope_keys=None)
