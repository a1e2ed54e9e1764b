"""objective=reward_model end to end: verifier pairs, training that ranks held-out pairs,
bit-exact resume after preemption, the Hugging Face export, and one-line config errors."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import reward_model_tiny
from posttrain import experiment, models, planner, reward_trainer
from posttrain.checkpoint import CheckpointManager
from posttrain.data import ByteTokenizer
from posttrain.metrics import read_metrics
from posttrain.tasks import registry
from posttrain.tasks.pairs import verifier_pairs
from tests.test_trainer import ROOT
from tests.xla_flags import xla_flags

DOMAINS = ["arithmetic/add_d1", "logic/parity_l1", "lists/max_l1"]
OVERRIDES = {"model.overrides.num_layers": 1, "model.overrides.d_model": 32,
             "model.overrides.ffn_dim": 64, "train.row_len": 128,
             "train.rows_per_microbatch": 8, "train.log_every": 1, "rm.batch_size": 16,
             "rm.lr": 3e-3, "rm.warmup": 2, "checkpoint.every": 1,
             "checkpoint.async_save": False}


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _surface_pairs(seed, count):
  """Pairs a tiny model can learn in a few steps: the chosen answer echoes the word, the
  rejected one shouts it backwards."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    word = "".join(rng.choice(list("abcdefghij"), rng.integers(3, 7)))
    rows.append({"prompt": f"Repeat: {word}", "chosen": word,
                 "rejected": word[::-1].upper() + "!", "margin": 0.5,
                 "domain": "short" if len(word) < 5 else "long"})
  return rows


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("pairs")
  return (_write(d / "train.jsonl", _surface_pairs(0, 192)),
          _write(d / "heldout.jsonl", _surface_pairs(1, 48)))


def _config(pair_files, **extra):
  c = reward_model_tiny.get_config()
  return planner.override(c, {**OVERRIDES, "rm.data": pair_files[0],
                             "rm.eval_data": pair_files[1], **extra})


def _params(workdir, config):
  cfg = reward_trainer.reward_model_config(config)
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  abstract = experiment.abstract_checkpoint(cfg, experiment.optimizer_like(config), mesh, ())
  state, extras, step = CheckpointManager(f"{workdir}/checkpoints",
                                          read_only=True).restore(abstract)
  return jax.tree.map(np.asarray, state["params"]), extras, step


def test_verifier_pairs_prefer_what_the_verifier_accepts():
  rows = verifier_pairs(DOMAINS, 30, seed=3)
  assert [r["domain"] for r in rows[:3]] == DOMAINS
  for row in rows:
    domain = registry.get(row["domain"])
    task = domain.sample(row["seed"])
    assert task.prompt == row["prompt"] and row["seed"] % 2 == 0  # a training seed
    assert domain.score(task, row["chosen"]).value == 1.0
    assert domain.score(task, row["rejected"]).value < 1.0
  held = verifier_pairs(DOMAINS, 30, seed=3, heldout=True)
  assert all(r["seed"] % 2 == 1 for r in held)  # held-out seeds
  with pytest.raises(ValueError, match="multi-turn"):
    verifier_pairs([n for n in registry.names() if registry.get(n).multi_turn][:1], 1)
  with pytest.raises(ValueError, match="count must be >= 1"):
    verifier_pairs(DOMAINS, 0)


