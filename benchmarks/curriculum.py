"""Curriculum: RL steps to a target held-out pass rate, learnability vs uniform sampling.

    python -m benchmarks.curriculum [--quick]

One SFT warm start (the tiny policy of configs/default.py) on a mix of domains that it
solves, cannot solve at all, and solves sometimes, then GRPO from that same checkpoint
once per scheduler rule (uniform, learnability), with the same seed, batch and budget.
Every `eval_every` RL steps the greedy pass rate on held-out seeds of the whole mix is
measured. Reported per rule: the pass-rate curve, the first step at which it reaches the
target (SFT pass rate + margin) and the wall time; and the ratio learnability / uniform.
GRPO learns only from groups whose rewards differ, i.e. from the in-between domains, so a
rule that spends its prompts there should need fewer steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import ml_collections

# The mix. Expected after the warm start (measured and printed by every run, not assumed):
# lookups over a handful of cases the policy memorises; multi-digit arithmetic whose
# answers fit the token budget but not the model; and short arithmetic in between.
SOLVED = ("logic/boolexpr_l1", "logic/boolexpr_l2", "bases/hex2dec_l1", "bases/bin2dec_l1")
UNSOLVED = ("arithmetic/add_d5", "arithmetic/sub_d5", "arithmetic/div_d5",
            "bases/hex2dec_l5", "sequences/quad_l5", "lists/sum_l5")
IN_BETWEEN = ("arithmetic/add_d1", "arithmetic/div_d1", "bases/dec2bin_l1", "lists/min_l1",
              "equations/linear_l1", "sequences/arith_l1")
DOMAINS = SOLVED + UNSOLVED + IN_BETWEEN


def base_config(quick: bool) -> ml_collections.ConfigDict:
  """configs/default.py narrowed to the mix, with small RL batches and a fixed budget."""
  from configs import default

  c = default.get_config()
  c.tasks.domains = ",".join(DOMAINS)
  c.tasks.levels = ""
  c.sft.steps = 300
  c.train.rl_steps = 40 if quick else 80
  c.rollout.prompts_per_step = 16
  c.rollout.max_new_tokens = 32
  c.eval.seeds_per_domain = 8
  c.checkpoint.every = 10_000
  c.checkpoint.async_save = False
  c.train.log_every = 1_000_000  # The benchmark prints its own lines.
  return c


def _set(config: ml_collections.ConfigDict, overrides: dict[str, Any]):
  for key, value in overrides.items():
    node = config
    *path, leaf = key.split(".")
    for p in path:
      node = node[p]
    node[leaf] = value


def warm_start(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """SFT only (no RL); returns the held-out evaluation report of the warm-started policy."""
  from posttrain import trainer

  c = ml_collections.ConfigDict(config.to_dict())
  c.train.rl_steps = 0
  summary = trainer.train(c, workdir)
  return summary["eval"]["sft"]


def sampled_pass_rate(worker, domains: Sequence[str], *, seeds_per_domain: int, samples: int,
                      temperature: float, seed: int = 0) -> float:
  """Mean pass rate of `samples` completions at `temperature` per held-out task (the
  expected held-out reward RL maximises). A fixed `seed` gives every arm the same draws."""
  from posttrain.tasks import heldout_seed

  pairs = [(d, heldout_seed(i)) for d in domains for i in range(seeds_per_domain)]
  groups = worker.rollout(pairs, seed=seed, group_size=samples, temperature=temperature)
  passed = [s.reward.value >= 1.0 for g in groups for s in g.samples]
  return sum(passed) / max(len(passed), 1)


class _NeverPreempted:
  """The trainer's preemption flag, minus the signal handlers (the benchmark owns Ctrl-C)."""

  @staticmethod
  def is_set() -> bool:
    return False


