"""The trainer end to end: a few RL steps, resume after kill -9, bitwise resume, SIGTERM,
torn checkpoints, a different mesh on restore, and one-line errors from the launcher."""

import copy
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import default
from posttrain import experiment, planner, trainer
from posttrain.rl import presets
from posttrain.rl import train_step as ts
from posttrain.metrics import read_metrics
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small enough that a run compiles and finishes in seconds on 2 cores.
OVERRIDES = {
    "model.overrides.num_layers": 1, "model.overrides.d_model": 32,
    "model.overrides.ffn_dim": 64, "sft.steps": 2, "sft.batch_size": 8,
    "train.rl_steps": 3, "train.rows_per_microbatch": 8, "train.row_len": 128,
    "rollout.prompts_per_step": 4, "rollout.max_new_tokens": 8, "rollout.max_len": 128,
    "rl.group_size": 4, "eval.seeds_per_domain": 1, "checkpoint.every": 1,
    "checkpoint.async_save": False, "tasks.domains": "arithmetic/add_d1,strings/copy_l1",
    "tasks.levels": "1",
}


def _config(**extra):
  return planner.override(default.get_config(), {**OVERRIDES, **extra})


def _flags(**extra):
  return [f"--config.{k}={v}" for k, v in {**OVERRIDES, **extra}.items()]


def _launch(workdir, *args, **kwargs):
  cmd = [sys.executable, "-m", "launch.train", f"--config={ROOT}/configs/default.py",
         f"--workdir={workdir}", *args]
  env = {**os.environ, "XLA_FLAGS": xla_flags(8),
         "JAX_PLATFORMS": "cpu"}
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, **kwargs)


def _assert_export_is_the_policy(workdir, cfg_extra, params):
  """The model export_hf wrote to WORKDIR/hf computes what `params` (a checkpoint's) do."""
  from flax import nnx

  from posttrain import models
  model = models.create_model(trainer.model_config(_config(**cfg_extra)))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(params))
  nnx.update(model, state)
  exported = models.from_pretrained(str(workdir / "hf"))
  tokens = np.arange(1, 25, dtype=np.int32).reshape(2, 12)
  np.testing.assert_allclose(exported(tokens), model(tokens), atol=1e-4)
  return exported


def _final_params(workdir, cfg_extra=None):
  """Params of the newest checkpoint, on one device, as numpy."""
  c = _config(**(cfg_extra or {}))
  model_cfg = trainer.model_config(c)
  from posttrain.checkpoint import CheckpointManager
  from posttrain.models import make_mesh
  mesh = make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  abstract = experiment.abstract_checkpoint(model_cfg, experiment.optimizer_like(c), mesh, ())
  state, extras, step = CheckpointManager(os.path.join(workdir, "checkpoints"),
                                          read_only=True).restore(abstract)
  return jax.tree.map(np.asarray, state["params"]), extras, step


@pytest.mark.slow
@pytest.mark.parametrize("scan_before,scan_now", [(False, True), (True, False)])
def test_init_from_an_earlier_run_in_either_layout_of_the_layers(tmp_path, scan_before,
                                                                  scan_now):
  """init_from a checkpoint of a run whose scan_layers differs takes its params, relaid
  out; init_from a Hugging Face folder takes scan_layers from the overrides."""
  from flax import nnx

  from posttrain import models
  from posttrain.checkpoint import CheckpointManager
  from posttrain.rl import state as state_lib
  before = _config(**{"model.overrides.num_layers": 2, "model.overrides.scan_layers": scan_before})
  now = _config(**{"model.overrides.num_layers": 2, "model.overrides.scan_layers": scan_now,
                   "init_from": str(tmp_path)})
  mesh = models.make_mesh((1, 2, 1, 1), devices=jax.devices()[:2])
  saved = models.create_model(trainer.model_config(before), seed=5)
  optimizer = experiment.optimizer_like(before)
  state = state_lib.init_train_state(saved, optimizer, mesh=mesh)
  with CheckpointManager(str(tmp_path / "checkpoints")) as manager:
    manager.save(3, experiment.to_checkpoint(state), {}, force=True)
  cfg = trainer.model_config(now)
  loaded = experiment.initial_model(now, cfg, mesh, models.DEFAULT_RULES)
  assert loaded.cfg.scan_layers == scan_now
  want = models.relayout(saved, scan_layers=scan_now)
  got_params, want_params = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (loaded, want))
  for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  models.save_pretrained(saved, str(tmp_path / "hf"))
  now.init_from = str(tmp_path / "hf")
  from_hf = experiment.initial_model(now, cfg, mesh, models.DEFAULT_RULES)
  assert from_hf.cfg.scan_layers == scan_now
  np.testing.assert_array_equal(np.asarray(nnx.state(from_hf, nnx.Param)["embed"][...]),
                                np.asarray(saved.embed[...]))


def test_few_step_rl_run_end_to_end(tmp_path, capsys):
  summary = trainer.train(_config(), str(tmp_path))
  assert summary["status"] == "done" and summary["rl_steps"] == 3
  rows = read_metrics(str(tmp_path))
  # The SFT nll comes from the step's own log-probs: a fresh policy's is about ln(vocab).
  sft_rows = [r for r in rows if "sft/nll" in r]
  assert len(sft_rows) == 2
  vocab = trainer.model_config(_config()).vocab_size
  assert abs(sft_rows[0]["sft/nll"] - np.log(vocab)) < 0.3, (sft_rows[0], vocab)
  rl_rows = [r for r in rows if "reward/mean" in r]
  assert len(rl_rows) == 3
  for key in ("reward/mean", "response_length/mean", "kl", "entropy", "grad_norm",
              "learning_rate", "timing/rollout_s", "timing/update_s",
              "throughput/tokens_per_s", "staleness/mean", "clip_fraction/high"):
    assert key in rl_rows[-1], key
  assert any(k.startswith("reward/arithmetic/") for k in rl_rows[-1])
  # The process's CPU seconds in a step: positive, and at most every core for the step.
  for r in rl_rows:
    assert 0 < r["host/cpu_s"] <= os.cpu_count() * r["timing/step_s"] + 0.05, r
  assert os.listdir(tmp_path / "tb")
  ev = json.loads((tmp_path / "summary.json").read_text())["eval"]
  assert ev["final"]["samples"] == 2 and len(ev["final"]["tasks"]) == 2
  # The SFT -> RL change pairs the two evaluations' tasks and agrees with their rates.
  change = ev["change"]
  assert change["tasks"] == 2
  assert change["greedy"]["difference"] == pytest.approx(
      ev["final"]["pass_rate"] - ev["sft"]["pass_rate"], abs=1e-6)
  assert change["pass@1"]["difference"] == pytest.approx(
      ev["final"]["sampled"]["pass_rate"] - ev["sft"]["sampled"]["pass_rate"], abs=1e-6)
  assert "RL - SFT over 2 paired held-out tasks, 95% interval: pass@1 " in capsys.readouterr().out
  # Running again in a finished workdir resumes at the end and does no more steps.
  again = trainer.train(_config(), str(tmp_path))
  assert again["rl_steps"] == 3 and len([r for r in read_metrics(str(tmp_path))
                                         if "reward/mean" in r]) == 3


