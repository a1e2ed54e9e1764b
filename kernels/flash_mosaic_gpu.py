"""Flash attention kernels for NVIDIA Hopper (sm_90) in Pallas Mosaic GPU: the forward
(what `kernels.flash_attention` runs on Hopper by default) and the backward's dq and
dk / dv kernels (`gpu_backward='mosaic'`).

Forward: one CTA per (head, pair of 64-row q tiles, batch) runs three warpgroups:

* two consumer warpgroups, one q tile each: S = Q K^T and O += P V on the tensor cores
  with wgmma, the online softmax in base 2 in registers. A shared "schedule" barrier
  makes them take turns, so one warpgroup's softmax overlaps the other's matmuls;
* one producer warpgroup that streams K and V blocks into a ring of shared-memory
  slots with the TMA engine, each slot guarded by a "loaded" barrier (TMA arrives)
  and a "consumed" barrier (both consumers arrive).

The producer streams the union of the two tiles' visible kv blocks (causal or
sliding-window masks skip the rest). A consumer runs every step of that union so the
barrier phases stay in step: blocks its own tile cannot see are skipped without
compute, fully visible blocks run without the element mask, and the others are
masked. Masked logits are -inf while the running max starts finite, so a row that
sees no key at all ends with l = 0, output 0 and lse = +inf (no NaN).

Same masking contract as `kernels.flash_attention` (causal, sliding window, soft cap,
GQA, q shorter or longer than kv, any lengths, `q_offset`, segment ids). With segment
ids each tile's kv range is narrowed by `segment_block_ranges` (a table the kernel
reads from global memory), the producer also streams each kv block's ids (one more
barrier per slot, tied to the V slot's release), and each consumer keeps its tile's
q ids. Returns the output and the internal log-sum-exp [b, h, Tq]
(natural log, +inf for rows with no key), which either family's backward consumes.

The backward kernels follow the same plan (a producer streaming one operand family
through a ring of slots, two consumers taking turns, every step of the union run by
both), see `dkv` and `dq`. Imports jax only.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import math
import os
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

fa = importlib.import_module("kernels.flash_attention")  # the module, not the function

LOG2E = math.log2(math.e)
TILE_Q = 64  # rows per consumer warpgroup: one wgmma M tile
CONSUMERS = 2
# Start of the running max: finite, so a row that has seen only masked (-inf) logits
# keeps alpha = exp2(m - m) = 1 and p = 0 instead of NaN.
M_INIT = -1e30
SMEM_BYTES = 227 * 1024


def kv_block_and_slots(head_dim: int, itemsize: int = 2) -> tuple[int, int]:
  """(block_kv, ring slots) that fit Hopper's shared memory next to the two q tiles:
  128-key blocks in two slots up to head_dim 128 (the fastest shape on an H200),
  64-key blocks beyond."""
  q_bytes = CONSUMERS * TILE_Q * head_dim * itemsize
  for block_kv, slots in ((128, 2), (64, 2)):
    if q_bytes + 2 * slots * block_kv * head_dim * itemsize + 4096 <= SMEM_BYTES:
      return block_kv, slots
  raise ValueError(f"head_dim {head_dim} does not fit the Mosaic GPU kernel's shared "
                   f"memory")


def unsupported(cfg, q, k) -> str | None:
  """Why the Mosaic GPU forward cannot run this call (None: it can)."""
  if getattr(cfg, "alibi", False):  # every other mask option runs
    return "ALiBi (alibi_slopes; the Triton kernels take it)"
  if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
    return f"dtype {q.dtype} (bfloat16 and float16 only)"
  d = q.shape[-1]
  if d % 64 or d > 256:
    return f"head_dim {d} (a multiple of 64 up to 256 only)"
  try:  # ptxas 12.8 - 12.9.0 miscompiles such kernels (as JAX's own notes)
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
    version = cuda_versions.cuda_runtime_get_version() if cuda_versions else None
  except Exception:  # pylint: disable=broad-except
    version = None
  if version is not None and 12080 <= version < 12091:
    return f"CUDA runtime {version} (ptxas 12.8 - 12.9.0 miscompile)"
  return None


def unsupported_backward(cfg, q, k) -> str | None:
  """Why the Mosaic GPU backward kernels cannot run this call (None: they can)."""
  reason = unsupported(cfg, q, k)
  if reason:
    return reason
  if q.shape[-1] > 128:  # two f32 [64, head_dim] accumulators per thread
    return f"head_dim {q.shape[-1]} (up to 128 in the backward)"
  if cfg.dq_atomic:
    return "dq_atomic (an option of the Triton dk / dv kernel)"
  return None


# Device kinds of the sm_90 parts: H100 (SXM, PCIe, NVL), H200, H800, H20, GH200.
_HOPPER_KIND = re.compile(r"\bG?H(100|200|800|20)\b")


def hopper_kind(device_kind: str) -> bool:
  """Whether a device kind string ('NVIDIA H100 80GB HBM3', ...) names a Hopper GPU."""
  return bool(_HOPPER_KIND.search(device_kind))


def hopper_device() -> bool:
  """True when the target is an sm_90 GPU (wgmma exists on Hopper only): the abstract
  device of the mesh set with `jax.sharding.use_abstract_mesh` (`kernels.gpu_target`:
  lowering ahead of time on a host without the GPU) when it is a GPU, else the default
  device."""
  abstract = importlib.import_module("kernels.attention").target_device()
  if abstract is not None and abstract.platform in ("gpu", "cuda"):
    return hopper_kind(abstract.device_kind)
  try:
    device = jax.devices()[0]
  except Exception:  # pylint: disable=broad-except
    return False
  return (device.platform == "gpu"
          and str(getattr(device, "compute_capability", "")).startswith("9."))


def _tile_config(cfg, block_kv: int):
  return dataclasses.replace(cfg, block_q=TILE_Q, block_kv=block_kv)


def _ranges(cfg, tile, seg=None, kv_major: bool = False, full: bool = True):
  """(visible, fully visible) block ranges of the other axis for a q tile (kv_major: a
  kv tile); with segment ids narrowed by `seg`, the tile's row (lo, hi, full_lo,
  full_hi) of `segment_block_ranges` ([0] for q tiles, [1] for kv tiles). With
  `full=False` the visible range alone."""
  block_range, full_range = ((fa.q_block_range, fa.q_full_range) if kv_major
                             else (fa.kv_block_range, fa.kv_full_range))
  visible = block_range(cfg, tile)
  if seg is not None:
    visible = fa._and_range(visible, seg[0], seg[1])  # pylint: disable=protected-access
  if not full:
    return visible
  return visible, (full_range(cfg, tile) if seg is None
                   else full_range(cfg, tile, (seg[2], seg[3])))


def _spans(u_lo, u_hi, lo_hi, full_lo_hi):
  """The union [u_lo, u_hi] cut into (start, stop, kind) runs for one tile: skipped
  blocks before its own range, masked, fully visible, masked, skipped after."""
  lo, hi = lo_hi
  empty = lo > hi
  lo = jnp.where(empty, u_hi + 1, lo)
  hi = jnp.where(empty, u_hi, hi)
  full_lo, full_hi = full_lo_hi
  no_full = full_lo > full_hi
  full_lo = jnp.where(no_full, hi + 1, full_lo)
  full_hi = jnp.where(no_full, hi, full_hi)
  return ((u_lo, lo, "skip"), (lo, full_lo, "masked"), (full_lo, full_hi + 1, "full"),
          (full_hi + 1, hi + 1, "masked"), (hi + 1, u_hi + 1, "skip"))


def _hull(ranges, num_blocks: int):
  """(first block, number of blocks) of the smallest run holding the inclusive
  (lo, hi) ranges (empty ones, lo > hi, count for nothing)."""
  los, his = [], []
  for lo, hi in ranges:
    empty = lo > hi
    los.append(jnp.where(empty, num_blocks, lo))
    his.append(jnp.where(empty, -1, hi))
  u_lo, u_hi = jnp.minimum(*los), jnp.maximum(*his)
  n = jnp.maximum(u_hi - u_lo + 1, 0)
  return jnp.where(n > 0, u_lo, 0), n


def _union(cfg, first_tile, segment_row=lambda tile: None, kv_major: bool = False):
  """Blocks the producer streams for tiles first_tile and first_tile + 1 (kv blocks
  for q tiles, q blocks for kv tiles with `kv_major`; `segment_row(tile)`: the tile's
  segment row or None): (first block, number of blocks)."""
  tiles = [first_tile + t for t in range(CONSUMERS)]
  return _hull([_ranges(cfg, t, segment_row(t), kv_major, full=False) for t in tiles],
               cfg.num_q_blocks if kv_major else cfg.num_kv_blocks)


def _segment_row(cfg, table_ref, batch, tile):
  """A tile's (lo, hi, full_lo, full_hi) row of the segment block-range table, read
  from global memory; None without segment ids."""
  if not cfg.segments:
    return None
  return tuple(table_ref[batch, tile, j] for j in range(4))


def _take_turn(schedule):
  """Arrive at and wait on the barrier the two consumer warpgroups take turns on."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  plgpu.barrier_arrive(schedule)
  plgpu.barrier_wait(schedule)


