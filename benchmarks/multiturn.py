"""Multi-turn rollouts streamed through the cache against the chunks they ran in before.

    python -m benchmarks.multiturn [--quick] [--fit]

(`--fit`: a cache row for every row, so nothing waits for a slot.)

A tool domain answers each of a sample's turns twice ("=<n>", masked out of the loss),
then ends it: 3 model turns a sample. The policy is the sampler benchmark's model shape
(4 layers, d_model 256) over the byte tokenizer's vocabulary, random weights; a turn ends
at one of 17 stop ids (1/16 of the vocabulary) or at `new` tokens, so turn lengths
spread. GRPO rows (prompts x 4 samples) run through a KV cache of `slots` rows in the
`RolloutWorker`, two ways:

- chunks (`continuous=False`): `slots` rows at a time, turn by turn; each turn's call runs
  as long as its longest row, then the environment answers and the next turn prefills
  every transcript again;
- streamed, prefilled whole (`reuse_cache=False`): one sampler call; a row whose turn
  ended gets the answer between two rounds of decode steps and its transcript comes back
  as its next turn, prefilled whole into the first free slot, while the others decode;
- streamed (the default): the same, but the next turn goes on in its row's slot: only
  the answer is prefilled, against the cache the turn built.

Reports the first rollout's wall time (it compiles) and the programs compiled by the
end, then the median rollout wall time over repeats after `WARMUP` rollouts (the arms
take turns; a refill's shape follows its rows' transcript lengths, so the streamed arm
keeps meeting new shapes for a few rollouts), generated tokens per second, sampler calls
and decode occupancy (generated tokens / decoded row-steps).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

from benchmarks.continuous import print_markdown
from benchmarks.sampler import bench_config
from posttrain import models, tasks
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rollout import RolloutWorker
from posttrain.sampling import Sampler

CASE = (32, 4, 32, 48)  # prompts, samples each, slots, new tokens a turn at most
QUICK_CASE = (8, 4, 8, 24)
TURNS = 3
WARMUP = 4
ARMS = ("chunks", "streamed, prefilled whole", "streamed")


class _StopRich(ByteTokenizer):
  """Byte tokenizer whose turns also end at 16 byte ids: lengths spread like RL's."""

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return tuple(super().stop_ids) + tuple(range(16, 256, 16))


class _ToolDomain(tasks.Domain):
  """Answers every turn twice, then ends the sample."""

  def _sample(self, rng, seed):
    return tasks.Task(self.name, seed, f"Compute {seed} with the tool.", str(seed), level=1,
                      family=self.family)

  def _score(self, task, completion):
    return tasks.Reward(0.0, {"exact": 0.0}, "scored")

  def step(self, task, text):
    if text.count("\n=") >= TURNS - 1:
      return tasks.StepResult(observation=None, done=True)
    return tasks.StepResult(observation=f"={len(text)}", done=False)


def measure(prompts: int, samples: int, slots: int, new: int, repeats: int = 3) -> list[dict]:
  tok = _StopRich()
  domain = _ToolDomain("benchtool/calc_l1", "benchtool", 1)
  tasks.registry.register(domain, replace=True)
  workers: dict[str, RolloutWorker] = {}
  try:
    cfg = bench_config().replace(vocab_size=tok.vocab_size)
    calls = {"n": 0}
    for name in ARMS:  # a sampler each: their own compiled programs
      sampler = Sampler(models.create_model(cfg, seed=0), max_len=64 + TURNS * (new + 8))
      real = sampler.generate
      if name == "streamed, prefilled whole":
        real = functools.partial(real, reuse_cache=False)
      sampler.generate = lambda *a, _real=real, **k: (
          calls.__setitem__("n", calls["n"] + 1), _real(*a, **k))[1]
      workers[name] = RolloutWorker(sampler, tok, group_size=samples, max_new_tokens=new,
                                    temperature=1.0, chunk_rows=slots, max_turns=TURNS,
                                    continuous=name != "chunks")
    pairs = [(domain.name, s) for s in range(prompts)]
    runs = {name: [] for name in workers}
    first = {}
    for rep in range(WARMUP + repeats):
      for name, worker in workers.items():
        calls["n"] = 0
        t = time.perf_counter()
        groups = worker.rollout(pairs, seed=rep)
        wall = time.perf_counter() - t
        first.setdefault(name, wall)
        samples_ = [s for g in groups for s in g.samples]
        tokens = sum(sum(s.response_mask) for s in samples_)
        turns = statistics.mean(s.turns for s in samples_)
        if rep >= WARMUP:
          runs[name].append((wall, tokens, calls["n"], turns,
                             worker.last_stats.get("decode_occupancy", 0.0),
                             worker.last_stats.get("reused_prefix_fraction", 0.0)))
  finally:
    for worker in workers.values():
      worker.close()
    tasks.registry.unregister(domain.name)
  base = statistics.median(r[0] for r in runs["chunks"])
  out = []
  for name, rs in runs.items():
    wall = statistics.median(r[0] for r in rs)
    tokens = statistics.median(r[1] for r in rs)
    out.append({"arm": name, "first rollout s": round(first[name], 1),
                "programs": workers[name].sampler.num_compiles,
                "rollout s": round(wall, 3),
                "vs chunks": f"{base / wall:.2f}x",
                "tokens/s": round(tokens / wall), "model tokens": int(tokens),
                "turns/sample": round(statistics.median(r[3] for r in rs), 2),
                "sampler calls": int(statistics.median(r[2] for r in rs)),
                "occupancy": f"{statistics.median(r[4] for r in rs):.0%}",
                "later turns from cache": f"{statistics.median(r[5] for r in rs):.0%}"})
  return out


def run(quick: bool, fit: bool = False) -> list[dict]:
  return measure(*_case(quick, fit), repeats=2 if quick else 3)


def _case(quick: bool, fit: bool) -> tuple[int, int, int, int]:
  prompts, samples, slots, new = QUICK_CASE if quick else CASE
  return prompts, samples, prompts * samples if fit else slots, new


def main(argv: list[str]) -> None:
  quick, fit = "--quick" in argv, "--fit" in argv
  prompts, samples, slots, new = _case(quick, fit)
  print(f"{prompts * samples} rows ({prompts} prompts x {samples}), {slots} cache rows, "
        f"{TURNS} turns of up to {new} new tokens:")
  print_markdown(run(quick, fit))


if __name__ == "__main__":
  main(sys.argv[1:])
