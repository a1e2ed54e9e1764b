"""Pallas flash attention: forward and backward kernels under one `custom_vjp`.

Two kernel families share the masking rules and the block-skipping arithmetic below:

* TPU (Mosaic): grid (batch, heads, q blocks, kv blocks); the kv axis is sequential
  ("arbitrary") and the running max / sum / output live in VMEM scratch. Blocks that
  the causal / sliding-window mask hides entirely are skipped by `pl.when`, and their
  index_map is clamped to a visible block so no DMA is issued for them. Where the mask
  hides most pairs (a sliding window over long rows) a compact grid (batch, heads,
  steps) steps through the visible pairs only, their block ids read from a table in
  SMEM. Fully visible blocks skip the per-element mask. Layout [batch, heads, len,
  head_dim].
* GPU (Triton): grid (q blocks, batch, heads); each program loops over exactly the
  visible kv blocks with `fori_loop`, the fully visible ones in an unmasked loop.
  Layout [batch, len, heads, head_dim] (no copy). The softmax runs in base 2 (exp2 is
  one ex2 instruction; jnp.exp lowers to libdevice's exact expf).
* GPU on Hopper (sm_90): `kernels.flash_mosaic_gpu`, Pallas Mosaic GPU kernels (a TMA
  producer warpgroup, two wgmma consumer warpgroups) for the forward, dq and dk / dv.
  The forward runs by default wherever it can (16-bit inputs, head_dim a multiple of
  64 up to 256, no segment ids), the backward kernels when asked
  (`gpu_backward='mosaic'`, head_dim up to 128); `gpu_forward` and `gpu_backward`
  force either family.

With segment ids (packed rows), `segment_block_ranges` narrows each q block's kv range
(and each kv block's q range) to the blocks that hold its own sequences, so a row packing
n equal sequences computes about 1/n of the causal blocks: the GPU loops take the narrowed
bounds from a small input, the TPU kernels from a scalar-prefetched SMEM table that their
index maps also read, so skipped blocks issue no DMA. Block pairs that lie inside one
sequence (and below the diagonal) skip the element mask as well.

The backward pass recomputes probabilities from the saved log-sum-exp with one kernel
for dq (loop over kv blocks, on blocks of its own) and one for dk/dv (loop over q blocks
and over the query heads that share a kv head, so GQA needs no repeated k/v; it works
kv-major, k @ q.T, so no computed tile is ever transposed). On GPU,
`dq_atomic` folds dq into the dk/dv kernel with atomic adds; on TPU `fused_bwd` has the
dk/dv kernel write one dq partial per kv block, which XLA sums. Off TPU/GPU both families
run in Pallas interpret mode, which is what the CPU tests exercise.

ALiBi (`alibi_slopes`) is one more operand, the slopes times log2 e (f32 [heads]): in
SMEM on TPU (a scalar read per grid step), a whole small block on GPU (a scalar load per
program or per head of the group). Every visited block, masked or fully visible, adds
-slope * |q_pos - kv_pos| to its base-2 logits, positions computed as the mask's are. A
call without ALiBi compiles as before (`_Config.alibi` False: no operand). The Mosaic GPU
kernels have no ALiBi: calls with it run Triton.
"""
from __future__ import annotations

import dataclasses
import fractions
import functools
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import reference
from kernels.attention import target_platform

# Finite, so masked logits never create inf - inf; a row whose running max still equals
# it after every block saw no key at all.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
NUM_LANES = 128
NUM_SUBLANES = 8
_NT = (((1,), (1,)), ((), ()))  # dot_general: contract the last dims (x @ y.T)
_TN = (((0,), (0,)), ((), ()))  # dot_general: contract the first dims (x.T @ y)
LOG2E = math.log2(math.e)

