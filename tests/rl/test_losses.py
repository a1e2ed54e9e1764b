"""Losses against numpy references: values, gradients, masking, exact micro-batching."""

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.rl import losses

BATCH, LENGTH = 5, 7


def _surrogate_ref(log_ratio, adv, mask, eps_low, eps_high, dual_clip):
  ratio = np.exp(log_ratio)
  loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high))
  if dual_clip:
    loss = np.where(adv < 0, np.minimum(loss, -dual_clip * adv), loss)
  return np.where(mask, loss, 0.0)


def _inputs(seed, batch=BATCH, length=LENGTH, spread=0.5):
  rng = np.random.default_rng(seed)
  logp = -rng.random((batch, length)) * 3
  old = logp + rng.normal(size=(batch, length)) * spread
  adv = rng.normal(size=(batch, length))
  mask = rng.random((batch, length)) < 0.7
  return logp.astype(np.float32), old.astype(np.float32), adv.astype(np.float32), mask


def _with_garbage(x, mask, value=np.nan):
  return np.where(mask, x, value).astype(np.float32)


@pytest.mark.parametrize("dual_clip", [0.0, 3.0])
def test_ppo_surrogate_matches_reference(dual_clip):
  logp, old, adv, mask = _inputs(0, spread=1.0)
  got, metrics = losses.ppo_policy_loss(
      _with_garbage(logp, mask), _with_garbage(old, mask, np.inf), _with_garbage(adv, mask), mask,
      eps_low=0.2, eps_high=0.28, dual_clip=dual_clip,
  )
  want = _surrogate_ref(logp - old, adv, mask, 0.2, 0.28, dual_clip)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  ratio = np.exp(logp - old)
  n = mask.sum()
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(m["clip_fraction/high"], (mask & (adv > 0) & (ratio > 1.28)).sum() / n)
  np.testing.assert_allclose(m["clip_fraction/low"], (mask & (adv < 0) & (ratio < 0.8)).sum() / n)
  np.testing.assert_allclose(m["ratio/mean"], ratio[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(m["ratio/max"], ratio[mask].max(), rtol=1e-5)
  if dual_clip:
    want_dual = (mask & (adv < 0) & (ratio > dual_clip)).sum() / n
    assert want_dual > 0
    np.testing.assert_allclose(m["clip_fraction/dual"], want_dual)


@pytest.mark.parametrize("dual_clip", [0.0, 3.0])
def test_surrogate_gradient_is_zero_exactly_where_clipped(dual_clip):
  logp, old, adv, mask = _inputs(1, batch=11, length=13, spread=1.0)
  eps_low, eps_high = 0.2, 0.28

  def total(lp):
    loss, _ = losses.ppo_policy_loss(lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high,
                                     dual_clip=dual_clip)
    return jnp.sum(loss)

  # Garbage at masked positions of the differentiated input must not reach the gradient.
  old, adv = _with_garbage(old, mask, np.inf), _with_garbage(adv, mask)
  grad = np.asarray(jax.grad(total)(_with_garbage(logp, mask)))
  ratio = np.exp(logp - old)
  clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
  if dual_clip:
    clipped |= (adv < 0) & (ratio > dual_clip)
  assert clipped[mask].any() and (~clipped[mask]).any()
  assert np.all(grad[mask & clipped] == 0.0)
  # Unclipped: d/dlogp (-A r) = -A r.
  live = mask & ~clipped
  np.testing.assert_allclose(grad[live], (-adv * ratio)[live], rtol=1e-5)
  assert np.all(grad[~mask] == 0.0)


def _segments_and_mask(rng, batch, length):
  segment_ids = np.zeros((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), size=2, replace=False))
    segment_ids[b, : cuts[0]] = 1
    segment_ids[b, cuts[0] : cuts[1]] = 2
  mask = (rng.random((batch, length)) < 0.8) & (segment_ids > 0)
  return segment_ids, mask


def test_gspo_matches_sequence_level_objective_in_value_and_gradient():
  rng = np.random.default_rng(2)
  batch, length = 5, 11
  segment_ids, mask = _segments_and_mask(rng, batch, length)
  logp = (-rng.random((batch, length)) * 2).astype(np.float32)
  old = (logp + rng.normal(size=(batch, length)) * 3e-4).astype(np.float32)
  seq_adv = rng.normal(size=(batch, 3))
  adv = np.take_along_axis(seq_adv, segment_ids, axis=1).astype(np.float32)
  eps_low, eps_high = 3e-4, 4e-4

  def gspo_token(lp):
    per_token, _ = losses.gspo_policy_loss(
        lp, _with_garbage(old, mask), _with_garbage(adv, mask), mask,
        eps_low=eps_low, eps_high=eps_high, segment_ids=segment_ids)
    w, d = losses.token_weights(mask, "seq_mean_token_mean", segment_ids=segment_ids)
    return losses.aggregate(per_token, w, d)

  def sequence_level(lp):
    # 1/N sum_i -min(s_i A_i, clip(s_i) A_i), s_i from the length-normalised log ratio.
    total, count = 0.0, 0
    for b in range(batch):
      for s in (1, 2):
        sel = (segment_ids[b] == s) & mask[b]
        if not sel.any():
          continue
        log_s = jnp.sum(jnp.where(sel, lp[b] - old[b], 0.0)) / sel.sum()
        ratio = jnp.exp(log_s)
        a = seq_adv[b, s]
        total += -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
        count += 1
    return total / count

  gspo_token, sequence_level = jax.jit(gspo_token), jax.jit(sequence_level)
  np.testing.assert_allclose(gspo_token(logp), sequence_level(logp), rtol=1e-5)
  g_token = jax.jit(jax.grad(gspo_token))(_with_garbage(logp, mask))
  g_seq = jax.jit(jax.grad(sequence_level))(logp)
  np.testing.assert_allclose(g_token, np.where(mask, g_seq, 0.0), rtol=1e-4, atol=1e-7)

  # Every token of a sequence sees the same (sequence) ratio.
  _, metrics = losses.gspo_policy_loss(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high,
                                       segment_ids=segment_ids)
  log_ratio = losses.gspo_log_ratio(logp, old, mask, segment_ids)
  for b in range(batch):
    for s in (1, 2):
      sel = (segment_ids[b] == s) & mask[b]
      if sel.any():
        np.testing.assert_allclose(log_ratio[b][sel], (logp - old)[b][sel].mean(), atol=1e-6)


def test_cispo_keeps_every_tokens_gradient_weighted_by_the_clipped_ratio():
  """CISPO: value -A clip(r) and gradient -A clip(r) (d/dlogp) at every token, clipped or
  not; PPO's gradient is 0 where it clips. eps_low = 1: no lower bound."""
  logp, old, adv, mask = _inputs(4, batch=11, length=13, spread=1.0)
  eps_low, eps_high = 1.0, 0.28

  def total(lp, fn):
    loss, _ = fn(lp, _with_garbage(old, mask, np.inf), _with_garbage(adv, mask), mask,
                 eps_low=eps_low, eps_high=eps_high)
    return jnp.sum(loss)

  loss, metrics = losses.cispo_policy_loss(_with_garbage(logp, mask), old, adv, mask,
                                           eps_low=eps_low, eps_high=eps_high)
  ratio = np.exp(logp.astype(np.float64) - old)
  weight = np.clip(ratio, 1 - eps_low, 1 + eps_high)
  np.testing.assert_allclose(loss, np.where(mask, -adv * weight, 0.0), rtol=1e-5, atol=1e-6)
  grad = np.asarray(jax.grad(total)(_with_garbage(logp, mask), losses.cispo_policy_loss))
  np.testing.assert_allclose(grad, np.where(mask, -adv * weight, 0.0), rtol=1e-5, atol=1e-6)
  clipped = mask & (ratio > 1 + eps_high)
  assert clipped.any() and np.all(grad[clipped] != 0)
  ppo_grad = np.asarray(jax.grad(total)(logp, losses.ppo_policy_loss))
  assert np.all(ppo_grad[clipped & (adv > 0)] == 0)  # where PPO drops the token
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(m["clip_fraction/high"], clipped.sum() / mask.sum())
  assert float(m["clip_fraction/low"]) == 0.0
  np.testing.assert_allclose(m["ratio/mean"], ratio[mask].mean(), rtol=1e-5)


def test_gmpo_matches_its_sequence_level_objective_in_value_and_gradient():
  """GMPO's token form with seq_mean_token_mean aggregation equals the paper's objective,
  1/N sum_i -A_i exp(mean_t c_t), c_t the log ratio clipped against the advantage's sign."""
  rng = np.random.default_rng(5)
  batch, length = 5, 11
  segment_ids, mask = _segments_and_mask(rng, batch, length)
  logp = (-rng.random((batch, length)) * 2).astype(np.float32)
  old = (logp + rng.normal(size=(batch, length)) * 0.5).astype(np.float32)
  seq_adv = rng.normal(size=(batch, 3))
  adv = np.take_along_axis(seq_adv, segment_ids, axis=1).astype(np.float32)
  eps_low, eps_high = 0.4, 0.3

  def token_form(lp):
    per_token, _ = losses.gmpo_policy_loss(
        lp, _with_garbage(old, mask), _with_garbage(adv, mask), mask,
        eps_low=eps_low, eps_high=eps_high, segment_ids=segment_ids)
    w, d = losses.token_weights(mask, "seq_mean_token_mean", segment_ids=segment_ids)
    return losses.aggregate(per_token, w, d)

  def sequence_level(lp):
    total, count = 0.0, 0
    for b in range(batch):
      for s in (1, 2):
        sel = (segment_ids[b] == s) & mask[b]
        if not sel.any():
          continue
        a = seq_adv[b, s]
        log_r = lp[b] - old[b]
        # Pessimistic: the clip bounds the log ratio only in the direction A pushes it.
        c = (jnp.minimum(log_r, eps_high) if a > 0 else jnp.maximum(log_r, -eps_low))
        total += -a * jnp.exp(jnp.sum(jnp.where(sel, c, 0.0)) / sel.sum())
        count += 1
    return total / count

  token_form, sequence_level = jax.jit(token_form), jax.jit(sequence_level)
  np.testing.assert_allclose(token_form(logp), sequence_level(logp), rtol=1e-5)
  g_token = np.asarray(jax.jit(jax.grad(token_form))(_with_garbage(logp, mask)))
  g_seq = np.asarray(jax.jit(jax.grad(sequence_level))(logp))
  np.testing.assert_allclose(g_token, np.where(mask, g_seq, 0.0), rtol=1e-4, atol=1e-7)
  log_r = logp - old
  clipped = mask & (((adv > 0) & (log_r > eps_high)) | ((adv < 0) & (log_r < -eps_low)))
  assert clipped.any() and np.all(g_token[clipped] == 0)  # clipped tokens: no gradient
  _, metrics = losses.gmpo_policy_loss(logp, old, adv, mask, eps_low=eps_low,
                                       eps_high=eps_high, segment_ids=segment_ids)
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(float(m["clip_fraction/high"]) + float(m["clip_fraction/low"]),
                             clipped.sum() / mask.sum(), rtol=1e-6)


def _sapo_oracle(logp, old, adv, tau_pos, tau_neg):
  """SAPO's value and d/dlogp in float64 numpy: f(r) = 4/tau sigmoid(tau (r - 1))."""
  r = np.exp(logp.astype(np.float64) - old)
  tau = np.where(adv > 0, tau_pos, tau_neg)
  sig = 1.0 / (1.0 + np.exp(-tau * (r - 1.0)))
  return -adv * 4.0 / tau * sig, -adv * 4.0 * sig * (1.0 - sig) * r


def test_sapo_matches_its_soft_gate_in_value_and_gradient():
  """SAPO: value -A 4/tau sigmoid(tau (r - 1)), gradient -A g r with the gate
  g = 4 sigmoid (1 - sigmoid): PPO's gradient on-policy, damped smoothly off it (where PPO
  cuts it to 0 past the clip), sooner for negative advantages (tau_neg > tau_pos)."""
  logp, old, adv, mask = _inputs(7, batch=11, length=13, spread=1.0)
  tau_pos, tau_neg = 1.0, 1.05

  def total(lp, old_lp=old):
    loss, _ = losses.sapo_policy_loss(lp, _with_garbage(old_lp, mask, np.inf),
                                      _with_garbage(adv, mask), mask, eps_low=0.2,
                                      eps_high=0.2, tau_pos=tau_pos, tau_neg=tau_neg)
    return jnp.sum(loss)

  loss, metrics = losses.sapo_policy_loss(_with_garbage(logp, mask), old, adv, mask,
                                          eps_low=0.2, eps_high=0.2, tau_pos=tau_pos,
                                          tau_neg=tau_neg)
  want_loss, want_grad = _sapo_oracle(logp, old, adv, tau_pos, tau_neg)
  np.testing.assert_allclose(loss, np.where(mask, want_loss, 0.0), rtol=1e-5, atol=1e-6)
  grad = np.asarray(jax.grad(total)(_with_garbage(logp, mask)))
  np.testing.assert_allclose(grad, np.where(mask, want_grad, 0.0), rtol=1e-4, atol=1e-6)
  # On-policy (r = 1) the gate is 1: PPO's (and GRPO's) gradient, -A per token.
  on_policy = np.asarray(jax.grad(total)(logp, logp))
  np.testing.assert_allclose(on_policy, np.where(mask, -adv, 0.0), rtol=1e-6, atol=1e-7)
  # Past PPO's band the token keeps a damped gradient where PPO's is 0.
  ratio = np.exp(logp.astype(np.float64) - old)
  beyond = mask & (adv > 0) & (ratio > 1.2)
  assert beyond.any() and np.all(grad[beyond] != 0)
  gate = 4 * (want_grad / (-adv * ratio))
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(m["sapo/gate"], (gate / 4)[mask].mean(), rtol=1e-5)
  damped = mask & (gate / 4 < 0.5)
  np.testing.assert_allclose(float(m["clip_fraction/low"]) + float(m["clip_fraction/high"]),
                             damped.sum() / mask.sum(), rtol=1e-6)
  # The same ratio off 1 damps a negative advantage's token more than a positive one's.
  r = np.float32(1.6)
  lp = np.log(np.array([[r, r]], np.float32))
  g = jax.grad(lambda x: jnp.sum(losses.sapo_policy_loss(
      x, np.zeros((1, 2), np.float32), np.array([[1.0, -1.0]], np.float32),
      np.ones((1, 2), bool), eps_low=0.2, eps_high=0.2, tau_pos=1.0, tau_neg=2.0)[0]))(lp)
  assert abs(float(g[0, 0])) > abs(float(g[0, 1])) > 0
  # A wild ratio (log ratio 60, clipped at MAX_LOG_RATIO) closes the gate: finite, 0.
  wild = jax.grad(total)(np.where(mask, old + 60.0, np.nan).astype(np.float32))
  assert np.all(np.isfinite(wild)) and np.all(np.asarray(wild)[mask] == 0)


def test_sapo_through_rl_loss_uses_the_configured_temperatures():
  logp, old, adv, mask = _inputs(8, batch=6, length=9, spread=0.8)
  batch = {"loss_mask": mask, "advantages": adv, "old_logprobs": old}
  cfg = losses.LossConfig(policy_loss="sapo", sapo_tau_pos=0.5, sapo_tau_neg=3.0,
                          loss_agg_mode="seq_mean_token_mean")
  denominator = losses.loss_denominator(cfg, batch)
  loss, _ = losses.rl_loss(cfg, jnp.asarray(logp), batch, denominator=denominator)
  per_token, _ = _sapo_oracle(logp, old, adv, 0.5, 3.0)
  rows = mask.sum(axis=1)
  want = sum((per_token[b][mask[b]].sum() / rows[b]) for b in range(6) if rows[b])
  np.testing.assert_allclose(float(loss), want / (rows > 0).sum(), rtol=1e-5)
  for bad in (dict(sapo_tau_pos=0.0), dict(sapo_tau_neg=-1.0)):
    with pytest.raises(ValueError, match="sapo_tau_pos and sapo_tau_neg must be > 0"):
      losses.LossConfig(policy_loss="sapo", **bad)
  with pytest.raises(ValueError, match="dual_clip=3.0 applies to the ppo and gspo"):
    losses.LossConfig(policy_loss="sapo", dual_clip=3.0)


def test_gpg_is_the_plain_policy_gradient_without_ratio_or_clip():
  logp, old, adv, mask = _inputs(6, batch=9, length=11, spread=1.0)

  def total(lp):
    loss, _ = losses.gpg_policy_loss(lp, _with_garbage(old, mask, np.inf),
                                     _with_garbage(adv, mask), mask, eps_low=0.2, eps_high=0.2)
    return jnp.sum(loss)

  loss, metrics = losses.gpg_policy_loss(_with_garbage(logp, mask), old, adv, mask,
                                         eps_low=0.2, eps_high=0.2)
  np.testing.assert_allclose(loss, np.where(mask, -adv * logp, 0.0), rtol=1e-6)
  grad = np.asarray(jax.grad(total)(_with_garbage(logp, mask)))
  np.testing.assert_allclose(grad, np.where(mask, -adv, 0.0), rtol=1e-6)  # stale or not
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(m["ratio/mean"], np.exp(logp - old)[mask].mean(), rtol=1e-5)
  assert float(m["clip_fraction/high"]) == float(m["clip_fraction/low"]) == 0.0


def _covariance_ref(adv, logp, mask):
  a, lp = adv.astype(np.float64), logp.astype(np.float64)
  cov = (a - a[mask].mean()) * (lp - lp[mask].mean())
  return np.where(mask, cov, 0.0)


def test_kl_cov_selects_the_top_covariance_tokens_of_the_whole_batch():
  """The k = max(1, floor(fraction * n)) masked tokens of largest (A - mean A)(logp - mean
  logp), as veRL's kl_cov picks them; masked-out garbage takes no part."""
  logp, _, adv, mask = _inputs(8, batch=9, length=13)
  cov = _covariance_ref(adv, logp, mask)
  for fraction in (0.05, 0.2, 1e-4):
    k = max(1, int(fraction * mask.sum()))
    got = np.asarray(losses.covariance_selection(
        _with_garbage(adv, mask), _with_garbage(logp, mask, -np.inf), mask, mode="kl_cov",
        fraction=fraction))
    want = np.zeros(mask.shape, bool)
    order = np.argsort(-np.where(mask, cov, -np.inf), axis=None, kind="stable")[:k]
    want.flat[order] = True
    np.testing.assert_array_equal(got, want, err_msg=f"fraction={fraction}")
  np.testing.assert_allclose(losses.token_covariance(adv, logp, mask), cov, rtol=1e-4,
                             atol=1e-6)
  assert not np.asarray(losses.covariance_selection(
      adv, logp, np.zeros_like(mask), mode="kl_cov", fraction=0.5)).any()  # nothing masked


def test_clip_cov_draws_uniformly_among_tokens_in_the_covariance_window():
  logp, _, adv, mask = _inputs(9, batch=12, length=20)
  adv = adv * 4  # covariances of a few units, as the window (1, 5) expects
  cov = _covariance_ref(adv, logp, mask)
  window = mask & (cov > 1.0) & (cov < 5.0)
  fraction = 0.02
  k = max(1, int(fraction * mask.sum()))
  assert window.sum() > 2 * k

  def select(key, a=adv, lp=logp, m=mask):
    return np.asarray(losses.covariance_selection(a, lp, m, mode="clip_cov", fraction=fraction,
                                                  lower=1.0, upper=5.0, key=key))

  draws = np.stack([select(jax.random.PRNGKey(i)) for i in range(300)])
  assert np.all(draws.sum(axis=(1, 2)) == k)
  assert not (draws & ~window).any()  # only tokens in the window
  # Each token of the window is drawn about k / |window| of the time.
  freq = draws.mean(0)[window]
  np.testing.assert_allclose(freq, k / window.sum(), atol=0.12)
  # Fewer tokens in the window than k: all of them.
  np.testing.assert_array_equal(
      np.asarray(losses.covariance_selection(adv, logp, mask, mode="clip_cov", fraction=1.0,
                                             key=jax.random.PRNGKey(0))), window)
  # The draw is the same whatever leading axes the batch is split into (micro-batches).
  key = jax.random.PRNGKey(3)
  split = select(key, adv.reshape(3, 4, 20), logp.reshape(3, 4, 20), mask.reshape(3, 4, 20))
  np.testing.assert_array_equal(split.reshape(12, 20), select(key))


def test_covariance_losses_act_only_on_the_selected_tokens():
  """clip_cov: PPO's surrogate with the selected tokens' loss and gradient removed; kl_cov:
  the unclipped -A r everywhere plus coef |log r| on the selected ones."""
  logp, old, adv, mask = _inputs(10, batch=9, length=11, spread=0.5)
  rng = np.random.default_rng(0)
  selected = mask & (rng.random(mask.shape) < 0.3)
  ratio = np.exp(logp.astype(np.float64) - old)
  ppo = _surrogate_ref(logp - old, adv, mask, 0.2, 0.28, 0.0)

  def run(fn, lp, **kw):
    loss, metrics = fn(lp, _with_garbage(old, mask, np.inf), _with_garbage(adv, mask), mask,
                       eps_low=0.2, eps_high=0.28, selected=selected, **kw)
    return loss, metrics

  loss, metrics = run(losses.clip_cov_policy_loss, _with_garbage(logp, mask))
  np.testing.assert_allclose(loss, np.where(selected, 0.0, ppo), rtol=1e-5, atol=1e-6)
  grad = np.asarray(jax.grad(lambda lp: jnp.sum(run(losses.clip_cov_policy_loss, lp)[0]))(logp))
  ppo_grad = np.asarray(jax.grad(lambda lp: jnp.sum(losses.ppo_policy_loss(
      lp, old, adv, mask, eps_low=0.2, eps_high=0.28)[0]))(logp))
  np.testing.assert_allclose(grad, np.where(selected, 0.0, ppo_grad), rtol=1e-6)
  assert np.abs(ppo_grad[selected]).max() > 0
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(m["cov/selected_fraction"], selected.sum() / mask.sum())

  loss, metrics = run(losses.kl_cov_policy_loss, _with_garbage(logp, mask), coef=0.7)
  log_r = logp.astype(np.float64) - old
  want = np.where(mask, -adv * ratio + np.where(selected, 0.7 * np.abs(log_r), 0.0), 0.0)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  grad = np.asarray(jax.grad(lambda lp: jnp.sum(run(losses.kl_cov_policy_loss, lp,
                                                    coef=0.7)[0]))(logp))
  want_grad = np.where(mask, -adv * ratio + np.where(selected, 0.7 * np.sign(log_r), 0.0), 0.0)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(m["kl_cov/abs_log_ratio"], np.abs(log_r)[mask].mean(), rtol=1e-5)
  assert float(m["clip_fraction/high"]) == 0.0  # no clip at all
  with pytest.raises(ValueError, match="kl_cov needs the selected tokens"):
    losses.kl_cov_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)