@pytest.mark.parametrize("preset", ["kl_cov", "clip_cov"])
def test_covariance_algorithms_get_old_logprobs_even_with_one_update(preset):
  """clip_cov / kl_cov select their tokens from the learner's log-probs before the update:
  the trainer computes them for a single update per batch too (GRPO does not)."""
  import types
  for name, wanted in ((preset, True), ("grpo", False)):
    algo = presets.algorithm_config(name, num_minibatches=1, kl_coef=0.0)
    fake = types.SimpleNamespace(
        algo=algo, _updates_per_step=lambda: 1, state=types.SimpleNamespace(params=None),
        _logprobs=lambda params, batch, with_entropy=False: {"logprobs": "learner's"},
        _reference_in_step=lambda: False, _kl_coef=lambda: 0.0, teacher_path="", rl_teacher=False)
    out = trainer.Trainer._add_learner_inputs(fake, {"tokens": np.zeros((1, 2, 8))})
    assert (out.get("old_logprobs") == "learner's") is wanted, name


@pytest.mark.slow
def test_covariance_algorithm_runs_and_logs_its_selected_share(tmp_path):
  """A kl_cov run with one update per batch: the step gets the learner's log-probs and
  logs the selected share."""
  extra = {"algorithm": "kl_cov", "rl.num_minibatches": 1, "rl.cov_fraction": 0.05,
           "sft.steps": 0, "train.rl_steps": 1}
  assert trainer.train(_config(**extra), str(tmp_path))["status"] == "done"
  row = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r][-1]
  assert 0 < row["cov/selected_fraction"] <= 0.05 + 1e-6, row
  assert np.isfinite(row["kl_cov/abs_log_ratio"]) and np.isfinite(row["loss"])


def test_high_entropy_fraction_gets_old_logprobs_and_entropies_even_with_one_update():
  """top_entropy_fraction < 1 selects tokens by the learner's entropies before the update:
  the trainer computes them with the old log-probs (one pass) for a single update per batch
  too; with the knob off it computes neither."""
  import types
  for fraction, wanted in ((0.2, True), (1.0, False)):
    algo = presets.algorithm_config("grpo", num_minibatches=1, kl_coef=0.0,
                                    top_entropy_fraction=fraction)
    calls = []

    def logprobs(params, batch, with_entropy=False, calls=calls):
      calls.append(with_entropy)
      return {"logprobs": "learner's", **({"entropies": "entropies"} if with_entropy else {})}

    fake = types.SimpleNamespace(
        algo=algo, _updates_per_step=lambda: 1, state=types.SimpleNamespace(params=None),
        _logprobs=logprobs, _reference_in_step=lambda: False, _kl_coef=lambda: 0.0,
        teacher_path="", rl_teacher=False)
    out = trainer.Trainer._add_learner_inputs(fake, {"tokens": np.zeros((1, 2, 8))})
    assert calls == ([True] if wanted else []), fraction
    assert (out.get("old_logprobs") == "learner's") is wanted, fraction
    assert (out.get("old_entropies") == "entropies") is wanted, fraction


@pytest.mark.slow
def test_high_entropy_run_logs_its_selected_share(tmp_path):
  """A GRPO run keeping the top 20% of tokens by entropy: the step gets the learner's
  entropies and logs a selected share of 20% (up to one token)."""
  extra = {"rl.top_entropy_fraction": 0.2, "sft.steps": 0, "train.rl_steps": 1}
  assert trainer.train(_config(**extra), str(tmp_path))["status"] == "done"
  row = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r][-1]
  assert 0.2 - 1e-6 <= row["entropy/selected_fraction"] <= 0.2 + 1 / row["tokens"] + 1e-6, row
  assert row["entropy/threshold"] > 0 and np.isfinite(row["loss"]), row


@pytest.mark.slow
def test_kl_reference_survives_retention_and_resume(tmp_path):
  """With a KL term the RL-start checkpoint (the reference) is kept past keep_last, so
  a resumed run rebuilds the same reference."""
  extra = {"rl.kl_coef": 0.1, "checkpoint.keep_last": 1, "train.rl_steps": 2}
  assert trainer.train(_config(**extra), str(tmp_path))["status"] == "done"
  steps = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert steps == [2, 4]  # sft end / RL start (pinned) and the newest
  resumed = trainer.train(_config(**{**extra, "train.rl_steps": 3}), str(tmp_path))
  assert resumed["status"] == "done" and resumed["rl_steps"] == 3
  rl_rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rl_rows) == 3 and np.isfinite(rl_rows[-1]["kl"])


ADAPTIVE_KL = {"rl.kl_coef": 0.1, "rl.kl_controller": "adaptive", "rl.kl_target": 1e-7,
               "rl.kl_horizon": 32, "rl.entropy_coef": 0.5, "train.rl_steps": 4,
               "eval.seeds_per_domain": 0}


def _kl_rows(workdir):
  return [(r["kl/coef"], r["kl/controlled"]) for r in read_metrics(str(workdir))
          if "reward/mean" in r]


def _assert_adaptive_kl_sequence(rows, first, target, horizon, sequences):
  """Each step's coefficient is the controller's update of the last by the last's KL."""
  coef = first
  for used, kl in rows:
    assert used == pytest.approx(coef, rel=1e-12)
    error = np.clip(kl / target - 1, -0.2, 0.2)
    coef = coef * (1 + error * sequences / horizon)


@pytest.mark.parametrize("algorithm", [
    "grpo",  # a KL loss term
    pytest.param("reinforce_pp", marks=pytest.mark.slow),  # the KL in the token rewards
])
def test_adaptive_kl_controller_moves_the_coefficient_and_resumes_it(tmp_path, algorithm):
  """rl.kl_controller=adaptive: each step uses the coefficient the controller set from the
  step before's KL (the entropy bonus moves the policy away from the reference, past the
  tiny target: the coefficient falls while the KL is 0, then grows); a run cut after 2
  steps resumes with the same coefficient and KL."""
  config = {**ADAPTIVE_KL, "algorithm": algorithm}
  assert trainer.train(_config(**config), str(tmp_path / "straight"))["status"] == "done"
  straight = _kl_rows(tmp_path / "straight")
  assert len(straight) == 4
  _assert_adaptive_kl_sequence(straight, 0.1, 1e-7, 32, sequences=16)
  coefs = [c for c, _ in straight]
  assert coefs[1] < coefs[0], straight
  if algorithm == "grpo":
    assert coefs[-1] > coefs[-2], straight  # both ways
  assert any(kl > 1e-7 for _, kl in straight), straight
  cut = {**config, "train.rl_steps": 2}
  assert trainer.train(_config(**cut), str(tmp_path / "cut"))["status"] == "done"
  assert trainer.train(_config(**config), str(tmp_path / "cut"))["rl_steps"] == 4
  assert _kl_rows(tmp_path / "cut") == straight


@pytest.mark.slow
def test_dynamic_sampling_trains_only_on_groups_whose_rewards_differ(tmp_path, monkeypatch):
  """DAPO dynamic sampling in the trainer: all-equal groups are dropped and replaced by new
  draws until the step's prompts are full, and the scheduler learns only from kept groups."""
  from posttrain.rollout import worker as worker_lib
  from posttrain.tasks import Reward, scheduler as scheduler_lib
  # A reward the untrained policy varies on: the parity of the completion's length.
  monkeypatch.setattr(worker_lib, "_score", lambda task, sample: Reward(
      value=float(len(sample.text) % 2), components={}, verdict=""))
  seen = []
  update = scheduler_lib.Scheduler.update

  def spy(self, domain, rewards, advantages=None, **kwargs):
    seen.append(list(rewards))
    return update(self, domain, rewards, advantages, **kwargs)

  monkeypatch.setattr(scheduler_lib.Scheduler, "update", spy)
  summary = trainer.train(_config(**{"rl.dynamic_sampling": True, "rl.group_size": 2,
                                     "train.rl_steps": 3}), str(tmp_path))
  assert summary["status"] == "done"
  rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rows) == 3
  for r in rows:
    # 4 prompts kept per step; groups of 2 agree half the time, so some were replaced.
    assert r["dynamic_sampling/draws"] - r["dynamic_sampling/dropped"] == 4, r
  assert sum(r["dynamic_sampling/dropped"] for r in rows) > 0
  assert len(seen) == 12 and all(len(set(g)) == 2 for g in seen)
  # Every kept group has one pass and one fail: the batch's pass rate is exactly 1/2.
  assert all(r["pass_rate/mean"] == 0.5 for r in rows)


