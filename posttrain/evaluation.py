"""Evaluation on held-out seeds: stratified pass rates, pass@k, maj@k, process and cost
metrics, and regressions between checkpoints.

    report, timing = evaluation.evaluate_checkpoint(config, workdir, samples=8)

writes DIR/eval/step_N/:
  report.json   everything that is a function of (checkpoint, settings, seed): per-task
                outcomes, pass rates per stratum, process metrics, token and sandbox-run
                counts, the regression check. The same checkpoint and seed give a
                byte-identical file.
  timing.json   what varies from run to run: wall time per phase and sandbox seconds
                (per domain and per task). Kept out of report.json on purpose.
  report.md     the tables of both, for people.
  pass_rate_by_family.png, reward_curves.png   (posttrain.report)

Held-out seeds (`posttrain.tasks.heldout_seed`, odd) never meet the training seeds (even),
by construction; `evaluate_checkpoint` checks every seed it uses.

A task passes when its verifier's value is 1 (the trainer's `pass_rate` too): the reward's
`verifier` component where a reward model's score was mixed in, else its value. The
rollouts here never go through the trainer's reward model. Greedy pass@1
decodes at temperature 0; pass@k draws `samples` completions at the rollout temperature and
uses the unbiased estimator of Chen et al. (2021). maj@k (cons@k, self-consistency) is the
expected correctness of the majority answer of k of those samples, exactly over all k-subsets
(`posttrain.majority_vote`); code domains, which give no answer to vote on, are left out of
it, and `maj_tasks` counts the tasks it averages over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from posttrain import experiment, majority_vote, models
from posttrain.checkpoint import CheckpointManager
from posttrain.data.tokenizer import load_tokenizer
from posttrain.rl import train_step as ts
from posttrain.rollout import RolloutWorker
from posttrain.sampling import Sampler
from posttrain.tasks import execution, heldout_seed, is_heldout_seed, registry
from posttrain.tasks.families.tools import OBS_CLOSE, OBS_OPEN, TOOL_OPEN
from posttrain.tasks.reward_model import verifier_value

log = logging.getLogger("posttrain")

REPORT_FORMAT = 1
# Families whose domains run programs: rolled out one domain at a time, so that every
# sandbox run is counted against the domain that caused it.
SANDBOX_FAMILIES = ("code", "tools")
# Reward components that measure a step on the way to a pass.
INTERMEDIATE_COMPONENTS = ("format", "parses", "runs", "tests_passed", "partial", "tool_valid")
_DIGITS = 6


def pass_rates(worker, domains: Sequence[str], *, seeds_per_domain: int,
               first_seed_index: int = 0, samples: int = 0,
               temperature: float = 1.0) -> dict[str, Any]:
  """Greedy pass rate (verifier value 1) on `seeds_per_domain` held-out seeds of each domain,
  and with `samples` > 0 the mean pass rate of that many samples at `temperature`.

  Returns:
    {"pass_rate": overall, "families": {family: rate}, "domains": {domain: rate},
     "reward": mean reward, "samples": count, and with samples > 0
     "sampled": {"pass_rate", "families", "domains"}}
  """
  pairs = [(d, heldout_seed(first_seed_index + i)) for d in domains
           for i in range(seeds_per_domain)]
  greedy = worker.rollout(pairs, seed=0, group_size=1, temperature=0.0)
  report = _summarise(greedy)
  tasks = [{"domain": g.domain, "seed": int(g.seed), "passed": _passed(g.samples[0])}
           for g in greedy]
  if samples > 0:
    sampled_groups = worker.rollout(pairs, seed=1, group_size=samples, temperature=temperature)
    sampled = _summarise(sampled_groups)
    report["sampled"] = {k: sampled[k] for k in ("pass_rate", "families", "domains")}
    for t, g in zip(tasks, sampled_groups):
      t["sampled_passed"] = sum(_passed(x) for x in g.samples)
      t["samples"] = len(g.samples)
  report["tasks"] = tasks
  return report


def _paired_tasks(before: Mapping[str, Any], after: Mapping[str, Any]):
  """Both reports' task records by (domain, seed), and the sorted keys they share."""
  b = {(t["domain"], t["seed"]): t for t in before["tasks"]}
  a = {(t["domain"], t["seed"]): t for t in after["tasks"]}
  keys = sorted(set(b) & set(a))
  if not keys:
    raise ValueError("the two reports share no (domain, seed) task; evaluate both on the "
                     "same domains and seeds")
  return b, a, keys


