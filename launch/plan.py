"""Plan memory: `python -m launch.plan --config=configs/x.py [--device_memory_gb=95]
[--num_devices=N] [--kv_cache_dtype=int8] [--config.k=v]`.

Prints bytes per device of params, optimizer state, gradients, activations and the KV
cache for the config's mesh, whether they fit, and which knob to turn. Allocates nothing
and needs no accelerator: a v5p-256 mesh plans on a laptop. Exits 1 when it does not fit.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file.", lock_config=True)
_MEMORY = flags.DEFINE_float("device_memory_gb", 95.0,
                             "Memory of one device in GiB (v5p 95, v5e 16, H100 80).")
_DEVICES = flags.DEFINE_integer("num_devices", None,
                                "Devices in the run; fills a -1 mesh axis (default: the mesh "
                                "product, or the local device count for a -1 axis).")
_KV_DTYPE = flags.DEFINE_enum("kv_cache_dtype", None, ["int8", "bfloat16", "float16", "float32"],
                              "Sampler cache dtype (default: the model's compute dtype).")
flags.mark_flags_as_required(["config"])


def _fail(e: BaseException):
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  if isinstance(e, KeyError):
    msg = f"unknown config key {lines[-1] if lines else e}"
  else:
    msg = next((ln for ln in lines if "No such file" in ln), lines[-1] if lines else repr(e))
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - config_flags raises several kinds.
    _fail(e.__cause__ or e)


def main(argv):
  del argv
  from posttrain import planner
  try:
    p = planner.plan(_CONFIG.value, device_memory_gb=_MEMORY.value, num_devices=_DEVICES.value,
                     kv_cache_dtype=_KV_DTYPE.value)
  except (ValueError, KeyError) as e:
    _fail(e)
  print(planner.format_plan(p), flush=True)
  sys.exit(0 if p.fits else 1)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