@pytest.mark.parametrize("policy_loss", ["clip_cov", "kl_cov"])
def test_covariance_losses_split_into_microbatches_exactly(policy_loss):
  """Tokens selected over the whole batch first: four micro-batches give the one-batch
  loss and gradient (a per-micro-batch selection would not)."""
  cfg = losses.LossConfig(policy_loss=policy_loss, cov_fraction=0.1, clip_cov_lb=0.1,
                          clip_cov_ub=10.0, loss_agg_mode="seq_mean_token_mean")
  batch = _rollout_batch(14)
  batch["cov_selected"] = losses.covariance_selection(
      batch["advantages"], batch["old_logprobs"], batch["loss_mask"], mode=policy_loss,
      fraction=cfg.cov_fraction, lower=cfg.clip_cov_lb, upper=cfg.clip_cov_ub,
      key=jax.random.PRNGKey(1))
  assert np.asarray(batch["cov_selected"]).sum() >= 4
  params = _params(2)
  denominator = losses.loss_denominator(cfg, batch)
  (full, _), full_grad = jax.value_and_grad(_loss_fn(cfg, batch, denominator),
                                            has_aux=True)(params)
  loss, grad = 0.0, jax.tree.map(jnp.zeros_like, params)
  for i in range(4):
    mb = {k: np.asarray(v)[3 * i:3 * i + 3] for k, v in batch.items()}
    (part, _), g = jax.value_and_grad(_loss_fn(cfg, mb, denominator), has_aux=True)(params)
    loss, grad = loss + part, jax.tree.map(jnp.add, grad, g)
  np.testing.assert_allclose(loss, full, rtol=1e-5, atol=1e-6)
  for key in params:
    np.testing.assert_allclose(grad[key], full_grad[key], rtol=1e-5, atol=1e-6)
  del batch["cov_selected"]
  with pytest.raises(ValueError, match=r"batch lacks \['cov_selected'\]"):
    losses.rl_loss(cfg, jnp.zeros((12, LENGTH)), batch, denominator=1.0)


