"""Clip-Cov / KL-Cov steps: the cost of choosing their tokens over the whole batch.

    python -m benchmarks.cov_losses [--steps 10]

`clip_cov` and `kl_cov` pick a few tokens by the covariance of their log-prob and
advantage over the whole batch (a sort of every token), inside the update program before
its micro-batches. The baseline is the same update with PPO's clipped loss (token mean, no
KL), which picks nothing. Both read the learner's `old_logprobs`: with several updates per
rollout batch (the presets' 4 minibatches) every algorithm computes them anyway; with one
update, a covariance loss needs that forward pass where GRPO does not, and the last row
times it (`make_compute_logprobs` over the same batch).

Config: models.get_preset("bench") (4 layers, d_model 256, 4.2M parameters), one device,
the batch of benchmarks.train_step (16 sequences of 32 prompt + 64 response tokens), AdamW.
(The selected share, 2e-2 here, does not change the cost: every token is sorted.) The
arms run in turn, round by round, after one compiling step each; figures are medians
(min-max) of the warm steps, host packing excluded.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.train_step import grpo_batch
from posttrain import models
from posttrain.rl import presets
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts

ARMS = {
    "ppo loss (no selection)": dict(policy_loss="ppo"),
    "clip_cov (selection in the step)": dict(policy_loss="clip_cov", cov_fraction=2e-2),
    "kl_cov (selection in the step)": dict(policy_loss="kl_cov", cov_fraction=2e-2),
}
OLD_LOGPROBS = "old log-prob pass (one update per batch)"


def run(quick: bool = False, steps: int | None = None) -> list[dict]:
  """One row per arm: median step time (min-max) and its ratio to the ppo arm."""
  steps = steps or (3 if quick else 10)
  cfg = models.get_preset("bench")
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  optimizer = state_lib.make_optimizer(1e-5, warmup=0, total_steps=1000)
  compute_logprobs = ts.make_compute_logprobs(cfg, mesh=mesh)
  runners, times = {}, {name: [] for name in (*ARMS, OLD_LOGPROBS)}
  for name, knobs in ARMS.items():
    algo = presets.algorithm_config("grpo", kl_coef=0.0, loss_agg_mode="token_mean", **knobs)
    state = state_lib.init_train_state(models.create_model(cfg, mesh=mesh), optimizer,
                                       mesh=mesh)
    runners[name] = {"state": state, "step": ts.make_train_step(cfg, algo, optimizer,
                                                                mesh=mesh)}
  params = state_lib.frozen_copy(runners[next(iter(ARMS))]["state"].params)

  def batch_for(seed):
    batch = grpo_batch(cfg, seed=seed)
    old = compute_logprobs(params, batch)["logprobs"]
    noise = np.random.default_rng(seed).normal(0, 0.1, old.shape).astype(np.float32)
    return dict(batch, old_logprobs=np.asarray(old) + noise)

  def timed_step(name: str, batch) -> float:
    r = runners[name]
    start = time.perf_counter()
    r["state"], metrics = r["step"](r["state"], batch)
    jax.block_until_ready((r["state"].params, metrics))
    return time.perf_counter() - start

  def timed_logprobs(batch) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compute_logprobs(params, batch)["logprobs"])
    return time.perf_counter() - start

  batch = batch_for(0)
  for name in ARMS:
    timed_step(name, batch)  # compiles
  for seed in range(1, steps + 1):
    batch = batch_for(seed)
    for name in ARMS:
      times[name].append(timed_step(name, batch))
    times[OLD_LOGPROBS].append(timed_logprobs(batch))
  base = float(np.median(times["ppo loss (no selection)"]))
  return [{"arm": name, "step_ms": round(1e3 * float(np.median(t)), 1),
           "min_ms": round(1e3 * min(t), 1), "max_ms": round(1e3 * max(t), 1),
           "over_ppo": round(float(np.median(t)) / base, 2), "steps": steps}
          for name, t in times.items()]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=10, help="warm steps per arm")
  args = parser.parse_args()
  print(f"{'arm':42s} {'ms (min-max)':>22s} {'x ppo step':>11s}")
  for row in run(steps=args.steps):
    print(f"{row['arm']:42s} {row['step_ms']:9.1f} ({row['min_ms']}-{row['max_ms']}) "
          f"{row['over_ppo']:11.2f}")
  print(f"({args.steps} warm steps per arm; jax {jax.__version__}, "
        f"{jax.devices()[0].platform})")


if __name__ == "__main__":
  main()