def _logits(cfg, s):
  """Raw scores -> (logits to exp2 once multiplied by the returned scale, the capped
  natural logits or None): with a soft cap the scale is log2 e, else sm_scale log2 e."""
  if cfg.logits_soft_cap is None:
    return s, cfg.sm_scale * LOG2E, None
  capped = cfg.logits_soft_cap * jnp.tanh(s * (cfg.sm_scale / cfg.logits_soft_cap))
  return capped, LOG2E, capped


def _mask(cfg, s, q_pos, kv_pos, q_ids=None, kv_ids=None):
  """s with -inf where the mask hides a (query, key) pair; positions and ids are
  arrays broadcast to s's shape, or None."""
  visible = []
  if cfg.kv_len % cfg.block_kv:
    visible.append(kv_pos < cfg.kv_len)
  if cfg.causal:
    visible.append(q_pos >= kv_pos)
  if cfg.sliding_window is not None:
    visible.append(q_pos - kv_pos < cfg.sliding_window)
    if not cfg.causal:
      visible.append(kv_pos - q_pos < cfg.sliding_window)
  if q_ids is not None:
    visible.append((q_ids == kv_ids) & (kv_ids != 0))
  if not visible:
    return s
  return jnp.where(functools.reduce(lambda a, b: a & b, visible), s, -jnp.inf)


def _ds(cfg, p, dp, di, capped):
  """dS (already times sm_scale) from P, dP, the rows' di and the capped logits."""
  ds = p * (dp - di)
  if capped is not None:
    ds = ds * (1.0 - jnp.square(capped * (1.0 / cfg.logits_soft_cap)))
  return ds * cfg.sm_scale


