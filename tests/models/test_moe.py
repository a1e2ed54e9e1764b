"""Mixture-of-experts layers: routing and experts against a numpy oracle, gradients against
the dense mixture, sharding, the KV cache, scanned layers, configs and presets. The
sampler's padded copy of the experts is checked with their adapters in
test_expert_lora.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import transformer as tr

CFG = models.get_preset("tiny").replace(
    vocab_size=263, d_model=48, num_heads=6, num_kv_heads=3, head_dim=8, ffn_dim=40,
    num_layers=2, tie_embeddings=False, qk_norm=True, num_experts=5, num_experts_per_tok=2,
    architecture="Qwen3MoeForCausalLM", init_std=0.2)


@pytest.fixture(scope="module")
def model():
  return models.create_model(CFG, seed=1)


def _tokens(b=3, t=13, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, t)))


def _weights(e=5, d=24, f=16, seed=0, router_std=1.0):
  rng = np.random.default_rng(seed)
  return (rng.normal(0, router_std, (d, e)).astype(np.float32),
          rng.normal(0, 0.3, (e, d, f)).astype(np.float32),
          rng.normal(0, 0.3, (e, d, f)).astype(np.float32),
          rng.normal(0, 0.3, (e, f, d)).astype(np.float32))


def _oracle(x, router, gate, up, down, k, normalize):
  """Token by token in float64: softmax, top-k, and the chosen experts' SwiGLU."""
  x = np.asarray(x, np.float64)
  logits = x @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.zeros_like(x)
  for n in range(len(x)):
    top = np.argsort(-probs[n], kind="stable")[:k]
    w = probs[n, top] / (probs[n, top].sum() if normalize else 1.0)
    for e, we in zip(top, w):
      g, u = x[n] @ gate[e], x[n] @ up[e]
      out[n] += we * (g / (1 + np.exp(-g)) * u) @ down[e]
  return out


def _mixture(x, router, gate, up, down, k=2, normalize=True):
  w, e = tr.route(x, router, k, normalize)
  return tr.expert_mlps(x, w, e, gate, up, down)


def _dense_mixture(x, router, gate, up, down, k=2, normalize=True):
  """Every expert on every token, weighted by the same routing (zero off the top k)."""
  w, e = tr.route(x, router, k, normalize)
  combine = jnp.zeros((x.shape[0], gate.shape[0])).at[jnp.arange(x.shape[0])[:, None], e].add(w)
  h = jax.nn.silu(jnp.einsum("ND,EDF->NEF", x, gate)) * jnp.einsum("ND,EDF->NEF", x, up)
  return jnp.einsum("NED,NE->ND", jnp.einsum("NEF,EFD->NED", h, down), combine)


@pytest.mark.parametrize("k,normalize", [(1, False), (2, True), (2, False), (5, True)])
def test_experts_match_a_token_by_token_oracle(k, normalize):
  weights = _weights()
  x = np.random.default_rng(1).normal(size=(37, 24)).astype(np.float32)
  got = jax.jit(_mixture, static_argnums=(5, 6))(x, *weights, k, normalize)
  np.testing.assert_allclose(got, _oracle(x, *weights, k, normalize), atol=2e-5, rtol=1e-5)


def test_lopsided_routing_drops_no_token():
  """A router that sends every token to the same two experts (the others get none):
  dropless, so each token's output is still its two experts' mixture."""
  router, gate, up, down = _weights()
  router = np.zeros_like(router)
  router[:, 3], router[:, 1] = 5.0, 4.0  # x > 0 below: experts 3 then 1 win every token
  x = np.abs(np.random.default_rng(2).normal(size=(29, 24))).astype(np.float32) + 0.1
  e = jax.jit(tr.route, static_argnums=(2, 3))(x, router, 2, True)[1]
  assert set(np.asarray(e).ravel()) == {1, 3}
  got = jax.jit(_mixture)(x, router, gate, up, down)
  np.testing.assert_allclose(got, _oracle(x, router, gate, up, down, 2, True), atol=2e-5)


def test_gradients_equal_the_dense_mixture():
  weights = [jnp.asarray(w) for w in _weights(seed=3)]
  x = jnp.asarray(np.random.default_rng(4).normal(size=(21, 24)), jnp.float32)

  def loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a)))

  got = jax.jit(jax.grad(loss(_mixture), argnums=range(5)))(x, *weights)
  want = jax.jit(jax.grad(loss(_dense_mixture), argnums=range(5)))(x, *weights)
  for name, a, b in zip(("x", "router", "gate", "up", "down"), got, want):
    assert float(jnp.max(jnp.abs(b))) > 0, name
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)


