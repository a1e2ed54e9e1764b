"""Preference optimisation: the losses against the papers' formulas, pair packing, and the
jitted step (exact micro-batching, sharding, in-step reference, LoRA, learning, safety)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain import models
from posttrain.rl import preference
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts
from posttrain.rl.preference import PreferenceConfig
from tests.rl.test_train_step import CFG, assert_trees_close, fresh_state, one_device_mesh, snapshot

ROW_LEN = 24


# -- the losses: a float64 numpy oracle from the papers ------------------------------------


def log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def oracle_pair_losses(cfg, pc, pr, rc, rr, nc, nr):
  """Per-pair losses written from the papers (and TRL's DPOTrainer), in float64."""
  beta, eps = cfg.beta, cfg.label_smoothing
  a, b = pc - rc, pr - rr  # the chosen and rejected log-ratios
  h = beta * (a - b)
  if cfg.loss == "sigmoid":
    return -(1 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h)
  if cfg.loss == "robust":  # Chowdhury et al. 2024, eq. 7
    return (-(1 - eps) * log_sigmoid(h) + eps * log_sigmoid(-h)) / (1 - 2 * eps)
  if cfg.loss == "exo_pair":  # Ji et al. 2024, eq. 16: KL(p_policy || p_labels) of 2 classes
    eps = eps or 1e-3
    p = 1 / (1 + np.exp(-h))
    return p * (np.log(p) - np.log(1 - eps)) + (1 - p) * (np.log(1 - p) - np.log(eps))
  if cfg.loss == "nca_pair":  # Chen et al. 2024, NCA with K = 1
    return (-log_sigmoid(beta * a) - 0.5 * log_sigmoid(-beta * a)
            - 0.5 * log_sigmoid(-beta * b))
  if cfg.loss == "sppo_hard":  # Wu et al. 2024, eq. 4.7 with P(win) = 1, P(lose) = 0
    return (a - 1 / (2 * beta)) ** 2 + (b + 1 / (2 * beta)) ** 2
  if cfg.loss == "apo_zero":  # D'Oosterlinck et al. 2024, eq. 7
    return 1 - 1 / (1 + np.exp(-beta * a)) + 1 / (1 + np.exp(-beta * b))
  if cfg.loss == "apo_down":  # eq. 8
    return 1 / (1 + np.exp(-beta * a)) + 1 - 1 / (1 + np.exp(-h))
  if cfg.loss == "discopop":  # Chris Lu et al. 2024, eq. 5, as TRL writes it
    modulation = 1 / (1 + np.exp(-h / cfg.discopop_tau))
    return -log_sigmoid(h) * (1 - modulation) + np.exp(-h) * modulation
  if cfg.loss == "ipo":  # Azar et al. eq. 17 with TRL's per-token averaged log-ratios
    return ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
  if cfg.loss == "hinge":
    return np.maximum(0.0, 1 - beta * ((pc - rc) - (pr - rr)))
  if cfg.loss == "orpo":  # Hong et al. eq. 6-7: odds of the per-token mean probability
    return -beta * log_sigmoid(oracle_log_odds(pc / nc) - oracle_log_odds(pr / nr))
  z = beta * (pc / nc - pr / nr) - cfg.simpo_gamma
  return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def oracle_log_odds(mean_logp):
  p = np.exp(mean_logp)
  return np.log(p / (1 - p))


def oracle_rewards(cfg, pc, pr, rc, rr, nc, nr):
  if cfg.loss == "orpo":
    return oracle_log_odds(pc / nc), oracle_log_odds(pr / nr)
  if cfg.loss == "simpo":
    return cfg.beta * pc / nc, cfg.beta * pr / nr
  if cfg.loss == "ipo":
    return cfg.beta * (pc - rc) / nc, cfg.beta * (pr - rr) / nr
  return cfg.beta * (pc - rc), cfg.beta * (pr - rr)


def random_pair_values(seed, num_pairs):
  rng = np.random.default_rng(seed)
  nc = rng.integers(1, 30, num_pairs).astype(np.float64)
  nr = rng.integers(1, 30, num_pairs).astype(np.float64)
  pc, pr = -nc * rng.uniform(0.5, 3, num_pairs), -nr * rng.uniform(0.5, 3, num_pairs)
  rc, rr = pc + rng.normal(0, 2, num_pairs), pr + rng.normal(0, 2, num_pairs)
  return pc, pr, rc, rr, nc, nr


LOSS_CASES = {
    "dpo": PreferenceConfig("sigmoid", beta=0.1),
    "cdpo": PreferenceConfig("sigmoid", beta=0.5, label_smoothing=0.2),
    "ipo": PreferenceConfig("ipo", beta=0.3),
    "hinge": PreferenceConfig("hinge", beta=0.5),
    "simpo": PreferenceConfig("simpo", beta=2.0, simpo_gamma=0.7),
    "simpo_smoothed": PreferenceConfig("simpo", beta=2.5, simpo_gamma=1.2, label_smoothing=0.1),
    "orpo": PreferenceConfig("orpo", beta=0.25),
    "robust": PreferenceConfig("robust", beta=0.4, label_smoothing=0.15),
    "exo_pair": PreferenceConfig("exo_pair", beta=0.3),
    "exo_pair_smoothed": PreferenceConfig("exo_pair", beta=0.3, label_smoothing=0.05),
    "nca_pair": PreferenceConfig("nca_pair", beta=0.2),
    "sppo_hard": PreferenceConfig("sppo_hard", beta=0.5),
    "apo_zero": PreferenceConfig("apo_zero", beta=0.3),
    "apo_down": PreferenceConfig("apo_down", beta=0.3),
    "discopop": PreferenceConfig("discopop", beta=0.3),
    "discopop_warm": PreferenceConfig("discopop", beta=0.5, discopop_tau=0.8),
}


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_loss_and_gradient_match_the_papers_formulas(case):
  cfg = LOSS_CASES[case]
  num_pairs, total_pairs = 7, 11  # the other 4 pairs are in other micro-batches
  pc, pr, rc, rr, nc, nr = random_pair_values(3, num_pairs)
  mask = np.ones(num_pairs + 2, bool)
  mask[-2:] = False  # empty slots holding garbage

  def pad(x, garbage):
    return np.concatenate([x, [garbage, -garbage]]).astype(np.float32)

  def loss_fn(policy_chosen, policy_rejected):
    return preference.preference_loss(
        cfg, policy_chosen, policy_rejected, pad(rc, np.nan), pad(rr, np.inf),
        pad(nc, 0.0), pad(nr, np.nan), pair_mask=mask, denominator=total_pairs)

  (loss, metrics), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      jnp.asarray(pad(pc, np.nan)), jnp.asarray(pad(pr, np.nan)))

  def oracle(pc, pr):
    return oracle_pair_losses(cfg, pc, pr, rc, rr, nc, nr).sum() / total_pairs

  np.testing.assert_allclose(loss, oracle(pc, pr), rtol=1e-5)
  # Central differences of the float64 oracle, per pair and side.
  step = 1e-5
  for side, grad in enumerate(grads):
    want = np.zeros(num_pairs)
    for p in range(num_pairs):
      bump = np.zeros(num_pairs)
      bump[p] = step
      args_plus = (pc + bump, pr) if side == 0 else (pc, pr + bump)
      args_minus = (pc - bump, pr) if side == 0 else (pc, pr - bump)
      want[p] = (oracle(*args_plus) - oracle(*args_minus)) / (2 * step)
    np.testing.assert_allclose(grad[:num_pairs], want, rtol=1e-3, atol=1e-7)
    np.testing.assert_array_equal(grad[num_pairs:], 0.0)
    assert np.abs(want).max() > 1e-4

  values = {k: float(v.compute()) for k, v in metrics.items()}
  reward_c, reward_r = oracle_rewards(cfg, pc, pr, rc, rr, nc, nr)
  np.testing.assert_allclose(values["loss/preference"], oracle(pc, pr) * total_pairs / num_pairs,
                             rtol=1e-5)
  np.testing.assert_allclose(values["rewards/chosen"], reward_c.mean(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(values["rewards/rejected"], reward_r.mean(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(values["rewards/margin"], (reward_c - reward_r).mean(), rtol=1e-5,
                             atol=1e-6)
  accuracy = (reward_c > reward_r).mean()
  assert 0 < accuracy < 1
  np.testing.assert_allclose(values["rewards/accuracy"], accuracy, rtol=1e-6)
  np.testing.assert_allclose(values["logps/chosen"], pc.mean(), rtol=1e-5)
  np.testing.assert_allclose(values["logps/rejected"], pr.mean(), rtol=1e-5)


def test_policy_equal_to_reference_gives_log_2_and_no_accuracy():
  pc, pr, _, _, nc, nr = random_pair_values(4, 5)
  loss, metrics = preference.preference_loss(PreferenceConfig(beta=0.3), pc, pr, pc, pr, nc,
                                             nr)
  np.testing.assert_allclose(loss, np.log(2), rtol=1e-6)
  assert float(metrics["rewards/accuracy"].compute()) == 0.0


def test_config_errors_are_one_line_and_name_the_value():
  with pytest.raises(ValueError, match="unknown preference loss 'dpo'; known: sigmoid, robust, exo_pair, ipo"):
    PreferenceConfig("dpo")
  with pytest.raises(ValueError, match="beta must be > 0, got 0"):
    PreferenceConfig(beta=0)
  with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\), got 0.5"):
    PreferenceConfig(label_smoothing=0.5)
  with pytest.raises(ValueError, match="label_smoothing=0.1 applies to"):
    PreferenceConfig("ipo", label_smoothing=0.1)
  with pytest.raises(ValueError, match="label_smoothing=0.1 applies to"):
    PreferenceConfig("apo_zero", label_smoothing=0.1)
  with pytest.raises(ValueError, match="sft_coef must be >= 0, got -1"):
    PreferenceConfig(sft_coef=-1)
  with pytest.raises(ValueError, match="sft_coef=0.5 does not apply to orpo"):
    PreferenceConfig("orpo", sft_coef=0.5)
  assert PreferenceConfig("orpo").nll_coef == 1.0 and PreferenceConfig(sft_coef=0.3).nll_coef == 0.3
  with pytest.raises(ValueError, match="discopop_tau must be a finite number > 0, got 0"):
    PreferenceConfig("discopop", discopop_tau=0.0)
  with pytest.raises(ValueError, match="discopop_tau=0.2 applies to the discopop loss"):
    PreferenceConfig("sigmoid", discopop_tau=0.2)


def test_discopop_stays_finite_where_its_exponential_overflows():
  """A pair the policy ranks far the wrong way (margin -300): exp(-h) overflows float32,
  but its weight s(h / tau) is exp(-6000); the loss is the logistic one, -log s(h) = 300,
  and the gradient finite."""
  cfg = PreferenceConfig("discopop", beta=1.0)
  pc, pr = jnp.asarray([-400.0, -10.0]), jnp.asarray([-100.0, -12.0])
  ref = jnp.zeros(2)

  def loss_fn(pc):
    return preference.preference_loss(cfg, pc, pr, ref, ref)[0]

  loss, grad = jax.value_and_grad(loss_fn)(pc)
  h = 2.0  # the second pair's margin
  modulation = 1 / (1 + np.exp(-h / 0.05))
  second = -log_sigmoid(h) * (1 - modulation) + np.exp(-h) * modulation
  np.testing.assert_allclose(loss, (300.0 + second) / 2, rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_allclose(grad[0], -0.5, rtol=1e-5)  # d/dpc of -log s(pc - pr) / 2


def test_orpo_stays_finite_where_the_odds_overflow():
  """A response the policy is certain of (mean log-prob 0): the odds are held at 10^7
  there, the loss and gradient stay finite, and the other pairs' gradients are exact."""
  cfg = PreferenceConfig("orpo", beta=0.5)
  pc = jnp.asarray([0.0, -1e-9, -3.0, -4.0])
  pr = jnp.asarray([-2.0, -5.0, 0.0, -6.0])
  n = jnp.asarray([2.0, 1.0, 3.0, 2.0])

  def loss_fn(pc, pr):
    return preference.preference_loss(cfg, pc, pr, None, None, n, n)[0]

  loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1))(pc, pr)
  assert np.isfinite(loss) and all(np.isfinite(g).all() for g in grads)
  held = np.log(1 / np.expm1(1e-7))  # log-odds at the held mean log-prob
  want = -0.5 * log_sigmoid(np.array([held - oracle_log_odds(-1.0), held - oracle_log_odds(-5.0),
                                      oracle_log_odds(-1.0) - held,
                                      oracle_log_odds(-2.0) - oracle_log_odds(-3.0)])).mean()
  np.testing.assert_allclose(loss, want, rtol=1e-4)
  assert grads[0][0] == 0.0 and grads[0][1] == 0.0 and grads[1][2] == 0.0  # held: flat
  assert grads[0][3] < 0 < grads[1][3]  # a loss that falls as chosen rises, rejected falls


# -- packing pairs -------------------------------------------------------------------------


def random_pairs(seed, num_pairs=6, vocab=CFG.vocab_size):
  """Pairs whose two sequences fit one row of ROW_LEN; chosen responses with unscored
  (tool) tokens."""
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(num_pairs):
    chosen = rng.integers(1, vocab, rng.integers(2, 8))
    chosen_mask = rng.random(len(chosen)) < 0.7
    chosen_mask[0] = True
    pairs.append(dict(prompt_tokens=rng.integers(1, vocab, rng.integers(2, 6)),
                      chosen_tokens=chosen, chosen_mask=chosen_mask,
                      rejected_tokens=rng.integers(1, vocab, rng.integers(1, 8))))
  return pairs


def direct_sums(pairs, table, row_len):
  """Per pair and side, the sum over scored response tokens j of table[token_j, P - 1 + j]
  (response token j is the target of position P - 1 + j), and their count."""
  out = np.zeros((2, 2, len(pairs)))
  for i, pair in enumerate(pairs):
    prompt_len = len(pair["prompt_tokens"])
    for side, name in enumerate(("chosen", "rejected")):
      tokens = np.asarray(pair[f"{name}_tokens"])[:row_len - prompt_len]
      mask = np.asarray(pair.get(f"{name}_mask", np.ones(len(tokens))))[:len(tokens)] != 0
      positions = prompt_len - 1 + np.arange(len(tokens))
      out[0, side, i] = table[tokens, positions][mask].sum()
      out[1, side, i] = mask.sum()
  return out


def packed_sums(batch, values, num_pairs):
  """`preference.pair_sums` of each micro-batch, by input pair: `[2 (chosen, rejected), N]`."""
  out = np.full((2, num_pairs), np.nan)
  for m in range(batch["tokens"].shape[0]):
    masked = np.where(batch["loss_mask"][m], values[m], 0.0)
    chosen, rejected = preference.pair_sums(jnp.asarray(masked), batch["pair_ids"][m],
                                            batch["chosen"][m], batch["pair_mask"].shape[1])
    for slot, index in enumerate(batch["pair_index"][m]):
      if index >= 0:
        out[:, index] = chosen[slot], rejected[slot]
  return out


def test_pair_sums_from_the_packed_batch_equal_the_sequences_own():
  pairs = random_pairs(0, num_pairs=13)
  pairs[5]["chosen_tokens"] = np.arange(1, 40)  # cut to fit the row
  pairs[5]["chosen_mask"] = np.ones(39, bool)
  batch = preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=2, pad_id=0)
  num_micro, rows, _ = batch["tokens"].shape
  assert rows == 2 and num_micro & (num_micro - 1) == 0
  slots = batch["pair_mask"].shape[1]
  assert slots & (slots - 1) == 0 and batch["pair_mask"].sum() == 13
  assert sorted(batch["pair_index"][batch["pair_mask"]]) == list(range(13))
  assert int(batch["truncated"]) == 1
  for m in range(num_micro):
    for slot in range(slots):
      in_slot = batch["pair_ids"][m] == slot
      halves = {bool(c) for c in batch["chosen"][m][in_slot]}
      assert halves == ({True, False} if batch["pair_mask"][m, slot] else set())
    assert np.all((batch["pair_ids"][m] >= 0) == (batch["segment_ids"][m] > 0))

  table = np.random.default_rng(1).normal(size=(CFG.vocab_size, ROW_LEN))
  values = table[batch["targets"], batch["positions"]]
  want = direct_sums(pairs, table, ROW_LEN)
  np.testing.assert_allclose(packed_sums(batch, values, len(pairs)), want[0], rtol=1e-5)
  counts = packed_sums(batch, np.ones(values.shape), len(pairs))
  np.testing.assert_array_equal(counts, want[1])
  assert counts[0, 5] == ROW_LEN - len(pairs[5]["prompt_tokens"])


def test_pairs_fill_rows_without_padding_when_they_can():
  """Each pair is two 6-token sequences: two pairs fill a row of 24, so 16 pairs take
  exactly 8 rows, 4 micro-batches of 2 rows, no padding at all."""
  rng = np.random.default_rng(0)
  pairs = [dict(prompt_tokens=rng.integers(1, 50, 3), chosen_tokens=rng.integers(1, 50, 3),
                rejected_tokens=rng.integers(1, 50, 3)) for _ in range(16)]
  batch = preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=2)
  assert batch["tokens"].shape == (4, 2, ROW_LEN)
  assert (batch["segment_ids"] > 0).all() and batch["pair_mask"].shape == (4, 4)
  assert batch["pair_mask"].all() and int(batch["truncated"]) == 0
  # Three pairs of two 12-token sequences fill three one-row micro-batches; a fourth,
  # empty, rounds their count up to a power of two.
  full = [dict(p, prompt_tokens=np.arange(1, 7), chosen_tokens=np.arange(1, 7),
               rejected_tokens=np.arange(1, 7)) for p in pairs[:3]]
  lone = preference.pack_pairs(full, ROW_LEN, rows_per_microbatch=1)
  assert lone["tokens"].shape == (4, 1, ROW_LEN)
  assert lone["pair_mask"].sum(1).tolist() == [1, 1, 1, 0]
  assert (lone["segment_ids"][:3] > 0).all() and not lone["segment_ids"][3].any()


