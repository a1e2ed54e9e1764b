"""Majority-vote accuracy (maj@k): the vote on hand-worked cases, maj@k against enumeration of
every k-subset, answers normalised as the verifiers read them, hostile completions, and
maj@k next to pass@k in the evaluation's records, summaries and report."""

import itertools
import json
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain import evaluation, report
from posttrain.majority_vote import (
  answer_key,
  maj_at_k,
  majority_vote,
  vote_tally,
  votes_on,
)
from posttrain.rollout import Sample, TrajectoryGroup
from posttrain.tasks import ModelScoredDomain, registry
from posttrain.tasks.base import ANSWER_CLOSE, ANSWER_OPEN

ADD, CHOICE, LIST, TEXT = ("arithmetic/add_d1", "logic/boolexpr_l1", "equations/system_l1",
                           "strings/copy_l1")
CODE, CALC = "code/affine_l1", "tools/calc_l1"

# ----------------------------------------------------------------------------------------
# The vote
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("answers,passed,want", [
    (["4", "4", "4", "5"], [1, 1, 1, 0], 1.0),           # clear majority, right
    (["5", "5", "4"], [0, 0, 1], 0.0),                   # clear majority, wrong
    (["4", "4", "5", "5"], [1, 1, 0, 0], 0.5),           # tie, half of it right
    (["4", "5", "6"], [0, 1, 0], 1 / 3),                 # three-way tie, one right
    ([None, None, None, "4"], [0, 0, 0, 1], 1.0),        # no answer never wins
    ([None, None], [0, 0], 0.0),                         # no answer anywhere
    ([], [], 0.0),
    (["4", "4", "4", "5"], [1, 0, 1, 0], 2 / 3),         # one answer, mixed verdicts
])
def test_vote_on_hand_worked_cases(answers, passed, want):
  assert majority_vote(answers, passed) == pytest.approx(want, abs=1e-12)
  # The order of the completions never matters.
  for perm in itertools.islice(itertools.permutations(range(len(answers))), 24):
    assert majority_vote([answers[i] for i in perm], [passed[i] for i in perm]) == (
        pytest.approx(want, abs=1e-12))


def test_tally_counts_answers_and_passes():
  assert vote_tally(["a", None, "b", "a", "a", "b"], [1, 1, 0, 1, 0, 0]) == [[3, 2], [2, 0]]
  with pytest.raises(ValueError, match="2 answers but 1 pass flags"):
    vote_tally(["a", "b"], [True])


# ----------------------------------------------------------------------------------------
# maj@k against every k-subset
# ----------------------------------------------------------------------------------------


def _maj_at_k_brute(answers, passed, k):
  """Mean over all k-subsets of the subset's own vote: the share passed among the drawn
  completions of the most frequent answer, tied answers averaged, 0 without answers."""
  total, subsets = 0.0, list(itertools.combinations(range(len(answers)), k))
  for subset in subsets:
    counts = Counter(answers[i] for i in subset if answers[i] is not None)
    if not counts:
      continue
    top = max(counts.values())
    tied = [a for a, c in counts.items() if c == top]
    total += sum(sum(passed[i] for i in subset if answers[i] == a) / top
                 for a in tied) / len(tied)
  return total / len(subsets)


def test_maj_at_k_matches_enumeration_of_subsets():
  rng = random.Random(0)
  for _ in range(150):
    n = rng.randint(1, 9)
    answers = [rng.choice(["a", "b", "c", None][:rng.randint(1, 4)]) for _ in range(n)]
    passed = [rng.random() < 0.5 for _ in range(n)]
    votes = vote_tally(answers, passed)
    for k in range(1, n + 1):
      assert maj_at_k(n, votes, k) == pytest.approx(_maj_at_k_brute(answers, passed, k),
                                                    abs=1e-9), (answers, passed, k)
    assert maj_at_k(n, votes, n) == pytest.approx(majority_vote(answers, passed), abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), max_size=5),
       st.integers(0, 4), st.data())
