"""Model behaviour: sharding equivalence, causality, packing, chunked log-probs, heads."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models

CFG = models.get_preset("tiny").replace(vocab_size=263, d_model=48, num_heads=6, num_kv_heads=3,
                                        head_dim=8, ffn_dim=80, num_layers=2,
                                        tie_embeddings=False, qkv_bias=True, qk_norm=True)


@pytest.fixture(scope="module")
def model():
  return models.create_model(CFG, seed=1)


def _tokens(b=3, t=13, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, t)))


# The unsharded logits in one compiled call per model and shape; an eager call runs op by
# op and takes seconds.
_logits = nnx.jit(lambda m, t: m(t))


def _forward(model, tokens, mesh=None):
  if mesh is None:
    return _logits(model, tokens)
  ctx = models.ShardingContext(mesh)

  @nnx.jit
  def f(m, t):
    return m(t, ctx=ctx)

  return f(model, tokens)


@pytest.mark.parametrize("shape", [pytest.param((8, 1, 1, 1), marks=pytest.mark.slow),
                                   (1, 2, 4, 1), (2, 2, 2, 1), (1, 8, 1, 1)])
def test_sharded_forward_equals_unsharded(model, shape):
  mesh = models.make_mesh(shape)
  sharded = models.create_model(CFG, mesh=mesh, seed=1)
  tokens = _tokens(b=8)
  np.testing.assert_allclose(_forward(sharded, tokens, mesh), _forward(model, tokens),
                             atol=2e-5, rtol=2e-5)


def test_parameters_are_created_sharded():
  mesh = models.make_mesh((1, 2, 4, 1))
  m = models.create_model(CFG.replace(num_kv_heads=2, num_heads=4, ffn_dim=96), mesh=mesh)
  q = m.layers[0].attn.q_proj[...]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  # Each device holds only its shard, never the full tensor.
  assert q.addressable_shards[0].data.shape == (48 // 2, 4 // 4, 8)
  up = m.layers[0].mlp.up_proj[...]
  assert up.addressable_shards[0].data.shape == (24, 96 // 4)
  assert len(up.sharding.device_set) == 8


def test_indivisible_dimension_replicates_instead_of_failing():
  mesh = models.make_mesh((1, 1, 8, 1))
  # 3 kv heads cannot split 8 ways: that dimension replicates, the rest still shards.
  m = models.create_model(CFG, mesh=mesh)
  assert all(a is None for a in m.layers[0].attn.k_proj[...].sharding.spec)
  assert m.layers[0].mlp.up_proj[...].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")


def test_causal_by_gradient(model):
  tokens = _tokens(b=1, t=9)
  emb = model.embed[...]

  def loss_at(pos):
    def f(x):
      m = nnx.clone(model)
      m.embed[...] = x
      return m(tokens)[0, pos].sum()
    return jax.jit(jax.grad(f))(emb)

  g = loss_at(4)
  used = np.abs(np.asarray(g)).sum(-1) > 0
  later = set(np.asarray(tokens[0, 5:]).tolist()) - set(np.asarray(tokens[0, :5]).tolist())
  assert not any(used[t] for t in later), "position 4 depends on a later token"
  assert used[int(tokens[0, 0])]


def test_packed_segments_do_not_see_each_other(model):
  a, b = _tokens(1, 5, seed=1), _tokens(1, 7, seed=2)
  packed = jnp.concatenate([a, b, jnp.zeros((1, 3), a.dtype)], axis=1)
  seg = jnp.asarray([[1] * 5 + [2] * 7 + [0] * 3])
  pos = jnp.asarray([list(range(5)) + list(range(7)) + [0] * 3])
  out = nnx.jit(lambda m: m(packed, pos, seg))(model)
  np.testing.assert_allclose(out[:, :5], _forward(model, a), atol=1e-5)
  np.testing.assert_allclose(out[:, 5:12], _forward(model, b), atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 13, 64])
def test_chunked_logprobs_equal_full_log_softmax(model, chunk):
  tokens, targets = _tokens(2, 13, seed=3), _tokens(2, 13, seed=4)
  full = jax.nn.log_softmax(_logits(model, tokens), axis=-1)
  want = jnp.take_along_axis(full, targets[..., None], axis=-1)[..., 0]
  got, ent = nnx.jit(lambda m: m.token_logprobs(tokens, targets, chunk=chunk,
                                                return_entropy=True))(model)
  np.testing.assert_allclose(got, want, atol=1e-5)
  want_ent = -(jnp.exp(full) * full).sum(-1)
  np.testing.assert_allclose(ent, want_ent, atol=1e-4)


def test_chunked_logprob_gradient_matches_full(model):
  tokens, targets = _tokens(2, 11, seed=5), _tokens(2, 11, seed=6)
  graphdef, params = nnx.split(model)

  def chunked(p):
    return nnx.merge(graphdef, p).token_logprobs(tokens, targets, chunk=3).sum()

  def full(p):
    lp = jax.nn.log_softmax(nnx.merge(graphdef, p)(tokens), -1)
    return jnp.take_along_axis(lp, targets[..., None], -1).sum()

  g1, g2 = jax.jit(jax.grad(chunked))(params), jax.jit(jax.grad(full))(params)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_chunked_logprobs_never_build_full_float32_logits():
  cfg = CFG.replace(vocab_size=4099, logprob_chunk=16)
  m = models.create_model(cfg)
  tokens = jnp.zeros((2, 256), jnp.int32)
  graphdef, state = nnx.split(m)

  def f(state):
    return nnx.merge(graphdef, state).token_logprobs(tokens, tokens).sum()

  hlo = jax.jit(jax.grad(f)).lower(state).compile().as_text()
  assert "f32[2,256,4099]" not in hlo
  assert "f32[2,16,4099]" in hlo


@pytest.mark.parametrize("shape,vocab,parallel,biased", [
    ((2, 4, 1, 1), 1024, True, False),  # V over fsdp; the rows gather over fsdp, stay on data
    ((1, 4, 2, 1), 1024, True, True),   # V over tensor x fsdp; an output bias split as V
    ((1, 8, 1, 1), 1001, False, True),  # V does not divide: the projection is gathered whole
    ((1, 8, 1, 1), 48, False, False),   # 8 rows x 8 positions outnumber V: gathered whole too
])
def test_vocab_parallel_head_equals_the_unsharded_head(shape, vocab, parallel, biased):
  """With D split over fsdp, the log-prob head splits the vocabulary instead: the same
  log-probs, entropies and gradients (an output bias's too) as on one device, and no
  device gathers [D, V] (unless that holds less than the rows it would gather instead)."""
  mesh = models.make_mesh(shape)
  ctx = models.ShardingContext(mesh)
  b, t, d = 8, 24, 64
  assert (ctx.vocab_parallel_head(b, 8, d, vocab) is not None) == parallel
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, vocab)) * 0.1, jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, (b, t)))
  h_sharded = jax.device_put(h, ctx.sharding(("batch", "length", None), h.shape))
  w_sharded = jax.device_put(w, ctx.sharding(("embed", "vocab"), w.shape))
  bias = jnp.asarray(rng.normal(size=(vocab,)) if biased else np.zeros(vocab), jnp.float32)
  bias_sharded = jax.device_put(bias, ctx.sharding(("vocab",), bias.shape))

  def objective(c):
    def f(h, w, b):
      logp, ent = models.chunked_logprobs(h, w, targets, chunk=8, return_entropy=True, ctx=c,
                                          bias_V=b if biased else None)
      return jnp.sum(logp * jnp.arange(t)[None, :]) + jnp.sum(ent), (logp, ent)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

  (_, (logp, ent)), grads = objective(ctx)(h_sharded, w_sharded, bias_sharded)
  full = jax.nn.log_softmax(h @ w + bias[None, None], axis=-1)
  np.testing.assert_allclose(
      logp, jnp.take_along_axis(full, targets[..., None], -1)[..., 0], atol=1e-5)
  np.testing.assert_allclose(ent, -(jnp.exp(full) * full).sum(-1), atol=1e-4)
  (_, _), want = objective(models.ShardingContext(None))(h, w, bias)
  for got, ref in zip(grads, want):
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-4)
  if biased:  # d/db of sum(logp weights) + entropies: the bias learns
    assert np.abs(np.asarray(grads[2])).max() > 1e-3
  hlo = objective(ctx).lower(h_sharded, w_sharded, bias_sharded).compile().as_text()
  gathered = re.search(rf"f32\[{d},{vocab}\]\S* all-gather", hlo)
  assert (gathered is None) == parallel


def test_remat_gives_same_gradients(model):
  tokens = _tokens(2, 9)
  for policy in ("full", "dots_with_no_batch_dims"):
    other = models.create_model(CFG.replace(remat=policy), seed=1)
    grads = []
    for m in (model, other):
      graphdef, params = nnx.split(m)
      grads.append(jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).sum()))(params))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_bfloat16_compute_tracks_float32(model):
  m16 = models.create_model(CFG.replace(dtype="bfloat16"), seed=1)
  tokens = _tokens()
  out = _logits(m16, tokens)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), _logits(model, tokens), atol=0.05)


def test_value_head_shapes_and_gradient():
  m = models.create_model(CFG.replace(value_head=True))
  v = nnx.jit(lambda m, t: m.values(t))(m, _tokens())
  assert v.shape == (3, 13) and v.dtype == jnp.float32
  with pytest.raises(ValueError, match="no value head"):
    models.create_model(CFG).values(_tokens())


def test_kv_cache_decode_matches_full_forward(model):
  tokens = _tokens(2, 10, seed=7)
  full = _forward(model, tokens)
  cache = models.init_cache(CFG, 2, 16)
  call = nnx.jit(lambda m, t, p, c: m(t, p, cache=c))
  logits, cache = call(model, tokens[:, :6], jnp.broadcast_to(jnp.arange(6), (2, 6)), cache)
  np.testing.assert_allclose(logits, full[:, :6], atol=1e-5)
  for t in range(6, 10):
    pos = jnp.full((2, 1), t)
    step, cache = call(model, tokens[:, t:t + 1], pos, cache)
    np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-5)


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="num_kv_heads"):
    CFG.replace(num_kv_heads=4)
  with pytest.raises(ValueError, match="attention_impl"):
    CFG.replace(attention_impl="magic")
  with pytest.raises(ValueError, match="unknown model preset"):
    models.get_preset("gpt5")
  with pytest.raises(ValueError, match="tokens must be"):
    models.create_model(CFG)(jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="decode_chunk must be a positive int or None, got 0"):
    CFG.replace(decode_chunk=0)


def test_decode_chunk_follows_the_backend_unless_set():
  """Smaller decode blocks on CPU, large ones on accelerators; an explicit value wins."""
  auto = CFG.replace(decode_chunk=None)
  assert models.decode_chunk_for(auto, "cpu") == 256
  assert models.decode_chunk_for(auto, "gpu") == models.decode_chunk_for(auto, "tpu") == 1024
  assert models.decode_chunk_for(auto, "metal") == 1024  # unknown backends: the default
  assert models.decode_chunk_for(auto) == 256  # the tests run on CPU
  assert models.decode_chunk_for(CFG.replace(decode_chunk=48), "gpu") == 48


def test_presets_have_the_published_sizes():
  # Published parameter counts: Llama 3 8B ~8.03B, 70B ~70.6B, Qwen2.5 7B ~7.6B, Qwen3 8B ~8.2B.
  counts = {n: models.get_preset(n).num_params / 1e9 for n in
            ("llama3_8b", "llama3_70b", "qwen2_5_7b", "qwen3_8b")}
  assert abs(counts["llama3_8b"] - 8.03) < 0.05
  assert abs(counts["llama3_70b"] - 70.55) < 0.2
  assert abs(counts["qwen2_5_7b"] - 7.62) < 0.05
  assert abs(counts["qwen3_8b"] - 8.19) < 0.05
  # Abstract init allocates nothing and agrees with the formula.
  _, state = models.abstract_model(models.get_preset("llama3_8b"))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
  assert n == models.get_preset("llama3_8b").num_params


@pytest.mark.parametrize("impl,shape", [
    ("chunked", (1, 8, 1, 1)), ("ring", (1, 2, 1, 4)),
    # flash runs per shard: batch over data x fsdp, heads over tensor (3 divides the 3 kv
    # heads; with 2 a device's 3 query heads would straddle kv groups: heads stay whole).
    ("flash", (1, 2, 3, 1)), ("flash", (2, 1, 2, 1))])
def test_attention_impls_match_reference(model, impl, shape):
  mesh = models.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])
  other = models.create_model(CFG.replace(attention_impl=impl, attention_chunk=8), mesh=mesh,
                              seed=1)
  tokens = _tokens(b=2, t=16)
  np.testing.assert_allclose(_forward(other, tokens, mesh), _logits(model, tokens), atol=2e-5)


def test_flash_runs_on_each_devices_shard(monkeypatch):
  """XLA cannot partition a Pallas call (TPU refuses it, a GPU would run the whole batch
  on every device): on a mesh the model hands the kernel its local batch and heads."""
  import kernels
  seen = []
  original = kernels.flash_attention

  def spy(q, k, v, **kwargs):
    seen.append((q.shape, k.shape))
    return original(q, k, v, **kwargs)

  monkeypatch.setattr(kernels, "flash_attention", spy)
  mesh = models.make_mesh((2, 1, 3, 1), devices=jax.devices()[:6])
  model = models.create_model(CFG.replace(attention_impl="flash"), mesh=mesh, seed=1)
  _forward(model, _tokens(b=4, t=16), mesh)
  assert seen and set(seen) == {((2, 16, 2, 8), (2, 16, 1, 8))}


@pytest.mark.parametrize("impl,shape,entry", [
    ("flash", (1, 8, 1, 1), "flash_attention"),
    ("ring", (1, 2, 1, 4), "ring_attention_sharded")])
def test_attention_options_reach_the_flash_kernel(model, monkeypatch, impl, shape, entry):
  """attention_options (a device sweep's best flash options) go to the flash kernel,
  directly or as ring attention's inner kernel, and the logits still match."""
  import kernels
  seen = []
  original = getattr(kernels, entry)

  def spy(*args, **kwargs):
    seen.append(kwargs)
    return original(*args, **kwargs)

  monkeypatch.setattr(kernels, entry, spy)
  cfg = CFG.replace(attention_impl=impl,
                    attention_options="backend=gpu, block_q=16,block_kv=16,dq_atomic=true")
  mesh = models.make_mesh(shape)
  tokens = _tokens(b=2, t=16)
  got = _forward(models.create_model(cfg, mesh=mesh, seed=1), tokens, mesh)
  np.testing.assert_allclose(got, _logits(model, tokens), atol=2e-5)
  want = dict(backend="gpu", block_q=16, block_kv=16, dq_atomic=True)
  assert seen and all(kw.items() >= want.items() for kw in seen)
  if impl == "ring":
    assert all(kw["block_kernel"] == "flash" for kw in seen)


def test_attention_options_are_checked():
  assert models.config.parse_attention_options(" block_q=128 ,dq_atomic=False,backend=tpu") == (
      dict(block_q=128, dq_atomic=False, backend="tpu"))
  assert models.config.parse_attention_options("fused_bwd=true") == dict(fused_bwd=True)
  assert models.config.parse_attention_options("compact_grid=false") == dict(
      compact_grid=False)
  assert models.config.parse_attention_options("") == {}
  for text, message in (("block_z=1", "entry 'block_z=1': expected name=value with a name in"),
                        ("block_q", "entry 'block_q': expected name=value"),
                        ("block_q=big", "block_q='big': expected an integer"),
                        ("dq_atomic=yes", "dq_atomic='yes': expected true or false")):
    with pytest.raises(ValueError, match=message):
      CFG.replace(attention_impl="flash", attention_options=text)
  with pytest.raises(ValueError, match="are flash kernel options; attention_impl='chunked'"):
    CFG.replace(attention_impl="chunked", attention_options="block_q=128")


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("gated,act", [
    ("swiglu", jax.nn.silu), ("geglu", lambda g: jax.nn.gelu(g, approximate=True))])
def test_gated_mlp_backward_matches_autodiff(dtype, tol, gated, act):
  """The hand-written backwards equal autodiff of act(gate) * up (silu; Gemma's
  tanh-approximate gelu), saturated gates too."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  gate = (jax.random.normal(k1, (6, 40)) * 8).at[0, :4].set(
      jnp.array([-80.0, 80.0, 0.0, -1e-3])).astype(dtype)
  up = jax.random.normal(k2, (6, 40)).astype(dtype)
  dh = jax.random.normal(k3, (6, 40)).astype(dtype)
  plain = lambda g, u: act(g) * u  # noqa: E731
  out, vjp = jax.vjp(getattr(models.transformer, gated), gate, up)
  want, want_vjp = jax.vjp(plain, gate, up)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=tol,
                             atol=tol)
  for got, exp in zip(vjp(dh), want_vjp(dh)):
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exp, np.float32),
                               rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_clamped_swiglu_backward_matches_autodiff(dtype, tol):
  """gpt-oss's activation: the hand-written backward equals autodiff of the plain form,
  with a quarter of the gates and ups past the clamp (whose gradient is zero there)."""
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  # Off the bounds themselves: there autodiff of min / clip splits the gradient in half,
  # where torch's clamp (and ours) passes it whole.
  off = lambda x: jnp.where(jnp.abs(x) == 7.0, 6.5, x).astype(dtype)  # noqa: E731
  gate = off((jax.random.normal(k1, (6, 40)) * 7).astype(dtype))
  up = off((jax.random.normal(k2, (6, 40)) * 7).astype(dtype))
  dh = jax.random.normal(k3, (6, 40)).astype(dtype)

  def plain(g, u, limit=7.0, alpha=1.702):
    g, u = jnp.minimum(g.astype(jnp.float32), limit), jnp.clip(u.astype(jnp.float32),
                                                               -limit, limit)
    return ((u + 1.0) * g * jax.nn.sigmoid(alpha * g)).astype(dtype)

  out, vjp = jax.vjp(lambda g, u: models.transformer.clamped_swiglu(g, u, 7.0, 1.702),
                     gate, up)
  want, want_vjp = jax.vjp(plain, gate, up)
  assert 0.1 < float(jnp.mean(jnp.abs(up.astype(jnp.float32)) > 7)) < 0.5
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=tol, atol=tol)
  for got, exp in zip(vjp(dh), want_vjp(dh)):
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exp, np.float32),
                               rtol=tol, atol=tol * 10)


# The text_config of Qwen/Qwen3.5-27B's and Qwen/Qwen3.5-35B-A3B's published config.json
# (the fields a text model reads; layer_types left to full_attention_interval).
_QWEN3_5_TEXT = dict(
    attn_output_gate=True, full_attention_interval=4, head_dim=256, hidden_act="silu",
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
    linear_value_head_dim=128, max_position_embeddings=262_144, rms_norm_eps=1e-6,
    tie_word_embeddings=False, vocab_size=248_320, dtype="bfloat16",
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                     "partial_rotary_factor": 0.25})
_QWEN3_5_PUBLISHED = {
    "qwen3_5_27b": dict(_QWEN3_5_TEXT, architectures=["Qwen3_5ForCausalLM"],
                        model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17_408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        linear_num_value_heads=48),
    "qwen3_5_35b_a3b": dict(_QWEN3_5_TEXT, architectures=["Qwen3_5MoeForCausalLM"],
                            model_type="qwen3_5_moe_text", hidden_size=2048,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
}


@pytest.mark.parametrize("name,total,active", [("qwen3_5_27b", 26.90, 26.90),
                                               ("qwen3_5_35b_a3b", 34.66, 3.45)])
def test_qwen3_5_presets_are_the_published_configs(name, total, active):
  """Each preset is what `from_pretrained` builds from the published config.json (with
  the preset's training fields), so `launch.plan` sizes the real model before any file
  is fetched."""
  preset = models.get_preset(name)
  read = models.hf_config_to_model_config(
      _QWEN3_5_PUBLISHED[name], remat=preset.remat, scan_layers=preset.scan_layers)
  assert read == preset
  assert abs(preset.num_params / 1e9 - total) < 0.01
  assert abs(preset.num_active_params / 1e9 - active) < 0.01
  _, state = models.abstract_model(preset)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == preset.num_params
  models.hf.check_exportable(preset)