def test_hostile_pairs_raise_one_line_errors_naming_the_pair():
  good = random_pairs(2, num_pairs=3)

  def pack(bad_index, rows=2, **changes):
    pairs = [dict(p) for p in good]
    pairs[bad_index].update(changes)
    for key, value in changes.items():
      if value is None:
        del pairs[bad_index][key]
    return preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=rows, truncate=True)

  with pytest.raises(ValueError, match="pair 2: empty chosen_tokens"):
    pack(2, chosen_tokens=np.array([], np.int32), chosen_mask=None)
  with pytest.raises(ValueError, match="pair 1: empty rejected_tokens"):
    pack(1, rejected_tokens=[])
  with pytest.raises(ValueError, match="pair 0: prompt of 24 tokens leaves no response token"):
    pack(0, prompt_tokens=np.ones(24, np.int32))
  with pytest.raises(ValueError, match="pair 1: empty prompt_tokens"):
    pack(1, prompt_tokens=[])
  with pytest.raises(ValueError, match=r"pair 2: unknown key\(s\) \['answer'\]; known: prompt"):
    pack(2, answer=[1, 2])
  with pytest.raises(ValueError, match=r"pair 0: missing \['rejected_tokens'\]"):
    pack(0, rejected_tokens=None)
  with pytest.raises(ValueError, match="pair 1: chosen_mask has shape"):
    pack(1, chosen_tokens=[4, 5, 6], chosen_mask=[1, 0])
  with pytest.raises(ValueError, match=r"pair 1: no scored chosen token \(chosen_mask is all 0"):
    pack(1, chosen_tokens=[4, 5, 6], chosen_mask=[0, 0, 0])
  with pytest.raises(ValueError, match="pair 2: no scored rejected token within row_len 24"):
    pack(2, prompt_tokens=np.ones(20, np.int32), rejected_tokens=np.ones(9, np.int32),
         rejected_mask=np.arange(9) > 5)
  with pytest.raises(ValueError, match="pair 0: rejected_tokens must hold integer token ids"):
    pack(0, rejected_tokens=[1.5, 2.0])
  with pytest.raises(ValueError, match="pair 2: its sequences of 20 and 20 tokens do not fit"):
    pack(2, rows=1, prompt_tokens=np.ones(10, np.int32), chosen_tokens=np.ones(10, np.int32),
         rejected_tokens=np.ones(10, np.int32), chosen_mask=None)
  with pytest.raises(ValueError, match="pair 1: the chosen sequence has 30 tokens > row_len 24"):
    preference.pack_pairs([good[0], dict(good[1], prompt_tokens=np.ones(5, np.int32),
                                         chosen_tokens=np.ones(25, np.int32),
                                         chosen_mask=None)],
                          ROW_LEN, rows_per_microbatch=2, truncate=False)
  with pytest.raises(ValueError, match="pair 0: expected a mapping"):
    preference.pack_pairs([[1, 2, 3]], ROW_LEN, rows_per_microbatch=2)
  with pytest.raises(ValueError, match="non-empty sequence of pairs"):
    preference.pack_pairs([], ROW_LEN, rows_per_microbatch=2)


