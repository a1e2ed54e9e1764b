"""Static model of the TPU flash kernels, no TPU needed: compile them for TPU
generations with libtpu on this CPU host and count the bundles of their machine code.

    python -m benchmarks.tpu_static --tpu-python=/path/to/venv/bin/python \
        [--chips=v5e,v6e,v5p] [--arms=default|sweep|BQxBK[/BQxBK/BQxBK][+fused][,...]] \
        [--lengths=4096,16384] [--json FILE]

A TPU core issues one VLIW bundle per cycle, in order and statically scheduled, so the
bundles of a region of libtpu's final schedule are its cycle count, stalls aside. For
each chip and block-size arm, the forward, dq and dk/dv kernels (causal, bf16, head_dim
128, 16 query heads on 4 kv heads) are compiled as flash_attention's forward and
backward call them, with libtpu's bundle dump on (`--tpu-python`: a Python with libtpu,
its own venv; the worker runs there). In each kernel's grid-step loop the `pl.when`
bodies are the regions a branch skips; in source order: init, the unmasked step, the
masked step (the one with more compares and selects: the element mask) and finish. The
rest of the loop is the per-step overhead, what a skipped step costs (index maps, DMA
issue and waits, pipeline bookkeeping). An arm ending in `+fused` runs the fused
backward (`fused_bwd=True`): no dq kernel, a dk/dv kernel with a fifth matmul that
writes an f32 dq block a step, and XLA's sum of those partials, modelled as HBM-bound.

The model of a whole causal kernel sums over its grid: each step pays the overhead; a
visited step its body, or the MXU time of its matmuls if longer (libtpu issues matmuls
faster than an MXU finishes them, even on v4 whose rate is known: the core then waits
on the results), or the HBM time of the blocks it fetches if longer still (the pipeline
fetches them while the previous step computes); each q row (kv row for dk/dv) its init
and finish. The visited and masked counts are exact, from the kernels' own block
ranges. TFLOP/s count the causal half as benchmarks/attention.py does: forward 2
matmuls, forward + backward 7 (the backward 5; the kernels execute 7, dq 3 and dk/dv
4). libtpu's static profile of each kernel (`estimated_cycles`, at the compiled shape)
is printed beside the model; it weights the `pl.when` branches heuristically.

The kernels are compiled on their own with their operands in HBM (XLA's VMEM
memory-space assignment off), as at training sizes: at the compiled shape XLA would
otherwise keep operands in VMEM and drop their DMAs, and the static profile of the
layout transposes around them takes minutes on v6e. This is a static model from one
libtpu build, not a measurement: no stalls beyond the MXU and HBM bounds, no
contention, and v5p's megacore is assumed to split the grid evenly over its two cores.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TensorCore's numbers (jax/_src/pallas/mosaic/tpu_info.py, jax 0.10.2)."""
  topology: str  # a 4-chip description libtpu accepts ("v5e:1x1" does not compile)
  peak: float  # bf16 FLOP/s
  hbm: float  # HBM bytes/s
  mxu_flops: int  # bf16 FLOP a cycle on all MXUs
  cores: int = 1  # TensorCores one device runs a kernel on (megacore)

  @property
  def clock(self) -> float:
    return self.peak / self.mxu_flops


# MXU FLOP per cycle: 4 MXUs of 128 x 128 on v5e / v5p (1.5 and 1.75 GHz). v6e: Google
# documents two 256 x 256 MXUs, which would need 3.5 GHz for 918 TFLOP/s; libtpu's own
# static profile of an 8192^3 bf16 matmul gives 474k FLOP a cycle on v6e (126k on v5e),
# 90% of 524,288, so 524,288 and 1.75 GHz.
CHIPS = {
    "v5e": Chip("v5e:2x2", 1.97e14, 8.20e11, 4 * 128 * 128 * 2),
    "v6e": Chip("v6e:2x2", 9.20e14, 1.64e12, 524288),
    "v5p": Chip("v5p:2x2x1", 4.59e14 / 2, 2.46e12 / 2, 4 * 128 * 128 * 2, cores=2),
}
KERNELS = ("fwd", "dq", "dkv")
MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}  # block matmuls each kernel executes a step
FUSED = "+fused"  # arm suffix: flash_attention(fused_bwd=True), dq from the dk/dv kernel
# Arm suffixes for the grids: flash_attention(compact_grid=False) or (compact_grid=True);
# without either, the default (compact_grid=None) picks per kernel.
RECT, COMPACT = "+rect", "+compact"
SUFFIXES = {FUSED: ("fused_bwd", True), RECT: ("compact_grid", False),
            COMPACT: ("compact_grid", True)}  # suffix: the option it sets
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
TOKENS = 32768  # batch * length, as benchmarks/attention.py times them
COMPILE_BATCH = 2  # even: v5p splits the batch over its two cores
DELAY_SLOTS = 4  # bundles after a branch that run either way, when a dump has no branch
# The model's arms: (block_q, block_kv) of the forward, dk/dv and dq kernels.
SWEEP_BLOCKS = ((256, 256), (256, 512), (512, 256), (512, 512), (512, 1024), (1024, 512),
                (1024, 1024))
