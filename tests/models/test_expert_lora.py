"""LoRA adapters on a mixture's routed experts (experts_gate_up_proj, experts_down_proj;
experts_up_proj on experts without a gate): each expert's update against a numpy merge,
both layer layouts, folding, the parameter count, sharded and expert-parallel runs and
their gradients against one device, the sampler's padded copy, and configs that cannot
hold them."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import transformer as tr
from posttrain.models.config import DEFAULT_LORA_TARGETS
from tests.models.test_expert_parallel import CFG as EP_CFG
from tests.models.test_expert_parallel import NEMOTRON3 as EP_NEMOTRON3
from tests.models.test_expert_parallel import SHARED, _assert_same, _rules, _run
from tests.tpu_aot import requires_libtpu

EXPERT_TARGETS = "experts_gate_up_proj,experts_down_proj"
CFG = models.get_preset("tiny").replace(
    vocab_size=263, d_model=48, num_heads=6, num_kv_heads=3, head_dim=8, ffn_dim=40,
    num_layers=2, tie_embeddings=False, qk_norm=True, num_experts=5, num_experts_per_tok=2,
    architecture="Qwen3MoeForCausalLM", init_std=0.2, lora_rank=3, lora_alpha=6.0,
    lora_targets="q_proj," + EXPERT_TARGETS)
# Experts without a gate (relu^2, Nemotron 3's) in a latent of their own.
UNGATED_TARGETS = "experts_up_proj,experts_down_proj"
UNGATED = CFG.replace(mlp_activation="relu2", moe_latent_dim=24, qk_norm=False,
                      lora_targets="q_proj," + UNGATED_TARGETS)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 263, (3, 13)), jnp.int32)
logits = nnx.jit(lambda m, t: m(t))


def _randomised(model, seed=0):
  """Nonzero B (zero at init), so that every adapter changes the function."""
  rng = np.random.default_rng(seed)
  for path, v in nnx.iter_graph(model):
    if isinstance(v, nnx.LoRAParam) and path[-1].endswith("_b"):
      v[...] = jnp.asarray(rng.normal(0, 0.2, v.shape), v.dtype)
  return model


def _numpy_merged(model):
  """The base model with each expert e's W + s A_e B_e (gate and up from one B's two
  halves; experts without a gate up's own) and q_proj's update, merged in numpy."""
  cfg, s = model.cfg, model.cfg.lora_scale
  pure = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model)))  # writable copies
  for layer in pure["layers"].values():
    mlp, attn = layer["mlp"], layer["attn"]
    if "experts_up_proj_lora_a" in mlp:
      a, b = mlp.pop("experts_up_proj_lora_a"), mlp.pop("experts_up_proj_lora_b")
      for e in range(cfg.num_experts):
        mlp["up_proj"][e] += s * a[e].T @ b[e]
    else:
      a, b = mlp.pop("experts_gate_up_proj_lora_a"), mlp.pop("experts_gate_up_proj_lora_b")
      for e in range(cfg.num_experts):
        mlp["gate_proj"][e] += s * a[e].T @ b[e, :, 0]
        mlp["up_proj"][e] += s * a[e].T @ b[e, :, 1]
    a, b = mlp.pop("experts_down_proj_lora_a"), mlp.pop("experts_down_proj_lora_b")
    mlp["down_proj"] += s * np.einsum("ERF,ERD->EFD", a, b)
    a, b = attn.pop("q_proj_lora_a"), attn.pop("q_proj_lora_b")
    attn["q_proj"] += s * np.einsum("DR,RNH->DNH", a, b)
  plain = models.create_model(cfg.replace(lora_rank=0))
  state = nnx.state(plain)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(plain, state)
  return plain


@pytest.fixture(scope="module")
def model():
  return _randomised(models.create_model(CFG, seed=1))


def test_each_expert_adds_its_own_update_in_both_layouts(model, monkeypatch):
  mlp = model.layers[0].mlp
  assert mlp.experts_gate_up_proj_lora_a.shape == (5, 3, 48)  # the rank off the minor axis
  assert mlp.experts_gate_up_proj_lora_b.shape == (5, 3, 2, 40)
  assert mlp.experts_down_proj_lora_a.shape == (5, 3, 40)
  assert mlp.experts_down_proj_lora_b.shape == (5, 3, 48)
  assert CFG.num_lora_params == sum(
      x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  fresh = models.create_model(CFG, seed=1)  # B zero: the adapted model is the base
  np.testing.assert_array_equal(logits(fresh, TOKENS), logits(models.merge_lora(fresh), TOKENS))
  _assert_the_numpy_merge(model, logits(fresh, TOKENS), "experts_down_proj_lora_b",
                          ("layers", "experts", "lora", "embed"), monkeypatch)


def _assert_the_numpy_merge(model, base_logits, leaf, axes, monkeypatch):
  """The adapted model's logits move off `base_logits` and are the numpy merge's:
  merged, through either path of A, scanned (its `leaf` stacked with logical `axes`) and
  folded (that B zero after)."""
  want = logits(_numpy_merged(model), TOKENS)
  got = logits(model, TOKENS)
  assert float(jnp.abs(got - base_logits).max()) > 0.1
  np.testing.assert_allclose(got, want, atol=2e-5)
  np.testing.assert_allclose(logits(models.merge_lora(model), TOKENS), want, atol=2e-5)
  # These few rows gather each row's A; many rows (prefill, training) run a grouped matmul.
  with monkeypatch.context() as patch:
    patch.setattr(tr, "_GATHERED_A_BYTES", 0)
    np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(model, TOKENS), want, atol=2e-5)
  scanned = models.relayout(model, scan_layers=True)
  assert getattr(scanned.layers.mlp, leaf).get_metadata()["logical_axes"] == axes
  np.testing.assert_allclose(logits(scanned, TOKENS), want, atol=2e-5)
  folded = models.fold_lora(scanned, jax.random.key(3))  # the update in the base, B zero
  assert not np.any(np.asarray(getattr(folded.layers.mlp, leaf)[...]))
  np.testing.assert_allclose(logits(folded, TOKENS), want, atol=2e-5)


def test_experts_without_a_gate_adapt_up_and_down(monkeypatch):
  """relu^2 experts in a latent of 24 (Nemotron 3 Super's): up's adapter [E, r, L] /
  [E, r, F] and down's [E, r, F] / [E, r, L], each expert's update the numpy merge's,
  unrolled, scanned, through either path of A, and folded."""
  model = _randomised(models.create_model(UNGATED, seed=1))
  mlp = model.layers[0].mlp
  assert not hasattr(mlp, "gate_proj") and not hasattr(mlp, "experts_gate_up_proj_lora_a")
  assert mlp.experts_up_proj_lora_a.shape == (5, 3, 24)
  assert mlp.experts_up_proj_lora_b.shape == (5, 3, 40)
  assert mlp.experts_down_proj_lora_a.shape == (5, 3, 40)
  assert mlp.experts_down_proj_lora_b.shape == (5, 3, 24)
  assert UNGATED.lora_target_names == ("q_proj", "experts_up_proj", "experts_down_proj")
  assert UNGATED.num_lora_params == sum(
      x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  base = logits(models.merge_lora(models.create_model(UNGATED, seed=1)), TOKENS)
  _assert_the_numpy_merge(model, base, "experts_up_proj_lora_b",
                          ("layers", "experts", "lora", "mlp"), monkeypatch)


def test_gated_experts_in_a_latent_take_adapters_of_its_width():
  model = _randomised(models.create_model(CFG.replace(moe_latent_dim=24), seed=1))
  assert model.layers[0].mlp.experts_gate_up_proj_lora_a.shape == (5, 3, 24)
  assert model.layers[0].mlp.experts_down_proj_lora_b.shape == (5, 3, 24)
  np.testing.assert_allclose(logits(model, TOKENS), logits(models.merge_lora(model), TOKENS),
                             atol=2e-5)


def test_a_mixture_with_a_shared_expert_adapts_both():
  """DeepSeek-V3-like (a leading dense layer, a shared expert): the MLP targets adapt the
  dense MLPs and the shared expert, the expert targets the routed experts alone."""
  cfg = SHARED.replace(lora_rank=2, lora_targets="down_proj," + EXPERT_TARGETS)
  m = _randomised(models.create_model(cfg, seed=1))
  assert hasattr(m.dense_layers[0].mlp, "down_proj_lora_a")
  assert not hasattr(m.dense_layers[0].mlp, "experts_down_proj_lora_a")
  assert hasattr(m.layers[0].mlp.shared, "down_proj_lora_a")
  assert m.layers[0].mlp.experts_down_proj_lora_a.shape == (8, 2, 16)
  assert cfg.num_lora_params == sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.LoRAParam)))
  tokens = TOKENS % cfg.vocab_size
  np.testing.assert_allclose(logits(m, tokens), logits(models.merge_lora(m), tokens), atol=2e-5)


# F split over tensor beside fsdp; the experts split over fsdp (expert parallelism). Each
# with the rows' A gathered (few rows) and through a grouped matmul (many). Nemotron 3's
# experts (no gate, a latent; Mamba2 and attention layers of their own, scanned) too.
F_SPLIT, EXPERT_PARALLEL = ((1, 2, 4, 1), None), ((1, 4, 2, 1), ("fsdp",))


@pytest.mark.parametrize("shape,axes,grouped,ungated", [
    (*F_SPLIT, False, False), (*F_SPLIT, True, False), (*EXPERT_PARALLEL, False, False),
    (*EXPERT_PARALLEL, True, False), (*F_SPLIT, True, True), (*EXPERT_PARALLEL, False, True),
], ids=["f_split-gathered_a", "f_split-grouped_a", "expert_parallel-gathered_a",
        "expert_parallel-grouped_a", "nemotron3-f_split-grouped_a",
        "nemotron3-expert_parallel-gathered_a"])
def test_on_a_mesh_the_step_and_its_gradients_equal_one_device(shape, axes, grouped,
                                                               ungated, monkeypatch):
  """Loss, logits, the router loss and every gradient (the adapters' and the base's): one
  device's, with the experts' F split over tensor and with the experts split over E."""
  if grouped:
    monkeypatch.setattr(tr, "_GATHERED_A_BYTES", 0)
  base, targets = ((EP_NEMOTRON3, "in_proj," + UNGATED_TARGETS) if ungated else
                   (EP_CFG, "q_proj," + EXPERT_TARGETS))
  model = _randomised(models.create_model(base.replace(lora_rank=2, lora_targets=targets),
                                          seed=1))
  want = _run(model)
  lora = want[3]["moe_layers" if ungated else "layers"]
  lora = lora["mlp"] if ungated else lora[0]["mlp"]
  up = "experts_up_proj_lora_a" if ungated else "experts_gate_up_proj_lora_a"
  assert float(np.abs(lora[up]).max()) > 0
  assert float(np.abs(lora["experts_down_proj_lora_b"]).max()) > 0
  mesh = models.make_mesh(shape)
  _assert_same(_run(model, mesh, models.DEFAULT_RULES if axes is None else _rules(*axes)),
               want)


def test_the_sampler_pads_the_adapters_with_the_experts(model):
  """Experts 40 wide over tensor 2 (20 a device) and D 48, no multiples of 128: the
  sampler's gathered copy pads each device's slice of F with zeros to 128, and the down
  experts' D too (XLA:TPU otherwise keeps relaid copies of them through the decode
  loop), the adapters where they meet F or D alike, and samples what one device does."""
  from posttrain.sampling import Sampler
  prompts = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 37)), [3, 3, 3, 8]]
  sampler = Sampler(model, mesh=models.make_mesh((1, 4, 2, 1)), max_len=40)
  mlp = sampler._weights()["layers"][0]["mlp"]
  assert mlp["gate_proj"].shape == mlp["up_proj"].shape == (5, 48, 256)  # 5 experts
  assert mlp["down_proj"].shape == (5, 256, 128)
  gate = np.asarray(mlp["gate_proj"]).reshape(5, 48, 2, 128)
  np.testing.assert_array_equal(gate[..., 20:], 0.0)  # each device's padding
  np.testing.assert_array_equal(gate[..., :20].reshape(5, 48, 40),
                                np.asarray(model.layers[0].mlp.gate_proj[...]))
  assert mlp["experts_gate_up_proj_lora_b"].shape == (5, 3, 2, 256)
  assert mlp["experts_down_proj_lora_a"].shape == (5, 3, 256)
  assert mlp["experts_down_proj_lora_b"].shape == (5, 3, 128)
  b = np.asarray(mlp["experts_gate_up_proj_lora_b"]).reshape(5, 3, 2, 2, 128)
  np.testing.assert_array_equal(b[..., 20:], 0.0)
  np.testing.assert_array_equal(
      b[..., :20].reshape(5, 3, 2, 40),
      np.asarray(model.layers[0].mlp.experts_gate_up_proj_lora_b[...]))
  one = Sampler(model, max_len=40)
  for temperature in (0.0, 1.0):
    got = sampler.generate(prompts, max_new_tokens=8, temperature=temperature, seed=3)
    want = one.generate(prompts, max_new_tokens=8, temperature=temperature, seed=3)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


def test_the_sampler_pads_ungated_adapters_with_the_experts():
  """Experts without a gate in a latent of 24, F 40 over tensor 2: up's B pads over F as
  up does, down's A over F and B over the latent as down does; the samples are one
  device's."""
  from posttrain.sampling import Sampler
  model = _randomised(models.create_model(UNGATED, seed=1))
  prompts = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 37))]
  sampler = Sampler(model, mesh=models.make_mesh((1, 4, 2, 1)), max_len=32)
  mlp = sampler._weights()["layers"][0]["mlp"]
  assert mlp["up_proj"].shape == (5, 24, 256) and mlp["down_proj"].shape == (5, 256, 128)
  assert mlp["experts_up_proj_lora_a"].shape == (5, 3, 24)
  assert mlp["experts_up_proj_lora_b"].shape == (5, 3, 256)
  assert mlp["experts_down_proj_lora_a"].shape == (5, 3, 256)
  assert mlp["experts_down_proj_lora_b"].shape == (5, 3, 128)
  b = np.asarray(mlp["experts_up_proj_lora_b"]).reshape(5, 3, 2, 128)
  np.testing.assert_array_equal(b[..., 20:], 0.0)
  np.testing.assert_array_equal(b[..., :20].reshape(5, 3, 40),
                                np.asarray(model.layers[0].mlp.experts_up_proj_lora_b[...]))
  got = sampler.generate(prompts, max_new_tokens=6, temperature=1.0, seed=3)
  want = Sampler(model, max_len=32).generate(prompts, max_new_tokens=6, temperature=1.0,
                                             seed=3)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


