"""The jitted RL train step: exact micro-batch accumulation, sharding, safety, learning."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kernels
from posttrain import models
from posttrain.rl import advantages as advantages_lib
from posttrain.rl import losses, packing, presets
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts

ROW_LEN = 24
CFG = models.get_preset("tiny", num_layers=1, ffn_dim=128, logprob_chunk=8)
CRITIC_CFG = CFG.replace(value_head=True)


def one_device_mesh():
  return models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])


def snapshot(tree):
  return [np.array(x) for x in jax.tree.leaves(tree)]


def assert_trees_close(a, b, atol, rtol=0.0):
  for x, y in zip(snapshot(a), snapshot(b), strict=True):
    np.testing.assert_allclose(x, y, atol=atol, rtol=rtol)


def packed_rows(seed, num_seqs=16, vocab=CFG.vocab_size, rows=8):
  """Random trajectories packed into `rows` rows of ROW_LEN (several sequences per row)."""
  rng = np.random.default_rng(seed)
  trajectories = []
  for _ in range(num_seqs):
    prompt = rng.integers(1, vocab, rng.integers(2, 6))
    response = rng.integers(1, vocab, rng.integers(2, 8))
    trajectories.append(dict(
        prompt_tokens=prompt, response_tokens=response,
        response_mask=rng.random(len(response)) < 0.85,
        behaviour_logprobs=-rng.uniform(1.0, 8.0, len(response)),
        advantages=rng.normal(),
        rewards=rng.normal()))
  return packing.pack_trajectories(trajectories, ROW_LEN, num_rows=rows)


def microbatched(rows, num_micro):
  budget = ROW_LEN * len(rows["tokens"]) // num_micro
  return packing.split_microbatches(rows, budget, num_microbatches=num_micro)


@functools.cache
def compute_logprobs_for(cfg, mesh):
  """One jitted `make_compute_logprobs` per (config, mesh): a test that asks for the same
  log-probs again reuses the program instead of tracing and compiling it again."""
  return ts.make_compute_logprobs(cfg, mesh=mesh)


def add_learner_logprobs(batch, params, cfg, mesh, seed):
  """old / ref log-probs near the current ones, so ratios and KL are non-trivial."""
  out = compute_logprobs_for(cfg, mesh)(params, batch)
  rng = np.random.default_rng(seed)
  logprobs = np.asarray(out["logprobs"])
  batch = dict(batch)
  batch["old_logprobs"] = logprobs + rng.normal(0, 0.3, logprobs.shape).astype(np.float32)
  batch["ref_logprobs"] = logprobs + rng.normal(0, 0.3, logprobs.shape).astype(np.float32)
  if "values" in out:
    values = np.asarray(out["values"])
    batch["old_values"] = values + rng.normal(0, 0.1, values.shape).astype(np.float32)
    batch["returns"] = rng.normal(size=values.shape).astype(np.float32)
  return batch


def assert_one_batch_update(step, init, whole, split):
  """`step` on the batch as one micro-batch and as `split` updates the trainable params
  alike (and moves them) with the same metrics; returns the one-batch metrics."""
  state_1, metrics_1 = step(state_lib.frozen_copy(init), whole)
  state_4, metrics_4 = step(state_lib.frozen_copy(init), split)
  trainable = lambda s: (s.params, s.critic_params)  # noqa: E731
  # In numpy: eager jnp would compile a subtraction per parameter shape.
  delta_1 = jax.tree.map(np.subtract, trainable(state_1), trainable(init))
  delta_4 = jax.tree.map(np.subtract, trainable(state_4), trainable(init))
  assert min(np.max(np.abs(x)) for x in jax.tree.leaves(delta_1)) > 1e-6
  assert_trees_close(delta_4, delta_1, atol=1e-5)
  assert set(metrics_4) == set(metrics_1)
  for name in metrics_1:
    np.testing.assert_allclose(metrics_4[name], metrics_1[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  return metrics_1


def fresh_state(cfg, optimizer, mesh, seed=0):
  return state_lib.init_train_state(models.create_model(cfg, seed=seed), optimizer, mesh=mesh)


ALGOS = {  # name: (preset, overrides, policy config, separate critic config)
    # seq_mean_token_mean + k3 KL loss, plus TIS and dual clip to cover those terms.
    "grpo": ("grpo", dict(tis_cap=2.0, dual_clip=3.0), CFG, None),
    "dr_grpo": ("dr_grpo", dict(max_response_len=12, kl_coef=0.1), CFG, None),
    "gspo": ("gspo", dict(kl_coef=0.1, entropy_coef=0.01), CFG, None),
    "ppo": ("ppo", {}, CRITIC_CFG, None),  # token_mean, value head.
    "ppo_separate_critic": ("ppo", {}, CFG, CRITIC_CFG),
    "cispo": ("cispo", dict(eps_high=0.1), CFG, None),
    "gmpo": ("gmpo", dict(eps_low=0.1, eps_high=0.1), CFG, None),
    # Stiff gates, so the step's ratios close some of them.
    "sapo": ("sapo", dict(sapo_tau_pos=4.0, sapo_tau_neg=8.0), CFG, None),
}


@pytest.mark.parametrize("algorithm", [
    "grpo", "ppo",
    # Covered by the same weighting code as the two above; out of the default run for time.
    pytest.param("dr_grpo", marks=pytest.mark.slow),
    pytest.param("gspo", marks=pytest.mark.slow),
    pytest.param("ppo_separate_critic", marks=pytest.mark.slow),
    pytest.param("cispo", marks=pytest.mark.slow),
    pytest.param("gmpo", marks=pytest.mark.slow),
    "sapo",
])
def test_four_microbatches_give_the_one_batch_update(algorithm):
  preset, overrides, cfg, critic_cfg = ALGOS[algorithm]
  algo = presets.algorithm_config(preset, **overrides)
  mesh = one_device_mesh()
  # SGD with rate 1: the parameter change is the gradient itself, so this compares
  # gradients directly (Adam's first step would hide them behind g / |g|).
  optimizer = optax.sgd(1.0)
  step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh, critic_cfg=critic_cfg)
  critic = None if critic_cfg is None else models.create_model(critic_cfg, seed=1)
  init = state_lib.init_train_state(models.create_model(cfg), optimizer, mesh=mesh, critic=critic)
  rows = packed_rows(0)
  whole = add_learner_logprobs(microbatched(rows, 1), init.params, cfg, mesh, seed=1)
  if critic_cfg is not None:
    values = add_learner_logprobs(microbatched(rows, 1), init.critic_params, critic_cfg, mesh,
                                  seed=2)
    whole.update(old_values=values["old_values"], returns=values["returns"])
  split = {k: v.reshape((4, -1) + v.shape[2:]) for k, v in whole.items()}

  metrics_1 = assert_one_batch_update(step, init, whole, split)
  assert float(metrics_1["clip_fraction/low"]) + float(metrics_1["clip_fraction/high"]) > 0


def _cov_oracle_selection(adv, logp, mask, fraction):
  """kl_cov's tokens in numpy: the top max(1, floor(fraction n)) centred cross-products."""
  a, lp = adv.astype(np.float64), logp.astype(np.float64)
  cov = np.where(mask, (a - a[mask].mean()) * (lp - lp[mask].mean()), -np.inf)
  k = max(1, int(fraction * mask.sum()))
  selected = np.zeros(mask.shape, bool)
  selected.flat[np.argsort(-cov, axis=None, kind="stable")[:k]] = True
  return selected