def test_maj_at_one_is_the_answered_pass_rate_and_every_k_is_a_probability(pairs, none, data):
  votes = [[m, min(p, m)] for m, p in pairs]
  n = sum(m for m, _ in votes) + none
  if n == 0:
    return
  assert maj_at_k(n, votes, 1) == pytest.approx(sum(p for _, p in votes) / n, abs=1e-9)
  k = data.draw(st.integers(1, n))
  assert -1e-12 <= maj_at_k(n, votes, k) <= 1 + 1e-12


def test_maj_at_k_stays_finite_for_many_samples():
  # Two answers of 1000 each, one right: 1/2 at every k by symmetry, though C(2000, 1000)
  # overflows a float.
  for k in (1, 7, 1000, 1999, 2000):
    assert maj_at_k(2000, [[1000, 1000], [1000, 0]], k) == pytest.approx(0.5, abs=1e-9)
  assert maj_at_k(64, [[64, 64]], 5) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("args,match", [
    ((4, [[2, 1]], 0), "k=0 must be in"), ((4, [[2, 1]], 5), "k=5 must be in"),
    ((0, [], 1), "num_samples=0"), ((3, [[2, 1], [2, 0]], 1), "at most num_samples=3"),
    ((4, [[2, 3]], 1), "passed in"), ((4, [[0, 0]], 1), "completions >= 1"),
])
def test_maj_at_k_rejects_impossible_votes(args, match):
  with pytest.raises(ValueError, match=match):
    maj_at_k(*args)


# ----------------------------------------------------------------------------------------
# Answers as the verifiers read them
# ----------------------------------------------------------------------------------------


def _key(name, text, seed=1):
  domain = registry.get(name)
  return answer_key(domain, domain.sample(seed), text)


def test_answers_differing_only_by_the_verifiers_normalisation_vote_together():
  same_42 = ["<answer>42</answer>", "<answer> +42 </answer>", "<answer>'42'</answer>",
             "x <answer>7</answer> then <answer>042</answer>"]
  assert {_key(ADD, t) for t in same_42} == {42}
  assert _key(ADD, "<answer>1,042</answer>") == _key(ADD, "<answer>1042</answer>") == 1042
  assert _key(CHOICE, "<answer>True.</answer>") == _key(CHOICE, "<answer> true</answer>")
  assert _key(LIST, "<answer>[1, 2]</answer>") == _key(LIST, "<answer>1 2</answer>") == (1, 2)
  assert _key(TEXT, "<answer> 'ab' </answer>") == "ab" != _key(TEXT, "<answer>AB</answer>")
  # Three spellings of the right answer outvote two of a wrong one; on the raw text they
  # would not.
  domain = registry.get(ADD)
  task = domain.sample(1)
  a = int(task.answer)
  texts = [f"<answer>{a}</answer>", f"<answer> {a} </answer>", f"<answer>'{a}'</answer>",
           f"<answer>{a + 1}</answer>", f"<answer>{a + 1}</answer>"]
  passed = [domain.score(task, t).value == 1.0 for t in texts]
  assert passed == [True] * 3 + [False] * 2
  assert majority_vote([answer_key(domain, task, t) for t in texts], passed) == 1.0
  assert majority_vote(texts, passed) == 0.0


def test_answers_that_do_not_parse_are_no_answer():
  for text in ("no tags", "<answer></answer>", "<answer>forty-two</answer>",
               "<answer>4" + "0" * 5000 + "</answer>", "<answer>42"):
    assert _key(ADD, text) is None, text


def test_tool_answers_ignore_observations_and_code_has_none():
  assert _key(CALC, "<tool>calculator: 6*7</tool><observation><answer>1</answer>"
                    "</observation><answer> 42 </answer>") == 42
  assert votes_on(registry.get(ADD)) and not votes_on(registry.get(CODE))
  assert _key(CODE, "```python\ndef f(x):\n    return x\n```") is None
  wrapped = ModelScoredDomain(registry.get(CODE), _ConstantScorer())
  assert not votes_on(wrapped)
  assert votes_on(ModelScoredDomain(registry.get(ADD), _ConstantScorer()))


