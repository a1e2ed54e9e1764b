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
