"""Ring attention: sequence parallelism over one mesh axis with shard_map + ppermute.

Each device keeps its query shard and passes its key/value shard around the ring. At
step s device i holds the kv shard of device (i - s) mod n, attends to it with a
pluggable block kernel, and merges the partial result by log-sum-exp. The next
transfer is issued before the block is computed, so the collective can overlap the
compute. The backward pass is a second ring: dq stays home while dk / dv accumulate on
the travelling kv shard and arrive back at their owner after the last hop.

Causal masking is decided per block pair, not per element: a kv shard entirely in the
past is attended without a mask, the diagonal shard causally, and a future shard is
skipped. With the contiguous layout that leaves device 0 idle most of the time; the
zig-zag layout (`to_zigzag` on global arrays, `shard_to_zigzag` inside shard_map) gives
device i the chunks i and 2n-1-i of the sequence, so every off-diagonal step costs each
device exactly half a block.

A causal sliding window of w tokens (contiguous layout) reaches only the shards at most
(w + L - 2) // L behind a query shard of L positions: the ring stops after those steps
(kv travels that many hops less one, not n - 1), each step's block kernel masks the
window at the kv shard's distance, and the dk / dv that travelled are sent home by one
final shift. Every device then does the same work, so no zig-zag is needed.

ALiBi (`alibi_slopes`) biases by the distance between true positions, which a block
kernel does not know: it biases by its blocks' local positions (q's from `q_offset`,
kv's from 0). The windowed ring's blocks are at their true distance already. The others
run on position-contiguous pieces (the shard, or zig-zag's two chunks): a q piece wholly
after a kv piece is attended with local positions one piece apart, so every key sits
(qc - kc - 1) pieces closer than it is, and the slope times that distance is taken off
the block's lse (the output is unchanged: a constant per query cancels in the softmax);
the backward gets the lse shifted back. Causal zig-zag keeps three block calls a step
(`_alibi_zigzag_fwd`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from kernels import reference
from kernels.attention import place, target_platform
from kernels.chunked_attention import (
  DEFAULT_CHUNK_SIZE,
  MaskParams,
  blockwise_attention_bwd,
  blockwise_attention_fwd,
)

LAYOUTS = ("contiguous", "zigzag")


class BlockKernel(NamedTuple):
  """The inner kernel of the ring, for equal-position-origin q and kv blocks.

  fwd(q, k, v, q_seg, kv_seg, causal) -> (out [b, tq, h, d] f32, lse [b, tq, h] f32)
  bwd(q, k, v, q_seg, kv_seg, dout, lse, delta, causal) -> f32 (dq, dk, dv), where lse
    and delta = sum(dout * out, -1) come from the final (merged) output.
  Positions start at 0 in both blocks; `causal` masks q_pos < kv_pos. Rings with a
  sliding window also pass the keywords `window` (mask q_pos - kv_pos >= window) and
  `q_offset` (q's positions start there instead: the kv shard's distance). Rings with
  ALiBi pass `alibi_slopes` [heads] (bias by these local positions; `q_offset` may then
  be negative, non-causal).
  """
  fwd: Callable[..., Any]
  bwd: Callable[..., Any]


def chunked_block_kernel(sm_scale: float, logits_soft_cap: float | None = None,
                         chunk_size: int = DEFAULT_CHUNK_SIZE) -> BlockKernel:
  """Plain-JAX blockwise kernel: runs everywhere, O(shard x chunk) memory."""
  def params(causal, window):
    return MaskParams(causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                      sliding_window=window)

  def pos(q, k, q_offset):
    return (q_offset + jnp.arange(q.shape[1], dtype=jnp.int32)[None],
            jnp.arange(k.shape[1], dtype=jnp.int32)[None])

  def fwd(q, k, v, q_seg, kv_seg, causal, window=None, q_offset=0, alibi_slopes=None):
    return blockwise_attention_fwd(q, k, v, q_seg, kv_seg, *pos(q, k, q_offset),
                                   params(causal, window), chunk_size, chunk_size,
                                   alibi_slopes)

  def bwd(q, k, v, q_seg, kv_seg, dout, lse, delta, causal, window=None, q_offset=0,
          alibi_slopes=None):
    return blockwise_attention_bwd(q, k, v, q_seg, kv_seg, *pos(q, k, q_offset), dout,
                                   lse, delta, params(causal, window), chunk_size,
                                   chunk_size, alibi_slopes)

  return BlockKernel(fwd, bwd)


def reference_block_kernel(sm_scale: float,
                           logits_soft_cap: float | None = None) -> BlockKernel:
  """Materialises each block's scores; for small shards and tests."""
  def kw(q, k, causal, window, q_offset, alibi_slopes):
    return dict(q_positions=q_offset + jnp.arange(q.shape[1], dtype=jnp.int32)[None],
                kv_positions=jnp.arange(k.shape[1], dtype=jnp.int32)[None],
                causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                sliding_window=window, alibi_slopes=alibi_slopes)

  def fwd(q, k, v, q_seg, kv_seg, causal, window=None, q_offset=0, alibi_slopes=None):
    return reference.attention_block(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                     **kw(q, k, causal, window, q_offset, alibi_slopes))

  def bwd(q, k, v, q_seg, kv_seg, dout, lse, delta, causal, window=None, q_offset=0,
          alibi_slopes=None):
    return reference.attention_block_grad(q, k, v, dout, lse, delta, q_segment_ids=q_seg,
                                          kv_segment_ids=kv_seg,
                                          **kw(q, k, causal, window, q_offset, alibi_slopes))

  return BlockKernel(fwd, bwd)


