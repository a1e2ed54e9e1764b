"""Majority-vote accuracy of sampled completions: maj@k (cons@k in DeepSeek-R1, the
self-consistency of Wang et al. 2022).

    keys = [answer_key(domain, task, text) for text in completions]
    votes = vote_tally(keys, passed)        # [[completions, passed], ...] per distinct answer
    maj_at_k(len(keys), votes, k)           # expected vote correctness over k of the samples

An answer is what the domain's verifier reads, normalised as the verifier normalises it, so
completions differing only in what the verifier ignores vote together:

  procedural families   the answer kind's parse of the last <answer> pair (integers: sign,
                        digits, 1,000 grouping; choices lower-cased; lists as tuples; one
                        pair of quotes and the whitespace stripped)
  tools                 the integer in the last <answer> of the model's own text
  jsonl                 the last <answer> pair (else the last \\boxed{}) by the row's
                        verifier: exact (stripped), exact_ci (lower-cased too), int,
                        numeric (the exact rational value), math (a number's rational
                        value, else `mathcheck.normalize` of the text)
  gym, other domains    the stripped text of the last <answer> pair

A completion without one, or whose answer is too long or does not parse as the domain's
answer type, has no answer and takes no part in the vote. Tolerances and symbolic
equivalence (numeric's 1e-6, math-verify) are not partitions, so near-equal numbers and
equivalent expressions vote apart. Code domains have no answer to extract (a program's text
is not its answer, and grouping programs by behaviour needs sandbox runs of its own):
`votes_on` is False for them and the evaluation leaves them out of maj@k.
"""

from __future__ import annotations

import functools
import math
import sys
from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

from posttrain.tasks.base import MAX_ANSWER_CHARS, Domain, Reward, Task, extract_answer
from posttrain.tasks.families.code import CodeDomain
from posttrain.tasks.families.tools import ToolDomain, model_text
from posttrain.tasks.mathcheck import normalize as math_normalize
from posttrain.tasks.mathcheck import to_number
from posttrain.tasks.procedural import ProceduralDomain, parse_int
from posttrain.tasks.reward_model import ModelScoredDomain, verifier_value
from posttrain.tasks.tool_use import WithTools, own_text


def _unwrap(domain: Domain, completion: str | None = None) -> tuple[Domain, str | None]:
  """The domain that reads answers, and `completion` as it reads it (a tool-using
  wrapper's calls and observations removed)."""
  while isinstance(domain, (ModelScoredDomain, WithTools)):
    if isinstance(domain, WithTools) and completion is not None:
      completion = own_text(completion)
    domain = domain.inner
  return domain, completion


def votes_on(domain: Domain) -> bool:
  """Whether `domain`'s completions carry an answer to vote on (code domains' do not)."""
  return not isinstance(_unwrap(domain)[0], CodeDomain)


def answer_key(domain: Domain, task: Task, completion) -> Hashable | None:
  """The answer `domain`'s verifier reads in `completion`, normalised; None when there is
  none (see the module docstring). Never raises."""
  if not isinstance(completion, str):
    return None
  try:
    return _hashable(_answer(*_unwrap(domain, completion), task=task))
  except Exception:  # noqa: BLE001 - as in scoring, an answer that breaks a parser is none
    return None


def _answer(domain: Domain, completion: str, task: Task):
  if isinstance(domain, CodeDomain):
    return None
  tools = isinstance(domain, ToolDomain)
  # A JsonlDomain exists only once its module is loaded; importing it here would pull in
  # grain (seconds) for every evaluation.
  jsonl = sys.modules.get("posttrain.tasks.jsonl")
  from_file = jsonl is not None and isinstance(domain, jsonl.JsonlDomain)
  read = jsonl.read_answer if from_file else extract_answer
  raw = read(model_text(completion) if tools else completion)
  if raw is None or len(raw) > MAX_ANSWER_CHARS:
    return None
  if tools:
    return parse_int(raw)
  if isinstance(domain, ProceduralDomain):
    return domain.kind.parse(raw)
  if from_file:
    return _jsonl_answer(str(task.metadata.get("verifier", "exact")), raw)
  return raw.strip() or None


def _jsonl_answer(verifier: str, raw: str):
  if verifier in ("code", "code_partial"):  # programs: nothing to vote on
    return None
  text = raw.strip()
  if not text:
    return None
  if verifier == "exact_ci":
    return text.lower()
  if verifier == "int":
    return parse_int(raw)
  if verifier == "numeric":
    return to_number(raw)
  if verifier == "math":
    number = to_number(raw)
    return number if number is not None else (math_normalize(raw) or None)
  return text


