"""Label-free rewards (TTRL, Zuo et al. 2025): each sample is rewarded by agreement with its
group's majority answer; the verifier's value stays what a pass is judged on."""

import pytest

from posttrain import majority_vote, trainer
from posttrain.metrics import read_metrics
from posttrain.rollout import Sample, TrajectoryGroup
from posttrain.tasks import registry
from posttrain.tasks.reward_model import verifier_value
from tests.test_trainer import _config

ADD = "arithmetic/add_d1"


def _group(texts, baseline=None, seed=3):
  domain = registry.get(ADD)
  task = domain.sample(seed)

  def sample(text):
    s = Sample([1] * 4, [2] * 3, [1] * 3, [0.0] * 3, text, "stop")
    s.reward = domain.score(task, text)
    return s

  return TrajectoryGroup(ADD, seed, task, [sample(t) for t in texts], 0,
                         baseline=None if baseline is None else sample(baseline))


def _right_and_wrong():
  task = registry.get(ADD).sample(3)
  right = registry.get(ADD).demonstration(task)  # "<answer>N</answer>"
  answer = int(right.split("<answer>")[1].split("</answer>")[0])
  return right, f"<answer>{answer + 1}</answer>", f"<answer>{answer + 2}</answer>"


def test_majority_answer_is_the_mode_first_given_on_ties():
  assert majority_vote.majority_answer([None, 3, 4, 4, 3]) == 3  # tie: 3 came first
  assert majority_vote.majority_answer([4, 3, 3]) == 3
  assert majority_vote.majority_answer([None, None]) is None
  assert majority_vote.majority_answer([]) is None


def test_a_wrong_majority_is_rewarded_and_the_verifier_still_judges_the_pass():
  right, wrong, other = _right_and_wrong()
  # The answer written with spaces and a sign votes with the plain one.
  wrong_spaced = wrong.replace("<answer>", "<answer> +")
  group = _group([wrong, right, wrong_spaced, other, "no answer at all"], baseline=right)
  stats = majority_vote.relabel_by_majority(registry.get(ADD), group)
  assert [s.reward.value for s in group.samples] == [1.0, 0.0, 1.0, 0.0, 0.0]
  assert [verifier_value(s.reward) for s in group.samples] == [0.0, 1.0, 0.0, 0.0, 0.0]
  assert [s.reward.components["majority"] for s in group.samples] == [1.0, 0.0, 1.0, 0.0, 0.0]
  assert group.baseline.reward.value == 0.0 and verifier_value(group.baseline.reward) == 1.0
  assert stats == pytest.approx({"agreement": 0.4, "label_correct": 0.0, "no_answer": 0.2})
  # The group's rewards are now the votes: what the advantages and the scheduler read.
  assert group.rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_a_right_majority_and_a_group_without_answers():
  right, wrong, _ = _right_and_wrong()
  group = _group([right, wrong, right], baseline=right)
  stats = majority_vote.relabel_by_majority(registry.get(ADD), group)
  assert group.rewards.tolist() == [1.0, 0.0, 1.0] and group.baseline.reward.value == 1.0
  assert stats == pytest.approx({"agreement": 2 / 3, "label_correct": 1.0, "no_answer": 0.0})
  silent = _group(["", "nothing", None])
  stats = majority_vote.relabel_by_majority(registry.get(ADD), silent)
  assert silent.rewards.tolist() == [0.0, 0.0, 0.0]
  assert stats == pytest.approx({"agreement": 0.0, "label_correct": 0.0, "no_answer": 1.0})


def test_a_majority_vote_run_trains_on_votes_and_logs_the_labels_accuracy(tmp_path):
  """rollout.reward_source=majority_vote through the trainer: every sample's reward is its
  vote (0 or 1, 'majority' component equal to it), pass rates stay the verifier's."""
  extra = {"rollout.reward_source": "majority_vote", "train.rl_steps": 2,
           "eval.seeds_per_domain": 0, "sft.steps": 0}
  assert trainer.train(_config(**extra), str(tmp_path))["status"] == "done"
  rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rows) == 2
  for r in rows:
    for key in ("majority/agreement", "majority/label_correct", "majority/no_answer"):
      assert 0.0 <= r[key] <= 1.0, (key, r)
    # A sample is rewarded exactly when it agrees: the mean reward is the agreement.
    assert r["reward/mean"] == pytest.approx(r["majority/agreement"])


def test_bad_reward_sources_are_one_line_errors(tmp_path):
  with pytest.raises(ValueError, match=r"^rollout.reward_source must be 'verifier' or "
                                       r"'majority_vote', got 'crowd'$"):
    trainer.Trainer(_config(**{"rollout.reward_source": "crowd"}), str(tmp_path / "a"))
  with pytest.raises(ValueError, match=r"^rollout.reward_source=majority_vote needs answers "
                                       r"to vote on; the code domains code/affine_l1 give "
                                       r"none: drop them from tasks.domains$"):
    trainer.Trainer(_config(**{"rollout.reward_source": "majority_vote",
                               "tasks.domains": f"{ADD},code/affine_l1"}), str(tmp_path / "b"))