def _layer_loss(graphdef, ctx):
  def loss(state, x):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x, ctx)))
  return loss


@pytest.mark.parametrize("shape", [(1, 2, 4, 1), (2, 2, 2, 1), (1, 8, 1, 1), (1, 1, 1, 8)])
def test_sharded_layer_and_its_gradients_equal_one_device(shape):
  cfg = CFG.replace(d_model=32, ffn_dim=64)
  layer = tr.MoE(cfg, nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  x = jax.random.normal(jax.random.key(1), (4, 8, 32))
  one = jax.jit(jax.value_and_grad(_layer_loss(graphdef, models.ShardingContext(None)),
                                   argnums=(0, 1)))(state, x)
  mesh = models.make_mesh(shape)
  ctx = models.ShardingContext(mesh)
  placed = jax.device_put(state, models.factory.state_shardings(state, mesh,
                                                                 models.DEFAULT_RULES))
  got = jax.jit(jax.value_and_grad(_layer_loss(graphdef, ctx), argnums=(0, 1)))(placed, x)
  np.testing.assert_allclose(got[0], one[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(one[1]), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_tokens_stay_on_their_device():
  """On (data 1, fsdp 2, tensor 4) the forward and backward move weights (gathered over
  fsdp, their gradients summed) and, over tensor, the sum of each device's slice of F:
  one [local tokens, D] array each way. Never tokens between devices, sorted rows
  ([tokens k, D]) or an all-to-all."""
  cfg = CFG.replace(d_model=32, ffn_dim=64)
  layer = tr.MoE(cfg, nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  mesh = models.make_mesh((1, 2, 4, 1))
  ctx = models.ShardingContext(mesh)
  state = jax.device_put(state, models.factory.state_shardings(state, mesh,
                                                                models.DEFAULT_RULES))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (4, 6, 32)),
                     ctx.sharding(("batch", "length", "embed"), (4, 6, 32)))
  text = jax.jit(jax.grad(_layer_loss(graphdef, ctx), argnums=(0, 1))).lower(
      state, x).compile().as_text()
  ops = r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\("
  results = [m.group(1) for line in text.splitlines()
             if (m := re.search(r"= (.*?) " + ops, line))]  # each collective's result type
  assert results and not any("all-to-all" in line for line in text.splitlines())
  shapes = [tuple(int(d) for d in dims.split(",") if d)
            for r in results for dims in re.findall(r"f32\[([\d,]*)\]", r)]
  local_tokens = 4 * 6 // 2
  assert shapes.count((local_tokens, 32)) == 2, results  # y forward, dx backward
  for s in shapes:  # nothing sized by the global token count or the sorted rows
    assert 4 * 6 not in s and local_tokens * 2 not in s or s in ((5, 32, 64), (5, 64, 32)), s


@pytest.mark.parametrize("shape", [(1, 2, 4, 1), (2, 2, 2, 1)])
def test_sharded_model_equals_one_device(model, shape):
  mesh = models.make_mesh(shape)
  sharded = models.create_model(CFG, mesh=mesh, seed=1)
  assert sharded.layers[0].mlp.gate_proj[...].sharding.spec == jax.P(None, "fsdp", "tensor")
  tokens = _tokens(b=8)
  ctx = models.ShardingContext(mesh)
  got = nnx.jit(lambda m, t: m(t, ctx=ctx))(sharded, tokens)
  np.testing.assert_allclose(got, nnx.jit(lambda m, t: m(t))(model, tokens),
                             atol=2e-5, rtol=2e-5)


def test_kv_cache_decode_matches_full_forward(model):
  tokens = _tokens(2, 10, seed=7)
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  cache = models.init_cache(CFG, 2, 16)
  call = nnx.jit(lambda m, t, p, c: m(t, p, cache=c))
  logits, cache = call(model, tokens[:, :6], jnp.broadcast_to(jnp.arange(6), (2, 6)), cache)
  np.testing.assert_allclose(logits, full[:, :6], atol=1e-5)
  for t in range(6, 10):
    step, cache = call(model, tokens[:, t:t + 1], jnp.full((2, 1), t), cache)
    np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-5)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_layers_and_remat_give_the_same_gradients(model, remat):
  tokens = _tokens(2, 9)
  scanned = models.relayout(models.create_model(CFG.replace(remat=remat), seed=1),
                            scan_layers=True)
  assert scanned.layers.mlp.gate_proj.get_metadata()["logical_axes"] == (
      "layers", "experts", "embed", "mlp")
  grads = []
  for m in (model, scanned):
    graphdef, params = nnx.split(m)
    grads.append(jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(
        nnx.merge(graphdef, p)(tokens)))))(params))
  plain, stacked = (nnx.to_pure_dict(g) for g in grads)
  for i in range(CFG.num_layers):
    for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: np.asarray(x)[i], stacked["layers"])),
                    jax.tree.leaves(plain["layers"][i]), strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_config_counts_and_checks():
  _, state = models.abstract_model(CFG)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == CFG.num_params
  dense_mlp = 3 * CFG.d_model * CFG.ffn_dim * CFG.num_layers
  assert CFG.num_params - CFG.num_active_params == 3 * dense_mlp  # 5 experts, 2 active
  # Published sizes: Qwen3-30B-A3B 30.5B (3.3B active), Mixtral 8x7B 46.7B (12.9B).
  qwen, mixtral = models.get_preset("qwen3_30b_a3b"), models.get_preset("mixtral_8x7b")
  assert abs(qwen.num_params / 1e9 - 30.53) < 0.02
  assert abs(qwen.num_active_params / 1e9 - 3.35) < 0.02
  assert abs(mixtral.num_params / 1e9 - 46.70) < 0.02
  assert abs(mixtral.num_active_params / 1e9 - 12.88) < 0.02
  _, state = models.abstract_model(qwen)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == qwen.num_params
  # Shared experts, dense layers, latent attention: Qwen1.5-MoE-A2.7B 14.3B (2.7B
  # active), GLM-4.5-Air 106B, Moonlight-16B-A3B 16.0B (2.9B), DeepSeek-V3 671B (37.6B);
  # sparse attention's indexers: DeepSeek-V3.2 (V3's plus 0.85B), GLM-5 744B (40B active
  # as announced, 41.8B counting the embedding).
  for preset, total, active in [("qwen1_5_moe_a2_7b", 14.32, 2.69), ("glm4_5_air", 106.85, 13.42),
                                ("moonlight_16b_a3b", 15.96, 2.91), ("deepseek_v3", 671.03, 37.55),
                                ("deepseek_v3_2", 671.88, 38.40), ("glm5", 743.91, 41.78)]:
    cfg = models.get_preset(preset)
    assert abs(cfg.num_params / 1e9 - total) < 0.01, preset
    assert abs(cfg.num_active_params / 1e9 - active) < 0.01, preset
    _, state = models.abstract_model(cfg)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == cfg.num_params
    models.hf.check_exportable(cfg)  # each is its Hugging Face class
  with pytest.raises(ValueError, match=r"num_experts_per_tok=6 must be in \[1, num_experts=5\]"):
    CFG.replace(num_experts_per_tok=6)
  with pytest.raises(ValueError, match="num_experts_per_tok=2 needs num_experts > 0"):
    CFG.replace(num_experts=0)
  with pytest.raises(ValueError, match="num_experts must be an int >= 0"):
    CFG.replace(num_experts=-1)