def _hashable(x):
  if isinstance(x, (list, tuple)):
    return tuple(_hashable(v) for v in x)
  try:
    hash(x)
  except TypeError:
    return repr(x)
  return x


def vote_tally(answers: Sequence[Hashable | None], passed: Sequence[bool]) -> list[list[int]]:
  """[completions, passed] per distinct non-None answer, most frequent first.

  What maj@k needs of a task, as (samples, passed) is what pass@k needs: which answer is
  which does not matter, only how often each was given and how often it passed.
  """
  if len(answers) != len(passed):
    raise ValueError(f"got {len(answers)} answers but {len(passed)} pass flags")
  tally: dict[Hashable, list[int]] = defaultdict(lambda: [0, 0])
  for answer, ok in zip(answers, passed):
    if answer is not None:
      tally[answer][0] += 1
      tally[answer][1] += bool(ok)
  return sorted(tally.values(), key=lambda v: (-v[0], -v[1]))


def majority_vote(answers: Sequence[Hashable | None], passed: Sequence[bool]) -> float:
  """Correctness of the majority answer of one task's completions (maj@n).

  The vote scores the share of the completions holding the most frequent answer that
  passed (1 or 0 where they share a verdict); answers tied for most frequent score the mean
  of their shares; no answer anywhere scores 0.
  """
  votes = vote_tally(answers, passed)
  return maj_at_k(len(answers), votes, len(answers)) if votes else 0.0


def maj_at_k(num_samples: int, votes: Sequence[Sequence[int]], k: int) -> float:
  """Expected majority-vote correctness of k of a task's n samples.

  `votes` holds (m_a, p_a) per distinct answer a (`vote_tally`): m_a completions gave it and
  p_a of them passed, c_a = p_a / m_a; the other n - sum m_a samples have no answer. A
  uniformly drawn k-subset holds x_a completions of each answer, and its vote scores

      V = mean_{a in argmax_b x_b} c_a   if max_b x_b >= 1, else 0,

  and maj@k = E[V] over all C(n, k) subsets, computed exactly (no sampling) as

      sum_a c_a sum_{v >= 1} E[1{x_a = v, x_b <= v for b != a} / (1 + #{b != a: x_b = v})]

  from the product of one generating polynomial in (count, ties) per answer. Scoring c_a
  rather than the share passed among the x_a drawn is exact in expectation: those are a
  uniform x_a-subset of a's completions. maj@n is the vote of all the samples.

  lm-eval-harness reports maj@k as the vote of the first k samples of n
  (gsm8k-cot-self-consistency); the first k of n i.i.d. samples are one uniform k-subset,
  so this has the same expectation with less variance, as the unbiased pass@k of Chen et
  al. (2021) has over "any of the first k passed". Unlike the harness, samples without an
  answer never win the vote.
  """
  n, k = int(num_samples), int(k)
  if n < 1:
    raise ValueError(f"num_samples={num_samples} must be >= 1")
  if not 1 <= k <= n:
    raise ValueError(f"k={k} must be in [1, num_samples={n}]")
  pairs = tuple(sorted((int(m), int(p)) for m, p in votes))
  if any(m < 1 or not 0 <= p <= m for m, p in pairs) or sum(m for m, _ in pairs) > n:
    raise ValueError(f"votes={[list(v) for v in votes]} must be [completions >= 1, passed in "
                     f"[0, completions]] pairs holding at most num_samples={n} completions")
  return _expected_vote(n, pairs, k)


@functools.lru_cache(maxsize=1 << 14)
def _expected_vote(n: int, votes: tuple[tuple[int, int], ...], k: int) -> float:
  if not votes:
    return 0.0
  if k == n:
    top = max(m for m, _ in votes)
    tied = [p / m for m, p in votes if m == top]
    return sum(tied) / len(tied)
  # Drawing each sample independently with probability q = k / n and conditioning on k
  # drawn gives the uniform k-subset; binomial probabilities, unlike counts C(m, x), stay
  # in float range for any n.
  q = k / n
  answers_of_size: dict[int, int] = defaultdict(int)
  share_of_size: dict[int, float] = defaultdict(float)  # sum of c_a over answers of size m
  for m, p in votes:
    answers_of_size[m] += 1
    share_of_size[m] += p / m
  total = 0.0
  for v in range(1, min(k, max(answers_of_size)) + 1):
    rivals = sorted(m for m in answers_of_size if m >= v)  # sizes that can reach v
    # Unanswered samples and answers given fewer than v times never reach the winner.
    others = n - sum(m * answers_of_size[m] for m in rivals)
    for size in rivals:
      dist_XxT = _binomial_pmf(others, q)[:k - v + 1, None]  # [drawn, ties]
      for m in rivals:
        for _ in range(answers_of_size[m] - (m == size)):
          dist_XxT = _times_rival(dist_XxT, _binomial_pmf(m, q), v, k - v)
      if dist_XxT.shape[0] > k - v:
        ties = np.arange(dist_XxT.shape[1])
        credit = float(np.sum(dist_XxT[k - v] / (1 + ties)))
        total += share_of_size[size] * _binomial_pmf(size, q)[v] * credit
  return total / _binomial_pmf(n, q)[k]