_OPTION_NAMES = ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "block_q_dq",
                 "block_kv_dq")


# ----------------------------------------------------------------------------------
# Arms and the block-count model (plain Python on the kernels' range functions).


def _fa():
  return importlib.import_module("kernels.flash_attention")  # the module, not the function


def arm_options(fwd, dkv, dq) -> dict:
  """make_config options of an arm: (block_q, block_kv) of each kernel."""
  return dict(zip(_OPTION_NAMES, (*fwd, *dkv, *dq), strict=True))


def arm_name(options: dict) -> str:
  names = zip(_OPTION_NAMES[::2], _OPTION_NAMES[1::2], strict=True)
  pairs = [f"{options[q]}x{options[k]}" for q, k in names]
  grid = {None: "", False: RECT, True: COMPACT}[options.get("compact_grid")]
  if options.get("fused_bwd"):  # no dq kernel: its blocks do not matter
    return "/".join(dict.fromkeys(pairs[:2])) + FUSED + grid
  return (pairs[0] if len(set(pairs)) == 1 else "/".join(pairs)) + grid


def blocks_of(options: dict) -> list[int]:
  return [options[name] for name in _OPTION_NAMES]


def kernels_of(options: dict) -> tuple[str, ...]:
  """The Pallas kernels an arm runs: a fused backward has no dq kernel."""
  return ("fwd", "dkv") if options.get("fused_bwd") else KERNELS


def default_options() -> dict:
  """flash_attention's TPU defaults for these (16-bit, head_dim 128) inputs."""
  bq, bk, bq_bwd, bk_bwd = _fa().TPU_BLOCKS_16BIT
  return arm_options((bq, bk), (bq_bwd, bk_bwd), (bq_bwd, bk_bwd))  # dq: the bwd blocks


def parse_arms(text: str) -> list[tuple[str, dict]]:
  """`default`, `sweep` or BQxBK (every kernel) / BQxBK/BQxBK/BQxBK (forward, dk/dv, dq),
  each optionally with `+fused` (the fused backward) and / or `+rect` or `+compact`
  (the grids), comma-separated -> [(name, make_config options)], duplicates dropped."""
  arms = {}
  for item in text.split(","):
    item = item.strip()
    flags = {}
    while any(item.endswith(suffix) for suffix in SUFFIXES):
      suffix = next(suffix for suffix in SUFFIXES if item.endswith(suffix))
      name, value = SUFFIXES[suffix]
      flags[name] = value
      item = item[:-len(suffix)]
    if item == "default":
      found = [default_options()]
    elif item == "sweep":
      found = [arm_options(p, p, p) for p in SWEEP_BLOCKS]
    else:
      pairs = item.split("/")
      if len(pairs) not in (1, 3) or not all(re.fullmatch(r"\d+x\d+", p) for p in pairs):
        raise ValueError(
            f"arm {item!r}: expected default, sweep, BQxBK or BQxBK/BQxBK/BQxBK")
      blocks = [tuple(int(x) for x in p.split("x")) for p in pairs]
      blocks *= 3 if len(blocks) == 1 else 1
      if any(b < 128 or b % 128 for pair in blocks for b in pair):
        raise ValueError(f"arm {item!r}: TPU blocks are positive multiples of 128")
      found = [arm_options(*blocks)]
    for options in found:
      options = dict(options, **flags)
      arms.setdefault(arm_name(options), options)
  return list(arms.items())


