"""KTO step: the reference point from forward passes against the KL sequences in the backward.

    python -m benchmarks.kto [--steps 10]

KTO's reference point z0 needs the policy's and the reference's log-probs of mismatched
prompt-completion sequences, as many tokens as the examples themselves, but no gradient.
Our step computes it with forward passes over the whole batch before the micro-batches
(`train_step.make_preference_step` with `PreferenceConfig("kto")`). The naive path puts
those sequences through the update's forward and backward with the examples, a DPO step
over pairs (example, mismatched sequence), the same tokens. The third arm, APO-zero
unpaired, reads no mismatched sequences: the floor.

Config: models.get_preset("bench") (4 layers, d_model 256, 4.2M parameters), one device,
16 examples of a 32-token prompt and a 64-token completion (rows of 96 tokens, nothing
padded), the reference inside the update program, AdamW at 1e-5. The arms run in turn,
round by round, after one compiling step each; figures are medians (min-max) of the warm
steps, host packing excluded.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from posttrain import models
from posttrain.rl import kto, preference
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts

EXAMPLES, PROMPT_LEN, COMPLETION_LEN = 16, 32, 64
ROW_LEN = PROMPT_LEN + COMPLETION_LEN


def examples(seed: int, vocab_size: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  prompts = rng.integers(1, vocab_size, (EXAMPLES, PROMPT_LEN)).astype(np.int32)
  completions = rng.integers(1, vocab_size, (EXAMPLES, COMPLETION_LEN)).astype(np.int32)
  return [dict(prompt_tokens=p, completion_tokens=c, label=bool(i % 2))
          for i, (p, c) in enumerate(zip(prompts, completions))]


def kto_batch(items, with_kl: bool):
  return kto.pack_examples(items, ROW_LEN, rows_per_microbatch=EXAMPLES, with_kl=with_kl)


def naive_batch(items):
  """Each example against its mismatched sequence (the previous example's completion after
  its prompt), as a pair: both through the forward and backward pass."""
  pairs = [dict(prompt_tokens=x["prompt_tokens"], chosen_tokens=x["completion_tokens"],
                rejected_tokens=items[i - 1]["completion_tokens"])
           for i, x in enumerate(items)]
  return preference.pack_pairs(pairs, ROW_LEN, rows_per_microbatch=EXAMPLES)


ARMS = {
    "kto: z0 from forward passes": (preference.PreferenceConfig("kto"),
                                    lambda items: kto_batch(items, True)),
    "naive: KL sequences through the backward": (preference.PreferenceConfig("sigmoid"),
                                                 naive_batch),
    "apo_zero_unpaired: no KL sequences": (
        preference.PreferenceConfig("apo_zero_unpaired"), lambda items: kto_batch(items, False)),
}


def run(quick: bool = False, steps: int | None = None) -> list[dict]:
  """One row per arm: median step time (min-max) and its ratio to the naive arm."""
  steps = steps or (3 if quick else 10)
  cfg = models.get_preset("bench")
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  optimizer = state_lib.make_optimizer(1e-5, warmup=0, total_steps=1000)
  runners, times = {}, {name: [] for name in ARMS}
  for name, (pref_cfg, pack) in ARMS.items():
    state = state_lib.init_train_state(models.create_model(cfg, mesh=mesh), optimizer,
                                       mesh=mesh)
    step = ts.make_preference_step(cfg, pref_cfg, optimizer, mesh=mesh,
                                   reference_in_step=True)
    runners[name] = {"state": state, "reference": state_lib.frozen_copy(state.params),
                     "step": step, "pack": pack}

  def timed_step(name: str, seed: int) -> float:
    r = runners[name]
    batch = r["pack"](examples(seed, cfg.vocab_size))
    start = time.perf_counter()
    r["state"], metrics = r["step"](r["state"], batch, r["reference"])
    jax.block_until_ready((r["state"].params, metrics))
    return time.perf_counter() - start

  for name in ARMS:
    timed_step(name, 0)  # compiles
  for seed in range(1, steps + 1):
    for name in ARMS:
      times[name].append(timed_step(name, seed))
  naive = float(np.median(times["naive: KL sequences through the backward"]))
  return [{"arm": name, "step_ms": round(1e3 * float(np.median(t)), 1),
           "min_ms": round(1e3 * min(t), 1), "max_ms": round(1e3 * max(t), 1),
           "over_naive": round(float(np.median(t)) / naive, 2), "steps": steps,
           "tokens_per_step": 2 * EXAMPLES * ROW_LEN}
          for name, t in times.items()]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=10, help="warm steps per arm")
  args = parser.parse_args()
  print(f"{'arm':45s} {'step ms (min-max)':>22s} {'x naive':>8s}")
  for row in run(steps=args.steps):
    print(f"{row['arm']:45s} {row['step_ms']:9.1f} ({row['min_ms']}-{row['max_ms']}) "
          f"{row['over_naive']:8.2f}")
  print(f"({2 * EXAMPLES * ROW_LEN} tokens per step, examples and mismatched sequences; "
        f"{args.steps} warm steps per arm; jax {jax.__version__}, "
        f"{jax.devices()[0].platform})")


if __name__ == "__main__":
  main()