def test_overlong_filtering_trains_no_token_of_a_sample_that_never_ended(tmp_path,
                                                                         monkeypatch):
  """rl.mask_truncated: a sample cut off at max_new_tokens keeps its reward (the group's
  advantages see it) but none of its tokens is trained; a step of only such samples
  updates nothing and stays finite. The truncated share is logged either way."""
  seen = []
  to_batch = trainer._to_batch

  def spy(trajectories, **kw):
    seen.append([(t["response_tokens"].copy(), t["response_mask"].copy())
                 for t in trajectories])
    return to_batch(trajectories, **kw)

  monkeypatch.setattr(trainer, "_to_batch", spy)
  over = {"rl.mask_truncated": True, "train.rl_steps": 2, "sft.steps": 0,
          "eval.seeds_per_domain": 0}
  assert trainer.train(_config(**over), str(tmp_path / "masked"))["status"] == "done"
  stops = set(trainer.load_tokenizer(_config().tokenizer).stop_ids)
  rows = [r for r in read_metrics(str(tmp_path / "masked")) if "reward/mean" in r]
  assert len(seen) == len(rows) == 2
  for batch, row in zip(seen, rows):
    cut = [int(tokens[-1]) not in stops for tokens, _ in batch]
    assert row["response_length/truncated_fraction"] == pytest.approx(np.mean(cut))
    assert any(cut)  # an untrained policy rarely stops within 8 tokens
    for (tokens, mask), c in zip(batch, cut):
      assert (mask.sum() == 0) == c
    assert np.isfinite(row["grad_norm"])
  seen.clear()
  over["rl.mask_truncated"] = False
  assert trainer.train(_config(**over), str(tmp_path / "kept"))["status"] == "done"
  assert all(mask.sum() > 0 for batch in seen for _, mask in batch)


def test_sft_shards_interleave_into_the_unsharded_stream():
  from posttrain.data.tokenizer import load_tokenizer
  tok, domains = load_tokenizer("byte"), ["arithmetic/add_d1", "strings/copy_l1"]
  whole = [trainer.sft_dataset(domains, tok, 3)[i] for i in range(6)]
  shards = [trainer.sft_dataset(domains, tok, 3, shard=(i, 2)) for i in range(2)]
  interleaved = [shards[i % 2][i // 2] for i in range(6)]
  for a, b in zip(whole, interleaved):
    assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not np.array_equal(whole[0]["prompt_tokens"], whole[1]["prompt_tokens"])
  with pytest.raises(ValueError, match="shard index 2 is out of range for 2 shards"):
    trainer.sft_dataset(domains, tok, 3, shard=(2, 2))


def test_sft_position_survives_a_change_of_process_count():
  """Saved by 2 processes 3 demonstrations into each shard: 1 process (or 3) resumes at
  the 7th demonstration of the unsharded stream."""
  from posttrain.data.tokenizer import load_tokenizer
  tok, domains = load_tokenizer("byte"), ["arithmetic/add_d1", "strings/copy_l1"]
  whole = [trainer.sft_dataset(domains, tok, 3)[i] for i in range(9)]
  its = [iter(trainer.sft_dataset(domains, tok, 3, shard=(i, 2)).to_iter_dataset())
         for i in range(2)]
  for it in its:
    for _ in range(3):
      next(it)
  saved = {**its[0].get_state(), "shards": 2}
  one = iter(trainer.sft_dataset(domains, tok, 3).to_iter_dataset())
  one.set_state(trainer.sft_iterator_state(saved, 1))
  assert np.array_equal(next(one)["prompt_tokens"], whole[6]["prompt_tokens"])
  three = [iter(trainer.sft_dataset(domains, tok, 3, shard=(i, 3)).to_iter_dataset())
           for i in range(3)]
  for i, it in enumerate(three):
    it.set_state(trainer.sft_iterator_state(saved, 3))
    assert np.array_equal(next(it)["prompt_tokens"], whole[6 + i]["prompt_tokens"])
  # Same count, or a state saved before shards were recorded: unchanged.
  assert trainer.sft_iterator_state(saved, 2) == its[0].get_state()
  assert trainer.sft_iterator_state({"next_index": 5}, 1) == {"next_index": 5}


@pytest.mark.slow
def test_kill_9_then_resume_matches_uninterrupted_run_bitwise(tmp_path):
  """The three launches share a compilation cache (`compile_cache_dir`), as restarts of a
  job would: the later ones load the first one's programs, and still match bitwise."""
  straight, killed, cache = tmp_path / "straight", tmp_path / "killed", tmp_path / "cache"
  flags = _flags(compile_cache_dir=cache)
  proc = _launch(straight, *flags)
  text = proc.communicate(timeout=600)[0]
  assert proc.returncode == 0, text
  assert f"compilation cache: {cache}" in text and len(os.listdir(cache)) > 10
  proc = _launch(killed, *flags)
  # Kill -9 once the first RL step has been checkpointed (sft 2 + rl 1 = step 3).
  deadline = time.time() + 600
  while not (killed / "checkpoints" / "3").exists():
    assert proc.poll() is None, proc.stdout.read()
    assert time.time() < deadline
    time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  out = _launch(killed, *flags)
  text = out.communicate(timeout=600)[0]
  assert out.returncode == 0, text
  assert "resumed from checkpoint" in text
  a, extras_a, step_a = _final_params(straight)
  b, extras_b, step_b = _final_params(killed)
  assert step_a == step_b == 5 and extras_b["progress"]["rl_step"] == 3
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path):
  proc = _launch(tmp_path, *_flags(**{"train.rl_steps": 50, "checkpoint.every": 1000}))
  deadline = time.time() + 600
  while not any("reward/mean" in r for r in read_metrics(str(tmp_path))):
    assert proc.poll() is None and time.time() < deadline
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=300) == 0
  steps = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
  assert steps and max(steps) >= 3  # sft (2) + at least one RL step, saved on SIGTERM


def test_torn_checkpoint_is_skipped_and_different_mesh_restores(tmp_path):
  trainer.train(_config(**{"train.rl_steps": 2, "mesh.fsdp": 8}), str(tmp_path))
  ckpts = tmp_path / "checkpoints"
  newest = max(int(d) for d in os.listdir(ckpts) if d.isdigit())
  # Tear the newest checkpoint: truncate every data file in it.
  for root, _, files in os.walk(ckpts / str(newest) / "state"):
    for f in files:
      open(os.path.join(root, f), "w").close()
  t = trainer.Trainer(_config(**{"train.rl_steps": 2, "mesh.fsdp": 2, "mesh.tensor": 4}),
                      str(tmp_path))
  try:
    assert t.resumed_from == newest - 1
    spec = t.state.params["layers"][0]["mlp"]["up_proj"].value.sharding.spec
    assert tuple(spec) == ("fsdp", "tensor")
  finally:
    t.worker.close()
    t.ckpt.close()


