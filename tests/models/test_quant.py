"""A frozen base held quantized (QLoRA): the codes against a numpy oracle, the model against
one holding the dequantized weights, the train step, checkpoints, the sampler, Hugging
Face folders in and out, and the refusals."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import quant
from tests.models.test_lora import randomise_adapters

CFG = models.get_preset("tiny", num_layers=2, d_model=64, ffn_dim=96, num_heads=4,
                        num_kv_heads=2, head_dim=16, qkv_bias=True, lora_rank=4,
                        lora_alpha=8.0)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 250, (2, 12)), jnp.int32)
logits = jax.jit(lambda m, t: m(t))


def oracle(w, kind, block, axis):
  """Each block's scale (its absolute maximum, / 127 for int8, rounded to bfloat16) and
  each value's code, in numpy, with the block axis moved last: round to nearest for
  int8, the nearest NF4 level (by distance, ties to the lower) for nf4."""
  x = np.moveaxis(w.astype(np.float32), axis, -1)
  *lead, n = x.shape
  x = x.reshape(*lead, n // block, block)
  top = np.abs(x).max(-1)
  scale = (top / 127 if kind == "int8" else top).astype(ml_dtypes.bfloat16).astype(np.float32)
  y = x / np.where(scale == 0, 1, scale)[..., None]
  if kind == "int8":
    codes = np.clip(np.rint(y), -127, 127)
    levels = codes
  else:
    codes = np.abs(y[..., None] - quant.NF4_LEVELS).argmin(-1)
    levels = quant.NF4_LEVELS[codes]
  got = (levels * scale[..., None]).reshape(*lead, n)
  return np.moveaxis(got, -1, axis), np.moveaxis(scale, -1, axis)


@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_bfloat16_weights_dequantize_alike_on_host_and_device(kind, dtype):
  """In the weights' own dtype, the product of level and scale rounded once: the device's
  dequantization (what the layers read) is the host's (what exports write)."""
  w = (np.random.default_rng(2).standard_t(3, (48, 256)) * 0.05).astype(dtype)
  q = quant.quantize(w, kind)
  device = quant.dequantize(jax.tree.map(jnp.asarray, q))
  assert device.dtype == dtype
  np.testing.assert_array_equal(np.asarray(device), quant.dequantize_numpy(q))
  err = np.abs(np.asarray(device, np.float32) - w.astype(np.float32)).mean()
  assert err / np.abs(w.astype(np.float32)).mean() < (0.02 if kind == "int8" else 0.15)


@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("shape,axis,block,width", [
    ((64, 96), -1, 64, 48), ((3, 40, 20), -1, 64, 20), ((5, 130), -1, 64, 26),
    ((4, 256), -1, 64, 64), ((96, 64), -2, 64, 48), ((2, 40, 6, 8), -3, 64, 40),
    ((130, 4), -2, 64, 26)])
