"""Disaggregated (asynchronous) placement against the colocated one."""

import numpy as np

import pytest

from posttrain import tasks, trainer
from posttrain.metrics import read_metrics
from tests.test_trainer import _config


class LowercaseDomain(tasks.Domain):
  """Reward = fraction of lowercase letters: dense, so an untrained policy's groups differ."""

  def _sample(self, rng, seed):
    return tasks.Task(self.name, seed, "Write lowercase letters.", "abc", level=1,
                      family=self.family)

  def _score(self, task, completion):
    value = sum(c.islower() for c in completion) / max(len(completion), 1)
    return tasks.Reward(value, {"exact": value}, "scored")


class LowercaseToolDomain(LowercaseDomain):
  """The lowercase reward, and a tool that answers a sample's first turn once."""

  def step(self, task, text):
    if "=" in text:
      return tasks.StepResult(observation=None, done=True)
    return tasks.StepResult(observation=f"={len(text)}", done=False)


@pytest.fixture(scope="module", autouse=True)
def dense_domain():
  tasks.registry.register(LowercaseDomain("testing/lowercase_l1", "testing", 1), replace=True)
  tasks.registry.register(LowercaseToolDomain("testing/lowercasetool_l1", "testing", 1),
                          replace=True)
  yield
  tasks.registry.unregister("testing/lowercase_l1")
  tasks.registry.unregister("testing/lowercasetool_l1")


RUN = {"sft.steps": 0, "train.rl_steps": 3, "eval.seeds_per_domain": 0,
       "checkpoint.every": 1000, "rollout.max_new_tokens": 12,
       "tasks.domains": "testing/lowercase_l1"}


def _rl_rows(workdir):
  return [r for r in read_metrics(str(workdir)) if "reward/mean" in r]


def test_disaggregated_with_zero_lag_equals_colocated_exactly(tmp_path):
  colocated = _config(**RUN, **{"placement.devices": 4})
  trainer.train(colocated, str(tmp_path / "co"))
  disagg = _config(**RUN, **{"placement.mode": "disaggregated", "placement.rollout_devices": 4,
                             "placement.max_policy_lag": 0})
  trainer.train(disagg, str(tmp_path / "dis"))
  a, b = _rl_rows(tmp_path / "co"), _rl_rows(tmp_path / "dis")
  assert len(a) == len(b) == 3
  assert any(r["reward/mean"] > 0 and r["grad_norm"] > 0 for r in a)
  for ra, rb in zip(a, b):
    for key in ("reward/mean", "loss/policy", "grad_norm", "entropy", "kl"):
      assert ra[key] == rb[key], (key, ra[key], rb[key])
    assert rb["staleness/max"] == 0 and "timing/wait_for_rollout_s" in rb


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True])
def test_swapping_weights_between_batches_repeats_a_disaggregated_run_exactly(tmp_path,
                                                                              streamed):
  """placement.weight_swap=between_batches on one process: generation pauses every 3
  tokens (chunks: segments; streamed through 8 cache rows: rounds, the sampler lock let
  go after each), yet weights change only between batches (every segment resumes from
  its cache; no streamed rollout sees a swap), batch j samples with version j - 1
  (max_policy_lag=1), and a second run repeats the first exactly. (With in_flight, 48
  tokens take long enough that the learner's sync lands mid-batch.)"""
  cfg = _config(**{**RUN, "rollout.max_new_tokens": 48}, **{
      "placement.mode": "disaggregated", "placement.rollout_devices": 4,
      "placement.max_policy_lag": 1, "placement.segment_tokens": 3,
      "placement.weight_swap": "between_batches"},
      **({"rollout.chunk_rows": 8} if streamed else {}))
  trainer.train(cfg, str(tmp_path / "a"))
  trainer.train(cfg, str(tmp_path / "b"))
  a, b = _rl_rows(tmp_path / "a"), _rl_rows(tmp_path / "b")
  assert len(a) == len(b) == 3
  for i, (ra, rb) in enumerate(zip(a, b)):
    assert ra["staleness/max"] == rb["staleness/max"] == min(i, 1)
    if streamed:
      assert "rollout/resumed_fraction" not in ra and "rollout/weight_swaps" not in ra
      assert 0 < ra["rollout/decode_occupancy"] <= 1
    else:
      assert ra["rollout/resumed_fraction"] == 1.0
    for key in ("reward/mean", "loss/policy", "grad_norm", "entropy", "kl"):
      assert ra[key] == rb[key], (i, key, ra[key], rb[key])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_multi_turn_rollouts_stream_through_a_training_run(tmp_path, mode):
  """Two-turn rows (a tool answers each first turn) streamed through 8 cache rows train,
  colocated and disaggregated with in-flight swaps every 3 decode steps at most: every
  row gets the tool's turn, the staleness bound holds, the updates are finite."""
  extra = {"placement.devices": 4} if mode == "colocated" else {
      "placement.mode": "disaggregated", "placement.rollout_devices": 4,
      "placement.max_policy_lag": 1, "placement.segment_tokens": 3,
      "placement.weight_swap": "in_flight"}
  cfg = _config(**{**RUN, "tasks.domains": "testing/lowercasetool_l1"},
                **{"rollout.max_turns": 2, "rollout.chunk_rows": 8}, **extra)
  trainer.train(cfg, str(tmp_path))
  rows = _rl_rows(tmp_path)
  assert len(rows) == 3
  for r in rows:
    assert r["staleness/max"] <= (0 if mode == "colocated" else 1)
    assert np.isfinite(r["grad_norm"]) and np.isfinite(r["loss/policy"])
    assert 0 < r["rollout/decode_occupancy"] <= 1 and "rollout/resumed_fraction" not in r
    if mode == "colocated":
      assert r["rollout/tool_step_fraction"] == 1.0
      # No weights land mid-rollout: every second turn goes on in its row's slot.
      assert 0 < r["rollout/reused_prefix_fraction"] < 1