def _scores(a, b, c, d, shape, while_in_flight):
  """(a @ b.T, c @ d.T) in f32 [shape], issued as one wgmma group (b, d transposed in
  shared memory); `while_in_flight` runs before their results are read."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  def body(refs):
    s_ref, dp_ref = refs
    plgpu.wgmma(s_ref, a, b.transpose((1, 0)))
    plgpu.wgmma(dp_ref, c, d.transpose((1, 0)))
    while_in_flight()
    return s_ref[...], dp_ref[...]
  return pl.run_scoped(body, (plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32)))


@functools.cache
def _load_takes_index() -> bool:
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def _load(ref, *, layout):
  """A whole SMEM ref into registers (jax 0.10 wants an empty index, 0.11 deprecates
  passing one)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.load(ref, (), layout=layout) if _load_takes_index() else plgpu.load(
      ref, layout=layout)


def _iota(shape, dim):
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, table_ref, o_ref, lse_ref, scoped,
            *, cfg, block_kv, slots, num_pairs, head_dim):
  """`q_seg_ref`, `kv_seg_ref`, `table_ref` (segment ids and their block ranges) and
  the scratch's id buffers and barriers are None without segment ids."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  (q_smem2, k_smem, v_smem, lse_smem2, q_ids2, kv_ids), \
      (k_loaded, v_loaded, q_loaded, ids_loaded, q_ids_loaded), \
      (k_used, v_used), schedule = scoped
  batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  pair = lax.axis_index("q_seq")
  if cfg.causal:  # the longest rows first, so short ones fill the tail of the launch
    pair = num_pairs - 1 - pair
  first_tile = pair * CONSUMERS
  segment_row = functools.partial(_segment_row, cfg, table_ref, batch)
  u_lo, n = _union(cfg, first_tile, segment_row)
  dtype = q_ref.dtype
  schedule_turn = functools.partial(_take_turn, schedule)

  @pl.when(wg < CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    qo_smem, lse_smem = q_smem2.at[wg], lse_smem2.at[wg]
    tile = first_tile + wg
    q_base = tile * TILE_Q
    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, TILE_Q), head], qo_smem,
                            q_loaded.at[wg])
    plgpu.barrier_wait(q_loaded.at[wg])
    row = plgpu.Layout.WGMMA.reduce(1)
    q_ids = None
    if cfg.segments:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(q_base, TILE_Q)], q_ids2.at[wg],
                              q_ids_loaded.at[wg])
      plgpu.barrier_wait(q_ids_loaded.at[wg])
      q_ids = _load(q_ids2.at[wg], layout=row)
    m = plgpu.layout_cast(jnp.full((TILE_Q,), M_INIT, jnp.float32), row)
    l = plgpu.layout_cast(jnp.full((TILE_Q,), 0.0, jnp.float32), row)
    acc = plgpu.layout_cast(jnp.full((TILE_Q, head_dim), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA)

    @pl.when(n > 0)
    def _():
      plgpu.barrier_wait(k_loaded.at[0])
    pl.when(wg == 1)(schedule_turn)  # the two consumers take turns from here on

    def slot_of(ki):
      return lax.rem(ki - u_lo, jnp.int32(slots))

    def wait_next(ki):
      @pl.when(ki + 1 < u_lo + n)
      def _():
        plgpu.barrier_wait(k_loaded.at[slot_of(ki + 1)])

    def wait_ids(slot):  # every step waits, so the barrier phases stay in step
      if cfg.segments:
        plgpu.barrier_wait(ids_loaded.at[slot])

    def skip(ki, carry):
      slot = slot_of(ki)
      schedule_turn()
      plgpu.barrier_arrive(k_used.at[slot])
      wait_ids(slot)
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_wait(schedule)
      wait_next(ki)
      plgpu.barrier_arrive(v_used.at[slot])
      return carry

    def step(ki, carry, masked: bool):
      acc, m, l = carry
      slot = slot_of(ki)

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
        schedule_turn()
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((TILE_Q, block_kv), jnp.float32))
      plgpu.barrier_arrive(k_used.at[slot])
      s, scale, _ = _logits(cfg, s)
      if masked:
        ids = (None, None)
        if cfg.segments:  # the ids the V slot's release frees (read before it)
          plgpu.barrier_wait(ids_loaded.at[slot])
          ids = (lax.broadcast_in_dim(q_ids, s.shape, [0]), lax.broadcast_in_dim(
              _load(kv_ids.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)),
              s.shape, [1]))
        s = _mask(cfg, s, _iota(s.shape, 0) + (q_base + cfg.offset),
                  _iota(s.shape, 1) + ki * block_kv, *ids)
      else:
        wait_ids(slot)
      # Base-2 softmax with m kept in scaled units, so p = exp2(s * scale - m) is an FMA.
      m_next = jnp.maximum(m, s.max(axis=1) * scale)
      alpha = jnp.exp2(m - m_next)
      p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_next, s.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l = l * alpha + p.sum(axis=1)
      p16 = p.astype(dtype)
      acc, l, m_next, p16 = lax.optimization_barrier((acc, l, m_next, p16))
      plgpu.barrier_arrive(schedule)  # softmax done: the other consumer's turn
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_wait(schedule)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
        wait_next(ki)
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_used.at[slot])
      return acc, m_next, l

    spans = _spans(u_lo, u_lo + n - 1, *_ranges(cfg, tile, segment_row(tile)))
    carry = (acc, m, l)
    for start, stop, kind in spans:
      if kind == "skip":
        body = skip
      else:
        body = (lambda ki, c, masked=(kind == "masked"): step(ki, c, masked))
      carry = lax.fori_loop(start, stop, body, carry)
    acc, m, l = carry
    pl.when(wg == 0)(schedule_turn)

    # l >= 1 on any row that saw a key (its max contributes exp2(0)); 0 on a row that
    # saw none, whose acc is 0 too: dividing by max(l, 1) leaves such rows 0.
    inv = 1.0 / jnp.maximum(l, 1.0)
    qo_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
    lse_smem[...] = m + jnp.log(l) * LOG2E  # base 2; -inf where l == 0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[batch, pl.ds(q_base, TILE_Q), head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_base, TILE_Q)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == CONSUMERS)
  def _producer():
    _stream_kv(cfg, k_ref, v_ref, kv_seg_ref, (k_smem, v_smem, kv_ids),
               (k_loaded, v_loaded, ids_loaded), (k_used, v_used), batch, head, u_lo, n)


def _stream_kv(cfg, k_ref, v_ref, kv_seg_ref, buffers, loaded, used, batch, head, u_lo, n):
  """The producer warpgroup of the forward and dq kernels: streams kv blocks u_lo ..
  u_lo + n - 1 (K, V and with segment ids the keys' ids) of `head`'s kv head into the
  ring of slots, each refilled once both consumers have released it. A block's ids
  travel with its V, which consumers release after reading both."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  plgpu.set_max_registers(40, action="decrease")
  (k_smem, v_smem, kv_ids), (k_loaded, v_loaded, ids_loaded), (k_used, v_used) = \
      buffers, loaded, used
  slots, block_kv = k_smem.shape[0], k_smem.shape[1]
  kv_head = lax.div(head, jnp.int32(cfg.group))

  def load_k(ki, slot):
    rows = (batch, pl.ds(ki * block_kv, block_kv), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])

  def load_v(ki, slot):
    rows = (batch, pl.ds(ki * block_kv, block_kv), kv_head)
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])
    if cfg.segments:
      plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, pl.ds(ki * block_kv, block_kv)],
                              kv_ids.at[slot], ids_loaded.at[slot])

  for i in range(slots):
    @pl.when(i < n)
    def _(i=i):
      load_k(u_lo + i, i)
      load_v(u_lo + i, i)

  @pl.loop(0, jnp.maximum(n - slots, 0))
  def _(j):
    slot = lax.rem(j, jnp.int32(slots))
    ki = u_lo + j + slots
    plgpu.barrier_wait(k_used.at[slot])
    load_k(ki, slot)
    plgpu.barrier_wait(v_used.at[slot])
    load_v(ki, slot)


