"""On-policy distillation: the per-token advantage against numpy, the trainer adding the
teacher's term to what the RL batch trains on (checked against a plain forward of the
teacher's folder), a teacher equal to the student giving nothing, the planner counting the
teacher, and one-line errors for what cannot be distilled from."""

import numpy as np
import pytest

from configs import default
from posttrain import experiment, models, planner, trainer
from posttrain.metrics import read_metrics
from posttrain.rl import advantages as adv_lib
from tests.test_trainer import OVERRIDES

FAST = {"sft.steps": 0, "train.rl_steps": 1, "eval.seeds_per_domain": 0,
        "checkpoint.every": 100}


def _config(**extra):
  return planner.override(default.get_config(), {**OVERRIDES, **FAST, **extra})


def _student_cfg():
  return trainer.model_config(_config())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """A student's HF folder and two teachers: a larger model of the same vocabulary, and
  one with fewer tokens."""
  root = tmp_path_factory.mktemp("distill")
  cfg = _student_cfg()
  models.save_pretrained(models.create_model(cfg, seed=3), str(root / "student"))
  teacher = models.create_model(cfg.replace(num_layers=2, d_model=48, ffn_dim=96), seed=7)
  # Sharper than a fresh model, so its log-probs differ from the student's.
  teacher.final_norm.scale.value = teacher.final_norm.scale.value * 8.0
  models.save_pretrained(teacher, str(root / "teacher"))
  models.save_pretrained(models.create_model(cfg.replace(vocab_size=cfg.vocab_size - 16)),
                         str(root / "small_vocab"))
  rm_cfg = cfg.replace(value_head=True, lm_head=False,
                       architecture=experiment.reward_architecture(cfg.architecture))
  models.save_pretrained(models.create_model(rm_cfg), str(root / "reward_model"))
  return root


def test_distillation_advantages_match_numpy_and_ignore_masked_garbage():
  rng = np.random.default_rng(0)
  teacher = -rng.random((5, 9)).astype(np.float32) * 4
  student = -rng.random((5, 9)).astype(np.float32) * 4
  mask = rng.random((5, 9)) < 0.6
  got = adv_lib.distillation_advantages(np.where(mask, teacher, np.nan),
                                        np.where(mask, student, -np.inf), mask, coef=0.5)
  np.testing.assert_allclose(got, np.where(mask, 0.5 * (teacher - student), 0.0), rtol=1e-6)
  assert np.all(np.isfinite(got))
  with pytest.raises(ValueError, match="distillation coef must be >= 0, got -1.0"):
    adv_lib.distillation_advantages(teacher, student, mask, coef=-1.0)
  with pytest.raises(ValueError, match=r"student_logprobs shape \(5, 8\) != teacher_logprobs"):
    adv_lib.distillation_advantages(teacher, student[:, :8], mask)


