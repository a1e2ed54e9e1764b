"""ReMax (Li et al. 2023): each prompt's baseline is the reward of one greedy completion of
it by the rollout policy, scored like the samples and never trained on."""

import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from posttrain import trainer
from posttrain.rl import advantages as adv_lib
from posttrain.rl import presets
from posttrain.rollout import RolloutWorker, Sample, TrajectoryGroup
from posttrain.rollout import worker as worker_lib
from posttrain.tasks import Reward
from tests.test_trainer import _config
from tests.test_trainer_reward_model import _scores_by_hand
from tests.test_trainer_reward_model import reward_model  # noqa: F401  (the fixture)


def _remax_reference(rewards, baselines, ids, valid):
  """Loop reference: r_i minus the baseline of its group (groups in increasing id order)."""
  order = {g: k for k, g in enumerate(sorted(set(ids.tolist())))}
  return np.asarray([r - baselines[order[g]] if v else 0.0
                     for r, g, v in zip(rewards, ids, valid)], np.float32)


def test_remax_advantages_match_the_reference_in_both_layouts():
  rng = np.random.default_rng(0)
  rewards_GxS = rng.normal(size=(3, 5)).astype(np.float32)
  baselines_G = rng.normal(size=3).astype(np.float32)
  got = adv_lib.remax_advantages(rewards_GxS, baselines_G)
  np.testing.assert_allclose(got, rewards_GxS - baselines_G[:, None], atol=1e-6)
  # Flat, arbitrary ids, groups of 1, 2 and 4 members, invalid entries holding NaN.
  ids = np.asarray([11, 3, 11, 7, 3, 11, 11], np.int32)
  valid = np.asarray([1, 1, 0, 1, 1, 1, 0], bool)
  rewards = np.where(valid, rng.normal(size=7), np.nan).astype(np.float32)
  baselines = rng.normal(size=3).astype(np.float32)  # ids 3, 7, 11
  want = _remax_reference(rewards, baselines, ids, valid)
  got = adv_lib.remax_advantages(rewards, baselines, ids, valid=valid)
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert got[3] == pytest.approx(rewards[3] - baselines[1])  # a group of one learns too
  jitted = jax.jit(lambda r, b, g, v: adv_lib.remax_advantages(r, b, g, valid=v))
  np.testing.assert_allclose(jitted(rewards, baselines, ids, valid), want, atol=1e-6)
  grad = jax.grad(lambda b: jnp.sum(adv_lib.remax_advantages(rewards, b, ids, valid=valid)))
  np.testing.assert_allclose(grad(baselines), [-2.0, -1.0, -2.0])  # minus valid members


def test_remax_advantages_want_one_baseline_per_group():
  with pytest.raises(ValueError, match=r"one reward per group, shape \(3,\), got \(2,\)$"):
    adv_lib.remax_advantages(np.zeros((3, 4), np.float32), np.zeros(2, np.float32))
  with pytest.raises(ValueError, match=r"shape \(2,\), got \(3,\)$"):
    adv_lib.remax_advantages(np.zeros(4, np.float32), np.zeros(3, np.float32),
                             np.asarray([5, 5, 9, 9]))


def test_remax_is_registered_and_sequence_level():
  assert adv_lib.get_advantage_estimator("remax") is adv_lib.remax_advantages
  assert "remax" in adv_lib.SEQUENCE_LEVEL_ESTIMATORS


def test_the_preset_resolves_with_a_kl_loss_term():
  cfg = presets.algorithm_config("remax")
  assert cfg.advantage_estimator == "remax" and not cfg.use_critic
  # Sequence-level advantages read no per-token reward: veRL's KL in the reward is a loss.
  assert cfg.kl_coef == 0.001 and not cfg.kl_in_reward and cfg.group_size == 4
  # The baseline is no sample of the group: one sample a prompt (the paper's) is enough.
  assert presets.algorithm_config("remax", group_size=1).group_size == 1
  with pytest.raises(ValueError, match="invalid group_size=1 for algorithm 'rloo'"):
    presets.algorithm_config("rloo", group_size=1)


def _sample(n_generated: int, reward: float) -> Sample:
  return Sample(prompt_tokens=[1, 2], response_tokens=[5] * n_generated,
                response_mask=[1] * n_generated, behaviour_logprobs=[0.0] * n_generated,
                text="x" * n_generated, finish_reason="stop",
                reward=Reward(value=reward, components={}, verdict=""))


def _fake_trainer(**overrides):
  fake = types.SimpleNamespace(
      algo=presets.algorithm_config("remax", **overrides),
      config=ml_collections.ConfigDict({"rollout": {"max_new_tokens": 8}}))
  fake._shape = lambda group, rewards: trainer.Trainer._shape(fake, group, rewards)
  return fake


