"""Disaggregated (asynchronous) vs colocated RL steps on 8 fake CPU devices.

    python -m benchmarks.async_overlap [--quick] [--max_new_tokens=128]

Both runs: the same tiny policy from random weights (no SFT), GRPO on a few domains with a
long-tail completion length (an untrained policy stops at random, up to max_new_tokens).
At 128 new tokens the colocated rollout and update cost about the same. Colocated: all 8
devices sample, then train. Disaggregated: 4 devices sample while 4 train, one policy
version apart. Reports the median wall time per RL step after warm-up, the ratio, the
fraction of the disaggregated step the learner waits for rollouts, and two bounds on what
any overlap could reach on this machine: the slower side alone (perfect overlap), and the
colocated step's process CPU seconds spread over this machine's cores (the fake devices
share the host's cores, so the two sides cannot run faster together than that).
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import statistics  # noqa: E402
import tempfile  # noqa: E402

from configs import default  # noqa: E402
from posttrain import trainer  # noqa: E402
from posttrain.metrics import read_metrics  # noqa: E402

WARMUP = 2


def _config(steps: int, disaggregated: bool, max_new_tokens: int = 128):
  c = default.get_config()
  c.sft.steps = 0
  c.train.rl_steps = steps
  c.eval.seeds_per_domain = 0
  c.checkpoint.every = 1000
  c.tasks.domains = "arithmetic/add_d1,strings/count_l1,logic/parity_l1"
  c.rollout.prompts_per_step = 16
  c.rollout.max_new_tokens = max_new_tokens
  # A prompt plus 128 new tokens fits one 192-token row; at the default's 256 the rows
  # would still hold one sequence each, with more padding.
  c.train.row_len = 192
  c.train.log_every = 1
  if disaggregated:
    c.placement.mode = "disaggregated"
    c.placement.rollout_devices = 4
    c.placement.max_policy_lag = 1
  return c


def _measure(disaggregated: bool, steps: int, max_new_tokens: int = 128) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train(_config(steps, disaggregated, max_new_tokens), workdir)
    rows = [r for r in read_metrics(workdir) if "timing/step_s" in r][WARMUP:]
  median = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
  step, wait = median("timing/step_s"), median("timing/wait_for_rollout_s")
  return {"placement": "disaggregated 4+4" if disaggregated else "colocated 8",
          "steps_timed": len(rows), "step_s_median": round(step, 3),
          # What the two sides cost (in the disaggregated run they overlap).
          "rollout_s_median": round(median("timing/rollout_s"), 3),
          "update_s_median": round(median("timing/update_s") + median("timing/reference_s"),
                                   3),
          "wait_for_rollout_s_median": round(wait, 3),
          # Host cores busy during a step (process CPU seconds / wall seconds).
          "cores_busy": round(median("host/cpu_s") / step, 2),
          "cpu_s_median": round(median("host/cpu_s"), 3),
          "wait_fraction": round(wait / step, 3) if disaggregated else None}


def run(quick: bool = False, max_new_tokens: int = 128) -> list[dict]:
  steps = 6 if quick else 12
  co = _measure(False, steps, max_new_tokens)
  dis = _measure(True, steps, max_new_tokens)
  dis["vs_colocated"] = round(dis["step_s_median"] / co["step_s_median"], 3)
  co["vs_colocated"] = 1.0
  # What any overlap could reach here. Perfect overlap: the slower side alone. Host-bound:
  # the colocated step's CPU seconds spread over every core of this machine.
  cores = len(os.sched_getaffinity(0))
  co["bound_perfect_overlap"] = round(
      max(co["rollout_s_median"], co["update_s_median"]) / co["step_s_median"], 3)
  co["bound_host_cores"] = round(co["cpu_s_median"] / cores / co["step_s_median"], 3)
  return [co, dis]


def print_rows(rows: list[dict]) -> None:
  """One line of keys, then one of values per row, separated by ' | '."""
  keys = list(dict.fromkeys(k for r in rows for k in r))
  print(" | ".join(keys))
  for r in rows:
    print(" | ".join(str(r.get(k)) for k in keys))


def main(argv):
  tokens = [int(a.split("=", 1)[1]) for a in argv if a.startswith("--max_new_tokens=")]
  print_rows(run(quick="--quick" in argv, max_new_tokens=tokens[-1] if tokens else 128))


if __name__ == "__main__":
  main(sys.argv[1:])
