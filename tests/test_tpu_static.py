"""benchmarks/tpu_static.py without libtpu: the bundle-dump parser on a synthetic dump,
the block-count model against a brute-force causal mask, the cycle model's arithmetic
and the command line."""
import dataclasses

import numpy as np
import pytest

from benchmarks import tpu_static as ts

fa = ts._fa()


def _dump(bundles) -> str:
  """A final_bundles dump: (markers, ops, trailing comment) per bundle."""
  lines = ["= control target key start", "LB: loop body",
           "PF: predicated region fallthrough", "= control target key end", ""]
  for i, (markers, ops, comment) in enumerate(bundles):
    addr = f"{i:#x}" if i else "0"
    mark = " ".join(m + ":" for m in markers.split()) or "  :"
    tail = f" /* {comment} */" if comment else ""
    lines.append(f"  {addr:>5} {mark} > {{ {ops} }}{tail}")
  return "\n".join(lines) + "\n"


def _delay(n=3, start=None):
  """Delay slots; `start` opens a region in one of them (hoisted code of the next
  region, as libtpu schedules it), which must not end the slots."""
  slots = [("", "", "")] * n
  if start is not None:
    slots[1] = ("", "", f"Start region {start}")
  return slots


MATMUL = "%v1 = vmatmul.bf16.gmra.mxu0 %v0  ;;  %v2 = vpop.f32.mrf.mxu0"
MASK = "%vm3 = vcmp.lt.s32.totalorder %v4, %v5  ;;  %v6 = vsel /*vm=*/%vm3, %v2, -2.38e+38"
SPILLS = ("%7 = vst [vmem:[#allocation9_spill] sm:$0xff] /*vst_source=*/%v2  ;;  "
          "%v8 = vld [vmem:[#allocation9_spill] sm:$0xff]")


def _kernel_bundles(unmasked_ops=MATMUL, masked_ops=MASK + "  ;;  " + MATMUL):
  """A grid-step loop as libtpu lays it out: an outer guard around init (2 bundles),
  the unmasked step (5), the masked step (7) and finish (3); every branch followed by 4
  bundles that run either way, the last of them closing the branch's region."""
  return [
      ("", "%1 = smov 0", "Start region 1"),
      ("LB", "%2 = sadd.s32 1, %s1", "Start region 30 :: Start region 31"),
      ("", "%3 = sbr.rel (%p0) target = $region40", ""),  # pipeline guard: not a leaf
      *_delay(start=50), ("", "", "End region 31"),
      ("", "%4 = sbr.rel (%p1) target = $region33", "Start region 32"),  # init
      *_delay(start=51), ("", "", "End region 32"),
      ("", "%5 = vst [vmem:[#allocation2] sm:$0xff] %v0", "Start region 34"),
      ("", "%5 = vst [vmem:[#allocation2 + $0x8] sm:$0xff] %v0", "End region 34"),
      ("PF", "%6 = sbr.rel (%p2) target = $region37",
       "Start/End empty region 33 :: Start region 35"),  # unmasked step
      *_delay(), ("", "", "End region 35"),
      ("", unmasked_ops, "Start region 36"), ("", SPILLS, ""), ("", unmasked_ops, ""),
      ("", "%9 = vadd.f32 %v1, %v2", ""), ("", unmasked_ops, "End region 36"),
      ("PF", "", "Start/End empty region 37 :: Start region 38"),
      ("", "%7 = sbr.rel (%p3) target = $region41", ""),  # masked step
      *_delay(start=52), ("", "", "End region 38"),
      ("", masked_ops, "Start region 39"), *[("", masked_ops, "")] * 5,
      ("", masked_ops, "End region 39"),
      ("CT PF", "%8 = sbr.rel (%p4) target = $region43",
       "Start/End empty region 41 :: Start region 42"),  # finish
      *_delay(start=53), ("", "", "End region 42"),
      ("", "%v10 = vrcp.f32 %v9", ""), ("", "", ""),
      ("", "%11 = vst [vmem:[%s3] sm:$0xff] %v10", ""),
      ("PF", "", "Start/End empty region 43"),
      ("", "%12 = sst [smem:[#allocation5]] %s2", ""),
      ("PF", "", "Start/End empty region 40 :: End region 30"),
      ("", "%13 = sbr.rel (!%p5) target = $region30", ""),  # back to the loop body
      *_delay(), ("", "", "End region 1"),
      ("", "%14 = vsyncpa [#allocation6], 1", ""),
  ]