def test_url_workdir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError,
                     match=r"workdir 'gs://bucket/run' is a URL; .*mount the bucket \(gcsfuse"):
    trainer.Trainer(_config(), "gs://bucket/run")
  assert not os.listdir(tmp_path)  # no local "gs:" folder


@pytest.mark.parametrize("override, message", [
    ({"train.rl_steps": -1}, "train.rl_steps=-1 must be >= 0"),
    ({"rollout.max_new_tokens": 0}, "rollout.max_new_tokens=0 must be >= 1"),
    ({"optim.lr": 0.0}, "optim.lr=0.0 must be > 0"),
    ({"optim.lr": float("nan")}, "optim.lr=nan must be >= 0.0"),
    ({"rollout.top_p": 1.5}, r"rollout.top_p=1.5 must be in \[0, 1\]"),
    ({"rollout.max_new_tokens": 128}, "rollout.max_new_tokens=128 leaves no room for a prompt"),
    ({"checkpoint.every": 0}, "checkpoint.every=0 must be >= 1"),
    ({"compile_cache_min_secs": -1.0}, "compile_cache_min_secs=-1.0 must be >= 0.0"),
])
def test_out_of_range_config_fails_before_anything_is_built(tmp_path, override, message):
  with pytest.raises(ValueError, match=message):
    trainer.Trainer(_config(**override), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_range_check_names_wrong_types_a_config_file_can_hold():
  import ml_collections
  # A config file is Python: its fields can hold what a flag override could not.
  for fields, message in [({"train": {"row_len": 2.5}}, "train.row_len=2.5 must be a whole"),
                          ({"sft": {"steps": "many"}}, "sft.steps='many' is not an int"),
                          ({"optim": {"lr": None}}, None)]:
    c = ml_collections.ConfigDict(fields)
    if message is None:
      experiment.check_config(c)  # absent (None) fields are the defaults: skipped
    else:
      with pytest.raises(ValueError, match=message):
        experiment.check_config(c)


def test_data_cache_dir_is_the_workdirs_unless_given_or_turned_off(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  assert experiment.data_cache_dir(_config(), "/runs/a") == "/runs/a/data_cache"
  assert experiment.data_cache_dir(_config(data_cache_dir="none"), "/runs/a") is None
  assert experiment.data_cache_dir(_config(data_cache_dir="~/tok"), "/runs/a") == str(
      tmp_path / "tok")
  with pytest.raises(ValueError, match="data_cache_dir='gs://b/c' is a URL"):
    experiment.data_cache_dir(_config(data_cache_dir="gs://b/c"), "/runs/a")


def test_every_shipped_config_passes_the_range_check():
  import importlib
  names = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.endswith(".py") and not f.startswith("_"))
  assert "default" in names and len(names) >= 7
  for name in names:
    experiment.check_config(importlib.import_module(f"configs.{name}").get_config())


@pytest.mark.slow
def test_launcher_errors_are_one_line(tmp_path):
  proc = _launch(tmp_path, "--config.no_such_key=1")
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode != 0 and "no_such_key" in out and "Traceback" not in out
  proc = _launch(tmp_path, "--config.model.overrides.no_such_field=1")  # a nested dict's
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == 2 and "error: unknown config key 'no_such_field'" in out
  proc = _launch(tmp_path, "--config.mesh.fsdp=3")
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == 2 and "error: mesh shape (1, 3, 1, 1) needs 3 devices" in out
  assert "Traceback" not in out
  (tmp_path / "file").write_text("")  # a cache directory that cannot be made
  proc = _launch(tmp_path, f"--config.compile_cache_dir={tmp_path / 'file' / 'cache'}")
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == 2 and "Not a directory" in out and "Traceback" not in out


@pytest.mark.parametrize("preset,overrides,fused", [
    ("grpo", {}, True),                              # KL loss term, one update per batch
    ("grpo", {"kl_coef": 0.0}, False),               # no reference at all
    ("grpo", {"ppo_epochs": 2}, False),              # computed once for both epochs instead
    ("ppo", {}, False),                              # KL in the reward, before GAE
    ("reinforce_pp", {}, False),
])
def test_reference_pass_runs_in_the_update_only_for_a_single_kl_loss_update(
    preset, overrides, fused):
  assert ts.reference_in_step(presets.algorithm_config(preset, **overrides)) is fused


@pytest.mark.parametrize("estimator", ["opo", "reinforce_pp_baseline", "grpo", "rloo", "gpg",
                                       "grpo_passk"])
def test_sequence_advantages_read_each_groups_rewards_and_response_lengths(estimator):
  """The trainer hands the length-weighted estimators each sample's trained-token count and
  splits the advantages back per group."""
  import types

  from posttrain.rl import advantages as adv_lib
  algo = presets.algorithm_config("grpo", advantage_estimator=estimator)
  rng = np.random.default_rng(0)
  rewards = [rng.normal(size=4), rng.normal(size=3)]
  lengths = [rng.integers(1, 30, 4), rng.integers(1, 30, 3)]
  groups = [types.SimpleNamespace(samples=[types.SimpleNamespace(num_generated=int(n))
                                           for n in ls]) for ls in lengths]
  got = trainer.Trainer._sequence_advantages(types.SimpleNamespace(algo=algo), rewards, groups)
  flat = np.concatenate(rewards).astype(np.float32)
  ids = np.repeat([0, 1], [4, 3])
  fn = adv_lib.get_advantage_estimator(estimator)
  if estimator in adv_lib.LENGTH_WEIGHTED_ESTIMATORS:
    want = fn(flat, np.concatenate(lengths), ids)
  elif estimator == "rloo":
    want = fn(flat, ids)
  else:  # the preset's normalize_std reaches the group-normalising estimators
    want = fn(flat, ids, normalize_std=algo.normalize_std)
  assert [len(a) for a in got] == [4, 3]
  np.testing.assert_allclose(np.concatenate(got), want, atol=1e-6)


LORA = {"model.overrides.lora_rank": 4, "model.overrides.lora_alpha": 8.0}


@pytest.mark.slow
def test_lora_run_folds_sft_into_the_base_and_exports_the_merged_policy(tmp_path):
  """SFT then RL with LoRA adapters: RL starts on fresh adapters over a base that holds
  SFT's (so its first KL to the base is 0), and export_hf writes the adapted policy
  merged into plain Hugging Face weights."""
  from flax import nnx

  extra = {**LORA, "rl.kl_coef": 0.1, "train.rl_steps": 2, "export_hf": str(tmp_path / "hf"),
           "eval.seeds_per_domain": 0}
  assert trainer.train(_config(**extra), str(tmp_path))["status"] == "done"
  rl_rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rl_rows) == 2 and rl_rows[0]["kl"] == 0.0
  params, _, step = _final_params(str(tmp_path), extra)
  assert step == 4
  exported = _assert_export_is_the_policy(tmp_path, extra, params)
  assert exported.cfg.lora_rank == 0
  # Its final adapters alone are RL's: over the starting weights they would drop SFT's.
  from posttrain.export import export_checkpoint
  with pytest.raises(ValueError, match=r"past this run's SFT \(2 steps\) stage"):
    export_checkpoint(_config(**extra), str(tmp_path), str(tmp_path / "a"), adapter=True)
  # Resuming restores the adapters' optimizer state and goes on from the same base.
  again = trainer.train(_config(**{**extra, "train.rl_steps": 3}), str(tmp_path))
  assert again["status"] == "done" and again["rl_steps"] == 3
  resumed, _, _ = _final_params(str(tmp_path), extra)
  frozen = lambda p: jax.tree.leaves(nnx.split_state(p, nnx.LoRAParam, ...)[1])  # noqa: E731
  for a, b in zip(frozen(params), frozen(resumed), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_qlora_run_from_a_folder_trains_resumes_and_exports_merged(tmp_path):
  """RL through adapters on an NF4 base read from a Hugging Face folder: the colocated
  sampler holds the learner's codes uncopied, the base comes back bit for bit, a resumed
  run goes on from the same codes, export_hf writes the dequantized base merged with the
  adapters; a run whose SFT would fold adapters into the quantized base is refused
  before anything is built."""
  from flax import nnx

  from posttrain import models
  from posttrain.models import quant
  from posttrain.rl import state as state_lib
  folder = str(tmp_path / "base")
  plain = trainer.model_config(_config())
  models.save_pretrained(models.create_model(plain, seed=3), folder)
  extra = {**LORA, "model.overrides.base_quantization": "nf4", "init_from": folder,
           "sft.steps": 0, "train.rl_steps": 2, "export_hf": str(tmp_path / "hf"),
           "rl.kl_coef": 0.1, "eval.seeds_per_domain": 0}
  with pytest.raises(ValueError, match=r"sft.steps=2, preference.steps=0, train.rl_steps=2: "
                     "base_quantization='nf4': adapters cannot be folded"):
    trainer.Trainer(_config(**{**extra, "sft.steps": 2}), str(tmp_path / "refused"))
  run = str(tmp_path / "run")
  t = trainer.Trainer(_config(**extra), run)
  codes = [x for x in jax.tree.leaves(state_lib.split_trainable(t.state.params)[1])
           if x.dtype == np.uint8]
  assert len(codes) == 7  # the layer's 4 attention and 3 MLP projections
  held = {id(x) for x in jax.tree.leaves(t.sampler._state)}
  assert all(id(x) in held for x in codes)
  t.writer.close()
  assert trainer.train(_config(**extra), run)["status"] == "done"
  rows = [r for r in read_metrics(run) if "reward/mean" in r]
  assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
  params, _, step = _final_params(run, extra)
  assert step == 2
  base = models.from_pretrained(folder, lora_rank=4, lora_alpha=8.0, base_quantization="nf4")
  frozen = lambda p: jax.tree.leaves(nnx.split_state(p, nnx.LoRAParam, ...)[1])  # noqa: E731
  for a, b in zip(frozen(nnx.state(base, nnx.Param)), frozen(params), strict=True):
    np.testing.assert_array_equal(a, b)
  exported = _assert_export_is_the_policy(tmp_path, extra, params)
  assert exported.cfg.lora_rank == 0 and exported.cfg.base_quantization == ""
  assert not any(isinstance(v, quant.QuantizedParam)
                 for _, v in nnx.to_flat_state(nnx.state(exported)))
  again = trainer.train(_config(**{**extra, "train.rl_steps": 3}), run)
  assert again["status"] == "done" and again["rl_steps"] == 3
  resumed, _, _ = _final_params(run, extra)
  for a, b in zip(frozen(params), frozen(resumed), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_an_sft_qlora_run_exports_its_adapter_and_its_merged_weights_alike(tmp_path):
  """SFT alone on an int8 base: the PEFT adapter export, loaded back onto the quantized
  base, computes what the merged export (the dequantized base plus the adapters) does."""
  from posttrain import models
  from posttrain.export import export_checkpoint
  folder = str(tmp_path / "base")
  models.save_pretrained(models.create_model(trainer.model_config(_config()), seed=3), folder)
  c = _config(**{**LORA, "model.overrides.base_quantization": "int8", "init_from": folder,
                 "sft.steps": 2, "train.rl_steps": 0, "eval.seeds_per_domain": 0})
  run = str(tmp_path / "run")
  assert trainer.train(c, run)["status"] == "done"
  assert export_checkpoint(c, run, str(tmp_path / "adapter"), adapter=True)["adapter"]
  assert not export_checkpoint(c, run, str(tmp_path / "merged"))["adapter"]
  adapted = models.from_pretrained(folder, adapter=str(tmp_path / "adapter"),
                                   base_quantization="int8")
  merged = models.from_pretrained(str(tmp_path / "merged"))
  tokens = np.arange(1, 25, dtype=np.int32).reshape(2, 12)
  np.testing.assert_allclose(merged(tokens), adapted(tokens), atol=1e-5)
  base = models.from_pretrained(folder, lora_rank=4, lora_alpha=8.0, base_quantization="int8")
  assert np.abs(np.asarray(base(tokens)) - np.asarray(adapted(tokens))).max() > 1e-4  # SFT's


@pytest.mark.slow
def test_init_from_a_run_without_adapters_puts_fresh_ones_on_its_weights(tmp_path):
  from flax import nnx

  from posttrain import models
  from posttrain.checkpoint import CheckpointManager
  from posttrain.rl import state as state_lib
  before, now = _config(), _config(**LORA, init_from=str(tmp_path))
  mesh = models.make_mesh((1, 2, 1, 1), devices=jax.devices()[:2])
  saved = models.create_model(trainer.model_config(before), seed=5)
  state = state_lib.init_train_state(saved, experiment.optimizer_like(before), mesh=mesh)
  with CheckpointManager(str(tmp_path / "checkpoints")) as manager:
    manager.save(3, experiment.to_checkpoint(state), {}, force=True)
  loaded = experiment.initial_model(now, trainer.model_config(now), mesh,
                                      models.DEFAULT_RULES)
  assert loaded.cfg.lora_rank == 4 and nnx.state(loaded, nnx.LoRAParam)
  tokens = np.arange(1, 25, dtype=np.int32).reshape(2, 12)
  np.testing.assert_allclose(loaded(tokens), saved(tokens), atol=1e-5)


def _train_two_rl_steps_and_export(tmp_path, model_overrides):
  """SFT then two RL steps with export_hf: (final params, the exported model), after
  checking both steps' gradients are finite and the export computes the policy."""
  extra = {**model_overrides, "train.rl_steps": 2, "export_hf": str(tmp_path / "hf"),
           "eval.seeds_per_domain": 0}
  assert trainer.train(_config(**extra), str(tmp_path))["status"] == "done"
  rl_rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rl_rows) == 2 and all(np.isfinite(r["grad_norm"]) for r in rl_rows)
  params, _, _ = _final_params(str(tmp_path), extra)
  return params, _assert_export_is_the_policy(tmp_path, extra, params)


MOE = {"model.overrides.num_experts": 4, "model.overrides.num_experts_per_tok": 2,
       "model.overrides.architecture": "MixtralForCausalLM"}


@pytest.mark.slow
def test_mixture_of_experts_run_trains_and_exports_per_expert_files(tmp_path):
  """SFT then RL on a mixture-of-experts policy over the 8-device mesh; export_hf writes
  Mixtral files that load back as the trained policy."""
  params, exported = _train_two_rl_steps_and_export(tmp_path, MOE)
  assert params["layers"][0]["mlp"]["gate_proj"].shape == (4, 32, 64)
  assert exported.cfg.num_experts == 4 and exported.cfg.architecture == "MixtralForCausalLM"


@pytest.mark.parametrize("mode", ["old", "rollout"])
def test_routing_replay_hands_the_old_policys_experts_to_every_update(tmp_path, monkeypatch,
                                                                      mode):
  """rl.routing_replay on a mixture: the old log-probs' pass (old) or the sampler
  (rollout) records each token's experts and the updates (two minibatches) get them with
  the batch; a dense model refuses it before anything runs."""
  seen = []
  real = trainer.ts.ppo_update

  def ppo_update(step, state, batch, **kw):
    seen.append((np.shape(batch["tokens"]), np.asarray(batch["routing"])))
    return real(step, state, batch, **kw)

  monkeypatch.setattr(trainer.ts, "ppo_update", ppo_update)
  extra = {**MOE, "sft.steps": 0, "train.rl_steps": 1, "eval.seeds_per_domain": 0,
           "rl.routing_replay": mode, "rl.num_minibatches": 2}
  assert trainer.train(_config(**extra), str(tmp_path))["status"] == "done"
  (shape, routing), = seen
  assert routing.shape == shape + (1, 2) and routing.dtype == np.uint8
  assert 0 <= routing.min() and routing.max() < 4 and len(np.unique(routing)) > 1
  rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rows) == 1 and np.isfinite(rows[0]["grad_norm"])
  # The learner's own routing against the replayed, where its trained tokens are.
  assert 0 <= rows[0]["routing/mismatch"] < 0.05
  with pytest.raises(ValueError, match=rf"rl.routing_replay='{mode}' replays a mixture's "
                                       r"experts; this model \(LlamaForCausalLM\) has none"):
    trainer.train(_config(**{"rl.routing_replay": mode, "rl.num_minibatches": 2}),
                  str(tmp_path / "dense"))



