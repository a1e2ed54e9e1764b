"""DeepSeek Sparse Attention: DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5
(GlmMoeDsaForCausalLM) against `transformers`, with an index_topk far below the sequence
so that the indexer's choice shapes every logit; the sparse attention's pieces against
dense attention and against themselves in blocks; cached decoding (int8 too), the
gradient, export, and what we refuse."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import transformer as tr
from tests.models.parity import (check_export_round_trip, check_logits, check_on_a_mesh,
                                 check_preset_is_default_config, greedy_tokens, hf_logits,
                                 perturb, randomize_correction_biases, save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.8,
              kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, v_head_dim=12,
              qk_nope_head_dim=16, num_experts_per_tok=3, max_position_embeddings=64,
              n_group=4, topk_group=2, first_k_dense_replace=1, initializer_range=0.3,
              index_topk=4, index_n_heads=8, index_head_dim=16, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
CLASSES = {"deepseek_v32": (transformers.DeepseekV32Config,
                            transformers.DeepseekV32ForCausalLM),
           "glm5": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(name):
  config_cls, cls = CLASSES[name]
  torch.manual_seed(0)
  return randomize_correction_biases(perturb(cls(config_cls(**COMMON)).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, CLASSES, _hf_model)


def test_config_reads_the_indexer(saved):
  cfg = models.from_pretrained(saved["glm5"][0]).cfg
  assert (cfg.index_topk, cfg.index_heads, cfg.index_head_dim) == (4, 8, 16)
  assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.dense_layers, cfg.router_scoring) == (
      16, 12, 1, "sigmoid")


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_logits_match_transformers(saved, name, scan):
  """20 tokens, each query choosing 4 keys: transformers' logits, and far from the
  dense attention's (the choice matters)."""
  check_logits(*saved[name], TOKENS, scan)
  folder, hf = saved[name]
  dense = models.from_pretrained(folder, index_topk=64)
  assert np.abs(np.asarray(dense(TOKENS)) - hf_logits(hf, TOKENS)).max() > 1.0


