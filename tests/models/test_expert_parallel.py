"""Expert parallelism: with the rules splitting the logical "experts" axis over mesh axes,
each device holds and runs only its E / ep experts (tokens all-gathered over the ep axes,
the outputs reduce-scattered back). Logits, the load-balancing loss and every gradient
equal one device's and the default rules' (experts whole on each device); the experts
stay split over E inside the compiled program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models

CFG = models.get_preset("tiny").replace(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    ffn_dim=16, num_experts=8, num_experts_per_tok=2, tie_embeddings=False,
    architecture="Qwen3MoeForCausalLM", init_std=0.2)
# DeepSeek-V3-like: sigmoid routing in groups, a shared expert, a leading dense layer.
SHARED = CFG.replace(router_scoring="sigmoid", router_groups=2, router_group_topk=1,
                     shared_expert_dim=16, dense_layers=1, dense_ffn_dim=24,
                     architecture="DeepseekV3ForCausalLM")
# gpt-oss-like: router and expert biases, the clamped SwiGLU; layers scanned.
BIASED = CFG.replace(router_bias=True, expert_bias=True, mlp_activation="clamped_swiglu",
                     scan_layers=True, architecture="GptOssForCausalLM")

# Llama 4 Maverick-like: top-1 sigmoid routing scaling the expert's input, a shared expert,
# dense layers between the mixture layers, chunked rotary layers and a NoPE layer; scanned.
LLAMA4 = CFG.replace(num_layers=4, num_experts_per_tok=1, norm_topk_prob=False,
                     router_scoring="sigmoid", router_correction_bias=False,
                     routed_input_scaling=True, shared_expert_dim=16, moe_layer_step=2,
                     dense_ffn_dim=24, rope_layers=(1, 1, 1, 0), qk_l2_norm=True,
                     attention_chunk_size=2, sliding_window=2,
                     layer_types=("sliding_attention",) * 3 + ("full_attention",),
                     attn_temperature_tuning=True,
                     attn_floor_scale=2.0, scan_layers=True, architecture="Llama4ForCausalLM")

# Nemotron 3-like: single-sublayer layers (Mamba2, attention, mixtures alone), experts
# without a gate (relu^2) in a latent of their own, a shared expert; scanned.
NEMOTRON3 = CFG.replace(
    num_layers=4, layer_types=("linear_attention", "moe", "full_attention", "moe"),
    rope_layers=(0,) * 4, mlp_activation="relu2", linear_mixer="mamba2",
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_bias=True, linear_chunk=4, linear_dt_min=0.01,
    router_scoring="sigmoid", router_groups=2, router_group_topk=1, shared_expert_dim=24,
    routed_scaling_factor=2.5, moe_latent_dim=16, scan_layers=True,
    architecture="NemotronHForCausalLM")

# Gemma 4 26B-A4B-like: GeGLU experts beside each layer's dense MLP, the router reading the
# residual stream through its own scales; sliding layers beside full ones of their own
# widths (values from the keys), in two stacks; scanned.
GEMMA4 = CFG.replace(
    mlp_activation="gelu_tanh", shared_expert_dim=24, moe_input_norms=True,
    sandwich_norms=True, qk_norm=True, v_norm=True, layer_scale=True,
    attention_multiplier=1.0, sliding_window=2, global_head_dim=12, global_kv_heads=1,
    k_eq_v=True, layer_types=("sliding_attention", "full_attention"),
    rope=models.RopeConfig(theta=1_000_000.0, type="proportional", partial_rotary_factor=0.5),
    rope_local=models.RopeConfig(), scan_layers=True, architecture="Gemma4ForCausalLM")


def _rules(*axes):
  """The default rules with the experts' axis over `axes`."""
  return tuple((name, axes) if name == "experts" else (name, a)
               for name, a in models.DEFAULT_RULES)