def flash_block_kernel(sm_scale: float, logits_soft_cap: float | None = None,
                       **flash_options) -> BlockKernel:
  """Pallas flash kernels (`backend`, `block_q`, `block_kv`, `interpret`, ...)."""
  fa = importlib.import_module("kernels.flash_attention")  # the module, not the function

  def config(q, k, q_seg, causal, window, q_offset, alibi_slopes):
    # Positions start at 0 in both blocks (or q's at the kv shard's distance).
    return fa.make_config(q, k, causal=causal, sliding_window=window, q_offset=q_offset,
                          segments=q_seg is not None, sm_scale=sm_scale,
                          logits_soft_cap=logits_soft_cap, alibi=alibi_slopes is not None,
                          **flash_options)

  def backend():
    return flash_options.get("backend") or fa.default_backend()

  def fwd(q, k, v, q_seg, kv_seg, causal, window=None, q_offset=0, alibi_slopes=None):
    q, k, v = fa.supported_inputs(backend(), q, k, v)
    cfg = config(q, k, q_seg, causal, window, q_offset, alibi_slopes)
    out, lse = fa._forward(cfg, q, k, v, q_seg, kv_seg, slopes=alibi_slopes)
    return out.astype(jnp.float32), fa.public_lse(lse)

  def bwd(q, k, v, q_seg, kv_seg, dout, lse, delta, causal, window=None, q_offset=0,
          alibi_slopes=None):
    q, k, v = fa.supported_inputs(backend(), q, k, v)
    cfg = config(q, k, q_seg, causal, window, q_offset, alibi_slopes).for_backward()
    grads = fa._backward(cfg, q, k, v, q_seg, kv_seg, dout.astype(q.dtype),
                         fa.internal_lse(lse), jnp.swapaxes(delta, 1, 2),
                         slopes=alibi_slopes)
    return tuple(g.astype(jnp.float32) for g in grads)

  return BlockKernel(fwd, bwd)


def default_block_kernel(sm_scale: float, logits_soft_cap: float | None = None,
                         **options) -> BlockKernel:
  """Flash on TPU / GPU, chunked elsewhere."""
  if target_platform() in ("tpu", "gpu", "cuda", "rocm"):
    return flash_block_kernel(sm_scale, logits_soft_cap, **options)
  return chunked_block_kernel(sm_scale, logits_soft_cap, **options)


# ----------------------------------------------------------------------------------
# Zig-zag layout.


def _zigzag_order(num_shards: int):
  """Chunk order that gives shard i the chunks i and 2n-1-i (of 2n equal chunks)."""
  return [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]