def configs(options: dict, length: int, kv_length: int | None = None, heads=HEADS,
            kv_heads=KV_HEADS) -> dict:
  """Each kernel's _Config (the forward's, dk/dv's = the backward's, dq's) as
  flash_attention builds them for a causal call."""
  import jax
  import jax.numpy as jnp
  q = jax.ShapeDtypeStruct((1, length, heads, HEAD_DIM), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, kv_length or length, kv_heads, HEAD_DIM), jnp.bfloat16)
  cfg = _fa().make_config(q, k, causal=True, backend="tpu", interpret=False, **options)
  out = {"fwd": cfg, "dkv": cfg.for_backward(), "dq": cfg.for_backward().for_dq()}
  if cfg.fused_bwd:
    del out["dq"]
  return out


def grid_counts(cfg, kernel: str) -> dict:
  """Grid steps of one (batch row, query head) of a kernel, and how many run the
  unmasked / masked body and init + finish (rows; dk/dv's are per kv head, shared by
  the group's heads). From the kernels' own block ranges and grids (compact: the
  visible pairs, and a step for each row that sees none)."""
  fa = _fa()
  compact = fa.compact_steps(cfg, kernel)
  if kernel == "dkv":  # kv-major: each kv block visits a range of q blocks
    own, other = cfg.num_kv_blocks, cfg.num_q_blocks
    lo, hi = fa.q_block_range(cfg, np.arange(own))
    full_lo, full_hi = fa.q_full_range(cfg, np.arange(own))
    rows = own / cfg.group
  else:
    own, other = cfg.num_q_blocks, cfg.num_kv_blocks
    lo, hi = fa.kv_block_range(cfg, np.arange(own))
    full_lo, full_hi = fa.kv_full_range(cfg, np.arange(own))
    rows = own
  lo, hi = np.maximum(np.asarray(lo), 0), np.minimum(np.asarray(hi), other - 1)
  full_lo = np.maximum(np.asarray(full_lo), lo)
  full_hi = np.minimum(np.asarray(full_hi), hi)
  visited = int(np.maximum(hi - lo + 1, 0).sum())
  full = int(np.maximum(full_hi - full_lo + 1, 0).sum())
  steps = own * other if compact is None else len(compact) / (
      cfg.group if kernel == "dkv" else 1)
  return dict(steps=steps, unmasked=full, masked=visited - full, rows=rows)


def step_bytes(cfg, kernel: str) -> tuple[int, int]:
  """HBM bytes a visited step fetches and a row reads + writes once (bf16 blocks, f32
  lane- / sublane-replicated lse and di rows, as the kernels lay them out)."""
  bq, bk, d = cfg.block_q, cfg.block_kv, HEAD_DIM
  if kernel == "fwd":  # k, v a step; q in, out and lse [bq, 128] out a row
    return 2 * bk * d * 2, 2 * bq * d * 2 + bq * 128 * 4
  if kernel == "dq":  # k, v a step; q, do, lse, di in and dq out a row
    return 2 * bk * d * 2, 3 * bq * d * 2 + 2 * bq * 128 * 4
  # dk/dv: q, do, lse [8, bq], di a step (fused: its f32 dq block out); k, v in and dk,
  # dv out a kv row
  dq_out = bq * d * 4 if cfg.fused_bwd else 0
  return 2 * bq * d * 2 + 2 * 8 * bq * 4 + dq_out, 4 * bk * d * 2


def matmuls(cfg, kernel: str) -> int:
  return MATMULS[kernel] + (kernel == "dkv" and cfg.fused_bwd)


def mxu_cycles(cfg, kernel: str, chip: Chip) -> float:
  """Cycles one step's block matmuls keep the MXUs busy at peak."""
  return matmuls(cfg, kernel) * 2 * cfg.block_q * cfg.block_kv * HEAD_DIM / chip.mxu_flops


