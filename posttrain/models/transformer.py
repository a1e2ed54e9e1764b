"""Decoder-only transformer for the Llama 3 / Mistral / Ministral 3 / Qwen2.5 / Qwen3 /
Qwen3.5 (Gated DeltaNet layers) / Gemma / Gemma 2 / Gemma 3 / OLMo / Phi-3 / SmolLM3 /
Seed-OSS / EXAONE 4 / ERNIE 4.5 / GLM-4 / Granite (Granite 4-H and Bamba: Mamba2 layers) /
LFM2 (short convolutions) families and the mixtures of experts Qwen3-MoE / Qwen3.5-MoE /
Qwen3-Next / Qwen2-MoE / OLMoE / ERNIE 4.5 / Mixtral / gpt-oss / GLM-4.5 / DeepSeek-V2 / V3
(multi-head latent attention) (Flax NNX).

Shapes in names: B batch, T length, S cache length, D d_model, N heads, K kv heads,
H head_dim, F ffn, V vocab, E experts. Parameters carry logical axis names
(`logical_axes` metadata); `posttrain.models.sharding` maps them to mesh axes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np
from flax import nnx

from posttrain.models import quant
from posttrain.models import rope as rope_lib
from posttrain.models.config import (EXPERT_LORA_TARGETS, LINEAR_LORA_TARGETS, LORA_TARGETS,
                                     ModelConfig, RopeConfig, decode_chunk_for)
from posttrain.models.sharding import ShardingContext

_NO_SHARDING = ShardingContext(None)


def _dtype(name: str):
  return jnp.dtype(name)


def _param(rngs: nnx.Rngs | None, shape, names, dtype, init: str = "normal",
           std: float = 0.02) -> nnx.Param:
  if init == "normal":
    value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
  elif init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    value = jnp.zeros(shape, dtype)
  return nnx.Param(value, logical_axes=tuple(names))


class KVCache(NamedTuple):
  """Per-layer key/value cache, slot index = token position. k, v: [B, K, S, H].
  Multi-head latent attention caches one latent array in k ([B, 1, S, qk_rope_head_dim +
  kv_lora_rank]) and no v; with DeepSeek Sparse Attention (cfg.index_topk) v holds each
  token's index key ([B, 1, S, index_head_dim]).

  Heads-major: a decode step reads each kv head's slots as one contiguous block, with no
  transpose (`kernels.decode_attention(..., kv_layout="bksh")`). An int8 cache also holds
  float32 scales per head and slot, k_scale / v_scale: [B, K, S].

  A sliding-window layer's cache is a ring buffer when it has fewer slots than the
  sequence (`sliding_cache_slots`): position p goes in slot p % S, and the cache holds
  only the keys the window still reads.
  """

  k: jax.Array
  v: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None


class LinearCache(NamedTuple):
  """A linear-attention (Gated DeltaNet) layer's cache: the last linear_conv_kernel - 1
  inputs of its q, k and v convolutions ([B, C-1, key heads, key head dim] and [B, C-1,
  value heads, value head dim], the compute dtype) and the recurrent state [B, value heads,
  key head dim, value head dim] (float32; a Mamba2 layer's [B, heads, head dim, state],
  `_linear_state_dims`). Fixed-size whatever the row's length: it has no
  slots, and holds the row as of the last token written. A short-convolution layer
  (LFM2's, `ShortConv`) keeps its window of B * x in v_conv [B, C-1, d_model, 1], its
  other arrays empty (zero-sized)."""

  q_conv: jax.Array
  k_conv: jax.Array
  v_conv: jax.Array
  state: jax.Array


# Logical axes of a LinearCache's arrays (a stacked cache puts "layers" first).
LINEAR_CACHE_AXES = LinearCache(
    *(("batch", None, "linear_heads", "head_dim"),) * 3,
    ("batch", "linear_heads", None, None))


class HybridCaches(NamedTuple):
  """The cache of a scanned model of linear-attention and full-attention layers: the full
  layers' KV caches stacked ([L_full, B, K, S, H]) and the linear layers' `LinearCache`s
  stacked ([L_linear, ...]), each layer at its index among its own kind. With
  cfg.parallel_mixer (Falcon-H1) every layer has both: each stack holds every layer (a
  scanned model), or a layer's own HybridCaches of one of each is its entry in the
  cache's list."""

  full: KVCache
  linear: LinearCache


class LayerKindCaches(NamedTuple):
  """The cache of a scanned model with layers of both kinds: the full-attention layers'
  caches stacked ([L_full, B, K, S, H]) and the sliding layers' ring buffers stacked
  ([L_sliding, B, K, S_ring, H]), each layer at its index among its own kind."""

  full: KVCache
  sliding: KVCache


# The most tokens one cached call (not a prefill) writes into a sliding layer's ring
# buffer: the ring keeps window + this - 1 slots, so that no write overwrites a key that
# a query of the same call (or a later one) still reads. The sampler's continuing calls
# write at most this many tokens.
CACHED_WRITE_TOKENS = 512


def sliding_cache_slots(cfg: ModelConfig, max_len: int,
                        write_tokens: int = CACHED_WRITE_TOKENS) -> int:
  """Slots of a sliding layer's cache for rows of up to `max_len` positions: max_len, or
  when that is longer, a ring of window + write_tokens - 1 slots (rounded up to a
  multiple of 128, or of 8 below 128)."""
  if cfg.sliding_window is None:
    return max_len
  need = cfg.sliding_window + max(1, int(write_tokens)) - 1
  step = 128 if need > 128 else 8
  return min(max_len, -(-need // step) * step)


def init_linear_cache(cfg: ModelConfig, batch: int, dtype=None,
                      layers: tuple[int, ...] = ()) -> LinearCache:
  """One zeroed `LinearCache`; `layers=(L,)` gives each array a leading layer axis. Its
  conv inputs are in `dtype` (default the compute dtype; an int8 KV cache's model keeps
  them in the compute dtype), the state float32."""
  dtype = jnp.dtype(dtype or _dtype(cfg.dtype))
  if dtype == jnp.int8:
    dtype = jnp.dtype(_dtype(cfg.dtype))
  c = cfg.linear_conv_kernel - 1
  hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  if cfg.linear_mixer == "mamba1":  # x's window [C - 1, E, 1]; the state [E, 1, N]
    empty = jnp.zeros((*layers, batch, c, 0, 0), dtype)
    return LinearCache(empty, empty, jnp.zeros((*layers, batch, c, hv, 1), dtype),
                       jnp.zeros((*layers, batch, hv, 1, dk), jnp.float32))
  if cfg.linear_mixer == "short_conv":  # the window of d_model channels alone
    empty = jnp.zeros((*layers, batch, c, 0, 0), dtype)
    return LinearCache(empty, empty, jnp.zeros((*layers, batch, c, cfg.d_model, 1), dtype),
                       jnp.zeros((*layers, batch, 0, 0, 0), jnp.float32))
  return LinearCache(jnp.zeros((*layers, batch, c, hk, dk), dtype),
                     jnp.zeros((*layers, batch, c, hk, dk), dtype),
                     jnp.zeros((*layers, batch, c, hv, dv), dtype),
                     jnp.zeros((*layers, batch, hv, *_linear_state_dims(cfg)), jnp.float32))


def _linear_state_dims(cfg: ModelConfig) -> tuple[int, int]:
  """A linear layer's recurrent state per value head as its cache holds it: Gated
  DeltaNet's [key head dim, value head dim]; Mamba2's transposed, [head dim, state]
  (mamba_ssm's ssm_state), the state size last: on TPU a head dim of 64 last is padded to
  128 lanes, and XLA laid the cache out with the state last outside a scan over periods
  and as declared inside it, copying every layer's state in and out of the decode step."""
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  return (dv, dk) if cfg.linear_mixer in ("mamba2", "mamba1") else (dk, dv)


def init_layer_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None,
                     layers: tuple[int, ...] = ()) -> KVCache:
  """One zeroed KVCache of `max_len` slots; `layers=(L,)` gives each array a leading
  layer axis."""
  dtype = jnp.dtype(dtype or _dtype(cfg.dtype))
  shape = (*layers, batch, cfg.cache_heads, max_len, cfg.cache_head_dim)
  latent = bool(cfg.kv_lora_rank)  # one latent array, read as keys and values both
  # DeepSeek Sparse Attention keeps each token's index key in a latent cache's v.
  v_shape = (*shape[:-1], cfg.index_head_dim) if cfg.index_topk else shape
  no_v = latent and not cfg.index_topk
  if dtype == jnp.int8:
    scales = shape[:-1]
    return KVCache(jnp.zeros(shape, dtype), None if no_v else jnp.zeros(v_shape, dtype),
                   jnp.ones(scales, jnp.float32),
                   None if no_v else jnp.ones(scales, jnp.float32))
  return KVCache(jnp.zeros(shape, dtype), None if no_v else jnp.zeros(v_shape, dtype))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, *,
               write_tokens: int = CACHED_WRITE_TOKENS):
  """Zeroed cache for rows of up to `max_len` positions: a list of per-layer KVCaches, or
  with `cfg.scan_layers` one KVCache whose arrays stack the layers ([L, B, K, S, H]), or
  for layers of both kinds a `LayerKindCaches` of two stacks. A sliding layer's cache is
  a ring of `sliding_cache_slots(cfg, max_len, write_tokens)` slots, enough for cached
  calls of up to `write_tokens` tokens. dtype int8 stores quantized keys and values with
  scales."""
  ring = sliding_cache_slots(cfg, max_len, write_tokens)
  kinds = cfg.sliding_layers
  linear = cfg.linear_layers
  if cfg.parallel_mixer:  # each layer's KV cache and Mamba2 state both
    if cfg.scan_layers:
      return HybridCaches(init_layer_cache(cfg, batch, max_len, dtype, layers=(len(kinds),)),
                          init_linear_cache(cfg, batch, dtype, layers=(len(kinds),)))
    return [HybridCaches(init_layer_cache(cfg, batch, max_len, dtype),
                         init_linear_cache(cfg, batch, dtype)) for _ in kinds]
  if any(linear):  # an MLP or mixture alone (split_layers) has no cache: None in a list
    if cfg.scan_layers:
      return HybridCaches(
          init_layer_cache(cfg, batch, max_len, dtype,
                           layers=(sum(cfg.attention_layers),)),
          init_linear_cache(cfg, batch, dtype, layers=(linear.count(True),)))
    return [init_linear_cache(cfg, batch, dtype) if lin else
            init_layer_cache(cfg, batch, max_len, dtype) if full else None
            for lin, full in zip(linear, cfg.attention_layers)]
  if cfg.kv_shared_layers:  # a layer sharing keys and values holds no cache
    wide = cfg.global_config()
    first = cfg.num_layers - cfg.kv_shared_layers
    return [None if i >= first else init_layer_cache(cfg, batch, ring, dtype) if sliding
            else init_layer_cache(wide, batch, max_len, dtype)
            for i, sliding in enumerate(kinds)]
  if cfg.global_layers_apart:  # the full layers' caches at their own widths
    wide = cfg.global_config()
    if cfg.scan_layers:
      return LayerKindCaches(
          init_layer_cache(wide, batch, max_len, dtype, layers=(kinds.count(False),)),
          init_layer_cache(cfg, batch, ring, dtype, layers=(kinds.count(True),)))
    return [init_layer_cache(cfg, batch, ring, dtype) if sliding else
            init_layer_cache(wide, batch, max_len, dtype) for sliding in kinds]
  if cfg.scan_layers:
    if len(set(kinds)) > 1:
      return LayerKindCaches(
          init_layer_cache(cfg, batch, max_len, dtype, layers=(kinds.count(False),)),
          init_layer_cache(cfg, batch, ring, dtype, layers=(kinds.count(True),)))
    return init_layer_cache(cfg, batch, ring if kinds[0] else max_len, dtype,
                            layers=(cfg.num_layers,))
  return [init_layer_cache(cfg, batch, ring if sliding else max_len, dtype)
          for sliding in kinds]


# Logical axes of a cache array; the scales of an int8 cache take the first three. A
# stacked cache (scan_layers) puts "layers" first.
CACHE_AXES = ("batch", "kv_heads", "cache_length", "head_dim")


def _is_stacked(layer: KVCache | LinearCache) -> bool:
  if isinstance(layer, LinearCache):
    return layer.state.ndim == 5
  return layer.k.ndim == 5


def _is_unit(x) -> bool:
  return isinstance(x, (KVCache, LinearCache))


def map_cache_units(fn, *caches):
  """fn(unit, ...) on every unit of one or more caches of the same structure: a KVCache,
  or a linear-attention layer's LinearCache (a layer's, or a stack of layers'), keeping
  that structure."""
  return jax.tree.map(fn, *caches, is_leaf=_is_unit)


def cache_unit_axes(unit: KVCache | LinearCache) -> tuple:
  """The logical axes of each array of a cache unit (None for an absent array)."""
  prefix = ("layers",) if _is_stacked(unit) else ()
  if isinstance(unit, LinearCache):
    return tuple(prefix + axes for axes in LINEAR_CACHE_AXES)
  return tuple(None if x is None else prefix + (CACHE_AXES if i < 2 else CACHE_AXES[:3])
               for i, x in enumerate(unit))


def map_cache(fn, cache):
  """Applies fn(array, logical axes) to every array of a cache, keeping its structure."""
  def one(layer):
    return type(layer)(*(None if x is None else fn(x, axes)
                         for x, axes in zip(layer, cache_unit_axes(layer))))
  return map_cache_units(one, cache)


def constrain_cache(cache, ctx: ShardingContext):
  """Constrains every cache array to its logical axes (a no-op without a mesh)."""
  return map_cache(ctx.constrain, cache)


def cache_slots(cache) -> int:
  """Slots per row of the longest layer cache from `init_cache` (a sliding layer's ring
  may have fewer)."""
  return max(unit.k.shape[-2] for unit in jax.tree.leaves(cache, is_leaf=_is_unit)
             if isinstance(unit, KVCache))


class RMSNorm(nnx.Module):
  """y = w * x / sqrt(mean(x^2) + eps), normalised in float32 (Llama: cast, then scaled).

  With `unit_offset` (Gemma): y = (1 + w) * x / sqrt(...), w starting at zero, scaled in
  float32 before the cast. With `center` a LayerNorm without bias: x less its mean, over
  its standard deviation, scaled in float32 (Cohere's). `dim` a tuple: the mean spans the
  last len(dim) axes, and w has that shape (OLMo 2's q/k norms over every head at once,
  [heads, head_dim]), or the last `reduce` of them alone (each head normed over its own
  features, w a weight per head: Cohere's q/k norms). With `bias` (and `center`) a
  LayerNorm's bias b is added after w, in float32 (torch's LayerNorm); with `center` and
  `unit_offset` the weight is 1 + w (Nemotron's LayerNorm1P).
  """

  def __init__(self, dim: int | tuple[int, ...], eps: float, param_dtype, names=("norm",),
               unit_offset: bool = False, center: bool = False, reduce: int | None = None,
               bias: bool = False, weightless: bool = False):
    if bias and not center:
      raise ValueError("a norm's bias needs center=True (a LayerNorm)")
    self.weightless = bool(weightless)  # no scale: x / sqrt(mean(x^2) + eps) (nanochat)
    self.eps = eps
    self.unit_offset = bool(unit_offset)
    self.center = bool(center)
    dims = tuple(dim) if isinstance(dim, tuple) else (dim,)
    self.weight_axes = len(dims)
    self.axes = len(dims) if reduce is None else int(reduce)
    if not weightless:
      self.scale = _param(None, dims, names, param_dtype,
                          init="zeros" if unit_offset else "ones")
    if bias:
      self.bias = _param(None, dims, names, param_dtype, init="zeros")

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    axes = tuple(range(-self.axes, 0))
    if self.center:  # a LayerNorm without bias (Cohere's), scaled in float32
      x32 = x32 - jnp.mean(x32, axis=axes, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + self.eps)
    if self.weightless:
      return y.astype(x.dtype)
    w = self.weight_axes
    shape = (1,) * (x.ndim - w) + x.shape[x.ndim - w:]
    if self.center:
      scale = self.scale[...].astype(jnp.float32).reshape(shape)
      y = y * (1.0 + scale if self.unit_offset else scale)
      if hasattr(self, "bias"):
        y = y + self.bias[...].astype(jnp.float32).reshape(shape)
      return y.astype(x.dtype)
    if self.unit_offset:
      return (y * (1.0 + self.scale[...].astype(jnp.float32)).reshape(shape)).astype(x.dtype)
    scale = self.scale[...].astype(x.dtype).reshape(shape)
    return scale * y.astype(x.dtype)


def _norm(cfg: ModelConfig, dim: int | tuple[int, ...], names=("norm",),
          reduce: int | None = None, bias: bool | None = None) -> RMSNorm:
  """A norm of cfg's kind; `bias` (default cfg.norm_bias) False for q/k norms."""
  return RMSNorm(dim, cfg.norm_eps, _dtype(cfg.param_dtype), names,
                 unit_offset=cfg.norm_unit_offset, center=cfg.layer_norm, reduce=reduce,
                 bias=cfg.norm_bias if bias is None else bias,
                 weightless=cfg.norm_weightless)


def soft_cap(logits, cap: float | None):
  """cap * tanh(logits / cap) (Gemma 2's logit soft cap); `logits` itself for None."""
  if cap is None:
    return logits
  return cap * jnp.tanh(logits / cap)


def alibi_slopes(cfg: ModelConfig):
  """ALiBi's slopes [heads] (float32, a constant) for `kernels`, or None."""
  slopes = cfg.alibi_slopes
  return None if slopes is None else jnp.asarray(np.asarray(slopes, np.float32))


def attend(cfg: ModelConfig, q, k, v, segment_ids, ctx: ShardingContext,
           sliding: bool = False, sinks=None):
  """Full (training / prefill) attention through kernels/, selected by cfg.attention_impl;
  `sliding`: a sliding-window layer (cfg.sliding_window keys back); `sinks`: the layer's
  attention-sink logits [heads] (cfg.attention_sinks) or None.

  Pallas kernels (flash, and ring's flash blocks) run inside `shard_map` on a mesh: XLA
  cannot partition them (TPU refuses to compile, GPU would run the whole batch on every
  device).
  """
  import kernels  # Deferred: keeps `import posttrain.models` cheap.

  kwargs = dict(causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                sm_scale=cfg.attention_scale, logits_soft_cap=cfg.attn_logit_softcap,
                sliding_window=cfg.sliding_window if sliding else None, sinks=sinks,
                alibi_slopes=alibi_slopes(cfg))
  flash_options = cfg.flash_options
  if cfg.attention_impl == "chunked":
    return kernels.dot_product_attention(q, k, v, implementation="chunked",
                                         chunk_size=cfg.attention_chunk, **kwargs)
  if cfg.attention_impl not in ("flash", "ring"):
    return kernels.dot_product_attention(q, k, v, implementation="reference", **kwargs)
  if ctx.mesh is not None:
    from posttrain.models.sharding import logical_to_spec
    q_spec = logical_to_spec(("batch", None, "heads", None), ctx.rules, ctx.mesh, q.shape)
    kv_spec = logical_to_spec(("batch", None, "kv_heads", None), ctx.rules, ctx.mesh,
                              k.shape)
    batch_axis, head_axis = q_spec[0], q_spec[2]
  if cfg.attention_impl == "ring":
    if ctx.mesh is not None and ctx.mesh.shape.get("sequence", 1) > 1:
      if flash_options:
        kwargs.update(block_kernel="flash", **flash_options)
      # Batch and heads stay sharded inside the ring instead of gathering on each device.
      return kernels.ring_attention_sharded(
          q, k, v, mesh=ctx.mesh, axis_name="sequence", batch_axis=batch_axis,
          head_axis=head_axis if head_axis == kv_spec[2] else None, **kwargs)
    if not flash_options:
      return kernels.dot_product_attention(q, k, v, implementation="chunked", **kwargs)
    # Options name the flash kernel: without a sequence axis it runs on each shard.
  if ctx.mesh is None:
    return kernels.flash_attention(q, k, v, **kwargs, **flash_options)
  return kernels.sharded_attention(q, k, v, mesh=ctx.mesh, batch_axis=batch_axis,
                                   head_axis=head_axis, attention=kernels.flash_attention,
                                   **kwargs, **flash_options)


# -- DeepSeek Sparse Attention ----------------------------------------------------------------

# Queries per block of `sparse_attention`: each block's index scores and attention
# logits ([B, block, index_heads, S] and [B, heads, block, S], float32) are the largest
# arrays it holds; the scores are dropped once the block's keys are chosen, the logits
# recomputed in the backward pass rather than kept.
SPARSE_QUERY_BLOCK = 256


def index_scores(iq_BxTxHxI, iw_BxTxH, ik_BxSxI) -> jax.Array:
  """The lightning indexer's scores [B, T, S] (float32): sum_h w[t, h] relu(q[t, h] .
  k[s] / sqrt(I)) / sqrt(H) (DeepSeek-V3.2's `Indexer`, in float32 without its FP8
  rounding and Hadamard rotation, which leaves the dot products as they are)."""
  f32 = jnp.float32
  heads, dim = iq_BxTxHxI.shape[-2:]
  dots = jnp.einsum("BTHI,BSI->BTHS", iq_BxTxHxI.astype(f32), ik_BxSxI.astype(f32))
  weights = iw_BxTxH.astype(f32) * heads ** -0.5
  return jnp.einsum("BTH,BTHS->BTS", weights, jax.nn.relu(dots * dim ** -0.5))


def _top_keys(scores_BxTxS, valid_BxTxS, topk: int):
  """(indices [B, T, topk] int32, valid [B, T, topk] bool): each query's highest-scoring
  keys, the ones past its valid keys marked invalid."""
  scores = jax.lax.stop_gradient(jnp.where(valid_BxTxS, scores_BxTxS, -jnp.inf))
  top, idx = jax.lax.top_k(scores, topk)
  return idx.astype(jnp.int32), jnp.isfinite(top)


def _allowed(idx_BxTxK, ok_BxTxK, keys: int) -> jax.Array:
  """The [B, T, keys] mask of the keys `_top_keys` chose."""
  b, t, _ = idx_BxTxK.shape
  return jnp.zeros((b, t, keys), bool).at[
      jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], idx_BxTxK].set(ok_BxTxK)


def masked_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, allowed_BxTxS, sm_scale: float):
  """Softmax attention of q over the keys `allowed` for each query ([B, T, N, V] in q's
  dtype; logits and sums in float32, the probabilities cast to v's dtype before the
  values as transformers' eager attention does); K kv heads serve N / K query heads each.
  A query with no key allowed gets zeros."""
  b, t, n, h = q_BxTxNxH.shape
  kh = k_BxSxKxH.shape[2]
  q = q_BxTxNxH.reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_BxSxKxH,
                      preferred_element_type=jnp.float32) * sm_scale
  logits = jnp.where(allowed_BxTxS[:, None, None], logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0)))
  total = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("BKGTS,BSKV->BTKGV", p.astype(v_BxSxKxV.dtype), v_BxSxKxV,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, n, v_BxSxKxV.shape[-1]).astype(q_BxTxNxH.dtype)


def sparse_attention(q, k, v, iq, iw, ik, q_pos_BxT, k_pos_BxS, q_seg_BxT, k_seg_BxS,
                     topk: int, sm_scale: float, block: int = SPARSE_QUERY_BLOCK):
  """DeepSeek Sparse Attention: each query [B, T, N, H] attends (`masked_attention`) to
  the `topk` keys [B, S, K, H] of its own segment at positions up to its own that the
  indexer (queries iq [B, T, Hi, I], weights iw [B, T, Hi], keys ik [B, S, I]) scores
  highest. Queries go in blocks of `block`: the indexer's [block, S] scores are computed
  and dropped a block at a time, keeping each query's chosen key indices [T, topk]; the
  attention runs a block at a time under `jax.checkpoint`, its backward pass recomputing
  a block's probabilities from those indices (not the scores, nor the choice)."""
  b, t = q.shape[:2]
  keys = k.shape[1]
  iq, iw, ik = (jax.lax.stop_gradient(x) for x in (iq, iw, ik))  # no gradient: a choice

  def valid(q_pos, q_seg):
    return ((k_pos_BxS[:, None, :] <= q_pos[:, :, None])
            & (k_seg_BxS[:, None, :] == q_seg[:, :, None]) & (q_seg[:, :, None] != 0))

  def choose(iq, iw, q_pos, q_seg):
    return _top_keys(index_scores(iq, iw, ik), valid(q_pos, q_seg), topk)

  def attend_dense(q, q_pos, q_seg):  # every valid key chosen
    return masked_attention(q, k, v, valid(q_pos, q_seg), sm_scale)

  def attend_chosen(q, idx, ok):
    return masked_attention(q, k, v, _allowed(idx, ok, keys), sm_scale)

  dense = topk >= keys
  if t <= block:
    if dense:
      return attend_dense(q, q_pos_BxT, q_seg_BxT)
    return attend_chosen(q, *choose(iq, iw, q_pos_BxT, q_seg_BxT))
  pad = -t % block
  padded = [jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=c)
            for x, c in ((q, 0), (iq, 0), (iw, 0), (q_pos_BxT, -1), (q_seg_BxT, 0))]
  q_b, iq_b, iw_b, pos_b, seg_b = [jnp.moveaxis(x.reshape(b, -1, block, *x.shape[2:]), 1, 0)
                                   for x in padded]
  if dense:
    out = jax.lax.map(lambda xs: jax.checkpoint(attend_dense)(*xs), (q_b, pos_b, seg_b))
  else:
    idx, ok = jax.lax.map(lambda xs: choose(*xs), (iq_b, iw_b, pos_b, seg_b))
    out = jax.lax.map(lambda xs: jax.checkpoint(attend_chosen)(*xs), (q_b, idx, ok))
  out = jnp.moveaxis(out, 0, 1).reshape(b, t + pad, *out.shape[3:])
  return out[:, :t]


# -- LoRA adapters --------------------------------------------------------------------------

_ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The projections of `LinearAttention` a Gated DeltaNet target wraps, in the order its B's
# output columns hold them (each flattened row-major): one A shared by all, as the Hugging
# Face module it is named after is one matrix.
_LINEAR_PARTS = {"in_proj_qkv": ("q_proj", "k_proj", "v_proj"), "in_proj_z": ("z_proj",),
                 "in_proj_b": ("b_proj",), "in_proj_a": ("a_proj",),
                 "in_proj_qkvz": ("q_proj", "k_proj", "v_proj", "z_proj"),
                 "in_proj_ba": ("b_proj", "a_proj"), "out_proj": ("o_proj",),
                 "in_proj": ("z_proj", "v_proj", "k_proj", "q_proj", "a_proj")}