def test_gpt_oss_expert_adapters_are_refused_as_peft_files_and_export_merged(tmp_path):
  """gpt-oss's gate_up_proj interleaves gate and up [E, D, 2F]: its expert adapters
  train and merge, but PEFT files of them are refused by name."""
  from tests.models.test_expert_parallel import BIASED
  cfg = BIASED.replace(lora_rank=2, lora_targets="experts_gate_up_proj")
  m = _randomised(models.create_model(cfg, seed=1))
  tokens = TOKENS % cfg.vocab_size
  np.testing.assert_allclose(logits(m, tokens), logits(models.merge_lora(m), tokens), atol=2e-5)
  with pytest.raises(ValueError, match="GptOssForCausalLM with routed-expert targets "
                     r"\['experts_gate_up_proj'\] are not written or read"):
    models.save_lora_adapter(m, str(tmp_path))


def test_expert_targets_need_experts():
  dense = models.get_preset("tiny")
  with pytest.raises(ValueError, match=r"lora_targets \['experts_down_proj'\] adapt a "
                     r"mixture's routed experts, but this model has none"):
    dense.replace(lora_rank=2, lora_targets="q_proj,experts_down_proj")
  with pytest.raises(ValueError, match=r"lora_targets \['experts_up_proj'\] adapt experts "
                     "without a gate .*: use experts_gate_up_proj and experts_down_proj"):
    CFG.replace(lora_targets="experts_up_proj")
  with pytest.raises(ValueError, match=r"lora_targets \['experts_gate_up_proj'\]: this "
                     "model's experts have no gate .*; use experts_up_proj and "
                     "experts_down_proj"):
    UNGATED.replace(lora_targets="experts_gate_up_proj,experts_down_proj")
  with pytest.raises(ValueError, match="expected a comma-separated subset"):
    CFG.replace(lora_targets="experts_gate_proj")
  # Never a default: a mixture's default targets leave the routed experts alone.
  assert CFG.replace(lora_targets=DEFAULT_LORA_TARGETS).lora_target_names == (
      "q_proj", "k_proj", "v_proj", "o_proj")


