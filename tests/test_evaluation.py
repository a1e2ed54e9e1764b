"""Evaluation: pass@k and interval maths against oracles, summaries that add up, sandbox
accounting, and end to end on a tiny trained checkpoint (held-out seeds, regressions,
identical reports, valid PNGs, one-line launcher errors)."""

import itertools
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import default
from posttrain import evaluation, experiment, planner, report, trainer
from posttrain.rollout import Sample, TrajectoryGroup
from posttrain.sandbox import ExecResult
from posttrain.tasks import (
  ANSWER_INSTRUCTION,
  Domain,
  Reward,
  Task,
  execution,
  registry,
  set_sandbox,
)
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------
# Statistics against oracles
# ----------------------------------------------------------------------------------------


def _pass_at_k_brute(n, c, k):
  """Probability that a uniformly drawn k-subset of n samples (c correct) has a correct one."""
  outcomes = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_of_subsets():
  for n in range(1, 8):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert evaluation.pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute(n, c, k),
                                                              abs=1e-12), (n, c, k)
  # Large n: the product form stays finite where binomials overflow floats.
  assert evaluation.pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


@pytest.mark.parametrize("args", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(args):
  with pytest.raises(ValueError, match="must be in"):
    evaluation.pass_at_k(*args)


@pytest.mark.parametrize("x,n", [(1, 10), (3, 7), (50, 100), (99, 100), (2, 3)])
@pytest.mark.parametrize("confidence", [0.8, 0.95, 0.99])
def test_wilson_endpoints_solve_the_score_equation(x, n, confidence):
  z = {0.8: 1.2815515655446004, 0.95: 1.959963984540054, 0.99: 2.5758293035489004}[confidence]
  lo, hi = evaluation.wilson_interval(x, n, confidence)
  for p in (lo, hi):
    assert abs(x / n - p) == pytest.approx(z * math.sqrt(p * (1 - p) / n), rel=1e-9)
  assert lo < x / n < hi


def test_wilson_edges():
  assert evaluation.wilson_interval(0, 8)[0] == 0.0
  assert evaluation.wilson_interval(8, 8)[1] == 1.0
  assert evaluation.wilson_interval(8, 8)[0] == pytest.approx(8 / (8 + 1.959963984540054**2))
  with pytest.raises(ValueError, match="n=0"):
    evaluation.wilson_interval(0, 0)
  with pytest.raises(ValueError, match="confidence"):
    evaluation.wilson_interval(1, 2, 1.5)


def test_paired_interval_matches_published_example():
  # Cavo et al. 2012 (Fagerland, Lydersen & Laake, ch. 8): 59 both, 6 / 16 discordant,
  # 80 neither; Newcombe square-and-add: -0.0621 (95% CI -0.1186 to -0.0046).
  d, lo, hi = evaluation.paired_difference_interval(59, 16, 6, 80)
  assert (round(d, 4), round(lo, 4), round(hi, 4)) == (-0.0621, -0.1186, -0.0046)
  # Swapping the two checkpoints mirrors the interval.
  d2, lo2, hi2 = evaluation.paired_difference_interval(59, 6, 16, 80)
  assert (d2, lo2, hi2) == pytest.approx((-d, -hi, -lo))


@pytest.mark.parametrize("n,p_base,p_cur,rho", [(10, 0.5, 0.5, 0.0), (20, 0.8, 0.6, 0.5),
                                                (40, 0.3, 0.4, 0.3), (15, 0.9, 0.9, 0.0)])
def test_paired_interval_covers_the_true_difference(n, p_base, p_cur, rho):
  # Correlated pairs from a Gaussian copula; the interval must cover p_cur - p_base at
  # about its nominal rate (Newcombe reports ~0.95 mean coverage for method 10).
  rng = np.random.default_rng(0)
  trials, covered = 2000, 0
  from statistics import NormalDist
  tb, tc = NormalDist().inv_cdf(p_base), NormalDist().inv_cdf(p_cur)
  for _ in range(trials):
    z1 = rng.standard_normal(n)
    z2 = rho * z1 + math.sqrt(1 - rho**2) * rng.standard_normal(n)
    b, c = z1 < tb, z2 < tc
    _, lo, hi = evaluation.paired_difference_interval(int((b & c).sum()), int((b & ~c).sum()),
                                                      int((c & ~b).sum()), int((~b & ~c).sum()))
    covered += lo <= p_cur - p_base <= hi
  assert covered / trials >= 0.92


def test_compare_outcomes_flags_only_a_domain_made_worse():
  base = {"same": [True, False] * 5, "broken": [True] * 10, "better": [False] * 10,
          "noisy": [True, True, False, True, False, True, True, False, True, True]}
  cur = {"same": list(base["same"]), "broken": [False] * 10, "better": [True] * 10,
         "noisy": [True, False, False, True, True, True, False, False, True, True]}
  out = evaluation.compare_outcomes(base, cur)
  assert [d for d, v in out.items() if v["regressed"]] == ["broken"]
  assert [d for d, v in out.items() if v["improved"]] == ["better"]
  assert out["broken"]["difference"] == -1.0 and out["broken"]["ci_high"] < 0
  assert out["same"]["difference"] == 0.0 and out["same"]["ci_low"] < 0 < out["same"]["ci_high"]
  assert out["noisy"]["difference"] == pytest.approx(-0.1)


def test_compare_outcomes_rejects_unpaired_inputs():
  with pytest.raises(ValueError, match="'a'"):
    evaluation.compare_outcomes({"a": [True]}, {"a": [True, False]})
  with pytest.raises(ValueError, match="different names"):
    evaluation.compare_outcomes({"a": [True]}, {"b": [True]})
  with pytest.raises(ValueError, match="non-empty"):
    evaluation.compare_outcomes({"a": []}, {"a": []})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.data())