# -- the step ------------------------------------------------------------------------------


def numpy_pair_values(batch, logprobs):
  """(summed log-probs of chosen, of rejected, scored tokens of each) per real pair slot."""
  out = []
  for m, k in zip(*np.nonzero(batch["pair_mask"])):
    scored = batch["loss_mask"][m] & (batch["pair_ids"][m] == k)
    chosen, rejected = scored & batch["chosen"][m], scored & ~batch["chosen"][m]
    lp = np.asarray(logprobs[m], np.float64)
    out.append((lp[chosen].sum(), lp[rejected].sum(), chosen.sum(), rejected.sum()))
  return np.array(out).T


def reference_params(mesh, seed=1):
  return state_lib.frozen_copy(fresh_state(CFG, optax.sgd(1.0), mesh, seed=seed).params)


@pytest.mark.parametrize("case", ["cdpo+sft", "ipo", "hinge", "simpo+sft", "orpo", "nca_pair"])
def test_step_loss_is_the_loss_of_the_models_logprobs(case):
  cfg = {"cdpo+sft": PreferenceConfig("sigmoid", beta=0.5, label_smoothing=0.1, sft_coef=0.3),
         "nca_pair": PreferenceConfig("nca_pair", beta=0.5),
         "ipo": PreferenceConfig("ipo", beta=0.2),
         "hinge": PreferenceConfig("hinge", beta=2.0),
         "orpo": PreferenceConfig("orpo", beta=0.3),
         "simpo+sft": PreferenceConfig("simpo", beta=2.0, simpo_gamma=0.3, sft_coef=0.5)}[case]
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  state = fresh_state(CFG, optimizer, mesh)
  batch = preference.pack_pairs(random_pairs(5, num_pairs=7), ROW_LEN, rows_per_microbatch=2)
  compute_logprobs = ts.make_compute_logprobs(CFG, mesh=mesh)
  policy = np.asarray(compute_logprobs(state.params, batch)["logprobs"])
  ref = np.asarray(compute_logprobs(reference_params(mesh), batch)["logprobs"])
  if cfg.needs_reference:
    batch["ref_logprobs"] = ref
  _, metrics = ts.make_preference_step(CFG, cfg, optimizer, mesh=mesh)(state, batch)

  pc, pr, nc, nr = numpy_pair_values(batch, policy)
  rc, rr, _, _ = numpy_pair_values(batch, ref)
  want = oracle_pair_losses(cfg, pc, pr, rc, rr, nc, nr).mean()
  np.testing.assert_allclose(metrics["loss/preference"], want, rtol=1e-5)
  if cfg.sft_coef or cfg.loss == "orpo":
    scored_chosen = batch["loss_mask"] & batch["chosen"]
    nll = -policy[scored_chosen].mean()
    np.testing.assert_allclose(metrics["loss/sft"], nll, rtol=1e-5)
    want += (1.0 if cfg.loss == "orpo" else cfg.sft_coef) * nll
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)
  reward_c, reward_r = oracle_rewards(cfg, pc, pr, rc, rr, nc, nr)
  np.testing.assert_allclose(metrics["rewards/margin"], (reward_c - reward_r).mean(),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["logps/chosen"], pc.mean(), rtol=1e-5)
  assert float(metrics["pairs"]) == 7 and float(metrics["nonfinite"]) == 0