KERNEL_PREFIX = "flash_attention_"  # this module's kernel (and MLIR module) names
BASENAME = "mosaic_gpu.dump_basename"


def stable_basename(module) -> bool:
  """Names one of this module's lowered MLIR modules by its contents, not by a counter.

  jax 0.11's Mosaic GPU lowering tags each module with a fresh `mosaic_gpu.dump_basename`
  (entry_0, entry_1, ...). The compiled-kernel cache is keyed by a hash of the whole
  module, so the same kernel at another call site (each layer of a model, the remat
  recomputation, the reference pass) hashes differently and is compiled again: a
  4-layer GRPO step held 12 distinct hashes for 3 kernels, and a 16-layer 1.2B step on
  an H200 was still compiling after minutes. Deriving the name from the contents keeps it unique
  per kernel, so dumps still get one file per kernel. Returns whether it renamed:
  modules not of this file, and runs that dump (MOSAIC_GPU_DUMP_* set), keep theirs."""
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  attrs = module.operation.attributes
  if "sym_name" not in attrs or BASENAME not in attrs:
    return False
  name = ir.StringAttr(attrs["sym_name"]).value
  if (not name.startswith(KERNEL_PREFIX)
      or any(key.startswith("MOSAIC_GPU_DUMP") for key in os.environ)):
    return False
  with module.context:
    del attrs[BASENAME]
    digest = hashlib.sha256(module.operation.get_asm(binary=True)).hexdigest()[:16]
    attrs[BASENAME] = ir.StringAttr.get(f"{name}_{digest}")
  return True


@functools.cache
def stable_kernel_names() -> None:
  """Applies `stable_basename` to every module the Mosaic GPU lowering finishes (once
  per process; a no-op on jax versions without the counter)."""
  try:
    from jax.experimental.mosaic.gpu import core  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  lower = getattr(core, "lower_mgpu_module", None)
  if lower is None:
    return

  @functools.wraps(lower)
  def lower_then_rename(module, *args, **kwargs):
    result = lower(module, *args, **kwargs)
    stable_basename(module)
    return result
  core.lower_mgpu_module = lower_then_rename