def pass_rate_change(before: Mapping[str, Any], after: Mapping[str, Any], *,
                     confidence: float = 0.95) -> dict[str, Any]:
  """How much two `pass_rates` reports on the same held-out tasks differ, with intervals.

  Tasks pair up by (domain, seed). Greedy: Newcombe's paired interval on pass/fail.
  Sampled pass@1 (when both reports sampled): the mean over tasks of the per-task change
  in the fraction of samples that passed, with a normal interval on that mean (the tasks
  are the independent units; samples of one task are not).

  Returns:
    {"tasks": n, "greedy": {"difference", "ci_low", "ci_high"}, and "pass@1" alike},
    after minus before; {} when either report has no per-task outcomes.
  """
  if "tasks" not in before or "tasks" not in after:
    return {}
  b, a, keys = _paired_tasks(before, after)
  out: dict[str, Any] = {"tasks": len(keys), "confidence": confidence}
  g = compare_outcomes({"all": [b[k]["passed"] for k in keys]},
                       {"all": [a[k]["passed"] for k in keys]}, confidence=confidence)["all"]
  out["greedy"] = {k: g[k] for k in ("difference", "ci_low", "ci_high")}
  if all("samples" in b[k] and "samples" in a[k] for k in keys):
    d = np.asarray([a[k]["sampled_passed"] / a[k]["samples"]
                    - b[k]["sampled_passed"] / b[k]["samples"] for k in keys], np.float64)
    mean = float(d.mean())
    half = _z(confidence) * float(d.std(ddof=1)) / math.sqrt(len(d)) if len(d) > 1 else math.inf
    out["pass@1"] = {"difference": _r(mean), "ci_low": _r(max(-1.0, mean - half)),
                     "ci_high": _r(min(1.0, mean + half))}
  return out


def _summarise(groups) -> dict[str, Any]:
  by_domain: dict[str, list[float]] = defaultdict(list)
  rewards = []
  for g in groups:
    for sample in g.samples:
      rewards.append(float(sample.reward.value))
      by_domain[g.domain].append(1.0 if verifier_value(sample.reward) >= 1.0 else 0.0)
  by_family: dict[str, list[float]] = defaultdict(list)
  for d, v in by_domain.items():
    by_family[registry.get(d).family] += v
  return {
      "pass_rate": float(np.mean([v for vs in by_domain.values() for v in vs])),
      "families": {f: float(np.mean(v)) for f, v in sorted(by_family.items())},
      "domains": {d: float(np.mean(v)) for d, v in sorted(by_domain.items())},
      "reward": float(np.mean(rewards)),
      "samples": len(rewards),
  }