def test_identical_outcomes_are_never_flagged_and_swaps_mirror(outcomes, data):
  out = evaluation.compare_outcomes({"d": outcomes}, {"d": list(outcomes)})["d"]
  assert not out["regressed"] and not out["improved"] and out["difference"] == 0
  other = data.draw(st.lists(st.booleans(), min_size=len(outcomes), max_size=len(outcomes)))
  fwd = evaluation.compare_outcomes({"d": outcomes}, {"d": other})["d"]
  back = evaluation.compare_outcomes({"d": other}, {"d": outcomes})["d"]
  assert fwd["difference"] == pytest.approx(-back["difference"])
  assert (fwd["ci_low"], fwd["ci_high"]) == pytest.approx((-back["ci_high"], -back["ci_low"]))
  assert fwd["ci_low"] <= fwd["difference"] <= fwd["ci_high"]


# ----------------------------------------------------------------------------------------
# Records and summaries
# ----------------------------------------------------------------------------------------


def test_buckets_and_verdicts():
  assert [evaluation.prompt_length_bucket(n) for n in (0, 1, 16, 17, 32, 33, 200)] == [
      "1-16", "1-16", "1-16", "17-32", "17-32", "33-64", "129-256"]
  assert [evaluation.tool_call_bucket(n) for n in (0, 3, 4, 9)] == ["0", "3", "4+", "4+"]
  assert evaluation.verdict_kind("wrong (2/6 passed)") == "wrong"
  assert evaluation.verdict_kind("sandbox_error: no sandbox") == "sandbox_error"
  assert evaluation.verdict_kind("correct, invalid tool calls") == "correct, invalid tool calls"
  assert evaluation.verdict_kind("") == "(none)"


def test_retries_count_calls_after_error_observations():
  text = ("<tool>python: 1/0</tool>\n<observation>error: runtime_error: ZeroDivisionError"
          "</observation>\n<tool>python: print(1)</tool>\n<observation>1</observation>\n"
          "<tool>calculator: 2+</tool>\n<observation>error: bad</observation>\n"
          "<answer>1</answer>")
  assert evaluation.count_retries(text) == 1  # The last error is not followed by a call.
  assert evaluation.count_retries("<observation>error") == 0
  assert evaluation.count_retries("") == 0


