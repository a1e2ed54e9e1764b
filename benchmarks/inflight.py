"""In-flight weight swaps in a disaggregated run with streamed (continuously batched)
rollouts, on 8 fake CPU devices.

    python -m benchmarks.inflight [--quick] [--steps=N]

One tiny policy from random weights, GRPO, 16 prompts x 8 samples streamed through 32
cache rows (4 rollout devices sample while 4 train, max_policy_lag 1, weight_swap
in_flight). Arms, one after the other in this process:
  - held: the rollout thread keeps the sampler lock for the whole streamed rollout (what
    a streamed rollout did before it let go between rounds), so the learner's weight
    sync waits for the rollout to end;
  - rounds: the lock is let go between rounds of decode steps (each time an eighth of the
    cache rows has stopped), the default;
  - rounds + segment_tokens=16: rounds also end every 16 decode steps.
Reports medians after warm-up: the RL step, the learner's wait for the sampler lock
(`timing/weight_sync_wait_s`), the rollout, how stale the trained samples were
(`staleness/mean`, policy versions behind the learner) and the swaps that landed
mid-rollout, with the wait and step as ratios to the held arm.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import statistics  # noqa: E402
import tempfile  # noqa: E402

from benchmarks import async_overlap  # noqa: E402
from posttrain import trainer  # noqa: E402
from posttrain.metrics import read_metrics  # noqa: E402
from posttrain.rollout import worker as worker_lib  # noqa: E402

WARMUP = 2


def _config(steps: int, segment_tokens: int):
  c = async_overlap._config(steps, disaggregated=True, max_new_tokens=128)
  c.rollout.chunk_rows = 32  # 128 rows stream through 32 cache rows
  c.placement.weight_swap = "in_flight"
  c.placement.segment_tokens = segment_tokens
  return c


def _measure(name: str, steps: int, *, hold: bool, segment_tokens: int = 0) -> dict:
  real = worker_lib.RolloutWorker.__init__

  def held(self, *a, **k):  # the lock kept for the whole call: no rounds let go
    real(self, *a, **k)
    self._shared = False

  if hold:
    worker_lib.RolloutWorker.__init__ = held
  try:
    with tempfile.TemporaryDirectory() as workdir:
      trainer.train(_config(steps, segment_tokens), workdir)
      rows = [r for r in read_metrics(workdir) if "timing/step_s" in r][WARMUP:]
  finally:
    worker_lib.RolloutWorker.__init__ = real
  median = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
  return {"arm": name, "steps_timed": len(rows),
          "step_s_median": round(median("timing/step_s"), 3),
          "sync_wait_s_median": round(median("timing/weight_sync_wait_s"), 3),
          "sync_copy_s_median": round(median("timing/weight_sync_s"), 3),
          "update_s_median": round(median("timing/update_s"), 3),
          "cpu_s_median": round(median("host/cpu_s"), 3),
          "rollout_s_median": round(median("timing/rollout_s"), 3),
          "staleness_mean": round(statistics.mean(r["staleness/mean"] for r in rows), 3),
          "swaps_per_rollout": round(statistics.mean(r.get("rollout/weight_swaps", 0.0)
                                                     for r in rows), 2),
          "decode_occupancy": round(median("rollout/decode_occupancy"), 3)}


def run(quick: bool = False, steps: int = 0) -> list[dict]:
  steps = steps or (6 if quick else 12)
  arms = [_measure("held", steps, hold=True), _measure("rounds", steps, hold=False),
          _measure("rounds + segment_tokens=16", steps, hold=False, segment_tokens=16)]
  base = arms[0]
  for arm in arms:
    arm["sync_wait_vs_held"] = round(arm["sync_wait_s_median"]
                                     / max(base["sync_wait_s_median"], 1e-9), 3)
    arm["step_vs_held"] = round(arm["step_s_median"] / base["step_s_median"], 3)
  return arms


def main(argv):
  steps = [int(a.split("=", 1)[1]) for a in argv if a.startswith("--steps=")]
  async_overlap.print_rows(run(quick="--quick" in argv, steps=steps[-1] if steps else 0))


if __name__ == "__main__":
  main(sys.argv[1:])