def test_interleaved_dense_layers_config():
  """moe_layer_step: every n-th layer a mixture, the others dense; what it refuses."""
  cfg = CFG.replace(num_layers=6, moe_layer_step=3, dense_ffn_dim=40)
  assert cfg.mixture_flags == (False, False, True, False, False, True)
  assert (cfg.mixture_layers, cfg.num_dense_layers) == (2, 4)
  _, state = models.abstract_model(cfg)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == cfg.num_params
  assert models.transformer.layer_stacks(cfg) == (("dense_layers", (0, 1, 3, 4)),
                                                  ("layers", (2, 5)))
  for change, match in [
      (dict(moe_layer_step=2), r"moe_layer_step=2 and dense_ffn_dim=0: set both"),
      (dict(moe_layer_step=2, dense_ffn_dim=8, dense_layers=1), "with dense_layers=1 is not"),
      (dict(moe_layer_step=0), "moe_layer_step must be an int >= 1"),
      (dict(moe_layer_step=9, dense_ffn_dim=8), "moe_layer_step=9 leaves no mixture layer"),
      (dict(num_layers=5, moe_layer_step=2, dense_ffn_dim=8, scan_layers=True),
       "needs num_layers=5 a multiple of it"),
      (dict(num_experts=0, num_experts_per_tok=0, moe_layer_step=2, dense_ffn_dim=8),
       "moe_layer_step describe a mixture")]:
    with pytest.raises(ValueError, match=match):
      CFG.replace(**change)


