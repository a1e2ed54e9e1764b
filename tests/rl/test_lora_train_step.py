"""The train step with LoRA adapters: only they move, the optimizer holds only theirs,
the KL reference is the base weights, and the layouts and meshes agree."""

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.rl import presets
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts
from tests.rl.test_train_step import CFG, microbatched, one_device_mesh, packed_rows

LORA = CFG.replace(num_layers=2, lora_rank=4, lora_alpha=8.0)
ALGO = presets.algorithm_config("grpo", kl_coef=0.5)


def optimizer():
  return state_lib.make_optimizer(3e-2, warmup=0, total_steps=10, weight_decay=0.01)


def adapters(params):
  return state_lib.split_trainable(params)[0]


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_lora_step_trains_only_the_adapters_against_the_base_as_reference():
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  model = models.create_model(LORA, mesh=mesh)
  state = state_lib.init_train_state(model, optimizer(), mesh=mesh)
  base = leaves(state_lib.split_trainable(state.params)[1])
  # AdamW's moments cover the adapters alone: 2 x their size, plus scalar counters.
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert moments == 2 * LORA.num_lora_params
  step = ts.make_train_step(LORA, ALGO, optimizer(), mesh=mesh, reference_in_step=True)
  batch = microbatched(packed_rows(0), 2)
  state, m0 = step(state, batch)
  assert float(m0["kl"]) == 0.0  # B starts at zero: the policy is its base
  before = leaves(adapters(state.params))
  state, m1 = step(state, batch)
  assert float(m1["kl"]) > 0
  assert all(not np.array_equal(a, b) for a, b in zip(before, leaves(adapters(state.params))))
  for a, b in zip(base, leaves(state_lib.split_trainable(state.params)[1]), strict=True):
    np.testing.assert_array_equal(a, b)  # the frozen base, bit for bit
  # In-step reference == the base's log-probs computed outside and passed in the batch.
  outside = ts.make_train_step(LORA, ALGO, optimizer(), mesh=mesh, donate=False)
  ref = ts.make_compute_logprobs(LORA, mesh=mesh)(models.without_lora(state.params), batch)
  copy = jax.tree.map(lambda x: x.copy(), state)
  s_in, m_in = step(copy, batch)
  s_out, m_out = outside(state, {**batch, "ref_logprobs": ref["logprobs"]})
  np.testing.assert_allclose(float(m_in["kl"]), float(m_out["kl"]), rtol=1e-5)
  for a, b in zip(leaves(adapters(s_in.params)), leaves(adapters(s_out.params)), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)
  with pytest.raises(ValueError, match="base weights, already in the state"):
    step(s_in, batch, s_in.params)


@pytest.mark.slow
def test_scanned_sharded_lora_step_equals_the_one_device_layer_list():
  batch = microbatched(packed_rows(1), 2)
  model = models.create_model(LORA)
  rng = np.random.default_rng(0)
  for _, v in nnx.iter_graph(model):  # nonzero B: gradients reach every adapter
    if isinstance(v, nnx.LoRAParam):
      v[...] = v[...] + rng.normal(0, 0.05, v.shape).astype(np.float32)
  runs = {}
  for name, mesh, scan in (("list", one_device_mesh(), False),
                           ("scan", models.make_mesh((1, 4, 2, 1)), True)):
    m = models.relayout(model, scan_layers=scan, mesh=mesh)
    state = state_lib.init_train_state(m, optimizer(), mesh=mesh)
    step = ts.make_train_step(m.cfg, ALGO, optimizer(), mesh=mesh, reference_in_step=True)
    for _ in range(2):
      state, metrics = step(state, batch)
    params = models.relayout(nnx.merge(nnx.graphdef(m), state.params),
                             scan_layers=False) if scan else nnx.merge(nnx.graphdef(m),
                                                                       state.params)
    runs[name] = (nnx.to_pure_dict(nnx.state(params, nnx.LoRAParam)), float(metrics["loss"]))
  np.testing.assert_allclose(runs["scan"][1], runs["list"][1], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(runs["scan"][0]), jax.tree.leaves(runs["list"][0]),
                  strict=True):
    np.testing.assert_allclose(a, b, atol=2e-5)


def _model_of(params):
  """The LoRA model of `params` (as the trainer merges its state)."""
  graphdef, _, rest = ts._split_abstract(LORA)
  return nnx.merge(graphdef, params, rest)


def test_a_sampler_shares_the_base_the_step_hands_back():
  """The step donates the state and hands the frozen base back unchanged as new arrays:
  a colocated sampler holding the base uncopied takes them (`Sampler.reshare`) and
  samples after the updates as a sampler with its own copy of the same weights does;
  given deleted ones it refuses."""
  from posttrain.sampling import Sampler
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  state = state_lib.init_train_state(models.create_model(LORA, mesh=mesh), optimizer(),
                                     mesh=mesh)
  base = jax.tree.leaves(state_lib.split_trainable(state.params)[1])
  shared = Sampler(_model_of(state.params), mesh=mesh, max_len=32, gather_weights=False,
                   share=state_lib.split_trainable(state.params)[1])
  held = jax.tree.leaves(shared._state)
  assert shared.shares_weights
  assert sum(any(x is b for b in base) for x in held) == len(base)  # no copy of the base
  step = ts.make_train_step(LORA, ALGO, optimizer(), mesh=mesh, reference_in_step=True)
  batch = microbatched(packed_rows(0), 2)
  for i in range(2):
    old = state.params
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    after = jax.tree.leaves(state_lib.split_trainable(state.params)[1])
    assert all(x.is_deleted() for x in jax.tree.leaves(old))  # donated, the base too
    if i == 0:
      with pytest.raises(ValueError, match="was deleted"):
        shared.reshare(old)  # the donated arrays: deleted, nowhere else
    shared.reshare(state.params)
    assert sum(any(x is a for a in after) for x in jax.tree.leaves(shared._state)) == len(base)
  shared.update_params(state.params, share=state_lib.split_trainable(state.params)[1])
  own = Sampler(_model_of(state.params), mesh=mesh, max_len=32, gather_weights=False)
  assert not own.shares_weights
  prompts = [[5, 9, 2, 7], [11, 3]]
  got = shared.generate(prompts, max_new_tokens=6, temperature=0.0)
  want = own.generate(prompts, max_new_tokens=6, temperature=0.0)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)
