"""The rollout engine: one bucketed prefill call, then a jitted KV-cache decode loop.

    sampler = Sampler(model, max_len=1024)
    out = sampler.generate(prompts, max_new_tokens=256, temperature=1.0, top_p=0.95,
                           stop_token_ids=(eos,), seed=step)
    out.tokens[i, :out.lengths[i]], out.logprobs[i, :out.lengths[i]], out.finish_reasons[i]

Prompts are right-padded into a [batch bucket, length bucket] block; each row keeps its own
positions (slot = position), so short prompts never see shifted positions. Identical prompts
(a GRPO group) are prefilled once and their cache rows copied. Decoding runs in one
`lax.while_loop` over a donated cache and stops as soon as every row has stopped. Programs
are compiled ahead of time per shape bucket and counted in `num_compiles`.

With `generate(..., slots=N)` (continuous batching) at most N rows decode at once: a row
that stops hands its cache row to the next waiting prompt while the others go on, and
`on_finish` hears of each row as it ends. Rows sample from keys of their prompt's index
and their token's, so the samples are those of one call over every prompt.

A generation can pause and continue (partial rollouts): `generate(..., keep_cache=True,
reserve_tokens=total)` keeps the KV cache, and `resume(out.resume_state, rows,
max_new_tokens=n)` continues the rows that did not stop, drawing the same samples one
uninterrupted call would, as long as the weights have not changed in between.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posttrain import distributed, models
from posttrain.models.sharding import without_axes
from posttrain.models.transformer import (CACHED_WRITE_TOKENS, KVCache, LinearCache,
                                          cache_unit_axes, constrain_cache, map_cache_units,
                                          routing_dtype)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# A recorded routing buffer's logical axes: rows over the batch axes. It is held
# [rows, positions, layers x k]: with [layers, k] minor, XLA:TPU tiled a k of 8 out to 128
# lanes (the Qwen3-30B-A3B rollout's decode loop on a v5p-64: 0.29 GiB a chip for a
# 48 MiB record; BENCHMARKS.md).
_ROUTING_NAMES = ("batch", None, None)
# Continuous batching refills once this fraction of the slots has stopped: a prefill call
# per stopped row would cost more than the rows idle meanwhile.
_REFILL_FRACTION = 1 / 8


class SamplingMode(NamedTuple):
  """The static part of a sampling configuration (a new value compiles new programs).

  Temperature and the top-p threshold are runtime values; only whether they apply is static.
  """

  greedy: bool
  top_k: int | None
  top_p: bool


def sampling_mode(temperature: float, top_k: int | None, top_p: float | None,
                  vocab_size: int) -> SamplingMode:
  """Validates sampling arguments and returns the static mode they select."""
  if not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if top_k is not None and (int(top_k) != top_k or top_k < 1):
    raise ValueError(f"top_k must be a positive int or None, got {top_k}")
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
  if temperature == 0:
    return SamplingMode(greedy=True, top_k=None, top_p=False)
  top_k = None if top_k is None or top_k >= vocab_size else int(top_k)
  return SamplingMode(greedy=False, top_k=top_k, top_p=top_p is not None and top_p < 1.0)


def sample_logits(logits_BxV, keys_B, temperature, top_p, mode: SamplingMode):
  """Draws one token per row and returns (tokens [B] int32, behaviour log-probs [B] f32).

  The log-prob is under the distribution actually sampled from: softmax(logits / T)
  restricted to the top-k tokens, then to the smallest prefix (by probability) whose mass
  reaches top_p, renormalised. Greedy (temperature 0) picks the argmax and reports its
  log-prob under the untempered model distribution, log softmax(logits).
  """
  logits = logits_BxV.astype(jnp.float32)
  if mode.greedy:
    tokens = jnp.argmax(logits, axis=-1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens.astype(jnp.int32), jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0]
  scaled = logits / temperature
  if mode.top_k is None and not mode.top_p:
    tokens = jax.vmap(jax.random.categorical)(keys_B, scaled)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return tokens.astype(jnp.int32), jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0]
  # Sorted candidates: top-k keeps the first k, top-p a prefix of the sorted order.
  values, indices = jax.lax.top_k(scaled, mode.top_k or scaled.shape[-1])
  if mode.top_p:
    probs = jax.nn.softmax(values, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    values = jnp.where(mass_before < top_p, values, -jnp.inf)
  choice = jax.vmap(jax.random.categorical)(keys_B, values)
  tokens = jnp.take_along_axis(indices, choice[:, None], -1)[:, 0]
  logp = jnp.take_along_axis(jax.nn.log_softmax(values, axis=-1), choice[:, None], -1)[:, 0]
  return tokens.astype(jnp.int32), logp


def _row_keys(seed, step, row_ids):
  """One key per row and step: samples do not depend on the batch bucket, the mesh or the
  cache row a row runs in. `step` is the token's index in its row (a scalar or one per
  row), `row_ids` each row's index among the prompts."""
  steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), row_ids.shape)
  base = jax.random.key(seed)
  return jax.vmap(lambda s, r: jax.random.fold_in(jax.random.fold_in(base, s), r))(steps,
                                                                                     row_ids)


@dataclasses.dataclass(frozen=True)
class Completions:
  """Generated continuations, one row per prompt.

  Attributes:
    tokens: [rows, max_new_tokens] int32; entries at and after `lengths[i]` are pad_id.
    logprobs: [rows, max_new_tokens] float32 behaviour log-probs (see `sample_logits`);
      0.0 after `lengths[i]`.
    lengths: [rows] number of generated tokens, the stop token included.
    finish_reasons: "stop" (a stop token was generated; it is the last token) or "length".
    stats: how the call ran (not per row): `batch` and `prefill_rows` (padded; identical
      prompts share a prefill row), the `prompt_len` and `cache_len` buckets, `steps`,
      the token steps run (below max_new_tokens when every row stopped early; the
      prefill's token counts as one), `decode_steps` of them run by the decode loop
      over all `batch` rows, and `decoded`, the tokens those steps generated:
      decoded / (decode_steps x batch) is the share of decode work spent on live rows.
      With `slots` (continuous batching) also `inserts`, the prefill calls that filled
      freed cache rows (`prefill_rows` then sums theirs, `prompt_len` is the longest),
      and `weight_swaps`, how often `between_rounds` swapped in new weights.
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[str]
  stats: dict[str, int] = dataclasses.field(default_factory=dict)
  # With generate(..., keep_cache=True): what `Sampler.resume` continues from.
  resume_state: "ResumeState | None" = None
  # With Sampler(record_routing=True): per row, the experts each mixture layer chose for
  # each token the row fed, [prompt length + lengths[i] - 1, mixture layers, k]
  # (`models.transformer.routing_dtype`: uint8 for up to 256 experts)
  # (its prompt's tokens and those it generated but the last, in order; after `resume`,
  # the row's whole sequence so far).
  routing: list[np.ndarray] | None = None

  def token_lists(self) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]

  def logprob_lists(self) -> list[list[float]]:
    return [row[:n].tolist() for row, n in zip(self.logprobs, self.lengths)]


@dataclasses.dataclass
class ResumeState:
  """A paused generation: its KV cache on the devices and where each row stands.

  Made by `Sampler.generate(..., keep_cache=True)`, consumed by `Sampler.resume`, valid
  while the sampler's weights are those that filled the cache (`params_version`).
  """

  cache: Any
  rows: int  # prompts of the original call (the first `rows` of the batch)
  batch: int
  cache_len: int
  positions: np.ndarray  # [batch] position of each row's last token
  last: np.ndarray  # [batch] each row's last token
  generated: np.ndarray  # [batch] tokens generated so far
  open: np.ndarray  # [batch] bool: may continue (did not stop)
  mode: SamplingMode
  stop_ids: np.ndarray
  row_ids: np.ndarray  # [batch] each row's sampling-key index
  seed: int
  temperature: float
  top_p: float | None
  params_version: int


def _refill_at(batch: int) -> int:
  """Stopped slots, of `batch`, at which continuous batching refills."""
  return max(1, int(batch * _REFILL_FRACTION))


def refill_rows(batch: int, devices: int = 1) -> int:
  """The fewest rows a continuous-batching refill prefills, over `batch` slots spread
  over `devices` (the batch axes): `_REFILL_FRACTION` of the slots, the same power of two
  on every device."""
  per_device = _refill_at(batch) / devices
  return devices * min(batch // devices, 1 << (math.ceil(per_device) - 1).bit_length())


def _powers_of_two(lo: int, hi: int, *, halves: bool = False) -> tuple[int, ...]:
  """lo, 2 lo, 4 lo, ... below hi, then hi; with halves also 1.5x each (at most 25% padding)."""
  out, n = [], lo
  while n < hi:
    out += [n, n + n // 2] if halves and n >= 2 else [n]
    n *= 2
  return tuple(b for b in out if b < hi) + (hi,)


def default_length_bucket(n: int, max_len: int) -> int:
  """The length a Sampler with the default length_buckets pads `n` tokens to."""
  return _bucket(n, _powers_of_two(min(16, max_len), max_len, halves=True), "length")


# A mixture layer's expert leaves and their rank in one layer ([E, D, F], [E, F]; the
# experts' LoRA adapters [E, r, D], [E, r, 2, F] (ungated: [E, r, F]), [E, r, F],
# [E, r, D]).
_EXPERT_LEAF_RANKS = {"gate_proj": 3, "up_proj": 3, "down_proj": 3, "gate_bias": 2,
                      "up_bias": 2, "down_bias": 2, "experts_gate_up_proj_lora_a": 3,
                      "experts_gate_up_proj_lora_b": 4, "experts_up_proj_lora_a": 3,
                      "experts_up_proj_lora_b": 3, "experts_down_proj_lora_a": 3,
                      "experts_down_proj_lora_b": 3}


def _ids(share) -> set[int]:
  """The ids of the arrays in `share` (a pytree, or None) a sampler may hold uncopied."""
  return set() if share is None else {id(x) for x in jax.tree.leaves(share)}


def _shareable(x, shared: set[int], dtype, sharding) -> bool:
  """Whether the sampler holds `x` as it is: one of the caller's `shared` arrays, already
  in the sampler's dtype on its sharding."""
  return (id(x) in shared and isinstance(x, jax.Array) and x.dtype == dtype
          and x.sharding.is_equivalent_to(sharding, x.ndim))