_record = st.fixed_dictionaries({
    "domain": st.sampled_from(["a/x_l1", "a/y_l2", "b/z_l1"]),
    "prompt_tokens": st.integers(1, 600), "passed": st.booleans(),
    "reward": st.floats(0, 1), "verdict": st.sampled_from(["correct", "wrong", "no_answer"]),
    "components": st.just({"format": 1.0}), "tool_calls": st.integers(0, 6),
    "valid_tool_calls": st.none(), "retries": st.integers(0, 2), "turns": st.integers(1, 3),
    "generated_tokens": st.integers(0, 50), "samples": st.just(4),
    "sampled_passed": st.integers(0, 4), "sampled_reward": st.floats(0, 1),
    "sampled_generated_tokens": st.integers(0, 200),
    "reasoning_tokens": st.sampled_from([0, 0, 5, 17, 300]), "reasoning_closed": st.booleans()})


@settings(max_examples=40, deadline=None)
@given(st.lists(_record, min_size=1, max_size=30))
def test_strata_partition_the_tasks(records):
  for r in records:
    r["family"], r["level"] = r["domain"][0], int(r["domain"][-1])
  s = evaluation.summarize(records)
  total, passed = len(records), sum(r["passed"] for r in records)
  assert (s["overall"]["tasks"], s["overall"]["greedy_passed"]) == (total, passed)
  for name, buckets in s["strata"].items():
    assert sum(b["tasks"] for b in buckets.values()) == total, name
    assert sum(b["greedy_passed"] for b in buckets.values()) == passed, name
  assert sum(d["tasks"] for d in s["domains"].values()) == total
  # Reasoning length is a stratum only where some completion reasoned; "none" first.
  reasoned = [r for r in records if r["reasoning_tokens"]]
  assert ("reasoning_tokens" in s["strata"]) == bool(reasoned)
  if reasoned:
    buckets = s["strata"]["reasoning_tokens"]
    keys = list(buckets)
    assert (keys[0] == "none") == (len(reasoned) < total)
    lows = [int(k.split("-")[0]) for k in keys if k != "none"]
    assert lows == sorted(lows)
    assert sum(b["tasks"] for k, b in buckets.items() if k != "none") == len(reasoned)
  assert s["overall"]["process"]["unclosed_reasoning_rate"] == pytest.approx(
      sum(not r["reasoning_closed"] for r in records) / total, abs=1e-5)
  # pass@k is monotone in k and pass@1 equals the sampled pass rate.
  at_k = s["overall"]["pass_at_k"]
  assert list(at_k) == ["1", "2", "4"]
  assert at_k["1"] == pytest.approx(s["overall"]["sampled_pass_rate"], abs=1e-5)
  assert at_k["1"] <= at_k["2"] + 1e-9 <= at_k["4"] + 2e-9


# ----------------------------------------------------------------------------------------
# Sandbox accounting with a fake worker and a fake sandbox
# ----------------------------------------------------------------------------------------


class _FakeSandbox:
  """Answers every program with a timeout (no output); counts what it ran."""

  def __init__(self):
    self.calls = 0

  def run(self, request):
    self.calls += 1
    return ExecResult("timeout", -9, "", "", 0.25, 0.125, "deadline")

  def run_many(self, requests):
    return [self.run(r) for r in requests]


class _DemoWorker:
  """A RolloutWorker stand-in: every sample is the domain's demonstration (or `texts`)."""

  def __init__(self, texts=None):
    self.texts, self.calls = texts or {}, []

  def rollout(self, pairs, *, seed, group_size, temperature):
    self.calls.append([d for d, _ in pairs])
    groups = []
    for d, s in pairs:
      dom = registry.get(d)
      task = dom.sample(s)
      text = self.texts.get(d, dom.demonstration(task))
      samples = []
      for _ in range(group_size):
        sample = Sample([1] * (10 + s), [2] * 5, [1] * 5, [0.0] * 5, text, "stop",
                        turns=2 if dom.family == "tools" else 1)
        sample.reward = dom.score(task, text)
        samples.append(sample)
      groups.append(TrajectoryGroup(d, s, task, samples, 0))
    return groups


@pytest.fixture
def fake_sandbox():
  sandbox = _FakeSandbox()
  set_sandbox(sandbox)
  yield sandbox
  set_sandbox(None)


