"""On-policy distillation: the per-token advantage against numpy, the trainer adding the
teacher's term to what the RL batch trains on (checked against a plain forward of the
teacher's folder), a teacher equal to the student giving nothing, the planner counting the
teacher, and one-line errors for what cannot be distilled from."""

import jax
import jax.numpy as jnp
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
      ({"distill.teacher": str(folders / "teacher"), "distill.loss": "tvd"},
       "distill.loss='tvd'; expected one of \\('sampled', 'reverse_kl', 'forward_kl', "
       "'jsd'\\)"),
      ({"distill.teacher": str(folders / "teacher"), "distill.loss": "jsd",
        "distill.beta": 1.0}, "distill.beta=1.0 must be in \\(0, 1\\)"),
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


# -- the whole-vocabulary divergence in the step (distill.loss=reverse_kl | forward_kl) ----


def _np_divergence(logits, teacher, kind, temperature=1.0, beta=0.5):
  logits = logits.astype(np.float64) / temperature
  teacher = teacher.astype(np.float64)[..., :logits.shape[-1]]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  logq = teacher - np.log(np.exp(teacher - teacher.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - teacher.max(-1, keepdims=True)
  if kind == "reverse_kl":
    return (np.exp(logp) * (logp - logq)).sum(-1)
  if kind == "forward_kl":
    return (np.exp(logq) * (logq - logp)).sum(-1)
  # TRL's generalized_jsd_loss: the mixture m = beta q + (1 - beta) p.
  p, q = np.exp(logp), np.exp(logq)
  logm = np.log(beta * q + (1 - beta) * p)
  return beta * (q * (logq - logm)).sum(-1) + (1 - beta) * (p * (logp - logm)).sum(-1)


def _jnp_divergence(logp, logq, kind, beta=0.5):
  p, q = jnp.exp(logp), jnp.exp(logq)
  if kind == "reverse_kl":
    return jnp.sum(p * (logp - logq), -1)
  if kind == "forward_kl":
    return jnp.sum(q * (logq - logp), -1)
  logm = jnp.log(beta * q + (1 - beta) * p)
  return beta * jnp.sum(q * (logq - logm), -1) + (1 - beta) * jnp.sum(p * (logp - logm), -1)


@pytest.mark.parametrize("kind", models.DIVERGENCES)
def test_chunked_divergence_matches_numpy_and_its_gradient_the_plain_one(kind):
  """Chunks that do not divide the length, a teacher with more vocabulary rows (read on
  the model's tokens, renormalised) and of another width, a sampling temperature."""
  rng = np.random.default_rng(1)
  b, t, d, e, v, w = 2, 11, 8, 12, 37, 40
  h = rng.normal(size=(b, t, d)).astype(np.float32)
  wd = rng.normal(size=(d, v)).astype(np.float32)
  th = rng.normal(size=(b, t, e)).astype(np.float32)
  tw = (rng.normal(size=(e, w)) * 2).astype(np.float32)
  got = models.chunked_divergence(h, wd, th, tw, kind=kind, chunk=4, temperature=0.7,
                                  beta=0.3)
  want = _np_divergence(h @ wd, th @ tw, kind, temperature=0.7, beta=0.3)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(got) >= -1e-6)

  def plain(h_, w_):
    logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h_, w_) / 0.7, -1)
    logq = jax.nn.log_softmax(jnp.einsum("bte,ev->btv", th, tw[:, :v]), -1)
    div = _jnp_divergence(logp, logq, kind, beta=0.3)
    return jnp.sum(div * np.arange(t)[None, :] / t)

  def chunked(h_, w_):
    div = models.chunked_divergence(h_, w_, th, tw, kind=kind, chunk=4, temperature=0.7,
                                    beta=0.3)
    return jnp.sum(div * np.arange(t)[None, :] / t)

  for got_g, want_g in zip(jax.grad(chunked, (0, 1))(h, wd), jax.grad(plain, (0, 1))(h, wd)):
    np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-5)
  # Nothing flows into the teacher.
  g_t = jax.grad(lambda x: jnp.sum(models.chunked_divergence(h, wd, x, tw, kind=kind,
                                                             chunk=4)))(th)
  assert not np.any(np.asarray(g_t))
  with pytest.raises(ValueError, match="unknown divergence 'tvd'"):
    models.chunked_divergence(h, wd, th, tw, kind="tvd", chunk=4)
  with pytest.raises(ValueError, match="jsd needs beta in \\(0, 1\\)"):
    models.chunked_divergence(h, wd, th, tw, kind="jsd", chunk=4, beta=1.0)
  with pytest.raises(ValueError, match="teacher's vocabulary \\(30\\) is smaller"):
    models.chunked_divergence(h, wd, th, tw[:, :30], kind=kind, chunk=4)


