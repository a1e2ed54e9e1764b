"""The curriculum benchmark's pure parts: target crossing, domain classes, table rows.
(The benchmark itself trains for minutes; it is never run here.)"""

import pytest

from benchmarks import curriculum
from benchmarks.run import table
from posttrain.tasks import registry


def test_steps_to_target_is_the_first_evaluated_step_at_or_above_it():
  curve = [(0, 0.20), (5, 0.24), (10, 0.26), (15, 0.22), (20, 0.30)]
  assert curriculum.steps_to_target(curve, 0.25) == 10
  assert curriculum.steps_to_target(curve, 0.26) == 10  # Reaching counts, not only passing.
  assert curriculum.steps_to_target(curve, 0.30) == 20
  assert curriculum.steps_to_target(curve, 0.31) is None
  # A target computed as SFT rate + margin may carry float noise above an exact hit.
  assert curriculum.steps_to_target([(0, 0.1), (5, 0.3)], 0.1 + 0.2) == 5


def test_classify_splits_solved_unsolved_and_in_between():
  rates = {"a/x": 1.0, "a/y": 0.875, "b/z": 0.0, "c/w": 0.125, "d/v": 0.9}
  groups = curriculum.classify(rates)
  assert groups == {"solved": ["a/x", "d/v"], "in_between": ["a/y", "c/w"],
                    "unsolved": ["b/z"]}


GREEDY = (("greedy", "curve"),)


def _arm(name, curve, focus=0.5, sampled=None, seed=0):
  return {"name": name, "seed": seed, "curve": curve, "sampled_curve": sampled or [],
          "seconds": 12.0, "eval_seconds": 3.0, "focus": focus, "load": 2.5}


def test_summarize_reports_steps_per_margin_and_the_ratio_over_uniform():
  arms = [_arm("uniform", [(0, 0.2), (10, 0.22), (20, 0.26), (30, 0.27)], focus=0.3),
          _arm("learnability", [(0, 0.2), (10, 0.25), (20, 0.28), (30, 0.28)], focus=0.8)]
  rows = curriculum.summarize(arms, metrics=GREEDY, margins=(0.02, 0.05, 0.07))
  assert [r["arm"] for r in rows] == ["uniform", "learnability", "learnability / uniform"]
  uni, learn, ratio = rows
  assert (uni["+0.02"], uni["+0.05"], uni["+0.07"]) == (10, 20, 30)
  assert (learn["+0.02"], learn["+0.05"], learn["+0.07"]) == (10, 10, 20)
  assert (ratio["+0.02"], ratio["+0.05"], ratio["+0.07"]) == (1.0, 0.5, 0.67)
  assert uni["SFT"] == 0.2 and uni["final"] == 0.27 and learn["best"] == 0.28
  assert learn["in-between share"] == 0.8
  assert "10:0.250" in learn["curve (step:pass)"]
  assert "| learnability / uniform |" in table(rows)


def test_summarize_marks_targets_never_reached():
  never = _arm("uniform", [(0, 0.2), (10, 0.21)])
  fast = _arm("learnability", [(0, 0.2), (10, 0.3)])
  slow = _arm("learnability", [(0, 0.2), (10, 0.22)])
  rows = curriculum.summarize([never, fast], metrics=GREEDY, margins=(0.05,))
  assert rows[0]["+0.05"] == "-"
  # Uniform needs more than its 10-step budget, learnability took 10: ratio below 1.
  assert rows[-1]["+0.05"] == "<1.00"
  rows = curriculum.summarize([never, slow], metrics=GREEDY, margins=(0.05,))
  assert rows[-1]["+0.05"] == "neither"
  rows = curriculum.summarize([fast | {"name": "uniform"}, slow], metrics=GREEDY,
                              margins=(0.05,))
  assert rows[-1]["+0.05"] == "only uniform"


def test_summarize_pairs_ratios_by_seed_and_keeps_metrics_apart():
  arms = [_arm("uniform", [(0, 0.2), (10, 0.2), (20, 0.3)], sampled=[(0, 0.1), (10, 0.2)]),
          _arm("learnability", [(0, 0.2), (10, 0.3)], sampled=[(0, 0.1), (10, 0.2)]),
          _arm("uniform", [(0, 0.2), (10, 0.3)], seed=1),
          _arm("learnability", [(0, 0.2), (10, 0.3)], seed=1),
          _arm("learnability floor=0.05", [(0, 0.2), (10, 0.3)])]
  rows = curriculum.summarize(arms, margins=(0.05,))
  by = {(r["arm"], r["seed"], r["metric"]): r for r in rows}
  assert by[("learnability / uniform", 0, "greedy")]["+0.05"] == 0.5
  assert by[("learnability / uniform", 1, "greedy")]["+0.05"] == 1.0
  assert by[("learnability floor=0.05 / uniform", 0, "greedy")]["+0.05"] == 0.5
  assert by[("learnability / uniform", 0, "sampled")]["+0.05"] == 1.0
  # Seed 1 ran without sampled evaluation: no sampled rows for it.
  assert ("uniform", 1, "sampled") not in by
  assert ("learnability / uniform", 1, "sampled") not in by
  text = curriculum.ratios_over_seeds(rows)
  assert text[("learnability / uniform", "greedy", "+0.05")] == "median 0.75"
  assert text[("learnability / uniform", "sampled", "+0.05")] == "median 1"


def test_ratios_over_seeds_list_the_seeds_when_one_is_not_a_number():
  rows = [{"arm": "learnability / uniform", "seed": 0, "metric": "greedy", "+0.03": 0.5},
          {"arm": "learnability / uniform", "seed": 1, "metric": "greedy", "+0.03": "<0.40"}]
  assert curriculum.ratios_over_seeds(rows) == {
      ("learnability / uniform", "greedy", "+0.03"): "per seed 0.5, <0.40"}


def test_summarize_rejects_a_target_the_warm_start_already_meets():
  with pytest.raises(ValueError, match="margin=0"):
    curriculum.summarize([_arm("uniform", [(0, 0.2)])], margins=(0.03, 0.0))


def test_the_mix_names_registered_domains_once():
  assert len(set(curriculum.DOMAINS)) == len(curriculum.DOMAINS)
  for name in curriculum.DOMAINS:
    assert name in registry, name


def test_the_config_resolves_to_the_mix_and_equal_budgets():
  from posttrain import experiment

  quick, full = curriculum.base_config(True), curriculum.base_config(False)
  assert experiment.run_domains(quick) == list(curriculum.DOMAINS)
  assert quick.train.rl_steps < full.train.rl_steps
  assert full.eval.samples > 0  # The sampled metric is the primary one.
  for name, overrides in curriculum.ARMS + curriculum.EXTRA_ARMS:
    c = curriculum.base_config(False)
    curriculum._set(c, overrides)
    assert c.scheduler.rule in ("uniform", "learnability"), name
    # Arms differ only in the scheduler: same budget, batch, optimiser and seed.
    assert c.train.rl_steps == full.train.rl_steps and c.seed == full.seed
    assert c.rollout.prompts_per_step == full.rollout.prompts_per_step
    assert c.optim.to_dict() == full.optim.to_dict()