def _model(cfg):
  """A model whose zero-initialised biases (experts', correction) are random too, and its
  scales initialised to one (Gemma 4's router and layer scales) random about one."""
  model = models.create_model(cfg, seed=1)
  graphdef, state = nnx.split(model)
  flat = nnx.to_pure_dict(state)
  rng = np.random.default_rng(2)

  def perturb(path, x):
    name = str(path[-1])
    if any(b in name for b in ("gate_bias", "up_bias", "down_bias", "score_correction_bias")):
      return jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype)
    if any(s in name for s in ("router_scale", "per_expert_scale", "layer_scale")):
      return jnp.asarray(1.0 + rng.normal(0, 0.3, x.shape), x.dtype)  # Gemma 4's, at one
    return x
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(perturb, flat))
  return nnx.merge(graphdef, state)


def _batch(b=8, t=5):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
  segments = jnp.ones((b, t), jnp.int32).at[1, 3:].set(0)  # padding: no router stats
  return tokens, segments


def _loss_fn(graphdef, ctx):
  """(log-prob loss + load-balancing loss, (logits, load-balancing loss))."""

  def loss(state, tokens, segments):
    model = nnx.merge(graphdef, state)
    h, aux = model.hidden_states(tokens, segment_ids_BxT=segments, ctx=ctx, router_loss=True)
    logits = jnp.einsum("BTD,DV->BTV", h, model.unembed())
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.roll(tokens, -1, 1)[..., None],
                               axis=-1)[..., 0]
    return -jnp.mean(logp * segments) + aux, (logits, aux)
  return loss


def _run(model, mesh=None, rules=models.DEFAULT_RULES):
  if mesh is not None:
    model = models.shard_model(model, mesh, rules)
  graphdef, state = nnx.split(model)
  fn = jax.value_and_grad(_loss_fn(graphdef, models.ShardingContext(mesh, rules)),
                          has_aux=True)
  (loss, (logits, aux)), grads = jax.jit(fn)(state, *_batch())
  return loss, logits, aux, nnx.to_pure_dict(grads)


def _close(a, b, name):
  """Within float32 rounding: 1e-5 of each element, or of the array's largest (a sum in
  another order moves a small element by the rounding of the large ones)."""
  b = np.asarray(b)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b))),
                             err_msg=name)


def _assert_same(got, want):
  for name, a, b in zip(("loss", "logits", "router loss"), got[:3], want[:3]):
    _close(a, b, name)
  paths = jax.tree_util.tree_flatten_with_path(want[3])[0]
  for (path, b), a in zip(paths, jax.tree.leaves(got[3]), strict=True):
    _close(a, b, jax.tree_util.keystr(path))


# (mesh, experts' axes): F split over tensor 2 beside ep 4; data 2 beside ep 4; the
# experts over fsdp and tensor (E / 8 = 1 a device: tokens gathered over fsdp, already
# the same on both tensor devices); over data and fsdp (both gathered).
EP = [((1, 4, 2, 1), ("fsdp",)), ((2, 4, 1, 1), ("fsdp",)),
      ((1, 4, 2, 1), ("fsdp", "tensor")), ((2, 4, 1, 1), ("data", "fsdp"))]


# The default run keeps one mesh of each model (ep 4 beside tensor 2); every mesh is slow.
@pytest.mark.parametrize("cfg,cases", [
    (CFG, EP[:1]), (SHARED, EP[:1]), (BIASED, EP[:1]), (LLAMA4, EP[:1]),
    (NEMOTRON3, [((1, 4, 2, 1), None)] + EP[:1]), (GEMMA4, [((1, 4, 2, 1), None)] + EP[:1]),
    pytest.param(CFG, [((1, 4, 2, 1), None)] + EP[1:], marks=pytest.mark.slow),
    pytest.param(SHARED, EP[1:3], marks=pytest.mark.slow),
    pytest.param(BIASED, EP[1:3], marks=pytest.mark.slow),
], ids=["plain", "shared_sigmoid_groups", "biased_scanned", "llama4_interleaved_scanned",
         "nemotron3_latent_scanned", "gemma4_beside_mlp_scanned", "plain_every_mesh",
        "shared_every_mesh", "biased_every_mesh"])