def test_chunked_divergence_adds_both_output_biases():
  """Output projections with biases (Phi's lm_head): the model's logits h w + b, the
  teacher's th tw + tb read on the model's tokens; the model's bias takes the plain
  gradient, the teacher's none."""
  rng = np.random.default_rng(2)
  b, t, d, e, v, w = 2, 9, 8, 12, 37, 40
  h, wd = rng.normal(size=(b, t, d)), rng.normal(size=(d, v))
  th, tw = rng.normal(size=(b, t, e)), rng.normal(size=(e, w)) * 2
  bias, teacher_bias = rng.normal(size=(v,)) * 2, rng.normal(size=(w,)) * 2
  h, wd, th, tw, bias, teacher_bias = (jnp.asarray(x, jnp.float32) for x in
                                       (h, wd, th, tw, bias, teacher_bias))
  for kind in models.DIVERGENCES:
    got = models.chunked_divergence(h, wd, th, tw, kind=kind, chunk=4, beta=0.3,
                                    bias_V=bias, teacher_bias_W=teacher_bias)
    want = _np_divergence(np.asarray(h @ wd + bias[None, None]),
                          np.asarray(th @ tw + teacher_bias[None, None]),
                          kind, temperature=1.0, beta=0.3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

  def plain(b_):
    logp = jax.nn.log_softmax(h @ wd + b_[None, None], -1)
    logq = jax.nn.log_softmax(th @ tw[:, :v] + teacher_bias[None, None, :v], -1)
    return jnp.sum(_jnp_divergence(logp, logq, "reverse_kl"))

  def chunked(b_, tb_):
    return jnp.sum(models.chunked_divergence(h, wd, th, tw, kind="reverse_kl", chunk=4,
                                             bias_V=b_, teacher_bias_W=tb_))

  got_b, got_tb = jax.grad(chunked, (0, 1))(bias, teacher_bias)
  np.testing.assert_allclose(got_b, jax.grad(plain)(bias), rtol=1e-4, atol=1e-5)
  assert np.abs(np.asarray(got_b)).max() > 1e-3 and not np.any(np.asarray(got_tb))


def _step_setup(teacher_seed=5):
  import optax
  from flax import nnx

  from posttrain.rl import presets
  from posttrain.rl import state as state_lib
  from posttrain.rl import train_step as ts
  from tests.rl.test_train_step import (CFG, microbatched, one_device_mesh, packed_rows)
  mesh = one_device_mesh()
  teacher_cfg = CFG.replace(num_layers=2)
  teacher = models.create_model(teacher_cfg, seed=teacher_seed)
  teacher.final_norm.scale.value = teacher.final_norm.scale.value * 6.0
  teacher_params = nnx.state(teacher, nnx.Param)
  optimizer = optax.sgd(1.0)
  init = state_lib.init_train_state(models.create_model(CFG), optimizer, mesh=mesh)
  whole = {k: np.asarray(v) for k, v in microbatched(packed_rows(3), 1).items()}
  whole["advantages"] = np.zeros_like(whole["advantages"])  # the divergence alone
  algo = presets.algorithm_config("grpo", kl_coef=0.0)
  return (ts, state_lib, CFG, teacher_cfg, teacher, teacher_params, optimizer, init, whole,
          algo, mesh)


@pytest.mark.parametrize("kind", [
    "reverse_kl",
    # The same step code; the divergences' own math is checked above.
    pytest.param("forward_kl", marks=pytest.mark.slow),
    pytest.param("jsd", marks=pytest.mark.slow)])
def test_step_divergence_gradient_is_the_plain_losss_and_splits_exactly(kind):
  """With zero advantages the update is minus the gradient of coef * sum_t w_t D_t / D
  (GRPO's seq_mean_token_mean weights), computed here from plain forwards of both models;
  four micro-batches give the one-batch update."""
  from flax import nnx
  (ts, state_lib, cfg, teacher_cfg, teacher, teacher_params, optimizer, init, whole, algo,
   mesh) = _step_setup()
  coef = 0.5
  step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh, teacher_cfg=teacher_cfg,
                            distill_loss=kind, distill_coef=coef)
  state, metrics = step(state_lib.frozen_copy(init), whole, teacher=teacher_params)
  delta = jax.tree.map(np.subtract, nnx.to_pure_dict(state.params),
                       nnx.to_pure_dict(init.params))

  from posttrain.rl import losses
  tokens, positions, seg = (whole[k][0] for k in ("tokens", "positions", "segment_ids"))
  targets, mask = whole["targets"][0], whole["loss_mask"][0] != 0
  weights, denom = losses.token_weights(mask, "seq_mean_token_mean", segment_ids=seg)
  logq = jax.nn.log_softmax(teacher(tokens, positions, seg).astype(jnp.float32), -1)
  model = models.create_model(cfg)
  graphdef, _ = nnx.split(model)

  def oracle(params):
    m = nnx.merge(graphdef, params)
    logp = jax.nn.log_softmax(m(tokens, positions, seg).astype(jnp.float32), -1)
    div = _jnp_divergence(logp, logq, kind)
    return coef * jnp.sum(jnp.where(mask, div * weights, 0.0)) / denom, div

  (_, div), grad = jax.value_and_grad(oracle, has_aux=True)(init.params)
  del targets
  for got, want in zip(jax.tree.leaves(delta), jax.tree.leaves(nnx.to_pure_dict(grad))):
    np.testing.assert_allclose(got, -np.asarray(want), rtol=2e-3, atol=2e-6)
  np.testing.assert_allclose(metrics["distill/divergence"], np.asarray(div)[mask].mean(),
                             rtol=1e-4)
  split = {k: v.reshape((4, -1) + v.shape[2:]) for k, v in whole.items()}
  state_4, metrics_4 = step(state_lib.frozen_copy(init), split, teacher=teacher_params)
  for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(state_4.params)),
                  jax.tree.leaves(nnx.to_pure_dict(state.params))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics_4["distill/divergence"], metrics["distill/divergence"],
                             rtol=1e-5)
  with pytest.raises(ValueError, match="call train_step\\(state, batch, teacher="):
    step(state_lib.frozen_copy(init), whole)