# (block_q, block_kv, block_q_bwd, block_kv_bwd) per kernel family.
DEFAULT_BLOCKS = {"tpu": (512, 512, 512, 512), "gpu": (128, 64, 64, 64)}
# TPU blocks for 16-bit inputs with head_dim <= 128 (LLM training). A TPU grid step costs
# ~210-310 bundles besides its block's work, and 1024 blocks spread that over 4x the
# work: libtpu's schedules model forward + backward 3-12% faster on v5e, 8-18% on v5p
# and 28-41% on v6e at 4k-16k (`python -m benchmarks.tpu_static`, BENCHMARKS.md; no TPU
# has run them). Wider heads or f32 at 1024 overflow VMEM on v4 / v5e / v5p.
TPU_BLOCKS_16BIT = (1024, 1024, 1024, 1024)
# GPU (Triton) launch options (num_warps, num_stages) per direction; None warps = 8 for
# head_dim > 64, else 4. The best of a sweep on an H200 at length 8k, head_dim 128
# (`python -m benchmarks.attention --accelerator-only`): forward 351 TFLOP/s vs 264 with
# 2 stages; forward + backward 331 vs 172 with 8 backward warps.
DEFAULT_GPU_LAUNCH = {"fwd": (None, 3), "bwd": (4, 2)}


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything static about one call: shapes, mask options, blocks, backend."""
  backend: str  # "tpu" or "gpu": which kernel family
  interpret: Any  # False, True or a pltpu.InterpretParams
  q_len: int
  kv_len: int
  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int
  group: int  # query heads per kv head
  causal: bool
  sm_scale: float
  logits_soft_cap: float | None
  sliding_window: int | None
  segments: bool
  # ALiBi: the kernels take the slopes (times log2 e) as one more operand, f32 [heads]
  alibi: bool = False
  num_warps: int | None = None  # GPU only; None = by head_dim
  num_stages: int | None = None  # GPU only
  num_warps_bwd: int | None = None
  num_stages_bwd: int | None = None
  # The dq kernel's blocks (a q block per program, kv blocks per step); None = the
  # backward blocks, which then belong to the dk/dv kernel alone.
  block_q_dq: int | None = None
  block_kv_dq: int | None = None
  dq_atomic: bool = False  # GPU: dq by atomic adds in the dk/dv kernel (no dq kernel)
  # TPU: the dk/dv kernel also writes each step's ds @ k, summed over kv blocks by XLA
  # (no dq kernel)
  fused_bwd: bool = False
  # Position of q's first token counted from kv's first; None = kv_len - q_len (the
  # queries are the last positions). Ring attention's windowed blocks set it.
  q_offset: int | None = None
  # TPU: grids that step through the visible block pairs only (`compact_steps`), not
  # the whole rectangle: True, False, or None = where they skip most of it
  compact_grid: bool | None = None
  # GPU forward kernel: "mosaic" (Hopper wgmma + TMA, `kernels.flash_mosaic_gpu`),
  # "triton", or None = Mosaic where it runs (an sm_90 device, 16-bit inputs, head_dim a
  # multiple of 64 up to 256) and the call has no segment ids, else Triton
  gpu_forward: str | None = None
  # GPU backward kernels: "mosaic" (Hopper dq and dk / dv, `kernels.flash_mosaic_gpu`)
  # or "triton"; None = Triton (see `_mosaic_backward`)
  gpu_backward: str | None = None

  def for_backward(self) -> _Config:
    return dataclasses.replace(self, block_q=self.block_q_bwd, block_kv=self.block_kv_bwd,
                               num_warps=self.num_warps_bwd,
                               num_stages=self.num_stages_bwd)

  def for_dq(self) -> _Config:
    """The dq kernel's config, from a backward config."""
    return dataclasses.replace(self, block_q=self.block_q_dq or self.block_q,
                               block_kv=self.block_kv_dq or self.block_kv)

  @property
  def offset(self) -> int:
    return self.kv_len - self.q_len if self.q_offset is None else self.q_offset

  @property
  def num_q_blocks(self) -> int:
    return pl.cdiv(self.q_len, self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return pl.cdiv(self.kv_len, self.block_kv)

  @property
  def may_mask(self) -> bool:
    """False when no element of any block can be masked."""
    return (self.causal or self.sliding_window is not None or self.segments
            or self.kv_len % self.block_kv != 0)


# ----------------------------------------------------------------------------------
# Block skipping. These run on traced int32 program ids inside kernels and index maps,
# and on concrete ints in the tests; kernels and tests use the very same functions.


def _floor_div(a, b: int, bias: int):
  """floor(a / b) for a >= -bias * b, with only non-negative integer division."""
  if isinstance(a, int):
    return (a + bias * b) // b - bias
  return lax.div(a + bias * b, b) - bias


class _Ints:
  """Python-int stand-ins for the jnp ops of the block-range functions (`xp=_Ints`), so
  that trace-time tables need no device, not even under a TPU mesh."""
  int32 = int
  minimum = min
  maximum = max

  @staticmethod
  def asarray(x, dtype=None):
    del dtype
    return int(x)

  @staticmethod
  def where(c, a, b):
    return a if c else b


def _bias(cfg: _Config, block: int) -> int:
  return (cfg.q_len + cfg.kv_len + abs(cfg.offset) + (cfg.sliding_window or 0)) // block + 2


def kv_block_range(cfg: _Config, qi, xp=jnp):
  """Inclusive range [lo, hi] of kv blocks with a visible key for q block `qi`.

  Exact: block ki is in the range iff some real (query, key) pair in the two blocks
  passes the causal / sliding-window mask (segment ids are not considered).
  Empty ranges have lo > hi. `xp=_Ints` computes on a Python int.
  """
  qi = xp.asarray(qi, xp.int32)
  bq, bk, w = cfg.block_q, cfg.block_kv, cfg.sliding_window
  q_lo = qi * bq + cfg.offset
  q_hi = xp.minimum(qi * bq + bq - 1, cfg.q_len - 1) + cfg.offset
  last = cfg.num_kv_blocks - 1
  bias = _bias(cfg, bk)
  lo = xp.int32(0)
  hi = xp.int32(last)
  if cfg.causal:
    hi = xp.minimum(last, _floor_div(q_hi, bk, bias))
  elif w is not None:
    hi = xp.minimum(last, _floor_div(q_hi + w - 1, bk, bias))
  if w is not None:
    first = q_lo - w + 1  # the first query's first visible key: past the last, none
    lo = xp.where(first > cfg.kv_len - 1, last + 1,
                  xp.maximum(0, _floor_div(first, bk, bias)))
  return lo, hi


def q_block_range(cfg: _Config, ki, xp=jnp):
  """Inclusive range [lo, hi] of q blocks that see kv block `ki`; the exact inverse
  of `kv_block_range` (qi in q_block_range(ki) iff ki in kv_block_range(qi))."""
  ki = xp.asarray(ki, xp.int32)
  bq, bk, w = cfg.block_q, cfg.block_kv, cfg.sliding_window
  last = cfg.num_q_blocks - 1
  bias = _bias(cfg, bq)
  lo = xp.int32(0)
  hi = xp.int32(last)
  if cfg.causal or w is not None:
    # Smallest qi with hi(qi) >= ki: the block's last real query reaches key ki * bk.
    x = ki * bk - cfg.offset - (0 if cfg.causal else w - 1)
    lo = xp.where(x > cfg.q_len - 1, last + 1, xp.maximum(0, _floor_div(x, bq, bias)))
  if w is not None:
    # Largest qi with lo(qi) <= ki: the block's first query still reaches the block's
    # last real key.
    y = xp.minimum((ki + 1) * bk, cfg.kv_len) - 1 - cfg.offset + w - 1
    hi = xp.minimum(last, _floor_div(y, bq, bias))
  return lo, hi


def _in_range(i, lo_hi):
  lo, hi = lo_hi
  return (i >= lo) & (i <= hi)


def _clamp(i, lo_hi, n: int):
  """Index of the block to fetch at step i: i itself when visible, else the nearest
  visible block, so skipped steps re-use the resident buffer and issue no DMA."""
  lo, hi = lo_hi
  return jnp.clip(jnp.minimum(jnp.maximum(i, lo), hi), 0, n - 1)


def segment_block_ranges(q_seg, kv_seg, block_q: int, block_kv: int):
  """Block ranges that segment ids leave visible (packed rows skip other sequences).

  Args:
    q_seg, kv_seg: [b, Tq], [b, Tk] int32 segment ids (0 = padding), lengths whole
      multiples of block_q and block_kv.

  Returns:
    (kv_ranges [b, nq, 4], q_ranges [b, nk, 4]) int32. Columns 0-1: for each q block,
    the first and last kv block whose non-zero ids overlap the q block's [min, max]
    non-zero id; for each kv block, the same over q blocks. A block pair outside them
    holds no query and key of one segment; inside, the element mask still applies. For
    packed rows (ids never decrease along the row, then padding) the ranges hold exactly
    the blocks with a query and a key of one segment. Columns 2-3: the sub-range whose
    blocks the ids mask nowhere: both blocks hold one non-zero id, the same (exact for
    packed rows; empty when such blocks do not form one run). Empty ranges are (n, -1).
  """
  def bounds(seg, block):
    b, t = seg.shape
    s = seg.reshape(b, t // block, block)
    real = s != 0
    lo = jnp.where(real, s, jnp.iinfo(jnp.int32).max).min(axis=-1)
    hi = jnp.where(real, s, jnp.iinfo(jnp.int32).min).max(axis=-1)
    return lo, hi, real.all(axis=-1) & (lo == hi)

  def hull(hit):  # [b, m, n] -> first / last true along n, (n, -1) when none
    n = hit.shape[-1]
    first = jnp.argmax(hit, axis=-1)
    last = n - 1 - jnp.argmax(hit[..., ::-1], axis=-1)
    some = hit.any(axis=-1)
    return jnp.where(some, first, n), jnp.where(some, last, -1)

  def run(full):  # the hull, kept only when every block inside it is full
    first, last = hull(full)
    whole = full.sum(axis=-1) == last - first + 1
    return jnp.where(whole, first, full.shape[-1]), jnp.where(whole, last, -1)

  def table(hit, full):
    return jnp.stack([*hull(hit), *run(full)], axis=-1).astype(jnp.int32)

  q_lo, q_hi, q_one = bounds(q_seg.astype(jnp.int32), block_q)
  kv_lo, kv_hi, kv_one = bounds(kv_seg.astype(jnp.int32), block_kv)
  hit = (q_lo[:, :, None] <= kv_hi[:, None, :]) & (kv_lo[:, None, :] <= q_hi[:, :, None])
  full = q_one[:, :, None] & kv_one[:, None, :] & (q_lo[:, :, None] == kv_lo[:, None, :])
  return (table(hit, full),
          table(jnp.swapaxes(hit, 1, 2), jnp.swapaxes(full, 1, 2)))


def _and_range(lo_hi, lo, hi):
  """Intersection of two inclusive block ranges."""
  return jnp.maximum(lo_hi[0], lo), jnp.minimum(lo_hi[1], hi)


def _without_segments(cfg: _Config) -> _Config:
  return dataclasses.replace(cfg, segments=False)


def _block_fully_visible(cfg: _Config, qi, ki, ids_full=None, xp=jnp):
  """True when no element of the (qi, ki) block pair is masked (padding rows of q
  excepted, their outputs are discarded). With segment ids, `ids_full` says whether
  the ids mask none of the pair (from `segment_block_ranges`); without it, False."""
  if cfg.segments:
    if ids_full is None:
      return jnp.bool_(False)
    return _block_fully_visible(_without_segments(cfg), qi, ki) & ids_full
  if not cfg.may_mask:
    return jnp.bool_(True)
  bq, bk, w = cfg.block_q, cfg.block_kv, cfg.sliding_window
  q_lo = qi * bq + cfg.offset
  q_hi = xp.minimum(qi * bq + bq - 1, cfg.q_len - 1) + cfg.offset
  kv_lo, kv_hi = ki * bk, ki * bk + bk - 1
  full = kv_hi < cfg.kv_len
  if cfg.causal:
    full &= kv_hi <= q_lo
  if w is not None:
    full &= q_hi - kv_lo < w
    if not cfg.causal:
      full &= kv_hi - q_lo < w
  return full


def kv_full_range(cfg: _Config, qi, segment_full=None):
  """Inclusive range [lo, hi] of kv blocks that `qi` sees with no element masked:
  a sub-range of `kv_block_range(cfg, qi)` that loops may run without the mask
  (exactly the blocks of `_block_fully_visible`). With segment ids it is cut to
  `segment_full` (columns 2-3 of `segment_block_ranges`), or empty without it.
  Empty ranges have lo > hi."""
  qi = jnp.asarray(qi, jnp.int32)
  if cfg.segments:
    if segment_full is None:
      hi = kv_block_range(cfg, qi)[1]
      return hi + 1, hi
    return _and_range(kv_full_range(_without_segments(cfg), qi), *segment_full)
  lo, hi = kv_block_range(cfg, qi)
  if not cfg.may_mask:
    return lo, hi
  bq, bk, w = cfg.block_q, cfg.block_kv, cfg.sliding_window
  bias = _bias(cfg, bk)
  q_lo = qi * bq + cfg.offset
  q_hi = jnp.minimum(qi * bq + bq - 1, cfg.q_len - 1) + cfg.offset
  full_hi = jnp.minimum(hi, cfg.kv_len // bk - 1)  # the last partial block is masked
  if cfg.causal:  # key block ends at or before the first query
    full_hi = jnp.minimum(full_hi, _floor_div(q_lo + 1, bk, bias) - 1)
  full_lo = lo
  if w is not None:  # the last query still sees the block's first key
    full_lo = jnp.maximum(full_lo, _floor_div(q_hi - w, bk, bias) + 1)
    if not cfg.causal:  # the first query sees the block's last key
      full_hi = jnp.minimum(full_hi, _floor_div(q_lo + w - bk, bk, bias))
  return full_lo, full_hi


def q_full_range(cfg: _Config, ki, segment_full=None):
  """Inclusive range [lo, hi] of q blocks that see kv block `ki` with no element
  masked (a sub-range of `q_block_range`; with a sliding window the last q block,
  whose padding rows are never masked, may be left out). Segment ids as in
  `kv_full_range`."""
  ki = jnp.asarray(ki, jnp.int32)
  if cfg.segments:
    if segment_full is None:
      hi = q_block_range(cfg, ki)[1]
      return hi + 1, hi
    return _and_range(q_full_range(_without_segments(cfg), ki), *segment_full)
  lo, hi = q_block_range(cfg, ki)
  if not cfg.may_mask:
    return lo, hi
  bq, bk, w = cfg.block_q, cfg.block_kv, cfg.sliding_window
  bias = _bias(cfg, bq)
  kv_lo, kv_hi = ki * bk, ki * bk + bk - 1
  full_lo, full_hi = lo, hi
  if cfg.causal:  # the block's first query sees the last key
    full_lo = jnp.maximum(full_lo, _floor_div(kv_hi - cfg.offset + bq - 1, bq, bias))
  if w is not None:
    # Every row of the q block (padding included) still sees the first key.
    full_hi = jnp.minimum(full_hi, _floor_div(w + kv_lo - cfg.offset - bq, bq, bias))
    if not cfg.causal:
      full_lo = jnp.maximum(full_lo, _floor_div(kv_hi - cfg.offset - w, bq, bias) + 1)
  if cfg.kv_len % bk:
    full_hi = jnp.where(kv_hi >= cfg.kv_len, full_lo - 1, full_hi)
  return full_lo, full_hi


def _block_positions(cfg: _Config, qi, ki, shape, kv_major: bool = False):
  """int32 query and key positions [block_q, block_kv] of one block pair ([block_kv,
  block_q] with `kv_major`), as the mask and ALiBi see them."""
  q_axis = 1 if kv_major else 0
  q_pos = qi * cfg.block_q + cfg.offset + lax.broadcasted_iota(jnp.int32, shape, q_axis)
  kv_pos = ki * cfg.block_kv + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
  return q_pos, kv_pos


def _element_mask(cfg: _Config, qi, ki, shape, q_seg=None, kv_seg=None,
                  kv_major: bool = False):
  """[block_q, block_kv] bool mask of one block pair (True = visible); [block_kv,
  block_q] with `kv_major`. q_seg / kv_seg broadcast against it."""
  q_pos, kv_pos = _block_positions(cfg, qi, ki, shape, kv_major)
  mask = jnp.ones(shape, jnp.bool_)
  if cfg.kv_len % cfg.block_kv:
    mask &= kv_pos < cfg.kv_len
  if cfg.causal:
    mask &= q_pos >= kv_pos
  if cfg.sliding_window is not None:
    mask &= q_pos - kv_pos < cfg.sliding_window
    if not cfg.causal:
      mask &= kv_pos - q_pos < cfg.sliding_window
  if q_seg is not None:
    mask &= (q_seg == kv_seg) & (kv_seg != 0)
  return mask


def _soft_cap_grad(cfg: _Config, ds, capped):
  if cfg.logits_soft_cap is None:
    return ds
  return ds * (1.0 - jnp.square(capped / cfg.logits_soft_cap))


def _logits_base2(cfg: _Config, q, k):
  """Logits in base 2 (the natural logits times log2 e) and the capped natural
  logits (None without a soft cap). exp2 of them is the softmax's exp, and lowers to a
  single ex2 instruction where jnp.exp lowers to libdevice's exact expf; without a soft
  cap log2 e folds into the one scale multiply."""
  s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
  if cfg.logits_soft_cap is None:
    return s * (cfg.sm_scale * LOG2E), None
  capped = cfg.logits_soft_cap * jnp.tanh(s * (cfg.sm_scale / cfg.logits_soft_cap))
  return capped * LOG2E, capped


def _with_alibi(cfg: _Config, s, slope, qi, ki, kv_major: bool = False):
  """Base-2 logits s of one block pair plus ALiBi's bias, -slope * |q_pos - kv_pos| with
  `slope` the head's slope times log2 e (after the scale and soft cap, before the mask;
  the soft cap's derivative stays that of the unbiased logits); s itself when slope is
  None. Every visited block needs it, the fully visible ones too."""
  if slope is None:
    return s
  q_pos, kv_pos = _block_positions(cfg, qi, ki, s.shape, kv_major)
  # The distance in f32 (exact below 2^24): one convert, then float ops only.
  return s - slope * jnp.abs((q_pos - kv_pos).astype(jnp.float32))


# ----------------------------------------------------------------------------------
# TPU grids. A rectangular grid steps through every block pair and skips the hidden ones
# in `pl.when`, but a skipped step still pays the step overhead (index maps, DMA
# bookkeeping: 207-375 bundles). A compact grid steps through the pairs the causal /
# sliding-window mask leaves visible, listed row by row in a table prefetched into SMEM.

# Steps of a compact grid (8 bytes each in SMEM; TPU v4 and later have 1 MiB). Longer
# tables fall back to the rectangular grid.
MAX_COMPACT_STEPS = 1 << 15
# A compact step reads its block ids from SMEM, and libtpu's schedule of its pipeline
# bookkeeping is longer: 293 / 392 / 474 bundles of overhead a step against 207 / 212 /
# 208 for the rectangle's forward / dq / dk/dv on v5e (v6e 320 / 430 / 510 vs 238 / 262
# / 266; v5p 308 / 417 / 504 vs 237 / 285 / 313; `python -m benchmarks.tpu_static
# --arms=1024x1024+compact,1024x1024+rect`). A compact grid wins when its steps are
# fewer than that ratio of the rectangle's; by default (compact_grid=None) a kernel
# steps compactly below these fractions (under every chip's ratio): the forward for a
# causal triangle of 4+ blocks a side, all three kernels for long sliding windows.
COMPACT_AUTO_FRACTION = {"fwd": fractions.Fraction(7, 10), "dq": fractions.Fraction(1, 2),
                         "dkv": fractions.Fraction(2, 5)}  # exact: no rounding at the edge


@functools.lru_cache(maxsize=256)
def compact_steps(cfg: _Config, kernel: str = "fwd") -> tuple[tuple, ...] | None:
  """The block ids of a compact grid's steps for `kernel` ("fwd", "dq" or "dkv"): (qi,
  ki) row by row over q blocks, or for the dk/dv kernel, kv-major, (ki, gi, qi) over kv
  blocks and the group's heads. Only pairs `kv_block_range` keeps; a row that sees none
  gets one step at its first block, outside the range (it visits nothing, but init and
  finish run). None when the
  rectangular grid is used: no causal or window mask, `compact_grid` False, a table
  no shorter than the rectangle or longer than MAX_COMPACT_STEPS, or (compact_grid
  None) longer than the kernel's COMPACT_AUTO_FRACTION of the rectangle."""
  if cfg.compact_grid is False or not (cfg.causal or cfg.sliding_window is not None):
    return None
  kv_major = kernel == "dkv"
  nq, nk, g = cfg.num_q_blocks, cfg.num_kv_blocks, cfg.group
  rows, other = (nk, nq) if kv_major else (nq, nk)
  block_range = q_block_range if kv_major else kv_block_range
  inner = []
  for row in range(rows):
    a, b = block_range(cfg, row, xp=_Ints)
    inner.append(range(a, b + 1) if a <= b else [min(a, other - 1)])
  heads = g if kv_major else 1
  n, rectangle = heads * sum(len(ids) for ids in inner), nq * nk * heads
  if n >= rectangle or n > MAX_COMPACT_STEPS or (
      cfg.compact_grid is None and n > COMPACT_AUTO_FRACTION[kernel] * rectangle):
    return None
  if kv_major:
    return tuple((row, gi, i) for row, ids in enumerate(inner) for gi in range(g)
                 for i in ids)
  return tuple((row, i) for row, ids in enumerate(inner) for i in ids)


# Flags of a compact step (its table's second word; bits 8 and up: the head in group).
_FIRST, _LAST, _VISIBLE, _FULL = 1, 2, 4, 8


@functools.lru_cache(maxsize=256)
def _compact_words(cfg: _Config, kernel: str) -> tuple[int, ...]:
  """`compact_steps` as two int32 words a step (`_TpuGrid`): (row << 16 | inner block
  id), and the flags | head in group << 8."""
  steps, kv_major = compact_steps(cfg, kernel), kernel == "dkv"
  plain = _without_segments(cfg)
  words = []
  for n, step in enumerate(steps):
    row, gi, inner = step if kv_major else (step[0], 0, step[1])
    qi, ki = (inner, row) if kv_major else (row, inner)
    flags = ((_FIRST if n == 0 or steps[n - 1][0] != row else 0)
             | (_LAST if n + 1 == len(steps) or steps[n + 1][0] != row else 0))
    if _in_range(ki, kv_block_range(cfg, qi, xp=_Ints)):
      flags |= _VISIBLE | (_FULL if _block_fully_visible(plain, qi, ki, xp=_Ints) else 0)
    words += [row << 16 | inner, flags | gi << 8]
  return tuple(words)


@dataclasses.dataclass(frozen=True)
class _TpuGrid:
  """A TPU kernel's grid after its (batch, heads) dims: rectangular (q blocks, kv
  blocks), kv-major (kv blocks, heads in group, q blocks), or compact, one dim over
  `compact_steps`. A compact step is two int32 words in SMEM: (row << 16 | inner block
  id) and flags (first / last step of its row, pair visible, pair unmasked; segment ids
  not considered) | head in group << 8, so the scalar core decodes a step with shifts
  and masks, no division. Index maps and kernels see block ids either way."""
  cfg: _Config
  kernel: str  # "fwd", "dq" or "dkv"
  steps: tuple | None

  @classmethod
  def make(cls, cfg: _Config, kernel: str) -> _TpuGrid:
    steps = compact_steps(cfg, kernel)
    if steps is not None and max(cfg.num_q_blocks, cfg.num_kv_blocks) >= 1 << 15:
      steps = None  # ids do not fit 16 bits (lengths of millions of tokens)
    return cls(cfg, kernel, steps)

  @property
  def kv_major(self) -> bool:
    return self.kernel == "dkv"

  @property
  def dims(self) -> tuple[int, ...]:
    cfg = self.cfg
    if self.steps is not None:
      return (len(self.steps),)
    if self.kv_major:
      return cfg.num_kv_blocks, cfg.group, cfg.num_q_blocks
    return cfg.num_q_blocks, cfg.num_kv_blocks

  @property
  def semantics(self) -> tuple[str, ...]:
    """Batch, heads (and a rectangle's rows) are independent; the steps of a row run in
    order over its accumulators."""
    inner = ("arbitrary",) if self.steps is not None else (
        ("parallel", "arbitrary", "arbitrary") if self.kv_major
        else ("parallel", "arbitrary"))
    return ("parallel", "parallel") + inner

  def table(self):
    """The steps' words, a scalar-prefetch operand (None for a rectangular grid)."""
    if self.steps is None:
      return None
    return jnp.asarray(_compact_words(self.cfg, self.kernel), jnp.int32)

  def _decode(self, table_ref, s):
    """Block ids of compact step `s`, (qi, ki) or kv-major (ki, gi, qi), and its flags."""
    word, flags = table_ref[2 * s], table_ref[2 * s + 1]
    row, inner = word >> 16, word & 0xFFFF
    if self.kv_major:
      return (row, flags >> 8, inner), flags
    return (row, inner), flags

  def kernel_step(self, table_ref):
    """(block ids, first, last, visible, full) of the running grid step: whether it
    starts its row (init), ends it (finish), and whether the causal / window mask
    leaves its block pair visible, and wholly unmasked (segment ids not considered)."""
    cfg = self.cfg
    if self.steps is not None:
      ids, flags = self._decode(table_ref, pl.program_id(2))
      bit = lambda b: (flags & b) != 0  # noqa: E731
      return ids, bit(_FIRST), bit(_LAST), bit(_VISIBLE), bit(_FULL)
    ids = tuple(pl.program_id(2 + i) for i in range(len(self.dims)))
    if self.kv_major:
      ki, gi, qi = ids
      first = (gi == 0) & (qi == 0)
      last = (gi == cfg.group - 1) & (qi == cfg.num_q_blocks - 1)
    else:
      qi, ki = ids
      first, last = ki == 0, ki == cfg.num_kv_blocks - 1
    visible = _in_range(ki, kv_block_range(cfg, qi))
    return ids, first, last, visible, _block_fully_visible(_without_segments(cfg), qi, ki)

  def index_map(self, fn):
    """An index map from fn(bi, hi, *block ids, *prefetched ranges)."""
    n = len(self.dims)

    def index(bi, hi, *rest):
      refs = rest[n:]
      if self.steps is None:
        return fn(bi, hi, *rest[:n], *refs)
      ids, _ = self._decode(refs[0], rest[0])
      return fn(bi, hi, *ids, *refs[1:])
    return index


# ----------------------------------------------------------------------------------
# TPU kernels. Row statistics are [block, 128] lane-replicated arrays (as in JAX's
# splash attention) so that Mosaic never relayouts a vector of length block.


def _lanes(x, n: int):
  """[rows, 128] lane-replicated -> [rows, n]."""
  return jnp.tile(x, (1, pl.cdiv(n, NUM_LANES)))[:, :n]


def _lane_partial_sums(x):
  """[rows, n * 128] -> [rows, 128]: the sum of x's lane-aligned column slices, each
  lane a partial row sum (VPU adds only; no cross-lane reduction). TPU blocks are
  multiples of 128."""
  n = x.shape[-1]
  parts = [x[:, i:i + NUM_LANES] for i in range(0, n, NUM_LANES)]
  while len(parts) > 1:  # a tree: log-depth adds
    parts = [a + b for a, b in zip(parts[::2], parts[1::2])] + parts[len(parts) & ~1:]
  return parts[0]


def _tpu_segments(cfg: _Config, q_seg_ref, kv_seg_ref, shape):
  if not cfg.segments:
    return None, None
  q_seg = _lanes(q_seg_ref[...], shape[1])
  return q_seg, kv_seg_ref[:1, :]


def _tpu_seg_range(range_ref, bi, i, n: int, full: bool = False):
  """Entry (bi, i) of a flattened [b, n, 4] `segment_block_ranges` array in SMEM: the
  visible range, or with `full` the range the ids mask nowhere."""
  at = (bi * n + i) * 4 + (2 if full else 0)
  return range_ref[at], range_ref[at + 1]


def _tpu_slope(slopes_ref, head):
  """The ALiBi slope (times log2 e) of query head `head`, a scalar read from SMEM; None
  without ALiBi."""
  return None if slopes_ref is None else slopes_ref[head]


def _tpu_count(count_ref, masked: bool):
  """Debug counters: lane 0 counts the visited block pairs, lane 1 the masked ones."""
  lane = lax.broadcasted_iota(jnp.int32, count_ref.shape, 1)
  count_ref[...] += jnp.where(lane == 0, 1, jnp.where(lane == 1, int(masked), 0))


def _tpu_kv_range(cfg: _Config, bi, qi, range_ref):
  """kv blocks q block `qi` of batch row `bi` visits (index maps and kernels agree)."""
  lo_hi = kv_block_range(cfg, qi)
  if range_ref is not None:
    lo_hi = _and_range(lo_hi, *_tpu_seg_range(range_ref, bi, qi, cfg.num_q_blocks))
  return lo_hi


def _tpu_q_range(cfg: _Config, bi, ki, range_ref):
  """q blocks that see kv block `ki` of batch row `bi`."""
  lo_hi = q_block_range(cfg, ki)
  if range_ref is not None:
    lo_hi = _and_range(lo_hi, *_tpu_seg_range(range_ref, bi, ki, cfg.num_kv_blocks))
  return lo_hi


def _tpu_ids_full(cfg: _Config, bi, qi, ki, range_ref, by_kv_block: bool = False):
  """Whether the segment ids mask none of the (qi, ki) block pair (None without ids);
  the table is indexed by q block, or with `by_kv_block` by kv block."""
  if range_ref is None:
    return None
  if by_kv_block:
    return _in_range(qi, _tpu_seg_range(range_ref, bi, ki, cfg.num_kv_blocks, full=True))
  return _in_range(ki, _tpu_seg_range(range_ref, bi, qi, cfg.num_q_blocks, full=True))


def _tpu_segment_mask(cfg: _Config, qi, ki, visible, full, range_ref,
                      kv_major: bool = False):
  """A step's (visible, full) with the segment ids' block ranges applied (the causal /
  window mask's, as `_TpuGrid.kernel_step` gives them, unchanged without ids)."""
  if range_ref is None:
    return visible, full
  bi = pl.program_id(0)
  if kv_major:
    visible &= _in_range(qi, _tpu_seg_range(range_ref, bi, ki, cfg.num_kv_blocks))
  else:
    visible &= _in_range(ki, _tpu_seg_range(range_ref, bi, qi, cfg.num_q_blocks))
  return visible, full & _tpu_ids_full(cfg, bi, qi, ki, range_ref, by_kv_block=kv_major)


def _tpu_kv_index(cfg: _Config, grid: _TpuGrid, bi, hi, qi, ki, *r):
  """Index map of k / v blocks (q-major grids): a skipped step fetches the nearest
  visible block, already resident. `r`: the prefetched ranges, if any. A compact grid
  has no step outside the causal / window range to clamp (but for the one step of a
  row that sees nothing): only segment ids skip steps there."""
  if grid.steps is None:
    lo_hi = _tpu_kv_range(cfg, bi, qi, r[0] if r else None)
  elif r:
    lo_hi = _tpu_seg_range(r[0], bi, qi, cfg.num_q_blocks)
  else:
    return bi, hi // cfg.group, ki, 0
  return bi, hi // cfg.group, _clamp(ki, lo_hi, cfg.num_kv_blocks), 0


def _tpu_fwd_kernel(*refs, cfg: _Config, grid: _TpuGrid, counts: bool):
  refs = list(refs)
  table_ref = refs.pop(0) if grid.steps is not None else None
  range_ref = refs.pop(0) if cfg.segments else None
  q_ref, k_ref, v_ref = refs[:3]
  q_seg_ref, kv_seg_ref = refs[3:5] if cfg.segments else (None, None)
  rest = refs[5:] if cfg.segments else refs[3:]
  slopes_ref = rest.pop(0) if cfg.alibi else None
  o_ref, lse_ref = rest[:2]
  count_ref = rest[2] if counts else None
  m_sc, l_sc, acc_sc = rest[-3:]
  (qi, ki), first, last, visible, full = grid.kernel_step(table_ref)
  bq, bk = cfg.block_q, cfg.block_kv
  # Read here: interpret mode substitutes program ids outside pl.when bodies only.
  slope = _tpu_slope(slopes_ref, pl.program_id(1))

  @pl.when(first)
  def _init():
    m_sc[...] = jnp.full_like(m_sc, MASK_VALUE)
    l_sc[...] = jnp.zeros_like(l_sc)
    acc_sc[...] = jnp.zeros_like(acc_sc)
    if counts:
      count_ref[...] = jnp.zeros_like(count_ref)

  def step(masked: bool):
    s, _ = _logits_base2(cfg, q_ref[...], k_ref[...])
    s = _with_alibi(cfg, s, slope, qi, ki)
    if masked:
      q_seg, kv_seg = _tpu_segments(cfg, q_seg_ref, kv_seg_ref, (bq, bk))
      s = jnp.where(_element_mask(cfg, qi, ki, (bq, bk), q_seg, kv_seg), s, MASK_VALUE)
    m_prev, l_prev = m_sc[...], l_sc[...]
    m_next = jnp.maximum(m_prev, s.max(axis=-1)[:, None])  # running max in base 2
    p = jnp.exp2(s - _lanes(m_next, bk))
    alpha = jnp.exp2(m_prev - m_next)
    m_sc[...] = m_next
    # l is kept as per-lane partial sums (lane-aligned slices of p added up): the one
    # cross-lane sum a row needs is left to _finish.
    l_sc[...] = alpha * l_prev + _lane_partial_sums(p)
    v = v_ref[...]
    pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc_sc[...] = _lanes(alpha, acc_sc.shape[-1]) * acc_sc[...] + pv
    if counts:
      _tpu_count(count_ref, masked)

  visible, full = _tpu_segment_mask(cfg, qi, ki, visible, full, range_ref)
  if cfg.may_mask:
    pl.when(visible & full)(functools.partial(step, False))
    pl.when(visible & ~full)(functools.partial(step, True))
  else:
    pl.when(visible)(functools.partial(step, False))

  @pl.when(last)
  def _finish():
    m = m_sc[...]
    l = _lanes(l_sc[...].sum(axis=-1, keepdims=True), NUM_LANES)
    empty = m == MASK_VALUE  # no visible key in any block
    l_safe = jnp.where(empty, 1.0, l)
    # Empty rows accumulated exp(0) garbage; a zero scale (not a tiled bool mask, which
    # Mosaic handles poorly) clears them.
    inv_l = jnp.where(empty, 0.0, 1.0 / l_safe)
    o_ref[...] = (acc_sc[...] * _lanes(inv_l, acc_sc.shape[-1])).astype(o_ref.dtype)
    # +inf for empty rows makes exp(s - lse) = 0 in the backward pass.
    lse_ref[...] = jnp.where(empty, jnp.inf, (m + jnp.log2(l_safe)) * (1.0 / LOG2E))


def _tpu_grads_block(cfg: _Config, qi, ki, masked, q, k, v, do, lse2, di, q_seg, kv_seg,
                     kv_major: bool = False, slope=None):
  """(p, ds / sm_scale) [block_q, block_kv] of one block pair (the dq kernel), or with
  `kv_major` (p.T, ds.T / sm_scale) [block_kv, block_q] from k @ q.T (the dk/dv kernel,
  as splash attention's: its accumulating matmuls then need no XLU transpose). The
  kernels apply sm_scale once to the accumulated dq / dk. lse2 (the log-sum-exp in base
  2), di and the ids come already broadcastable against the block; `slope`: the head's
  ALiBi slope times log2 e, or None."""
  s, capped = _logits_base2(cfg, k, q) if kv_major else _logits_base2(cfg, q, k)
  s = _with_alibi(cfg, s, slope, qi, ki, kv_major)
  if masked:
    s = jnp.where(_element_mask(cfg, qi, ki, s.shape, q_seg, kv_seg, kv_major), s,
                  MASK_VALUE)
  p = jnp.exp2(s - lse2)
  dp = (lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32) if kv_major
        else lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32))
  return p, _soft_cap_grad(cfg, p * (dp - di), capped)


def _tpu_dq_kernel(*refs, cfg: _Config, grid: _TpuGrid, counts: bool):
  refs = list(refs)
  table_ref = refs.pop(0) if grid.steps is not None else None
  range_ref = refs.pop(0) if cfg.segments else None
  q_ref, k_ref, v_ref, do_ref, stats_ref = refs[:5]
  q_seg_ref, kv_seg_ref = refs[5:7] if cfg.segments else (None, None)
  rest = refs[7:] if cfg.segments else refs[5:]
  slopes_ref = rest.pop(0) if cfg.alibi else None
  dq_ref = rest[0]
  count_ref = rest[1] if counts else None
  dq_sc = rest[-1]
  (qi, ki), first, last, visible, full = grid.kernel_step(table_ref)
  slope = _tpu_slope(slopes_ref, pl.program_id(1))

  @pl.when(first)
  def _init():
    dq_sc[...] = jnp.zeros_like(dq_sc)
    if counts:
      count_ref[...] = jnp.zeros_like(count_ref)

  def step(masked: bool):
    k = k_ref[...]
    q_seg, kv_seg = (_tpu_segments(cfg, q_seg_ref, kv_seg_ref,
                                   (cfg.block_q, cfg.block_kv)) if masked else (None, None))
    bk = cfg.block_kv
    lse2, di = stats_ref[:, :NUM_LANES], stats_ref[:, NUM_LANES:]
    _, ds = _tpu_grads_block(cfg, qi, ki, masked, q_ref[...], k, v_ref[...], do_ref[...],
                             _lanes(lse2, bk), _lanes(di, bk), q_seg, kv_seg,
                             slope=slope)
    dq_sc[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    if counts:
      _tpu_count(count_ref, masked)

  visible, full = _tpu_segment_mask(cfg, qi, ki, visible, full, range_ref)
  pl.when(visible & full)(functools.partial(step, False))
  if cfg.may_mask:
    pl.when(visible & ~full)(functools.partial(step, True))

  @pl.when(last)
  def _finish():
    dq_ref[...] = (dq_sc[...] * cfg.sm_scale).astype(dq_ref.dtype)


def _tpu_dkv_kernel(*refs, cfg: _Config, grid: _TpuGrid, counts: bool):
  refs = list(refs)
  table_ref = refs.pop(0) if grid.steps is not None else None
  range_ref = refs.pop(0) if cfg.segments else None
  q_ref, k_ref, v_ref, do_ref, stats_ref = refs[:5]
  q_seg_ref, kv_seg_ref = refs[5:7] if cfg.segments else (None, None)
  rest = refs[7:] if cfg.segments else refs[5:]
  slopes_ref = rest.pop(0) if cfg.alibi else None
  dk_ref, dv_ref = rest[:2]
  rest = rest[2:]
  dq_ref = rest.pop(0) if cfg.fused_bwd else None
  count_ref = rest[0] if counts else None
  dk_sc, dv_sc = rest[-2:]
  (ki, gi, qi), first, last, visible, full = grid.kernel_step(table_ref)
  # The query head: kv head pl.program_id(1)'s gi-th of its group.
  slope = _tpu_slope(slopes_ref, pl.program_id(1) * cfg.group + gi)

  @pl.when(first)
  def _init():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)
    if counts:
      count_ref[...] = jnp.zeros_like(count_ref)

  def step(masked: bool):
    # kv-major: lse and di arrive as one [8, bq] block (`_tpu_stats`: rows 0-3 lse, 4-7
    # di), the q ids sublane-replicated ([8, bq] rows), the kv ids lane-replicated
    # ([bk, 128] columns).
    q, do = q_ref[...], do_ref[...]
    q_seg = kv_seg = None
    if masked and cfg.segments:
      q_seg, kv_seg = q_seg_ref[:1, :], _lanes(kv_seg_ref[...], q.shape[0])
    p, ds = _tpu_grads_block(cfg, qi, ki, masked, q, k_ref[...], v_ref[...], do,
                             stats_ref[:1, :], stats_ref[_DI_ROW:_DI_ROW + 1, :], q_seg,
                             kv_seg, kv_major=True, slope=slope)
    dv_sc[...] += lax.dot(p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    ds = ds.astype(q.dtype)
    dk_sc[...] += lax.dot(ds, q, preferred_element_type=jnp.float32)
    if dq_ref is not None:  # this kv block's share of dq (ds is kv-major: ds.T @ k)
      dq_ref[...] = lax.dot_general(ds, k_ref[...], _TN, preferred_element_type=jnp.float32)
    if counts:
      _tpu_count(count_ref, masked)

  visible, full = _tpu_segment_mask(cfg, qi, ki, visible, full, range_ref, kv_major=True)
  pl.when(visible & full)(functools.partial(step, False))
  if cfg.may_mask:
    pl.when(visible & ~full)(functools.partial(step, True))

  @pl.when(last)
  def _finish():
    dk_ref[...] = (dk_sc[...] * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tpu_compiler_params(semantics):
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=semantics)


def _vmem(shape):
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.VMEM(shape, jnp.float32)


def _lane_rows(x):
  """[..., T] -> [..., T, 128]: each value replicated along the lanes (a column)."""
  return jnp.broadcast_to(x[..., None], x.shape + (NUM_LANES,))


def _sublane_rows(x):
  """[..., T] -> [..., 8, T]: replicated along the sublanes (a row)."""
  return jnp.broadcast_to(x[..., None, :], x.shape[:-1] + (NUM_SUBLANES, x.shape[-1]))


_DI_ROW = NUM_SUBLANES // 2


def _tpu_stats(lse2, di, kv_major: bool = False):
  """lse (base 2) and di [b, h, T] as the backward kernels' one row-statistics operand,
  one block fetch a step instead of two: [b, h, T, 256], lse replicated along lanes
  0-127 and di along 128-255 (the dq kernel); kv-major (the dk / dv kernel)
  [b, h, 8, T], lse in sublanes 0-3 and di in 4-7."""
  if kv_major:
    shape = lse2.shape[:-1] + (_DI_ROW, lse2.shape[-1])
    return jnp.concatenate([jnp.broadcast_to(lse2[..., None, :], shape),
                            jnp.broadcast_to(di[..., None, :], shape)], axis=-2)
  return jnp.concatenate([_lane_rows(lse2), _lane_rows(di)], axis=-1)


def _tpu_segment_operands(cfg, q_seg, kv_seg, kv_major: bool = False):
  """Segment ids laid out as Mosaic likes them: q [b, Tq, 128], kv [b, 8, Tk]; kv-major
  (the dk/dv kernel) q [b, 8, Tq], kv [b, Tk, 128]."""
  if kv_major:
    return _sublane_rows(q_seg), _lane_rows(kv_seg)
  return _lane_rows(q_seg), _sublane_rows(kv_seg)


def _tpu_slopes_operand(cfg: _Config, slopes, in_specs, operands):
  """With ALiBi, appends the slopes (f32 [heads], times log2 e) as a whole array in SMEM,
  which the kernels read one scalar of a step."""
  if cfg.alibi:
    from jax.experimental.pallas import tpu as pltpu
    in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    operands.append(slopes)


def _struct(shape, dtype, like):
  """Output type varying over the same shard_map axes as `like`, which
  shard_map(check_vma=True) requires of pallas_call outputs."""
  mat = getattr(jax.typeof(like), "manual_axis_type", None)
  if mat is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _count_spec(index):
  """Debug counters: one (8, 128) int32 tile per block, a shape Mosaic accepts."""
  return pl.BlockSpec((None, None, None, NUM_SUBLANES, NUM_LANES),
                      lambda *ids: (*index(*ids), 0, 0))


def _count_shape(b, h, n, like):
  return _struct((b, h, n, NUM_SUBLANES, NUM_LANES), jnp.int32, like)


def _tpu_call(cfg: _Config, grid: _TpuGrid, lead, kernel, in_specs, out_specs, out_shape,
              scratch, name: str, operands, ranges):
  """pallas_call of a TPU kernel over (*lead, *grid.dims): `lead` is (batch, heads). A
  compact grid's step table and, with segment ids, the flattened block ranges are
  prefetched into SMEM, in that order, where index maps (trailing arguments) and
  kernels (first) read them."""
  from jax.experimental.pallas import tpu as pltpu
  prefetch = tuple(x for x in (grid.table(), None if ranges is None else ranges.reshape(-1))
                   if x is not None)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch), grid=(*lead, *grid.dims),
      in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch)
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg, grid=grid), grid_spec=grid_spec,
      out_shape=out_shape, compiler_params=_tpu_compiler_params(grid.semantics),
      interpret=cfg.interpret, name=name,
  )(*prefetch, *operands)