def test_sequence_advantages_subtract_the_greedy_samples_shaped_reward():
  """With the overlong penalty (max 8 tokens, a ramp over the last 4) the baseline is
  shaped by its own length, as the samples are by theirs."""
  fake = _fake_trainer(overlong_penalty=True, overlong_buffer_len=4)
  groups = [TrajectoryGroup("d", 0, None, [_sample(2, 1.0), _sample(6, 1.0), _sample(8, 0.0)],
                            0, baseline=_sample(6, 1.0)),
            TrajectoryGroup("d", 1, None, [_sample(3, 0.0)], 0, baseline=_sample(1, 1.0))]
  shaped = [fake._shape(g, g.rewards) for g in groups]
  np.testing.assert_allclose(shaped[0], [1.0, 0.5, -1.0])
  got = trainer.Trainer._sequence_advantages(fake, shaped, groups)
  assert [len(a) for a in got] == [3, 1]
  # Baselines: 1 - 0.5 (6 tokens) and 1 (1 token, no penalty).
  np.testing.assert_allclose(np.concatenate(got), [0.5, 0.0, -1.5, -1.0], atol=1e-6)


def test_a_group_without_a_greedy_baseline_is_a_one_line_error():
  fake = _fake_trainer()
  groups = [TrajectoryGroup("arithmetic/add_d1", 7, None, [_sample(2, 1.0), _sample(3, 0.0)],
                            0)]
  with pytest.raises(RuntimeError) as info:
    trainer.Trainer._sequence_advantages(fake, [groups[0].rewards], groups)
  message = str(info.value)
  assert "remax" in message and "'arithmetic/add_d1' seed 7" in message and "\n" not in message


def _spy_rollouts(monkeypatch):
  """Records each worker.rollout call's keyword arguments and the stats it left."""
  calls = []
  rollout = RolloutWorker.rollout

  def spy(self, pairs, **kwargs):
    groups = rollout(self, pairs, **kwargs)
    calls.append((kwargs, self.last_stats))
    return groups

  monkeypatch.setattr(RolloutWorker, "rollout", spy)
  return calls


def test_rollout_attaches_each_group_the_samplers_greedy_completion(tmp_path, monkeypatch,
                                                                    reward_model):
  """Each group's baseline is the sampler's greedy completion of its prompt, scored by the
  verifier and mixed with the reward model like the samples; the reward model's stats
  count only the samples."""
  path, model = reward_model
  t = trainer.Trainer(_config(**{"algorithm": "remax", "sft.steps": 0,
                                 "reward_model.path": path, "reward_model.mix": 0.5}),
                      str(tmp_path))
  calls = _spy_rollouts(monkeypatch)
  groups, extra = t._rollout(t._step_seed(0))
  assert len(groups) == 4 and [len(g.samples) for g in groups] == [4] * 4
  # One sampled rollout, then one greedy completion per group; the worker keeps reporting
  # the sampled rollout's stats (what the step logs as its rollout's).
  assert len(calls) == 2
  assert calls[1][0]["temperature"] == 0.0 and calls[1][0]["group_size"] == 1
  assert "token_budget" not in calls[1][0] and "temperature" not in calls[0][0]
  assert t.worker.last_stats is calls[0][1]
  r = t.config.rollout
  prompts = [g.samples[0].prompt_tokens for g in groups]
  greedy = t.sampler.generate(prompts, max_new_tokens=int(r.max_new_tokens), temperature=0.0,
                              stop_token_ids=t.tok.stop_ids).token_lists()
  scores = _scores_by_hand(model, [(g.task.prompt, g.baseline.text) for g in groups])
  for g, tokens, score in zip(groups, greedy, scores):
    b = g.baseline
    assert b is not None and all(b is not s for s in g.samples)
    assert b.prompt_tokens == g.samples[0].prompt_tokens and b.response_tokens == tokens
    verified = worker_lib._score(g.task, b).value  # the same verifier as the samples
    assert b.reward.components["verifier"] == verified
    assert b.reward.value == pytest.approx(0.5 * verified + 0.5 / (1 + np.exp(-score)),
                                           abs=1e-5)
  assert extra["reward_model/scored"] == 16
  assert extra["remax/baseline_reward"] == pytest.approx(
      np.mean([g.baseline.reward.value for g in groups]))
  assert extra["remax/baseline_tokens"] == pytest.approx(
      np.mean([g.baseline.num_generated for g in groups]))
  assert extra["timing/remax_baseline_s"] > 0
  t.worker.close()


@pytest.mark.slow
def test_dynamic_sampling_keeps_single_samples_that_beat_or_trail_the_greedy_one(
    tmp_path, monkeypatch):
  """One sample a prompt, dynamic sampling: a group is kept when its sample scores
  otherwise than the greedy completion (else every group of one would be dropped); a
  remax run trains on them and logs the baseline."""
  from posttrain.metrics import read_metrics
  # A reward the untrained policy varies on: the parity of the completion's length.
  monkeypatch.setattr(worker_lib, "_score", lambda task, sample: Reward(
      value=float(len(sample.text) % 2), components={}, verdict=""))
  extra = {"algorithm": "remax", "rl.group_size": 1, "rl.dynamic_sampling": True,
           "sft.steps": 0, "train.rl_steps": 2, "eval.seeds_per_domain": 0}
  summary = trainer.train(_config(**extra), str(tmp_path))
  assert summary["status"] == "done"
  rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rows) == 2
  for row in rows:
    assert row["dynamic_sampling/draws"] - row["dynamic_sampling/dropped"] == 4, row
    # Each kept sample's reward is 1 - the greedy one's: their means add up to 1.
    assert row["reward/mean"] + row["remax/baseline_reward"] == pytest.approx(1.0), row
    assert np.isfinite(row["loss"]) and row["remax/baseline_tokens"] > 0