def test_codes_match_the_numpy_oracle_on_host_and_device(kind, shape, axis, block, width):
  rng = np.random.default_rng(1)
  w = (rng.standard_t(3, shape) * 0.05).astype(np.float32)  # heavy tails: outliers
  first = np.moveaxis(w, axis, -1)  # a view: one block of zeros (scale 0, codes of 0)
  first[(0,) * (first.ndim - 1)][:width] = 0
  w.reshape(-1)[-1] = 0.75
  host = quant.quantize(w, kind, block, axis=axis)
  device = quant.quantize(jnp.asarray(w), kind, block, axis=axis)
  assert host.block == width and host.shape == shape and host.dtype == np.float32
  assert host.values.dtype == (np.int8 if kind == "int8" else np.uint8)
  k = len(shape) + axis
  packed = (*shape[:k], shape[k] // (2 if kind == "nf4" else 1), *shape[k + 1:])
  assert host.values.shape == packed  # nf4: two codes a byte along the block axis
  assert host.scales.shape == (*shape[:k], shape[k] // width, *shape[k + 1:])
  assert host.scales.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(np.asarray(device.values), host.values)
  np.testing.assert_array_equal(np.asarray(device.scales), host.scales)
  want, scale = oracle(w, kind, width, axis)
  got = quant.dequantize_numpy(host)
  np.testing.assert_array_equal(np.asarray(host.scales).astype(np.float32), scale)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  np.testing.assert_array_equal(np.asarray(quant.dequantize(device)), got)
  assert not np.moveaxis(got, axis, -1)[(0,) * (len(shape) - 1)][:width].any()
  # Within half a step of the weight: int8's step is the scale, nf4's widest gap 0.33.
  step = np.repeat(scale, width, axis=axis)
  bound = step * (0.5 if kind == "int8" else 0.17) * 1.01 + 1e-12
  assert (np.abs(got - w) <= bound).all()
  # The largest value of a block is exact (nf4's level 1, int8's 127 to bfloat16's rounding).
  assert abs(got.reshape(-1)[-1] - 0.75) < (0.75 / 127 if kind == "int8" else 1e-6) + 3e-3


def test_bad_quantization_configs_are_one_line_errors():
  with pytest.raises(ValueError, match="base_quantization must be 'int8', 'nf4'"):
    CFG.replace(base_quantization="fp4")
  with pytest.raises(ValueError, match="set lora_rank > 0"):
    CFG.replace(lora_rank=0, base_quantization="nf4")
  with pytest.raises(ValueError, match="base_quantization_block must be an int >= 2"):
    CFG.replace(base_quantization="int8", base_quantization_block=1)
  with pytest.raises(ValueError, match="two values a byte along axis -2: it must be even"):
    quant.quantize(np.ones((5, 4), np.float32), "nf4", axis=-2)
  with pytest.raises(ValueError, match="one of \\('int8', 'nf4'\\)"):
    quant.quantize(np.ones((4, 4), np.float32), "int4")
  with pytest.raises(ValueError, match="axis=-3 is not a negative axis"):
    quant.quantize(np.ones((4, 4), np.float32), "int8", axis=-3)


def dequantized_plain(model):
  """A model of the same config without quantization whose base weights are `model`'s
  dequantized (the oracle of the quantized forward)."""
  pure = jax.tree.map(np.asarray, quant.map_quantized(quant.dequantize_numpy,
                                                      nnx.to_pure_dict(nnx.state(model))))
  plain = models.create_model(model.cfg.replace(base_quantization=""))
  state = nnx.state(plain)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(plain, state)
  return plain


@pytest.mark.parametrize("kind", quant.KINDS)
def test_the_quantized_model_computes_with_its_dequantized_weights(kind):
  base = randomise_adapters(models.create_model(CFG, seed=2))
  model = randomise_adapters(models.create_model(CFG.replace(base_quantization=kind), seed=2))
  held = {"/".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(model))
          if isinstance(v, quant.QuantizedParam)}
  # Every projection of the layers, nothing else (norms, biases, embeddings, head).
  assert held == {f"layers/{i}/{m}/{n}" for i in range(2) for m, n in [
      ("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
      ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")]}
  # The adapters, embeddings and norms are the unquantized model's, draw for draw.
  for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(base)),
                            nnx.to_flat_state(nnx.state(model)), strict=True):
    if not isinstance(b, quant.QuantizedParam):
      np.testing.assert_array_equal(a[...], b[...], err_msg=str(p))
  want = logits(dequantized_plain(model), TOKENS)
  got = logits(model, TOKENS)
  np.testing.assert_allclose(got, want, atol=2e-5)
  full = logits(base, TOKENS)
  err = float(jnp.abs(got - full).max()) / float(jnp.abs(full).max())
  assert 0 < err < (0.01 if kind == "int8" else 0.15)
  merged = models.merge_lora(model)  # export's path: the base dequantized, adapters in
  assert merged.cfg.base_quantization == "" and not merged.cfg.lora_rank
  np.testing.assert_allclose(logits(merged, TOKENS), want, atol=2e-5)
  scanned = models.relayout(model, scan_layers=True)
  assert isinstance(scanned.layers.mlp.up_proj, quant.QuantizedParam)
  np.testing.assert_allclose(logits(scanned, TOKENS), want, atol=2e-5)
  # A projection takes (4 or 8 bits + 16 / block) / 16 of its bfloat16 bytes: at block
  # 64, 0.27x (nf4) or 0.52x (int8). Blocks run along D (q, k, v, gate, up: 64), F (down:
  # 96, blocks of 48) and the heads (o_proj: 4).
  q = [v.get_raw_value() for v in jax.tree.leaves(nnx.state(scanned), is_leaf=lambda x:
                                                   isinstance(x, quant.QuantizedParam))
       if isinstance(v, quant.QuantizedParam)]
  assert sorted({x.block for x in q}) == [4, 48, 64]
  bits = 4 if kind == "nf4" else 8
  assert sum(x.nbytes for x in q) == sum(x.size * (bits + 16 / x.block) / 8 for x in q)


def test_adapters_cannot_fold_into_a_quantized_base():
  model = models.create_model(CFG.replace(base_quantization="nf4"))
  with pytest.raises(ValueError, match="cannot be folded into a quantized base"):
    models.fold_lora(model, jax.random.key(0))
  with pytest.raises(ValueError, match="cannot be folded into a quantized base"):
    models.with_lora(model, 8, jax.random.key(0))
  # A base without adapters takes fresh ones over its quantized projections.
  plain = models.create_model(CFG.replace(lora_rank=0), seed=5)
  fresh = models.with_lora(plain, 4, jax.random.key(0), base_quantization="int8")
  assert isinstance(fresh.layers[0].mlp.down_proj, quant.QuantizedParam)
  ref = models.create_model(CFG.replace(base_quantization="int8"), seed=5)
  np.testing.assert_array_equal(fresh.layers[1].attn.o_proj.get_value().values,
                                ref.layers[1].attn.o_proj.get_value().values)


def _moe(kind):
  """A mixture (4 experts of 40, adapters on q_proj and on every expert) with its base
  quantized and nonzero adapters."""
  from tests.models.test_expert_lora import CFG as MOE, _randomised
  return _randomised(models.create_model(
      MOE.replace(num_experts=4, base_quantization=kind), seed=1))


def _loss_and_adapter_grads(model, mesh=None, rules=models.DEFAULT_RULES):
  """(loss, logits, the adapters' gradients) of a next-token loss: the base, quantized,
  is not differentiated."""
  if mesh is not None:
    model = models.shard_model(model, mesh, rules)
  graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
  ctx = models.ShardingContext(mesh, rules)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 263, (4, 13)), jnp.int32)

  def loss_fn(lora):
    out = nnx.merge(graphdef, lora, base)(tokens, ctx=ctx)
    logp = jax.nn.log_softmax(out[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean(), out

  (loss, out), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(lora)
  return loss, out, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_quantized_experts_run_split_over_a_mesh_as_on_one_device(kind):
  """The routed experts' codes split over fsdp (expert parallelism) and their F over
  tensor: loss, logits and every adapter's gradient are one device's."""
  from tests.models.test_expert_parallel import _rules
  model = _moe(kind)
  experts = model.layers[0].mlp.gate_proj
  assert isinstance(experts, quant.QuantizedParam) and experts.shape == (4, 48, 40)
  want = _loss_and_adapter_grads(model)
  mesh = models.make_mesh((1, 4, 2, 1))
  got = _loss_and_adapter_grads(model, mesh, _rules("fsdp"))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  np.testing.assert_allclose(got[1], want[1], atol=2e-5)
  for (path, b), a in zip(jax.tree_util.tree_flatten_with_path(want[2])[0],
                          jax.tree.leaves(got[2]), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(want[2])) > 0


def test_the_sampler_samples_a_quantized_base_as_one_device_does():
  """Over a mesh with the experts split over fsdp, the sampler keeps the experts' codes
  split on E and unpadded, and samples what one device does (and what the merged,
  dequantized model does)."""
  from posttrain.sampling import Sampler
  from tests.models.test_expert_parallel import _rules
  model = _moe("nf4")
  prompts = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 37)), [3, 3, 3, 8]]
  sampler = Sampler(model, mesh=models.make_mesh((1, 4, 2, 1)), rules=_rules("fsdp"),
                    max_len=40)
  codes = sampler._weights()["layers"][0]["mlp"]["gate_proj"].get_value()
  assert isinstance(codes, quant.QArray) and codes.values.shape == (4, 24, 40)  # D packed
  assert codes.values.sharding.spec[0] == codes.scales.sharding.spec[0] == "fsdp"
  # Weights left sharded over the batch axes: each decode step gathers the codes.
  sharded = Sampler(model, mesh=models.make_mesh((1, 4, 2, 1)), rules=_rules("fsdp"),
                    max_len=40, gather_weights=False)
  one = Sampler(model, max_len=40)
  merged = Sampler(models.merge_lora(model), max_len=40)
  for temperature in (0.0, 1.0):
    want = one.generate(prompts, max_new_tokens=8, temperature=temperature, seed=3)
    for s in (sampler, sharded):
      got = s.generate(prompts, max_new_tokens=8, temperature=temperature, seed=3)
      np.testing.assert_array_equal(got.tokens, want.tokens)
      np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
    plain = merged.generate(prompts, max_new_tokens=8, temperature=temperature, seed=3)
    np.testing.assert_array_equal(plain.tokens, want.tokens)
    np.testing.assert_allclose(plain.logprobs, want.logprobs, atol=1e-4)