def one_update(cfg, mesh, batch, *, reference_in_step=False, reference=None, steps=1):
  optimizer = optax.sgd(1.0)  # the parameter change is the gradient itself
  step = ts.make_preference_step(CFG, cfg, optimizer, mesh=mesh,
                                 reference_in_step=reference_in_step)
  state = fresh_state(CFG, optimizer, mesh)
  start = state_lib.frozen_copy(state.params)  # the step donates the state
  for _ in range(steps):
    state, metrics = step(state, batch, reference) if reference_in_step else step(state, batch)
  # In numpy: eager jnp would compile a subtraction per parameter shape and sharding.
  return jax.tree.map(np.subtract, state.params, start), metrics


def with_reference(batch, mesh, reference):
  logprobs = ts.make_compute_logprobs(CFG, mesh=mesh)(reference, batch)["logprobs"]
  return dict(batch, ref_logprobs=np.asarray(logprobs))


def assert_metrics_close(a, b, rtol=1e-5):
  assert set(a) == set(b)
  for name in a:
    np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=1e-6, err_msg=name)


def test_more_microbatches_give_the_same_update():
  """One pair per row and micro-batch (8 micro-batches, one of them empty) or all seven
  pairs in one micro-batch: the same loss, metrics and gradient."""
  cfg = PreferenceConfig("sigmoid", beta=0.5, sft_coef=0.2)
  mesh = one_device_mesh()
  reference = reference_params(mesh)
  pairs = random_pairs(6, num_pairs=7)
  batches = [preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=rows)
             for rows in (8, 1)]
  assert [b["tokens"].shape[0] for b in batches] == [1, 8]
  results = [one_update(cfg, mesh, with_reference(b, mesh, reference)) for b in batches]
  (delta_one, metrics_one), (delta_many, metrics_many) = results
  assert np.abs(delta_one["embed"][...]).max() > 1e-4
  assert_trees_close(delta_many, delta_one, atol=1e-6)
  assert_metrics_close(metrics_many, metrics_one)