def _reorder_chunks(x, order, axis):
  n = len(order)
  if x.shape[axis] % n:
    raise ValueError(
        f"sequence length {x.shape[axis]} must be divisible by 2 * num_shards = {n}")
  shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
  x = jnp.take(x.reshape(shape), jnp.asarray(order), axis=axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def to_zigzag(x, num_shards: int, axis: int = 1):
  """Permutes a sequence axis so that contiguous sharding over `num_shards` devices
  balances causal attention: shard i holds chunks i and 2*num_shards-1-i."""
  return _reorder_chunks(x, _zigzag_order(num_shards), axis)


def from_zigzag(x, num_shards: int, axis: int = 1):
  """Inverse of `to_zigzag`."""
  order = _zigzag_order(num_shards)
  inverse = sorted(range(len(order)), key=order.__getitem__)
  return _reorder_chunks(x, inverse, axis)


def _zigzag_perms(n: int):
  """ppermute pairs moving each contiguous shard's first / second half (chunks 2i and
  2i+1) to the device that holds it in the zig-zag layout."""
  first = [(i, 2 * i if 2 * i < n else 2 * n - 1 - 2 * i) for i in range(n)]
  second = [(i, 2 * i + 1 if 2 * i + 1 < n else 2 * n - 2 - 2 * i) for i in range(n)]
  return first, second


def _split_halves(x, axis):
  c = x.shape[axis] // 2
  return lax.slice_in_dim(x, 0, c, axis=axis), lax.slice_in_dim(x, c, 2 * c, axis=axis)


def shard_to_zigzag(x, axis_name, axis: int = 1):
  """Inside shard_map: turns contiguous sequence shards into zig-zag shards with two
  ppermutes (each device sends and receives exactly its own shard's worth)."""
  if x.shape[axis] % 2:
    raise ValueError(f"zigzag layout needs an even local length, got {x.shape[axis]}")
  first, second = _split_halves(x, axis)
  perm_first, perm_second = _zigzag_perms(lax.axis_size(axis_name))
  got_first = lax.ppermute(first, axis_name, perm_first)
  got_second = lax.ppermute(second, axis_name, perm_second)
  # Even devices receive their early chunk from the "first" transfer, odd ones from
  # the "second".
  even = lax.axis_index(axis_name) % 2 == 0
  early = jnp.where(even, got_first, got_second)
  late = jnp.where(even, got_second, got_first)
  return jnp.concatenate([early, late], axis)


def shard_from_zigzag(x, axis_name, axis: int = 1):
  """Inverse of `shard_to_zigzag`."""
  early, late = _split_halves(x, axis)
  even = lax.axis_index(axis_name) % 2 == 0
  got_first = jnp.where(even, early, late)
  got_second = jnp.where(even, late, early)
  perm_first, perm_second = _zigzag_perms(lax.axis_size(axis_name))
  invert = lambda perm: [(dst, src) for src, dst in perm]
  first = lax.ppermute(got_first, axis_name, invert(perm_first))
  second = lax.ppermute(got_second, axis_name, invert(perm_second))
  return jnp.concatenate([first, second], axis)


# ----------------------------------------------------------------------------------
# The ring.

_SKIP, _FULL, _DIAG, _KV_FIRST, _Q_SECOND = range(5)
# The block pairs that can occur in each layout, in lax.switch order.
_MODES = {"contiguous": (_SKIP, _FULL, _DIAG), "zigzag": (_DIAG, _KV_FIRST, _Q_SECOND)}


@dataclasses.dataclass(frozen=True)
class _Ring:
  axis_name: Any
  causal: bool
  layout: str
  kernel: BlockKernel
  window: int | None = None  # a causal sliding window (contiguous layout)


def window_steps(window: int, shard_len: int, n: int) -> int:
  """Ring steps a causal window of `window` tokens needs over shards of `shard_len`
  positions on n devices: kv shards up to (window + shard_len - 2) // shard_len behind
  hold a key some query of the shard sees."""
  return min(n, (window + shard_len - 2) // shard_len + 1)


def _step_mode(ring: _Ring, me, src):
  """Index into `_MODES[layout]`: which part of (local q, kv shard of device src) is
  visible. Non-causal rings always attend the full block and need no switch."""
  if ring.layout == "contiguous":
    return jnp.where(src == me, 2, jnp.where(src < me, 1, 0))
  # Zig-zag: local chunks are (me, 2n-1-me); kv chunks (src, 2n-1-src).
  return jnp.where(src == me, 0, jnp.where(src < me, 1, 2))


def _switch(ring: _Ring, me, src, branches):
  if not ring.causal:
    return branches[_FULL]()
  return lax.switch(_step_mode(ring, me, src),
                    [branches[mode] for mode in _MODES[ring.layout]])


def _halves(x):
  if x is None:
    return None, None
  c = x.shape[1] // 2
  return x[:, :c], x[:, c:]


def _zeros(x):
  # full_like keeps x's shard_map axes, so loop carries and switch branches type-check
  # under shard_map(check_vma=True).
  return lax.full_like(x, 0.0, jnp.float32)


def _empty_partial(q):
  return _zeros(q), lax.full_like(q, reference.NEG_INF, jnp.float32, q.shape[:3])


def _block_fwd(ring: _Ring, me, src, q, k, v, q_seg, kv_seg):
  fwd = ring.kernel.fwd

  def skip():
    return _empty_partial(q)

  def full():
    return fwd(q, k, v, q_seg, kv_seg, False)

  def diag():
    return fwd(q, k, v, q_seg, kv_seg, True)

  def kv_first():
    return fwd(q, _halves(k)[0], _halves(v)[0], q_seg, _halves(kv_seg)[0], False)

  def q_second():
    out, lse = fwd(_halves(q)[1], k, v, _halves(q_seg)[1], kv_seg, False)
    empty_out, empty_lse = _empty_partial(_halves(q)[0])
    return (jnp.concatenate([empty_out, out], 1), jnp.concatenate([empty_lse, lse], 1))

  return _switch(ring, me, src, {_SKIP: skip, _FULL: full, _DIAG: diag,
                                 _KV_FIRST: kv_first, _Q_SECOND: q_second})


def _block_bwd(ring: _Ring, me, src, q, k, v, q_seg, kv_seg, do, lse, delta):
  bwd = ring.kernel.bwd
  f32 = _zeros

  def skip():
    return f32(q), f32(k), f32(v)

  def full():
    return bwd(q, k, v, q_seg, kv_seg, do, lse, delta, False)

  def diag():
    return bwd(q, k, v, q_seg, kv_seg, do, lse, delta, True)

  def kv_first():
    (k1, k2), (v1, _) = _halves(k), _halves(v)
    dq, dk, dv = bwd(q, k1, v1, q_seg, _halves(kv_seg)[0], do, lse, delta, False)
    return dq, jnp.concatenate([dk, f32(k2)], 1), jnp.concatenate([dv, f32(k2)], 1)

  def q_second():
    q1, q2 = _halves(q)
    dq, dk, dv = bwd(q2, k, v, _halves(q_seg)[1], kv_seg, _halves(do)[1],
                     _halves(lse)[1], _halves(delta)[1], False)
    return jnp.concatenate([f32(q1), dq], 1), dk, dv

  return _switch(ring, me, src, {_SKIP: skip, _FULL: full, _DIAG: diag,
                                 _KV_FIRST: kv_first, _Q_SECOND: q_second})


# ALiBi: blocks per pair of position-contiguous pieces (see the module docstring).


def _pieces(ring: _Ring, x):
  """A local shard split into its position-contiguous pieces (None stays None): the
  shard itself, or its two zig-zag chunks."""
  return [x] if ring.layout == "contiguous" else list(_halves(x))


def _chunk_ids(ring: _Ring, device, n):
  """The pieces' positions in units of their length: device i's shard is chunk i;
  zig-zag, its chunks are i and 2n-1-i."""
  return [device] if ring.layout == "contiguous" else [device, 2 * n - 1 - device]


def _static_order(i: int, j: int):
  """sign(qc - kc) of q piece i and kv piece j where the layout fixes it (a zig-zag
  shard's early chunk, < n, is before any shard's late one, >= n), else None."""
  return None if i == j else (1 if i > j else -1)


def _shift_lse(lse, slopes, distance):
  """lse [b, t, h] of logits that were each slopes[h] * distance too high (-inf stays)."""
  slopes = slopes.astype(jnp.float32).reshape(1, 1, -1)
  return lse - slopes * jnp.asarray(distance, jnp.float32)


def _alibi_pair(ring: _Ring, qc, kc, length: int, call, skip, order=None):
  """One (q piece, kv piece) pair with ALiBi, the pieces `length` positions each at
  chunks qc and kc (traced). `call(causal, q_offset, distance)` runs the block kernel
  with local positions q_offset apart, each key `distance` positions closer than it is;
  `skip()` gives the empty partial. A q piece after the kv piece (every key before every
  query) runs one piece apart, the same piece causal as the ring, a q piece before the
  kv piece is skipped (causal) or runs minus one piece apart. `order`: sign(qc - kc) when
  the layout fixes it (zig-zag's early q chunk vs a late kv chunk), else None (a switch)."""
  def future():
    return call(False, -length, (kc - qc - 1) * length)

  branches = [skip if ring.causal else future, lambda: call(ring.causal, 0, 0),
              lambda: call(False, length, (qc - kc - 1) * length)]
  if order is not None:
    return branches[order + 1]()
  return lax.switch(jnp.sign(qc - kc) + 1, branches)


def _alibi_block_fwd(ring: _Ring, me, src, q, k, v, q_seg, kv_seg, slopes):
  """`_block_fwd` with ALiBi: each q piece against each kv piece of device src's shard,
  merged, each pair's lse corrected to the true distances."""
  if ring.layout == "zigzag" and ring.causal:
    return _alibi_zigzag_fwd(ring, me, src, q, k, v, q_seg, kv_seg, slopes)
  n = lax.axis_size(ring.axis_name)
  q_parts = zip(_pieces(ring, q), _pieces(ring, q_seg), _chunk_ids(ring, me, n))
  kv_parts = list(zip(_pieces(ring, k), _pieces(ring, v), _pieces(ring, kv_seg),
                      _chunk_ids(ring, src, n)))
  outs, lses = [], []
  for i, (q_p, q_seg_p, qc) in enumerate(q_parts):
    out, lse = _empty_partial(q_p)
    for j, (k_p, v_p, kv_seg_p, kc) in enumerate(kv_parts):
      def call(causal, q_offset, distance):
        out_p, lse_p = ring.kernel.fwd(q_p, k_p, v_p, q_seg_p, kv_seg_p, causal,
                                       q_offset=q_offset, alibi_slopes=slopes)
        return out_p, _shift_lse(lse_p, slopes, distance)

      pair = _alibi_pair(ring, qc, kc, q_p.shape[1], call, lambda: _empty_partial(q_p),
                         _static_order(i, j))
      out, lse = reference.merge_attention(out, lse, *pair)
    outs.append(out)
    lses.append(lse)
  return jnp.concatenate(outs, 1), jnp.concatenate(lses, 1)


def _alibi_block_bwd(ring: _Ring, me, src, q, k, v, q_seg, kv_seg, do, lse, delta,
                     slopes):
  """`_block_bwd` with ALiBi: each pair of pieces as `_alibi_block_fwd` ran it, its
  kernel given the final lse shifted to the local distances."""
  if ring.layout == "zigzag" and ring.causal:
    return _alibi_zigzag_bwd(ring, me, src, q, k, v, q_seg, kv_seg, do, lse, delta, slopes)
  n = lax.axis_size(ring.axis_name)
  q_parts = zip(_pieces(ring, q), _pieces(ring, q_seg), _pieces(ring, do),
                _pieces(ring, lse), _pieces(ring, delta), _chunk_ids(ring, me, n))
  kv_parts = list(zip(_pieces(ring, k), _pieces(ring, v), _pieces(ring, kv_seg),
                      _chunk_ids(ring, src, n)))
  dqs = []
  dks, dvs = [_zeros(x) for x in _pieces(ring, k)], [_zeros(x) for x in _pieces(ring, v)]
  for i, (q_p, q_seg_p, do_p, lse_p, delta_p, qc) in enumerate(q_parts):
    dq = _zeros(q_p)
    for j, (k_p, v_p, kv_seg_p, kc) in enumerate(kv_parts):
      def call(causal, q_offset, distance):
        return ring.kernel.bwd(q_p, k_p, v_p, q_seg_p, kv_seg_p, do_p,
                               _shift_lse(lse_p, slopes, -distance), delta_p, causal,
                               q_offset=q_offset, alibi_slopes=slopes)

      grads = _alibi_pair(ring, qc, kc, q_p.shape[1], call,
                          lambda: (_zeros(q_p), _zeros(k_p), _zeros(v_p)), _static_order(i, j))
      dq, dks[j], dvs[j] = dq + grads[0], dks[j] + grads[1], dvs[j] + grads[2]
    dqs.append(dq)
  return tuple(jnp.concatenate(x, 1) for x in (dqs, dks, dvs))


# Causal zig-zag with ALiBi runs three block calls a step, as without it. Of the four
# chunk pairs, the early q chunk never sees the late kv chunk and the late q chunk always
# sees all of the early kv chunk (one call); the diagonal pairs (early with early, late
# with late) are either both diagonal blocks (src == me: one causal call on the two
# stacked along the batch) or one wholly past pair (the early ones when src < me, the
# late ones when src > me: one call on the pair sliced out) and one hidden pair.


def _stacked(x):
  """[b, 2c, ...] -> its halves stacked along the batch, [2b, c, ...] (None stays)."""
  return None if x is None else jnp.concatenate(_halves(x), 0)


def _unstacked(x):
  """Inverse of `_stacked`."""
  return jnp.concatenate(jnp.split(x, 2, axis=0), 1)


def _past_diagonal_pair(me, src, c: int):
  """(first position in the shard, slice) of the one wholly past diagonal pair: the
  early chunks (0) when src < me, the late ones (c) when src > me."""
  start = jnp.where(src > me, c, 0)
  return start, lambda x: None if x is None else lax.dynamic_slice_in_dim(x, start, c, 1)


def _alibi_zigzag_fwd(ring: _Ring, me, src, q, k, v, q_seg, kv_seg, slopes):
  n, c = lax.axis_size(ring.axis_name), q.shape[1] // 2
  fwd = functools.partial(ring.kernel.fwd, alibi_slopes=slopes)

  def both_diagonal():
    out, lse = fwd(_stacked(q), _stacked(k), _stacked(v), _stacked(q_seg),
                   _stacked(kv_seg), True)
    return _unstacked(out), _unstacked(lse)

  def one_past():
    start, pair = _past_diagonal_pair(me, src, c)
    out, lse = fwd(pair(q), pair(k), pair(v), pair(q_seg), pair(kv_seg), False, q_offset=c)
    lse = _shift_lse(lse, slopes, (jnp.abs(me - src) - 1) * c)
    empty_out, empty_lse = _empty_partial(q)
    return (lax.dynamic_update_slice_in_dim(empty_out, out, start, 1),
            lax.dynamic_update_slice_in_dim(empty_lse, lse, start, 1))

  out, lse = lax.cond(src == me, both_diagonal, one_past)
  # The late q chunk (2n-1-me) against the early kv chunk (src).
  out_late, lse_late = fwd(_halves(q)[1], _halves(k)[0], _halves(v)[0], _halves(q_seg)[1],
                           _halves(kv_seg)[0], False, q_offset=c)
  lse_late = _shift_lse(lse_late, slopes, (2 * n - 2 - me - src) * c)
  out_late, lse_late = reference.merge_attention(out[:, c:], lse[:, c:], out_late, lse_late)
  return (jnp.concatenate([out[:, :c], out_late], 1),
          jnp.concatenate([lse[:, :c], lse_late], 1))


def _alibi_zigzag_bwd(ring: _Ring, me, src, q, k, v, q_seg, kv_seg, do, lse, delta, slopes):
  n, c = lax.axis_size(ring.axis_name), q.shape[1] // 2
  bwd = functools.partial(ring.kernel.bwd, alibi_slopes=slopes)

  def both_diagonal():
    grads = bwd(*(_stacked(x) for x in (q, k, v, q_seg, kv_seg, do, lse, delta)), True)
    return tuple(_unstacked(g) for g in grads)

  def one_past():
    start, pair = _past_diagonal_pair(me, src, c)
    lse_local = _shift_lse(pair(lse), slopes, -(jnp.abs(me - src) - 1) * c)
    grads = bwd(pair(q), pair(k), pair(v), pair(q_seg), pair(kv_seg), pair(do), lse_local,
                pair(delta), False, q_offset=c)
    return tuple(lax.dynamic_update_slice_in_dim(_zeros(x), g, start, 1)
                 for x, g in zip((q, k, v), grads))

  dq, dk, dv = lax.cond(src == me, both_diagonal, one_past)
  # The late q chunk (2n-1-me) against the early kv chunk (src).
  late, early = (lambda x: _halves(x)[1]), (lambda x: _halves(x)[0])  # noqa: E731
  lse_local = _shift_lse(late(lse), slopes, -(2 * n - 2 - me - src) * c)
  dq_late, dk_early, dv_early = bwd(late(q), early(k), early(v), late(q_seg), early(kv_seg),
                                    late(do), lse_local, late(delta), False, q_offset=c)
  return (jnp.concatenate([dq[:, :c], dq[:, c:] + dq_late], 1),
          jnp.concatenate([dk[:, :c] + dk_early, dk[:, c:]], 1),
          jnp.concatenate([dv[:, :c] + dv_early, dv[:, c:]], 1))


def _rotate(ring: _Ring, xs, shift: int = 1):
  n = lax.axis_size(ring.axis_name)
  perm = [(i, (i + shift) % n) for i in range(n)]
  return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), xs)


