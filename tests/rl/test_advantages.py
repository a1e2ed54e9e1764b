"""Advantage estimators against loop-based numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.rl import advantages as adv_lib


def _random_segments(rng, batch, length, max_segments=3):
  """Packed-row segment ids 1..k with trailing padding (0)."""
  segment_ids = np.zeros((batch, length), np.int32)
  for b in range(batch):
    pos, seg = 0, 0
    while pos < length - 1 and seg < max_segments:
      n = int(rng.integers(1, length - pos))
      seg += 1
      segment_ids[b, pos : pos + n] = seg
      pos += n
  return segment_ids


def _garbage(x, mask, value=np.nan):
  return np.where(mask, x, value).astype(np.float32)


def _sequences(mask, segment_ids):
  """Yields (row, valid positions in order) for every sequence."""
  for b in range(mask.shape[0]):
    ids = np.ones(mask.shape[1], np.int32) if segment_ids is None else segment_ids[b]
    for s in np.unique(ids[ids > 0]):
      yield b, [t for t in range(mask.shape[1]) if ids[t] == s and mask[b, t]]


def _whiten_ref(x, mask):
  valid = x[mask].astype(np.float64)
  mean = valid.mean()
  var = valid.var(ddof=1)
  return np.where(mask, (x - mean) / np.sqrt(var + 1e-8), 0.0)


def _gae_ref(rewards, values, mask, segment_ids, gamma, lam):
  adv = np.zeros(rewards.shape)
  ret = np.zeros(rewards.shape)
  for b, positions in _sequences(mask, segment_ids):
    next_value = next_adv = 0.0
    for t in reversed(positions):
      delta = rewards[b, t] + gamma * next_value - values[b, t]
      next_adv = delta + gamma * lam * next_adv
      next_value = values[b, t]
      adv[b, t] = next_adv
      ret[b, t] = next_adv + values[b, t]
  return adv, ret


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7)])
def test_gae_matches_reference_and_ignores_masked_garbage(packed, gamma, lam):
  rng = np.random.default_rng(0)
  batch, length = 5, 7
  rewards = rng.normal(size=(batch, length))
  values = rng.normal(size=(batch, length))
  segment_ids = _random_segments(rng, batch, length) if packed else None
  mask = rng.random((batch, length)) < 0.7
  if packed:
    mask &= segment_ids > 0
  want_adv, want_ret = _gae_ref(rewards, values, mask, segment_ids, gamma, lam)

  adv, ret = adv_lib.gae_advantages(
      _garbage(rewards, mask), _garbage(values, mask, np.inf), mask,
      gamma=gamma, lam=lam, segment_ids=segment_ids, whiten=False,
  )
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)

  whitened, _ = adv_lib.gae_advantages(
      _garbage(rewards, mask), _garbage(values, mask), mask,
      gamma=gamma, lam=lam, segment_ids=segment_ids,
  )
  np.testing.assert_allclose(whitened, _whiten_ref(want_adv, mask), rtol=1e-4, atol=1e-5)


def test_gae_restarts_at_segment_boundaries():
  # Two sequences in one row: the first must not see the second's values.
  rewards = np.array([[0.0, 1.0, 0.0, 5.0]], np.float32)
  values = np.array([[0.5, 0.25, 100.0, 100.0]], np.float32)
  mask = np.ones((1, 4), bool)
  segment_ids = np.array([[1, 1, 2, 2]])
  adv, _ = adv_lib.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0,
                                  segment_ids=segment_ids, whiten=False)
  np.testing.assert_allclose(adv[0, :2], [1.0 - 0.5, 1.0 - 0.25])


def test_gae_gradient_wrt_values_is_finite_with_garbage():
  rng = np.random.default_rng(1)
  mask = rng.random((3, 7)) < 0.6
  values = _garbage(rng.normal(size=(3, 7)), mask)
  rewards = _garbage(rng.normal(size=(3, 7)), mask, np.inf)

  def total(v):
    return jnp.sum(adv_lib.gae_advantages(rewards, v, mask)[1])

  grad = jax.jit(jax.grad(total))(values)
  assert np.all(np.isfinite(grad))
  assert np.all(grad[~mask] == 0)


def _reinforce_pp_ref(rewards, mask, gamma, kl, kl_coef, segment_ids):
  penalised = rewards - kl_coef * kl
  returns = np.zeros(rewards.shape)
  for b, positions in _sequences(mask, segment_ids):
    running = 0.0
    for t in reversed(positions):
      running = penalised[b, t] + gamma * running
      returns[b, t] = running
  return _whiten_ref(returns, mask), returns


@pytest.mark.parametrize("packed", [False, True])
def test_reinforce_plus_plus_matches_reference(packed):
  rng = np.random.default_rng(2)
  batch, length = 5, 7
  rewards = rng.normal(size=(batch, length))
  kl = rng.normal(size=(batch, length)) ** 2
  segment_ids = _random_segments(rng, batch, length) if packed else None
  mask = rng.random((batch, length)) < 0.75
  if packed:
    mask &= segment_ids > 0
  want_adv, want_ret = _reinforce_pp_ref(rewards, mask, 0.9, kl, 0.3, segment_ids)
  adv, ret = adv_lib.reinforce_plus_plus_advantages(
      _garbage(rewards, mask), mask, gamma=0.9, kl=_garbage(kl, mask, -np.inf), kl_coef=0.3,
      segment_ids=segment_ids,
  )
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-4, atol=1e-5)
  valid = np.asarray(adv)[mask]
  assert abs(valid.mean()) < 1e-5 and abs(valid.std(ddof=1) - 1) < 1e-3


def _group_ref(rewards, group_ids, valid, kind):
  out = np.zeros(len(rewards))
  for g in np.unique(group_ids):
    members = np.flatnonzero((group_ids == g) & valid)
    if len(members) < 2:
      continue
    r = rewards[members].astype(np.float64)
    if kind == "grpo":
      out[members] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    elif kind == "dr_grpo":
      out[members] = r - r.mean()
    elif kind == "rloo":
      out[members] = [r[i] - np.delete(r, i).mean() for i in range(len(r))]
    elif kind.startswith("gpg"):  # scaled by alpha below
      if r.max() > r.min():
        out[members] = (r - r.mean()) / ((r.std(ddof=1) + 1e-6) if kind == "gpg_std" else 1)
    else:  # passk: the first best sample gets its lead over the runner-up
      best = int(np.argmax(r))
      lead = r[best] - np.max(np.delete(r, best))
      out[members[best]] = lead / (r.std(ddof=1) + 1e-6)
  if kind.startswith("gpg"):
    # alpha = B / (B - M): valid samples over those of groups whose rewards differ.
    informative = 0
    for g in np.unique(group_ids):
      m = np.flatnonzero((group_ids == g) & valid)
      if len(m) > 1 and rewards[m].max() > rewards[m].min():
        informative += len(m)
    out *= valid.sum() / max(informative, 1)
  return out


KINDS = {
    "grpo": lambda r, g=None, valid=None: adv_lib.group_normalized_advantages(r, g, valid=valid),
    "dr_grpo": lambda r, g=None, valid=None: adv_lib.group_normalized_advantages(
        r, g, normalize_std=False, valid=valid),
    "rloo": lambda r, g=None, valid=None: adv_lib.rloo_advantages(r, g, valid=valid),
    "gpg": lambda r, g=None, valid=None: adv_lib.gpg_advantages(r, g, valid=valid),
    "gpg_std": lambda r, g=None, valid=None: adv_lib.gpg_advantages(
        r, g, normalize_std=True, valid=valid),
    "passk": lambda r, g=None, valid=None: adv_lib.passk_advantages(r, g, valid=valid),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_group_estimators_2d_layout(kind):
  rng = np.random.default_rng(3)
  rewards = rng.normal(size=(3, 5)).astype(np.float32)
  group_ids = np.repeat(np.arange(3), 5)
  want = _group_ref(rewards.reshape(-1), group_ids, np.ones(15, bool), kind).reshape(3, 5)
  got = jax.jit(KINDS[kind])(rewards)
  assert got.shape == (3, 5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_group_estimators_group_id_vector_with_invalid_garbage(kind):
  rng = np.random.default_rng(4)
  n = 21
  # Uneven, shuffled groups with large arbitrary ids; one singleton group.
  group_ids = rng.choice([7, 1_000_003, 42, 5], size=n)
  group_ids[0] = 99
  valid = rng.random(n) < 0.8
  rewards = rng.normal(size=n)
  want = _group_ref(rewards, group_ids, valid, kind)
  garbage = np.where(valid, rewards, np.nan).astype(np.float32)
  got = jax.jit(KINDS[kind])(garbage, group_ids, valid)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert got[0] == 0.0  # singleton group: no baseline, no signal


def test_gpg_scales_by_the_share_of_samples_that_carry_a_gradient():
  """Two of four groups scored alike: alpha = 16 / 8 doubles the others' centred rewards."""
  rewards = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 1]], np.float32)
  got = np.asarray(adv_lib.gpg_advantages(rewards))
  np.testing.assert_allclose(got[:2], 0.0)
  np.testing.assert_allclose(got[2], 2 * (rewards[2] - 0.25), rtol=1e-6)
  np.testing.assert_allclose(got[3], 2 * (rewards[3] - 0.75), rtol=1e-6)
  # Nothing informative: all zeros, no division by zero.
  assert np.all(np.asarray(adv_lib.gpg_advantages(np.ones((2, 3), np.float32))) == 0)