@pytest.mark.parametrize("policy_loss", ["kl_cov", "clip_cov"])
def test_covariance_step_selects_over_the_whole_batch_and_splits_exactly(policy_loss):
  """The step picks its tokens from the whole batch's old log-probs and advantages before
  the micro-batches run: four micro-batches make the one-batch update, and the loss is the
  oracle's on the model's own log-probs (clip_cov: drawn with the step's key)."""
  fraction = 0.1
  algo = presets.algorithm_config(policy_loss, cov_fraction=fraction, clip_cov_lb=0.01,
                                  clip_cov_ub=100.0, kl_cov_coef=0.5, num_minibatches=1)
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  step = ts.make_train_step(CFG, algo, optimizer, mesh=mesh)
  assert "old_logprobs" in step.required
  init = fresh_state(CFG, optimizer, mesh)
  whole = add_learner_logprobs(microbatched(packed_rows(7), 1), init.params, CFG, mesh, seed=3)
  del whole["ref_logprobs"]
  split = {k: v.reshape((4, -1) + v.shape[2:]) for k, v in whole.items()}
  state_4, metrics_4 = step(state_lib.frozen_copy(init), split)
  delta_4 = jax.tree.map(np.subtract, state_4.params, init.params)
  assert min(np.max(np.abs(x)) for x in jax.tree.leaves(delta_4)) > 1e-6
  if policy_loss == "kl_cov":  # the same selection path for both: one of them compiles both
    state_1, metrics_1 = step(state_lib.frozen_copy(init), whole)
    delta_1 = jax.tree.map(np.subtract, state_1.params, init.params)
    assert_trees_close(delta_4, delta_1, atol=1e-5)
    for name in metrics_1:
      np.testing.assert_allclose(metrics_4[name], metrics_1[name], rtol=1e-5, atol=1e-6,
                                 err_msg=name)

  mask = np.asarray(whole["loss_mask"])[0] != 0
  adv, old = np.asarray(whole["advantages"])[0], np.asarray(whole["old_logprobs"])[0]
  logp = np.asarray(ts.make_compute_logprobs(CFG, mesh=mesh)(init.params, whole)["logprobs"])[0]
  log_r = logp.astype(np.float64) - old
  ratio = np.exp(log_r)
  if policy_loss == "kl_cov":
    selected = _cov_oracle_selection(adv, old, mask, fraction)
    per_token = -adv * ratio + np.where(selected, 0.5 * np.abs(log_r), 0.0)
  else:  # the draw of the step's own key: fold_in(rng, step)
    selected = np.asarray(losses.covariance_selection(
        adv, old, mask, mode="clip_cov", fraction=fraction, lower=0.01, upper=100.0,
        key=jax.random.fold_in(init.rng, init.step)))
    assert selected.sum() == max(1, int(fraction * mask.sum()))
    per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
    per_token = np.where(selected, 0.0, per_token)
  # Over the whole batch: a selection per micro-batch would pick other tokens.
  np.testing.assert_allclose(metrics_4["cov/selected_fraction"], selected.sum() / mask.sum(),
                             rtol=1e-6)
  np.testing.assert_allclose(metrics_4["loss"], per_token[mask].sum() / mask.sum(), rtol=1e-4)
  with pytest.raises(ValueError, match="old_logprobs"):
    step(state_lib.frozen_copy(init), {k: v for k, v in whole.items() if k != "old_logprobs"})


