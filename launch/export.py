"""Write a run's checkpoint as a Hugging Face folder (`posttrain.export`):

    python -m launch.export --config=configs/default.py --workdir=DIR --out=OUT [--step=N]
        [--dtype=bfloat16] [--adapter] [--max_shard_gb=4] [--config.k=v]

A policy run is written as its *ForCausalLM, a reward-model run as its
*ForSequenceClassification, LoRA adapters merged; `--adapter` writes them alone as a PEFT
adapter folder (over the weights the run started from: refused past an SFT or preference
stage whose adapters the run folded into its base before the next). Pass the config (and overrides) the run was trained with. One process
restores the whole checkpoint, whatever mesh wrote it; a model too big for one host's
memory is exported by the same command on every host (`--coordinator_address=HOST:PORT
--num_processes=N --process_id=I`, the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID environment variables, or nothing on a TPU pod slice or SLURM job): each
restores its shards and process 0 writes the files.
"""

import logging

from absl import app, flags
from ml_collections import config_flags

from launch import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (checkpoints/ inside).")
_OUT = flags.DEFINE_string("out", None, "The folder to write.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "Tensor dtype of the merged weights (default: the model's).")
_ADAPTER = flags.DEFINE_bool("adapter", False, "Write the LoRA adapters alone (PEFT format); "
                             "refused past a stage whose adapters were folded into the base.")
_MAX_SHARD_GB = flags.DEFINE_float("max_shard_gb", 4.0, "Largest safetensors file, in GB.")
_PROCESSES = common.define_process_flags()
flags.mark_flags_as_required(["config", "workdir", "out"])


def main(argv):
  del argv
  from posttrain.export import export_checkpoint
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  if not _MAX_SHARD_GB.value > 0:
    common.fail(ValueError(f"--max_shard_gb={_MAX_SHARD_GB.value} must be > 0"))
  try:
    common.join_processes(_PROCESSES)  # before anything touches the devices
    done = export_checkpoint(_CONFIG.value, _WORKDIR.value, _OUT.value, step=_STEP.value,
                             dtype=_DTYPE.value, adapter=_ADAPTER.value,
                             max_shard_bytes=int(_MAX_SHARD_GB.value * (1 << 30)))
  except (ValueError, OSError, KeyError) as e:
    common.fail(e)
  print(f"wrote checkpoint {done['step']} as {done['architecture']}"
        f"{' (LoRA adapter)' if done['adapter'] else ''} to {done['out']}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