def test_passk_credits_only_each_groups_first_best_sample():
  rewards = np.array([[0.0, 1.0, 0.5, 1.0],    # tied best: no lead, nothing credited
                      [0.2, 0.9, 0.4, 0.1],    # best 0.9 leads 0.4 by 0.5
                      [0.0, 0.0, 0.0, 0.0]], np.float32)
  got = np.asarray(adv_lib.passk_advantages(rewards, normalize_std=False))
  want = np.zeros((3, 4))
  want[1, 1] = 0.5
  np.testing.assert_allclose(got, want, atol=1e-6)
  # The credit is nonnegative: pass@k never pushes a sample down.
  rng = np.random.default_rng(9)
  got = np.asarray(adv_lib.passk_advantages(rng.normal(size=(6, 5)).astype(np.float32)))
  assert np.all(got >= 0) and np.all((got > 0).sum(axis=1) == 1)


def test_group_layouts_agree():
  rng = np.random.default_rng(5)
  rewards = rng.normal(size=(5, 3)).astype(np.float32)
  ids = np.repeat(np.arange(5), 3)
  perm = rng.permutation(15)
  flat = adv_lib.group_normalized_advantages(rewards.reshape(-1)[perm], ids[perm])
  np.testing.assert_allclose(np.asarray(flat)[np.argsort(perm)].reshape(5, 3),
                             adv_lib.group_normalized_advantages(rewards), atol=1e-6)


