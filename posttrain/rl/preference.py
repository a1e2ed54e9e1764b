"""Offline preference optimisation: DPO and its variants, and packing preference pairs.

    batch = pack_pairs(pairs, row_len=2048, rows_per_microbatch=8, pad_id=tok.pad_id)
    batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
    step = train_step.make_preference_step(model_cfg, PreferenceConfig(beta=0.1), optimizer,
                                           mesh=mesh)
    state, metrics = step(state, batch)

A pair is a mapping

    prompt_tokens     int [P]   (P >= 1)
    chosen_tokens     int [Rc]  the preferred response (Rc >= 1)
    rejected_tokens   int [Rr]  the dispreferred response (Rr >= 1)
    chosen_mask       [Rc] optional, nonzero = scored (0 for tool output of a multi-turn
                      response); default all 1. Likewise rejected_mask.
    margin            float, optional: the reward model's required margin
                      (`posttrain.rl.reward_model`); the losses here ignore it
    domain            str, optional: the pair's group, for stratified metrics

and its two sequences, prompt + chosen and prompt + rejected, are packed into rows with
`posttrain.rl.packing`. `pack_pairs` returns the usual per-token arrays `[M, B, T]`
(`tokens, targets, positions, segment_ids, loss_mask`) plus

    pair_ids     int32 [M, B, T]  the pair's slot within its micro-batch, -1 in padding
    chosen       bool  [M, B, T]  True on the chosen sequence's tokens
    pair_mask    bool  [M, P]     which of the P pair slots of a micro-batch hold a pair
    pair_index   int32 [M, P]     the slot's pair in the input list, -1 for empty slots
    truncated    int   scalar     sequences whose response tail was cut to fit row_len

Both sequences of a pair share a micro-batch: the loss is nonlinear in the pair's two
log-probs, so a pair's gradient needs both in one forward pass.

Losses. With `pi_c, pi_r` the policy's log-probs of the chosen and rejected responses
summed over their scored tokens, `ref_c, ref_r` the reference's, and `n_c, n_r` the
numbers of scored tokens, each loss compares per-pair rewards `r_c, r_r`, most through
their margin `h = r_c - r_r`:

    sigmoid    r = beta * (pi - ref)     -(1-eps) log s(h) - eps log s(-h)       DPO, cDPO
    robust     r = beta * (pi - ref)     (-(1-eps) log s(h) + eps log s(-h))      rDPO
                                           / (1 - 2 eps)
    exo_pair   r = beta * (pi - ref)     s(h) (log s(h) - log(1-eps))            EXO
                                           + s(-h) (log s(-h) - log eps)
    ipo        r = beta * (pi - ref) / n (h / beta - 1 / (2 beta))^2             IPO
    hinge      r = beta * (pi - ref)     max(0, 1 - h)                           SLiC
    nca_pair   r = beta * (pi - ref)     -log s(r_c) - log s(-r_c) / 2           NCA
                                           - log s(-r_r) / 2
    sppo_hard  r = beta * (pi - ref)     (r_c - 1/2)^2 / beta^2                  SPPO (hard)
                                           + (r_r + 1/2)^2 / beta^2
    apo_zero   r = beta * (pi - ref)     1 - s(r_c) + s(r_r)                     APO-zero
    apo_down   r = beta * (pi - ref)     s(r_c) + 1 - s(h)                       APO-down
    discopop   r = beta * (pi - ref)     -log s(h) (1 - s(h / tau))              DiscoPOP
                                           + exp(-h) s(h / tau)
    simpo      r = beta * pi / n         -(1-eps) log s(h - gamma)               SimPO
                                           - eps log s(gamma - h)
    orpo       r = log(p / (1 - p)),     -beta log s(h)                          ORPO
                 p = exp(pi / n)         + NLL(chosen)

(s the logistic sigmoid, eps the label smoothing, gamma SimPO's target margin, tau
DiscoPOP's temperature (its exp term is computed as exp(-h + log s(h / tau)), finite
where the sigmoid underflows); EXO's eps
is 1e-3 when label smoothing is 0, as in TRL; IPO, SimPO and ORPO average the log-probs
per token, as their papers and TRL do; SimPO and ORPO read no reference). The formulas are
TRL's DPOTrainer `loss_type`s. ORPO's reward is the log-odds of the per-token mean
probability, and its loss always carries the NLL term below with weight 1 (Hong et al.
2024, TRL's ORPOTrainer); a mean log-prob above -1e-7 is held there (odds of 10^7), where
the odds' gradient would overflow. An optional NLL term on the chosen responses (RPO,
TRL's `rpo_alpha`) adds `sft_coef * sum(-log p(chosen tokens)) / #chosen tokens`.

The losses of unpaired feedback, `kto` and `apo_zero_unpaired`, share this config and
`train_step.make_preference_step`; their math and packing are `posttrain.rl.kto`'s.

Exact micro-batch accumulation, as in `posttrain.rl.losses`: the preference loss is a sum
over pairs divided by the number of pairs of the whole batch, the NLL term a sum over
tokens divided by the chosen tokens of the whole batch, so the micro-batch losses and
gradients add up to the one-batch values.
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.rl import packing
from posttrain.rl.losses import Metric

Array = jax.Array

# Losses of unpaired feedback, one labelled completion per example (`posttrain.rl.kto`).
UNPAIRED_LOSSES = ("kto", "apo_zero_unpaired")
# The paired losses that compare the policy with a reference (all but SimPO and ORPO).
_PAIRED_REFERENCE_LOSSES = ("sigmoid", "robust", "exo_pair", "ipo", "hinge", "nca_pair",
                            "sppo_hard", "apo_zero", "apo_down", "discopop")
PREFERENCE_LOSSES = _PAIRED_REFERENCE_LOSSES + ("simpo", "orpo") + UNPAIRED_LOSSES
REFERENCE_LOSSES = _PAIRED_REFERENCE_LOSSES + UNPAIRED_LOSSES
# The losses label smoothing applies to.
_LOGISTIC_LOSSES = ("sigmoid", "robust", "exo_pair", "simpo")
# EXO's smoothing when label_smoothing is 0 (its loss needs log eps), as in TRL.
_EXO_EPS = 1e-3

PAIR_KEYS = ("prompt_tokens", "chosen_tokens", "rejected_tokens")
OPTIONAL_PAIR_KEYS = ("chosen_mask", "rejected_mask", "margin", "domain")

# The per-token arrays of a packed preference batch; pair_mask is per pair slot.
TOKEN_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask", "pair_ids",
              "chosen")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
  """The knobs of a preference loss (the equations are in the module docstring).

  Attributes:
    loss: one of `PREFERENCE_LOSSES`.
    beta: the reward scale (DPO's KL strength); > 0.
    label_smoothing: the assumed fraction of flipped labels, in [0, 0.5); sigmoid (cDPO),
      robust, exo_pair and simpo only.
    simpo_gamma: SimPO's target reward margin.
    sft_coef: weight of the NLL term on the chosen responses (RPO); 0 = off. ORPO's
      loss holds that term with weight 1 already; sft_coef must stay 0 there.
    desirable_weight, undesirable_weight: KTO's weights of the desirable and the
      undesirable examples' losses (`posttrain.rl.kto`); unpaired losses only.
    discopop_tau: DiscoPOP's temperature, > 0 (the paper's and TRL's 0.05); discopop only.
  """

  loss: str = "sigmoid"
  beta: float = 0.1
  label_smoothing: float = 0.0
  simpo_gamma: float = 0.5
  sft_coef: float = 0.0
  desirable_weight: float = 1.0
  undesirable_weight: float = 1.0
  discopop_tau: float = 0.05

  def __post_init__(self):
    if self.loss not in PREFERENCE_LOSSES:
      raise ValueError(f"unknown preference loss {self.loss!r}; known: "
                       f"{', '.join(PREFERENCE_LOSSES)}")
    if not self.beta > 0:
      raise ValueError(f"beta must be > 0, got {self.beta}")
    if not 0 <= self.label_smoothing < 0.5:
      raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
    if self.label_smoothing and self.loss not in _LOGISTIC_LOSSES:
      raise ValueError(f"label_smoothing={self.label_smoothing} applies to the "
                       f"{' and '.join(_LOGISTIC_LOSSES)} losses, not {self.loss!r}")
    if self.sft_coef < 0:
      raise ValueError(f"sft_coef must be >= 0, got {self.sft_coef}")
    if self.sft_coef and self.loss == "orpo":
      raise ValueError(f"sft_coef={self.sft_coef} does not apply to orpo, whose loss holds "
                       "the NLL of the chosen responses with weight 1")
    if self.sft_coef and self.unpaired:
      raise ValueError(f"sft_coef={self.sft_coef} applies to paired losses, not "
                       f"{self.loss!r}")
    for name in ("desirable_weight", "undesirable_weight"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
      if value != 1.0 and not self.unpaired:
        raise ValueError(f"{name}={value} applies to the unpaired losses "
                         f"({', '.join(UNPAIRED_LOSSES)}), not {self.loss!r}")
    if not (math.isfinite(self.discopop_tau) and self.discopop_tau > 0):
      raise ValueError(f"discopop_tau must be a finite number > 0, got {self.discopop_tau}")
    if self.discopop_tau != 0.05 and self.loss != "discopop":
      raise ValueError(f"discopop_tau={self.discopop_tau} applies to the discopop loss, not "
                       f"{self.loss!r}")

  @property
  def needs_reference(self) -> bool:
    return self.loss in REFERENCE_LOSSES

  @property
  def unpaired(self) -> bool:
    """The loss learns from single labelled completions (`posttrain.rl.kto`)."""
    return self.loss in UNPAIRED_LOSSES

  @property
  def nll_coef(self) -> float:
    """The weight of the chosen responses' NLL in the loss."""
    return 1.0 if self.loss == "orpo" else self.sft_coef


# ---------------------------------------------------------------------------------------
# Losses of per-pair log-probs
# ---------------------------------------------------------------------------------------


def _logistic(h, eps):
  return -(1.0 - eps) * jax.nn.log_sigmoid(h) - eps * jax.nn.log_sigmoid(-h)


# ORPO's largest mean log-prob: log-odds of 10^7 (module docstring).
_ORPO_MAX_MEAN_LOGP = -1e-7


def _log_odds(mean_logp):
  """log(p / (1 - p)) of p = exp(mean_logp) <= 1, with log(1 - p) computed stably."""
  x = jnp.minimum(mean_logp, _ORPO_MAX_MEAN_LOGP)
  log1m = jnp.where(x > -np.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))
  return x - log1m