def rl_arm(config: ml_collections.ConfigDict, init_from: str, workdir: str, *,
           eval_every: int, samples: int = 4, log=print) -> dict[str, Any]:
  """GRPO from the checkpoint in `init_from`, evaluated every `eval_every` steps.

  The trainer's own RL stage runs in chunks of `eval_every` steps (its step budget, and so
  its learning-rate schedule, is the full `train.rl_steps` from the start).

  Returns:
    {"curve": [(rl_step, greedy held-out pass rate)], "sampled_curve": [(rl_step, held-out
     pass rate of `samples` completions per task at the rollout temperature)] (empty when
     samples=0), "seconds": RL wall time without the
     evaluations, "eval_seconds": ..., "final": the last evaluation report,
     "draws": {domain: times drawn}}
  """
  from posttrain import evaluation, trainer

  c = ml_collections.ConfigDict(config.to_dict())
  c.init_from = init_from
  c.sft.steps = 0
  total = int(c.train.rl_steps)
  t = trainer.Trainer(c, workdir)
  try:
    seeds = int(c.eval.seeds_per_domain)
    curve, sampled_curve, train_s, eval_s, report = [], [], 0.0, 0.0, None
    step = 0
    while True:
      start = time.perf_counter()
      t.sync_weights()
      report = evaluation.pass_rates(t.worker, t.domains, seeds_per_domain=seeds)
      curve.append((step, report["pass_rate"]))
      line = f"  step {step:3d}  held-out pass greedy {report['pass_rate']:.3f}"
      if samples:
        sampled_curve.append((step, sampled_pass_rate(
            t.worker, t.domains, seeds_per_domain=seeds, samples=samples,
            temperature=float(c.rollout.temperature))))
        line += f"  sampled {sampled_curve[-1][1]:.3f}"
      eval_s += time.perf_counter() - start
      log(f"{line}  (RL {train_s:.0f}s, eval {eval_s:.0f}s)")
      if step >= total:
        break
      step = min(step + eval_every, total)
      t.config.train.rl_steps = step
      start = time.perf_counter()
      t._rl_stage(_NeverPreempted())
      train_s += time.perf_counter() - start
    draws = dict(zip(t.scheduler.domains, t.scheduler.times_drawn.tolist()))
    return {"curve": curve, "sampled_curve": sampled_curve, "seconds": train_s, "eval_seconds": eval_s, "final": report,
            "draws": draws}
  finally:
    t.worker.close()
    t.ckpt.close()
    t.writer.close()


def steps_to_target(curve: Sequence[tuple[int, float]], target: float) -> int | None:
  """The first evaluated step whose pass rate reaches `target`; None if none does."""
  for step, rate in curve:
    if rate >= target - 1e-12:
      return int(step)
  return None


def classify(domain_rates: dict[str, float], solved_at: float = 0.9) -> dict[str, list[str]]:
  """Splits domains by their pass rate: solved (>= solved_at), unsolved (0), in between."""
  out: dict[str, list[str]] = {"solved": [], "in_between": [], "unsolved": []}
  for name, rate in sorted(domain_rates.items()):
    key = "solved" if rate >= solved_at else "unsolved" if rate <= 0.0 else "in_between"
    out[key].append(name)
  return out


def _curve_text(curve: Sequence[tuple[int, float]]) -> str:
  return " ".join(f"{s}:{r:.3f}" for s, r in curve)


# Held-out metrics, each a curve key of rl_arm's result and its target margin over the
# warm start: greedy pass rate (as the trainer's evaluation) and the pass rate of sampled
# completions at the rollout temperature (what RL maximises; lower variance).
METRICS = (("greedy", "curve", 0.05), ("sampled", "sampled_curve", 0.05))


def _ratio(steps: int | None, base: int | None, name: str, baseline: str) -> Any:
  if steps is not None and base:
    return round(steps / base, 2)
  if steps is None and base is None:
    return "neither reached"
  return f"only {baseline} reached" if steps is None else f"only {name} reached"


