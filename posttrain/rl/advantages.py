"""Advantage estimators: small pure jnp functions and one registry.

Token arrays are `[batch, length]` and aligned to *target* tokens (the layout
`posttrain.rl.packing` produces); `mask` marks the targets that are the model's
own generated tokens. Values at masked positions are never read: they are
replaced with `jnp.where` before any arithmetic, so NaN/inf garbage there cannot
leak into outputs or gradients. Rows may hold several packed sequences; pass
their `segment_ids` (0 = padding) so recursions restart at every sequence.

Sequence-level estimators (GRPO, RLOO, OPO, REINFORCE++-baseline, GPG, pass@k, ReMax)
take one scalar reward per sequence (OPO and REINFORCE++-baseline each response's length
too, ReMax each group's greedy reward), either as `[num_groups, group_size]` or as a flat
`[num_sequences]` vector with a group-id vector of the same length.

Batch-level normalisation (GAE whitening, REINFORCE++) is over every valid token
of the arrays passed in: call these once on the whole rollout batch, before
splitting it into minibatches.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from posttrain.rl import losses

Array = jax.Array

# Added to the standard deviation before dividing (GRPO) and to the variance
# under the square root (whitening), as in TRL / verl.
STD_EPS = 1e-6
VAR_EPS = 1e-8


def _segment_boundary(segment_ids: Array | None, shape) -> Array:
  """True at the last position of each sequence: position t+1 starts another one."""
  boundary = jnp.zeros(shape, bool).at[:, -1].set(True)
  if segment_ids is None:
    return boundary
  segment_ids = jnp.asarray(segment_ids)
  return boundary.at[:, :-1].set(segment_ids[:, :-1] != segment_ids[:, 1:])


def _reverse_gae_scan(rewards, values, mask, boundary, gamma, lam):
  """Reverse scan over valid tokens; masked tokens are skipped, not zeroed."""

  def step(carry, xs):
    next_adv, next_value = carry
    reward_t, value_t, valid_t, boundary_t = xs
    # A new sequence starts after t: nothing downstream of t belongs to it.
    next_adv = jnp.where(boundary_t, 0.0, next_adv)
    next_value = jnp.where(boundary_t, 0.0, next_value)
    delta = reward_t + gamma * next_value - value_t
    adv_t = delta + gamma * lam * next_adv
    carry = (jnp.where(valid_t, adv_t, next_adv), jnp.where(valid_t, value_t, next_value))
    return carry, jnp.where(valid_t, adv_t, 0.0)

  batch = rewards.shape[0]
  init = (jnp.zeros((batch,), rewards.dtype), jnp.zeros((batch,), rewards.dtype))
  xs = (rewards.T, values.T, mask.T, boundary.T)
  _, advantages_TxB = jax.lax.scan(step, init, xs, reverse=True)
  return advantages_TxB.T


def masked_whiten(x: Array, mask: Array) -> Array:
  """Normalises `x` over the valid tokens of the whole batch.

  `(x - mean) / sqrt(var + 1e-8)` with the unbiased variance over `mask`; 0 at
  masked positions.

  Args:
    x: `[batch, length]` values.
    mask: `[batch, length]`, nonzero where `x` is valid.

  Returns:
    The whitened `[batch, length]` array.
  """
  mask = losses.as_mask(mask)
  x = jnp.where(mask, x, 0.0)
  count = jnp.sum(mask)
  mean = jnp.sum(x) / jnp.maximum(count, 1)
  centred = jnp.where(mask, x - mean, 0.0)
  var = jnp.sum(centred * centred) / jnp.maximum(count - 1, 1)
  return centred * jax.lax.rsqrt(var + VAR_EPS)


def gae_advantages(
    token_rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    segment_ids: Array | None = None,
    whiten: bool = True,
) -> tuple[Array, Array]:
  """Generalised advantage estimation (Schulman et al. 2016) over valid tokens.

  Over the valid tokens of one sequence, in order, with `V_{T} = 0` past the
  last one:

      delta_t = r_t + gamma * V_{t+1} - V_t
      A_t     = delta_t + gamma * lam * A_{t+1}
      R_t     = A_t + V_t                       (value-function target)

  `t+1` is the next *valid* token of the same sequence, so tool-output tokens
  inside a response (mask 0) are skipped rather than cut the recursion. With
  `whiten`, advantages are then normalised over all valid tokens (`masked_whiten`).

  Args:
    token_rewards: `[batch, length]` per-token rewards (typically the sequence
      reward on its last valid token, minus a per-token KL penalty).
    values: `[batch, length]` critic values.
    mask: `[batch, length]`, nonzero on valid (generated) tokens.
    gamma: discount.
    lam: GAE lambda.
    segment_ids: optional `[batch, length]` packed-sequence ids (0 = padding).
    whiten: normalise the advantages over the batch.

  Returns:
    `(advantages, returns)`, both `[batch, length]`, 0 at masked positions.
  """
  losses.check_token_shapes(token_rewards=token_rewards, values=values, mask=mask,
                            segment_ids=segment_ids)
  mask = losses.as_mask(mask)
  rewards = jnp.where(mask, token_rewards, 0.0).astype(jnp.float32)
  values = jnp.where(mask, values, 0.0).astype(jnp.float32)
  boundary = _segment_boundary(segment_ids, mask.shape)
  advantages = _reverse_gae_scan(rewards, values, mask, boundary, gamma, lam)
  returns = jnp.where(mask, advantages + values, 0.0)
  if whiten:
    advantages = masked_whiten(advantages, mask)
  return advantages, returns


def reinforce_plus_plus_advantages(
    token_rewards: Array,
    mask: Array,
    *,
    gamma: float = 1.0,
    kl: Array | None = None,
    kl_coef: float = 0.0,
    segment_ids: Array | None = None,
) -> tuple[Array, Array]:
  """REINFORCE++ (Hu 2025): KL-penalised discounted returns, batch-normalised.

      r'_t = r_t - kl_coef * kl_t
      G_t  = r'_t + gamma * G_{t+1}             (over valid tokens of a sequence)
      A_t  = (G_t - mean(G)) / sqrt(var(G) + 1e-8)   over all valid tokens

  Args:
    token_rewards: `[batch, length]` per-token rewards.
    mask: `[batch, length]`, nonzero on valid tokens.
    gamma: discount.
    kl: optional `[batch, length]` per-token KL estimate to the reference policy
      (e.g. `posttrain.rl.losses.kl_divergence`).
    kl_coef: weight of the KL penalty.
    segment_ids: optional `[batch, length]` packed-sequence ids.

  Returns:
    `(advantages, returns)`, both `[batch, length]`, 0 at masked positions.
  """
  losses.check_token_shapes(token_rewards=token_rewards, mask=mask, kl=kl, segment_ids=segment_ids)
  mask = losses.as_mask(mask)
  rewards = jnp.where(mask, token_rewards, 0.0).astype(jnp.float32)
  if kl is not None:
    rewards = rewards - kl_coef * jnp.where(mask, kl, 0.0)
  boundary = _segment_boundary(segment_ids, mask.shape)
  zeros = jnp.zeros_like(rewards)
  # GAE with V = 0 and lam = 1 is exactly the discounted return.
  returns = _reverse_gae_scan(rewards, zeros, mask, boundary, gamma, 1.0)
  return masked_whiten(returns, mask), returns


def _group_layout(rewards, group_ids, valid):
  """Flattens rewards to `[n]` with dense group ids in `[0, n)` and a valid mask."""
  rewards = jnp.asarray(rewards)
  if group_ids is None:
    if rewards.ndim != 2:
      raise ValueError(
          "rewards must be [num_groups, group_size] when group_ids is None, "
          f"got shape {rewards.shape}"
      )
    num_groups, group_size = rewards.shape
    dense_ids = jnp.repeat(jnp.arange(num_groups), group_size)
  else:
    group_ids = jnp.asarray(group_ids)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
      raise ValueError(
          "with group_ids, rewards and group_ids must both be [num_sequences]; "
          f"got {rewards.shape} and {group_ids.shape}"
      )
    # Arbitrary ids (e.g. prompt indices of the whole run) -> 0..n-1, jit-safe.
    _, dense_ids = jnp.unique(group_ids, return_inverse=True, size=group_ids.shape[0])
    dense_ids = dense_ids.reshape(-1)
  flat = rewards.reshape(-1)
  if valid is None:
    valid_flat = jnp.ones(flat.shape, bool)
  else:
    if jnp.shape(valid) != rewards.shape:
      raise ValueError(f"valid shape {jnp.shape(valid)} != rewards shape {rewards.shape}")
    valid_flat = losses.as_mask(valid).reshape(-1)
  flat = jnp.where(valid_flat, flat, 0.0).astype(jnp.float32)
  return flat, dense_ids, valid_flat


def _group_sums(x, dense_ids, n):
  """Per-element sum of `x` over its group."""
  return jax.ops.segment_sum(x, dense_ids, num_segments=n)[dense_ids]


def _group_centred_std(flat, ids, valid_flat, count):
  """Per element: its reward minus its group's mean (0 if invalid), and the group's
  standard deviation (ddof=1), over the valid members."""
  n = flat.shape[0]
  mean = _group_sums(flat, ids, n) / jnp.maximum(count, 1.0)
  centred = jnp.where(valid_flat, flat - mean, 0.0)
  var = _group_sums(centred * centred, ids, n) / jnp.maximum(count - 1.0, 1.0)
  return centred, jnp.sqrt(var)


def group_normalized_advantages(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    normalize_std: bool = True,
    valid: Array | None = None,
) -> Array:
  """GRPO group-relative advantages (Shao et al. 2024); Dr.GRPO without the std.

      A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-6)   normalize_std=True  (GRPO)
      A_i =  r_i - mean_g(r)                        normalize_std=False (Dr.GRPO)

  `mean_g`, `std_g` (unbiased, ddof=1) are over the valid members of sequence
  i's group. A group with a single valid member has no baseline: its advantage is 0.

  Args:
    rewards: `[num_groups, group_size]`, or `[num_sequences]` with `group_ids`.
    group_ids: optional `[num_sequences]` integer group of each sequence (any
      values; equal ids = same prompt).
    normalize_std: divide by the group standard deviation.
    valid: optional mask of the same shape as `rewards`; invalid sequences
      (padding, filtered) take no part and get advantage 0.

  Returns:
    Advantages with the shape of `rewards`.
  """
  flat, ids, valid_flat = _group_layout(rewards, group_ids, valid)
  n = flat.shape[0]
  count = _group_sums(valid_flat.astype(jnp.float32), ids, n)
  centred, std = _group_centred_std(flat, ids, valid_flat, count)
  advantages = centred / (std + STD_EPS) if normalize_std else centred
  advantages = jnp.where(valid_flat & (count > 1), advantages, 0.0)
  return advantages.reshape(jnp.shape(rewards))


def rloo_advantages(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    valid: Array | None = None,
) -> Array:
  """RLOO leave-one-out baseline (Ahmadian et al. 2024).

      A_i = r_i - 1/(n_g - 1) * sum_{j in g, j != i} r_j

  over the `n_g` valid members of sequence i's group; 0 when `n_g < 2`.

  Args:
    rewards: `[num_groups, group_size]`, or `[num_sequences]` with `group_ids`.
    group_ids: optional `[num_sequences]` integer group of each sequence.
    valid: optional mask of the same shape as `rewards`.

  Returns:
    Advantages with the shape of `rewards`.
  """
  flat, ids, valid_flat = _group_layout(rewards, group_ids, valid)
  n = flat.shape[0]
  count = _group_sums(valid_flat.astype(jnp.float32), ids, n)
  others = (_group_sums(flat, ids, n) - flat) / jnp.maximum(count - 1.0, 1.0)
  advantages = jnp.where(valid_flat & (count > 1), flat - others, 0.0)
  return advantages.reshape(jnp.shape(rewards))


def _weighted_layout(rewards, lengths, group_ids, valid):
  flat, ids, valid_flat = _group_layout(rewards, group_ids, valid)
  lengths = jnp.asarray(lengths, jnp.float32)
  if lengths.shape != jnp.shape(rewards):
    raise ValueError(f"lengths shape {lengths.shape} != rewards shape {jnp.shape(rewards)}")
  weight = jnp.where(valid_flat, lengths.reshape(-1), 0.0)
  return flat, ids, valid_flat, weight


def opo_advantages(
    rewards: Array,
    lengths: Array,
    group_ids: Array | None = None,
    *,
    valid: Array | None = None,
) -> Array:
  """OPO's optimal baseline (Hao et al. 2025): the group's rewards averaged with each
  response's length as its weight, the variance-minimising baseline for sequence-level
  rewards under exact on-policy training.

      A_i = r_i - sum_{j in g} l_j r_j / sum_{j in g} l_j

  over the valid members of sequence i's group; 0 for a group of one (as veRL's `opo`).

  Args:
    rewards: `[num_groups, group_size]`, or `[num_sequences]` with `group_ids`.
    lengths: the responses' trained token counts, shaped like `rewards`.
    group_ids: optional `[num_sequences]` integer group of each sequence.
    valid: optional mask of the same shape as `rewards`.

  Returns:
    Advantages with the shape of `rewards`.
  """
  flat, ids, valid_flat, weight = _weighted_layout(rewards, lengths, group_ids, valid)
  n = flat.shape[0]
  count = _group_sums(valid_flat.astype(jnp.float32), ids, n)
  total = _group_sums(weight, ids, n)
  baseline = _group_sums(weight * flat, ids, n) / jnp.maximum(total, 1e-9)
  advantages = jnp.where(valid_flat & (count > 1), flat - baseline, 0.0)
  return advantages.reshape(jnp.shape(rewards))


def reinforce_pp_baseline_advantages(
    rewards: Array,
    lengths: Array,
    group_ids: Array | None = None,
    *,
    valid: Array | None = None,
) -> Array:
  """REINFORCE++-baseline (Hu et al. 2025, OpenRLHF's `reinforce_baseline`): the group's
  mean reward subtracted, then the result whitened over every trained token of the batch.

      a_i = r_i - mean_g(r)
      A_i = (a_i - mu) / sqrt(var + 1e-8),  mu, var over the batch's tokens

  A sequence's tokens all carry a_i, so the token statistics are those of the a_i weighted
  by length. Call it once on the whole rollout batch.

  Args:
    rewards: `[num_groups, group_size]`, or `[num_sequences]` with `group_ids`.
    lengths: the responses' trained token counts, shaped like `rewards`.
    group_ids: optional `[num_sequences]` integer group of each sequence.
    valid: optional mask of the same shape as `rewards`.

  Returns:
    Advantages with the shape of `rewards` (0 for invalid sequences).
  """
  flat, ids, valid_flat, weight = _weighted_layout(rewards, lengths, group_ids, valid)
  n = flat.shape[0]
  count = _group_sums(valid_flat.astype(jnp.float32), ids, n)
  centred = jnp.where(valid_flat, flat - _group_sums(flat, ids, n) / jnp.maximum(count, 1.0),
                      0.0)
  total = jnp.maximum(jnp.sum(weight), 1e-9)
  mean = jnp.sum(weight * centred) / total
  var = jnp.sum(weight * (centred - mean) ** 2) / total
  advantages = jnp.where(valid_flat, (centred - mean) * jax.lax.rsqrt(var + VAR_EPS), 0.0)
  return advantages.reshape(jnp.shape(rewards))


def _group_spread(flat, ids, valid_flat, n):
  """Per element: its group's (max, min) reward over the valid members."""
  big = jnp.finfo(jnp.float32).max
  group_max = jax.ops.segment_max(jnp.where(valid_flat, flat, -big), ids, num_segments=n)[ids]
  group_min = jax.ops.segment_min(jnp.where(valid_flat, flat, big), ids, num_segments=n)[ids]
  return group_max, group_min


def gpg_advantages(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    normalize_std: bool = False,
    valid: Array | None = None,
) -> Array:
  """GPG's group advantages with its gradient correction (Chu et al. 2025).

      A_i = alpha (r_i - mean_g(r)) [/ (std_g(r) + 1e-6)],   alpha = B / (B - M)

  over the B valid sequences of the batch, M of which belong to groups whose rewards are
  all alike (advantage 0, no gradient): the loss is averaged over the whole batch, so
  alpha scales the informative samples' share back to what it would be without them.
  The paper divides by no standard deviation (normalize_std=False). veRL's `gpg`
  counts nonzero rewards for B - M instead; this is the paper's count. Call it once on
  the whole rollout batch.

  Args:
    rewards: `[num_groups, group_size]`, or `[num_sequences]` with `group_ids`.
    group_ids: optional `[num_sequences]` integer group of each sequence.
    normalize_std: divide by the group standard deviation (ddof=1), as GRPO.
    valid: optional mask of the same shape as `rewards`.

  Returns:
    Advantages with the shape of `rewards` (0 for invalid sequences and groups of one).
  """
  flat, ids, valid_flat = _group_layout(rewards, group_ids, valid)
  n = flat.shape[0]
  count = _group_sums(valid_flat.astype(jnp.float32), ids, n)
  group_max, group_min = _group_spread(flat, ids, valid_flat, n)
  informative = valid_flat & (count > 1) & (group_max > group_min)
  alpha = (jnp.sum(valid_flat).astype(jnp.float32)
           / jnp.maximum(jnp.sum(informative), 1).astype(jnp.float32))
  base = group_normalized_advantages(flat, ids, normalize_std=normalize_std, valid=valid_flat)
  return jnp.where(informative, alpha * base, 0.0).reshape(jnp.shape(rewards))


def passk_advantages(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    normalize_std: bool = True,
    valid: Array | None = None,
) -> Array:
  """Pass@k advantages (veRL's `grpo_passk`, after Tang et al. 2025): a group is scored by
  its best sample, so only that sample is credited, with its lead over the runner-up.

      A_i = (r_max - r_second) [/ (std_g(r) + 1e-6)]   i the group's best (the first one)
      A_i = 0                                           every other sample

  A group of one, or whose best reward is tied, gets 0 throughout.

  Args:
    rewards: `[num_groups, group_size]`, or `[num_sequences]` with `group_ids`.
    group_ids: optional `[num_sequences]` integer group of each sequence.
    normalize_std: divide by the group standard deviation (ddof=1).
    valid: optional mask of the same shape as `rewards`.

  Returns:
    Advantages with the shape of `rewards`.
  """
  flat, ids, valid_flat = _group_layout(rewards, group_ids, valid)
  n = flat.shape[0]
  count = _group_sums(valid_flat.astype(jnp.float32), ids, n)
  big = jnp.finfo(jnp.float32).max
  scored = jnp.where(valid_flat, flat, -big)
  group_max = jax.ops.segment_max(scored, ids, num_segments=n)[ids]
  at_max = valid_flat & (flat == group_max)
  # The group's first sample at its maximum (lowest position), and the best of the rest.
  position = jnp.arange(n)
  first = jax.ops.segment_min(jnp.where(at_max, position, n), ids, num_segments=n)[ids]
  best = at_max & (position == first)
  second = jax.ops.segment_max(jnp.where(best, -big, scored), ids, num_segments=n)[ids]
  lead = group_max - second
  if normalize_std:
    lead = lead / (_group_centred_std(flat, ids, valid_flat, count)[1] + STD_EPS)
  return jnp.where(best & (count > 1), lead, 0.0).reshape(jnp.shape(rewards))


def remax_advantages(
    rewards: Array,
    baselines: Array,
    group_ids: Array | None = None,
    *,
    valid: Array | None = None,
) -> Array:
  """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
  Learning Method for Large Language Models"; veRL's `remax`): each prompt's baseline is
  the reward of the policy's greedy completion of it.

      A_i = r_i - b_g      b_g the greedy completion's reward, g sequence i's prompt

  The baseline comes from outside the samples, so a group of one has an advantage too.

  Args:
    rewards: `[num_groups, group_size]`, or `[num_sequences]` with `group_ids`.
    baselines: `[num_groups]` greedy rewards: row g's, or with `group_ids` that of the
      g-th smallest id.
    group_ids: optional `[num_sequences]` integer group of each sequence.
    valid: optional mask of the same shape as `rewards`.

  Returns:
    Advantages with the shape of `rewards` (0 for invalid sequences).
  """
  flat, ids, valid_flat = _group_layout(rewards, group_ids, valid)
  baselines = jnp.asarray(baselines, jnp.float32)
  if group_ids is None:
    want = (jnp.shape(rewards)[0],)
  elif isinstance(group_ids, jax.core.Tracer):  # the group count is not known under jit
    want = baselines.shape[:1]
  else:
    want = (int(jnp.unique(jnp.asarray(group_ids)).size),)
  if baselines.shape != want:
    raise ValueError(f"baselines must hold one reward per group, shape {want}, "
                     f"got {baselines.shape}")
  advantages = jnp.where(valid_flat, flat - baselines[ids], 0.0)
  return advantages.reshape(jnp.shape(rewards))


def distillation_advantages(
    teacher_logprobs: Array,
    student_logprobs: Array,
    mask: Array,
    *,
    coef: float = 1.0,
) -> Array:
  """On-policy distillation's per-token advantage (GKD, Agarwal et al. 2024, with the
  reverse KL; Lu et al. 2025, "On-Policy Distillation"):

      A_t = coef * (log p_teacher(y_t) - log p_student(y_t))

  for the student's own sampled tokens y_t: minus the single-sample estimate of the
  per-token reverse KL, KL(student || teacher), with no sum over later tokens (a discount
  of 0), so each token is pushed toward what the teacher would say there. Added to an
  estimator's advantages, or alone (pure distillation), it makes the policy-gradient loss
  minimise the reverse KL to the teacher on the student's own distribution.

  Args:
    teacher_logprobs: `[batch, length]` the teacher's log-probs of the targets.
    student_logprobs: `[batch, length]` the student's (the policy that sampled them).
    mask: `[batch, length]`, nonzero on trained targets.
    coef: the advantage's weight, >= 0.

  Returns:
    `[batch, length]` float32, 0 at masked positions.
  """
  if not coef >= 0:
    raise ValueError(f"distillation coef must be >= 0, got {coef}")
  losses.check_token_shapes(teacher_logprobs=teacher_logprobs,
                            student_logprobs=student_logprobs, mask=mask)
  mask = losses.as_mask(mask)
  gap = (jnp.where(mask, jnp.asarray(teacher_logprobs, jnp.float32), 0.0)
         - jnp.where(mask, jnp.asarray(student_logprobs, jnp.float32), 0.0))
  return jnp.where(mask, coef * gap, 0.0)


def dynamic_sampling_mask(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    valid: Array | None = None,
) -> Array:
  """DAPO dynamic sampling: keep only groups whose rewards are not all equal.

  A group where every sample scores the same has zero GRPO advantage and only
  dilutes the batch; the sampler should draw more prompts instead.

  Args:
    rewards: `[num_groups, group_size]`, or `[num_sequences]` with `group_ids`.
    group_ids: optional `[num_sequences]` integer group of each sequence.
    valid: optional mask of the same shape as `rewards`.

  Returns:
    Boolean mask with the shape of `rewards`: True for valid members of
    informative groups.
  """
  flat, ids, valid_flat = _group_layout(rewards, group_ids, valid)
  group_max, group_min = _group_spread(flat, ids, valid_flat, flat.shape[0])
  return (valid_flat & (group_max > group_min)).reshape(jnp.shape(rewards))


def overlong_penalty(
    response_lengths: Array,
    *,
    max_response_len: int,
    buffer_len: int,
    factor: float = 1.0,
) -> Array:
  """DAPO soft overlong punishment, added to the sequence reward.

      0                                  if L <= L_max - L_buf
      factor * ((L_max - L_buf) - L) / L_buf   if L_max - L_buf < L <= L_max
      -factor                            if L > L_max

  Args:
    response_lengths: `[num_sequences]` generated lengths in tokens.
    max_response_len: `L_max`, the sampler's response budget.
    buffer_len: `L_buf`, length of the linear penalty ramp before `L_max`.
    factor: penalty at and past `L_max`.

  Returns:
    `[num_sequences]` float32 penalties (<= 0).
  """
  if not 0 < buffer_len <= max_response_len:
    raise ValueError(
        f"buffer_len must be in (0, max_response_len={max_response_len}], got {buffer_len}")
  lengths = jnp.asarray(response_lengths, jnp.float32)
  start = max_response_len - buffer_len
  ramp = (start - lengths) / buffer_len
  penalty = jnp.where(lengths <= start, 0.0, jnp.where(lengths <= max_response_len, ramp, -1.0))
  return factor * penalty


# Registry: estimator name -> pure function. "Dr.GRPO" is "grpo" with
# normalize_std=False (a preset knob), not a separate estimator.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Array | tuple[Array, Array]]] = {
    "gae": gae_advantages,
    "grpo": group_normalized_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_plus_plus_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "opo": opo_advantages,
    "gpg": gpg_advantages,
    "grpo_passk": passk_advantages,
    "remax": remax_advantages,
}

# Estimators that need no critic and take one reward per sequence.
SEQUENCE_LEVEL_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg",
                                       "grpo_passk", "remax"})
# The sequence-level ones that also read each response's length.
LENGTH_WEIGHTED_ESTIMATORS = frozenset({"reinforce_pp_baseline", "opo"})


def get_advantage_estimator(name: str) -> Callable[..., Array | tuple[Array, Array]]:
  """Returns the registered estimator `name`; one-line error if unknown."""
  if name not in ADVANTAGE_ESTIMATORS:
    known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
    raise ValueError(f"unknown advantage estimator {name!r}; known: {known}")
  return ADVANTAGE_ESTIMATORS[name]