# A short convolution's in_proj (`ShortConv`): its B, C and x, in LFM2's row order.
_SHORT_CONV_IN = ("b_proj", "c_proj", "x_proj")
# A Mamba 1 layer's in_proj (`Mamba1`): x, then the gate.
_MAMBA1_IN = ("v_proj", "z_proj")


def _linear_parts(cfg: ModelConfig, target: str) -> tuple[str, ...]:
  """The projections of a linear layer's mixer that `target` wraps (`_LINEAR_PARTS`; a
  short convolution's in_proj its B, C and x)."""
  if cfg.linear_mixer == "short_conv" and target == "in_proj":
    return _SHORT_CONV_IN
  if cfg.linear_mixer == "mamba1" and target == "in_proj":
    return _MAMBA1_IN
  return _LINEAR_PARTS[target]


def _linear_part_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Output shape of each of `LinearAttention`'s (or `ShortConv`'s) input projections."""
  hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  if cfg.linear_mixer == "short_conv":
    return dict.fromkeys(_SHORT_CONV_IN, (cfg.d_model,))
  return {"q_proj": (hk, dk), "k_proj": (hk, dk), "v_proj": (hv, dv), "z_proj": (hv, dv),
          "b_proj": (hv,), "a_proj": (hv,)}


# The stacks whose layers' MLP is dense in a mixture-of-experts model: its leading (or
# interleaved) dense layers (a hybrid's linear-attention ones apart), and with
# split_layers its MLPs alone.
_DENSE_STACKS = ("dense_layers", "linear_dense_layers", "mlp_layers")
# The stacks of linear-attention layers.
_LINEAR_STACKS = ("linear_layers", "linear_dense_layers")


# The stacks of layers attending over another layer's keys and values (kv_shared_layers).
_SHARED_STACKS = ("shared_layers", "shared_global_layers")


def _mlp_width(cfg: ModelConfig, stack: str) -> int:
  """The width of the dense MLP an MLP target wraps in a layer of `stack`: ffn_dim (twice
  that in a layer sharing keys and values with kv_shared_wide_mlp); a mixture's leading
  dense layers' (or MLPs alone, split_layers) dense_ffn_dim, its mixture layers' shared
  expert's."""
  if not cfg.num_experts:
    return cfg.ffn_dim * (2 if stack in _SHARED_STACKS and cfg.kv_shared_wide_mlp else 1)
  return cfg.dense_ffn_dim if stack in _DENSE_STACKS else cfg.shared_expert_dim


def _owner_path(cfg: ModelConfig, target: str, stack: str) -> tuple[str, ...]:
  """The submodules of a layer of `stack` down to the one holding `target`: its attention
  (or Gated DeltaNet) module, its MLP, or a mixture layer's shared expert."""
  if target in _LINEAR_PARTS:
    return ("linear_attn",)
  if target in _ATTN_TARGETS:
    return ("attn",)
  if target in EXPERT_LORA_TARGETS:
    return ("mlp",)
  return ("mlp", "shared") if cfg.num_experts and stack not in _DENSE_STACKS else ("mlp",)


def _lora_axes(cfg: ModelConfig, target: str, stack: str = "layers"):
  """(input shape, input axes, output shape, output axes) of a wrapped projection in a
  layer of `stack`. A routed-expert target's input leads with the experts [E, in]: its
  A is [E, r, in] (the rank off the minor axis, which TPU pads to 128 lanes; PEFT's own
  order), its B [E, r, out...] (`_lora_experts`)."""
  if stack in ("global_layers", "shared_global_layers"):  # full layers at their own widths
    cfg = cfg.global_config()
  d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  # The experts' width: the model's, or the latent they run in (moe_latent_dim).
  de = cfg.moe_latent_dim or d
  if target == "experts_gate_up_proj":  # B's columns: gate's F, then up's
    return ((cfg.num_experts, de), ("experts", "embed"), (2, cfg.ffn_dim), (None, "mlp"))
  if target == "experts_up_proj":  # experts without a gate (relu^2)
    return ((cfg.num_experts, de), ("experts", "embed"), (cfg.ffn_dim,), ("mlp",))
  if target == "experts_down_proj":
    return ((cfg.num_experts, cfg.ffn_dim), ("experts", "mlp"), (de,), ("embed",))
  f = _mlp_width(cfg, stack)
  if target in _LINEAR_PARTS:
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    if target == "out_proj" and cfg.linear_mixer == "short_conv":
      return ((d,), ("linear_heads",), (d,), ("embed",))
    if target == "out_proj":
      return ((hv, dv), ("linear_heads", "head_dim"), (d,), ("embed",))
    parts = _linear_parts(cfg, target)
    if len(parts) == 1:  # z_proj, b_proj, a_proj: shaped, sharded, as their weights
      out = _linear_part_shapes(cfg)[parts[0]]
      return ((d,), ("embed",), out, ("linear_heads", "head_dim")[:len(out)])
    shapes = _linear_part_shapes(cfg)
    return ((d,), ("embed",), (sum(int(np.prod(shapes[p])) for p in parts),), (None,))
  if cfg.kv_lora_rank and target in _ATTN_TARGETS:  # MLA's (`_lora_param`)
    r, v, hn = cfg.kv_lora_rank, cfg.v_head_dim, h - cfg.qk_rope_head_dim
    q_in = ((cfg.q_lora_rank,), ("latent",)) if cfg.q_lora_rank else ((d,), ("embed",))
    return {"q_proj": (*q_in, (n, h), ("heads", "head_dim")),
            "k_proj": ((r,), ("latent",), (n, hn), ("heads", "head_dim")),
            "v_proj": ((r,), ("latent",), (n, v), ("heads", "head_dim")),
            "o_proj": ((n, v), ("heads", "head_dim"), (d,), ("embed",))}[target]
  return {"q_proj": ((d,), ("embed",), (n, h), ("heads", "head_dim")),
          "k_proj": ((d,), ("embed",), (k, h), ("kv_heads", "head_dim")),
          "v_proj": ((d,), ("embed",), (k, h), ("kv_heads", "head_dim")),
          "o_proj": ((n, h), ("heads", "head_dim"), (d,), ("embed",)),
          "gate_proj": ((d,), ("embed",), (f,), ("mlp",)),
          "up_proj": ((d,), ("embed",), (f,), ("mlp",)),
          "down_proj": ((f,), ("mlp",), (d,), ("embed",))}[target]


def _lora_experts(target: str) -> int:
  """1 for a routed-expert target (its A and B lead with the experts), else 0."""
  return int(target in EXPERT_LORA_TARGETS)


def _lora_init(cfg: ModelConfig, target: str, key, stack: str = "layers"):
  """(A [in..., r], B [r, out...]; a routed-expert target's [E, r, in], [E, r, out...]):
  A as PEFT draws it (kaiming-uniform, a=sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
  fan_in an expert's own), B zero, so a new adapter changes nothing."""
  in_shape, _, out_shape, _ = _lora_axes(cfg, target, stack)
  r, pd = cfg.lora_rank, _dtype(cfg.param_dtype)
  lead = in_shape[:_lora_experts(target)]
  bound = 1.0 / float(np.sqrt(np.prod(in_shape[len(lead):])))
  a_shape = (*lead, r, *in_shape[len(lead):]) if lead else (*in_shape, r)
  a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
  return a.astype(pd), jnp.zeros((*lead, r, *out_shape), pd)


