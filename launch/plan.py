"""Plan memory: `python -m launch.plan --config=configs/x.py [--device_memory_gb=95]
[--num_devices=N] [--kv_cache_dtype=int8] [--compile_for=v5p:2x4x4] [--config.k=v]`.

Prints bytes per device of params, optimizer state, gradients, activations and the KV
cache for the config's mesh, whether they fit, and which knob to turn. Allocates nothing
and needs no accelerator: a v5p-256 mesh plans on a laptop. Exits 1 when it does not fit.

`--compile_for=TOPOLOGY` (needs libtpu: `pip install -e '.[tpu]'`) also compiles the RL
update and the sampler's prefill and decode for that TPU slice on this host, as the
trainer builds them, and prints what XLA says one device needs beside the plan; it fails
here if a program cannot compile for the slice. Topologies are named generation:chips,
e.g. v5p:2x4x4 (32 chips), v5e:16x16 (256), v6e:4x4.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from launch import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file.", lock_config=True)
_MEMORY = flags.DEFINE_float("device_memory_gb", 95.0,
                             "Memory of one device in GiB (v5p 95, v5e 16, H100 ~79).")
_DEVICES = flags.DEFINE_integer("num_devices", None,
                                "Devices in the run (default: placement.devices, else the "
                                "mesh product, else the local device count for a -1 axis).")
_KV_DTYPE = flags.DEFINE_enum("kv_cache_dtype", None, ["int8", "bfloat16", "float16", "float32"],
                              "Sampler cache dtype (default: the model's compute dtype).")
_COMPILE_FOR = flags.DEFINE_string(
    "compile_for", None, "A TPU topology (e.g. v5p:2x4x4) to compile the RL update and the "
    "rollout for, ahead of time on this host; needs libtpu.")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # The table is the output.
  from posttrain import planner
  try:
    p = planner.plan(_CONFIG.value, device_memory_gb=_MEMORY.value, num_devices=_DEVICES.value,
                     kv_cache_dtype=_KV_DTYPE.value)
  except (ValueError, KeyError, OSError) as e:
    common.fail(e)
  print(planner.format_plan(p), flush=True)
  fits = p.fits
  if _COMPILE_FOR.value and p.placement == "reward_model":
    common.fail(ValueError("--compile_for compiles a policy run's update and sampler; a "
                           "reward-model run is planned, not compiled"))
  if _COMPILE_FOR.value:
    from posttrain import aot
    topology = _COMPILE_FOR.value
    train_resident, rollout_resident = planner.resident_outside_programs(p, _CONFIG.value)
    try:
      devices = aot.tpu_devices(topology)
      report = aot.compile_rl_step(_CONFIG.value, devices, topology=topology)
      print(aot.format_report(report, p.train_peak, train_resident), flush=True)
      rollout = aot.compile_rollout(_CONFIG.value, devices)
      print(aot.format_rollout(rollout, p.rollout_peak, rollout_resident), flush=True)
    except aot.CompileError as e:
      print(f"does not compile for {topology}: {e}", flush=True)
      sys.exit(1)
    except (ValueError, KeyError) as e:
      common.fail(e)
    peak = max(report.peak + train_resident[0],
               max(rollout.prefill_peak, rollout.decode_peak) + rollout_resident[0])
    if p.capacity is not None and peak > p.capacity:
      print(f"does not fit: the compiled peak exceeds the {planner.human_bytes(p.capacity)} "
            "a device may use", flush=True)
      fits = False
  sys.exit(0 if fits else 1)


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