def dq_sum_seconds(cfg, chip: Chip, batch: int, heads=HEADS) -> float:
  """The fused backward's XLA sum of the f32 dq partials, HBM-bound: it reads one
  [Tq, d] partial per slot (`fused_dq_slots`: per kv block, or per kv block a window
  reaches) and writes dq in bf16, per (batch row, head)."""
  slots, _ = _fa().fused_dq_slots(cfg)
  per_head = slots * cfg.q_len * HEAD_DIM * 4 + cfg.q_len * HEAD_DIM * 2
  return batch * heads * per_head / (chip.hbm * chip.cores)


def kernel_cycles(regions: dict, cfg, kernel: str, chip: Chip, batch: int,
                  heads=HEADS) -> float:
  """Modelled cycles of a whole kernel on one TensorCore (the grid split over the
  device's cores): the overhead every step; on visited steps the body, or the MXU time
  of its matmuls if longer (the schedule issues matmuls faster than an MXU finishes
  them: the core then waits on their results), or the HBM time of the step's blocks if
  longer still (fetched while the previous step computes); init + finish once a row."""
  counts = grid_counts(cfg, kernel)
  visited = counts["unmasked"] + counts["masked"]
  per_step, per_row = step_bytes(cfg, kernel)
  hbm = (per_step + counts["rows"] * per_row / max(visited, 1)) * chip.clock / chip.hbm
  over, mxu = regions["overhead"], mxu_cycles(cfg, kernel, chip)
  masked_body = regions["masked"] if regions["masked"] is not None else regions["unmasked"]
  step = lambda body: max(over + max(body, mxu), hbm)  # noqa: E731
  cycles = ((counts["steps"] - visited) * over
            + counts["unmasked"] * step(regions["unmasked"])
            + counts["masked"] * step(masked_body)
            + counts["rows"] * (regions["init"] + regions["finish"]))
  return cycles * batch * heads / chip.cores


def causal_flops(length: int, batch: int, heads=HEADS, window: int | None = None) -> float:
  """benchmarks/attention.py's forward count: 2 matmuls over the causal half, or with a
  sliding window over the (query, key) pairs it keeps."""
  if window is None or window >= length:
    return 4 * batch * heads * length**2 * HEAD_DIM / 2
  pairs = window * length - window * (window - 1) / 2
  return 4 * batch * heads * pairs * HEAD_DIM


# ----------------------------------------------------------------------------------
# The bundle dump: `<addr> <markers>: > { op ;; op } /* Start region N :: End region M */`


@dataclasses.dataclass(frozen=True)
class Bundle:
  markers: tuple[str, ...]  # LB loop body, LH, LE, PB, PF, CT
  ops: str
  events: tuple[tuple[str, int], ...]  # ("start" | "end" | "empty", region)
  target: int | None  # region a branch in the bundle jumps to


_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-fA-F]+|\d+)\s+((?:[A-Z]{2}:\s*)*):?\s*>?\s*\{(.*)\}"
                     r"([^{}]*)$")
_EVENT = re.compile(r"(Start/End empty|Start|End) region (\d+)")
_BRANCH = re.compile(r"\bsbr\.rel\b(?:\s*\([^)]*\))?\s*target = \$region(\d+)")
_SPILL = re.compile(r"\bv(?:st|ld)\b[^;]*?\[vmem:\[#allocation\d+_spill")
_KINDS = {"Start": "start", "End": "end", "Start/End empty": "empty"}


def parse_bundles(text: str) -> list[Bundle]:
  """The bundles of a final_bundles dump, in issue order (other lines are skipped)."""
  bundles = []
  for line in text.splitlines():
    m = _BUNDLE.match(line)
    if not m:
      continue
    branch = _BRANCH.search(m.group(2))
    bundles.append(Bundle(
        markers=tuple(re.findall(r"[A-Z]{2}", m.group(1))), ops=m.group(2),
        events=tuple((_KINDS[k], int(r)) for k, r in _EVENT.findall(m.group(3))),
        target=int(branch.group(1)) if branch else None))
  return bundles


def _delay_slots(bundles: list[Bundle]) -> int:
  """Bundles after a branch that run either way: the branch's region ends that many
  bundles later (4 on v5e, v5p and v6e); the most common distance in the dump."""
  gaps = collections.Counter()
  for i, b in enumerate(bundles):
    if b.target is None:
      continue
    for j in range(i + 1, min(i + 9, len(bundles))):
      if any(kind == "end" for kind, _ in bundles[j].events):
        gaps[j - i] += 1
        break
  return gaps.most_common(1)[0][0] if gaps else DELAY_SLOTS


