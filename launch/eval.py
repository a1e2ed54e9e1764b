"""Evaluate a checkpoint on held-out seeds and write DIR/eval/step_N/ (report.json, report.md,
timing.json, plots):

    python -m launch.eval --config=configs/default.py --workdir=DIR [--step=N]
        [--domains=GLOB,...] [--samples=K] [--seeds_per_domain=N] [--baseline_step=M]
        [--seed=S] [--confidence=0.95] [--config.k=v]

`--initial` evaluates the weights the run starts from (`--config.init_from=HF_FOLDER`, say)
before any training, into DIR/eval/initial/: a base model on your task files, e.g.
`--config.tasks.files=test.jsonl --domains=jsonl/test --initial`.

A model too big for one host: the same command on every host, with
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`, the environment
variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or nothing on a TPU
pod slice or SLURM job (detected). The mesh spans every host; process 0 writes the report.
"""

import logging

from absl import app, flags
from ml_collections import config_flags

from launch import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (checkpoints/ inside).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_DOMAINS = flags.DEFINE_string("domains", None, "Comma-separated domain globs (default: the "
                               "config's tasks.domains and tasks.levels).")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per task at the rollout temperature, "
                                "for pass@k and maj@k (0: greedy only).")
_SEEDS = flags.DEFINE_integer("seeds_per_domain", None, "Held-out seeds per domain (default: "
                              "config.eval.seeds_per_domain).")
_BASELINE = flags.DEFINE_integer("baseline_step", None, "Compare with this checkpoint and flag "
                                 "domains that got worse beyond noise.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_INITIAL = flags.DEFINE_bool("initial", False, "Evaluate the weights the run starts from "
                             "(the config's init_from: a Hugging Face folder, an earlier run, "
                             "or random) instead of a checkpoint: a baseline before training; "
                             "writes WORKDIR/eval/initial/.")
_CONFIDENCE = flags.DEFINE_float("confidence", 0.95, "Level of the regression intervals.")
_PROCESSES = common.define_process_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  import jax

  from posttrain import evaluation, experiment
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  log = logging.getLogger("posttrain")
  try:
    common.join_processes(_PROCESSES)  # before anything touches the devices
    cache = experiment.enable_compile_cache(_CONFIG.value)
    if cache:
      log.info("compilation cache: %s", cache)
    log.info("devices: %s", jax.devices())
    report, timing = evaluation.evaluate_checkpoint(
        _CONFIG.value, _WORKDIR.value, step=_STEP.value, domains=_DOMAINS.value,
        samples=_SAMPLES.value, seeds_per_domain=_SEEDS.value, baseline_step=_BASELINE.value,
        seed=_SEED.value, confidence=_CONFIDENCE.value, initial=_INITIAL.value)
  except (ValueError, OSError, KeyError) as e:
    common.fail(e)
  o = report["overall"]
  where = "initial" if _INITIAL.value else f"step_{report['step']}"
  log.info("%s: %d tasks, greedy pass@1 %.3f%s%s; %.1f s; wrote %s/eval/%s",
           where.replace("_", " "), o["tasks"], o["greedy_pass_rate"],
           "".join(f", pass@{k} {v:.3f}" for k, v in o.get("pass_at_k", {}).items()),
           "".join(f", maj@{k} {v:.3f}" for k, v in o.get("maj_at_k", {}).items()),
           timing["total_s"], _WORKDIR.value, where)
  if "regression" in report:
    log.info("regressed vs step %d: %s", _BASELINE.value,
             ", ".join(report["regression"]["regressed"]) or "none")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
