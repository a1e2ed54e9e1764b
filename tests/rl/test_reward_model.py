"""Reward-model training: the Bradley-Terry loss against a float64 numpy oracle, the rewards
read at each packed sequence's last token, and the jitted step (against the model's own
unpacked values, exact micro-batching, sharding, learning, the bias left alone)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain import models
from posttrain.rl import preference, reward_model
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts
from posttrain.rl.reward_model import RewardLossConfig
from tests.rl.test_preference import ROW_LEN, random_pairs
from tests.rl.test_train_step import CFG, assert_trees_close, one_device_mesh

RM_CFG = CFG.replace(value_head=True)


def log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def oracle(rc, rr, margin, center_coef):
  """Per-pair Bradley-Terry losses and centring terms in float64 (TRL's RewardTrainer)."""
  return -log_sigmoid(rc - rr - margin), center_coef * (rc + rr) ** 2


@pytest.mark.parametrize("center_coef", [0.0, 0.01])
def test_loss_and_gradient_match_the_oracle(center_coef):
  rng = np.random.default_rng(0)
  n, total = 9, 13  # the other 4 pairs are in other micro-batches
  rc, rr = rng.normal(0, 3, n), rng.normal(0, 3, n)
  rc[0], rr[0] = 60.0, -60.0  # saturated: no overflow
  rc[1], rr[1] = -60.0, 60.0
  margin = rng.uniform(0, 2, n)
  cfg = RewardLossConfig(center_coef=center_coef)

  def pad(x, garbage):  # two empty slots holding garbage
    return jnp.asarray(np.concatenate([x, [garbage, -garbage]]), jnp.float32)

  mask = np.r_[np.ones(n, bool), False, False]

  def loss_fn(c, r):
    return reward_model.bradley_terry_loss(cfg, c, r, margin=pad(margin, 5.0), pair_mask=mask,
                                           denominator=jnp.float32(total))

  (loss, metrics), (grad_c, grad_r) = jax.value_and_grad(loss_fn, argnums=(0, 1),
                                                         has_aux=True)(pad(rc, np.nan),
                                                                       pad(rr, np.inf))
  bt, center = oracle(rc, rr, margin, center_coef)
  np.testing.assert_allclose(loss, (bt + center).sum() / total, rtol=1e-5)
  # d/drc of -log s(h) is -s(-h); of c (rc + rr)^2 is 2 c (rc + rr).
  s_neg = 1.0 / (1.0 + np.exp(rc - rr - margin))
  np.testing.assert_allclose(grad_c[:n], (-s_neg + 2 * center_coef * (rc + rr)) / total,
                             rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(grad_r[:n], (s_neg + 2 * center_coef * (rc + rr)) / total,
                             rtol=1e-4, atol=1e-7)
  assert np.all(np.asarray(grad_c[n:]) == 0) and np.all(np.asarray(grad_r[n:]) == 0)
  got = {k: float(v) for k, v in jax.tree.map(
      lambda m: m.total / m.count, metrics, is_leaf=lambda x: hasattr(x, "reduce")).items()}
  np.testing.assert_allclose(got["loss/reward_model"], bt.mean(), rtol=1e-5)
  np.testing.assert_allclose(got["rewards/margin"], (rc - rr).mean(), rtol=1e-5)
  np.testing.assert_allclose(got["rewards/accuracy"], (rc > rr).mean())
  assert ("loss/center" in got) == (center_coef > 0)


def test_equal_rewards_give_log_2_and_no_accuracy():
  loss, metrics = reward_model.bradley_terry_loss(RewardLossConfig(), jnp.ones(4), jnp.ones(4))
  np.testing.assert_allclose(loss, np.log(2), rtol=1e-6)
  assert float(metrics["rewards/accuracy"].total) == 0.0  # a tie is not a right answer


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "0.1"])
def test_config_errors_name_the_value(bad):
  with pytest.raises(ValueError, match="center_coef"):
    RewardLossConfig(center_coef=bad)