def summarize(arms: Sequence[dict[str, Any]], *, metrics=METRICS,
              baseline: str = "uniform") -> list[dict[str, Any]]:
  """Table rows: one per arm and metric, then the steps-to-target ratios over `baseline`.

  Args:
    arms: dicts with "name", one curve [(step, pass rate)] per metric (step 0 = the warm
      start, the same for every arm), "seconds", "eval_seconds", "load" (load average
      while the arm ran) and "focus" (the share of drawn prompts from in-between domains).
    metrics: (metric name, curve key, margin); target = warm-start value + margin.
    baseline: the arm name the ratios divide by.
  """
  rows, ratios = [], []
  for metric, key, margin in metrics:
    if not margin > 0:
      raise ValueError(f"margin={margin} for {metric} must be > 0: the warm start would "
                       "meet the target")
    curves = [a[key] for a in arms if a.get(key)]
    if not curves:
      continue
    start = curves[0][0][1]
    target = start + margin
    reached = {}
    for arm in arms:
      curve = arm.get(key)
      if not curve:
        continue
      steps = steps_to_target(curve, target)
      reached[arm["name"]] = steps
      rows.append({"arm": arm["name"], "metric": metric, "SFT": round(start, 3),
                   "target": round(target, 3),
                   "steps to target": steps if steps is not None else "not reached",
                   "final": round(curve[-1][1], 3), "best": round(max(r for _, r in curve), 3),
                   "in-between share": round(arm["focus"], 2),
                   "RL wall s": round(arm["seconds"], 1),
                   "eval wall s": round(arm["eval_seconds"], 1),
                   "load avg": round(arm.get("load", float("nan")), 1),
                   "curve (step:pass)": _curve_text(curve)})
    for name, steps in reached.items():
      if name != baseline:
        ratios.append({"arm": f"{name} / {baseline}", "metric": metric,
                       "steps to target": _ratio(steps, reached.get(baseline), name, baseline)})
  return rows + ratios


# (name, config overrides) per RL arm; every arm shares the warm start, seed and budget.
ARMS = (("uniform", {"scheduler.rule": "uniform"}),
        ("learnability", {"scheduler.rule": "learnability"}))
# Full runs also try a lower floor (more of the batch on the in-between domains).
EXTRA_ARMS = (("learnability floor=0.05", {"scheduler.rule": "learnability",
                                           "scheduler.floor": 0.05}),)


def run(quick: bool, *, workdir: str | None = None, log=print) -> list[dict[str, Any]]:
  """Warm start once, then one RL arm per rule in turn; returns the table rows."""
  logging.getLogger("absl").setLevel(logging.ERROR)
  root = workdir or tempfile.mkdtemp(prefix="curriculum_bench_")
  config = base_config(quick)
  eval_every = 5 if quick else 10
  try:
    start = time.perf_counter()
    sft_dir = os.path.join(root, "sft")
    report = warm_start(config, sft_dir)
    log(f"warm start: {config.sft.steps} SFT steps in {time.perf_counter() - start:.0f}s, "
        f"greedy held-out pass {report['pass_rate']:.3f} ({config.eval.seeds_per_domain} "
        f"seeds per domain), load avg {os.getloadavg()[0]:.1f}")
    groups = classify(report["domains"])
    for key, names in groups.items():
      log(f"  {key:10s} " + ", ".join(f"{n} {report['domains'][n]:.2f}" for n in names))
    arms = []
    for name, overrides in ARMS + (() if quick else EXTRA_ARMS):
      c = ml_collections.ConfigDict(config.to_dict())
      _set(c, overrides)
      log(f"{name}: {c.train.rl_steps} GRPO steps of {c.rollout.prompts_per_step} prompts x "
          f"{c.rl.group_size}, lr {c.optim.lr}")
      load = [os.getloadavg()[0]]
      out = rl_arm(c, sft_dir, os.path.join(root, name.replace(" ", "_")),
                   eval_every=eval_every, log=log)
      load.append(os.getloadavg()[0])
      drawn = sum(out["draws"].values())
      focus = sum(out["draws"][n] for n in groups["in_between"]) / max(drawn, 1)
      arms.append({"name": name, **out, "focus": focus, "load": sum(load) / len(load)})
    return summarize(arms)
  finally:
    if workdir is None:
      shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="fewer RL steps and only the two main arms")
  parser.add_argument("--workdir", default=None, help="keep the run's files here")
  args = parser.parse_args(argv)
  from benchmarks.run import table

  rows = run(args.quick, workdir=args.workdir)
  print(table(rows))
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