def _region_at(bundles: list[Bundle], region: int, after: int) -> int:
  """Index of the first bundle from `after` on where `region` starts (or is empty)."""
  for j in range(after, len(bundles)):
    if any(r == region and kind != "end" for kind, r in bundles[j].events):
      return j
  raise ValueError(f"branch target region {region} not found")


def loop_bodies(bundles: list[Bundle]) -> tuple[int, list[tuple[int, int]]]:
  """(bundles one iteration of the grid-step loop issues when nothing is skipped, the
  innermost bodies a branch inside it can skip as [start, end) bundle indices)."""
  try:
    first = next(i for i, b in enumerate(bundles) if "LB" in b.markers)
  except StopIteration:
    raise ValueError("no loop body (LB) in the dump") from None
  delay = _delay_slots(bundles)
  heads = {r for kind, r in bundles[first].events if kind == "start"}
  try:
    back = next(i for i in range(first + 1, len(bundles)) if bundles[i].target in heads)
  except StopIteration:
    raise ValueError("no branch back to the loop body") from None
  spans = []
  for i in range(first, back):
    if bundles[i].target is not None and bundles[i].target not in heads:
      end = _region_at(bundles, bundles[i].target, i + 1)
      if end > i + 1 + delay:
        spans.append((i + 1 + delay, end))
  leaves = [s for s in spans
            if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
  return back + delay + 1 - first, sorted(leaves)


def kernel_regions(text: str) -> dict:
  """A kernel's loop from its final_bundles dump: bundles of the loop, of init, the
  unmasked and the masked step, finish, the per-step overhead (the rest), and the
  vector spill loads + stores in the step bodies. Steps are the bodies that use the
  MXU; the masked one (source order: second) must hold more compares and selects."""
  bundles = parse_bundles(text)
  loop, leaves = loop_bodies(bundles)
  ops = ["\n".join(b.ops for b in bundles[s:e]) for s, e in leaves]
  steps = [i for i, o in enumerate(ops) if re.search(r"\.mxu\d", o)]
  if not steps or len(steps) > 2:
    raise ValueError(f"{len(steps)} guarded regions use the MXU; expected 1 or 2 steps")
  size = lambda i: leaves[i][1] - leaves[i][0]  # noqa: E731
  before = [i for i in range(len(leaves)) if i < steps[0]]
  after = [i for i in range(len(leaves)) if i > steps[-1]]
  out = dict(loop=loop, init=size(before[-1]) if before else 0,
             unmasked=size(steps[0]), masked=size(steps[1]) if len(steps) == 2 else None,
             finish=size(after[0]) if after else 0,
             spills=max(len(_SPILL.findall(ops[i])) for i in steps),
             unmapped=len(before[:-1]) + len(after[1:]))  # left in the overhead
  out["overhead"] = loop - sum(size(i) for i in (*before[-1:], *steps, *after[:1]))
  mask_ops = [len(re.findall(r"= v(?:cmp|sel)\b", ops[i])) for i in steps]
  out["mask_checked"] = len(steps) == 1 or mask_ops[1] > mask_ops[0]
  return out


# ----------------------------------------------------------------------------------
# The worker: runs in a Python with libtpu.


def dump_flags(dump_dir: str, profile_dir: str) -> str:
  """LIBTPU_INIT_ARGS: final bundles and static profiles only, operands left in HBM
  (vf / gf: the v5 and v6 compilers' memory-space assignment)."""
  return (f"--xla_jf_dump_to={dump_dir} --xla_jf_dump_llo_text=true "
          f"--xla_jf_dump_llo_pass_label_regex=final_bundles "
          f"--xla_jf_dump_static_llo_profile_to={profile_dir} "
          "--xla_vf_vmem_memory_space_assignment=false "
          "--xla_gf_vmem_memory_space_assignment=false")


def _compile(mesh, options: dict, length: int, kernel: str) -> None:
  """One of the three pallas_calls of a causal flash_attention forward + backward, with
  its operands laid out as _forward / _backward pass them ([b, h, T, d]; lse and di
  packed by `_tpu_stats`: lane rows for dq, sublane rows for dk/dv), compiled for the
  mesh's TPU."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  fa = _fa()
  cfg = configs(options, length)[kernel]
  if length % math.lcm(cfg.block_q, cfg.block_kv):
    raise ValueError(f"length {length} is not a multiple of the blocks")
  b, h, kvh, d = COMPILE_BATCH, HEADS, KV_HEADS, HEAD_DIM
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dtype, sharding=NamedSharding(mesh, P()))
  q, kv = spec((b, h, length, d)), spec((b, kvh, length, d))
  if kernel == "fwd":
    fn, args = lambda q, k, v: fa._tpu_forward(cfg, q, k, v, None, None, False), (q, kv, kv)
  else:
    stats = (b, h, length, 256) if kernel == "dq" else (b, h, 8, length)
    call = fa._tpu_dq if kernel == "dq" else fa._tpu_dkv
    fn = lambda q, k, v, do, stats: call(  # noqa: E731
        cfg, q, k, v, None, None, do, stats, False)
    args = (q, kv, kv, q, spec(stats, jnp.float32))
  with jax.set_mesh(mesh):  # Pallas reads the TPU generation from the abstract mesh
    jax.jit(fn).lower(*args).compile()


def _read_kernel(kernel: str, dump_dir: str, profile_dir: str) -> dict:
  name = f"flash_attention_{kernel}"
  dumps = [p for p in glob.glob(os.path.join(dump_dir, f"*-{name}.*final_bundles.txt"))
           if "schedule-analysis" not in p]
  if len(dumps) != 1:
    raise ValueError(f"{len(dumps)} bundle dumps of {name}")
  with open(dumps[0]) as f:
    out = kernel_regions(f.read())
  profiles = glob.glob(os.path.join(profile_dir, f"{name}.*_static_llo_profile.textproto"))
  if profiles:
    with open(max(profiles, key=os.path.getmtime)) as f:
      m = re.search(r"estimated_cycles: (\d+)", f.read())
    out["estimated_cycles"] = int(m.group(1)) if m else None
  return out


def worker(spec: dict) -> None:
  """Compiles each kernel of every (chip, arm) of `spec` in turn; prints one JSON line
  per (chip, arm)."""
  dump_dir, profile_dir = spec["dump_dir"], spec["profile_dir"]
  # Read once, when libtpu starts (at the first topology), not at `import jax`.
  flags = os.environ.get("LIBTPU_INIT_ARGS", "")
  if "--xla_jf_dump_to=" not in flags:  # run directly, not by run_worker
    os.environ["LIBTPU_INIT_ARGS"] = f"{flags} {dump_flags(dump_dir, profile_dir)}".strip()
  from jax.experimental import topologies
  from jax.sharding import Mesh
  for chip in spec["chips"]:
    devices = topologies.get_topology_desc(CHIPS[chip].topology, "tpu").devices
    mesh = Mesh(devices[:1], ("x",))
    for name, options in spec["arms"]:
      row = dict(chip=chip, arm=name, options=options, kernels={})
      for kernel in kernels_of(options):
        for d in (dump_dir, profile_dir):  # ~6 MB a compile; profiles keep one name per op
          shutil.rmtree(d, ignore_errors=True)
          os.makedirs(d)
        try:
          _compile(mesh, options, spec["length"], kernel)
          row["kernels"][kernel] = _read_kernel(kernel, dump_dir, profile_dir)
        except Exception as e:  # noqa: BLE001 (a VMEM overflow and the like: report it)
          first = (str(e).strip().splitlines() or [type(e).__name__])[0]
          row["kernels"][kernel] = dict(error=first[:200])
      print(json.dumps(row), flush=True)
    shutil.rmtree(dump_dir, ignore_errors=True)
    shutil.rmtree(profile_dir, ignore_errors=True)


def run_worker(tpu_python: str, chips, arms, length: int):
  """Yields the worker's rows; it runs in `tpu_python` with the dump flags set."""
  with tempfile.TemporaryDirectory(prefix="tpu_static_") as tmp, \
       tempfile.TemporaryFile("w+") as log:  # libtpu's chatter; a pipe could fill up
    spec = dict(chips=list(chips), arms=arms, length=length,
                dump_dir=os.path.join(tmp, "dump"),
                profile_dir=os.path.join(tmp, "profile"))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               LIBTPU_INIT_ARGS=dump_flags(spec["dump_dir"], spec["profile_dir"]))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with subprocess.Popen([tpu_python, "-m", "benchmarks.tpu_static", "--worker",
                           json.dumps(spec)], cwd=root, env=env, stdout=subprocess.PIPE,
                          stderr=log, text=True) as proc:
      for line in proc.stdout:
        if line.startswith("{"):
          yield json.loads(line)
    if proc.returncode:
      log.seek(0)
      lines = [line for line in log.read().splitlines() if line.strip()]
      raise RuntimeError(f"the libtpu worker failed ({proc.returncode}): "
                         + (lines[-1] if lines else "no output"))


