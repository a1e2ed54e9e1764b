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


GREEDY = (("greedy", "curve", 0.05),)


def _arm(name, curve, focus=0.5, sampled=None):
  return {"name": name, "curve": curve, "sampled_curve": sampled or [], "seconds": 12.0,
          "eval_seconds": 3.0, "focus": focus, "load": 2.5}


def test_summarize_reports_steps_and_the_ratio_over_uniform():
  arms = [_arm("uniform", [(0, 0.2), (10, 0.22), (20, 0.26), (30, 0.27)], focus=0.3),
          _arm("learnability", [(0, 0.2), (10, 0.25), (20, 0.28), (30, 0.28)], focus=0.8)]
  rows = curriculum.summarize(arms, metrics=GREEDY)
  assert [r["arm"] for r in rows] == ["uniform", "learnability", "learnability / uniform"]
  assert rows[0]["target"] == pytest.approx(0.25)
  assert rows[0]["steps to target"] == 20 and rows[1]["steps to target"] == 10
  assert rows[2]["steps to target"] == 0.5
  assert rows[0]["final"] == 0.27 and rows[1]["best"] == 0.28
  assert rows[1]["in-between share"] == 0.8
  assert "10:0.250" in rows[1]["curve (step:pass)"]
  assert "| learnability / uniform |" in table(rows)


def test_summarize_has_rows_per_metric_with_their_own_targets():
  arms = [_arm("uniform", [(0, 0.2), (10, 0.3)], sampled=[(0, 0.1), (10, 0.12)]),
          _arm("learnability", [(0, 0.2), (10, 0.3)], sampled=[(0, 0.1), (10, 0.2)])]
  rows = curriculum.summarize(arms, metrics=(("greedy", "curve", 0.05),
                                             ("sampled", "sampled_curve", 0.05)))
  by = {(r["arm"], r["metric"]): r for r in rows}
  assert by[("uniform", "sampled")]["target"] == pytest.approx(0.15)
  assert by[("uniform", "sampled")]["steps to target"] == "not reached"
  assert by[("learnability", "sampled")]["steps to target"] == 10
  assert by[("learnability / uniform", "greedy")]["steps to target"] == 1.0
  assert by[("learnability / uniform", "sampled")]["steps to target"] == (
      "only learnability reached")
  # Without sampled curves (samples=0) the metric has no rows at all.
  rows = curriculum.summarize([_arm("uniform", [(0, 0.2)])])
  assert {r["metric"] for r in rows} == {"greedy"}


def test_summarize_says_which_arm_reached_when_one_did_not():
  never = _arm("uniform", [(0, 0.2), (10, 0.21)])
  fast = _arm("learnability", [(0, 0.2), (10, 0.3)])
  slow = _arm("learnability", [(0, 0.2), (10, 0.22)])
  rows = curriculum.summarize([never, fast], metrics=GREEDY)
  assert rows[0]["steps to target"] == "not reached"
  assert rows[-1]["steps to target"] == "only learnability reached"
  rows = curriculum.summarize([never, slow], metrics=GREEDY)
  assert rows[-1]["steps to target"] == "neither reached"
  rows = curriculum.summarize([fast | {"name": "uniform"}, slow], metrics=GREEDY)
  assert rows[-1]["steps to target"] == "only uniform reached"


def test_summarize_rejects_a_target_the_warm_start_already_meets():
  with pytest.raises(ValueError, match="margin=0"):
    curriculum.summarize([_arm("uniform", [(0, 0.2)])], metrics=(("greedy", "curve", 0.0),))


def test_the_mix_names_registered_domains_once():
  assert len(set(curriculum.DOMAINS)) == len(curriculum.DOMAINS)
  for name in curriculum.DOMAINS:
    assert name in registry, name


def test_the_config_resolves_to_the_mix_and_equal_budgets():
  from posttrain import experiment

  quick, full = curriculum.base_config(True), curriculum.base_config(False)
  assert experiment.run_domains(quick) == list(curriculum.DOMAINS)
  assert quick.train.rl_steps < full.train.rl_steps
  for name, overrides in curriculum.ARMS + curriculum.EXTRA_ARMS:
    c = curriculum.base_config(False)
    curriculum._set(c, overrides)
    assert c.scheduler.rule in ("uniform", "learnability"), name
    assert c.train.rl_steps == full.train.rl_steps and c.seed == full.seed