def _alibi_kw(slopes):
  return {} if slopes is None else {"alibi_slopes": slopes}


def _window_forward(ring: _Ring, q, k, v, q_seg, kv_seg, slopes=None):
  """The windowed ring: step s attends the kv shard s behind (q positions start s *
  shard_len after its keys, their true distance, so ALiBi needs no correction); devices
  before it (me < s: the shard wrapped round from the end) skip. The steps unroll: their
  offsets are static."""
  n, me, shard = lax.axis_size(ring.axis_name), lax.axis_index(ring.axis_name), q.shape[1]
  steps = window_steps(ring.window, shard, n)
  out, lse = _empty_partial(q)
  kv = (k, v, kv_seg)
  for s in range(steps):
    next_kv = _rotate(ring, kv) if s + 1 < steps else None  # issued before the compute
    k_s, v_s, kv_seg_s = kv
    block = functools.partial(ring.kernel.fwd, q, k_s, v_s, q_seg, kv_seg_s, True,
                              window=ring.window, q_offset=s * shard, **_alibi_kw(slopes))
    out_s, lse_s = block() if s == 0 else lax.cond(me >= s, block,
                                                   lambda: _empty_partial(q))
    out, lse = reference.merge_attention(out, lse, out_s, lse_s)
    kv = next_kv
  return out, lse


