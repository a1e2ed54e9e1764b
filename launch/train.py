"""Train: `python -m launch.train --config=configs/default.py --workdir=DIR [--config.k=v]`."""

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")
flags.mark_flags_as_required(["config", "workdir"])


def _fail(e: BaseException):
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  if isinstance(e, KeyError):
    msg = f"unknown config key {lines[-1] if lines else e}"
  else:
    msg = next((ln for ln in lines if "No such file" in ln), lines[-1] if lines else repr(e))
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv):
  """absl flag parsing with config errors (unknown key, bad value) as one line."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - config_flags raises several kinds.
    _fail(e.__cause__ or e)


def main(argv):
  del argv
  import jax

  from posttrain import trainer
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  log = logging.getLogger("posttrain")
  try:
    config = _CONFIG.value
    log.info("devices: %s", jax.devices())
    log.info("config:\n%s", config)
    mesh = trainer.build_mesh(config)
    log.info("mesh: %s", dict(mesh.shape))
    summary = trainer.train(config, _WORKDIR.value)
  except (ValueError, OSError, KeyError, trainer.NonFiniteLossError) as e:
    _fail(e)
  log.info("finished: %s", {k: v for k, v in summary.items() if k != "eval"})


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
