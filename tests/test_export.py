"""Exporting any checkpoint of a run as a Hugging Face folder (`posttrain.export`,
`launch.export`): the step asked for, merged or as a PEFT adapter, a policy or a reward
model, and one-line refusals. The checkpoints are written here the way the trainers write
theirs, from models of known weights (no training needed)."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default, reward_model_tiny
from posttrain import experiment, models, planner
from posttrain.checkpoint import CheckpointManager
from posttrain.export import export_checkpoint
from posttrain.rl import state as rl_state
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {"model.overrides.num_layers": 1, "model.overrides.d_model": 32,
             "model.overrides.ffn_dim": 64}
TOKENS = jnp.arange(1, 25, dtype=jnp.int32).reshape(2, 12)


def _config(module=default, **extra):
  return planner.override(module.get_config(), {**OVERRIDES, **extra})


def _randomise(model, seed):
  """Every LoRA parameter and the value head random (fresh B is 0, a fresh head small)."""
  rng = np.random.default_rng(seed)
  for _, v in nnx.iter_graph(model):
    if isinstance(v, nnx.LoRAParam):
      v[...] = jnp.asarray(rng.normal(size=v.shape) * 0.1, v.dtype)
  if model.cfg.value_head:
    model.value_w[...] = jnp.asarray(rng.normal(size=model.value_w.shape), jnp.float32)


def _fake_run(workdir, config, seeds=(1, 2), progress=None):
  """A run's checkpoints 1, 2, ...: the model of seed s at step i, in the trainers'
  layout (the run's optimizer structure, on the run's mesh), with the trainer's
  `progress`. Returns the models."""
  reward = experiment.objective(config) == "reward_model"
  cfg = (experiment.reward_model_config if reward else experiment.model_config)(config)
  mesh = experiment.build_mesh(config)
  manager = CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=1,
                              keep_last=None, async_save=False)
  out = {}
  for step, seed in enumerate(seeds, 1):
    model = models.create_model(cfg, seed=seed)
    _randomise(model, seed)
    state = rl_state.init_train_state(model, experiment.optimizer_like(config), mesh=mesh)
    manager.save(step, experiment.to_checkpoint(state), {"progress": progress or {}},
                 force=True)
    out[step] = model
  manager.wait()
  manager.close()
  return out


def test_a_policy_checkpoint_merged_at_any_step_and_in_bfloat16(tmp_path):
  config = _config()
  run = _fake_run(str(tmp_path / "run"), config)
  want = {s: np.asarray(m(TOKENS)) for s, m in run.items()}
  assert np.abs(want[1] - want[2]).max() > 1e-2
  for step in (1, None):  # None: the newest
    out = tmp_path / f"step_{step}"
    done = export_checkpoint(config, str(tmp_path / "run"), str(out), step=step)
    assert done == {"step": step or 2, "out": str(out), "architecture": "LlamaForCausalLM",
                    "adapter": False}
    np.testing.assert_allclose(models.from_pretrained(str(out))(TOKENS), want[step or 2],
                               atol=1e-5)
  assert not os.path.exists(out / "tokenizer.json")  # the byte tokenizer has no files
  export_checkpoint(config, str(tmp_path / "run"), str(tmp_path / "bf16"), dtype="bfloat16")
  written = json.loads((tmp_path / "bf16" / "config.json").read_text())
  assert written["torch_dtype"] == "bfloat16"
  half = models.from_pretrained(str(tmp_path / "bf16"))
  assert half.cfg.param_dtype == "bfloat16"
  np.testing.assert_allclose(np.asarray(half(TOKENS), np.float32), want[2], atol=0.1)


def test_lora_runs_export_merged_or_as_a_peft_adapter_on_the_base(tmp_path):
  config = _config(**{"model.overrides.lora_rank": 2,
                      "model.overrides.lora_targets": "q_proj,v_proj,up_proj"})
  run = _fake_run(str(tmp_path / "run"), config, seeds=(3,))
  model = run[1]
  want = np.asarray(model(TOKENS))
  export_checkpoint(config, str(tmp_path / "run"), str(tmp_path / "merged"))
  np.testing.assert_allclose(models.from_pretrained(str(tmp_path / "merged"))(TOKENS), want,
                             atol=1e-5)
  done = export_checkpoint(config, str(tmp_path / "run"), str(tmp_path / "adapter"),
                           adapter=True)
  assert done["adapter"] and (tmp_path / "adapter" / "adapter_config.json").exists()
  # The adapter on the base weights (the adapters off) computes the trained model.
  base = nnx.clone(model)
  for _, v in nnx.iter_graph(base):
    if isinstance(v, nnx.LoRAParam):
      v[...] = jnp.zeros_like(v[...])
  models.save_pretrained(base, str(tmp_path / "base"))
  again = models.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
  np.testing.assert_allclose(again(TOKENS), want, atol=1e-5)


@pytest.mark.parametrize("progress,refused", [
    ({"stage": "sft", "sft_step": 3}, False),  # SFT's own adapters, on the start's weights
    ({"stage": "rl", "sft_step": 0, "rl_step": 2}, False),  # RL alone: nothing folded
    ({"stage": "rl", "sft_step": 3, "rl_step": 2}, True),
    ({"stage": "done", "sft_step": 0, "pref_step": 4}, True),
    ({"stage": "preference", "sft_step": 3, "pref_step": 1}, True),
    ({"stage": "done", "sft_step": 3, "folded_steps": 3}, True),
    # SFT alone (train.rl_steps=0): the trainer folded nothing.
    ({"stage": "done", "sft_step": 3, "folded_steps": 0}, False),
], ids=["sft", "rl_alone", "rl_after_sft", "done_after_preference", "preference_after_sft",
        "counted_folded", "sft_alone"])
def test_adapters_past_a_folded_stage_are_refused(tmp_path, progress, refused):
  """Entering RL (or preference training) a LoRA run folds the earlier stage's adapters
  into its base and trains fresh ones: past such a stage the adapters alone would drop
  that update on the starting weights, so only merged weights are exported."""
  config = _config(**{"model.overrides.lora_rank": 2})
  _fake_run(str(tmp_path / "run"), config, seeds=(3,), progress=progress)
  out = str(tmp_path / "adapter")
  if not refused:
    assert export_checkpoint(config, str(tmp_path / "run"), out, adapter=True)["adapter"]
    return
  with pytest.raises(ValueError, match=r"^checkpoint 1 is past this run's .* stage, whose "
                     r"adapters were folded into the base weights: .*export merged") as e:
    export_checkpoint(config, str(tmp_path / "run"), out, adapter=True)
  assert "\n" not in str(e.value) and not os.path.exists(out)
  assert not export_checkpoint(config, str(tmp_path / "run"), str(tmp_path / "m"))["adapter"]


def test_a_reward_model_run_exports_a_sequence_classifier(tmp_path):
  config = _config(reward_model_tiny)
  run = _fake_run(str(tmp_path / "run"), config)
  done = export_checkpoint(config, str(tmp_path / "run"), str(tmp_path / "rm"), step=1)
  assert done["architecture"] == "LlamaForSequenceClassification"
  exported = models.from_pretrained(str(tmp_path / "rm"))
  assert not exported.cfg.lm_head and exported.cfg.pad_token_id == 256  # the byte pad id
  np.testing.assert_allclose(exported.scores(TOKENS), run[1].scores(TOKENS), atol=1e-5)


def test_what_cannot_be_exported_is_refused_in_one_line(tmp_path):
  config = _config()
  _fake_run(str(tmp_path / "run"), config, seeds=(1,))
  run = str(tmp_path / "run")
  for workdir, kwargs, message in [
      (run, {"step": 9}, r"^step=9 is not a checkpoint in .*; have \[1\]$"),
      (run, {"adapter": True}, r"^adapter=True needs a run with LoRA adapters"),
      (run, {"dtype": "int8"}, r"^dtype='int8'; expected one of"),
      (run, {"adapter": True, "dtype": "bfloat16"}, r"^dtype applies to merged weights"),
      (run, {"out": run}, r"is the run's workdir"),
      (str(tmp_path), {}, r"has no checkpoints/ folder")]:
    kwargs = {"out": str(tmp_path / "x"), **kwargs}
    with pytest.raises(ValueError, match=message) as e:
      export_checkpoint(config, workdir, kwargs.pop("out"), **kwargs)
    assert "\n" not in str(e.value)
  assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_the_launcher_writes_a_folder_that_loads_and_fails_in_one_line(tmp_path):
  config = _config()
  run = _fake_run(str(tmp_path / "run"), config, seeds=(1, 2))
  env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  command = [sys.executable, "-m", "launch.export", f"--config={ROOT}/configs/default.py",
             f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}", *flags]
  proc = subprocess.run(command + ["--step=1"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert f"wrote checkpoint 1 as LlamaForCausalLM to {tmp_path / 'hf'}" in proc.stdout
  np.testing.assert_allclose(models.from_pretrained(str(tmp_path / "hf"))(TOKENS),
                             run[1](TOKENS), atol=1e-5)
  proc = subprocess.run(command + ["--step=7"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error: step=7 is not a checkpoint")
