"""KTO: preference optimisation from unpaired feedback, one labelled completion at a time.

    batch = pack_examples(examples, row_len=2048, rows_per_microbatch=8,
                          pad_id=tok.pad_id, with_kl=True)
    step = train_step.make_preference_step(model_cfg, PreferenceConfig(loss="kto"),
                                           optimizer, mesh=mesh, reference_in_step=True)
    state, metrics = step(state, batch, reference)

An example is a mapping

    prompt_tokens       int [P]  (P >= 1)
    completion_tokens   int [C]  (C >= 1)
    completion_mask     [C] optional, nonzero = scored (0 for tool output); default all 1
    label               bool     True = desirable, False = undesirable
    domain              str, optional (ignored here)

as `posttrain.data.preference.UnpairedData` streams them; a pair becomes two examples.

Losses (Ethayarajh et al. 2024; TRL's KTOTrainer). With `r = pi - ref` the policy's minus
the reference's log-prob of a completion, summed over its scored tokens, and s the
logistic sigmoid:

    kto                desirable  1 - s(beta (r - z0))    undesirable  1 - s(beta (z0 - r))
    apo_zero_unpaired  desirable  1 - s(beta r)           undesirable  s(beta r)

each weighted by `desirable_weight` or `undesirable_weight` and averaged over the
examples of the batch. KTO's reference point `z0` estimates the policy's KL divergence
from the reference: `max(0, mean_i (pi - ref)(y_j | x_i))` over mismatched pairs, example
i's prompt with the completion of example i - 1 of the batch (cyclically), as TRL pairs
them. z0 is a constant of the step (no gradient flows through it), so its sequences need a
forward pass of the policy and of the reference and no backward pass: the step computes
it over the whole batch before the micro-batches, and the micro-batch losses add up to the
one-batch loss exactly.

Packed layout. The examples' own sequences are packed as `posttrain.rl.packing` packs
trajectories, `[M, B, T]` per-token keys (`tokens, targets, positions, segment_ids,
loss_mask`) plus

    example_ids     int32 [M, B, T]  the example's slot within its micro-batch, -1 in padding
    example_mask    bool  [M, S]     which of the S slots of a micro-batch hold an example
    desirable       bool  [M, S]     the slot's label
    example_index   int32 [M, S]     the slot's example in the input list, -1 for empty slots

and, with `with_kl`, the mismatched sequences as `kl_tokens, kl_targets, kl_positions,
kl_segment_ids, kl_loss_mask` `[K, B, T]` (K micro-batches of their own: they are only
summed). `truncated` counts the sequences whose completion tail was cut to fit `row_len`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.rl import packing
from posttrain.rl.losses import Metric
from posttrain.rl.preference import PreferenceConfig, check_keys, token_array

Array = jax.Array

EXAMPLE_KEYS = ("prompt_tokens", "completion_tokens", "label")
OPTIONAL_EXAMPLE_KEYS = ("completion_mask", "domain")
SEQUENCE_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")
TOKEN_KEYS = SEQUENCE_KEYS + ("example_ids",)
KL_KEYS = tuple(f"kl_{key}" for key in SEQUENCE_KEYS)
SLOT_KEYS = ("example_mask", "desirable")


def needs_kl(cfg: PreferenceConfig) -> bool:
  """The loss reads KTO's reference point (and so the mismatched sequences)."""
  return cfg.loss == "kto"


# ---------------------------------------------------------------------------------------
# The loss of per-example log-probs
# ---------------------------------------------------------------------------------------