TEMPERATURE = 0.7


@functools.cache
def compute_with_entropy_for(cfg, mesh, temperature=TEMPERATURE):
  return ts.make_compute_logprobs(cfg, mesh=mesh, temperature=temperature, with_entropy=True)


def test_compute_logprobs_with_entropy_is_the_tempered_softmax_entropy():
  """with_entropy=True: each target position's entropy of softmax(logits / temperature), and
  the same log-probs, from one pass; the default returns no entropies."""
  mesh = one_device_mesh()
  model = models.create_model(CFG, seed=0)
  params = fresh_state(CFG, optax.sgd(1.0), mesh, seed=0).params
  batch = microbatched(packed_rows(5), 2)
  out = compute_with_entropy_for(CFG, mesh)(params, batch)
  assert set(out) == {"logprobs", "entropies"}
  for m in range(2):
    logits = np.asarray(model(batch["tokens"][m], batch["positions"][m],
                              batch["segment_ids"][m]), np.float64) / TEMPERATURE
    log_softmax = logits - logits.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    entropies = -np.sum(np.exp(log_softmax) * log_softmax, axis=-1)
    logprobs = np.take_along_axis(log_softmax, batch["targets"][m][..., None], -1)[..., 0]
    np.testing.assert_allclose(out["entropies"][m], entropies, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["logprobs"][m], logprobs, rtol=1e-4, atol=1e-5)
  assert np.ptp(np.asarray(out["entropies"])) > 0.01  # positions differ
  assert "entropies" not in compute_logprobs_for(CFG, mesh)(params, batch)


def test_high_entropy_step_selects_over_the_whole_batch_and_splits_exactly():
  """top_entropy_fraction: the step keeps the policy loss of the whole batch's top tokens by
  their entropy before the update: four micro-batches make the one-batch update, and the
  loss is the oracle's on the model's own log-probs."""
  fraction = 0.3
  algo = presets.algorithm_config("grpo", top_entropy_fraction=fraction, kl_coef=0.0,
                                  loss_agg_mode="token_mean")
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  step = ts.make_train_step(CFG, algo, optimizer, mesh=mesh, temperature=TEMPERATURE)
  assert "old_entropies" in step.required
  init = fresh_state(CFG, optimizer, mesh)
  whole = add_learner_logprobs(microbatched(packed_rows(8), 1), init.params, CFG, mesh, seed=5)
  del whole["ref_logprobs"]
  current = compute_with_entropy_for(CFG, mesh)(init.params, whole)
  whole["old_entropies"] = np.asarray(current["entropies"])
  split = {k: v.reshape((4, -1) + v.shape[2:]) for k, v in whole.items()}
  metrics_1 = assert_one_batch_update(step, init, whole, split)

  mask = np.asarray(whole["loss_mask"])[0] != 0
  adv, old = np.asarray(whole["advantages"])[0], np.asarray(whole["old_logprobs"])[0]
  entropies = whole["old_entropies"][0]
  k = max(1, int(np.ceil(fraction * mask.sum() - 1e-9)))
  order = np.argsort(-np.where(mask, entropies, -np.inf), axis=None, kind="stable")[:k]
  selected = np.zeros(mask.shape, bool)
  selected.flat[order] = True
  ratio = np.exp(np.asarray(current["logprobs"])[0].astype(np.float64) - old)
  per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
  # The policy term on the selected tokens over every trained token (a selection per
  # micro-batch would pick other tokens, a normaliser of the selected ones differ).
  np.testing.assert_allclose(metrics_1["loss"], per_token[selected].sum() / mask.sum(),
                             rtol=1e-4)
  np.testing.assert_allclose(metrics_1["entropy/selected_fraction"], k / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(metrics_1["entropy/threshold"], entropies[selected].min(),
                             rtol=1e-6)
  np.testing.assert_allclose(metrics_1["entropy"], entropies[mask].mean(), rtol=1e-4)
  with pytest.raises(ValueError, match=r"^top_entropy_fraction=0.3 selects tokens by "
                     r"batch\['old_entropies'\][^\n]*$"):
    step(state_lib.frozen_copy(init), {k: v for k, v in whole.items() if k != "old_entropies"})

@pytest.mark.parametrize("remat", ["full", "dots"])
def test_rematerialised_model_gives_the_same_microbatched_step(remat):
  """remat inside the scan over micro-batches (log-probs and the update) computes what
  the plain model computes."""
  algo = presets.algorithm_config("grpo")
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  init = fresh_state(CFG, optimizer, mesh)
  batch = add_learner_logprobs(microbatched(packed_rows(3), 2), init.params, CFG, mesh,
                               seed=4)
  results = []
  for cfg in (CFG, CFG.replace(remat=remat)):
    logprobs = ts.make_compute_logprobs(cfg, mesh=mesh)(init.params, batch)["logprobs"]
    step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh)
    new_state, _ = step(state_lib.frozen_copy(init), batch)
    results.append((logprobs, new_state.params))
  np.testing.assert_allclose(results[1][0], results[0][0], atol=1e-5)
  assert_trees_close(results[1][1], results[0][1], atol=1e-5)