def _tpu_forward(cfg: _Config, q, k, v, q_seg, kv_seg, counts: bool, slopes=None):
  """q [b, h, Tq, d], k/v [b, kvh, Tk, d] (padded) -> out, lse [b, h, Tq, 128].
  slopes: ALiBi's f32 [h] times log2 e (with cfg.alibi)."""
  b, h, tq, d = q.shape
  bq, bk = cfg.block_q, cfg.block_kv
  ranges = _segment_ranges(cfg, q_seg, kv_seg)[0] if cfg.segments else None
  grid = _TpuGrid.make(cfg, "fwd")
  # Index maps take (bi, hi, qi, ki) and the prefetched ranges, if any.
  kv_index = functools.partial(_tpu_kv_index, cfg, grid)
  q_index = lambda bi, hi, qi, ki, *_: (bi, hi, qi, 0)  # noqa: E731

  in_specs = [
      pl.BlockSpec((None, None, bq, d), grid.index_map(q_index)),
      pl.BlockSpec((None, None, bk, d), grid.index_map(kv_index)),
      pl.BlockSpec((None, None, bk, d), grid.index_map(kv_index)),
  ]
  operands = [q, k, v]
  if cfg.segments:
    in_specs += [
        pl.BlockSpec((None, bq, NUM_LANES),
                     grid.index_map(lambda bi, hi, qi, ki, *_: (bi, qi, 0))),
        pl.BlockSpec((None, NUM_SUBLANES, bk), grid.index_map(
            lambda bi, hi, qi, ki, *r: (bi, 0, kv_index(bi, hi, qi, ki, *r)[2]))),
    ]
    operands += _tpu_segment_operands(cfg, q_seg, kv_seg)
  _tpu_slopes_operand(cfg, slopes, in_specs, operands)
  out_specs = [
      pl.BlockSpec((None, None, bq, d), grid.index_map(q_index)),
      pl.BlockSpec((None, None, bq, NUM_LANES), grid.index_map(q_index)),
  ]
  out_shape = [_struct(q.shape, q.dtype, q),
               _struct((b, h, tq, NUM_LANES), jnp.float32, q)]
  if counts:
    out_specs.append(_count_spec(grid.index_map(lambda bi, hi, qi, ki, *_: (bi, hi, qi))))
    out_shape.append(_count_shape(b, h, cfg.num_q_blocks, q))
  return _tpu_call(
      cfg, grid, (b, h), functools.partial(_tpu_fwd_kernel, counts=counts), in_specs,
      out_specs, out_shape, [_vmem((bq, NUM_LANES)), _vmem((bq, NUM_LANES)), _vmem((bq, d))],
      "flash_attention_fwd", operands, ranges)