def _window_backward(ring: _Ring, q, k, v, q_seg, kv_seg, do, lse, delta, slopes=None):
  """The backward of `_window_forward`: dk / dv travel with their kv shard for the same
  steps, then one shift sends them home."""
  n, me, shard = lax.axis_size(ring.axis_name), lax.axis_index(ring.axis_name), q.shape[1]
  steps = window_steps(ring.window, shard, n)
  dq, kv, dkv = _zeros(q), (k, v, kv_seg), (_zeros(k), _zeros(v))
  for s in range(steps):
    k_s, v_s, kv_seg_s = kv
    block = functools.partial(ring.kernel.bwd, q, k_s, v_s, q_seg, kv_seg_s, do, lse,
                              delta, True, window=ring.window, q_offset=s * shard,
                              **_alibi_kw(slopes))
    dq_s, dk_s, dv_s = block() if s == 0 else lax.cond(
        me >= s, block, lambda: (_zeros(q), _zeros(k), _zeros(v)))
    dq, dkv = dq + dq_s, (dkv[0] + dk_s, dkv[1] + dv_s)
    if s + 1 < steps:
      kv, dkv = _rotate(ring, kv), _rotate(ring, dkv)
  # The dk / dv of shard c are on device c + steps - 1.
  dk, dv = _rotate(ring, dkv, -(steps - 1)) if steps > 1 else dkv
  return dq, dk, dv