def test_last_tokens_mark_where_each_packed_sequence_ends():
  seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0],
                  [1, 1, 1, 1, 1, 1, 1, 1],
                  [0, 0, 0, 0, 0, 0, 0, 0]])
  want = np.array([[0, 0, 1, 0, 1, 1, 0, 0],
                   [0, 0, 0, 0, 0, 0, 0, 1],
                   [0, 0, 0, 0, 0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(reward_model.last_tokens(seg), want)


def with_margins(pairs, batch, seed=0):
  rng = np.random.default_rng(seed)
  for p in pairs:
    p["margin"] = float(rng.uniform(0, 1))
  return dict(batch, pair_margin=reward_model.pair_margins(pairs, batch))


def own_rewards(params, pairs, cfg=RM_CFG):
  """Each pair's two rewards from the model alone on its sequence (no packing): the score
  head's h . w at the sequence's last token, in float64. The sequences are right-padded
  to one length for one call; under causal attention nothing after a token changes it."""
  graphdef, _, rest = ts._split_abstract(cfg)
  model = nnx.merge(graphdef, params, rest)
  seqs = [np.concatenate([pair["prompt_tokens"], pair[f"{name}_tokens"]])[:ROW_LEN]
          for name in ("chosen", "rejected") for pair in pairs]
  tokens = np.zeros((len(seqs), ROW_LEN), np.int32)
  for i, seq in enumerate(seqs):
    tokens[i, :len(seq)] = seq
  h = np.asarray(nnx.jit(lambda m, t: m.hidden_states(t))(model, jnp.asarray(tokens)),
                 np.float64)
  last = h[np.arange(len(seqs)), [len(seq) - 1 for seq in seqs]]
  return (last @ np.asarray(model.value_w[...], np.float64)).reshape(2, len(pairs))


def fresh_state(optimizer, mesh, seed=0, cfg=RM_CFG):
  return state_lib.init_train_state(models.create_model(cfg, seed=seed), optimizer, mesh=mesh)


def test_step_loss_is_the_bradley_terry_loss_of_each_sequences_own_score():
  """Packed several sequences a row, cut to fit: the step's rewards are the model's
  scores of each sequence run alone, and its loss the oracle's on them."""
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  pairs = random_pairs(3, num_pairs=7)
  pairs[2]["rejected_tokens"] = np.arange(1, 40)  # cut to fit the row
  batch = preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=2)
  batch = with_margins(pairs, batch)
  cfg = RewardLossConfig(center_coef=0.05)
  state = fresh_state(optimizer, mesh)
  rc, rr = own_rewards(state.params, pairs)
  step = ts.make_reward_model_step(RM_CFG, cfg, optimizer, mesh=mesh)
  _, metrics = step(state, batch)
  margin = np.asarray([p["margin"] for p in pairs])
  bt, center = oracle(rc, rr, margin, cfg.center_coef)
  np.testing.assert_allclose(metrics["loss/reward_model"], bt.mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], (bt + center).mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["rewards/chosen"], rc.mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["rewards/rejected"], rr.mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["rewards/accuracy"], (rc > rr).mean())
  assert float(metrics["pairs"]) == 7 and float(metrics["nonfinite"]) == 0


def one_update(mesh, batch, steps=1, cfg=RewardLossConfig(center_coef=0.01)):
  optimizer = optax.sgd(1.0)
  step = ts.make_reward_model_step(RM_CFG, cfg, optimizer, mesh=mesh)
  state = fresh_state(optimizer, mesh)
  start = state_lib.frozen_copy(state.params)  # the step donates the state
  for _ in range(steps):
    state, metrics = step(state, batch)
  return jax.tree.map(jnp.subtract, state.params, start), metrics


def assert_metrics_close(a, b, rtol=1e-5):
  assert set(a) == set(b)
  for name in a:
    np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=1e-6, err_msg=name)


