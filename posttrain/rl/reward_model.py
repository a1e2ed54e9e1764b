"""Reward models from preference pairs: the Bradley-Terry loss on a scalar score head.

    batch = preference.pack_pairs(pairs, row_len=2048, rows_per_microbatch=8, pad_id=0)
    batch["pair_margin"] = pair_margins(pairs, batch)
    step = train_step.make_reward_model_step(rm_cfg, RewardLossConfig(), optimizer, mesh=mesh)
    state, metrics = step(state, batch)

A reward model is the transformer trunk with a score head instead of the vocabulary
projection (`ModelConfig(value_head=True, lm_head=False)`; Hugging Face's
`*ForSequenceClassification` with one label). A sequence's reward is the head's value at
its last token, the rule Hugging Face's models apply to the last non-padding token: so a
pair's sequences, prompt + chosen and prompt + rejected packed by
`posttrain.rl.preference.pack_pairs`, are scored where they end, and the score head reads
`h . w` (no bias, as in Hugging Face's score layer).

With `r_c, r_r` the rewards of a pair's chosen and rejected sequences and `m` its
margin (the row's optional `"margin"`, TRL's column; 0 by default), the loss is

    -log s(r_c - r_r - m)  +  center_coef * (r_c + r_r)^2

(s the logistic sigmoid; the second term is TRL's `center_rewards_coefficient`, which
keeps the rewards centred on zero: the Bradley-Terry term alone fixes only their
differences). The loss is a sum over pairs divided by the pairs of the whole batch, so
micro-batches accumulate exactly, as in `posttrain.rl.preference`.

Logged: `loss/reward_model`, `rewards/accuracy` (the share of pairs with r_c > r_r;
a tie counts as wrong), `rewards/margin` (r_c - r_r), `rewards/chosen`,
`rewards/rejected`, and with centring `loss/center`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.rl.losses import Metric
from posttrain.rl.preference import pair_sums

Array = jax.Array

# The per-token keys of a packed reward-model batch (preference.pack_pairs's, without the
# loss mask's role: every sequence is scored at its last token), then the per-pair ones.
TOKEN_KEYS = ("tokens", "positions", "segment_ids", "pair_ids", "chosen")
PAIR_KEYS = ("pair_mask", "pair_margin")


@dataclasses.dataclass(frozen=True)
class RewardLossConfig:
  """The reward model's loss.

  Attributes:
    center_coef: weight of the mean squared sum of a pair's rewards (TRL's
      `center_rewards_coefficient`, 0.01 in its examples); 0 turns it off.
  """

  center_coef: float = 0.0

  def __post_init__(self):
    if not (isinstance(self.center_coef, (int, float)) and math.isfinite(self.center_coef)
            and self.center_coef >= 0):
      raise ValueError(f"center_coef must be a finite number >= 0, got {self.center_coef!r}")


def score_values(h_BxTxD: Array, w_D: Array) -> Array:
  """The score head's value at every position, float32 [B, T]: `h . w`, no bias (Hugging
  Face's score layer has none, so a reward model's bias never enters its loss)."""
  return jnp.einsum("BTD,D->BT", h_BxTxD.astype(jnp.float32), w_D)


def last_tokens(segment_ids_BxT: Array) -> Array:
  """bool [B, T]: the positions that end a packed sequence (segment id > 0 and the next
  position holds another segment, or the row ends)."""
  seg = jnp.asarray(segment_ids_BxT)
  following = jnp.concatenate([seg[:, 1:], jnp.zeros_like(seg[:, :1])], axis=1)
  return (seg > 0) & (following != seg)


def pair_scores(values_BxT: Array, mb: Mapping[str, Array]) -> tuple[Array, Array]:
  """The rewards `([P], [P])` of each pair slot's chosen and rejected sequences: the
  values at the sequences' last tokens (0 in empty slots)."""
  num_pairs = jnp.shape(mb["pair_mask"])[-1]
  at_end = jnp.where(last_tokens(mb["segment_ids"]), values_BxT, 0.0).astype(jnp.float32)
  return pair_sums(at_end, mb["pair_ids"], jnp.asarray(mb["chosen"]), num_pairs)