def layer_stacks(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
  """(attribute, the model's layers it holds, in order) of each of the model's layer
  stacks: a mixture's dense layers (`dense_layers`: leading, or between its mixture
  layers with cfg.moe_layer_step) then `layers`; or for a model
  with linear-attention layers, those (`linear_layers`) and the attention layers
  (`layers`), interleaved in the model as layer_types says (a mixture's dense layers
  apart: `linear_dense_layers` and `dense_layers`, LFM2-MoE's); with cfg.split_layers the
  MLPs alone too (`mlp_layers`) and the mixtures alone (`moe_layers`); with
  cfg.global_layers_apart the sliding layers (`layers`) and the full ones
  (`global_layers`); with cfg.kv_shared_layers the layers sharing keys and values in
  `shared_layers` (and `shared_global_layers`)."""
  linear = cfg.linear_layers
  if cfg.kv_shared_layers:  # Gemma 4 E2B / E4B: the layers sharing keys and values apart
    first = cfg.num_layers - cfg.kv_shared_layers
    sliding = cfg.sliding_layers
    apart = cfg.global_layers_apart
    groups = (("layers", lambda i: not apart or sliding[i], False),
              ("global_layers", lambda i: apart and not sliding[i], False),
              ("shared_layers", lambda i: not apart or sliding[i], True),
              ("shared_global_layers", lambda i: apart and not sliding[i], True))
    out = tuple((name, tuple(i for i in range(cfg.num_layers)
                             if (i >= first) == shared and keep(i)))
                for name, keep, shared in groups)
    return tuple((name, indices) for name, indices in out if indices)
  if cfg.global_layers_apart:  # Gemma 4: the full layers at their own widths
    sliding = cfg.sliding_layers
    return (("layers", tuple(i for i, s in enumerate(sliding) if s)),
            ("global_layers", tuple(i for i, s in enumerate(sliding) if not s)))
  if cfg.split_layers:
    return tuple((name, tuple(i for i, on in enumerate(flags) if on)) for name, flags in (
        ("linear_layers", linear), ("layers", cfg.attention_layers),
        ("mlp_layers", cfg.mlp_layers), ("moe_layers", cfg.moe_layers)) if any(flags))
  if any(linear):  # a mixture's dense layers apart, linear and attention each
    moe = cfg.mixture_flags if cfg.num_experts else (True,) * cfg.num_layers
    stacks = (("linear_dense_layers", lambda lin, m: lin and not m),
              ("dense_layers", lambda lin, m: not lin and not m),
              ("linear_layers", lambda lin, m: lin and m),
              ("layers", lambda lin, m: not lin and m))
    return tuple((name, indices) for name, keep in stacks
                 if (indices := tuple(i for i, (lin, m) in enumerate(zip(linear, moe))
                                      if keep(lin, m))))
  if not cfg.num_experts:
    return (("layers", tuple(range(cfg.num_layers))),)
  flags = cfg.mixture_flags
  dense = tuple(i for i, moe in enumerate(flags) if not moe)
  return ((("dense_layers", dense),) if dense else ()) + (
      ("layers", tuple(i for i, moe in enumerate(flags) if moe)),)


def layer_path(cfg: ModelConfig, i: int) -> tuple[str, int]:
  """Where layer i's parameters sit, unstacked: ("layers", j), ("dense_layers", j),
  ("linear_layers", j), ("linear_dense_layers", j), ("mlp_layers", j) or
  ("moe_layers", j)."""
  for name, indices in layer_stacks(cfg):
    if i in indices:
      return name, indices.index(i)
  raise ValueError(f"layer {i} is not in a model of {cfg.num_layers} layers")


def layer_index(cfg: ModelConfig, stack: str, j: int) -> int:
  """The inverse of `layer_path`: the model's layer j of `stack`."""
  return dict(layer_stacks(cfg))[stack][j]


def stack_lora_targets(cfg: ModelConfig, stack: str) -> tuple[str, ...]:
  """The LoRA targets the layers of `stack` carry: a linear-attention layer has no
  q/k/v/o_proj of attention, an attention layer no Gated DeltaNet projections, and a
  mixture layer MLP targets only on its shared expert (its routed experts: the
  EXPERT_LORA_TARGETS)."""
  other = _ATTN_TARGETS if stack in _LINEAR_STACKS else LINEAR_LORA_TARGETS
  if cfg.parallel_mixer:  # every layer has both
    other = ()
  if cfg.split_layers:  # one sublayer a layer: the MLP's targets on the MLPs (and
    # mixtures' shared experts) alone
    other = (LORA_TARGETS[4:] + other if stack not in ("mlp_layers", "moe_layers") else
             _ATTN_TARGETS + LINEAR_LORA_TARGETS)
  if cfg.num_experts and not cfg.shared_expert_dim and stack not in _DENSE_STACKS:
    other += LORA_TARGETS[4:]
  if stack == "global_layers" and cfg.k_eq_v:  # values from the keys' projection
    other += ("v_proj",)
  if stack in _SHARED_STACKS:  # keys and values another layer's
    other += ("k_proj", "v_proj")
  if stack in _DENSE_STACKS or (cfg.split_layers and stack != "moe_layers"):
    other += EXPERT_LORA_TARGETS  # a layer without a mixture routes to no experts
  return tuple(t for t in cfg.lora_target_names if t not in other)


def _fresh_adapter(cfg: ModelConfig, target: str, key, layer=None, stack: str = "layers"):
  """(A, B) of a new adapter on `target`: layer `layer`'s, or with `layer` None every
  layer's of `stack` stacked on a leading axis. Layer i draws from
  fold_in(fold_in(key, i), the target's index in LORA_TARGETS + LINEAR_LORA_TARGETS +
  EXPERT_LORA_TARGETS)."""
  index = (LORA_TARGETS + LINEAR_LORA_TARGETS + EXPERT_LORA_TARGETS).index(target)

  def one(i):
    return _lora_init(cfg, target, jax.random.fold_in(jax.random.fold_in(key, i), index),
                      stack)

  if layer is not None:
    return one(layer)
  return jax.vmap(one)(jnp.asarray(dict(layer_stacks(cfg))[stack], jnp.int32))


def _lora_params(cfg: ModelConfig, target: str) -> tuple[str, ...]:
  """The weights an adapter on `target` wraps, in its B's column order: one but for a
  fused Gated DeltaNet projection (`_LINEAR_PARTS`) and the experts' gate and up."""
  if target in EXPERT_LORA_TARGETS:
    return {"experts_gate_up_proj": ("gate_proj", "up_proj"),
            "experts_up_proj": ("up_proj",)}.get(target, ("down_proj",))
  if target in _LINEAR_PARTS:
    return _linear_parts(cfg, target)
  return (_lora_param(cfg, target),)


def _lora_param(cfg: ModelConfig, target: str) -> str:
  """The weight an adapter on `target` wraps: the target itself, or under multi-head
  latent attention q_b_proj (with a query latent), k_b_proj, v_b_proj."""
  if not cfg.kv_lora_rank:
    return target
  return {"q_proj": "q_b_proj" if cfg.q_lora_rank else "q_proj", "k_proj": "k_b_proj",
          "v_proj": "v_b_proj"}.get(target, target)


def _attach_lora(model: "Transformer", key) -> None:
  """Gives every layer's target projections their adapters: `<target>_lora_a` / `_b`
  (nnx.LoRAParam), drawn by `_fresh_adapter`; the base weights, drawn before, are those
  of the same model without adapters."""
  cfg = model.cfg
  for t in cfg.lora_target_names:
    _, in_names, _, out_names = _lora_axes(cfg, t)
    owners = []
    for stack, indices in layer_stacks(cfg):
      if t not in stack_lora_targets(cfg, stack):
        continue
      blocks = getattr(model, stack)
      owners += ([(blocks, ("layers",), stack, _fresh_adapter(cfg, t, key, stack=stack))]
                 if cfg.scan_layers else
                 [(block, (), stack, _fresh_adapter(cfg, t, key, indices[j], stack=stack))
                  for j, block in enumerate(blocks)])
    experts = in_names[:_lora_experts(t)]  # a routed-expert target's A and B lead with E
    a_names = ((*experts, "lora", *in_names[1:]) if experts else (*in_names, "lora"))
    for block, lead, stack, (a, b) in owners:
      owner = block
      for name in _owner_path(cfg, t, stack):
        owner = getattr(owner, name)
      setattr(owner, f"{t}_lora_a", nnx.LoRAParam(a, logical_axes=(*lead, *a_names)))
      setattr(owner, f"{t}_lora_b", nnx.LoRAParam(
          b, logical_axes=(*lead, *experts, "lora", *out_names)))


def _add_lora(module, target: str, y, x, down: str, up: str):
  """y + scale * (x A) B when `module` has an adapter on `target`, else y."""
  a = getattr(module, f"{target}_lora_a", None)
  if a is None:
    return y
  b = getattr(module, f"{target}_lora_b")
  dt = y.dtype
  xa = jnp.einsum(down, x.astype(dt), a[...].astype(dt))
  return y + (module.cfg.lora_scale * jnp.einsum(up, xa, b[...].astype(dt))).astype(dt)


def _add_fused_lora(module, target: str, outs: dict, x) -> dict:
  """`outs` (a Gated DeltaNet layer's input projections by weight name, [B, T, ...]) with
  the adapter on `target` added to each projection it wraps, when `module` has one."""
  a = getattr(module, f"{target}_lora_a", None)
  if a is None:
    return outs
  b = getattr(module, f"{target}_lora_b")[...]
  dt = x.dtype
  xa = jnp.einsum("BTD,DR->BTR", x, a[...].astype(dt))
  y = module.cfg.lora_scale * jnp.einsum("BTR,RO->BTO", xa, b.reshape(b.shape[0], -1).astype(dt))
  outs, start = dict(outs), 0
  for name in _linear_parts(module.cfg, target):
    size = int(np.prod(outs[name].shape[2:]))
    part = y[..., start:start + size].reshape(outs[name].shape)
    outs[name], start = outs[name] + part.astype(dt), start + size
  return outs


def _fold_adapters(model: "Transformer", key, cfg: ModelConfig | None = None) -> dict:
  """The model's state as a pure dict, each adapter folded into its projection
  (W + scale * A B, in float32); with `key`, fresh adapters of `cfg` (default: the
  model's; `_fresh_adapter`'s draws, B zero) in their place, else none."""
  old = model.cfg
  cfg = cfg or old
  pure = quant.map_quantized(quant.dequantize, nnx.to_pure_dict(nnx.state(model)))
  stacked = old.scan_layers
  layers = []  # (a layer's dict, or a stack's, its stack, its layer index or None)
  for stack, indices in layer_stacks(old):
    layers += ([(pure[stack], stack, None)] if stacked else
               [(pure[stack][j], stack, i) for j, i in enumerate(indices)])
  for layer, stack, i in layers:
    for t in stack_lora_targets(old, stack):
      owner = layer
      for name in _owner_path(old, t, stack):
        owner = owner[name]
      a, b = owner.pop(f"{t}_lora_a"), owner.pop(f"{t}_lora_b")
      r = old.lora_rank
      if _lora_experts(t):  # [(L,) E, r, in] -> [(L,) E, in, r]
        a = jnp.swapaxes(a, -1, -2)
      lead = a.shape[:int(stacked) + _lora_experts(t)]  # the layers', the experts' axes
      delta = jnp.matmul(a.reshape(*lead, -1, r).astype(jnp.float32),
                         b.reshape(*lead, r, -1).astype(jnp.float32)) * old.lora_scale
      start = 0  # a fused target's columns hold its weights' updates in turn
      for name in _lora_params(old, t):
        w = owner[name]
        size = w.size // int(np.prod(delta.shape[:-1]))
        part = delta[..., start:start + size].reshape(w.shape)
        owner[name], start = (w.astype(jnp.float32) + part).astype(w.dtype), start + size
    if key is None:
      continue
    for t in stack_lora_targets(cfg, stack):
      owner = layer
      for name in _owner_path(cfg, t, stack):
        owner = owner[name]
      owner[f"{t}_lora_a"], owner[f"{t}_lora_b"] = _fresh_adapter(cfg, t, key, i, stack=stack)
  return pure


def _rebuild(cfg: ModelConfig, pure: dict) -> "Transformer":
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  for path, var in nnx.to_flat_state(abstract):  # a quantized base's projections, requantized
    if isinstance(var, quant.QuantizedParam):
      *owner, name = path
      node = functools.reduce(lambda d, k: d[k], owner, pure)
      if not isinstance(node[name], quant.QArray):
        node[name] = quant.quantize(
            node[name], cfg.base_quantization, cfg.base_quantization_block,
            axis=quant.block_axis(var.get_metadata()["logical_axes"]),
            dtype=var.get_raw_value().dtype)
  nnx.replace_by_pure_dict(abstract, pure)
  return nnx.merge(graphdef, abstract)


def merge_lora(model: "Transformer") -> "Transformer":
  """The model with each adapter folded into its projection (W + scale * A B) and no
  adapters: what Hugging Face export and plain inference use. A model without adapters
  is returned as it is; a quantized base (QLoRA) comes back dequantized, in param_dtype."""
  if not model.cfg.lora_rank:
    return model
  return _rebuild(model.cfg.replace(lora_rank=0, base_quantization=""),
                  _fold_adapters(model, None))


def fold_lora(model: "Transformer", key) -> "Transformer":
  """The same function as `model`: its adapters folded into the base weights, fresh
  adapters (A drawn from `key`, B zero) on top. Where a second LoRA stage starts (RL
  after SFT), so that its base, the KL reference, is the policy it starts from.

  Raises ValueError for a quantized base (QLoRA): requantized, it would round most of
  the adapters' update away."""
  if not model.cfg.lora_rank:
    return model
  check_foldable(model.cfg)
  return _rebuild(model.cfg, _fold_adapters(model, key))


def check_foldable(cfg: ModelConfig) -> None:
  """Raises ValueError when adapters cannot be folded into `cfg`'s base and trained on:
  a quantized base (QLoRA) would round most of their update away."""
  if cfg.base_quantization:
    raise ValueError(f"base_quantization={cfg.base_quantization!r}: adapters cannot be folded "
                     "into a quantized base (requantizing rounds most of their update away); "
                     "run the stages as runs of their own, exporting the merged weights "
                     "between them")


def with_lora(model: "Transformer", lora_rank: int, key, **lora: object) -> "Transformer":
  """The same function as `model` with fresh adapters of `lora_rank` (and optionally
  lora_alpha / lora_targets) on top; any adapters it had are folded in first. Rank 0
  returns `merge_lora(model)`. The layer layout is the model's."""
  cfg = model.cfg.replace(lora_rank=int(lora_rank), **lora)
  if not cfg.lora_rank:
    return merge_lora(model)
  if model.cfg.lora_rank:
    check_foldable(cfg)
  return _rebuild(cfg, _fold_adapters(model, key, cfg))


def without_lora(params):
  """`params` (an nnx.State of the model's parameters) with every adapter zeroed: the
  base model, sharing the base arrays (the KL reference of a LoRA run)."""
  def zero(v):
    return v.replace(jnp.zeros_like(v[...])) if isinstance(v, nnx.LoRAParam) else v

  return jax.tree.map(zero, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


class Attention(nnx.Module):
  """Grouped-query attention with optional qkv bias (Qwen2) and q/k norm (Qwen3 per head,
  OLMo 2 over all heads); or with cfg.kv_lora_rank multi-head latent attention
  (DeepSeek-V3: `_latent_qkv`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, global_layer: bool = False,
               kv_shared: bool = False):
    """`global_layer`: a full-attention layer of its own (cfg.global_layers_apart; `cfg`
    its `global_config()`), without a v_proj under cfg.k_eq_v. `kv_shared`: a layer
    attending over another's keys and values (cfg.kv_shared_layers), with no k_proj,
    v_proj or k_norm."""
    self.cfg = cfg
    self.values_from_keys = bool(global_layer and cfg.k_eq_v)
    self.kv_shared = bool(kv_shared)
    pd, std = _dtype(cfg.param_dtype), cfg.init_std
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if cfg.kv_lora_rank:
      self._init_latent(cfg, rngs)
    else:
      self.q_proj = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd, std=std)
      if not kv_shared:
        self.k_proj = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std=std)
      if not (self.values_from_keys or kv_shared):
        self.v_proj = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd,
                             std=std)
    v = cfg.v_head_dim or h
    self.o_proj = _param(rngs, (n, v, d), ("heads", "head_dim", "embed"), pd, std=std)
    if cfg.qkv_bias:
      self.q_bias = _param(None, (n, h), ("heads", "head_dim"), pd, init="zeros")
      self.k_bias = _param(None, (k, h), ("kv_heads", "head_dim"), pd, init="zeros")
      self.v_bias = _param(None, (k, h), ("kv_heads", "head_dim"), pd, init="zeros")
    if cfg.qk_norm and (cfg.qk_norm_heads or cfg.qk_norm_head_weights):
      # OLMo 2: over every head's features at once; Cohere: each head alone, its own weight
      reduce = 1 if cfg.qk_norm_head_weights else None
      self.q_norm = _norm(cfg, (n, h), names=("heads", "head_dim"), reduce=reduce,
                          bias=False)
      self.k_norm = _norm(cfg, (k, h), names=("kv_heads", "head_dim"), reduce=reduce,
                          bias=False)
    elif cfg.qk_norm:
      self.q_norm = _norm(cfg, h, names=("head_dim",), bias=False)
      if not kv_shared:
        self.k_norm = _norm(cfg, h, names=("head_dim",), bias=False)
    if cfg.attn_out_bias:
      self.o_bias = _param(None, (d,), ("embed",), pd, init="zeros")
    if cfg.attention_sinks:
      self.sinks = _param(rngs, (n,), ("heads",), pd, std=std)
    if cfg.attn_output_gate:
      self.q_gate = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd, std=std)

  def _init_latent(self, cfg: ModelConfig, rngs: nnx.Rngs):
    pd, std = _dtype(cfg.param_dtype), cfg.init_std
    d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
    rq, rkv, hr = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    # The latents' norms: transformers' DeepSeek RMSNorm default eps, whatever the layers'.
    latent_norm = lambda r: RMSNorm(r, 1e-6, pd, ("latent",))  # noqa: E731
    if rq:
      self.q_a_proj = _param(rngs, (d, rq), ("embed", "latent"), pd, std=std)
      self.q_a_norm = latent_norm(rq)
      self.q_b_proj = _param(rngs, (rq, n, h), ("latent", "heads", "head_dim"), pd, std=std)
    else:
      self.q_proj = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd, std=std)
    self.kv_a_proj = _param(rngs, (d, rkv), ("embed", "latent"), pd, std=std)
    self.kv_a_norm = latent_norm(rkv)
    self.k_rope_proj = _param(rngs, (d, hr), ("embed", "head_dim"), pd, std=std)
    self.k_b_proj = _param(rngs, (rkv, n, h - hr), ("latent", "heads", "head_dim"), pd,
                           std=std)
    self.v_b_proj = _param(rngs, (rkv, n, cfg.v_head_dim), ("latent", "heads", "head_dim"),
                           pd, std=std)
    if cfg.index_topk:  # DeepSeek Sparse Attention's lightning indexer
      hi, di = cfg.index_heads, cfg.index_head_dim
      self.index_q_proj = _param(rngs, (rq, hi, di), ("latent", "heads", "head_dim"), pd,
                                 std=std)
      self.index_k_proj = _param(rngs, (d, di), ("embed", "head_dim"), pd, std=std)
      self.index_k_norm_scale = _param(None, (di,), ("head_dim",), pd, init="ones")
      self.index_k_norm_bias = _param(None, (di,), ("head_dim",), pd, init="zeros")
      self.index_weights_proj = _param(rngs, (d, hi), ("embed", "heads"), pd, std=std)

  def _index_parts(self, x, q_in, cos, sin):
    """The indexer's queries [B, T, Hi, I] (from the query latent), head weights
    [B, T, Hi] and keys [B, T, I] (LayerNorm, eps 1e-6, over x index_k_proj), the first
    qk_rope_head_dim features of queries and keys rotated."""
    dt = _dtype(self.cfg.dtype)
    iq = jnp.einsum("BTR,RHI->BTHI", q_in, self.index_q_proj[...].astype(dt))
    ik = jnp.einsum("BTD,DI->BTI", x, self.index_k_proj[...].astype(dt)).astype(jnp.float32)
    mean = jnp.mean(ik, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(ik - mean), axis=-1, keepdims=True)
    ik = ((ik - mean) * jax.lax.rsqrt(var + 1e-6)
          * self.index_k_norm_scale[...].astype(jnp.float32)[None, None]
          + self.index_k_norm_bias[...].astype(jnp.float32)[None, None]).astype(dt)
    iw = jnp.einsum("BTD,DH->BTH", x, self.index_weights_proj[...].astype(dt))
    return (rope_lib.apply_rope(iq, cos, sin), iw,
            rope_lib.apply_rope(ik[:, :, None], cos, sin)[:, :, 0])

  def _sparse(self, keys: int) -> bool:
    """Whether attention over `keys` keys is sparse: DeepSeek Sparse Attention with more
    keys than a query chooses (at most index_topk keys, every one is chosen)."""
    return bool(self.cfg.index_topk) and keys > self.cfg.index_topk

  def _sm_scale(self) -> float:
    return self.cfg.attention_scale or float(self.cfg.head_dim) ** -0.5

  def _latent_block(self, q, k, v, index, segment_ids_BxT, ctx):
    """A latent layer's block attending to itself in the expanded form (training, a
    prefill): DeepSeek Sparse Attention where the block has more keys than index_topk,
    else the kernels' causal attention within segments."""
    if index is None or not self._sparse(q.shape[1]):
      return attend(self.cfg, q, k, v, segment_ids_BxT, ctx)
    pos = jnp.broadcast_to(jnp.arange(q.shape[1])[None], segment_ids_BxT.shape)
    return sparse_attention(q, k, v, *index, pos, pos, segment_ids_BxT, segment_ids_BxT,
                            self.cfg.index_topk, self._sm_scale())

  def _latent_qkv(self, x, cos, sin):
    """q, k, v [B, T, N, H] of multi-head latent attention, rotated: the keys' and values'
    latent c = RMSNorm(x kv_a_proj); k = [rope(x k_rope_proj), c k_b_proj] (the rotated
    part shared by every head, first), v = c v_b_proj zero-padded to H; q from q_proj,
    or through its own latent (q_a_proj, RMSNorm, q_b_proj), its first features rotated."""
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    if cfg.q_lora_rank:
      q_in = self.q_a_norm(jnp.einsum("BTD,DR->BTR", x, self.q_a_proj[...].astype(dt)))
      q = jnp.einsum("BTR,RNH->BTNH", q_in, self.q_b_proj[...].astype(dt))
    else:
      q_in = x
      q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...].astype(dt))
    q = _add_lora(self, "q_proj", q, q_in, "BTD,DR->BTR", "BTR,RNH->BTNH")
    latent = self.kv_a_norm(jnp.einsum("BTD,DR->BTR", x, self.kv_a_proj[...].astype(dt)))
    k_rope = jnp.einsum("BTD,DH->BTH", x, self.k_rope_proj[...].astype(dt))[:, :, None]
    k_rope = rope_lib.apply_rope(k_rope, cos, sin)
    k_nope = jnp.einsum("BTR,RNH->BTNH", latent, self.k_b_proj[...].astype(dt))
    k_nope = _add_lora(self, "k_proj", k_nope, latent, "BTD,DR->BTR", "BTR,RNH->BTNH")
    b, t, n, _ = k_nope.shape
    k = jnp.concatenate([jnp.broadcast_to(k_rope, (b, t, n, k_rope.shape[-1])), k_nope], -1)
    v = jnp.einsum("BTR,RNV->BTNV", latent, self.v_b_proj[...].astype(dt))
    v = _add_lora(self, "v_proj", v, latent, "BTD,DR->BTR", "BTR,RNH->BTNH")
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, cfg.head_dim - cfg.v_head_dim)))
    cached = jnp.concatenate([k_rope, latent[:, :, None]], -1)  # [B, T, 1, Hr + R]
    index = self._index_parts(x, q_in, cos, sin) if cfg.index_topk else None
    return rope_lib.apply_rope(q, cos, sin), k, v, cached, index

  def _latent_read(self, q, cache: KVCache, positions_BxT, layer, index=None):
    """Cached multi-head latent attention, absorbed: each head's query against the
    latent cache is [q's rotated part, q's unrotated part . k_b_proj] (one cache head of
    Hr + R features, read as keys and values both), and the output's latent part goes
    through v_b_proj: [B, T, N, v_head_dim]. The same function as the expanded form.
    With DeepSeek Sparse Attention over more slots than index_topk, `index` (the
    indexer's queries and weights) picks each query's keys among the cached index keys
    (the cache's v)."""
    import kernels
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    hr = cfg.qk_rope_head_dim
    q_nope = q[..., hr:]
    q_latent = jnp.einsum("BTNH,RNH->BTNR", q_nope, self.k_b_proj[...].astype(dt))
    if hasattr(self, "k_proj_lora_a"):  # k_b_proj + s A B, absorbed: (q B^T) A^T
      qb = jnp.einsum("BTNH,rNH->BTNr", q_nope, self.k_proj_lora_b[...].astype(dt))
      q_latent = q_latent + (cfg.lora_scale * jnp.einsum(
          "BTNr,Rr->BTNR", qb, self.k_proj_lora_a[...].astype(dt))).astype(dt)
    q_abs = jnp.concatenate([q[..., :hr], q_latent], -1)
    if self._sparse(cache.k.shape[-2]):
      def read(x, scale):  # this layer's [B, S, F] (int8: dequantized)
        if layer is not None:
          x, scale = x[layer], None if scale is None else scale[layer]
        x = x[:, 0]
        if scale is not None:
          x = (x.astype(jnp.float32) * scale[:, 0, :, None]).astype(dt)
        return x
      latent, keys = read(cache.k, cache.k_scale), read(cache.v, cache.v_scale)
      b, slots = latent.shape[:2]
      k_pos = jnp.broadcast_to(jnp.arange(slots)[None], (b, slots))
      ones = jnp.ones((b, slots), jnp.int32)
      out = sparse_attention(q_abs, latent[:, :, None], latent[:, :, None], *index, keys,
                             positions_BxT, k_pos, (positions_BxT >= 0).astype(jnp.int32),
                             ones, cfg.index_topk, self._sm_scale())
    else:
      out = kernels.decode_attention(
          q_abs, cache.k, cache.k, lengths=positions_BxT[:, -1] + 1, k_scale=cache.k_scale,
          v_scale=cache.k_scale, chunk_size=decode_chunk_for(cfg), kv_layout="bksh",
          finite_tail=True, layer=layer, sm_scale=self._sm_scale())
    out_latent = out[..., hr:].astype(dt)
    values = jnp.einsum("BTNR,RNV->BTNV", out_latent, self.v_b_proj[...].astype(dt))
    if hasattr(self, "v_proj_lora_a"):  # v_b_proj + s A B: (o A) B
      oa = jnp.einsum("BTNR,Rr->BTNr", out_latent, self.v_proj_lora_a[...].astype(dt))
      values = values + (cfg.lora_scale * jnp.einsum(
          "BTNr,rNV->BTNV", oa, self.v_proj_lora_b[...].astype(dt))).astype(dt)
    return values

  def _sinks(self):
    """The sink logits [heads] in float32, or None."""
    return self.sinks[...].astype(jnp.float32) if self.cfg.attention_sinks else None

  def __call__(self, x_BxTxD, cos, sin, segment_ids_BxT, cache: KVCache | None,
               positions_BxT, ctx: ShardingContext, prefill: bool = False, layer=None,
               sliding=False, nope=False, shared=None, keep_kv: bool = False):
    """With `layer` (an int32 scalar), `cache` stacks every layer's arrays ([L, ...]):
    this layer's keys and values are written in place at that index, and the whole
    stacked cache is returned. `sliding`: a sliding-window layer, a Python bool or (a scan
    over layers of both kinds) a traced one, which picks the attention at run time.
    `nope`: a NoPE layer (cfg.rope_layers), a Python bool or a traced one; Llama 4's
    options (`_llama4`) read it. A layer sharing another's keys and values
    (`kv_shared`) takes them as `shared`, (k, v, that layer's cache or None), and holds
    no cache; with `keep_kv` the result ends with this layer's (k, v)."""
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    x = x_BxTxD.astype(dt)
    index = None
    if self.kv_shared:
      return self._shared_attention(x, cos, sin, segment_ids_BxT, positions_BxT, ctx,
                                    prefill, sliding, shared)
    if cfg.kv_lora_rank:
      q, k, v, latent, index = self._latent_qkv(x, cos, sin)
      q, k = self._llama4(q, k, positions_BxT, nope)  # Mistral 4's query scaling
    else:
      q, k, v = self._qkv(x, cos, sin)
      q, k = self._llama4(q, k, positions_BxT, nope)
    # Llama 4's chunked layers (the sliding ones, cfg.attention_chunk_size): training and
    # prefill attend within segments split at the chunks, decoding with local_chunk.
    chunk = cfg.attention_chunk_size
    chunk_ids = None
    if chunk and (cache is None or prefill):
      import kernels
      chunk_ids = kernels.local_chunk_segment_ids(segment_ids_BxT, positions_BxT, chunk)

    def ids(kind: bool):  # the segments a layer of this kind attends within
      return chunk_ids if chunk and kind else segment_ids_BxT

    def local(kind: bool):
      return chunk if chunk and kind else None
    q = ctx.constrain(q, ("batch", "length", "heads", "head_dim"))
    k = ctx.constrain(k, ("batch", "length", "kv_heads", "head_dim"))
    v = ctx.constrain(v, ("batch", "length", "kv_heads", "head_dim"))
    static = isinstance(sliding, (bool, np.bool_))
    if cfg.kv_lora_rank:  # the latent cache; training and a prefill attend expanded
      new_cache = None if cache is None else self._write(
          latent, None if index is None else index[2][:, :, None], segment_ids_BxT, cache,
          positions_BxT, ctx, prefill, layer, False, q.shape[1])
      out = (self._latent_block(q, k, v, index, segment_ids_BxT, ctx)
             if cache is None or prefill else
             self._latent_read(q, new_cache, positions_BxT, layer,
                               None if index is None else index[:2]))
    elif cache is None:
      def full(window: bool):
        return attend(cfg, q, k, v, ids(window), ctx, sliding=window, sinks=self._sinks())
      # Both kinds under one scan: the layer's flag picks a kernel, each one static.
      out = (full(bool(sliding)) if static else
             jax.lax.cond(sliding, lambda: full(True), lambda: full(False)))
      new_cache = None
    elif isinstance(cache, LayerKindCaches):
      # Both kinds under one scan, each kind's layers stacked apart, `layer` the index
      # among its kind: the keys go to both stacks, at an index past the other kind's
      # stack there (dropped), and the layer's flag picks the stack read and the kernel.
      # Written inside a lax.cond instead, XLA:TPU copied the stack a branch passes
      # through at every layer of every decode step.
      at = {kind: jnp.where(sliding == kind, layer, stack.k.shape[0])
            for kind, stack in ((False, cache.full), (True, cache.sliding))}
      new_cache = LayerKindCaches(*(
          self._write(k, v, segment_ids_BxT, stack, positions_BxT, ctx, prefill, at[kind],
                      kind, q.shape[1], drop=True)
          for kind, stack in ((False, cache.full), (True, cache.sliding))))
      read = lambda kind: self._read(  # noqa: E731
          q, k, v, ids(kind), new_cache.sliding if kind else new_cache.full,
          positions_BxT, ctx, prefill, layer, kind, local(kind))
      out = jax.lax.cond(sliding, lambda: read(True), lambda: read(False))
    elif not static:
      raise ValueError("a scanned model with layers of both kinds takes a LayerKindCaches "
                       "(build the cache with init_cache)")
    else:
      new_cache = self._write(k, v, segment_ids_BxT, cache, positions_BxT, ctx, prefill,
                              layer, bool(sliding), q.shape[1])
      out = self._read(q, k, v, ids(bool(sliding)), new_cache, positions_BxT, ctx, prefill,
                       layer, bool(sliding), local(bool(sliding)))
    out = ctx.constrain(out, ("batch", "length", "heads", "head_dim"))
    y = self._out(out, x)
    return (y, new_cache, (k, v)) if keep_kv else (y, new_cache)

  def _out(self, out, x):
    """o_proj of the attention's output [B, T, N, H] (`x` the layer's normed input)."""
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    out = out.astype(dt)
    if cfg.v_head_dim and cfg.v_head_dim < cfg.head_dim:  # MLA's padded values cut back
      out = out[..., :cfg.v_head_dim]
    if cfg.attn_output_gate:  # Qwen3-Next / Qwen3.5: out * sigmoid(x W_gate), per feature
      gate = jnp.einsum("BTD,DNH->BTNH", x, self.q_gate[...].astype(dt))
      out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dt)
    y = jnp.einsum("BTNH,NHD->BTD", out, self.o_proj[...].astype(dt))
    y = _add_lora(self, "o_proj", y, out, "BTNH,NHR->BTR", "BTR,RD->BTD")
    if cfg.attn_out_bias:
      y = y + self.o_bias[...].astype(dt)[None, None]
    return y

  def _shared_attention(self, x, cos, sin, segment_ids_BxT, positions_BxT, ctx, prefill,
                        sliding, shared):
    """(y, None): this layer's queries over the keys and values of the layer it shares
    them with: those it computed (training, a prefill) or its cache (decoding)."""
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    if shared is None:
      raise ValueError("a layer sharing another's keys and values needs them (shared=)")
    k, v, cache = shared
    q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...].astype(dt))
    q = _add_lora(self, "q_proj", q, x, "BTD,DR->BTR", "BTR,RNH->BTNH")
    if cfg.qk_norm:
      q = self.q_norm(q)
    q = ctx.constrain(rope_lib.apply_rope(q, cos, sin), ("batch", "length", "heads",
                                                          "head_dim"))
    window = bool(sliding)
    if cache is None or prefill:
      out = attend(cfg, q, k, v, segment_ids_BxT, ctx, sliding=window, sinks=self._sinks())
    else:
      out = self._read(q, None, None, segment_ids_BxT, cache, positions_BxT, ctx, False,
                       None, window)
    out = ctx.constrain(out, ("batch", "length", "heads", "head_dim"))
    return self._out(out, x), None


  def _llama4(self, q, k, positions_BxT, nope):
    """(q, k) after Llama 4's options: the rotary layers' q and k normed
    (cfg.qk_l2_norm), the NoPE layers' queries scaled by position
    (cfg.attn_temperature_tuning); and every layer's queries scaled by position
    (cfg.attn_position_scale, Ministral 3's). `nope` is a Python bool or a traced one (a
    scan over layers of both kinds: each result picked by it)."""
    cfg = self.cfg
    static = isinstance(nope, (bool, np.bool_))
    pick = ((lambda on_nope, on_rope: on_nope if nope else on_rope) if static else
            (lambda on_nope, on_rope: jnp.where(nope, on_nope, on_rope)))
    if cfg.qk_l2_norm:
      def l2(x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.norm_eps)
        return xf.astype(x.dtype)
      q, k = pick(q, l2(q)), pick(k, l2(k))
    if cfg.attn_temperature_tuning and not (static and not nope):
      p = positions_BxT.astype(jnp.float32)
      scale = jnp.log1p(jnp.floor((p + 1.0) / cfg.attn_floor_scale)) * cfg.attn_scale + 1.0
      scale = pick(scale, jnp.ones_like(scale))
      q = (q.astype(jnp.float32) * scale[:, :, None, None]).astype(q.dtype)
    if cfg.attn_position_scale:
      p = jnp.maximum(positions_BxT, 0).astype(jnp.float32)  # padding's -1: no scaling
      scale = 1.0 + cfg.attn_position_scale * jnp.log1p(
          jnp.floor(p / cfg.attn_position_scale_length))
      q = (q.astype(jnp.float32) * scale[:, :, None, None]).astype(q.dtype)
    return q, k

  def _qkv(self, x, cos, sin):
    """q [B, T, N, H], k and v [B, T, K, H], rotated."""
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...].astype(dt))
    k = jnp.einsum("BTD,DKH->BTKH", x, self.k_proj[...].astype(dt))
    q = _add_lora(self, "q_proj", q, x, "BTD,DR->BTR", "BTR,RNH->BTNH")
    k = _add_lora(self, "k_proj", k, x, "BTD,DR->BTR", "BTR,RKH->BTKH")
    if self.values_from_keys:  # Gemma 4's full layers: the keys' projection, unnormed
      v = k
    else:
      v = jnp.einsum("BTD,DKH->BTKH", x, self.v_proj[...].astype(dt))
      v = _add_lora(self, "v_proj", v, x, "BTD,DR->BTR", "BTR,RKH->BTKH")
    if cfg.v_norm:  # over each head, no weight (Gemma 4)
      v = _weightless_rms(v, cfg.norm_eps)
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(dt)[None, None]
      k = k + self.k_bias[...].astype(dt)[None, None]
      v = v + self.v_bias[...].astype(dt)[None, None]
    c = cfg.clip_qkv
    if c is not None:  # OLMo's: each projection clamped (OLMoE's v; its q, k below)
      q, k, v = ((x if cfg.clip_qkv_after_norm and x is not v else jnp.clip(x, -c, c))
                 for x in (q, k, v))
    if cfg.qk_norm and not cfg.qk_norm_after_rope:
      q, k = self.q_norm(q), self.k_norm(k)
    if c is not None and cfg.clip_qkv_after_norm:  # OLMoE's: the normed q and k clamped
      q, k = jnp.clip(q, -c, c), jnp.clip(k, -c, c)
    q, k = rope_lib.apply_rope(q, cos, sin), rope_lib.apply_rope(k, cos, sin)
    if cfg.qk_norm_after_rope:  # Hunyuan's: the rotated q and k normed
      q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v

  def _ring(self, cache: KVCache, sliding: bool, queries: int) -> bool:
    """A sliding layer's cache is a ring when it holds every key a call's queries read;
    shorter, it is the whole row's cache (slot = position), as a full layer's is."""
    window = self.cfg.sliding_window
    return bool(sliding and window) and cache.k.shape[-2] >= window + queries - 1

  def _write(self, k, v, segment_ids_BxT, cache: KVCache, positions_BxT, ctx, prefill,
             layer, sliding: bool, queries: int, drop: bool = False) -> KVCache:
    """The cache with this call's keys and values written (`write_cache`)."""
    window = self.cfg.sliding_window if sliding else None
    slots, t = cache.k.shape[-2], k.shape[1]
    if prefill:
      if t > slots and not (window and slots >= window):
        raise ValueError(f"a prefill of {t} tokens does not fit a cache of {slots} slots")
      new = write_cache(cache, k, v, positions_BxT, prefill=True, layer=layer,
                        ring=bool(window), segment_ids_BxT=segment_ids_BxT, drop=drop)
    else:
      new = write_cache(cache, k, v, positions_BxT, layer=layer,
                        ring=self._ring(cache, sliding, queries), drop=drop)
    return constrain_cache(new, ctx)

  def _read(self, q, k, v, segment_ids_BxT, cache: KVCache, positions_BxT, ctx, prefill,
            layer, sliding: bool, local_chunk=None):
    """Attention of the queries over the cache just written (of the block itself in a
    prefill, within `segment_ids_BxT`); `local_chunk`: the chunk a decoding query sees
    (Llama 4's chunked layers)."""
    cfg = self.cfg
    if prefill:
      # After a prefill's write the block holds every key (the cache was empty): the
      # training kernel (chunked / flash, causal within segments) is exact and never
      # scores the empty cache slots.
      return attend(cfg, q, k, v, segment_ids_BxT, ctx, sliding=sliding, sinks=self._sinks())
    import kernels
    lengths = positions_BxT[:, -1] + 1
    # Keys per block, as in chunked attention; blocks past the longest row (or before
    # the window) are skipped. The cache starts zeroed and is written only with the
    # model's keys and values, so slots past a row's length are finite and the kernel
    # need not zero them. A stacked cache (scan_layers) is read block by block at this
    # layer, in place.
    return kernels.decode_attention(
        q, cache.k, cache.v, lengths=lengths, k_scale=cache.k_scale,
        v_scale=cache.v_scale, chunk_size=decode_chunk_for(cfg), kv_layout="bksh",
        finite_tail=True, layer=layer, sm_scale=cfg.attention_scale,
        logits_soft_cap=cfg.attn_logit_softcap,
        sliding_window=cfg.sliding_window if sliding else None,
        ring=self._ring(cache, sliding, q.shape[1]), sinks=self._sinks(),
        local_chunk=local_chunk, alibi_slopes=alibi_slopes(cfg))

def write_cache(cache: KVCache, k_BxTxKxH, v_BxTxKxH, positions_BxT,
                prefill: bool = False, layer=None, ring: bool = False,
                segment_ids_BxT=None, drop: bool = False) -> KVCache:
  """Writes the new keys/values at their positions (slot = position), row by row.

  With `prefill` the block's keys fill slots 0..T-1 of every row (their positions): one
  slice update of the cache, which XLA keeps on each row's device. Scattered by row and
  position, it all-gathered every row's keys across the batch axes first (the prompt
  cache of every row on every device, at each layer).

  Indexed by (row, kv head, position), each [B, T, K] triple writing one head_dim vector:
  `cache.k[rows, heads, pos]` is [B, T, K, H], the keys' own layout, so they go in
  without a transpose. Updating one head's slot at a time, not a slot's [K, H] window,
  lets XLA:TPU keep the heads-major cache layout attention reads, in place; with [K, H]
  windows it copied every layer's whole cache between a slot-major and that layout at
  each decode step (`tests/models/test_transformer_tpu_compile.py` counts such copies).

  With `layer` (an int32 scalar) the cache stacks the layers ([L, B, K, S(, H)]) and the
  writes go to that layer's slots, in place in the stacked arrays: a scan over layers
  carries the whole cache and never copies a layer of it out and back.

  With `ring` (a sliding layer's ring buffer) position p goes in slot p % S. A prefill
  longer than the ring keeps each row's newest S keys, the row's length being its
  non-padding tokens (`segment_ids_BxT`, right padding; default all T).

  With `drop` a `layer` past the stack writes nothing (a prefill then scatters the block
  at the layer index instead of a slice update, which would clamp it).
  """
  at = () if layer is None else (layer,)
  slots = cache.k.shape[-2]
  if prefill and ring and k_BxTxKxH.shape[1] > slots:
    t = k_BxTxKxH.shape[1]
    n = (jnp.full((k_BxTxKxH.shape[0], 1), t, jnp.int32) if segment_ids_BxT is None else
         jnp.sum(segment_ids_BxT != 0, axis=1, dtype=jnp.int32)[:, None])
    # Slot s holds the row's newest position p = s (mod S); never-written slots take
    # position 0's key (finite, and read as no position at all).
    source = jnp.maximum(n - 1 - jnp.mod(n - 1 - jnp.arange(slots)[None], slots), 0)
    k_BxTxKxH, v_BxTxKxH = (None if x is None else
                            jnp.take_along_axis(x, source[:, :, None, None], axis=1)
                            for x in (k_BxTxKxH, v_BxTxKxH))
  if prefill:
    def put(c, x):  # x [B, T, K(, H)] into c [(L,) B, K, S(, H)] at slot 0
      x = jnp.swapaxes(x, 1, 2).astype(c.dtype)
      if drop and layer is not None:
        return c.at[layer, :, :, :x.shape[2]].set(x, mode="drop")
      if layer is not None:
        x = x[None]
      return jax.lax.dynamic_update_slice(c, x, at + (0,) * (c.ndim - len(at)))
    return _written(cache, k_BxTxKxH, v_BxTxKxH, put)
  b, t, kv_heads, _ = k_BxTxKxH.shape
  rows = jnp.arange(b)[:, None, None]
  heads = jnp.arange(kv_heads)[None, None, :]
  pos = (jnp.mod(positions_BxT, slots) if ring else
         jnp.clip(positions_BxT, 0, slots - 1))[:, :, None]
  idx = (*at, rows, heads, pos)
  set_ = lambda c, x: c.at[idx].set(x.astype(c.dtype), mode="drop")  # noqa: E731
  return _written(cache, k_BxTxKxH, v_BxTxKxH, set_)


def _written(cache: KVCache, k, v, write) -> KVCache:
  """The cache with `write(array, new)` applied to each of its arrays (int8: the new keys
  and values quantized, with their scales); a latent cache has no v."""
  if cache.k_scale is None:
    return KVCache(write(cache.k, k), None if cache.v is None else write(cache.v, v))
  import kernels
  k, k_scale = kernels.quantize_int8(k)
  if cache.v is None:
    return KVCache(write(cache.k, k), None, write(cache.k_scale, k_scale), None)
  v, v_scale = kernels.quantize_int8(v)
  return KVCache(write(cache.k, k), write(cache.v, v), write(cache.k_scale, k_scale),
                 write(cache.v_scale, v_scale))


@jax.custom_vjp
def swiglu(gate, up):
  """silu(gate) * up, with a backward pass that saves only its two inputs.

  Autodiff of `jax.nn.silu(gate) * up` keeps sigmoid(gate) and silu(gate) as well and
  spends separate element-wise passes on them; here the forward is one fused pass and the
  backward recomputes the sigmoid inside the one pass that makes both gradients.
  """
  return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dh):
  gate, up = res
  g, u, d = (x.astype(jnp.float32) for x in (gate, up, dh))
  sig = jax.nn.sigmoid(g)
  dgate = d * u * sig * (1.0 + g * (1.0 - sig))
  dup = d * g * sig
  return dgate.astype(gate.dtype), dup.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


_GELU_C = float(np.sqrt(2.0 / np.pi))


@jax.custom_vjp
def geglu(gate, up):
  """gelu(gate) * up with tanh-approximate GELU (Gemma's gelu_pytorch_tanh), with a
  backward pass that, like `swiglu`'s, saves only its two inputs: autodiff of the tanh
  form keeps five more [tokens, F] intermediates a layer."""
  return jax.nn.gelu(gate, approximate=True) * up


