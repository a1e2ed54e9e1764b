"""The packed-row block count of benchmarks/attention.py, against the closed form, and
the device sweep's backward arms."""
import argparse
import importlib

import pytest

from benchmarks import attention

fa = importlib.import_module("kernels.flash_attention")  # the module, not the function


def test_packed_rows_visit_only_each_sequences_causal_blocks():
  length, tpu_block = 8192, fa.TPU_BLOCKS_16BIT[0]  # bf16, head_dim 128: 1024 blocks
  rows = attention.packed_blocks(length=length, sequences=(1, 2, 4, 8))
  assert len(rows) == 8
  for row in rows:
    n = row["sequences"]
    if "tpu" in row["benchmark"]:  # square blocks: m blocks a sequence, m(m+1)/2 pairs
      assert f"blocks {tpu_block}x{tpu_block}" in row["benchmark"]
      m = length // n // tpu_block
      want = n * m * (m + 1) // 2
    else:  # 128 x 64: q block i of a sequence sees 2(i + 1) kv blocks
      m = length // n // 128
      want = n * m * (m + 1)
    assert row["visited_blocks"] == want, row
    assert row["fraction"] == round(want / row["causal_blocks"], 3)
    # Sequences start on block boundaries here, so only the diagonal's pairs need the
    # element mask: one per q block (TPU), two per 128-row q block of 64-key blocks.
    assert row["masked_blocks"] == (length // tpu_block if "tpu" in row["benchmark"]
                                    else 2 * length // 128)
  assert [r["fraction"] for r in rows[:4]] == [1.0, 0.556, 0.333, 0.222]


def test_backward_sweep_arms_parse_into_flash_options():
  arms = attention._bwd_arms("64x64x4x2,32x128x4x3x128x32,64x128x8x2xatomic")
  assert arms == (
      dict(block_q_bwd=64, block_kv_bwd=64, num_warps_bwd=4, num_stages_bwd=2),
      dict(block_q_bwd=32, block_kv_bwd=128, num_warps_bwd=4, num_stages_bwd=3,
           block_q_dq=128, block_kv_dq=32),
      dict(block_q_bwd=64, block_kv_bwd=128, num_warps_bwd=8, num_stages_bwd=2,
           dq_atomic=True))
  assert attention.GPU_BWD_SWEEP[0] == arms[0]  # the default comes first
  with pytest.raises(argparse.ArgumentTypeError, match="want 4 or 6 numbers"):
    attention._bwd_arms("64x64x4")


def test_the_step_benchmark_takes_the_sweeps_fastest_backward_options(tmp_path):
  """benchmarks.gpu_step --tuned: the fastest forward + backward arm of a device sweep,
  as attention_options a ModelConfig accepts."""
  import json

  from benchmarks import gpu_step
  from posttrain import models
  rows = [dict(benchmark="sweep fwd", implementation="flash block_q=64", time_ms=1.0),
          dict(benchmark="sweep fwd+bwd", implementation="flash block_q=128,dq_atomic=True",
               time_ms=9.5),
          dict(benchmark="sweep fwd+bwd", implementation="flash block_q=128,block_q_bwd=32,"
               "block_kv_bwd=128,block_q_dq=128,block_kv_dq=32", time_ms=8.25),
          dict(benchmark="sweep fwd+bwd", implementation="flash num_warps_bwd=2",
               time_ms=None, note="failed: out of shared memory")]
  path = tmp_path / "attention.json"
  path.write_text(json.dumps(rows))
  options = gpu_step.best_sweep_options(str(path))
  assert options == "block_q=128,block_q_bwd=32,block_kv_bwd=128,block_q_dq=128,block_kv_dq=32"
  cfg = gpu_step.model_config(True, "flash").replace(attention_options=options)
  assert cfg.flash_options["block_kv_dq"] == 32
  rows[1]["time_ms"] = 1.5  # dq_atomic=True (Python's spelling) parses too
  path.write_text(json.dumps(rows))
  assert models.config.parse_attention_options(gpu_step.best_sweep_options(str(path))) == dict(
      block_q=128, dq_atomic=True)
  assert gpu_step.best_sweep_options(str(tmp_path / "missing.json")) is None