def test_an_export_the_architecture_cannot_hold_fails_first(tmp_path):
  extra = {**MOE, "model.overrides.architecture": "LlamaForCausalLM",
           "export_hf": str(tmp_path / "hf")}
  with pytest.raises(ValueError, match="a mixture of experts is written as one of"):
    trainer.train(_config(**extra), str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _sft_file_config(tmp_path, **extra):
  words = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "peach", "grape", "melon",
           "mango", "guava"]
  train = _write_jsonl(tmp_path / "train.jsonl",
                       [{"prompt": f"Repeat: {w}", "completion": w} for w in words[:10]] +
                       [{"messages": [{"role": "user", "content": "Say hi"},
                                      {"role": "assistant", "content": "hi"},
                                      {"role": "user", "content": "Again"},
                                      {"role": "assistant", "content": "hi"}]}])
  held = _write_jsonl(tmp_path / "heldout.jsonl",
                      [{"prompt": f"Repeat: {w}", "completion": w} for w in words[10:]])
  return _config(**{"sft.data": train, "sft.eval_data": held, "sft.steps": 6,
                    "sft.eval_every": 3, "sft.warmup": 1, "train.rl_steps": 0,
                    "eval.seeds_per_domain": 0,
                    **extra})


def test_sft_on_files_learns_logs_heldout_nll_and_resumes_exactly(tmp_path, monkeypatch,
                                                                   caplog):
  from flax import nnx

  from posttrain import models
  from posttrain.data import ByteTokenizer
  from posttrain.data.sft import SFTData
  caplog.set_level("INFO", logger="posttrain")
  straight = trainer.train(_sft_file_config(tmp_path), str(tmp_path / "straight"))
  # Both files are tokenized into the run's own cache (data_cache_dir="", the default).
  assert len(list((tmp_path / "straight" / "data_cache").glob("sft-*"))) == 2
  rows = read_metrics(str(tmp_path / "straight"))
  nll = [r["sft/nll"] for r in rows if "sft/nll" in r]
  held = [r["eval_sft/nll"] for r in rows if "eval_sft/nll" in r]
  assert len(nll) == 6 and nll[-1] < nll[0] - 0.5  # it learns the file
  assert len(held) == 2 and held[-1] == straight["sft_heldout_nll"]

  # The held-out figure is the mean NLL per trained token of the file, by hand.
  params, _, _ = _final_params(tmp_path / "straight", {"sft.steps": 6, "train.rl_steps": 0})
  model = models.create_model(trainer.model_config(_config()))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(params))
  nnx.update(model, state)
  total = count = 0
  for ex in SFTData.from_files(str(tmp_path / "heldout.jsonl"), ByteTokenizer(),
                               row_len=128).examples:
    tokens = np.concatenate([ex["prompt_tokens"], ex["response_tokens"]])[None]
    logp = jax.nn.log_softmax(np.asarray(model(tokens), np.float64)[0, :-1], axis=-1)
    picked = logp[np.arange(tokens.shape[1] - 1), tokens[0, 1:]][len(ex["prompt_tokens"]) - 1:]
    total -= float(np.sum(picked * ex["response_mask"]))
    count += int(ex["response_mask"].sum())
  np.testing.assert_allclose(straight["sft_heldout_nll"], total / count, rtol=1e-4)

  # Preempted after step 4 and resumed: the same weights, bit for bit, and the data stream
  # picks up where it stopped.
  class StopAt4(trainer.PreemptionFlag):
    def reached(self, step):
      return step == 4 or super().reached(step)

  monkeypatch.setattr(trainer, "PreemptionFlag", StopAt4)
  config = _sft_file_config(tmp_path)  # the files as the preempted run saw them
  assert trainer.train(copy.deepcopy(config), str(tmp_path / "cut"))["status"] == "preempted"
  monkeypatch.undo()
  caplog.clear()
  resumed = trainer.train(config, str(tmp_path / "cut"))
  assert resumed["status"] == "done" and resumed["sft_steps"] == 6
  assert caplog.text.count("SFT data: cache hit") == 2  # the restart tokenizes nothing
  b, _, _ = _final_params(tmp_path / "cut", {"sft.steps": 6, "train.rl_steps": 0})
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert resumed["sft_heldout_nll"] == straight["sft_heldout_nll"]