def test_sandbox_runs_are_counted_against_their_domain(fake_sandbox):
  code, calc, plain = "code/affine_l1", "tools/calc_l1", "arithmetic/add_d1"
  bad_calls = ("<tool>calculator: 2+</tool>\n<observation>error: bad</observation>\n"
               "<tool>calculator: 1+1</tool>\n<observation>2</observation>\n<answer>2</answer>")
  worker = _DemoWorker({calc: bad_calls})
  pairs = evaluation.eval_pairs([plain, code, calc], 3)
  recorder = evaluation.SandboxRecorder()
  original = execution.get_sandbox
  with recorder.installed():
    greedy = evaluation.rollout_by_domain(worker, pairs, recorder, seed=0, group_size=1,
                                          temperature=0.0)
    sampled = evaluation.rollout_by_domain(worker, pairs, recorder, seed=1, group_size=2,
                                           temperature=1.0)
  assert execution.get_sandbox is original
  # Order kept; sandbox domains rolled out one call each, the rest batched.
  assert [(g.domain, g.seed) for g in greedy] == pairs
  assert worker.calls[:3] == [[plain] * 3, [code] * 3, [calc] * 3]
  assert recorder.statuses() == {code: {"timeout": 9}}
  assert fake_sandbox.calls == 9
  records = evaluation.task_records(greedy, sampled)
  s = evaluation.summarize(records, recorder.statuses())
  code_stats = s["domains"][code]
  assert code_stats["process"]["sandbox_statuses"] == {"timeout": 9}
  assert code_stats["process"]["verdicts"] == {"timeout": 3}
  assert code_stats["cost"]["sandbox_runs_per_task"] == 3.0
  assert code_stats["process"]["components"]["parses"] == 1.0
  assert code_stats["process"]["components"]["runs"] == 0.0
  tools = s["domains"][calc]["process"]
  assert tools["tool_calls_per_task"] == 2.0 and tools["tool_call_validity"] == 0.5
  assert tools["retries_per_task"] == 1.0 and tools["turns_per_task"] == 2.0
  assert s["domains"][plain]["greedy_pass_rate"] == 1.0  # Demonstrations pass.
  assert s["domains"][plain]["process"]["sandbox_statuses"] == {}
  assert s["overall"]["process"]["sandbox_statuses"] == {"timeout": 9}
  assert s["strata"]["tool_calls"]["2"]["tasks"] == 3
  seconds = recorder.seconds()[code]
  assert seconds == {"runs": 9, "wall_s": 9 * 0.25, "cpu_s": 9 * 0.125}


def test_pass_rates_keep_per_task_outcomes_and_the_change_pairs_them():
  add, sub = "arithmetic/add_d1", "arithmetic/sub_d1"
  before = evaluation.pass_rates(_DemoWorker({sub: "<answer>no</answer>"}), [add, sub],
                                 seeds_per_domain=4, samples=3)
  after = evaluation.pass_rates(_DemoWorker(), [add, sub], seeds_per_domain=4, samples=3)
  assert [(t["domain"], t["passed"], t["sampled_passed"], t["samples"])
          for t in before["tasks"]] == [(add, True, 3, 3)] * 4 + [(sub, False, 0, 3)] * 4
  assert before["pass_rate"] == before["sampled"]["pass_rate"] == 0.5
  change = evaluation.pass_rate_change(before, after)
  assert change["tasks"] == 8
  for kind in ("greedy", "pass@1"):
    c = change[kind]
    assert c["difference"] == 0.5 and 0 < c["ci_low"] < 0.5 < c["ci_high"] <= 1.0, kind
  # Reversed, the change mirrors; reports without per-task outcomes give no change.
  back = evaluation.pass_rate_change(after, before)
  assert back["pass@1"] == {"difference": -0.5, "ci_low": -change["pass@1"]["ci_high"],
                            "ci_high": -change["pass@1"]["ci_low"]}
  assert evaluation.pass_rate_change({"pass_rate": 0.5}, after) == {}
  with pytest.raises(ValueError, match="share no"):
    evaluation.pass_rate_change(before, {"tasks": [{"domain": add, "seed": -1,
                                                    "passed": True}]})