def _geglu_fwd(gate, up):
  return geglu(gate, up), (gate, up)


def _geglu_bwd(res, dh):
  gate, up = res
  g, u, d = (x.astype(jnp.float32) for x in (gate, up, dh))
  t = jnp.tanh(_GELU_C * (g + 0.044715 * g * g * g))
  gelu = 0.5 * g * (1.0 + t)
  dgelu = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * g * g)
  return (d * u * dgelu).astype(gate.dtype), (d * gelu).astype(up.dtype)


geglu.defvjp(_geglu_fwd, _geglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def clamped_swiglu(gate, up, limit: float, alpha: float):
  """gpt-oss's gated activation: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
  g = min(gate, limit), in float32, cast back to gate's dtype. Its backward, like
  `swiglu`'s, saves only the two inputs; the clamps pass gradient where the input lies
  within them, bounds included (as torch's clamp)."""
  g = jnp.minimum(gate.astype(jnp.float32), limit)
  u = jnp.clip(up.astype(jnp.float32), -limit, limit)
  return ((u + 1.0) * g * jax.nn.sigmoid(alpha * g)).astype(gate.dtype)


def _clamped_swiglu_fwd(gate, up, limit, alpha):
  return clamped_swiglu(gate, up, limit, alpha), (gate, up)


def _clamped_swiglu_bwd(limit, alpha, res, dh):
  gate, up = res
  x, y, d = (a.astype(jnp.float32) for a in (gate, up, dh))
  g, u = jnp.minimum(x, limit), jnp.clip(y, -limit, limit)
  sig = jax.nn.sigmoid(alpha * g)
  dgate = jnp.where(x <= limit, d * (u + 1.0) * sig * (1.0 + alpha * g * (1.0 - sig)), 0.0)
  dup = jnp.where((y >= -limit) & (y <= limit), d * g * sig, 0.0)
  return dgate.astype(gate.dtype), dup.astype(up.dtype)


clamped_swiglu.defvjp(_clamped_swiglu_fwd, _clamped_swiglu_bwd)


_GATED = {"silu": swiglu, "gelu_tanh": geglu}


def gated_activation(cfg: ModelConfig):
  """`fn(gate, up)` of cfg.mlp_activation."""
  if cfg.mlp_activation == "clamped_swiglu":
    return lambda gate, up: clamped_swiglu(gate, up, cfg.swiglu_limit, cfg.swiglu_alpha)
  return _GATED[cfg.mlp_activation]


class MLP(nnx.Module):
  """A gated MLP: down(act(gate(x)) * up(x)), act silu (SwiGLU) or tanh-approximate GELU
  (GeGLU, cfg.mlp_activation); with mlp_activation relu2 no gate: down(relu(up(x))^2)
  (Nemotron-H). Falcon-H1's cfg.mlp_gate_multiplier scales gate(x) before the activation
  and cfg.mlp_down_multiplier the output."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None):
    """`width`: the hidden width F (default cfg.ffn_dim; a mixture's shared expert and
    dense layers have their own)."""
    self.cfg = cfg
    pd, std = _dtype(cfg.param_dtype), cfg.init_std
    f = width or cfg.ffn_dim
    if not cfg.ungated:
      self.gate_proj = _param(rngs, (cfg.d_model, f), ("embed", "mlp"), pd, std=std)
    self.up_proj = _param(rngs, (cfg.d_model, f), ("embed", "mlp"), pd, std=std)
    self.down_proj = _param(rngs, (f, cfg.d_model), ("mlp", "embed"), pd, std=std)
    if cfg.mlp_bias:  # StarCoder2's, Jais 2's
      if not cfg.ungated:
        self.gate_bias = _param(None, (f,), ("mlp",), pd, init="zeros")
      self.up_bias = _param(None, (f,), ("mlp",), pd, init="zeros")
      self.down_bias = _param(None, (cfg.d_model,), ("embed",), pd, init="zeros")
    if cfg.mlp_activation == "xielu":  # Apertus: xIELU's learned scales, as HF holds them
      # (before their softplus: alpha_p 0.8 and alpha_n 0.8 at init), its fixed beta / eps
      inverse = lambda v: float(np.log(np.expm1(v)))  # noqa: E731  softplus's inverse
      self.xielu_alpha_p = nnx.Param(jnp.full((1,), inverse(0.8), pd), logical_axes=(None,))
      self.xielu_alpha_n = nnx.Param(jnp.full((1,), inverse(0.8 - 0.5), pd),
                                     logical_axes=(None,))
      self.xielu_beta = nnx.Param(jnp.asarray(0.5, pd), logical_axes=())
      self.xielu_eps = nnx.Param(jnp.asarray(-1e-6, pd), logical_axes=())

  def __call__(self, x_BxTxD, ctx: ShardingContext):
    dt = _dtype(self.cfg.dtype)
    b, t, d = x_BxTxD.shape
    # 2-D matmuls over [B*T, D]: XLA:CPU's backward of the 3-D einsums transposes every
    # activation (about 2x slower train step); on TPU/GPU both lower to the same dots.
    x_NxD = x_BxTxD.astype(dt).reshape(b * t, d)
    up_NxF = _add_lora(self, "up_proj", x_NxD @ self.up_proj[...].astype(dt), x_NxD,
                       "ND,DR->NR", "NR,RF->NF")
    if self.cfg.mlp_bias:
      up_NxF = up_NxF + self.up_bias[...].astype(dt)[None]
    if self.cfg.mlp_activation == "relu2":
      h_NxF = jnp.square(jax.nn.relu(up_NxF))
    elif self.cfg.mlp_activation == "relu_ungated":  # OPT's
      h_NxF = jax.nn.relu(up_NxF)
    elif self.cfg.mlp_activation in ("gelu_tanh_ungated", "gelu_ungated"):
      h_NxF = jax.nn.gelu(up_NxF, approximate=self.cfg.mlp_activation == "gelu_tanh_ungated")
    elif self.cfg.mlp_activation == "xielu":
      h_NxF = self._xielu(up_NxF)
    else:
      gate_NxF = _add_lora(self, "gate_proj", x_NxD @ self.gate_proj[...].astype(dt), x_NxD,
                           "ND,DR->NR", "NR,RF->NF")
      if self.cfg.mlp_bias:
        gate_NxF = gate_NxF + self.gate_bias[...].astype(dt)[None]
      if self.cfg.mlp_gate_multiplier != 1.0:  # Falcon-H1's, in the compute dtype as its
        gate_NxF = gate_NxF * jnp.asarray(self.cfg.mlp_gate_multiplier, gate_NxF.dtype)
      h_NxF = gated_activation(self.cfg)(gate_NxF, up_NxF)
    h = ctx.constrain(h_NxF.reshape(b, t, -1), ("batch", "length", "mlp"))
    h_NxF = h.reshape(b * t, -1)
    y_NxD = _add_lora(self, "down_proj", h_NxF @ self.down_proj[...].astype(dt), h_NxF,
                      "NF,FR->NR", "NR,RD->ND")
    if self.cfg.mlp_bias:
      y_NxD = y_NxD + self.down_bias[...].astype(dt)[None]
    if self.cfg.mlp_down_multiplier != 1.0:
      y_NxD = y_NxD * jnp.asarray(self.cfg.mlp_down_multiplier, y_NxD.dtype)
    return y_NxD.reshape(b, t, d)

  def _xielu(self, x):
    """Apertus's xIELU: alpha_p x^2 + beta x for x > 0, else
    (expm1(min(x, eps)) - x) alpha_n + beta x, alpha_p = softplus(its parameter) and
    alpha_n = beta + softplus(its), in x's dtype as transformers computes it; beta and eps
    (buffers in transformers') take no gradient."""
    dt = x.dtype
    beta = jax.lax.stop_gradient(self.xielu_beta[...]).astype(dt)
    eps = jax.lax.stop_gradient(self.xielu_eps[...]).astype(dt)
    alpha_p = jax.nn.softplus(self.xielu_alpha_p[...][0].astype(dt))
    alpha_n = beta + jax.nn.softplus(self.xielu_alpha_n[...][0].astype(dt))
    return jnp.where(x > 0, alpha_p * x * x + beta * x,
                     (jnp.expm1(jnp.minimum(x, eps)) - x) * alpha_n + beta * x)


def route(x_NxD, router_DxE, top_k: int, normalize: bool, return_probs: bool = False,
          bias_E=None, *, scoring: str = "softmax", correction_E=None, groups: int = 1,
          group_topk: int = 1, scale: float = 1.0, experts_NxK=None,
          jitter_eps: float = 0.01):
  """(weights [N, k] float32, experts [N, k] int32): each token's top-k experts.

  softmax scoring: by the router's softmax (in float32; the logits plus `bias_E` when
  given), the weights rescaled to sum to one with `normalize` (gpt-oss's softmax over
  the top-k logits); with `groups`, among the experts of the `group_topk` groups with the
  best single probability (DeepSeek-V2's group_limited_greedy); with `correction_E`
  (ERNIE 4.5), the top-k of the probabilities plus it (no gradient), weighted by the
  probabilities, the logits from float32 inputs.

  sigmoid scoring (GLM-4.5, DeepSeek-V3): each expert scores sigmoid(logit), the logits
  from float32 inputs; the top-k is chosen on the scores plus `correction_E` (which
  takes no gradient), among the experts of the `group_topk` best of `groups` equal
  groups (each ranked by the sum of its two best corrected scores); the weights are the
  chosen experts' own scores, rescaled to sum to one with `normalize`.

  sparsemixer scoring (PhiMoE, `sparsemixer`): the experts by the logits, each weighted
  by the softmax over the logits within 2 `jitter_eps` of its own; `normalize` unused.

  Either way the weights are then multiplied by `scale`. With `return_probs` also each
  token's distribution over experts [N, E] (the softmax; the scores normalised to sum
  to one), what the load-balancing loss reads.

  `experts_NxK` (routing replay): the experts each token takes, chosen elsewhere (by the
  sampler, or the policy before the update); the weights are the router's own
  probabilities (scores) of those experts, rescaled and scaled as above, so the router
  still learns from the loss.
  """
  if experts_NxK is not None:
    experts_NxK = experts_NxK.astype(jnp.int32)
  if scoring == "sparsemixer":
    logits = jnp.einsum("ND,DE->NE", x_NxD, router_DxE.astype(x_NxD.dtype),
                        preferred_element_type=jnp.float32)
    weights, experts = sparsemixer(logits, top_k, jitter_eps, experts_NxK)
    probs = jax.nn.softmax(logits, axis=-1)
  elif scoring == "sigmoid":
    logits = jnp.einsum("ND,DE->NE", x_NxD.astype(jnp.float32),
                        router_DxE.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    choice = scores
    if correction_E is not None:
      choice = choice + jax.lax.stop_gradient(correction_E.astype(jnp.float32))[None]
    choice = jax.lax.stop_gradient(choice)
    if experts_NxK is not None:
      experts = experts_NxK
    elif groups > 1:
      n, e = choice.shape
      grouped = choice.reshape(n, groups, e // groups)
      group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
      _, best = jax.lax.top_k(group_scores, group_topk)
      keep = jnp.any(best[:, :, None] == jnp.arange(groups)[None, None], axis=1)
      choice = jnp.where(jnp.repeat(keep, e // groups, axis=1), choice, -jnp.inf)
      _, experts = jax.lax.top_k(choice, top_k)
    else:
      _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  else:
    if correction_E is not None:  # ERNIE 4.5: the router in float32
      x_NxD = x_NxD.astype(jnp.float32)
    logits = jnp.einsum("ND,DE->NE", x_NxD, router_DxE.astype(x_NxD.dtype),
                        preferred_element_type=jnp.float32)
    if bias_E is not None:
      logits = logits + bias_E.astype(jnp.float32)[None]
    probs = jax.nn.softmax(logits, axis=-1)
    if experts_NxK is not None:
      experts = experts_NxK
      weights = jnp.take_along_axis(probs, experts, axis=-1)
    elif correction_E is not None:
      choice = probs + correction_E.astype(jnp.float32)[None]
      _, experts = jax.lax.top_k(jax.lax.stop_gradient(choice), top_k)
      weights = jnp.take_along_axis(probs, experts, axis=-1)
    elif groups > 1:
      n, e = probs.shape
      _, best = jax.lax.top_k(jnp.max(probs.reshape(n, groups, e // groups), axis=-1),
                              group_topk)
      keep = jnp.any(best[:, :, None] == jnp.arange(groups)[None, None], axis=1)
      choice = jnp.where(jnp.repeat(keep, e // groups, axis=1), probs, -jnp.inf)
      _, experts = jax.lax.top_k(jax.lax.stop_gradient(choice), top_k)
      weights = jnp.take_along_axis(probs, experts, axis=-1)
    else:
      weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  if scale != 1.0:
    weights = weights * scale
  return (weights, experts.astype(jnp.int32)) + ((probs,) if return_probs else ())


def sparsemixer(logits_NxE, top_k: int, jitter_eps: float, experts_NxK=None):
  """(weights [N, k], experts [N, k] int32) of PhiMoE's sparsemixer as transformers runs
  it in evaluation: expert i is the best logit not yet chosen (or `experts_NxK`'s i-th),
  weighted by the softmax over the logits not yet chosen whose distance below its own,
  relative to max(|logit|, its own), is at most 2 `jitter_eps`. The band is chosen
  without gradient; the weights' gradient is the softmax's."""
  e = logits_NxE.shape[1]
  free = logits_NxE  # the logits not yet chosen (-inf once chosen)
  weights, experts = [], []
  for i in range(top_k):
    top = (jnp.argmax(jax.lax.stop_gradient(free), axis=-1).astype(jnp.int32)
           if experts_NxK is None else experts_NxK[:, i])
    own = jax.lax.stop_gradient(jnp.take_along_axis(free, top[:, None], axis=-1))
    factor = jnp.maximum(jnp.abs(jax.lax.stop_gradient(logits_NxE)), own)
    # (not >, as transformers masks: a 0 / 0 stays in the band)
    band = ~((own - jax.lax.stop_gradient(logits_NxE)) / factor > 2 * jitter_eps)
    gates = jax.nn.softmax(jnp.where(band, free, -jnp.inf), axis=-1)
    weights.append(jnp.take_along_axis(gates, top[:, None], axis=-1)[:, 0])
    experts.append(top)
    free = jnp.where(jnp.arange(e)[None] == top[:, None], -jnp.inf, free)
  return jnp.stack(weights, -1), jnp.stack(experts, -1)


def routing_dtype(cfg: ModelConfig):
  """The integer type recorded routing is held in (the sampler's record, a batch's):
  uint8 for up to 256 experts, int16 up to 32,767, else int32."""
  return (jnp.uint8 if cfg.num_experts <= 256 else
          jnp.int16 if cfg.num_experts < 2**15 else jnp.int32)


class RouterStats(NamedTuple):
  """Sums over a layer's (or layers') tokens for the load-balancing loss: assignments
  per expert [E] (each token counts its k experts), router probabilities per expert [E],
  and tokens []. Padding tokens count nothing."""

  assigned: jax.Array
  probs: jax.Array
  tokens: jax.Array


def load_balancing_loss(stats: RouterStats, num_experts: int) -> jax.Array:
  """E * sum_e (assigned_e / tokens) (probs_e / tokens), over every layer's tokens pooled,
  as `transformers` computes a mixture's aux loss (uniform routing gives k)."""
  n = jnp.maximum(stats.tokens, 1.0)
  return num_experts * jnp.sum((stats.assigned / n) * (stats.probs / n))


# Up to this many bytes of gathered [rows, r, in] adapters, `expert_mlps` gathers each
# sorted row's LoRA A rather than run a grouped matmul over them.
_GATHERED_A_BYTES = 64 * 2**20


def expert_mlps(x_NxD, weights_NxK, experts_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, *,
                activation=None, gate_bias_ExF=None, up_bias_ExF=None, lora=None,
                lora_scale: float = 1.0, scale_inputs: bool = False):
  """sum_k weights[n, k] * SwiGLU_{experts[n, k]}(x[n]) [N, D] float32, dropless; with
  `scale_inputs`, sum_k SwiGLU_{experts[n, k]}(weights[n, k] * x[n]) (Llama 4: each row's
  input scaled in x's dtype, as transformers does). `gate_ExDxF` None: experts without a
  gate, relu(x up)^2 down (Nemotron 3).
  `activation`: fn(gate, up) in SwiGLU's place; the biases are added to each expert's
  gate and up projections (a down projection's bias is the caller's, added once after
  any sum over F slices). `lora`: each expert's LoRA adapters (`MoE._adapters`), any of
  "gate_up" (A [E, r, D], B [E, r, 2, F]: gate's F columns, then up's), "up" (experts
  without a gate: A [E, r, D], B [E, r, F]) and "down" (A [E, r, F], B [E, r, D]), each
  adding lora_scale * (x A_e^T) B_e to its projections
  through two more grouped matmuls (A transposed in the first). With F split, down's A
  holds the slice's columns: its share of the update sums over the slices as the
  outputs do.

  The N * k (token, expert) pairs are sorted by expert and each expert's run goes through
  its weights with `kernels.grouped_matmul` (`jax.lax.ragged_dot`, a grouped-matmul
  kernel on TPU, and a Pallas kernel for the weight gradient there; XLA:CPU expands it
  densely). No capacity: no token is dropped, whatever the routing. With F split
  (each device holding a slice of every expert), the result is that slice's share. An
  expert id of E (a pair another device runs: `MoE._expert_parallel`) sorts last, in no
  group: its rows are never multiplied and come out zero, its biases zero.
  """
  import kernels
  n, k = experts_NxK.shape
  flat = experts_NxK.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=up_ExDxF.shape[0]).astype(jnp.int32)
  x_sorted = jnp.take(x_NxD, order // k, axis=0)
  if scale_inputs:
    row_weights = jnp.take(weights_NxK.reshape(-1), order).astype(x_sorted.dtype)
    x_sorted = x_sorted * row_weights[:, None]
  gated = gate_ExDxF is not None
  gate = kernels.grouped_matmul(x_sorted, gate_ExDxF, sizes) if gated else None
  up = kernels.grouped_matmul(x_sorted, up_ExDxF, sizes)
  lora = lora or {}

  def adapted(x, name, out_dtype=None):  # lora_scale * (x A_e^T) B_e, e each row's expert
    a, b = lora[name]
    if x.shape[0] * a[0].size * x.dtype.itemsize <= _GATHERED_A_BYTES:
      # Few rows (decoding): each row's A gathered, [M, r, in]. A grouped matmul would
      # read A with the rank minor, which XLA:TPU lays out in a copy of every layer's
      # A padded to 128 lanes, kept through the decode loop.
      rows_a = jnp.take(a.astype(x.dtype), jnp.take(flat, order), axis=0, mode="fill",
                        fill_value=0)
      xa = jnp.einsum("MK,MRK->MR", x, rows_a)
    else:
      xa = kernels.grouped_matmul(x, a.astype(x.dtype), sizes, None, True)
    xab = kernels.grouped_matmul(xa, b.reshape(b.shape[0], b.shape[1], -1).astype(x.dtype),
                                 sizes, out_dtype)
    return lora_scale * xab

  if "gate_up" in lora:
    gate_up = adapted(x_sorted, "gate_up")
    gate = gate + gate_up[:, :gate.shape[1]].astype(gate.dtype)
    up = up + gate_up[:, gate.shape[1]:].astype(up.dtype)
  if "up" in lora:  # experts without a gate
    up = up + adapted(x_sorted, "up").astype(up.dtype)
  if gate_bias_ExF is not None:  # each sorted row's expert's bias (an id past E: zero)
    expert_sorted = jnp.take(flat, order)
    gate = gate + jnp.take(gate_bias_ExF, expert_sorted, axis=0, mode="fill",
                           fill_value=0).astype(gate.dtype)
    up = up + jnp.take(up_bias_ExF, expert_sorted, axis=0, mode="fill",
                       fill_value=0).astype(up.dtype)
  if gated:
    h = (swiglu if activation is None else activation)(gate, up)
  else:  # relu^2, no gate
    h = jnp.square(jax.nn.relu(up))
  y_sorted = kernels.grouped_matmul(h, down_ExFxD, sizes, jnp.float32)
  if "down" in lora:
    y_sorted = y_sorted + adapted(h, "down", jnp.float32)
  # A down projection padded past D (the sampler's copy: `Sampler._expert_padding`)
  # computes zero columns after D.
  y_sorted = y_sorted[:, :x_NxD.shape[1]]
  # Back to token order (a gather by the inverse permutation; its gradient is a gather too).
  y = jnp.take(y_sorted, jnp.argsort(order), axis=0).reshape(n, k, -1)
  if scale_inputs:
    return jnp.sum(y, axis=1)
  return jnp.einsum("NKD,NK->ND", y, weights_NxK.astype(jnp.float32))


class MoE(nnx.Module):
  """A sparse mixture of SwiGLU experts (Qwen3-MoE, Mixtral): a router [D, E] picks each
  token's `num_experts_per_tok` experts; their outputs are summed, weighted by the
  router's probabilities (`route`). Experts [E, D, F] / [E, F, D]. With
  cfg.shared_expert_dim a dense MLP (`shared`) that every token runs is added
  (Qwen2-MoE scales it by sigmoid(x . shared_gate)); with sigmoid routing the router has
  a `score_correction_bias` [E] that only the choice of experts reads (GLM-4.5,
  DeepSeek-V3), which no gradient reaches. LoRA on the routed experts
  (EXPERT_LORA_TARGETS) gives each expert its own adapters, `experts_gate_up_proj_lora_a`
  [E, r, D] / `_b` [E, r, 2, F] (`experts_up_proj_lora_a` / `_b` [E, r, D] / [E, r, F]
  for experts without a gate) and `experts_down_proj_lora_a` [E, r, F] / `_b` [E, r, D]
  (`expert_mlps` runs them). With mlp_activation relu2 the experts and the shared
  expert have no gate (Nemotron 3); with cfg.moe_latent_dim the routed experts read and
  write a latent of that width (`latent_in` [D, L], `latent_out` [L, D]).

  On a mesh the layer runs in `shard_map`: each device routes and runs its own tokens
  through every expert (the experts' D gathered over fsdp like a dense layer's, F split
  over the "mlp" axes with the partial outputs summed there). Tokens never leave their
  device, whatever the routing.

  Expert parallelism, where the rules split the logical "experts" axis over mesh axes
  (the "ep" axes, e.g. ("experts", ("fsdp",))): each device holds and runs only its E / ep
  experts, never gathering the others (`_expert_parallel`). Each device routes its own
  tokens as above, then the tokens and their routing are all-gathered over the ep axes
  that split the tokens, each device runs the (token, expert) pairs of its experts, and
  the weighted sums are reduce-scattered back to the tokens' devices (all-gather and
  reduce-scatter, no all-to-all: dropless, nothing to size).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    pd, std = _dtype(cfg.param_dtype), cfg.init_std
    e, d, f = cfg.num_experts, cfg.d_model, cfg.ffn_dim
    self.router = _param(rngs, (d, e), ("embed", "experts"), pd, std=std)
    if cfg.moe_latent_dim:  # the experts' own width, between two projections
      lat = cfg.moe_latent_dim
      self.latent_in = _param(rngs, (d, lat), ("embed", "latent"), pd, std=std)
      self.latent_out = _param(rngs, (lat, d), ("latent", "embed"), pd, std=std)
      d = lat
    if not cfg.ungated:
      self.gate_proj = _param(rngs, (e, d, f), ("experts", "embed", "mlp"), pd, std=std)
    self.up_proj = _param(rngs, (e, d, f), ("experts", "embed", "mlp"), pd, std=std)
    self.down_proj = _param(rngs, (e, f, d), ("experts", "mlp", "embed"), pd, std=std)
    if cfg.router_bias:
      self.router_bias = _param(rngs, (e,), ("experts",), pd, std=std)
    if cfg.expert_bias:
      self.gate_bias = _param(None, (e, f), ("experts", "mlp"), pd, init="zeros")
      self.up_bias = _param(None, (e, f), ("experts", "mlp"), pd, init="zeros")
      self.down_bias = _param(None, (e, d), ("experts", "embed"), pd, init="zeros")
    if cfg.has_correction_bias:
      # float32, as transformers keeps it
      self.score_correction_bias = _param(None, (e,), ("experts",), jnp.float32,
                                          init="zeros")
    if cfg.shared_expert_dim:
      self.shared = MLP(cfg, rngs, cfg.shared_expert_dim)
    if cfg.shared_expert_gate:
      self.shared_gate = _param(rngs, (d,), ("embed",), pd, std=std)
    if cfg.moe_input_norms:  # Gemma 4's
      self.pre_norm = _norm(cfg, d)
      self.shared_out_norm = _norm(cfg, d)
      self.routed_out_norm = _norm(cfg, d)
      self.router_scale = _param(None, (d,), ("embed",), pd, init="ones")
      self.per_expert_scale = _param(None, (e,), ("experts",), pd, init="ones")

  def __call__(self, x_BxTxD, ctx: ShardingContext, segment_ids_BxT=None,
               router_stats: bool = False, experts=None, record_experts: bool = False,
               residual=None):
    """[B, T, D]; with `router_stats`, also this layer's `RouterStats` over every
    device's tokens (segment id 0 = padding, not counted).

    `experts` [B, T, k] int (routing replay): each token's experts, taken as given
    (`route`'s experts_NxK). With `record_experts`, returns (y, the stats or None, the
    experts the router chose for each token [B, T, k] int32: with `experts` given, those
    it would have chosen, not those taken). With cfg.moe_input_norms the router and the
    routed experts read `residual` (the residual stream, un-normed), the shared expert
    x_BxTxD."""
    cfg = self.cfg
    if cfg.moe_input_norms:
      if residual is None:
        raise ValueError("a mixture with moe_input_norms reads the residual stream: pass "
                         "residual=")
      r = residual.astype(jnp.float32)
      r = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + cfg.norm_eps)
      dt = residual.dtype
      router_in = (r.astype(dt) * self.router_scale[...].astype(dt)[None, None]
                   * jnp.asarray(cfg.d_model ** -0.5, dt))
      y, stats, chosen = self._routed(self.pre_norm(residual), ctx, segment_ids_BxT,
                                      router_stats, experts, record_experts, router_in)
      y = self.routed_out_norm(y)
      y = y + self.shared_out_norm(self.shared(x_BxTxD, ctx)).astype(y.dtype)
    else:
      y, stats, chosen = self._routed(x_BxTxD, ctx, segment_ids_BxT, router_stats, experts,
                                      record_experts)
    if cfg.shared_expert_dim and not cfg.moe_input_norms:
      y = self._add_shared(x_BxTxD, ctx, y)
      if cfg.shared_expert_average:  # Cohere2-MoE: (routed + shared) / 2
        y = y * jnp.asarray(0.5, y.dtype)
    if record_experts:
      return y, stats, chosen
    return (y, stats) if router_stats else y

  def _add_shared(self, x_BxTxD, ctx: ShardingContext, y):
    shared = self.shared(x_BxTxD, ctx)
    if self.cfg.shared_expert_gate:
      dt = shared.dtype
      gate = jnp.einsum("BTD,D->BT", x_BxTxD.astype(dt), self.shared_gate[...].astype(dt),
                        preferred_element_type=jnp.float32)
      shared = (shared * jax.nn.sigmoid(gate)[..., None].astype(dt)).astype(dt)
    return y + shared.astype(y.dtype)

  def _routed(self, x_BxTxD, ctx: ShardingContext, segment_ids_BxT, router_stats: bool,
              replay=None, record: bool = False, router_in=None):
    """(y [B, T, D], the RouterStats or None, with `record` the experts the router chose
    [B, T, k] (with `replay`, those it would have chosen), else None). `router_in`: what
    the router reads [B, T, D] when not the experts' input (cfg.moe_input_norms)."""
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    b, t, d = x_BxTxD.shape
    e, f = cfg.num_experts, cfg.ffn_dim
    gated = hasattr(self, "gate_proj")
    # Without a gate (relu^2 experts) an empty array holds the gate's place.
    weights = [w[...].astype(dt) if w is not None else jnp.zeros((0,), dt) for w in (
        self.router, getattr(self, "gate_proj", None), self.up_proj, self.down_proj)]
    # What the routed experts read in a latent (`latent_in`), [B, T, L]; without one they
    # read the tokens themselves, and an empty array holds its place.
    x_experts = jnp.zeros((0,), dt)
    if cfg.moe_latent_dim:
      x_experts = ctx.constrain(
          jnp.einsum("BTD,DL->BTL", x_BxTxD.astype(dt), self.latent_in[...].astype(dt)),
          ("batch", "length", "latent"))
    if cfg.router_scoring == "sigmoid" or cfg.softmax_correction_bias:
      weights[0] = self.router[...].astype(jnp.float32)  # in float32, as transformers runs it
    # Biases (gpt-oss), zeros where the model has none: [E], [E, F], [E, F], [E, D].
    weights += [getattr(self, name)[...].astype(dt) if hasattr(self, name) else
                jnp.zeros(shape, dt) for name, shape in (
                    ("router_bias", (e,)), ("gate_bias", (e, f)), ("up_bias", (e, f)),
                    ("down_bias", (e, d)))]
    # A sigmoid router's correction bias [E] in float32 (zeros where there is none).
    weights.append(self.score_correction_bias[...] if hasattr(self, "score_correction_bias")
                   else jnp.zeros((e,), jnp.float32))
    # Gemma 4's scale of each chosen expert's weight [E] (ones where there is none).
    weights.append(self.per_expert_scale[...].astype(jnp.float32)
                   if hasattr(self, "per_expert_scale") else jnp.ones((e,), jnp.float32))
    # The router's own input, or an empty array in its place.
    x_router = (jnp.zeros((0,), dt) if router_in is None else
                ctx.constrain(router_in.astype(dt), ("batch", "length", "embed")))
    adapters = self._adapters()
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones((b, t), jnp.int32)
    mesh = ctx.mesh
    token_axes, f_axes, ep_axes = (), (), ()
    if mesh is not None and mesh.size > 1:
      from posttrain.models.sharding import logical_to_spec
      tokens = logical_to_spec(("batch", "length"), ctx.rules, mesh, (b, t))
      token_axes = tuple(a for entry in tokens if entry
                         for a in ((entry,) if isinstance(entry, str) else entry))
      f_entry = logical_to_spec(("mlp",), ctx.rules, mesh, (cfg.ffn_dim,))[0]
      f_axes = tuple(a for a in ((f_entry,) if isinstance(f_entry, str) else f_entry or ())
                     if a not in token_axes)
      # The axes the experts' E splits over (as `state_shardings` lays them out, E first),
      # none by default; F splits over the "mlp" axes they leave.
      ep_entry = logical_to_spec(("experts",), ctx.rules, mesh, (e,))[0]
      ep_axes = (ep_entry,) if isinstance(ep_entry, str) else tuple(ep_entry or ())
      f_axes = tuple(a for a in f_axes if a not in ep_axes)

    k = cfg.num_experts_per_tok
    if replay is not None and tuple(replay.shape) != (b, t, k):
      raise ValueError(f"replayed experts have shape {tuple(replay.shape)}, expected "
                       f"[batch, length, num_experts_per_tok] = {(b, t, k)}")
    # Replayed experts, or an empty array in their place.
    replay_in = jnp.zeros((0,), jnp.int32) if replay is None else replay.astype(jnp.int32)

    def local(x, x_in, x_router, segment_ids, given, router, gate, up, down, router_b,
              gate_b, up_b, down_b, correction, expert_scale, lora):
      lb, lt, _ = x.shape
      x_NxD = x.reshape(lb * lt, d).astype(dt)
      gate = gate if gated else None
      routing = functools.partial(
          route, x_NxD if router_in is None else x_router.reshape(lb * lt, d),
          router, k, cfg.norm_topk_prob, return_probs=True,
          bias_E=router_b if cfg.router_bias else None, scoring=cfg.router_scoring,
          correction_E=correction if cfg.has_correction_bias else None,
          groups=cfg.router_groups, jitter_eps=cfg.router_jitter_eps,
          group_topk=cfg.router_group_topk, scale=cfg.routed_scaling_factor)
      w, e, probs = routing(experts_NxK=None if replay is None else given.reshape(lb * lt, k))
      if cfg.moe_input_norms:
        w = w * expert_scale[e]
      own = e
      if record and replay is not None:  # what the router alone would have chosen
        own = jax.lax.stop_gradient(routing()[1])
      biased = cfg.expert_bias
      if cfg.moe_latent_dim:  # the experts' input: the tokens' latent
        x_NxD = x_in.reshape(lb * lt, -1).astype(dt)
      if ep_axes:
        y = self._expert_parallel(x_NxD, w, e, gate, up, down, gate_b, up_b, down_b,
                                  ep_axes, token_axes, f_axes, lora)
      else:
        if f_axes:
          # Each device runs its slice of F from here on: marked so, the backward sums the
          # slices' input gradients once, over [N, D] tokens, not over the sorted [N k, D]
          # rows of each projection.
          x_NxD = jax.lax.pcast(x_NxD, f_axes, to="varying")
        y = expert_mlps(x_NxD, w, e, gate, up, down,
                        activation=gated_activation(cfg) if gated else None,
                        gate_bias_ExF=gate_b if biased else None,
                        up_bias_ExF=up_b if biased else None, lora=lora,
                        lora_scale=cfg.lora_scale, scale_inputs=cfg.routed_input_scaling)
        if f_axes:
          y = jax.lax.psum(y, f_axes)
        if biased:  # each chosen expert's down bias, by its weight, once after the sum: the
          # weights spread over the experts [N, E] times the biases [E, D] (gathering each
          # token's k biases made a float32 [N, k, D], 0.7 GiB a layer for gpt-oss-20b).
          spread = jnp.einsum("NK,NKE->NE", w, jax.nn.one_hot(e, cfg.num_experts,
                                                              dtype=jnp.float32))
          y = y + jnp.einsum("NE,ED->ND", spread, down_b.astype(jnp.float32))
      y = y.astype(dt).reshape(lb, lt, -1)
      stats = None
      if router_stats:
        keep = (segment_ids.reshape(-1) > 0).astype(jnp.float32)
        stats = RouterStats(
            jnp.einsum("NKE,N->E", jax.nn.one_hot(e, cfg.num_experts, dtype=jnp.float32),
                       keep),
            jnp.einsum("NE,N->E", probs, keep), jnp.sum(keep))
        stats = jax.lax.psum(stats, token_axes) if token_axes else stats
      return y, stats, (own.reshape(lb, lt, k) if record else None)

    if mesh is None or mesh.size == 1:
      y, stats, chosen = local(x_BxTxD, x_experts, x_router, segment_ids_BxT, replay_in,
                               *weights, adapters)
      return self._latent_out(y, ctx), stats, chosen
    from jax.sharding import PartitionSpec as P
    from kernels.attention import place
    f_spec = None if not f_axes else f_axes[0] if len(f_axes) == 1 else f_axes
    # The experts (and their biases) split over E on the ep axes, as stored; the router,
    # its bias and the correction bias whole.
    e_spec = None if not ep_axes else ep_entry
    x_spec = P(*tokens, None)
    gate_spec = P(e_spec, None, f_spec) if gated else P()
    given_spec = P() if replay is None else P(*tokens, None)
    specs = (x_spec, x_spec if cfg.moe_latent_dim else P(),
             x_spec if router_in is not None else P(), P(*tokens), given_spec, P(),
             gate_spec, P(e_spec, None, f_spec),
             P(e_spec, f_spec, None), P(), P(e_spec, f_spec), P(e_spec, f_spec),
             P(e_spec, None), P(), P())
    # The adapters as their experts: E on the ep axes, F (gate and up's B columns, down's
    # A's) on the mlp axes, D and the rank whole.
    lora_specs = {"gate_up": (P(e_spec, None, None), P(e_spec, None, None, f_spec)),
                  "up": (P(e_spec, None, None), P(e_spec, None, f_spec)),
                  "down": (P(e_spec, None, f_spec), P(e_spec, None, None))}
    lora_specs = {name: lora_specs[name] for name in adapters}
    args = [place(a, mesh, spec) for a, spec in zip(
        [x_BxTxD, x_experts, x_router, segment_ids_BxT, replay_in, *weights], specs)]
    args.append(jax.tree.map(lambda a, spec: place(a, mesh, spec), adapters, lora_specs))
    specs += (lora_specs,)
    out_specs = (x_spec, RouterStats(P(), P(), P()) if router_stats else None,
                 P(*tokens, None) if record else None)
    y, stats, chosen = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs,
                                     check_vma=True)(*args)
    return self._latent_out(y, ctx), stats, chosen

  def _latent_out(self, y, ctx: ShardingContext):
    """The routed experts' output back in the model's width: through `latent_out` where
    the experts run in a latent."""
    if not self.cfg.moe_latent_dim:
      return y
    dt = _dtype(self.cfg.dtype)
    return ctx.constrain(jnp.einsum("BTL,LD->BTD", y, self.latent_out[...].astype(dt)),
                         ("batch", "length", "embed"))

  def _adapters(self) -> dict:
    """The routed experts' LoRA adapters in the compute dtype, as `expert_mlps` takes
    them: {"gate_up": (A, B), "up": (A, B), "down": (A, B)}, those the layer has."""
    dt = _dtype(self.cfg.dtype)
    return {name: (getattr(self, f"experts_{name}_proj_lora_a")[...].astype(dt),
                   getattr(self, f"experts_{name}_proj_lora_b")[...].astype(dt))
            for name in ("gate_up", "up", "down")
            if hasattr(self, f"experts_{name}_proj_lora_a")}

  def _expert_parallel(self, x_NxD, weights_NxK, experts_NxK, gate_ExDxF, up_ExDxF,
                       down_ExFxD, gate_bias_ExF, up_bias_ExF, down_bias_ExD,
                       ep_axes: tuple, token_axes: tuple, f_axes: tuple, lora=None):
    """Inside the shard_map: the routed experts' output [N, D] float32 for this device's
    N tokens (their routing `weights_NxK`, `experts_NxK` over all E experts), from the
    device's E / ep experts [E / ep, D, F'] (F' = F over `f_axes`) and every device's.

    The tokens, weights and expert ids are all-gathered over the ep axes that split the
    tokens (`token_axes`), M = N x their size rows; over an ep axis that does not, the
    tokens are the same on each of its devices already. Each device then runs every
    gathered token's pairs with its own experts: the ids of the others' become E / ep,
    a group past the last, sorted after the local experts' runs and never assigned rows
    in `expert_mlps`' grouped matmuls (rows past the group sizes: zero out of
    `ragged_dot`, even from NaN inputs, checked on CPU; the TPU weight-gradient kernel
    never visits them); their weights are zeroed too. The per-device sums are
    reduce-scattered back to the tokens' devices over the gathered axes and summed over
    the others and the F slices. The backward transposes each: the gathered tokens'
    gradients are reduce-scattered, the outputs' gradients all-gathered.

    Cost a device: the gathered [M, D] tokens and the sorted [M k, *] rows (k pairs a
    token, most of them another device's), of which the grouped matmuls need the local
    ones alone, about N k with balanced routing, M k at worst (dropless)."""
    cfg = self.cfg
    n_local = up_ExDxF.shape[0]
    gathered = tuple(a for a in ep_axes if a in token_axes)
    x_MxD, weights_MxK, experts_MxK = x_NxD, weights_NxK, experts_NxK
    if gathered:
      x_MxD, weights_MxK, experts_MxK = (jax.lax.all_gather(a, gathered, axis=0, tiled=True)
                                         for a in (x_NxD, weights_NxK, experts_NxK))
    # This device's experts are [first, first + E / ep) of E: axis_index over the ep axes
    # counts their devices in the order E is split over them.
    ids_MxK = experts_MxK - jax.lax.axis_index(ep_axes) * n_local
    mine_MxK = (ids_MxK >= 0) & (ids_MxK < n_local)
    ids_MxK = jnp.where(mine_MxK, ids_MxK, n_local)
    weights_MxK = jnp.where(mine_MxK, weights_MxK, 0.0)
    # The other sums: over the ep axes the tokens were not gathered on, and F's slices.
    summed = tuple(a for a in ep_axes if a not in gathered) + f_axes
    if summed:  # as in `_routed`: the backward sums the input gradients once, over [M, D]
      x_MxD = jax.lax.pcast(x_MxD, summed, to="varying")
    y_MxD = expert_mlps(x_MxD, weights_MxK, ids_MxK, gate_ExDxF, up_ExDxF, down_ExFxD,
                        activation=gated_activation(cfg) if gate_ExDxF is not None else None,
                        gate_bias_ExF=gate_bias_ExF if cfg.expert_bias else None,
                        up_bias_ExF=up_bias_ExF if cfg.expert_bias else None, lora=lora,
                        lora_scale=cfg.lora_scale, scale_inputs=cfg.routed_input_scaling)
    if cfg.expert_bias:  # the local experts' down biases (out-of-range ids: a zero row),
      # added on one F slice alone so that the sum over the slices counts them once
      spread_MxE = jnp.einsum("MK,MKE->ME", weights_MxK,
                              jax.nn.one_hot(ids_MxK, n_local, dtype=jnp.float32))
      bias_MxD = jnp.einsum("ME,ED->MD", spread_MxE, down_bias_ExD.astype(jnp.float32))
      if f_axes:
        bias_MxD = jnp.where(jax.lax.axis_index(f_axes) == 0, bias_MxD, 0.0)
      y_MxD = y_MxD + bias_MxD
    y_NxD = y_MxD
    if gathered:  # reduce-scatter first: the sum over the others then moves [N, D] alone
      y_NxD = jax.lax.psum_scatter(y_MxD, gathered, scatter_dimension=0, tiled=True)
    return jax.lax.psum(y_NxD, summed) if summed else y_NxD


class LinearAttention(nnx.Module):
  """Gated DeltaNet (Qwen3-Next, Qwen3.5's linear_attention layers): a linear attention
  whose cache is a fixed-size recurrent state (`LinearCache`).

  q, k [B, T, key heads, Dk] and v [B, T, value heads, Dv] are projections of x, each
  through a causal depthwise convolution of cfg.linear_conv_kernel taps and SiLU. Per
  value head the state S [Dk, Dv] decays by exp(g_t), g_t = -exp(A_log) softplus(a_t +
  dt_bias), and learns v_t at rate beta_t = sigmoid(b_t) by the delta rule; o_t = S^T q_t
  with q and k L2-normalised (`kernels.gated_delta_rule`). The output is RMS-normed per
  head, gated by SiLU(z_t) (z a fourth projection) and projected back by o_proj.

  Padding tokens (segment id 0) leave the state and the convolution's window as they
  are, and a new segment starts from a zero state: a prefill's right padding, and a
  cached call's rows that feed nothing (the sampler's finished rows), cost nothing.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    pd, std = _dtype(cfg.param_dtype), cfg.init_std
    d, c = cfg.d_model, cfg.linear_conv_kernel
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    self.q_proj = _param(rngs, (d, hk, dk), ("embed", "linear_heads", "head_dim"), pd, std=std)
    self.k_proj = _param(rngs, (d, hk, dk), ("embed", "linear_heads", "head_dim"), pd, std=std)
    self.v_proj = _param(rngs, (d, hv, dv), ("embed", "linear_heads", "head_dim"), pd, std=std)
    self.z_proj = _param(rngs, (d, hv, dv), ("embed", "linear_heads", "head_dim"), pd, std=std)
    self.b_proj = _param(rngs, (d, hv), ("embed", "linear_heads"), pd, std=std)
    self.a_proj = _param(rngs, (d, hv), ("embed", "linear_heads"), pd, std=std)
    # The convolutions' taps, oldest input first (torch's conv1d weight [C, 1, taps]).
    conv_std = float(1.0 / np.sqrt(c))
    self.q_conv = _param(rngs, (hk, dk, c), ("linear_heads", "head_dim", None), pd,
                         std=conv_std)
    self.k_conv = _param(rngs, (hk, dk, c), ("linear_heads", "head_dim", None), pd,
                         std=conv_std)
    self.v_conv = _param(rngs, (hv, dv, c), ("linear_heads", "head_dim", None), pd,
                         std=conv_std)
    # A in [1, 16) (transformers draws U(0.01, 16)); dt_bias one.
    key = rngs.params() if rngs is not None else jax.random.key(0)
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(key, (hv,), jnp.float32, 1.0, 16.0))
                           .astype(pd), logical_axes=("linear_heads",))
    self.dt_bias = _param(None, (hv,), ("linear_heads",), pd, init="ones")
    self.norm = _param(None, (dv,), ("head_dim",), pd, init="ones")
    self.o_proj = _param(rngs, (hv, dv, d), ("linear_heads", "head_dim", "embed"), pd,
                         std=std)

  def __call__(self, x_BxTxD, segment_ids_BxT, cache: LinearCache | None,
               ctx: ShardingContext, prefill: bool = False, layer=None):
    """(y [B, T, D], the new cache or None). `cache` starts the recurrence (but in a
    prefill, which starts every row afresh) and is returned as of each row's last token
    that is not padding; with `layer` it stacks every linear layer's ([L, ...]) and this
    layer's entry is read and written in place."""
    import kernels
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    x = x_BxTxD.astype(dt)
    b, t, _ = x.shape
    heads = ("batch", "length", "linear_heads", "head_dim")
    outs = {name: jnp.einsum("BTD,D...->BT...", x, getattr(self, name)[...].astype(dt))
            for name in ("q_proj", "k_proj", "v_proj", "z_proj", "b_proj", "a_proj")}
    for target in cfg.lora_target_names:
      if target in _LINEAR_PARTS and target != "out_proj":
        outs = _add_fused_lora(self, target, outs, x)
    q, k, v, z = (ctx.constrain(outs[f"{n}_proj"], heads) for n in "qkvz")
    beta = jax.nn.sigmoid(outs["b_proj"].astype(jnp.float32))
    a = outs["a_proj"].astype(jnp.float32)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32))[None, None] * jax.nn.softplus(
        a + self.dt_bias[...].astype(jnp.float32)[None, None])
    old = None
    if cache is not None and not prefill:
      old = cache if layer is None else jax.tree.map(lambda c: c[layer], cache)

    def conv(u, w, state):  # [B, T, H, F] through its taps [H, F, C]
      h, f = u.shape[2:]
      out = kernels.causal_conv1d(
          u.reshape(b, t, h * f), w[...].astype(dt).reshape(h * f, -1),
          segment_ids=segment_ids_BxT,
          initial_state=None if state is None else state.reshape(b, -1, h * f),
          activation="silu", return_final_state=True)
      return out[0].reshape(u.shape), out[1].reshape(b, -1, h, f)

    q, q_conv = conv(q, self.q_conv, None if old is None else old.q_conv)
    k, k_conv = conv(k, self.k_conv, None if old is None else old.k_conv)
    v, v_conv = conv(v, self.v_conv, None if old is None else old.v_conv)
    out, state = kernels.gated_delta_rule(
        q, k, v, g, beta, segment_ids=segment_ids_BxT,
        initial_state=None if old is None else old.state, qk_l2norm=True,
        chunk_size=cfg.linear_chunk, return_final_state=True)
    out = ctx.constrain(out.astype(dt), heads)
    # RMS norm per head (Llama's: cast, then scaled), gated by SiLU(z) in float32.
    o32 = out.astype(jnp.float32)
    o32 = o32 * jax.lax.rsqrt(jnp.mean(jnp.square(o32), -1, keepdims=True) + cfg.norm_eps)
    o = self.norm[...].astype(dt)[None, None, None] * o32.astype(dt)
    o = (o.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dt)
    y = jnp.einsum("BTVH,VHD->BTD", o, self.o_proj[...].astype(dt))
    y = _add_lora(self, "out_proj", y, o, "BTVH,VHR->BTR", "BTR,RD->BTD")
    return y, self._cache_out(cache, layer, q_conv, k_conv, v_conv, state, ctx)

  @staticmethod
  def _cache_out(cache, layer, q_conv, k_conv, v_conv, state, ctx):
    """The cache after a call: None without one; else the new windows and state, written
    in place at `layer` of a stacked cache."""
    if cache is None:
      return None
    new = LinearCache(q_conv.astype(cache.q_conv.dtype), k_conv.astype(cache.k_conv.dtype),
                      v_conv.astype(cache.v_conv.dtype), state)
    if layer is not None:
      new = jax.tree.map(
          lambda c, n: jax.lax.dynamic_update_index_in_dim(c, n.astype(c.dtype), layer, 0),
          cache, new)
    return map_cache(ctx.constrain, new)


@functools.partial(jax.checkpoint, static_argnums=(5, 6, 7), prevent_cse=False)
def _mamba2_gated_norm(out, x, z, skip, scale, groups: int, eps: float,
                       where: str = "after_gate"):
  """Mamba2's output [B, T, H, P] in x's dtype: (out + D x) SiLU(z), RMS-normed over
  each of `groups` runs of heads, times `scale` [H, P], in float32 and cast once (as
  transformers' is). `where` (cfg.linear_norm): the norm after the gate (Mamba2's), before
  it (norm(y) SiLU(z)), or "none" (y SiLU(z); `scale` unused). Rematerialised: the
  backward keeps its inputs alone, not the six float32 [H, P] rows of its steps."""
  x32 = x.astype(jnp.float32)
  y = out.astype(jnp.float32) + skip.astype(jnp.float32)[None, None, :, None] * x32
  gate = jax.nn.silu(z.astype(jnp.float32))
  if where == "none":
    return (y * gate).astype(x.dtype)
  if where == "after_gate":
    y = y * gate
  grouped = y.reshape(*y.shape[:2], groups, -1)
  grouped = grouped * jax.lax.rsqrt(jnp.mean(jnp.square(grouped), -1, keepdims=True) + eps)
  y = scale.astype(jnp.float32)[None, None] * grouped.reshape(y.shape)
  return (y if where == "after_gate" else y * gate).astype(x.dtype)


class Mamba2(LinearAttention):
  """Mamba2's selective state space (Granite 4's -h- models' mamba layers), in the form
  its duality with linear attention gives it: C is the query, B the key and x the value,
  so its projections, convolutions and cache take `LinearAttention`'s names and shapes.

  in_proj's parts are z_proj (the gate) and v_proj (x) [D, heads, head dim], k_proj (B)
  and q_proj (C) [D, groups, state], and a_proj (the time step) [D, heads]. x, B and C
  each pass one causal depthwise convolution of cfg.linear_conv_kernel taps (plus its
  bias with cfg.linear_conv_bias) and SiLU. Then per head, dt_t = softplus(a_t + dt_bias)
  clipped to [linear_dt_min, linear_dt_max] (in a decode step too, which transformers' and
  mamba_ssm's one-token steps skip: a token scores the same decoded or prefilled), and
  the state S [state, head dim] (groups shared by heads in order, as key heads are):

      S <- exp(-exp(A_log) dt_t) S + B_t (dt_t x_t)^T,    y_t = S^T C_t + D x_t

  (`kernels.gated_linear_attention`). y is gated by SiLU(z), RMS-normed over each group's
  heads together (Mamba2's gated norm, norm_before_gate=False), scaled by `norm` [heads,
  head dim], and projected back by o_proj (out_proj). Falcon-H1's variants: the norm
  before the gate or none (cfg.linear_norm; none: no `norm`), and in_proj's parts z, x,
  B, C and dt scaled by cfg.ssm_multipliers after the projection. Padding and new segments behave as
  in `LinearAttention`: the cache is the same `LinearCache` (C's window in q_conv, B's in
  k_conv, x's in v_conv; the state transposed, [heads, head dim, state], as mamba_ssm's
  ssm_state).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    pd, std = _dtype(cfg.param_dtype), cfg.init_std
    d, c = cfg.d_model, cfg.linear_conv_kernel
    groups, heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    state, width = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    parts = {"q": (groups, state), "k": (groups, state), "v": (heads, width)}
    for name, shape in {**parts, "z": (heads, width)}.items():
      setattr(self, f"{name}_proj", _param(rngs, (d, *shape),
                                           ("embed", "linear_heads", "head_dim"), pd, std=std))
    self.a_proj = _param(rngs, (d, heads), ("embed", "linear_heads"), pd, std=std)
    conv_std = float(1.0 / np.sqrt(c))
    for name, shape in parts.items():  # taps oldest input first, as LinearAttention's
      setattr(self, f"{name}_conv", _param(rngs, (*shape, c),
                                           ("linear_heads", "head_dim", None), pd,
                                           std=conv_std))
      if cfg.linear_conv_bias:
        setattr(self, f"{name}_conv_bias", _param(None, shape, ("linear_heads", "head_dim"),
                                                  pd, init="zeros"))
    # transformers' Granite 4 initialisation: A = 1..heads, dt_bias and D one.
    self.A_log = nnx.Param(jnp.log(jnp.arange(1, heads + 1, dtype=jnp.float32)).astype(pd),
                           logical_axes=("linear_heads",))
    self.dt_bias = _param(None, (heads,), ("linear_heads",), pd, init="ones")
    self.D = _param(None, (heads,), ("linear_heads",), pd, init="ones")
    if cfg.linear_norm != "none":
      self.norm = _param(None, (heads, width), ("linear_heads", "head_dim"), pd, init="ones")
    self.o_proj = _param(rngs, (heads, width, d), ("linear_heads", "head_dim", "embed"), pd,
                         std=std)

  def __call__(self, x_BxTxD, segment_ids_BxT, cache: LinearCache | None,
               ctx: ShardingContext, prefill: bool = False, layer=None):
    """(y [B, T, D], the new cache or None), as `LinearAttention.__call__`."""
    import kernels
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    x = x_BxTxD.astype(dt)
    b, t, _ = x.shape
    heads = ("batch", "length", "linear_heads", "head_dim")
    outs = {name: jnp.einsum("BTD,D...->BT...", x, getattr(self, name)[...].astype(dt))
            for name in ("z_proj", "v_proj", "k_proj", "q_proj", "a_proj")}
    for target in cfg.lora_target_names:
      if target in _LINEAR_PARTS and target != "out_proj":
        outs = _add_fused_lora(self, target, outs, x)
    # Falcon-H1's mup vector: in_proj's parts (z, x, B, C, dt) scaled, LoRA's included.
    for name, m in zip(("z_proj", "v_proj", "k_proj", "q_proj", "a_proj"),
                       cfg.ssm_multipliers):
      if m != 1.0:
        outs[name] = outs[name] * jnp.asarray(m, outs[name].dtype)
    old = None
    if cache is not None and not prefill:
      old = cache if layer is None else jax.tree.map(lambda c: c[layer], cache)

    def conv(name, state):  # [B, T, H, F] through its taps [H, F, C] (and bias), SiLU
      u = ctx.constrain(outs[f"{name}_proj"], heads)
      h, f = u.shape[2:]
      w = getattr(self, f"{name}_conv")[...].astype(dt).reshape(h * f, -1)
      bias = getattr(self, f"{name}_conv_bias", None)
      out, final = kernels.causal_conv1d(
          u.reshape(b, t, h * f), w,
          bias=None if bias is None else bias[...].astype(dt).reshape(h * f),
          segment_ids=segment_ids_BxT,
          initial_state=None if state is None else state.reshape(b, -1, h * f),
          activation="silu", return_final_state=True)
      return out.reshape(u.shape), final.reshape(b, -1, h, f)

    xs, v_conv = conv("v", None if old is None else old.v_conv)
    bs, k_conv = conv("k", None if old is None else old.k_conv)
    cs, q_conv = conv("q", None if old is None else old.q_conv)
    step = jax.nn.softplus(outs["a_proj"].astype(jnp.float32)
                           + self.dt_bias[...].astype(jnp.float32)[None, None])
    step = jnp.clip(step, cfg.linear_dt_min, cfg.linear_dt_max)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32))[None, None] * step
    x32 = xs.astype(jnp.float32)
    out, state = kernels.gated_linear_attention(
        cs, bs, x32 * step[..., None], g, segment_ids=segment_ids_BxT,
        initial_state=None if old is None else old.state.swapaxes(-1, -2),
        chunk_size=cfg.linear_chunk, return_final_state=True)
    norm = self.norm[...] if cfg.linear_norm != "none" else None
    o = ctx.constrain(_mamba2_gated_norm(out, xs, outs["z_proj"], self.D[...], norm,
                                         cfg.linear_num_key_heads, cfg.norm_eps,
                                         cfg.linear_norm), heads)
    y = jnp.einsum("BTVH,VHD->BTD", o, self.o_proj[...].astype(dt))
    y = _add_lora(self, "out_proj", y, o, "BTVH,VHR->BTR", "BTR,RD->BTD")
    return y, self._cache_out(cache, layer, q_conv, k_conv, v_conv, state.swapaxes(-1, -2),
                              ctx)


class Mamba1(LinearAttention):
  """Mamba 1's selective scan (MambaForCausalLM's and FalconMamba's mixer; cfg.linear_mixer
  "mamba1"), per channel c of E = linear_num_value_heads and state entry n of N =
  linear_key_head_dim:

      x, z = in_proj(u)                 v_proj, z_proj [D, E, 1]
      x = SiLU(conv(x))                 v_conv [E, 1, taps] (+ v_conv_bias [E, 1])
      r, B, C = x_proj(x)               x_dt [E, R], x_b, x_c [E, N]
      dt = softplus(dt_proj(r) + dt_bias), clipped to [linear_dt_min, linear_dt_max]
      h[c, n] <- exp(dt[c] A[c, n]) h[c, n] + dt[c] B[n] x[c],   A = -exp(A_log) [E, N]
      y[c] = C . h[c] + D[c] x[c],   out = o_proj(y SiLU(z))     o_proj [E, 1, D]

  (`kernels.selective_scan`). With cfg.linear_bcdt_norm r, B and C are each RMS-normed
  first, without a weight (FalconMamba) or each by its own scale, dt_norm [R], b_norm and
  c_norm [N] (Jamba). A channel is a head of width 1, so the
  projections, the cache and LoRA's in_proj / out_proj take Mamba2's shapes: the cache is
  a `LinearCache` whose v_conv holds x's window [B, taps - 1, E, 1] and whose state is
  [B, E, 1, N] (mamba_ssm's ssm_state [B, E, N]); q_conv and k_conv are empty. Padding
  and new segments behave as in `LinearAttention`.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    pd, std = _dtype(cfg.param_dtype), cfg.init_std
    d, c = cfg.d_model, cfg.linear_conv_kernel
    e, n, r = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_dt_rank
    wide = ("embed", "linear_heads", "head_dim")
    self.v_proj = _param(rngs, (d, e, 1), wide, pd, std=std)
    self.z_proj = _param(rngs, (d, e, 1), wide, pd, std=std)
    self.v_conv = _param(rngs, (e, 1, c), ("linear_heads", "head_dim", None), pd,
                         std=float(1.0 / np.sqrt(c)))
    if cfg.linear_conv_bias:
      self.v_conv_bias = _param(None, (e, 1), ("linear_heads", "head_dim"), pd, init="zeros")
    self.x_dt = _param(rngs, (e, r), ("linear_heads", None), pd, std=std)
    self.x_b = _param(rngs, (e, n), ("linear_heads", None), pd, std=std)
    self.x_c = _param(rngs, (e, n), ("linear_heads", None), pd, std=std)
    self.dt_proj = _param(rngs, (r, e), (None, "linear_heads"), pd, std=float(r ** -0.5))
    if cfg.linear_bcdt_norm == "weighted":
      for name, width in (("dt_norm", r), ("b_norm", n), ("c_norm", n)):
        setattr(self, name, _param(None, (width,), (None,), pd, init="ones"))
    self.dt_bias = _param(None, (e,), ("linear_heads",), pd, init="zeros")
    # transformers' initialisation: A = 1..N for every channel, D one.
    self.A_log = nnx.Param(jnp.broadcast_to(jnp.log(jnp.arange(1, n + 1, dtype=jnp.float32)),
                                            (e, n)).astype(pd),
                           logical_axes=("linear_heads", None))
    self.D = _param(None, (e,), ("linear_heads",), pd, init="ones")
    self.o_proj = _param(rngs, (e, 1, d), ("linear_heads", "head_dim", "embed"), pd, std=std)

  def __call__(self, x_BxTxD, segment_ids_BxT, cache: LinearCache | None,
               ctx: ShardingContext, prefill: bool = False, layer=None):
    """(y [B, T, D], the new cache or None), as `LinearAttention.__call__`."""
    import kernels
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    u = x_BxTxD.astype(dt)
    b, t, _ = u.shape
    channels = ("batch", "length", "linear_heads")
    outs = {name: jnp.einsum("BTD,D...->BT...", u, getattr(self, name)[...].astype(dt))
            for name in _MAMBA1_IN}
    if "in_proj" in cfg.lora_target_names:
      outs = _add_fused_lora(self, "in_proj", outs, u)
    old = None
    if cache is not None and not prefill:
      old = cache if layer is None else jax.tree.map(lambda c: c[layer], cache)
    e = cfg.linear_num_value_heads
    bias = getattr(self, "v_conv_bias", None)
    xs, window = kernels.causal_conv1d(
        ctx.constrain(outs["v_proj"].reshape(b, t, e), channels),
        self.v_conv[...].astype(dt).reshape(e, -1),
        bias=None if bias is None else bias[...].astype(dt).reshape(e),
        segment_ids=segment_ids_BxT,
        initial_state=None if old is None else old.v_conv.reshape(b, -1, e),
        activation="silu", return_final_state=True)
    xs = ctx.constrain(xs.astype(dt), channels)
    low, bs, cs = (jnp.einsum("BTE,EK->BTK", xs, getattr(self, name)[...].astype(dt))
                   for name in ("x_dt", "x_b", "x_c"))
    if cfg.linear_bcdt_norm != "none":  # RMS norms in float32, cast back (then scaled)
      low, bs, cs = (_weightless_rms(v, cfg.linear_bcdt_norm_eps) for v in (low, bs, cs))
    if cfg.linear_bcdt_norm == "weighted":
      low, bs, cs = (v * getattr(self, name)[...].astype(dt)[None, None]
                     for v, name in ((low, "dt_norm"), (bs, "b_norm"), (cs, "c_norm")))
    step = jax.nn.softplus(
        jnp.einsum("BTK,KE->BTE", low, self.dt_proj[...].astype(dt)).astype(jnp.float32)
        + self.dt_bias[...].astype(jnp.float32)[None, None])
    step = jnp.clip(step, cfg.linear_dt_min, cfg.linear_dt_max)
    a = -jnp.exp(self.A_log[...].astype(jnp.float32))
    out, state = kernels.selective_scan(
        xs, step, a, bs[:, :, None], cs[:, :, None], D=self.D[...].astype(jnp.float32),
        segment_ids=segment_ids_BxT,
        initial_state=None if old is None else old.state.reshape(b, e, -1),
        chunk_size=cfg.linear_chunk, return_final_state=True)
    gate = jax.nn.silu(outs["z_proj"].reshape(b, t, e).astype(jnp.float32))
    o = ctx.constrain((out.astype(jnp.float32) * gate).astype(dt), channels)[..., None]
    y = jnp.einsum("BTVH,VHD->BTD", o, self.o_proj[...].astype(dt))
    y = _add_lora(self, "out_proj", y, o, "BTVH,VHR->BTR", "BTR,RD->BTD")
    if cache is None:
      return y, None
    empty = cache.q_conv if layer is None else cache.q_conv[layer]
    return y, self._cache_out(cache, layer, empty, empty, window.reshape(b, -1, e, 1),
                              state.reshape(b, e, 1, -1), ctx)


def _weightless_rms(x, eps: float):
  """x RMS-normed over its last axis without a weight, in float32, cast back."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)).astype(
      x.dtype)


class ShortConv(nnx.Module):
  """LFM2's gated short convolution (its "conv" layers; cfg.linear_mixer "short_conv"):

      y = out_proj(C * conv(B * x)),    B, C, x = in_proj(u) (three [D, D] parts)

  conv depthwise and causal over cfg.linear_conv_kernel taps, with no activation. in_proj's
  parts are kept apart (b_proj, c_proj, x_proj [D, D]: LFM2's rows in that order), the
  taps `conv` [D, C] oldest input first, the output o_proj [D, D] (out_proj); with
  cfg.linear_conv_bias each has a bias. The channels take the "linear_heads" axis.

  Its cache is a `LinearCache` whose v_conv [B, C-1, D, 1] holds the last C-1 values of
  B * x (the other arrays empty). Padding tokens (segment id 0) leave it as it is, and a
  new segment starts from zeros, as in `LinearAttention`.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    pd, std = _dtype(cfg.param_dtype), cfg.init_std
    d, c = cfg.d_model, cfg.linear_conv_kernel
    for name in _SHORT_CONV_IN:
      setattr(self, name, _param(rngs, (d, d), ("embed", "linear_heads"), pd, std=std))
    self.conv = _param(rngs, (d, c), ("linear_heads", None), pd, std=float(1.0 / np.sqrt(c)))
    self.o_proj = _param(rngs, (d, d), ("linear_heads", "embed"), pd, std=std)
    if cfg.linear_conv_bias:
      for name in ("b_bias", "c_bias", "x_bias", "conv_bias"):
        setattr(self, name, _param(None, (d,), ("linear_heads",), pd, init="zeros"))
      self.o_bias = _param(None, (d,), ("embed",), pd, init="zeros")

  def __call__(self, x_BxTxD, segment_ids_BxT, cache: LinearCache | None,
               ctx: ShardingContext, prefill: bool = False, layer=None):
    """(y [B, T, D], the new cache or None), as `LinearAttention.__call__`."""
    import kernels
    cfg, dt = self.cfg, _dtype(self.cfg.dtype)
    x = x_BxTxD.astype(dt)
    b, t, d = x.shape
    channels = ("batch", "length", "linear_heads")
    outs = {name: jnp.einsum("BTD,DE->BTE", x, getattr(self, name)[...].astype(dt))
            for name in _SHORT_CONV_IN}
    if cfg.linear_conv_bias:
      outs = {name: y + getattr(self, name.replace("_proj", "_bias"))[...].astype(dt)[None, None]
              for name, y in outs.items()}
    if "in_proj" in cfg.lora_target_names:
      outs = _add_fused_lora(self, "in_proj", outs, x)
    bx = ctx.constrain(outs["b_proj"] * outs["x_proj"], channels)
    old = None
    if cache is not None and not prefill:
      old = cache.v_conv if layer is None else cache.v_conv[layer]
    bias = getattr(self, "conv_bias", None)
    conv, window = kernels.causal_conv1d(
        bx, self.conv[...].astype(dt), bias=None if bias is None else bias[...].astype(dt),
        segment_ids=segment_ids_BxT,
        initial_state=None if old is None else old.reshape(b, -1, d),
        activation=None, return_final_state=True)
    o = ctx.constrain(outs["c_proj"] * conv.astype(dt), channels)
    y = jnp.einsum("BTE,ED->BTD", o, self.o_proj[...].astype(dt))
    if cfg.linear_conv_bias:
      y = y + self.o_bias[...].astype(dt)[None, None]
    y = _add_lora(self, "out_proj", y, o, "BTE,ER->BTR", "BTR,RD->BTD")
    if cache is None:
      return y, None
    window = window.reshape(b, -1, d, 1).astype(cache.v_conv.dtype)
    if layer is not None:
      window = jax.lax.dynamic_update_index_in_dim(cache.v_conv, window, layer, 0)
    return y, map_cache(ctx.constrain, cache._replace(v_conv=window))


class Block(nnx.Module):
  """x + attn(norm(x)), then x + mlp(norm(x)) (`post_attn_norm` is the MLP's input norm,
  Llama's post_attention_layernorm). With cfg.sandwich_norms (Gemma 2 / 3) each output is
  normed too before its residual add: `attn_out_norm`, `mlp_out_norm`. With
  cfg.output_norms (OLMo 2 / 3) only the outputs are: x + norm(attn(x)), then
  x + norm(mlp(x)). `dense`: one of a mixture's leading dense layers (cfg.dense_layers),
  its MLP dense of width cfg.dense_ffn_dim. `linear`: a linear-attention layer, its
  mixer `linear_attn` (`LinearAttention`) in place of `attn`. With cfg.split_layers
  (Nemotron-H) a block is one sublayer and its input_norm: the mixer alone, or with
  `mlp_only` the MLP alone, x + mlp(norm(x)) (of width dense_ffn_dim in a model with
  mixtures), or with `moe_only` the mixture of experts alone (Nemotron 3)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dense: bool = False,
               linear: bool = False, mlp_only: bool = False, moe_only: bool = False,
               global_layer: bool = False, kv_shared: bool = False):
    self.residual_multiplier = float(cfg.residual_multiplier)
    # cfg.residual_fp32: the dtype a sublayer reads the float32 stream in (None: as it is)
    self.sublayer_dtype = str(cfg.dtype) if cfg.residual_fp32 else None
    pd = _dtype(cfg.param_dtype)
    if cfg.layer_scale:  # Gemma 4's layer_scalar
      self.layer_scale = _param(None, (1,), (None,), pd, init="ones")
    if cfg.per_layer_dim:  # Gemma 4 E2B / E4B: the layer's per-layer input
      d, p = cfg.d_model, cfg.per_layer_dim
      self.per_layer_gate = _param(rngs, (d, p), ("embed", None), pd, std=cfg.init_std)
      self.per_layer_out = _param(rngs, (p, d), (None, "embed"), pd, std=cfg.init_std)
      self.per_layer_out_norm = _norm(cfg, d)
    if not cfg.output_norms:
      self.input_norm = _norm(cfg, cfg.d_model)
    if mlp_only:
      self.mlp = MLP(cfg, rngs, cfg.dense_ffn_dim if cfg.num_experts else None)
      return
    if moe_only:
      self.mlp = MoE(cfg, rngs)
      return
    if linear:
      mixer = {"mamba2": Mamba2, "short_conv": ShortConv, "mamba1": Mamba1}.get(
          cfg.linear_mixer, LinearAttention)
      self.linear_attn = mixer(cfg, rngs)
    else:
      self.attn = Attention(cfg.global_config() if global_layer else cfg, rngs, global_layer,
                            kv_shared)
    if cfg.parallel_mixer:  # Falcon-H1: Mamba2 beside the attention
      self.linear_attn = Mamba2(cfg, rngs)
    if cfg.split_layers:  # the mixer alone
      return
    if not (cfg.output_norms or cfg.parallel_residual) or cfg.parallel_mlp_norm:
      self.post_attn_norm = _norm(cfg, cfg.d_model)
    if dense:
      self.mlp = MLP(cfg, rngs, cfg.dense_ffn_dim)
    elif kv_shared and cfg.kv_shared_wide_mlp:  # Gemma 4's double-wide MLP
      self.mlp = MLP(cfg, rngs, 2 * cfg.ffn_dim)
    else:
      self.mlp = MoE(cfg, rngs) if cfg.num_experts else MLP(cfg, rngs)
    if cfg.sandwich_norms or cfg.output_norms:
      self.attn_out_norm = _norm(cfg, cfg.d_model)
      self.mlp_out_norm = _norm(cfg, cfg.d_model)

  def __call__(self, x, cos, sin, segment_ids, cache, positions, ctx, prefill=False,
               layer=None, router_stats: bool = False, sliding=False, nope=False,
               experts=None, record_experts: bool = False, per_layer=None, shared_kv=None,
               keep_kv: bool = False):
    """(x, cache); with `router_stats` (a mixture's layer) (x, cache, RouterStats).

    A mixture's layer replays `experts` [B, T, k] when given (`MoE`); with
    `record_experts` it returns (x, cache, the RouterStats or None, the experts each
    token took [B, T, k]). A decode step's (one new token a row, against a cache) reads
    a quantized base gathered as codes (`quant.gathering`).

    `per_layer` [B, T, P]: the layer's per-layer input (cfg.per_layer_dim). `shared_kv`:
    (k, v, cache) of the layer whose keys and values a layer sharing them attends over
    (cfg.kv_shared_layers). With `keep_kv` the result ends with this layer's (k, v), as
    its cache takes them (a layer others share)."""
    args = (x, cos, sin, segment_ids, cache, positions, ctx, prefill, layer, router_stats,
            sliding, nope, experts, record_experts, per_layer, shared_kv, keep_kv)
    decoding = cache is not None and not prefill and x.shape[1] == 1
    with quant.gathering(ctx if decoding else None):
      return self._call(*args)

  def _call(self, x, cos, sin, segment_ids, cache, positions, ctx, prefill, layer,
            router_stats, sliding, nope, experts, record_experts, per_layer, shared_kv,
            keep_kv):
    pre = hasattr(self, "input_norm")
    post = hasattr(self, "attn_out_norm")
    new_cache, stats, chosen, kv = cache, None, None, None
    moe = isinstance(getattr(self, "mlp", None), MoE)
    if (experts is not None or record_experts) and not moe:
      raise ValueError("replayed or recorded experts need a mixture-of-experts layer")

    def done(x):
      if hasattr(self, "layer_scale"):  # no gradient reaches it (a buffer in HF's)
        x = x * jax.lax.stop_gradient(self.layer_scale[...][0]).astype(x.dtype)
      if record_experts:
        out = (x, new_cache, stats, chosen)
      else:
        out = (x, new_cache, stats) if router_stats else (x, new_cache)
      return out + (kv,) if keep_kv else out

    def mlp(inputs, residual=None):
      if not moe:
        return self.mlp(inputs, ctx)
      out = self.mlp(inputs, ctx, segment_ids, router_stats=router_stats, experts=experts,
                     record_experts=record_experts, residual=residual)
      if record_experts:
        return out
      return (*out, None) if router_stats else (out, None, None)

    if hasattr(self, "linear_attn") and hasattr(self, "attn"):
      h, new_cache = self._parallel(self.input_norm(x), cos, sin, segment_ids, cache,
                                    positions, ctx, prefill, layer, sliding, nope)
    elif hasattr(self, "linear_attn"):
      h, new_cache = self.linear_attn(self._normed(x) if pre else x, segment_ids, cache,
                                      ctx, prefill, layer)
    elif hasattr(self, "attn"):
      xn = self._normed(x) if pre else x
      h, new_cache, *kept = self.attn(
          xn, cos, sin, segment_ids, cache, positions, ctx, prefill, layer, sliding, nope,
          shared=shared_kv, keep_kv=keep_kv)
      kv = kept[0] if kept else None
      if self.attn.cfg.parallel_residual:  # Cohere: the MLP reads the same normed input
        # (GPT-NeoX: its own norm of x)
        m = mlp(self.post_attn_norm(x) if self.attn.cfg.parallel_mlp_norm else xn, x)
        if moe:
          m, stats, chosen = m
        return done(ctx.constrain(x + self._residual(h) + self._residual(m),
                                  ("batch", "length", "embed")))
    else:  # an MLP or a mixture alone (split_layers): its input norm is the block's one
      h = mlp(self._normed(x))
      if moe:
        h, stats, chosen = h
      return done(ctx.constrain(x + self._residual(h), ("batch", "length", "embed")))
    x = x + self._residual(self.attn_out_norm(h) if post else h)
    if not hasattr(self, "mlp"):  # the mixer alone (split_layers)
      return done(ctx.constrain(x, ("batch", "length", "embed")))
    h = mlp(self.post_attn_norm(x) if pre else x, x)
    if moe:
      h, stats, chosen = h
    x = ctx.constrain(x + self._residual(self.mlp_out_norm(h) if post else h),
                      ("batch", "length", "embed"))
    if per_layer is not None:  # Gemma 4's per-layer input, gated by the stream
      dt = x.dtype
      g = jnp.einsum("BTD,DP->BTP", x, self.per_layer_gate[...].astype(dt))
      g = gated_activation(self.attn.cfg)(g, per_layer.astype(dt))
      h = jnp.einsum("BTP,PD->BTD", g, self.per_layer_out[...].astype(dt))
      x = ctx.constrain(x + self.per_layer_out_norm(h), ("batch", "length", "embed"))
    return done(x)

  def _parallel(self, xn, cos, sin, segment_ids, cache, positions, ctx, prefill, layer,
                sliding, nope):
    """cfg.parallel_mixer's mixers (Falcon-H1): attention and Mamba2 on the normed input
    `xn`, each scaled going in and coming out by its multipliers, summed; (h, the cache:
    a `HybridCaches` of the attention's and the Mamba2's, or None)."""
    cfg = self.attn.cfg

    def scaled(v, m):
      return v if m == 1.0 else v * jnp.asarray(m, v.dtype)

    full, linear = (None, None) if cache is None else cache
    a, full = self.attn(scaled(xn, cfg.attention_in_multiplier), cos, sin, segment_ids, full,
                        positions, ctx, prefill, layer, sliding, nope)
    m, linear = self.linear_attn(scaled(xn, cfg.ssm_in_multiplier), segment_ids, linear, ctx,
                                 prefill, layer)
    h = scaled(m, cfg.ssm_out_multiplier) + scaled(a, cfg.attention_out_multiplier)
    return h, (None if cache is None else HybridCaches(full, linear))

  def _normed(self, x):
    """The input norm of x, read in the compute dtype with cfg.residual_fp32."""
    if self.sublayer_dtype is not None:
      x = x.astype(_dtype(self.sublayer_dtype))
    return self.input_norm(x)

  def _residual(self, h):
    """A sublayer's output as its residual add takes it: times Granite's
    residual_multiplier (in its dtype, as transformers' bfloat16 product is)."""
    m = self.residual_multiplier
    return h if m == 1.0 else h * jnp.asarray(m, h.dtype)


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _rope_frequencies(rope: RopeConfig, cfg: ModelConfig) -> tuple:
  """(inv_freq, LongRoPE's long inv_freq or None, scaling, dynamic NTK scaling's (theta,
  rotated features, factor, original context) or None), of floats and tuples of them."""
  inv_freq, scaling = rope_lib.inverse_frequencies(rope, cfg.head_dim,
                                                   cfg.max_position_embeddings)
  long = None
  if rope.type == "longrope":
    long = tuple(float(f) for f in rope_lib.inverse_frequencies(
        rope, cfg.head_dim, cfg.max_position_embeddings, long=True)[0])
  dynamic = None
  if rope.type == "dynamic":  # past the model's context, as transformers scales it
    dynamic = (float(rope.theta), rope.rotary_dim(cfg.head_dim), float(rope.factor),
               int(cfg.max_position_embeddings))
  return tuple(float(f) for f in inv_freq), long, scaling, dynamic


def _rope_tables(rope: RopeConfig, freqs: tuple, positions_BxT, segment_ids_BxT):
  inv_freq, long, scaling, dynamic = freqs
  if dynamic is not None:
    return rope_lib.dynamic_tables(positions_BxT, segment_ids_BxT, np.asarray(inv_freq),
                                   *dynamic)
  if long is None:
    return rope_lib.rope_tables(positions_BxT, inv_freq, scaling)
  return rope_lib.longrope_tables(positions_BxT, segment_ids_BxT, np.asarray(inv_freq),
                                  np.asarray(long), scaling,
                                  rope.original_max_position_embeddings)


def value_head_std(cfg: ModelConfig) -> float:
  """Standard deviation of a new value head's weights: a reward model's score head
  (lm_head=False) draws 1 / sqrt(D + 1), as TRL and OpenAI's lm-human-preferences
  initialise the reward head, so a new model's scores have about unit scale; a value
  head beside a language-model head (PPO critic) draws cfg.init_std."""
  return cfg.init_std if cfg.lm_head else 1.0 / float(np.sqrt(cfg.d_model + 1))


class Transformer(nnx.Module):
  """The policy: `model(tokens)` returns logits [B, T, V]. With cfg.lm_head=False, a
  reward model: `scores(tokens, segment_ids)` returns one scalar per row [B]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = _dtype(cfg.param_dtype)
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pd,
                        std=cfg.init_std)
    # A mixture's leading dense layers in `dense_layers`, the others in `layers`
    # (`layer_stacks`); each a list of blocks, or with scan_layers one stacked block.
    for stack, indices in layer_stacks(cfg):
      kind = dict(dense=stack in ("dense_layers", "linear_dense_layers"),
                  linear=stack in _LINEAR_STACKS,
                  mlp_only=stack == "mlp_layers", moe_only=stack == "moe_layers",
                  global_layer=stack in ("global_layers", "shared_global_layers"),
                  kv_shared=stack in _SHARED_STACKS)
      setattr(self, stack, _stacked_blocks(cfg, rngs, len(indices), **kind)
              if cfg.scan_layers else
              nnx.List([Block(cfg, rngs, **kind) for _ in indices]))
    if cfg.learned_positions:  # GPT-2's absolute position embedding (OPT's past 2 rows)
      self.pos_embed = _param(rngs, (cfg.max_position_embeddings + cfg.position_offset,
                                     cfg.d_model), (None, "embed"), pd, std=cfg.init_std)
    if cfg.per_layer_dim:  # Gemma 4 E2B / E4B's per-layer embeddings
      p, n = cfg.per_layer_dim, cfg.num_layers
      self.per_layer_embed = _param(rngs, (cfg.per_layer_vocab or cfg.vocab_size, n, p),
                                    ("vocab", None, None), pd, std=cfg.init_std)
      self.per_layer_proj = _param(rngs, (cfg.d_model, n, p), ("embed", None, None), pd,
                                   std=cfg.init_std)
      self.per_layer_norm = _norm(cfg, p)
    if cfg.embed_norm and not cfg.norm_weightless:  # BLOOM's word_embeddings_layernorm
      self.embed_norm = _norm(cfg, cfg.d_model)
    self.final_norm = _norm(cfg, cfg.d_model)
    if cfg.lm_head and not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pd,
                            std=cfg.init_std)
    if cfg.lm_head and cfg.lm_head_bias:  # Phi-2's
      self.lm_head_bias = _param(None, (cfg.vocab_size,), ("vocab",), pd, init="zeros")
    if cfg.value_head:
      self.value_w = _param(rngs, (cfg.d_model,), ("embed",), jnp.float32,
                            std=value_head_std(cfg))
      self.value_b = _param(None, (), (), jnp.float32, init="zeros")
    # Static: not parameters. (inv_freq, LongRoPE's long inv_freq or None, scaling) of
    # the rotary embedding, and of the sliding layers' own (Gemma 3, OLMo 3).
    self._rope = _rope_frequencies(
        cfg.rope, cfg.global_config() if cfg.global_layers_apart else cfg)
    if cfg.rope_local is not None:
      self._rope_local = _rope_frequencies(cfg.rope_local, cfg)
    if cfg.lora_rank:  # Drawn last: the base weights are those of the model without.
      _attach_lora(self, rngs.params())
    if cfg.base_quantization:  # QLoRA: the frozen projections held quantized
      quant.quantize_model(self, cfg.base_quantization, cfg.base_quantization_block)

  # -- trunk ------------------------------------------------------------------------------

  def hidden_states(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, *,
                    cache: list[KVCache] | None = None, ctx: ShardingContext = _NO_SHARDING,
                    prefill: bool = False, router_loss: bool = False, routing=None,
                    return_routing: bool = False):
    """Final-normed hidden states [B, T, D] (and the updated cache when one is given; or
    with `router_loss`, a mixture's `load_balancing_loss` over every layer and token;
    with `return_routing`, the routing last).

    Args:
      tokens_BxT: int token ids.
      positions_BxT: per-token positions (default 0..T-1); restart per packed segment.
      segment_ids_BxT: packed-sequence ids, 0 = padding (default all ones).
      cache: a KV cache from `init_cache`; new keys are written at `positions`, queries
        attend to slots <= their position.
      ctx: mesh + rules for activation constraints.
      prefill: the cache is empty and the block holds positions 0..T-1 of every row:
        attend within the block (segment ids mask right padding) with
        cfg.attention_impl, and write its keys/values into slots 0..T-1 of the cache.
      routing: routing replay, a mixture's experts for every token [B, T, M, k] int (M
        its mixture layers, in order; k = num_experts_per_tok): each mixture layer
        sends each token to these experts, weighted by its router's probabilities of
        them (`route`), rather than to its own top-k (the experts the sampler or the
        policy before the update chose: the update's log-probs follow the same experts).
        Without a cache.
      return_routing: also return the experts every mixture layer chose for each token,
        [B, T, M, k] int32 (what `routing` replays). With `routing` given, those its
        routers would have chosen (the layers' inputs follow the replayed experts): how
        far the replayed routing is from the model's own.
    """
    cfg = self.cfg
    if tokens_BxT.ndim != 2:
      raise ValueError(f"tokens must be [batch, length], got shape {tokens_BxT.shape}")
    if (routing is not None or return_routing) and not cfg.num_experts:
      raise ValueError("routing replay needs a mixture of experts (num_experts > 0)")
    if routing is not None:
      want = (*tokens_BxT.shape, cfg.mixture_layers, cfg.num_experts_per_tok)
      if cache is not None:
        raise ValueError("routing is replayed without a cache (a training or log-prob "
                         "pass), not while decoding")
      if tuple(routing.shape) != want:
        raise ValueError(f"routing has shape {tuple(routing.shape)}, expected [batch, "
                         f"length, mixture layers, num_experts_per_tok] = {want}")
      if not jnp.issubdtype(routing.dtype, jnp.integer):
        raise ValueError(f"routing must hold integer expert ids, got {routing.dtype}")
    # Per mixture layer [M, B, T, k]: what each layer replays; recorded the same way.
    replay = None if routing is None else jnp.moveaxis(routing, 2, 0)
    record = bool(return_routing)
    if prefill and cache is None:
      raise ValueError("prefill=True needs a cache to fill")
    if router_loss and (cache is not None or not cfg.num_experts):
      raise ValueError("router_loss=True needs a mixture of experts (num_experts > 0) and "
                       "no cache")
    if cache is not None:
      _check_cache_layout(cfg, cache)
    b, t = tokens_BxT.shape
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones((b, t), jnp.int32)
    x = jnp.take(self.embed[...], tokens_BxT, axis=0)
    if cfg.learned_positions:  # GPT-2: each position's own row, NaN past the table
      x = x + jnp.take(self.pos_embed[...], positions_BxT + cfg.position_offset, axis=0,
                       mode="fill", fill_value=jnp.nan)
    if cfg.embed_scale:  # sqrt(D), rounded to the table's dtype as Gemma's is.
      x = x * jnp.asarray(float(np.sqrt(cfg.d_model)), x.dtype)
    if cfg.embedding_multiplier != 1.0:  # Granite's, in the table's dtype as its is
      x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
    if cfg.embed_norm:  # nanochat's by the final norm (weightless), BLOOM's by its own
      x = (self.final_norm if cfg.norm_weightless else self.embed_norm)(x)
    x = ctx.constrain(x.astype(jnp.float32 if cfg.residual_fp32 else _dtype(cfg.dtype)),
                      ("batch", "length", "embed"))
    tables = _rope_tables(cfg.rope, self._rope, positions_BxT, segment_ids_BxT)
    local = tables
    if cfg.rope_local is not None:
      local = _rope_tables(cfg.rope_local, self._rope_local, positions_BxT, segment_ids_BxT)
    stats, chosen = None, []
    if cfg.scan_layers and (any(cfg.linear_layers) or cfg.global_layers_apart):
      if all(cfg.nope_layers):  # no position embedding at all (Granite 4's -h- models)
        tables = tuple(f(t) for f, t in zip((jnp.ones_like, jnp.zeros_like), tables))
      blocks = {kind: getattr(self, _HYBRID_STACKS[kind])
                for kind in dict.fromkeys(layer_kinds(cfg))}
      x, new_caches, stats, chosen = _scan_hybrid(
          blocks, cfg, x, tables, segment_ids_BxT, cache, positions_BxT, ctx, prefill,
          router_loss, replay, record, local)
    elif cfg.scan_layers and cfg.moe_layer_step > 1:
      x, new_caches, stats, chosen = _scan_interleaved(
          self.dense_layers, self.layers, cfg, x, tables, local, segment_ids_BxT, cache,
          positions_BxT, ctx, prefill, router_loss, replay, record)
    elif cfg.scan_layers:
      new_caches = cache
      for stack, (first, *_) in layer_stacks(cfg):
        # A mixture's "layers" stack holds its mixture layers alone, in order.
        mixture = bool(cfg.num_experts) and stack == "layers"
        routed = router_loss and mixture
        x, new_caches, part, got = _scan_blocks(
            getattr(self, stack), x, tables, local, segment_ids_BxT, new_caches,
            positions_BxT, ctx, prefill, cfg.remat, routed, cfg.sliding_layers,
            cfg.nope_layers, first, replay if mixture else None, record and mixture)
        stats = part if routed else stats
        chosen = got if mixture else chosen
    else:
      new_caches = []
      placed = sorted(((i, block) for stack, indices in layer_stacks(cfg)
                       for i, block in zip(indices, getattr(self, stack))),
                      key=lambda pair: pair[0])
      m = 0  # mixture layers so far
      per_layer = (self._per_layer_inputs(tokens_BxT, x, ctx) if cfg.per_layer_dim
                   else None)
      producers = {cfg.kv_producer(i) for i in range(cfg.num_layers)} - {None}
      kept = {}  # a producer's (k, v, cache) for the layers sharing them
      for i, block in placed:
        layer_cache = None if cache is None else cache[i]
        sliding = cfg.sliding_layers[i]
        mixture = cfg.mixture_flags[i]
        routed = router_loss and mixture
        given = replay[m] if replay is not None and mixture else None
        rec = record and mixture
        cos, sin = local if sliding else tables
        nope = cfg.nope_layers[i]
        if nope:  # cos 1, sin 0: q and k pass unrotated
          cos, sin = jnp.ones_like(cos), jnp.zeros_like(sin)
        extra = dict(per_layer=None if per_layer is None else per_layer[:, :, i],
                     shared_kv=kept.get(cfg.kv_producer(i)), keep_kv=i in producers)
        if cfg.remat != "none" and cache is None:
          out = _remat_block(block, x, cos, sin, segment_ids_BxT, positions_BxT, ctx,
                             cfg.remat, routed, sliding, nope, given, rec, **extra)
        else:
          out = block(x, cos, sin, segment_ids_BxT, layer_cache, positions_BxT, ctx,
                      prefill, router_stats=routed, sliding=sliding, nope=nope,
                      experts=given, record_experts=rec, **extra)
        x, c = out[:2]
        if i in producers:
          kept[i] = (*out[-1], c)
        if routed:
          stats = out[2] if stats is None else jax.tree.map(jnp.add, stats, out[2])
        if rec:
          chosen.append(out[3])
        m += mixture
        new_caches.append(c)
    h = self.final_norm(x)
    if cfg.residual_fp32:  # the float32 stream's norm, rounded as the layers' outputs are
      h = h.astype(_dtype(cfg.dtype))
    out = (h,)
    if router_loss:
      out += (load_balancing_loss(stats, cfg.num_experts),)
    elif cache is not None:
      out += (new_caches,)
    if record:  # [M, B, T, k] -> [B, T, M, k]
      out += (jnp.moveaxis(chosen if isinstance(chosen, jax.Array) else jnp.stack(chosen),
                           0, 2),)
    return out[0] if len(out) == 1 else out

  def _per_layer_inputs(self, tokens_BxT, x_BxTxD, ctx: ShardingContext):
    """Each token's per-layer inputs [B, T, L, P] (cfg.per_layer_dim, Gemma 4's PLE): its
    per-layer embedding (times sqrt(P)) plus the normed projection of its scaled
    embedding `x_BxTxD` (times 1 / sqrt(D)), times 1 / sqrt(2)."""
    cfg = self.cfg
    dt = x_BxTxD.dtype
    table = self.per_layer_embed[...]
    ids = jnp.clip(tokens_BxT, 0, table.shape[0] - 1)
    own = jnp.take(table, ids, axis=0)  # [B, T, L, P]
    own = own * jnp.asarray(float(np.sqrt(cfg.per_layer_dim)), own.dtype)
    proj = jnp.einsum("BTD,DLP->BTLP", x_BxTxD, self.per_layer_proj[...].astype(dt))
    proj = self.per_layer_norm(proj * jnp.asarray(cfg.d_model ** -0.5, dt))
    out = (proj + own.astype(dt)) * jnp.asarray(2.0 ** -0.5, dt)
    return ctx.constrain(out, ("batch", "length", None, None))

  def _require_lm_head(self) -> None:
    if not self.cfg.lm_head:
      raise ValueError("this model has no language-model head (lm_head=False): it has no "
                       "logits or log-probs, only values and scores (a reward model)")

  def unembed(self) -> jax.Array:
    """The output projection [D, V] (divided by Granite's logits_scaling, times Falcon-H1's
    lm_head_multiplier: every head's logits are scaled so)."""
    self._require_lm_head()
    return self._head_scaled(self.embed[...].T if self.cfg.tie_embeddings else
                             self.lm_head[...])

  def unembed_bias(self) -> jax.Array | None:
    """The output projection's bias [V] (cfg.lm_head_bias; scaled as `unembed`), or None:
    the logits are h `unembed()` + this."""
    self._require_lm_head()
    return self._head_scaled(self.lm_head_bias[...]) if self.cfg.lm_head_bias else None

  def _head_scaled(self, w):
    if self.cfg.logits_scaling != 1.0:
      w = w / jnp.asarray(self.cfg.logits_scaling, w.dtype)
    if self.cfg.lm_head_multiplier != 1.0:
      w = w * jnp.asarray(self.cfg.lm_head_multiplier, w.dtype)
    return w

  def __call__(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, *, cache=None,
               ctx: ShardingContext = _NO_SHARDING, prefill: bool = False):
    self._require_lm_head()
    out = self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT, cache=cache, ctx=ctx,
                             prefill=prefill)
    h, new_cache = out if cache is not None else (out, None)
    dt = _dtype(self.cfg.dtype)
    logits = jnp.einsum("BTD,DV->BTV", h.astype(dt), self.unembed().astype(dt))
    if self.cfg.lm_head_bias:
      logits = logits + self.unembed_bias().astype(dt)[None, None]
    logits = soft_cap(logits, self.cfg.final_logit_softcap)
    logits = ctx.constrain(logits, ("batch", "length", "vocab"))
    return (logits, new_cache) if cache is not None else logits

  # -- heads ------------------------------------------------------------------------------

  def token_logprobs(self, tokens_BxT, targets_BxT, positions_BxT=None, segment_ids_BxT=None,
                     *, chunk: int | None = None, return_entropy: bool = False,
                     temperature: float = 1.0, ctx: ShardingContext = _NO_SHARDING):
    """log p(targets[t] | tokens[:t+1]) [B, T] float32, computed chunk by chunk.

    Never materialises float32 [B, T, V] logits: the vocabulary projection, log-softmax and
    gather run over `chunk` positions at a time, rematerialised in the backward pass.
    """
    self._require_lm_head()
    h = self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT, ctx=ctx)
    return chunked_logprobs(h, self.unembed(), targets_BxT, chunk=chunk or self.cfg.logprob_chunk,
                            return_entropy=return_entropy, temperature=temperature,
                            compute_dtype=_dtype(self.cfg.dtype), ctx=ctx,
                            logit_soft_cap=self.cfg.final_logit_softcap,
                            bias_V=self.unembed_bias())

  def values(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, *,
             ctx: ShardingContext = _NO_SHARDING):
    """Scalar value per position [B, T] float32 (requires cfg.value_head)."""
    if not self.cfg.value_head:
      raise ValueError("this model has no value head; build it with value_head=True")
    h = self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT, ctx=ctx)
    return jnp.einsum("BTD,D->BT", h.astype(jnp.float32), self.value_w[...]) + self.value_b[...]

  def scores(self, tokens_BxT, segment_ids_BxT=None, positions_BxT=None, *,
             ctx: ShardingContext = _NO_SHARDING):
    """One scalar per row [B] float32: the value at the row's last position whose
    segment id is > 0 (requires cfg.value_head).

    Rows hold one right-padded sequence each (segment id 0 = padding; default: no
    padding, the last position): Hugging Face's sequence-classification rule, the score
    of the last non-pad token. A row without a real token scores 0.
    """
    values_BxT = self.values(tokens_BxT, positions_BxT, segment_ids_BxT, ctx=ctx)
    if segment_ids_BxT is None:
      return values_BxT[:, -1]
    index_BxT = jax.lax.broadcasted_iota(jnp.int32, values_BxT.shape, 1)
    last_B = jnp.max(jnp.where(segment_ids_BxT > 0, index_BxT, -1), axis=1)
    picked_B = jnp.take_along_axis(values_BxT, jnp.maximum(last_B, 0)[:, None], axis=1)[:, 0]
    return jnp.where(last_B >= 0, picked_B, 0.0)


def _remat_block(block, x, cos, sin, segment_ids, positions, ctx, policy_name,
                 router_stats: bool = False, sliding: bool = False, nope: bool = False,
                 experts=None, record_experts: bool = False, per_layer=None, shared_kv=None,
                 keep_kv: bool = False):
  # The block is split into a pure pytree and merged inside the checkpointed function,
  # so it also works when the caller merged the model outside an enclosing trace (a
  # lax.scan over micro-batches): nnx.remat would refuse to touch such variables.
  graphdef, state = nnx.split(block)

  def run(state, x, cos, sin, segment_ids, positions, experts, per_layer, shared_kv):
    return nnx.merge(graphdef, state)(x, cos, sin, segment_ids, None, positions, ctx,
                                      router_stats=router_stats, sliding=sliding,
                                      nope=nope, experts=experts,
                                      record_experts=record_experts, per_layer=per_layer,
                                      shared_kv=shared_kv, keep_kv=keep_kv)

  fn = jax.checkpoint(run, policy=_REMAT_POLICIES[policy_name], prevent_cse=True)
  return fn(state, x, cos, sin, segment_ids, positions, experts, per_layer, shared_kv)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, count: int | None = None,
                    dense: bool = False, linear: bool = False, mlp_only: bool = False,
                    moe_only: bool = False, global_layer: bool = False,
                    kv_shared: bool = False) -> Block:
  """One Block whose parameters stack `count` layers' (default all) on a leading "layers"
  axis (`dense`: a mixture's leading dense layers).

  Each layer draws from its own key, split off one draw of `rngs.params`; the layer
  axis is named "layers" in every parameter's logical axes (replicated by the default
  rules)."""
  keys = jax.random.split(rngs.params(), cfg.num_layers if count is None else count)
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: Block(cfg, nnx.Rngs(0), dense, linear, mlp_only, moe_only, global_layer,
                    kv_shared)))
  state = jax.vmap(lambda key: nnx.state(
      Block(cfg, nnx.Rngs(params=key), dense, linear, mlp_only, moe_only,
            global_layer, kv_shared)))(keys)

  def name_axis(v):
    return v.replace(logical_axes=("layers",) + tuple(v.get_metadata()["logical_axes"]))

  return nnx.merge(graphdef, jax.tree.map(name_axis, state,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable)))


# A hybrid model's training period of more runs of one kind of layer than this rebuilds
# its unrolled layers in order under full remat (`_scan_hybrid`); Bamba-9B's seven stay
# checkpointed as they were.
_UNROLLED_RUNS = 8
# A hybrid model's kinds of layer (`layer_kinds`) and the stacks holding them.
_HYBRID_STACKS = {"linear": "linear_layers", "full": "layers", "mlp": "mlp_layers",
                  "moe": "moe_layers", "sliding": "layers", "global": "global_layers",
                  "linear_dense": "linear_dense_layers", "full_dense": "dense_layers"}
# Where a kind's cache sits in a HybridCaches (an MLP or a mixture alone has none), or
# (cfg.global_layers_apart) in a LayerKindCaches.
_HYBRID_CACHES = {"linear": "linear", "full": "full", "mlp": None, "moe": None,
                  "sliding": "sliding", "global": "full", "linear_dense": "linear",
                  "full_dense": "full"}


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
  """Per layer of a hybrid model, its kind: "linear" (a linear-attention layer), "full"
  (attention), "mlp" (an MLP alone, cfg.split_layers) or "moe" (a mixture alone), a
  mixture's dense layers "linear_dense" / "full_dense"; with cfg.global_layers_apart
  "sliding" or "global"."""
  if cfg.global_layers_apart:
    return tuple("sliding" if s else "global" for s in cfg.sliding_layers)
  kinds = tuple("linear" if lin else "mlp" if mlp else "moe" if moe else "full"
                for lin, mlp, moe in zip(cfg.linear_layers, cfg.mlp_layers, cfg.moe_layers))
  if cfg.num_experts and not cfg.split_layers:  # a mixture's dense layers apart
    kinds = tuple(k if m else k + "_dense" for k, m in zip(kinds, cfg.mixture_flags))
  return kinds


def period_runs(cfg: ModelConfig) -> list[list]:
  """[kind, first, count] of each run of consecutive layers of one kind in a hybrid
  model's period (`layer_kinds`), first the run's first layer among its kind's in the
  period."""
  runs = []
  for kind in layer_kinds(cfg)[:cfg.layer_period]:
    if runs and runs[-1][0] == kind:
      runs[-1][2] += 1
    else:
      runs.append([kind, sum(r[2] for r in runs if r[0] == kind), 1])
  return runs


def ordered_layers(cfg: ModelConfig) -> dict[str, int]:
  """{kind: its layers} a scanned hybrid's training rebuilds in order (`_ordered_remat`:
  single-layer runs of a period of more than _UNROLLED_RUNS runs under full remat, but
  for a mixture's layers where the step takes their router statistics, a load-balancing
  loss); {} for other models."""
  if not (cfg.scan_layers and any(cfg.linear_layers) and cfg.remat == "full"
          and (cfg.split_layers or not cfg.num_experts)):
    return {}
  runs = period_runs(cfg)
  if len(runs) <= _UNROLLED_RUNS:
    return {}
  periods = cfg.num_layers // cfg.layer_period
  out: dict[str, int] = {}
  for kind, _, count in runs:
    if count == 1 and not (kind == "moe" and cfg.router_aux_loss_coef):
      out[kind] = out.get(kind, 0) + periods
  return out


def _scan_hybrid(blocks: dict[str, Block], cfg: ModelConfig, x, tables, segment_ids, cache,
                 positions, ctx, prefill, router_stats: bool, replay=None,
                 record: bool = False, local_tables=None):
  """Runs a model of linear- and full-attention layers (and, with cfg.split_layers, MLPs
  alone; `blocks` maps each kind of `layer_kinds` to its stack) as one `lax.scan` over
  periods of cfg.layer_period layers (Qwen3.5: three linear layers, then a full one):
  the program holds one period, whatever the depth.

  With a cache (prefill, decoding) the period's layers are unrolled in the body (their
  weights indexed from the kinds' stacks by layer), each layer's cache and (decoding)
  weights passed through optimization barriers so that XLA holds one layer's gathered
  weights and cache entries at a time, not the period's. Without one (training), each
  run of consecutive layers of one kind is an inner `lax.scan` of rematerialised layers:
  unrolled, the backward pass may rebuild all of a period's layers before it needs the
  first, and XLA:TPU did (three Gated DeltaNet layers' working sets live at once: 9.5
  GiB a chip more in Qwen3.5-27B's update on v5p-64); a loop rebuilds one at a time.
  Returns (x, the HybridCaches or None, the layers' RouterStats summed with
  `router_stats`, else None, the experts each mixture layer chose [M, B, T, k] with
  `record`, else None). `replay`: the experts each mixture layer takes, the same shape
  (a cache-free pass). With cfg.global_layers_apart (Gemma 4) the kinds are the sliding
  layers, which rotate by `local_tables`, and the full ones (their cache a
  LayerKindCaches)."""
  p = cfg.layer_period
  pattern = layer_kinds(cfg)[:p]
  periods = cfg.num_layers // p
  per = {kind: pattern.count(kind) for kind in blocks}

  def mixes(kind):  # whether a layer of this kind holds a mixture of experts
    return (bool(cfg.num_experts) and (kind == "moe" or not cfg.split_layers)
            and not kind.endswith("_dense"))

  mixing = sum(mixes(kind) for kind in pattern)  # mixture layers a period
  # The experts each period's mixture layers take: [periods, mixing, B, T, k].
  replay = None if replay is None else replay.reshape(periods, mixing, *replay.shape[1:])
  # Training scans the stacks as [periods, layers a period, ...]. A cached call of more
  # than one period indexes the stacks as they are, by layer: their reshape left XLA:TPU
  # a layout to pick, and it relaid whole stacks for the prefill and sliced a period's
  # weights at once (Qwen3.5-27B's rollout on a v5p-64: 2.15 GiB a chip; BENCHMARKS.md).
  # One period's reshape is free (Bamba-9B-shaped, v5e-8: prefill 9.29 GiB, 9.37 by layer).
  by_layer = cache is not None and periods > 1
  graphs, states = {}, {}
  for kind, stack in blocks.items():
    graphs[kind], state = nnx.split(stack)
    states[kind] = state if by_layer else jax.tree.map(
        lambda a, n=per[kind]: a.reshape(periods, n, *a.shape[1:]), state)
  runs = period_runs(cfg)

  def kind_tables(kind):  # (cos, sin) of a layer of this kind
    return local_tables if kind == "sliding" and local_tables is not None else tables

  def routed(kind):  # whether a layer of this kind gives router statistics
    return router_stats and mixes(kind)

  def recorded(kind):  # whether a layer of this kind returns the experts it chose
    return record and mixes(kind)

  def run(kind, j, period_state, x, unit, i, experts=None):
    # The period's j-th layer of this kind (j static, or traced in an inner scan), taken
    # inside the checkpoint: a slice taken outside would be a residual, a second copy of
    # every layer's weights.
    state = jax.tree.map(lambda a: a[j], period_state)
    return nnx.merge(graphs[kind], state)(x, *kind_tables(kind), segment_ids, unit,
                                          positions, ctx, prefill, i,
                                          router_stats=routed(kind), sliding=kind == "sliding",
                                          experts=experts, record_experts=recorded(kind))

  def run_layer(kind, state, x, experts=None):  # an inner scan's layer: its weights are
    # the scan's xs
    return nnx.merge(graphs[kind], state)(x, *kind_tables(kind), segment_ids, None,
                                          positions, ctx, prefill, None,
                                          router_stats=routed(kind), sliding=kind == "sliding",
                                          experts=experts, record_experts=recorded(kind))

  if cache is None and cfg.remat != "none":
    policy = _REMAT_POLICIES[cfg.remat]
    # A layer `run` unrolled in the body is no scan's: without prevent_cse, XLA merged
    # its rematerialised forward with the forward pass itself (a one-period model's loop
    # of one step is inlined), keeping every such layer's activations for the backward:
    # a Nemotron-H-8B-shaped update on a v5e-8 needed 18.9 GiB a chip of temporaries.
    run = jax.checkpoint(run, policy=policy, prevent_cse=True, static_argnums=(0,))
    run_layer = jax.checkpoint(run_layer, policy=policy, prevent_cse=False,
                               static_argnums=(0,))

  def add_stats(stats, new):
    return new if stats is None else jax.tree.map(jnp.add, stats, new)

  # A period of many runs (a pattern that does not repeat, as Nemotron-H-8B's: one
  # period of 52 layers, nearly every run a single layer) under full remat takes each
  # unrolled layer's weights tied to its input and rebuilds it only once its output's
  # cotangent has arrived (`_ordered_remat`, `_unrolled_layer`). Checkpointed, XLA:TPU
  # sliced (and relaid) every such layer's weights up front and held them (16 layers
  # of Nemotron-H-8B's widths, LoRA, on a v5e-8: 4.25 GiB a chip of temporaries, 3.08
  # tied; the ordering alone left 4.25; all 52 layers: 13.4, 10.3). A scan over the
  # layers switching on each one's kind kept every kind's weights as the switch's
  # residuals (16 layers: 19.9).
  ordered = cache is None and bool(ordered_layers(cfg))

  def body(carry, xs):
    x, caches = carry
    period_states, period, period_replay = xs
    stats = None
    chosen = []  # the period's mixture layers' experts, in order
    mixed = 0  # the period's mixture layers so far
    if caches is None:
      for kind, first, count in runs:
        given = None  # the run's replayed experts [count, B, T, k]
        if mixes(kind) and period_replay is not None:
          given = period_replay[mixed:mixed + count]
        mixed += count if mixes(kind) else 0
        if (count == 1 and ordered and not routed(kind)
            and not (mixes(kind) and (record or given is not None))):
          layer = functools.partial(_unrolled_layer, graphs[kind], first, ctx)
          x = _ordered_remat(layer)(x, period_states[kind],
                                    (*kind_tables(kind), segment_ids, positions))
          continue
        if count == 1:
          out = run(kind, first, period_states[kind], x, None, None,
                    None if given is None else given[0])
          x = out[0]
          if routed(kind):
            stats = add_stats(stats, out[2])
          if recorded(kind):
            chosen.append(out[3][None])
          continue
        if count == per[kind]:  # all the period's layers of this kind: scanned as xs

          def step(x, xs, kind=kind):
            state, experts = xs
            out = run_layer(kind, state, x, experts)
            return out[0], (out[2] if routed(kind) else None,
                            out[3] if recorded(kind) else None)

          x, (new, got) = jax.lax.scan(step, x, (period_states[kind], given))
        else:  # some of them: indexed inside the checkpoint

          def step(x, xs, kind=kind):
            j, experts = xs
            out = run(kind, j, period_states[kind], x, None, None, experts)
            return out[0], (out[2] if routed(kind) else None,
                            out[3] if recorded(kind) else None)

          x, (new, got) = jax.lax.scan(step, x, (jnp.arange(first, first + count), given))
        if routed(kind):
          stats = add_stats(stats, jax.tree.map(lambda s: jnp.sum(s, axis=0), new))
        if recorded(kind):
          chosen.append(got)
      return (x, caches), (stats, jnp.concatenate(chosen) if record else None)
    seen = dict.fromkeys(blocks, 0)
    # A kind's cache entries sit in its field's stack, shared with any other kind of that
    # field (a mixture's dense linear layers and its other linear ones): the layer's index
    # among the field's layers.
    fields = [_HYBRID_CACHES[kind] for kind in pattern]
    per_field = {f: fields.count(f) for f in fields}
    seen_field = dict.fromkeys(per_field, 0)
    for kind in pattern:
      j = seen[kind]
      seen[kind] += 1
      field = _HYBRID_CACHES[kind]
      at = period * per_field[field] + seen_field[field]
      seen_field[field] += 1
      stack = states[kind] if by_layer else period_states[kind]
      if not prefill or kind == "moe":
        # A decode step gathers each layer's (FSDP-sharded) weights; tied to the layer's
        # input, a layer's gather waits for the layer before it. Unrolled and untied,
        # XLA:TPU gathered every layer's weights at the top of the step (a Bamba-9B-shaped
        # decode on a v5e-8: 13.3 GiB a chip, 7.9 tied; BENCHMARKS.md). The kind's stack
        # is tied and then sliced: tying the layer's slice held more (9.4; on 8 of those
        # layers 3.07 against 2.69; XLA's report showed whole stacks relaid once a call).
        # Not in a prefill, where either tie raised XLA:TPU's peak (8 layers: 2.98 GiB
        # untied, 5.3 and 5.7 tied), but for the mixtures alone (Nemotron 3): untied,
        # XLA:TPU relaid the whole stack of local experts and sliced every mixture
        # layer's share of it before the first layer ran (Nemotron-3-Nano-shaped, experts
        # over fsdp, v5e-8: prefill 15.80 GiB a chip, 13.29 with the mixtures tied).
        x, stack = jax.lax.optimization_barrier((x, stack))
      if by_layer:
        state = jax.tree.map(lambda a, i=period * per[kind] + j: jax.lax.dynamic_index_in_dim(
            a, i, keepdims=False), stack)
      else:
        state = jax.tree.map(lambda a, j=j: a[j], stack)
      unit = None if field is None else getattr(caches, field)
      out = nnx.merge(graphs[kind], state)(x, *kind_tables(kind), segment_ids, unit,
                                           positions, ctx, prefill, at,
                                           router_stats=routed(kind),
                                           sliding=kind == "sliding",
                                           record_experts=recorded(kind))
      # The next layer takes the cache and x as this one left them: without this barrier
      # XLA:TPU held more of the layers' work at once (the same model's prefill: 10.8
      # GiB a chip, 9.3 with it).
      x, caches = jax.lax.optimization_barrier(
          (out[0], caches if field is None else caches._replace(**{field: out[1]})))
      if routed(kind):
        stats = add_stats(stats, out[2])
      if recorded(kind):
        chosen.append(out[3])
    return (x, caches), (stats, jnp.stack(chosen) if record else None)

  (x, cache), (stats, chosen) = jax.lax.scan(
      body, (x, cache),
      (None if by_layer else states, jnp.arange(periods, dtype=jnp.int32), replay))
  if router_stats:
    stats = jax.tree.map(lambda s: jnp.sum(s, axis=0), stats)
  if record:  # [periods, mixing, B, T, k] -> [M, B, T, k]
    chosen = chosen.reshape(periods * mixing, *chosen.shape[2:])
  return x, cache, stats, chosen


def _unrolled_layer(graph, j, ctx, x, stack, inputs):
  """x through the j-th layer of `stack` (a kind's period of stacked weights, `graph`
  its graph), without a cache, `inputs` its (cos, sin, segment ids, positions): an
  `_ordered_remat` layer of `_scan_hybrid`."""
  cos, sin, segment_ids, positions = inputs
  # Tied to the layer's input, its weights are sliced when the layer runs: free to,
  # XLA:TPU sliced (and relaid) every layer's up front and held them all.
  x, stack = jax.lax.optimization_barrier((x, stack))
  state = jax.tree.map(lambda a: a[j], stack)
  return nnx.merge(graph, state)(x, cos, sin, segment_ids, None, positions, ctx)[0]


def _ordered_remat(layer):
  """`layer(x, weights, inputs) -> x` saving only its arguments (full remat), its
  backward rebuilding the forward only once the cotangent of its output has arrived:
  the arguments and the cotangent pass one optimization barrier, so XLA cannot rebuild
  a layer ahead of the layers after it (as it may a `jax.checkpoint`, whose rebuild
  depends on saved inputs alone). `inputs` (rotary tables, segment ids, positions) take
  no gradient."""
  @jax.custom_vjp
  def run(x, weights, inputs):
    return layer(x, weights, inputs)

  def forward(x, weights, inputs):
    return layer(x, weights, inputs), (x, weights, inputs)

  def backward(saved, cotangent):
    saved, cotangent = jax.lax.optimization_barrier((saved, cotangent))
    x, weights, inputs = saved
    dx, dweights = jax.vjp(lambda x, w: layer(x, w, inputs), x, weights)[1](cotangent)
    zeros = jax.tree.map(lambda a: (jnp.zeros_like(a) if jnp.issubdtype(a.dtype, jnp.floating)
                                    else np.zeros(a.shape, jax.dtypes.float0)), inputs)
    return dx, dweights, zeros

  run.defvjp(forward, backward)
  return run


def _scan_interleaved(dense_blocks: Block, mixture_blocks: Block, cfg: ModelConfig, x, tables,
                      local_tables, segment_ids, cache, positions, ctx, prefill,
                      router_stats: bool, replay=None, record: bool = False):
  """Runs a mixture whose dense layers sit between its mixture layers (cfg.moe_layer_step
  = p: p - 1 dense layers, then a mixture layer; Llama 4 Maverick's p = 2) as one
  `lax.scan` over periods of p layers: the program holds one period, whatever the depth.
  Each layer's NoPE and sliding flags ride the scan (as in `_scan_blocks`: the flag picks
  the layer's rotary tables, kernel and, in a LayerKindCaches, its stack). The cache,
  when given, stacks every layer (or every layer of a kind) and travels in the carry.
  Each layer is rematerialised on its own, its weights sliced from the period's inside
  the checkpoint. Returns (x, the cache or None, the mixture layers' RouterStats summed
  with `router_stats`, else None, the experts each mixture layer chose [periods, B, T, k]
  with `record`, else None). `replay`: the experts each mixture layer takes, the same
  shape."""
  p = cfg.moe_layer_step
  periods = cfg.num_layers // p
  dense_graph, dense_state = nnx.split(dense_blocks)
  mixture_graph, mixture_state = nnx.split(mixture_blocks)
  dense_state = jax.tree.map(lambda a: a.reshape(periods, p - 1, *a.shape[1:]), dense_state)
  nopes = jnp.asarray(cfg.nope_layers, bool).reshape(periods, p)
  kinds = np.asarray(cfg.sliding_layers, bool)
  mixed = len(set(kinds.tolist())) > 1
  slides = jnp.asarray(kinds).reshape(periods, p)
  index = np.arange(cfg.num_layers)  # each layer's index in the cache (among its kind's)
  if isinstance(cache, LayerKindCaches):
    index = np.where(kinds, np.cumsum(kinds) - 1, np.cumsum(~kinds) - 1)
  index = jnp.asarray(index, jnp.int32).reshape(periods, p)

  def run(graph, routed, j, state, x, unit, i, nope, slide, experts=None, rec=False):
    if j is not None:  # the period's j-th dense layer
      state = jax.tree.map(lambda a: a[j], state)
    sliding = slide if mixed else bool(kinds[0])
    cos, sin = (jnp.where(slide, a, b) for a, b in zip(local_tables, tables))
    cos, sin = jnp.where(nope, 1.0, cos), jnp.where(nope, 0.0, sin)
    return nnx.merge(graph, state)(x, cos, sin, segment_ids, unit, positions, ctx, prefill,
                                   i, router_stats=routed, sliding=sliding, nope=nope,
                                   experts=experts, record_experts=rec)

  if cache is None and cfg.remat != "none":
    run = jax.checkpoint(run, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False,
                         static_argnums=(0, 1, 2, 10))

  def body(carry, xs):
    x, cache = carry
    dense, mixture, nope, slide, at, experts = xs
    for j in range(p - 1):
      out = run(dense_graph, False, j, dense, x, cache, None if cache is None else at[j],
                nope[j], slide[j], None, False)
      x, cache = out[0], out[1]
    out = run(mixture_graph, router_stats, None, mixture, x, cache,
              None if cache is None else at[p - 1], nope[p - 1], slide[p - 1], experts,
              record)
    return (out[0], out[1]), (out[2] if router_stats else None, out[3] if record else None)

  (x, cache), (stats, chosen) = jax.lax.scan(
      body, (x, cache), (dense_state, mixture_state, nopes, slides, index, replay))
  if router_stats:
    stats = jax.tree.map(lambda s: jnp.sum(s, axis=0), stats)
  return x, cache, stats, chosen


def _check_cache_layout(cfg: ModelConfig, cache) -> None:
  mixed = len(set(cfg.sliding_layers)) > 1
  want = ((LayerKindCaches if mixed else KVCache) if cfg.scan_layers else list)
  if cfg.linear_mixers and cfg.scan_layers:
    want = HybridCaches
  if not isinstance(cache, want) or (want is KVCache and not _is_stacked(cache)):
    raise ValueError(
        "cache layout does not match the model: scan_layers models take one KVCache "
        "stacking the layers (a LayerKindCaches of two stacks with layers of both kinds, "
        "a HybridCaches with linear-attention layers), "
        "others a list per layer (build it with init_cache(cfg, ...))")


def _scan_blocks(blocks: Block, x, tables, local_tables, segment_ids, cache, positions, ctx,
                 prefill, remat: str, router_stats: bool = False,
                 sliding_layers: tuple[bool, ...] = (), nope_layers: tuple[bool, ...] = (),
                 first: int = 0, replay=None, record: bool = False):
  """Runs the stacked layers as one `lax.scan`: the program holds one layer's body,
  whatever the depth, so compile time and program size do not grow with layers.
  Returns (x, cache, the layers' RouterStats summed with `router_stats`, else None, the
  experts each layer chose [layers, B, T, k] with `record`, else None). `replay`: the
  experts each layer takes [layers, B, T, k] (a stack of mixture layers).

  The cache, when given, stacks the layers and travels in the carry: each layer writes
  its slots in place (`write_cache(..., layer=i)`). With layers of both kinds it is a
  LayerKindCaches, and each layer's index among its own kind rides the scan. `tables` /
  `local_tables` are the rotary (cos, sin) of full / sliding layers; with layers of both kinds
  (`sliding_layers`) each layer's flag rides the scan and picks its tables and kernel.
  NoPE layers (`nope_layers`) take cos 1 and sin 0 by a flag that rides the scan too.
  `blocks` are the model's layers `first`, `first + 1`, ... (a stack after a mixture's
  dense layers): the flags are the whole model's, and the cache holds every layer.
  """
  graphdef, state = nnx.split(blocks)
  depth = jax.tree.leaves(state)[0].shape[0]
  every_sliding = tuple(sliding_layers)
  sliding_layers = every_sliding[first:first + depth]
  nope_layers = tuple(nope_layers)[first:first + depth]
  kinds = set(sliding_layers)
  flags = jnp.asarray(sliding_layers, bool) if len(kinds) > 1 else None
  static = bool(sliding_layers and sliding_layers[0])
  nopes = jnp.asarray(nope_layers, bool) if any(nope_layers) else None

  def run(state, x, cache, i, flag, nope, experts=None):
    if flag is None:
      cos, sin, sliding = *(local_tables if static else tables), static
    else:
      cos, sin = (jnp.where(flag, a, b) for a, b in zip(local_tables, tables))
      sliding = flag
    if nope is not None:
      cos, sin = jnp.where(nope, 1.0, cos), jnp.where(nope, 0.0, sin)
    return nnx.merge(graphdef, state)(x, cos, sin, segment_ids, cache, positions, ctx,
                                      prefill, i, router_stats=router_stats, sliding=sliding,
                                      nope=False if nope is None else nope, experts=experts,
                                      record_experts=record)

  if cache is None:
    if remat != "none":
      # No prevent_cse: a scan body is not merged with its neighbours.
      run = jax.checkpoint(run, policy=_REMAT_POLICIES[remat], prevent_cse=False)

    def body(x, xs):
      layer_state, flag, nope, experts = xs
      out = run(layer_state, x, None, None, flag, nope, experts)
      return out[0], (out[2] if router_stats else None, out[3] if record else None)

    x, (stats, chosen) = jax.lax.scan(body, x, (state, flags, nopes, replay))
    return x, None, (jax.tree.map(lambda s: jnp.sum(s, axis=0), stats) if router_stats
                     else None), chosen

  # Each layer's index in the cache: its own, or among the layers of its kind.
  index = np.arange(len(every_sliding))
  if isinstance(cache, LayerKindCaches):
    kinds = np.asarray(every_sliding, bool)
    index = np.where(kinds, np.cumsum(kinds) - 1, np.cumsum(~kinds) - 1)
  index = index[first:first + depth]

  def body_cached(x_cache, xs):
    x, cache = x_cache
    layer_state, flag, nope, i = xs
    out = run(layer_state, x, cache, i, flag, nope)
    return (out[0], out[1]), (out[3] if record else None)

  (x, cache), chosen = jax.lax.scan(body_cached, (x, cache),
                                    (state, flags, nopes, jnp.asarray(index, jnp.int32)))
  return x, cache, None, chosen


def chunked_logprobs(h_BxTxD, w_DxV, targets_BxT, *, chunk: int, return_entropy: bool = False,
                     temperature: float = 1.0, compute_dtype=jnp.float32,
                     ctx: ShardingContext = _NO_SHARDING, logit_soft_cap: float | None = None,
                     bias_V=None):
  """Per-token log-probs (and optionally entropies) of targets, `chunk` positions at a time.
  `logit_soft_cap`: the model's final logit soft cap, applied before the temperature.
  `bias_V`: the output projection's bias (`Transformer.unembed_bias`), or None.

  Under a mesh whose rules split D (fsdp), the vocabulary is split instead
  (`ShardingContext.vocab_parallel_head`): no device holds the whole [D, V] projection
  or its gradient, only [rows, chunk, V / devices] logits.
  """
  b, t, d = h_BxTxD.shape
  chunk = max(1, min(chunk, t))
  layout = ctx.vocab_parallel_head(b, chunk, d, w_DxV.shape[1])
  n = -(-t // chunk)
  pad = n * chunk - t
  h = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
  tg = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
  h = h.reshape(b, n, chunk, d).swapaxes(0, 1)
  tg = tg.reshape(b, n, chunk).swapaxes(0, 1)
  w = w_DxV.astype(compute_dtype)
  bias = _head_bias(bias_V, layout, ctx)
  if layout is not None:
    w_spec, logits_spec = layout
    w = jax.lax.with_sharding_constraint(w, NamedSharding(ctx.mesh, w_spec))
    rows_spec = PartitionSpec(logits_spec[0], PartitionSpec.UNCONSTRAINED, None)

  @jax.checkpoint
  def one_chunk(h_BxCxD, t_BxC):
    h_BxCxD = h_BxCxD.astype(compute_dtype)
    if layout is not None:
      h_BxCxD = jax.lax.with_sharding_constraint(h_BxCxD, NamedSharding(ctx.mesh, rows_spec))
    logits = jnp.einsum("BCD,DV->BCV", h_BxCxD, w, preferred_element_type=jnp.float32)
    if bias is not None:
      logits = logits + bias[None, None]
    if layout is not None:
      logits = jax.lax.with_sharding_constraint(logits, NamedSharding(ctx.mesh, logits_spec))
    logits = soft_cap(logits, logit_soft_cap)
    if temperature != 1.0:
      logits = logits / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    if layout is None:
      picked = jnp.take_along_axis(logits, t_BxC[..., None], axis=-1)[..., 0]
    else:  # A reduction over the split vocabulary, where a gather would collect it.
      vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
      picked = jnp.sum(jnp.where(vocab_ids == t_BxC[..., None], logits, 0.0), axis=-1)
    logp = picked - logz
    if not return_entropy:
      return logp, jnp.zeros_like(logp)
    probs = jax.nn.softmax(logits, axis=-1)
    entropy = logz - jnp.sum(probs * logits, axis=-1)
    return logp, entropy

  def body(carry, xs):
    return carry, one_chunk(*xs)

  _, (logp, ent) = jax.lax.scan(body, None, (h, tg))
  logp = logp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  if return_entropy:
    return logp, ent.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return logp


def _head_bias(bias_V, layout, ctx: ShardingContext):
  """An output projection's bias [V] as float32 logits add it (None stays None), its
  vocabulary split as the logits' is under a split-vocabulary `layout`."""
  if bias_V is None:
    return None
  bias = bias_V.astype(jnp.float32)
  if layout is not None:
    bias = jax.lax.with_sharding_constraint(
        bias, NamedSharding(ctx.mesh, PartitionSpec(layout[1][-1])))
  return bias


DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")


def chunked_divergence(h_BxTxD, w_DxV, teacher_h_BxTxE, teacher_w_ExW, *, kind: str,
                       chunk: int, temperature: float = 1.0, compute_dtype=jnp.float32,
                       beta: float = 0.5, logit_soft_cap: float | None = None,
                       teacher_logit_soft_cap: float | None = None,
                       ctx: ShardingContext = _NO_SHARDING, bias_V=None, teacher_bias_W=None):
  """Per-position divergence between the model's next-token distribution and a teacher's,
  over the whole vocabulary, `chunk` positions at a time (no [B, T, V] array):

      reverse_kl  KL(p || q) = sum_v p(v) (log p(v) - log q(v))   (mode-seeking; GKD's
                  on-policy choice)
      forward_kl  KL(q || p) = sum_v q(v) (log q(v) - log p(v))   (mass-covering)
      jsd         beta KL(q || m) + (1 - beta) KL(p || m), m = beta q + (1 - beta) p
                  (GKD's generalised Jensen-Shannon divergence, as TRL's
                  `generalized_jsd_loss`: forward KL as beta -> 0, reverse as beta -> 1)

  with p the model's (its logits, soft-capped by `logit_soft_cap`, at `temperature`), q
  the teacher's (soft-capped by `teacher_logit_soft_cap`) at temperature 1, which carries
  no gradient. A teacher with a larger vocabulary (padding rows, say) is
  read on the model's V tokens, renormalised there.

  Under a mesh whose rules split D (or the teacher's E) over fsdp, the vocabulary is split
  instead, as in `chunked_logprobs` (`ShardingContext.vocab_parallel_head`): both
  projections move to [D or E, V / devices], each chunk's hidden states (the model's and
  the teacher's) gather over the embed axes, and the log-softmaxes reduce across the
  slices, so no device holds either whole projection or the model's whole gradient.

  Args:
    h_BxTxD, w_DxV: the model's final hidden states and output projection.
    teacher_h_BxTxE, teacher_w_ExW: the teacher's, W >= V.
    bias_V, teacher_bias_W: their output projections' biases (`Transformer.unembed_bias`),
      or None.
    kind: one of DIVERGENCES.
    beta: jsd's interpolation, in (0, 1).
    ctx: the mesh and rules, for the split-vocabulary layout (none: the plain one).

  Returns:
    `[B, T]` float32, differentiable in the model's inputs.
  """
  if kind not in DIVERGENCES:
    raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES}")
  if kind == "jsd" and not 0 < beta < 1:
    raise ValueError(f"jsd needs beta in (0, 1) (0: forward_kl, 1: reverse_kl), got {beta}")
  b, t, d = h_BxTxD.shape
  vocab = w_DxV.shape[1]
  if teacher_h_BxTxE.shape[:2] != (b, t):
    raise ValueError(f"teacher hidden states {teacher_h_BxTxE.shape} do not match the "
                     f"model's {h_BxTxD.shape}")
  if teacher_w_ExW.shape[1] < vocab:
    raise ValueError(f"the teacher's vocabulary ({teacher_w_ExW.shape[1]}) is smaller than "
                     f"the model's ({vocab})")
  chunk = max(1, min(chunk, t))
  n = -(-t // chunk)
  pad = n * chunk - t

  def split(x):
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    return x.reshape(b, n, chunk, x.shape[-1]).swapaxes(0, 1)

  # The layout where the model's D splits, else where the teacher's E does (the model's
  # projection, whole in D, then only slices its vocabulary): one layout for both, as
  # their logits meet elementwise.
  layout = (ctx.vocab_parallel_head(b, chunk, d, vocab)
            or ctx.vocab_parallel_head(b, chunk, teacher_h_BxTxE.shape[-1], vocab))
  w = w_DxV.astype(compute_dtype)
  tw = jax.lax.stop_gradient(teacher_w_ExW[:, :vocab]).astype(compute_dtype)
  if layout is not None:
    w_spec, logits_spec = layout  # (None, the vocabulary's axes): fits D and E alike
    rows_spec = PartitionSpec(logits_spec[0], PartitionSpec.UNCONSTRAINED, None)
    w = jax.lax.with_sharding_constraint(w, NamedSharding(ctx.mesh, w_spec))
    tw = jax.lax.with_sharding_constraint(tw, NamedSharding(ctx.mesh, w_spec))
  bias = _head_bias(bias_V, layout, ctx)
  teacher_bias = _head_bias(None if teacher_bias_W is None else
                            jax.lax.stop_gradient(teacher_bias_W[:vocab]), layout, ctx)

  def rows(x):  # a chunk's hidden states, gathered over the embed axes
    if layout is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, rows_spec))

  def split_vocab(x):  # a chunk's logits, the vocabulary split
    if layout is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, logits_spec))

  @jax.checkpoint
  def one_chunk(h_BxCxD, th_BxCxE):
    h_BxCxD = rows(h_BxCxD.astype(compute_dtype))
    th_BxCxE = rows(jax.lax.stop_gradient(th_BxCxE).astype(compute_dtype))
    logits = split_vocab(jnp.einsum("BCD,DV->BCV", h_BxCxD, w,
                                    preferred_element_type=jnp.float32))
    if bias is not None:
      logits = logits + bias[None, None]
    logits = soft_cap(logits, logit_soft_cap)
    if temperature != 1.0:
      logits = logits / temperature
    teacher = split_vocab(jnp.einsum("BCE,EV->BCV", th_BxCxE, tw,
                                     preferred_element_type=jnp.float32))
    if teacher_bias is not None:
      teacher = teacher + teacher_bias[None, None]
    teacher = soft_cap(teacher, teacher_logit_soft_cap)
    logp = jax.nn.log_softmax(logits, axis=-1)
    logq = jax.nn.log_softmax(teacher, axis=-1)
    if kind == "reverse_kl":
      return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    if kind == "forward_kl":
      return jnp.sum(jnp.exp(logq) * (logq - logp), axis=-1)
    logm = jnp.logaddexp(logq + jnp.log(beta), logp + jnp.log1p(-beta))
    return (beta * jnp.sum(jnp.exp(logq) * (logq - logm), axis=-1)
            + (1 - beta) * jnp.sum(jnp.exp(logp) * (logp - logm), axis=-1))

  _, div = jax.lax.scan(lambda c, xs: (c, one_chunk(*xs)), None,
                        (split(h_BxTxD), split(teacher_h_BxTxE)))
  return div.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
