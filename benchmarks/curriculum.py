"""Curriculum: RL steps to a target held-out pass rate, learnability vs uniform sampling.

    python -m benchmarks.curriculum [--quick] [--workdir=DIR]

One SFT warm start (the tiny byte-level policy of configs/default.py) on a mix of domains
it solves, cannot solve at all, and solves sometimes; then GRPO from that one checkpoint
once per scheduler rule, with the same RL seed, batch and step budget. Every `eval_every`
RL steps the held-out pass rate of the whole mix is measured twice: greedy (as the
trainer's evaluation) and over `eval.samples` completions per task at the rollout
temperature (the expected held-out reward GRPO maximises; four times the samples, so less
noise). Reported per arm and metric: the curve, the first evaluated step reaching the
warm start + each margin in MARGINS, wall times and the share of prompts the scheduler
drew from in-between domains; then learnability / uniform step ratios per RL seed.

Why it should matter: a GRPO group whose rewards are all equal has zero advantage, so only
in-between domains (pass rate strictly between 0 and 1) teach anything; learnability
weights domains by p (1 - p) and spends most prompts there, uniform a third or so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import ml_collections

# The mix, grouped by what the warm start was expected to reach (each run measures and
# prints the actual split): boolean/binary lookups it memorises; multi-digit arithmetic
# whose answers fit the token budget but not the model; one-digit arithmetic and small
# conversions in between.
SOLVED = ("logic/boolexpr_l1", "logic/boolexpr_l2", "bases/dec2bin_l1")
UNSOLVED = ("arithmetic/add_d5", "arithmetic/sub_d5", "arithmetic/div_d5",
            "bases/hex2dec_l5", "sequences/quad_l5", "lists/sum_l5", "sequences/arith_l1")
IN_BETWEEN = ("arithmetic/add_d1", "arithmetic/div_d1", "bases/hex2dec_l1",
              "bases/bin2dec_l1", "lists/min_l1", "equations/linear_l1")
DOMAINS = SOLVED + UNSOLVED + IN_BETWEEN

# (metric, curve key of rl_arm's result): sampled first, it is the less noisy one.
METRICS = (("sampled", "sampled_curve"), ("greedy", "curve"))
# Targets: warm-start pass rate + margin (absolute). With 16 domains x 16 seeds x 4
# samples the sampled rate's standard error is about 0.012.
MARGINS = (0.02, 0.03, 0.04)
# (name, config overrides) per RL arm; all share the warm start, the budget and, per RL
# seed, every random draw the rule does not change.
ARMS = (("uniform", {"scheduler.rule": "uniform"}),
        ("learnability", {"scheduler.rule": "learnability"}))
# Full runs add a lower floor (more of each batch on the in-between domains) on seed 0.
EXTRA_ARMS = (("learnability floor=0.05", {"scheduler.rule": "learnability",
                                           "scheduler.floor": 0.05}),)


def base_config(quick: bool) -> ml_collections.ConfigDict:
  """configs/default.py narrowed to the mix, with a gentler RL optimiser and fixed budget."""
  from configs import default

  c = default.get_config()
  c.tasks.domains = ",".join(DOMAINS)
  c.tasks.levels = ""
  c.sft.steps = 300
  c.train.rl_steps = 40 if quick else 100
  c.rollout.prompts_per_step = 32
  c.rollout.max_new_tokens = 32  # Room for every answer of the mix: failures are wrong.
  c.train.row_len = 192  # As in the recorded figures (the default now packs 256).
  # A fresh Adam moves every weight by ~lr per step whatever the gradient's size; at
  # 5e-4 (the default) the held-out pass rate of this warm start fell in every run.
  c.optim.lr = 3e-4
  c.optim.warmup = 10
  c.eval.seeds_per_domain = 16
  c.eval.samples = 4
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


def rl_arm(config: ml_collections.ConfigDict, init_from: str, workdir: str, *,
           eval_every: int, log=print) -> dict[str, Any]:
  """GRPO from the checkpoint in `init_from`, evaluated every `eval_every` steps.

  The trainer's own RL stage runs in chunks of `eval_every` steps (its step budget, and so
  its learning-rate schedule, is the full `train.rl_steps` from the start).

  Returns:
    {"curve": [(rl_step, greedy held-out pass rate)], "sampled_curve": [(rl_step, held-out
     pass rate of `eval.samples` completions per task at the rollout temperature)] (empty
     when eval.samples is 0), "seconds": RL wall time without the evaluations,
     "eval_seconds": ..., "final": the last evaluation report, "draws": {domain: prompts}}
  """
  from posttrain import evaluation, trainer
  from posttrain.checkpoint import PreemptionFlag

  c = ml_collections.ConfigDict(config.to_dict())
  c.init_from = init_from
  c.sft.steps = 0
  total = int(c.train.rl_steps)
  samples = int(c.eval.get("samples", 0) or 0)
  t = trainer.Trainer(c, workdir)
  flag = PreemptionFlag()
  try:
    seeds = int(c.eval.seeds_per_domain)
    curve, sampled_curve, train_s, eval_s, report = [], [], 0.0, 0.0, None
    step = 0
    while True:
      start = time.perf_counter()
      t.sync_weights()
      report = evaluation.pass_rates(t.worker, t.domains, seeds_per_domain=seeds,
                                     samples=samples,
                                     temperature=float(c.rollout.temperature))
      curve.append((step, report["pass_rate"]))
      line = f"  step {step:3d}  held-out pass: greedy {report['pass_rate']:.3f}"
      if samples:
        sampled_curve.append((step, report["sampled"]["pass_rate"]))
        line += f"  sampled {sampled_curve[-1][1]:.3f}"
      eval_s += time.perf_counter() - start
      log(f"{line}  (RL {train_s:.0f}s, eval {eval_s:.0f}s)")
      if step >= total:
        break
      step = min(step + eval_every, total)
      t.config.train.rl_steps = step
      start = time.perf_counter()
      if not t._rl_stage(flag):
        raise KeyboardInterrupt("interrupted")
      train_s += time.perf_counter() - start
    draws = dict(zip(t.scheduler.domains, t.scheduler.times_drawn.tolist()))
    return {"curve": curve, "sampled_curve": sampled_curve, "seconds": train_s,
            "eval_seconds": eval_s, "final": report, "draws": draws}
  finally:
    flag.close()
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


def _ratio(steps: int | None, base: int | None, budget: int) -> Any:
  """steps / base; when only this arm reached the target within `budget` steps the
  baseline needs more than `budget`, so the ratio is below steps / budget."""
  if steps is not None and base:
    return round(steps / base, 2)
  if steps is None and base is None:
    return "neither"
  return "only uniform" if steps is None else f"<{steps / budget:.2f}"


def summarize(arms: Sequence[dict[str, Any]], *, metrics=METRICS, margins=MARGINS,
              baseline: str = "uniform") -> list[dict[str, Any]]:
  """Table rows: one per arm and metric, then step ratios over `baseline` (same RL seed).

  Args:
    arms: dicts with "name", "seed", a curve [(step, pass rate)] per metric key (step 0 =
      the warm start), "seconds", "eval_seconds", "load" (load average while it ran) and
      "focus" (the share of drawn prompts from in-between domains).
    metrics: (metric name, curve key); a metric no arm has a curve for is left out.
    margins: targets are the curve's step-0 value + each margin.
    baseline: the arm name the ratios divide by.

  Returns:
    Rows whose "+m" columns hold steps to reach warm start + m ("-" when never), then
    rows "<arm> / <baseline>" whose "+m" columns hold step ratios: a number, "<x" when
    only the arm reached the target (the baseline needs more than its whole budget),
    "only uniform" or "neither".
  """
  bad = [m for m in margins if not m > 0]
  if bad:
    raise ValueError(f"margin={bad[0]} must be > 0: the warm start would meet the target")
  cols = [f"+{m:g}" for m in margins]
  rows, ratios = [], []
  for metric, key in metrics:
    reached: dict[tuple[str, int], list[int | None]] = {}
    budgets: dict[tuple[str, int], int] = {}
    for arm in arms:
      curve = arm.get(key)
      if not curve:
        continue
      start = curve[0][1]
      budgets[(arm["name"], arm["seed"])] = curve[-1][0]
      steps = [steps_to_target(curve, start + m) for m in margins]
      reached[(arm["name"], arm["seed"])] = steps
      rows.append({"arm": arm["name"], "seed": arm["seed"], "metric": metric,
                   "SFT": round(start, 3),
                   **{c: "-" if s is None else s for c, s in zip(cols, steps)},
                   "final": round(curve[-1][1], 3), "best": round(max(r for _, r in curve), 3),
                   "in-between share": round(arm["focus"], 2),
                   "RL wall s": round(arm["seconds"], 1),
                   "eval wall s": round(arm["eval_seconds"], 1),
                   "load avg": round(arm.get("load", float("nan")), 1),
                   "curve (step:pass)": _curve_text(curve)})
    for (name, seed), steps in reached.items():
      base = reached.get((baseline, seed))
      if name == baseline or base is None:
        continue
      budget = budgets[(baseline, seed)]
      ratios.append({"arm": f"{name} / {baseline}", "seed": seed, "metric": metric,
                     **{c: _ratio(s, b, budget) for c, s, b in zip(cols, steps, base)}})
  return rows + ratios


def ratios_over_seeds(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str, str], str]:
  """{(arm, metric, margin column): text} from summarize's ratio rows: the median over
  seeds when every seed has a number, else the per-seed values."""
  cells: dict[tuple[str, str, str], list[Any]] = {}
  for row in rows:
    if " / " not in str(row["arm"]):
      continue
    for col, value in row.items():
      if col.startswith("+"):
        cells.setdefault((row["arm"], row["metric"], col), []).append(value)
  return {k: (f"median {statistics.median(v):g}"
              if all(isinstance(x, (int, float)) for x in v)
              else "per seed " + ", ".join(map(str, v)))
          for k, v in cells.items()}


def run(quick: bool, *, workdir: str | None = None, log=print) -> list[dict[str, Any]]:
  """Warm start once, then the RL arms one after the other; returns the table rows."""
  logging.getLogger("absl").setLevel(logging.ERROR)
  root = workdir or tempfile.mkdtemp(prefix="curriculum_bench_")
  config = base_config(quick)
  eval_every = 10
  plan = [(name, o, 0) for name, o in ARMS]
  if not quick:
    plan += [(name, o, 1) for name, o in ARMS] + [(name, o, 0) for name, o in EXTRA_ARMS]
  try:
    start = time.perf_counter()
    sft_dir = os.path.join(root, "sft")
    report = warm_start(config, sft_dir)
    log(f"warm start: {config.sft.steps} SFT steps + evaluation in "
        f"{time.perf_counter() - start:.0f}s, held-out pass greedy {report['pass_rate']:.3f}"
        f" ({config.eval.seeds_per_domain} seeds per domain), load avg "
        f"{os.getloadavg()[0]:.1f}")
    groups = classify(report["domains"])
    for key, names in groups.items():
      log(f"  {key:10s} " + ", ".join(f"{n} {report['domains'][n]:.2f}" for n in names))
    arms = []
    for name, overrides, seed in plan:
      c = ml_collections.ConfigDict(config.to_dict())
      _set(c, {**overrides, "seed": seed})
      log(f"{name}, RL seed {seed}: {c.train.rl_steps} GRPO steps of "
          f"{c.rollout.prompts_per_step} prompts x {c.rl.group_size}, lr {c.optim.lr}")
      load = [os.getloadavg()[0]]
      out = rl_arm(c, sft_dir, os.path.join(root, f"{name.replace(' ', '_')}_s{seed}"),
                   eval_every=eval_every, log=log)
      load.append(os.getloadavg()[0])
      drawn = sum(out["draws"].values())
      focus = sum(out["draws"][n] for n in groups["in_between"]) / max(drawn, 1)
      arms.append({"name": name, "seed": seed, **out, "focus": focus,
                   "load": sum(load) / len(load)})
    rows = summarize(arms)
    for (arm, metric, col), text in ratios_over_seeds(rows).items():
      log(f"steps to warm start {col}, {metric}, {arm}: {text}")
    return rows
  finally:
    if workdir is None:
      shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="fewer RL steps, one RL seed, only the two main arms")
  parser.add_argument("--workdir", default=None, help="keep the run's files here")
  args = parser.parse_args(argv)
  from benchmarks.run import table

  rows = run(args.quick, workdir=args.workdir)
  print(table(rows))
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