def _ring_forward(ring: _Ring, q, k, v, q_seg, kv_seg, slopes=None):
  if ring.window is not None:
    return _window_forward(ring, q, k, v, q_seg, kv_seg, slopes)
  n = lax.axis_size(ring.axis_name)
  me = lax.axis_index(ring.axis_name)

  def step(s, carry, rotate=True):
    out, lse, kv = carry
    # Issue the transfer first: it does not depend on this step's compute.
    next_kv = _rotate(ring, kv) if rotate else kv
    k_s, v_s, kv_seg_s = kv
    if slopes is None:
      out_s, lse_s = _block_fwd(ring, me, (me - s) % n, q, k_s, v_s, q_seg, kv_seg_s)
    else:
      out_s, lse_s = _alibi_block_fwd(ring, me, (me - s) % n, q, k_s, v_s, q_seg, kv_seg_s,
                                      slopes)
    out, lse = reference.merge_attention(out, lse, out_s, lse_s)
    return out, lse, next_kv

  carry = (*_empty_partial(q), (k, v, kv_seg))
  carry = lax.fori_loop(0, n - 1, step, carry)
  out, lse, _ = step(n - 1, carry, rotate=False)
  return out, lse


def _ring_backward(ring: _Ring, q, k, v, q_seg, kv_seg, do, lse, delta, slopes=None):
  if ring.window is not None:
    return _window_backward(ring, q, k, v, q_seg, kv_seg, do, lse, delta, slopes)
  n = lax.axis_size(ring.axis_name)
  me = lax.axis_index(ring.axis_name)

  def step(s, carry, last=False):
    dq, kv, dkv = carry
    k_s, v_s, kv_seg_s = kv
    block_bwd = _block_bwd if slopes is None else functools.partial(_alibi_block_bwd,
                                                                    slopes=slopes)
    dq_s, dk_s, dv_s = block_bwd(ring, me, (me - s) % n, q, k_s, v_s, q_seg, kv_seg_s,
                                 do, lse, delta)
    dkv = (dkv[0] + dk_s, dkv[1] + dv_s)
    # dk / dv travel with their kv shard; after n hops they are home.
    return dq + dq_s, (kv if last else _rotate(ring, kv)), _rotate(ring, dkv)

  carry = (_zeros(q), (k, v, kv_seg), (_zeros(k), _zeros(v)))
  carry = lax.fori_loop(0, n - 1, step, carry)
  dq, _, (dk, dv) = step(n - 1, carry, last=True)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ring(q, k, v, q_seg, kv_seg, sinks, slopes, ring):
  return _ring_fwd(q, k, v, q_seg, kv_seg, sinks, slopes, ring)[0]