def test_rollout_thread_generates_no_batch_past_the_last_step():
  """AsyncRollouts makes exactly the run's batches: the final weight sync does not wait
  for (and the rollout devices do not compute) a batch nobody will train on."""
  import threading
  import types
  made = []

  class Learner:
    max_policy_lag, partial, sampler_version = 1, "resume", 0
    progress = types.SimpleNamespace(rl_step=0, policy_version=0)

    def _step_seed(self, k):
      return k

    def _rollout(self, k):
      made.append(k)
      sample = types.SimpleNamespace(oldest_version=self.progress.policy_version,
                                     versions=[self.progress.policy_version])
      return [types.SimpleNamespace(samples=[sample])], {}

  learner = Learner()
  source = trainer.AsyncRollouts(learner, total_steps=3)
  try:
    for _ in range(3):
      source.get()
      learner.progress.rl_step += 1
      learner.progress.policy_version += 1
      done = threading.Event()
      threading.Thread(target=lambda: (source.wait_generated(
          learner.progress.rl_step + learner.max_policy_lag), done.set())).start()
      assert done.wait(30), "the learner waited for a batch past the last step"
      source.publish(learner.progress.rl_step)
  finally:
    source.close()
  assert made == [0, 1, 2]


def test_unknown_weight_swap_is_a_clear_error(tmp_path):
  cfg = _config(**RUN, **{"placement.weight_swap": "sometimes"})
  with pytest.raises(ValueError, match="placement.weight_swap='sometimes'; expected auto"):
    trainer.Trainer(cfg, str(tmp_path))


