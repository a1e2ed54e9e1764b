"""KTO and APO-zero from unpaired feedback: the losses against a float64 oracle of the
paper's (and TRL's) formulas, packing examples and their mismatched KL sequences, and the
jitted step (the model's log-probs, exact micro-batching, in-step reference, sharding,
LoRA, learning)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain import models
from posttrain.rl import kto
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts
from posttrain.rl.preference import PreferenceConfig
from tests.rl.test_train_step import CFG, assert_trees_close, fresh_state, one_device_mesh, snapshot

ROW_LEN = 24


# -- the loss: a float64 numpy oracle ------------------------------------------------------


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def oracle_losses(cfg, policy, ref, desirable, kl_policy=None, kl_ref=None):
  """Per-example losses and z0, as TRL's KTOTrainer computes them."""
  r = np.asarray(policy, np.float64) - np.asarray(ref, np.float64)
  if cfg.loss == "kto":
    z0 = max(float(np.mean(np.asarray(kl_policy, np.float64) - kl_ref)), 0.0)
    good, bad = 1 - sigmoid(cfg.beta * (r - z0)), 1 - sigmoid(cfg.beta * (z0 - r))
  else:
    z0 = 0.0
    good, bad = 1 - sigmoid(cfg.beta * r), sigmoid(cfg.beta * r)
  return np.where(desirable, cfg.desirable_weight * good, cfg.undesirable_weight * bad), z0