def example_losses(cfg: PreferenceConfig, logratios: Array, desirable: Array, kl=0.0
                   ) -> Array:
  """Per-example weighted losses (module docstring) of `r = pi - ref` `[N]`."""
  if not cfg.unpaired:
    raise ValueError(f"{cfg.loss!r} is not an unpaired loss")
  r = jnp.asarray(logratios, jnp.float32)
  kl = jax.lax.stop_gradient(jnp.asarray(kl, jnp.float32))
  if cfg.loss == "kto":
    good = 1.0 - jax.nn.sigmoid(cfg.beta * (r - kl))
    bad = 1.0 - jax.nn.sigmoid(cfg.beta * (kl - r))
  else:
    good = 1.0 - jax.nn.sigmoid(cfg.beta * r)
    bad = jax.nn.sigmoid(cfg.beta * r)
  return jnp.where(desirable, cfg.desirable_weight * good, cfg.undesirable_weight * bad)


def unpaired_loss(cfg: PreferenceConfig, policy_logps, ref_logps, desirable, *, kl=0.0,
                  example_mask=None, denominator=None) -> tuple[Array, dict[str, Metric]]:
  """The loss of a set of examples: `sum_i mask_i * loss_i / D`.

  Args:
    cfg: an unpaired loss.
    policy_logps, ref_logps: `[N]` summed completion log-probs of the policy and the
      reference.
    desirable: `[N]` bool labels.
    kl: KTO's reference point z0 (unused by apo_zero_unpaired).
    example_mask: `[N]` the real examples (default all); the others may hold garbage.
    denominator: `D`, the number of real examples of the whole batch (default: these).

  Returns:
    `(loss, metrics)`: `loss/preference`, and `rewards/{chosen,rejected}` (beta r) and
    `logps/{chosen,rejected}` (pi) as means over the desirable and the undesirable
    examples.
  """
  policy_logps = jnp.asarray(policy_logps, jnp.float32)
  mask = (jnp.ones(policy_logps.shape, bool) if example_mask is None
          else jnp.asarray(example_mask) != 0)
  desirable = jnp.asarray(desirable) != 0
  # Empty slots hold zeros before any arithmetic: nothing there reaches the gradient.
  pi = jnp.where(mask, policy_logps, 0.0)
  ref = jnp.where(mask, jnp.asarray(ref_logps, jnp.float32), 0.0)
  losses = jnp.where(mask, example_losses(cfg, pi - ref, desirable, kl), 0.0)
  count = jnp.sum(mask)
  loss = jnp.sum(losses) / jnp.maximum(count if denominator is None else denominator, 1)
  rewards = cfg.beta * jax.lax.stop_gradient(pi - ref)

  def mean(x, where):
    return Metric.mean(jnp.sum(jnp.where(where, jax.lax.stop_gradient(x), 0.0)),
                       jnp.sum(where))

  good, bad = mask & desirable, mask & ~desirable
  return loss, {
      "loss/preference": mean(losses, mask),
      "rewards/chosen": mean(rewards, good),
      "rewards/rejected": mean(rewards, bad),
      "logps/chosen": mean(pi, good),
      "logps/rejected": mean(pi, bad),
  }


def finish_metrics(values: Mapping[str, Array]) -> dict[str, Array]:
  """`rewards/margin`: the desirable examples' mean reward minus the undesirable ones'."""
  return {**values, "rewards/margin": values["rewards/chosen"] - values["rewards/rejected"]}


def example_sums(x_BxT: Array, example_ids_BxT: Array, num_slots: int) -> Array:
  """`[S]` sums of `x` over each slot's tokens (x already 0 where it must not count)."""
  ids = jnp.asarray(example_ids_BxT, jnp.int32)
  slot = jnp.where(ids >= 0, ids, num_slots)

  def one_row(x_row, slot_row):
    return jax.ops.segment_sum(x_row, slot_row, num_segments=num_slots + 1)

  # vmap keeps the scatter per row, so a batch-sharded input stays sharded.
  return jnp.sum(jax.vmap(one_row)(x_BxT, slot), axis=0)[:num_slots]


