"""The RL train step on a mixture-of-experts policy: 8 devices equal one, and GRPO learns."""

import numpy as np
import optax
import pytest

from posttrain import models
from posttrain.rl import presets
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts
from tests.rl.test_train_step import (add_learner_logprobs, assert_trees_close, fresh_state,
                                      microbatched, one_device_mesh, packed_rows,
                                      two_sgd_steps)

CFG = models.get_preset("tiny", num_layers=1, ffn_dim=64, logprob_chunk=8, num_experts=4,
                        num_experts_per_tok=2, init_std=0.1)


def test_eight_devices_match_one_device():
  """On fsdp x tensor (experts gathered over fsdp, split over tensor) two SGD steps, which
  move the router and every expert, equal one device's."""
  results = [two_sgd_steps(CFG, mesh, packed_rows(3))
             for mesh in (one_device_mesh(), models.make_mesh((1, 2, 4, 1)))]
  for start, state, _, _ in results:
    mlp, before = state.params["layers"][0]["mlp"], start["layers"][0]["mlp"]
    moved = {name: np.abs(np.asarray(mlp[name][...]) - np.asarray(before[name][...]))
             for name in ("router", "down_proj")}
    assert moved["router"].max() > 0  # the router learns, and every expert
    assert (moved["down_proj"].max(axis=(1, 2)) > 0).all()
  (_, state_1, hist_1, _), (_, state_8, hist_8, _) = results
  assert len(state_8.params["layers"][0]["mlp"]["gate_proj"][...].sharding.device_set) == 8
  assert_trees_close(state_8.params, state_1.params, atol=1e-5)
  for m1, m8 in zip(hist_1, hist_8):
    for name in m1:
      np.testing.assert_allclose(m8[name], m1[name], rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_load_balancing_loss_joins_the_update_averaged_over_microbatches():
  """router_aux_loss_coef adds coef x the mean of the micro-batches' load-balancing losses
  to the loss (logged as loss/router_aux) and its gradient to the router's; on 8 devices
  as on one."""
  algo = presets.algorithm_config("grpo")
  optimizer = optax.sgd(1.0)
  coef = 0.5
  rows = packed_rows(5)
  results = {}
  for name, cfg, mesh in (("plain", CFG, one_device_mesh()),
                          ("aux", CFG.replace(router_aux_loss_coef=coef), one_device_mesh()),
                          ("aux8", CFG.replace(router_aux_loss_coef=coef),
                           models.make_mesh((1, 2, 4, 1)))):
    state = fresh_state(cfg, optimizer, mesh)
    batch = add_learner_logprobs(microbatched(rows, 2), state.params, CFG, mesh, seed=6)
    start = state_lib.frozen_copy(state.params)  # the step donates the state
    new_state, metrics = ts.make_train_step(cfg, algo, optimizer, mesh=mesh)(state, batch)
    results[name] = (start, batch, new_state, metrics)
  plain, aux, aux8 = results["plain"], results["aux"], results["aux8"]
  assert "loss/router_aux" not in plain[3]
  from flax import nnx
  model = models.create_model(CFG)
  nnx.update(model, plain[0])
  batch = plain[1]
  want = np.mean([float(model.hidden_states(batch["tokens"][i], batch["positions"][i],
                                            batch["segment_ids"][i], router_loss=True)[1])
                  for i in range(2)])
  np.testing.assert_allclose(aux[3]["loss/router_aux"], want, rtol=1e-5)
  np.testing.assert_allclose(aux[3]["loss"] - plain[3]["loss"], coef * want, rtol=1e-4)
  router = lambda s: np.asarray(s.params["layers"][0]["mlp"]["router"][...])  # noqa: E731
  assert np.abs(router(aux[2]) - router(plain[2])).max() > 1e-6
  np.testing.assert_allclose(aux8[3]["loss/router_aux"], aux[3]["loss/router_aux"], rtol=1e-5)
  assert_trees_close(aux8[2].params, aux[2].params, atol=1e-5)


REPLAY_CFG = CFG.replace(num_layers=2)


def _replay_batch(mesh):
  """A two-micro-batch batch with advantages, the routing the policy records on it
  (`with_routing`), and (state, that routing moved to other experts, the old log-probs
  under the moved routing, those under the policy's own)."""
  state = fresh_state(REPLAY_CFG, optax.sgd(0.5), mesh)
  batch = microbatched(packed_rows(3), 2)
  recorded = ts.make_compute_logprobs(REPLAY_CFG, mesh=mesh, with_routing=True)(
      state.params, batch)
  routing = np.asarray(recorded["routing"])
  assert routing.dtype == np.uint8  # up to 256 experts
  assert routing.shape == np.shape(batch["tokens"]) + (2, 2)
  moved = ((routing + 1) % REPLAY_CFG.num_experts).astype(routing.dtype)
  plain = ts.make_compute_logprobs(REPLAY_CFG, mesh=mesh)
  old_moved = np.asarray(plain(state.params, {**batch, "routing": moved})["logprobs"])
  return state, batch, routing, moved, old_moved, np.asarray(recorded["logprobs"])


def test_compute_logprobs_records_the_routing_the_model_takes():
  """with_routing: each micro-batch's experts are the model's own record; replaying
  them gives the same log-probs, replaying others does not."""
  from flax import nnx
  mesh = one_device_mesh()
  state, batch, routing, moved, old_moved, old = _replay_batch(mesh)
  model = models.create_model(REPLAY_CFG)
  nnx.update(model, state.params)
  for i in range(2):
    _, want = model.hidden_states(batch["tokens"][i], batch["positions"][i],
                                  batch["segment_ids"][i], return_routing=True)
    np.testing.assert_array_equal(routing[i], np.asarray(want))
  again = ts.make_compute_logprobs(REPLAY_CFG, mesh=mesh)(state.params,
                                                          {**batch, "routing": routing})
  np.testing.assert_allclose(again["logprobs"], old, atol=1e-6)
  assert np.abs(old_moved - old).max() > 1e-3


@pytest.mark.parametrize("mesh_shape", [None, (1, 2, 4, 1)], ids=["one", "fsdp_tensor"])
def test_the_update_follows_the_batch_routing(mesh_shape):
  """Old log-probs taken under given experts: with those experts in the batch, the
  step's first update sees ratios of exactly 1 (its forward takes the same experts, on
  8 devices too); without them it routes by its own top-k and the ratios move. Split
  into shuffled minibatches (`ppo_update`) each row keeps its own experts."""
  mesh = one_device_mesh() if mesh_shape is None else models.make_mesh(mesh_shape)
  state, batch, routing, moved, old_moved, old = _replay_batch(mesh)
  algo = presets.algorithm_config("grpo", kl_coef=0.0, num_minibatches=2,
                                  routing_replay="old")
  step = ts.make_train_step(REPLAY_CFG, algo, optax.sgd(0.5), mesh=mesh, donate=False)
  replayed = {**batch, "old_logprobs": old_moved, "routing": moved}
  _, metrics = step(state, replayed)
  np.testing.assert_allclose(float(metrics["ratio/mean"]), 1.0, atol=1e-6)
  np.testing.assert_allclose(float(metrics["ratio/max"]), 1.0, atol=1e-6)
  # The routers would have chosen otherwise: every first layer's choice, say.
  assert float(metrics["routing/mismatch"]) > 0.5
  _, metrics = step(state, {**batch, "old_logprobs": old, "routing": routing})
  assert float(metrics["routing/mismatch"]) == 0.0  # its own routing
  _, metrics = step(state, {**batch, "old_logprobs": old_moved})
  assert float(metrics["ratio/max"]) > 1.001 and "routing/mismatch" not in metrics
  _, history = ts.ppo_update(step, state, replayed, epochs=1, minibatches=2, seed=3)
  np.testing.assert_allclose(float(history[0]["ratio/max"]), 1.0, atol=1e-6)
  # The second minibatch runs after an update: the moved routers change the weights of
  # the replayed experts, not which experts.
  assert float(history[1]["ratio/max"]) != 1.0


def test_routing_replay_refuses_what_it_cannot_replay():
  mesh = one_device_mesh()
  state, batch, routing, *_ = _replay_batch(mesh)
  algo = presets.algorithm_config("grpo", kl_coef=0.0, num_minibatches=2,
                                  routing_replay="old")
  step = ts.make_train_step(REPLAY_CFG, algo, optax.sgd(0.5), mesh=mesh, donate=False)
  with pytest.raises(ValueError, match=r"batch\['routing'\] has shape \(2, 4, 24, 1, 2\), "
                                       r"expected \(2, 4, 24, 2, 2\)"):
    step(state, {**batch, "routing": routing[..., :1, :]})
  dense = CFG.replace(num_experts=0, num_experts_per_tok=0)
  with pytest.raises(ValueError, match="with_routing=True records a mixture's experts"):
    ts.make_compute_logprobs(dense, mesh=mesh, with_routing=True)
  with pytest.raises(ValueError, match="routing_replay=old keeps the old policy's experts"):
    presets.algorithm_config("grpo", routing_replay="old")
  with pytest.raises(ValueError, match="unknown routing_replay 'sampler'"):
    presets.algorithm_config("grpo", routing_replay="sampler", num_minibatches=2)


def test_routing_mismatch_counts_layers_whose_expert_sets_differ_on_masked_tokens():
  replayed = np.array([[[[0, 1], [2, 3]], [[4, 5], [0, 2]], [[1, 2], [3, 4]]]])  # [1, 3, 2, 2]
  own = np.array([[[[1, 0], [2, 4]], [[4, 5], [0, 2]], [[0, 0], [0, 0]]]])
  mask = np.array([[1, 1, 0]])
  # Token 0: layer 0 the same set in another order, layer 1 differs; token 1 the same;
  # token 2 masked out. One of four pairs.
  np.testing.assert_allclose(float(ts.routing_mismatch(replayed, own, mask)), 0.25)
  assert float(ts.routing_mismatch(replayed, own, np.zeros((1, 3)))) == 0.0