def pair_rewards(cfg: PreferenceConfig, policy_chosen, policy_rejected, ref_chosen=None,
                 ref_rejected=None, chosen_tokens=None, rejected_tokens=None
                 ) -> tuple[Array, Array]:
  """The implicit rewards `(r_c, r_r)` the loss compares, per pair (module docstring).

  Args:
    cfg: the loss.
    policy_chosen, policy_rejected: `[P]` the policy's summed response log-probs.
    ref_chosen, ref_rejected: `[P]` the reference's; unused by simpo.
    chosen_tokens, rejected_tokens: `[P]` scored tokens per response (ipo, simpo), >= 1.
  """
  if cfg.needs_reference and (ref_chosen is None or ref_rejected is None):
    raise ValueError(f"the {cfg.loss} loss needs the reference's log-probs")
  if cfg.loss in ("ipo", "simpo", "orpo") and (chosen_tokens is None
                                               or rejected_tokens is None):
    raise ValueError(f"the {cfg.loss} loss needs the responses' token counts")
  if cfg.loss == "orpo":
    return (_log_odds(policy_chosen / chosen_tokens),
            _log_odds(policy_rejected / rejected_tokens))
  if cfg.loss == "simpo":
    return (cfg.beta * policy_chosen / chosen_tokens,
            cfg.beta * policy_rejected / rejected_tokens)
  chosen = cfg.beta * (policy_chosen - ref_chosen)
  rejected = cfg.beta * (policy_rejected - ref_rejected)
  if cfg.loss == "ipo":
    return chosen / chosen_tokens, rejected / rejected_tokens
  return chosen, rejected


