"""RL rewards from a learned reward model: the trainer scores every rollout sample of the
matching domains on the rollout devices and mixes the scores with the verifiers; pass
rates and the held-out evaluation stay the verifiers'."""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models, planner, trainer
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.metrics import read_metrics
from posttrain.rollout import RolloutWorker
from posttrain.rollout import reward_model as reward_model_lib
from posttrain.rollout import worker as worker_lib
from posttrain.tasks import Reward
from tests.test_trainer import _config

TOK = ByteTokenizer()
RM_CFG = models.get_preset("tiny", vocab_size=TOK.vocab_size, num_layers=1, d_model=32,
                           num_heads=2, num_kv_heads=1, head_dim=16, ffn_dim=48,
                           value_head=True, lm_head=False,
                           architecture="LlamaForSequenceClassification")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
  """(folder, model): a random reward model written as a Hugging Face sequence classifier."""
  model = models.create_model(RM_CFG, seed=11)
  path = str(tmp_path_factory.mktemp("rm"))
  models.save_pretrained(model, path)
  return path, model


def _parity_verifier(task, sample):
  # A verifier the untrained policy passes about half the time, by the text's length.
  return Reward(value=float(len(sample.text) % 2), components={"parity": 1.0}, verdict="")


def _spy(monkeypatch):
  """Records every RL rollout's groups with their verifier rewards (before the trainer
  mixes), and every reward model call."""
  rollouts, calls = [], []
  rollout, score = RolloutWorker.rollout, reward_model_lib.TransformerRewardModel.score_texts

  def spy_rollout(self, pairs, **kwargs):
    groups = rollout(self, pairs, **kwargs)
    if "group_size" not in kwargs:  # the evaluation's rollouts pass theirs
      rollouts.append((groups, [[s.reward for s in g.samples] for g in groups]))
    return groups

  def spy_score(self, prompts, completions):
    calls.append(len(prompts))
    return score(self, prompts, completions)

  monkeypatch.setattr(worker_lib, "_score", _parity_verifier)
  monkeypatch.setattr(RolloutWorker, "rollout", spy_rollout)
  monkeypatch.setattr(reward_model_lib.TransformerRewardModel, "score_texts", spy_score)
  return rollouts, calls