@functools.lru_cache(maxsize=256)
def fused_dq_slots(cfg: _Config) -> tuple[int, bool]:
  """(slots, windowed): the fused backward writes its f32 dq partials to [slots, b, h,
  rows, d]. One slot per kv block (slot ki; rows = Tq), unless a sliding window leaves
  each q block fewer kv blocks than that: then (windowed) pair (qi, ki) writes slot
  ki - lo(qi), lo the first kv block qi sees, and a kv block's steps that visit nothing
  write block ki of a last, spare slot (rows = max(Tq, kv blocks x block_q): under a
  window another kv block's pair may own their slot ki - lo(qi), and an output block
  must not be revisited once left). A window of w tokens keeps ~w / block_kv_bwd + 2
  slots however long the row."""
  nq, nk = cfg.num_q_blocks, cfg.num_kv_blocks
  if cfg.sliding_window is None:
    return nk, False
  widest = 0
  for qi in range(nq):
    lo, hi = kv_block_range(cfg, qi, xp=_Ints)
    widest = max(widest, hi - lo + 1)
  if (widest + 1) * max(nq, nk) < nk * nq:
    return widest + 1, True
  return nk, False


def fused_visited(cfg: _Config, ranges=None):
  """bool [slots, b or 1, q blocks] (the spare slot left out): whether a step of the
  dk/dv kernel wrote that slot of the q block's dq partials (`fused_dq_slots`), by the
  kernel's own block ranges (`ranges`: the q ranges of `_segment_ranges`)."""
  slots, windowed = fused_dq_slots(cfg)
  qi = jnp.arange(cfg.num_q_blocks)[None, None, :]
  if windowed:
    lo, hi = kv_block_range(cfg, qi)
    ki = lo + jnp.arange(slots - 1)[:, None, None]
    visible = ki <= hi
  else:
    ki = jnp.arange(cfg.num_kv_blocks)[:, None, None]
    visible = _in_range(ki, kv_block_range(cfg, qi))
  if ranges is not None:  # [b, kv blocks, 4]: (lo, hi) of q blocks first
    at = jnp.clip(ki, 0, cfg.num_kv_blocks - 1)[..., 0, :]  # [slots, q blocks]
    seg_lo, seg_hi = (jnp.moveaxis(ranges[:, at, c], 0, 1) for c in (0, 1))
    visible &= _in_range(qi, (seg_lo, seg_hi))  # [slots, b, q blocks]
  return visible