def microbatch_loss(cfg: PreferenceConfig, logprobs_BxT: Array, mb: Mapping[str, Array], *,
                    kl, denominator) -> tuple[Array, dict[str, Metric]]:
  """The loss of one packed micro-batch; summing it over the micro-batches gives the
  batch loss.

  Args:
    cfg: an unpaired loss.
    logprobs_BxT: the policy's log-probs of the targets (differentiable).
    mb: `loss_mask, example_ids, ref_logprobs` `[B, T]`, `example_mask, desirable` `[S]`.
    kl: z0 (`kl_reference_point`); ignored by apo_zero_unpaired.
    denominator: the number of examples of the whole batch.
  """
  mask = jnp.asarray(mb["loss_mask"]) != 0
  slots = jnp.asarray(mb["example_mask"]).shape[-1]

  def sums(x):
    return example_sums(jnp.where(mask, x, 0.0).astype(jnp.float32), mb["example_ids"],
                        slots)

  return unpaired_loss(cfg, sums(logprobs_BxT), sums(jax.lax.stop_gradient(mb["ref_logprobs"])),
                       mb["desirable"], kl=kl, example_mask=mb["example_mask"],
                       denominator=denominator)


def kl_reference_point(policy_sum, reference_sum, examples) -> Array:
  """KTO's z0 = max(0, sum over the mismatched sequences of (pi - ref) / examples)."""
  z = (jnp.asarray(policy_sum, jnp.float32) - jnp.asarray(reference_sum, jnp.float32)
       ) / jnp.maximum(jnp.asarray(examples, jnp.float32), 1.0)
  return jax.lax.stop_gradient(jnp.maximum(z, 0.0))


# ---------------------------------------------------------------------------------------
# Packing examples on the host
# ---------------------------------------------------------------------------------------