def test_eight_devices_match_one_device():
  """data 2 x fsdp 2 x tensor 2: two SGD steps equal one device's."""
  cfg = PreferenceConfig("ipo", beta=0.2)
  batch = preference.pack_pairs(random_pairs(7, num_pairs=9), ROW_LEN, rows_per_microbatch=4)
  results = []
  for mesh in (one_device_mesh(), models.make_mesh((2, 2, 2, 1))):
    results.append(one_update(cfg, mesh, with_reference(batch, mesh, reference_params(mesh)),
                              steps=2))
  (delta_1, metrics_1), (delta_8, metrics_8) = results
  assert np.abs(delta_1["embed"][...]).max() > 1e-4
  # IPO's squared loss makes large SGD steps: float32 sums in another order differ by
  # a few parts in 1e5 of them.
  assert_trees_close(delta_8, delta_1, atol=1e-5, rtol=1e-4)
  assert_metrics_close(metrics_8, metrics_1, rtol=1e-4)


def test_reference_in_step_matches_precomputed_reference_logprobs():
  cfg = PreferenceConfig("sigmoid", beta=0.5)
  mesh = one_device_mesh()
  reference = reference_params(mesh)
  before = snapshot(reference)
  batch = preference.pack_pairs(random_pairs(8, num_pairs=6), ROW_LEN, rows_per_microbatch=2)
  delta_in, metrics_in = one_update(cfg, mesh, batch, reference_in_step=True,
                                    reference=reference)
  delta_out, metrics_out = one_update(cfg, mesh, with_reference(batch, mesh, reference))
  assert abs(float(metrics_in["rewards/margin"])) > 1e-3  # a reference other than the policy
  assert_trees_close(delta_in, delta_out, atol=1e-6)
  assert_metrics_close(metrics_in, metrics_out)
  for x, y in zip(snapshot(reference), before, strict=True):
    np.testing.assert_array_equal(x, y)