def bradley_terry_loss(cfg: RewardLossConfig, reward_chosen: Array, reward_rejected: Array,
                       *, margin: Array | None = None, pair_mask: Array | None = None,
                       denominator: Array | None = None) -> tuple[Array, dict[str, Metric]]:
  """The loss of per-pair rewards `[P]` (module docstring) and its metrics.

  Args:
    cfg: the loss.
    reward_chosen, reward_rejected: the pairs' rewards.
    margin: each pair's required margin (default 0).
    pair_mask: which slots hold a pair (default all).
    denominator: the pairs the loss is divided by (default: the pairs here); the whole
      batch's count when this is one micro-batch of several.

  Returns:
    `(loss, metrics)`.
  """
  rc = jnp.asarray(reward_chosen, jnp.float32)
  rr = jnp.asarray(reward_rejected, jnp.float32)
  mask = jnp.ones(rc.shape, bool) if pair_mask is None else jnp.asarray(pair_mask) != 0
  m = jnp.zeros(rc.shape, jnp.float32) if margin is None else jnp.asarray(margin, jnp.float32)
  # Empty slots hold zeros before any arithmetic: nothing there reaches the gradient.
  rc, rr, m = (jnp.where(mask, x, 0.0) for x in (rc, rr, m))
  bt = jnp.where(mask, jax.nn.softplus(-(rc - rr - m)), 0.0)  # -log s(h), overflow-free
  total = bt
  center = None
  if cfg.center_coef > 0:
    center = jnp.where(mask, (rc + rr) ** 2, 0.0)
    total = bt + cfg.center_coef * center
  count = jnp.sum(mask)
  if denominator is None:
    denominator = count
  loss = jnp.sum(total) / jnp.maximum(denominator, 1)

  def mean(x):
    return Metric.mean(jnp.sum(jnp.where(mask, jax.lax.stop_gradient(x), 0.0)), count)

  metrics = {
      "loss/reward_model": mean(bt),
      "rewards/chosen": mean(rc),
      "rewards/rejected": mean(rr),
      "rewards/margin": mean(rc - rr),
      "rewards/accuracy": mean((rc > rr).astype(jnp.float32)),
  }
  if center is not None:
    metrics["loss/center"] = mean(center)
  return loss, metrics


def batch_denominators(batch: Mapping[str, Array]) -> dict[str, Array]:
  """The whole batch's pair count (sum it over micro-batches)."""
  return {"pairs": jnp.sum(jnp.asarray(batch["pair_mask"]) != 0).astype(jnp.float32)}


def microbatch_reward_loss(cfg: RewardLossConfig, values_BxT: Array, mb: Mapping[str, Array],
                           *, denominators: Mapping[str, Array]
                           ) -> tuple[Array, dict[str, Metric]]:
  """The loss of one packed micro-batch from the score head's values `[B, T]`.

  Args:
    cfg: the loss.
    values_BxT: the head's value at every position (differentiable).
    mb: `segment_ids, pair_ids, chosen` `[B, T]`, `pair_mask` and `pair_margin` `[P]`.
    denominators: `batch_denominators` of the whole batch.

  Returns:
    `(loss, metrics)`: summing `loss` over the micro-batches gives the batch loss.
  """
  chosen, rejected = pair_scores(values_BxT, mb)
  return bradley_terry_loss(cfg, chosen, rejected, margin=mb.get("pair_margin"),
                            pair_mask=mb["pair_mask"], denominator=denominators["pairs"])


def pair_margins(pairs: Sequence[Mapping[str, Any]], batch: Mapping[str, np.ndarray]
                 ) -> np.ndarray:
  """float32 `[M, P]`: each pair slot's margin (its pair's `"margin"`, default 0), laid
  out like `batch["pair_index"]` of `preference.pack_pairs(pairs, ...)`."""
  margins = np.asarray([float(p.get("margin", 0.0)) for p in pairs], np.float32)
  index = np.asarray(batch["pair_index"])
  if index.size and int(index.max()) >= len(pairs):
    raise ValueError(f"batch['pair_index'] names pair {int(index.max())} of only "
                     f"{len(pairs)} pairs: pack the same pairs")
  return np.where(index >= 0, margins[np.maximum(index, 0)], 0.0).astype(np.float32)
