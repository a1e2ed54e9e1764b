"""Routing replay: a mixture's forward records the experts each layer chose for each token
(`hidden_states(..., return_routing=True)`) and replays given ones (`routing=`), in every
layout of layers (unrolled, scanned, interleaved dense layers, hybrid periods with and
without split layers and with interleaved dense layers, Gemma 4's two stacks of attention
layers), with a KV cache, on a
mesh; `route` with given experts against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import transformer as tr

BASE = dict(vocab_size=97, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=16,
            num_experts=6, num_experts_per_tok=2, init_std=0.3)
KINDS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}

CONFIGS = {
    # Qwen3-MoE-like with one leading dense layer: a dense stack, then the mixtures.
    "leading_dense": models.ModelConfig(num_layers=3, dense_layers=1, dense_ffn_dim=24,
                                        qk_norm=True, **BASE),
    # Llama 4-like: a dense layer between mixture layers.
    "interleaved": models.ModelConfig(num_layers=4, moe_layer_step=2, dense_ffn_dim=24,
                                      **BASE),
    # DeepSeek-V3-like: sigmoid scores with a correction bias, grouped, a shared expert.
    "sigmoid_groups": models.ModelConfig(
        num_layers=2, router_scoring="sigmoid", router_correction_bias=True,
        router_groups=3, router_group_topk=2, shared_expert_dim=16, norm_topk_prob=True,
        routed_scaling_factor=2.5, **BASE),
    # Qwen3.5-MoE-like: three Gated DeltaNet layers to a full one, every MLP a mixture.
    "hybrid": models.ModelConfig(
        num_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_chunk=4, **BASE),
    # Nemotron 3-like: Mamba2, mixtures, attention and MLPs each a layer of its own.
    "split": models.ModelConfig(
        num_layers=6, layer_types=tuple(KINDS[c] for c in "ME*EM-"), rope_layers=(0,) * 6,
        mlp_activation="relu2", linear_mixer="mamba2", linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
        linear_chunk=4, dense_ffn_dim=24, router_scoring="sigmoid", shared_expert_dim=16,
        remat="full", **{**BASE, "num_experts_per_tok": 3}),
    # Jamba-like: Mamba 1 and attention layers, every other one's MLP a mixture
    # (unnormalised softmax weights).
    "hybrid_interleaved": models.ModelConfig(
        num_layers=4, layer_types=("linear_attention",) * 2 + ("full_attention",
                                                                "linear_attention"),
        rope_layers=(0,) * 4, moe_layer_step=2, dense_ffn_dim=24, norm_topk_prob=False,
        linear_mixer="mamba1", linear_num_key_heads=1, linear_num_value_heads=64,
        linear_key_head_dim=8, linear_value_head_dim=1, linear_dt_rank=4, linear_chunk=4,
        linear_bcdt_norm="weighted", **BASE),
    # Gemma 4 26B-A4B-like: GeGLU experts beside each layer's dense MLP, routed from the
    # residual stream; sliding layers and wider full ones in two stacks.
    "beside_mlp": models.ModelConfig(
        num_layers=4, layer_types=("sliding_attention", "full_attention") * 2,
        sliding_window=3, global_head_dim=12, global_kv_heads=1, k_eq_v=True, v_norm=True,
        layer_scale=True, qk_norm=True, sandwich_norms=True, mlp_activation="gelu_tanh",
        shared_expert_dim=16, moe_input_norms=True, attention_multiplier=1.0,
        rope=models.RopeConfig(type="proportional", partial_rotary_factor=0.5),
        rope_local=models.RopeConfig(), **BASE),
}


def _tokens(b=2, t=11, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, BASE["vocab_size"], (b, t)))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models_of(request):
  """(config, the unrolled model, the same weights scanned)."""
  cfg = CONFIGS[request.param]
  model = models.create_model(cfg.replace(scan_layers=False), seed=1)
  return cfg, model, models.relayout(model, scan_layers=True)


def _forward(model, tokens, **kw):
  return jax.jit(lambda t: model.hidden_states(t, **kw))(tokens)


def test_recorded_routing_replays_to_the_same_states_in_every_layout(models_of):
  """Each layout records the same experts (those its own top-k picks), and replaying
  them gives the states of the plain forward."""
  cfg, unrolled, scanned = models_of
  tokens = _tokens()
  plain = _forward(unrolled, tokens)
  h, routing = _forward(unrolled, tokens, return_routing=True)
  assert routing.shape == (2, 11, cfg.mixture_layers, cfg.num_experts_per_tok)
  assert routing.dtype == jnp.int32
  np.testing.assert_array_equal(h, plain)
  # Distinct experts per token, within range, and not one expert for every token.
  r = np.asarray(routing)
  assert r.min() >= 0 and r.max() < cfg.num_experts
  assert (np.sort(r, -1)[..., 1:] != np.sort(r, -1)[..., :-1]).all()
  assert len(np.unique(r)) > 1
  h2, routing2 = _forward(scanned, tokens, return_routing=True)
  np.testing.assert_array_equal(routing2, routing)
  np.testing.assert_allclose(h2, plain, atol=1e-5)
  for model in (unrolled, scanned):
    np.testing.assert_allclose(_forward(model, tokens, routing=routing), plain, atol=1e-5)
  # Replaying its own routing, the model would have chosen the same.
  np.testing.assert_array_equal(_forward(unrolled, tokens, routing=routing,
                                         return_routing=True)[1], routing)


def test_replayed_experts_are_taken_in_every_layout(models_of):
  """Other experts given: each layer runs those (unrolled and scanned agree), the states
  change, and the gradients reach the router, the same scanned or not."""
  cfg, unrolled, scanned = models_of
  tokens = _tokens(seed=3)
  routing = _forward(unrolled, tokens, return_routing=True)[1]
  other = (routing + 1) % cfg.num_experts  # still distinct per token
  a = _forward(unrolled, tokens, routing=other)
  b = _forward(scanned, tokens, routing=other)
  # float32 summed in the scan's order and the unrolled layers': 1.3e-5 apart at most on
  # values up to 2 (the hybrid periods), against the 1e-3 the replay moves them
  np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4)
  assert np.abs(np.asarray(a) - np.asarray(_forward(unrolled, tokens))).max() > 1e-3
  # Recorded while replaying: what the routers would have chosen. The first mixture
  # layer's input is the plain forward's, so its choice is the plain one, not the given.
  for model in (unrolled, scanned):
    own = np.asarray(_forward(model, tokens, routing=other, return_routing=True)[1])
    np.testing.assert_array_equal(own[:, :, 0], np.asarray(routing)[:, :, 0])

  def loss(model):
    return jnp.sum(jnp.sin(model.hidden_states(tokens, routing=other)))

  grads = [nnx.to_pure_dict(jax.jit(nnx.grad(loss))(m)) for m in (unrolled, scanned)]
  # The stacks of mixture layers: moe_layers (split), layers, or a hybrid's linear_layers.
  stacks = [s for s, v in grads[1].items()
            if isinstance(v, dict) and "router" in v.get("mlp", {})]
  assert stacks
  for stack in stacks:
    for j in range(len(grads[0][stack])):
      got = np.asarray(grads[1][stack]["mlp"]["router"])[j]
      want = np.asarray(grads[0][stack][j]["mlp"]["router"])
      assert np.abs(want).max() > 0
      np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_a_cached_prefill_and_decode_record_what_the_whole_forward_does(models_of):
  """The sampler's calls: a prefill, then one token at a time, each recording its
  tokens' experts: together the whole sequence's, as one forward without a cache."""
  cfg, unrolled, scanned = models_of
  tokens = _tokens(seed=5)
  want = np.asarray(_forward(unrolled, tokens, return_routing=True)[1])
  for model in (unrolled, scanned):
    cache = models.init_cache(model.cfg, 2, 16)
    step = jax.jit(lambda t, p, c, prefill: model.hidden_states(
        t, p, cache=c, prefill=prefill, return_routing=True), static_argnums=3)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    _, cache, got = step(tokens[:, :7], pos, cache, True)
    parts = [np.asarray(got)]
    for t in range(7, 11):
      _, cache, got = step(tokens[:, t:t + 1], jnp.full((2, 1), t), cache, False)
      parts.append(np.asarray(got))
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), want)


def test_route_takes_given_experts_weighted_by_the_router():
  """`route(..., experts_NxK=)`: the given experts, each weighted by the router's softmax
  (sigmoid score), renormalised over them with `normalize`, then scaled."""
  rng = np.random.default_rng(0)
  x, router = rng.normal(size=(7, 12)), rng.normal(size=(12, 6))
  given = np.stack([rng.permutation(6)[:3] for _ in range(7)])
  logits = x @ router
  for scoring, score in (("softmax", np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)),
                         ("sigmoid", 1 / (1 + np.exp(-logits)))):
    for normalize in (False, True):
      w, e = tr.route(jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32), 3,
                      normalize, scoring=scoring, scale=1.5, experts_NxK=jnp.asarray(given))
      want = np.take_along_axis(score, given, -1)
      if normalize:
        want = want / want.sum(-1, keepdims=True)
      np.testing.assert_array_equal(e, given)
      np.testing.assert_allclose(w, 1.5 * want, rtol=1e-5)


def test_routing_on_a_mesh_equals_one_device():
  """Sharded (tokens over data and fsdp, the experts' F over tensor) and with the
  experts split over fsdp (expert parallelism): the same record, the same replay."""
  cfg = CONFIGS["leading_dense"].replace(scan_layers=True)
  tokens = _tokens(b=8, seed=9)
  one = models.create_model(cfg, seed=1)
  want_h, want = _forward(one, tokens, return_routing=True)
  other = (want + 2) % cfg.num_experts
  want_replay = _forward(one, tokens, routing=other)
  mesh = models.make_mesh((2, 2, 2, 1))
  split = tuple(("experts", ("fsdp",)) if name == "experts" else (name, axes)
                for name, axes in models.DEFAULT_RULES)
  for rules in (models.DEFAULT_RULES, split):
    ctx = models.ShardingContext(mesh, rules)
    sharded = models.shard_model(models.create_model(cfg, seed=1), mesh, rules)
    h, got = jax.jit(lambda t: sharded.hidden_states(t, ctx=ctx, return_routing=True))(tokens)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(h, want_h, atol=2e-5)
    replayed = jax.jit(lambda t, r: sharded.hidden_states(t, ctx=ctx, routing=r))(tokens, other)
    np.testing.assert_allclose(replayed, want_replay, atol=2e-5)


def test_what_routing_replay_refuses():
  cfg = CONFIGS["leading_dense"]
  model = models.create_model(cfg, seed=0)
  tokens = _tokens()
  good = jnp.zeros((2, 11, cfg.mixture_layers, 2), jnp.int32)
  with pytest.raises(ValueError, match=r"routing has shape \(2, 11, 1, 2\), expected .*"
                                       r"\(2, 11, 2, 2\)"):
    model.hidden_states(tokens, routing=good[:, :, :1])
  with pytest.raises(ValueError, match="routing must hold integer expert ids"):
    model.hidden_states(tokens, routing=good.astype(jnp.float32))
  with pytest.raises(ValueError, match="replayed without a cache"):
    model.hidden_states(tokens, cache=models.init_cache(cfg, 2, 16), routing=good)
  dense = models.create_model(models.ModelConfig(
      **{**BASE, "num_experts": 0, "num_experts_per_tok": 0}, num_layers=1), seed=0)
  for kw in (dict(routing=good), dict(return_routing=True)):
    with pytest.raises(ValueError, match="routing replay needs a mixture of experts"):
      dense.hidden_states(tokens, **kw)


def test_recorded_routing_is_held_in_the_narrowest_integer_for_the_experts():
  for experts, dtype in ((8, jnp.uint8), (256, jnp.uint8), (257, jnp.int16),
                         (32767, jnp.int16), (40000, jnp.int32)):
    cfg = CONFIGS["interleaved"].replace(num_experts=experts)
    assert tr.routing_dtype(cfg) == dtype