# ----------------------------------------------------------------------------------
# Rows and tables.


def kernel_rows(result: dict, lengths, compile_length: int) -> list[dict]:
  """Per-kernel rows of one worker result: bundles, bounds, model vs static profile at
  the compiled shape, modelled time and TFLOP/s at each length."""
  chip = CHIPS[result["chip"]]
  base = dict(chip=result["chip"], arm=result["arm"])
  options = result["options"]
  rows = []
  for kernel in kernels_of(options):
    regions = result["kernels"][kernel]
    row = dict(base, kernel=kernel)
    if options.get("sliding_window"):
      row["window"] = options["sliding_window"]
    if "error" in regions:
      rows.append(dict(row, note=regions["error"]))
      continue
    cfg = configs(options, compile_length)[kernel]
    compiled_compact = _fa().compact_steps(cfg, kernel) is not None
    per_step, _ = step_bytes(cfg, kernel)
    model = kernel_cycles(regions, cfg, kernel, chip, COMPILE_BATCH)
    est = regions.get("estimated_cycles")
    body = max(regions["unmasked"], regions["masked"] or 0)
    row.update(blocks=f"{cfg.block_q}x{cfg.block_kv}", unmasked=regions["unmasked"],
               masked=regions["masked"], overhead=regions["overhead"],
               init_finish=regions["init"] + regions["finish"],
               mxu_bound=round(mxu_cycles(cfg, kernel, chip)),
               hbm_bound=round(per_step * chip.clock / chip.hbm), spills=regions["spills"],
               model_mcycles=round(model / 1e6, 3),
               static_mcycles=None if est is None else round(est / 1e6, 3))
    other_grid = []  # lengths whose grid is not the compiled one's kind (its overhead)
    for length in lengths:
      cfg = configs(options, length)[kernel]
      if (_fa().compact_steps(cfg, kernel) is not None) != compiled_compact:
        other_grid.append(str(length))
      batch = max(1, TOKENS // length)
      seconds = kernel_cycles(regions, cfg, kernel, chip, batch) / chip.clock
      row[f"ms@{length}"] = round(seconds * 1e3, 3)
      row[f"tflops@{length}"] = round(
          matmuls(cfg, kernel) / 2 * causal_flops(length, batch,
                                                  window=cfg.sliding_window)
          / seconds / 1e12, 1)
    notes = []
    if row["mxu_bound"] > body:
      notes.append("MXU-bound")
    if row["hbm_bound"] > regions["overhead"] + max(body, row["mxu_bound"]):
      notes.append("HBM-bound")
    if not regions["mask_checked"] or regions["unmapped"]:
      notes.append("regions unverified")
    if other_grid:
      notes.append(f"compiled grid {'compact' if compiled_compact else 'rectangular'}, "
                   f"not at {'/'.join(other_grid)}")
    row["note"] = ", ".join(notes)
    rows.append(row)
  if options.get("fused_bwd"):
    row = dict(base, kernel="dq_sum", note="XLA, HBM-bound")
    for length in lengths:
      seconds = dq_sum_seconds(configs(options, length)["dkv"], chip,
                               max(1, TOKENS // length))
      row[f"ms@{length}"] = round(seconds * 1e3, 3)
    rows.append(row)
  return rows


def summary_rows(rows: list[dict], lengths) -> list[dict]:
  """fwd and fwd + bwd TFLOP/s of each (chip, arm) at each length (attention.py's
  counts: 2 and 7 matmuls over the causal half), with each chip's arms ranked."""
  out = []
  by_arm = collections.defaultdict(dict)
  for r in rows:
    by_arm[(r["chip"], r["arm"])][r["kernel"]] = r
  for (chip, arm), kernels in by_arm.items():
    row = dict(chip=chip, arm=arm)
    failed = [r["note"] for r in kernels.values() if f"ms@{lengths[0]}" not in r]
    backward = ("dq_sum" if "dq_sum" in kernels else "dq", "dkv")
    if failed or any(k not in kernels for k in ("fwd", *backward)):
      out.append(dict(row, note="; ".join(failed)))
      continue
    for length in lengths:
      batch = max(1, TOKENS // length)
      fwd = kernels["fwd"][f"ms@{length}"] / 1e3
      total = fwd + sum(kernels[k][f"ms@{length}"] for k in backward) / 1e3
      flops = causal_flops(length, batch, window=kernels["fwd"].get("window"))
      row[f"fwd@{length}"] = round(flops / fwd / 1e12, 1)
      row[f"fwd+bwd@{length}"] = round(3.5 * flops / total / 1e12, 1)
    out.append(row)
  for chip in {r["chip"] for r in out}:
    key = f"fwd+bwd@{lengths[0]}"
    ranked = sorted((r for r in out if r["chip"] == chip and key in r),
                    key=lambda r: -r[key])
    for rank, r in enumerate(ranked, 1):
      r["rank"] = rank
  return out


def markdown(rows: list[dict]) -> str:
  columns = list(collections.OrderedDict.fromkeys(k for r in rows for k in r))
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in rows:
    lines.append("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in columns)
                 + " |")
  return "\n".join(lines)


def _positive_ints(text: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected comma-separated integers, got {text!r}") from None
  if not values or any(v < 128 for v in values):
    raise argparse.ArgumentTypeError(f"lengths must be at least 128, got {text!r}")
  return values


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tpu-python", default=sys.executable,
                      help="a Python with libtpu (its own venv); default this one")
  parser.add_argument("--chips", default="v5e,v6e,v5p")
  parser.add_argument("--arms", default="default")
  parser.add_argument("--lengths", type=_positive_ints, default=[4096, 16384],
                      help="modelled lengths (batch * length = 32k tokens)")
  parser.add_argument("--compile-length", type=int, default=4096,
                      help="length compiled (and statically profiled), batch 2")
  parser.add_argument("--window", type=int, default=None,
                      help="a sliding window for every arm (causal within it)")
  parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    return args
  chips = [c.strip() for c in args.chips.split(",")]
  unknown = [c for c in chips if c not in CHIPS]
  if unknown or not chips:
    parser.error(f"unknown chip(s) {unknown}: expected some of {sorted(CHIPS)}")
  args.chips = chips
  try:
    args.arms = parse_arms(args.arms)
  except ValueError as e:
    parser.error(str(e))
  if args.window is not None:
    if args.window < 1:
      parser.error(f"--window must be positive, got {args.window}")
    args.arms = [(f"{name} w{args.window}", dict(options, sliding_window=args.window))
                 for name, options in args.arms]
  for name, options in args.arms:
    if args.compile_length % math.lcm(*blocks_of(options)):
      parser.error(f"--compile-length {args.compile_length} is not a multiple of the "
                   f"blocks of arm {name}")
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.worker:
    worker(json.loads(args.worker))
    return
  rows = []
  for result in run_worker(args.tpu_python, args.chips, args.arms, args.compile_length):
    new = kernel_rows(result, args.lengths, args.compile_length)
    for r in new:
      print(f"  {r}", file=sys.stderr, flush=True)
    rows += new
  summary = summary_rows(rows, args.lengths)
  print(f"Per kernel (bundles a step; model and static profile in Mcycles at length "
        f"{args.compile_length}, batch {COMPILE_BATCH}; ms and TFLOP/s at "
        f"{TOKENS} tokens):\n")
  print(markdown(rows))
  print(f"\nForward and forward + backward TFLOP/s (rank by fwd+bwd@{args.lengths[0]}):\n")
  print(markdown(summary))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(kernels=rows, summary=summary), f, indent=1)


if __name__ == "__main__":
  main()
