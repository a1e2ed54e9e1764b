"""Plan memory: `python -m launch.plan --config=configs/x.py [--device_memory_gb=95]
[--num_devices=N] [--kv_cache_dtype=int8] [--config.k=v]`.

Prints bytes per device of params, optimizer state, gradients, activations and the KV
cache for the config's mesh, whether they fit, and which knob to turn. Allocates nothing
and needs no accelerator: a v5p-256 mesh plans on a laptop. Exits 1 when it does not fit.
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
  sys.exit(0 if p.fits else 1)


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