def test_sft_data_errors_fail_before_anything_is_built(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
  with pytest.raises(ValueError, match=f"^{bad}:2: a row needs"):
    trainer.Trainer(_config(**{"sft.data": str(bad)}), str(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists()


def _pairs_config(tmp_path, **extra):
  words = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "peach", "grape", "melon",
           "mango", "guava", "olive", "lemon"]
  pairs = [{"prompt": f"Repeat: {w}", "chosen": w, "rejected": w[::-1] + "?"} for w in words]
  train = _write_jsonl(tmp_path / "pairs.jsonl", pairs[:10])
  held = _write_jsonl(tmp_path / "heldout_pairs.jsonl", pairs[10:])
  return _config(**{"sft.steps": 0, "preference.steps": 6, "preference.data": train,
                    "preference.eval_data": held, "preference.batch_size": 8,
                    "preference.warmup": 1, "preference.lr": 3e-3, "preference.beta": 0.5,
                    "train.rl_steps": 0, "eval.seeds_per_domain": 0, **extra})


def test_dpo_stage_learns_the_pairs_logs_heldout_metrics_and_resumes_exactly(tmp_path,
                                                                             monkeypatch):
  from flax import nnx

  from posttrain import models
  from posttrain.data import ByteTokenizer
  from posttrain.data.preference import PreferenceData
  straight = trainer.train(_pairs_config(tmp_path), str(tmp_path / "straight"))
  assert straight["status"] == "done" and straight["preference_steps"] == 6
  rows = read_metrics(str(tmp_path / "straight"))
  margin = [r["preference/rewards/margin"] for r in rows if "preference/rewards/margin" in r]
  loss = [r["preference/loss/preference"] for r in rows if "preference/loss/preference" in r]
  assert len(margin) == 6 and margin[0] == 0.0 and abs(loss[0] - np.log(2)) < 1e-5
  assert margin[-1] > 0.1 and loss[-1] < loss[0]  # it learns to prefer the chosen answers
  held = straight["preference_heldout"]
  assert held["pairs"] == 4 and 0 <= held["rewards/accuracy"] <= 1

  # The held-out chosen log-probs are the policy's summed log-probs of each answer.
  params, extras, step = _final_params(tmp_path / "straight", {"sft.steps": 0,
                                                               "train.rl_steps": 0})
  assert step == 6 and extras["progress"]["pref_step"] == 6
  model = models.create_model(trainer.model_config(_config()))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(params))
  nnx.update(model, state)
  sums = []
  for pair in PreferenceData.from_files(str(tmp_path / "heldout_pairs.jsonl"),
                                        ByteTokenizer(), row_len=128).examples:
    tokens = np.concatenate([pair["prompt_tokens"], pair["chosen_tokens"]])[None]
    logp = jax.nn.log_softmax(np.asarray(model(tokens), np.float64)[0, :-1], axis=-1)
    picked = logp[np.arange(tokens.shape[1] - 1), tokens[0, 1:]][len(pair["prompt_tokens"]) - 1:]
    sums.append(float(np.sum(picked * pair["chosen_mask"])))
  np.testing.assert_allclose(held["logps/chosen"], np.mean(sums), rtol=1e-4)

  # Preempted after step 3: the reference comes back from the stage's first checkpoint and
  # the pair stream from its saved position, so the weights match bit for bit.
  class StopAt3(trainer.PreemptionFlag):
    def reached(self, step):
      return step == 3 or super().reached(step)

  monkeypatch.setattr(trainer, "PreemptionFlag", StopAt3)
  assert trainer.train(_pairs_config(tmp_path, **{"checkpoint.keep_last": 1}),
                       str(tmp_path / "cut"))["status"] == "preempted"
  monkeypatch.undo()
  resumed = trainer.train(_pairs_config(tmp_path, **{"checkpoint.keep_last": 1}),
                          str(tmp_path / "cut"))
  b, _, _ = _final_params(tmp_path / "cut", {"sft.steps": 0, "train.rl_steps": 0})
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert resumed["preference_heldout"] == held


def test_kto_stage_learns_unpaired_labels_and_logs_heldout_metrics(tmp_path):
  """preference.loss=kto on TRL's unpaired rows mixed with pair rows (one example of each
  label): the desirable answers' rewards rise above the undesirable ones', and the
  held-out report's log-probs are the trained model's own."""
  from flax import nnx

  from posttrain import models
  from posttrain.data import ByteTokenizer
  from posttrain.data.preference import UnpairedData
  words = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "peach", "grape", "melon",
           "mango", "guava", "olive", "lemon"]
  rows = []
  for i, w in enumerate(words):
    if i % 2:
      rows.append({"prompt": f"Repeat: {w}", "chosen": w, "rejected": w[::-1] + "?"})
    else:
      rows += [{"prompt": f"Repeat: {w}", "completion": w, "label": True},
               {"prompt": f"Repeat: {w}", "completion": w[::-1] + "?", "label": False}]
  train = _write_jsonl(tmp_path / "feedback.jsonl", rows[:14])
  held = _write_jsonl(tmp_path / "heldout_feedback.jsonl", rows[14:])
  c = _config(**{"sft.steps": 0, "preference.steps": 6, "preference.data": train,
                 "preference.eval_data": held, "preference.batch_size": 8,
                 "preference.warmup": 1, "preference.lr": 3e-3, "preference.beta": 0.5,
                 "preference.loss": "kto", "preference.undesirable_weight": 1.2,
                 "train.rl_steps": 0, "eval.seeds_per_domain": 0})
  summary = trainer.train(c, str(tmp_path / "run"))
  assert summary["status"] == "done" and summary["preference_steps"] == 6
  logged = [r for r in read_metrics(str(tmp_path / "run")) if "preference/kl" in r]
  assert len(logged) == 6 and logged[0]["preference/rewards/margin"] == 0.0
  assert logged[0]["preference/kl"] == 0.0  # the policy is its reference at the start
  # r = 0: each loss is 1/2 times its weight, for some count d of desirable examples.
  first = logged[0]["preference/loss/preference"]
  assert min(abs(first - (0.5 * d + 0.5 * 1.2 * (8 - d)) / 8) for d in range(9)) < 1e-6
  assert logged[-1]["preference/rewards/margin"] > 0.1
  assert logged[-1]["preference/loss/preference"] < logged[0]["preference/loss/preference"]
  report = summary["preference_heldout"]
  data = UnpairedData.from_files(held, ByteTokenizer(), row_len=128)
  held_rows = rows[14:]
  assert report["examples"] == len(data) == sum(1 if "completion" in r else 2 for r in held_rows)
  assert report["desirable"] == sum(1 for r in held_rows if r.get("label", True))
  assert report["rewards/margin"] > 0 and report["kl"] >= 0

  # The held-out desirable log-probs are the final policy's summed log-probs of each answer.
  params, _, _ = _final_params(tmp_path / "run", {"sft.steps": 0, "train.rl_steps": 0})
  model = models.create_model(trainer.model_config(_config()))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(params))
  nnx.update(model, state)
  sums = []
  for example in data.examples:
    if example["label"]:
      tokens = np.concatenate([example["prompt_tokens"], example["completion_tokens"]])[None]
      logp = jax.nn.log_softmax(np.asarray(model(tokens), np.float64)[0, :-1], axis=-1)
      picked = logp[np.arange(tokens.shape[1] - 1),
                    tokens[0, 1:]][len(example["prompt_tokens"]) - 1:]
      sums.append(float(np.sum(picked * example["completion_mask"])))
  np.testing.assert_allclose(report["logps/chosen"], np.mean(sums), rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["orpo", "ipo"])