def test_stale_groups_beyond_the_bound_are_dropped_and_counted(tmp_path):
  # Weights reach the sampler only every 3 steps, so batches fall > 1 version behind.
  cfg = _config(**{**RUN, "train.rl_steps": 5}, **{
      "placement.mode": "disaggregated", "placement.rollout_devices": 4,
      "placement.max_policy_lag": 1, "placement.sync_every": 3})
  trainer.train(cfg, str(tmp_path))
  rows = _rl_rows(tmp_path)
  assert len(rows) == 5
  assert max(r["staleness/max"] for r in rows) <= 1
  assert sum(r["dropped_stale"] for r in rows) > 0
  synced = [r for r in rows if r["step"] % 3 == 0]
  assert synced and all(r["timing/weight_sync_s"] > 0 and r["timing/weight_sync_wait_s"] >= 0
                        for r in synced)
  # Off-policy samples are corrected with truncated importance weights.
  assert any(abs(r["is_weight/mean"] - 1.0) > 1e-6 for r in rows)
  assert all(np.isfinite(r["loss/policy"]) for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_partial_rollouts_across_steps_train_on_complete_groups(tmp_path, mode):
  """placement.step_tokens=5 with 12 new tokens: an untrained policy's groups take three
  rollout calls, so each step keeps generating until groups complete, then trains on
  whole groups only."""
  placement = ({"placement.mode": "disaggregated", "placement.rollout_devices": 4}
               if mode == "disaggregated" else {})
  cfg = _config(**{**RUN, "train.rl_steps": 3, "rollout.prompts_per_step": 4},
                **placement, **{"placement.step_tokens": 5})
  trainer.train(cfg, str(tmp_path))
  rows = _rl_rows(tmp_path)
  assert len(rows) == 3
  assert all(r["rollout/calls"] == 3 and r["rollout/carried_groups"] == 0 for r in rows)
  assert all(r["response_length/mean"] > 5 and np.isfinite(r["loss/policy"]) for r in rows)


class _CarryingWorker:
  """Stands in for RolloutWorker: records the pairs asked for; completes one group per
  call and carries the rest."""

  def __init__(self, carried):
    self.carried, self.asked, self.last_stats = carried, [], {}

  def rollout(self, pairs, **kw):
    self.asked.append(list(pairs))
    self.carried += len(pairs) - 1
    self.last_stats = {"carried_groups": float(self.carried)}
    return ["group"]

  def drop_carried(self):
    n, self.carried = self.carried, 0
    return n


def test_partial_rollouts_draw_new_prompts_only_for_free_places(tmp_path):
  t = trainer.Trainer(_config(**RUN, **{"placement.step_tokens": 4,
                                        "rollout.prompts_per_step": 4}), str(tmp_path))
  try:
    t.worker.close()
    t.worker = _CarryingWorker(carried=3)
    groups, extra = t._rollout(step_seed=1)
    assert len(t.worker.asked[0]) == 1  # 4 places, 3 taken by groups in flight
    t.worker.carried = 6
    groups, extra = t._rollout(step_seed=2)
    assert t.worker.asked[-1] == []  # more in flight than places: no new prompts
    assert extra["rollout/carried_groups"] == 5 and extra["rollout/calls"] == 1
  finally:
    t.ckpt.close()


def test_partial_rollouts_dropped_by_config_are_counted_and_replaced(tmp_path):
  """placement.partial=drop: groups not complete within the step's tokens are discarded
  (rollout/dropped_partial) and the next step draws all its prompts anew; a budget no
  group can finish in is a clear error, not an endless loop."""
  t = trainer.Trainer(_config(**RUN, **{"placement.step_tokens": 4, "placement.partial": "drop",
                                        "rollout.prompts_per_step": 4}), str(tmp_path / "a"))
  try:
    t.worker.close()
    t.worker = _CarryingWorker(carried=0)
    _, extra = t._rollout(step_seed=1)
    assert extra["rollout/dropped_partial"] == 3 and t.worker.carried == 0
    _, extra = t._rollout(step_seed=2)
    assert len(t.worker.asked[-1]) == 4  # nothing in flight: every place is new
  finally:
    t.ckpt.close()
  cfg = _config(**{**RUN, "train.rl_steps": 1}, **{"placement.step_tokens": 5,
                                                  "placement.partial": "drop"})
  with pytest.raises(trainer.RolloutStalledError,
                     match="no group finished within placement.step_tokens=5"):
    trainer.train(cfg, str(tmp_path / "b"))


def test_partial_rollouts_across_steps_refuse_dynamic_sampling_and_multi_turn(tmp_path):
  with pytest.raises(ValueError, match="cannot be combined with dynamic sampling"):
    trainer.Trainer(_config(**RUN, **{"placement.step_tokens": 4,
                                      "rl.dynamic_sampling": True}), str(tmp_path / "a"))
  with pytest.raises(ValueError, match="needs rollout.max_turns=1, got 2"):
    trainer.Trainer(_config(**RUN, **{"placement.step_tokens": 4, "rollout.max_turns": 2}),
                    str(tmp_path / "b"))


class _Dev:
  def __init__(self, process_index, i):
    self.process_index, self.id = process_index, i

  def __repr__(self):
    return f"d{self.process_index}.{self.id}"


def test_one_process_rolls_out_on_its_first_devices():
  from posttrain import experiment
  devices = [_Dev(0, i) for i in range(8)]
  roll, train = experiment.split_devices(devices, 3)
  assert roll == devices[:3] and train == devices[3:]


def test_several_hosts_each_give_the_same_share_of_their_devices():
  """Every host takes part in both meshes: 2 rollout devices from each of 4 hosts, in
  device order, not the first 8 devices (which would be hosts 0 and 1 only)."""
  from posttrain import experiment
  devices = [_Dev(p, p * 4 + i) for p in range(4) for i in range(4)]
  roll, train = experiment.split_devices(devices, 8)
  assert [(d.process_index, d.id % 4) for d in roll] == [(p, i) for p in range(4)
                                                         for i in range(2)]
  assert [(d.process_index, d.id % 4) for d in train] == [(p, i) for p in range(4)
                                                          for i in range(2, 4)]
  with pytest.raises(ValueError, match="rollout_devices=6 must be a multiple of the 4 "):
    experiment.split_devices(devices, 6)
  with pytest.raises(ValueError, match="different numbers of devices"):
    experiment.split_devices(devices[:-1], 8)


@pytest.mark.parametrize("devices, rollout, message", [
    (1, 1, "placement.mode=disaggregated needs at least 2 devices .*; 1 available"),
    (8, 8, r"placement.rollout_devices=8 must leave devices for training \(1..7\)"),
    (8, 0, r"placement.rollout_devices=0 must leave devices for training \(1..7\)"),
])
def test_disaggregated_placement_without_devices_for_both_sides_is_refused(
    devices, rollout, message):
  from posttrain import experiment
  c = _config(**{"placement.mode": "disaggregated", "placement.devices": devices,
                 "placement.rollout_devices": rollout})
  with pytest.raises(ValueError, match=message):
    experiment.build_meshes(c)
