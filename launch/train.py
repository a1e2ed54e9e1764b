"""Train: `python -m launch.train --config=configs/default.py --workdir=DIR [--config.k=v]`.

Several processes (one per host): the same command on every host, plus either
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`, the environment
variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or nothing on a
TPU pod slice or SLURM job (detected); see posttrain/distributed.py.
"""

import logging

from absl import app, flags
from ml_collections import config_flags

from launch import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")
_PROCESSES = common.define_process_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  import jax

  from posttrain import experiment, reward_trainer, trainer
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  log = logging.getLogger("posttrain")
  try:
    # Before anything touches the devices: the mesh then spans every host's devices.
    common.join_processes(_PROCESSES)
    config = _CONFIG.value
    experiment.check_config(config)
    cache = experiment.enable_compile_cache(config)
    if cache:
      log.info("compilation cache: %s", cache)
    log.info("devices: %s", jax.devices())
    log.info("config:\n%s", config)
    mesh = experiment.build_mesh(config)
    log.info("mesh: %s", dict(mesh.shape))
    if experiment.objective(config) == "reward_model":
      summary = reward_trainer.train(config, _WORKDIR.value)
    else:
      summary = trainer.train(config, _WORKDIR.value)
  except (ValueError, OSError, KeyError, trainer.NonFiniteLossError,
          trainer.RolloutStalledError) as e:
    common.fail(e)
  log.info("finished: %s", {k: v for k, v in summary.items() if k != "eval"})


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