def test_lora_step_trains_the_adapters_against_the_base():
  cfg = PreferenceConfig("sigmoid", beta=1.0)
  lora_cfg = CFG.replace(lora_rank=4, lora_alpha=8.0)
  mesh = one_device_mesh()
  optimizer = state_lib.make_optimizer(3e-2, warmup=0, total_steps=10)
  state = state_lib.init_train_state(models.create_model(lora_cfg), optimizer, mesh=mesh)
  base = snapshot(state_lib.split_trainable(state.params)[1])
  adapters = snapshot(state_lib.split_trainable(state.params)[0])
  step = ts.make_preference_step(lora_cfg, cfg, optimizer, mesh=mesh, reference_in_step=True)
  batch = preference.pack_pairs(random_pairs(9, num_pairs=4), ROW_LEN, rows_per_microbatch=2)
  state, first = step(state, batch)
  # B starts at zero: the policy is its base, the reference.
  np.testing.assert_allclose(first["loss"], np.log(2), rtol=1e-6)
  assert float(first["rewards/accuracy"]) == 0.0
  state, _ = step(state, batch)
  moved = snapshot(state_lib.split_trainable(state.params)[0])
  assert all(not np.array_equal(a, b) for a, b in zip(moved, adapters))
  for a, b in zip(snapshot(state_lib.split_trainable(state.params)[1]), base, strict=True):
    np.testing.assert_array_equal(a, b)
  # The in-step reference is the base's log-probs computed outside.
  outside = ts.make_preference_step(lora_cfg, cfg, optimizer, mesh=mesh, donate=False)
  ref = ts.make_compute_logprobs(lora_cfg, mesh=mesh)(models.without_lora(state.params), batch)
  copy = jax.tree.map(lambda x: x.copy(), state)
  s_in, m_in = step(copy, batch)
  s_out, m_out = outside(state, dict(batch, ref_logprobs=ref["logprobs"]))
  assert float(m_in["rewards/margin"]) > 0
  assert_metrics_close(m_in, m_out)
  assert_trees_close(state_lib.split_trainable(s_in.params)[0],
                     state_lib.split_trainable(s_out.params)[0], atol=1e-6)
  with pytest.raises(ValueError, match="base weights, already in the state"):
    step(s_in, batch, s_in.params)