def test_scanned_layers_give_the_same_sharded_step():
  """scan_layers: log-probs and one AdamW step (weight decay on the stacked matrices,
  none on the stacked norms and biases), on 8 devices, equal the layer list's."""
  cfg = CFG.replace(num_layers=2, qkv_bias=True, remat="full")
  algo = presets.algorithm_config("grpo")
  mesh = models.make_mesh((1, 4, 2, 1))
  optimizer = state_lib.make_optimizer(1e-2, warmup=0, total_steps=10, weight_decay=0.1)
  plain = models.create_model(cfg, seed=0)
  results = []
  for m in (plain, models.relayout(plain, scan_layers=True)):
    init = state_lib.init_train_state(m, optimizer, mesh=mesh)
    rows = microbatched(packed_rows(3), 2)
    batch = add_learner_logprobs(rows, init.params, m.cfg, mesh, seed=4)
    logprobs = compute_logprobs_for(m.cfg, mesh)(init.params, rows)["logprobs"]
    new_state, metrics = ts.make_train_step(m.cfg, algo, optimizer, mesh=mesh)(init, batch)
    results.append((logprobs, nnx.to_pure_dict(new_state.params), metrics["loss"]))
  (lp_a, pa, loss_a), (lp_b, pb, loss_b) = results
  np.testing.assert_allclose(lp_b, lp_a, atol=1e-5)
  np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5)
  assert pb["layers"]["attn"]["q_proj"].sharding.spec[:2] == (None, "fsdp")
  for i in range(cfg.num_layers):
    assert_trees_close(jax.tree.map(lambda x: np.asarray(x)[i], pb["layers"]), pa["layers"][i],
                       atol=1e-5)
  assert_trees_close(pb["embed"], pa["embed"], atol=1e-5)


def two_sgd_steps(cfg, mesh, rows):
  """(start params, state after two GRPO + TIS steps of SGD 0.5, their metrics, batch)."""
  algo = presets.algorithm_config("grpo", tis_cap=2.0)
  optimizer = optax.sgd(0.5)
  step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh)
  state = fresh_state(cfg, optimizer, mesh)
  start = state_lib.frozen_copy(state.params)  # the step donates the state
  batch = add_learner_logprobs(microbatched(rows, 2), state.params, cfg, mesh, seed=4)
  history = []
  for _ in range(2):
    state, metrics = step(state, batch)
    history.append(metrics)
  return start, state, history, batch