def _high_entropy_oracle(entropies, mask, fraction):
  """The paper's top-k in numpy: k = max(1, ceil(fraction n)) of the masked tokens of
  largest entropy, ties to the earlier one; fraction read as the decimal it was written."""
  k = max(1, math.ceil(fractions.Fraction(str(fraction)) * int(mask.sum())))
  order = np.argsort(-np.where(mask, entropies, -np.inf), axis=None, kind="stable")[:k]
  selected = np.zeros(mask.shape, bool)
  selected.flat[order] = True
  return selected & mask


def test_high_entropy_selection_keeps_the_top_fraction_of_the_whole_batch():
  """k = max(1, ceil(fraction n)) masked tokens of largest entropy, ties to the earlier
  token, the same whatever leading axes split the batch; masked-out garbage takes no part."""
  rng = np.random.default_rng(11)
  mask = rng.random((12, 13)) < 0.7
  entropies = rng.gamma(2.0, 0.5, mask.shape).astype(np.float32)
  ties = np.round(entropies, 1)  # many equal values
  for ent in (entropies, ties):
    for fraction in (0.2, 0.05, 1e-4, 0.5, 0.7, 1.0):
      got = np.asarray(losses.high_entropy_selection(_with_garbage(ent, mask), mask,
                                                     fraction=fraction))
      want = _high_entropy_oracle(ent, mask, fraction)
      np.testing.assert_array_equal(got, want, err_msg=f"fraction={fraction}")
  assert np.asarray(losses.high_entropy_selection(entropies, mask, fraction=1.0)).sum() \
      == mask.sum()  # 1 keeps every trained token
  # ceil of an exact product is that integer: 0.3 * 10 and 0.7 * 10 (3.0000000000000004 and
  # 7.000000000000001 in float64) keep 3 and 7 of 10 tokens.
  ten = np.zeros((2, 7), bool)
  ten.flat[:10] = True
  for fraction, k in ((0.3, 3), (0.7, 7), (0.25, 3), (0.01, 1)):
    assert np.asarray(losses.high_entropy_selection(entropies[:2, :7], ten,
                                                    fraction=fraction)).sum() == k
  # Micro-batch axes in front select the same tokens as the flat batch.
  split = losses.high_entropy_selection(ties.reshape(3, 4, 13), mask.reshape(3, 4, 13),
                                        fraction=0.2)
  np.testing.assert_array_equal(np.asarray(split).reshape(12, 13),
                                _high_entropy_oracle(ties, mask, 0.2))
  assert not np.asarray(losses.high_entropy_selection(entropies, np.zeros_like(mask),
                                                      fraction=0.5)).any()
  for fraction in (0.0, 1.5):
    with pytest.raises(ValueError, match=f"fraction must be in \\(0, 1\\], got {fraction}"):
      losses.high_entropy_selection(entropies, mask, fraction=fraction)
  with pytest.raises(ValueError, match=r"entropies shape \(12, 13\) != loss_mask shape"):
    losses.high_entropy_selection(entropies, mask[:, :5], fraction=0.2)