@pytest.mark.parametrize("name", list(CLASSES))
def test_greedy_generation_matches_transformers(saved, name):
  """The sampler's cached decoding (the indexer's keys cached beside the latent) gives
  transformers' greedy tokens."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[name], PROMPTS, 10, False)):
    assert got == want, (name, i)


def test_on_a_mesh(saved):
  """Scanned and sharded over data x tensor (the indexer's heads split like the
  attention's): transformers' logits and greedy tokens."""
  model = check_on_a_mesh(*saved["glm5"], TOKENS, PROMPTS, atol=1e-4)
  sharding = model.layers.attn.index_q_proj[...].sharding
  assert sharding.spec[2] == "tensor", sharding.spec


def test_cached_decoding_equals_the_full_forward(saved):
  """Prefill then one token at a time (scanned cache, an int8 cache too): each step's
  logits are the full forward's at that position; the int8 cache's within its rounding
  (0.5 here, as a dense int8 cache's) but where that rounding changes which of the
  close-scored keys a query chooses (one step in 16 here)."""
  model = models.from_pretrained(saved["deepseek_v32"][0], scan_layers=True)
  tokens = jnp.asarray(TOKENS[:, :14])
  full = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))

  def decode(dtype):
    cache = models.init_cache(model.cfg, 2, 32, dtype)
    seg = jnp.ones((2, 6), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    step = nnx.jit(lambda m, t, p, s, c, prefill: m(t, p, s, cache=c, prefill=prefill),
                   static_argnames="prefill")
    logits, cache = step(model, tokens[:, :6], pos, seg, cache, True)
    out = [np.asarray(logits)]
    for t in range(6, 14):
      logits, cache = step(model, tokens[:, t:t + 1], jnp.full((2, 1), t), jnp.ones((2, 1),
                           jnp.int32), cache, False)
      out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)

  np.testing.assert_allclose(decode(jnp.float32), full, atol=1e-4, rtol=0)
  steps = np.abs(decode(jnp.int8) - full).max(-1)[:, 6:]
  assert np.mean(steps < 0.5) >= 0.85, steps


def test_sparse_attention_pieces():
  """With topk at least the keys every key is chosen and sparse attention is dense
  attention; in blocks of queries it is itself unblocked, forward and gradient; a query
  with no key allowed gets zeros, and the choice takes exactly topk keys."""
  rng = np.random.default_rng(1)
  b, t, n, h, hi, di = 2, 24, 4, 8, 3, 8
  q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(3))
  iq = jnp.asarray(rng.standard_normal((b, t, hi, di)), jnp.float32)
  iw = jnp.asarray(rng.standard_normal((b, t, hi)), jnp.float32)
  ik = jnp.asarray(rng.standard_normal((b, t, di)), jnp.float32)
  seg = jnp.asarray([[1] * 16 + [2] * 6 + [0] * 2, [1] * 24], jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))

  def sparse(q, k, v, topk, block=256):
    return tr.sparse_attention(q, k, v, iq, iw, ik, pos, pos, seg, seg, topk, h ** -0.5,
                               block=block)

  import kernels
  dense = kernels.reference_attention(q, k, v, causal=True, q_segment_ids=seg,
                                      kv_segment_ids=seg)
  real = np.asarray(seg)[:, :, None, None] != 0
  np.testing.assert_allclose(np.where(real, sparse(q, k, v, t), 0),
                             np.where(real, dense, 0), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(sparse(q, k, v, 5))[0, -2:], 0)  # padding

  def loss(q, k, v, block):
    return jnp.sum(jnp.sin(sparse(q, k, v, 5, block)))
  whole = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, 256)
  blocked = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, 8)
  np.testing.assert_allclose(blocked[0], whole[0], rtol=1e-5)
  for got, want in zip(blocked[1], whole[1]):
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(want).max() > 1e-2

  valid = (pos[:, None, :] <= pos[:, :, None]) & (seg[:, None, :] == seg[:, :, None])
  chosen = tr._allowed(*tr._top_keys(tr.index_scores(iq, iw, ik), valid, 5), t)
  counts = np.asarray(chosen.sum(-1))
  np.testing.assert_array_equal(counts, np.minimum(np.asarray(valid.sum(-1)), 5))


def test_a_train_step_moves_the_loss(saved):
  """The gradient flows through the chosen keys' attention (the choice itself has none)
  into every projection but the indexer's."""
  model = models.from_pretrained(saved["deepseek_v32"][0])
  tokens = jnp.asarray(TOKENS)

  def loss(m):
    logits = m(tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
  grads = nnx.jit(nnx.grad(loss))(model)
  attn = grads["layers"][0]["attn"]  # the first mixture layer's
  assert float(jnp.abs(attn.kv_a_proj[...]).max()) > 0
  assert float(jnp.abs(attn.q_b_proj[...]).max()) > 0
  assert float(jnp.abs(attn.index_q_proj[...]).max()) == 0


@pytest.mark.parametrize("name", list(CLASSES))
def test_export_round_trip_is_exact(saved, name, tmp_path):
  written = check_export_round_trip(*saved[name], CLASSES[name][1], TOKENS, tmp_path / "out")
  assert (written["index_topk"], written["index_n_heads"], written["index_head_dim"]) == (
      4, 8, 16)
  assert written["mlp_layer_types"] == ["dense", "sparse", "sparse"]


def test_what_we_refuse(saved):
  config = json.loads(open(f"{saved['glm5'][0]}/config.json").read())
  with pytest.raises(ValueError, match="layers that reuse another layer's sparse attention"):
    models.hf_config_to_model_config({**config,
                                      "indexer_types": ["full", "shared", "full"]})
  with pytest.raises(ValueError, match="layers that reuse"):
    models.hf_config_to_model_config({**config, "index_topk_pattern": "FSF",
                                      "indexer_types": None})
  cfg = models.hf_config_to_model_config(config)
  with pytest.raises(ValueError, match="need multi-head latent attention with a query "
                                       "latent"):
    cfg.replace(q_lora_rank=0)
  with pytest.raises(ValueError, match="set index_topk, index_heads and index_head_dim "
                                       "together"):
    cfg.replace(index_heads=0)
  with pytest.raises(ValueError, match="index_topk=4 cannot be written as "
                                       "DeepseekV3ForCausalLM"):
    models.hf.check_exportable(cfg.replace(architecture="DeepseekV3ForCausalLM"))
  with pytest.raises(ValueError, match="index_topk=0 cannot be written as "
                                       "GlmMoeDsaForCausalLM"):
    models.hf.check_exportable(cfg.replace(index_topk=0, index_heads=0, index_head_dim=0))


def test_the_glm5_preset_is_transformers_default_config():
  """glm5 written as a config.json is transformers' GlmMoeDsaConfig (GLM-5's), and reads
  back as the preset (training-only fields aside); deepseek_v3_2 reads back too."""
  check_preset_is_default_config("glm5", transformers.GlmMoeDsaConfig, (
      "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
      "num_hidden_layers", "num_attention_heads", "n_shared_experts", "n_routed_experts",
      "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
      "v_head_dim", "qk_nope_head_dim", "num_experts_per_tok", "n_group", "topk_group",
      "norm_topk_prob", "rms_norm_eps", "mlp_layer_types", "max_position_embeddings",
      "tie_word_embeddings", "index_topk", "index_head_dim", "index_n_heads",
      "indexer_types"))
  preset = models.get_preset("deepseek_v3_2")
  back = models.hf_config_to_model_config(models.hf.model_config_to_hf(preset))
  assert back == preset.replace(remat=back.remat, scan_layers=back.scan_layers)