def pair_losses(cfg: PreferenceConfig, reward_chosen: Array, reward_rejected: Array
                ) -> Array:
  """Per-pair loss of the rewards `r_c, r_r` (module docstring)."""
  margin = reward_chosen - reward_rejected
  eps, log_sigmoid, sigmoid = cfg.label_smoothing, jax.nn.log_sigmoid, jax.nn.sigmoid
  if cfg.loss == "sigmoid":
    return _logistic(margin, eps)
  if cfg.loss == "robust":
    return (-(1.0 - eps) * log_sigmoid(margin) + eps * log_sigmoid(-margin)) / (1.0 - 2 * eps)
  if cfg.loss == "exo_pair":
    eps = eps or _EXO_EPS
    return (sigmoid(margin) * (log_sigmoid(margin) - np.log1p(-eps))
            + sigmoid(-margin) * (log_sigmoid(-margin) - np.log(eps)))
  if cfg.loss == "ipo":
    return (margin / cfg.beta - 1.0 / (2.0 * cfg.beta)) ** 2
  if cfg.loss == "hinge":
    return jax.nn.relu(1.0 - margin)
  if cfg.loss == "nca_pair":
    return (-log_sigmoid(reward_chosen) - 0.5 * log_sigmoid(-reward_chosen)
            - 0.5 * log_sigmoid(-reward_rejected))
  if cfg.loss == "sppo_hard":
    return (((reward_chosen - 0.5) / cfg.beta) ** 2
            + ((reward_rejected + 0.5) / cfg.beta) ** 2)
  if cfg.loss == "apo_zero":
    return 1.0 - sigmoid(reward_chosen) + sigmoid(reward_rejected)
  if cfg.loss == "apo_down":
    return sigmoid(reward_chosen) + 1.0 - sigmoid(margin)
  if cfg.loss == "discopop":  # Chris Lu et al. 2024, eq. 5 (TRL's `discopop`)
    tau = cfg.discopop_tau
    return (-log_sigmoid(margin) * sigmoid(-margin / tau)
            + jnp.exp(-margin + log_sigmoid(margin / tau)))
  if cfg.loss == "orpo":
    return -cfg.beta * log_sigmoid(margin)
  return _logistic(margin - cfg.simpo_gamma, eps)