def _parse(index: int, example: Mapping[str, Any], row_len: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
  """(prompt, completion, completion mask, label) of one example, validated."""
  where = f"example {index}"
  check_keys(where, example, EXAMPLE_KEYS, OPTIONAL_EXAMPLE_KEYS)
  label = example["label"]
  if not isinstance(label, (bool, np.bool_)):
    raise ValueError(f"{where}: label must be a bool (True = desirable), got "
                     f"{label!r}")
  prompt = token_array(where, example, "prompt_tokens")
  completion = token_array(where, example, "completion_tokens")
  if not len(prompt):
    raise ValueError(f"{where}: empty prompt_tokens (the first completion token "
                     "needs a context)")
  if len(prompt) + 1 > row_len:
    raise ValueError(f"{where}: prompt of {len(prompt)} tokens leaves no completion "
                     f"token in row_len {row_len}")
  if not len(completion):
    raise ValueError(f"{where}: empty completion_tokens")
  mask = example.get("completion_mask")
  mask = np.ones(len(completion), bool) if mask is None else np.asarray(mask) != 0
  if mask.shape != completion.shape:
    raise ValueError(f"{where}: completion_mask has shape {mask.shape}, "
                     f"completion_tokens has {len(completion)} tokens")
  if not mask.any():
    raise ValueError(f"{where}: no scored completion token (completion_mask is "
                     "all 0)")
  return prompt, completion, mask, bool(label)


def _sequence(prompt, completion, mask, row_len: int) -> tuple[dict[str, np.ndarray], bool]:
  """A packer trajectory, its completion cut to fit row_len; (trajectory, was cut)."""
  keep = row_len - len(prompt)
  cut = len(completion) > keep
  return {"prompt_tokens": prompt, "response_tokens": completion[:keep],
          "response_mask": mask[:keep]}, cut


def _power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def pack_examples(examples: Sequence[Mapping[str, Any]], row_len: int, *,
                  rows_per_microbatch: int, pad_id: int = 0, with_kl: bool = True
                  ) -> dict[str, np.ndarray]:
  """Packs labelled examples (and, `with_kl`, their mismatched sequences) for the step.

  The examples' sequences fill rows first-fit-decreasing (`packing.pack_trajectories`),
  and consecutive rows make a micro-batch. The micro-batch counts and the slots per micro-batch are rounded up to
  powers of two, so a jitted step sees few shapes. A completion longer than its row is
  cut at the tail (counted in `truncated`); one whose scored tokens are all cut away is
  an error.

  Args:
    examples: mappings with the keys of the module docstring.
    row_len: tokens per row.
    rows_per_microbatch: rows B of each micro-batch (a multiple of the devices the
      batch is split over).
    pad_id: token id of padding and of the last positions' targets.
    with_kl: also pack KTO's mismatched sequences; needs at least two examples.

  Returns:
    Dict of numpy arrays (layout in the module docstring), with `truncated` a scalar.
  """
  if row_len < 2:
    raise ValueError(f"row_len must be >= 2, got {row_len}")
  if rows_per_microbatch < 1:
    raise ValueError(f"rows_per_microbatch must be >= 1, got {rows_per_microbatch}")
  if isinstance(examples, Mapping) or not len(examples):
    raise ValueError("pack_examples needs a non-empty sequence of examples")
  parsed = [_parse(i, example, row_len) for i, example in enumerate(examples)]
  if with_kl and len(parsed) < 2:
    raise ValueError("KTO's KL estimate pairs each prompt with another example's "
                     f"completion: a batch needs at least 2 examples, got {len(parsed)}")
  sequences, truncated = [], 0
  for index, (prompt, completion, mask, _) in enumerate(parsed):
    seq, cut = _sequence(prompt, completion, mask, row_len)
    if not seq["response_mask"].any():
      raise ValueError(f"example {index}: no scored completion token within row_len "
                       f"{row_len}")
    sequences.append(seq)
    truncated += cut

  # Micro-batches are consecutive rows of one first-fit-decreasing packing (longest
  # sequences first); a sequence's slot is its rank among its micro-batch's examples.
  rows = packing.pack_trajectories(sequences, row_len, pad_id=pad_id)
  rows = {key: rows[key] for key in SEQUENCE_KEYS + ("seq_ids",)}
  num_micro = _power_of_two(-(-len(rows["tokens"]) // rows_per_microbatch))
  batch = packing.split_microbatches(rows, rows_per_microbatch * row_len,
                                     num_microbatches=num_micro, pad_id=pad_id)
  seq_ids = batch.pop("seq_ids")
  members = [np.unique(ids[ids >= 0]) for ids in seq_ids]
  slots = _power_of_two(max(len(group) for group in members))
  batch["example_ids"] = np.full(seq_ids.shape, -1, np.int32)
  batch["example_mask"] = np.zeros((num_micro, slots), bool)
  batch["desirable"] = np.zeros((num_micro, slots), bool)
  batch["example_index"] = np.full((num_micro, slots), -1, np.int32)
  for micro, group in enumerate(members):
    scored = seq_ids[micro] >= 0
    batch["example_ids"][micro][scored] = np.searchsorted(group, seq_ids[micro][scored])
    batch["example_mask"][micro, :len(group)] = True
    batch["desirable"][micro, :len(group)] = [parsed[i][3] for i in group]
    batch["example_index"][micro, :len(group)] = group

  if with_kl:
    n = len(parsed)
    mismatched = []
    for i, (prompt, _, _, _) in enumerate(parsed):
      _, completion, mask, _ = parsed[(i - 1) % n]
      seq, cut = _sequence(prompt, completion, mask, row_len)
      mismatched.append(seq)
      truncated += cut
    kl_rows = packing.pack_trajectories(mismatched, row_len, pad_id=pad_id)
    kl_micro = _power_of_two(-(-len(kl_rows["tokens"]) // rows_per_microbatch))
    kl = packing.split_microbatches({k: kl_rows[k] for k in SEQUENCE_KEYS},
                                    rows_per_microbatch * row_len,
                                    num_microbatches=kl_micro, pad_id=pad_id)
    batch.update({f"kl_{key}": value for key, value in kl.items()})
  batch["truncated"] = np.asarray(truncated)
  return batch