def _param_path(path) -> str:
  """A leaf's path without nnx's Variable `.value`, so State and pure dicts compare equal."""
  return jax.tree_util.keystr(tuple(
      k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")))


def _grouping(row_source: np.ndarray, prefill_rows: int, batch: int) -> int | None:
  """g when the rows' prompts (row_source, the real rows') are prompt 0 g times, then
  prompt 1 g times, ... with g = batch / prefill_rows, so that repeating each prefilled
  row g times gives every row its prompt's cache (padding rows, inactive, take what the
  repeat gives them); else None."""
  if batch % prefill_rows:
    return None
  g = batch // prefill_rows
  want = np.repeat(np.arange(prefill_rows, dtype=np.int64), g)[:len(row_source)]
  return g if np.array_equal(np.asarray(row_source), want) else None


class _HeldCaches:
  """Freed slots whose cache still holds the sequence their last row ran (its prompt and
  its tokens but the last: the last was sampled, never fed back), indexed by length and
  last tokens so that finding the one a prompt extends costs a lookup per length held,
  not a comparison with every held sequence."""

  _TAIL = 8

  def __init__(self):
    self.seqs: dict[int, np.ndarray] = {}
    self._index: dict[tuple, list[int]] = {}
    self._lengths: collections.Counter = collections.Counter()

  def _key(self, seq: np.ndarray, length: int) -> tuple:
    return length, tuple(seq[max(0, length - self._TAIL):length].tolist())

  def add(self, slot: int, seq: np.ndarray) -> None:
    self.drop(slot)
    self.seqs[slot] = seq
    self._index.setdefault(self._key(seq, seq.size), []).append(slot)
    self._lengths[seq.size] += 1

  def drop(self, slot: int) -> None:
    seq = self.seqs.pop(slot, None)
    if seq is None:
      return
    key = self._key(seq, seq.size)
    self._index[key].remove(slot)
    if not self._index[key]:
      del self._index[key]
    self._lengths[seq.size] -= 1
    if not self._lengths[seq.size]:
      del self._lengths[seq.size]

  def match(self, prompt: np.ndarray, usable) -> tuple[int, int] | None:
    """(slot, tokens cached) of a held sequence that is a proper prefix of `prompt`
    (the longest), among the slots `usable(slot)` accepts; None if none is."""
    for length in sorted((n for n in self._lengths if n < prompt.size), reverse=True):
      for slot in self._index.get(self._key(prompt, length), ()):
        if usable(slot) and np.array_equal(self.seqs[slot], prompt[:length]):
          return slot, length
    return None


def _extend_width(tokens: int, cache_len: int, chunk: int) -> int:
  """Tokens a row a continuing call (`Sampler._extend`) takes, for at most `tokens` left
  in its longest row: a power of two from 16 up, at most `chunk`."""
  return min(chunk, 1 << max(4, (tokens - 1).bit_length()), cache_len)


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
  for b in buckets:
    if b >= n:
      return b
  raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


class Sampler:
  """Batched autoregressive sampling from a `posttrain.models.Transformer`.

  Args:
    model: the policy (its current weights are copied into the sampler).
    mesh: rollout mesh; batch shards over data/fsdp, heads over tensor. None: one device.
    rules: logical-axis rules (default `models.DEFAULT_RULES`).
    max_len: longest prompt + completion (default cfg.max_position_embeddings).
    cache_dtype: None (the model's compute dtype) or "int8" (per-token, per-head scales).
    batch_buckets: batch sizes to pad to (default powers of two).
    length_buckets: prompt and cache lengths to pad to (default 16, 24, 32, 48, 64, ...:
      powers of two and their midpoints, capped at max_len).
    pad_id: token written after a row stops and into padding.
    gather_weights: at the start of each generate / resume call, gather the weights over
      the batch mesh axes (data, fsdp) in the compute dtype, once, for the whole call
      (freed after it). Otherwise (False) an FSDP-sharded model gathers every layer's
      weights inside every decode step. Costs the model's compute-dtype bytes over the
      tensor axis per device during sampling. Skipped when there is nothing to gather or
      cast (one device on the batch axes, weights already in the compute dtype).
    extend_chunk: a prompt continued in its slot (`reuse_cache`) is written in chunks of
      at most this many tokens (a power of two from 16 up, or this), so its programs never
      depend on its length. A sliding-window layer keeps a ring of window + extend_chunk - 1
      slots (`models.sliding_cache_slots`) instead of the whole row's.
    share: arrays among the model's weights the sampler holds as they are, uncopied
      (`update_params`' share: a colocated learner's frozen LoRA base; `reshare`).
    record_routing: a mixture of experts' routing replay: every call records the experts
      each mixture layer chose for each token it fed (the prompt's and those generated
      but the last), `Completions.routing`, what the learner's update replays
      (`Transformer.hidden_states(..., routing=)`); a resumed row's is its whole
      sequence's, from its first token.
  """

  def __init__(self, model: models.Transformer, *, mesh: Mesh | None = None, rules=None,
               max_len: int | None = None, cache_dtype: str | None = None,
               batch_buckets: Sequence[int] | None = None,
               length_buckets: Sequence[int] | None = None, pad_id: int = 0,
               gather_weights: bool = True, extend_chunk: int = CACHED_WRITE_TOKENS,
               share=None, record_routing: bool = False):
    cfg = model.cfg
    self.cfg = cfg
    if record_routing and not cfg.num_experts:
      raise ValueError("record_routing=True records a mixture's experts; this model has "
                       "none (num_experts=0)")
    self.record_routing = bool(record_routing)
    self.mesh = mesh
    self.rules = models.rules_from_config(rules)
    self.max_len = int(max_len or cfg.max_position_embeddings)
    if cfg.learned_positions and self.max_len > cfg.max_position_embeddings:
      raise ValueError(f"max_len={self.max_len} is past this model's learned position "
                       f"embedding of {cfg.max_position_embeddings} positions")
    if self.max_len < 2:
      raise ValueError(f"max_len must be at least 2, got {self.max_len}")
    if cache_dtype not in (None, "int8"):
      raise ValueError(f"cache_dtype must be None or 'int8', got {cache_dtype!r}")
    self.cache_dtype = cache_dtype
    if int(extend_chunk) != extend_chunk or extend_chunk < 1:
      raise ValueError(f"extend_chunk must be a positive int, got {extend_chunk}")
    self.extend_chunk = int(extend_chunk)
    if not 0 <= pad_id < cfg.vocab_size:
      raise ValueError(f"pad_id={pad_id} is outside the vocabulary [0, {cfg.vocab_size})")
    self.pad_id = int(pad_id)
    self._ctx = models.ShardingContext(mesh, self.rules)
    self._batch_multiple = self._batch_shards()
    self.batch_buckets = self._check_buckets(batch_buckets, "batch_buckets")
    if length_buckets is None:
      self.length_buckets = _powers_of_two(min(16, self.max_len), self.max_len, halves=True)
    else:
      given = self._check_buckets(length_buckets, "length_buckets")
      self.length_buckets = tuple(b for b in given if b < self.max_len) + (self.max_len,)
    self._graphdef, state = nnx.split(model)
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    if abstract and mesh is None:
      raise ValueError("a sampler of an abstract model (nnx.eval_shape) needs a mesh")
    shardings = (models.state_shardings(state, mesh, self.rules) if mesh is not None
                 else jax.tree.map(lambda x: x.sharding, state))
    if abstract:  # compile-only (`compile`), e.g. for devices this host does not have
      state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           state, shardings)
    else:  # A copy, never an alias: a learner that donates its params must not free ours
      # (but the arrays of `share`, as `update_params` takes them).
      shared = _ids(share)
      state = jax.tree.map(lambda x, s: x if _shareable(x, shared, x.dtype, s) else
                           distributed.copy_to(x, s), state, shardings)
    # the indices of the leaves held uncopied (`share`), for `reshare`
    self._shared: set[int] = set() if abstract else {
        i for i, x in enumerate(jax.tree.leaves(state)) if id(x) in shared}
    self._treedef = jax.tree.structure(state)
    self._paths = [_param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    self._specs = [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state)]
    self._state = state
    # The layout prefill and decode read the weights in (`_weights`): without the batch
    # mesh axes, floating leaves in the compute dtype (the model casts them to it anyway).
    # Nothing to gather or cast (no batch axis over several devices, weights already in
    # the compute dtype): the programs read the sampler's own weights.
    # Experts split over E (expert parallelism: the rules map "experts" to mesh axes) stay
    # split on E: the MoE layer runs each device's own experts (`MoE._expert_parallel`).
    compute = jnp.dtype(cfg.dtype)
    specs = [] if mesh is None else [
        (shape, compute if jnp.issubdtype(dtype, jnp.floating)
         and jnp.dtype(dtype).itemsize > compute.itemsize else dtype,
         self._without_batch_axes(sharding, self._expert_axis(path, len(shape))
                                  if cfg.num_experts else None))
        for path, (shape, dtype, sharding) in zip(self._paths, self._specs)]
    spread = self._batch_multiple > 1
    narrower = any(new[1] != old[1] for new, old in zip(specs, self._specs))
    self.gather_weights = bool(gather_weights) and mesh is not None and (spread or narrower)
    # The gathered experts padded to 128 columns a device with zeros (`_expert_padding`):
    # leaf -> [(axis, shards, width a device, padded)].
    self._expert_pad = self._expert_padding() if self.gather_weights else {}
    for i, pads in self._expert_pad.items():
      shape, dtype, sharding = specs[i]
      for axis, shards, _, padded in pads:
        shape = shape[:axis] + (shards * padded,) + shape[axis + 1:]
      specs[i] = (shape, dtype, sharding)
    self._weight_specs = specs if self.gather_weights else self._specs
    self._programs: dict[tuple, Any] = {}
    self.params_version = 0  # bumped by update_params; a ResumeState needs the same

  # -- public -----------------------------------------------------------------------------

  @property
  def num_compiles(self) -> int:
    """Programs compiled so far (each shape bucket and sampling mode compiles once)."""
    return len(self._programs)

  @property
  def shares_weights(self) -> bool:
    """Whether it holds any of the caller's arrays uncopied (`update_params`' share)."""
    return bool(self._shared)

  def param_shardings(self) -> list:
    """The sampler's sharding of each parameter leaf, in `jax.tree.leaves` order."""
    return [sharding for _, _, sharding in self._specs]

  def slot_rows(self, slots: int) -> int:
    """The cache rows `generate(..., slots=slots)` decodes at once: `slots` rounded up to
    a batch bucket. Continuous batching runs for more prompts than that."""
    return self._batch_bucket(int(slots))

  def update_params(self, params, *, share=None) -> None:
    """Swaps in new weights without recompiling.

    Args:
      params: a model of the same architecture, its `nnx.state` (e.g. a learner's
        `nnx.Param` state) or that state as a pure dict. Leaves are copied to the sampler's
        shardings (resharding when they live on another mesh) and cast to its dtypes; the
        sampler never aliases them, so the caller may donate or delete its own. With
        several processes and a rollout mesh on other devices than the params' (a
        disaggregated multi-host run), `distributed.copy_to` keeps the copy on the
        devices whenever each host with rollout devices also holds train devices.
      share: arrays among `params`' leaves (any pytree of them, e.g. a LoRA model's
        frozen base) the sampler holds as they are, with no copy, where one already
        sits on the sampler's sharding in its dtype: a colocated learner's base weights.
        The caller must not delete them while the sampler holds them (until the next
        update); a step that donates them and hands them back unchanged (the train
        step's passed-through base) must be followed by `reshare`.
    """
    state = nnx.state(params) if isinstance(params, nnx.Module) else params
    shared, held = _ids(share), set()
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    paths = [_param_path(p) for p, _ in flat]
    if paths != self._paths:
      missing = sorted(set(self._paths) - set(paths)) or sorted(set(paths) - set(self._paths))
      raise ValueError(f"params do not match the sampler's model; first differing leaf: "
                       f"{missing[0] if missing else paths[0]}")
    leaves = []
    for path, (_, x), (shape, dtype, sharding) in zip(paths, flat, self._specs):
      if tuple(x.shape) != tuple(shape):
        raise ValueError(f"param {path} has shape {tuple(x.shape)}, expected {tuple(shape)}")
      if _shareable(x, shared, dtype, sharding):
        held.add(len(leaves))
        leaves.append(x)  # held as it is: the caller's
        continue
      x = distributed.copy_to(x, sharding)
      leaves.append(x if x.dtype == dtype else x.astype(dtype))
    self._state = jax.tree.unflatten(self._treedef, leaves)
    self._shared = held
    self.params_version += 1

  def reshare(self, params) -> None:
    """Takes the caller's arrays in place of those the sampler holds uncopied
    (`update_params`' share) that the caller has since donated: a train step that
    donates its state hands the frozen base back unchanged as new arrays (over the same
    buffers or others, as XLA aliases them), and the old ones, deleted, must not be read
    again. The caller vouches that those values are unchanged; the weights (and
    params_version) stay as they are. A held array still alive is kept. Raises
    ValueError when a held array was deleted and `params` holds a deleted one in its
    place (`update_params` with live weights)."""
    if not self._shared:
      return
    state = nnx.state(params) if isinstance(params, nnx.Module) else params
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    if [_param_path(p) for p, _ in flat] != self._paths:
      raise ValueError("params do not match the sampler's model")
    leaves = jax.tree.leaves(self._state)
    for i in self._shared:
      if not leaves[i].is_deleted():
        continue
      x = flat[i][1]
      shape, dtype, sharding = self._specs[i]
      if not (isinstance(x, jax.Array) and not x.is_deleted() and x.shape == shape
              and _shareable(x, {id(x)}, dtype, sharding)):
        raise ValueError(f"the sampler's shared weight {self._paths[i]} was deleted and "
                         "the params given have no live array of its layout in its place; "
                         "call update_params")
      leaves[i] = x
    self._state = jax.tree.unflatten(self._treedef, leaves)

  def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, stop_token_ids: Sequence[int] = (),
               seed: int = 0, keep_cache: bool = False,
               reserve_tokens: int | None = None, slots: int | None = None,
               on_finish: Callable[[int, np.ndarray, np.ndarray, str], Any] | None = None,
               row_offset: int = 0,
               between_rounds: Callable[[np.ndarray], Any] | None = None,
               round_steps: int | None = None,
               max_prompt_len: int | None = None,
               reuse_cache: bool = True) -> Completions:
    """Samples a continuation of every prompt.

    Args:
      prompts: token-id lists (may hold earlier turns and tool observations).
      max_new_tokens: tokens to generate per row at most.
      temperature: softmax temperature; 0 is greedy.
      top_k: keep only the k most likely tokens (static: a new k compiles new programs).
      top_p: nucleus threshold in (0, 1].
      stop_token_ids: a row ends after generating one of these (it is kept).
      seed: the same seed gives the same samples.
      keep_cache: keep the KV cache in `Completions.resume_state`, so `resume` can
        continue the rows that did not stop without prefilling them again.
      reserve_tokens: size the cache for this many new tokens in all (>= max_new_tokens),
        the room later `resume` calls can use.
      slots: continuous batching: at most this many rows decode at once (the cache holds
        `slots` rows), and a row that stops hands its slot to the next waiting prompt
        while the others go on, so short completions never wait for the longest. The
        samples are those of one call over all the prompts (a row's sampling key is its
        prompt's index and its token's). None, or at least as many slots as prompts
        and no `between_rounds`: every row at once (with `between_rounds`, the cache
        holds as many rows as the prompts, rounded up to a bucket, and runs in rounds).
      on_finish: called as `on_finish(i, tokens, logprobs, finish_reason)` for each
        prompt i as its row ends (with `slots`, while others still decode; else after the
        call), e.g. to score it; with record_routing also given the row's
        `routing=` (as `Completions.routing` holds it).
      row_offset: the index of prompts[0] in a longer list of prompts: row i samples
        with that list's key for row_offset + i, so calls over consecutive slices of the
        list draw what one call over all of it draws.
      between_rounds: with continuous batching (`slots` given), called
        as `between_rounds(live)` on the host after each round of decode steps, once its
        finished rows went to `on_finish` and before the next prompts are prefilled;
        `live` holds the indices of the prompts whose rows are still decoding. It may call
        `update_params`: the rows that follow are prefilled under the new weights, and the
        live rows go on under them with the cache their earlier tokens built (their
        log-probs are those of the distribution that drew each token, as importance
        sampling needs). A disaggregated run's rollout thread releases the sampler lock
        here, so the learner's weights land mid-generation. It may return more prompts
        (token-id lists, e.g. a finished row's transcript with a tool's answer: its next
        turn); they are prefilled ahead of the prompts still waiting, take the indices
        after the last prompt so far in the order returned (their sampling keys and
        `on_finish` use those), and each generates at most max_new_tokens, fewer where
        max_len leaves less room. `Completions` then has a row for each.
      round_steps: with continuous batching, at most this many decode steps per round
        (default: a round ends only when an eighth of the slots' rows have ended), so
        `between_rounds` runs at least that often.
      max_prompt_len: with continuous batching, the longest prompt the call may prefill
        (those `between_rounds` returns included; default: the longest of `prompts`),
        which sizes the cache.
      reuse_cache: with continuous batching, a prompt `between_rounds` returns that
        extends a row ended since its slot was last refilled (that row's prompt and its
        tokens but the last, all drawn under the current weights) goes on in that slot:
        only its tokens after them are prefilled, in chunks of at most 512 that attend to
        the cache the row built (a tool's answer after a turn, not the whole transcript
        again). It samples what a prefill of the whole prompt samples (with an int8
        cache, up to its rounding: the earlier keys are read quantized). A returned
        prompt with no such slot (it went to another prompt, or new weights landed
        since) is written into a free slot the same way from its first token, so later
        turns never compile a prefill per transcript length. False: every returned
        prompt is prefilled whole. Stats count the `continued` rows, their
        `reused_tokens`, and the returned prompts `rewritten` from the first token.
    """
    cfg = self.cfg
    mode = sampling_mode(temperature, top_k, top_p, cfg.vocab_size)
    lens = self._check_prompts(prompts)
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens}")
    max_new_tokens = int(max_new_tokens)
    if isinstance(row_offset, bool) or int(row_offset) != row_offset or row_offset < 0:
      raise ValueError(f"row_offset must be a non-negative int, got {row_offset!r}")
    row_offset = int(row_offset)
    longest = int(lens.max())
    if longest + max_new_tokens > self.max_len:
      raise ValueError(f"longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} "
                       f"exceeds max_len={self.max_len}")
    reserve = max_new_tokens if reserve_tokens is None else int(reserve_tokens)
    if reserve < max_new_tokens or longest + reserve > self.max_len:
      raise ValueError(f"reserve_tokens={reserve_tokens} must be at least max_new_tokens="
                       f"{max_new_tokens} and fit max_len={self.max_len} after the longest "
                       f"prompt ({longest} tokens)")
    stop = [int(t) for t in stop_token_ids]
    bad = [t for t in stop if not 0 <= t < cfg.vocab_size]
    if bad:
      raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    stop_ids = np.full(max(4, 1 << max(len(stop) - 1, 0).bit_length()), -1, np.int32)
    stop_ids[:len(stop)] = stop
    if round_steps is not None and (isinstance(round_steps, bool)
                                    or int(round_steps) != round_steps or round_steps < 1):
      raise ValueError(f"round_steps must be a positive int or None, got {round_steps!r}")
    if slots is not None:
      if isinstance(slots, bool) or int(slots) != slots or slots < 1:
        raise ValueError(f"slots must be a positive int or None, got {slots!r}")
      if keep_cache:
        raise ValueError("keep_cache cannot be combined with slots: continuous batching "
                         "reuses a row's cache slot once the row stops")
      # With between_rounds the rows run in rounds even when every prompt has a slot
      # (next turns come back between them).
      if self._batch_bucket(int(slots)) < len(prompts) or between_rounds is not None:
        room = longest if max_prompt_len is None else max_prompt_len
        if (isinstance(room, bool) or int(room) != room or not longest <= room
            or room >= self.max_len):
          raise ValueError(f"max_prompt_len must be an int from the longest prompt "
                           f"({longest}) to max_len - 1 ({self.max_len - 1}), got "
                           f"{max_prompt_len!r}")
        return self._generate_slots(
            prompts, lens, batch=self._batch_bucket(min(int(slots), len(prompts))),
            max_new_tokens=max_new_tokens, mode=mode,
            stop_ids=stop_ids, seed=int(seed % 2**32), temperature=temperature,
            top_p=top_p, on_finish=on_finish, row_offset=row_offset,
            between_rounds=between_rounds, round_steps=round_steps,
            max_prompt_len=int(room), reuse_cache=bool(reuse_cache))

    rows = len(prompts)
    batch = self._batch_bucket(rows)
    cache_len = _bucket(longest + reserve, self.length_buckets, "sequence length")
    # Each distinct prompt is prefilled once; rows gather their cache from `row_source`
    # (padding rows copy prompt 0 and stay inactive).
    tokens, distinct_lens, row_source, group = self._distinct(prompts, lens, batch)
    prefill_rows, prompt_len = tokens.shape

    rowwise = self._rowwise
    seed_value = int(seed % 2**32)
    seed, temp, nucleus = self._sampling_scalars(seed_value, temperature, top_p, mode)
    prompt_lens = rowwise(distinct_lens[row_source])
    active = rowwise(np.arange(batch) < rows)
    row_ids = np.arange(batch, dtype=np.int32) + row_offset
    ids = rowwise(row_ids)

    weights = self._weights()
    prefill_args = (weights, rowwise(tokens), rowwise(distinct_lens), rowwise(row_source),
                    ids, seed, temp, nucleus)
    prefill = self._program(
        ("prefill", prefill_rows, batch, prompt_len, cache_len, mode, group),
        functools.partial(self._prefill, cache_len=cache_len, mode=mode, group=group),
        prefill_args, donate=())
    cache, first, first_logp = prefill(*prefill_args)
    cache, (out_tokens, out_logp, lengths, stopped, steps) = self._run_decode(
        weights, cache, first, first_logp, prompt_lens, active, ids, max_new_tokens,
        stop_ids, seed, temp, nucleus, step0=0, batch=batch, cache_len=cache_len, mode=mode)
    del weights, prefill_args
    routing = None
    if self.record_routing:  # each row's fed tokens: its prompt, then all it drew but the last
      buffer = self._fetch(cache[1])
      ends = distinct_lens[row_source] + np.maximum(lengths - 1, 0)
      routing = [self._experts(buffer[i, :ends[i]]) for i in range(rows)]
      if not keep_cache:
        cache = None
    resume = None
    if keep_cache:
      ends = np.maximum(lengths - 1, 0)
      base = np.asarray(distinct_lens[row_source], np.int64)
      resume = ResumeState(
          cache=cache, rows=rows, batch=batch, cache_len=cache_len,
          positions=base + ends, last=out_tokens[np.arange(batch), ends],
          generated=lengths.astype(np.int64), open=(np.arange(batch) < rows) & ~stopped,
          mode=mode, stop_ids=stop_ids, row_ids=row_ids, seed=seed_value,
          temperature=float(temperature),
          top_p=top_p, params_version=self.params_version)
    out = Completions(tokens=out_tokens[:rows, :max_new_tokens],
                      logprobs=out_logp[:rows, :max_new_tokens],
                      lengths=lengths[:rows],
                      finish_reasons=[FINISH_STOP if s else FINISH_LENGTH
                                      for s in stopped[:rows]],
                      stats=dict(batch=batch, prefill_rows=prefill_rows,
                                 prompt_len=prompt_len, cache_len=cache_len,
                                 steps=int(steps), decode_steps=int(steps) - 1,
                                 decoded=int(np.maximum(lengths[:rows] - 1, 0).sum())),
                      resume_state=resume, routing=routing)
    if on_finish is not None:
      for i in range(rows):
        n = int(out.lengths[i])
        extra = {} if routing is None else {"routing": routing[i]}
        on_finish(i, out.tokens[i, :n], out.logprobs[i, :n], out.finish_reasons[i], **extra)
    return out

  def _generate_slots(self, prompts, lens: np.ndarray, *, batch: int, max_new_tokens: int,
                      mode: SamplingMode, stop_ids: np.ndarray, seed: int,
                      temperature: float, top_p: float | None, on_finish,
                      row_offset: int, between_rounds=None,
                      round_steps: int | None = None,
                      max_prompt_len: int | None = None,
                      reuse_cache: bool = True) -> Completions:
    """`generate` with continuous batching over `batch` cache rows (slots).

    The first `batch` prompts fill every slot in one prefill, laid out as `generate`
    lays out its rows. Then the decode loop runs until `_REFILL_FRACTION` of the slots
    have stopped (every slot once no prompt waits); their rows are handed to `on_finish`
    and the next waiting prompts are prefilled into those slots. A slot lives on one
    device of the batch axes, and a refill gives each device the next prompts for its
    own free slots (padded to the same count), which it prefills and writes itself: no
    device ever holds another's cache rows. A round also ends after `round_steps` decode
    steps; `between_rounds` runs after each, and new weights it swaps in are read from
    the next round on, as are the prompts it returns. Each row generates at most
    max_new_tokens, and no further than max_len. With `reuse_cache`, a returned prompt
    that extends the sequence an ended row's slot still holds goes on in that slot
    (`_extend_slots`) instead of waiting for a refill.
    """
    prompts, lens = list(prompts), np.asarray(lens, np.int32)
    rows = len(prompts)
    devices = self._batch_multiple
    per_device = batch // devices
    room = int(lens.max()) if max_prompt_len is None else int(max_prompt_len)
    cache_len = _bucket(min(room + max_new_tokens, self.max_len), self.length_buckets,
                        "sequence length")
    limit = lambda n: np.minimum(max_new_tokens, self.max_len - n)  # noqa: E731
    limits = limit(lens)  # each prompt's most new tokens
    sampling = self._sampling_scalars(seed, temperature, top_p, mode)
    fixed = (self._put(stop_ids, ()), *sampling)
    weights, version = self._weights(), self.params_version
    refill = _refill_at(batch)
    max_steps = self._scalar(int(round_steps or np.iinfo(np.int32).max), np.int32)
    tokens = np.full((rows, max_new_tokens), self.pad_id, np.int32)
    logprobs = np.zeros((rows, max_new_tokens), np.float32)
    lengths = np.zeros(rows, np.int32)
    stopped_rows = np.zeros(rows, bool)
    routing: list[np.ndarray | None] | None = [None] * rows if self.record_routing else None
    first = min(rows, batch)  # fewer prompts than slots: the others start free
    state, prefilled, longest = self._fill_slots(
        weights, prompts[:first], lens[:first], limits[:first], fixed,
        row_offset=row_offset, batch=batch, cache_len=cache_len, mode=mode)
    slot_row = np.where(np.arange(batch) < first, np.arange(batch), -1)
    waiting = list(range(rows - 1, batch - 1, -1))  # popped from the end: prompt order
    free: list[list[int]] = [[int(s) for s in range(d * per_device, (d + 1) * per_device)
                              if s >= first] for d in range(devices)]  # of each device
    # A freed slot keeps its row's cache until a refill: a next turn may go on there.
    held = _HeldCaches() if reuse_cache and between_rounds is not None else None
    began = np.full(batch, version, np.int64)  # the weights each slot's row began under
    steps = inserts = swaps = continued = reused = rewritten = 0

    def write_on(state, items):
      """`_extend_slots` of items (slot, prompt, tokens cached), under the current
      weights; those prompts' rows then live in their slots."""
      state = self._extend_slots(
          weights, state, prompts, limits, items, fixed, row_offset=row_offset,
          rows=refill_rows(batch, devices) // devices, batch=batch, cache_len=cache_len,
          mode=mode)
      for slot, j, _ in items:
        slot_row[slot], began[slot] = j, version
      return state

    while True:
      # Slots count as done once their row ended (until a refill): the round ends when
      # `refill` more rows end. With nothing waiting every slot runs to its end, unless
      # between_rounds may bring next turns (or waits to let the learner in).
      live = int((slot_row >= 0).sum())
      if waiting:  # every free slot was refilled
        return_at = min(refill, len(waiting))
      elif between_rounds is not None:
        return_at = batch - live + min(refill, live)
      else:
        return_at = batch
      args = (weights, state, *fixed, self._scalar(return_at, np.int32), max_steps)
      decode = self._program(("decode_slots", batch, cache_len, stop_ids.size, mode),
                             functools.partial(self._decode_slots, mode=mode), args,
                             donate=(1,))
      state, ran = decode(*args)
      del args
      done, stopped, gen, ran = self._fetch(
          (state["done"], state["stopped"], state["gen"], ran))
      steps += int(ran)
      ended = np.flatnonzero(done & (slot_row >= 0))
      out_tok, out_logp, out_routing = self._take_rows(state, ended, batch=batch,
                                                       cache_len=cache_len)
      for k, slot in enumerate(ended):
        i, n = int(slot_row[slot]), int(gen[slot])
        tokens[i, :n], logprobs[i, :n] = out_tok[k, :n], out_logp[k, :n]
        lengths[i], stopped_rows[i] = n, bool(stopped[slot])
        if routing is not None:  # the fed tokens: the prompt, then all drawn but the last
          routing[i] = self._experts(out_routing[k, :int(lens[i]) + n - 1])
        slot_row[slot] = -1
        free[slot // per_device].append(int(slot))
        if held is not None:
          held.add(int(slot), np.concatenate([np.asarray(prompts[i], np.int64),
                                              out_tok[k, :n - 1].astype(np.int64)]))
        if on_finish is not None:
          extra = {} if routing is None else {"routing": routing[i]}
          on_finish(i, tokens[i, :n], logprobs[i, :n],
                    FINISH_STOP if stopped_rows[i] else FINISH_LENGTH, **extra)
      if between_rounds is not None:
        more = between_rounds(slot_row[slot_row >= 0].copy())
        if self.params_version != version:  # new weights: every later program reads them
          weights, version, swaps = self._weights(), self.params_version, swaps + 1
        if more:  # next turns: queued ahead of the waiting prompts, in the order given
          more = list(more)
          new_lens = self._check_prompts(more, first=len(prompts))
          if new_lens.max() > room:
            raise ValueError(f"a prompt between_rounds returned holds {new_lens.max()} "
                             f"tokens, more than max_prompt_len={room}")
          start, n = len(prompts), len(more)
          prompts += more
          lens = np.concatenate([lens, new_lens])
          limits = np.concatenate([limits, limit(new_lens)])
          # Rows whose slot still holds the start of their prompt (drawn under the
          # current weights) go on there.
          extend, fresh = [], []
          for j in range(start, start + n):
            found = held is not None and held.match(np.asarray(prompts[j], np.int64),
                                        lambda slot: began[slot] == version)
            if found:
              held.drop(found[0])
              extend.append((found[0], j, found[1]))
            else:
              fresh.append(j)
          waiting += reversed(fresh)
          tokens = np.concatenate([tokens, np.full((n, max_new_tokens), self.pad_id,
                                                   np.int32)])
          logprobs = np.concatenate([logprobs, np.zeros((n, max_new_tokens), np.float32)])
          lengths = np.concatenate([lengths, np.zeros(n, np.int32)])
          stopped_rows = np.concatenate([stopped_rows, np.zeros(n, bool)])
          if routing is not None:
            routing += [None] * n
          if extend:
            state = write_on(state, extend)
            for slot, *_ in extend:
              free[slot // per_device].remove(slot)
            continued, reused = continued + len(extend), reused + sum(c for *_, c in extend)
      if not waiting:
        if (slot_row < 0).all():
          break
        continue
      # Each device takes the next prompts for its free slots, in prompt order: a
      # group's rows land together and share a prefill on their device.
      placed: list[list[tuple[int, int]]] = [[] for _ in range(devices)]
      for d in range(devices):
        while waiting and free[d]:
          placed[d].append((free[d].pop(), waiting.pop()))
      if not any(placed):  # a round cut short by round_steps freed no slot
        continue
      if held is not None:
        # Later turns with no cache to go on from (their slot was refilled, or new
        # weights landed) are written into their slots in chunks too, from position 0:
        # a refill would compile a program for every transcript length bucket.
        chunked = [(slot, i, 0) for pairs in placed for slot, i in pairs if i >= rows]
        if chunked:
          placed = [[(slot, i) for slot, i in pairs if i < rows] for pairs in placed]
          state = write_on(state, chunked)
          for slot, *_ in chunked:
            held.drop(slot)
          rewritten += len(chunked)
        if not any(placed):
          continue
      state, used, bucket = self._refill_slots(
          weights, state, prompts, lens, limits, placed, fixed, row_offset=row_offset,
          min_rows=refill_rows(batch, devices) // devices, batch=batch, cache_len=cache_len,
          mode=mode)
      for pairs in placed:
        for slot, i in pairs:
          slot_row[slot], began[slot] = i, version
          if held is not None:
            held.drop(slot)
      inserts, prefilled, longest = inserts + 1, prefilled + used, max(longest, bucket)
    del state, weights
    return Completions(tokens=tokens, logprobs=logprobs, lengths=lengths,
                       finish_reasons=[FINISH_STOP if s else FINISH_LENGTH
                                       for s in stopped_rows],
                       stats=dict(batch=batch, prefill_rows=prefilled, prompt_len=longest,
                                  cache_len=cache_len, steps=steps + 1, decode_steps=steps,
                                  decoded=int(np.maximum(lengths - 1, 0).sum()),
                                  inserts=inserts, weight_swaps=swaps,
                                  continued=continued, reused_tokens=reused,
                                  rewritten=rewritten),
                       routing=routing)

  def _take_rows(self, state, slots: np.ndarray, *, batch: int, cache_len: int):
    """The generated tokens and log-probs of `slots` ([n, cache_len] each, on the host),
    and with record_routing their routing by position ([n, cache_len, layers x k]; else
    None), copied off the devices for those rows only (the index padded to a power of
    two)."""
    if not slots.size:
      return (np.zeros((0, cache_len), np.int32), np.zeros((0, cache_len), np.float32),
              None)
    index = np.zeros(1 << (slots.size - 1).bit_length(), np.int32)
    index[:slots.size] = slots
    names = ("tokens", "logp") + (("routing",) if self.record_routing else ())
    args = (tuple(state[n] for n in names), self._put(index, ()))
    take = self._program(("take_rows", index.size, batch, cache_len),
                         lambda arrays, idx: tuple(a[idx] for a in arrays), args, donate=())
    out = [x[:slots.size] for x in self._fetch(take(*args))]
    return out[0], out[1], (out[2] if self.record_routing else None)

  def _fill_slots(self, weights, prompts, lens, limits, fixed, *, row_offset: int,
                  batch: int, cache_len: int, mode: SamplingMode):
    """The slot state with the prompts in slots 0, 1, ... (at most `batch`; slots past
    them are empty: done, nothing to generate); returns (state, prefill rows,
    prompt-length bucket)."""
    tokens, distinct_lens, row_source, group = self._distinct(prompts, lens, batch)
    rowwise = self._rowwise
    ids = np.arange(batch, dtype=np.int32) + row_offset
    limit = np.zeros(batch, np.int32)
    limit[:len(prompts)] = limits
    args = (weights, rowwise(tokens), rowwise(distinct_lens), rowwise(row_source),
            rowwise(ids), rowwise(limit), *fixed)
    fill = self._program(
        ("fill", tokens.shape[0], batch, tokens.shape[1], cache_len, mode, group),
        functools.partial(self._fill, cache_len=cache_len, mode=mode, group=group), args,
        donate=())
    return fill(*args), tokens.shape[0], tokens.shape[1]

  def _refill_slots(self, weights, state, prompts, lens, limits, placed, fixed, *,
                    row_offset: int, min_rows: int, batch: int, cache_len: int,
                    mode: SamplingMode):
    """Prefills the prompts `placed[d]` lists ((slot, prompt index) pairs on device d)
    into their slots, prompt i to generate at most limits[i] tokens. Each device
    prefills its distinct prompts once (a GRPO group's rows share one prefill) and
    copies them to its rows. Every device's rows are padded to
    the same count, a power of two and at least `min_rows`, and its distinct prompts to
    a power of two (so few programs compile); padding rows are dropped. Returns (state,
    prefill rows, prompt-length bucket)."""
    devices, per_device = len(placed), batch // len(placed)
    k = min(per_device, 1 << (max(max(map(len, placed)), min_rows) - 1).bit_length())
    sources = []
    for pairs in placed:
      seen: dict[tuple[int, ...], int] = {}
      sources.append([seen.setdefault(tuple(prompts[i]), len(seen)) for _, i in pairs])
    u = min(k, 1 << (max(max(src, default=0) for src in sources)).bit_length())
    prompt_len = _bucket(max(int(lens[i]) for pairs in placed for _, i in pairs),
                         self.length_buckets, "prompt length")
    tokens = np.full((devices * u, prompt_len), self.pad_id, np.int32)
    prompt_lens = np.ones(devices * u, np.int32)
    source = np.zeros(devices * k, np.int32)  # each row's distinct prompt on its device
    local = np.full(devices * k, per_device, np.int32)  # past the device's slots: dropped
    ids = np.zeros(devices * k, np.int32)
    limit = np.ones(devices * k, np.int32)
    for d, (pairs, src) in enumerate(zip(placed, sources)):
      for j, ((slot, i), p) in enumerate(zip(pairs, src)):
        tokens[d * u + p, :lens[i]] = prompts[i]
        prompt_lens[d * u + p] = lens[i]
        source[d * k + j], local[d * k + j] = p, slot - d * per_device
        ids[d * k + j], limit[d * k + j] = row_offset + i, limits[i]
    rowwise = self._rowwise
    args = (weights, state, rowwise(tokens), rowwise(prompt_lens), rowwise(source),
            rowwise(local), rowwise(ids), rowwise(limit), *fixed)
    refill = self._program(("refill", devices * u, devices * k, prompt_len, batch, cache_len,
                            mode), functools.partial(self._refill, mode=mode), args,
                           donate=(1,))
    return refill(*args), devices * u, prompt_len

  def _extend_slots(self, weights, state, prompts, limits, items, fixed, *, row_offset: int,
                    rows: int, batch: int, cache_len: int, mode: SamplingMode):
    """Goes on with prompt j in the slot that holds its first `cached` tokens' cache
    (0: any free slot), for each (slot, j, cached) of `items`: its other tokens are
    written on into the slot's cache and its first new token sampled, as `_refill`
    would after prefilling all of it. Each call takes `rows` slots a device (padded) and
    `_extend_width` tokens of each: a longer remainder goes on in the next call."""
    devices = self._batch_multiple
    per_device = batch // devices
    todo: list[list[list[int]]] = [[] for _ in range(devices)]
    for slot, j, cached in items:
      todo[slot // per_device].append([slot, j, cached])
    rowwise = self._rowwise
    while any(todo):
      now = [t[:rows] for t in todo]
      longest = max(len(prompts[j]) - at for t in now for _, j, at in t)
      width = _extend_width(longest, cache_len, self.extend_chunk)
      n = devices * rows
      tokens = np.full((n, width), self.pad_id, np.int32)
      start, count = np.zeros(n, np.int32), np.ones(n, np.int32)
      local = np.full(n, per_device, np.int32)  # past the device's slots: dropped
      ids, limit, final = np.zeros(n, np.int32), np.ones(n, np.int32), np.zeros(n, bool)
      for d, t in enumerate(now):
        for r, item in enumerate(t):
          slot, j, at = item
          m = min(width, len(prompts[j]) - at)
          x = d * rows + r
          tokens[x, :m] = prompts[j][at:at + m]
          start[x], count[x], local[x] = at, m, slot - d * per_device
          ids[x], limit[x], final[x] = row_offset + j, limits[j], at + m == len(prompts[j])
          item[2] = at + m
      todo = [[item for item in t if item[2] < len(prompts[item[1]])] for t in todo]
      args = (weights, state, rowwise(tokens), rowwise(start), rowwise(count), rowwise(local),
              rowwise(ids), rowwise(limit), rowwise(final), *fixed)
      program = self._program(("extend", n, width, batch, cache_len, mode),
                              functools.partial(self._extend, mode=mode), args, donate=(1,))
      state = program(*args)
    return state

  def _distinct(self, prompts, lens: np.ndarray, batch: int):
    """Each distinct prompt once, for one prefill serving `batch` rows: (tokens [U, L]
    and lengths [U] of the U distinct prompts, padded to their buckets; row_source [batch],
    the distinct prompt of each row (padding rows take prompt 0); group, see `_grouping`)."""
    distinct: dict[tuple[int, ...], int] = {}
    row_source = np.zeros(batch, np.int32)
    row_source[:len(prompts)] = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    prefill_rows = self._batch_bucket(len(distinct))
    prompt_len = _bucket(int(lens.max()), self.length_buckets, "prompt length")
    tokens = np.full((prefill_rows, prompt_len), self.pad_id, np.int32)
    distinct_lens = np.ones(prefill_rows, np.int32)
    for p, i in distinct.items():
      tokens[i, :len(p)] = p
      distinct_lens[i] = len(p)
    return tokens, distinct_lens, row_source, _grouping(row_source[:len(prompts)],
                                                        prefill_rows, batch)

  def compile(self, rows: int, prompt_len: int, max_new_tokens: int, *,
              distinct_prompts: int | None = None, temperature: float = 1.0,
              top_k: int | None = None, top_p: float | None = None,
              num_stop_ids: int = 1, slots: int | None = None,
              max_prompt_len: int | None = None, rounds: bool = False):
    """Compiles, without running, the programs `generate` runs for `rows` prompts
    (`distinct_prompts` of them different, default all: a GRPO group shares one prefill)
    of up to `prompt_len` tokens and `max_new_tokens` new ones; later calls of the same
    shapes reuse them. A sampler of an abstract model (`nnx.eval_shape`) on another
    platform's mesh compiles for those devices.

    Returns:
      (prefill, decode): the compiled programs (`memory_analysis()` says what they need).
      With `slots` fewer than the rows (continuous batching): (fill, decode, refill), the
      prefill of the first `slots` rows, the decode loop over the slots, and a refill
      of the smallest size (its prompts as long as `prompt_len`, or `max_prompt_len`
      for the later turns `generate`'s between_rounds returns; all different). With a
      `max_prompt_len` beyond `prompt_len` also the widest call that continues later
      turns in their slots (`reuse_cache`), as many rows as that refill. `rounds`: the
      programs of a call with `between_rounds`, which runs in rounds over the slots even
      when they outnumber the rows.
    """
    mode = sampling_mode(temperature, top_k, top_p, self.cfg.vocab_size)
    if prompt_len < 1 or max_new_tokens < 1 or prompt_len + max_new_tokens > self.max_len:
      raise ValueError(f"prompt_len={prompt_len} + max_new_tokens={max_new_tokens} must be "
                       f"positive and fit max_len={self.max_len}")
    batch = self._batch_bucket(rows)
    distinct = min(rows, distinct_prompts or rows)
    if slots is not None and (self._batch_bucket(slots) < rows or rounds):
      room = prompt_len if max_prompt_len is None else int(max_prompt_len)
      if not prompt_len <= room < self.max_len:
        raise ValueError(f"max_prompt_len={max_prompt_len} must be from prompt_len="
                         f"{prompt_len} to max_len - 1 ({self.max_len - 1})")
      return self._compile_slots(rows, distinct, prompt_len, max_new_tokens, mode=mode,
                                 batch=self._batch_bucket(min(slots, rows)),
                                 num_stop_ids=num_stop_ids, max_prompt_len=room)
    prefill_rows = self._batch_bucket(distinct)
    # The program `generate` runs for rows that repeat each distinct prompt in turn (a
    # GRPO group's samples side by side, as the rollout worker lays them out).
    group = None
    if rows % distinct == 0:
      group = _grouping(np.repeat(np.arange(distinct), rows // distinct), prefill_rows,
                        batch)
    cache_len = _bucket(prompt_len + max_new_tokens, self.length_buckets, "sequence length")
    prompt_len = _bucket(prompt_len, self.length_buckets, "prompt length")

    def row(dtype, *shape, rows=batch):
      return self._abstract((rows, *shape), dtype, ("batch",) + (None,) * len(shape))

    scalar = lambda dtype: self._abstract((), dtype, ())  # noqa: E731
    stop_ids = 1 << max(num_stop_ids - 1, 0).bit_length()
    weights = self._abstract_weights()
    prefill_args = (weights, row(jnp.int32, prompt_len, rows=prefill_rows),
                    row(jnp.int32, rows=prefill_rows), row(jnp.int32), row(jnp.int32),
                    scalar(jnp.uint32), scalar(jnp.float32), scalar(jnp.float32))
    prefill = self._program(
        ("prefill", prefill_rows, batch, prompt_len, cache_len, mode, group),
        functools.partial(self._prefill, cache_len=cache_len, mode=mode, group=group),
        prefill_args, donate=())
    cache, first, first_logp = prefill.out_info
    decode_args = (weights, cache, first, first_logp, row(jnp.int32), row(jnp.bool_),
                   row(jnp.int32), scalar(jnp.int32),
                   self._abstract((max(4, stop_ids),), jnp.int32, ()), *prefill_args[5:],
                   scalar(jnp.int32))
    decode = self._program(("decode", batch, cache_len, max(4, stop_ids), mode),
                           functools.partial(self._decode, mode=mode, out_len=cache_len),
                           decode_args, donate=(1,))
    return prefill, decode

  def _compile_slots(self, rows: int, distinct: int, prompt_len: int, max_new_tokens: int, *,
                     mode: SamplingMode, batch: int, num_stop_ids: int, max_prompt_len: int):
    """`compile` for continuous batching over `batch` slots."""
    later_turns = max_prompt_len > prompt_len
    per = rows // distinct if rows % distinct == 0 else 1  # rows of a prompt, side by side
    first = min(rows, batch)  # slots past the prompts start empty, as prompt 0's rows
    row_source = np.where(np.arange(batch) < first, np.arange(batch) // per, 0)
    prefill_rows = self._batch_bucket(int(row_source[first - 1]) + 1)
    group = _grouping(row_source[:first], prefill_rows, batch)
    cache_len = _bucket(min(max_prompt_len + max_new_tokens, self.max_len),
                        self.length_buckets, "sequence length")
    refill_len = _bucket(max_prompt_len, self.length_buckets, "prompt length")
    prompt_len = _bucket(prompt_len, self.length_buckets, "prompt length")
    n = refill_rows(batch, self._batch_multiple)

    def row(dtype, *shape, rows=batch):
      return self._abstract((rows, *shape), dtype, ("batch",) + (None,) * len(shape))

    scalar = lambda dtype: self._abstract((), dtype, ())  # noqa: E731
    weights = self._abstract_weights()
    stops = max(4, 1 << max(num_stop_ids - 1, 0).bit_length())
    fixed = (self._abstract((stops,), jnp.int32, ()), scalar(jnp.uint32),
             scalar(jnp.float32), scalar(jnp.float32))
    fill_args = (weights, row(jnp.int32, prompt_len, rows=prefill_rows),
                 row(jnp.int32, rows=prefill_rows), row(jnp.int32), row(jnp.int32),
                 row(jnp.int32), *fixed)
    fill = self._program(
        ("fill", prefill_rows, batch, prompt_len, cache_len, mode, group),
        functools.partial(self._fill, cache_len=cache_len, mode=mode, group=group),
        fill_args, donate=())
    state = fill.out_info
    decode = self._program(("decode_slots", batch, cache_len, stops, mode),
                           functools.partial(self._decode_slots, mode=mode),
                           (weights, state, *fixed, scalar(jnp.int32), scalar(jnp.int32)),
                           donate=(1,))
    # The fullest refill of that size: every row a prompt of its own.
    refill_args = (weights, state, row(jnp.int32, refill_len, rows=n),
                   *(row(jnp.int32, rows=n) for _ in range(5)), *fixed)
    refill_program = self._program(("refill", n, n, refill_len, batch, cache_len, mode),
                                   functools.partial(self._refill, mode=mode), refill_args,
                                   donate=(1,))
    if not later_turns:
      return fill, decode, refill_program
    # Later turns go on in their slots (reuse_cache): the widest chunk they write.
    width = _extend_width(max_prompt_len - 1, cache_len, self.extend_chunk)
    extend_args = (weights, state, row(jnp.int32, width, rows=n),
                   *(row(jnp.int32, rows=n) for _ in range(5)), row(jnp.bool_, rows=n),
                   *fixed)
    extend = self._program(("extend", n, width, batch, cache_len, mode),
                           functools.partial(self._extend, mode=mode), extend_args,
                           donate=(1,))
    return fill, decode, refill_program, extend

  def resume(self, state: ResumeState, rows: Sequence[int], *,
             max_new_tokens: int) -> Completions:
    """Continues a paused generation for some of its rows, from the kept KV cache.

    Args:
      state: `Completions.resume_state` of the call being continued (or of an earlier
        `resume`); the sampler's weights must not have changed since (`update_params`
        invalidates it: prefill the sequences again under the new weights instead).
      rows: indices into the original prompts, each of a row that has not stopped.
      max_new_tokens: tokens to generate per row at most, within the reserved room.

    Returns:
      Completions for `rows`, in that order, with `resume_state` for the next segment.
      Sampling settings are the original call's; when every resumed row has generated as
      many tokens as the others, the samples are those one uninterrupted call would draw.
    """
    if state.cache is None:
      raise ValueError("this generation was already resumed: continue from the "
                       "resume_state that call returned")
    if state.params_version != self.params_version:
      raise ValueError("the sampler's weights changed since this generation paused; "
                       "its KV cache is stale: generate again from the tokens so far")
    rows = [int(r) for r in rows]
    if not rows or any(not 0 <= r < state.rows or not state.open[r] for r in rows):
      raise ValueError(f"rows must be non-empty indices of rows that did not stop, got {rows}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens}")
    max_new_tokens = int(max_new_tokens)
    # Fed tokens fill slots up to positions + max_new_tokens - 1 (the last drawn is not fed).
    room = state.cache_len - int(state.positions[rows].max())
    if max_new_tokens > room:
      raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the {room} tokens left in "
                       f"the reserved cache; pass a larger reserve_tokens to generate")
    batch = state.batch
    active_np = np.zeros(batch, bool)
    active_np[rows] = True
    rowwise = self._rowwise
    mode = state.mode
    # The decode loop treats each row's last token as its step-0 token: it is fed first
    # (its K/V was never written) at position prompt_lens_B, i.e. `positions`.
    cache, (out_tokens, out_logp, lengths, stopped, steps) = self._run_decode(
        self._weights(), state.cache, rowwise(state.last.astype(np.int32)),
        rowwise(np.zeros(batch, np.float32)), rowwise(state.positions.astype(np.int32)),
        rowwise(active_np), rowwise(state.row_ids), max_new_tokens + 1, state.stop_ids,
        *self._sampling_scalars(state.seed, state.temperature, state.top_p, mode),
        step0=int(state.generated[rows[0]]) - 1, batch=batch, cache_len=state.cache_len,
        mode=mode)
    state.cache = None  # donated to the decode program
    new = np.where(active_np, lengths - 1, 0)
    routing = None
    if self.record_routing:  # each row's fed tokens, from its first: up to its last drawn
      buffer = self._fetch(cache[1])
      routing = [self._experts(buffer[r, :int(state.positions[r] + new[r])]) for r in rows]
    ends = np.maximum(lengths - 1, 0)
    last = np.where(active_np & (new > 0), out_tokens[np.arange(batch), ends], state.last)
    nxt = dataclasses.replace(
        state, cache=cache, positions=state.positions + new, last=last,
        generated=state.generated + new, open=active_np & ~stopped)
    idx = np.asarray(rows)
    return Completions(tokens=out_tokens[idx, 1:max_new_tokens + 1],
                       logprobs=out_logp[idx, 1:max_new_tokens + 1], lengths=new[idx],
                       finish_reasons=[FINISH_STOP if s else FINISH_LENGTH
                                       for s in stopped[idx]],
                       stats=dict(batch=batch, prefill_rows=0, prompt_len=0,
                                  cache_len=state.cache_len, steps=int(steps) - 1,
                                  decode_steps=int(steps) - 1, decoded=int(new[idx].sum())),
                       resume_state=nxt, routing=routing)

  def _run_decode(self, weights, cache, first, first_logp, prompt_lens, active, row_ids,
                  max_new_tokens: int, stop_ids: np.ndarray, seed, temp, nucleus, *,
                  step0: int, batch: int, cache_len: int, mode: SamplingMode):
    """Runs the decode program; returns (cache, host outputs)."""
    decode_args = (weights, cache, first, first_logp, prompt_lens, active, row_ids,
                   self._scalar(max_new_tokens, np.int32), self._put(stop_ids, ()), seed,
                   temp, nucleus, self._scalar(step0, np.int32))
    decode = self._program(("decode", batch, cache_len, stop_ids.size, mode),
                           functools.partial(self._decode, mode=mode, out_len=cache_len),
                           decode_args, donate=(1,))
    cache, *outputs = decode(*decode_args)
    return cache, self._fetch(outputs)

  # -- jitted bodies (pure functions of arrays) -------------------------------------------

  def _logits(self, model, h_BxD):
    """[B, V] float32 logits of the last hidden states.

    With the weights left sharded (gather_weights=False), the output projection's D axis
    is split over the batch axes, and XLA gathered all of it onto every device to
    project the batch's rows (1 GiB a device for Llama 3's 128K vocabulary, in prefill
    and again in every decode step). Splitting the rows' D the same way instead, each
    device projects every row through its own slice of D and the partial logits are
    summed and scattered back by row: [B, V] float32 a device, never [D, V]."""
    dt = jnp.dtype(self.cfg.dtype)
    h_BxD, w_DxV = h_BxD.astype(dt), model.unembed().astype(dt)
    split = self.mesh is not None and not self.gather_weights and self._batch_multiple > 1
    if split:
      d_axes = self._ctx.sharding(("embed", "vocab"), w_DxV.shape).spec[0]
      h_BxD = jax.lax.with_sharding_constraint(
          h_BxD, NamedSharding(self.mesh, PartitionSpec(None, d_axes)))
    logits = jnp.einsum("BD,DV->BV", h_BxD, w_DxV, preferred_element_type=jnp.float32)
    if self.cfg.lm_head_bias:
      logits = logits + model.unembed_bias().astype(jnp.float32)[None]
    logits = models.soft_cap(logits, self.cfg.final_logit_softcap)
    return self._ctx.constrain(logits, ("batch", "vocab")) if split else logits

  def _init_cache(self, rows: int, length: int):
    """A zeroed cache of `rows` rows of `length` positions (sliding layers' rings sized
    for `extend_chunk`)."""
    return models.init_cache(self.cfg, rows, length,
                             jnp.int8 if self.cache_dtype == "int8" else None,
                             write_tokens=self.extend_chunk)

  def _prompt_cache(self, model, tokens_UxL, prompt_lens_U):
    """Runs the U prompts (right-padded to L) through the model: their cache of L slots,
    the float32 logits [U, V] after each prompt's last token, and with record_routing
    the experts each token took ([U, L, layers, k] as `_routing` holds them; else None)."""
    distinct, length = tokens_UxL.shape
    cache = constrain_cache(self._init_cache(distinct, length), self._ctx)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (distinct, length))
    segment_ids = (positions < prompt_lens_U[:, None]).astype(jnp.int32)
    out = model.hidden_states(tokens_UxL, positions, segment_ids, cache=cache, ctx=self._ctx,
                              prefill=True, return_routing=self.record_routing)
    h, cache = out[:2]
    h_last = jnp.take_along_axis(h, (prompt_lens_U - 1)[:, None, None], axis=1)[:, 0]
    return cache, self._logits(model, h_last), self._routing(out[2] if len(out) > 2 else None)

  def _routing(self, experts):
    """Recorded experts [B, T, layers, k] as the sampler holds them: [B, T, layers x k]
    (`_ROUTING_NAMES`), `routing_dtype` (uint8 for up to 256 experts), rows over the
    batch axes."""
    if experts is None:
      return None
    experts = experts.reshape(*experts.shape[:2], -1).astype(routing_dtype(self.cfg))
    return self._ctx.constrain(experts, _ROUTING_NAMES)

  def _experts(self, held: np.ndarray) -> np.ndarray:
    """A row's record as the sampler holds it [T, layers x k], as Completions gives it:
    [T, layers, k]."""
    return held.reshape(held.shape[0], self.cfg.mixture_layers, self.cfg.num_experts_per_tok)

  def _write_routing(self, buffer, experts_BxTxMxK, positions_BxT, written_BxT):
    """buffer [B, S, layers x k] with each row's experts written at their positions, where
    `written_BxT` (elsewhere left as it was). A scatter per row (vmapped: the rows are a
    batching dimension, which XLA partitions with the rows; one scatter indexed by
    [row, position] made it gather every device's rows of the buffer, each step)."""
    at = jnp.where(written_BxT, positions_BxT, buffer.shape[1])  # past the end: dropped
    write = lambda row, experts, at: row.at[at].set(experts, mode="drop")  # noqa: E731
    return self._ctx.constrain(jax.vmap(write)(buffer, self._routing(experts_BxTxMxK), at),
                               _ROUTING_NAMES)

  def _prefill(self, state, tokens_UxL, prompt_lens_U, row_source_B, row_ids_B, seed,
               temperature, top_p, *, cache_len: int, mode: SamplingMode,
               group: int | None = None):
    """Prefills the U distinct prompts, gives each of the B rows its prompt's cache.

    The prompts fill a cache of their own length L; each row gathers its prompt's and
    extends it to cache_len (as `models.init_cache` would have it). Gathering the full
    cache_len cache instead made XLA replicate U rows of it on every device of the batch
    axes: 7.9 GiB a device for a 7B model's 64 prompts at 9,216 slots. With `group`
    (`_grouping`: row b's prompt is b // group) rows repeat their prompts' caches in
    place, which leaves each device's rows on the device of their prompts: a gather by
    row_source would copy the L-long cache of all U prompts to every device of the
    batch axes (0.88 GiB a device for that 7B model). `row_ids_B`: each row's index
    among the prompts, for its sampling key."""
    cache, tokens, logp, routing = self._prefill_rows(
        state, tokens_UxL, prompt_lens_U, row_source_B, row_ids_B, seed, temperature, top_p,
        cache_len=cache_len, mode=mode, group=group)
    return ((cache, routing) if self.record_routing else cache), tokens, logp

  def _prefill_rows(self, state, tokens_UxL, prompt_lens_U, row_source_B, row_ids_B, seed,
                    temperature, top_p, *, cache_len: int, mode: SamplingMode,
                    group: int | None = None):
    """`_prefill`'s (cache, first tokens, their log-probs, and with record_routing each
    row's routing [B, cache_len, layers, k] by position, else None)."""
    model = nnx.merge(self._graphdef, state)
    constrain = functools.partial(constrain_cache, ctx=self._ctx)
    cache, logits, routing = self._prompt_cache(model, tokens_UxL, prompt_lens_U)
    if group is None:
      take = lambda x: x[row_source_B]  # noqa: E731
    else:
      take = lambda x: jnp.repeat(x, group, axis=0)  # noqa: E731
    logits = take(logits)
    target = jax.eval_shape(lambda: self._init_cache(1, cache_len))

    def extend(x, slots, fill):  # [B, kv_heads, L(, head_dim)] -> [B, kv_heads, slots(, ...)]
      rows = take(x)
      if rows.shape[2] == slots:  # A sliding layer's ring, whole already.
        return rows
      tail = jnp.full((*rows.shape[:2], slots - rows.shape[2], *rows.shape[3:]), fill,
                      rows.dtype)
      return jnp.concatenate([rows, tail], axis=2)

    def extend_unit(unit, want):
      if isinstance(unit, LinearCache):  # a linear layer's state: its rows, no slots
        return LinearCache(*(jax.lax.map(take, a) if unit.state.ndim == 5 else take(a)
                             for a in unit))

      def extend_layer(layer):  # an int8 cache's scales (fields 2, 3) start at one
        return KVCache(*(None if x is None else extend(x, want.k.shape[-2], int(i >= 2))
                         for i, x in enumerate(layer)))
      if unit.k.ndim == 5:
        # Layers stacked (scan_layers): one layer at a time, into the stacked result. All
        # at once, XLA materialised every layer's taken rows (2 GiB a device for an 8B
        # model's 1,024 rows of 1,024 slots) where one layer's are enough.
        return jax.lax.map(extend_layer, unit)
      return extend_layer(unit)

    cache = map_cache_units(extend_unit, cache, target)
    cache = constrain(cache)
    if routing is not None:  # each row its prompt's, the slots after it zero
      routing = take(routing)
      routing = self._ctx.constrain(
          jnp.pad(routing, ((0, 0), (0, cache_len - routing.shape[1]), (0, 0))), _ROUTING_NAMES)
    keys = _row_keys(seed, 0, row_ids_B)
    tokens, logp = sample_logits(logits, keys, temperature, top_p, mode)
    return cache, tokens, logp, routing

  def _fill(self, weights, tokens_UxL, prompt_lens_U, row_source_B, row_ids_B, limit_B,
            stop_ids, seed, temperature, top_p, *, cache_len: int,
            mode: SamplingMode, group: int | None):
    """The slot state of `generate`'s first prefill: row b holds its prompt's cache and
    first token at its prompt's length, and generates at most limit_B[b] tokens."""
    cache, first, logp, routing = self._prefill_rows(
        weights, tokens_UxL, prompt_lens_U, row_source_B, row_ids_B, seed, temperature,
        top_p, cache_len=cache_len, mode=mode, group=group)
    stopped = jnp.any(first[:, None] == stop_ids[None, :], axis=-1)
    head = jnp.arange(cache_len)[None, :] == 0
    row = lambda x: self._ctx.constrain(x, ("batch",) + (None,) * (x.ndim - 1))  # noqa: E731
    return dict(
        cache=cache, last=row(first), pos=row(prompt_lens_U[row_source_B]),
        gen=row(jnp.ones_like(first)), ids=row(row_ids_B), limit=row(limit_B),
        done=row(stopped | (limit_B <= 1)), stopped=row(stopped),
        tokens=row(jnp.where(head, first[:, None], self.pad_id)),
        logp=row(jnp.where(head, logp[:, None], 0.0)),
        **({} if routing is None else {"routing": routing}))

  def _refill(self, weights, slots, tokens_UxL, prompt_lens_U, source_N, local_N, row_ids_N,
              limit_N, stop_ids, seed, temperature, top_p, *, mode: SamplingMode):
    """Prefills the U distinct prompts (u = U / devices on each device) and writes N new
    rows into their slots: row d*k + j (k = N / devices) takes distinct prompt
    source_N[d*k + j] of device d and goes to slot local_N[d*k + j] of device d's block
    of the slots, all on device d. A row's cache is written over its prompt's slots
    only; the slots after it keep the previous row's (finite) keys, which decode
    attention masks by length and overwrites as the new row grows."""
    model = nnx.merge(self._graphdef, weights)
    cache, logits, routing = self._prompt_cache(model, tokens_UxL, prompt_lens_U)
    logits = self._local_take(logits, source_N, ("batch", None))
    first, logp = sample_logits(logits, _row_keys(seed, 0, row_ids_N), temperature, top_p,
                                mode)
    out = dict(self._new_rows(slots, first, logp, stop_ids, local_N=local_N,
                              pos=self._local_take(prompt_lens_U, source_N, ("batch",)),
                              ids=row_ids_N, limit=limit_N),
               cache=self._put_cache(slots["cache"], cache, local_N=local_N,
                                     source_N=source_N))
    if routing is not None:  # each new row its prompt's, over its slot's whole row
      old = slots["routing"]
      routing = jnp.pad(routing, ((0, 0), (0, old.shape[1] - routing.shape[1]), (0, 0)))
      out["routing"] = self._local_put(old, routing, _ROUTING_NAMES, local_N=local_N,
                                       source_N=source_N)
    return out

  def _put_cache(self, old, new, *, local_N, source_N=None):
    """`_local_put` of every cache array (a layer list, or stacks of layers): with
    `source_N` a prompt cache's first slots into the rows' slots (a sliding layer's ring,
    when the prompt filled it, whole), else whole rows."""

    def put_layer(old_layer, new_layer):
      linear = isinstance(old_layer, LinearCache)  # whole rows: it has no slots
      lead = (old_layer.state.ndim if linear else old_layer.k.ndim) - 4  # 1 if stacked
      return type(old_layer)(*(None if o is None else self._local_put(
          o, n, axes, local_N=local_N, axis=lead, source_N=source_N,
          length=None if source_N is None or linear else n.shape[lead + 2])
          for o, n, axes in zip(old_layer, new_layer, cache_unit_axes(old_layer))))

    return map_cache_units(put_layer, old, new)

  def _new_rows(self, slots, first, logp, stop_ids, *, local_N, pos, ids, limit):
    """The slots' state (but the cache) with N new rows written into slots local_N (as
    `_local_put` places them; past a device's block: dropped): each has sampled `first`
    (log-prob `logp`) at position `pos` and generates at most `limit` tokens."""
    stopped = jnp.any(first[:, None] == stop_ids[None, :], axis=-1)
    head = jnp.arange(slots["tokens"].shape[1])[None, :] == 0
    row = lambda name, x: self._local_put(  # noqa: E731
        slots[name], x, ("batch",) + (None,) * (x.ndim - 1), local_N=local_N)
    return dict(
        last=row("last", first), pos=row("pos", pos), gen=row("gen", jnp.ones_like(first)),
        ids=row("ids", ids), limit=row("limit", limit),
        done=row("done", stopped | (limit <= 1)), stopped=row("stopped", stopped),
        tokens=row("tokens", jnp.where(head, first[:, None], self.pad_id)),
        logp=row("logp", jnp.where(head, logp[:, None], 0.0)))

  def _extend(self, weights, slots, tokens_NxC, start_N, count_N, local_N, row_ids_N,
              limit_N, final_N, stop_ids, seed, temperature, top_p, *, mode: SamplingMode):
    """Runs count_N[r] tokens of row r (of tokens_NxC, from position start_N[r]) against
    the cache of slot local_N[r] of its device's block (as `_refill` places rows), and
    writes their keys and values there. Rows with final_N set (their prompt's last
    token is among them) become live: their first token is sampled with their prompt's
    key. Padding tokens after a row's count write keys past its length, which decode
    attention masks and the row overwrites as it grows."""
    model = nnx.merge(self._graphdef, weights)
    old = slots["cache"]

    def take_layer(layer):  # one layer's [B, ...] arrays
      return type(layer)(*(None if x is None else self._local_take(x, local_N, axes)
                           for x, axes in zip(layer, cache_unit_axes(layer))))

    def stacked(unit):
      return (unit.state if isinstance(unit, LinearCache) else unit.k).ndim == 5

    # Layers stacked (scan_layers): taken one layer at a time into the stacked copy. All
    # at once along the rows' axis, the program needed 2.91 GiB of temporaries a device
    # against 1.36 GiB (an 8B model's 16 of 128 slots of 2,048 on a v5e-8).
    cache = constrain_cache(map_cache_units(
        lambda unit: jax.lax.map(take_layer, unit) if stacked(unit) else take_layer(unit),
        old), self._ctx)
    width = tokens_NxC.shape[1]
    positions = start_N[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
    fed = jnp.arange(width)[None, :] < count_N[:, None]
    out = model.hidden_states(tokens_NxC, positions, self._fed(fed), cache=cache,
                              ctx=self._ctx, return_routing=self.record_routing)
    h, cache = out[:2]
    h_last = jnp.take_along_axis(h, (count_N - 1)[:, None, None], axis=1)[:, 0]
    first, logp = sample_logits(self._logits(model, h_last), _row_keys(seed, 0, row_ids_N),
                                temperature, top_p, mode)
    # Rows whose prompt goes on in a later call leave the slot's state as it is.
    live_at = jnp.where(final_N, local_N, slots["last"].shape[0] // self._batch_multiple)
    new = dict(self._new_rows(slots, first, logp, stop_ids, local_N=live_at,
                              pos=start_N + count_N, ids=row_ids_N, limit=limit_N),
               cache=self._put_cache(old, cache, local_N=local_N))
    if self.record_routing:  # the fed tokens' experts, at their positions in the slot's row
      rows = self._local_take(slots["routing"], local_N, _ROUTING_NAMES)
      rows = self._write_routing(rows, out[2], positions, fed)
      new["routing"] = self._local_put(slots["routing"], rows, _ROUTING_NAMES,
                                       local_N=local_N)
    return new

  def _fed(self, fed_BxT):
    """The segment ids of a cached call's tokens: with linear mixers (linear-attention
    layers, or Falcon-H1's beside the attention), 0 for the tokens a row does not feed
    (padding after its count, a finished row's step), which leave its recurrent state as
    it is; None (all fed) otherwise, where attention masks by position alone."""
    if not self.cfg.linear_mixers:
      return None
    return fed_BxT.astype(jnp.int32)

  def _local_take(self, x, source_N, names: tuple):
    """Rows of x ([U, ...], u a device) for N rows (k a device): row d*k + j is row
    source_N[d*k + j] of device d's block of x, taken on device d (an index past the
    block takes its last row)."""
    take = lambda a, src: jnp.take(a, src, axis=0, mode="clip")  # noqa: E731
    if self.mesh is None or self._batch_multiple == 1:
      return take(x, source_N)
    spec = self._ctx.sharding(names, x.shape).spec
    out_spec = self._ctx.sharding(names, (source_N.shape[0],) + x.shape[1:]).spec
    index_spec = self._ctx.sharding(("batch",), source_N.shape).spec
    return jax.shard_map(take, mesh=self.mesh, in_specs=(spec, index_spec),
                         out_specs=out_spec, check_vma=False)(
        self._ctx.constrain(x, names), source_N)

  def _local_put(self, old, new, names: tuple, *, local_N, axis: int = 0,
                 length: int | None = None, source_N=None):
    """Writes rows of new (along `axis`) into old's: row d*k + j (or with `source_N`,
    row source_N[d*k + j] of device d's block of new) into row local_N[d*k + j] of device
    d's block of old (indices past the block are dropped), and with `length` only old's
    first `length` cache slots. Under a mesh each device takes and writes its own rows
    (`shard_map`): no device sees another's rows, whatever slots are free."""
    new = new.astype(old.dtype)

    def scatter(o, n, idx, src=None):
      if src is not None:
        n = jnp.take(n, src, axis=axis)
      index = (slice(None),) * axis + (idx,)
      if length is not None:
        index += (slice(None), slice(0, length))
      return o.at[index].set(n, mode="drop")

    args = (old, new, local_N) + (() if source_N is None else (source_N,))
    if self.mesh is None or self._batch_multiple == 1:
      return scatter(*args)
    spec = self._ctx.sharding(names, old.shape).spec
    new_spec = self._ctx.sharding(names, new.shape).spec
    if length is not None and (tuple(spec)[axis + 2:axis + 3] != (None,)
                               or tuple(new_spec)[axis + 2:axis + 3] != (None,)):
      raise ValueError("continuous batching needs the cache_length axis unsharded; the "
                       f"rules shard it as {spec}")
    index_spec = self._ctx.sharding(("batch",), local_N.shape).spec
    return jax.shard_map(scatter, mesh=self.mesh,
                         in_specs=(spec, new_spec) + (index_spec,) * (len(args) - 2),
                         out_specs=spec, check_vma=False)(
        self._ctx.constrain(old, names), self._ctx.constrain(new, names), *args[2:])

  def _decode_slots(self, state, slots, stop_ids, seed, temperature, top_p, return_at,
                    max_steps, *, mode: SamplingMode):
    """Decodes every live slot row until `return_at` rows are done (empty rows count),
    none is live or `max_steps` steps ran; returns (slots, steps run). Each row feeds its
    last token at its own position and samples with its prompt's key at its own token
    index."""
    model = nnx.merge(self._graphdef, state)
    width = slots["tokens"].shape[1]
    columns = jnp.arange(width)[None, :]

    def cond(carry):
      done = carry[0]["done"]
      return (jnp.any(~done) & (jnp.sum(done.astype(jnp.int32)) < return_at)
              & (carry[1] < max_steps))

    def body(carry):
      st, steps = carry
      live = ~st["done"]
      out = model.hidden_states(st["last"][:, None], st["pos"][:, None],
                                self._fed(live[:, None]), cache=st["cache"], ctx=self._ctx,
                                return_routing=self.record_routing)
      h, cache = out[:2]
      if self.record_routing:
        st = dict(st, routing=self._write_routing(st["routing"], out[2], st["pos"][:, None],
                                                  live[:, None]))
      keys = _row_keys(seed, st["gen"], st["ids"])
      tok, logp = sample_logits(self._logits(model, h[:, 0]), keys, temperature, top_p, mode)
      here = live[:, None] & (columns == st["gen"][:, None])
      gen = st["gen"] + live.astype(jnp.int32)
      stopped = st["stopped"] | (live & jnp.any(tok[:, None] == stop_ids[None, :], axis=-1))
      return dict(
          st, cache=cache, last=jnp.where(live, tok, st["last"]),
          pos=st["pos"] + live.astype(jnp.int32), gen=gen, stopped=stopped,
          done=st["done"] | stopped | (gen >= st["limit"]),
          tokens=jnp.where(here, tok[:, None], st["tokens"]),
          logp=jnp.where(here, logp[:, None], st["logp"])), steps + 1

    return jax.lax.while_loop(cond, body, (slots, jnp.int32(0)))

  def _decode(self, state, cache, first_B, first_logp_B, prompt_lens_B, active_B, row_ids_B,
              max_new_tokens, stop_ids, seed, temperature, top_p, step0, *,
              mode: SamplingMode, out_len: int):
    model = nnx.merge(self._graphdef, state)
    batch = first_B.shape[0]

    def is_stop(tok_B):
      return jnp.any(tok_B[:, None] == stop_ids[None, :], axis=-1)

    out_tokens = jnp.full((batch, out_len), self.pad_id, jnp.int32)
    out_tokens = out_tokens.at[:, 0].set(jnp.where(active_B, first_B, self.pad_id))
    out_logp = jnp.zeros((batch, out_len), jnp.float32)
    out_logp = out_logp.at[:, 0].set(jnp.where(active_B, first_logp_B, 0.0))
    stopped = active_B & is_stop(first_B)
    done = ~active_B | stopped | (max_new_tokens <= 1)
    lengths = active_B.astype(jnp.int32)

    def cond(carry):
      step, done = carry[1], carry[6]
      return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
      cache, step, last_B, out_tokens, out_logp, lengths, done, stopped = carry
      positions = (prompt_lens_B + step - 1)[:, None]  # Position of `last`.
      if self.record_routing:
        cache, routing = cache
      out = model.hidden_states(last_B[:, None], positions, self._fed(~done[:, None]),
                                cache=cache, ctx=self._ctx,
                                return_routing=self.record_routing)
      h, cache = out[:2]
      if self.record_routing:
        cache = (cache, self._write_routing(routing, out[2], positions, ~done[:, None]))
      keys = _row_keys(seed, step + step0, row_ids_B)
      tok, logp = sample_logits(self._logits(model, h[:, 0]), keys, temperature, top_p, mode)
      tok = jnp.where(done, self.pad_id, tok)
      logp = jnp.where(done, 0.0, logp)
      out_tokens = jax.lax.dynamic_update_slice_in_dim(out_tokens, tok[:, None], step, 1)
      out_logp = jax.lax.dynamic_update_slice_in_dim(out_logp, logp[:, None], step, 1)
      lengths = lengths + (~done).astype(jnp.int32)
      stopped = stopped | (~done & is_stop(tok))
      done = done | stopped | (step + 1 >= max_new_tokens)
      return cache, step + 1, tok, out_tokens, out_logp, lengths, done, stopped

    carry = (cache, jnp.int32(1), first_B, out_tokens, out_logp, lengths, done, stopped)
    cache, steps, _, out_tokens, out_logp, lengths, _, stopped = jax.lax.while_loop(
        cond, body, carry)
    return cache, out_tokens, out_logp, lengths, stopped, steps

  # -- helpers ----------------------------------------------------------------------------

  def _program(self, key: tuple, fn, args, donate: tuple[int, ...], out_shardings=None):
    """The compiled program for `key`, lowered and compiled ahead of time on first use."""
    if key not in self._programs:
      jitted = (jax.jit(fn, donate_argnums=donate) if out_shardings is None else
                jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings))
      self._programs[key] = jitted.lower(*args).compile()
    return self._programs[key]

  def _without_batch_axes(self, sharding, kept_axis: int | None = None):
    """`sharding` with the mesh axes the batch spreads over (data, fsdp) removed, but
    from dimension `kept_axis` (an expert-parallel leaf's E)."""
    batch_axes = set(dict(self.rules).get("batch", ()))
    return NamedSharding(sharding.mesh, PartitionSpec(*(
        e if i == kept_axis else without_axes(e, batch_axes)
        for i, e in enumerate(sharding.spec))))

  @staticmethod
  def _expert_leaf(path: str) -> str:
    """The name of a mixture layer's expert leaf (gate_proj, up_proj, down_proj, one of
    their biases or LoRA adapters; a quantized one's codes or scales) at `path`, or ""
    (a shared expert's, a leading dense layer's, or any other leaf)."""
    path = path.removesuffix(".values").removesuffix(".scales")
    leaf = path.rsplit("'", 2)[-2] if path.endswith("']") else ""
    if (leaf not in _EXPERT_LEAF_RANKS
        or not path.startswith(("['layers']", "['linear_layers']", "['moe_layers']"))
        or not path.endswith(f"['mlp']['{leaf}']")):
      return ""
    return leaf

  @classmethod
  def _expert_axis(cls, path: str, ndim: int) -> int | None:
    """The E dimension of a mixture's expert leaf (a layer's or a stack's), else None."""
    leaf = cls._expert_leaf(path)
    return ndim - _EXPERT_LEAF_RANKS[leaf] if leaf else None

  def _weights(self):
    """The weights prefill and decode read: the sampler's own, or (gather_weights) a
    copy gathered over the batch axes in the compute dtype, made once per call."""
    if not self.gather_weights:
      return self._state
    return self._gather_program()(self._state)

  def _expert_padding(self) -> dict[int, list[tuple[int, int, int, int]]]:
    """{leaf index: [(axis, shards, width, padded)]} for a mixture's experts where an
    axis the grouped matmuls keep minor has a width on a device, `width`, that is no
    multiple of 128: the gathered copy pads each device's slice with zeros to `padded`.
    That axis is F for the gate and up experts (and their biases), F and D for the down
    experts (whose output `expert_mlps` cuts back to D). Unpadded, XLA:TPU laid the
    gathered experts out with the other axis minor (less tile padding) and kept a
    relaid copy through the decode loop for the grouped matmuls: for gpt-oss-20b (F 1440
    a device, D 2880 on a v5p-64) 12 GiB a chip for gate and up, 6 GiB for down. The
    zeros change nothing: gate and up of zero give an activation of zero (SwiGLU,
    gpt-oss's clamped one), and the down projection's zero rows and columns add
    nothing to the kept outputs."""
    cfg = self.cfg
    if not cfg.num_experts or cfg.base_quantization:
      # A quantized base's experts (QLoRA) are codes with their scales: kept as they are.
      return {}

    def split(name: str, size: int) -> tuple[int, int, int]:
      """(shards, width a device, padded) of a logical axis in the gathered copy."""
      entry = self._without_batch_axes(self._ctx.sharding((name,), (size,))).spec[0]
      names = () if entry is None else (entry,) if isinstance(entry, str) else entry
      shards = math.prod(self.mesh.shape[a] for a in names)
      return shards, size // shards, -(-(size // shards) // 128) * 128

    f_shards, f_width, f_padded = split("mlp", cfg.ffn_dim)
    # The experts' D: the model's, or the latent they run in (moe_latent_dim).
    d_shards, d_width, d_padded = split("embed", cfg.moe_latent_dim or cfg.d_model)
    out = {}
    for i, path in enumerate(self._paths):
      leaf = self._expert_leaf(path)
      if not leaf:
        continue
      ndim = len(self._specs[i][0])
      pads = []
      # Their LoRA adapters pad alike where they meet F or D: gate and up's B and down's
      # A over F, down's B over D.
      if leaf in ("gate_proj", "up_proj", "gate_bias", "up_bias", "experts_gate_up_proj_lora_b",
                  "experts_up_proj_lora_b", "experts_down_proj_lora_a") and (
                      f_padded != f_width):
        pads.append((ndim - 1, f_shards, f_width, f_padded))
      elif leaf == "experts_down_proj_lora_b" and d_padded != d_width:
        pads.append((ndim - 1, d_shards, d_width, d_padded))
      elif leaf == "down_proj":
        if f_padded != f_width:
          pads.append((ndim - 2, f_shards, f_width, f_padded))
        if d_padded != d_width:
          pads.append((ndim - 1, d_shards, d_width, d_padded))
      if pads:
        out[i] = pads
    return out

  def _gather_program(self):
    """The program that makes `_weights`' gathered copy (compiled once)."""
    dtypes = [dtype for _, dtype, _ in self._weight_specs]
    shardings = jax.tree.unflatten(
        self._treedef, [sharding for _, _, sharding in self._weight_specs])

    def pad(x, axis, shards, width, padded):  # each device's slice of `axis` to `padded`
      x = x.reshape(x.shape[:axis] + (shards, width) + x.shape[axis + 1:])
      widths = [(0, 0)] * x.ndim
      widths[axis + 1] = (0, padded - width)
      x = jnp.pad(x, widths)
      return x.reshape(x.shape[:axis] + (shards * padded,) + x.shape[axis + 2:])

    def gather(state):
      leaves = [x.astype(d) for x, d in zip(jax.tree.leaves(state), dtypes)]
      for i, pads in self._expert_pad.items():
        for how in pads:
          leaves[i] = pad(leaves[i], *how)
      return jax.tree.unflatten(self._treedef, leaves)

    return self._program(("weights",), gather, (self._state,), donate=(),
                         out_shardings=shardings)

  def _fetch(self, outputs):
    """Device outputs to host numpy (gathered from every process's devices)."""
    if jax.process_count() > 1:  # Rows live on every host's devices: gather them here.
      from jax.experimental import multihost_utils
      outputs = multihost_utils.process_allgather(outputs, tiled=True)
    return jax.device_get(outputs)

  def _abstract_weights(self):
    """The weights the programs read, as abstract arrays (compiling the gather first)."""
    if self.gather_weights:
      self._gather_program()
    return jax.tree.unflatten(self._treedef, [
        jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        for shape, dtype, sharding in self._weight_specs])

  def _rowwise(self, x: np.ndarray):
    return self._put(x, ("batch",) + (None,) * (x.ndim - 1))

  def _scalar(self, x, dtype):
    return self._put(np.asarray(x, dtype), ())

  def _sampling_scalars(self, seed: int, temperature: float, top_p: float | None,
                        mode: SamplingMode):
    """(seed, temperature, top-p threshold) as the device scalars the programs take."""
    return (self._scalar(np.uint32(seed), np.uint32),
            self._scalar(temperature if not mode.greedy else 1.0, np.float32),
            self._scalar(top_p if mode.top_p else 1.0, np.float32))

  def _abstract(self, shape: tuple, dtype, names: tuple) -> jax.ShapeDtypeStruct:
    """What `_put` would place, as an abstract array (for compiling only)."""
    sharding = None if self.mesh is None else self._ctx.sharding(names, shape)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  def _put(self, x: np.ndarray, names: tuple):
    if self.mesh is None:
      return jax.device_put(x)
    return distributed.put(x, self._ctx.sharding(names, x.shape))

  def _batch_bucket(self, rows: int) -> int:
    batch = _bucket(rows, self.batch_buckets, "batch of prompts")
    return -(-batch // self._batch_multiple) * self._batch_multiple

  def _batch_shards(self) -> int:
    if self.mesh is None:
      return 1
    axes = dict(self.rules).get("batch", ())
    return int(np.prod([self.mesh.shape.get(a, 1) for a in axes]))

  def _check_buckets(self, buckets, name: str) -> tuple[int, ...]:
    if buckets is None:
      return _powers_of_two(1, 2**20)
    out = tuple(sorted(int(b) for b in buckets))
    if not out or out[0] < 1:
      raise ValueError(f"{name} must be positive ints, got {tuple(buckets)}")
    return out

  def _check_prompts(self, prompts, first: int = 0) -> np.ndarray:
    """Each prompt's length; a clear error for a bad one (numbered from `first`)."""
    if isinstance(prompts, (str, bytes)) or not len(prompts):
      raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r}")
    lens = []
    vocab = self.cfg.vocab_size
    for i, p in enumerate(prompts, first):
      if isinstance(p, (int, np.integer)) or not len(p):
        raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r}")
      arr = np.asarray(p)
      if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"prompt {i} must be a flat list of int token ids, got {p!r}")
      if arr.min() < 0 or arr.max() >= vocab:
        bad = int(arr[(arr < 0) | (arr >= vocab)][0])
        raise ValueError(f"prompt {i} holds token id {bad}, outside the vocabulary [0, {vocab})")
      lens.append(arr.size)
    return np.asarray(lens, np.int32)