def test_dpo_steps_learn_to_prefer_the_chosen_responses():
  """Twenty Adam steps from policy == reference: every pair's chosen log-ratio ends above
  its rejected one, judged by fresh log-probs of the trained policy."""
  mesh = one_device_mesh()
  cfg = PreferenceConfig("sigmoid", beta=0.1)
  optimizer = state_lib.make_optimizer(1e-2, warmup=0, total_steps=20)
  state = fresh_state(CFG, optimizer, mesh)
  compute_logprobs = ts.make_compute_logprobs(CFG, mesh=mesh)
  reference = state_lib.frozen_copy(state.params)
  batch = preference.pack_pairs(random_pairs(10, num_pairs=6), ROW_LEN, rows_per_microbatch=2)
  batch["ref_logprobs"] = np.asarray(compute_logprobs(reference, batch)["logprobs"])
  step = ts.make_preference_step(CFG, cfg, optimizer, mesh=mesh)
  history = []
  for _ in range(20):
    state, metrics = step(state, batch)
    history.append({k: float(v) for k, v in metrics.items()})
  assert history[0]["rewards/accuracy"] == 0.0
  np.testing.assert_allclose(history[0]["loss"], np.log(2), rtol=1e-6)
  assert history[-1]["rewards/accuracy"] == 1.0 and history[-1]["rewards/margin"] > 0
  assert history[-1]["loss"] < 0.9 * np.log(2)
  pc, pr, _, _ = numpy_pair_values(batch, np.asarray(compute_logprobs(state.params,
                                                                      batch)["logprobs"]))
  rc, rr, _, _ = numpy_pair_values(batch, batch["ref_logprobs"])
  assert ((pc - rc) - (pr - rr)).min() > 0.5
  assert step.jitted._cache_size() == 1


def test_nonfinite_batch_leaves_the_state_unchanged():
  mesh = one_device_mesh()
  optimizer = state_lib.make_optimizer(1e-2, warmup=0, total_steps=10)
  step = ts.make_preference_step(CFG, PreferenceConfig(), optimizer, mesh=mesh)
  state = fresh_state(CFG, optimizer, mesh)
  clean = preference.pack_pairs(random_pairs(11, num_pairs=4), ROW_LEN, rows_per_microbatch=2)
  clean = with_reference(clean, mesh, reference_params(mesh))
  scored = clean["loss_mask"]

  # Garbage where nothing is scored never reaches the loss.
  hidden = dict(clean, ref_logprobs=np.where(scored, clean["ref_logprobs"], np.nan))
  state, metrics = step(state, hidden)
  assert float(metrics["nonfinite"]) == 0 and int(state.step) == 1

  params, opt_state = snapshot(state.params), snapshot(state.opt_state)
  poisoned = dict(clean, ref_logprobs=clean["ref_logprobs"].copy())
  poisoned["ref_logprobs"][tuple(np.argwhere(scored)[0])] = np.nan
  state, metrics = step(state, poisoned)
  assert float(metrics["nonfinite"]) == 1 and not np.isfinite(float(metrics["loss"]))
  assert int(state.step) == 1
  for x, y in zip(snapshot(state.params), params, strict=True):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(snapshot(state.opt_state), opt_state, strict=True):
    np.testing.assert_array_equal(x, y)
  state, metrics = step(state, clean)
  assert float(metrics["nonfinite"]) == 0 and int(state.step) == 2


def test_router_aux_loss_joins_the_preference_loss():
  moe_cfg = models.get_preset("tiny", num_layers=1, ffn_dim=64, logprob_chunk=8, num_experts=4,
                              num_experts_per_tok=2, init_std=0.1, router_aux_loss_coef=0.5)
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  state = fresh_state(moe_cfg, optimizer, mesh)
  batch = preference.pack_pairs(random_pairs(12, num_pairs=4), ROW_LEN, rows_per_microbatch=1)
  step = ts.make_preference_step(moe_cfg, PreferenceConfig("simpo", beta=2.0), optimizer,
                                 mesh=mesh)
  _, metrics = step(state, batch)
  assert float(metrics["loss/router_aux"]) > 0
  np.testing.assert_allclose(metrics["loss"], metrics["loss/preference"]
                             + 0.5 * metrics["loss/router_aux"], rtol=1e-5)