def preference_loss(cfg: PreferenceConfig, policy_chosen, policy_rejected, ref_chosen=None,
                    ref_rejected=None, chosen_tokens=None, rejected_tokens=None, *,
                    pair_mask=None, denominator=None) -> tuple[Array, dict[str, Metric]]:
  """The preference loss of a set of pairs: `sum_p mask_p * loss_p / D`.

  Args:
    cfg: the loss.
    policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens,
      rejected_tokens: `[P]` per-pair values as in `pair_rewards`.
    pair_mask: `[P]` the real pairs (default all); the others' values may be garbage.
    denominator: `D`, the number of real pairs of the whole batch (default: of these).

  Returns:
    `(loss, metrics)` with `loss/preference`, `rewards/{chosen,rejected,margin,accuracy}`
    and `logps/{chosen,rejected}` as per-pair means.
  """
  policy_chosen = jnp.asarray(policy_chosen, jnp.float32)
  mask = (jnp.ones(policy_chosen.shape, bool) if pair_mask is None
          else jnp.asarray(pair_mask) != 0)

  # Slots without a pair hold zeros (and one token) before any arithmetic, so that
  # nothing there reaches the loss or its gradient.
  def clean(x, fill=0.0):
    return None if x is None else jnp.where(mask, jnp.asarray(x, jnp.float32), fill)

  pc, pr = clean(policy_chosen), clean(policy_rejected)
  rc, rr = clean(ref_chosen), clean(ref_rejected)
  nc, nr = clean(chosen_tokens, 1.0), clean(rejected_tokens, 1.0)
  reward_chosen, reward_rejected = pair_rewards(cfg, pc, pr, rc, rr, nc, nr)
  margin = reward_chosen - reward_rejected
  losses = jnp.where(mask, pair_losses(cfg, reward_chosen, reward_rejected), 0.0)
  count = jnp.sum(mask)
  if denominator is None:
    denominator = count
  loss = jnp.sum(losses) / jnp.maximum(denominator, 1)

  def mean(x):
    return Metric.mean(jnp.sum(jnp.where(mask, jax.lax.stop_gradient(x), 0.0)), count)

  metrics = {
      "loss/preference": mean(losses),
      "rewards/chosen": mean(reward_chosen),
      "rewards/rejected": mean(reward_rejected),
      "rewards/margin": mean(margin),
      "rewards/accuracy": mean((reward_chosen > reward_rejected).astype(jnp.float32)),
      "logps/chosen": mean(pc),
      "logps/rejected": mean(pr),
  }
  return loss, metrics