def test_trainer_distils_over_the_whole_vocabulary_in_the_step(folders, tmp_path):
  """distill.loss=reverse_kl, distillation alone: toward a sharper copy of the student the
  divergence falls over a few steps; from the student's own weights it is 0 and so is the
  gradient."""
  student = str(folders / "student")
  sharp = tmp_path / "sharp"
  model = models.from_pretrained(student)
  model.final_norm.scale.value = model.final_norm.scale.value * 8.0
  models.save_pretrained(model, str(sharp))
  common = {"distill.loss": "reverse_kl", "distill.reward_weight": 0.0, "init_from": student,
            "optim.lr": 1e-2, "optim.warmup": 0}
  trainer.train(_config(**common, **{"distill.teacher": student}), str(tmp_path / "self"))
  row = read_metrics(str(tmp_path / "self"))[-1]
  assert abs(row["distill/divergence"]) < 1e-5 and row["grad_norm"] < 1e-5
  trainer.train(_config(**common, **{"distill.teacher": str(sharp), "train.rl_steps": 8,
                                     "rollout.prompts_per_step": 8, "rl.group_size": 8,
                                     "train.rows_per_microbatch": 16}), str(tmp_path / "run"))
  divergence = [r["distill/divergence"] for r in read_metrics(str(tmp_path / "run"))]
  assert len(divergence) == 8 and min(divergence) > 0
  assert np.mean(divergence[-3:]) < 0.9 * np.mean(divergence[:3]), divergence


def test_the_update_reads_log_probs_at_the_rollout_temperature(tmp_path):
  """Old log-probs come at the sampler's temperature; so must the update's, or the ratio of
  an on-policy update is not 1 (and PPO epochs clip the wrong tokens)."""
  trainer.train(_config(**{"rollout.temperature": 0.7, "rl.tis_cap": 2.0}), str(tmp_path))
  row = read_metrics(str(tmp_path))[-1]
  assert abs(row["ratio/mean"] - 1.0) < 1e-4 and abs(row["ratio/max"] - 1.0) < 1e-4


def test_planner_counts_the_in_step_teachers_hidden_states(folders):
  extra = {"distill.teacher": str(folders / "teacher")}
  sampled = planner.plan(_config(**extra), num_devices=1)
  in_step = planner.plan(_config(**extra, **{"distill.loss": "forward_kl"}), num_devices=1)
  teacher_cfg = experiment.teacher_config(_config(**extra))
  rows, row_len = OVERRIDES["train.rows_per_microbatch"], OVERRIDES["train.row_len"]
  assert in_step["teacher"] - sampled["teacher"] == rows * row_len * teacher_cfg.d_model * 4