def test_parse_bundles_reads_markers_events_and_branches():
  bundles = ts.parse_bundles(_dump(_kernel_bundles()))
  assert len(bundles) == 54  # the key lines at the top are no bundles
  assert bundles[1].markers == ("LB",)
  assert bundles[1].events == (("start", 30), ("start", 31))
  assert bundles[14].markers == ("PF",)
  assert bundles[14].events == (("empty", 33), ("start", 35))
  assert bundles[14].target == 37
  assert bundles[37].markers == ("CT", "PF") and bundles[37].target == 43
  assert bundles[48].target == 30 and bundles[47].events == (("empty", 40), ("end", 30))
  assert [b.target for b in bundles if b.target is not None] == [40, 33, 37, 41, 43, 30]


def test_kernel_regions_maps_the_guarded_bodies():
  regions = ts.kernel_regions(_dump(_kernel_bundles()))
  # The loop runs from the LB bundle to the back branch's last delay slot (1..52).
  assert regions == dict(loop=52, init=2, unmasked=5, masked=7, finish=3, spills=2,
                         unmapped=0, overhead=52 - 2 - 5 - 7 - 3, mask_checked=True)


def test_kernel_regions_flags_a_masked_step_without_the_mask():
  # The second MXU body is taken as the masked step; here it holds fewer selects.
  regions = ts.kernel_regions(_dump(_kernel_bundles(unmasked_ops=MASK + " ;; " + MATMUL,
                                                     masked_ops=MATMUL)))
  assert not regions["mask_checked"]


def test_kernel_regions_rejects_dumps_it_cannot_map():
  bundles = _kernel_bundles()
  with pytest.raises(ValueError, match="no loop body"):
    ts.kernel_regions(_dump([(m.replace("LB", ""), o, c) for m, o, c in bundles]))
  with pytest.raises(ValueError, match="use the MXU"):
    ts.kernel_regions(_dump(_kernel_bundles(unmasked_ops="%9 = vadd.f32 %v1, %v2",
                                            masked_ops="%9 = vadd.f32 %v1, %v2")))


