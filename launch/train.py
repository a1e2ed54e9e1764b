"""Train: `python -m launch.train --config=configs/default.py --workdir=DIR [--config.k=v]`."""

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  import jax

  from posttrain import trainer
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  config = _CONFIG.value
  log = logging.getLogger("posttrain")
  log.info("devices: %s", jax.devices())
  log.info("config:\n%s", config)
  try:
    mesh = trainer.build_mesh(config)
    log.info("mesh: %s", dict(mesh.shape))
    summary = trainer.train(config, _WORKDIR.value)
  except (ValueError, FileNotFoundError, trainer.NonFiniteLossError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  log.info("finished: %s", {k: v for k, v in summary.items() if k != "eval"})


if __name__ == "__main__":
  app.run(main)