def _launch(entry, out_type, grid, tiles_axis: str, operands):
  """Runs `entry` on a (heads, tiles, batch) grid of CTAs of three warpgroups ("wg")."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  stable_kernel_names()
  return plgpu.kernel(
      entry, out_type=out_type, grid=grid, grid_names=("heads", tiles_axis, "batch"),
      num_threads=CONSUMERS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*operands)


def forward(cfg, q, k, v, q_seg=None, kv_seg=None):
  """q [b, Tq, h, d], k / v [b, Tk, kvh, d] (any lengths), with `cfg.segments` also
  q_seg [b, Tq], kv_seg [b, Tk] int ids (0 = padding) -> (out [b, Tq, h, d],
  internal lse [b, h, Tq]: natural log, +inf for rows that see no key).

  `cfg` is the flash `_Config` (its blocks are ignored: the kernel tiles q by 64 rows
  per warpgroup and picks its kv block by head_dim). Runs on a GPU only (the Mosaic
  GPU interpreter of jax 0.10 lacks wgmma accumulators, layouts and transposed refs;
  that of jax 0.11 cannot lower the wgmma pipeline effect)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  b, tq, h, d = q.shape
  block_kv, slots = kv_block_and_slots(d, q.dtype.itemsize)
  cfg = _tile_config(cfg, block_kv)
  pair_rows = CONSUMERS * TILE_Q
  qp = fa._pad_len(q, 1, pair_rows)  # pylint: disable=protected-access
  kp = fa._pad_len(k, 1, block_kv)  # pylint: disable=protected-access
  vp = fa._pad_len(v, 1, block_kv)  # pylint: disable=protected-access
  num_pairs = qp.shape[1] // pair_rows
  dtype = q.dtype
  operands = [qp, kp, vp]
  if cfg.segments:
    q_seg = fa._pad_len(q_seg.astype(jnp.int32), 1, pair_rows)  # pylint: disable=protected-access
    kv_seg = fa._pad_len(kv_seg.astype(jnp.int32), 1, block_kv)  # pylint: disable=protected-access
    table = fa.segment_block_ranges(q_seg, kv_seg, TILE_Q, block_kv)[0]
    operands += [q_seg, kv_seg, table]

  def flash_attention_fwd(*refs):
    q_ref, k_ref, v_ref = refs[:3]
    seg_refs = refs[3:6] if cfg.segments else (None, None, None)
    o_ref, lse_ref = refs[-2:]
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda shape: plgpu.SMEM(shape, dtype, transforms=transforms)  # noqa: E731
    ids = lambda shape: plgpu.SMEM(shape, jnp.int32) if cfg.segments else None  # noqa: E731
    ids_barrier = (lambda n: plgpu.Barrier(num_barriers=n)  # noqa: E731
                   if cfg.segments else None)
    scratch = [smem((CONSUMERS, TILE_Q, d)), smem((slots, block_kv, d)),
               smem((slots, block_kv, d)), plgpu.SMEM((CONSUMERS, TILE_Q), jnp.float32),
               ids((CONSUMERS, TILE_Q)), ids((slots, block_kv))]
    pl.run_scoped(
        lambda *scoped: _kernel(q_ref, k_ref, v_ref, *seg_refs, o_ref, lse_ref, scoped,
                                cfg=cfg, block_kv=block_kv, slots=slots,
                                num_pairs=num_pairs, head_dim=d),
        scratch,
        (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
         plgpu.Barrier(num_barriers=CONSUMERS), ids_barrier(slots),
         ids_barrier(CONSUMERS)),
        (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),) * 2,
        plgpu.Barrier(num_arrivals=CONSUMERS),
        collective_axes="wg",
    )

  out_type = (jax.ShapeDtypeStruct(qp.shape, dtype),
              jax.ShapeDtypeStruct((b, h, qp.shape[1]), jnp.float32))
  out, lse2 = _launch(flash_attention_fwd, out_type, (h, num_pairs, b), "q_seq", operands)
  lse2 = lse2[:, :, :tq]
  lse = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2 * (1.0 / LOG2E))
  return out[:, :tq], lse


# ----------------------------------------------------------------------------------
# dk / dv. One CTA per (kv head, pair of 64-row kv tiles, batch): each consumer holds
# its kv tile's K and V (and key ids) in shared memory and steps over the q tiles that
# see it, for every query head of its group (GQA sums in registers); the producer
# streams q, dO, the rows' lse and di (and query ids). Per step, kv-major as the Triton
# kernel: S^T = K Q^T and dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q, each pair
# one wgmma group.