def _brute_force(cfg, kernel="fwd"):
  """Steps, fully visible and partly masked block pairs of the causal mask, element by
  element (real queries only; keys past kv_len are masked). Steps: the whole rectangle,
  or with a compact grid (compact_grid True, or None and under the kernel's fraction)
  the visible pairs and one for each row (q block, or kv block for dk/dv) that sees
  none."""
  nq, nk, bq, bk = cfg.num_q_blocks, cfg.num_kv_blocks, cfg.block_q, cfg.block_kv
  q = np.arange(nq * bq)[:, None] + cfg.kv_len - cfg.q_len
  k = np.arange(nk * bk)[None, :]
  mask = (q >= k) & (k < cfg.kv_len)
  unmasked = masked = 0
  visible = np.zeros((nq, nk), bool)
  for qi in range(nq):
    rows = slice(qi * bq, min(qi * bq + bq, cfg.q_len))
    for ki in range(nk):
      block = mask[rows, ki * bk:(ki + 1) * bk]
      unmasked += bool(block.all())
      masked += bool(block.any() and not block.all())
      visible[qi, ki] = block.any()
  compact = int(np.maximum(visible.sum(axis=0 if kernel == "dkv" else 1), 1).sum())
  auto = compact <= fa.COMPACT_AUTO_FRACTION[kernel] * nq * nk
  use = cfg.compact_grid or (cfg.compact_grid is None and auto)
  return dict(steps=compact if use else nq * nk, unmasked=unmasked, masked=masked)


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("q_len, kv_len, bq, bk", [
    (2048, 2048, 512, 512),
    (2048, 2048, 256, 1024),
    (1000, 1000, 256, 128),  # ragged: the last blocks are partly padding
    (384, 1000, 128, 256),  # fewer queries than keys: the diagonal is offset
])
def test_grid_counts_match_a_brute_force_causal_mask(q_len, kv_len, bq, bk, compact):
  options = dict(ts.arm_options((bq, bk), (bq, bk), (bq, bk)), compact_grid=compact)
  cfgs = ts.configs(options, q_len, kv_len)
  want = _brute_force(cfgs["fwd"])
  assert want["masked"] and want["unmasked"]  # the shapes do exercise both bodies
  # A compact grid drops the skipped steps: what is left is the visible pairs.
  assert (want["steps"] == want["masked"] + want["unmasked"]) == compact
  fwd = ts.grid_counts(cfgs["fwd"], "fwd")
  assert fwd == dict(want, rows=cfgs["fwd"].num_q_blocks)
  # The dk/dv kernel visits the same pairs kv-major; init / finish once per kv head.
  dkv = ts.grid_counts(cfgs["dkv"], "dkv")
  assert dkv == dict(_brute_force(cfgs["dkv"], "dkv"),
                     rows=cfgs["dkv"].num_kv_blocks / (ts.HEADS // ts.KV_HEADS))


def test_grid_counts_follow_each_kernels_own_blocks():
  cfgs = ts.configs(ts.arm_options((512, 512), (256, 1024), (1024, 256)), 4096)
  assert [(c.block_q, c.block_kv) for c in cfgs.values()] == [(512, 512), (256, 1024),
                                                             (1024, 256)]
  for kernel, cfg in cfgs.items():
    counts = ts.grid_counts(cfg, kernel)
    assert {k: counts[k] for k in ("steps", "unmasked", "masked")} == _brute_force(
        cfg, kernel)


REGIONS = dict(loop=0, init=20, unmasked=1000, masked=1200, finish=30, overhead=100,
               spills=0, unmapped=0, mask_checked=True)


def test_kernel_cycles_sum_over_the_grid():
  options = ts.arm_options((512, 512), (512, 512), (512, 512))
  compact = ts.configs(dict(options, compact_grid=True), 2048)["fwd"]
  cfg = ts.configs(dict(options, compact_grid=False), 2048)["fwd"]
  counts = ts.grid_counts(cfg, "fwd")  # 4 x 4 blocks: 6 unmasked, 4 masked, 6 skipped
  assert counts == dict(steps=16, unmasked=6, masked=4, rows=4)
  assert ts.grid_counts(compact, "fwd") == dict(counts, steps=10)  # no skipped steps
  free = ts.Chip("none", peak=1e30, hbm=1e30, mxu_flops=10**30)  # no MXU / HBM limits
  one = 6 * 100 + 6 * 1100 + 4 * 1300 + 4 * 50
  assert ts.kernel_cycles(REGIONS, cfg, "fwd", free, batch=1, heads=1) == pytest.approx(one)
  assert ts.kernel_cycles(REGIONS, compact, "fwd", free, 1, 1) == pytest.approx(
      one - 6 * 100)
  assert ts.kernel_cycles(REGIONS, cfg, "fwd", free, 2, 3) == pytest.approx(6 * one)
  megacore = dataclasses.replace(free, cores=2)
  assert ts.kernel_cycles(REGIONS, cfg, "fwd", megacore, 1, 1) == pytest.approx(one / 2)
  # An MXU slower than the bodies: every visited step takes overhead + MXU time.
  slow_mxu = dataclasses.replace(free, mxu_flops=2 * 2 * 512 * 512 * 128 // 4096)
  assert ts.kernel_cycles(REGIONS, cfg, "fwd", slow_mxu, 1, 1) == pytest.approx(
      6 * 100 + 10 * (100 + 4096) + 4 * 50)
  # HBM slower still: a visited step takes its blocks' fetch time (k and v, plus its
  # share of the rows' q, out and lse).
  slow_hbm = dataclasses.replace(free, hbm=free.clock / 8)  # 1/8 byte a cycle
  per_step, per_row = ts.step_bytes(cfg, "fwd")
  hbm = 8 * (per_step + 4 * per_row / 10)
  assert ts.kernel_cycles(REGIONS, cfg, "fwd", slow_hbm, 1, 1) == pytest.approx(
      6 * 100 + 10 * hbm + 4 * 50)


def test_kernel_rows_and_summary_from_a_worker_result():
  kernels = dict(fwd=dict(REGIONS, estimated_cycles=10**6), dq=dict(REGIONS, masked=None),
                 dkv=dict(error="RESOURCE_EXHAUSTED: scoped vmem"))
  result = dict(chip="v5e", arm="512x512", options=ts.arm_options(*[(512, 512)] * 3),
                kernels=kernels)
  rows = ts.kernel_rows(result, [4096, 8192], 4096)
  assert [r["kernel"] for r in rows] == ["fwd", "dq", "dkv"]
  fwd, dq, dkv = rows
  assert fwd["blocks"] == "512x512" and fwd["mxu_bound"] == 1024
  assert fwd["static_mcycles"] == 1
  assert fwd["note"] == ""  # bodies of 1000 / 1200 bundles vs 1024 MXU cycles
  assert dq["mxu_bound"] == 1536 and dq["note"] == "MXU-bound"
  assert fwd["tflops@8192"] > fwd["tflops@4096"] > 0  # fewer skipped steps per visit
  assert dkv == dict(chip="v5e", arm="512x512", kernel="dkv",
                     note="RESOURCE_EXHAUSTED: scoped vmem")
  good = dict(result, arm="other", kernels=dict(fwd=REGIONS, dq=REGIONS, dkv=REGIONS))
  summary = ts.summary_rows(rows + ts.kernel_rows(good, [4096, 8192], 4096), [4096, 8192])
  assert summary[0] == dict(chip="v5e", arm="512x512",
                            note="RESOURCE_EXHAUSTED: scoped vmem")
  assert summary[1]["rank"] == 1 and summary[1]["fwd@4096"] == fwd["tflops@4096"]
  table = ts.markdown(summary).splitlines()
  assert table[0].startswith("| chip | arm | note |") and len(table) == 4


def test_fused_arm_rows_replace_the_dq_kernel_by_the_xla_sum():
  """A fused-backward arm compiles no dq kernel; its dk/dv kernel counts 5 matmuls and
  writes an f32 dq block a step, and an HBM-bound row models XLA's sum of the partials
  (one [Tq, d] f32 read per kv block, a bf16 dq written)."""
  (name, options), = ts.parse_arms("512x512+fused")
  assert name == "512x512+fused" and options["fused_bwd"] is True
  assert ts.kernels_of(options) == ("fwd", "dkv") and "dq" not in ts.configs(options, 4096)
  result = dict(chip="v5e", arm=name, options=options,
                kernels=dict(fwd=REGIONS, dkv=REGIONS))
  rows = ts.kernel_rows(result, [4096], 4096)
  assert [r["kernel"] for r in rows] == ["fwd", "dkv", "dq_sum"]
  fwd, dkv, dq_sum = rows
  assert dkv["mxu_bound"] == 5 * 2 * 512 * 512 * 128 // (4 * 128 * 128 * 2)
  cfg = ts.configs(options, 4096)["dkv"]
  assert ts.step_bytes(cfg, "dkv")[0] == 2 * 512 * 128 * 2 + 2 * 8 * 512 * 4 + 512 * 128 * 4
  chip, batch = ts.CHIPS["v5e"], ts.TOKENS // 4096
  read = 8 * 4096 * 128 * 4  # 8 kv blocks of f32 partials, per (batch row, head)
  want = batch * ts.HEADS * (read + 4096 * 128 * 2) / chip.hbm
  assert dq_sum["ms@4096"] == pytest.approx(want * 1e3, abs=1e-3)
  (summary,) = ts.summary_rows(rows, [4096])
  total = (fwd["ms@4096"] + dkv["ms@4096"] + dq_sum["ms@4096"]) / 1e3
  assert summary["fwd+bwd@4096"] == pytest.approx(
      3.5 * ts.causal_flops(4096, batch) / total / 1e12, abs=0.1)
  # The split backward's arm of the same blocks is another arm.
  assert [n for n, _ in ts.parse_arms("512x512,512x512+fused,default+fused")] == [
      "512x512", "512x512+fused", "1024x1024+fused"]


def test_grid_arms_set_compact_grid():
  """`+rect` / `+compact` (either order with `+fused`) compile and model
  compact_grid=False / True; without either, flash_attention's default picks."""
  arms = dict(ts.parse_arms("512x512+rect,512x512+fused+rect,512x512+rect+fused,512x512,"
                            "512x512+compact"))
  assert list(arms) == ["512x512+rect", "512x512+fused+rect", "512x512", "512x512+compact"]
  assert arms["512x512+rect"]["compact_grid"] is False
  assert arms["512x512+compact"]["compact_grid"] is True
  assert arms["512x512+fused+rect"] == dict(arms["512x512+rect"], fused_bwd=True)
  assert "compact_grid" not in arms["512x512"]
  steps = {(n, k): ts.grid_counts(cfg, k)["steps"] for n in ("512x512+rect",
                                                             "512x512+compact", "512x512")
           for k, cfg in ts.configs(arms[n], 4096).items()}
  # 8 x 8 blocks, 36 visible. The default: the forward compact (36 / 64 steps is under
  # its 0.7), the backward kernels rectangular; dk/dv per query head.
  assert steps == {
      ("512x512+rect", "fwd"): 64, ("512x512+rect", "dq"): 64, ("512x512+rect", "dkv"): 64,
      ("512x512+compact", "fwd"): 36, ("512x512+compact", "dq"): 36,
      ("512x512+compact", "dkv"): 36,
      ("512x512", "fwd"): 36, ("512x512", "dq"): 64, ("512x512", "dkv"): 64}
  # With a long sliding window the default steps compactly: 15 visible pairs.
  for kernel, cfg in ts.configs(dict(arms["512x512"], sliding_window=512), 4096).items():
    assert ts.grid_counts(cfg, kernel)["steps"] == 15, kernel


def test_window_flag_sets_every_arm_and_the_flop_count():
  args = ts.parse_args(["--arms=512x512,512x512+rect", "--window=1024"])
  assert [n for n, _ in args.arms] == ["512x512 w1024", "512x512+rect w1024"]
  assert all(o["sliding_window"] == 1024 for _, o in args.arms)
  # Visible pairs: 1024 * 4096 - 1024 * 1023 / 2 (the first 1023 rows see fewer).
  assert ts.causal_flops(4096, 1, 1, window=1024) == 4 * (1024 * 4096 - 1024 * 1023 / 2) * 128
  assert ts.causal_flops(4096, 1, 1, window=8192) == ts.causal_flops(4096, 1, 1)


def test_parse_args_defaults_and_arms():
  args = ts.parse_args([])
  assert args.chips == ["v5e", "v6e", "v5p"] and args.lengths == [4096, 16384]
  assert args.arms == [("1024x1024", ts.default_options())]
  sweep = ts.parse_args(["--arms=sweep,default", "--chips=v6e"]).arms
  assert [name for name, _ in sweep] == [f"{q}x{k}" for q, k in ts.SWEEP_BLOCKS]
  assert len(sweep) <= 8 and ("1024x1024", ts.default_options()) in sweep
  (name, options), = ts.parse_args(["--arms=256x512/512x1024/1024x256"]).arms
  assert name == "256x512/512x1024/1024x256"
  assert options == dict(block_q=256, block_kv=512, block_q_bwd=512, block_kv_bwd=1024,
                         block_q_dq=1024, block_kv_dq=256)


@pytest.mark.parametrize("argv, message", [
    (["--chips=v5e,v7"], "unknown chip"),
    (["--arms=512"], "expected default, sweep"),
    (["--arms=512x512/256x256"], "expected default, sweep"),
    (["--arms=100x512"], "multiples of 128"),
    (["--arms=fused"], "expected default, sweep"),
    (["--lengths=4096,abc"], "comma-separated integers"),
    (["--lengths=64"], "at least 128"),
    (["--compile-length=3000"], "not a multiple of the blocks"),
])
def test_parse_args_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    ts.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_rows_note_lengths_whose_grid_is_not_the_compiled_ones():
  """The per-step overhead comes from the compiled kernel: a modelled length whose
  default grid is of the other kind (compact vs rectangular) is flagged."""
  options = dict(ts.default_options(), sliding_window=2048)
  result = dict(chip="v5e", arm="1024x1024 w2048", options=options,
                kernels=dict(fwd=REGIONS, dq=REGIONS, dkv=REGIONS))
  rows = {r["kernel"]: r for r in ts.kernel_rows(result, [4096, 16384], 4096)}
  # At 4k the window keeps 9 of 16 pairs: compact for the forward (under 0.7), not
  # for dq (0.5) or dk/dv (0.4); at 16k 45 of 256: compact for all three.
  assert "compiled grid" not in rows["fwd"]["note"]
  for kernel in ("dq", "dkv"):
    assert "compiled grid rectangular, not at 16384" in rows[kernel]["note"]
  assert rows["fwd"]["window"] == 2048