def test_the_train_step_moves_the_expert_adapters_alone():
  """GRPO with a KL term on (data 1, fsdp 2, tensor 2): AdamW holds moments for the
  adapters alone, every adapter moves and every base weight, experts included, stays."""
  from posttrain.rl import presets
  from posttrain.rl import state as state_lib
  from posttrain.rl import train_step as ts
  from tests.rl.test_train_step import CFG as STEP_CFG
  from tests.rl.test_train_step import microbatched, packed_rows
  cfg = EP_CFG.replace(vocab_size=STEP_CFG.vocab_size, lora_rank=2,
                       lora_targets=EXPERT_TARGETS)
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  opt = state_lib.make_optimizer(3e-2, warmup=0, total_steps=10, weight_decay=0.01)
  state = state_lib.init_train_state(models.create_model(cfg, mesh=mesh), opt, mesh=mesh)
  assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim) == (
      2 * cfg.num_lora_params)
  step = ts.make_train_step(cfg, presets.algorithm_config("grpo", kl_coef=0.5), opt,
                            mesh=mesh, reference_in_step=True)
  batch = microbatched(packed_rows(0), 2)
  adapters, base = (
      [np.asarray(x) for x in jax.tree.leaves(t)]  # copies: the step donates the state
      for t in state_lib.split_trainable(state.params))
  for _ in range(2):  # the first step moves A's alone (B is zero), the second both
    state, metrics = step(state, batch)
  assert float(metrics["kl"]) > 0
  after, after_base = state_lib.split_trainable(state.params)
  for a, b in zip(adapters, jax.tree.leaves(after), strict=True):
    assert not np.array_equal(a, np.asarray(b))
  for a, b in zip(base, jax.tree.leaves(after_base), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))


