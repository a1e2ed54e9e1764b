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
SOLVED = ("logic/boolexpr_l1", "bases/hex2dec_l1", "bases/bin2dec_l1", "arithmetic/mod_d1")
UNSOLVED = ("arithmetic/add_d5", "arithmetic/sub_d5", "arithmetic/div_d5",
            "bases/hex2dec_l5", "sequences/quad_l5", "lists/sum_l5")
IN_BETWEEN = ("arithmetic/add_d1", "arithmetic/sub_d1", "bases/dec2bin_l2", "lists/min_l2")
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


class _NeverPreempted:
  """The trainer's preemption flag, minus the signal handlers (the benchmark owns Ctrl-C)."""

  @staticmethod
  def is_set() -> bool:
    return False


def rl_arm(config: ml_collections.ConfigDict, init_from: str, workdir: str, *,
           eval_every: int, log=print) -> dict[str, Any]:
  """GRPO from the checkpoint in `init_from`, evaluated every `eval_every` steps.

  The trainer's own RL stage runs in chunks of `eval_every` steps (its step budget, and so
  its learning-rate schedule, is the full `train.rl_steps` from the start).

  Returns:
    {"curve": [(rl_step, held-out pass rate)], "seconds": RL wall time without the
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
    curve, train_s, eval_s, report = [], 0.0, 0.0, None
    step = 0
    while True:
      start = time.perf_counter()
      t.sync_weights()
      report = evaluation.pass_rates(t.worker, t.domains, seeds_per_domain=seeds)
      eval_s += time.perf_counter() - start
      curve.append((step, report["pass_rate"]))
      log(f"  [{c.scheduler.rule}] step {step:3d}  held-out pass {report['pass_rate']:.3f}  "
          f"RL {train_s:6.1f}s")
      if step >= total:
        break
      step = min(step + eval_every, total)
      t.config.train.rl_steps = step
      start = time.perf_counter()
      t._rl_stage(_NeverPreempted())
      train_s += time.perf_counter() - start
    draws = dict(zip(t.scheduler.domains, t.scheduler.times_drawn.tolist()))
    return {"curve": curve, "seconds": train_s, "eval_seconds": eval_s, "final": report,
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


def summarize(arms: Sequence[dict[str, Any]], *, sft_pass: float, margin: float,
              baseline: str = "uniform") -> list[dict[str, Any]]:
  """Table rows: one per arm, then each arm's steps-to-target ratio over `baseline`.

  Args:
    arms: dicts with "name", "curve" [(step, pass rate)], "seconds", "eval_seconds" and
      "focus" (the share of drawn prompts from in-between domains).
    sft_pass: held-out pass rate of the warm start (the curves' step 0).
    margin: target = sft_pass + margin.
    baseline: the arm name the ratios divide by.
  """
  if not margin > 0:
    raise ValueError(f"margin={margin} must be > 0: the warm start would meet the target")
  target = sft_pass + margin
  rows, reached = [], {}
  for arm in arms:
    steps = steps_to_target(arm["curve"], target)
    reached[arm["name"]] = steps
    rows.append({"arm": arm["name"], "SFT pass": round(sft_pass, 3), "target": round(target, 3),
                 "steps to target": steps if steps is not None else "not reached",
                 "final pass": round(arm["curve"][-1][1], 3),
                 "best pass": round(max(r for _, r in arm["curve"]), 3),
                 "in-between share": round(arm["focus"], 2),
                 "RL wall s": round(arm["seconds"], 1), "eval wall s": round(arm["eval_seconds"], 1),
                 "curve (step:pass)": _curve_text(arm["curve"])})
  base = reached.get(baseline)
  for arm in arms:
    if arm["name"] == baseline:
      continue
    steps = reached[arm["name"]]
    if steps is not None and base:
      ratio: Any = round(steps / base, 2)
    elif steps is None and base is None:
      ratio = "neither reached"
    elif steps is None:
      ratio = f"only {baseline} reached"
    else:
      ratio = f"only {arm['name']} reached"
    rows.append({"arm": f"{arm['name']} / {baseline}", "steps to target": ratio})
  return rows


# (name, config overrides) per RL arm; every arm shares the warm start, seed and budget.
ARMS = (("uniform", {"scheduler.rule": "uniform"}),
        ("learnability", {"scheduler.rule": "learnability"}))
# Full runs also try a lower floor (more of the batch on the in-between domains).
EXTRA_ARMS = (("learnability floor=0.05", {"scheduler.rule": "learnability",
                                           "scheduler.floor": 0.05}),)
MARGIN = 0.05  # Target: SFT pass rate + MARGIN on the whole mix.


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
        f"held-out pass {report['pass_rate']:.3f} ({config.eval.seeds_per_domain} seeds per "
        f"domain, load avg {os.getloadavg()[0]:.1f})")
    groups = classify(report["domains"])
    for key, names in groups.items():
      log(f"  {key:10s} " + ", ".join(f"{n} {report['domains'][n]:.2f}" for n in names))
    arms = []
    for name, overrides in ARMS + (() if quick else EXTRA_ARMS):
      c = ml_collections.ConfigDict(config.to_dict())
      _set(c, overrides)
      log(f"{name}: {c.train.rl_steps} GRPO steps of {c.rollout.prompts_per_step} prompts x "
          f"{c.rl.group_size} (load avg {os.getloadavg()[0]:.1f})")
      out = rl_arm(c, sft_dir, os.path.join(root, name.replace(" ", "_")),
                   eval_every=eval_every, log=log)
      drawn = sum(out["draws"].values())
      focus = sum(out["draws"][n] for n in groups["in_between"]) / max(drawn, 1)
      arms.append({"name": name, **out, "focus": focus})
    rows = summarize(arms, sft_pass=report["pass_rate"], margin=MARGIN)
    for row in rows:
      row["load avg"] = round(os.getloadavg()[0], 1)
      break
    return rows
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