TILE_Q_BWD = 64  # q rows per streamed step


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_seg_ref, kv_seg_ref,
                table_ref, dk_ref, dv_ref, scoped, *, cfg, head_dim):
  """Segment refs, id buffers and their barriers are None without segment ids."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  (k_smem2, v_smem2, q_smem, do_smem, lse_smem, di_smem, q_ids, kv_ids2), \
      (q_loaded, do_loaded, lse_loaded, di_loaded, kv_loaded, ids_loaded), used, \
      schedule = scoped
  batch, kv_head, wg = (lax.axis_index("batch"), lax.axis_index("heads"),
                        lax.axis_index("wg"))
  first_tile = lax.axis_index("kv_seq") * CONSUMERS
  segment_row = functools.partial(_segment_row, cfg, table_ref, batch)
  u_lo, n = _union(cfg, first_tile, segment_row, kv_major=True)
  slots = q_smem.shape[0]
  bq, bk = cfg.block_q, cfg.block_kv
  group = cfg.group
  dtype = q_ref.dtype
  schedule_turn = functools.partial(_take_turn, schedule)

  @pl.when(wg < CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    tile = first_tile + wg
    kv_base = tile * bk
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    rows = (batch, pl.ds(kv_base, bk), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_loaded.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_loaded.at[CONSUMERS + wg])
    plgpu.barrier_wait(kv_loaded.at[wg])
    plgpu.barrier_wait(kv_loaded.at[CONSUMERS + wg])
    key_ids = None
    if cfg.segments:  # one id per key: a row of S^T
      plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, pl.ds(kv_base, bk)], kv_ids2.at[wg],
                              kv_loaded.at[2 * CONSUMERS + wg])
      plgpu.barrier_wait(kv_loaded.at[2 * CONSUMERS + wg])
      key_ids = _load(kv_ids2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    zeros = plgpu.layout_cast(jnp.full((bk, head_dim), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA)
    col = plgpu.Layout.WGMMA.reduce(0)  # one value per query (a column of S^T)
    pl.when(wg == 1)(schedule_turn)

    def slot_of(step):
      return lax.rem(step, jnp.int32(slots))

    def wait_rows(slot):  # every step waits, so the barrier phases stay in step
      plgpu.barrier_wait(lse_loaded.at[slot])
      plgpu.barrier_wait(di_loaded.at[slot])
      if cfg.segments:
        plgpu.barrier_wait(ids_loaded.at[slot])

    def skip(step):
      slot = slot_of(step)
      plgpu.barrier_wait(q_loaded.at[slot])
      plgpu.barrier_wait(do_loaded.at[slot])
      schedule_turn()
      wait_rows(slot)
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)
      plgpu.barrier_arrive(used.at[slot])

    def compute(step, qi, carry, masked: bool):
      dk, dv = carry
      slot = slot_of(step)
      plgpu.barrier_wait(q_loaded.at[slot])
      plgpu.barrier_wait(do_loaded.at[slot])

      s, dp = _scores(k_smem, q_smem.at[slot], v_smem, do_smem.at[slot], (bk, bq),
                      schedule_turn)
      wait_rows(slot)

      def per_query(ref):  # [bq] row statistics broadcast over the tile's keys
        return lax.broadcast_in_dim(_load(ref.at[slot], layout=col), s.shape, [1])
      s, scale, capped = _logits(cfg, s)
      if masked:
        ids = (None, None)
        if cfg.segments:
          ids = (per_query(q_ids), lax.broadcast_in_dim(key_ids, s.shape, [0]))
        s = _mask(cfg, s, _iota(s.shape, 1) + (qi * bq + cfg.offset),
                  _iota(s.shape, 0) + kv_base, *ids)
      p = jnp.exp2(s * scale - per_query(lse_smem))  # padding rows: lse +inf, p = 0
      ds = _ds(cfg, p, dp, per_query(di_smem), capped)
      p16, ds16 = p.astype(dtype), ds.astype(dtype)
      dk, dv, p16, ds16 = lax.optimization_barrier((dk, dv, p16, ds16))
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

      def grads(refs):
        dv_ref, dk_ref = refs
        plgpu.wgmma(dv_ref, p16, do_smem.at[slot])
        plgpu.wgmma(dk_ref, ds16, q_smem.at[slot])
      dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
      plgpu.barrier_arrive(used.at[slot])
      return dk, dv

    lo_hi, full = _ranges(cfg, tile, segment_row(tile), kv_major=True)
    spans = _spans(u_lo, u_lo + n - 1, lo_hi, full)

    def head(gi, carry):
      base = gi * n - u_lo  # step of (gi, qi) = base + qi
      for start, stop, kind in spans:
        if kind == "skip":
          def body(qi, c):
            skip(base + qi)
            return c
        else:
          def body(qi, c, masked=(kind == "masked")):
            return compute(base + qi, qi, c, masked)
        carry = lax.fori_loop(start, stop, body, carry)
      return carry
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    pl.when(wg == 0)(schedule_turn)

    k_smem[...] = dk.astype(dtype)  # K and V are done with: their buffers stage dk, dv
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == CONSUMERS)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")

    def load(step, slot):
      gi = lax.div(step, jnp.maximum(n, 1))
      qi = u_lo + step - gi * n
      head = kv_head * group + gi
      rows = (batch, pl.ds(qi * bq, bq), head)
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_loaded.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_loaded.at[slot])
      cols = (batch, head, pl.ds(qi * bq, bq))
      plgpu.copy_gmem_to_smem(lse_ref.at[cols], lse_smem.at[slot], lse_loaded.at[slot])
      plgpu.copy_gmem_to_smem(di_ref.at[cols], di_smem.at[slot], di_loaded.at[slot])
      if cfg.segments:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(qi * bq, bq)], q_ids.at[slot],
                                ids_loaded.at[slot])

    total = n * group
    for i in range(slots):
      pl.when(i < total)(lambda i=i: load(jnp.int32(i), i))

    @pl.loop(0, jnp.maximum(total - slots, 0))
    def _(j):
      slot = lax.rem(j, jnp.int32(slots))
      plgpu.barrier_wait(used.at[slot])
      load(j + slots, slot)


def dkv(cfg, q, k, v, do, lse, di, q_seg=None, kv_seg=None):
  """dk, dv of flash attention on Hopper. q, do [b, Tq, h, d], k, v [b, Tk, kvh, d]
  (any lengths), lse (internal: natural log, +inf for rows that see no key) and
  di = sum(do * out, -1) [b, h, Tq] f32, with `cfg.segments` q_seg [b, Tq] and
  kv_seg [b, Tk] -> dk, dv [b, Tk, kvh, d] in k's dtype. `cfg` as for `forward`."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  b, tq, h, d = q.shape
  tk, kvh = k.shape[1], k.shape[2]
  cfg = dataclasses.replace(cfg, block_q=TILE_Q_BWD, block_kv=TILE_Q)
  pair_rows = CONSUMERS * TILE_Q
  pad = fa._pad_len  # pylint: disable=protected-access
  qp, dop = pad(q, 1, TILE_Q_BWD), pad(do.astype(q.dtype), 1, TILE_Q_BWD)
  kp, vp = pad(k, 1, pair_rows), pad(v, 1, pair_rows)
  lse2 = pad(lse * LOG2E, 2, TILE_Q_BWD, jnp.inf)
  dip = pad(di, 2, TILE_Q_BWD)
  num_pairs = kp.shape[1] // pair_rows
  slots = 2
  dtype = q.dtype
  operands = [qp, kp, vp, dop, lse2, dip]
  if cfg.segments:
    q_seg = pad(q_seg.astype(jnp.int32), 1, TILE_Q_BWD)
    kv_seg = pad(kv_seg.astype(jnp.int32), 1, pair_rows)
    operands += [q_seg, kv_seg,
                 fa.segment_block_ranges(q_seg, kv_seg, TILE_Q_BWD, TILE_Q)[1]]

  def flash_attention_dkv(*refs):
    seg_refs = refs[6:9] if cfg.segments else (None, None, None)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda shape: plgpu.SMEM(shape, dtype, transforms=transforms)  # noqa: E731
    rows = lambda: plgpu.SMEM((slots, TILE_Q_BWD), jnp.float32)  # noqa: E731
    ids = lambda shape: plgpu.SMEM(shape, jnp.int32) if cfg.segments else None  # noqa: E731
    scratch = [smem((CONSUMERS, TILE_Q, d)), smem((CONSUMERS, TILE_Q, d)),
               smem((slots, TILE_Q_BWD, d)), smem((slots, TILE_Q_BWD, d)), rows(), rows(),
               ids((slots, TILE_Q_BWD)), ids((CONSUMERS, TILE_Q))]
    loaded = tuple(plgpu.Barrier(num_barriers=slots) for _ in range(4))
    pl.run_scoped(
        lambda *scoped: _dkv_kernel(*refs[:6], *seg_refs, *refs[-2:], scoped, cfg=cfg,
                                    head_dim=d),
        scratch,
        loaded + (plgpu.Barrier(num_barriers=3 * CONSUMERS),
                  plgpu.Barrier(num_barriers=slots) if cfg.segments else None),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),
        plgpu.Barrier(num_arrivals=CONSUMERS),
        collective_axes="wg",
    )

  out_type = (jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype))
  dk, dv = _launch(flash_attention_dkv, out_type, (kvh, num_pairs, b), "kv_seq", operands)
  return dk[:, :tk], dv[:, :tk]


