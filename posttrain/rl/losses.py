"""Policy, KL, entropy and value losses for the PPO/GRPO family.

All token arrays are `[batch, length]`, aligned to target tokens (see
`posttrain.rl.packing`); `loss_mask` marks the model's own generated targets.
Inputs at masked positions are replaced with `jnp.where` before any arithmetic,
so NaN/inf garbage there never reaches outputs or gradients.

Exact micro-batch accumulation. Every aggregation is a weighted token sum
`sum_t w_t * loss_t / D` whose weights `w` and denominator `D` depend only on
masks (`token_weights`). A train step sums the per-microbatch denominators of
the whole (mini)batch first, then calls `rl_loss(..., denominator=D_total)` per
microbatch: the microbatch losses and their gradients then add up to exactly
the full-batch values. Metrics are `Metric`s holding sums and counts; merge them
with `merge_metrics` and turn them into numbers with `compute_metrics`.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array

# Log-ratios are clamped before exp: exp(20) ~ 5e8 is far outside any clip range
# and keeps one stale token from producing inf * 0 = NaN.
MAX_LOG_RATIO = 20.0

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


# ----------------------------------------------------------------------------
# Metrics carried as (sum, count) so micro-batch averages stay exact.
# ----------------------------------------------------------------------------


@struct.dataclass
class Metric:
  """A metric accumulated over micro-batches.

  `reduce="mean"`: `total / count`. `"max"`: `total` is a running max.
  `"std"`: standard deviation from `total` (sum), `total_sq` (sum of squares)
  and `count`.
  """

  total: Array
  count: Array
  total_sq: Array
  reduce: str = struct.field(pytree_node=False, default="mean")

  @classmethod
  def mean(cls, total, count) -> "Metric":
    zero = jnp.zeros((), jnp.float32)
    return cls(jnp.asarray(total, jnp.float32), jnp.asarray(count, jnp.float32), zero, "mean")

  @classmethod
  def max(cls, value, count) -> "Metric":
    zero = jnp.zeros((), jnp.float32)
    return cls(jnp.asarray(value, jnp.float32), jnp.asarray(count, jnp.float32), zero, "max")

  @classmethod
  def std(cls, total, total_sq, count) -> "Metric":
    return cls(
        jnp.asarray(total, jnp.float32),
        jnp.asarray(count, jnp.float32),
        jnp.asarray(total_sq, jnp.float32),
        "std",
    )

  def merge(self, other: "Metric") -> "Metric":
    if self.reduce == "max":
      total = jnp.maximum(self.total, other.total)
    else:
      total = self.total + other.total
    return Metric(total, self.count + other.count, self.total_sq + other.total_sq, self.reduce)

  def compute(self) -> Array:
    has_data = self.count > 0
    count = jnp.maximum(self.count, 1.0)
    if self.reduce == "max":
      return jnp.where(has_data, self.total, 0.0)
    mean = self.total / count
    if self.reduce == "std":
      return jnp.sqrt(jnp.maximum(self.total_sq / count - mean * mean, 0.0))
    return mean


def merge_metrics(a: Mapping[str, Metric], b: Mapping[str, Metric]) -> dict[str, Metric]:
  """Merges two metric dicts (e.g. two micro-batches); keys present in either."""
  out = dict(a)
  for name, metric in b.items():
    out[name] = out[name].merge(metric) if name in out else metric
  return out


def merge_stacked_metrics(metrics: Mapping[str, Metric]) -> dict[str, Metric]:
  """Merges metrics stacked on a leading axis (e.g. the outputs of a `lax.scan`)."""

  def reduce(metric: Metric) -> Metric:
    fold = jnp.max if metric.reduce == "max" else jnp.sum
    return Metric(fold(metric.total, 0), jnp.sum(metric.count, 0), jnp.sum(metric.total_sq, 0),
                  metric.reduce)

  return {name: reduce(metric) for name, metric in metrics.items()}


def compute_metrics(metrics: Mapping[str, Metric]) -> dict[str, Array]:
  """Final values of a metric dict, as device scalars (no host sync)."""
  return {name: metric.compute() for name, metric in metrics.items()}


def _masked_mean_metric(x, mask) -> Metric:
  return Metric.mean(jnp.sum(jnp.where(mask, x, 0.0)), jnp.sum(mask))


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def check_token_shapes(**arrays) -> None:
  """One-line ValueError unless all non-None arrays share one `[batch, length]` shape."""
  shapes = {name: jnp.shape(a) for name, a in arrays.items() if a is not None}
  first_name, first_shape = next(iter(shapes.items()))
  if len(first_shape) != 2:
    raise ValueError(f"{first_name} must be [batch, length], got shape {first_shape}")
  for name, shape in shapes.items():
    if shape != first_shape:
      raise ValueError(f"{name} shape {shape} != {first_name} shape {first_shape}")


def as_mask(mask) -> Array:
  """Any-dtype mask as bool."""
  return jnp.asarray(mask) != 0


def _clean(x, mask) -> Array:
  return jnp.where(mask, x, 0.0).astype(jnp.float32)


def segment_sum_per_token(x: Array, segment_ids: Array | None) -> Array:
  """Each token gets the sum of `x` over its sequence (same row, same segment id).

  Args:
    x: `[batch, length]`; must already be 0 where it should not count.
    segment_ids: `[batch, length]` packed-sequence ids, or None when each row is
      one sequence.

  Returns:
    `[batch, length]` per-token sequence sums.
  """
  if segment_ids is None:
    return jnp.broadcast_to(jnp.sum(x, axis=-1, keepdims=True), x.shape)
  length = x.shape[-1]

  def one_row(x_row, ids_row):
    return jax.ops.segment_sum(x_row, ids_row, num_segments=length + 1)[ids_row]

  # vmap keeps the scatter per row, so a batch-sharded input stays sharded.
  return jax.vmap(one_row)(x, jnp.asarray(segment_ids, jnp.int32))


def _num_sequences(mask, segment_ids) -> Array:
  """Number of sequences with at least one valid token (an exact integer count)."""
  if segment_ids is None:
    return jnp.sum(jnp.any(mask, axis=-1))
  length = mask.shape[-1]

  def one_row(mask_row, ids_row):
    return jax.ops.segment_max(mask_row, ids_row, num_segments=length + 1)

  has_valid = jax.vmap(one_row)(mask.astype(jnp.int32), jnp.asarray(segment_ids, jnp.int32))
  return jnp.sum(has_valid > 0)


def token_weights(
    loss_mask: Array,
    mode: str,
    *,
    segment_ids: Array | None = None,
    max_response_len: int | None = None,
) -> tuple[Array, Array]:
  """Per-token weights `w` and denominator `D` of a loss aggregation mode.

  The aggregated loss is `sum_t w_t * loss_t / D`:

      token_mean               w_t = m_t          D = sum_t m_t            (DAPO)
      seq_mean_token_mean      w_t = m_t / n_i    D = #sequences           (GRPO)
      seq_mean_token_sum_norm  w_t = m_t / L_max  D = #sequences           (Dr.GRPO)

  `n_i` is the number of valid tokens of token t's sequence, `L_max` a constant
  (the sampler's maximum response length). Sequences without valid tokens do
  not count. `D` of a batch is the sum of the `D`s of its micro-batches.

  Args:
    loss_mask: `[batch, length]`, nonzero on trained targets.
    mode: one of `AGG_MODES`.
    segment_ids: optional packed-sequence ids; None = one sequence per row.
    max_response_len: `L_max`, required for `seq_mean_token_sum_norm`.

  Returns:
    `(weights [batch, length] float32, denominator scalar float32)`.
  """
  if mode not in AGG_MODES:
    raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(AGG_MODES)}")
  check_token_shapes(loss_mask=loss_mask, segment_ids=segment_ids)
  mask = as_mask(loss_mask)
  maskf = mask.astype(jnp.float32)
  if mode == "token_mean":
    return maskf, jnp.sum(maskf)
  num_sequences = _num_sequences(mask, segment_ids).astype(jnp.float32)
  if mode == "seq_mean_token_mean":
    lengths = segment_sum_per_token(maskf, segment_ids)
    return jnp.where(mask, 1.0 / jnp.maximum(lengths, 1.0), 0.0), num_sequences
  if not max_response_len or max_response_len <= 0:
    raise ValueError(f"seq_mean_token_sum_norm needs max_response_len > 0, got {max_response_len}")
  return maskf / float(max_response_len), num_sequences


def aggregate(per_token_loss: Array, weights: Array, denominator: Array) -> Array:
  """`sum_t w_t * loss_t / D`, 0 when `D == 0`. Masked tokens have `w_t = 0`."""
  numerator = jnp.sum(jnp.where(weights != 0, per_token_loss * weights, 0.0))
  return jnp.where(denominator > 0, numerator / jnp.maximum(denominator, 1e-30), 0.0)


# ----------------------------------------------------------------------------
# Policy losses
# ----------------------------------------------------------------------------


def clipped_surrogate(
    log_ratio: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
) -> tuple[Array, dict[str, Metric]]:
  """PPO clipped surrogate with asymmetric (clip-higher) and dual clipping.

      r_t = exp(log_ratio_t)
      L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
      L_t = min(L_t, -c A_t)          if A_t < 0 and dual_clip c > 1

  The gradient is zero where the ratio is clipped in the direction the
  advantage pushes: A > 0 and r > 1 + eps_high; A < 0 and r < 1 - eps_low;
  A < 0 and r > c (dual clip).

  Args:
    log_ratio: `[batch, length]` log importance ratio (learner / old policy).
    advantages: `[batch, length]`.
    mask: `[batch, length]`, nonzero on trained targets.
    eps_low: lower clip range (ratio floor `1 - eps_low`).
    eps_high: upper clip range (ratio ceiling `1 + eps_high`; DAPO uses > eps_low).
    dual_clip: `c > 1` enables dual clipping; 0 disables it.

  Returns:
    `(per_token_loss, metrics)`; loss is 0 at masked positions. Metrics:
    clip_fraction/low, clip_fraction/high, clip_fraction/dual, ratio/mean, ratio/max.
  """
  mask = as_mask(mask)
  log_ratio = jnp.clip(_clean(log_ratio, mask), -MAX_LOG_RATIO, MAX_LOG_RATIO)
  advantages = _clean(advantages, mask)
  ratio = jnp.exp(log_ratio)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(unclipped, clipped)
  dual_clipped = jnp.zeros(mask.shape, bool)
  if dual_clip:
    dual_bound = -dual_clip * advantages
    dual_clipped = (advantages < 0) & (loss > dual_bound)
    loss = jnp.where(advantages < 0, jnp.minimum(loss, dual_bound), loss)
  loss = jnp.where(mask, loss, 0.0)

  count = jnp.sum(mask)
  high = mask & (advantages > 0) & (ratio > 1.0 + eps_high)
  low = mask & (advantages < 0) & (ratio < 1.0 - eps_low)
  ratio_stop = jax.lax.stop_gradient(ratio)
  metrics = {
      "clip_fraction/low": Metric.mean(jnp.sum(low), count),
      "clip_fraction/high": Metric.mean(jnp.sum(high), count),
      "clip_fraction/dual": Metric.mean(jnp.sum(mask & dual_clipped), count),
      "ratio/mean": _masked_mean_metric(ratio_stop, mask),
      "ratio/max": Metric.max(jnp.max(jnp.where(mask, ratio_stop, -jnp.inf)), count),
  }
  return loss, metrics


def ppo_log_ratio(log_probs, old_log_probs, mask, segment_ids=None) -> Array:
  """Token-level log ratio `log pi(y_t) - log pi_old(y_t)` (0 at masked tokens)."""
  del segment_ids
  mask = as_mask(mask)
  return _clean(log_probs, mask) - _clean(old_log_probs, mask)


def gspo_log_ratio(log_probs, old_log_probs, mask, segment_ids=None) -> Array:
  """GSPO-token log ratio (Zheng et al. 2025), sequence-level in value.

      log s_i     = 1/|y_i| sum_t (log pi(y_t) - log pi_old(y_t))
      log s_{i,t} = sg[log s_i] + log pi(y_t) - sg[log pi(y_t)]

  Its value is the length-normalised sequence ratio `s_i` for every token of
  sequence i; its gradient is `s_i * grad log pi(y_t)`. With advantages constant
  over a sequence and `seq_mean_token_mean` aggregation this equals the
  sequence-level GSPO objective in value and gradient.
  """
  mask = as_mask(mask)
  log_probs = _clean(log_probs, mask)
  token_log_ratio = log_probs - _clean(old_log_probs, mask)
  seq_sum = segment_sum_per_token(jnp.where(mask, token_log_ratio, 0.0), segment_ids)
  seq_len = segment_sum_per_token(mask.astype(jnp.float32), segment_ids)
  seq_log_ratio = jax.lax.stop_gradient(seq_sum / jnp.maximum(seq_len, 1.0))
  log_ratio = seq_log_ratio + log_probs - jax.lax.stop_gradient(log_probs)
  return jnp.where(mask, log_ratio, 0.0)


def _policy_loss(log_ratio_fn, log_probs, old_log_probs, advantages, loss_mask, eps_low,
                 eps_high, dual_clip, segment_ids):
  check_token_shapes(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                loss_mask=loss_mask, segment_ids=segment_ids)
  log_ratio = log_ratio_fn(log_probs, old_log_probs, loss_mask, segment_ids)
  return clipped_surrogate(log_ratio, advantages, loss_mask, eps_low=eps_low,
                           eps_high=eps_high, dual_clip=dual_clip)


def ppo_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    segment_ids: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
  """PPO per-token loss: `clipped_surrogate` of the token ratio (`ppo_log_ratio`).

  Returns:
    `(per_token_loss [batch, length], metrics)`.
  """
  return _policy_loss(ppo_log_ratio, log_probs, old_log_probs, advantages, loss_mask,
                      eps_low, eps_high, dual_clip, segment_ids)


def gspo_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    segment_ids: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
  """GSPO per-token loss: `clipped_surrogate` of the sequence ratio (`gspo_log_ratio`).

  Pass `segment_ids` for packed rows so the ratio is per sequence, not per row.

  Returns:
    `(per_token_loss [batch, length], metrics)`.
  """
  return _policy_loss(gspo_log_ratio, log_probs, old_log_probs, advantages, loss_mask,
                      eps_low, eps_high, dual_clip, segment_ids)


def _refuse_dual_clip(dual_clip: float, loss: str) -> None:
  if dual_clip:
    raise ValueError(f"dual_clip={dual_clip} applies to the ppo and gspo losses, not {loss}")


def _ratio_metrics(ratio, mask, low, high) -> dict[str, Metric]:
  count = jnp.sum(mask)
  ratio = jax.lax.stop_gradient(ratio)
  return {
      "clip_fraction/low": Metric.mean(jnp.sum(mask & low), count),
      "clip_fraction/high": Metric.mean(jnp.sum(mask & high), count),
      "clip_fraction/dual": Metric.mean(jnp.zeros(()), count),
      "ratio/mean": _masked_mean_metric(ratio, mask),
      "ratio/max": Metric.max(jnp.max(jnp.where(mask, ratio, -jnp.inf)), count),
  }


def cispo_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    segment_ids: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
  """CISPO (MiniMax-M1, 2025): the importance weight is clipped and held constant, and
  every token keeps its policy gradient (PPO's clip zeroes the gradient of clipped tokens).

      w_t = sg(clip(r_t, 1 - eps_low, 1 + eps_high))
      L_t = -A_t w_t (1 + log pi(y_t) - sg(log pi(y_t)))

  Its value is `-A_t w_t` and its gradient `-A_t w_t grad log pi(y_t)`, as veRL's
  `cispo` loss. `eps_low = 1` sets no lower bound (the paper's choice).

  Returns:
    `(per_token_loss [batch, length], metrics)`; clip fractions count the tokens whose
    weight was clipped, whatever their advantage's sign.
  """
  del segment_ids
  _refuse_dual_clip(dual_clip, "cispo")
  check_token_shapes(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                     loss_mask=loss_mask)
  mask = as_mask(loss_mask)
  log_probs = _clean(log_probs, mask)
  log_ratio = jnp.clip(log_probs - _clean(old_log_probs, mask), -MAX_LOG_RATIO, MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  advantages = _clean(advantages, mask)
  loss = -advantages * weight * (1.0 + log_probs - jax.lax.stop_gradient(log_probs))
  metrics = _ratio_metrics(ratio, mask, ratio < 1.0 - eps_low, ratio > 1.0 + eps_high)
  return jnp.where(mask, loss, 0.0), metrics


def gmpo_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    segment_ids: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
  """GMPO (Zhao et al. 2025): the geometric mean of a sequence's token ratios, each
  clipped in log space, in place of GRPO's arithmetic mean.

      c_t = sgn(A_t) min(sgn(A_t) log r_t, sgn(A_t) clip(log r_t, -eps_low, eps_high))
      s_i = exp(mean_{t in i} c_t),   L_i = -A_i s_i
      L_t = -A_t exp(sg[log s_i] + c_t - sg[c_t])      (per token)

  Each token's value is its sequence's `-A s_i` and its gradient `-A s_i grad c_t`, so with
  advantages constant over a sequence and `seq_mean_token_mean` aggregation this is the
  sequence-level objective in value and gradient (as GSPO's token form is). The clip
  range is in log space: the paper's (e^-0.4, e^0.4) is eps_low = eps_high = 0.4. Pass
  `segment_ids` for packed rows.

  Returns:
    `(per_token_loss [batch, length], metrics)`; `ratio/*` are the sequence ratios s_i.
  """
  _refuse_dual_clip(dual_clip, "gmpo")
  check_token_shapes(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                     loss_mask=loss_mask, segment_ids=segment_ids)
  mask = as_mask(loss_mask)
  log_ratio = jnp.clip(_clean(log_probs, mask) - _clean(old_log_probs, mask),
                       -MAX_LOG_RATIO, MAX_LOG_RATIO)
  advantages = _clean(advantages, mask)
  sign = jnp.sign(advantages)
  clipped = jnp.clip(log_ratio, -eps_low, eps_high)
  c = sign * jnp.minimum(sign * log_ratio, sign * clipped)
  c = jnp.where(mask, c, 0.0)
  seq_sum = segment_sum_per_token(c, segment_ids)
  seq_len = segment_sum_per_token(mask.astype(jnp.float32), segment_ids)
  log_s = jax.lax.stop_gradient(seq_sum / jnp.maximum(seq_len, 1.0))
  loss = -advantages * jnp.exp(log_s + c - jax.lax.stop_gradient(c))
  metrics = _ratio_metrics(jnp.exp(log_s), mask, (advantages < 0) & (log_ratio < -eps_low),
                           (advantages > 0) & (log_ratio > eps_high))
  return jnp.where(mask, loss, 0.0), metrics


def gpg_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    segment_ids: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
  """GPG (Chu et al. 2025): the plain policy gradient, no ratio and no clip.

      L_t = -A_t log pi(y_t)

  On-policy its gradient is PPO's at ratio 1; it takes no importance weight for stale
  samples (use one update per rollout batch). `eps_low` and `eps_high` are unused.

  Returns:
    `(per_token_loss [batch, length], metrics)`; `ratio/*` describe pi / pi_old, clip
    fractions are 0.
  """
  del segment_ids, eps_low, eps_high
  _refuse_dual_clip(dual_clip, "gpg")
  check_token_shapes(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                     loss_mask=loss_mask)
  mask = as_mask(loss_mask)
  log_probs = _clean(log_probs, mask)
  ratio = jnp.exp(jnp.clip(log_probs - _clean(old_log_probs, mask),
                           -MAX_LOG_RATIO, MAX_LOG_RATIO))
  none = jnp.zeros(mask.shape, bool)
  loss = -_clean(advantages, mask) * log_probs
  return jnp.where(mask, loss, 0.0), _ratio_metrics(ratio, mask, none, none)


def sapo_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    segment_ids: Array | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Array, dict[str, Metric]]:
  """SAPO (Gao et al. 2025, Qwen): a smooth gate in place of the hard clip.

      tau_t = tau_pos if A_t > 0 else tau_neg
      f(r)  = 4 / tau_t * sigmoid(tau_t (r_t - 1))
      L_t   = -A_t f(r_t)

  Its gradient is `-A_t g_t r_t grad log pi(y_t)` with the gate
  `g_t = 4 sigmoid(tau_t (r_t - 1)) (1 - sigmoid(tau_t (r_t - 1)))`: 1 on-policy (r = 1,
  PPO's gradient there), falling smoothly as the ratio leaves 1 in either direction,
  faster for larger `tau`. Where PPO drops a token outside its band entirely, SAPO
  damps it; a larger `tau_neg` damps negative-advantage tokens sooner (their gradients
  spread probability over the whole vocabulary, the less stable side). `eps_low` and
  `eps_high` are unused.

  Returns:
    `(per_token_loss [batch, length], metrics)`: `sapo/gate` is the mean gate `g_t`, clip
    fractions count tokens whose gate fell below 1/2 (|tau (r - 1)| > 1.76), low for
    r < 1, high for r > 1.
  """
  del segment_ids, eps_low, eps_high
  _refuse_dual_clip(dual_clip, "sapo")
  if not (tau_pos > 0 and tau_neg > 0):
    raise ValueError(f"sapo needs tau_pos > 0 and tau_neg > 0, got ({tau_pos}, {tau_neg})")
  check_token_shapes(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                     loss_mask=loss_mask)
  mask = as_mask(loss_mask)
  log_ratio = jnp.clip(_clean(log_probs, mask) - _clean(old_log_probs, mask),
                       -MAX_LOG_RATIO, MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  advantages = _clean(advantages, mask)
  tau = jnp.where(advantages > 0, tau_pos, tau_neg)
  z = tau * (ratio - 1.0)
  loss = -advantages * (4.0 / tau) * jax.nn.sigmoid(z)
  sig = jax.lax.stop_gradient(jax.nn.sigmoid(z))
  gate = 4.0 * sig * (1.0 - sig)
  damped = gate < 0.5
  metrics = _ratio_metrics(ratio, mask, damped & (ratio < 1.0), damped & (ratio > 1.0))
  metrics["sapo/gate"] = _masked_mean_metric(gate, mask)
  return jnp.where(mask, loss, 0.0), metrics


# ----------------------------------------------------------------------------
# Covariance-selected tokens: Clip-Cov and KL-Cov (Cui et al. 2025)
# ----------------------------------------------------------------------------

# Policy losses that act on the tokens `covariance_selection` picks (batch["cov_selected"]).
COVARIANCE_LOSSES = ("clip_cov", "kl_cov")


def token_covariance(advantages: Array, log_probs: Array, loss_mask: Array) -> Array:
  """Each token's centred cross-product, the summands of Cov(log pi, A) over the batch:

      cov_t = (A_t - mean(A)) (log pi(y_t) - mean(log pi))

  Means over the masked tokens of the whole array (any shape); 0 at masked-out tokens.
  The entropy of a softmax policy falls, under policy gradient, by about this covariance:
  tokens where it is large (confident and rewarded) are the ones that collapse entropy.
  """
  mask = as_mask(loss_mask)
  advantages, log_probs = _clean(advantages, mask), _clean(log_probs, mask)
  count = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
  mean_a = jnp.sum(advantages) / count
  mean_lp = jnp.sum(log_probs) / count
  return jnp.where(mask, (advantages - mean_a) * (log_probs - mean_lp), 0.0)


def _descending_ranks(scores: Array, eligible: Array) -> Array:
  """0-based rank of each eligible element by descending score among the eligible ones
  (ties in array order); the others rank after all of them."""
  flat = jnp.where(eligible, scores, -jnp.inf).reshape(-1)
  order = jnp.argsort(-flat, stable=True)
  ranks = jnp.zeros(order.shape, jnp.int32).at[order].set(
      jnp.arange(order.shape[0], dtype=jnp.int32))
  return ranks.reshape(scores.shape)


def covariance_selection(advantages: Array, log_probs: Array, loss_mask: Array, *,
                         mode: str, fraction: float, lower: float = 1.0,
                         upper: float = 5.0, key: Array | None = None) -> Array:
  """The tokens Clip-Cov or KL-Cov act on, chosen over the whole (mini)batch.

  With n masked tokens and k = max(1, floor(fraction * n)):

      kl_cov    the k tokens of largest `token_covariance` (ties: the earlier one)
      clip_cov  k tokens drawn uniformly without replacement among those with
                lower < cov_t < upper (all of them when fewer)

  as veRL's `kl_cov` / `clip_cov` losses pick them. Computed once for a step's whole batch
  (leading micro-batch axes included), so micro-batching changes nothing.

  Args:
    advantages, log_probs, loss_mask: same shape; `log_probs` without gradient (the
      train step passes the learner's `old_logprobs`, equal to the current ones on a
      batch's first update).
    mode: "clip_cov" or "kl_cov".
    fraction: the share of masked tokens selected, in (0, 1].
    lower, upper: clip_cov's covariance window.
    key: clip_cov's PRNG key.

  Returns:
    A bool array of the inputs' shape.
  """
  if mode not in COVARIANCE_LOSSES:
    raise ValueError(f"unknown covariance selection {mode!r}; known: "
                     f"{', '.join(COVARIANCE_LOSSES)}")
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}")
  mask = as_mask(loss_mask)
  cov = token_covariance(advantages, jax.lax.stop_gradient(log_probs), mask)
  count = jnp.sum(mask)
  k = jnp.maximum(1, jnp.floor(count.astype(jnp.float32) * fraction).astype(jnp.int32))
  if mode == "kl_cov":
    return mask & (_descending_ranks(cov, mask) < k)
  if key is None:
    raise ValueError("clip_cov's selection is random: pass a PRNG key")
  if not lower < upper:
    raise ValueError(f"clip_cov needs lower < upper, got ({lower}, {upper})")
  candidates = mask & (cov > lower) & (cov < upper)
  # A uniform priority per token: the k highest among the candidates are a uniform draw
  # without replacement. Drawn flat, so the draw does not depend on the micro-batch layout.
  priority = jax.random.uniform(key, (cov.size,)).reshape(cov.shape)
  return candidates & (_descending_ranks(priority, candidates) < k)


def _selected_metrics(selected, mask) -> dict[str, Metric]:
  return {"cov/selected_fraction": Metric.mean(jnp.sum(mask & selected), jnp.sum(mask))}


def _covariance_inputs(loss, log_probs, old_log_probs, advantages, loss_mask, selected,
                       dual_clip):
  """The checks the covariance losses share; (mask, selected) as bool."""
  _refuse_dual_clip(dual_clip, loss)
  if selected is None:
    raise ValueError(f"{loss} needs the selected tokens (losses.covariance_selection)")
  check_token_shapes(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                     loss_mask=loss_mask, selected=selected)
  return as_mask(loss_mask), as_mask(selected)


def clip_cov_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    segment_ids: Array | None = None,
    selected: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
  """Clip-Cov (Cui et al. 2025): PPO's clipped surrogate with the selected tokens' loss
  and gradient removed, a few tokens of high covariance between log-prob and advantage,
  which keeps the policy's entropy from collapsing.

      L_t = 0                                              selected
      L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))   otherwise

  Args:
    selected: `covariance_selection(..., mode="clip_cov")` of the whole batch.

  Returns:
    `(per_token_loss [batch, length], metrics)`: PPO's, plus `cov/selected_fraction`.
  """
  del segment_ids
  mask, selected = _covariance_inputs("clip_cov", log_probs, old_log_probs, advantages,
                                      loss_mask, selected, dual_clip)
  loss, metrics = clipped_surrogate(ppo_log_ratio(log_probs, old_log_probs, mask), advantages,
                                    mask, eps_low=eps_low, eps_high=eps_high)
  metrics.update(_selected_metrics(selected, mask))
  return jnp.where(selected, 0.0, loss), metrics


def kl_cov_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    segment_ids: Array | None = None,
    selected: Array | None = None,
    coef: float = 1.0,
) -> tuple[Array, dict[str, Metric]]:
  """KL-Cov (Cui et al. 2025): the unclipped policy gradient, with a penalty on the
  selected tokens (those of largest covariance between log-prob and advantage) for moving
  away from the old policy.

      L_t = -A_t r_t + coef |log r_t|     selected
      L_t = -A_t r_t                      otherwise

  as veRL's `kl_cov`. No ratio clip: `eps_low` and `eps_high` are unused.

  Args:
    selected: `covariance_selection(..., mode="kl_cov")` of the whole batch.
    coef: the penalty's weight (the paper's and veRL's default 1).

  Returns:
    `(per_token_loss [batch, length], metrics)`: ratio statistics (clip fractions 0),
    `cov/selected_fraction` and `kl_cov/abs_log_ratio`, the mean |log r| of the tokens.
  """
  del segment_ids, eps_low, eps_high
  mask, selected = _covariance_inputs("kl_cov", log_probs, old_log_probs, advantages,
                                      loss_mask, selected, dual_clip)
  log_ratio = jnp.clip(ppo_log_ratio(log_probs, old_log_probs, mask),
                       -MAX_LOG_RATIO, MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  advantages = _clean(advantages, mask)
  abs_log_ratio = jnp.abs(log_ratio)
  loss = -advantages * ratio + jnp.where(selected, coef * abs_log_ratio, 0.0)
  none = jnp.zeros(mask.shape, bool)
  metrics = _ratio_metrics(ratio, mask, none, none)
  metrics.update(_selected_metrics(selected, mask))
  metrics["kl_cov/abs_log_ratio"] = _masked_mean_metric(
      jax.lax.stop_gradient(abs_log_ratio), mask)
  return jnp.where(mask, loss, 0.0), metrics


POLICY_LOSSES: dict[str, Callable[..., tuple[Array, dict[str, Metric]]]] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
    "gmpo": gmpo_policy_loss,
    "gpg": gpg_policy_loss,
    "sapo": sapo_policy_loss,
    "clip_cov": clip_cov_policy_loss,
    "kl_cov": kl_cov_policy_loss,
}


def get_policy_loss(name: str):
  """Returns the registered policy loss `name`; one-line error if unknown."""
  if name not in POLICY_LOSSES:
    raise ValueError(f"unknown policy loss {name!r}; known: {', '.join(sorted(POLICY_LOSSES))}")
  return POLICY_LOSSES[name]


# ----------------------------------------------------------------------------
# High-entropy minority tokens (Wang et al. 2025)
# ----------------------------------------------------------------------------


def _top_count(count: Array, fraction: float) -> Array:
  """max(1, ceil(fraction * count)) in float32. The slack of 2^-22 (relative) exceeds the
  float32 rounding of the product, so an exact integer product is not rounded up to the
  next integer (below ~4M tokens the count is exact)."""
  product = count.astype(jnp.float32) * fraction
  return jnp.maximum(1, jnp.ceil(product * (1.0 - 2.0**-22)).astype(jnp.int32))


def high_entropy_selection(entropies: Array, loss_mask: Array, *, fraction: float) -> Array:
  """The tokens whose policy gradient `top_entropy_fraction` keeps: the high-entropy
  "forking" tokens of Wang et al. 2025 (Beyond the 80/20 Rule), chosen over a whole batch.

  With n masked tokens, the k = max(1, ceil(fraction * n)) of largest entropy (ties: the
  earlier one in array order), as the paper's code picks them (`get_global_entropy_top_mask`
  of its veRL fork: a top-k of ceil(ratio * n)). TRL's `top_entropy_quantile` keeps instead
  every token whose entropy is >= the linearly interpolated (1 - fraction) quantile:
  1 + floor(fraction * (n - 1)) tokens when entropies are distinct (ceil(fraction * n) or one
  fewer) and every tie at the threshold, chosen per micro-batch (gathered over processes)
  from the entropies of the pass being differentiated. Here the selection is made once for
  a step's whole batch (leading micro-batch axes included) from the learner's entropies
  before the update (the current ones on a batch's first update), so micro-batching
  changes nothing.

  Args:
    entropies: the per-token entropies of the learner's (tempered) next-token
      distribution, any shape; values at masked-out positions are ignored (NaN included).
    loss_mask: same shape, nonzero on trained targets.
    fraction: the share of masked tokens selected, in (0, 1]; 1 selects them all.

  Returns:
    A bool array of the inputs' shape, False wherever `loss_mask` is 0.
  """
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}")
  if jnp.shape(entropies) != jnp.shape(loss_mask):
    raise ValueError(f"entropies shape {jnp.shape(entropies)} != loss_mask shape "
                     f"{jnp.shape(loss_mask)}")
  mask = as_mask(loss_mask)
  k = _top_count(jnp.sum(mask), fraction)
  ranks = _descending_ranks(jax.lax.stop_gradient(entropies).astype(jnp.float32), mask)
  return mask & (ranks < k)


# ----------------------------------------------------------------------------
# Off-policy correction
# ----------------------------------------------------------------------------


def truncated_importance_weights(
    old_log_probs: Array, behaviour_log_probs: Array, mask: Array, *, cap: float
) -> Array:
  """Truncated importance sampling (TIS) weights between sampler and learner.

      w_t = min(exp(log pi_old(y_t) - log mu(y_t)), cap)

  `mu` is the sampler (behaviour) policy, `pi_old` the learner's copy of the
  same weights (they differ by numerics, or by policy lag when disaggregated).
  Multiplies the per-token policy loss; carries no gradient.

  Returns:
    `[batch, length]` weights, 0 at masked positions.
  """
  if cap <= 0:
    raise ValueError(f"tis cap must be > 0, got {cap}")
  check_token_shapes(old_log_probs=old_log_probs, behaviour_log_probs=behaviour_log_probs,
                     mask=mask)
  mask = as_mask(mask)
  log_w = _clean(old_log_probs, mask) - _clean(behaviour_log_probs, mask)
  weights = jnp.minimum(jnp.exp(jnp.minimum(log_w, MAX_LOG_RATIO)), cap)
  return jax.lax.stop_gradient(jnp.where(mask, weights, 0.0))


IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")


def rollout_importance_weights(
    old_log_probs: Array, behaviour_log_probs: Array, mask: Array, *, cap: float,
    level: str = "token", mode: str = "truncate", lower: float = 0.0, veto: float = 0.0,
    segment_ids: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
  """Importance weights between the sampler (mu) and the learner (pi_old), at the token or
  the sequence level, truncated or masked (as veRL's rollout importance sampling).

      token      log w_t = log pi_old(y_t) - log mu(y_t)
      sequence   log w_t = sum over t's sequence of the token log-ratios (the product)
      geometric  log w_t = their mean over t's sequence (the geometric mean)

      truncate   w_t = min(w_t, cap)                       (TIS)
      mask       w_t = w_t if lower <= w_t <= cap, else 0  (MIS; lower 0 = 1 / cap)

  With `veto` > 0, every token of a sequence holding a token whose own ratio is below
  `veto` gets weight 0 (a token the sampler found far likelier than the learner does:
  the sign of a numerics or a staleness failure). Pass `segment_ids` for packed rows.
  The weights multiply the per-token policy loss and carry no gradient.

  Returns:
    `([batch, length] weights, 0 at masked positions; metrics)`: `is_weight/mean` (of the
    weights applied), `is_weight/masked_fraction` (tokens weighted 0 by the mask or the
    veto), `is_weight/truncated_fraction` (tokens whose weight was capped).
  """
  if not cap > 0:
    raise ValueError(f"importance weight cap must be > 0, got {cap}")
  if level not in IS_LEVELS:
    raise ValueError(f"unknown importance level {level!r}; known: {', '.join(IS_LEVELS)}")
  if mode not in IS_MODES:
    raise ValueError(f"unknown importance mode {mode!r}; known: {', '.join(IS_MODES)}")
  if lower < 0 or (lower and lower >= cap):
    raise ValueError(f"the lower bound must be 0 (1 / cap) or in (0, cap={cap}), got {lower}")
  if veto < 0:
    raise ValueError(f"veto must be 0 (off) or > 0, got {veto}")
  check_token_shapes(old_log_probs=old_log_probs, behaviour_log_probs=behaviour_log_probs,
                     mask=mask, segment_ids=segment_ids)
  mask = as_mask(mask)
  token_log_w = _clean(old_log_probs, mask) - _clean(behaviour_log_probs, mask)
  log_w = token_log_w
  if level != "token":
    log_w = segment_sum_per_token(token_log_w, segment_ids)
    if level == "geometric":
      log_w = log_w / jnp.maximum(segment_sum_per_token(mask.astype(jnp.float32),
                                                        segment_ids), 1.0)
  w = jnp.exp(jnp.clip(log_w, -MAX_LOG_RATIO, MAX_LOG_RATIO))
  truncated = jnp.zeros(mask.shape, bool)
  if mode == "truncate":
    truncated = w > cap
    weights = jnp.minimum(w, cap)
  else:
    low = lower or 1.0 / cap
    weights = jnp.where((w >= low) & (w <= cap), w, 0.0)
  if veto:
    bad = (mask & (token_log_w < math.log(veto))).astype(jnp.float32)
    weights = jnp.where(segment_sum_per_token(bad, segment_ids) > 0, 0.0, weights)
  weights = jax.lax.stop_gradient(jnp.where(mask, weights, 0.0))
  count = jnp.sum(mask)
  metrics = {
      "is_weight/mean": _masked_mean_metric(weights, mask),
      "is_weight/masked_fraction": Metric.mean(jnp.sum(mask & (weights == 0.0)), count),
      "is_weight/truncated_fraction": Metric.mean(jnp.sum(mask & truncated & (weights > 0)),
                                                  count),
  }
  return weights, metrics


# ----------------------------------------------------------------------------
# KL to a frozen reference, entropy, value
# ----------------------------------------------------------------------------


def _k1(log_ratio):
  return -log_ratio


def _k2(log_ratio):
  return 0.5 * log_ratio * log_ratio


def _k3(log_ratio):
  return jnp.expm1(log_ratio) - log_ratio


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_divergence(
    log_probs: Array, ref_log_probs: Array, mask: Array, *, estimator: str = "k3"
) -> Array:
  """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020).

  With `log r = log pi_ref(y_t) - log pi(y_t)` and `y_t ~ pi`:

      k1 = -log r                 unbiased, can be negative
      k2 = (log r)^2 / 2          biased, >= 0, low variance
      k3 = (r - 1) - log r        unbiased, >= 0, low variance

  Differentiable in `log_probs` (for use as a loss term). `log r` is clamped to
  [-20, 20] so one stale token cannot overflow `exp`.

  Returns:
    `[batch, length]` estimates, 0 at masked positions.
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown kl estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
  check_token_shapes(log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask)
  mask = as_mask(mask)
  log_r = _clean(ref_log_probs, mask) - _clean(log_probs, mask)
  log_r = jnp.clip(log_r, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  return jnp.where(mask, KL_ESTIMATORS[estimator](log_r), 0.0)


def kl_penalized_rewards(
    token_rewards: Array,
    log_probs: Array,
    ref_log_probs: Array,
    mask: Array,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> Array:
  """Per-token rewards with the KL penalty folded in (`kl_in_reward`).

      r'_t = r_t - kl_coef * k(t)

  Args:
    token_rewards: `[batch, length]`.
    log_probs: `[batch, length]` log-probs of the sampled targets under the
      policy that generated them (no gradient needed).
    ref_log_probs: `[batch, length]` under the frozen reference.
    mask: `[batch, length]`.
    kl_coef: penalty weight.
    estimator: k1, k2 or k3.

  Returns:
    `[batch, length]` rewards, 0 at masked positions.
  """
  mask = as_mask(mask)
  kl = kl_divergence(log_probs, ref_log_probs, mask, estimator=estimator)
  return jax.lax.stop_gradient(jnp.where(mask, _clean(token_rewards, mask) - kl_coef * kl, 0.0))


KL_CONTROLLERS = ("fixed", "adaptive")


def adaptive_kl_coef(coef: float, current_kl: float, *, target: float, horizon: int,
                     n_steps: int) -> float:
  """The next KL coefficient of the adaptive controller (Ziegler et al. 2019, section 2.2;
  veRL's `AdaptiveKLController`, TRL's `AdaptiveKLController`):

      e = clip(KL / target - 1, -0.2, 0.2)
      coef <- coef * (1 + e * n_steps / horizon)

  so the coefficient grows while the policy drifts further than `target` from the
  reference and shrinks while it stays closer, by at most 20% per `horizon` samples.

  Args:
    coef: the coefficient the step used.
    current_kl: the KL the step measured (mean over its trained tokens); a non-finite
      value leaves the coefficient as it is.
    target: the KL to hold, > 0.
    horizon: samples over which the error is corrected, >= 1.
    n_steps: samples (sequences) in the step.
  """
  if not target > 0 or horizon < 1:
    raise ValueError(f"the adaptive KL controller needs target > 0 and horizon >= 1, got "
                     f"target={target}, horizon={horizon}")
  if not math.isfinite(current_kl):
    return float(coef)
  error = min(max(current_kl / target - 1.0, -0.2), 0.2)
  return float(coef) * (1.0 + error * n_steps / horizon)


def clipped_value_loss(
    values: Array, old_values: Array, returns: Array, mask: Array, *, value_clip: float
) -> tuple[Array, dict[str, Metric]]:
  """PPO clipped value loss.

      V^clip_t = V_old_t + clip(V_t - V_old_t, -eps_v, eps_v)
      L_t = 0.5 * max((V_t - R_t)^2, (V^clip_t - R_t)^2)

  `value_clip <= 0` disables clipping (plain squared error).

  Returns:
    `(per_token_loss, metrics)`; metrics: clip_fraction/value, value/mean.
  """
  check_token_shapes(values=values, old_values=old_values, returns=returns, mask=mask)
  mask = as_mask(mask)
  values = _clean(values, mask)
  old_values = _clean(old_values, mask)
  returns = _clean(returns, mask)
  loss_unclipped = jnp.square(values - returns)
  if value_clip > 0:
    values_clipped = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
    loss_clipped = jnp.square(values_clipped - returns)
    clipped = mask & (loss_clipped > loss_unclipped)
    loss = jnp.maximum(loss_unclipped, loss_clipped)
  else:
    clipped = jnp.zeros(mask.shape, bool)
    loss = loss_unclipped
  metrics = {
      "clip_fraction/value": Metric.mean(jnp.sum(clipped), jnp.sum(mask)),
      "value/mean": _masked_mean_metric(jax.lax.stop_gradient(values), mask),
  }
  return jnp.where(mask, 0.5 * loss, 0.0), metrics


# ----------------------------------------------------------------------------
# The combined objective
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The loss knobs of an algorithm preset (`posttrain.rl.presets`)."""

  policy_loss: str = "ppo"
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float = 0.0
  loss_agg_mode: str = "token_mean"
  max_response_len: int = 0
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_in_reward: bool = False
  entropy_coef: float = 0.0
  tis_cap: float = 0.0
  tis_level: str = "token"
  tis_mode: str = "truncate"
  tis_lower: float = 0.0
  tis_veto: float = 0.0
  use_critic: bool = False
  value_coef: float = 0.5
  value_clip: float = 0.2
  cov_fraction: float = 2e-4
  clip_cov_lb: float = 1.0
  clip_cov_ub: float = 5.0
  kl_cov_coef: float = 1.0
  sapo_tau_pos: float = 1.0
  sapo_tau_neg: float = 1.05
  top_entropy_fraction: float = 1.0

  def __post_init__(self):
    get_policy_loss(self.policy_loss)
    if not 0 < self.cov_fraction <= 1:
      raise ValueError(f"cov_fraction must be in (0, 1], got {self.cov_fraction}")
    if not 0 < self.top_entropy_fraction <= 1:
      raise ValueError(f"top_entropy_fraction must be in (0, 1] (1: off), got "
                       f"{self.top_entropy_fraction}")
    if not self.clip_cov_lb < self.clip_cov_ub:
      raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got ({self.clip_cov_lb}, "
                       f"{self.clip_cov_ub})")
    if self.kl_cov_coef < 0:
      raise ValueError(f"kl_cov_coef must be >= 0, got {self.kl_cov_coef}")
    if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
      raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0, got "
                       f"({self.sapo_tau_pos}, {self.sapo_tau_neg})")
    if self.loss_agg_mode not in AGG_MODES:
      known = ", ".join(AGG_MODES)
      raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; known: {known}")
    if self.kl_estimator not in KL_ESTIMATORS:
      known = ", ".join(KL_ESTIMATORS)
      raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; known: {known}")
    if not 0 <= self.eps_low <= 1:
      raise ValueError(f"eps_low must be in [0, 1] (1: no lower clip), got {self.eps_low}")
    if self.eps_high < 0:
      raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
    if self.dual_clip and self.dual_clip <= 1:
      raise ValueError(f"dual_clip must be 0 (off) or > 1, got {self.dual_clip}")
    if self.dual_clip and self.policy_loss not in ("ppo", "gspo"):
      raise ValueError(f"dual_clip={self.dual_clip} applies to the ppo and gspo policy "
                       f"losses, not {self.policy_loss!r}")
    if self.tis_cap < 0:
      raise ValueError(f"tis_cap must be 0 (off) or > 0, got {self.tis_cap}")
    if self.tis_level not in IS_LEVELS:
      raise ValueError(f"unknown tis_level {self.tis_level!r}; known: {', '.join(IS_LEVELS)}")
    if self.tis_mode not in IS_MODES:
      raise ValueError(f"unknown tis_mode {self.tis_mode!r}; known: {', '.join(IS_MODES)}")
    if self.tis_lower < 0 or (self.tis_lower and self.tis_cap
                              and self.tis_lower >= self.tis_cap):
      raise ValueError(f"tis_lower must be 0 (1 / tis_cap) or in (0, tis_cap), got "
                       f"{self.tis_lower}")
    if self.tis_veto < 0:
      raise ValueError(f"tis_veto must be 0 (off) or > 0, got {self.tis_veto}")
    if self.loss_agg_mode == "seq_mean_token_sum_norm" and self.max_response_len <= 0:
      raise ValueError(
          f"seq_mean_token_sum_norm needs max_response_len > 0, got {self.max_response_len}")

  @classmethod
  def from_config(cls, config: Mapping[str, Any], **overrides) -> "LossConfig":
    """Picks this dataclass's fields from a preset ConfigDict (extra keys ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {name: config[name] for name in names if name in config}
    values.update(overrides)
    return cls(**values)


def loss_denominator(cfg: LossConfig, batch: Mapping[str, Array]) -> Array:
  """Denominator `D` of `cfg.loss_agg_mode` for one (micro)batch; sum these over micro-batches."""
  _, denominator = token_weights(
      batch["loss_mask"],
      cfg.loss_agg_mode,
      segment_ids=batch.get("segment_ids"),
      max_response_len=cfg.max_response_len,
  )
  return denominator


def rl_loss(
    cfg: LossConfig,
    log_probs: Array,
    batch: Mapping[str, Array],
    *,
    denominator: Array,
    entropies: Array | None = None,
    values: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
  """The full PPO/GRPO-family loss of one micro-batch.

      L = sum_t w_t * ( S_t * IS_t * L^pi_t + kl_coef * k(t) - entropy_coef * H_t
                        + value_coef * L^V_t ) / D

  with `w`, `D` from `token_weights(cfg.loss_agg_mode)` (`D` is the *global*
  denominator, see the module docstring), `L^pi` the registered policy loss,
  `IS` the truncated importance weights (when `tis_cap > 0`), `S` 1 on the tokens
  `high_entropy_selection` keeps and 0 elsewhere (when `top_entropy_fraction < 1`; 1
  otherwise: the other terms and `w`, `D` see every token, as in TRL and the paper's
  code), the KL term only when `kl_coef > 0` and not `kl_in_reward`, the value term
  when `use_critic`.

  Args:
    cfg: loss knobs.
    log_probs: `[batch, length]` learner log-probs of the targets (differentiable).
    batch: `loss_mask`, `advantages` and optionally `segment_ids`,
      `old_logprobs` (default: `stop_gradient(log_probs)`, i.e. on-policy),
      `cov_selected` (the clip_cov / kl_cov losses: `covariance_selection` of the
      whole batch), `entropy_selected` (`top_entropy_fraction < 1`:
      `high_entropy_selection` of the whole batch),
      `behaviour_logprobs` (for TIS), `ref_logprobs` (for KL), `kl_coef` (`[batch]`:
      each row's KL weight in place of `cfg.kl_coef`, which must still be > 0),
      `old_values` and `returns` (for the critic).
    denominator: sum of `loss_denominator` over all micro-batches of the step.
    entropies: `[batch, length]` per-token policy entropies (entropy bonus/metric).
    values: `[batch, length]` critic values (differentiable) when `use_critic`.

  Returns:
    `(loss, metrics)`: summing `loss` over micro-batches gives the batch loss.
  """
  needed = ["loss_mask", "advantages"]
  needed += ["behaviour_logprobs"] if cfg.tis_cap > 0 else []
  needed += ["ref_logprobs"] if cfg.kl_coef > 0 and not cfg.kl_in_reward else []
  needed += ["old_values", "returns"] if cfg.use_critic else []
  needed += ["cov_selected"] if cfg.policy_loss in COVARIANCE_LOSSES else []
  needed += ["entropy_selected"] if cfg.top_entropy_fraction < 1 else []
  missing = [key for key in needed if key not in batch]
  if missing:
    raise ValueError(f"batch lacks {missing} needed by this loss config")
  if cfg.use_critic and values is None:
    raise ValueError("use_critic=True needs critic values")
  if cfg.entropy_coef and entropies is None:
    raise ValueError(f"entropy_coef={cfg.entropy_coef} needs per-token entropies")
  mask = as_mask(batch["loss_mask"])
  segment_ids = batch.get("segment_ids")
  weights, local_denominator = token_weights(
      mask, cfg.loss_agg_mode, segment_ids=segment_ids, max_response_len=cfg.max_response_len
  )
  old_log_probs = batch.get("old_logprobs")
  if old_log_probs is None:
    old_log_probs = jax.lax.stop_gradient(log_probs)
  advantages = batch["advantages"]
  extra = {}
  if cfg.policy_loss in COVARIANCE_LOSSES:
    extra["selected"] = batch["cov_selected"]
  if cfg.policy_loss == "kl_cov":
    extra["coef"] = cfg.kl_cov_coef
  if cfg.policy_loss == "sapo":
    extra.update(tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg)
  policy_loss, metrics = get_policy_loss(cfg.policy_loss)(
      log_probs,
      old_log_probs,
      advantages,
      mask,
      eps_low=cfg.eps_low,
      eps_high=cfg.eps_high,
      dual_clip=cfg.dual_clip,
      segment_ids=segment_ids,
      **extra,
  )
  if cfg.tis_cap > 0:
    is_weights, is_metrics = rollout_importance_weights(
        old_log_probs, batch["behaviour_logprobs"], mask, cap=cfg.tis_cap,
        level=cfg.tis_level, mode=cfg.tis_mode, lower=cfg.tis_lower, veto=cfg.tis_veto,
        segment_ids=segment_ids)
    policy_loss = policy_loss * is_weights
    metrics.update(is_metrics)
  if cfg.top_entropy_fraction < 1:
    selected = as_mask(batch["entropy_selected"])
    policy_loss = jnp.where(selected, policy_loss, 0.0)  # no gradient either
    metrics["entropy/selected_fraction"] = Metric.mean(jnp.sum(mask & selected),
                                                       jnp.sum(mask))

  def weighted_sum(per_token):
    return jnp.sum(jnp.where(mask, per_token * weights, 0.0))

  def term(per_token):
    safe_denominator = jnp.maximum(denominator, 1e-30)
    return jnp.where(denominator > 0, weighted_sum(per_token) / safe_denominator, 0.0)

  policy_sum = weighted_sum(policy_loss)
  metrics["loss/policy"] = Metric.mean(policy_sum, local_denominator)
  # The learner's mean log-prob of the trained tokens before the update: -nll for SFT.
  metrics["logprob/mean"] = _masked_mean_metric(jax.lax.stop_gradient(log_probs), mask)
  loss = term(policy_loss)

  if "ref_logprobs" in batch:
    kl = kl_divergence(log_probs, batch["ref_logprobs"], mask, estimator=cfg.kl_estimator)
    metrics["kl"] = _masked_mean_metric(jax.lax.stop_gradient(kl), mask)
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
      metrics["loss/kl"] = Metric.mean(weighted_sum(kl), local_denominator)
      if "kl_coef" in batch:  # a coefficient per row (the adaptive controller's value)
        loss = loss + term(kl * batch["kl_coef"].astype(kl.dtype)[:, None])
      else:
        loss = loss + cfg.kl_coef * term(kl)

  if entropies is not None:
    entropies = _clean(entropies, mask)
    metrics["entropy"] = _masked_mean_metric(jax.lax.stop_gradient(entropies), mask)
    if cfg.entropy_coef:
      loss = loss - cfg.entropy_coef * term(entropies)

  if cfg.use_critic:
    value_loss, value_metrics = clipped_value_loss(
        values, batch["old_values"], batch["returns"], mask, value_clip=cfg.value_clip
    )
    metrics.update(value_metrics)
    metrics["loss/value"] = Metric.mean(weighted_sum(value_loss), local_denominator)
    loss = loss + cfg.value_coef * term(value_loss)

  advantages = jax.lax.stop_gradient(_clean(advantages, mask))
  count = jnp.sum(mask)
  metrics["advantages/mean"] = Metric.mean(jnp.sum(advantages), count)
  metrics["advantages/std"] = Metric.std(
      jnp.sum(advantages), jnp.sum(advantages * advantages), count)
  return loss, metrics