def test_the_compiled_update_takes_the_in_step_teacher(folders):
  """aot compiles the update the trainer runs: with distill.loss=reverse_kl its arguments
  hold the teacher's params beside the state."""
  from posttrain import aot
  extra = {"distill.teacher": str(folders / "teacher"), "distill.loss": "reverse_kl"}
  devices = jax.devices()[:1]
  with_teacher = aot.compile_rl_step(_config(**extra), devices)
  without = aot.compile_rl_step(_config(), devices)
  teacher_cfg = experiment.teacher_config(_config(**extra))
  teacher = planner.state_bytes(teacher_cfg, with_teacher.mesh)[0]
  assert with_teacher.arguments - without.arguments == teacher


# -- logit distillation in SFT (distill.stages) ---------------------------------------------

SFT_KD = {"train.rl_steps": 0, "sft.steps": 10, "sft.batch_size": 8, "sft.warmup": 0,
          "sft.lr": 1e-2,
          "distill.stages": "sft", "distill.coef": 5.0}


def test_sft_distils_the_teacher_into_the_student(folders, tmp_path):
  """distill.stages=sft: from the student's own weights the divergence (read before each
  update) is 0 at the first step; toward a sharper teacher it falls over the steps, and
  below what plain SFT leaves."""
  student = str(folders / "student")
  sharp = tmp_path / "sharp"
  model = models.from_pretrained(student)
  model.final_norm.scale.value = model.final_norm.scale.value * 8.0
  models.save_pretrained(model, str(sharp))
  trainer.train(_config(**{**SFT_KD, "distill.teacher": student, "init_from": student,
                            "sft.steps": 1}), str(tmp_path / "self"))
  (row,) = [r for r in read_metrics(str(tmp_path / "self")) if "sft/nll" in r]
  assert abs(row["sft/distill"]) < 1e-5
  runs = {}
  for name, coef in (("kd", 5.0), ("plain", 0.0)):
    trainer.train(_config(**{**SFT_KD, "distill.teacher": str(sharp), "init_from": student,
                              "distill.coef": coef}), str(tmp_path / name))
    runs[name] = [r["sft/distill"] for r in read_metrics(str(tmp_path / name))
                  if "sft/nll" in r]
  assert len(runs["kd"]) == 10 and runs["kd"][0] == pytest.approx(runs["plain"][0], rel=1e-4)
  first, last = np.mean(runs["kd"][:3]), np.mean(runs["kd"][-3:])
  assert last < 0.75 * first and last < 0.8 * np.mean(runs["plain"][-3:]), runs


def test_an_sft_teacher_leaves_rl_and_the_plan_alone(folders, tmp_path):
  """Without "rl" in distill.stages the RL step reads no teacher, and the plan counts none."""
  extra = {**SFT_KD, "sft.steps": 1, "train.rl_steps": 1,
           "distill.teacher": str(folders / "teacher")}
  trainer.train(_config(**extra), str(tmp_path))
  rows = read_metrics(str(tmp_path))
  assert "sft/distill" in [r for r in rows if "sft/nll" in r][0]
  rl = [r for r in rows if "reward/mean" in r]
  assert len(rl) == 1 and not any(k.startswith("distill/") for k in rl[0])
  p = planner.plan(_config(**extra), num_devices=8)
  assert p["teacher"] == 0 and "freed when SFT ends" in p.components["teacher"].formula
  both = planner.plan(_config(**{**extra, "distill.stages": "sft,rl"}), num_devices=8)
  assert both["teacher"] > 0


@pytest.mark.parametrize("change,message", [
    ({"distill.stages": "pretraining"}, r"distill.stages='pretraining': expected a "
                                        r"comma-separated subset of \('sft', 'rl'\)"),
    ({"distill.stages": ""}, "distill.stages='': expected"),
    ({"distill.sft_loss": "sampled"}, r"distill.sft_loss='sampled'; expected one of"),
])
def test_bad_distillation_stages_are_one_line_errors(folders, tmp_path, change, message):
  with pytest.raises(ValueError, match=message):
    experiment.check_config(_config(**{"distill.teacher": str(folders / "teacher"),
                                       **change}))