# ----------------------------------------------------------------------------------
# dq. The forward's layout: one CTA per (head, pair of 64-row q tiles, batch); each
# consumer keeps its tile's q, dO, lse, di (and ids) and steps over the visible kv
# blocks the producer streams: S = Q K^T and dP = dO V^T, then dQ += dS K.

BLOCK_KV_DQ = 64  # keys per streamed step: S, dP and dQ fit the registers at 64


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_seg_ref, kv_seg_ref,
               table_ref, dq_ref, scoped, *, cfg, num_pairs, head_dim):
  """Segment refs, id buffers and their barriers are None without segment ids."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  (q_smem2, do_smem2, lse_smem2, di_smem2, q_ids2, k_smem, v_smem, kv_ids), \
      (k_loaded, v_loaded, ids_loaded, tile_loaded), (k_used, v_used), schedule = scoped
  batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  pair = lax.axis_index("q_seq")
  if cfg.causal:  # the longest rows first
    pair = num_pairs - 1 - pair
  first_tile = pair * CONSUMERS
  segment_row = functools.partial(_segment_row, cfg, table_ref, batch)
  u_lo, n = _union(cfg, first_tile, segment_row)
  slots, bk = k_smem.shape[0], cfg.block_kv
  dtype = q_ref.dtype
  schedule_turn = functools.partial(_take_turn, schedule)

  @pl.when(wg < CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    tile = first_tile + wg
    q_base = tile * TILE_Q
    rows, cols = (batch, pl.ds(q_base, TILE_Q), head), (batch, head, pl.ds(q_base, TILE_Q))
    loads = [(q_ref.at[rows], q_smem2), (do_ref.at[rows], do_smem2),
             (lse_ref.at[cols], lse_smem2), (di_ref.at[cols], di_smem2)]
    if cfg.segments:
      loads.append((q_seg_ref.at[batch, pl.ds(q_base, TILE_Q)], q_ids2))
    for i, (src, dst) in enumerate(loads):
      plgpu.copy_gmem_to_smem(src, dst.at[wg], tile_loaded.at[i * CONSUMERS + wg])
    for i in range(len(loads)):
      plgpu.barrier_wait(tile_loaded.at[i * CONSUMERS + wg])
    q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
    row = plgpu.Layout.WGMMA.reduce(1)  # one value per query (a row of S)
    per_query = lambda ref: lax.broadcast_in_dim(  # noqa: E731
        _load(ref.at[wg], layout=row), (TILE_Q, bk), [0])
    dq = plgpu.layout_cast(jnp.full((TILE_Q, head_dim), 0.0, jnp.float32),
                           plgpu.Layout.WGMMA)
    pl.when(wg == 1)(schedule_turn)

    def slot_of(ki):
      return lax.rem(ki - u_lo, jnp.int32(slots))

    def wait_ids(slot):  # every step waits, so the barrier phases stay in step
      if cfg.segments:
        plgpu.barrier_wait(ids_loaded.at[slot])

    def skip(ki, carry):
      slot = slot_of(ki)
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      schedule_turn()
      wait_ids(slot)
      plgpu.barrier_arrive(v_used.at[slot])
      schedule_turn()
      plgpu.barrier_arrive(k_used.at[slot])
      return carry

    def step(ki, dq, masked: bool):
      slot = slot_of(ki)
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])

      s, dp = _scores(q_smem, k_smem.at[slot], do_smem, v_smem.at[slot], (TILE_Q, bk),
                      schedule_turn)
      wait_ids(slot)
      s, scale, capped = _logits(cfg, s)
      if masked:
        ids = (None, None)
        if cfg.segments:
          ids = (per_query(q_ids2), lax.broadcast_in_dim(
              _load(kv_ids.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)),
              s.shape, [1]))
        s = _mask(cfg, s, _iota(s.shape, 0) + (q_base + cfg.offset),
                  _iota(s.shape, 1) + ki * bk, *ids)
      plgpu.barrier_arrive(v_used.at[slot])  # V and the key ids are done with
      p = jnp.exp2(s * scale - per_query(lse_smem2))  # padding rows: lse +inf, p = 0
      ds16 = _ds(cfg, p, dp, per_query(di_smem2), capped).astype(dtype)
      dq, ds16 = lax.optimization_barrier((dq, ds16))
      schedule_turn()

      def grad(dq_ref):
        plgpu.wgmma(dq_ref, ds16, k_smem.at[slot])
      dq = pl.run_state(grad)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(k_used.at[slot])
      return dq

    spans = _spans(u_lo, u_lo + n - 1, *_ranges(cfg, tile, segment_row(tile)))
    for start, stop, kind in spans:
      body = skip if kind == "skip" else (
          lambda ki, c, masked=(kind == "masked"): step(ki, c, masked))
      dq = lax.fori_loop(start, stop, body, dq)
    pl.when(wg == 0)(schedule_turn)

    q_smem[...] = dq.astype(dtype)  # q is done with: its buffer stages dq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == CONSUMERS)
  def _producer():
    _stream_kv(cfg, k_ref, v_ref, kv_seg_ref, (k_smem, v_smem, kv_ids),
               (k_loaded, v_loaded, ids_loaded), (k_used, v_used), batch, head, u_lo, n)


def dq(cfg, q, k, v, do, lse, di, q_seg=None, kv_seg=None):
  """dq of flash attention on Hopper; arguments as for `dkv` -> dq [b, Tq, h, d] in
  q's dtype."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  b, tq, h, d = q.shape
  cfg = _tile_config(cfg, BLOCK_KV_DQ)
  pair_rows = CONSUMERS * TILE_Q
  pad = fa._pad_len  # pylint: disable=protected-access
  qp, dop = pad(q, 1, pair_rows), pad(do.astype(q.dtype), 1, pair_rows)
  kp, vp = pad(k, 1, BLOCK_KV_DQ), pad(v, 1, BLOCK_KV_DQ)
  operands = [qp, kp, vp, dop, pad(lse * LOG2E, 2, pair_rows, jnp.inf), pad(di, 2, pair_rows)]
  if cfg.segments:
    q_seg = pad(q_seg.astype(jnp.int32), 1, pair_rows)
    kv_seg = pad(kv_seg.astype(jnp.int32), 1, BLOCK_KV_DQ)
    operands += [q_seg, kv_seg,
                 fa.segment_block_ranges(q_seg, kv_seg, TILE_Q, BLOCK_KV_DQ)[0]]
  num_pairs = qp.shape[1] // pair_rows
  slots, dtype = 2, q.dtype

  def flash_attention_dq(*refs):
    seg_refs = refs[6:9] if cfg.segments else (None, None, None)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda shape: plgpu.SMEM(shape, dtype, transforms=transforms)  # noqa: E731
    rows = lambda: plgpu.SMEM((CONSUMERS, TILE_Q), jnp.float32)  # noqa: E731
    ids = lambda shape: plgpu.SMEM(shape, jnp.int32) if cfg.segments else None  # noqa: E731
    scratch = [smem((CONSUMERS, TILE_Q, d)), smem((CONSUMERS, TILE_Q, d)), rows(), rows(),
               ids((CONSUMERS, TILE_Q)), smem((slots, BLOCK_KV_DQ, d)),
               smem((slots, BLOCK_KV_DQ, d)), ids((slots, BLOCK_KV_DQ))]
    pl.run_scoped(
        lambda *scoped: _dq_kernel(*refs[:6], *seg_refs, refs[-1], scoped, cfg=cfg,
                                   num_pairs=num_pairs, head_dim=d),
        scratch,
        (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
         plgpu.Barrier(num_barriers=slots) if cfg.segments else None,
         plgpu.Barrier(num_barriers=5 * CONSUMERS)),
        (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),) * 2,
        plgpu.Barrier(num_arrivals=CONSUMERS),
        collective_axes="wg",
    )

  out = _launch(flash_attention_dq, jax.ShapeDtypeStruct(qp.shape, dtype),
                (h, num_pairs, b), "q_seq", operands)
  return out[:, :tq]