# ---------------------------------------------------------------------------------------
# From per-token log-probs of a packed micro-batch
# ---------------------------------------------------------------------------------------


def pair_sums(x_BxT: Array, pair_ids_BxT: Array, chosen_BxT: Array, num_pairs: int
              ) -> tuple[Array, Array]:
  """Sums of `x` over each pair's chosen and over its rejected tokens, `([P], [P])`.

  `x` must already be 0 where it should not count (outside the loss mask).
  """
  pair_ids = jnp.asarray(pair_ids_BxT, jnp.int32)
  # Slots 0..P-1 chosen, P..2P-1 rejected, 2P the padding (dropped).
  slot = jnp.where(pair_ids >= 0, pair_ids + jnp.where(chosen_BxT, 0, num_pairs),
                   2 * num_pairs)

  def one_row(x_row, slot_row):
    return jax.ops.segment_sum(x_row, slot_row, num_segments=2 * num_pairs + 1)

  # vmap keeps the scatter per row, so a batch-sharded input stays sharded.
  sums = jnp.sum(jax.vmap(one_row)(x_BxT, slot), axis=0)
  return sums[:num_pairs], sums[num_pairs:2 * num_pairs]


def batch_denominators(batch: Mapping[str, Array]) -> dict[str, Array]:
  """The whole batch's pair count and chosen-token count (sum them over micro-batches)."""
  chosen_scored = (jnp.asarray(batch["loss_mask"]) != 0) & jnp.asarray(batch["chosen"])
  return {"pairs": jnp.sum(jnp.asarray(batch["pair_mask"]) != 0).astype(jnp.float32),
          "chosen_tokens": jnp.sum(chosen_scored).astype(jnp.float32)}