def _fused_dq(cfg: _Config, parts, q_seg, kv_seg):
  """dq [b, h, Tq, d] f32 from the fused dk/dv kernel's partials [slots, b, h, Tq, d]
  (`fused_dq_slots`): blocks no step wrote (skipped pairs) hold garbage and are masked
  out, not multiplied."""
  _, b, h, _, d = parts.shape
  ranges = _segment_ranges(cfg, q_seg, kv_seg)[1] if cfg.segments else None
  visited = fused_visited(cfg, ranges)
  nq, bq = cfg.num_q_blocks, cfg.block_q
  parts = parts[:visited.shape[0], :, :, :nq * bq].reshape(-1, b, h, nq, bq, d)
  dq = jnp.where(visited[:, :, None, :, None, None], parts, 0.0).sum(axis=0)
  return (dq * cfg.sm_scale).reshape(b, h, nq * bq, d)


def _segment_ranges(cfg: _Config, q_seg, kv_seg):
  """`segment_block_ranges` over the config's blocks (ids padded to at least them)."""
  return segment_block_ranges(q_seg[:, :cfg.num_q_blocks * cfg.block_q],
                              kv_seg[:, :cfg.num_kv_blocks * cfg.block_kv],
                              cfg.block_q, cfg.block_kv)


def _tpu_dq(cfg: _Config, q, k, v, q_seg, kv_seg, do, stats, counts: bool, slopes=None):
  """Layouts as in `_tpu_forward`; stats: lse (base 2) and di packed by `_tpu_stats`,
  [b, h, Tq, 256]. Grid (b, h, q blocks, kv blocks), as the forward pass."""
  b, h, _, d = q.shape
  bq, bk = cfg.block_q, cfg.block_kv
  kv_ranges = _segment_ranges(cfg, q_seg, kv_seg)[0] if cfg.segments else None
  grid = _TpuGrid.make(cfg, "dq")
  kv_index = functools.partial(_tpu_kv_index, cfg, grid)
  q_index = grid.index_map(lambda bi, hi, qi, ki, *_: (bi, hi, qi, 0))
  q_spec = pl.BlockSpec((None, None, bq, d), q_index)
  stats_spec = pl.BlockSpec((None, None, bq, 2 * NUM_LANES), q_index)
  kv_spec = pl.BlockSpec((None, None, bk, d), grid.index_map(kv_index))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stats_spec]
  operands = [q, k, v, do, stats]
  if cfg.segments:
    in_specs += [
        pl.BlockSpec((None, bq, NUM_LANES),
                     grid.index_map(lambda bi, hi, qi, ki, *_: (bi, qi, 0))),
        pl.BlockSpec((None, NUM_SUBLANES, bk), grid.index_map(
            lambda bi, hi, qi, ki, *r: (bi, 0, kv_index(bi, hi, qi, ki, *r)[2]))),
    ]
    operands += _tpu_segment_operands(cfg, q_seg, kv_seg)
  _tpu_slopes_operand(cfg, slopes, in_specs, operands)
  out_specs = [q_spec]
  out_shape = [_struct(q.shape, q.dtype, q)]
  if counts:
    out_specs.append(_count_spec(grid.index_map(lambda bi, hi, qi, ki, *_: (bi, hi, qi))))
    out_shape.append(_count_shape(b, h, cfg.num_q_blocks, q))
  return _tpu_call(
      cfg, grid, (b, h), functools.partial(_tpu_dq_kernel, counts=counts), in_specs,
      out_specs, out_shape, [_vmem((bq, d))], "flash_attention_dq", operands, kv_ranges)


def _tpu_dkv(cfg: _Config, q, k, v, q_seg, kv_seg, do, stats, counts: bool, slopes=None):
  """dk, dv; grid (b, kv heads, kv blocks, heads in group, q blocks). stats: lse (base
  2) and di packed by `_tpu_stats`, [b, h, 8, Tq] (rows: the kernel works kv-major)."""
  b, kvh = k.shape[:2]
  d = q.shape[-1]
  bq, bk, g = cfg.block_q, cfg.block_kv, cfg.group
  nq, nk = cfg.num_q_blocks, cfg.num_kv_blocks
  q_ranges = _segment_ranges(cfg, q_seg, kv_seg)[1] if cfg.segments else None
  grid = _TpuGrid.make(cfg, "dkv")

  # Index maps from (bi, kh, ki, gi, qi) and the prefetched ranges, if any.
  def q_index(bi, kh, ki, gi, qi, *r):  # a skipped step: as `_tpu_kv_index`
    if grid.steps is None:
      qi = _clamp(qi, _tpu_q_range(cfg, bi, ki, r[0] if r else None), nq)
    elif r:
      qi = _clamp(qi, _tpu_seg_range(r[0], bi, ki, nk), nq)
    return bi, kh * g + gi, qi, 0

  def stats_index(*ids):  # [b, h, 8, Tq] rows of lse and di
    bi, hi, qi, _ = q_index(*ids)
    return bi, hi, 0, qi

  q_spec = pl.BlockSpec((None, None, bq, d), grid.index_map(q_index))
  stats_spec = pl.BlockSpec((None, None, NUM_SUBLANES, bq), grid.index_map(stats_index))
  kv_spec = pl.BlockSpec((None, None, bk, d),
                         grid.index_map(lambda bi, kh, ki, gi, qi, *_: (bi, kh, ki, 0)))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stats_spec]
  operands = [q, k, v, do, stats]
  if cfg.segments:
    in_specs += [
        pl.BlockSpec((None, NUM_SUBLANES, bq), grid.index_map(
            lambda bi, kh, ki, gi, qi, *r: (bi, 0, q_index(bi, kh, ki, gi, qi, *r)[2]))),
        pl.BlockSpec((None, bk, NUM_LANES),
                     grid.index_map(lambda bi, kh, ki, gi, qi, *_: (bi, ki, 0))),
    ]
    operands += _tpu_segment_operands(cfg, q_seg, kv_seg, kv_major=True)
  _tpu_slopes_operand(cfg, slopes, in_specs, operands)
  out_specs = [kv_spec, kv_spec]
  out_shape = [_struct(k.shape, k.dtype, q), _struct(v.shape, v.dtype, q)]
  if cfg.fused_bwd:
    # dq partials (`fused_dq_slots`). A skipped step maps to the block its neighbour
    # writes (q_index clamps qi to a visited q block), so it writes nothing back; a
    # step whose whole row visits nothing, windowed, to its kv block's spare block.
    # `_fused_dq` masks the blocks no step wrote.
    slots, windowed = fused_dq_slots(cfg)
    rows = max(nq, nk) * bq if windowed else q.shape[2]

    def dq_index(bi, kh, ki, gi, qi, *r):
      _, head, qb, _ = q_index(bi, kh, ki, gi, qi, *r)
      if not windowed:
        return ki, bi, head, qb, 0
      lo, hi = kv_block_range(cfg, qb)
      visible = _in_range(ki, (lo, hi))
      if r:
        visible &= _in_range(qb, _tpu_seg_range(r[0], bi, ki, nk))
      return (jnp.where(visible, ki - lo, slots - 1), bi, head,
              jnp.where(visible, qb, ki), 0)
    out_specs.append(pl.BlockSpec((None, None, None, bq, d), grid.index_map(dq_index)))
    out_shape.append(_struct((slots, b, q.shape[1], rows, d), jnp.float32, q))
  if counts:
    out_specs.append(_count_spec(grid.index_map(lambda bi, kh, ki, gi, qi, *_: (bi, kh, ki))))
    out_shape.append(_count_shape(b, kvh, nk, q))
  return _tpu_call(
      cfg, grid, (b, kvh), functools.partial(_tpu_dkv_kernel, counts=counts), in_specs,
      out_specs, out_shape, [_vmem((bk, d)), _vmem((bk, d))], "flash_attention_dkv",
      operands, q_ranges)


# ----------------------------------------------------------------------------------
# GPU (Triton) kernels: one program per (q block | kv block, batch, head), looping over
# the visible blocks of the other axis. Row statistics are plain [block] vectors.


def _gpu_q_block(cfg: _Config, program: Any):
  """q block of a grid program: with a causal mask the last (longest-running) q blocks
  are launched first, so short blocks fill the tail of the launch."""
  return cfg.num_q_blocks - 1 - program if cfg.causal else program


def _gpu_block_mask(cfg, qi, ki, shape, q_seg_ref, kv_seg_ref, kv_major: bool = False):
  q_seg = kv_seg = None
  if cfg.segments:
    q_seg = q_seg_ref[pl.ds(qi * cfg.block_q, cfg.block_q)]
    kv_seg = kv_seg_ref[pl.ds(ki * cfg.block_kv, cfg.block_kv)]
    q_seg, kv_seg = ((q_seg[None, :], kv_seg[:, None]) if kv_major
                     else (q_seg[:, None], kv_seg[None, :]))
  return _element_mask(cfg, qi, ki, shape, q_seg, kv_seg, kv_major)


def _visible_loop(lo_hi, full_lo_hi, body, init, counts: bool):
  """Runs `body(i, carry, masked)` over the visible blocks [lo, hi]: the fully visible
  sub-range [full_lo, full_hi] without the element mask, the blocks before and after
  it with the mask. With `counts` it also counts the iterations it ran, and the masked
  ones (the debug counters of the block-skipping tests)."""
  lo, hi = lo_hi
  full_lo, full_hi = full_lo_hi
  empty = full_lo > full_hi
  full_lo = jnp.where(empty, hi + 1, full_lo)
  full_hi = jnp.where(empty, hi, full_hi)
  spans = ((lo, jnp.minimum(hi, full_lo - 1), True), (full_lo, full_hi, False),
           (jnp.maximum(lo, full_hi + 1), hi, True))
  carry, visits, masked_visits = init, jnp.int32(0), jnp.int32(0)
  for start, stop, masked in spans:
    carry = lax.fori_loop(start, stop + 1, functools.partial(body, masked=masked), carry)
    if counts:
      n = jnp.maximum(stop + 1 - start, 0)
      visits += n
      masked_visits += n if masked else 0
  return carry, ((visits, masked_visits) if counts else None)