def _scores_by_hand(model, pairs):
  """The reward model's value at the last token of each encoded (prompt, completion),
  every sequence right-padded to one length (causal attention: padding after a token
  cannot change its value)."""
  seqs = []
  for prompt, text in pairs:
    ids, mask = TOK.encode_chat([{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": text}])
    seqs.append(ids[:int(np.flatnonzero(mask)[-1]) + 1])
  width = max(len(s) for s in seqs)
  tokens = np.full((len(seqs), width), TOK.pad_id, np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  values = np.asarray(nnx.jit(lambda m, t: m.values(t))(model, jnp.asarray(tokens)))
  return np.asarray([values[i, len(s) - 1] for i, s in enumerate(seqs)], np.float64)


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def test_rl_rewards_are_the_reward_models_scores(tmp_path, monkeypatch, reward_model):
  """mix=1: every sample's reward is sigmoid(score) of its text, recomputed here; the
  logged rewards are their means; pass rates are the verifier's; the evaluation never
  calls the reward model."""
  path, model = reward_model
  rollouts, calls = _spy(monkeypatch)
  steps = 2
  summary = trainer.train(_config(**{
      "reward_model.path": path, "reward_model.mix": 1.0, "sft.steps": 0,
      "train.rl_steps": steps}), str(tmp_path))
  assert summary["status"] == "done"
  rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rows) == steps == len(rollouts)
  assert calls == [16] * steps  # one call a step, every sample (4 prompts x 4); none in eval
  for row, (groups, verified) in zip(rows, rollouts):
    samples = [s for g in groups for s in g.samples]
    raw = _scores_by_hand(model, [(g.task.prompt, s.text) for g in groups for s in g.samples])
    assert np.std(raw) > 0.01  # distinct scores: a mix-up of samples would show
    got = np.asarray([s.reward.value for s in samples])
    np.testing.assert_allclose(got, _sigmoid(raw), atol=1e-5)
    assert row["reward/mean"] == pytest.approx(float(_sigmoid(raw).mean()), abs=1e-5)
    for dom in {g.domain for g in groups}:
      want = np.mean([np.mean(_sigmoid(_scores_by_hand(
          model, [(g.task.prompt, s.text) for s in g.samples]))) for g in groups
          if g.domain == dom])
      assert row[f"reward/{dom}"] == pytest.approx(want, abs=1e-5)
    parity = np.asarray([r.value for rs in verified for r in rs])
    assert [s.reward.components["verifier"] for s in samples] == parity.tolist()
    assert row["pass_rate/mean"] == pytest.approx(float((parity >= 1).mean()))
    # The curriculum's pass rates are the verifier's too: mixed rewards never reach 1.
    if row is rows[0]:  # first updates: a running mean of the groups' pass fractions
      for dom in {g.domain for g in groups}:
        fractions = [np.mean([v.value >= 1 for v in vs]) for g, vs in zip(groups, verified)
                     if g.domain == dom]
        assert row[f"scheduler/curriculum/pass_rate/{dom}"] == pytest.approx(
            float(np.mean(fractions)))
      assert any(row[f"scheduler/curriculum/pass_rate/{g.domain}"] > 0 for g in groups)
    assert row["reward_model/score_mean"] == pytest.approx(float(raw.mean()), abs=1e-5)
    assert row["reward_model/score_std"] == pytest.approx(float(raw.std()), abs=1e-5)
    assert row["reward_model/truncated"] == 0 and row["reward_model/scored"] == 16
    assert row["timing/reward_model_s"] > 0
  # The held-out evaluation is the verifier's: rewards 0 or 1, never a squashed score.
  final = summary["eval"]["final"]
  assert final["reward"] in (0.0, 0.5, 1.0) and final["samples"] == 2


def test_a_mix_of_one_half_mixes_and_a_resumed_run_loads_the_model_again(
    tmp_path, monkeypatch, reward_model):
  path, model = reward_model
  rollouts, calls = _spy(monkeypatch)
  extra = {"reward_model.path": path, "reward_model.mix": 0.5, "reward_model.squash": "clip",
           "reward_model.domains": "strings/*", "sft.steps": 0, "eval.seeds_per_domain": 0,
           "train.rl_steps": 1}
  assert trainer.train(_config(**extra), str(tmp_path))["rl_steps"] == 1
  extra["train.rl_steps"] = 2
  assert trainer.train(_config(**extra), str(tmp_path))["rl_steps"] == 2
  rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rows) == 2 == len(rollouts)
  for row, (groups, verified) in zip(rows, rollouts):
    rewards = []
    for g, vs in zip(groups, verified):
      parity = np.asarray([v.value for v in vs])
      got = np.asarray([s.reward.value for s in g.samples])
      if g.domain.startswith("strings/"):
        raw = _scores_by_hand(model, [(g.task.prompt, s.text) for s in g.samples])
        np.testing.assert_allclose(got, 0.5 * parity + 0.5 * np.clip(raw, 0, 1), atol=1e-5)
        assert all("model" in s.reward.components for s in g.samples)
      else:  # not a domain it scores: the verifier alone, untouched
        assert got.tolist() == parity.tolist()
        assert all("model" not in s.reward.components for s in g.samples)
      rewards += got.tolist()
    assert row["reward/mean"] == pytest.approx(float(np.mean(rewards)), abs=1e-6)
    scored = sum(len(g.samples) for g in groups if g.domain.startswith("strings/"))
    assert row["reward_model/scored"] == scored
  assert calls == [int(r["reward_model/scored"]) for r in rows if r["reward_model/scored"]]


@pytest.mark.parametrize("override, message", [
    ({"reward_model.squash": "tanh"}, r"^reward_model.squash='tanh'; expected one of"),
    ({"reward_model.mix": 1.5}, r"^reward_model.mix=1.5 must be in \[0, 1\]$"),
    ({"reward_model.mix": -0.1}, r"^reward_model.mix=-0.1 must be >= 0.0$"),
    ({"reward_model.batch_size": 0}, r"^reward_model.batch_size=0 must be >= 1$"),
    ({"reward_model.domains": "arithmetic/*,nope/*"},
     r"^reward_model.domains='arithmetic/\*,nope/\*': 'nope/\*' matches none of the run's"),
    ({"reward_model.domains": " , "}, r"^reward_model.domains=' , ' holds no pattern"),
])
def test_a_bad_reward_model_config_fails_before_anything_is_built(tmp_path, reward_model,
                                                                  override, message):
  config = _config(**{"reward_model.path": reward_model[0], **override})
  with pytest.raises(ValueError, match=message) as e:
    trainer.Trainer(config, str(tmp_path / "run"))
  assert "\n" not in str(e.value)
  assert not (tmp_path / "run").exists()


def test_a_folder_without_a_value_head_fails_naming_the_path(tmp_path):
  lm = str(tmp_path / "lm")
  models.save_pretrained(models.create_model(RM_CFG.replace(
      value_head=False, lm_head=True, architecture="LlamaForCausalLM")), lm)
  for path, message in [(lm, "has no value head"), (str(tmp_path / "none"), "no config.json")]:
    with pytest.raises(ValueError, match=f"^reward model '{path}' .*{message}") as e:
      trainer.Trainer(_config(**{"reward_model.path": path}), str(tmp_path / "run"))
    assert "\n" not in str(e.value)
  assert not (tmp_path / "run").exists()


def test_the_tokenizer_is_the_configured_one_else_the_runs(reward_model):
  import ml_collections
  path = reward_model[0]
  run_tok = ByteTokenizer()
  section = ml_collections.ConfigDict(dict(path=path, batch_size=5, max_len=0, tokenizer=""))
  rm = reward_model_lib.TransformerRewardModel.from_config(section, tokenizer=run_tok,
                                                           default_max_len=77)
  assert rm.tok is run_tok and rm.max_len == 77 and rm.batch_size == 5
  section.tokenizer, section.max_len = "byte", 40
  rm = reward_model_lib.TransformerRewardModel.from_config(section, tokenizer=run_tok)
  assert rm.tok is not run_tok and isinstance(rm.tok, ByteTokenizer) and rm.max_len == 40
  with pytest.raises(ValueError, match="holds no tokenizer.json"):
    reward_model_lib.TransformerRewardModel.from_pretrained(path)


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_the_planner_counts_the_reward_model_on_the_rollout_devices(reward_model, placement):
  path = reward_model[0]
  extra = {"placement.mode": placement, "placement.rollout_devices": 2,
           "train.rows_per_microbatch": 6 if placement == "disaggregated" else 8}
  without = planner.plan(_config(**extra), num_devices=8)
  p = planner.plan(_config(**extra, **{"reward_model.path": path}), num_devices=8)
  rollout_mesh = models.make_mesh(tuple(p.rollout_mesh.values()),
                                  devices=jax.devices()[:math.prod(p.rollout_mesh.values())])
  rm = reward_model_lib.TransformerRewardModel.from_pretrained(path, TOK, mesh=rollout_mesh)
  per_device: dict = {}
  for leaf in jax.tree.leaves(rm._state):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  assert p["reward_model"] == max(per_device.values()) > 0
  assert without["reward_model"] == 0
  assert p.rollout_peak == without.rollout_peak + p["reward_model"]
  if placement == "colocated":
    assert p.train_peak == without.train_peak + p["reward_model"]
  else:
    assert p.train_peak == without.train_peak
  missing = planner.plan(_config(**extra, **{"reward_model.path": os.devnull + "x"}),
                         num_devices=8)
  assert missing["reward_model"] == 0
  assert "not counted" in missing.components["reward_model"].formula


# About two and a half minutes on two cores: runs with -m slow.
@pytest.mark.slow
def test_two_processes_score_the_same_samples_with_one_program(tmp_path, reward_model):
  """Every process holds every sample's text after the rollout and scores all of them
  with the same programs over the 8 devices of both: the run finishes (a mismatched
  program would hang or fail) and both hosts log the same rewards."""
  import json

  from tests.test_multihost import _run_two, _train_args
  results = _run_two(_train_args(tmp_path, **{"reward_model.path": reward_model[0],
                                              "eval.seeds_per_domain": 0}), timeout=900)
  lines = []
  for code, out in results:
    assert code == 0, out[-3000:]
    lines.append([ln.split("|")[1] for ln in out.splitlines() if ln.startswith("[grpo] step")])
  assert len(lines[0]) == 2 and lines[0] == lines[1]  # each host's rewards, step by step
  rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  rl_rows = [r for r in rows if "reward/mean" in r]
  assert [r["reward_model/scored"] for r in rl_rows] == [16, 16]
  assert all(0 < r["reward/mean"] < 1 for r in rl_rows)