def microbatch_preference_loss(cfg: PreferenceConfig, logprobs_BxT: Array,
                               mb: Mapping[str, Array], *, denominators: Mapping[str, Array]
                               ) -> tuple[Array, dict[str, Metric]]:
  """The loss of one packed micro-batch from the policy's per-target log-probs.

  Args:
    cfg: the loss.
    logprobs_BxT: the policy's log-probs of the targets (differentiable).
    mb: `loss_mask, pair_ids, chosen` `[B, T]`, `pair_mask` `[P]` and, for the losses
      with a reference, `ref_logprobs` `[B, T]`.
    denominators: `batch_denominators` of the whole batch.

  Returns:
    `(loss, metrics)`: summing `loss` over the micro-batches gives the batch loss.
  """
  mask = jnp.asarray(mb["loss_mask"]) != 0
  pair_mask = jnp.asarray(mb["pair_mask"]) != 0
  num_pairs = pair_mask.shape[-1]
  chosen = jnp.asarray(mb["chosen"])

  def sums(x):
    return pair_sums(jnp.where(mask, x, 0.0).astype(jnp.float32), mb["pair_ids"], chosen,
                     num_pairs)

  policy_chosen, policy_rejected = sums(logprobs_BxT)
  ref_chosen = ref_rejected = None
  if cfg.needs_reference:
    ref_chosen, ref_rejected = sums(jax.lax.stop_gradient(mb["ref_logprobs"]))
  chosen_tokens, rejected_tokens = sums(jnp.ones(mask.shape, jnp.float32))
  loss, metrics = preference_loss(cfg, policy_chosen, policy_rejected, ref_chosen,
                                  ref_rejected, chosen_tokens, rejected_tokens,
                                  pair_mask=pair_mask, denominator=denominators["pairs"])
  if cfg.nll_coef > 0:
    nll = jnp.sum(jnp.where(mask & chosen, -logprobs_BxT, 0.0))
    metrics["loss/sft"] = Metric.mean(jax.lax.stop_gradient(nll), jnp.sum(mask & chosen))
    loss = loss + cfg.nll_coef * nll / jnp.maximum(denominators["chosen_tokens"], 1)
  return loss, metrics


# ---------------------------------------------------------------------------------------
# Packing pairs on the host
# ---------------------------------------------------------------------------------------


def token_array(where: str, item: Mapping[str, Any], key: str) -> np.ndarray:
  """`item[key]` as int32 tokens; ValueError naming `where` (e.g. "pair 3") otherwise."""
  value = np.asarray(item[key])
  if value.ndim != 1:
    raise ValueError(f"{where}: {key} must be a 1-D token array, got shape {value.shape}")
  if value.size and not np.issubdtype(value.dtype, np.integer):
    raise ValueError(f"{where}: {key} must hold integer token ids, got {value.dtype}")
  return value.astype(np.int32)


def check_keys(where: str, item: Any, required: Sequence[str], optional: Sequence[str]
               ) -> None:
  """ValueError naming `where` unless `item` is a mapping with every required key and no
  key outside required + optional."""
  if not isinstance(item, Mapping):
    raise ValueError(f"{where}: expected a mapping with keys {', '.join(required)}, got "
                     f"{type(item).__name__}")
  unknown = sorted(set(item) - set(required) - set(optional))
  if unknown:
    raise ValueError(f"{where}: unknown key(s) {unknown}; known: "
                     f"{', '.join(tuple(required) + tuple(optional))}")
  missing = [key for key in required if key not in item]
  if missing:
    raise ValueError(f"{where}: missing {missing}")


def _pair_sequences(index: int, pair: Mapping[str, Any], row_len: int, truncate: bool
                    ) -> tuple[list[dict[str, np.ndarray]], int]:
  """The pair's two trajectories (chosen first) cut to row_len, and how many were cut."""
  check_keys(f"pair {index}", pair, PAIR_KEYS, OPTIONAL_PAIR_KEYS)
  prompt = token_array(f"pair {index}", pair, "prompt_tokens")
  if not len(prompt):
    raise ValueError(f"pair {index}: empty prompt_tokens (the first response token needs a "
                     "context)")
  if len(prompt) + 1 > row_len:
    raise ValueError(f"pair {index}: prompt of {len(prompt)} tokens leaves no response token "
                     f"in row_len {row_len}")
  sequences, truncated = [], 0
  for side in ("chosen", "rejected"):
    response = token_array(f"pair {index}", pair, f"{side}_tokens")
    if not len(response):
      raise ValueError(f"pair {index}: empty {side}_tokens")
    mask = pair.get(f"{side}_mask")
    mask = np.ones(len(response), bool) if mask is None else np.asarray(mask) != 0
    if mask.shape != response.shape:
      raise ValueError(f"pair {index}: {side}_mask has shape {mask.shape}, {side}_tokens "
                       f"has {len(response)} tokens")
    if len(prompt) + len(response) > row_len:
      if not truncate:
        raise ValueError(f"pair {index}: the {side} sequence has "
                         f"{len(prompt) + len(response)} tokens > row_len {row_len}; raise "
                         "row_len or pass truncate=True")
      # A cut sequence keeps the response tokens some position still predicts.
      keep = row_len - len(prompt)
      response, mask = response[:keep], mask[:keep]
      truncated += 1
    if not mask.any():
      raise ValueError(f"pair {index}: no scored {side} token"
                       + (f" within row_len {row_len}" if truncated else
                          f" ({side}_mask is all 0)"))
    sequences.append({"prompt_tokens": prompt, "response_tokens": response,
                      "response_mask": mask})
  return sequences, truncated