def _gpu_counts(count_ref, visits):
  """Writes (visited block pairs, masked ones) to a [2] counter block."""
  count_ref[...] = jnp.where(lax.iota(jnp.int32, 2) == 0, visits[0], visits[1])


def _gpu_ranges(cfg: _Config, block_range, full_range, i, range_ref):
  """(visible, fully visible) block ranges of the other axis for block `i`: the mask's,
  narrowed by the segment ids' (`range_ref`: one row of `segment_block_ranges`)."""
  if not cfg.segments:
    return block_range(cfg, i), full_range(cfg, i)
  return (_and_range(block_range(cfg, i), range_ref[0], range_ref[1]),
          full_range(cfg, i, (range_ref[2], range_ref[3])))


def _gpu_slopes(cfg: _Config, rest):
  """(slopes ref, the refs after it): with ALiBi the slopes follow the segment inputs."""
  return (rest[0], rest[1:]) if cfg.alibi else (None, rest)


def _gpu_fwd_kernel(*refs, cfg: _Config, counts: bool):
  q_ref, k_ref, v_ref = refs[:3]
  q_seg_ref, kv_seg_ref, range_ref = refs[3:6] if cfg.segments else (None, None, None)
  slopes_ref, rest = _gpu_slopes(cfg, refs[6:] if cfg.segments else refs[3:])
  o_ref, lse_ref = rest[:2]
  qi = _gpu_q_block(cfg, pl.program_id(0))
  bq, bk = cfg.block_q, cfg.block_kv
  q = q_ref[...]
  slope = None if slopes_ref is None else slopes_ref[pl.program_id(2)]

  def body(ki, carry, masked):
    acc, m, l = carry
    kv_slice = pl.ds(ki * bk, bk)
    s, _ = _logits_base2(cfg, q, k_ref[kv_slice, :])
    s = _with_alibi(cfg, s, slope, qi, ki)
    if masked:
      s = jnp.where(_gpu_block_mask(cfg, qi, ki, (bq, bk), q_seg_ref, kv_seg_ref), s,
                    MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=-1))  # running max and lse in base 2
    alpha = jnp.exp2(m - m_next)
    p = jnp.exp2(s - m_next[:, None])
    v = v_ref[kv_slice, :]
    pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_next, alpha * l + p.sum(axis=-1)

  # full_like keeps the loaded values' shard_map axes (interpret mode under shard_map).
  init = (lax.full_like(q, 0.0, jnp.float32), lax.full_like(q, MASK_VALUE, jnp.float32, (bq,)),
          lax.full_like(q, 0.0, jnp.float32, (bq,)))
  (acc, m, l), visited = _visible_loop(
      *_gpu_ranges(cfg, kv_block_range, kv_full_range, qi, range_ref), body, init, counts)
  empty = m == MASK_VALUE
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = jnp.where(empty[:, None], 0.0, acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, jnp.inf, (m + jnp.log2(l_safe)) * (1.0 / LOG2E))
  if counts:
    _gpu_counts(rest[2], visited)


def _gpu_ds(cfg, qi, ki, masked, q, k, v, do, lse2, di, q_seg_ref, kv_seg_ref,
            kv_major: bool = False, slope=None):
  """(p, ds) [block_q, block_kv] of one block pair; `lse2` is the log-sum-exp in base 2.
  With `kv_major`, (p.T, ds.T) [block_kv, block_q] from k @ q.T, so that the dk/dv
  kernel's dv += p.T @ do and dk += ds.T @ q need no transpose of a computed tile (each
  costs a trip through shared memory in Triton). `slope`: the head's ALiBi slope times
  log2 e, or None."""
  s, capped = _logits_base2(cfg, k, q) if kv_major else _logits_base2(cfg, q, k)
  s = _with_alibi(cfg, s, slope, qi, ki, kv_major)
  if masked:
    s = jnp.where(_gpu_block_mask(cfg, qi, ki, s.shape, q_seg_ref, kv_seg_ref, kv_major), s,
                  MASK_VALUE)
  row = (lambda x: x[None, :]) if kv_major else (lambda x: x[:, None])  # per query
  p = jnp.exp2(s - row(lse2))
  dp = (lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32) if kv_major
        else lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32))
  return p, _soft_cap_grad(cfg, p * (dp - row(di)), capped) * cfg.sm_scale


def _gpu_dq_kernel(*refs, cfg: _Config, counts: bool):
  q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
  q_seg_ref, kv_seg_ref, range_ref = refs[6:9] if cfg.segments else (None, None, None)
  slopes_ref, rest = _gpu_slopes(cfg, refs[9:] if cfg.segments else refs[6:])
  qi = _gpu_q_block(cfg, pl.program_id(0))
  bk = cfg.block_kv
  q, do, lse, di = q_ref[...], do_ref[...], lse_ref[...], di_ref[...]
  slope = None if slopes_ref is None else slopes_ref[pl.program_id(2)]

  def body(ki, dq, masked):
    kv_slice = pl.ds(ki * bk, bk)
    k = k_ref[kv_slice, :]
    _, ds = _gpu_ds(cfg, qi, ki, masked, q, k, v_ref[kv_slice, :], do, lse, di, q_seg_ref,
                    kv_seg_ref, slope=slope)
    return dq + lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  dq, visited = _visible_loop(
      *_gpu_ranges(cfg, kv_block_range, kv_full_range, qi, range_ref), body,
      lax.full_like(q, 0.0, jnp.float32), counts)
  rest[0][...] = dq.astype(rest[0].dtype)
  if counts:
    _gpu_counts(rest[1], visited)


def _gpu_dkv_kernel(*refs, cfg: _Config, counts: bool):
  # q_ref, do_ref: [Tq, group, d]; lse_ref (base 2), di_ref: [group, Tq]; k_ref, v_ref:
  # [bk, d]. With dq_atomic, refs end in the [b, Tq, h, d] f32 dq buffer (input aliased
  # to output), which each step adds its ds @ k to.
  q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
  q_seg_ref, kv_seg_ref, range_ref = refs[6:9] if cfg.segments else (None, None, None)
  slopes_ref, rest = _gpu_slopes(cfg, refs[9:] if cfg.segments else refs[6:])
  if cfg.dq_atomic:
    rest = rest[1:]  # the aliased input; the output ref is the one written
    dq_ref = rest[2]
  ki, bi, kh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq = cfg.block_q
  k, v = k_ref[...], v_ref[...]
  q_range, q_full = _gpu_ranges(cfg, q_block_range, q_full_range, ki, range_ref)

  def head(gi, carry):
    # The group's gi-th query head.
    slope = None if slopes_ref is None else slopes_ref[kh * cfg.group + gi]

    def body(qi, dkv, masked):
      dk, dv = dkv
      q_slice = pl.ds(qi * bq, bq)
      q, do = q_ref[q_slice, gi, :], do_ref[q_slice, gi, :]
      p_t, ds_t = _gpu_ds(cfg, qi, ki, masked, q, k, v, do, lse_ref[gi, q_slice],
                          di_ref[gi, q_slice], q_seg_ref, kv_seg_ref, kv_major=True,
                          slope=slope)
      dv = dv + lax.dot(p_t.astype(do.dtype), do, preferred_element_type=jnp.float32)
      ds_t = ds_t.astype(q.dtype)
      dk = dk + lax.dot(ds_t, q, preferred_element_type=jnp.float32)
      if cfg.dq_atomic:  # dq rows of this q block += ds @ k
        from jax.experimental.pallas import triton as pltriton
        pltriton.atomic_add(
            dq_ref, (bi, q_slice, kh * cfg.group + gi, slice(None)),
            lax.dot_general(ds_t, k, _TN, preferred_element_type=jnp.float32))
      return dk, dv

    dkv, visited = _visible_loop(q_range, q_full, body, carry[0], counts)
    return dkv, (tuple(a + b for a, b in zip(carry[1], visited)) if counts else carry[1])

  zeros = lax.full_like(k, 0.0, jnp.float32)
  (dk, dv), visited = lax.fori_loop(0, cfg.group, head,
                                    ((zeros, zeros), (jnp.int32(0), jnp.int32(0))))
  rest[0][...] = dk.astype(rest[0].dtype)
  rest[1][...] = dv.astype(rest[1].dtype)
  if counts:
    _gpu_counts(rest[-1], visited)


def _gpu_compiler_params(cfg: _Config, d: int):
  if cfg.interpret:
    return None
  from jax.experimental.pallas import triton as plgpu  # only ever imported for GPU runs
  return plgpu.CompilerParams(num_warps=cfg.num_warps or (4 if d <= 64 else 8),
                              num_stages=cfg.num_stages)


def _gpu_slopes_operand(cfg: _Config, slopes, in_specs, operands):
  """With ALiBi, appends the slopes (f32 [heads], times log2 e) as one whole block, which
  the kernels load a scalar of."""
  if cfg.alibi:
    in_specs.append(pl.BlockSpec(slopes.shape, lambda *_: (0,)))
    operands.append(slopes)


def _gpu_forward(cfg: _Config, q, k, v, q_seg, kv_seg, counts: bool, slopes=None):
  """q [b, Tq, h, d], k/v [b, Tk, kvh, d] (padded) -> out, lse [b, h, Tq]. slopes:
  ALiBi's f32 [h] times log2 e (with cfg.alibi)."""
  b, tq, h, d = q.shape
  tk = k.shape[1]
  bq, g, nq = cfg.block_q, cfg.group, cfg.num_q_blocks
  qb = functools.partial(_gpu_q_block, cfg)
  in_specs = [
      pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, qb(i), hi, 0)),
      pl.BlockSpec((None, tk, None, d), lambda qi, bi, hi: (bi, 0, hi // g, 0)),
      pl.BlockSpec((None, tk, None, d), lambda qi, bi, hi: (bi, 0, hi // g, 0)),
  ]
  operands = [q, k, v]
  if cfg.segments:
    kv_ranges = _segment_ranges(cfg, q_seg, kv_seg)[0]
    in_specs += [pl.BlockSpec((None, tq), lambda qi, bi, hi: (bi, 0)),
                 pl.BlockSpec((None, tk), lambda qi, bi, hi: (bi, 0)),
                 pl.BlockSpec((None, None, 4), lambda i, bi, hi: (bi, qb(i), 0))]
    operands += [q_seg, kv_seg, kv_ranges]
  _gpu_slopes_operand(cfg, slopes, in_specs, operands)
  out_specs = [pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, qb(i), hi, 0)),
               pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, qb(i)))]
  out_shape = [_struct(q.shape, q.dtype, q),
               _struct((b, h, tq), jnp.float32, q)]
  if counts:
    out_specs.append(pl.BlockSpec((None, None, None, 2), lambda i, bi, hi: (bi, hi, qb(i), 0)))
    out_shape.append(_struct((b, h, nq, 2), jnp.int32, q))
  return pl.pallas_call(
      functools.partial(_gpu_fwd_kernel, cfg=cfg, counts=counts),
      grid=(nq, b, h), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_gpu_compiler_params(cfg, d), interpret=cfg.interpret,
      name="flash_attention_fwd",
  )(*operands)