@requires_libtpu
def test_the_adapters_compile_to_grouped_kernels_for_tpu(monkeypatch):
  """For a TPU (v5e 2x2, F over tensor) the experts' adapters run as grouped matmuls as
  the experts do, their weight gradients this project's Pallas kernel: no product over
  every expert's rows appears, rank 16 blocks included."""
  monkeypatch.setattr(tr, "_GATHERED_A_BYTES", 0)  # the many rows of a training step
  from jax.sharding import PartitionSpec as P
  from tests.tpu_aot import compile_for, spec, tpu_mesh
  mesh = tpu_mesh("v5e", (2, 2), ("fsdp", "tensor"))
  e, n, d, f, r, k = 16, 1024, 256, 256, 16, 2
  specs = (P("fsdp"), P("fsdp"), P("fsdp"), P(None, None, "tensor"), P(None, None, "tensor"),
           P(None, "tensor", None), P(), P(None, None, None, "tensor"), P(None, None, "tensor"),
           P())

  def loss(*args):
    def local(x, weights, experts, gate, up, down, ga, gb, da, db):
      y = tr.expert_mlps(jax.lax.pcast(x, ("tensor",), to="varying"), weights, experts, gate,
                         up, down, lora={"gate_up": (ga, gb), "down": (da, db)},
                         lora_scale=2.0)
      return jax.lax.psum(jnp.sum(y), ("fsdp", "tensor"))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())(*args)

  bf = jnp.bfloat16
  shapes = [((2 * n, d), bf), ((2 * n, k), jnp.float32), ((2 * n, k), jnp.int32),
            ((e, d, f), bf), ((e, d, f), bf), ((e, f, d), bf), ((e, r, d), bf),
            ((e, r, 2, f), bf), ((e, r, f), bf), ((e, r, d), bf)]
  compiled = compile_for(mesh, jax.grad(loss, argnums=(0, 6, 7, 8, 9)),
                         *(spec(mesh, s, dt, p) for (s, dt), p in zip(shapes, specs)))
  text = compiled.as_text()
  # The experts' forward and input gradient (XLA's kernel), the adapters' four weight
  # gradients (ours): 9 kernels without adapters, as many again with them.
  assert len(re.findall(r"custom_call_target=\"tpu_custom_call\"", text)) >= 13
  assert not re.search(rf"\[{e},{n * k},", text)  # no [experts, rows, ...] expansion