def _ring_fwd(q, k, v, q_seg, kv_seg, sinks, slopes, ring):
  out, lse = _ring_forward(ring, q, k, v, q_seg, kv_seg, slopes)
  # Once, after the ring's merge; the backward ring reads the lse and output with them.
  out, lse = reference.add_sinks(out, lse, sinks)
  out = out.astype(q.dtype)
  return out, (q, k, v, q_seg, kv_seg, sinks, slopes, out, lse)


def _ring_bwd(ring, res, do):
  q, k, v, q_seg, kv_seg, sinks, slopes, out, lse = res
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  dq, dk, dv = _ring_backward(ring, q, k, v, q_seg, kv_seg, do, lse, delta, slopes)
  # This shard's queries' part: `ring_attention` casts the sinks to varying over the
  # ring's axis, whose transpose sums the shards' parts.
  dsinks = None if sinks is None else reference.sinks_grad(sinks, lse, delta)
  # ALiBi's slopes are constants: no gradient.
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsinks,
          None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _check_ring_args(q, k, v, q_segment_ids, kv_segment_ids, layout, sm_scale,
                     logits_soft_cap, sliding_window, causal, sinks=None, alibi_slopes=None):
  reference.check_attention_inputs(q, k, v, q_segment_ids, kv_segment_ids,
                                   sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                                   sliding_window=sliding_window, sinks=sinks,
                                   alibi_slopes=alibi_slopes)
  if sliding_window is not None and not causal:
    raise ValueError(f"ring attention takes a sliding_window ({sliding_window}) only "
                     f"with causal=True; use chunked or flash attention")
  if sliding_window is not None and layout == "zigzag":
    raise ValueError("ring attention with a sliding_window runs the contiguous layout "
                     "(a window balances the ring by itself), got layout='zigzag'")
  if q.shape[1] != k.shape[1]:
    raise ValueError(f"ring attention needs q_len == kv_len, got {q.shape[1]} and "
                     f"{k.shape[1]}")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def ring_attention(q, k, v, *, axis_name, causal: bool = True, q_segment_ids=None,
                   kv_segment_ids=None, sm_scale: float | None = None,
                   logits_soft_cap: float | None = None, sliding_window=None,
                   layout: str = "contiguous", block_kernel: BlockKernel | str | None = None,
                   sinks=None, alibi_slopes=None, **kernel_options):
  """Attention over a sequence sharded along `axis_name`; call inside `shard_map`.

  Args:
    q: local shard [batch, len / n, heads, head_dim]; k, v: [batch, len / n, kv_heads,
      head_dim], for the same positions (self-attention: equal q and kv lengths).
    axis_name: the mesh axis the sequence is split over (n devices, in order).
    causal, q_segment_ids, kv_segment_ids, sm_scale, logits_soft_cap: as in
      `kernels.reference_attention` (segment ids are local shards too).
    sliding_window: a causal sliding window (contiguous layout only): the ring runs only
      the `window_steps` steps whose kv shards the window reaches.
    layout: 'contiguous' (shard i holds positions [i * len / n, (i + 1) * len / n)) or
      'zigzag' (the sequence was permuted with `to_zigzag`; balances causal work).
    block_kernel: a `BlockKernel`, or 'flash', 'chunked', 'reference'; default flash on
      TPU / GPU and chunked elsewhere. `kernel_options` go to its factory (e.g.
      `interpret`, `block_q` for flash, `chunk_size` for chunked).
    sinks: optional float [heads] attention-sink logits (this shard's heads), as in
      `kernels.reference_attention`, applied once after the ring's merge; their gradient
      is summed over `axis_name`.
    alibi_slopes: optional float [heads] ALiBi slopes (this shard's heads), as in
      `kernels.reference_attention`, by the true positions of the layout. A custom
      `BlockKernel` must take them (see its docstring).

  Returns:
    The local output shard [batch, len / n, heads, head_dim] in q's dtype.
  """
  _check_ring_args(q, k, v, q_segment_ids, kv_segment_ids, layout, sm_scale,
                   logits_soft_cap, sliding_window, causal, sinks, alibi_slopes)
  if layout == "zigzag" and q.shape[1] % 2:
    raise ValueError(f"zigzag layout needs an even local length, got {q.shape[1]}")
  scale = reference.default_sm_scale(q.shape[-1], sm_scale)
  factories = {"flash": flash_block_kernel, "chunked": chunked_block_kernel,
               "reference": reference_block_kernel, None: default_block_kernel}
  if not isinstance(block_kernel, BlockKernel):
    if block_kernel not in factories:
      raise ValueError(f"block_kernel must be a BlockKernel or one of "
                       f"{list(factories)[:3]}, got {block_kernel!r}")
    block_kernel = factories[block_kernel](scale, logits_soft_cap, **kernel_options)
  ring = _Ring(axis_name=axis_name, causal=bool(causal), layout=layout,
               kernel=block_kernel,
               window=None if sliding_window is None else int(sliding_window))
  if sinks is not None:
    sinks = _varying(sinks, axis_name)
  if alibi_slopes is not None:  # beside varying q in the kernels
    alibi_slopes = _varying(lax.stop_gradient(alibi_slopes), axis_name)
  return _ring(q, k, v, q_segment_ids, kv_segment_ids, sinks, alibi_slopes, ring)


