"""LoRA adapters on the model: exact at init, the adapted function against a numpy merge,
folding and re-basing, both layer layouts, sharding and bad configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models

CFG = models.get_preset("tiny", num_layers=2, d_model=64, ffn_dim=96, num_heads=4,
                        num_kv_heads=2, head_dim=16, qkv_bias=True)
LORA = CFG.replace(lora_rank=4, lora_alpha=8.0)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 250, (2, 12)), jnp.int32)
logits = jax.jit(lambda m, t: m(t))


def randomise_adapters(model, seed=0):
  """Nonzero B (zero at init) so the adapters change the function."""
  rng = np.random.default_rng(seed)
  for path, v in nnx.iter_graph(model):
    if isinstance(v, nnx.LoRAParam):
      v[...] = jnp.asarray(rng.normal(0, 0.2, v.shape), v.dtype) if path[-1].endswith("_b") \
          else v[...]
  return model


def numpy_merged(model):
  """The adapted model's weights, W + alpha / r * A B, merged in numpy into a model
  without adapters (the oracle)."""
  cfg = model.cfg
  pure = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  for i in range(cfg.num_layers):
    layer = pure["layers"][i]
    for t in TARGETS:
      owner = layer["attn" if t in TARGETS[:4] else "mlp"]
      a, b = owner.pop(f"{t}_lora_a"), owner.pop(f"{t}_lora_b")
      w = owner[t]
      r = a.shape[-1]
      owner[t] = w + (a.reshape(-1, r) @ b.reshape(r, -1)).reshape(w.shape) * (8.0 / 4)
  plain = models.create_model(cfg.replace(lora_rank=0))
  state = nnx.state(plain)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(plain, state)
  return plain


@pytest.mark.slow
def test_new_adapters_change_nothing_and_leave_the_base_init_alone():
  base, adapted = models.create_model(CFG, seed=3), models.create_model(LORA, seed=3)
  np.testing.assert_array_equal(logits(base, TOKENS), logits(adapted, TOKENS))
  lora = nnx.state(adapted, nnx.LoRAParam)
  assert sum(x.size for x in jax.tree.leaves(lora)) == LORA.num_lora_params
  attn = adapted.layers[1].attn
  assert attn.q_proj_lora_a.shape == (64, 4) and attn.q_proj_lora_b.shape == (4, 4, 16)
  assert attn.o_proj_lora_a.shape == (4, 16, 4) and attn.o_proj_lora_b.shape == (4, 64)
  assert attn.q_proj_lora_b.get_metadata()["logical_axes"] == ("lora", "heads", "head_dim")
  assert float(jnp.abs(attn.q_proj_lora_a[...]).max()) > 0
  assert float(jnp.abs(attn.q_proj_lora_a[...]).max()) <= 1 / np.sqrt(64)  # PEFT's bound
  # The base weights are the model's without adapters, draw for draw.
  for x, y in zip(jax.tree.leaves(nnx.state(base, nnx.Param)),
                  jax.tree.leaves(nnx.split_state(nnx.state(adapted, nnx.Param),
                                                  nnx.LoRAParam, ...)[1]), strict=True):
    np.testing.assert_array_equal(x, y)


def test_adapted_function_equals_the_numpy_merge_in_both_layouts():
  model = randomise_adapters(models.create_model(LORA))
  want = logits(numpy_merged(model), TOKENS)
  got = logits(model, TOKENS)
  assert float(jnp.abs(got - logits(models.create_model(CFG), TOKENS)).max()) > 0.1
  np.testing.assert_allclose(got, want, atol=2e-5)
  np.testing.assert_allclose(logits(models.merge_lora(model), TOKENS), want, atol=2e-5)
  scanned = models.relayout(model, scan_layers=True)
  assert scanned.layers.attn.q_proj_lora_b.get_metadata()["logical_axes"][0] == "layers"
  np.testing.assert_allclose(logits(scanned, TOKENS), want, atol=2e-5)
  np.testing.assert_allclose(logits(models.merge_lora(scanned), TOKENS), want, atol=2e-5)


def test_fold_and_with_lora_keep_the_function_and_start_fresh_adapters():
  model = randomise_adapters(models.create_model(LORA))
  want = logits(model, TOKENS)
  for m in (model, models.relayout(model, scan_layers=True)):
    folded = models.fold_lora(m, jax.random.key(1))
    np.testing.assert_allclose(logits(folded, TOKENS), want, atol=2e-5)
    lora = nnx.to_pure_dict(nnx.state(folded, nnx.LoRAParam))
    b = [x for p, x in jax.tree_util.tree_leaves_with_path(lora)
         if jax.tree_util.keystr(p).endswith("_lora_b']")]
    assert len(b) == 7 * (1 if m.cfg.scan_layers else 2)
    assert all(np.abs(np.asarray(x)).max() == 0 for x in b)  # fresh adapters: B zero
    # Its base alone (adapters zeroed) is now the adapted policy: the KL reference of RL.
    base = nnx.merge(*nnx.split(folded, nnx.Param, ...)[:1],
                     models.without_lora(nnx.state(folded, nnx.Param)),
                     nnx.state(folded, nnx.Not(nnx.Param)))
    np.testing.assert_allclose(logits(base, TOKENS), want, atol=2e-5)
  other = models.with_lora(model, 2, jax.random.key(2), lora_targets="q_proj,down_proj")
  assert other.cfg.lora_target_names == ("q_proj", "down_proj")
  assert not hasattr(other.layers[0].attn, "k_proj_lora_a")
  assert other.layers[0].mlp.down_proj_lora_a.shape == (96, 2)
  np.testing.assert_allclose(logits(other, TOKENS), want, atol=2e-5)
  plain = models.with_lora(model, 0, None)
  assert plain.cfg.lora_rank == 0 and not nnx.state(plain, nnx.LoRAParam)


def test_adapters_shard_by_their_logical_axes():
  mesh = models.make_mesh((1, 2, 4, 1))
  model = models.create_model(LORA.replace(num_heads=8, num_kv_heads=4), mesh=mesh)
  attn, mlp = model.layers[0].attn, model.layers[0].mlp
  P = jax.sharding.PartitionSpec  # noqa: N806
  # The rank axis shards over fsdp wherever the adapter's other axis leaves it free.
  assert attn.q_proj_lora_b[...].sharding.spec == P("fsdp", "tensor", None)
  assert attn.q_proj_lora_a[...].sharding.spec == P("fsdp", None)
  assert mlp.down_proj_lora_a[...].sharding.spec == P("tensor", "fsdp")
  out = jax.jit(lambda m, t: m(t, ctx=models.ShardingContext(mesh)))(model, TOKENS)
  np.testing.assert_allclose(out, logits(model, TOKENS), atol=2e-5)


@pytest.mark.parametrize("overrides, match", [
    (dict(lora_rank=-1), "lora_rank must be an int >= 0"),
    (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha must be > 0"),
    (dict(lora_rank=4, lora_targets="q_proj,lm_head"), "lora_targets='q_proj,lm_head'"),
    (dict(lora_rank=4, lora_targets=" , "), "expected a comma-separated subset"),
])
def test_bad_lora_configs_are_one_line_errors(overrides, match):
  with pytest.raises(ValueError, match=match):
    CFG.replace(**overrides)