def _assign_microbatches(pair_lengths: Sequence[tuple[int, int]], row_len: int,
                         rows_per_microbatch: int) -> list[list[int]]:
  """The pairs of each micro-batch: longest pairs first, each into the first micro-batch
  whose rows (filled first-fit-decreasing, as `pack_trajectories` fills them) take both."""
  order = sorted(range(len(pair_lengths)), key=lambda i: -sum(pair_lengths[i]))
  capacity = rows_per_microbatch * row_len
  microbatches: list[list[int]] = []
  lengths: list[list[int]] = []
  for index in order:
    chosen_len, rejected_len = pair_lengths[index]
    for members, sizes in zip(microbatches, lengths):
      if sum(sizes) + chosen_len + rejected_len > capacity:
        continue
      trial = sizes + [chosen_len, rejected_len]
      if packing.first_fit_decreasing(trial, row_len).max() < rows_per_microbatch:
        members.append(index)
        sizes.extend((chosen_len, rejected_len))
        break
    else:
      if packing.first_fit_decreasing([chosen_len, rejected_len], row_len).max() >= \
          rows_per_microbatch:
        raise ValueError(f"pair {index}: its sequences of {chosen_len} and {rejected_len} "
                         f"tokens do not fit {rows_per_microbatch} row(s) of {row_len}")
      microbatches.append([index])
      lengths.append([chosen_len, rejected_len])
  # Input order within a micro-batch, so packing is deterministic and readable.
  return [sorted(members) for members in microbatches]