CASES = {
    "kto": PreferenceConfig("kto", beta=0.5),
    "kto weighted": PreferenceConfig("kto", beta=0.2, desirable_weight=1.5,
                                     undesirable_weight=0.7),
    "apo_zero": PreferenceConfig("apo_zero_unpaired", beta=0.3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_gradient_match_the_formulas(case):
  cfg = CASES[case]
  rng = np.random.default_rng(0)
  n = 9
  policy, ref = rng.normal(-20, 4, n), rng.normal(-20, 4, n)
  kl_policy, kl_ref = rng.normal(-30, 3, n), rng.normal(-33, 3, n)  # z0 about 3 > 0
  desirable = rng.random(n) < 0.5
  mask = np.ones(n, bool)
  mask[[2, 7]] = False
  want, z0 = oracle_losses(cfg, policy, ref, desirable, kl_policy, kl_ref)
  kl = kto.kl_reference_point(np.sum(kl_policy), np.sum(kl_ref), n) if cfg.loss == "kto" else 0.0
  np.testing.assert_allclose(kl, z0, rtol=1e-5)

  def loss_of(p):
    return kto.unpaired_loss(cfg, p, ref, desirable, kl=kl, example_mask=mask,
                             denominator=10.0)

  loss, metrics = loss_of(jnp.asarray(policy, jnp.float32))
  np.testing.assert_allclose(loss, want[mask].sum() / 10.0, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss/preference"].compute(), want[mask].mean(), rtol=1e-5)
  good, bad = mask & desirable, mask & ~desirable
  rewards = cfg.beta * (policy - ref)
  np.testing.assert_allclose(metrics["rewards/chosen"].compute(), rewards[good].mean(),
                             rtol=1e-4)
  np.testing.assert_allclose(metrics["rewards/rejected"].compute(), rewards[bad].mean(),
                             rtol=1e-4)
  np.testing.assert_allclose(metrics["logps/rejected"].compute(), policy[bad].mean(),
                             rtol=1e-5)
  # The gradient against central differences of the float64 oracle; none for masked slots.
  grad = np.asarray(jax.grad(lambda p: loss_of(p)[0])(jnp.asarray(policy, jnp.float32)))
  eps = 1e-4
  for i in range(n):
    up, down = policy.copy(), policy.copy()
    up[i] += eps
    down[i] -= eps
    numeric = (oracle_losses(cfg, up, ref, desirable, kl_policy, kl_ref)[0][mask].sum()
               - oracle_losses(cfg, down, ref, desirable, kl_policy, kl_ref)[0][mask].sum()
               ) / (2 * eps * 10.0)
    np.testing.assert_allclose(grad[i], numeric, rtol=1e-3, atol=1e-7)
  assert grad[2] == 0 and grad[7] == 0
  # Desirable completions are pushed up, undesirable ones down.
  assert (grad[good] < 0).all() and (grad[bad] > 0).all()


def test_the_reference_point_is_clamped_at_zero_and_carries_no_gradient():
  assert float(kto.kl_reference_point(-5.0, 3.0, 4)) == 0.0
  np.testing.assert_allclose(kto.kl_reference_point(10.0, 2.0, 4), 2.0)
  cfg = PreferenceConfig("kto", beta=0.5)
  grad = jax.grad(lambda kl: jnp.sum(kto.example_losses(cfg, jnp.ones(3), jnp.array(
      [True, False, True]), kl)))(jnp.float32(0.7))
  assert float(grad) == 0.0


def test_config_errors_are_one_line_and_name_the_value():
  for kwargs, message in [
      (dict(loss="kto", sft_coef=0.1), "sft_coef=0.1 applies to paired losses, not 'kto'"),
      (dict(loss="kto", desirable_weight=0.0), "desirable_weight must be a finite number > 0"),
      (dict(loss="kto", undesirable_weight=float("nan")), "undesirable_weight must be"),
      (dict(loss="sigmoid", desirable_weight=2.0), "desirable_weight=2.0 applies to the "
                                                    "unpaired losses"),
      (dict(loss="kto", label_smoothing=0.1), "label_smoothing=0.1 applies to the sigmoid"),
  ]:
    with pytest.raises(ValueError, match=message) as err:
      PreferenceConfig(**kwargs)
    assert "\n" not in str(err.value)
  assert PreferenceConfig("kto").needs_reference and PreferenceConfig("kto").unpaired
  assert not PreferenceConfig("sigmoid").unpaired


# -- packing -------------------------------------------------------------------------------


def random_examples(seed, n=7, vocab=CFG.vocab_size):
  """Examples that fit a row of ROW_LEN, with unscored (tool) completion tokens."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    completion = rng.integers(1, vocab, rng.integers(2, 9))
    mask = rng.random(len(completion)) < 0.7
    mask[0] = True
    out.append(dict(prompt_tokens=rng.integers(1, vocab, rng.integers(2, 7)),
                    completion_tokens=completion, completion_mask=mask,
                    label=bool(i % 3 != 1)))
  return out


def direct_sum(prompt, completion, mask, table, row_len=ROW_LEN):
  """Sum over scored completion tokens j of table[token_j, P - 1 + j] (completion token j
  is the target of position P - 1 + j), its tail cut at row_len."""
  completion = np.asarray(completion)[:row_len - len(prompt)]
  mask = np.asarray(mask)[:len(completion)] != 0
  positions = len(prompt) - 1 + np.arange(len(completion))
  return table[completion, positions][mask].sum()


def test_packed_sums_equal_each_examples_own_and_kl_pairs_the_previous_completion():
  examples = random_examples(1, n=11)
  examples[4]["completion_tokens"] = np.arange(1, 40)  # cut to fit the row
  examples[4]["completion_mask"] = np.ones(39, bool)
  batch = kto.pack_examples(examples, ROW_LEN, rows_per_microbatch=2)
  num_micro, rows, length = batch["tokens"].shape
  assert rows == 2 and length == ROW_LEN and num_micro & (num_micro - 1) == 0
  slots = batch["example_mask"].shape[1]
  assert slots & (slots - 1) == 0 and batch["example_mask"].sum() == 11
  assert sorted(batch["example_index"][batch["example_mask"]]) == list(range(11))
  np.testing.assert_array_equal(batch["desirable"][batch["example_mask"]],
                                [examples[i]["label"] for i in
                                 batch["example_index"][batch["example_mask"]]])
  # A value per (token, position): the sum the step forms from the packed batch must be
  # each example's own.
  table = np.random.default_rng(2).normal(size=(CFG.vocab_size, ROW_LEN))

  def values(prefix=""):
    return table[batch[f"{prefix}targets"], batch[f"{prefix}positions"]]

  got = np.full(11, np.nan)
  v = values()
  for m in range(num_micro):
    sums = kto.example_sums(jnp.asarray(np.where(batch["loss_mask"][m], v[m], 0.0)),
                            batch["example_ids"][m], slots)
    for slot, index in enumerate(batch["example_index"][m]):
      if index >= 0:
        got[index] = sums[slot]
  want = [direct_sum(e["prompt_tokens"], e["completion_tokens"], e["completion_mask"], table)
          for e in examples]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # The KL sequences: example i's prompt with example i-1's completion; only their total
  # matters.
  kl_total = np.where(batch["kl_loss_mask"], values("kl_"), 0.0).sum()
  kl_want = sum(direct_sum(e["prompt_tokens"], examples[i - 1]["completion_tokens"],
                           examples[i - 1]["completion_mask"], table)
                for i, e in enumerate(examples))
  np.testing.assert_allclose(kl_total, kl_want, rtol=1e-6)
  assert batch["kl_tokens"].shape[1:] == (rows, ROW_LEN)
  assert int(batch["truncated"]) >= 2  # example 4 and the KL sequence with its completion
  assert "kl_tokens" not in kto.pack_examples(examples, ROW_LEN, rows_per_microbatch=2,
                                              with_kl=False)


def test_hostile_examples_raise_one_line_errors_naming_the_example():
  good = random_examples(3, n=2)
  cases = [
      (dict(good[0], label=1), "example 0: label must be a bool"),
      (dict(good[0], label="yes"), "example 0: label must be a bool"),
      ({k: v for k, v in good[0].items() if k != "label"}, r"example 0: missing \['label'\]"),
      (dict(good[0], prompt_tokens=[]), "example 0: empty prompt_tokens"),
      (dict(good[0], completion_tokens=[]), "example 0: empty completion_tokens"),
      (dict(good[0], completion_tokens=[1.5, 2.0]), "must hold integer token ids"),
      (dict(good[0], completion_mask=[0] * len(good[0]["completion_tokens"])),
       "no scored completion token"),
      (dict(good[0], completion_mask=[1]), "completion_mask has shape"),
      (dict(good[0], prompt_tokens=np.ones(ROW_LEN, int)), "leaves no completion token"),
      (dict(good[0], chosen_tokens=[1]), r"unknown key\(s\) \['chosen_tokens'\]"),
  ]
  for bad, message in cases:
    with pytest.raises(ValueError, match=message) as err:
      kto.pack_examples([bad, good[1]], ROW_LEN, rows_per_microbatch=2)
    assert "\n" not in str(err.value)
  with pytest.raises(ValueError, match="at least 2 examples"):
    kto.pack_examples(good[:1], ROW_LEN, rows_per_microbatch=2)
  kto.pack_examples(good[:1], ROW_LEN, rows_per_microbatch=2, with_kl=False)  # apo_zero
  with pytest.raises(ValueError, match="non-empty sequence of examples"):
    kto.pack_examples([], ROW_LEN, rows_per_microbatch=2)


# -- the step ------------------------------------------------------------------------------


def reference_params(mesh, seed=1):
  """Another random model with 3x sharper logits: it gives random completions lower
  log-probs than the policy does, so KTO's reference point (the policy's mean log-ratio on
  mismatched pairs) is above zero and active."""
  params = state_lib.frozen_copy(fresh_state(CFG, optax.sgd(1.0), mesh, seed=seed).params)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x * 3.0 if "final_norm" in jax.tree_util.keystr(path) else x, params)


def logprobs(params, batch, mesh, prefix=""):
  sub = {k: batch[f"{prefix}{k}"] for k in ("tokens", "targets", "positions", "segment_ids")}
  return np.asarray(ts.make_compute_logprobs(CFG, mesh=mesh)(params, sub)["logprobs"],
                    np.float64)


def with_reference(batch, mesh, reference):
  out = dict(batch, ref_logprobs=logprobs(reference, batch, mesh).astype(np.float32))
  if "kl_tokens" in batch:
    out["kl_ref_logprobs"] = logprobs(reference, batch, mesh, "kl_").astype(np.float32)
  return out


def slot_values(batch, lp):
  """Per real slot: (summed log-prob, label)."""
  out = []
  for m, k in zip(*np.nonzero(batch["example_mask"])):
    scored = batch["loss_mask"][m] & (batch["example_ids"][m] == k)
    out.append((lp[m][scored].sum(), batch["desirable"][m, k]))
  sums, labels = np.array(out).T
  return sums, labels.astype(bool)


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_loss_is_the_loss_of_the_models_logprobs(case):
  cfg = CASES[case]
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  state = fresh_state(CFG, optimizer, mesh)
  reference = reference_params(mesh)
  batch = kto.pack_examples(random_examples(5, n=7), ROW_LEN, rows_per_microbatch=2,
                            with_kl=kto.needs_kl(cfg))
  batch = with_reference(batch, mesh, reference)
  policy_lp = logprobs(state.params, batch, mesh)
  policy_kl = logprobs(state.params, batch, mesh, "kl_") if "kl_tokens" in batch else None
  _, metrics = ts.make_preference_step(CFG, cfg, optimizer, mesh=mesh)(state, batch)

  pi, desirable = slot_values(batch, policy_lp)
  ref, _ = slot_values(batch, batch["ref_logprobs"].astype(np.float64))
  kl_args = ()
  if kto.needs_kl(cfg):
    kl_mask = batch["kl_loss_mask"]
    kl_args = (policy_kl[kl_mask].sum() / 7,
               batch["kl_ref_logprobs"][kl_mask].sum() / 7)
  want, z0 = oracle_losses(cfg, pi, ref, desirable, *kl_args)
  assert cfg.loss != "kto" or z0 > 0  # two random models: the reference point is active
  np.testing.assert_allclose(metrics["loss"], want.mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["kl"], z0, rtol=1e-4, atol=1e-6)
  rewards = cfg.beta * (pi - ref)
  np.testing.assert_allclose(metrics["rewards/margin"],
                             rewards[desirable].mean() - rewards[~desirable].mean(), rtol=1e-4)
  np.testing.assert_allclose(metrics["logps/chosen"], pi[desirable].mean(), rtol=1e-5)
  assert float(metrics["examples"]) == 7 and float(metrics["desirable"]) == desirable.sum()
  assert float(metrics["nonfinite"]) == 0


def one_update(cfg, mesh, batch, *, reference_in_step=False, reference=None, steps=1):
  optimizer = optax.sgd(1.0)  # the parameter change is the gradient itself
  step = ts.make_preference_step(CFG, cfg, optimizer, mesh=mesh,
                                 reference_in_step=reference_in_step)
  state = fresh_state(CFG, optimizer, mesh)
  start = state_lib.frozen_copy(state.params)  # the step donates the state
  for _ in range(steps):
    state, metrics = step(state, batch, reference) if reference_in_step else step(state, batch)
  return jax.tree.map(np.subtract, state.params, start), metrics


def assert_metrics_close(a, b, rtol=1e-5):
  assert set(a) == set(b)
  for name in a:
    np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=1e-6, err_msg=name)


def test_more_microbatches_give_the_same_update_and_reference_point():
  """All seven examples in one micro-batch, or one row per micro-batch: the reference
  point is the whole batch's either way, so loss, metrics and gradient are the same."""
  cfg = PreferenceConfig("kto", beta=0.5, undesirable_weight=1.3)
  mesh = one_device_mesh()
  reference = reference_params(mesh)
  examples = random_examples(6, n=7)
  batches = [kto.pack_examples(examples, ROW_LEN, rows_per_microbatch=rows)
             for rows in (8, 1)]
  assert batches[0]["tokens"].shape[0] == 1 and batches[1]["tokens"].shape[0] >= 2
  assert batches[1]["kl_tokens"].shape[0] >= 2
  results = [one_update(cfg, mesh, with_reference(b, mesh, reference)) for b in batches]
  (delta_one, metrics_one), (delta_many, metrics_many) = results
  assert float(metrics_one["kl"]) > 0
  assert np.abs(delta_one["embed"][...]).max() > 1e-4
  assert_trees_close(delta_many, delta_one, atol=1e-6)
  assert_metrics_close(metrics_many, metrics_one)


def test_reference_in_step_matches_precomputed_reference_logprobs():
  cfg = PreferenceConfig("kto", beta=0.5)
  mesh = one_device_mesh()
  reference = reference_params(mesh)
  before = snapshot(reference)
  batch = kto.pack_examples(random_examples(8, n=6), ROW_LEN, rows_per_microbatch=2)
  delta_in, metrics_in = one_update(cfg, mesh, batch, reference_in_step=True,
                                    reference=reference)
  delta_out, metrics_out = one_update(cfg, mesh, with_reference(batch, mesh, reference))
  assert float(metrics_in["kl"]) > 0
  assert_trees_close(delta_in, delta_out, atol=1e-6)
  assert_metrics_close(metrics_in, metrics_out)
  for x, y in zip(snapshot(reference), before, strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_eight_devices_match_one_device():
  """data 2 x fsdp 2 x tensor 2: two SGD steps equal one device's."""
  cfg = PreferenceConfig("kto", beta=0.5)
  batch = kto.pack_examples(random_examples(7, n=9), ROW_LEN, rows_per_microbatch=4)
  results = []
  for mesh in (one_device_mesh(), models.make_mesh((2, 2, 2, 1))):
    results.append(one_update(cfg, mesh, with_reference(batch, mesh, reference_params(mesh)),
                              steps=2))
  (delta_1, metrics_1), (delta_8, metrics_8) = results
  assert np.abs(delta_1["embed"][...]).max() > 1e-4
  assert_trees_close(delta_8, delta_1, atol=1e-5, rtol=1e-4)
  assert_metrics_close(metrics_8, metrics_1, rtol=1e-4)


def test_lora_kto_starts_at_one_half_and_learns_the_labels():
  """With LoRA the reference is the base (B starts at zero: r = 0, z0 = 0, each loss 1/2);
  Adam steps then raise the desirable completions' log-ratios above the undesirable ones',
  judged by fresh log-probs, while the base weights stay put."""
  cfg = PreferenceConfig("kto", beta=0.5)
  lora_cfg = CFG.replace(lora_rank=4, lora_alpha=8.0)
  mesh = one_device_mesh()
  optimizer = state_lib.make_optimizer(3e-2, warmup=0, total_steps=15)
  state = state_lib.init_train_state(models.create_model(lora_cfg), optimizer, mesh=mesh)
  base = snapshot(state_lib.split_trainable(state.params)[1])
  step = ts.make_preference_step(lora_cfg, cfg, optimizer, mesh=mesh, reference_in_step=True)
  batch = kto.pack_examples(random_examples(9, n=6), ROW_LEN, rows_per_microbatch=2)
  history = []
  for _ in range(15):
    state, metrics = step(state, batch)
    history.append({k: float(v) for k, v in metrics.items()})
  np.testing.assert_allclose(history[0]["loss"], 0.5, rtol=1e-6)
  assert history[0]["kl"] == 0.0 and history[0]["rewards/margin"] == 0.0
  assert history[-1]["loss"] < 0.8 * 0.5 and history[-1]["rewards/margin"] > 0
  for a, b in zip(snapshot(state_lib.split_trainable(state.params)[1]), base, strict=True):
    np.testing.assert_array_equal(a, b)
  compute = ts.make_compute_logprobs(lora_cfg, mesh=mesh)
  sub = {k: batch[k] for k in ("tokens", "targets", "positions", "segment_ids")}
  pi, desirable = slot_values(batch, np.asarray(compute(state.params, sub)["logprobs"]))
  ref, _ = slot_values(batch, np.asarray(compute(models.without_lora(state.params),
                                                 sub)["logprobs"]))
  assert (pi - ref)[desirable].min() > (pi - ref)[~desirable].max()
  assert step.jitted._cache_size() == 1


def test_step_misuse_raises():
  mesh = one_device_mesh()
  optimizer = optax.sgd(1.0)
  state = fresh_state(CFG, optimizer, mesh)
  batch = kto.pack_examples(random_examples(0, n=2), ROW_LEN, rows_per_microbatch=2)
  step = ts.make_preference_step(CFG, PreferenceConfig("kto"), optimizer, mesh=mesh)
  with pytest.raises(ValueError, match=r"missing \['ref_logprobs', 'kl_ref_logprobs'\]"):
    step(state, batch)
  batch = with_reference(batch, mesh, reference_params(mesh))
  with pytest.raises(ValueError, match=r"batch\['example_ids'\] has shape"):
    step(state, dict(batch, example_ids=batch["example_ids"][..., :-1]))
  with pytest.raises(ValueError, match=r"example_mask'\] must be \[microbatches, slots\]"):
    step(state, dict(batch, example_mask=batch["example_mask"][0]))
  with pytest.raises(ValueError, match=r"batch\['kl_targets'\] has shape"):
    step(state, dict(batch, kl_targets=batch["kl_targets"][..., :-1]))
  apo = kto.pack_examples(random_examples(0, n=2), ROW_LEN, rows_per_microbatch=2,
                          with_kl=False)
  with pytest.raises(ValueError, match=r"missing \['kl_tokens'"):
    step(state, with_reference(apo, mesh, reference_params(mesh)))