def _gpu_dq(cfg: _Config, q, k, v, q_seg, kv_seg, do, lse2, di, counts: bool,
            slopes=None):
  """Layouts as in `_gpu_forward`; lse2 (base 2) and di are [b, h, Tq]. Grid (q
  blocks, b, h), as the forward pass."""
  b, tq, h, d = q.shape
  tk = k.shape[1]
  bq, g, nq = cfg.block_q, cfg.group, cfg.num_q_blocks
  qb = functools.partial(_gpu_q_block, cfg)
  q_spec = pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, qb(i), hi, 0))
  kv_spec = pl.BlockSpec((None, tk, None, d), lambda qi, bi, hi: (bi, 0, hi // g, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, qb(i)))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  operands = [q, k, v, do, lse2, di]
  if cfg.segments:
    in_specs += [pl.BlockSpec((None, tq), lambda qi, bi, hi: (bi, 0)),
                 pl.BlockSpec((None, tk), lambda qi, bi, hi: (bi, 0)),
                 pl.BlockSpec((None, None, 4), lambda i, bi, hi: (bi, qb(i), 0))]
    operands += [q_seg, kv_seg, _segment_ranges(cfg, q_seg, kv_seg)[0]]
  _gpu_slopes_operand(cfg, slopes, in_specs, operands)
  out_specs = [q_spec]
  out_shape = [_struct(q.shape, q.dtype, q)]
  if counts:
    out_specs.append(pl.BlockSpec((None, None, None, 2), lambda i, bi, hi: (bi, hi, qb(i), 0)))
    out_shape.append(_struct((b, h, nq, 2), jnp.int32, q))
  return pl.pallas_call(
      functools.partial(_gpu_dq_kernel, cfg=cfg, counts=counts),
      grid=(nq, b, h), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_gpu_compiler_params(cfg, d), interpret=cfg.interpret,
      name="flash_attention_dq",
  )(*operands)


def _gpu_dkv(cfg: _Config, q, k, v, q_seg, kv_seg, do, lse2, di, counts: bool,
             slopes=None):
  """dk, dv (and with dq_atomic, dq in f32 last): grid (kv blocks, b, kv heads)."""
  b, tq, h, d = q.shape
  tk, kvh = k.shape[1], k.shape[2]
  bk, g, nk = cfg.block_kv, cfg.group, cfg.num_kv_blocks
  group_spec = pl.BlockSpec((None, tq, g, d), lambda ki, bi, kh: (bi, 0, kh, 0))
  kv_spec = pl.BlockSpec((None, bk, None, d), lambda ki, bi, kh: (bi, ki, kh, 0))
  rows_spec = pl.BlockSpec((None, g, tq), lambda ki, bi, kh: (bi, kh, 0))
  in_specs = [group_spec, kv_spec, kv_spec, group_spec, rows_spec, rows_spec]
  operands = [q, k, v, do, lse2, di]
  if cfg.segments:
    in_specs += [pl.BlockSpec((None, tq), lambda ki, bi, kh: (bi, 0)),
                 pl.BlockSpec((None, tk), lambda ki, bi, kh: (bi, 0)),
                 pl.BlockSpec((None, None, 4), lambda ki, bi, kh: (bi, ki, 0))]
    operands += [q_seg, kv_seg, _segment_ranges(cfg, q_seg, kv_seg)[1]]
  _gpu_slopes_operand(cfg, slopes, in_specs, operands)
  out_specs = [kv_spec, kv_spec]
  out_shape = [_struct(k.shape, k.dtype, q), _struct(v.shape, v.dtype, q)]
  aliases = {}
  if cfg.dq_atomic:
    # Programs of different kv blocks add to the same dq rows, so dq stays whole in
    # global memory (no block copy-in / copy-out) and starts from zeros.
    aliases = {len(operands): len(out_shape)}
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(jnp.zeros(q.shape, jnp.float32))
    out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    out_shape.append(_struct(q.shape, jnp.float32, q))
  if counts:
    out_specs.append(pl.BlockSpec((None, None, None, 2), lambda ki, bi, kh: (bi, kh, ki, 0)))
    out_shape.append(_struct((b, kvh, nk, 2), jnp.int32, q))
  return pl.pallas_call(
      functools.partial(_gpu_dkv_kernel, cfg=cfg, counts=counts),
      grid=(nk, b, kvh), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, compiler_params=_gpu_compiler_params(cfg, d),
      interpret=cfg.interpret, name="flash_attention_dkv",
  )(*operands)


# ----------------------------------------------------------------------------------
# Layout, padding and the custom_vjp.


def _pad_len(x, axis: int, multiple: int, value=0):
  pad = (-x.shape[axis]) % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _head_dim_for(cfg: _Config, d: int) -> int:
  # Triton tiles need power-of-two dims of at least 16; zero columns change nothing.
  if cfg.backend == "gpu" and not cfg.interpret:
    return max(16, pl.next_power_of_2(d))
  return d


def _prepare_rows(cfg: _Config, x, block: int):
  """Pads a [b, len, heads, d] array to whole blocks (and head_dim for Triton), and
  transposes it to [b, heads, len, d] for TPU."""
  d_pad = _head_dim_for(cfg, x.shape[-1]) - x.shape[-1]
  x = _pad_len(x, 1, block)
  if d_pad:
    x = jnp.pad(x, [(0, 0)] * 3 + [(0, d_pad)])
  return jnp.swapaxes(x, 1, 2) if cfg.backend == "tpu" else x


def _prepare(cfg: _Config, q, k, v, q_seg, kv_seg, q_multiple=None, kv_multiple=None):
  """Pads lengths to whole blocks (or the given multiples of them) for the kernels."""
  q_multiple, kv_multiple = q_multiple or cfg.block_q, kv_multiple or cfg.block_kv
  q = _prepare_rows(cfg, q, q_multiple)
  k = _prepare_rows(cfg, k, kv_multiple)
  v = _prepare_rows(cfg, v, kv_multiple)
  if cfg.segments:
    q_seg = _pad_len(q_seg.astype(jnp.int32), 1, q_multiple)
    kv_seg = _pad_len(kv_seg.astype(jnp.int32), 1, kv_multiple)
  return q, k, v, q_seg, kv_seg


def _mosaic_forward(cfg: _Config, q, k) -> bool:
  """Whether the GPU forward runs the Mosaic GPU (Hopper) kernel."""
  if cfg.backend != "gpu" or cfg.interpret or cfg.gpu_forward == "triton" or cfg.alibi:
    return False  # (make_config refuses gpu_forward="mosaic" with ALiBi)
  mosaic = importlib.import_module("kernels.flash_mosaic_gpu")
  reason = mosaic.unsupported(cfg, q, k)
  if cfg.gpu_forward == "mosaic":
    if reason:
      raise ValueError(f"gpu_forward='mosaic' cannot run this call: {reason}")
    return True
  # Calls with segment ids (packed rows: every RL step) keep Triton until a model step
  # with the Mosaic kernels has run on a device (the kernels alone are checked).
  return reason is None and not cfg.segments and mosaic.hopper_device()


def _mosaic_backward(cfg: _Config, q, k) -> bool:
  """Whether the GPU backward runs the Mosaic GPU (Hopper) dq and dk / dv kernels: only
  when asked. On an H200 they are correct and 1.1-1.2x faster than the Triton ones at
  4k-32k, but a 1.2B model step with them did not finish compiling there (jax 0.11
  compiled every call site anew: 64 kernels for that step, lowered on a CPU host;
  `flash_mosaic_gpu.stable_basename` brings it to 4, not yet timed on a device), so None
  keeps Triton."""
  if cfg.backend != "gpu" or cfg.interpret or cfg.gpu_backward != "mosaic" or cfg.alibi:
    return False  # (make_config refuses gpu_backward="mosaic" with ALiBi)
  reason = importlib.import_module("kernels.flash_mosaic_gpu").unsupported_backward(
      cfg, q, k)
  if reason:
    raise ValueError(f"gpu_backward='mosaic' cannot run this call: {reason}")
  return True


def _slopes_base2(cfg: _Config, slopes):
  """ALiBi's slopes [heads] as the kernels' operand: f32 times log2 e (the kernels' logits
  are in base 2), without a gradient; None without ALiBi."""
  if not cfg.alibi:
    return None
  if slopes is None:
    raise ValueError("a config with alibi=True needs the alibi_slopes")
  return lax.stop_gradient(jnp.asarray(slopes, jnp.float32)) * LOG2E


def _forward(cfg: _Config, q, k, v, q_seg, kv_seg, counts=False, slopes=None):
  """Returns out [b, Tq, h, d] (q.dtype), internal lse [b, h, Tq] (+inf = no key).
  slopes: ALiBi's [h] (with cfg.alibi)."""
  tq, d = q.shape[1], q.shape[3]
  if not counts and _mosaic_forward(cfg, q, k):
    return importlib.import_module("kernels.flash_mosaic_gpu").forward(cfg, q, k, v, q_seg,
                                                                       kv_seg)
  slopes = _slopes_base2(cfg, slopes)
  qp, kp, vp, q_seg, kv_seg = _prepare(cfg, q, k, v, q_seg, kv_seg)
  if cfg.backend == "tpu":
    res = _tpu_forward(cfg, qp, kp, vp, q_seg, kv_seg, counts, slopes)
    out, lse = jnp.swapaxes(res[0], 1, 2), res[1][..., 0]
    res = (*res[:2], res[2][..., 0, :2]) if counts else res
  else:
    res = _gpu_forward(cfg, qp, kp, vp, q_seg, kv_seg, counts, slopes)
    out, lse = res[0], res[1]
  out, lse = out[:, :tq, :, :d], lse[:, :, :tq]
  return (out, lse, res[2]) if counts else (out, lse)


def _backward(cfg: _Config, q, k, v, q_seg, kv_seg, do, lse, di, counts=False,
              slopes=None):
  """lse (internal convention) and di = sum(do * out, -1) are [b, h, Tq] f32. `cfg` is
  a backward config: its blocks are the dk/dv kernel's, `for_dq()` the dq kernel's.
  With `counts`, also returns the kernels' visit counters (dq's None with dq_atomic).
  slopes: ALiBi's [h] (with cfg.alibi)."""
  if not counts and _mosaic_backward(cfg, q, k):
    mosaic = importlib.import_module("kernels.flash_mosaic_gpu")  # pads for itself
    args = (cfg, q, k, v, do, lse, di, q_seg, kv_seg)
    dk, dv = mosaic.dkv(*args)
    return mosaic.dq(*args), dk, dv
  tq, tk, d = q.shape[1], k.shape[1], q.shape[-1]
  slopes = _slopes_base2(cfg, slopes)
  dq_cfg = cfg if cfg.fused_bwd else cfg.for_dq()  # fused: no dq kernel
  q_multiple = math.lcm(cfg.block_q, dq_cfg.block_q)
  kv_multiple = math.lcm(cfg.block_kv, dq_cfg.block_kv)
  qp, kp, vp, q_seg, kv_seg = _prepare(cfg, q, k, v, q_seg, kv_seg, q_multiple, kv_multiple)
  dop = _prepare_rows(cfg, do, q_multiple)
  lse = _pad_len(lse, 2, q_multiple, jnp.inf)
  di = _pad_len(di, 2, q_multiple)
  dq_counts = None
  if cfg.backend == "tpu":
    args, lse2 = (qp, kp, vp, q_seg, kv_seg, dop), lse * LOG2E
    dkv_out = _tpu_dkv(cfg, *args, _tpu_stats(lse2, di, kv_major=True), counts, slopes)
    dk, dv = (jnp.swapaxes(x, 1, 2) for x in dkv_out[:2])
    if cfg.fused_bwd:
      dq = jnp.swapaxes(_fused_dq(cfg, dkv_out[2], q_seg, kv_seg), 1, 2).astype(q.dtype)
    else:
      dq_out = _tpu_dq(dq_cfg, *args, _tpu_stats(lse2, di), counts, slopes)
      dq = jnp.swapaxes(dq_out[0], 1, 2)
      dq_counts = dq_out[1][..., 0, :2] if counts else None
    if counts:
      dkv_counts = dkv_out[-1][..., 0, :2]
  else:
    args = (qp, kp, vp, q_seg, kv_seg, dop, lse * LOG2E, di, counts)
    dkv_out = _gpu_dkv(cfg, *args, slopes)
    dk, dv = dkv_out[:2]
    if cfg.dq_atomic:
      dq = dkv_out[2].astype(q.dtype)
    else:
      dq_out = _gpu_dq(dq_cfg, *args, slopes)
      dq = dq_out[0]
      dq_counts = dq_out[1] if counts else None
    dkv_counts = dkv_out[-1] if counts else None
  grads = dq[:, :tq, :, :d], dk[:, :tk, :, :d], dv[:, :tk, :, :d]
  return (grads, (dq_counts, dkv_counts)) if counts else grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, q_seg, kv_seg, sinks, slopes, cfg):
  return _flash_fwd(q, k, v, q_seg, kv_seg, sinks, slopes, cfg)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, sinks, slopes, cfg):
  out, lse = _forward(cfg, q, k, v, q_seg, kv_seg, slopes=slopes)
  if sinks is not None:  # the backward kernels then read the lse and output with them
    out, lse = reference.add_sinks(out, public_lse(lse), sinks)
    lse = internal_lse(lse)
  return out, (q, k, v, q_seg, kv_seg, sinks, slopes, out, lse)


def _flash_bwd(cfg, res, do):
  q, k, v, q_seg, kv_seg, sinks, slopes, out, lse = res
  di = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))
  dq, dk, dv = _backward(cfg.for_backward(), q, k, v, q_seg, kv_seg, do.astype(q.dtype),
                         lse, di, slopes=slopes)
  dsinks = (None if sinks is None else
            reference.sinks_grad(sinks, public_lse(lse), jnp.swapaxes(di, 1, 2)))
  return dq, dk, dv, None, None, dsinks, None  # ALiBi's slopes are constants


_flash.defvjp(_flash_fwd, _flash_bwd)