def test_the_train_step_moves_the_adapters_over_a_base_it_never_changes(tmp_path):
  """A sharded GRPO step with the in-step KL reference (the quantized base, adapters
  off): the adapters move, the codes and scales come back bit for bit, the optimizer
  holds the adapters' moments alone, and a checkpoint restores the state exactly."""
  from posttrain.checkpoint import CheckpointManager
  from posttrain.rl import presets
  from posttrain.rl import state as state_lib
  from posttrain.rl import train_step as ts
  from tests.rl.test_train_step import CFG as STEP_CFG, microbatched, packed_rows
  cfg = STEP_CFG.replace(num_layers=2, lora_rank=4, lora_alpha=8.0, scan_layers=True,
                         base_quantization="nf4")
  opt = lambda: state_lib.make_optimizer(3e-2, warmup=0, total_steps=10)  # noqa: E731
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  state = state_lib.init_train_state(models.create_model(cfg, mesh=mesh), opt(), mesh=mesh)
  frozen = state_lib.split_trainable(state.params)[1]
  codes = [x for x in jax.tree.leaves(frozen) if x.dtype == np.uint8]
  assert len(codes) == 7 and any(x.sharding.spec != (None,) * x.ndim for x in codes)
  base = [np.asarray(x) for x in jax.tree.leaves(frozen)]
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert moments == 2 * cfg.num_lora_params
  step = ts.make_train_step(cfg, presets.algorithm_config("grpo", kl_coef=0.5), opt(),
                            mesh=mesh, reference_in_step=True)
  batch = microbatched(packed_rows(0), 2)
  adapters = [np.asarray(x) for x in jax.tree.leaves(state_lib.split_trainable(state.params)[0])]
  for _ in range(2):
    state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["kl"]) > 0
  after = jax.tree.leaves(state_lib.split_trainable(state.params)[0])
  assert all(not np.array_equal(a, b) for a, b in zip(adapters, after) if a.any() or b.any())
  for a, b in zip(base, jax.tree.leaves(state_lib.split_trainable(state.params)[1]),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  with CheckpointManager(str(tmp_path)) as ckpt:
    ckpt.save(2, state, {"step": 2}, force=True)
    ckpt.wait()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), state)
    restored, extras, at = ckpt.restore(abstract)
  assert at == 2 and extras == {"step": 2}
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    assert a.dtype == b.dtype and a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)


