"""Continuous batching against the chunked static batches the rollout worker ran before.

    python -m benchmarks.continuous [--quick]

A GRPO rollout of many rows, with a KV cache that holds only `slots` of them at once (the
memory a real run has), on the sampler benchmark's model (4 layers, d_model 256, random
weights, prompts of 32 random tokens, 4 samples each). Lengths come from the model: a row
ends at one of `STOP_IDS` (1/64 of the vocabulary), so they spread like RL completions,
most short and a few running to the cap. Three ways to run the same rows:

- static chunks: `generate` on `slots` rows at a time, each call running as long as its
  longest row (`RolloutWorker` with `continuous=False`);
- continuous: one `generate(..., slots=slots)`: a stopped row's slot takes the next prompt;
- one batch: every row at once (a cache `rows / slots` times larger).

Every arm draws the same samples (a row's keys are its prompt's index and its token's; the
chunks pass `row_offset`), so they generate the same tokens. `row-steps` is cache rows x
token steps; `occupancy` = generated tokens / row-steps. Figures are medians of warm
repeats (the compiling call excluded), the arms taking turns within each repeat.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.sampler import bench_config, make_prompts
from posttrain import models
from posttrain.sampling import Sampler

# 16 of 1,024 ids end a row: at temperature 1 the random model stops about every 64 tokens.
STOP_IDS = tuple(range(4, 1024, 64))
TEMPERATURE = 1.0
# (prompts, samples each, slots, new tokens at most)
CASE = (32, 4, 32, 256)
QUICK_CASE = (8, 4, 8, 128)


def measure(prompts: int, samples: int, slots: int, new_tokens: int, repeats: int = 5):
  cfg = bench_config()
  model = models.create_model(cfg, seed=0)
  rows = make_prompts(prompts, samples)
  sampler = Sampler(model, max_len=32 + new_tokens)
  kw = dict(max_new_tokens=new_tokens, temperature=TEMPERATURE, stop_token_ids=STOP_IDS)

  def static(seed):
    outs = [sampler.generate(rows[i:i + slots], seed=seed, row_offset=i, **kw)
            for i in range(0, len(rows), slots)]
    return (sum(int(o.lengths.sum()) for o in outs),
            sum(o.stats["steps"] * o.stats["batch"] for o in outs))

  def continuous(seed):
    out = sampler.generate(rows, seed=seed, slots=slots, **kw)
    return int(out.lengths.sum()), out.stats["steps"] * out.stats["batch"]

  def one_batch(seed):
    out = sampler.generate(rows, seed=seed, **kw)
    return int(out.lengths.sum()), out.stats["steps"] * out.stats["batch"]

  arms = {"static chunks": static, "continuous": continuous, "one batch": one_batch}
  runs = {name: [] for name in arms}
  for rep in range(repeats + 1):
    for name, fn in arms.items():
      t = time.perf_counter()
      tokens, row_steps = fn(rep)
      if rep:  # the first call compiles
        runs[name].append((tokens / (time.perf_counter() - t), tokens, row_steps))
  base = float(np.median([r[0] for r in runs["static chunks"]]))
  out = []
  for name, rs in runs.items():
    tps = float(np.median([r[0] for r in rs]))
    tokens = float(np.median([r[1] for r in rs]))
    row_steps = float(np.median([r[2] for r in rs]))
    out.append({"arm": name, "cache rows": len(rows) if name == "one batch" else slots,
                "tokens/s": round(tps), "vs static": f"{tps / base:.2f}x",
                "tokens": int(tokens), "row-steps": int(row_steps),
                "occupancy": f"{tokens / row_steps:.0%}"})
  return out


def run(quick: bool) -> list[dict]:
  """benchmarks.run's entry."""
  return measure(*(QUICK_CASE if quick else CASE), repeats=3 if quick else 5)


def print_markdown(rows: list[dict]) -> None:
  """The rows as a markdown table (numbers with thousands separators)."""
  print("| " + " | ".join(rows[0]) + " |")
  print("|" + "---|" * len(rows[0]))
  for row in rows:
    print("| " + " | ".join(f"{v:,}" if isinstance(v, (int, float)) else str(v)
                            for v in row.values()) + " |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  prompts, samples, slots, new = QUICK_CASE if args.quick else CASE
  print(f"{prompts * samples} rows ({prompts} prompts x {samples}), {slots} cache rows, "
        f"up to {new} new tokens, stop ids {len(STOP_IDS)}/1024, T={TEMPERATURE}:")
  print_markdown(run(args.quick))


if __name__ == "__main__":
  main()