def default_backend() -> str:
  """Kernel family for the target platform: 'gpu' on GPUs, 'tpu' elsewhere."""
  return "gpu" if target_platform() in ("gpu", "cuda", "rocm") else "tpu"


def supported_inputs(backend: str, *xs):
  """TPUs have no float16 vectors (Mosaic refuses the loads): there float16 inputs run
  in float32."""
  if backend == "tpu" and any(x.dtype == jnp.float16 for x in xs):
    return tuple(x.astype(jnp.float32) for x in xs)
  return xs


def make_config(q, k, *, causal=True, segments=False, sm_scale=None, q_offset=None,
                logits_soft_cap=None, sliding_window=None, backend=None, block_q=None,
                block_kv=None, block_q_bwd=None, block_kv_bwd=None, block_q_dq=None,
                block_kv_dq=None, dq_atomic=False, fused_bwd=False, compact_grid=None,
                gpu_forward=None, gpu_backward=None, num_warps=None, num_stages=None,
                num_warps_bwd=None, num_stages_bwd=None, interpret=None,
                alibi=False) -> _Config:
  """Validates the tuning options and freezes them with the shapes into a config.
  `q_offset`: the position of q's first token counted from kv's first (default kv_len -
  q_len, the contract's), for blocks cut from a longer sequence (ring attention).
  `alibi`: the kernels take ALiBi's slopes (`_forward` / `_backward`'s `slopes`)."""
  backend = default_backend() if backend is None else backend
  if backend not in DEFAULT_BLOCKS:
    raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
  platform = target_platform()
  if interpret is None:
    interpret = platform not in ("tpu", "gpu", "cuda", "rocm")
  # (A CPU host may still lower either family for another platform, ahead of time.)
  family = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform)
  if not interpret and family is not None and family != backend:
    raise ValueError(f"backend {backend!r} kernels cannot be compiled on a {platform} "
                     f"device; pass interpret=True to emulate them")
  q_len, kv_len = q.shape[1], k.shape[1]
  # Blocks never exceed the (padded) sequence: short inputs use one block.
  minimum = NUM_LANES if backend == "tpu" else 16
  fit = lambda block, n: min(block, max(minimum, pl.cdiv(n, minimum) * minimum))
  # Explicit forward blocks also apply to the backward pass unless it has its own, and
  # the backward blocks to the dq kernel unless it has its own.
  given = (block_q, block_kv, block_q if block_q_bwd is None else block_q_bwd,
           block_kv if block_kv_bwd is None else block_kv_bwd)
  names = ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "block_q_dq",
           "block_kv_dq")
  defaults = DEFAULT_BLOCKS[backend]
  if backend == "tpu" and q.dtype.itemsize <= 2 and q.shape[-1] <= 128:
    defaults = TPU_BLOCKS_16BIT
  blocks = []
  for name, block, default, n in zip(names, given, defaults, (q_len, kv_len) * 2):
    blocks.append(fit(default, n) if block is None else block)
  blocks += [blocks[2] if block_q_dq is None else block_q_dq,
             blocks[3] if block_kv_dq is None else block_kv_dq]
  for name, block in zip(names, blocks):
    if int(block) != block or block < 1 or block % minimum:
      raise ValueError(
          f"{name} must be a positive multiple of {minimum} for the {backend} kernel, "
          f"got {block}")
  blocks = [int(block) for block in blocks]
  if dq_atomic and backend != "gpu":
    raise ValueError("dq_atomic is an option of the gpu (Triton) kernels; the tpu "
                     "kernels' counterpart is fused_bwd")
  if gpu_forward not in (None, "mosaic", "triton"):
    raise ValueError(f"gpu_forward must be 'mosaic', 'triton' or None, got {gpu_forward!r}")
  if gpu_backward not in (None, "mosaic", "triton"):
    raise ValueError(
        f"gpu_backward must be 'mosaic', 'triton' or None, got {gpu_backward!r}")
  for name, value in (("gpu_forward", gpu_forward), ("gpu_backward", gpu_backward)):
    if value is not None and backend != "gpu":
      raise ValueError(f"{name} is an option of the gpu kernels")
    if value == "mosaic" and alibi:
      raise ValueError(f"{name}='mosaic' has no ALiBi (alibi_slopes): use 'triton' or None")
  if fused_bwd and backend != "tpu":
    raise ValueError("fused_bwd is an option of the tpu (Mosaic) kernels; the gpu "
                     "kernels' counterpart is dq_atomic")
  # Launch options are per direction (unlike blocks): the best forward and backward
  # options differ, and carrying one over slowed the backward kernels 2x.
  launch = dict(num_warps=num_warps, num_stages=num_stages, num_warps_bwd=num_warps_bwd,
                num_stages_bwd=num_stages_bwd)
  defaults = dict(zip(launch, DEFAULT_GPU_LAUNCH["fwd"] + DEFAULT_GPU_LAUNCH["bwd"]))
  for name, value in launch.items():
    if value is not None and (int(value) != value or value < 1):
      raise ValueError(f"{name} must be a positive integer, got {value}")
    launch[name] = defaults[name] if value is None else int(value)
  return _Config(
      backend=backend, interpret=interpret, q_len=q_len, kv_len=kv_len,
      block_q=blocks[0], block_kv=blocks[1], block_q_bwd=blocks[2],
      block_kv_bwd=blocks[3], block_q_dq=blocks[4], block_kv_dq=blocks[5],
      dq_atomic=bool(dq_atomic), fused_bwd=bool(fused_bwd),
      q_offset=None if q_offset is None else int(q_offset),
      compact_grid=None if compact_grid is None else bool(compact_grid),
      gpu_forward=gpu_forward, gpu_backward=gpu_backward, group=q.shape[2] // k.shape[2],
      causal=bool(causal), sm_scale=reference.default_sm_scale(q.shape[-1], sm_scale),
      logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      sliding_window=None if sliding_window is None else int(sliding_window),
      segments=segments, alibi=bool(alibi), **launch)


def flash_attention(q, k, v, *, causal: bool = True, q_segment_ids=None,
                    kv_segment_ids=None, sm_scale: float | None = None,
                    logits_soft_cap: float | None = None,
                    sliding_window: int | None = None, backend: str | None = None,
                    block_q: int | None = None, block_kv: int | None = None,
                    block_q_bwd: int | None = None, block_kv_bwd: int | None = None,
                    block_q_dq: int | None = None, block_kv_dq: int | None = None,
                    dq_atomic: bool = False, fused_bwd: bool = False,
                    compact_grid: bool | None = None, gpu_forward: str | None = None,
                    gpu_backward: str | None = None, num_warps: int | None = None,
                    num_stages: int | None = None,
                    num_warps_bwd: int | None = None, num_stages_bwd: int | None = None,
                    interpret=None, sinks=None, alibi_slopes=None):
  """Flash attention with Pallas kernels for the forward and backward passes.

  Args:
    q: [batch, q_len, heads, head_dim].
    k, v: [batch, kv_len, kv_heads, head_dim]; heads % kv_heads == 0.
    causal, q_segment_ids, kv_segment_ids, sm_scale, logits_soft_cap, sliding_window:
      as in `kernels.reference_attention`.
    backend: kernel family, 'tpu' (Mosaic) or 'gpu' (Triton); default from the platform.
    block_q, block_kv: forward block sizes (default on TPU 1024 for 16-bit inputs with
      head_dim <= 128, else 512; 128 x 64 on GPU; capped at the padded length);
      multiples of 128 on TPU and 16 on GPU. Lengths need not be multiples of them.
    block_q_bwd, block_kv_bwd: the same for the backward kernels (default: the forward
      blocks if given, else the TPU default above and 64 on GPU).
    block_q_dq, block_kv_dq: the dq kernel's own blocks (default: the backward blocks,
      which then set only the dk / dv kernel's). The dk / dv kernel holds a kv block
      and steps over q blocks, the dq kernel the reverse, so their best shapes differ.
    dq_atomic: GPU only. The dk / dv kernel also adds each step's ds @ k to an f32 dq
      with atomic adds, and no dq kernel runs: the backward computes 5 block matmuls
      instead of 7. Summation order then varies from run to run (not bitwise
      deterministic).
    fused_bwd: TPU only. The dk / dv kernel also computes each step's ds @ k and writes
      it to a float32 buffer of one dq per kv block ([kv blocks, batch, heads, q_len,
      head_dim]), which XLA sums; no dq kernel runs, so the backward computes 5 block
      matmuls instead of 7 and the softmax once instead of twice. Costs that buffer's
      memory and HBM traffic, which grow with kv_len / block_kv_bwd: best at short and
      medium lengths. Deterministic.
    compact_grid: TPU only. With a causal or sliding-window mask, True makes the
      kernels' grids step through the visible block pairs only (a table in SMEM), not
      through every pair with the hidden ones skipped; False keeps the rectangle. A
      skipped step still costs the step overhead, which over a long sliding-window row
      is most of the work, but a compact step's overhead is larger. None (default):
      compact where it drops most of the rectangle's steps (long windows), not for a
      causal triangle.
    gpu_forward: GPU only. 'mosaic': the forward runs the Hopper kernel of
      `kernels.flash_mosaic_gpu` (Pallas Mosaic GPU: wgmma, TMA, warp-specialised
      producer and two consumer warpgroups); it takes 16-bit inputs with a head_dim
      that is a multiple of 64 up to 256. 'triton': the Triton kernel. None (default):
      Mosaic on an sm_90 device for the calls it takes without segment ids, else
      Triton. The Triton launch options (`num_warps`, `num_stages`, blocks) apply to
      Triton only.
    gpu_backward: GPU only. 'mosaic': the backward runs the Hopper kernels of
      `kernels.flash_mosaic_gpu`: dk / dv (kv-major wgmma steps over streamed q tiles,
      GQA heads summed in registers) and dq (the forward's layout); 16-bit inputs,
      head_dim a multiple of 64 up to 128, no `dq_atomic`; on an H200 1.1-1.2x
      faster than the Triton ones. 'triton' or None (default): the Triton kernels.
      Interpret mode runs the Triton kernels whatever `gpu_forward` and
      `gpu_backward` say.
    num_warps, num_stages: Triton launch options of the GPU forward kernel (default 8
      warps for head_dim > 64, else 4; 3 pipeline stages); ignored by the TPU family.
    num_warps_bwd, num_stages_bwd: the same for the backward kernels (default 4 warps,
      2 stages; independent of the forward options).
    interpret: run in Pallas interpret mode; None = only when not on TPU / GPU.
    sinks: optional float [heads] attention-sink logits, as in
      `kernels.reference_attention`: applied to the kernels' output and log-sum-exp, which
      the backward kernels then read unchanged; their gradient comes from the lse.
    alibi_slopes: optional float [heads], ALiBi's slopes, as in
      `kernels.reference_attention`: every kernel adds the bias to each visited block
      (no gradient for the slopes). The Mosaic GPU kernels have none: with slopes the
      GPU runs Triton, and `gpu_forward` / `gpu_backward` 'mosaic' is refused.

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype; differentiable in q, k, v (and sinks).
  """
  reference.check_attention_inputs(
      q, k, v, q_segment_ids, kv_segment_ids, sm_scale=sm_scale,
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, sinks=sinks,
      alibi_slopes=alibi_slopes)
  out_dtype = q.dtype
  q, k, v = supported_inputs(default_backend() if backend is None else backend, q, k, v)
  cfg = make_config(q, k, causal=causal, segments=q_segment_ids is not None,
                    sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                    sliding_window=sliding_window, backend=backend, block_q=block_q,
                    block_kv=block_kv, block_q_bwd=block_q_bwd, block_kv_bwd=block_kv_bwd,
                    block_q_dq=block_q_dq, block_kv_dq=block_kv_dq, dq_atomic=dq_atomic,
                    fused_bwd=fused_bwd, compact_grid=compact_grid,
                    gpu_forward=gpu_forward, gpu_backward=gpu_backward,
                    num_warps=num_warps,
                    num_stages=num_stages,
                    num_warps_bwd=num_warps_bwd, num_stages_bwd=num_stages_bwd,
                    interpret=interpret, alibi=alibi_slopes is not None)
  return _flash(q, k, v, q_segment_ids, kv_segment_ids, sinks, alibi_slopes,
                cfg).astype(out_dtype)


def public_lse(lse):
  """Internal lse [b, h, Tq] (+inf = no key) -> public [b, Tq, h] (-inf = no key)."""
  return jnp.swapaxes(jnp.where(lse == jnp.inf, -jnp.inf, lse), 1, 2)


def internal_lse(lse):
  """Inverse of `public_lse`."""
  lse = jnp.swapaxes(lse, 1, 2)
  return jnp.where(lse == -jnp.inf, jnp.inf, lse)