def test_step_misuse_raises():
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  state = fresh_state(CFG, optimizer, mesh)
  batch = preference.pack_pairs(random_pairs(0, num_pairs=2), ROW_LEN, rows_per_microbatch=2)
  with pytest.raises(ValueError, match="the simpo loss reads no reference"):
    ts.make_preference_step(CFG, PreferenceConfig("simpo"), optimizer, mesh=mesh,
                            reference_in_step=True)
  step = ts.make_preference_step(CFG, PreferenceConfig(), optimizer, mesh=mesh)
  with pytest.raises(ValueError, match=r"missing \['ref_logprobs'\]"):
    step(state, batch)
  with pytest.raises(ValueError, match="built without reference_in_step=True"):
    step(state, batch, state.params)
  batch["ref_logprobs"] = np.zeros(batch["tokens"].shape, np.float32)
  with pytest.raises(ValueError, match=r"batch\['pair_ids'\] has shape \(1, 2, 23\)"):
    step(state, dict(batch, pair_ids=batch["pair_ids"][..., :-1]))
  with pytest.raises(ValueError, match="pair_mask'\\] must be \\[microbatches, pairs\\]"):
    step(state, dict(batch, pair_mask=batch["pair_mask"][0]))


# ---------------------------------------------------------------------------------------
# Online pairs from scored groups
# ---------------------------------------------------------------------------------------


def _samples(responses, prompt=(7, 8)):
  return [{"prompt_tokens": np.asarray(prompt), "response_tokens": np.asarray(r),
           "response_mask": np.ones(len(r), np.int32)} for r in responses]


def test_pairs_from_group_prefers_the_best_over_the_worst_deterministically():
  samples = _samples([[1], [2], [3], [4], [5], [6]])
  rewards = [0.5, 1.0, 0.0, 1.0, 0.0, 0.5]
  (pair,) = preference.pairs_from_group(samples, rewards)
  # Best: the first of the two 1.0s; worst: the last of the two 0.0s.
  assert pair["chosen_tokens"].tolist() == [2] and pair["rejected_tokens"].tolist() == [5]
  assert pair["prompt_tokens"].tolist() == [7, 8] and pair["chosen_mask"].tolist() == [1]
  two = preference.pairs_from_group(samples, rewards, pairs_per_group=2)
  assert [(p["chosen_tokens"][0], p["rejected_tokens"][0]) for p in two] == [(2, 5), (4, 3)]
  # The third pair would tie (0.5 against 0.5): no pair.
  assert len(preference.pairs_from_group(samples, rewards, pairs_per_group=3)) == 2
  assert preference.pairs_from_group(samples, [1.0] * 6) == []
  # A sample with no response token takes no part.
  empty = _samples([[1], [], [3]])
  (p,) = preference.pairs_from_group(empty, [1.0, 0.0, 0.5])
  assert (p["chosen_tokens"].tolist(), p["rejected_tokens"].tolist()) == ([1], [3])
  with pytest.raises(ValueError, match="share their prompt tokens"):
    preference.pairs_from_group(_samples([[1]]) + _samples([[2]], prompt=(9,)), [1.0, 0.0])
  with pytest.raises(ValueError, match="2 samples but 1 rewards"):
    preference.pairs_from_group(_samples([[1], [2]]), [1.0])


@pytest.mark.parametrize("knobs, bad", [
    (dict(kl_coef=0.1), "kl_coef"), (dict(group_size=1), "group_size"),
    (dict(pairs_per_group=5), "pairs_per_group"), (dict(num_minibatches=2), "num_minibatches"),
])
def test_online_dpo_preset_refuses_knobs_it_cannot_honour(knobs, bad):
  from posttrain.rl import presets
  cfg = presets.algorithm_config("online_dpo")
  assert presets.preference_config(cfg) == preference.PreferenceConfig(loss="sigmoid", beta=0.1)
  assert presets.preference_config(presets.algorithm_config("grpo")) is None
  with pytest.raises(ValueError, match=f"invalid {bad}="):
    presets.algorithm_config("online_dpo", **knobs)
  with pytest.raises(ValueError, match="unknown preference loss"):
    presets.algorithm_config("grpo", preference_loss="dpo")
  # An unpaired loss labels samples instead of pairing them (online KTO).
  kto_cfg = presets.algorithm_config("online_dpo", preference_loss="kto",
                                     undesirable_weight=2.0)
  assert presets.preference_config(kto_cfg) == preference.PreferenceConfig(
      loss="kto", beta=0.1, undesirable_weight=2.0)
  with pytest.raises(ValueError, match="desirable_weight"):
    presets.algorithm_config("online_dpo", desirable_weight=2.0)  # a paired loss
  with pytest.raises(ValueError, match="invalid undesirable_weight="):
    presets.algorithm_config("grpo", undesirable_weight=2.0)  # no preference loss