def test_more_microbatches_and_eight_devices_give_the_same_update():
  mesh = one_device_mesh()
  pairs = random_pairs(6, num_pairs=7)
  one, many = (with_margins(pairs, preference.pack_pairs(pairs, ROW_LEN,
                                                           rows_per_microbatch=rows))
               for rows in (8, 1))
  assert [one["tokens"].shape[0], many["tokens"].shape[0]] == [1, 8]
  delta_one, metrics_one = one_update(mesh, one)
  delta_many, metrics_many = one_update(mesh, many)
  assert float(jnp.abs(delta_one["value_w"][...]).max()) > 1e-4
  assert_trees_close(delta_many, delta_one, atol=1e-6)
  assert_metrics_close(metrics_many, metrics_one)

  four = with_margins(pairs, preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=4))
  delta_1, metrics_1 = one_update(mesh, four, steps=2)
  delta_8, metrics_8 = one_update(models.make_mesh((2, 2, 2, 1)), four, steps=2)
  assert_trees_close(delta_8, delta_1, atol=1e-5, rtol=1e-4)
  assert_metrics_close(metrics_8, metrics_1, rtol=1e-4)


@pytest.mark.slow
def test_training_ranks_every_pair_and_leaves_the_bias_alone():
  """Thirty Adam steps from a random head: every chosen sequence scores above its
  rejected one when scored afresh, and the bias, which Hugging Face's score layer lacks,
  stays zero."""
  mesh = one_device_mesh()
  optimizer = state_lib.make_optimizer(1e-2, warmup=0, total_steps=30)
  pairs = random_pairs(10, num_pairs=6)
  batch = with_margins(pairs, preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=2))
  step = ts.make_reward_model_step(RM_CFG, RewardLossConfig(), optimizer, mesh=mesh)
  state = fresh_state(optimizer, mesh)
  history = []
  for _ in range(30):
    state, metrics = step(state, batch)
    history.append({k: float(v) for k, v in metrics.items()})
  assert history[-1]["rewards/accuracy"] == 1.0
  assert history[-1]["loss"] < 0.5 * history[0]["loss"]
  rc, rr = own_rewards(state.params, pairs)
  assert np.all(rc - rr > 0)
  assert float(state.params["value_b"][...]) == 0.0
  assert step.jitted._cache_size() == 1


def test_step_misuse_raises():
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  with pytest.raises(ValueError, match="value_head=True"):
    ts.make_reward_model_step(CFG, RewardLossConfig(), optimizer, mesh=mesh)
  step = ts.make_reward_model_step(RM_CFG, RewardLossConfig(), optimizer, mesh=mesh)
  pairs = random_pairs(1, num_pairs=3)
  batch = preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=2)
  state = fresh_state(optimizer, mesh)
  with pytest.raises(ValueError, match="pair_margin"):
    step(state, batch)
  bad = dict(batch, pair_margin=np.zeros((1, 1), np.float32))
  with pytest.raises(ValueError, match="pair_margins"):
    step(state, bad)
  with pytest.raises(ValueError, match="names pair"):
    reward_model.pair_margins(pairs[:1], batch)


def test_lora_reward_model_trains_its_adapters_and_score_head_not_the_base():
  """With LoRA the score head trains beside the adapters (it is new, like PEFT's
  modules_to_save); the base weights stay bit-identical."""
  lora_cfg = RM_CFG.replace(lora_rank=4)
  mesh = one_device_mesh()
  optimizer = state_lib.make_optimizer(1e-2, warmup=0, total_steps=5)
  pairs = random_pairs(4, num_pairs=5)
  batch = with_margins(pairs, preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=2))
  state = fresh_state(optimizer, mesh, cfg=lora_cfg)
  trainable, frozen = state_lib.split_trainable(state.params)
  names = {"/".join(map(str, path)) for path, _ in jax.tree_util.tree_leaves_with_path(
      trainable)}
  assert any("value_w" in n for n in names) and not any("embed" in n for n in names)
  before = jax.tree.map(np.array, (trainable, frozen))
  step = ts.make_reward_model_step(lora_cfg, RewardLossConfig(), optimizer, mesh=mesh)
  for _ in range(3):
    state, metrics = step(state, batch)
  assert float(metrics["nonfinite"]) == 0
  trainable, frozen = state_lib.split_trainable(state.params)
  for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(before[1]), strict=True):
    np.testing.assert_array_equal(x, y)
  assert not np.allclose(np.asarray(state.params["value_w"][...]),
                         before[0]["value_w"][...])
  assert float(state.params["value_b"][...]) == 0.0