def _teacher_logprobs(folder, batch):
  """The oracle: a plain forward of the teacher's folder, log-softmax, the targets."""
  model = models.from_pretrained(str(folder))
  tokens = np.asarray(batch["tokens"])
  out = np.zeros(tokens.shape, np.float64)
  for m in range(tokens.shape[0]):
    logits = np.asarray(model(tokens[m], np.asarray(batch["positions"][m]),
                              np.asarray(batch["segment_ids"][m])), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    out[m] = np.take_along_axis(logp, np.asarray(batch["targets"][m])[..., None], -1)[..., 0]
  return out


def test_trainer_trains_on_the_reward_advantage_plus_the_teachers_term(folders, tmp_path,
                                                                       monkeypatch):
  captured = {}
  add = trainer.Trainer._add_distillation

  def spy(self, out, shape):
    # A fresh student scores 0 everywhere, its group advantages all 0: stand in for them
    # with random ones, so the reward's weight shows.
    task = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    captured["task"] = np.where(np.asarray(out["loss_mask"]) != 0, task, 0.0)
    out["advantages"] = captured["task"]
    add(self, out, shape)
    captured["batch"] = {k: np.asarray(v) for k, v in out.items()}

  monkeypatch.setattr(trainer.Trainer, "_add_distillation", spy)
  coef, weight = 2.0, 0.5
  trainer.train(_config(**{"distill.teacher": str(folders / "teacher"), "distill.coef": coef,
                           "distill.reward_weight": weight,
                           "init_from": str(folders / "student")}), str(tmp_path))
  batch = captured["batch"]
  mask = batch["loss_mask"] != 0
  assert mask.sum() > 20 and np.abs(captured["task"][mask]).max() > 0
  teacher = _teacher_logprobs(folders / "teacher", batch)
  want = weight * captured["task"] + coef * (teacher - batch["old_logprobs"])
  np.testing.assert_allclose(batch["advantages"][mask], want[mask], rtol=1e-4, atol=1e-4)
  assert np.all(batch["advantages"][~mask] == 0)
  row = read_metrics(str(tmp_path))[-1]
  np.testing.assert_allclose(row["distill/reverse_kl"],
                             np.mean((batch["old_logprobs"] - teacher)[mask]), rtol=1e-4)
  assert row["distill/reverse_kl"] > 0.1  # the sharper teacher disagrees with the student


def test_a_teacher_equal_to_the_student_adds_nothing(folders, tmp_path):
  """Distilling from the student's own weights: a reverse KL of 0, no advantage left when
  the reward's weight is 0, so the update leaves the weights where they were."""
  student = str(folders / "student")
  trainer.train(_config(**{"distill.teacher": student, "distill.reward_weight": 0.0,
                           "init_from": student}), str(tmp_path))
  row = read_metrics(str(tmp_path))[-1]
  assert abs(row["distill/reverse_kl"]) < 1e-5
  assert abs(row["advantages/mean"]) < 1e-5 and row["advantages/std"] < 1e-5
  assert row["grad_norm"] < 1e-5


def test_planner_counts_the_teacher_on_the_train_devices(folders):
  without = planner.plan(_config(), num_devices=8)
  with_teacher = planner.plan(_config(**{"distill.teacher": str(folders / "teacher")}),
                              num_devices=8)
  teacher_cfg = experiment.teacher_config(_config(**{"distill.teacher":
                                                     str(folders / "teacher")}))
  assert with_teacher["teacher"] == planner.state_bytes(teacher_cfg, with_teacher.mesh,
                                                        models.DEFAULT_RULES)[0]
  assert with_teacher["teacher"] > 0 and without["teacher"] == 0
  assert with_teacher.train_peak == without.train_peak + with_teacher["teacher"]
  text = planner.format_plan(with_teacher)
  assert "reference + teacher + sampler" in text and "frozen, no optimizer" in text
  bf16 = planner.plan(_config(**{"distill.teacher": str(folders / "teacher"),
                                 "distill.dtype": "bfloat16"}), num_devices=8)
  assert bf16["teacher"] * 2 == with_teacher["teacher"]


def test_what_cannot_be_distilled_from_is_a_one_line_error(folders, tmp_path):
  cases = [
      ({"distill.teacher": str(tmp_path / "nowhere")}, "has no config.json"),
      ({"distill.teacher": str(folders / "reward_model")}, "without a language-model head"),
      ({"distill.teacher": str(folders / "teacher"), "distill.dtype": "int4"},
       "distill.dtype='int4'"),
      ({"distill.teacher": str(folders / "teacher"), "distill.coef": 0.0,
        "distill.reward_weight": 0.0}, "leave no advantage"),
      ({"distill.teacher": str(folders / "teacher"), "distill.coef": -1.0},
       "distill.coef=-1.0 must be >= 0"),
  ]
  for extra, message in cases:
    with pytest.raises(ValueError, match=message) as info:
      experiment.check_config(_config(**extra))
    assert "\n" not in str(info.value)
  trainer_cases = [
      ({"distill.teacher": str(folders / "small_vocab")}, "the teacher must read the student"),
      ({"distill.teacher": str(folders / "teacher"), "algorithm": "online_dpo"},
       "trains a preference loss on pairs"),
      ({"distill.teacher": str(folders / "teacher"), "distill.reward_weight": 0.0,
        "algorithm": "dapo"}, "set rl.dynamic_sampling=False"),
  ]
  for extra, message in trainer_cases:
    with pytest.raises(ValueError, match=message) as info:
      trainer.Trainer(_config(**extra), str(tmp_path / "run"))
    assert "\n" not in str(info.value)