def _power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def pack_pairs(pairs: Sequence[Mapping[str, Any]], row_len: int, *, rows_per_microbatch: int,
               pad_id: int = 0, truncate: bool = True) -> dict[str, np.ndarray]:
  """Packs preference pairs into micro-batches (layout in the module docstring).

  Pairs go longest first into the first micro-batch with room for both their sequences;
  within a micro-batch `packing.pack_trajectories` fills the rows first-fit-decreasing.
  The micro-batch count M and the pair slots per micro-batch P are rounded up to powers
  of two, so a jitted step sees few shapes.

  Args:
    pairs: mappings with the keys of the module docstring.
    row_len: tokens per row.
    rows_per_microbatch: rows B of each micro-batch (a multiple of the devices the
      batch is split over).
    pad_id: token id of padding and of the last positions' targets.
    truncate: cut the response tail of a sequence longer than `row_len` (counted in
      `truncated`) instead of raising.

  Returns:
    Dict of numpy arrays: the per-token keys `[M, B, T]`, `pair_mask` and `pair_index`
    `[M, P]`, `truncated` a scalar.
  """
  if row_len < 2:
    raise ValueError(f"row_len must be >= 2, got {row_len}")
  if rows_per_microbatch < 1:
    raise ValueError(f"rows_per_microbatch must be >= 1, got {rows_per_microbatch}")
  if isinstance(pairs, Mapping) or not len(pairs):
    raise ValueError("pack_pairs needs a non-empty sequence of pairs")
  sequences, truncated = [], 0
  for index, pair in enumerate(pairs):
    seqs, cut = _pair_sequences(index, pair, row_len, truncate)
    sequences.append(seqs)
    truncated += cut
  pair_lengths = [tuple(len(s["prompt_tokens"]) + len(s["response_tokens"]) for s in seqs)
                  for seqs in sequences]
  assignment = _assign_microbatches(pair_lengths, row_len, rows_per_microbatch)

  # One pack per micro-batch, its trajectories chosen, rejected, chosen, ...: the
  # sequence index s of the micro-batch is pair slot s // 2, chosen when s is even.
  rows = [packing.pack_trajectories([seq for i in members for seq in sequences[i]], row_len,
                                    num_rows=rows_per_microbatch, pad_id=pad_id)
          for members in assignment]
  rows = {key: np.concatenate([r[key] for r in rows])
          for key in TOKEN_KEYS[:5] + ("seq_ids",)}
  num_micro = _power_of_two(len(assignment))
  batch = packing.split_microbatches(rows, rows_per_microbatch * row_len,
                                     num_microbatches=num_micro, pad_id=pad_id)
  seq_ids = batch.pop("seq_ids")
  batch["pair_ids"] = np.where(seq_ids >= 0, seq_ids // 2, -1).astype(np.int32)
  batch["chosen"] = (seq_ids >= 0) & (seq_ids % 2 == 0)

  slots = _power_of_two(max(len(members) for members in assignment))
  batch["pair_mask"] = np.zeros((num_micro, slots), bool)
  batch["pair_index"] = np.full((num_micro, slots), -1, np.int32)
  for micro, members in enumerate(assignment):
    batch["pair_mask"][micro, :len(members)] = True
    batch["pair_index"][micro, :len(members)] = members
  batch["truncated"] = np.asarray(truncated)
  return batch


# ---------------------------------------------------------------------------------------
# Online pairs from scored groups
# ---------------------------------------------------------------------------------------


def pairs_from_group(samples: Sequence[Mapping[str, Any]], rewards: Sequence[float], *,
                     pairs_per_group: int = 1) -> list[dict[str, np.ndarray]]:
  """Preference pairs from one prompt's scored samples: the i-th best against the i-th
  worst, for i < pairs_per_group, while the better one's reward is strictly higher.

  Args:
    samples: packer trajectories of one prompt (`prompt_tokens`, `response_tokens`,
      optionally `response_mask`), e.g. `rollout.group_to_trajectories`'s.
    rewards: their rewards, in the same order.
    pairs_per_group: at most this many pairs, no sample in two of them.

  Returns:
    Pairs in `pack_pairs`'s format. Ties keep the samples' order (the earlier sample
    ranks higher), so the result is deterministic; samples with no response token are
    left out.
  """
  if len(samples) != len(rewards):
    raise ValueError(f"{len(samples)} samples but {len(rewards)} rewards")
  kept = [i for i, s in enumerate(samples) if len(np.asarray(s["response_tokens"]))]
  # Stable: best first; equal rewards keep the samples' order.
  order = sorted(kept, key=lambda i: -float(rewards[i]))
  pairs = []
  for rank in range(min(pairs_per_group, len(order) // 2)):
    best, worst = order[rank], order[len(order) - 1 - rank]
    if not float(rewards[best]) > float(rewards[worst]):
      break
    chosen, rejected = samples[best], samples[worst]
    if not np.array_equal(chosen["prompt_tokens"], rejected["prompt_tokens"]):
      raise ValueError("a group's samples must share their prompt tokens")
    pair = {"prompt_tokens": np.asarray(chosen["prompt_tokens"], np.int32)}
    for name, s in (("chosen", chosen), ("rejected", rejected)):
      pair[f"{name}_tokens"] = np.asarray(s["response_tokens"], np.int32)
      pair[f"{name}_mask"] = np.asarray(s.get("response_mask",
                                              np.ones(len(s["response_tokens"]))), np.int32)
    pairs.append(pair)
  return pairs