def test_sft_then_lora_preference_then_rl_with_a_kl_reference(tmp_path, loss):
  """Every stage in one run, LoRA adapters folded into the base between them; the KL
  reference of RL is the policy after the preference stage."""
  c = _pairs_config(tmp_path, **{"sft.steps": 2, "preference.steps": 2, "preference.loss": loss,
                                 "train.rl_steps": 2, "rl.kl_coef": 0.01,
                                 "model.overrides.lora_rank": 4, "eval.seeds_per_domain": 1})
  summary = trainer.train(c, str(tmp_path / "run"))
  assert (summary["sft_steps"], summary["preference_steps"], summary["rl_steps"]) == (2, 2, 2)
  assert set(summary["eval"]) >= {"sft", "preference", "final", "change"}
  rows = read_metrics(str(tmp_path / "run"))
  assert [r["step"] for r in rows if "preference/loss/preference" in r] == [3, 4]
  assert [r["step"] for r in rows if "kl" in r and "reward/mean" in r] == [5, 6]


@pytest.mark.slow
def test_rl_without_sft_rebuilds_its_kl_reference_on_resume(tmp_path, monkeypatch):
  """A run that starts at RL writes the checkpoint its KL reference is rebuilt from."""
  extra = {"sft.steps": 0, "train.rl_steps": 3, "rl.kl_coef": 0.01, "checkpoint.keep_last": 1}

  class StopAt2(trainer.PreemptionFlag):
    def reached(self, step):
      return step == 2 or super().reached(step)

  monkeypatch.setattr(trainer, "PreemptionFlag", StopAt2)
  assert trainer.train(_config(**extra), str(tmp_path))["status"] == "preempted"
  monkeypatch.undo()
  assert trainer.train(_config(**extra), str(tmp_path))["rl_steps"] == 3