class _ConstantScorer:
  def score_texts(self, prompts, completions):
    return [0.5] * len(completions)


def test_jsonl_answers_follow_the_row_verifier(tmp_path):
  from posttrain.tasks.jsonl import JsonlDomain
  rows = [{"prompt": "p", "answer": "Paris"},
          {"prompt": "p", "answer": "yes", "verifier": "exact_ci"},
          {"prompt": "p", "answer": "1.5", "verifier": "numeric"},
          {"prompt": "p", "answer": "x/2", "verifier": "math"}]
  path = tmp_path / "quiz.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  domain = JsonlDomain.from_file(path)
  key = lambda row, text: answer_key(domain, domain.sample(2 * row + 1), f"<answer>{text}</answer>")
  assert key(0, " Paris ") == "Paris" != key(0, "paris")
  assert key(1, "YES ") == key(1, "yes")
  assert key(2, "3/2") == key(2, "1.5") == key(2, "150%")
  assert key(2, "one and a half") is None and key(0, "  ") is None
  assert key(3, "$\\frac{3}{2}$") == key(3, "1.5")
  assert key(3, "\\boxed{X/2}") == key(3, "x / 2")


@pytest.mark.parametrize("text", [None, "", 42, b"<answer>42</answer>", "\x00", "٤٢",
                                  "<answer>٤٢</answer>", "<answer>４２</answer>",
                                  "<answer>\u202e42</answer>", "<answer>🙂</answer>"])
def test_hostile_completions_have_no_answer_or_a_defined_one(text):
  for name in (ADD, CHOICE, LIST, CALC, CODE):
    assert _key(name, text) is None, (name, text)
  assert _key(TEXT, "<answer>🙂</answer>") == "🙂"


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60), st.sampled_from([ADD, CHOICE, LIST, TEXT, CALC, CODE,
                                              "bases/dec2base_l1", "bases/dec2bin_l1"]))
def test_answer_key_never_raises_and_is_hashable(body, name):
  for text in (body, f"<answer>{body}</answer>"):
    key = _key(name, text)
    assert key is None or hash(key) is not None
  domain = registry.get(name)
  if name not in (CODE, CALC, TEXT) and ANSWER_OPEN not in body and ANSWER_CLOSE not in body:
    # Where the answer kind parses the text, the key is exactly its parse.
    parsed = domain.kind.parse(body)
    want = tuple(parsed) if isinstance(parsed, list) else parsed
    assert _key(name, f"<answer>{body}</answer>") == want


# ----------------------------------------------------------------------------------------
# maj@k in the evaluation: records, summaries and the report
# ----------------------------------------------------------------------------------------


class _ScriptedWorker:
  """A RolloutWorker stand-in: greedy completions are the demonstration, sampled ones come
  from `script(task)`, a list of texts (any object: the verifier and the vote must cope)."""

  def __init__(self, script):
    self.script = script

  def rollout(self, pairs, *, seed, group_size, temperature):
    groups = []
    for name, s in pairs:
      domain = registry.get(name)
      task = domain.sample(s)
      if temperature > 0:
        texts = self.script(task)
      else:  # The demonstration passes; code's would need a sandbox.
        texts = ["no code"] if name == CODE else [domain.demonstration(task)]
      assert len(texts) == group_size
      samples = []
      for text in texts:
        sample = Sample([1] * 12, [2] * 3, [1] * 3, [0.0] * 3, text, "stop")
        sample.reward = domain.score(task, text)
        samples.append(sample)
      groups.append(TrajectoryGroup(name, s, task, samples, 0))
    return groups


def _script(task):
  if task.domain == CODE:
    return ["no code here", None, "", "é"]
  right, wrong = f"<answer>{task.answer}</answer>", f"<answer>{int(task.answer) + 1}</answer>"
  if task.seed % 4 == 1:  # two right (one spelled differently), one wrong, one unanswered
    return [right, f"<answer>'{task.answer}'</answer>", wrong, None]
  return [wrong, wrong, right, "🙂"]  # the majority is wrong