# ----------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct (Chen et al. 2021).

      pass@k = 1 - C(n - c, k) / C(n, k)

  computed as a product, 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never overflows.
  """
  n, c, k = int(num_samples), int(num_correct), int(k)
  if not 0 <= c <= n:
    raise ValueError(f"num_correct={num_correct} must be in [0, num_samples={num_samples}]")
  if not 1 <= k <= n:
    raise ValueError(f"k={k} must be in [1, num_samples={num_samples}]")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def _z(confidence: float) -> float:
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence must be in (0, 1), got {confidence}")
  return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
  """Wilson score interval for a binomial proportion: the p with |p_hat - p| <=
  z sqrt(p (1 - p) / n)."""
  if n < 1 or not 0 <= successes <= n:
    raise ValueError(f"need 0 <= successes={successes} <= n={n} and n >= 1")
  z = _z(confidence)
  p = successes / n
  denom = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference_interval(both: int, baseline_only: int, current_only: int, neither: int,
                               confidence: float = 0.95) -> tuple[float, float, float]:
  """Newcombe's square-and-add interval for the difference of paired proportions.

  The pairs are the same task under the baseline and the current checkpoint; the counts
  say which of the two passed. With p_c, p_b the pass rates, (l, u) their Wilson intervals
  and phi their (continuity-corrected) correlation, the difference d = p_c - p_b lies in

      d - sqrt((p_c - l_c)^2 + (u_b - p_b)^2 - 2 phi (p_c - l_c)(u_b - p_b))
      d + sqrt((p_b - l_b)^2 + (u_c - p_c)^2 - 2 phi (p_b - l_b)(u_c - p_c))

  (Newcombe 1998, Statistics in Medicine 17:2635, method 10). Close to nominal coverage
  down to a handful of pairs, unlike the Wald interval or a bootstrap.

  Returns:
    (difference, low, high), current minus baseline.
  """
  counts = (both, baseline_only, current_only, neither)
  if any(int(c) != c or c < 0 for c in counts) or sum(counts) < 1:
    raise ValueError(f"paired counts must be non-negative ints with a positive sum, got "
                     f"{counts}")
  n = sum(counts)
  cur_pass, base_pass = both + current_only, both + baseline_only
  p_c, p_b = cur_pass / n, base_pass / n
  l_c, u_c = wilson_interval(cur_pass, n, confidence)
  l_b, u_b = wilson_interval(base_pass, n, confidence)
  margins = cur_pass * (n - cur_pass) * base_pass * (n - base_pass)
  phi = 0.0
  if margins:
    a = both * neither - current_only * baseline_only
    phi = (a - n / 2) / math.sqrt(margins) if a > n / 2 else min(a, 0) / math.sqrt(margins)
  d = p_c - p_b
  lo = d - math.sqrt(max(0.0, (p_c - l_c) ** 2 + (u_b - p_b) ** 2
                         - 2 * phi * (p_c - l_c) * (u_b - p_b)))
  hi = d + math.sqrt(max(0.0, (p_b - l_b) ** 2 + (u_c - p_c) ** 2
                         - 2 * phi * (p_b - l_b) * (u_c - p_c)))
  return d, max(-1.0, lo), min(1.0, hi)


def compare_outcomes(baseline: Mapping[str, Sequence[bool]], current: Mapping[str, Sequence[bool]],
                     *, confidence: float = 0.95) -> dict[str, dict[str, Any]]:
  """Per-name paired comparison of pass/fail outcomes (the same tasks, in the same order).

  A name is `regressed` when the whole confidence interval of (current - baseline) lies
  below zero, `improved` when it lies above. Each name is tested at `confidence` on its
  own: with many domains expect about (1 - confidence) / 2 of the unchanged-but-noisy ones
  to be flagged by chance.
  """
  if set(baseline) != set(current):
    odd = sorted(set(baseline) ^ set(current))
    raise ValueError(f"baseline and current outcomes cover different names, e.g. {odd[0]!r}")
  out = {}
  for name in sorted(baseline):
    b, c = [bool(x) for x in baseline[name]], [bool(x) for x in current[name]]
    if len(b) != len(c) or not b:
      raise ValueError(f"{name!r}: {len(b)} baseline vs {len(c)} current outcomes; they "
                       "must pair up and be non-empty")
    both = sum(x and y for x, y in zip(b, c))
    base_only = sum(x and not y for x, y in zip(b, c))
    cur_only = sum(y and not x for x, y in zip(b, c))
    d, lo, hi = paired_difference_interval(both, base_only, cur_only,
                                           len(b) - both - base_only - cur_only, confidence)
    out[name] = {"tasks": len(b), "baseline_pass_rate": _r(sum(b) / len(b)),
                 "pass_rate": _r(sum(c) / len(c)), "difference": _r(d), "ci_low": _r(lo),
                 "ci_high": _r(hi), "regressed": hi < 0, "improved": lo > 0}
  return out


def compare_reports(baseline: Mapping[str, Any], current: Mapping[str, Any], *,
                    confidence: float = 0.95) -> dict[str, Any]:
  """Regression check of two reports' greedy outcomes, paired by (domain, seed).

  Returns the `regression` block of a report: per domain, per family and overall
  differences with intervals, and the list of regressed domains.
  """
  base, cur, keys = _paired_tasks(baseline, current)
  groups: dict[str, dict[str, tuple[list, list]]] = {"domains": {}, "families": {}}
  for key in keys:
    for kind, name in (("domains", key[0]), ("families", cur[key]["family"])):
      b, c = groups[kind].setdefault(name, ([], []))
      b.append(base[key]["passed"])
      c.append(cur[key]["passed"])
  result: dict[str, Any] = {"baseline_step": baseline.get("step"), "confidence": confidence,
                            "method": "Newcombe paired interval, greedy pass@1 by seed",
                            "paired_tasks": len(keys)}
  for kind, by_name in groups.items():
    result[kind] = compare_outcomes({k: v[0] for k, v in by_name.items()},
                                    {k: v[1] for k, v in by_name.items()},
                                    confidence=confidence)
  result["overall"] = compare_outcomes({"all": [base[k]["passed"] for k in keys]},
                                       {"all": [cur[k]["passed"] for k in keys]},
                                       confidence=confidence)["all"]
  result["regressed"] = [d for d, v in result["domains"].items() if v["regressed"]]
  return result


# ----------------------------------------------------------------------------------------
# Per-task records and their summaries
# ----------------------------------------------------------------------------------------


def _r(x: float) -> float:
  return round(float(x), _DIGITS)


def _mean(xs: Iterable[float]) -> float | None:
  xs = list(xs)
  return _r(sum(xs) / len(xs)) if xs else None


def prompt_length_bucket(num_tokens: int) -> str:
  """Powers of two: '1-16', '17-32', '33-64', ..."""
  hi = max(16, 1 << max(int(num_tokens) - 1, 0).bit_length())
  return f"{1 if hi == 16 else hi // 2 + 1}-{hi}"


def reasoning_bucket(num_tokens: int) -> str:
  """'none' for a completion without reasoning, else powers of two as prompt lengths are."""
  return "none" if not num_tokens else prompt_length_bucket(num_tokens)


def tool_call_bucket(num_calls: int, cap: int = 4) -> str:
  return str(num_calls) if num_calls < cap else f"{cap}+"


def verdict_kind(verdict: str) -> str:
  """'wrong (2/6 passed)' -> 'wrong', 'sandbox_error: ...' -> 'sandbox_error'."""
  head = verdict.split(":", 1)[0].split(" (", 1)[0].strip()
  return head or "(none)"


def count_retries(text: str) -> int:
  """Tool calls made after an error observation (the model trying again)."""
  retries, pos = 0, 0
  while True:
    start = text.find(OBS_OPEN, pos)
    if start < 0:
      return retries
    end = text.find(OBS_CLOSE, start)
    if end < 0:
      return retries
    body = text[start + len(OBS_OPEN):end].lstrip()
    pos = end + len(OBS_CLOSE)
    if body.startswith("error") and text.find(TOOL_OPEN, pos) >= 0:
      retries += 1


def _tool_calls(sample) -> tuple[int, int | None]:
  """(calls, valid calls): from the reward when the domain counts calls (valid ones only
  where it judges them, `tool_valid`), else the worker's count."""
  comps = sample.reward.components if sample.reward else {}
  if "tool_calls" in comps:
    calls = round(float(comps["tool_calls"]))
    if "tool_valid" not in comps:
      return calls, None
    return calls, round(float(comps["tool_valid"]) * calls)
  return int(sample.tool_calls), None


