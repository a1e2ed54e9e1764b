"""The RL train step on a mixture-of-experts policy: 8 devices equal one, and GRPO learns."""

import numpy as np
import optax

from posttrain import models
from posttrain.rl import presets
from posttrain.rl import train_step as ts
from tests.rl.test_train_step import (add_learner_logprobs, assert_trees_close, fresh_state,
                                      microbatched, one_device_mesh, packed_rows)

CFG = models.get_preset("tiny", num_layers=1, ffn_dim=64, logprob_chunk=8, num_experts=4,
                        num_experts_per_tok=2, init_std=0.1)


def test_eight_devices_match_one_device():
  """On fsdp x tensor (experts gathered over fsdp, split over tensor) two SGD steps, which
  move the router and every expert, equal one device's."""
  algo = presets.algorithm_config("grpo", tis_cap=2.0)
  optimizer = optax.sgd(0.5)
  rows = packed_rows(3)
  results = []
  for mesh in (one_device_mesh(), models.make_mesh((1, 2, 4, 1))):
    step = ts.make_train_step(CFG, algo, optimizer, mesh=mesh)
    state = fresh_state(CFG, optimizer, mesh)
    start = [np.array(x) for x in (state.params["layers"][0]["mlp"]["router"][...],
                                   state.params["layers"][0]["mlp"]["down_proj"][...])]
    batch = add_learner_logprobs(microbatched(rows, 2), state.params, CFG, mesh, seed=4)
    history = []
    for _ in range(2):
      state, metrics = step(state, batch)
      history.append(metrics)
    mlp = state.params["layers"][0]["mlp"]
    moved = [np.abs(np.asarray(mlp[name][...]) - before).max(axis=tuple(range(1, before.ndim)))
             for name, before in zip(("router", "down_proj"), start)]
    assert moved[0].max() > 0 and (moved[1] > 0).all()  # the router and every expert learn
    results.append((state, history))
  (state_1, hist_1), (state_8, hist_8) = results
  assert len(state_8.params["layers"][0]["mlp"]["gate_proj"][...].sharding.device_set) == 8
  assert_trees_close(state_8.params, state_1.params, atol=1e-5)
  for m1, m8 in zip(hist_1, hist_8):
    for name in m1:
      np.testing.assert_allclose(m8[name], m1[name], rtol=1e-4, atol=1e-6, err_msg=name)