def test_eight_devices_match_one_device():
  results = [two_sgd_steps(CFG, mesh, packed_rows(3))
             for mesh in (one_device_mesh(), models.make_mesh((1, 2, 4, 1)))]
  (_, state_1, hist_1, batch_1), (_, state_8, hist_8, batch_8) = results
  ref_1, ref_8 = batch_1["ref_logprobs"], batch_8["ref_logprobs"]
  np.testing.assert_allclose(ref_8, ref_1, atol=1e-5)
  embed = state_8.params["embed"][...]
  assert len(embed.sharding.device_set) == 8
  assert_trees_close(state_8.params, state_1.params, atol=1e-5)
  for m1, m8 in zip(hist_1, hist_8):
    for name in m1:
      np.testing.assert_allclose(m8[name], m1[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_reference_params_never_change_and_survive_donation():
  mesh = one_device_mesh()
  optimizer = state_lib.make_optimizer(1e-2, warmup=0, total_steps=10)
  algo = presets.algorithm_config("grpo")
  state = fresh_state(CFG, optimizer, mesh)
  reference = state_lib.frozen_copy(state.params)
  before = snapshot(reference)
  policy_before = snapshot(state.params)
  compute_logprobs = ts.make_compute_logprobs(CFG, mesh=mesh)
  step = ts.make_train_step(CFG, algo, optimizer, mesh=mesh)
  for seed in range(3):
    batch = microbatched(packed_rows(seed), 2)
    batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
    state, metrics = step(state, batch)
  assert float(metrics["kl"]) > 0
  for x, y in zip(snapshot(reference), before, strict=True):
    np.testing.assert_array_equal(x, y)
  moved = [not np.array_equal(x, y) for x, y in zip(snapshot(state.params), policy_before)]
  assert all(moved)


@pytest.mark.parametrize("num_micro,mesh_shape", [
    (1, (1, 1, 1, 1)), (2, (1, 2, 2, 1)),
    pytest.param(2, (1, 1, 1, 1), marks=pytest.mark.slow)])
def test_reference_in_step_matches_precomputed_reference_logprobs(num_micro, mesh_shape):
  """The fused program (reference pass inside the step) makes the update the two-program
  path makes, and leaves the reference untouched."""
  mesh = models.make_mesh(mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
  optimizer = optax.sgd(1.0)
  algo = presets.algorithm_config("grpo", kl_coef=0.5)
  init = fresh_state(CFG, optimizer, mesh)
  reference = state_lib.frozen_copy(fresh_state(CFG, optimizer, mesh, seed=1).params)
  before = snapshot(reference)
  batch = microbatched(packed_rows(5), num_micro)
  two_programs = dict(batch, ref_logprobs=ts.make_compute_logprobs(CFG, mesh=mesh)(
      reference, batch)["logprobs"])
  state_2, metrics_2 = ts.make_train_step(CFG, algo, optimizer, mesh=mesh)(
      state_lib.frozen_copy(init), two_programs)
  fused = ts.make_train_step(CFG, algo, optimizer, mesh=mesh, reference_in_step=True)
  state_1, metrics_1 = fused(state_lib.frozen_copy(init), batch, reference)
  assert float(metrics_1["kl"]) > 1e-3  # a reference other than the policy
  assert_trees_close(state_1.params, state_2.params, atol=1e-5)
  for name in metrics_2:
    np.testing.assert_allclose(metrics_1[name], metrics_2[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  for x, y in zip(snapshot(reference), before, strict=True):
    np.testing.assert_array_equal(x, y)


def test_reference_in_step_misuse_raises():
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  state = fresh_state(CFG, optimizer, mesh)
  batch = microbatched(packed_rows(0), 1)
  grpo = presets.algorithm_config("grpo")
  fused = ts.make_train_step(CFG, grpo, optimizer, mesh=mesh, reference_in_step=True)
  with pytest.raises(ValueError, match="call train_step\\(state, batch, reference\\)"):
    fused(state, batch)
  with pytest.raises(ValueError, match="built without reference_in_step=True"):
    ts.make_train_step(CFG, grpo, optimizer, mesh=mesh)(state, batch, state.params)
  with pytest.raises(ValueError, match="reference_in_step needs a KL loss term"):
    ts.make_train_step(CFG, presets.algorithm_config("grpo", kl_coef=0.0), optimizer,
                       mesh=mesh, reference_in_step=True)


def test_nonfinite_loss_is_reported_and_the_update_skipped():
  mesh = one_device_mesh()
  optimizer = state_lib.make_optimizer(1e-2, warmup=0, total_steps=10)
  step = ts.make_train_step(CFG, presets.algorithm_config("dapo"), optimizer, mesh=mesh)
  state = fresh_state(CFG, optimizer, mesh)
  clean = microbatched(packed_rows(5), 2)
  mask = clean["loss_mask"]

  # Garbage where loss_mask is 0 must not count: the losses never read it.
  hidden_nan = dict(clean, advantages=np.where(mask, clean["advantages"], np.nan))
  state, metrics = step(state, hidden_nan)
  assert float(metrics["nonfinite"]) == 0 and int(state.step) == 1

  params, opt_state = snapshot(state.params), snapshot(state.opt_state)
  poisoned = dict(clean, advantages=clean["advantages"].copy())
  m, r, t = np.argwhere(mask)[0]
  poisoned["advantages"][m, r, t] = np.nan
  state, metrics = step(state, poisoned)
  assert float(metrics["nonfinite"]) == 1
  assert not np.isfinite(float(metrics["loss"]))
  assert int(state.step) == 1
  for x, y in zip(snapshot(state.params), params, strict=True):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(snapshot(state.opt_state), opt_state, strict=True):
    np.testing.assert_array_equal(x, y)

  state, metrics = step(state, clean)  # The skipped step left nothing poisoned behind.
  assert float(metrics["nonfinite"]) == 0 and int(state.step) == 2
  assert all(np.isfinite(x).all() for x in snapshot(state.params))


def test_step_compiles_once_across_new_data():
  mesh = models.make_mesh((1, 2, 4, 1))
  optimizer = state_lib.make_optimizer(1e-3, warmup=2, total_steps=10, weight_decay=0.1)
  step = ts.make_train_step(CFG, presets.algorithm_config("grpo"), optimizer, mesh=mesh)
  compute_logprobs = ts.make_compute_logprobs(CFG, mesh=mesh)
  state = fresh_state(CFG, optimizer, mesh)
  reference = state_lib.frozen_copy(state.params)
  rates = []
  for seed in range(4):
    batch = microbatched(packed_rows(seed), 2)
    batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
    state, metrics = step(state, batch)
    rates.append(float(metrics["learning_rate"]))
  assert step.jitted._cache_size() == 1
  assert compute_logprobs.jitted._cache_size() == 1
  assert set(ts.STANDARD_METRICS) <= set(metrics)
  expected = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)
  np.testing.assert_allclose(rates, [expected(i) for i in range(4)], rtol=1e-6)


def sequence_logprob(logprobs, batch):
  mask = np.asarray(batch["loss_mask"])
  return np.where(mask, np.asarray(logprobs), 0.0).sum(-1)


def test_grpo_steps_raise_the_logprob_of_rewarded_responses():
  mesh = one_device_mesh()
  cfg = CFG
  good, bad = 7, 11  # Reward 1 for a response of `good` tokens, 0 for `bad` ones.
  prompt = np.array([3, 4, 5, 6])
  trajectories, rewards = [], []
  for i in range(8):
    token = good if i % 2 == 0 else bad
    trajectories.append(dict(prompt_tokens=prompt, response_tokens=np.full(6, token)))
    rewards.append(float(token == good))
  adv = advantages_lib.group_normalized_advantages(np.array(rewards)[None])[0]
  for traj, a in zip(trajectories, np.asarray(adv)):
    traj["advantages"] = float(a)
  batch = packing.split_microbatches(packing.pack_trajectories(trajectories, 12), 12 * 4)

  optimizer = state_lib.make_optimizer(1e-2, warmup=0, total_steps=20)
  algo = presets.algorithm_config("grpo")
  state = fresh_state(cfg, optimizer, mesh)
  reference = state_lib.frozen_copy(state.params)
  compute_logprobs = ts.make_compute_logprobs(cfg, mesh=mesh)
  step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh)
  batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
  before = sequence_logprob(batch["ref_logprobs"], batch)
  for _ in range(4):
    state, metrics = step(state, batch)
  after = sequence_logprob(compute_logprobs(state.params, batch)["logprobs"], batch)
  # Packing may reorder sequences: tell them apart by their response token.
  is_good = np.asarray(batch["tokens"])[..., 5] == good
  assert (after - before)[is_good].min() > 1.0
  assert (after - before)[~is_good].max() < 0.0
  assert float(metrics["kl"]) > 0


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_ppo_update_reduces_value_loss(critic):
  # The value-head case runs sharded; the separate critic on one device (time).
  mesh = models.make_mesh((1, 2, 4, 1)) if critic == "value_head" else one_device_mesh()
  optimizer = state_lib.make_optimizer(3e-3, warmup=0, total_steps=50)
  algo = presets.algorithm_config("ppo", kl_coef=0.5)  # k1 KL in the reward.
  if critic == "separate":
    policy_cfg, critic_cfg = CFG, CRITIC_CFG
    state = state_lib.init_train_state(models.create_model(CFG, seed=0), optimizer, mesh=mesh,
                                critic=models.create_model(CRITIC_CFG, seed=1))
    step = ts.make_train_step(CFG, algo, optimizer, mesh=mesh, critic_cfg=CRITIC_CFG)
  else:
    policy_cfg = critic_cfg = CRITIC_CFG
    state = fresh_state(CRITIC_CFG, optimizer, mesh)
    step = ts.make_train_step(CRITIC_CFG, algo, optimizer, mesh=mesh)
  compute_logprobs = ts.make_compute_logprobs(policy_cfg, mesh=mesh)
  compute_values = ts.make_compute_logprobs(critic_cfg, mesh=mesh)

  def critic_params(state):
    return state.params if critic == "value_head" else state.critic_params

  batch = microbatched(packed_rows(7), 4)
  old_logprobs = compute_logprobs(state.params, batch)["logprobs"]
  values = compute_values(critic_params(state), batch)["values"]
  noise = np.random.default_rng(0).normal(0, 0.5, batch["tokens"].shape)
  batch.update(old_logprobs=old_logprobs, ref_logprobs=old_logprobs + noise)
  batch = ts.add_gae_advantages(batch, values, algo)

  # Reference: numpy k1 penalty, then GAE row by row over the flattened micro-batches.
  def rows(x):
    return np.asarray(x).reshape(-1, ROW_LEN)
  mask = rows(batch["loss_mask"])
  penalised = np.where(mask, rows(batch["rewards"]) + 0.5 * rows(noise), 0.0)
  adv, returns = advantages_lib.gae_advantages(penalised, rows(values), mask,
                                               gamma=1.0, lam=0.95,
                                               segment_ids=rows(batch["segment_ids"]))
  np.testing.assert_allclose(rows(batch["advantages"]), adv, atol=1e-5)
  np.testing.assert_allclose(rows(batch["returns"]), returns, atol=1e-5)

  def value_error(state):
    v = np.asarray(compute_values(critic_params(state), batch)["values"])
    m = np.asarray(batch["loss_mask"])
    return float(np.sum(m * (v - np.asarray(batch["returns"])) ** 2) / m.sum())

  policy_before = snapshot(state.params)
  start = value_error(state)
  history = []
  for _ in range(3):
    state, metrics = ts.ppo_update(step, state, batch, epochs=2, minibatches=2)
    history += metrics
  assert len(history) == 12 and int(state.step) == 12
  assert value_error(state) < 0.7 * start
  assert all(not np.array_equal(x, y) for x, y in zip(snapshot(state.params), policy_before))
  assert float(history[-1]["loss/value"]) < float(history[0]["loss/value"])
  assert step.jitted._cache_size() == 1


def test_ppo_update_minibatches_are_train_steps_on_the_halves():
  mesh = one_device_mesh()
  optimizer = optax.sgd(0.1)
  algo = presets.algorithm_config("dapo")
  step = ts.make_train_step(CFG, algo, optimizer, mesh=mesh)
  init = fresh_state(CFG, optimizer, mesh)
  batch = add_learner_logprobs(microbatched(packed_rows(9), 4), init.params, CFG, mesh, 2)
  state, _ = ts.ppo_update(step, state_lib.frozen_copy(init), batch, epochs=1, minibatches=2,
                           shuffle=False)
  manual = state_lib.frozen_copy(init)
  for half in (slice(0, 2), slice(2, 4)):
    manual, _ = step(manual, {k: v[half] for k, v in batch.items()})
  assert_trees_close(state.params, manual.params, atol=1e-6)


# -- user errors: one line, naming the value ----------------------------------------------


def test_bad_inputs_fail_early_with_clear_messages():
  mesh = models.make_mesh((1, 2, 4, 1))
  optimizer = optax.sgd(0.1)
  grpo = presets.algorithm_config("grpo")
  step = ts.make_train_step(CFG, grpo, optimizer, mesh=mesh)
  batch = microbatched(packed_rows(0), 2)
  with pytest.raises(ValueError, match="ref_logprobs"):
    step(None, batch)
  batch["ref_logprobs"] = np.zeros(batch["tokens"].shape, np.float32)
  with pytest.raises(ValueError, match=r"advantages.*\(2, 4, 23\)"):
    step(None, dict(batch, advantages=batch["advantages"][..., :-1]))
  odd_rows = {k: v[:, :3] for k, v in batch.items()}
  with pytest.raises(ValueError, match="3 rows"):
    step(None, odd_rows)
  with pytest.raises(ValueError, match="value head"):
    ts.make_train_step(CFG, presets.algorithm_config("ppo"), optimizer, mesh=mesh)
  with pytest.raises(ValueError, match="trains no critic"):
    ts.make_train_step(CFG, grpo, optimizer, mesh=mesh, critic_cfg=CRITIC_CFG)
  with pytest.raises(ValueError, match="critic_cfg must have value_head"):
    ts.make_train_step(CFG, presets.algorithm_config("ppo"), optimizer, mesh=mesh,
                       critic_cfg=CFG)
  with pytest.raises(ValueError, match="max_response_len"):
    ts.make_train_step(CFG, presets.algorithm_config("dr_grpo"), optimizer, mesh=mesh)
  with pytest.raises(ValueError, match="warmup"):
    state_lib.make_optimizer(1e-3, warmup=10, total_steps=10)
  with pytest.raises(ValueError, match="-0.1"):
    state_lib.make_optimizer(-0.1, warmup=0, total_steps=10)
  with pytest.raises(ValueError, match="minibatches=3"):
    ts.ppo_update(step, None, batch, epochs=1, minibatches=3)


@pytest.mark.parametrize("scan", [False, True])
def test_weight_decay_skips_norms_and_biases_and_reaches_matrices(scan):
  """Also with the layers stacked (scan_layers), where a norm scale is [L, D] and a
  bias [L, N, H]: the layer axis does not make them matrices."""
  cfg = CFG.replace(qkv_bias=True, scan_layers=scan)
  optimizer = state_lib.make_optimizer(1.0, warmup=0, total_steps=10, weight_decay=0.5, clip=None)

  @jax.jit  # one program, not one dispatch per leaf and op
  def shifted_and_zero_grad_updates(params):
    # Shifted so that biases (zero at init) would show a decay.
    params = jax.tree.map(lambda x: x + 0.1, params)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    return params, optimizer.update(zero_grads, optimizer.init(params), params)[0]

  params, updates = shifted_and_zero_grad_updates(
      nnx.state(models.create_model(cfg), nnx.Param))
  layer = updates["layers"] if scan else updates["layers"][0]
  params_layer = params["layers"] if scan else params["layers"][0]
  for leaf in (updates["final_norm"]["scale"], layer["input_norm"]["scale"],
               layer["attn"]["q_bias"], layer["attn"]["k_bias"]):
    assert np.abs(np.asarray(leaf[...])).max() == 0.0
  np.testing.assert_allclose(updates["embed"][...], -0.5 * np.asarray(params["embed"][...]),
                             rtol=1e-6)
  np.testing.assert_allclose(layer["mlp"]["up_proj"][...],
                             -0.5 * np.asarray(params_layer["mlp"]["up_proj"][...]), rtol=1e-6)


def test_weight_decay_skips_the_vectors_of_every_layer_stack():
  """A scanned hybrid's stacks of Mamba2 layers and of MLPs alone (Nemotron-H's) hold
  per-layer vectors as [L, heads] (A_log, dt_bias, D) and a gated norm's scale as [L,
  heads, head dim]: none of them decays, and their matrices do."""
  cfg = models.ModelConfig(
      vocab_size=64, d_model=32, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16,
      ffn_dim=48, layer_types=("linear_attention", "mlp", "full_attention", "mlp"),
      rope_layers=(0,) * 4, mlp_activation="relu2", linear_mixer="mamba2",
      linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=8,
      linear_value_head_dim=16, linear_conv_bias=True, scan_layers=True)
  optimizer = state_lib.make_optimizer(1.0, warmup=0, total_steps=10, weight_decay=0.5, clip=None)
  params = jax.tree.map(lambda x: x + 0.1, nnx.state(models.create_model(cfg), nnx.Param))
  updates = jax.jit(lambda p: optimizer.update(jax.tree.map(jnp.zeros_like, p),
                                               optimizer.init(p), p)[0])(params)
  mamba = updates["linear_layers"]["linear_attn"]
  for leaf in (mamba["A_log"], mamba["dt_bias"], mamba["D"], mamba["norm"],
               mamba["v_conv_bias"], updates["mlp_layers"]["input_norm"]["scale"],
               updates["linear_layers"]["input_norm"]["scale"]):
    assert np.abs(np.asarray(leaf[...])).max() == 0.0
  for ours, base in ((mamba["v_proj"], params["linear_layers"]["linear_attn"]["v_proj"]),
                     (updates["mlp_layers"]["mlp"]["up_proj"],
                      params["mlp_layers"]["mlp"]["up_proj"])):
    np.testing.assert_allclose(ours[...], -0.5 * np.asarray(base[...]), rtol=1e-6)


def test_grpo_step_lowers_one_mosaic_kernel_per_shape_for_hopper():
  """Every layer, the remat recomputation and the backward call the same three Mosaic
  GPU kernels, so a GPU compiles three, not one per call site (jax 0.11 stamped each
  call site's module with a fresh name: a 16-layer 1.2B step held 64 distinct kernels,
  and did not finish compiling on an H200 in minutes). Lowered for CUDA on this host."""
  cfg = CFG.replace(num_layers=3, head_dim=64, dtype="bfloat16", remat="full",
                    attention_impl="flash", attention_options=(
                        "backend=gpu,interpret=false,gpu_forward=mosaic,gpu_backward=mosaic"))
  mesh = one_device_mesh()
  optimizer = state_lib.make_optimizer(1e-3, warmup=0, total_steps=10)
  step = ts.make_train_step(cfg, presets.algorithm_config("grpo"), optimizer, mesh=mesh)
  state = jax.eval_shape(lambda: fresh_state(cfg, optimizer, mesh))
  batch = microbatched(packed_rows(0), 2)
  batch["ref_logprobs"] = np.zeros(batch["tokens"].shape, np.float32)
  with kernels.gpu_target():
    text = step.jitted.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 3 * 4  # fwd, remat fwd, dk/dv, dq
  hashes = re.findall(r'kernel_hash = "([^"]*)"', text)
  assert len(hashes) == 12 and len(set(hashes)) == 3


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_step_never_gathers_the_output_projection(tied):
  """With D split over fsdp the step's log-prob head splits the vocabulary instead of
  gathering the [D, V] projection (and, trained, its whole gradient) on every device:
  4.9 GiB a device for Llama 3 8B before (BENCHMARKS.md, log-prob head)."""
  cfg = CFG.replace(vocab_size=1024, tie_embeddings=tied)
  mesh = models.make_mesh((1, 8, 1, 1))
  optimizer = state_lib.make_optimizer(1e-3, warmup=2, total_steps=10)
  step = ts.make_train_step(cfg, presets.algorithm_config("grpo"), optimizer, mesh=mesh)
  state = fresh_state(cfg, optimizer, mesh)
  batch = add_learner_logprobs(microbatched(packed_rows(0, vocab=1024, rows=16), 2),
                               state.params, cfg, mesh, seed=0)
  state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  text = step.jitted.lower(state, {k: batch[k] for k in batch if k in ts.TOKEN_KEYS}
                           ).compile().as_text()
  whole = rf"\[({cfg.d_model},{cfg.vocab_size}|{cfg.vocab_size},{cfg.d_model})\]"
  gathers = [ln for ln in text.splitlines()
             if re.search(whole + r"\S* all-gather(-start)?\(", ln)]
  assert not gathers, gathers[:2]


def test_a_kl_coefficient_per_row_is_the_presets_coefficient_without_a_compile():
  """batch['kl_coef'] (the adaptive KL controller's value, `[M, B]`) goes through PPO
  minibatches to the loss: rows at 0.03 update exactly as a preset with kl_coef=0.03,
  whatever the preset's own; its shape and a config without a KL loss term are checked."""
  mesh = one_device_mesh()
  optimizer = optax.sgd(0.01)
  algo = lambda c: presets.algorithm_config("grpo", kl_coef=c, num_minibatches=2)  # noqa: E731
  init = fresh_state(CFG, optimizer, mesh)
  batch = add_learner_logprobs(microbatched(packed_rows(3), 4), init.params, CFG, mesh, seed=4)
  controlled = ts.make_train_step(CFG, algo(0.5), optimizer, mesh=mesh)
  fixed = ts.make_train_step(CFG, algo(0.03), optimizer, mesh=mesh)
  rows = {**batch, "kl_coef": np.full(batch["tokens"].shape[:2], 0.03, np.float32)}
  run = lambda step, b: ts.ppo_update(  # noqa: E731
      step, state_lib.frozen_copy(init), b, epochs=1, minibatches=2, seed=7)
  (state_a, hist_a), (state_b, hist_b) = run(controlled, rows), run(fixed, batch)
  assert_trees_close(state_a.params, state_b.params, atol=1e-6, rtol=1e-5)
  for a, b in zip(hist_a, hist_b, strict=True):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
    assert float(a["loss/kl"]) > 0
  # The coefficient acts: 0.5 on every row is another update.
  (state_c, _) = run(controlled, {**batch, "kl_coef": np.full(batch["tokens"].shape[:2], 0.5,
                                                                np.float32)})
  assert max(np.max(np.abs(x - y)) for x, y in zip(snapshot(state_c.params),
                                                     snapshot(state_a.params))) > 1e-5
  assert controlled.jitted._cache_size() == 1  # a new coefficient is not a new program
  with pytest.raises(ValueError, match=r"batch\['kl_coef'\] has shape \(4,\), expected \(4, 2\)"):
    controlled(state_lib.frozen_copy(init), {**batch, "kl_coef": np.zeros(4, np.float32)})
  no_kl = ts.make_train_step(CFG, presets.algorithm_config("grpo", kl_coef=0.0), optimizer,
                             mesh=mesh)
  with pytest.raises(ValueError, match="weighs a KL loss term"):
    no_kl(state_lib.frozen_copy(init), rows)