def _varying(x, axis_name):
  """x cast to varying over `axis_name` (a no-op without shard_map's replication checks);
  x itself when it varies already."""
  try:
    return lax.pcast(x, axis_name, to="varying")
  except ValueError:  # "Unsupported pcast from=varying"
    return x


def ring_attention_sharded(q, k, v, *, mesh, axis_name, causal: bool = True,
                           q_segment_ids=None, kv_segment_ids=None,
                           sm_scale: float | None = None,
                           logits_soft_cap: float | None = None, sliding_window=None,
                           layout: str | None = None, batch_axis=None, head_axis=None,
                           block_kernel: BlockKernel | str | None = None,
                           sinks=None, alibi_slopes=None, **kernel_options):
  """Ring attention on global arrays: shards the sequence over `axis_name` of `mesh`.

  Args:
    q, k, v, causal, segment ids, sm_scale, logits_soft_cap, sliding_window,
      block_kernel, kernel_options: as in `ring_attention`, but global
      ([batch, len, heads, head_dim]; len divisible by the axis size, by twice it
      for zig-zag).
    mesh: a `jax.sharding.Mesh`; axis_name: its axis that splits the sequence.
    layout: 'zigzag' (the default without a window) re-deals the contiguous shards into
      the zig-zag layout inside the map (two ppermutes each way), balancing causal work;
      'contiguous' (the default, and the only layout, with a sliding window) runs the
      ring on the contiguous shards.
    batch_axis, head_axis: optional mesh axes that also split batch / heads.
    sinks: optional float [heads] attention-sink logits (split over `head_axis`).
    alibi_slopes: optional float [heads] ALiBi slopes (split over `head_axis`).

  Returns:
    [batch, len, heads, head_dim] in q's dtype, in the original order.
  """
  if layout is None:
    layout = "zigzag" if sliding_window is None else "contiguous"
  _check_ring_args(q, k, v, q_segment_ids, kv_segment_ids, layout, sm_scale,
                   logits_soft_cap, sliding_window, causal, sinks, alibi_slopes)
  n = mesh.shape[axis_name]
  zig = layout == "zigzag"
  if q.shape[1] % (2 * n if zig else n):
    raise ValueError(f"sequence length {q.shape[1]} must be divisible by "
                     f"{'2 * ' if zig else ''}the '{axis_name}' axis size {n}")
  segments = q_segment_ids is not None
  seq = P(batch_axis, axis_name, head_axis, None)
  seg_spec = P(batch_axis, axis_name)

  per_head = {name: x for name, x in (("sinks", sinks), ("alibi_slopes", alibi_slopes))
              if x is not None}  # [heads] arrays, split with the heads

  def local(q, k, v, *rest):
    local_per_head = dict(zip(per_head, rest))
    q_seg, kv_seg = rest[len(per_head):] if segments else (None, None)
    # Arrive contiguous; the zig-zag permutation is two ppermutes inside the map.
    to_zig = (lambda x: shard_to_zigzag(x, axis_name)) if zig else (lambda x: x)
    q, k, v = to_zig(q), to_zig(k), to_zig(v)
    if segments:
      q_seg, kv_seg = to_zig(q_seg), to_zig(kv_seg)
    out = ring_attention(q, k, v, axis_name=axis_name, causal=causal,
                         q_segment_ids=q_seg, kv_segment_ids=kv_seg, sm_scale=sm_scale,
                         logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                         layout=layout, block_kernel=block_kernel, **local_per_head,
                         **kernel_options)
    return shard_from_zigzag(out, axis_name) if zig else out

  args, specs = [q, k, v], [seq, seq, seq]
  for x in per_head.values():
    args.append(x)
    specs.append(P(head_axis))
  if segments:
    args += [q_segment_ids, kv_segment_ids]
    specs += [seg_spec, seg_spec]
  args = [place(x, mesh, spec) for x, spec in zip(args, specs)]
  return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=seq,
                       check_vma=False)(*args)
