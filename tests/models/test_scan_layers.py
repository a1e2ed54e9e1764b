"""scan_layers: the layers stacked and run as one lax.scan compute what the list computes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models

CFG = models.get_preset("tiny").replace(vocab_size=263, d_model=48, num_heads=6, num_kv_heads=3,
                                        head_dim=8, ffn_dim=80, num_layers=3,
                                        tie_embeddings=False, qkv_bias=True, qk_norm=True,
                                        attn_out_bias=True,  # Qwen3's attention_bias
                                        architecture="Qwen3ForCausalLM")
SCAN = CFG.replace(scan_layers=True)


@pytest.fixture(scope="module")
def pair():
  """(a model with a list of layers, the same parameters stacked for a scan)."""
  plain = models.create_model(CFG, seed=1)
  return plain, models.relayout(plain, scan_layers=True)


def _tokens(b=3, t=13, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, t)))


def _pure(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_stacked_parameters_carry_the_layers_axis(pair):
  plain, scanned = pair
  q = scanned.layers.attn.q_proj
  assert q.shape == (3, 48, 6, 8)
  assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "head_dim")
  assert scanned.layers.input_norm.scale.get_metadata()["logical_axes"] == ("layers", "norm")
  for i in range(3):
    np.testing.assert_array_equal(q[...][i], plain.layers[i].attn.q_proj[...])
  back = models.relayout(scanned, scan_layers=False)
  for a, b in zip(jax.tree.leaves(_pure(back)), jax.tree.leaves(_pure(plain)), strict=True):
    np.testing.assert_array_equal(a, b)
  # A fresh scanned model draws each layer from its own key: layers differ.
  fresh = models.create_model(SCAN, seed=0)
  w = np.asarray(fresh.layers.mlp.up_proj[...])
  assert not np.allclose(w[0], w[1])
  assert sum(x.size for x in jax.tree.leaves(_pure(fresh))) == SCAN.num_params


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_forward_and_gradients_equal_the_layer_list(remat):
  tokens = _tokens()
  plain = models.create_model(CFG.replace(remat=remat), seed=1)
  scanned = models.relayout(plain, scan_layers=True)
  assert scanned.cfg.remat == remat

  @nnx.jit
  def loss_and_grad(m, t):
    def loss(m):
      return jnp.mean(m(t) ** 2)
    return nnx.value_and_grad(loss)(m)

  (la, ga), (lb, gb) = loss_and_grad(plain, tokens), loss_and_grad(scanned, tokens)
  np.testing.assert_allclose(lb, la, rtol=1e-5)
  ga, gb = nnx.to_pure_dict(ga), nnx.to_pure_dict(gb)
  for i in range(CFG.num_layers):
    for a, b in zip(jax.tree.leaves(ga["layers"][i]),
                    jax.tree.leaves(jax.tree.map(lambda x: np.asarray(x)[i], gb["layers"])),
                    strict=True):
      np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-4)
  np.testing.assert_allclose(gb["embed"], ga["embed"], atol=2e-6, rtol=1e-4)


@pytest.mark.slow
def test_packed_token_logprobs_equal_the_layer_list(pair):
  plain, scanned = pair
  tokens = _tokens(b=2, t=16)
  segments = jnp.asarray(np.repeat([[1] * 9 + [2] * 5 + [0] * 2], 2, axis=0))
  positions = jnp.asarray(np.repeat([list(range(9)) + list(range(5)) + [0, 0]], 2, axis=0))
  a = plain.token_logprobs(tokens, jnp.roll(tokens, -1, 1), positions, segments)
  b = scanned.token_logprobs(tokens, jnp.roll(tokens, -1, 1), positions, segments)
  np.testing.assert_allclose(b, a, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_prefill_and_decode_with_a_stacked_cache_equal_the_layer_list(pair, cache_dtype):
  plain, scanned = pair
  tokens = _tokens(b=2, t=10)
  positions = jnp.broadcast_to(jnp.arange(10), (2, 10))

  @nnx.jit
  def run(m):
    cache = models.init_cache(m.cfg, 2, 24, jnp.int8 if cache_dtype else None)
    _, cache = m.hidden_states(tokens, positions, cache=cache, prefill=True)
    steps = []
    for t in range(3):  # rows at different lengths: row 1 lags one token behind
      pos = jnp.array([[10 + t], [9 + t]])
      h, cache = m.hidden_states(tokens[:, t:t + 1], pos, cache=cache)
      steps.append(h)
    return jnp.concatenate(steps, 1), cache

  outs = [run(m) for m in pair]
  np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-5)
  stacked, per_layer = outs[1][1], outs[0][1]
  assert isinstance(stacked, models.KVCache) and stacked.k.shape == (3, 2, 3, 24, 8)
  assert models.cache_slots(stacked) == models.cache_slots(per_layer) == 24
  for i, layer in enumerate(per_layer):
    for a, b in zip(layer, stacked):
      if a is not None:
        np.testing.assert_allclose(np.asarray(b)[i].astype(np.float32), np.asarray(a, np.float32),
                                   atol=1e-5 if cache_dtype is None else 1.0)


def test_cache_layout_must_match_the_model(pair):
  plain, scanned = pair
  tokens = _tokens(b=2, t=4)
  with pytest.raises(ValueError, match="cache layout does not match the model"):
    scanned.hidden_states(tokens, cache=models.init_cache(CFG, 2, 8), prefill=True)
  with pytest.raises(ValueError, match="cache layout does not match the model"):
    plain.hidden_states(tokens, cache=models.init_cache(SCAN, 2, 8), prefill=True)


@pytest.mark.slow
def test_sharded_scanned_model_keeps_the_layer_axis_whole():
  mesh = models.make_mesh((1, 2, 4, 1))
  cfg = SCAN.replace(num_heads=4, num_kv_heads=2, ffn_dim=96)
  m = models.create_model(cfg, mesh=mesh, seed=1)
  q = m.layers.attn.q_proj[...]
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  assert q.addressable_shards[0].data.shape == (3, 24, 1, 8)
  local = models.create_model(cfg, seed=1)
  tokens = _tokens(b=4)

  @nnx.jit
  def f(m, t):
    return m(t, ctx=models.ShardingContext(mesh))

  np.testing.assert_allclose(f(m, tokens), nnx.jit(lambda m, t: m(t))(local, tokens),
                             atol=2e-5, rtol=2e-5)


def _dots(cfg, layers):
  graphdef, state = models.abstract_model(cfg.replace(num_layers=layers))
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)

  def loss(state, tokens):
    return nnx.merge(graphdef, state)(tokens).astype(jnp.float32).mean()

  text = jax.jit(jax.grad(loss)).lower(state, tokens).as_text()
  return len(re.findall(r"stablehlo.dot_general", text))


def test_program_size_does_not_grow_with_depth():
  """What scan_layers is for: a 12-layer gradient holds the dots of a 2-layer one (the
  layer list unrolls, and compile time grows with depth)."""
  assert _dots(SCAN, 12) == _dots(SCAN, 2)
  assert _dots(CFG, 12) > 5 * _dots(CFG, 2) / 2


def test_hugging_face_files_are_the_same_from_either_layout(tmp_path, pair):
  """save_pretrained writes the same tensors from a scanned model; from_pretrained
  stacks them into a scanned model, on a mesh too."""
  from safetensors.numpy import load_file
  plain, scanned = pair
  models.save_pretrained(plain, str(tmp_path / "a"))
  models.save_pretrained(scanned, str(tmp_path / "b"))
  a = load_file(str(tmp_path / "a" / "model.safetensors"))
  b = load_file(str(tmp_path / "b" / "model.safetensors"))
  assert sorted(a) == sorted(b) and "model.layers.2.self_attn.q_proj.bias" in a
  assert "model.layers.2.self_attn.o_proj.bias" in a
  for name in a:
    np.testing.assert_array_equal(b[name], a[name], err_msg=name)
  loaded = models.from_pretrained(str(tmp_path / "a"), scan_layers=True)
  assert loaded.cfg.scan_layers
  for x, y in zip(jax.tree.leaves(_pure(loaded)), jax.tree.leaves(_pure(scanned)), strict=True):
    np.testing.assert_array_equal(x, y)
  mesh = models.make_mesh((1, 2, 4, 1))
  on_mesh = models.from_pretrained(str(tmp_path / "a"), scan_layers=True, mesh=mesh)
  k = on_mesh.layers.attn.k_proj[...]
  assert k.sharding.spec[:2] == (None, "fsdp")
  np.testing.assert_array_equal(np.asarray(k), np.asarray(scanned.layers.attn.k_proj[...]))


@pytest.mark.slow
@pytest.mark.parametrize("impl,shape", [("ring", (1, 2, 1, 4)), ("flash", (1, 2, 3, 1))])
def test_sharded_kernels_run_inside_the_scan(pair, impl, shape):
  """Ring attention (ppermute around the sequence axis) and per-shard flash attention
  (shard_map) inside the layer scan, on a mesh, with their gradients."""
  plain, _ = pair
  mesh = models.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])
  cfg = SCAN.replace(attention_impl=impl, attention_chunk=8)
  scanned = models.relayout(plain, scan_layers=True, mesh=mesh)
  graphdef, state = nnx.split(scanned)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))))
  tokens = _tokens(b=2, t=16)
  ctx = models.ShardingContext(mesh)

  def loss(state, m_graphdef):
    return jnp.mean(nnx.merge(m_graphdef, state)(tokens, ctx=ctx) ** 2)

  got, got_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)(state, graphdef)
  want, want_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)(
      state, nnx.graphdef(scanned))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