@pytest.mark.slow
def test_lora_on_a_mixture_adapts_attention_only():
  m = models.create_model(CFG.replace(lora_rank=4), seed=1)
  assert m.cfg.lora_target_names == ("q_proj", "k_proj", "v_proj", "o_proj")
  assert hasattr(m.layers[0].attn, "q_proj_lora_a")
  assert not any("lora" in name for name in vars(m.layers[0].mlp))
  assert m.cfg.num_lora_params == sum(
      x.size for x in jax.tree.leaves(nnx.state(m, nnx.LoRAParam)))
  np.testing.assert_array_equal(  # B starts at zero: the adapted model is the base
      m(_tokens()), models.merge_lora(m)(_tokens()))
  with pytest.raises(ValueError, match=r"lora_targets \['up_proj'\] are MLP projections"):
    CFG.replace(lora_rank=4, lora_targets="q_proj,up_proj")


@pytest.mark.slow
@pytest.mark.parametrize("shape", [None, (1, 2, 4, 1)])
def test_sampler_draws_what_the_model_computes(model, shape):
  """Greedy tokens equal argmax decoding by full recomputation; sampled tokens' behaviour
  log-probs equal the model's own log-probs of them (on one device and on a mesh)."""
  from posttrain.sampling import Sampler
  mesh = None if shape is None else models.make_mesh(shape)
  sampler = Sampler(model, mesh=mesh, max_len=40)
  prompts = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 37)), [3, 3, 3, 8]]
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  greedy = sampler.generate(prompts, max_new_tokens=8, temperature=0.0)
  buf = np.zeros((len(prompts), max(map(len, prompts)) + 8), np.int32)  # right padded
  for i, p in enumerate(prompts):
    buf[i, :len(p)] = p
  for t in range(8):  # the causal model: padding to the right changes nothing before it
    logits = np.asarray(forward(state, jnp.asarray(buf)))
    for i, p in enumerate(prompts):
      buf[i, len(p) + t] = np.argmax(logits[i, len(p) + t - 1])
  for i, p in enumerate(prompts):
    assert greedy.tokens[i].tolist() == buf[i, len(p):len(p) + 8].tolist()
  out = sampler.generate(prompts, max_new_tokens=8, temperature=1.0, seed=3)
  logprobs = jax.jit(lambda s, t, g: nnx.merge(graphdef, s).token_logprobs(t, g))
  for i, p in enumerate(prompts):
    seq = np.asarray([p + out.token_lists()[i]])
    ref = logprobs(state, seq, np.roll(seq, -1, axis=1))[0, len(p) - 1:-1]
    np.testing.assert_allclose(out.logprobs[i, :out.lengths[i]], ref, atol=1e-4)


@pytest.mark.parametrize("shape", [None, (1, 2, 4, 1), (2, 2, 2, 1)])
def test_load_balancing_loss_and_its_gradient_on_a_mesh_and_scanned(model, shape):
  """The router loss pools every layer's and every device's tokens (padding excluded):
  the same value and router gradients sharded, and with the layers scanned."""
  tokens = _tokens(4, 10, seed=3)
  segments = jnp.ones((4, 10), jnp.int32).at[1, 6:].set(0)

  def loss_and_grad(m, mesh):
    graphdef, state = nnx.split(m)
    ctx = models.ShardingContext(mesh)

    def loss(state):
      return nnx.merge(graphdef, state).hidden_states(tokens, segment_ids_BxT=segments,
                                                      ctx=ctx, router_loss=True)[1]
    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    return value, nnx.to_pure_dict(grads)

  want, want_grads = loss_and_grad(model, None)
  assert 1.9 < float(want) < 3.0  # k = 2 for uniform routing, more when lopsided
  mesh = None if shape is None else models.make_mesh(shape)
  placed = model if mesh is None else models.create_model(CFG, mesh=mesh, seed=1)
  got, grads = loss_and_grad(models.relayout(placed, scan_layers=True), mesh)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for i in range(CFG.num_layers):
    np.testing.assert_allclose(grads["layers"]["mlp"]["router"][i],
                               want_grads["layers"][i]["mlp"]["router"], atol=1e-6, rtol=1e-4)
  if shape is not None:
    return
  # Padding counts nothing: the loss of the unpadded tokens alone.
  router_loss = nnx.jit(lambda m, t, s: m.hidden_states(t, segment_ids_BxT=s,
                                                        router_loss=True)[1])
  alone = router_loss(model, tokens[1:2, :6], None)
  padded = router_loss(model, tokens[1:2], segments[1:2])
  np.testing.assert_allclose(padded, alone, rtol=1e-5)
  with pytest.raises(ValueError, match="router_loss=True needs a mixture of experts"):
    models.create_model(CFG.replace(num_experts=0, num_experts_per_tok=0)).hidden_states(
        tokens, router_loss=True)
  with pytest.raises(ValueError, match="router_aux_loss_coef=0.1 needs a mixture"):
    CFG.replace(num_experts=0, num_experts_per_tok=0, router_aux_loss_coef=0.1)