def test_maj_at_k_sits_next_to_pass_at_k_in_records_summaries_and_report(tmp_path):
  worker = _ScriptedWorker(_script)
  pairs = evaluation.eval_pairs([ADD, "arithmetic/sub_d1", CODE], 4)
  greedy = worker.rollout(pairs, seed=0, group_size=1, temperature=0.0)
  sampled = worker.rollout(pairs, seed=1, group_size=4, temperature=1.0)
  records = evaluation.task_records(greedy, sampled)
  by_seed = {(r["domain"], r["seed"]): r for r in records}
  # Seeds 1, 5: votes 42 x2 (right), 43 x1; seeds 3, 7: 43 x2 (wrong), 42 x1.
  assert by_seed[(ADD, 1)]["sampled_votes"] == [[2, 2], [1, 0]]
  assert by_seed[(ADD, 1)]["sampled_majority"] == 1.0
  assert by_seed[(ADD, 3)]["sampled_votes"] == [[2, 0], [1, 1]]
  assert by_seed[(ADD, 3)]["sampled_majority"] == 0.0
  assert "sampled_votes" not in by_seed[(CODE, 1)]  # code: nothing to vote on
  s = evaluation.summarize(records)
  dom = s["domains"][ADD]
  want = {str(k): round((_maj_at_k_brute([42, 42, 43, None], [1, 1, 0, 0], k)
                         + _maj_at_k_brute([43, 43, 42, None], [0, 0, 1, 0], k)) / 2, 6)
          for k in (1, 2, 4)}
  assert dom["maj_at_k"] == pytest.approx(want, abs=1e-6) and dom["maj_tasks"] == 4
  assert dom["maj_at_k"]["4"] == 0.5 and dom["pass_at_k"]["4"] == 1.0
  assert "maj_at_k" not in s["domains"][CODE] and "pass_at_k" in s["domains"][CODE]
  overall = s["overall"]
  assert list(overall["maj_at_k"]) == list(overall["pass_at_k"]) == ["1", "2", "4"]
  assert overall["maj_tasks"] == 8 and overall["tasks"] == 12
  assert overall["maj_at_k"] == s["strata"]["family"]["arithmetic"]["maj_at_k"]
  assert overall["maj_at_k"] == s["strata"]["level"]["1"]["maj_at_k"]
  assert "maj_at_k" not in s["strata"]["family"]["code"]
  # The report: maj@k columns after pass@k, "-" where a stratum has no vote.
  rep = {"format": 1, "step": 3, "settings": {
      "domains": [p[0] for p in pairs[::4]], "seeds_per_domain": 4, "first_seed_index": 0,
      "heldout_seeds": [1, 7], "samples": 4, "k": [1, 2, 4], "temperature": 1.0, "top_p": 0.0,
      "top_k": 0, "max_new_tokens": 8, "max_turns": 1, "seed": 0}, **s, "tasks": records}
  md = report.markdown(rep, {"total_s": 1.0})
  assert "| pass@1 | pass@2 | pass@4 | maj@1 | maj@2 | maj@4 |" in md
  assert "(over 8 of 12 tasks: code domains give no answer to vote on)" in md
  cells = [f"{dom['pass_at_k'][k]:.3f}" for k in "124"] + [
      f"{dom['maj_at_k'][k]:.3f}" for k in "124"]
  assert f"| {ADD} | 1 | 4 | 4 | 1.000 | " + " | ".join(cells) + " |" in md
  assert "| code | 4 | 0 | 0.000 | 0.000 | 0.000 | 0.000 | - | - | - |" in md
  paths = report.write(str(tmp_path), rep, {"total_s": 1.0, "sandbox": {}})
  with open(paths["report"]) as fh:
    assert json.load(fh) == rep
  # Without samples there is neither pass@k nor maj@k.
  plain = evaluation.summarize(evaluation.task_records(greedy))
  assert "maj_at_k" not in plain["overall"] and "pass_at_k" not in plain["overall"]