def _token_weights_ref(mask, segment_ids, mode):
  """(w, D) of token_mean or seq_mean_token_mean, in numpy."""
  if mode == "token_mean":
    return mask.astype(np.float64), mask.sum()
  weights, sequences = np.zeros(mask.shape), 0
  for b in range(mask.shape[0]):
    for s in np.unique(segment_ids[b][mask[b]]):
      tokens = mask[b] & (segment_ids[b] == s)
      weights[b][tokens] = 1.0 / tokens.sum()
      sequences += 1
  return weights, sequences


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_rl_loss_keeps_the_policy_term_of_the_selected_tokens_only(mode):
  """top_entropy_fraction: the policy loss and its gradient only on the selected tokens, the
  normaliser of every trained token, the KL and entropy terms on every token."""
  cfg = losses.LossConfig(loss_agg_mode=mode, eps_high=0.28, kl_coef=0.1, entropy_coef=0.01,
                          top_entropy_fraction=0.3)
  batch = _rollout_batch(15)
  mask, seg = batch["loss_mask"], batch["segment_ids"]
  rng = np.random.default_rng(15)
  old = np.where(mask, batch["old_logprobs"], 0.0).astype(np.float64)
  logp = old + rng.normal(0, 0.4, mask.shape)
  entropies = rng.gamma(2.0, 0.5, mask.shape)
  selected = _high_entropy_oracle(entropies, mask, cfg.top_entropy_fraction)
  batch["entropy_selected"] = selected
  assert 0 < selected.sum() < mask.sum()
  weights, d = _token_weights_ref(mask, seg, mode)
  denominator = 2.0 * d  # the step's: other micro-batches' tokens count too

  def run(lp, ent):
    return losses.rl_loss(cfg, lp, batch, denominator=denominator, entropies=ent)

  (loss, metrics), (grad_lp, grad_ent) = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)(
      _with_garbage(logp, mask), _with_garbage(entropies, mask))

  adv = np.where(mask, batch["advantages"], 0.0).astype(np.float64)
  ratio = np.exp(logp - old)
  policy = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.28))
  log_r = np.where(mask, batch["ref_logprobs"], 0.0) - logp
  kl = np.expm1(log_r) - log_r
  per_token = np.where(selected, policy, 0.0) + 0.1 * kl - 0.01 * entropies
  np.testing.assert_allclose(loss, (weights * per_token)[mask].sum() / denominator, rtol=1e-5)
  unclipped = ~(((adv > 0) & (ratio > 1.28)) | ((adv < 0) & (ratio < 0.8)))
  d_policy = np.where(selected & unclipped, -adv * ratio, 0.0)
  d_kl = 0.1 * (1.0 - np.exp(log_r))
  want_lp = np.where(mask, weights * (d_policy + d_kl) / denominator, 0.0)
  np.testing.assert_allclose(grad_lp, want_lp, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(grad_ent, np.where(mask, -0.01 * weights / denominator, 0.0),
                             rtol=1e-5, atol=1e-9)
  assert np.abs(want_lp[mask & ~selected]).min() > 0  # the KL still moves every token
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(m["entropy/selected_fraction"], selected.sum() / mask.sum())
  np.testing.assert_allclose(m["loss/policy"],
                             (weights * np.where(selected, policy, 0.0))[mask].sum() / d,
                             rtol=1e-5)
  np.testing.assert_allclose(m["entropy"], entropies[mask].mean(), rtol=1e-5)
  del batch["entropy_selected"]
  with pytest.raises(ValueError, match=r"batch lacks \['entropy_selected'\]"):
    run(logp, entropies)

def _agg_ref(loss, mask, segment_ids, mode, max_len):
  if mode == "token_mean":
    return loss[mask].sum() / mask.sum()
  per_seq = []
  for b in range(loss.shape[0]):
    ids = np.ones(loss.shape[1]) if segment_ids is None else segment_ids[b]
    for s in np.unique(ids[ids > 0]):
      sel = (ids == s) & mask[b]
      if sel.any():
        norm = sel.sum() if mode == "seq_mean_token_mean" else max_len
        per_seq.append(loss[b][sel].sum() / norm)
  return np.mean(per_seq)


@pytest.mark.parametrize("mode", losses.AGG_MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_aggregation_modes_match_reference(mode, packed):
  rng = np.random.default_rng(3)
  segment_ids, mask = _segments_and_mask(rng, BATCH, LENGTH)
  if not packed:
    segment_ids = None
  mask[0] = False  # a sequence without valid tokens does not count
  loss = rng.normal(size=(BATCH, LENGTH)).astype(np.float32)
  w, d = losses.token_weights(mask, mode, segment_ids=segment_ids, max_response_len=13)
  got = losses.aggregate(_with_garbage(loss, mask, np.inf), w, d)
  np.testing.assert_allclose(got, _agg_ref(loss, mask, segment_ids, mode, 13), rtol=1e-5)


def test_aggregate_of_empty_batch_is_zero():
  mask = np.zeros((3, 5), bool)
  for mode in losses.AGG_MODES:
    w, d = losses.token_weights(mask, mode, max_response_len=5)
    assert float(d) == 0 and float(losses.aggregate(np.full((3, 5), np.nan), w, d)) == 0.0


# --- the combined objective on a tiny model -------------------------------------------------

VOCAB, EMBED = 11, 5


def _model_outputs(params, tokens, targets):
  logits = params["embed"][tokens] @ params["out"]  # [B, T, V]
  log_softmax = jax.nn.log_softmax(logits)
  log_probs = jnp.take_along_axis(log_softmax, targets[..., None], axis=-1)[..., 0]
  entropies = -jnp.sum(jnp.exp(log_softmax) * log_softmax, axis=-1)
  values = logits[..., 0]
  return log_probs, entropies, values


def _rollout_batch(seed, rows=12, length=LENGTH):
  rng = np.random.default_rng(seed)
  segment_ids, mask = _segments_and_mask(rng, rows, length)
  shape = (rows, length)
  batch = {
      "tokens": rng.integers(0, VOCAB, shape).astype(np.int32),
      "targets": rng.integers(0, VOCAB, shape).astype(np.int32),
      "segment_ids": segment_ids,
      "loss_mask": mask,
      "advantages": rng.normal(size=shape),
      "old_logprobs": -rng.random(shape) * 3,
      "behaviour_logprobs": -rng.random(shape) * 3,
      "ref_logprobs": -rng.random(shape) * 3,
      "old_values": rng.normal(size=shape),
      "returns": rng.normal(size=shape),
  }
  return {k: (_with_garbage(v, mask) if v.dtype == np.float64 else v) for k, v in batch.items()}


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"embed": jnp.asarray(rng.normal(size=(VOCAB, EMBED)), jnp.float32),
          "out": jnp.asarray(rng.normal(size=(EMBED, VOCAB)), jnp.float32)}


def _loss_fn(cfg, batch, denominator):
  def fn(params):
    log_probs, entropies, values = _model_outputs(params, batch["tokens"], batch["targets"])
    return losses.rl_loss(cfg, log_probs, batch, denominator=denominator, entropies=entropies,
                          values=values)
  return fn


CONFIGS = {
    "grpo": losses.LossConfig(loss_agg_mode="seq_mean_token_mean", kl_coef=0.04, kl_estimator="k3",
                              tis_cap=2.0),
    "dapo": losses.LossConfig(loss_agg_mode="token_mean", eps_high=0.28, entropy_coef=0.01,
                              dual_clip=3.0),
    "dr_grpo": losses.LossConfig(loss_agg_mode="seq_mean_token_sum_norm", max_response_len=7),
    "gspo_ppo_critic": losses.LossConfig(policy_loss="gspo", loss_agg_mode="seq_mean_token_mean",
                                         use_critic=True, kl_coef=0.1, kl_estimator="k2"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_four_microbatches_equal_one_batch(name):
  cfg = CONFIGS[name]
  batch = _rollout_batch(4)
  params = _params()

  @jax.jit
  def full_batch(params, batch):
    denominator = losses.loss_denominator(cfg, batch)
    (loss, metrics), grad = jax.value_and_grad(_loss_fn(cfg, batch, denominator),
                                               has_aux=True)(params)
    return loss, grad, losses.compute_metrics(metrics)

  @jax.jit
  def accumulated(params, stacked):
    # What a train step does: global denominator first, then a scan over micro-batches.
    denominator = jnp.sum(jax.vmap(lambda mb: losses.loss_denominator(cfg, mb))(stacked))

    def step(grad_acc, mb):
      (loss, m), grad = jax.value_and_grad(_loss_fn(cfg, mb, denominator), has_aux=True)(params)
      return jax.tree.map(jnp.add, grad_acc, grad), (loss, m)

    grads, (loss, m) = jax.lax.scan(step, jax.tree.map(jnp.zeros_like, params), stacked)
    merged = losses.merge_stacked_metrics(m)
    # Pairwise merging gives the same as merging the stack at once.
    pairwise = {}
    for i in range(4):
      pairwise = losses.merge_metrics(pairwise, jax.tree.map(lambda x, i=i: x[i], m))
    return jnp.sum(loss), grads, losses.compute_metrics(merged), losses.compute_metrics(pairwise)

  full_loss, full_grad, full_values = full_batch(params, batch)
  stacked = {k: v.reshape(4, 3, *v.shape[1:]) for k, v in batch.items()}
  loss, grad, values, pairwise = accumulated(params, stacked)
  np.testing.assert_allclose(loss, full_loss, rtol=1e-6, atol=1e-6)
  for key in params:
    np.testing.assert_allclose(grad[key], full_grad[key], rtol=1e-5, atol=1e-6)
  assert set(values) == set(full_values) == set(pairwise)
  for key in full_values:
    np.testing.assert_allclose(values[key], full_values[key], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(pairwise[key], full_values[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_masked_garbage_never_leaks_into_loss_or_gradient():
  cfg = CONFIGS["gspo_ppo_critic"]
  cfg = losses.LossConfig(**{**cfg.__dict__, "tis_cap": 2.0, "entropy_coef": 0.01})
  batch = _rollout_batch(5)
  mask = batch["loss_mask"]
  clean = {k: (np.where(mask, v, 0.0).astype(np.float32) if v.dtype == np.float32 else v)
           for k, v in batch.items()}
  denominator = losses.loss_denominator(cfg, batch)
  params = _params(1)

  def fn(b, poison):
    def inner(p):
      log_probs, entropies, values = _model_outputs(p, b["tokens"], b["targets"])
      if poison:  # the model emits garbage at masked positions, on a live gradient path
        log_probs = log_probs + jnp.where(mask, 0.0, jnp.nan)
        entropies = entropies + jnp.where(mask, 0.0, jnp.inf)
        values = values + jnp.where(mask, 0.0, -jnp.inf)
      return losses.rl_loss(cfg, log_probs, b, denominator=denominator, entropies=entropies,
                            values=values)
    return inner

  (loss_garbage, m_garbage), g_garbage = jax.jit(
      jax.value_and_grad(fn(batch, True), has_aux=True))(params)
  (loss_clean, m_clean), g_clean = jax.jit(
      jax.value_and_grad(fn(clean, False), has_aux=True))(params)
  assert np.isfinite(loss_garbage)
  np.testing.assert_allclose(loss_garbage, loss_clean, rtol=1e-6)
  for key in params:
    assert np.all(np.isfinite(g_garbage[key]))
    np.testing.assert_allclose(g_garbage[key], g_clean[key], rtol=1e-6, atol=1e-7)
  for key, value in losses.compute_metrics(m_garbage).items():
    np.testing.assert_allclose(value, losses.compute_metrics(m_clean)[key], rtol=1e-6, err_msg=key)


def test_on_policy_loss_is_minus_weighted_advantage_with_policy_gradient():
  cfg = losses.LossConfig(loss_agg_mode="token_mean")
  batch = _rollout_batch(6)
  del batch["old_logprobs"]
  mask = batch["loss_mask"]
  log_probs = jnp.asarray(-np.random.default_rng(0).random(mask.shape), jnp.float32)
  d = losses.loss_denominator(cfg, batch)

  def fn(lp):
    return losses.rl_loss(cfg, lp, batch, denominator=d)[0]

  adv = np.where(mask, batch["advantages"], 0.0)
  np.testing.assert_allclose(fn(log_probs), -adv.sum() / mask.sum(), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(fn)(log_probs), -adv / mask.sum(), rtol=1e-5, atol=1e-7)
  # The mean log-prob of the trained tokens (the SFT stage logs its negative as the nll);
  # garbage past the mask does not count.
  poisoned = jnp.where(mask, log_probs, -jnp.inf)
  metrics = losses.compute_metrics(losses.rl_loss(cfg, poisoned, batch, denominator=d)[1])
  np.testing.assert_allclose(metrics["logprob/mean"],
                             np.asarray(log_probs)[mask.astype(bool)].mean(), rtol=1e-5)


def test_truncated_importance_weights():
  logp, old, _, mask = _inputs(7, spread=2.0)
  got = losses.truncated_importance_weights(_with_garbage(logp, mask), _with_garbage(old, mask),
                                            mask, cap=2.0)
  want = np.where(mask, np.minimum(np.exp(logp - old), 2.0), 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert (want == 2.0).any()
  with pytest.raises(ValueError, match="tis cap must be > 0, got 0"):
    losses.truncated_importance_weights(logp, old, mask, cap=0)


def test_tis_scales_policy_loss_and_reports_mean_weight():
  cfg = losses.LossConfig(tis_cap=1.5)
  batch = _rollout_batch(8)
  mask = batch["loss_mask"]
  log_probs = jnp.asarray(batch["old_logprobs"])
  d = losses.loss_denominator(cfg, batch)
  loss, metrics = losses.rl_loss(cfg, jnp.where(mask, log_probs, 0.0), batch, denominator=d)
  w = np.minimum(np.exp(batch["old_logprobs"] - batch["behaviour_logprobs"]), 1.5)[mask]
  # ratio is 1 (log_probs == old), so the loss is -sum(w * A) / n.
  np.testing.assert_allclose(loss, -(w * batch["advantages"][mask]).sum() / mask.sum(), rtol=1e-5)
  np.testing.assert_allclose(losses.compute_metrics(metrics)["is_weight/mean"], w.mean(), rtol=1e-5)


def _rollout_is_ref(old, behaviour, mask, segment_ids, *, cap, level, mode, lower, veto):
  """The weights of `rollout_importance_weights` written per sequence, in float64."""
  log_r = np.where(mask, old.astype(np.float64) - behaviour, 0.0)
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for s in np.unique(segment_ids[b][segment_ids[b] > 0]):
      sel = (segment_ids[b] == s) & mask[b]
      if not sel.any():
        continue
      if level == "token":
        w = np.exp(log_r[b][sel])
      else:
        total = log_r[b][sel].sum()
        w = np.full(sel.sum(), np.exp(total if level == "sequence" else total / sel.sum()))
      if mode == "truncate":
        w = np.minimum(w, cap)
      else:
        w = np.where((w >= (lower or 1 / cap)) & (w <= cap), w, 0.0)
      if veto and (log_r[b][sel] < np.log(veto)).any():
        w = np.zeros_like(w)
      out[b][sel] = w
  return out


@pytest.mark.parametrize("level,mode,lower,veto", [
    ("token", "truncate", 0.0, 0.0), ("token", "mask", 0.0, 0.0), ("token", "mask", 0.6, 0.0),
    ("sequence", "truncate", 0.0, 0.0), ("sequence", "mask", 0.0, 0.0),
    ("geometric", "truncate", 0.0, 0.0), ("geometric", "mask", 0.0, 0.2),
    ("token", "truncate", 0.0, 0.1)])
def test_rollout_importance_weights_match_their_definition_per_sequence(level, mode, lower,
                                                                       veto):
  rng = np.random.default_rng(11)
  segment_ids, mask = _segments_and_mask(rng, 9, 13)
  old = (-rng.random((9, 13)) * 3).astype(np.float32)
  # A shift per sequence (some sequences far off, some near) plus token noise.
  shift = np.take_along_axis(rng.normal(0, 0.8, (9, 4)), segment_ids, axis=1)
  behaviour = (old + shift + rng.normal(0, 0.3, old.shape)).astype(np.float32)
  if veto:  # one token the sampler found far likelier than the learner
    b, t = np.argwhere(mask)[len(np.argwhere(mask)) // 2]
    behaviour[b, t] = old[b, t] + 5.0
  cap = 2.0
  got, metrics = losses.rollout_importance_weights(
      _with_garbage(old, mask), _with_garbage(behaviour, mask, np.inf), mask, cap=cap,
      level=level, mode=mode, lower=lower, veto=veto, segment_ids=segment_ids)
  want = _rollout_is_ref(old, behaviour, mask, segment_ids, cap=cap, level=level, mode=mode,
                         lower=lower, veto=veto)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  m = losses.compute_metrics(metrics)
  np.testing.assert_allclose(m["is_weight/mean"], want[mask].mean(), rtol=1e-4)
  zeroed = (want[mask] == 0).mean()
  np.testing.assert_allclose(m["is_weight/masked_fraction"], zeroed, atol=1e-6)
  if mode == "mask" or veto:
    assert zeroed > 0  # the case exercises what it names
  if mode == "truncate" and not veto:
    assert (want[mask] == cap).any() and zeroed == 0


def test_sequence_weights_are_constant_over_each_packed_sequence():
  """Rows of several sequences: each sequence has one weight, whatever its row holds."""
  rng = np.random.default_rng(12)
  segment_ids, mask = _segments_and_mask(rng, 6, 17)
  old = (-rng.random((6, 17)) * 2).astype(np.float32)
  behaviour = (old + rng.normal(0, 0.2, old.shape)).astype(np.float32)
  got, _ = losses.rollout_importance_weights(old, behaviour, mask, cap=5.0, level="sequence",
                                             segment_ids=segment_ids)
  got = np.asarray(got)
  for b in range(6):
    for seg in np.unique(segment_ids[b][mask[b]]):
      values = got[b][(segment_ids[b] == seg) & mask[b]]
      assert np.all(values == values[0])
  assert len(np.unique(got[mask])) > 3  # sequences differ


def test_rl_loss_applies_the_configured_rollout_weights():
  cfg = losses.LossConfig(tis_cap=1.5, tis_level="geometric", tis_mode="mask")
  batch = _rollout_batch(8)
  mask = batch["loss_mask"]
  d = losses.loss_denominator(cfg, batch)
  old = np.where(mask, batch["old_logprobs"], 0.0)
  loss, metrics = losses.rl_loss(cfg, jnp.asarray(old), batch, denominator=d)
  w = _rollout_is_ref(batch["old_logprobs"], batch["behaviour_logprobs"], mask,
                      batch["segment_ids"], cap=1.5, level="geometric", mode="mask", lower=0.0,
                      veto=0.0)
  # ratio 1 (log_probs == old): the loss is -sum(w A) / n.
  adv = np.where(mask, batch["advantages"], 0.0)
  np.testing.assert_allclose(loss, -(w * adv).sum() / mask.sum(), rtol=1e-5)
  m = losses.compute_metrics(metrics)
  assert 0 < float(m["is_weight/masked_fraction"]) < 1


def test_rollout_importance_errors_are_one_line():
  x, mask = np.zeros((2, 3), np.float32), np.ones((2, 3))
  cases = [(dict(cap=0.0), "cap must be > 0"),
           (dict(cap=2.0, level="seq"), "unknown importance level 'seq'; known: token"),
           (dict(cap=2.0, mode="clip"), "unknown importance mode 'clip'"),
           (dict(cap=2.0, lower=3.0), r"lower bound must be 0 \(1 / cap\) or in \(0, cap=2.0\)"),
           (dict(cap=2.0, veto=-1.0), "veto must be 0")]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message) as info:
      losses.rollout_importance_weights(x, x, mask, **kwargs)
    assert "\n" not in str(info.value)
  for kwargs, message in [(dict(tis_level="seq"), "unknown tis_level 'seq'"),
                          (dict(tis_mode="clip"), "unknown tis_mode 'clip'"),
                          (dict(tis_cap=2.0, tis_lower=2.0), "tis_lower must be 0"),
                          (dict(tis_veto=-0.1), "tis_veto must be 0")]:
    with pytest.raises(ValueError, match=message):
      losses.LossConfig(**kwargs)


def test_kl_estimators_on_samples_from_two_categoricals():
  key_q, key_p, key_x = jax.random.split(jax.random.key(0), 3)
  log_q = jax.nn.log_softmax(jax.random.normal(key_q, (7,)))
  log_p = jax.nn.log_softmax(jax.random.normal(key_p, (7,)))
  exact = float(jnp.sum(jnp.exp(log_q) * (log_q - log_p)))
  x = jax.random.categorical(key_x, log_q, shape=(200, 1000))  # x ~ q
  log_probs, ref_log_probs = log_q[x], log_p[x]
  mask = np.ones(x.shape, bool)
  est = {k: np.asarray(losses.kl_divergence(log_probs, ref_log_probs, mask, estimator=k),
                       np.float64)
         for k in losses.KL_ESTIMATORS}
  for k in ("k1", "k3"):  # unbiased: within 4 standard errors
    stderr = est[k].std() / np.sqrt(est[k].size)
    assert abs(est[k].mean() - exact) < 4 * stderr, (k, est[k].mean(), exact)
  assert (est["k1"] < 0).any()  # k1 is unbiased but not per-sample positive
  assert (est["k2"] >= 0).all() and (est["k3"] >= 0).all()
  assert est["k3"].std() < est["k1"].std()


def test_kl_estimators_on_samples_from_two_gaussians():
  rng = np.random.default_rng(9)
  mu_q, s_q, mu_p, s_p = 0.0, 1.0, 0.3, 1.2
  x = rng.normal(mu_q, s_q, size=(500, 400))

  def log_normal(x, mu, s):
    return -0.5 * ((x - mu) / s) ** 2 - np.log(s) - 0.5 * np.log(2 * np.pi)

  exact = np.log(s_p / s_q) + (s_q**2 + (mu_q - mu_p) ** 2) / (2 * s_p**2) - 0.5
  mask = np.ones(x.shape, bool)
  for k in ("k1", "k3"):
    est = np.asarray(losses.kl_divergence(log_normal(x, mu_q, s_q).astype(np.float32),
                                          log_normal(x, mu_p, s_p).astype(np.float32), mask,
                                          estimator=k), np.float64)
    assert abs(est.mean() - exact) < 4 * est.std() / np.sqrt(est.size), k


def test_k2_k3_nonnegative_on_extreme_log_ratios_and_masked():
  rng = np.random.default_rng(10)
  logp = rng.normal(size=(3, 7)).astype(np.float32) * 30
  ref = rng.normal(size=(3, 7)).astype(np.float32) * 30
  mask = rng.random((3, 7)) < 0.6
  for k in ("k2", "k3"):
    got = np.asarray(losses.kl_divergence(_with_garbage(logp, mask), ref, mask, estimator=k))
    assert np.all(np.isfinite(got)) and np.all(got >= 0) and np.all(got[~mask] == 0)
  for k in losses.KL_ESTIMATORS:
    grad = jax.grad(lambda lp: jnp.sum(losses.kl_divergence(lp, ref, mask, estimator=k)))(
        _with_garbage(logp, mask))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~mask] == 0), k
  with pytest.raises(ValueError, match="unknown kl estimator 'k4'"):
    losses.kl_divergence(logp, ref, mask, estimator="k4")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalized_rewards(estimator):
  logp, ref, _, mask = _inputs(11)
  rewards = np.random.default_rng(11).normal(size=mask.shape).astype(np.float32)
  log_r = ref - logp
  k = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}[estimator]
  got = losses.kl_penalized_rewards(_with_garbage(rewards, mask), _with_garbage(logp, mask), ref,
                                    mask, kl_coef=0.1, estimator=estimator)
  np.testing.assert_allclose(got, np.where(mask, rewards - 0.1 * k, 0.0), rtol=1e-5, atol=1e-6)


def test_clipped_value_loss_value_and_gradient():
  rng = np.random.default_rng(12)
  values, old, returns = (rng.normal(size=(BATCH, LENGTH)).astype(np.float32) for _ in range(3))
  mask = rng.random((BATCH, LENGTH)) < 0.7
  eps = 0.2
  clipped = old + np.clip(values - old, -eps, eps)
  want = np.where(mask, 0.5 * np.maximum((values - returns) ** 2, (clipped - returns) ** 2), 0.0)

  def total(v):
    loss, _ = losses.clipped_value_loss(v, _with_garbage(old, mask), returns, mask, value_clip=eps)
    return jnp.sum(loss), loss

  (_, got), grad = jax.value_and_grad(total, has_aux=True)(_with_garbage(values, mask))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  use_clipped = (clipped - returns) ** 2 > (values - returns) ** 2
  # Where the clipped branch wins and values moved beyond the range, the gradient is 0.
  frozen = mask & use_clipped & (np.abs(values - old) > eps)
  assert frozen.any()
  assert np.all(np.asarray(grad)[frozen] == 0)
  live = mask & ~use_clipped
  np.testing.assert_allclose(np.asarray(grad)[live], (values - returns)[live], rtol=1e-5)
  assert np.all(np.asarray(grad)[~mask] == 0)


def test_metric_merge_and_compute():
  a = {"x": losses.Metric.mean(3.0, 2.0), "m": losses.Metric.max(5.0, 1.0),
       "s": losses.Metric.std(1.0, 5.0, 2.0)}
  b = {"x": losses.Metric.mean(1.0, 2.0), "m": losses.Metric.max(7.0, 1.0),
       "s": losses.Metric.std(-1.0, 5.0, 2.0), "y": losses.Metric.mean(0.0, 0.0)}
  got = losses.compute_metrics(losses.merge_metrics(a, b))
  np.testing.assert_allclose(got["x"], 1.0)
  np.testing.assert_allclose(got["m"], 7.0)
  np.testing.assert_allclose(got["s"], np.sqrt(10.0 / 4))  # values {2,-1} and {1,-2}: mean 0
  assert float(got["y"]) == 0.0
  # Metrics are pytrees: they pass through jit and lax.scan carries.
  merged = jax.jit(losses.merge_metrics)(a, b)
  assert merged["m"].reduce == "max"


def test_loss_config_errors_are_one_line_and_name_the_value():
  cases = [
      (dict(loss_agg_mode="mean"), "unknown loss_agg_mode 'mean'"),
      (dict(policy_loss="trpo"), "unknown policy loss 'trpo'"),
      (dict(dual_clip=0.9), "dual_clip must be 0 \\(off\\) or > 1, got 0.9"),
      (dict(eps_low=1.5), "eps_low must be in \\[0, 1\\] \\(1: no lower clip\\), got 1.5"),
      (dict(policy_loss="cispo", dual_clip=3.0), "dual_clip=3.0 applies to the ppo and gspo"),
      (dict(loss_agg_mode="seq_mean_token_sum_norm"), "needs max_response_len > 0, got 0"),
      (dict(policy_loss="kl_cov", dual_clip=3.0), "dual_clip=3.0 applies to the ppo and gspo"),
      (dict(cov_fraction=0.0), "cov_fraction must be in \\(0, 1\\], got 0.0"),
      (dict(clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb must be < clip_cov_ub"),
      (dict(kl_cov_coef=-1.0), "kl_cov_coef must be >= 0, got -1.0"),
      (dict(top_entropy_fraction=0.0),
       "top_entropy_fraction must be in \\(0, 1\\] \\(1: off\\), got 0.0"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message) as info:
      losses.LossConfig(**kwargs)
    assert "\n" not in str(info.value)
  batch = _rollout_batch(13)
  del batch["ref_logprobs"], batch["behaviour_logprobs"]
  with pytest.raises(ValueError, match=r"^batch lacks \['behaviour_logprobs', 'ref_logprobs'\]"):
    losses.rl_loss(losses.LossConfig(kl_coef=0.1, tis_cap=2.0), jnp.zeros((12, LENGTH)), batch,
                   denominator=1.0)
  with pytest.raises(ValueError, match="use_critic=True needs critic values"):
    losses.rl_loss(losses.LossConfig(use_critic=True), jnp.zeros((12, LENGTH)), batch,
                   denominator=1.0)
  with pytest.raises(ValueError, match=r"old_log_probs shape \(3, 5\) != log_probs shape \(3, 7\)"):
    losses.ppo_policy_loss(np.zeros((3, 7)), np.zeros((3, 5)), np.zeros((3, 7)), np.ones((3, 7)),
                           eps_low=0.2, eps_high=0.2)


def _verl_adaptive_kl(value, current_kl, target, horizon, n_steps):
  """veRL's AdaptiveKLController.update, transcribed."""
  proportional_error = np.clip(current_kl / target - 1, -0.2, 0.2)
  mult = 1 + proportional_error * n_steps / horizon
  return value * mult


@pytest.mark.parametrize("current_kl", [0.0, 0.05, 0.099, 0.1, 0.11, 0.12, 0.5, 7.0])
def test_adaptive_kl_coef_follows_the_controller_of_ziegler_et_al(current_kl):
  got = losses.adaptive_kl_coef(0.2, current_kl, target=0.1, horizon=1000, n_steps=64)
  np.testing.assert_allclose(got, _verl_adaptive_kl(0.2, current_kl, 0.1, 1000, 64), rtol=1e-12)
  # Far from the target the step is the clipped 20% per horizon, either way.
  if current_kl >= 0.12 or current_kl <= 0.08:
    assert abs(got / 0.2 - 1) == pytest.approx(0.2 * 64 / 1000)


def test_adaptive_kl_coef_holds_on_nonfinite_kl_and_rejects_bad_knobs():
  assert losses.adaptive_kl_coef(0.3, float("nan"), target=0.1, horizon=10, n_steps=4) == 0.3
  assert losses.adaptive_kl_coef(0.3, float("inf"), target=0.1, horizon=10, n_steps=4) == 0.3
  for bad in (dict(target=0.0, horizon=10), dict(target=0.1, horizon=0)):
    with pytest.raises(ValueError, match="target > 0 and horizon >= 1"):
      losses.adaptive_kl_coef(0.3, 0.1, n_steps=4, **bad)


def test_rl_loss_weighs_the_kl_term_by_each_rows_coefficient():
  """batch['kl_coef'] (the adaptive controller's value, one per row) replaces the config's
  coefficient: equal rows give the config's loss and gradient at that value; unequal rows
  weigh each row's KL tokens by its own."""
  cfg = losses.LossConfig(kl_coef=0.5, loss_agg_mode="token_mean", kl_estimator="k3")
  batch = _rollout_batch(21)
  mask = batch["loss_mask"]
  rows = mask.shape[0]
  d = losses.loss_denominator(cfg, batch)
  logp = jnp.asarray(np.where(mask, batch["old_logprobs"] + 0.1, 0.0), jnp.float32)

  def loss_of(c, batch):
    return losses.rl_loss(c, logp, batch, denominator=d)[0]

  same = {**batch, "kl_coef": np.full(rows, 0.03, np.float32)}
  np.testing.assert_allclose(loss_of(cfg, same),
                             loss_of(losses.LossConfig(kl_coef=0.03, kl_estimator="k3"), batch),
                             rtol=1e-6)
  grad = lambda c, b: jax.grad(  # noqa: E731
      lambda lp: losses.rl_loss(c, lp, b, denominator=d)[0])(logp)
  np.testing.assert_allclose(grad(cfg, same),
                             grad(losses.LossConfig(kl_coef=0.03, kl_estimator="k3"), batch),
                             rtol=1e-5, atol=1e-8)
  coef = np.linspace(0.0, 2.0, rows).astype(np.float32)
  per_row = {**batch, "kl_coef": coef}
  without_kl = losses.rl_loss(losses.LossConfig(), logp, batch, denominator=d)[0]
  log_r = np.float64(batch["ref_logprobs"]) - np.float64(logp)
  k3 = np.where(mask, np.exp(log_r) - 1 - log_r, 0.0)
  want = float(without_kl) + (coef[:, None] * k3).sum() / mask.sum()
  np.testing.assert_allclose(loss_of(cfg, per_row), want, rtol=1e-5)
