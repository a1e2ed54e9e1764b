"""DeepSeek-V3 (DeepseekV3ForCausalLM: DeepSeek-V3 / R1, Kimi K2, Moonlight) against
`transformers`: multi-head latent attention (queries through their own latent or one
projection; keys and values from a normed latent, every head sharing one rotated key
part; interleaved rotary pairs; YaRN's mscale on the softmax), GLM-4.5's mixture
(sigmoid group routing with a correction bias, shared experts, a leading dense layer).
Logits (layer list and scanned), gradients, the latent KV cache against the full
forward, greedy generation, export, the reward model, and what we refuse; DeepSeek-V2's
softmax routing (greedy and group-limited) on the same attention."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_reward_model_round_trip,
                                 greedy_tokens, hf_logits, perturb,
                                 randomize_correction_biases, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
              kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
              n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
# YaRN x4 past 16 positions, mscale_all_dim scaling the softmax.
YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0,
            original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.7,
            beta_fast=32.0, beta_slow=1.0)
VARIANTS = {"q_latent": dict(q_lora_rank=12), "q_proj": dict(q_lora_rank=None),
            "yarn": dict(q_lora_rank=12, rope_parameters=YARN)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))
_prefill = nnx.jit(lambda m, t, c: m(t, cache=c, prefill=True))
_extend = nnx.jit(lambda m, t, p, c: m(t, p, cache=c))


def _hf_model(name, cls="DeepseekV3ForCausalLM", **extra):
  cfg = transformers.DeepseekV3Config(**{**COMMON, **VARIANTS[name], **extra})
  torch.manual_seed(0)
  return randomize_correction_biases(perturb(getattr(transformers, cls)(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, list(VARIANTS), _hf_model)


def test_config_reads_latent_attention(saved):
  cfg = models.from_pretrained(saved["q_latent"][0]).cfg
  assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim,
          cfg.head_dim, cfg.num_kv_heads) == (16, 12, 8, 12, 24, 4)
  assert cfg.rope.rotary_dim(cfg.head_dim) == 8
  assert (cfg.router_scoring, cfg.router_groups, cfg.router_group_topk, cfg.dense_layers,
          cfg.shared_expert_dim) == ("sigmoid", 4, 2, 1, 24)
  assert models.from_pretrained(saved["q_proj"][0]).cfg.q_lora_rank == 0
  yarn = models.from_pretrained(saved["yarn"][0]).cfg
  m = 0.1 * 0.7 * np.log(4.0) + 1.0
  assert yarn.attention_scale == pytest.approx(24 ** -0.5 * m * m)
  assert cfg.num_params == sum(
      x.size for x in jax.tree.leaves(nnx.state(models.from_pretrained(saved["q_latent"][0]))))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, variant, scan):
  folder, hf = saved[variant]
  want = hf_logits(hf, TOKENS)
  got = _jitted_logits(models.from_pretrained(folder, scan_layers=scan), TOKENS)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


def test_gradients_match_transformers(saved):
  """Through the query latent, the key/value latent (and its norm), the keys' rotated
  part (back in HF's interleaved order), k_b_proj and v_b_proj (kv_b_proj's rows)."""
  folder, hf_model = saved["q_latent"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  n, hn, hr, v, r = 4, 16, 8, 12, 16
  rotated = np.concatenate([np.arange(0, hr, 2), np.arange(1, hr, 2)])
  pairs = []
  for i in range(3):
    layer = grads["dense_layers"][0] if i == 0 else grads["layers"][i - 1]
    attn, hf = layer["attn"], hf_model.model.layers[i].self_attn
    kv_a = hf.kv_a_proj_with_mqa.weight.grad.numpy()
    kv_b = hf.kv_b_proj.weight.grad.numpy().reshape(n, hn + v, r)
    pairs += [(np.asarray(attn["q_a_proj"][...]).T, hf.q_a_proj.weight.grad),
              (attn["q_a_norm"]["scale"][...], hf.q_a_layernorm.weight.grad),
              (np.asarray(attn["kv_a_proj"][...]).T, kv_a[:r]),
              (np.asarray(attn["k_rope_proj"][...]).T[np.argsort(rotated)], kv_a[r:]),
              (attn["kv_a_norm"]["scale"][...], hf.kv_a_layernorm.weight.grad),
              (np.asarray(attn["k_b_proj"][...]).transpose(1, 2, 0), kv_b[:, :hn]),
              (np.asarray(attn["v_b_proj"][...]).transpose(1, 2, 0), kv_b[:, hn:]),
              (np.asarray(attn["o_proj"][...]).reshape(n * v, -1).T, hf.o_proj.weight.grad)]
  for ours, theirs in pairs:
    assert_close_to_scale(ours, np.asarray(theirs))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_cached_decoding_equals_the_full_forward(saved, scan):
  """Prefill 12 positions (expanded attention, the latent written), then 4 at a time
  against the latent cache (absorbed): the same logits as one forward over all 20. The
  cache holds one latent "head" of qk_rope_head_dim + kv_lora_rank features a token and
  no value array."""
  m = models.from_pretrained(saved["yarn"][0], scan_layers=scan)
  want = np.asarray(_jitted_logits(m, jnp.asarray(TOKENS)))
  cache = models.init_cache(m.cfg, 2, 24)
  unit = cache if scan else cache[0]
  assert unit.k.shape[-3:] == (1, 24, 8 + 16) and unit.v is None
  got, cache = _prefill(m, jnp.asarray(TOKENS[:, :12]), cache)
  parts = [np.asarray(got)]
  for start in (12, 16):
    positions = jnp.broadcast_to(jnp.arange(start, start + 4), (2, 4))
    got, cache = _extend(m, jnp.asarray(TOKENS[:, start:start + 4]), positions, cache)
    parts.append(np.asarray(got))
  np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=1e-4, rtol=0)


def test_int8_latent_cache_holds_the_latent_to_its_rounding(saved):
  """An int8 cache quantizes each token's latent with one float32 scale: dequantized,
  within half a step of the float cache's; no value array or scale."""
  m = models.from_pretrained(saved["yarn"][0], scan_layers=True)
  caches = {}
  for dtype in (None, "int8"):
    _, caches[dtype] = _prefill(m, jnp.asarray(TOKENS[:, :12]),
                                models.init_cache(m.cfg, 2, 24, dtype=dtype))
  f, q = caches[None], caches["int8"]
  assert q.k.dtype == jnp.int8 and q.v is None and q.v_scale is None
  deq = np.asarray(q.k, np.float32) * np.asarray(q.k_scale)[..., None]
  step = np.asarray(q.k_scale)[..., None]
  assert np.all(np.abs(deq - np.asarray(f.k))[:, :, :, :12] <= 0.51 * step[:, :, :, :12])
  assert np.abs(np.asarray(f.k)[:, :, :, :12]).max() > 1.0