def _passed(sample) -> bool:
  return bool(sample.reward is not None and verifier_value(sample.reward) >= 1.0)


def task_records(greedy_groups, sampled_groups=None) -> list[dict[str, Any]]:
  """One JSON-safe record per task from greedy groups (and sampled groups, same order)."""
  if sampled_groups is not None and len(sampled_groups) != len(greedy_groups):
    raise ValueError(f"{len(greedy_groups)} greedy groups but {len(sampled_groups)} sampled")
  records = []
  for i, g in enumerate(greedy_groups):
    s = g.samples[0]
    calls, valid = _tool_calls(s)
    reward = s.reward
    rec = {"domain": g.domain, "family": registry.get(g.domain).family, "level": g.task.level,
           "seed": int(g.seed), "prompt_tokens": len(s.prompt_tokens), "passed": _passed(s),
           "reward": _r(reward.value if reward else 0.0),
           "verdict": verdict_kind(reward.verdict if reward else ""),
           "components": {k: _r(v) for k, v in sorted((reward.components if reward
                                                        else {}).items())},
           "tool_calls": calls, "valid_tool_calls": valid, "retries": count_retries(s.text),
           "turns": int(s.turns), "generated_tokens": s.num_generated,
           "reasoning_tokens": int(s.reasoning_tokens),
           "reasoning_closed": bool(s.reasoning_closed), "finish_reason": s.finish_reason}
    if sampled_groups is not None:
      sg = sampled_groups[i]
      if (sg.domain, sg.seed) != (g.domain, g.seed):
        raise ValueError(f"sampled group {i} is {sg.domain}/{sg.seed}, greedy is "
                         f"{g.domain}/{g.seed}")
      rec["samples"] = len(sg.samples)
      rec["sampled_passed"] = sum(_passed(x) for x in sg.samples)
      rec["sampled_reward"] = _r(np.mean([x.reward.value if x.reward else 0.0
                                          for x in sg.samples]))
      rec["sampled_generated_tokens"] = sum(x.num_generated for x in sg.samples)
      domain = registry.get(g.domain)
      if majority_vote.votes_on(domain):
        votes = majority_vote.vote_tally(
            [majority_vote.answer_key(domain, sg.task, x.text) for x in sg.samples],
            [_passed(x) for x in sg.samples])
        rec["sampled_votes"] = votes
        rec["sampled_majority"] = _r(majority_vote.maj_at_k(len(sg.samples), votes,
                                                            len(sg.samples)))
    records.append(rec)
  return records


def k_values(samples: int) -> list[int]:
  """1, 2, 4, ... up to `samples`, and `samples` itself."""
  ks = [k for k in (1 << i for i in range(max(samples, 1).bit_length())) if k <= samples]
  return sorted(set(ks) | ({samples} if samples else set()))