def test_constant_group_has_zero_advantage_not_nan():
  rewards = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], np.float32)
  got = np.asarray(adv_lib.group_normalized_advantages(rewards))
  assert np.all(np.isfinite(got)) and np.all(got[0] == 0) and got[1, 0] < 0 < got[1, 1]


def _length_weighted_ref(rewards, lengths, group_ids, valid, kind):
  """OPO (Hao et al. 2025) and REINFORCE++-baseline (OpenRLHF), written out in float64:
  the latter whitens over every token, each response's tokens carrying its value."""
  rewards, lengths = rewards.astype(np.float64), lengths.astype(np.float64)
  out = np.zeros(len(rewards))
  for g in np.unique(group_ids):
    members = np.flatnonzero((group_ids == g) & valid)
    if kind == "opo":
      if len(members) > 1:
        r, l = rewards[members], lengths[members]
        out[members] = r - (l * r).sum() / l.sum()
    elif len(members):
      out[members] = rewards[members] - rewards[members].mean()
  if kind == "reinforce_pp_baseline":
    tokens = np.concatenate([np.full(int(lengths[i]), out[i]) for i in np.flatnonzero(valid)])
    out = np.where(valid, (out - tokens.mean()) / np.sqrt(tokens.var() + 1e-8), 0.0)
  return out


@pytest.mark.parametrize("kind", ["opo", "reinforce_pp_baseline"])
def test_length_weighted_estimators_match_their_formulas(kind):
  rng = np.random.default_rng(6)
  n = 23
  group_ids = rng.choice([3, 900_001, 17, 8], size=n)
  group_ids[0] = 55  # a group of one
  valid = rng.random(n) < 0.85
  valid[0] = True
  rewards = rng.normal(size=n)
  lengths = rng.integers(1, 40, n)
  want = _length_weighted_ref(rewards, lengths, group_ids, valid, kind)
  fn = jax.jit(adv_lib.get_advantage_estimator(kind))
  got = fn(np.where(valid, rewards, np.nan).astype(np.float32), lengths, group_ids, valid=valid)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  if kind == "opo":
    assert got[0] == 0.0
    # Equal lengths: the plain group mean (Dr.GRPO's advantage).
    r2 = rng.normal(size=(4, 6)).astype(np.float32)
    np.testing.assert_allclose(adv_lib.opo_advantages(r2, np.full((4, 6), 9)),
                               adv_lib.group_normalized_advantages(r2, normalize_std=False),
                               atol=1e-6)
  else:
    tokens = np.repeat(np.asarray(got)[valid], lengths[valid])
    np.testing.assert_allclose([tokens.mean(), tokens.std()], [0.0, 1.0], atol=1e-5)
  with pytest.raises(ValueError, match=r"lengths shape \(3,\) != rewards shape \(23,\)"):
    fn(rewards, lengths[:3], group_ids)


def test_dynamic_sampling_mask():
  rewards = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, np.nan, 0.5]], np.float32)
  valid = np.array([[1, 1, 1], [1, 1, 1], [1, 0, 1]], bool)
  got = adv_lib.dynamic_sampling_mask(rewards, valid=valid)
  np.testing.assert_array_equal(got, [[0, 0, 0], [1, 1, 1], [0, 0, 0]])


def test_overlong_penalty():
  got = adv_lib.overlong_penalty(np.array([10, 60, 80, 100, 101]), max_response_len=100,
                                 buffer_len=40, factor=0.5)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -0.5])
  with pytest.raises(ValueError, match="buffer_len"):
    adv_lib.overlong_penalty(np.array([1]), max_response_len=10, buffer_len=11)


def test_registry_and_errors():
  assert adv_lib.get_advantage_estimator("rloo") is adv_lib.rloo_advantages
  with pytest.raises(ValueError, match=r"unknown advantage estimator 'gea'; known: gae, gpg, grpo"):
    adv_lib.get_advantage_estimator("gea")
  with pytest.raises(ValueError, match=r"values shape \(3, 5\) != token_rewards shape \(3, 7\)"):
    adv_lib.gae_advantages(np.zeros((3, 7)), np.zeros((3, 5)), np.ones((3, 7)))
  with pytest.raises(ValueError, match=r"rewards must be \[num_groups, group_size\]"):
    adv_lib.group_normalized_advantages(np.zeros(6))