def assert_same_codes(read, want, mesh) -> int:
  """`read`'s quantized weights (laid out on `mesh`) hold `want`'s codes and scales, bit
  for bit; returns how many there are."""
  flat = dict(nnx.to_flat_state(nnx.state(want)))
  held = 0
  for path, v in nnx.to_flat_state(nnx.state(read)):
    if isinstance(v, quant.QuantizedParam):
      held += 1
      got, ref = v.get_value(), flat[path].get_value()
      assert got.values.sharding.mesh.shape == mesh.shape
      np.testing.assert_array_equal(got.values, ref.values, err_msg=str(path))
      np.testing.assert_array_equal(got.scales, ref.scales, err_msg=str(path))
  return held


@pytest.mark.parametrize("scan", [False, True])
def test_a_folder_is_quantized_as_it_is_read_and_exports_dequantized(scan, tmp_path):
  """from_pretrained(..., base_quantization=) quantizes each tensor as it reads it (on a
  mesh, stacked or not): the same codes as quantizing the whole model after a plain
  read. The merged export is a plain folder of the dequantized base plus the adapters,
  and a PEFT adapter folder from the run loads back onto a quantized base."""
  from tests.models.test_expert_lora import CFG as MOE
  folder, out, adapter = (str(tmp_path / n) for n in ("base", "out", "adapter"))
  models.save_pretrained(models.create_model(MOE.replace(num_experts=4, lora_rank=0), seed=4),
                         folder)
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  lora = dict(lora_rank=3, lora_alpha=6.0, lora_targets=MOE.lora_targets, scan_layers=scan)
  read = models.from_pretrained(folder, mesh=mesh, base_quantization="int8", **lora)
  plain = models.from_pretrained(folder, **lora)
  want = models.with_lora(models.merge_lora(plain), 3, jax.random.key(0),
                          base_quantization="int8", lora_alpha=6.0,
                          lora_targets=MOE.lora_targets)
  held = assert_same_codes(read, want, mesh)
  assert held == (1 if scan else 2) * 7  # a layer's attention 4, its experts 3
  read = randomise_adapters(read)
  models.save_pretrained(read, out)
  back = models.from_pretrained(out)
  assert back.cfg.base_quantization == "" and not back.cfg.lora_rank
  np.testing.assert_allclose(logits(back, TOKENS), logits(read, TOKENS), atol=2e-5)
  models.save_lora_adapter(read, adapter)
  again = models.from_pretrained(folder, adapter=adapter, base_quantization="int8",
                                 scan_layers=scan)
  np.testing.assert_allclose(logits(again, TOKENS), logits(read, TOKENS), atol=2e-5)