def test_pass_at_one_change_is_the_mean_paired_difference_with_a_normal_interval():
  rng = np.random.default_rng(0)
  n, k = 200, 4
  b, a = rng.integers(0, k + 1, n), rng.integers(0, k + 1, n)
  rep = lambda c: {"tasks": [{"domain": "d", "seed": i, "passed": bool(x == k),
                              "sampled_passed": int(x), "samples": k}
                             for i, x in enumerate(c)]}
  c = evaluation.pass_rate_change(rep(b), rep(a), confidence=0.9)["pass@1"]
  d = (a - b) / k
  half = 1.6448536269514722 * d.std(ddof=1) / math.sqrt(n)
  assert c["difference"] == pytest.approx(d.mean(), abs=1e-6)
  assert (c["ci_low"], c["ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half),
                                                      abs=1e-6)


def test_eval_pairs_are_heldout_and_validated():
  pairs = evaluation.eval_pairs(["a", "b"], 3, first_seed_index=2)
  assert pairs == [("a", 5), ("a", 7), ("a", 9), ("b", 5), ("b", 7), ("b", 9)]
  with pytest.raises(ValueError, match="seeds_per_domain must be >= 1, got 0"):
    evaluation.eval_pairs(["a"], 0)


def test_select_domains_errors_name_the_pattern():
  assert experiment.select_domains("arithmetic/add_d1,strings/copy_l*", "1") == [
      "arithmetic/add_d1", "strings/copy_l1"]
  with pytest.raises(ValueError, match="'nope/\\*'"):
    experiment.select_domains("nope/*")


# ----------------------------------------------------------------------------------------
# Reports and plots on a synthetic report
# ----------------------------------------------------------------------------------------


def _read(path):
  with open(path) as fh:
    return fh.read()


def _png_size(path):
  with open(path, "rb") as fh:
    head = fh.read(24)
  assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
  return struct.unpack(">II", head[16:24])


def _synthetic_report(with_regression=True):
  records = [{"domain": d, "family": d.split("/")[0], "level": lvl, "seed": s,
              "prompt_tokens": 20 + s, "passed": s % 3 == 1, "reward": float(s % 3 == 1),
              "verdict": "correct" if s % 3 == 1 else "wrong", "components": {"format": 1.0},
              "tool_calls": 0, "valid_tool_calls": None, "retries": 0, "turns": 1,
              "generated_tokens": 7, "finish_reason": "stop", "samples": 2,
              "sampled_passed": s % 3, "sampled_reward": 0.5, "sampled_generated_tokens": 14}
             for d, lvl in (("a/x_l1", 1), ("b/y_l2", 2)) for s in (1, 3, 5, 7)]
  rep = {"format": 1, "step": 7, "settings": {
      "domains": ["a/x_l1", "b/y_l2"], "seeds_per_domain": 4, "first_seed_index": 0,
      "heldout_seeds": [1, 7], "samples": 2, "k": [1, 2], "temperature": 1.0, "top_p": 0.0,
      "top_k": 0, "max_new_tokens": 8, "max_turns": 1, "seed": 0},
         **evaluation.summarize(records), "tasks": records}
  if with_regression:
    worse = [dict(r, passed=False) if r["domain"] == "b/y_l2" else r for r in records]
    rep["regression"] = evaluation.compare_reports({"step": 3, "tasks": records},
                                                   {"tasks": worse})
  return rep


def test_report_files_tables_and_png_sizes(tmp_path):
  rows = [{"step": s, "reward/mean": s / 10, "reward/a/x_l1": s / 20, "reward/b/y_l2": 0.1}
          for s in range(1, 6)] + [{"step": 6, "kl": 0.1}]
  with open(tmp_path / "metrics.jsonl", "w") as fh:
    fh.writelines(json.dumps(r) + "\n" for r in rows)
  rep = _synthetic_report()
  paths = report.write(str(tmp_path / "out"), rep, {"greedy_s": 1.5, "total_s": 2.0,
                                                   "sandbox": {}}, str(tmp_path))
  assert _png_size(paths["family"]) == report.FAMILY_PLOT_PX
  assert _png_size(paths["curves"]) == report.CURVES_PLOT_PX
  assert json.loads(_read(paths["report"])) == rep
  assert "greedy_s" in json.loads(_read(paths["timing"]))
  md = _read(paths["markdown"])
  assert "| b/y_l2 | 4 | 0.500 | 0.000 | -0.500 |" in md  # 2 of 4 seeds passed before.
  assert "## Regression vs checkpoint 3" in md and "Regressed: none" in md
  assert "| a | 4 | 2 | 0.500 | 0.500 | 0.750 |" in md  # Family row: greedy, pass@1, @2.
  assert f"![greedy pass rate by family]({report.FAMILY_PLOT})" in md
  series = report.reward_series(rows)
  assert series["a/x_l1"] == ([1, 2, 3, 4, 5], [0.05, 0.1, 0.15, 0.2, 0.25])


def test_compare_reports_pairs_by_domain_and_seed_and_flags_the_broken_domain():
  rep = _synthetic_report(with_regression=False)
  broken = [dict(r, passed=r["domain"] == "a/x_l1" and r["passed"]) for r in rep["tasks"]]
  for r in broken:  # b/y_l2 passed everything before and nothing now.
    if r["domain"] == "b/y_l2":
      r["passed"] = False
  base = [dict(r, passed=True) if r["domain"] == "b/y_l2" else r for r in rep["tasks"]]
  reg = evaluation.compare_reports({"step": 1, "tasks": base[::-1]}, {"tasks": broken})
  assert reg["regressed"] == ["b/y_l2"] and reg["paired_tasks"] == 8
  assert reg["families"]["b"]["regressed"] and not reg["families"]["a"]["regressed"]
  assert reg["domains"]["a/x_l1"]["difference"] == 0.0
  with pytest.raises(ValueError, match="share no"):
    evaluation.compare_reports({"tasks": base}, {"tasks": [dict(broken[0], seed=99)]})


# ----------------------------------------------------------------------------------------
# End to end on a tiny trained checkpoint
# ----------------------------------------------------------------------------------------

# Small enough that training compiles and finishes in well under a minute on 2 cores.
OVERRIDES = {
    "model.overrides.num_layers": 1, "model.overrides.d_model": 32,
    "model.overrides.ffn_dim": 64, "sft.steps": 0, "train.rl_steps": 2,
    "train.rows_per_microbatch": 8, "train.row_len": 128, "rollout.prompts_per_step": 4,
    "rollout.max_new_tokens": 8, "rollout.max_len": 128, "rl.group_size": 4,
    "eval.seeds_per_domain": 0, "checkpoint.every": 1, "checkpoint.keep_last": 5,
    "checkpoint.async_save": False, "tasks.domains": "arithmetic/add_d1,strings/copy_l1",
    "tasks.levels": "1",
}


def _config():
  return planner.override(default.get_config(), OVERRIDES)


class _FixedDomain(Domain):
  """Passes on a fixed set of seeds whatever the model writes (or never, when broken)."""

  def __init__(self, name, level, passes):
    super().__init__(name, "evaltest", level)
    self.passes, self.broken = passes, False

  def _sample(self, rng, seed):
    return Task(self.name, seed, "Say" + " so" * seed + f". {ANSWER_INSTRUCTION}", "x",
                {}, self.level, self.family)

  def _score(self, task, completion):
    ok = self.passes(task.seed) and not self.broken
    return Reward(float(ok), {"format": 1.0, "exact": float(ok)}, "correct" if ok else "wrong")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 2-step RL run (checkpoints 1 and 2); the seeds every task was sampled from."""
  workdir = str(tmp_path_factory.mktemp("run"))
  seen = []
  sample = Domain.sample

  def recording_sample(self, seed):
    seen.append((self.name, seed))
    return sample(self, seed)

  Domain.sample = recording_sample
  try:
    summary = trainer.train(_config(), workdir)
  finally:
    Domain.sample = sample
  assert summary["status"] == "done"
  return workdir, seen


@pytest.fixture
def fixed():
  """Two model-independent domains, registered for one test only (the registry is global
  and other modules' tests may run in this process between ours)."""
  domains = [_FixedDomain("evaltest/always_l1", 1, lambda s: True),
             _FixedDomain("evaltest/half_l2", 2, lambda s: s % 4 == 1)]
  for d in domains:
    registry.register(d)
  yield {d.name: d for d in domains}
  for d in domains:
    registry.unregister(d.name)


def test_report_on_a_trained_checkpoint(run, fixed):
  workdir, train_seen = run
  seen = []
  sample = Domain.sample

  def recording_sample(self, seed):
    seen.append((self.name, seed))
    return sample(self, seed)

  Domain.sample = recording_sample
  try:
    rep, timing = evaluation.evaluate_checkpoint(
        _config(), workdir, domains="arithmetic/add_d1,evaltest/*", samples=2,
        seeds_per_domain=4, baseline_step=2)
  finally:
    Domain.sample = sample
  # Held-out seeds never meet a training seed, for any domain.
  train_seeds, eval_seeds = {s for _, s in train_seen}, {s for _, s in seen}
  assert train_seeds and eval_seeds and not train_seeds & eval_seeds
  assert eval_seeds == {1, 3, 5, 7}
  assert rep["step"] == 2 and [t["seed"] for t in rep["tasks"]] == [1, 3, 5, 7] * 3
  o = rep["overall"]
  assert o["tasks"] == 12 and o["greedy_passed"] == 4 + 2  # always: 4; half: seeds 1, 5.
  for name, buckets in rep["strata"].items():
    assert sum(b["tasks"] for b in buckets.values()) == 12, name
    assert sum(b["greedy_passed"] for b in buckets.values()) == 6, name
  assert list(rep["strata"]["family"]) == ["arithmetic", "evaltest"]
  assert rep["strata"]["level"]["2"]["greedy_pass_rate"] == 0.5
  assert len(rep["strata"]["prompt_tokens"]) >= 2
  always = rep["domains"]["evaltest/always_l1"]
  assert always["greedy_pass_rate"] == 1.0 and always["pass_at_k"] == {"1": 1.0, "2": 1.0}
  assert rep["domains"]["evaltest/half_l2"]["pass_at_k"]["2"] == 0.5
  # maj@k next to pass@k: every task here has an answer protocol to vote on.
  assert list(o["maj_at_k"]) == ["1", "2"] and o["maj_tasks"] == 12
  assert all("sampled_votes" in t and "sampled_majority" in t for t in rep["tasks"])
  assert all(t["generated_tokens"] <= 8 for t in rep["tasks"])
  assert o["cost"]["generated_tokens"] == sum(t["generated_tokens"] for t in rep["tasks"])
  assert set(timing) >= {"restore_s", "greedy_s", "sampled_s", "baseline_s", "total_s"}
  # Identical checkpoints: nothing flagged, every difference exactly zero.
  reg = rep["regression"]
  assert reg["regressed"] == [] and reg["baseline_step"] == 2
  assert all(v["difference"] == 0 for v in reg["domains"].values())
  # Files: report.json is the returned report; the plots are PNGs of the documented size.
  out = os.path.join(workdir, "eval", "step_2")
  with open(os.path.join(out, "report.json")) as fh:
    first = fh.read()
  assert json.loads(first) == rep
  assert _png_size(os.path.join(out, report.FAMILY_PLOT)) == report.FAMILY_PLOT_PX
  assert _png_size(os.path.join(out, report.CURVES_PLOT)) == report.CURVES_PLOT_PX
  md = _read(os.path.join(out, "report.md"))
  assert "| evaltest/half_l2 | 2 | 4 | 2 | 0.500 |" in md
  assert "| pass@1 | pass@2 | maj@1 | maj@2 |" in md
  # The same checkpoint and seed give a byte-identical report.json.
  evaluation.evaluate_checkpoint(_config(), workdir, domains="arithmetic/add_d1,evaltest/*",
                                 samples=2, seeds_per_domain=4, baseline_step=2)
  with open(os.path.join(out, "report.json")) as fh:
    assert fh.read() == first


def test_initial_evaluation_reads_init_from_without_checkpoints(run, fixed, tmp_path):
  """--initial evaluates the weights a run starts from: with init_from an earlier run it
  gives that run's newest checkpoint's report, task for task, from a workdir holding no
  checkpoint; and it writes DIR/eval/initial/."""
  workdir, _ = run
  kw = dict(domains="arithmetic/add_d1,evaltest/*", samples=2, seeds_per_domain=2)
  trained, _ = evaluation.evaluate_checkpoint(_config(), workdir, write=False, **kw)
  c = planner.override(_config(), {"init_from": workdir})
  fresh = str(tmp_path / "fresh")
  initial, _ = evaluation.evaluate_checkpoint(c, fresh, initial=True, **kw)
  assert initial["tasks"] == trained["tasks"] and initial["step"] == 0
  assert initial["initial"] == workdir
  with open(os.path.join(fresh, "eval", "initial", "report.json")) as fh:
    assert json.loads(fh.read()) == initial
  with pytest.raises(ValueError, match="give no step or baseline_step"):
    evaluation.evaluate_checkpoint(c, fresh, initial=True, step=2, **kw)
  with pytest.raises(ValueError, match="--initial evaluates"):
    evaluation.evaluate_checkpoint(c, fresh, **kw)


def test_regression_flags_a_domain_broken_on_purpose(run, fixed, monkeypatch):
  workdir, _ = run
  params = evaluation.Policy.params

  def params_breaking_the_newest(self, step):
    # The current checkpoint (2) gets a broken always-pass domain; the baseline (1) not.
    fixed["evaltest/always_l1"].broken = step != 1
    return params(self, step)

  monkeypatch.setattr(evaluation.Policy, "params", params_breaking_the_newest)
  try:
    rep, _ = evaluation.evaluate_checkpoint(
        _config(), workdir, step=2, domains="evaltest/*", samples=0, seeds_per_domain=6,
        baseline_step=1, write=False)
  finally:
    fixed["evaltest/always_l1"].broken = False
  reg = rep["regression"]
  assert reg["regressed"] == ["evaltest/always_l1"]
  broken = reg["domains"]["evaltest/always_l1"]
  assert (broken["baseline_pass_rate"], broken["pass_rate"]) == (1.0, 0.0)
  assert broken["ci_high"] < 0
  assert reg["families"]["evaltest"]["difference"] == pytest.approx(-0.5)
  assert not reg["domains"]["evaltest/half_l2"]["regressed"]
  assert "pass_at_k" not in rep["overall"] and rep["settings"]["k"] == []
  assert "maj_at_k" not in rep["overall"]


def test_bad_arguments_are_one_line_errors(run):
  workdir, _ = run
  with pytest.raises(ValueError, match="step=9 is not a checkpoint .* have \\[1, 2\\]"):
    evaluation.evaluate_checkpoint(_config(), workdir, step=9, seeds_per_domain=1)
  with pytest.raises(ValueError, match="baseline_step=7 is not a checkpoint"):
    evaluation.evaluate_checkpoint(_config(), workdir, baseline_step=7, seeds_per_domain=1)
  with pytest.raises(ValueError, match="no checkpoints/ folder"):
    evaluation.evaluate_checkpoint(_config(), workdir + "/nope", seeds_per_domain=1)
  with pytest.raises(ValueError, match="seeds_per_domain must be >= 1, got 0"):
    evaluation.evaluate_checkpoint(_config(), workdir)  # The config's 0.
  cfg = _config()
  cfg.rollout.temperature = 0.0
  with pytest.raises(ValueError, match="samples=4 needs rollout.temperature > 0"):
    evaluation.evaluate_checkpoint(cfg, workdir, samples=4, seeds_per_domain=1)


def test_launcher_error_is_one_line(run):
  workdir, _ = run
  env = {**os.environ, "XLA_FLAGS": xla_flags(8),
         "JAX_PLATFORMS": "cpu"}
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  proc = subprocess.run(
      [sys.executable, "-m", "launch.eval", f"--config={ROOT}/configs/default.py",
       f"--workdir={workdir}", "--step=9", "--seeds_per_domain=1", *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "error: step=9 is not a checkpoint" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_tool_call_counts_come_from_the_domain_and_validity_only_where_judged():
  from posttrain.evaluation import _tool_calls
  from posttrain.rollout.worker import Sample
  from posttrain.tasks import Reward

  def sample(components, worker_calls=3):
    return Sample([1], [2], [1], [0.0], "", "stop", reward=Reward(1.0, components),
                  tool_calls=worker_calls)

  assert _tool_calls(sample({"tool_calls": 4.0, "tool_valid": 0.5})) == (4, 2)  # judged
  assert _tool_calls(sample({"tool_calls": 2.0})) == (2, None)  # counted, not judged
  assert _tool_calls(sample({"exact": 1.0})) == (3, None)  # the worker's count