def test_expert_parallel_equals_one_device(cfg, cases):
  """Logits, the router loss and the gradients of every parameter: the same on one device,
  with the default rules (`None`: experts whole on each device) and with the experts
  split over E on the ep axes, each device's shard E / ep experts."""
  model = _model(cfg)
  want = _run(model)
  assert float(jnp.max(jnp.abs(jnp.asarray(jax.tree.leaves(want[3])[0])))) > 0
  for shape, axes in cases:
    mesh = models.make_mesh(shape)
    rules = models.DEFAULT_RULES if axes is None else _rules(*axes)
    if axes is not None:
      placed = models.shard_model(model, mesh, rules)
      stack = getattr(placed, "moe_layers", placed.layers)
      gate = (stack if cfg.scan_layers else stack[0]).mlp.up_proj[...]
      ep = int(np.prod([mesh.shape[a] for a in axes]))
      entry = axes[0] if len(axes) == 1 else axes
      f = None if "tensor" in axes or mesh.shape["tensor"] == 1 else "tensor"
      lead = (None,) if cfg.scan_layers else ()
      assert gate.sharding.spec == jax.P(*lead, entry, None, f), gate.sharding.spec
      e_axis = len(lead)
      assert {s.data.shape[e_axis] for s in gate.addressable_shards} == {cfg.num_experts // ep}
    _assert_same(_run(model, mesh, rules), want)


def _shapes(text):
  """Every array shape in an HLO text."""
  return {tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"\b(?:f32|bf16|f16|s32|u32|pred)\[([\d,]*)\]", text)}


def test_no_device_holds_every_expert():
  """The compiled forward and backward (mesh (1, 4, 2, 1), experts over fsdp): each device
  holds [E / 4, D, F / 2] of an expert projection, and no array anywhere in the per-device
  program has all E experts' [E, D, F'] or [E, F', D] (F' = F or F / 2), so none is
  all-gathered, summed or built whole. The same check finds them with the default rules
  (the experts' D gathered over fsdp: [E, D, F / 2] on each device): it can fail."""
  e, d, f = CFG.num_experts, CFG.d_model, CFG.ffn_dim
  whole = {(e, d, f), (e, f, d), (e, d, f // 2), (e, f // 2, d)}
  mesh = models.make_mesh((1, 4, 2, 1))
  model = _model(CFG)
  texts = {}
  for name, rules in (("default", models.DEFAULT_RULES), ("ep", _rules("fsdp"))):
    graphdef, state = nnx.split(models.shard_model(model, mesh, rules))
    fn = jax.value_and_grad(_loss_fn(graphdef, models.ShardingContext(mesh, rules)),
                            has_aux=True)
    texts[name] = jax.jit(fn).lower(state, *_batch()).compile().as_text()

  def windows(shapes):
    return {s[i:i + 3] for s in shapes for i in range(len(s) - 2)}
  assert windows(_shapes(texts["default"])) & whole  # the check sees gathered experts
  ep = windows(_shapes(texts["ep"]))
  assert (e // 4, d, f // 2) in ep and (e // 4, f // 2, d) in ep  # the local experts
  assert not ep & whole, ep & whole


def test_the_sampler_keeps_the_experts_split():
  """The sampler's gathered copy (the batch axes removed) keeps an expert-parallel
  model's experts split over E, each device E / ep of them, and samples what one
  device does."""
  from posttrain.sampling import Sampler
  model = _model(CFG)
  prompts = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 37)), [3, 3, 3, 8]]
  mesh = models.make_mesh((1, 4, 2, 1))
  sampler = Sampler(model, mesh=mesh, max_len=40, rules=_rules("fsdp"))
  assert sampler.gather_weights
  weights = sampler._weights()
  gate = weights["layers"][0]["mlp"]["gate_proj"]
  assert {s.data.shape[0] for s in gate.addressable_shards} == {CFG.num_experts // 4}
  q = weights["layers"][0]["attn"]["q_proj"]  # the rest gathered over fsdp as before
  assert {s.data.shape[0] for s in q.addressable_shards} == {CFG.d_model}
  one = Sampler(model, max_len=40)
  got = sampler.generate(prompts, max_new_tokens=8, temperature=0.0)
  want = one.generate(prompts, max_new_tokens=8, temperature=0.0)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