def group_stats(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Task count, greedy pass@1, and sampled pass@k and maj@k for a set of task records."""
  n = len(records)
  passed = sum(r["passed"] for r in records)
  out: dict[str, Any] = {"tasks": n, "greedy_passed": passed,
                         "greedy_pass_rate": _r(passed / n) if n else None,
                         "greedy_reward": _mean(r["reward"] for r in records)}
  if n and "samples" in records[0]:
    k_max = min(r["samples"] for r in records)
    out["sampled_pass_rate"] = _mean(r["sampled_passed"] / r["samples"] for r in records)
    out["pass_at_k"] = {str(k): _mean(pass_at_k(r["samples"], r["sampled_passed"], k)
                                      for r in records) for k in k_values(k_max)}
    voted = [r for r in records if "sampled_votes" in r]
    if voted:
      out["maj_at_k"] = {str(k): _mean(majority_vote.maj_at_k(r["samples"], r["sampled_votes"], k)
                                       for r in voted) for k in k_values(k_max)}
      out["maj_tasks"] = len(voted)
    out["sampled_reward"] = _mean(r["sampled_reward"] for r in records)
  return out


def process_metrics(records: Sequence[Mapping[str, Any]],
                    sandbox_statuses: Mapping[str, int] | None = None) -> dict[str, Any]:
  """Tool-call validity, retries, turns, reasoning length and how often it never ended
  (a reasoning model that ran out of tokens thinking), reward components, verdicts,
  sandbox statuses."""
  n = max(len(records), 1)
  calls = sum(r["tool_calls"] for r in records)
  scored = [r for r in records if r["valid_tool_calls"] is not None]
  scored_calls = sum(r["tool_calls"] for r in scored)
  components: dict[str, list[float]] = defaultdict(list)
  for r in records:
    for k, v in r["components"].items():
      components[k].append(v)
  return {
      "tool_calls_per_task": _r(calls / n),
      "tool_call_validity": (_r(sum(r["valid_tool_calls"] for r in scored) / scored_calls)
                             if scored_calls else None),
      "retries_per_task": _r(sum(r["retries"] for r in records) / n),
      "turns_per_task": _r(sum(r["turns"] for r in records) / n),
      "reasoning_tokens_per_task": _r(sum(r.get("reasoning_tokens", 0) for r in records) / n),
      "unclosed_reasoning_rate": _r(sum(not r.get("reasoning_closed", True)
                                        for r in records) / n),
      "components": {k: _mean(v) for k, v in sorted(components.items())},
      "verdicts": dict(sorted(Counter(r["verdict"] for r in records).items())),
      "sandbox_statuses": dict(sorted((sandbox_statuses or {}).items())),
  }


def cost_metrics(records: Sequence[Mapping[str, Any]], sandbox_runs: int = 0) -> dict[str, Any]:
  """Token and sandbox-run counts (deterministic; seconds go to timing.json)."""
  n = max(len(records), 1)
  out = {"generated_tokens": sum(r["generated_tokens"] for r in records),
         "generated_tokens_per_task": _r(sum(r["generated_tokens"] for r in records) / n),
         "sandbox_runs_per_task": _r(sandbox_runs / n)}
  sampled = [r for r in records if "samples" in r]
  if sampled:
    out["sampled_generated_tokens_per_sample"] = _r(
        sum(r["sampled_generated_tokens"] for r in sampled) / sum(r["samples"] for r in sampled))
  return out


STRATA = {
    "family": lambda r: r["family"],
    "level": lambda r: str(r["level"]),
    "prompt_tokens": lambda r: prompt_length_bucket(r["prompt_tokens"]),
    "tool_calls": lambda r: tool_call_bucket(r["tool_calls"]),
}


def _bucket_order(key: str):
  if key == "none":  # no reasoning: before any length
    return (-1, 0, key)
  head = key.split("-", 1)[0].rstrip("+")
  return (0, int(head), key) if head.isdigit() else (1, 0, key)


def summarize(records: Sequence[Mapping[str, Any]],
              sandbox: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, Any]:
  """Overall, per-stratum and per-domain summaries of task records.

  Args:
    records: `task_records(...)` output.
    sandbox: {domain: {status: runs}}; runs not attributed to a domain may use any key.

  Strata (family, level, prompt-length bucket, greedy tool calls, and, where any greedy
  completion reasoned, its reasoning length) each partition the tasks, so their `tasks`
  and `greedy_passed` add up to the overall counts.
  """
  sandbox = sandbox or {}
  all_statuses: Counter = Counter()
  for statuses in sandbox.values():
    all_statuses.update(statuses)
  by_domain: dict[str, list] = defaultdict(list)
  for r in records:
    by_domain[r["domain"]].append(r)
  strata = {}
  strata_keys = dict(STRATA)
  if any(r.get("reasoning_tokens") for r in records):  # reasoning models: does length pay?
    strata_keys["reasoning_tokens"] = lambda r: reasoning_bucket(r.get("reasoning_tokens", 0))
  for name, key in strata_keys.items():
    buckets: dict[str, list] = defaultdict(list)
    for r in records:
      buckets[key(r)].append(r)
    strata[name] = {b: group_stats(buckets[b]) for b in sorted(buckets, key=_bucket_order)}
  domains = {}
  for d in sorted(by_domain):
    recs = by_domain[d]
    statuses = dict(sandbox.get(d, {}))
    domains[d] = {"family": recs[0]["family"], "level": recs[0]["level"], **group_stats(recs),
                  "process": process_metrics(recs, statuses),
                  "cost": cost_metrics(recs, sum(statuses.values()))}
  return {"overall": {**group_stats(records),
                      "process": process_metrics(records, all_statuses),
                      "cost": cost_metrics(records, sum(all_statuses.values()))},
          "strata": strata, "domains": domains}


# ----------------------------------------------------------------------------------------
# Sandbox accounting
# ----------------------------------------------------------------------------------------


class SandboxRecorder:
  """Counts sandbox runs (status, wall and CPU seconds) against the domain being rolled out.

  While `installed()`, code and tool domains reach the sandbox through a recording proxy
  (`posttrain.tasks.execution.get_sandbox` is the documented injection point). Runs are
  credited to `self.domain`, which the evaluator sets around each domain's rollout.
  """

  def __init__(self):
    self.domain: str | None = None
    self.runs: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    self._lock = threading.Lock()

  def record(self, result) -> None:
    with self._lock:
      self.runs[self.domain or "(unattributed)"].append(
          (str(result.status), float(result.wall_s), float(result.cpu_s)))

  def statuses(self) -> dict[str, dict[str, int]]:
    return {d: dict(sorted(Counter(s for s, _, _ in runs).items()))
            for d, runs in sorted(self.runs.items())}

  def seconds(self) -> dict[str, dict[str, float]]:
    return {d: {"runs": len(runs), "wall_s": sum(w for _, w, _ in runs),
                "cpu_s": sum(c for _, _, c in runs)} for d, runs in sorted(self.runs.items())}

  @contextlib.contextmanager
  def installed(self):
    original = execution.get_sandbox
    recorder = self

    class _Recording:
      def __init__(self, inner):
        self._inner = inner

      def run(self, request):
        result = self._inner.run(request)
        recorder.record(result)
        return result

      def run_many(self, requests):
        results = self._inner.run_many(requests)
        for result in results:
          recorder.record(result)
        return results

      def __getattr__(self, name):
        return getattr(self._inner, name)

    execution.get_sandbox = lambda: _Recording(original())
    try:
      yield self
    finally:
      execution.get_sandbox = original


# ----------------------------------------------------------------------------------------
# Restoring a checkpoint and rolling out
# ----------------------------------------------------------------------------------------


class Policy:
  """A run's checkpoints opened read-only, restored onto the run's mesh on demand.

  Restores the whole train state (optimizer moments included: the checkpoint layer
  restores complete trees) and keeps only the params.
  """

  def __init__(self, config, workdir: str, *, initial: bool = False):
    self.config = config
    self.mesh = experiment.build_meshes(config)[1]
    self.rules = models.rules_from_config(config.get("sharding_rules") or None)
    self.tok = load_tokenizer(config.tokenizer)
    self.cfg = experiment.model_config(config, self.tok.vocab_size)
    self._graphdef, _, self._rest = ts._split_abstract(self.cfg)
    self.initial = initial
    self.ckpt = None
    if initial:  # the run's starting weights (config.init_from); checkpoints not needed
      return
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
      raise ValueError(f"workdir={workdir!r} has no checkpoints/ folder (--initial "
                       "evaluates the config's init_from without one)")
    self.ckpt = CheckpointManager(directory, read_only=True)
    self._abstract = experiment.abstract_checkpoint(
        self.cfg, experiment.optimizer_like(config), self.mesh, self.rules)

  def steps(self) -> list[int]:
    return self.ckpt.all_steps() if self.ckpt is not None else []

  def params(self, step: int | None):
    """(params, step) of checkpoint `step` (None: the newest readable one); with
    `initial`, the run's starting weights as step 0."""
    if self.initial:  # the model's own structure: an init_from folder's architecture
      model = experiment.initial_model(self.config, self.cfg, self.mesh, self.rules)
      self._graphdef, params, self._rest = nnx.split(model, nnx.Param, ...)
      return params, 0
    if step is not None and step not in self.steps():
      raise ValueError(f"step={step} is not a checkpoint in {self.ckpt.directory}; have "
                       f"{self.steps()}")
    restored = self.ckpt.restore(self._abstract, step=step)
    if restored is None:
      raise ValueError(f"no complete checkpoint in {self.ckpt.directory}")
    state, _, step = restored
    return state["params"], step

  def model(self, params) -> models.Transformer:
    return nnx.merge(self._graphdef, params, self._rest)

  def close(self):
    if self.ckpt is not None:
      self.ckpt.close()


def rollout_by_domain(worker, pairs: Sequence[tuple[str, int]], recorder: SandboxRecorder, *,
                      seed: int, group_size: int, temperature: float) -> list:
  """worker.rollout over `pairs`, in their order: domains that do not run programs in one
  batched call, each code/tool domain in its own call (so its sandbox runs are its own)."""
  blocks: dict[str | None, list[int]] = defaultdict(list)
  for i, (domain, _) in enumerate(pairs):
    uses_sandbox = registry.get(domain).family in SANDBOX_FAMILIES
    blocks[domain if uses_sandbox else None].append(i)
  order = ([None] if None in blocks else []) + sorted(b for b in blocks if b is not None)
  out: list = [None] * len(pairs)
  for n, block in enumerate(order):
    idx = blocks[block]
    recorder.domain = block
    groups = worker.rollout([pairs[i] for i in idx], seed=seed * 1009 + n,
                            group_size=group_size, temperature=temperature)
    recorder.domain = None
    for i, g in zip(idx, groups):
      out[i] = g
  return out


def eval_pairs(domains: Sequence[str], seeds_per_domain: int,
               first_seed_index: int = 0) -> list[tuple[str, int]]:
  """(domain, held-out seed) pairs; raises if any seed could be a training seed."""
  if int(seeds_per_domain) < 1:
    raise ValueError(f"seeds_per_domain must be >= 1, got {seeds_per_domain}")
  pairs = [(d, heldout_seed(first_seed_index + i)) for d in domains
           for i in range(int(seeds_per_domain))]
  bad = [s for _, s in pairs if not is_heldout_seed(s)]
  if bad:  # By construction never; the check guards the construction.
    raise RuntimeError(f"evaluation seed {bad[0]} is not a held-out seed")
  return pairs


def evaluate_checkpoint(config, workdir: str, *, step: int | None = None,
                        domains: str | None = None, samples: int = 0,
                        seeds_per_domain: int | None = None, baseline_step: int | None = None,
                        seed: int = 0, confidence: float = 0.95, first_seed_index: int = 0,
                        write: bool = True, initial: bool = False
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Evaluates checkpoint `step` of the run in `workdir` on held-out seeds; with `initial`,
  the weights the run starts from instead (config.init_from: a Hugging Face folder, an
  earlier run, or random), a baseline before any training, written to DIR/eval/initial/.

  Args:
    config: the run's config (model, mesh, tokenizer, rollout and tasks sections).
    workdir: the run's workdir (checkpoints under DIR/checkpoints, read only).
    step: checkpoint step; None for the newest.
    domains: comma-separated globs over registered domains (the run's task sources
      included); None for the config's `eval.domains`, else its `tasks.domains` and
      `tasks.levels`.
    samples: completions per task at the rollout temperature for pass@k (0: greedy only).
    seeds_per_domain: held-out seeds per domain; None for `config.eval.seeds_per_domain`.
    baseline_step: also evaluate this checkpoint (greedy, same seeds) and flag domains
      whose pass rate fell beyond noise.
    seed: sampling seed (the same seed and checkpoint give the same report.json).
    confidence: level of the regression intervals.
    first_seed_index: index of the first held-out seed.
    write: write DIR/eval/step_N/ (report.json, timing.json, report.md, plots).
    initial: evaluate config.init_from's weights (step 0 in the report); `step` and
      `baseline_step` must then be None.

  Returns:
    (report, timing): the contents of report.json and timing.json.
  """
  if experiment.objective(config) != "policy":
    raise ValueError(f"objective={experiment.objective(config)}: a reward model samples "
                     "nothing to evaluate; its held-out pair accuracy is eval_rm/* in "
                     "WORKDIR/metrics.jsonl")
  t_start = time.perf_counter()
  experiment.register_task_sources(config)  # the run's own domains can be named too
  names = (experiment.select_domains(domains) if domains else experiment.eval_domains(config))
  n_seeds = int(config.eval.seeds_per_domain if seeds_per_domain is None else seeds_per_domain)
  pairs = eval_pairs(names, n_seeds, first_seed_index)
  samples = int(samples)
  r = config.rollout
  temperature = float(r.temperature)
  if samples < 0:
    raise ValueError(f"samples must be >= 0, got {samples}")
  if samples and temperature <= 0:
    raise ValueError(f"samples={samples} needs rollout.temperature > 0, got {temperature}")
  if initial and (step is not None or baseline_step is not None):
    raise ValueError("initial evaluates the config's init_from: give no step or "
                     "baseline_step with it")
  policy = Policy(config, workdir, initial=initial)
  timing: dict[str, Any] = {}
  try:
    t0 = time.perf_counter()
    params, step = policy.params(step)
    if baseline_step is not None and baseline_step not in policy.steps():
      raise ValueError(f"baseline_step={baseline_step} is not a checkpoint in "
                       f"{policy.ckpt.directory}; have {policy.steps()}")
    sampler = Sampler(policy.model(params), mesh=policy.mesh, rules=policy.rules,
                      max_len=int(r.max_len), pad_id=policy.tok.pad_id,
                      gather_weights=bool(r.get("gather_weights", True)))
    timing["restore_s"] = time.perf_counter() - t0
    worker = RolloutWorker(
        sampler, policy.tok, group_size=1, max_new_tokens=int(r.max_new_tokens),
        temperature=temperature, top_p=float(r.top_p) if r.get("top_p") else None,
        top_k=int(r.top_k) if r.get("top_k") else None, chunk_rows=int(r.chunk_rows),
        scoring_threads=int(r.scoring_threads), max_turns=int(r.max_turns),
        continuous=bool(r.get("continuous_batching", True)),
        reasoning=experiment.rollout_reasoning(config),
        thinking=experiment.rollout_thinking(config),
        system_prompt=str(r.get("system_prompt", "") or "") or None,
        tool_format=experiment.rollout_tool_format(config))
    recorder = SandboxRecorder()
    try:
      with recorder.installed():
        t0 = time.perf_counter()
        greedy = rollout_by_domain(worker, pairs, recorder, seed=seed, group_size=1,
                                   temperature=0.0)
        timing["greedy_s"] = time.perf_counter() - t0
        sampled = None
        if samples:
          t0 = time.perf_counter()
          sampled = rollout_by_domain(worker, pairs, recorder, seed=seed + 1,
                                      group_size=samples, temperature=temperature)
          timing["sampled_s"] = time.perf_counter() - t0
        records = task_records(greedy, sampled)
        statuses, seconds = recorder.statuses(), recorder.seconds()
        baseline = None
        if baseline_step is not None:
          t0 = time.perf_counter()
          base_params, _ = policy.params(baseline_step)
          sampler.update_params(base_params)
          base_recorder = SandboxRecorder()
          with base_recorder.installed():
            base_groups = rollout_by_domain(worker, pairs, base_recorder, seed=seed,
                                            group_size=1, temperature=0.0)
          baseline = {"step": baseline_step, "tasks": task_records(base_groups)}
          timing["baseline_s"] = time.perf_counter() - t0
    finally:
      worker.close()
  finally:
    policy.close()

  report: dict[str, Any] = {
      "format": REPORT_FORMAT, "step": int(step),
      **({"initial": str(config.get("init_from", "") or "random")} if initial else {}),
      "settings": {"domains": names, "seeds_per_domain": n_seeds,
                   "first_seed_index": int(first_seed_index),
                   "heldout_seeds": [heldout_seed(first_seed_index),
                                     heldout_seed(first_seed_index + n_seeds - 1)],
                   "samples": samples, "k": k_values(samples), "temperature": temperature,
                   "top_p": float(r.get("top_p") or 0.0), "top_k": int(r.get("top_k") or 0),
                   "max_new_tokens": int(r.max_new_tokens), "max_turns": int(r.max_turns),
                   "seed": int(seed)},
      **summarize(records, statuses)}
  if baseline is not None:
    report["regression"] = compare_reports(baseline, {"tasks": records}, confidence=confidence)
  report["tasks"] = records
  timing["total_s"] = time.perf_counter() - t_start
  timing["sandbox"] = {
      d: {**v, "wall_s_per_task": v["wall_s"] / max(sum(x["domain"] == d for x in records), 1)}
      for d, v in seconds.items()}
  if write and jax.process_index() == 0:
    from posttrain import report as report_lib
    report_lib.write(os.path.join(workdir, "eval", "initial" if initial else f"step_{step}"),
                     report, timing, workdir)
  return report, timing


def dumps(report: Mapping[str, Any]) -> str:
  """The canonical report.json text (stable key order and float formatting)."""
  return json.dumps(report, indent=1, allow_nan=False) + "\n"