def _times_rival(dist_XxT: np.ndarray, pmf: np.ndarray, v: int, max_drawn: int) -> np.ndarray:
  """Adds one rival answer that must stay at or below v: [drawn, ties] -> the same with its
  x <= v drawn ones added, a tie when x = v."""
  drawn, ties = dist_XxT.shape
  rows = min(drawn + v, max_drawn + 1)
  out = np.zeros((rows, ties + 1))
  if v <= ties:  # Few counts below v: one shifted add each.
    for x in range(min(v, rows)):
      span = min(drawn, rows - x)
      out[x:x + span, :-1] += pmf[x] * dist_XxT[:span]
  else:  # Few tie counts: one convolution over the drawn axis each.
    for t in range(ties):
      below = np.convolve(dist_XxT[:, t], pmf[:v])[:rows]
      out[:len(below), t] += below
  span = min(drawn, rows - v)
  if span > 0:
    out[v:v + span, 1:] += pmf[v] * dist_XxT[:span]
  return out


@functools.lru_cache(maxsize=1024)
def _binomial_pmf(m: int, q: float) -> np.ndarray:
  """P(Binomial(m, q) = x) for x = 0..m, through log-gamma (no overflow)."""
  x = np.arange(m + 1)
  log_choose = np.asarray([math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1)
                           for i in range(m + 1)])
  pmf = np.exp(log_choose + x * math.log(q) + (m - x) * math.log1p(-q))
  pmf.flags.writeable = False  # cached: shared by every caller
  return pmf


# ---------------------------------------------------------------------------------------
# Label-free rewards: the majority answer as the label (TTRL)
# ---------------------------------------------------------------------------------------


def majority_answer(answers: Sequence[Hashable | None]) -> Hashable | None:
  """The most frequent non-None answer; among answers tied for most frequent, the one
  given first (Python's `Counter.most_common`, as TTRL picks it); None without answers."""
  counts: dict[Hashable, int] = {}
  for answer in answers:
    if answer is not None:
      counts[answer] = counts.get(answer, 0) + 1
  if not counts:
    return None
  top = max(counts.values())
  return next(a for a in counts if counts[a] == top)


def vote_reward(reward: Reward | None, agrees: bool) -> Reward:
  """`reward` with its value replaced by the vote's (1 if the completion gives the
  majority answer, else 0), the verifier's own value kept as the `verifier` component (what
  pass rates are judged on) and the vote as `majority`."""
  components = dict(reward.components) if reward is not None else {}
  components["verifier"] = verifier_value(reward) if reward is not None else 0.0
  components["majority"] = float(agrees)
  verdict = reward.verdict if reward is not None else ""
  return Reward(float(agrees), components, verdict)


def relabel_by_majority(domain: Domain, group) -> dict[str, float]:
  """Test-time RL's rewards (Zuo et al. 2025, TTRL): each sample of `group` (a
  `TrajectoryGroup`) is rewarded 1 when its answer is the group's majority answer, else 0,
  whatever the verifier said; no verifier label is read. A ReMax greedy baseline, if the
  group has one, is rewarded against the samples' majority too.

  Returns the group's vote statistics: `agreement` (the share of samples giving the
  majority answer), `label_correct` (1 when the verifier passes the majority answer: the
  label's accuracy, for monitoring only), `no_answer` (the share without an answer).
  """
  keys = [answer_key(domain, group.task, s.text) for s in group.samples]
  label = majority_answer(keys)
  agree = [label is not None and key == label for key in keys]
  for sample, ok in zip(group.samples, agree):
    sample.reward = vote_reward(sample.reward, ok)
  baseline = getattr(group, "baseline", None)
  if baseline is not None:
    key = answer_key(domain, group.task, baseline.text)
    baseline.reward = vote_reward(baseline.reward, label is not None and key == label)
  label_passed = [verifier_value(s.reward) >= 1.0 for s, ok in zip(group.samples, agree) if ok]
  return {"agreement": sum(agree) / max(len(agree), 1),
          "label_correct": float(bool(label_passed) and all(label_passed)),
          "no_answer": sum(k is None for k in keys) / max(len(keys), 1)}
