"""aot: the trainer's RL update compiled for a TPU slice on this CPU host (libtpu)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from configs import default
from posttrain import aot, experiment, planner
from tests.tpu_aot import requires_libtpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLASH_FSDP4 = {"model.overrides.attention_impl": "flash", "mesh.fsdp": 4}


def _config():
  c = default.get_config()
  c.update_from_flattened_dict(FLASH_FSDP4)
  return c


def _plan(*args):
  # Layers scanned, as the shipped TPU configs run them.
  return subprocess.run(
      [sys.executable, "-m", "launch.plan", "--config=configs/default.py", "--num_devices=4",
       "--device_memory_gb=16", *[f"--config.{k}={v}" for k, v in FLASH_FSDP4.items()],
       "--config.model.overrides.scan_layers=true", *args], cwd=ROOT, capture_output=True,
      text=True, timeout=600)


@pytest.fixture(scope="module")
def rl_report():
  return aot.compile_rl_step(_config(), aot.tpu_devices("v5e:2x2"), topology="v5e:2x2")


@pytest.fixture(scope="module")
def rollout_report():
  return aot.compile_rollout(_config(), aot.tpu_devices("v5e:2x2"))


@pytest.mark.slow
@requires_libtpu
def test_rl_update_compiles_for_a_v5e_slice_with_flash_kernels(rl_report):
  config, report = _config(), rl_report
  assert report.mesh == {"data": 1, "fsdp": 4, "tensor": 1, "sequence": 1}
  layers = int(config.model.overrides.num_layers)
  # forward, dq and dk/dv kernels per layer, all in the program (not interpreted)
  assert report.mosaic_kernels >= 3 * layers
  # The arguments are the sharded train state and the batch: at least their logical
  # bytes per device (TPU tiles pad small arrays, so not exactly).
  params, opt = planner.state_bytes(experiment.model_config(config),
                                    report.mesh, clip=bool(config.optim.get("clip")))
  assert params + opt <= report.arguments <= 4 * (params + opt) + (1 << 20)
  assert report.aliased > 0  # the donated state is updated in place
  assert report.peak == (report.arguments + report.outputs - report.aliased
                         + report.temporaries)


@requires_libtpu
def test_rollout_programs_compile_for_a_v5e_slice(rollout_report):
  config, report = _config(), rollout_report
  r = config.rollout
  assert report.rows == planner.sampler_batch(config, int(config.rl.group_size), 4)
  assert not report.continuous  # the cache holds all of the step's rows: one call
  assert report.prompt_len + report.max_new_tokens == int(r.max_len)
  # The decode program holds the KV cache (donated, updated in place) and the params.
  cache = planner.kv_cache_bytes(experiment.model_config(config), batch=report.rows,
                                 max_len=int(r.max_len), mesh=planner.abstract_mesh(
                                     report.mesh))
  assert cache <= report.decode_peak <= 4 * cache + (16 << 20)
  assert report.prefill_peak > 0
  # The plan does not undercount the compiled rollout: with what the device holds
  # outside the programs, XLA's peak is within the planned one (before the plan counted
  # the prefill, XLA needed 1.27x it here).
  plan = planner.plan(config, num_devices=4)
  resident = planner.resident_outside_programs(plan, config)[1][0]
  assert max(report.prefill_peak, report.decode_peak) + resident <= plan.rollout_peak


@pytest.mark.slow
@requires_libtpu
@pytest.mark.parametrize("turns,slots", [(1, 64), (3, 64), (3, 256)])
def test_streamed_rollout_programs_compile_within_the_plan(turns, slots):
  """With fewer cache rows than the step's rows, the worker streams them (continuous
  batching): the fill, decode loop and refill compile for the slice (multi-turn: a
  refill of transcripts up to max_len - 1 tokens, and the widest call that continues
  a turn in its slot), the decode holds the slots' cache, and the plan (which counts
  chunk_rows rows of cache) covers them. Multi-turn rows that fit the cache (256 of
  256) run in rounds too. head_dim 128, as real models have it: the preset's 32 pads 4x
  in TPU tiles, which the plan (logical bytes) does not count."""
  config = _config()
  config.rollout.chunk_rows = slots
  config.rollout.max_turns = turns
  config.model.overrides.head_dim = 128
  report = aot.compile_rollout(config, aot.tpu_devices("v5e:2x2"))
  assert report.continuous and report.rows == slots
  cache = planner.kv_cache_bytes(experiment.model_config(config), batch=slots,
                                 max_len=int(config.rollout.max_len),
                                 mesh=planner.abstract_mesh(report.mesh))
  assert cache <= report.decode_peak <= 4 * cache + (16 << 20)
  plan = planner.plan(config, num_devices=4)
  resident = planner.resident_outside_programs(plan, config)[1][0]
  assert max(report.prefill_peak, report.decode_peak) + resident <= plan.rollout_peak
  assert f"{slots} slots (continuous batching)" in aot.format_rollout(report)


@pytest.mark.slow  # the RL step's TPU compile alone takes about a minute on 2 cores
@requires_libtpu
def test_compiled_peaks_print_against_the_plan(rl_report, rollout_report):
  """What `launch.plan --compile_for` prints after the table (the command itself runs in
  the test below, on a program too big for the chip)."""
  config = _config()
  p = planner.plan(config, num_devices=4)
  train_resident, rollout_resident = planner.resident_outside_programs(p, config)
  out = "\n".join([aot.format_report(rl_report, p.train_peak, train_resident),
                   aot.format_rollout(rollout_report, p.rollout_peak, rollout_resident)])
  assert "compiled for v5e:2x2" in out
  assert "peak per device (XLA)" in out and "compiled / planned" in out
  assert "compiled the rollout" in out and "the plan's rollout peak" in out
  # Colocated: what the device holds outside each program is added before comparing.
  assert out.count("held outside this program") == 2
  ratio = (rl_report.peak + train_resident[0]) / p.train_peak
  assert f"compiled / planned = {ratio:.2f}" in out


@pytest.mark.slow
@requires_libtpu
def test_plan_compile_for_reports_a_program_too_big_for_the_chip():
  done = _plan("--compile_for=v5e:2x2", "--config.train.rows_per_microbatch=4096",
               "--config.train.row_len=4096", "--config.rollout.max_len=4096")
  assert done.returncode == 1
  assert "does not compile for v5e:2x2: RESOURCE_EXHAUSTED" in done.stdout


@requires_libtpu
def test_unknown_topology_is_one_line_error():
  done = _plan("--compile_for=v9z:2x2")
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith("error: TPU topology 'v9z:2x2':")


def test_without_libtpu_the_error_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu -> ImportError
  with pytest.raises(ValueError, match=r"needs libtpu: pip install -e '\.\[tpu\]'"):
    aot.tpu_devices("v5e:2x2")