@pytest.mark.parametrize("variant,scan", [("q_latent", False), ("yarn", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Rows pass the YaRN variant's original context (16) while decoding."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, scan)):
    assert got == want, i


@pytest.mark.parametrize("variant", ["q_latent", "q_proj"])
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  folder, hf = saved[variant]
  ours = models.from_pretrained(folder, scan_layers=variant == "q_proj")
  models.save_pretrained(ours, str(tmp_path / "out"))
  from safetensors.numpy import load_file
  assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(
      load_file(f"{folder}/model.safetensors"))
  back = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == "deepseek_v3" and written["rope_interleave"]
  assert models.hf_config_to_model_config(written) == ours.cfg.replace(scan_layers=False)


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("q_latent", cls="DeepseekV3ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.DeepseekV3ForSequenceClassification, tmp_path)


def test_on_a_mesh(saved):
  """Heads split over "tensor", the latents whole: the same logits."""
  folder, hf = saved["q_latent"]
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  m = models.from_pretrained(folder, mesh=mesh, scan_layers=True)
  assert m.layers.attn.k_b_proj[...].sharding.spec == jax.P(None, None, "tensor", None)
  got = jax.jit(lambda t: m(t, ctx=models.ShardingContext(mesh)))(TOKENS)
  np.testing.assert_allclose(np.asarray(got), hf_logits(hf, TOKENS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("change,match", [
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"topk_method": "greedy"}, "only DeepSeek-V3's routing"),
    ({"attention_bias": True}, "attention_bias=true"),
])
def test_configs_we_cannot_read_are_refused(saved, tmp_path, change, match):
  config = json.loads(open(f"{saved['q_latent'][0]}/config.json").read())
  with pytest.raises(ValueError, match=match):
    models.hf_config_to_model_config({**config, **change})


def test_bad_latent_configs_are_refused():
  base = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=2,
              head_dim=12, ffn_dim=8, kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8,
              rope=models.RopeConfig(partial_rotary_factor=4 / 12))
  models.ModelConfig(**base)
  for change, match in [
      (dict(num_kv_heads=1), "num_kv_heads=1 must equal num_heads=2"),
      (dict(qk_rope_head_dim=12), "qk_rope_head_dim=12 must be even and in"),
      (dict(v_head_dim=16), "v_head_dim=16 must be in"),
      (dict(rope=models.RopeConfig()), "rotates 12 of head_dim=12, but qk_rope_head_dim=4"),
      (dict(qk_norm=True), "qk_norm with multi-head latent attention"),
      (dict(kv_lora_rank=0), "q_lora_rank|qk_rope_head_dim, v_head_dim describe"),
  ]:
    with pytest.raises(ValueError, match=match):
      models.ModelConfig(**{**base, **change})
  with pytest.raises(ValueError, match="kv_lora_rank=8 cannot be written as LlamaForCausalLM"):
    models.hf.check_exportable(models.ModelConfig(**base, architecture="LlamaForCausalLM"))


# DeepSeek-V2: the same latent attention, a softmax router (V2-Lite: greedy, one q_proj;
# V2: group_limited_greedy over groups ranked by their best probability), unnormalised
# weights times routed_scaling_factor.
V2 = {"v2_lite": dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0),
      "v2": dict(q_lora_rank=12, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                 routed_scaling_factor=16.0, rope_parameters=YARN)}


def _hf_v2(name, cls="DeepseekV2ForCausalLM", **extra):
  common = {k: v for k, v in COMMON.items() if k not in ("n_group", "topk_group",
                                                         "routed_scaling_factor")}
  cfg = transformers.DeepseekV2Config(**{**common, **V2[name], **extra})
  torch.manual_seed(0)
  model = perturb(getattr(transformers, cls)(cfg).float().eval())
  with torch.no_grad():  # routers that prefer different experts per token
    for layer in model.model.layers[1:]:
      layer.mlp.gate.weight.normal_(0.0, 0.5)
  return model


@pytest.fixture(scope="module")
def saved_v2(tmp_path_factory):
  return save_families(tmp_path_factory, list(V2), _hf_v2)


def test_v2_config_reads_its_routing(saved_v2):
  lite = models.from_pretrained(saved_v2["v2_lite"][0]).cfg
  assert (lite.router_scoring, lite.router_groups, lite.norm_topk_prob, lite.q_lora_rank,
          lite.kv_lora_rank) == ("softmax", 1, False, 0, 16)
  v2 = models.from_pretrained(saved_v2["v2"][0]).cfg
  assert (v2.router_groups, v2.router_group_topk, v2.routed_scaling_factor) == (4, 2, 16.0)


@pytest.mark.parametrize("variant", list(V2))
@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_v2_logits_match_transformers(saved_v2, variant, scan):
  folder, hf = saved_v2[variant]
  want = hf_logits(hf, TOKENS)
  got = _jitted_logits(models.from_pretrained(folder, scan_layers=scan), TOKENS)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def test_v2_grouped_routing_matches_numpy():
  """group_limited_greedy: the groups with the best single probability, then the top-k
  probabilities among their experts, unnormalised, times the scale."""
  from posttrain.models.transformer import route
  rng = np.random.default_rng(2)
  x, w = rng.normal(size=(64, 16)), rng.normal(size=(16, 16))
  weights, experts = route(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 3,
                           False, groups=4, group_topk=2, scale=16.0)
  logits = x @ w
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  for p, got_w, got_e in zip(probs, np.asarray(weights), np.asarray(experts)):
    groups = np.argsort(p.reshape(4, 4).max(-1))[::-1][:2]
    allowed = np.concatenate([np.arange(4 * g, 4 * g + 4) for g in groups])
    want_e = allowed[np.argsort(p[allowed])[::-1][:3]]
    assert sorted(got_e) == sorted(want_e)
    np.testing.assert_allclose(sorted(got_w), sorted(p[want_e] * 16.0), rtol=1e-5)


def test_v2_greedy_generation_and_export(saved_v2, tmp_path):
  folder, hf = saved_v2["v2"]
  for i, (got, want) in enumerate(greedy_tokens(folder, hf, PROMPTS, 10, True)):
    assert got == want, i
  ours = models.from_pretrained(folder)
  models.save_pretrained(ours, str(tmp_path / "out"))
  back = transformers.DeepseekV2ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["topk_method"] == "group_limited_greedy"
  assert models.hf_config_to_model_config(written) == ours.cfg
  with pytest.raises(ValueError, match="norm_topk_prob=True cannot be written as "
                                       "DeepseekV2ForCausalLM"):
    models.hf.check_exportable(ours.cfg.replace(norm_topk_prob=True))


@pytest.mark.parametrize("variant", [pytest.param("q_latent", marks=pytest.mark.slow),
                                     "q_proj"])
def test_lora_on_latent_attention(saved, variant, tmp_path):
  """Adapters on MLA's per-head projections (q_proj: the queries', q_b_proj with a query
  latent; k_proj: k_b_proj; v_proj: v_b_proj; o_proj) in every layer, the dense one
  too, and on the dense layer's MLP and each shared expert: fresh ones change nothing; trained ones move the logits, merge exactly, and the
  absorbed cached path (k_b_proj's adapter folded into the queries, v_b_proj's into the
  output) equals the full forward. PEFT files are refused by name."""
  folder, hf = saved[variant]
  m = models.from_pretrained(folder, lora_rank=4, scan_layers=True)
  assert m.cfg.lora_target_names == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj")
  assert hasattr(m.dense_layers.mlp, "up_proj_lora_a")
  assert hasattr(m.layers.mlp.shared, "up_proj_lora_a")
  adapters = nnx.state(m, nnx.LoRAParam)
  assert sum(x.size for x in jax.tree.leaves(adapters)) == m.cfg.num_lora_params
  np.testing.assert_allclose(np.asarray(_jitted_logits(m, TOKENS)), hf_logits(hf, TOKENS),
                             atol=1e-4, rtol=0)
  keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(adapters))))
  nnx.update(m, jax.tree.map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape),
                             adapters))
  want = np.asarray(_jitted_logits(m, jnp.asarray(TOKENS)))
  assert np.abs(want - hf_logits(hf, TOKENS)).max() > 0.1
  np.testing.assert_allclose(np.asarray(_jitted_logits(models.merge_lora(m), TOKENS)), want,
                             atol=1e-4, rtol=0)
  got, cache = _prefill(m, jnp.asarray(TOKENS[:, :12]), models.init_cache(m.cfg, 2, 24))
  positions = jnp.broadcast_to(jnp.arange(12, 20), (2, 8))
  rest, _ = _extend(m, jnp.asarray(TOKENS[:, 12:]), positions, cache)
  np.testing.assert_allclose(np.concatenate([np.asarray(got), np.asarray(rest)], 1), want,
                             atol=1e-4, rtol=0)
  with pytest.raises(ValueError, match="PEFT adapter files of DeepseekV3ForCausalLM"):
    models.save_lora_adapter(m, str(tmp_path / "adapter"))