def test_preference_config_errors_fail_before_anything_is_built(tmp_path):
  for extra, message in [({"preference.data": ""}, "preference.steps > 0 needs preference.data"),
                         ({"preference.loss": "dpo"}, "unknown preference loss"),
                         ({"preference.loss": "kto", "preference.batch_size": 1},
                          "preference.batch_size=1 with loss=kto"),
                         ({"preference.loss": "kto", "preference.sft_coef": 0.5},
                          "sft_coef=0.5 applies to paired losses"),
                         ({"preference.batch_size": 0}, "preference.batch_size=0 must be >= 1")]:
    with pytest.raises(ValueError, match=message):
      trainer.Trainer(_pairs_config(tmp_path, **extra), str(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_online_dpo_pairs_each_groups_best_and_worst_sample(tmp_path, monkeypatch):
  """algorithm=online_dpo: dynamic sampling keeps groups whose rewards differ, each gives
  its best sample against its worst, one preference update; the reference is the policy
  RL started from, so the first update's loss is log 2."""
  from posttrain.rollout import worker as worker_lib
  from posttrain.tasks import Reward
  # A reward the untrained policy varies on: the parity of the completion's length.
  monkeypatch.setattr(worker_lib, "_score", lambda task, sample: Reward(
      value=float(len(sample.text) % 2), components={}, verdict=""))
  c = _config(**{"algorithm": "online_dpo", "train.rl_steps": 2, "rl.group_size": 4,
                 "rl.sft_coef": 0.5, "eval.seeds_per_domain": 0})
  summary = trainer.train(c, str(tmp_path))
  assert summary["rl_steps"] == 2
  rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rows) == 2
  for r in rows:
    # 4 informative groups a step, one pair each.
    assert r["preference/pairs"] == 4 and r["nonfinite"] == 0 and r["loss/sft"] > 0
    assert 0 <= r["preference/rewards/accuracy"] <= 1
  assert abs(rows[0]["loss/preference"] - np.log(2)) < 1e-5
  assert rows[0]["preference/rewards/margin"] == 0.0


def test_online_kto_labels_samples_by_their_groups_mean(tmp_path, monkeypatch):
  """algorithm=online_kto: in each informative group the samples above the mean reward are
  desirable and those below undesirable, one KTO update on them all; the reference is the
  policy RL started from, so the first update's loss is 1 - sigmoid(0) = 0.5."""
  from posttrain.rollout import worker as worker_lib
  from posttrain.tasks import Reward
  monkeypatch.setattr(worker_lib, "_score", lambda task, sample: Reward(
      value=float(len(sample.text) % 2), components={}, verdict=""))
  c = _config(**{"algorithm": "online_kto", "train.rl_steps": 2, "rl.group_size": 4,
                 "rl.desirable_weight": 1.5, "eval.seeds_per_domain": 0})
  assert trainer.train(c, str(tmp_path))["rl_steps"] == 2
  rows = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
  assert len(rows) == 2
  for r in rows:
    # 4 informative groups of 4 a step: every sample is above or below its group's mean,
    # and the passing ones are the desirable ones.
    assert r["preference/examples"] == 16 and r["nonfinite"] == 0
    assert r["preference/desirable"] == 16 * r["pass_rate/mean"]
  # Weighted by 1.5 the desirable ones, 1 the rest: the mean loss of 0.5s.
  d = rows[0]["preference/desirable"]
  assert rows[0]["loss/preference"] == pytest.approx(0.5 * (1.5 * d + 16 - d) / 16, abs=1e-5)
  with pytest.raises(ValueError, match="desirable_weight"):
    trainer.train(_config(**{"rl.desirable_weight": 2.0}), str(tmp_path / "bad"))


GEMMA2 = {"model.overrides.architecture": "Gemma2ForCausalLM", "model.overrides.num_layers": 2,
          "model.overrides.norm_unit_offset": True, "model.overrides.sandwich_norms": True,
          "model.overrides.embed_scale": True, "model.overrides.mlp_activation": "gelu_tanh",
          "model.overrides.query_pre_attn_scalar": 16.0,
          "model.overrides.attn_logit_softcap": 50.0,
          "model.overrides.final_logit_softcap": 30.0, "model.overrides.sliding_window": 8,
          "model.overrides.layer_types": "sliding_attention,full_attention",
          "model.overrides.scan_layers": True}


GPT_OSS = {"model.overrides.architecture": "GptOssForCausalLM",
           "model.overrides.num_layers": 2, "model.overrides.num_experts": 4,
           "model.overrides.num_experts_per_tok": 2, "model.overrides.qkv_bias": True,
           "model.overrides.attn_out_bias": True, "model.overrides.attention_sinks": True,
           "model.overrides.router_bias": True, "model.overrides.expert_bias": True,
           "model.overrides.mlp_activation": "clamped_swiglu",
           "model.overrides.sliding_window": 8,
           "model.overrides.layer_types": "sliding_attention,full_attention",
           "model.overrides.scan_layers": True}


@pytest.mark.slow
def test_gpt_oss_run_trains_and_exports_what_transformers_reads(tmp_path):
  """SFT then RL on a gpt-oss policy (sinks, biased attention and experts, the clamped
  SwiGLU, sliding and full layers scanned) over the 8-device mesh; export_hf writes
  GptOssForCausalLM files that load back as the policy."""
  params, exported = _train_two_rl_steps_and_export(tmp_path, GPT_OSS)
  assert exported.cfg.architecture == "GptOssForCausalLM" and exported.cfg.attention_sinks
  assert params["layers"]["attn"]["sinks"].shape[0] == 2  # stacked layers: [L, heads]


@pytest.mark.slow
def test_gemma2_run_trains_and_exports_what_transformers_reads(tmp_path):
  """SFT then RL on a Gemma 2 policy (sliding and full layers scanned, soft caps) over the
  8-device mesh; export_hf writes Gemma2ForCausalLM files that load back as the policy."""
  _, exported = _train_two_rl_steps_and_export(tmp_path, GEMMA2)
  assert exported.cfg.architecture == "Gemma2ForCausalLM"
  assert exported.cfg.sliding_layers == (True, False)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_colocated_lora_sampler_holds_the_learners_base_uncopied(tmp_path, lora):
  """Colocated with LoRA, the sampler holds the learner's frozen base arrays themselves
  (its own copy is the adapters): from its start, after a step that donates the state
  and hands the base back over the same buffers (the `state` setter points the sampler
  at the new arrays), and after each weight sync; without LoRA it holds a copy of
  everything."""
  from posttrain.rl import state as state_lib
  t = trainer.Trainer(_config(**(LORA if lora else {})), str(tmp_path))
  donating = jax.jit(lambda state: state, donate_argnums=0)  # as a train step hands it back
  for _ in range(2):
    for _ in range(2):
      frozen = state_lib.split_trainable(t.state.params)[1]
      learner = {id(x) for x in jax.tree.leaves(t.state.params)}
      held = [x for x in jax.tree.leaves(t.sampler._state) if id(x) in learner]
      assert len(held) == (len(jax.tree.leaves(frozen)) if lora else 0)
      assert held or not lora
      assert not any(x.is_deleted() for x in jax.tree.leaves(t.sampler._state))
      t.state = donating(t.state)
    t.sync_weights()
  t.writer.close()