@pytest.mark.slow
def test_reward_model_learns_resumes_exactly_and_exports(tmp_path, pair_files, monkeypatch):
  steps = 24
  straight = reward_trainer.train(_config(pair_files, **{"rm.steps": steps,
                                                         "rm.eval_every": 12,
                                                         "export_hf": str(tmp_path / "hf")}),
                                  str(tmp_path / "straight"))
  assert straight["status"] == "done" and straight["rm_steps"] == steps
  rows = read_metrics(str(tmp_path / "straight"))
  held = [r for r in rows if "eval_rm/rewards/accuracy" in r]
  assert len(held) == 2 and held[-1]["eval_rm/pairs"] == 48
  # Random scores rank about half the pairs; trained ones the held-out tasks' answers.
  assert held[-1]["eval_rm/rewards/accuracy"] >= 0.9, held
  assert straight["rm_heldout"]["rewards/accuracy"] == held[-1]["eval_rm/rewards/accuracy"]
  train_rows = [r for r in rows if "rm/loss/reward_model" in r]
  assert len(train_rows) == steps
  assert train_rows[-1]["rm/loss/reward_model"] < 0.5 * train_rows[0]["rm/loss/reward_model"]
  params, _, _ = _params(tmp_path / "straight", _config(pair_files))
  assert "lm_head" not in params and float(params["value_b"]) == 0.0

  # The export is a sequence classifier whose scores are the trained model's.
  exported = models.from_pretrained(str(tmp_path / "hf"))
  assert exported.cfg.architecture == "LlamaForSequenceClassification"
  assert not exported.cfg.lm_head and exported.cfg.value_head
  hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert hf_config["pad_token_id"] == ByteTokenizer().pad_id
  np.testing.assert_allclose(np.asarray(exported.value_w[...]), params["value_w"], rtol=1e-6)
  tok = ByteTokenizer()
  ids, _ = tok.encode_chat([{"role": "user", "content": "What is 2+3?"},
                            {"role": "assistant", "content": "<answer>5</answer>"}])
  tokens = np.asarray([ids + [tok.pad_id] * 5], np.int32)
  segments = np.asarray([[1] * len(ids) + [0] * 5], np.int32)
  h = np.asarray(exported.hidden_states(tokens[:, :len(ids)]), np.float64)[0, -1]
  np.testing.assert_allclose(exported.scores(tokens, segments)[0], h @ params["value_w"],
                             rtol=1e-4, atol=1e-5)

  # Preempted after step 5 and resumed: the same weights, bit for bit.
  class StopAt5(reward_trainer.PreemptionFlag):
    def reached(self, step):
      return step == 5 or super().reached(step)

  cut = str(tmp_path / "cut")
  monkeypatch.setattr(reward_trainer, "PreemptionFlag", StopAt5)
  short = _config(pair_files, **{"rm.steps": 8, "rm.eval_every": 0})
  assert reward_trainer.train(short, cut)["status"] == "preempted"
  monkeypatch.undo()
  resumed = reward_trainer.train(short, cut)
  assert resumed["status"] == "done" and resumed["rm_steps"] == 8
  reward_trainer.train(short, str(tmp_path / "whole"))
  a, _, _ = _params(tmp_path / "whole", short)
  b, extras, step = _params(cut, short)
  assert step == 8 and extras["progress"]["step"] == 8
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("extra, message", [
    ({"rm.data": ""}, "needs rm.data"),
    ({"sft.steps": 3}, "set sft.steps=0"),
    ({"train.rl_steps": 2}, "set train.rl_steps=0"),
    ({"rm.steps": 0}, "rm.steps=0 must be >= 1"),
    ({"rm.lr": 0.0}, "rm.lr=0.0 must be > 0"),
    ({"rm.center_coef": -1.0}, "center_coef"),
    ({"objective": "critic"}, "objective='critic'"),
    ({"init_from": "/nonexistent"}, "a reward model starts from a Hugging Face folder"),
])
def test_config_errors_fail_before_anything_is_written(tmp_path, pair_files, extra, message):
  with pytest.raises(ValueError, match=message) as e:
    reward_trainer.RewardModelTrainer(_config(pair_files, **extra), str(tmp_path / "run"))
  assert "\n" not in str(e.value)
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_launcher_runs_the_reward_model_objective(tmp_path, pair_files):
  flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, "rm.steps": 2, "rm.eval_every": 0,
                                           "rm.data": pair_files[0],
                                           "rm.eval_data": ""}.items()]
  cmd = [sys.executable, "-m", "launch.train", f"--config={ROOT}/configs/reward_model_tiny.py",
         f"--workdir={tmp_path}", *flags]
  env = {"XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
  out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert json.loads((tmp_path / "summary.json").read_text())["rm_steps"] == 2
  bad = subprocess.run(cmd + ["--config.rm.data="], cwd=ROOT, env={**os.environ, **env},
                       capture_output=True, text=True, timeout=600)
  assert bad.returncode != 0 and "needs rm.data" in bad.stderr + bad.stdout


def test_pairs_command_writes_rows_and_rejects_bad_input(tmp_path):
  out = tmp_path / "p.jsonl"
  cmd = [sys.executable, "-m", "launch.pairs", "--domains=arithmetic/add_d1", "--count=5",
         f"--out={out}"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(rows) == 5 and all(set(r) == {"prompt", "chosen", "rejected", "domain", "seed"}
                                for r in rows)
  bad = subprocess.run(cmd[:3] + ["--domains=nothing/here", "--count=5", f"--out={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "matches no registered domain" in bad.stderr
  assert "Traceback" not in bad.stderr


def test_policy_tools_refuse_a_reward_model_config(tmp_path, pair_files):
  from posttrain import evaluation, trainer
  config = _config(pair_files)
  with pytest.raises(ValueError, match="trains no policy"):
    trainer.Trainer(config, str(tmp_path / "run"))
  with pytest.raises(ValueError, match="eval_rm"):
    evaluation.evaluate_checkpoint(config, str(tmp_path / "run"))
  config.objective = "policy"
  with pytest.raises(ValueError, match="needs objective=reward_model"):
    reward_trainer.RewardModelTrainer(config, str(tmp_path / "run"))


@pytest.mark.slow
def test_heldout_accuracy_per_domain_is_each_pairs_own_scores(tmp_path, pair_files):
  """An untrained model: each held-out pair scored alone (its two sequences, the score
  head at their last token) decides its domain's accuracy."""
  t = reward_trainer.RewardModelTrainer(_config(pair_files, **{"rm.steps": 1}),
                                        str(tmp_path / "run"))
  report = t.heldout()
  model = t._model()
  right = {}
  for pair in t.eval_data.examples:
    scores = []
    for side in ("chosen", "rejected"):
      seq = np.concatenate([pair["prompt_tokens"], pair[f"{side}_tokens"]])[None]
      scores.append(float(model.scores(seq.astype(np.int32))[0]))
    right.setdefault(pair["domain"], []).append(scores[0] > scores[1])
  assert set(right) == {"short", "long"}
  for domain, outcomes in right.items():
    np.testing.assert_allclose(report[f"accuracy/{domain}"], np.mean(outcomes))
  overall = np.mean([o for v in right.values() for o in v])
  assert 0.0 < overall < 1.0  # the check means something
  np.testing.assert_allclose(report["rewards/accuracy"], overall, rtol=1e-6)


def test_the_planner_plans_the_reward_model_update(pair_files):
  """The update alone: the score-head model's params (no vocabulary projection), AdamW,
  two gradients when a step's sequences need several micro-batches; nothing sampled."""
  from posttrain import planner
  untied = {"model.overrides.tie_embeddings": False}  # the policy has a projection to drop
  config = _config(pair_files, **untied)
  p = planner.plan(config, num_devices=8, device_memory_gb=16)
  policy = _config(pair_files, objective="policy", **untied)
  cfg = reward_trainer.reward_model_config(config)
  assert not cfg.lm_head and cfg.value_head
  params, opt = planner.state_bytes(cfg, p.mesh, clip=True)
  assert (p["params"], p["optimizer"]) == (params, opt)
  policy_params = planner.state_bytes(experiment.model_config(policy), p.mesh)[0]
  shards = p.mesh["fsdp"] * p.mesh["data"]
  assert policy_params - params == pytest.approx(cfg.vocab_size * cfg.d_model * 4 / shards,
                                                 rel=0.02)
  assert p["gradients"] == 2 * params  # 2 x 16 sequences a step in rows of 8
  assert p["sampler"] == p["kv_cache"] == p.rollout_peak == 0
  assert p.peak == sum(p[k] for k in ("params", "optimizer", "gradients", "activations",
                                      "batch"))
  assert p.fits and "reward model training" in planner.format_plan(p)
  one = planner.plan(_config(pair_files, **untied, **{"rm.batch_size": 4}), num_devices=8)
  assert one["gradients"] == params  # 8 sequences fit one micro-batch of 8 rows
