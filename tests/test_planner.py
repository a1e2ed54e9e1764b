"""The memory planner against real arrays on 8 fake devices, JAX's own count of saved
residuals, hand arithmetic for the KV cache, and the shipped real-scale configs."""

import glob
import importlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # The oracle of what backward keeps.

from configs import default
from posttrain import experiment, models, planner
from posttrain.rl import state as rl_state
from posttrain.rl import train_step as ts
from posttrain.sampling import Sampler
from posttrain.sampling import sampler as sampler_lib
from posttrain.sampling.sampler import default_length_bucket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Configs for real hardware carry the plan command (and the device memory) in their docstring.
REAL_CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                      if "python -m launch.plan" in pathlib.Path(p).read_text())


def _config(**changes):
  return planner.override(default.get_config(), changes)


def _assert_mixture_share_exact(cfg, widths):
  """What JAX keeps for `cfg` (a mixture, 4 rows of 128 on one device) against the plan:
  the whole within 10%, the mixture's share (less a dense twin's) exact."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  kept, planned = [], []
  for c in (cfg, _dense_twin(cfg, **widths)):
    kept.append(sum(n for n, _, _ in _residuals(c, 4, 128)))
    planned.append(planner.saved_activation_bytes(c, rows=4, row_len=128, mesh=one_device))
  assert planned[0] == pytest.approx(kept[0], rel=0.1)
  assert planned[0] - planned[1] == kept[0] - kept[1]


def _real_train_state(config, shape=(1, 8, 1, 1)):
  """(mesh, model config, train state): what the trainer builds for `config` on a mesh
  of `shape`."""
  mesh = models.make_mesh(shape)
  cfg = experiment.model_config(config)
  o = config.optim
  optimizer = rl_state.make_optimizer(o.lr, o.warmup, 100, o.weight_decay, o.clip)
  return mesh, cfg, rl_state.init_train_state(models.create_model(cfg, mesh=mesh), optimizer,
                                              mesh=mesh)


def _real_per_device_bytes(tree) -> int:
  """Bytes on the fullest device, summed over every array's addressable shards."""
  per_device: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values())


# Odd widths: 6 heads, 2 kv heads and ffn 160 divide some mesh axes and not others, so
# some weights shard and some replicate.
TINY = {"model.overrides.num_layers": 2, "model.overrides.d_model": 96,
        "model.overrides.ffn_dim": 160, "model.overrides.num_heads": 6,
        "model.overrides.num_kv_heads": 2, "model.overrides.head_dim": 16}


@pytest.mark.parametrize("mesh, param_dtype", [
    ((1, 8, 1, 1), "float32"),
    ((2, 2, 2, 1), "float32"),
    ((1, 2, 4, 1), "bfloat16"),   # 2 kv heads on 4-way tensor: replicated
    pytest.param((8, 1, 1, 1), "float32",  # data parallel only: everything replicated
                 marks=pytest.mark.slow),
])
def test_params_and_optimizer_bytes_match_real_arrays_on_8_devices(mesh, param_dtype):
  config = _config(**TINY, **{"model.overrides.param_dtype": param_dtype,
                              **dict(zip(("mesh.data", "mesh.fsdp", "mesh.tensor",
                                          "mesh.sequence"), mesh))})
  p = planner.plan(config)
  assert p.mesh == dict(zip(models.MESH_AXES, mesh))
  # What the trainer builds: a sharded model, then the train state on the same mesh.
  real_mesh, cfg, state = _real_train_state(config, mesh)
  real_params = _real_per_device_bytes(state.params)
  real_opt = _real_per_device_bytes(state.opt_state)
  assert p["params"] == pytest.approx(real_params, rel=0.05)
  assert p["optimizer"] == pytest.approx(real_opt, rel=0.05)
  # Colocated, the trainer's Sampler holds its own copy (never an alias), in both peaks.
  model = models.create_model(cfg, mesh=real_mesh)
  sampler = Sampler(model, mesh=real_mesh, max_len=64)
  assert p["sampler"] == pytest.approx(_real_per_device_bytes(sampler._state), rel=0.05)
  assert p.train_peak == sum(p[k] for k in ("params", "optimizer", "reference", "sampler",
                                            "gradients", "activations", "batch"))
  if mesh[1] == 8:  # pure FSDP divides every matrix: exact, and 1/8 of the total
    assert p["params"] == real_params
    total = sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert total / 8 <= p["params"] < total / 8 * 1.05


def test_a_colocated_lora_sampler_is_planned_as_the_adapters_it_copies():
  """Colocated with LoRA, the trainer's Sampler holds the learner's frozen base itself
  (`Trainer._shared_base`): its own arrays are the adapters, which the plan counts; the
  sampling programs' argument includes the base, so the learner's share outside them
  is less it."""
  config = _config(**TINY, **{"model.overrides.lora_rank": 4, "mesh.fsdp": 8,
                              "rollout.gather_weights": False})
  p = planner.plan(config)
  real_mesh, cfg, state = _real_train_state(config)
  frozen = rl_state.split_trainable(state.params)[1]
  graphdef, _, rest = ts._split_abstract(cfg)
  sampler = Sampler(nnx.merge(graphdef, state.params, rest), mesh=real_mesh, max_len=64,
                    share=frozen)
  learner = {id(x) for x in jax.tree.leaves(state.params)}
  own = [x for x in jax.tree.leaves(sampler._state) if id(x) not in learner]
  assert p["sampler"] == _real_per_device_bytes(own) > 0
  assert p["sampler"] < p["params"] / 3
  base = p["params"] - p["sampler"]
  assert base == _real_per_device_bytes(frozen)
  assert planner.resident_outside_programs(p, config)[1][0] == (
      p["params"] + p["optimizer"] + p["reference"] - base)


def test_disaggregated_sampler_weights_match_real_arrays_on_the_rollout_mesh():
  config = _config(**TINY, **{"placement.mode": "disaggregated", "placement.rollout_devices": 2,
                              "train.rows_per_microbatch": 6})
  p = planner.plan(config, num_devices=8)
  assert p.placement == "disaggregated"
  assert p.mesh["fsdp"] == 6 and p.rollout_mesh["fsdp"] == 2
  train_mesh, rollout_mesh = experiment.build_meshes(config)
  model = models.create_model(experiment.model_config(config), mesh=train_mesh)
  # What the Sampler holds: the model's state resharded onto the rollout mesh.
  on_rollout = nnx.state(models.shard_model(model, rollout_mesh))
  assert p["sampler"] == pytest.approx(_real_per_device_bytes(on_rollout), rel=0.05)
  assert p["params"] == pytest.approx(
      _real_per_device_bytes(nnx.state(model, nnx.Param)), rel=0.05)
  # The copy a generate call gathers over the batch axes, as the Sampler makes it.
  sampler = Sampler(models.shard_model(model, rollout_mesh), mesh=rollout_mesh, max_len=64)
  assert p["gathered"] == pytest.approx(_real_per_device_bytes(sampler._weights()), rel=0.05)
  assert p["gathered"] > p["sampler"]  # replicated over the rollout mesh's fsdp axis
  # Each side peaks on its own devices; the KV cache is not on the train devices.
  assert p.rollout_peak == p["sampler"] + p["gathered"] + p["kv_cache"] + max(
      p["prefill"], p["decode_step"])
  assert p.train_peak == sum(p[k] for k in ("params", "optimizer", "reference", "gradients",
                                            "activations", "batch"))


def test_a_mesh_bigger_than_the_machine_plans_without_devices():
  p = planner.plan(_config(**{"model.preset": "llama3_8b",
                              "model.overrides": {"scan_layers": True},  # traces one layer
                              "train.rows_per_microbatch": 512}), num_devices=512)
  assert p.mesh["fsdp"] == 512 and len(jax.devices()) == 8
  # Matrices split 512 ways; the replicated norm scales add under 2%.
  assert 16.06e9 / 512 <= p["params"] < 16.06e9 / 512 * 1.02


@pytest.mark.parametrize("dtype, impl, remat", [
    ("float32", "reference", "none"),
    ("bfloat16", "chunked", "dots"),
    ("float32", "chunked", "dots_with_no_batch_dims"),
    ("bfloat16", "reference", "dots"),
    ("bfloat16", "flash", "full"),
    ("float32", "flash", "none"),
])
def test_saved_activations_match_what_jax_keeps_for_backward(dtype, impl, remat):
  cfg = models.get_preset("tiny", num_layers=3, d_model=96, ffn_dim=160, num_heads=6,
                          num_kv_heads=2, head_dim=16, remat=remat, attention_impl=impl,
                          attention_chunk=32, logprob_chunk=64, dtype=dtype, param_dtype=dtype)
  graphdef, params, rest = nnx.split(
      nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  rows, length = 4, 128

  def loss(params, tokens):
    model = nnx.merge(graphdef, params, rest)
    return model.token_logprobs(tokens, tokens).sum()

  kept = sum(math.prod(aval.shape) * aval.dtype.itemsize
             for aval, src in saved_residuals(loss, params,
                                              jax.ShapeDtypeStruct((rows, length), jnp.int32))
             if "from the argument" not in src)
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  estimate = planner.saved_activation_bytes(cfg, rows=rows, row_len=length, mesh=one_device)
  assert estimate == pytest.approx(kept, rel=0.1)


GEMMA2 = dict(norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
              mlp_activation="gelu_tanh", query_pre_attn_scalar=16.0, attn_logit_softcap=50.0,
              final_logit_softcap=30.0, sliding_window=32,
              layer_types=("sliding_attention", "full_attention", "sliding_attention"))


OLMO2 = dict(output_norms=True, qk_norm=True, qk_norm_heads=True, qkv_bias=True,
             attn_out_bias=True)


@pytest.mark.parametrize("dtype, impl, remat, gemma", [
    ("bfloat16", "flash", "none", GEMMA2),
    ("float32", "reference", "none", GEMMA2),
    ("bfloat16", "flash", "dots", GEMMA2),
    ("float32", "chunked", "dots_with_no_batch_dims", GEMMA2),
    ("bfloat16", "flash", "full", GEMMA2),
    ("bfloat16", "flash", "none", dict(norm_unit_offset=True, embed_scale=True,
                                       mlp_activation="gelu_tanh")),  # Gemma 1
    ("bfloat16", "chunked", "none", dict(sandwich_norms=True)),
    ("bfloat16", "flash", "none", dict(GEMMA2, qk_norm=True)),  # Gemma 3's q/k norms
    ("bfloat16", "flash", "none", dict(qk_norm=True)),  # Qwen3
    ("float32", "reference", "none", dict(qk_norm=True)),
    ("bfloat16", "flash", "none", OLMO2),
    ("float32", "reference", "none", OLMO2),
    ("bfloat16", "chunked", "dots", OLMO2),
    ("float32", "chunked", "dots_with_no_batch_dims", OLMO2),
])
def test_gemma_saved_activations_match_what_jax_keeps_for_backward(dtype, impl, remat, gemma):
  """(1 + w) norms in float32, sandwich norms, GeGLU, soft caps, sliding layers; q/k
  norms per head and over every head, and OLMo's output norms."""
  cfg = models.get_preset("tiny", num_layers=3, d_model=96, ffn_dim=160, num_heads=6,
                          num_kv_heads=2, head_dim=16, remat=remat, attention_impl=impl,
                          attention_chunk=32, logprob_chunk=64, dtype=dtype, param_dtype=dtype,
                          **gemma)
  kept = sum(b for b, _, _ in _residuals(cfg, 4, 128))
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  estimate = planner.saved_activation_bytes(cfg, rows=4, row_len=128, mesh=one_device)
  assert estimate == pytest.approx(kept, rel=0.05)


# A mixture: 5 experts of width 40, 2 a token (a prime E catches a transposed axis).
MOE = dict(num_layers=2, d_model=96, ffn_dim=40, num_heads=6, num_kv_heads=2, head_dim=16,
           num_experts=5, num_experts_per_tok=2, logprob_chunk=64)
# Qwen2-MoE's layout: a shared expert (width 24) every token runs, scaled by
# sigmoid(x . w), and top-k weights left unnormalised.
QWEN2_MOE = dict(shared_expert_dim=24, shared_expert_gate=True, norm_topk_prob=False)
# GLM-4.5's: sigmoid routing among the best 2 of 3 groups of 2 experts, its weights
# scaled, a shared expert of ffn_dim, and the first of 3 layers dense (width 56).
GLM4_MOE = dict(num_layers=3, num_experts=6, router_scoring="sigmoid", router_groups=3,
                router_group_topk=2, routed_scaling_factor=2.5, shared_expert_dim=40,
                dense_layers=1, dense_ffn_dim=56)


def _dense_twin(cfg, **changes):
  """A dense model of `cfg`'s depth and widths, its MLPs as wide as `cfg`'s leading
  dense layers (their share cancels against it)."""
  return models.get_preset("tiny", **{**MOE, "num_layers": cfg.num_layers,
                                      "ffn_dim": cfg.dense_ffn_dim or cfg.ffn_dim,
                                      "num_experts": 0, "num_experts_per_tok": 0}, **changes)


def _residuals(cfg, rows, length, mesh=None, rules=models.DEFAULT_RULES):
  """(bytes, source, shape) of what the backward of token_logprobs keeps, less its
  arguments; under a mesh, shard_map's residuals stack every device's on their first
  axis."""
  graphdef, params, rest = nnx.split(
      nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  ctx = models.ShardingContext(mesh, rules)

  def loss(params, tokens):
    return nnx.merge(graphdef, params, rest).token_logprobs(tokens, tokens, ctx=ctx).sum()

  tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
  if mesh is None:
    found = saved_residuals(loss, params, tokens)
  else:
    with jax.set_mesh(mesh):
      found = saved_residuals(loss, params, tokens)
  return [(math.prod(aval.shape) * aval.dtype.itemsize, src, aval.shape)
          for aval, src in found if "from the argument" not in src]


@pytest.mark.parametrize("dtype, impl, remat", [
    ("float32", "reference", "none"),
    ("bfloat16", "flash", "none"),
    ("bfloat16", "chunked", "dots"),
    ("float32", "flash", "dots_with_no_batch_dims"),
    ("bfloat16", "flash", "dots_with_no_batch_dims"),
    ("bfloat16", "flash", "full"),
])
def test_mixture_saved_activations_match_what_jax_keeps_for_backward(dtype, impl, remat):
  """A mixture's layer keeps per token its k sorted input rows, their gate, up and
  product, float32 expert outputs, router probabilities, top-k weights, ids and
  permutations; the dots policies only the router's float32 logits (its grouped
  matmuls are no dot_general). The mixture's share is exact: against a dense model of
  the same widths."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  kept, planned = {}, {}
  for experts in (5, 0):
    cfg = models.get_preset("tiny", **{**MOE, "num_experts": experts,
                                       "num_experts_per_tok": 2 if experts else 0},
                            remat=remat, attention_impl=impl, attention_chunk=32,
                            dtype=dtype, param_dtype=dtype)
    kept[experts] = sum(n for n, _, _ in _residuals(cfg, 4, 128))
    planned[experts] = planner.saved_activation_bytes(cfg, rows=4, row_len=128,
                                                      mesh=one_device)
  assert planned[5] == pytest.approx(kept[5], rel=0.1)
  assert planned[5] - planned[0] == kept[5] - kept[0]
  if remat != "full":  # the dense MLP keeps 2-3 [tokens, F]; the mixture far more or less
    assert (planned[5] > planned[0]) == (remat == "none")


@pytest.mark.parametrize("remat", ["none", "dots", "dots_with_no_batch_dims", "full"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", [QWEN2_MOE, GLM4_MOE], ids=["qwen2_moe", "glm4_moe"])
def test_shared_experts_sigmoid_routing_and_dense_layers_match_what_jax_keeps(
    layout, dtype, remat):
  """Qwen2-MoE's and GLM-4.5's mixtures: a shared expert keeps a dense MLP's gate, up
  (its input rows and product without remat), and its sigmoid gate what the gate's
  gradients read; sigmoid routing its float32 input rows and scores in the softmax's
  place, nothing for the groups or the correction bias; the leading dense layer a dense
  MLP's terms at its own width. Exact against a dense model as wide as that layer."""
  widths = dict(remat=remat, attention_impl="flash", dtype=dtype, param_dtype=dtype)
  cfg = models.get_preset("tiny", **{**MOE, **layout}, **widths)
  _assert_mixture_share_exact(cfg, widths)


# Multi-head latent attention (DeepSeek-V3's): 6 heads of 24 features, 16 unrotated and 8
# rotated (one rotated key part for every head), keys and values from a normed latent of
# 16, queries through their own of 12, values 12 wide (zero-padded to 24 for the kernel,
# cut back before o_proj).
MLA = dict(num_kv_heads=6, head_dim=24, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8,
           v_head_dim=12, rope=models.RopeConfig(theta=10_000.0, partial_rotary_factor=1 / 3))
# Its twin: standard attention of as many kv heads, as wide, as rotated.
MHA = {**MLA, "kv_lora_rank": 0, "q_lora_rank": 0, "qk_rope_head_dim": 0, "v_head_dim": 0}
# DeepSeek-V3's layout: GLM-4.5's mixture (sigmoid group routing, its weights scaled, a
# shared expert, the first of 3 layers dense) under multi-head latent attention.
DEEPSEEK_V3 = {**GLM4_MOE, **MLA}


@pytest.mark.parametrize("dtype, impl, remat", [
    *((dtype, "flash", remat) for dtype in ("float32", "bfloat16")
      for remat in ("none", "dots", "dots_with_no_batch_dims", "full")),
    ("float32", "reference", "none"),
    ("bfloat16", "reference", "none"),
    ("bfloat16", "chunked", "dots"),
])
def test_latent_attention_saved_activations_match_what_jax_keeps(dtype, impl, remat):
  """Multi-head latent attention keeps without remat each latent's a-projection output
  and its norm's float32 rows and columns, its expanded keys and padded values in k's
  and v's place, and the output cut back to v_head_dim (with reference attention in
  place of the full-width one); a dots policy its projections' outputs (the latents, the
  rotated key part, the keys' unrotated part, the values before their padding) in place
  of k's and v's. Queries through a latent and through q_proj; with reference attention
  values as wide as the keys too (nothing cut back). Exact against standard attention
  of as many heads."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  dense = dict(num_layers=2, d_model=96, ffn_dim=160, num_heads=6, logprob_chunk=64,
               remat=remat, attention_impl=impl, attention_chunk=32, dtype=dtype,
               param_dtype=dtype)
  variants = [MLA, {**MLA, "q_lora_rank": 0}]
  if impl == "reference":
    variants.append({**MLA, "v_head_dim": 24})
  kept, planned = [], []
  for layout in (MHA, *variants):
    cfg = models.get_preset("tiny", **dense, **layout)
    kept.append(sum(n for n, _, _ in _residuals(cfg, 4, 128)))
    planned.append(planner.saved_activation_bytes(cfg, rows=4, row_len=128, mesh=one_device))
  for k, p in zip(kept[1:], planned[1:]):
    assert p == pytest.approx(k, rel=0.1)
    assert p - planned[0] == k - kept[0]
  if remat != "full":  # the latents alone add nothing under full remat
    assert kept[1] != kept[0]


@pytest.mark.parametrize("dtype, remat", [("bfloat16", "none"),
                                          ("float32", "dots_with_no_batch_dims")])
def test_deepseek_v3_layout_saved_activations_match_what_jax_keeps(dtype, remat):
  """DeepSeek-V3's layout (a sigmoid-routed mixture with a shared expert and a leading
  dense layer, under multi-head latent attention): the attention's terms and the
  mixture's add up, exact against the same mixture under standard attention."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  widths = dict(remat=remat, attention_impl="flash", dtype=dtype, param_dtype=dtype)
  kept, planned = [], []
  for layout in (DEEPSEEK_V3, {**GLM4_MOE, **MHA}):
    cfg = models.get_preset("tiny", **{**MOE, **layout}, **widths)
    kept.append(sum(n for n, _, _ in _residuals(cfg, 4, 128)))
    planned.append(planner.saved_activation_bytes(cfg, rows=4, row_len=128, mesh=one_device))
  assert planned[0] == pytest.approx(kept[0], rel=0.1)
  assert planned[0] - planned[1] == kept[0] - kept[1]


# Qwen3.5's layout: three Gated DeltaNet layers (2 key heads of 16, 6 value heads of 24,
# chunks of 32) to each full-attention layer, whose output is gated; (1 + w) norms
# without embed_scale, q/k norms, a quarter of each head rotated.
QWEN3_5 = dict(num_layers=4, d_model=96, ffn_dim=160, num_heads=6, num_kv_heads=2,
               head_dim=16, layer_types=("linear_attention",) * 3 + ("full_attention",),
               linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
               linear_value_head_dim=24, linear_chunk=32, attn_output_gate=True,
               qk_norm=True, norm_unit_offset=True, logprob_chunk=64,
               rope=models.RopeConfig(theta=10_000.0, partial_rotary_factor=0.25))
# Qwen3.5-MoE's (and Qwen3-Next's): those layers, every MLP MOE's 5 experts of 40 (2 a
# token, renormalised) beside a shared expert of 24 scaled by sigmoid(x . w).
QWEN3_5_MOE = {**QWEN3_5, "ffn_dim": 40, "num_experts": 5, "num_experts_per_tok": 2,
               "shared_expert_dim": 24, "shared_expert_gate": True}


def _linear_layer_share(layout, rows, length, **widths):
  """(planned, kept) bytes of `layout`'s model, and the share of its first Gated DeltaNet
  layer in each: against the same model without that layer. What a layer keeps once
  beside its tokens and the planner leaves out (its block norms' two float32 scales [D],
  a few scalars) is at most 8D + 32 bytes."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  types = layout["layer_types"]
  kept, planned = [], []
  for kinds in (types, types[1:]):
    cfg = models.get_preset("tiny", **{**layout, "num_layers": len(kinds),
                                       "layer_types": kinds}, **widths)
    kept.append(sum(n for n, _, _ in _residuals(cfg, rows, length)))
    planned.append(planner.saved_activation_bytes(cfg, rows=rows, row_len=length,
                                                  mesh=one_device))
  return planned[0], kept[0], planned[0] - planned[1], kept[0] - kept[1]


@pytest.mark.parametrize("dtype, remat, length", [
    *((dtype, remat, 128) for dtype in ("float32", "bfloat16")
      for remat in ("none", "dots", "dots_with_no_batch_dims", "full")),
    ("float32", "none", 100),  # the delta rule's last chunk padded
    ("bfloat16", "dots", 100),
])
def test_linear_attention_saved_activations_match_what_jax_keeps(dtype, remat, length):
  """Qwen3.5's Gated DeltaNet layers keep without remat their convolutions' inputs, the
  delta rule's float32 masked and chunked inputs, its float32 state entering each chunk,
  its output's norm and SiLU gate; a dots policy the six projections and every batched
  matmul of each chunk's body; dots_with_no_batch_dims the projections alone. The
  gated full-attention layer, with its output gate, beside them. A linear layer's share
  is exact, but for what it keeps once that no layer counts (its norms' scales)."""
  widths = dict(remat=remat, attention_impl="flash", dtype=dtype, param_dtype=dtype)
  planned, kept, planned_layer, kept_layer = _linear_layer_share(QWEN3_5, 4, length, **widths)
  assert planned == pytest.approx(kept, rel=0.05)
  assert 0 <= kept_layer - planned_layer <= 8 * 96 + 32


@pytest.mark.parametrize("dtype, remat", [("float32", "none"), ("bfloat16", "none"),
                                          ("bfloat16", "dots")])
def test_linear_attention_mixture_saved_activations_match_what_jax_keeps(dtype, remat):
  """Qwen3.5-MoE's layout (Qwen3-Next's): a mixture with a gated shared expert under
  Gated DeltaNet and gated attention layers. The mixture's terms and the linear layers'
  add up; a linear layer's share is exact as in a dense model."""
  widths = dict(remat=remat, attention_impl="flash", dtype=dtype, param_dtype=dtype)
  planned, kept, planned_layer, kept_layer = _linear_layer_share(QWEN3_5_MOE, 4, 128,
                                                                 **widths)
  assert planned == pytest.approx(kept, rel=0.05)
  assert 0 <= kept_layer - planned_layer <= 8 * 96 + 32


# Granite 4's -h- layout at Qwen3.5's widths: three Mamba2 layers (2 groups of B and C
# with a state of 16, 6 heads of 24, the convolution's bias) to each attention layer.
MAMBA2 = {**{k: v for k, v in QWEN3_5.items()
             if k not in ("attn_output_gate", "qk_norm", "norm_unit_offset")},
          "linear_mixer": "mamba2", "linear_conv_bias": True}


@pytest.mark.parametrize("dtype, remat, length", [
    *((dtype, remat, 128) for dtype in ("float32", "bfloat16")
      for remat in ("none", "dots", "dots_with_no_batch_dims", "full")),
    ("bfloat16", "none", 100),  # the scan's last chunk padded
    ("float32", "dots", 100),
])
def test_mamba2_saved_activations_match_what_jax_keeps(dtype, remat, length):
  """A Mamba2 layer keeps without remat its convolutions' inputs, the scan's float32
  masked and chunked inputs, its state entering each chunk, its output and the gated
  norm's; a dots policy its five projections and each chunk's batched matmuls;
  dots_with_no_batch_dims the projections alone. Its share is exact but for its norms'
  scales, as a Gated DeltaNet layer's."""
  widths = dict(remat=remat, attention_impl="flash", dtype=dtype, param_dtype=dtype)
  planned, kept, planned_layer, kept_layer = _linear_layer_share(MAMBA2, 4, length, **widths)
  assert planned == pytest.approx(kept, rel=0.05)
  assert 0 <= kept_layer - planned_layer <= 8 * 96 + 32


# LFM2's layout at Qwen3.5's widths: gated short convolutions (y = C * conv(B * x), three
# taps over d_model's 96 channels) between attention layers with q/k norms.
LFM2 = dict(num_layers=4, d_model=96, ffn_dim=160, num_heads=6, num_kv_heads=2, head_dim=16,
            layer_types=("linear_attention", "full_attention") * 2, linear_mixer="short_conv",
            linear_conv_kernel=3, qk_norm=True, logprob_chunk=64)


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "conv_bias"])
@pytest.mark.parametrize("dtype, remat, length", [
    *((dtype, remat, 128) for dtype in ("float32", "bfloat16")
      for remat in ("none", "dots", "dots_with_no_batch_dims", "full")),
    ("bfloat16", "none", 100),  # no chunks: nothing padded
])
def test_short_conv_saved_activations_match_what_jax_keeps(dtype, remat, length, bias):
  """An LFM2 short-convolution layer keeps without remat B, C and x, B * x, the
  convolution's output and C times it (the convolution itself rematerialised); a dots
  policy in_proj's three outputs and out_proj's (the convolution is no matmul: both
  dots policies alike); full remat its input. Its biases and taps keep nothing more. Its
  share is exact but, without remat, for its norms' two scales."""
  widths = dict(remat=remat, attention_impl="flash", dtype=dtype, param_dtype=dtype,
                linear_conv_bias=bias)
  planned, kept, planned_layer, kept_layer = _linear_layer_share(LFM2, 4, length, **widths)
  assert planned == pytest.approx(kept, rel=0.05)
  # Without remat the block's two norm scales [D] (in the compute dtype) alone are left.
  norms = 2 * 96 * np.dtype(dtype).itemsize if remat == "none" else 0
  assert kept_layer - planned_layer == norms


# Falcon-H1's layout: every layer's attention (4 heads, 2 kv heads of 16) beside a Mamba2
# mixer (2 groups of B and C with a state of 16, 6 heads of 24, the convolution's bias),
# both on the normed input, each scaled in and out; in_proj's five parts scaled too, and
# the MLP's gate and down projection.
FALCON_H1 = dict(num_layers=2, d_model=64, ffn_dim=160, num_heads=4, num_kv_heads=2,
                 head_dim=16, parallel_mixer=True, linear_mixer="mamba2",
                 linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                 linear_value_head_dim=24, linear_chunk=32, linear_conv_bias=True,
                 logprob_chunk=64, attention_in_multiplier=0.5,
                 attention_out_multiplier=0.75, ssm_in_multiplier=1.25,
                 ssm_out_multiplier=0.5, ssm_multipliers=(0.5, 1.5, 0.25, 2.0, 0.75),
                 mlp_gate_multiplier=0.5, mlp_down_multiplier=1.5)
# Its twin without the Mamba2 mixers (and their multipliers): attention layers alone.
FALCON_H1_ATTENTION = {k: v for k, v in FALCON_H1.items()
                       if k not in ("parallel_mixer", "linear_conv_bias", "ssm_multipliers")
                       and not k.startswith(("attention_", "ssm_"))}


@pytest.mark.parametrize("dtype, remat, length, layout", [
    *((dtype, remat, 128, {"linear_norm": norm}) for norm in ("after_gate", "none")
      for dtype in ("float32", "bfloat16")
      for remat in ("none", "dots", "dots_with_no_batch_dims", "full")),
    ("bfloat16", "none", 100, {}),  # the scan's last chunk padded
    ("float32", "dots", 100, {}),
    # Unscaled inputs: the mixers read the normed input itself.
    ("float32", "none", 128, {"attention_in_multiplier": 1.0, "ssm_in_multiplier": 1.0}),
    ("bfloat16", "none", 128, {"ssm_in_multiplier": 1.0}),  # one scaled copy beside it
])
def test_parallel_mixer_saved_activations_match_what_jax_keeps(dtype, remat, length, layout):
  """A Falcon-H1 layer keeps its attention layer's terms and beside them its Mamba2's, as a
  Mamba2 layer's mixer keeps them (no remat: its convolutions' inputs, the scan's float32
  inputs, chunk states and output; a dots policy its projections, out_proj's output among
  them, and each chunk's batched matmuls); without remat also the scaled input the mixers
  read in the normed input's place, and the multipliers' scalars. Its share (against the
  attention layers alone) is exact, linear_norm after the gate or none; the MLP's
  multipliers' share (against unscaled MLPs) too."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  widths = dict(remat=remat, attention_impl="flash", dtype=dtype, param_dtype=dtype)
  unscaled = {k: v for k, v in FALCON_H1_ATTENTION.items() if not k.startswith("mlp_")}
  kept, planned = [], []
  for c in ({**FALCON_H1, **layout}, FALCON_H1_ATTENTION, unscaled):
    cfg = models.get_preset("tiny", **c, **widths)
    assert cfg.parallel_mixer == (c is not FALCON_H1_ATTENTION and c is not unscaled)
    kept.append(sum(n for n, _, _ in _residuals(cfg, 4, length)))
    planned.append(planner.saved_activation_bytes(cfg, rows=4, row_len=length,
                                                  mesh=one_device))
  assert planned[0] == pytest.approx(kept[0], rel=0.05)
  assert planned[0] - planned[1] == kept[0] - kept[1]
  assert planned[1] - planned[2] == kept[1] - kept[2]
  assert (kept[0] > kept[1]) == (remat != "full")


# Nemotron-H's layout: single-sublayer layers, Mamba2 (MAMBA2's widths), NoPE attention
# and MLPs of squared ReLU without a gate, each alone with its norm.
NEMOTRON_H = dict(d_model=96, ffn_dim=160, num_heads=6, num_kv_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                  linear_value_head_dim=24, linear_chunk=32, logprob_chunk=64,
                  linear_mixer="mamba2", linear_conv_bias=True, mlp_activation="relu2",
                  attention_impl="flash")
NEMOTRON_H_LAYERS = ("linear_attention", "mlp", "full_attention") * 2


@pytest.mark.parametrize("dtype, remat", [
    (dtype, remat) for dtype in ("float32", "bfloat16")
    for remat in ("none", "dots", "dots_with_no_batch_dims", "full")])
def test_single_sublayer_layers_saved_activations_match_what_jax_keeps(dtype, remat):
  """Nemotron-H's layers are a block's halves: a Mamba2 or attention layer keeps its
  mixer's share and one norm's, an MLP layer the MLP's and its own norm's (relu^2: up,
  its mask and two products; under dots up alone). Each kind's share is exact but for
  its norm's scale; the model within 2% (what lies outside the layers is counted as
  for every model: a NoPE model's tables, counted in its attention layers, twice)."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  rows, length = 4, 128

  def measured(kinds):
    cfg = models.get_preset("tiny", **NEMOTRON_H, num_layers=len(kinds), layer_types=kinds,
                            rope_layers=(0,) * len(kinds), remat=remat, dtype=dtype,
                            param_dtype=dtype)
    return (sum(n for n, _, _ in _residuals(cfg, rows, length)),
            planner.saved_activation_bytes(cfg, rows=rows, row_len=length, mesh=one_device))

  kept, planned = measured(NEMOTRON_H_LAYERS)
  assert planned == pytest.approx(kept, rel=0.02)
  for i in range(3):  # a Mamba2 layer, an MLP, an attention layer
    less_kept, less_planned = measured(NEMOTRON_H_LAYERS[:i] + NEMOTRON_H_LAYERS[i + 1:])
    assert 0 <= (kept - less_kept) - (planned - less_planned) <= 4 * 96 + 32, i


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_mamba2_layers_alone_and_a_float32_stream_match_what_jax_keeps(remat):
  """Mamba2ForCausalLM's layout (Mamba2 mixers alone, ffn_dim=0) in bfloat16, its
  residual stream in bfloat16 or float32 (residual_fp32): the planner within 1% of what
  JAX keeps, and the float32 stream's cost (the final norm's input, under remat each
  layer's input too) within 256 bytes of what it adds."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  rows, length, kinds = 4, 128, ("linear_attention",) * 3

  def measured(fp32):
    cfg = models.get_preset("tiny", **{**NEMOTRON_H, "ffn_dim": 0}, num_layers=3,
                            layer_types=kinds, rope_layers=(0,) * 3, remat=remat,
                            dtype="bfloat16", param_dtype="bfloat16", residual_fp32=fp32)
    return (sum(n for n, _, _ in _residuals(cfg, rows, length)),
            planner.saved_activation_bytes(cfg, rows=rows, row_len=length, mesh=one_device))

  (kept, planned), (kept32, planned32) = measured(False), measured(True)
  assert planned == pytest.approx(kept, rel=0.01)
  assert planned32 == pytest.approx(kept32, rel=0.01)
  assert kept32 - kept >= 2 * rows * length * 96  # the stream's rows, in float32
  assert abs((kept32 - kept) - (planned32 - planned)) <= 256


@pytest.mark.parametrize("dtype, remat", [("bfloat16", "none"), ("float32", "none"),
                                          ("float32", "dots"), ("bfloat16", "dots"),
                                          ("bfloat16", "full")])
def test_mamba1_layers_saved_activations_match_what_jax_keeps(dtype, remat):
  """MambaForCausalLM's layout (Mamba 1 mixers alone: 192 channels, a state of 16, a
  time step of rank 6): the planner within 1% of what JAX keeps, and each layer's share
  (two layers against three) within 0.5%."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  rows, length = 4, 128

  def measured(layers):
    cfg = models.get_preset(
        "tiny", d_model=96, num_heads=1, num_kv_heads=1, head_dim=2, ffn_dim=0,
        linear_mixer="mamba1", linear_num_key_heads=1, linear_num_value_heads=192,
        linear_key_head_dim=16, linear_value_head_dim=1, linear_dt_rank=6,
        linear_conv_bias=True, linear_chunk=32, logprob_chunk=64, num_layers=layers,
        layer_types=("linear_attention",) * layers, rope_layers=(0,) * layers, remat=remat,
        dtype=dtype, param_dtype=dtype)
    return (sum(n for n, _, _ in _residuals(cfg, rows, length)),
            planner.saved_activation_bytes(cfg, rows=rows, row_len=length, mesh=one_device))

  (kept2, planned2), (kept3, planned3) = measured(2), measured(3)
  assert planned3 == pytest.approx(kept3, rel=0.01)
  assert planned3 - planned2 == pytest.approx(kept3 - kept2, rel=0.005)


@pytest.mark.parametrize("dtype, remat, norm", [("float32", "none", "weighted"),
                                                ("bfloat16", "none", "weightless"),
                                                ("bfloat16", "dots", "weighted"),
                                                ("bfloat16", "full", "weighted")])
def test_jamba_layers_saved_activations_match_what_jax_keeps(dtype, remat, norm):
  """Jamba's layout (Mamba 1 layers, NoPE attention, each beside an MLP that every other
  layer is a mixture) with the norms on dt, B and C weighted or not: the planner within
  1% of what JAX keeps (under remat, the NoPE attention layer's float32 unit tables
  counted)."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  kinds = ("linear_attention", "linear_attention", "full_attention", "linear_attention")
  cfg = models.get_preset(
      "tiny", d_model=96, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=160,
      dense_ffn_dim=160, num_experts=4, num_experts_per_tok=2, moe_layer_step=2,
      norm_topk_prob=False, linear_mixer="mamba1", linear_num_key_heads=1,
      linear_num_value_heads=192, linear_key_head_dim=16, linear_value_head_dim=1,
      linear_dt_rank=6, linear_conv_bias=True, linear_chunk=32, logprob_chunk=64,
      attention_impl="flash", linear_bcdt_norm=norm, num_layers=4, layer_types=kinds,
      rope_layers=(0,) * 4, remat=remat, dtype=dtype, param_dtype=dtype)
  kept = sum(n for n, _, _ in _residuals(cfg, 4, 128))
  planned = planner.saved_activation_bytes(cfg, rows=4, row_len=128, mesh=one_device)
  assert planned == pytest.approx(kept, rel=0.01)


# Nemotron 3's layout: Nemotron-H's layers beside mixtures alone ("moe"), each of 6
# experts of 40 without a gate (relu^2), 2 a token by sigmoid scores scaled by 2.5, and a
# shared relu^2 expert of 24; its MLPs alone are dense_ffn_dim (160) wide.
NEMOTRON_3 = {**NEMOTRON_H, "ffn_dim": 40, "num_experts": 6, "num_experts_per_tok": 2,
              "router_scoring": "sigmoid", "routed_scaling_factor": 2.5,
              "shared_expert_dim": 24, "dense_ffn_dim": 160}
NEMOTRON_3_LAYERS = ("linear_attention", "moe", "full_attention", "mlp") * 2


@pytest.mark.parametrize("latent", [0, 16], ids=["experts_in_d", "latent"])
@pytest.mark.parametrize("dtype, remat", [
    (dtype, remat) for dtype in ("float32", "bfloat16")
    for remat in ("none", "dots", "dots_with_no_batch_dims", "full")])
def test_mixture_layers_alone_saved_activations_match_what_jax_keeps(dtype, remat, latent):
  """Nemotron 3's mixtures alone keep a mixture layer's share and one norm's: the routed
  experts' sorted rows, up, relu^2's mask and two products (no gate), a sigmoid router's
  float32 rows and scores, the shared expert as a relu^2 MLP; in a latent the rows L
  wide, and latent_in's and latent_out's inputs (under dots latent_in's output and the
  float32 weighted sum, a dot with a batch dimension). Its MLPs alone are dense MLPs of
  dense_ffn_dim. Each kind's share is exact but for its norm's scale; the model within
  2%, as Nemotron-H's."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  rows, length = 4, 128

  def measured(kinds):
    cfg = models.get_preset("tiny", **NEMOTRON_3, num_layers=len(kinds), layer_types=kinds,
                            rope_layers=(0,) * len(kinds), moe_latent_dim=latent, remat=remat,
                            dtype=dtype, param_dtype=dtype)
    return (sum(n for n, _, _ in _residuals(cfg, rows, length)),
            planner.saved_activation_bytes(cfg, rows=rows, row_len=length, mesh=one_device))

  kept, planned = measured(NEMOTRON_3_LAYERS)
  assert planned == pytest.approx(kept, rel=0.02)
  for i, kind in enumerate(NEMOTRON_3_LAYERS[:4]):  # Mamba2, a mixture, attention, an MLP
    less_kept, less_planned = measured(NEMOTRON_3_LAYERS[:i] + NEMOTRON_3_LAYERS[i + 1:])
    assert 0 <= (kept - less_kept) - (planned - less_planned) <= 4 * 96 + 32, kind


@pytest.mark.parametrize("remat", ["none", "dots", "dots_with_no_batch_dims"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", [
    dict(mlp_activation="relu2"),
    dict(moe_latent_dim=16, shared_expert_dim=24),
    dict(mlp_activation="relu2", moe_latent_dim=16, router_scoring="sigmoid",
         shared_expert_dim=24, norm_topk_prob=False)], ids=["relu2", "latent", "relu2_latent"])
def test_experts_without_a_gate_or_in_a_latent_match_what_jax_keeps(layout, dtype, remat):
  """A mixture of relu^2 experts (no gate: up, the mask and two products a row), or of
  experts in a latent (their rows L wide, latent_in's and latent_out's inputs), in a
  layer of attention and a mixture. Exact against a dense model of the same activation."""
  widths = dict(remat=remat, attention_impl="flash", dtype=dtype, param_dtype=dtype,
                mlp_activation=layout.get("mlp_activation", "silu"))
  cfg = models.get_preset("tiny", **{**MOE, **layout, **widths})
  _assert_mixture_share_exact(cfg, widths)


@pytest.mark.parametrize("layout", [QWEN3_5, MAMBA2], ids=["gated_deltanet", "mamba2"])
def test_linear_weight_bytes_are_the_mixers_projections_and_taps(layout):
  """What the planner gathers for a linear layer's mixer is its projections and
  convolution taps in the compute dtype: a Mamba2 layer has no b_proj."""
  cfg = models.get_preset("tiny", **layout, dtype="bfloat16")
  mixer = models.Transformer(cfg, rngs=nnx.Rngs(0)).linear_layers[0].linear_attn
  names = [n for n in ("q_proj", "k_proj", "v_proj", "z_proj", "b_proj", "a_proj", "o_proj",
                       "q_conv", "k_conv", "v_conv") if hasattr(mixer, n)]
  assert ("b_proj" in names) == (layout is QWEN3_5)
  want = sum(getattr(mixer, n)[...].size for n in names) * 2
  assert planner._linear_weight_bytes(cfg, cfg.linear_num_key_heads,
                                      cfg.linear_num_value_heads) == want


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_linear_heads_split_over_tensor(remat):
  """Over fsdp 4 x tensor 2 a device keeps of 8 rows what one device keeps of 2 rows of
  the model with every axis the tensor axis splits halved: the Gated DeltaNet layers'
  key and value heads ("linear_heads"), the attention's heads and kv heads, the MLP and
  the vocabulary. JAX's count of that model agrees."""
  mesh = planner.abstract_mesh(dict(zip(models.MESH_AXES, (1, 4, 2, 1))))
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  cfg = models.get_preset("tiny", **QWEN3_5, remat=remat, attention_impl="flash")
  half = cfg.replace(linear_num_key_heads=1, linear_num_value_heads=3, num_heads=3,
                     num_kv_heads=1, ffn_dim=80, vocab_size=136)
  planned = planner.saved_activation_bytes(cfg, rows=8, row_len=128, mesh=mesh)
  assert planned == planner.saved_activation_bytes(half, rows=2, row_len=128, mesh=one_device)
  assert planned == pytest.approx(sum(n for n, _, _ in _residuals(half, 2, 128)), rel=0.05)


@pytest.mark.parametrize("dtype, impl, remat", [
    ("float32", "reference", "none"),
    ("bfloat16", "flash", "none"),
    ("bfloat16", "chunked", "dots"),
    ("float32", "flash", "dots_with_no_batch_dims"),
    ("bfloat16", "flash", "full"),
])
def test_attention_output_gate_matches_what_jax_keeps(dtype, impl, remat):
  """An attention output gate (Qwen3-Next's, Qwen3.5's) keeps without remat the float32
  sigmoid, its compute-dtype cast and the gated output, (4 + 2s)NH a token; a dots
  policy its projection, sNH; full remat nothing. Exact against the same model ungated."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  kept, planned = [], []
  for gated in (True, False):
    cfg = models.get_preset("tiny", num_layers=2, d_model=96, ffn_dim=160, num_heads=6,
                            num_kv_heads=2, head_dim=16, logprob_chunk=64, remat=remat,
                            attention_impl=impl, attention_chunk=32, dtype=dtype,
                            param_dtype=dtype, attn_output_gate=gated)
    kept.append(sum(n for n, _, _ in _residuals(cfg, 4, 128)))
    planned.append(planner.saved_activation_bytes(cfg, rows=4, row_len=128, mesh=one_device))
  assert planned[0] == pytest.approx(kept[0], rel=0.1)
  assert planned[0] - planned[1] == kept[0] - kept[1]
  if remat != "full":
    assert kept[0] > kept[1]


@pytest.mark.parametrize("shape", [(1, 8, 1, 1), (2, 4, 1, 1)])
@pytest.mark.parametrize("remat", ["none", "dots_with_no_batch_dims"])
@pytest.mark.parametrize("layout", [{}, GLM4_MOE], ids=["softmax", "glm4_moe"])
def test_mixture_on_a_mesh_keeps_its_shard_of_the_experts(layout, shape, remat):
  """Inside shard_map each device keeps its own tokens' rows; without remat also the
  router and, outside it, the experts it was given: in the compute dtype, D gathered.
  A sigmoid router (GLM-4.5) keeps its input rows and itself in float32, and the
  scale; its shared expert and leading dense layer run outside shard_map."""
  cfg = models.get_preset("tiny", **{**MOE, **layout}, remat=remat, attention_impl="flash",
                          dtype="bfloat16", param_dtype="float32")
  mesh = models.make_mesh(shape)
  rows, length, (e, k, d, f, s) = 8, 128, (cfg.num_experts, 2, 96, 40, 2)
  sigmoid = cfg.router_scoring == "sigmoid"
  tokens = rows // (shape[0] * shape[1]) * length  # rows over data x fsdp
  if remat == "none":
    # A sigmoid router's input rows in float32, two float32 columns fewer than softmax's.
    per_token = ((4 if sigmoid else s) * d + s * (k * d + 3 * k * f)
                 + 4 * (k * d + e + 5 * k + (2 if sigmoid else 4)))
    # Group sizes, the router (float32 for sigmoid routing) and the routed scaling.
    per_layer = 4 * e + (4 * d * e + 4 if sigmoid else s * d * e)
    experts = s * 3 * e * d * f
  else:
    per_token, per_layer, experts = 4 * e, 0, 0
  found = _residuals(cfg, rows, length, mesh)
  # shard_map's residuals stack all 8 devices' (each varies over data x fsdp here).
  inside = sum(n for n, src, _ in found if "MoE._routed" in src) / mesh.size
  assert inside == cfg.mixture_layers * (tokens * per_token + per_layer)
  gathered = sum(n for n, src, shape in found if "(place)" in src and shape[0] == e)
  assert gathered == cfg.mixture_layers * experts  # replicated: every device holds them whole
  # The planner counts the same, in place of a dense MLP's gate, up (and product), with
  # the shared expert's (a dense MLP of its width, and its input rows without remat).
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, shape)))
  dense = _dense_twin(cfg, remat=remat, attention_impl="flash", dtype="bfloat16",
                      param_dtype="float32")
  dense_mlp = s * (3 if remat == "none" else 2) * (cfg.dense_ffn_dim or f)
  fs = cfg.shared_expert_dim
  shared = (s * (d + 3 * fs) if remat == "none" else 2 * s * fs) if fs else 0
  assert (planner.saved_activation_bytes(cfg, rows=rows, row_len=length, mesh=abstract)
          - planner.saved_activation_bytes(dense, rows=rows, row_len=length, mesh=abstract)
          == cfg.mixture_layers * (tokens * (per_token - (s * d if remat == "none" else 0)
                                             - dense_mlp + shared) + per_layer + experts))


LORA_LAYOUTS = {
    "llama": (dict(num_layers=2, d_model=96, ffn_dim=160, num_heads=6, num_kv_heads=2,
                   head_dim=16, logprob_chunk=64),
              "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
    # A gated shared expert (its down projection's adapter read by the gate's gradient)
    # beside routed experts with adapters of their own (grouped matmuls: no dots).
    "qwen2_moe": ({**MOE, **QWEN2_MOE},
                  "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,"
                  "experts_gate_up_proj,experts_down_proj"),
    # Multi-head latent attention: k_proj / v_proj adapt k_b_proj / v_b_proj.
    "mla": (dict(num_layers=2, d_model=96, ffn_dim=160, num_heads=4, num_kv_heads=4,
                 head_dim=24, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
                 v_head_dim=16, logprob_chunk=64,
                 rope=models.RopeConfig(partial_rotary_factor=8 / 24)),
            "q_proj,k_proj,v_proj,o_proj"),
    # Nemotron 3's single-sublayer layers: o_proj's and out_proj's products feed the
    # residual alone (as down_proj's), the MLPs and shared experts have no gate_proj.
    "nemotron_3": ({**{k: v for k, v in NEMOTRON_3.items() if k != "attention_impl"},
                    "num_layers": 4, "layer_types": NEMOTRON_3_LAYERS[:4],
                    "rope_layers": (0,) * 4},
                   "q_proj,k_proj,v_proj,o_proj,up_proj,down_proj,in_proj,out_proj"),
    # Falcon-H1's layers: the Mamba2's in_proj (its five parts, then scaled) and out_proj
    # beside the attention's and the MLP's adapters, on the same stack.
    "falcon_h1": (FALCON_H1, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,"
                             "in_proj,out_proj"),
    # LFM2's: one in_proj adapter over a short convolution's B, C and x (3D wide) and its
    # out_proj, beside the attention's and the MLP's, with the convolutions' biases.
    "lfm2": ({**LFM2, "linear_conv_bias": True},
             "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj,out_proj"),
}


@pytest.mark.parametrize("remat", ["dots_with_no_batch_dims", "none", "full"])
@pytest.mark.parametrize("layout", list(LORA_LAYOUTS))
def test_lora_adapters_saved_activations_match_what_jax_keeps(layout, remat):
  """A dots policy keeps each adapter's x A and (x A) B (both dots; down_proj's B
  product only where a shared expert's gate reads it, a single-sublayer layer's o_proj
  and out_proj none: only the residual reads them), no remat its x A alone (the
  routed experts' adapters aside, which Qwen2-MoE's layout shows), full remat nothing:
  what LoRA of rank 4 adds to the saved activations, against the same model without."""
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  widths, targets = LORA_LAYOUTS[layout]
  kept, planned = [], []
  for rank in (4, 0):
    cfg = models.get_preset("tiny", **widths, remat=remat, attention_impl="flash",
                            dtype="bfloat16", param_dtype="bfloat16", lora_rank=rank,
                            lora_alpha=8.0,
                            lora_targets=targets if rank else models.config.DEFAULT_LORA_TARGETS)
    kept.append(sum(n for n, _, _ in _residuals(cfg, 4, 128)))
    planned.append(planner.saved_activation_bytes(cfg, rows=4, row_len=128, mesh=one_device))
  added, counted = kept[0] - kept[1], planned[0] - planned[1]
  if remat == "dots_with_no_batch_dims":
    assert counted == added > 0
  elif remat == "full":
    assert counted == added == 0
  elif layout != "qwen2_moe":
    assert 0 <= added - counted <= 64  # a few scalars
  else:  # the routed experts' sorted rows' adapter products: not counted
    assert counted < added


def test_lora_under_a_dots_policy_is_planned_as_xla_tpu_compiled_it():
  """The adapters' saved products under dots_with_no_batch_dims, against XLA:TPU's
  compiles on a v5p-64 (libtpu 0.0.42.1, BENCHMARKS.md): Llama 4 Scout at 32 rows a
  micro-batch 33.46 GiB a chip with the sampler's own copy of the weights beside the
  update (planned 27.39 before the products were counted), 27.19 now that the sampler
  shares the frozen base (the same program, 6.27 GiB less beside it); Qwen3-30B-A3B
  with adapters on the attention and experts 34.79 (31.03 before), now 31.23."""
  scout = importlib.import_module("configs.llama4_scout_lora_grpo_v5p64").get_config()
  dots = planner.override(scout, {"model.overrides.remat": "dots_with_no_batch_dims",
                                  "train.rows_per_microbatch": 32})
  assert planner.plan(dots).train_peak / 2**30 == pytest.approx(27.19, rel=0.02)
  qwen = importlib.import_module("configs.qwen3_30b_a3b_grpo_v5p64").get_config()
  lora = planner.plan(planner.override(qwen, {"model.overrides.lora_rank": 16}))
  assert 31.23 < lora.train_peak / 2**30 < 31.23 * 1.1


# Expert parallelism over fsdp (`--config.sharding_rules='(("experts", ("fsdp",)),)'`).
EXPERTS_OVER_FSDP = models.rules_from_config((("experts", ("fsdp",)),))


def test_expert_parallelism_names_the_experts_a_device_runs_and_whose_tokens():
  """By default every device runs every expert on its own tokens; with the experts split
  over an axis that splits the tokens too, each runs E / ep of them on the tokens of
  that axis's devices; over an axis that does not (tensor), on its own."""
  cfg = models.get_preset("tiny", **{**MOE, "num_experts": 16})
  mesh = planner.abstract_mesh(dict(zip(models.MESH_AXES, (2, 4, 2, 1))))
  assert planner.expert_parallelism(cfg, 16, 128, mesh) == (16, 1)
  assert planner.expert_parallelism(cfg, 16, 128, mesh, EXPERTS_OVER_FSDP) == (4, 4)
  over_tensor = models.rules_from_config((("experts", ("tensor",)),))
  assert planner.expert_parallelism(cfg, 16, 128, mesh, over_tensor) == (8, 1)
  both = models.rules_from_config((("experts", ("data", "fsdp")),))
  assert planner.expert_parallelism(cfg, 16, 128, mesh, both) == (2, 8)


@pytest.mark.parametrize("experts", [8, 16])
@pytest.mark.parametrize("remat", ["none", "dots_with_no_batch_dims"])
def test_expert_parallel_mixture_keeps_every_gathered_tokens_rows(remat, experts):
  """Experts over fsdp 8: each device routes its own tokens, then keeps for each of the
  8 devices' tokens gathered to its E / 8 experts the sorted rows, gate, up, product,
  float32 outputs and the pairs' weights, ids and which are its own; the group sizes of
  its own experts, and its experts' (and the router's) cast to the compute dtype alone,
  never the other experts.
  The planner counts exactly that (and a dots policy the router's logits alone)."""
  cfg = models.get_preset("tiny", **{**MOE, "num_experts": experts}, remat=remat,
                          attention_impl="flash", dtype="bfloat16", param_dtype="float32")
  mesh = models.make_mesh((1, 8, 1, 1))
  rows, length, (e, k, d, f, s) = 8, 128, (experts, 2, 96, 40, 2)
  local, g = experts // 8, 8
  tokens = rows // 8 * length
  if remat == "none":
    routed = s * (k * d + 3 * k * f) + 4 * (k * d + 4 * k) + k
    per_token = s * d + 4 * (e + 2 * k + 4) + g * routed
    per_layer, experts_kept = 4 * local, s * 3 * local * d * f
    router = s * d * e  # its cast, given to every device
  else:
    per_token, per_layer, experts_kept, router = 4 * e, 0, 0, 0
  found = _residuals(cfg, rows, length, mesh, EXPERTS_OVER_FSDP)
  inside = sum(n for n, src, _ in found if "MoE._routed" in src or "_expert_parallel" in src)
  assert inside / mesh.size == cfg.mixture_layers * (tokens * per_token + per_layer + router)
  cast = sum(n for n, src, shape in found if "(place)" in src
             and tuple(shape) in ((e, d, f), (e, f, d)))
  assert cast / 8 == cfg.mixture_layers * experts_kept  # E over 8 devices
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, (1, 8, 1, 1))))
  dense = _dense_twin(cfg, remat=remat, attention_impl="flash", dtype="bfloat16",
                      param_dtype="float32")
  dense_mlp = s * (3 if remat == "none" else 2) * f
  assert (planner.saved_activation_bytes(cfg, rows=rows, row_len=length, mesh=abstract,
                                         rules=EXPERTS_OVER_FSDP)
          - planner.saved_activation_bytes(dense, rows=rows, row_len=length, mesh=abstract)
          == cfg.mixture_layers * (tokens * (per_token - (s * d if remat == "none" else 0)
                                             - dense_mlp) + per_layer + experts_kept + router))


def _device_residuals(cfg, rows, length, rules):
  """Bytes one device of a (1, 8, 1, 1) mesh keeps of `_residuals` (the params in the
  compute dtype: no weight casts), the other arrays split over fsdp 8 with the tokens:
  shard_map's residuals (every device's stacked), and the experts it is given whole (D
  gathered) without expert parallelism; with it those are the device's stored slice,
  no copy."""
  mesh = models.make_mesh((1, 8, 1, 1))
  experts = 0 if dict(rules).get("experts") else 1  # a gathered copy, or none
  return sum(experts * n if "(place)" in src else n / 8
             for n, src, _ in _residuals(cfg, rows, length, mesh, rules))


@pytest.mark.parametrize("rules, remat, latent", [
    (models.DEFAULT_RULES, "none", 16),
    (models.DEFAULT_RULES, "dots", 16),
    (EXPERTS_OVER_FSDP, "none", 0),
    (EXPERTS_OVER_FSDP, "none", 16),
    (EXPERTS_OVER_FSDP, "dots", 16),
], ids=["gathered-none-latent", "gathered-dots-latent", "ep-none", "ep-none-latent",
        "ep-dots-latent"])
def test_mixture_layers_alone_on_a_mesh_match_what_jax_keeps(rules, remat, latent):
  """Nemotron 3's mixture alone over fsdp 8, its 8 experts gathered whole or split over
  the devices: its share of a device's saved activations (a second mixture layer's) is
  exact but for its norm's scale. With expert parallelism the router's float32 rows
  and scores are the device's own tokens', the router is gathered whole, and under dots
  the float32 weighted sum before latent_out holds the 8 devices' tokens."""
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, (1, 8, 1, 1))))
  kinds = ("linear_attention", "moe", "full_attention", "mlp", "moe")
  rows, length = 8, 128
  shares = []
  for layers in (kinds, kinds[:1] + kinds[2:]):
    cfg = models.get_preset("tiny", **{**NEMOTRON_3, "num_experts": 8}, num_layers=len(layers),
                            layer_types=layers, rope_layers=(0,) * len(layers),
                            moe_latent_dim=latent, remat=remat, dtype="bfloat16",
                            param_dtype="bfloat16")
    shares.append((_device_residuals(cfg, rows, length, rules),
                   planner.saved_activation_bytes(cfg, rows=rows, row_len=length,
                                                  mesh=abstract, rules=rules)))
  (kept, planned), (less_kept, less_planned) = shares
  assert 0 <= (kept - less_kept) - (planned - less_planned) <= 2 * 96 / 8


@pytest.mark.parametrize("dtype, scoring, norm_topk_prob, activation", [
    ("bfloat16", "sigmoid", True, "silu"),
    ("bfloat16", "softmax", False, "relu2"),
    ("float32", "sigmoid", False, "relu2"),
])
def test_expert_parallel_routing_variants_match_what_jax_keeps(dtype, scoring, norm_topk_prob,
                                                               activation):
  """Expert parallelism keeps the routing's variants as a device running every expert
  does (a sigmoid router's float32 rows and two columns fewer, no normaliser's sum and
  weights without norm_topk_prob), on its own tokens, and the router gathered whole (in
  float32 for a sigmoid router) whatever the params' dtype. Exact against a dense model."""
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, (1, 8, 1, 1))))
  widths = dict(remat="none", attention_impl="flash", dtype=dtype, param_dtype=dtype,
                mlp_activation=activation)
  cfg = models.get_preset("tiny", **{**MOE, "num_experts": 8, "router_scoring": scoring,
                                     "norm_topk_prob": norm_topk_prob}, **widths)
  kept, planned = [], []
  for c in (cfg, _dense_twin(cfg, **widths)):
    kept.append(_device_residuals(c, 8, 128, EXPERTS_OVER_FSDP))
    planned.append(planner.saved_activation_bytes(c, rows=8, row_len=128, mesh=abstract,
                                                  rules=EXPERTS_OVER_FSDP))
  assert planned[0] - planned[1] == kept[0] - kept[1]


def test_expert_parallel_sampler_copy_keeps_the_experts_split():
  """The sampler's copy gathered over fsdp keeps the experts' E split when the rules
  split it over fsdp: the plan's `gathered` is what the Sampler holds, and the experts'
  share of it is 1/4 of theirs gathered whole."""
  rules = (("experts", ("fsdp",)),)
  changes = {**TINY, "model.overrides.num_experts": 8, "model.overrides.num_experts_per_tok": 2,
             "model.overrides.ffn_dim": 64, "mesh.fsdp": 4, "mesh.tensor": 2}
  config = _config(**changes, sharding_rules=rules)
  p = planner.plan(config)
  cfg = experiment.model_config(config)
  real_mesh = models.make_mesh((1, 4, 2, 1))
  model = models.create_model(cfg, mesh=real_mesh, rules=models.rules_from_config(rules))
  sampler = Sampler(model, mesh=real_mesh, rules=rules, max_len=64)
  assert p["gathered"] == pytest.approx(_real_per_device_bytes(sampler._weights()), rel=0.05)
  whole = planner.plan(_config(**changes))["gathered"]
  # A layer's 8 experts of D 96, F 32 a device (over tensor), each padded to 128 lanes
  # (F for gate and up, F and D for down: `expert_padding_bytes`), float32.
  experts = 4 * cfg.mixture_layers * 8 * (2 * 96 * 128 + 128 * 128)
  assert whole - p["gathered"] == experts - experts // 4


def test_expert_parallel_plan_of_llama4_on_a_v5p64():
  """Llama 4 on a v5p-64 (fsdp 16 x tensor 2, LoRA): Maverick does not fit 60 GiB chips
  with each layer's 128 experts gathered, and the advice names expert parallelism, its
  plan above
  the 62.47 GiB a chip XLA:TPU compiled it to with the sampler's own copy of the weights
  (libtpu 0.0.42.1, BENCHMARKS.md), 39.14 now that the sampler shares the frozen base
  (the same program, 23.33 GiB less beside it). A decode step then gathers a layer's
  router and not its experts. Scout's 16 experts, one a chip, cost more that way: the
  tokens of 16 chips to spare a 1.9 GiB layer (compiled: 21.35 GiB against 19.34)."""
  module = importlib.import_module("configs.llama4_scout_lora_grpo_v5p64")
  maverick = planner.override(module.get_config(), {"model.preset": "llama4_maverick"})
  # 60 GiB chips: with its base shared by the sampler, Maverick fits a v5p's 95 either
  # way (compiled 56.33 GiB a chip gathering its experts).
  p = planner.plan(maverick, device_memory_gb=60)
  assert not p.fits
  flag = """--config.sharding_rules='(("experts", ("fsdp",)),)'"""
  (line,) = [a for a in p.advice if a.startswith(flag)]
  ep = planner.plan(planner.override(maverick, {"sharding_rules": (("experts", ("fsdp",)),)}),
                    device_memory_gb=60)
  assert ep.fits and f"peak {planner.human_bytes(ep.peak)}" in line
  # Compiled: 39.14 GiB for the update, 33.37 for the rollout; the plan stays above.
  assert 39.14 < ep.train_peak / 2**30 < 39.14 * 1.1
  assert 33.37 < ep.rollout_peak / 2**30 < 33.37 * 1.1
  assert "8 experts a device taking 16 devices' tokens" in ep.components["activations"].formula
  cfg = experiment.model_config(maverick)
  mesh = planner.abstract_mesh(ep.mesh)
  attention = planner._attention_weight_bytes(cfg, 40 // 2, 8 // 2)
  # The shared expert, and the sigmoid router in float32 (gathered, as without it).
  mixture = 2 * 3 * cfg.d_model * cfg.shared_expert_dim // 2 + 4 * cfg.d_model * 128
  dense = 2 * 3 * cfg.d_model * cfg.dense_ffn_dim // 2  # the layers between: now larger
  assert mixture < dense
  assert planner.decode_step_bytes(cfg, rows=512, mesh=mesh, rules=EXPERTS_OVER_FSDP,
                                   gathered=False) == (
      512 * cfg.vocab_size // 2 * 4 + attention + dense)
  assert planner.decode_step_bytes(cfg, rows=512, mesh=mesh, gathered=False) == (
      512 * cfg.vocab_size // 2 * 4 + attention + mixture + 2 * 3 * 128 * cfg.d_model * 8192 // 2)
  scout = module.get_config()
  assert (planner.plan(planner.override(scout, {"sharding_rules": (("experts", ("fsdp",)),)}))
          .train_peak > planner.plan(scout).train_peak)


def test_mixture_plan_counts_every_expert():
  """A mixture's params are all num_params (every expert), on real arrays too; a layer
  gathered for a decode step or a backward holds all E experts, whatever the routing."""
  config = _config(**TINY, **{"model.overrides.num_experts": 5,
                              "model.overrides.num_experts_per_tok": 2})
  cfg = experiment.model_config(config)
  assert planner.plan(config, num_devices=1)["params"] == cfg.num_params * 4
  p = planner.plan(config)  # fsdp 8
  real_mesh = models.make_mesh((1, 8, 1, 1))
  model = models.create_model(cfg, mesh=real_mesh)
  assert p["params"] == _real_per_device_bytes(nnx.state(model, nnx.Param))
  for preset in ("qwen3_30b_a3b", "mixtral_8x7b"):
    big = models.get_preset(preset, scan_layers=True)  # traces one layer
    whole = dict.fromkeys(models.MESH_AXES, 1)
    assert planner.state_bytes(big, whole)[0] == big.num_params * 2  # bfloat16
  # Qwen3-30B-A3B over fsdp 8 x tensor 4: a decode step with weights left sharded
  # gathers 8 heads, 1 kv head and all 128 experts at F 768 / 4, 1.1 GiB / 4 of them.
  big = models.get_preset("qwen3_30b_a3b")
  mesh = planner.abstract_mesh({"data": 1, "fsdp": 8, "tensor": 4, "sequence": 1})
  d, nh, kh, e, f = 2048, 8 * 128, 1 * 128, 128, 768 // 4
  experts = 2 * (3 * e * d * f + d * e)
  assert 0.28 < experts / 2**30 < 0.29
  assert planner.decode_step_bytes(big, rows=64, mesh=mesh, gathered=False) == (
      64 * big.vocab_size // 4 * 4 + 2 * (2 * d * nh + 2 * d * kh) + experts)
  # The shipped v5p-64 run (fsdp 16 x tensor 2, float32 params, micro-batches
  # accumulated): the update holds the experts' float32 gradient once more than the
  # params' (as XLA:TPU compiles it), and two bfloat16 copies of every layer's experts.
  config = importlib.import_module("configs.qwen3_30b_a3b_grpo_v5p64").get_config()
  p = planner.plan(config)
  cfg = experiment.model_config(config)
  fsdp16 = planner.abstract_mesh(p.mesh)
  f32 = planner.expert_bytes(cfg, fsdp16)
  assert f32 == 48 * 3 * 128 * (2048 // 16) * (768 // 2) * 4  # 3.375 GiB
  assert planner.microbatches(config, experiment.algorithm(config))[0] > 1
  assert p["gradients"] == 2 * p["params"] + f32
  one = planner.plan(planner.override(config, {"rl.num_minibatches": 16}))  # 1 per update
  assert one["gradients"] == one["params"]
  bf16 = planner.override(config, {"model.overrides.param_dtype": "bfloat16"})
  rows, row_len = int(config.train.rows_per_microbatch), int(config.train.row_len)
  assert (planner.activation_bytes(cfg, rows=rows, row_len=row_len, mesh=fsdp16)[0]
          - planner.activation_bytes(experiment.model_config(bf16), rows=rows,
                                     row_len=row_len, mesh=fsdp16)[0]) == f32
  assert planner.expert_bytes(models.get_preset("llama3_8b"), fsdp16) == 0


def test_mixture_with_dense_layers_plans_its_params_and_its_largest_layer():
  """GLM-4.5's layout (the first of 3 layers dense, a shared expert, a float32 correction
  bias): the params are num_params, on real arrays too; the experts (their gradient,
  casts and the sampler's padding) are the mixture layers' alone; a layer gathered for
  a decode step or a prefill is the larger of a mixture layer (experts, float32 router,
  shared expert) and a dense layer (its MLP of dense_ffn_dim)."""
  glm = {f"model.overrides.{name}": value for name, value in GLM4_MOE.items()}
  config = _config(**{**TINY, **glm, "model.overrides.num_experts_per_tok": 2})
  cfg = experiment.model_config(config)
  assert (cfg.num_layers, cfg.dense_layers, cfg.mixture_layers) == (3, 1, 2)
  assert planner.plan(config, num_devices=1)["params"] == cfg.num_params * 4
  whole = dict.fromkeys(models.MESH_AXES, 1)
  assert planner.state_bytes(cfg.replace(scan_layers=True), whole)[0] == cfg.num_params * 4
  p = planner.plan(config)  # fsdp 8
  model = models.create_model(cfg, mesh=models.make_mesh((1, 8, 1, 1)))
  assert p["params"] == _real_per_device_bytes(nnx.state(model, nnx.Param))
  e, d, f, fs, s = 6, 96, 160, 40, np.dtype(cfg.dtype).itemsize
  fsdp8 = planner.abstract_mesh(p.mesh)
  assert planner.expert_bytes(cfg, fsdp8) == 2 * 3 * e * (d // 8) * f * 4
  pad = s * 2 * e * ((256 - f) * 2 * d + 256 * 128 - f * d)  # F 160 -> 256, D 96 -> 128
  assert planner.expert_padding_bytes(cfg, whole) == pad
  # Left sharded, a decode step gathers the larger layer: here a mixture layer.
  attn = s * (2 * d * 6 * 16 + 2 * d * 2 * 16)
  mixture = s * 3 * e * d * f + 4 * d * e + s * 3 * d * fs
  logits = 8 * cfg.vocab_size * 4
  assert planner.decode_step_bytes(cfg, rows=8, mesh=fsdp8, gathered=False) == (
      logits + attn + mixture)
  wide = cfg.replace(dense_ffn_dim=4000)  # the dense layer's MLP outweighs the experts
  assert planner.decode_step_bytes(wide, rows=8, mesh=fsdp8, gathered=False) == (
      logits + attn + s * 3 * d * 4000)
  # So does a prefill's layer forward: the wide layer's five [tokens, F] outweigh the
  # mixture layer's rows (k sorted inputs, five [k, F], float32 outputs, router columns
  # and the shared expert's five [tokens, Fs]); left sharded, with its weights.
  args = dict(prompts=8, prompt_len=64, rows=8, mesh=fsdp8)
  assert (planner.prefill_bytes(wide, gathered=False, **args)
          - planner.prefill_bytes(wide, **args)) == attn + s * 3 * d * 4000
  assert (planner.prefill_bytes(wide, **args) - planner.prefill_bytes(cfg, **args)
          == 64 * (s * (5 * 4000 - 2 * d - 5 * 2 * f - 5 * fs) - 4 * (2 * 2 * d + 2 * e)))


def _check_cache_bytes_are_init_caches(cfg) -> None:
  """The planner's cache on one device is the arrays init_cache builds for `cfg` (8 rows
  of 64 slots), float or int8 with its scales, the layers listed or stacked."""
  one = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  for dtype in (None, "int8"):
    for scanned in (cfg, cfg.replace(scan_layers=True)):
      arrays = jax.eval_shape(lambda: models.init_cache(  # noqa: B023
          scanned, 8, 64, jnp.int8 if dtype else None))  # noqa: B023
      assert planner.kv_cache_bytes(scanned, batch=8, max_len=64, mesh=one, dtype=dtype) == (
          sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(arrays)))


def _tiny(layout):
  """The TINY run config with the model's fields of `layout` overridden."""
  return _config(**{**TINY, **{f"model.overrides.{k}": v for k, v in layout.items()}})


def test_latent_attention_plan_counts_its_projections():
  """Multi-head latent attention's params are num_params, on real arrays too (with and
  without a query latent, and in DeepSeek-V3's mixture layout); a layer gathered for a
  decode step holds its projections in the compute dtype, the latent ones whole and the
  heads' split over tensor, as real arrays shard them; the cache is the arrays the
  model's init_cache builds; a prefill's layer forward keeps its projections' outputs
  beside the expanded keys and padded values."""
  # Over fsdp 8; queries through a latent over data 4 x tensor 2 (the heads split).
  deepseek = {**DEEPSEEK_V3, "num_experts_per_tok": 2}
  mesh = (4, 1, 2, 1)
  real = {}
  for layout, shape in (({**MLA, "q_lora_rank": 0}, (1, 8, 1, 1)),
                        (deepseek, (1, 8, 1, 1)), (MLA, mesh)):
    config = planner.override(_tiny(layout), dict(zip(
        ("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.sequence"), shape)))
    cfg = experiment.model_config(config)
    assert planner.plan(_tiny(layout), num_devices=1)["params"] == cfg.num_params * 4
    model = models.create_model(cfg, mesh=models.make_mesh(shape))
    real[shape] = nnx.state(model, nnx.Param)
    assert planner.plan(config)["params"] == _real_per_device_bytes(real[shape]), layout
  # Left sharded over data 4 x tensor 2, a decode step gathers one layer: on real arrays,
  # this device's shard of the first layer's projections (the norms' scales aside): 3
  # heads and F 80 a device, the latents' projections and k_rope_proj whole.
  d, n, h, rq, r, hr, v, f, s = 96, 3, 24, 12, 16, 8, 12, 80, 4
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, mesh)))
  weights = [x for path, x in jax.tree_util.tree_leaves_with_path(real[mesh]["layers"][0])
             if "norm" not in jax.tree_util.keystr(path)]
  logits = 8 * cfg.vocab_size // 2 * 4
  assert planner.decode_step_bytes(cfg, rows=8, mesh=abstract, gathered=False) == (
      logits + _real_per_device_bytes(weights))
  attn = s * (d * rq + rq * n * h + d * (r + hr) + r * n * (h - hr + v) + n * v * d)
  assert _real_per_device_bytes(weights) == attn + s * 3 * d * f
  # Queries through q_proj: D NH in place of D Rq + Rq NH.
  no_q_latent = experiment.model_config(_tiny({**MLA, "q_lora_rank": 0}))
  assert (planner.decode_step_bytes(cfg, rows=8, mesh=abstract, gathered=False)
          - planner.decode_step_bytes(no_q_latent, rows=8, mesh=abstract, gathered=False)
          == s * (d * rq + rq * n * h - d * n * h))
  # The cache: the arrays init_cache builds for the model, int8 with their scales, layers
  # listed or stacked: the latent alone, one head of Hr + R features (no v), 2 layers.
  cfg = experiment.model_config(_tiny(MLA))
  one = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  assert planner.kv_cache_bytes(cfg, batch=8, max_len=64, mesh=one) == 2 * 8 * 64 * (hr + r) * s
  _check_cache_bytes_are_init_caches(cfg)
  # A prefill (16 prompts of 64 over fsdp 8, all 6 heads a device) against standard
  # attention of as many heads, the prompts' caches aside: the latents, the rotated key
  # part, the unrotated keys and the unpadded values more in its layer's forward.
  n, rq = 6, 12
  mha = experiment.model_config(_tiny(MHA))
  fsdp8 = planner.abstract_mesh({"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1})
  args = dict(prompts=16, prompt_len=64, rows=16, mesh=fsdp8)

  def forward(c):
    return planner.prefill_bytes(c, **args) - planner.kv_cache_bytes(
        c, batch=16, max_len=64, mesh=fsdp8)

  assert forward(cfg) - forward(mha) == 2 * 64 * s * (rq + r + hr + n * (h - hr) + n * v)
  # DeepSeek-V3's layout: its gathered layer (a mixture layer's experts, the float32
  # router and the shared expert) holds the latent projections in place of q, k, v, o.
  ds = experiment.model_config(_tiny(deepseek))
  twin = experiment.model_config(_tiny({**deepseek, **MHA}))
  attn = s * (d * rq + rq * n * h + d * (r + hr) + r * n * (h - hr + v) + n * v * d)
  assert (planner.decode_step_bytes(ds, rows=8, mesh=fsdp8, gathered=False)
          - planner.decode_step_bytes(twin, rows=8, mesh=fsdp8, gathered=False)
          == attn - s * 4 * d * n * h)


def test_linear_attention_plan_counts_its_layers():
  """Qwen3.5's layout: params are num_params, on real arrays too; a layer gathered for a
  decode step is the larger kind, here a Gated DeltaNet layer (its projections, taps and
  o_proj, the key and value heads split over tensor as real arrays shard them) beside
  the MLP; the backward's recomputed layer is the larger kind too; a prefill's layer
  forward is a linear layer's, by hand."""
  mesh = (4, 1, 2, 1)
  config = planner.override(_tiny(QWEN3_5), dict(zip(
      ("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.sequence"), mesh)))
  cfg = experiment.model_config(config)
  assert any(cfg.linear_layers) and cfg.attn_output_gate
  assert planner.plan(_tiny(QWEN3_5), num_devices=1)["params"] == cfg.num_params * 4
  real = nnx.state(models.create_model(cfg, mesh=models.make_mesh(mesh)), nnx.Param)
  assert planner.plan(config)["params"] == _real_per_device_bytes(real)
  # Left sharded over data 4 x tensor 2, a decode step gathers one layer: a linear one,
  # larger than the gated attention layer (norm scales, A_log and dt_bias aside).
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, mesh)))
  linear = [x for path, x in jax.tree_util.tree_leaves_with_path(real["linear_layers"][0])
            if not re.search("norm|A_log|dt_bias", jax.tree_util.keystr(path))]
  full = [x for path, x in jax.tree_util.tree_leaves_with_path(real["layers"][0])
          if "norm" not in jax.tree_util.keystr(path)]
  assert _real_per_device_bytes(linear) > _real_per_device_bytes(full)
  logits = 8 * cfg.vocab_size // 2 * 4
  assert planner.decode_step_bytes(cfg, rows=8, mesh=abstract, gathered=False) == (
      logits + _real_per_device_bytes(linear))
  # The ungated twin's attention layer is s D NH smaller (its q_gate).
  ungated = cfg.replace(attn_output_gate=False, layer_types=("full_attention",) * 4)
  gated = cfg.replace(layer_types=("full_attention",) * 4)
  assert (planner.decode_step_bytes(gated, rows=8, mesh=abstract, gathered=False)
          - planner.decode_step_bytes(ungated, rows=8, mesh=abstract, gathered=False)
          == 4 * 96 * 3 * 16)
  # The backward's recomputed layer (twice under a remat policy): a linear layer's beside
  # flash attention's, the attention layer's beside the reference's [T, T] scores; and,
  # the model having linear layers, what a linear layer's backward holds beyond them.
  one = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  logits = 3 * 4 * 64 * cfg.vocab_size * 4
  for impl, larger in (("flash", "linear"), ("reference", "attention")):
    c = cfg.replace(attention_impl=impl)
    acts = planner.activation_bytes(c, rows=4, row_len=128, mesh=one, remat="dots")[0]
    saved = planner.saved_activation_bytes(c, rows=4, row_len=128, mesh=one, remat="dots")
    layers = {"linear": planner.linear_layer_activation_bytes(
                  c, "none", key_heads=2, value_heads=6, mlp=160, kv_len=128, dense=True),
              "attention": planner.layer_activation_bytes(
                  c, "none", heads=6, kv_heads=2, mlp=160, kv_len=128, dense=True)}
    assert max(layers, key=layers.get) == larger
    backward = 4 * 128 * planner._linear_backward_bytes(c, 2, 6, kv_len=128)
    assert acts - saved == int(2 * 4 * 128 * layers[larger] + backward) + logits
  # A prefill of 16 prompts of 64 over fsdp 8 (2 a device) beside flash attention, the
  # prompts' cache aside: the linear layer's projections, conv outputs, float32 scan
  # inputs and output, the MLP, and per row one chunk's [c, c] matrices and the state;
  # and the linear layers' input projections relaid (q, k, v, z, b, a), D whole.
  fsdp8 = planner.abstract_mesh({"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1})
  flash = cfg.replace(attention_impl="flash")
  d, k, v, hv, c, s = 96, 2 * 16, 6 * 24, 6, 32, 4
  per_token = (s * (2 * d + 4 * k + 3 * v + 2 * hv) + 4 * (2 * k + 2 * v + 2 * hv)
               + s * 5 * 160)
  per_row = 4 * hv * (5 * c * c + 2 * 16 * 24)
  relaid = s * d * (2 * k + 2 * v + 2 * hv) * sum(cfg.linear_layers)
  assert sum(cfg.linear_layers) == 3
  assert (planner.prefill_bytes(flash, prompts=16, prompt_len=64, rows=16, mesh=fsdp8)
          - planner.kv_cache_bytes(flash, batch=16, max_len=64, mesh=fsdp8)
          == relaid + 2 * 64 * per_token + 2 * per_row)


def test_parallel_mixer_plan_counts_its_mixers():
  """Falcon-H1's layout: params are num_params, on real arrays too; a layer gathered for
  a decode step holds its attention, its Mamba2 (projections, taps, out_proj) and its
  MLP, the heads split over tensor as real arrays shard them; the cache is every layer's
  KV cache and Mamba2 state, as init_cache builds them (listed or stacked, int8 too);
  the backward's recomputed layer holds the Mamba2's terms and a linear mixer's
  backward; a prefill's layer forward holds the Mamba2's beside the attention's, and
  every layer's Mamba2 input projections relaid, by hand."""
  mesh = (4, 1, 2, 1)
  config = planner.override(_tiny(FALCON_H1), dict(zip(
      ("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.sequence"), mesh)))
  cfg = experiment.model_config(config)
  assert cfg.parallel_mixer and not any(cfg.linear_layers)
  p = planner.plan(_tiny(FALCON_H1), num_devices=1, device_memory_gb=16)
  assert p["params"] == cfg.num_params * 4
  assert "Mamba2" in planner.format_plan(p)
  real = nnx.state(models.create_model(cfg, mesh=models.make_mesh(mesh)), nnx.Param)
  assert planner.plan(config)["params"] == _real_per_device_bytes(real)
  # Left sharded over data 4 x tensor 2, a decode step gathers one layer: its attention,
  # Mamba2 and MLP (norm scales, A_log, dt_bias, D and the taps' biases aside).
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, mesh)))
  layer = [x for path, x in jax.tree_util.tree_leaves_with_path(real["layers"][0])
           if not re.search(r"norm|A_log|dt_bias|conv_bias|\['D'\]",
                            jax.tree_util.keystr(path))]
  mixer = [x for path, x in jax.tree_util.tree_leaves_with_path(real["layers"][0])
           if re.search(r"\['linear_attn'\]\['(\w_proj|\w_conv)'\]",
                        jax.tree_util.keystr(path))]
  assert len(mixer) == 9  # z, x, B, C, dt and out projections, three taps
  assert planner._linear_weight_bytes(cfg, 1, 3) == _real_per_device_bytes(mixer)
  logits = 8 * cfg.vocab_size // 2 * 4
  assert planner.decode_step_bytes(cfg, rows=8, mesh=abstract, gathered=False) == (
      logits + _real_per_device_bytes(layer))
  # The cache: each layer's KV cache and its Mamba2 state, as init_cache builds them.
  one = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  _check_cache_bytes_are_init_caches(cfg)
  attention_only = experiment.model_config(_tiny(FALCON_H1_ATTENTION))
  state = 8 * (6 * 16 * 24 * 4 + 3 * (2 * 2 * 16 + 6 * 24) * 4)  # float32 state, conv inputs
  assert (planner.kv_cache_bytes(cfg, batch=8, max_len=64, mesh=one)
          - planner.kv_cache_bytes(attention_only, batch=8, max_len=64, mesh=one)
          == 2 * state)
  # The backward's recomputed layer (twice under a remat policy): the attention layer's
  # and its Mamba2's, and what a linear mixer's backward holds beyond them.
  acts = planner.activation_bytes(cfg, rows=4, row_len=128, mesh=one, remat="dots")[0]
  saved = planner.saved_activation_bytes(cfg, rows=4, row_len=128, mesh=one, remat="dots")
  layer = (planner.layer_activation_bytes(cfg, "none", heads=4, kv_heads=2, mlp=160,
                                          kv_len=128, dense=True)
           + planner.parallel_mixer_activation_bytes(cfg, "none", key_heads=2,
                                                     value_heads=6, kv_len=128))
  backward = 4 * 128 * planner._linear_backward_bytes(cfg, 2, 6, kv_len=128)
  assert acts - saved == int(2 * 4 * 128 * layer + backward) + 3 * 4 * 64 * cfg.vocab_size * 4
  # A prefill of 16 prompts of 64 over fsdp 8 (2 a device), the prompts' cache aside,
  # against the attention layers alone: the Mamba2's projections, conv outputs, float32
  # scan inputs and output, and per row one chunk's [c, c] matrices and the state; and
  # every layer's Mamba2 input projections relaid, D whole.
  fsdp8 = planner.abstract_mesh({"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1})
  d, k, v, hv, c, s = 64, 2 * 16, 6 * 24, 6, 32, 4

  def forward(m):
    return (planner.prefill_bytes(m, prompts=16, prompt_len=64, rows=16, mesh=fsdp8)
            - planner.kv_cache_bytes(m, batch=16, max_len=64, mesh=fsdp8))

  per_token = s * (4 * k + 3 * v + 2 * hv) + 4 * (2 * k + 2 * v + 2 * hv)
  per_row = 4 * hv * (5 * c * c + 2 * 16 * 24)
  relaid = s * d * (2 * k + 2 * v + 2 * hv) * 2
  assert forward(cfg) - forward(attention_only) == relaid + 2 * 64 * per_token + 2 * per_row
  # Over fsdp 4 x tensor 2 a device keeps of 8 rows what one device keeps of 2 rows of
  # the model with every axis the tensor axis splits halved, the Mamba2's groups and
  # heads among them.
  fsdp4_tensor2 = planner.abstract_mesh(dict(zip(models.MESH_AXES, (1, 4, 2, 1))))
  half = cfg.replace(linear_num_key_heads=1, linear_num_value_heads=3, num_heads=2,
                     num_kv_heads=1, ffn_dim=80, vocab_size=cfg.vocab_size // 2)
  assert (planner.saved_activation_bytes(cfg, rows=8, row_len=128, mesh=fsdp4_tensor2)
          == planner.saved_activation_bytes(half, rows=2, row_len=128, mesh=one))


def test_short_conv_plan_counts_its_layers():
  """LFM2's layout: params are num_params, on real arrays too; a layer gathered for a
  decode step is the larger kind, here a short-convolution layer (in_proj's three
  parts, the taps, out_proj and the biases, its channels split over tensor as real
  arrays shard them) beside the MLP; the cache is the attention layers' KV caches and
  the conv layers' windows, as init_cache builds them; the backward's recomputed layer
  is the larger kind, beside the convolution's float32 backward; a prefill's layer
  forward is a conv layer's by hand (weights left sharded, its weights with it), with
  nothing relaid; a pattern of many runs holds each conv layer's projection outputs."""
  mesh = (4, 1, 2, 1)
  layout = {**LFM2, "linear_conv_bias": True}
  config = planner.override(_tiny(layout), dict(zip(
      ("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.sequence"), mesh)))
  cfg = experiment.model_config(config)
  assert cfg.linear_mixer == "short_conv" and sum(cfg.linear_layers) == 2
  p = planner.plan(_tiny(layout), num_devices=1, device_memory_gb=16)
  assert p["params"] == cfg.num_params * 4
  assert "2 of the layers short convolutions" in p.components["activations"].formula
  assert "2 short convolutions' windows" in p.components["kv_cache"].formula
  assert "relaid" not in p.components["prefill"].formula
  real = nnx.state(models.create_model(cfg, mesh=models.make_mesh(mesh)), nnx.Param)
  assert planner.plan(config)["params"] == _real_per_device_bytes(real)
  # Left sharded over data 4 x tensor 2, a decode step gathers one layer: a conv layer
  # (48 of its 96 channels a device), larger than the attention layer (norm scales aside).
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, mesh)))
  d, e, f, s = 96, 48, 80, 4
  assert planner._linear_shards(cfg, 8, 128, abstract, models.DEFAULT_RULES) == (0, e)
  conv = [x for path, x in jax.tree_util.tree_leaves_with_path(real["linear_layers"][0])
          if "norm" not in jax.tree_util.keystr(path)]
  mixer = [x for path, x in jax.tree_util.tree_leaves_with_path(real["linear_layers"][0])
           if "linear_attn" in jax.tree_util.keystr(path)]
  full = [x for path, x in jax.tree_util.tree_leaves_with_path(real["layers"][0])
          if "norm" not in jax.tree_util.keystr(path)]
  assert len(mixer) == 10  # b, c, x and out projections, the taps, five biases
  assert _real_per_device_bytes(conv) > _real_per_device_bytes(full)
  assert _real_per_device_bytes(conv) == _real_per_device_bytes(mixer) + s * 3 * d * f
  assert (planner._linear_weight_bytes(cfg, 0, e) == _real_per_device_bytes(mixer)
          == s * (4 * d * e + 3 * e + 4 * e + d))
  assert planner._linear_weight_bytes(cfg.replace(linear_conv_bias=False), 0, e) == (
      s * (4 * d * e + 3 * e))
  logits = 8 * cfg.vocab_size // 2 * 4
  assert planner.decode_step_bytes(cfg, rows=8, mesh=abstract, gathered=False) == (
      logits + _real_per_device_bytes(conv))
  # The cache: the attention layers' KV caches and the conv layers' windows of C - 1 = 2
  # inputs of B * x, as init_cache builds them.
  one = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  _check_cache_bytes_are_init_caches(cfg)
  attention_only = cfg.replace(num_layers=2, layer_types=("full_attention",) * 2)
  assert (planner.kv_cache_bytes(cfg, batch=8, max_len=64, mesh=one)
          - planner.kv_cache_bytes(attention_only, batch=8, max_len=64, mesh=one)
          == 2 * 8 * 2 * d * s)
  # The backward's recomputed layer (twice under a remat policy): the larger of a conv
  # layer's (by hand: the block's, SwiGLU's and six [D] rows) and the q/k-normed
  # attention layer's, and the convolution's float32 backward, 24 bytes a channel.
  layers = {"conv": planner.linear_layer_activation_bytes(
                cfg, "none", key_heads=0, value_heads=d, mlp=160, kv_len=128, dense=True),
            "attention": planner.layer_activation_bytes(
                cfg, "none", heads=6, kv_heads=2, mlp=160, kv_len=128, dense=True)}
  assert layers["conv"] == s * 4 * d + 4 * (4 * d + 4) + s * 3 * 160 + 6 * s * d
  for impl in ("flash", "reference"):
    c = cfg.replace(attention_impl=impl)
    layers["attention"] = planner.layer_activation_bytes(
        c, "none", heads=6, kv_heads=2, mlp=160, kv_len=128, dense=True)
    acts = planner.activation_bytes(c, rows=4, row_len=128, mesh=one, remat="dots")[0]
    saved = planner.saved_activation_bytes(c, rows=4, row_len=128, mesh=one, remat="dots")
    assert acts - saved == (int(2 * 4 * 128 * max(layers.values()) + 4 * 128 * 24 * d)
                            + 3 * 4 * 64 * cfg.vocab_size * 4)
  # A prefill of 16 prompts of 64 over fsdp 8 (2 a device) beside flash attention, the
  # prompts' cache aside: the conv layer's block rows and six [D] rows, and its MLP's
  # five [F] rows; left sharded, that layer's weights (all 96 channels) gathered too.
  # Nothing relaid either way.
  fsdp8 = planner.abstract_mesh({"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1})
  flash = cfg.replace(attention_impl="flash")
  args = dict(prompts=16, prompt_len=64, rows=16, mesh=fsdp8)
  forward = 2 * 64 * (s * (2 * d + 6 * d) + s * 5 * 160)
  cache = planner.kv_cache_bytes(flash, batch=16, max_len=64, mesh=fsdp8)
  assert planner.prefill_bytes(flash, **args) - cache == forward
  assert planner.prefill_bytes(flash, **args, gathered=False) - cache == (
      forward + s * (4 * d * d + 3 * d + 4 * d + d) + s * 3 * d * 160)
  assert planner._relaid_stack_bytes(flash.replace(scan_layers=True), fsdp8,
                                     models.DEFAULT_RULES) == 0
  # LFM2-350M's pattern, scanned under full remat: its single-layer runs (4 conv layers,
  # 6 attention layers) are rebuilt in order, each holding its projections' outputs, a
  # conv layer's B, C, x and out_proj's s(3D + D), beside the MLP's 2sF (bfloat16).
  from posttrain.models.transformer import ordered_layers
  pattern = "CCACCACCACACACAC"
  kinds = {"C": "linear_attention", "A": "full_attention"}
  lfm2_350m = models.get_preset("tiny", **{**LFM2, "num_layers": len(pattern),
                                           "layer_types": tuple(kinds[k] for k in pattern)},
                                remat="full", scan_layers=True, dtype="bfloat16",
                                param_dtype="bfloat16")
  assert ordered_layers(lfm2_350m) == {"linear": 4, "full": 6}

  def held(m):
    return (planner.activation_bytes(m, rows=2, row_len=64, mesh=one)[0]
            - planner.activation_bytes(m.replace(scan_layers=False), rows=2, row_len=64,
                                       mesh=one)[0])

  assert held(lfm2_350m) == 2 * 64 * (4 * 2 * (3 * d + d + 2 * 160)
                                      + 6 * 2 * (2 * 96 + 16 * 32 + 2 * 160))


# Nemotron 3 in a run config: Mamba2, NoPE attention, an MLP alone of 40 and two
# mixtures alone of 8 relu^2 experts of 16 (2 a token, sigmoid scores) in a latent of
# 16, each with a shared expert of 24.
NEMOTRON_3_RUN = dict(
    vocab_size=64, d_model=32, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8,
    ffn_dim=16, layer_types=("linear_attention", "moe", "full_attention", "moe", "mlp",
                             "linear_attention"),
    rope_layers=(0,) * 6, mlp_activation="relu2", linear_mixer="mamba2",
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_bias=True, linear_chunk=4, num_experts=8,
    num_experts_per_tok=2, router_scoring="sigmoid", shared_expert_dim=24, dense_ffn_dim=40,
    moe_latent_dim=16, architecture="NemotronHForCausalLM")


@pytest.mark.parametrize("latent", [16, 0], ids=["latent", "experts_in_d"])
def test_mixture_layers_alone_plan_counts_their_weights(latent):
  """Nemotron 3's params are num_params, on real arrays too; its experts (their extra
  gradient, their casts) are the moe layers' up and down alone, [E, L, F] and [E, F, L]
  in a latent; the sampler's gathered copy is what the Sampler holds (relu^2 experts pad
  up and down alone), the experts gathered or split over fsdp (expert parallelism); a
  decode step with weights left sharded gathers the largest layer, here a mixture
  (experts, float32 router, latent projections, shared expert), as real arrays shard
  it; mixtures and MLPs alone have no cache."""
  config = _tiny({**NEMOTRON_3_RUN, "moe_latent_dim": latent})
  cfg = experiment.model_config(config)
  assert (cfg.mixture_layers, cfg.num_dense_layers) == (2, 1)
  assert planner.plan(config, num_devices=1)["params"] == cfg.num_params * 4
  # Over fsdp 4 x tensor 2, the experts' D (their latent's L) over fsdp or, expert
  # parallel, their E; F over tensor.
  real_mesh = models.make_mesh((1, 4, 2, 1))
  for rules in ((), (("experts", ("fsdp",)),)):
    shaped = planner.override(config, {"mesh.fsdp": 4, "mesh.tensor": 2,
                                       "sharding_rules": rules})
    p = planner.plan(shaped)
    model = models.create_model(cfg, mesh=real_mesh, rules=models.rules_from_config(rules))
    real = nnx.state(model, nnx.Param)
    assert p["params"] == _real_per_device_bytes(real), rules
    experts = [x for path, x in jax.tree_util.tree_leaves_with_path(real["moe_layers"])
               if re.search(r"\['mlp'\]\['(up|down)_proj'\]", jax.tree_util.keystr(path))]
    assert len(experts) == 4
    assert planner.expert_bytes(cfg, planner.abstract_mesh(p.mesh),
                                models.rules_from_config(rules)) == (
        _real_per_device_bytes(experts)), rules
    sampler = Sampler(model, mesh=real_mesh, rules=rules, max_len=64)
    assert p["gathered"] == _real_per_device_bytes(sampler._weights()), rules
  # Left sharded over data 4 x tensor 2, a decode step gathers one layer: this device's
  # shard of a mixture's weights (its norm and correction bias aside), the largest kind.
  mesh = (4, 1, 2, 1)
  real = nnx.state(models.create_model(cfg, mesh=models.make_mesh(mesh)), nnx.Param)
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, mesh)))
  moe = [x for path, x in jax.tree_util.tree_leaves_with_path(real["moe_layers"][0])
         if not re.search("norm|correction", jax.tree_util.keystr(path))]
  logits = 8 * cfg.vocab_size // 2 * 4
  assert planner.decode_step_bytes(cfg, rows=8, mesh=abstract, gathered=False) == (
      logits + _real_per_device_bytes(moe))
  # The cache: the arrays init_cache builds, one attention layer's and two Mamba2 states.
  one = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  for scanned in (cfg, cfg.replace(scan_layers=True)):
    arrays = jax.eval_shape(lambda: models.init_cache(scanned, 8, 64))  # noqa: B023
    assert planner.kv_cache_bytes(scanned, batch=8, max_len=64, mesh=one) == (
        sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(arrays)))


def test_activations_follow_the_remat_policy_and_the_mesh():
  cfg = models.get_preset("llama3_8b")
  def mesh(**sizes):
    return planner.abstract_mesh({**dict.fromkeys(models.MESH_AXES, 1), **sizes})

  by_policy = [planner.activation_bytes(cfg, rows=8, row_len=2048, mesh=mesh(), remat=r)[0]
               for r in ("none", "dots", "dots_with_no_batch_dims", "full")]
  assert by_policy == sorted(by_policy, reverse=True) and by_policy[0] > 3 * by_policy[-1]
  # Rows spread over fsdp: 8 rows on 4 devices keep what 2 rows keep on one.
  assert (planner.saved_activation_bytes(cfg, rows=8, row_len=2048, mesh=mesh(fsdp=4))
          == planner.saved_activation_bytes(cfg, rows=2, row_len=2048, mesh=mesh()))
  # Tensor parallelism splits heads and MLP, never the block input (full remat).
  assert (planner.saved_activation_bytes(cfg, rows=8, row_len=2048, mesh=mesh(tensor=4),
                                         remat="dots_with_no_batch_dims")
          < planner.saved_activation_bytes(cfg, rows=8, row_len=2048, mesh=mesh(),
                                           remat="dots_with_no_batch_dims"))


def test_fused_flash_backward_adds_its_dq_partials():
  """fused_bwd keeps one f32 dq per kv block of the backward while a layer is
  differentiated: rows x length x heads x head_dim x 4 bytes x kv blocks."""
  base = models.get_preset("llama3_8b").replace(attention_impl="flash")
  mesh = planner.abstract_mesh({**dict.fromkeys(models.MESH_AXES, 1), "tensor": 4})
  plain = planner.activation_bytes(base, rows=2, row_len=4096, mesh=mesh)[0]
  for options, kv_blocks in (("fused_bwd=true", 4),  # bf16, head_dim 128: 1024 blocks
                             ("fused_bwd=true,block_kv=512", 8),
                             ("fused_bwd=true,block_kv=512,block_kv_bwd=2048", 2)):
    cfg = base.replace(attention_options=options)
    got = planner.activation_bytes(cfg, rows=2, row_len=4096, mesh=mesh)[0]
    assert got - plain == 2 * 4096 * (32 // 4) * 128 * 4 * kv_blocks, options
  assert planner.fused_dq_bytes(base.replace(attention_options="dq_atomic=false"), rows=2,
                                row_len=4096, heads=8) == 0
  # Ring attention runs the kernel on each device's chunk of the row.
  ring = base.replace(attention_impl="ring", attention_options="fused_bwd=true")
  assert planner.fused_dq_bytes(ring, rows=2, row_len=4096, heads=8) == (
      2 * 4096 * 8 * 128 * 4 * 4)
  # Short rows: the kernel's blocks shrink to the padded length (one kv block).
  cfg = base.replace(attention_options="fused_bwd=true")
  assert planner.fused_dq_bytes(cfg, rows=1, row_len=300, heads=1) == 300 * 128 * 4


def test_gathered_weights_only_when_there_is_something_to_gather():
  cfg = models.get_preset("llama3_8b").replace(dtype="bfloat16", param_dtype="float32")
  rules = models.DEFAULT_RULES
  one = dict.fromkeys(models.MESH_AXES, 1)
  f32 = cfg.replace(dtype="float32")
  assert planner.decode_weight_bytes(f32, {**one, "tensor": 4}, rules) == 0
  params = planner.state_bytes(f32, {**one, "tensor": 4}, rules)[0]
  assert planner.decode_weight_bytes(cfg, {**one, "tensor": 4}, rules) == params // 2
  assert planner.decode_weight_bytes(f32, {**one, "fsdp": 8, "tensor": 4}, rules) == params


def test_what_lies_outside_the_compiled_programs():
  """launch.plan --compile_for adds to XLA's figures what a device holds outside each
  program: colocated, the sampler's copy during the update, the learner's state and
  (gathered for sampling) that copy while sampling; on a rollout mesh, the sampler's own
  weights when the programs read a gathered copy."""
  p = planner.plan(_config(**TINY))
  (train, _), (rollout, _) = planner.resident_outside_programs(p, _config(**TINY))
  assert p.placement == "colocated" and train == p["sampler"] > 0
  assert p["gathered"] > 0
  assert rollout == p["params"] + p["optimizer"] + p["reference"] + p["sampler"]
  # Left sharded, the sampler's own weights are the sampling programs' argument: inside
  # XLA's figure, not outside it.
  config = _config(**TINY, **{"rollout.gather_weights": False})
  p = planner.plan(config)
  assert planner.resident_outside_programs(p, config)[1][0] == (
      p["params"] + p["optimizer"] + p["reference"])
  config = _config(**TINY, **{"placement.mode": "disaggregated",
                              "placement.rollout_devices": 2, "train.rows_per_microbatch": 6})
  p = planner.plan(config, num_devices=8)
  assert planner.resident_outside_programs(p, config)[0] == (0, "")
  assert planner.resident_outside_programs(p, config)[1][0] == p["sampler"]
  config.rollout.gather_weights = False  # the programs read the sampler's own weights
  assert planner.resident_outside_programs(p, config)[1] == (0, "")


def test_a_reference_outside_the_update_is_resident_beside_it():
  """With several updates per batch the KL reference's log-probs are computed before the
  update, not in it: its copy of the weights waits on the train devices, outside the
  compiled update (colocated and disaggregated); with one update per batch it is the
  update's argument, inside XLA's figure."""
  beside = _config(**TINY, **{"rl.kl_coef": 0.1, "rl.num_minibatches": 4})
  p = planner.plan(beside)
  assert p["reference"] == p["params"] > 0
  assert planner.resident_outside_programs(p, beside)[0][0] == p["sampler"] + p["reference"]
  inside = _config(**TINY, **{"rl.kl_coef": 0.1, "rl.num_minibatches": 1})
  p = planner.plan(inside)
  assert planner.resident_outside_programs(p, inside)[0][0] == p["sampler"]
  apart = planner.override(beside, {"placement.mode": "disaggregated",
                                    "placement.rollout_devices": 2,
                                    "train.rows_per_microbatch": 6})
  p = planner.plan(apart, num_devices=8)
  assert planner.resident_outside_programs(p, apart)[0][0] == p["reference"] > 0


def test_kv_cache_bytes_by_hand():
  cfg = models.get_preset("llama3_8b")  # 32 layers, 8 kv heads of 128, bfloat16
  fsdp32 = planner.abstract_mesh({"data": 1, "fsdp": 32, "tensor": 1, "sequence": 1})
  # 64 rows over 32 devices = 2 rows of 4096 slots, k and v, every layer, 2 bytes.
  assert planner.kv_cache_bytes(cfg, batch=64, max_len=4096, mesh=fsdp32) == (
      2 * 4096 * 8 * 128 * 2 * 2 * 32) == 1 << 30
  # int8: one byte per value plus a float32 scale per slot and head.
  assert planner.kv_cache_bytes(cfg, batch=64, max_len=4096, mesh=fsdp32, dtype="int8") == (
      2 * 32 * (2 * 4096 * 8 * 128 + 2 * 4096 * 8 * 4))
  # kv heads split over tensor=8; tensor=16 does not divide 8 heads, so they replicate.
  tp8 = planner.abstract_mesh({"data": 1, "fsdp": 4, "tensor": 8, "sequence": 1})
  tp16 = planner.abstract_mesh({"data": 1, "fsdp": 2, "tensor": 16, "sequence": 1})
  assert planner.kv_cache_bytes(cfg, batch=64, max_len=4096, mesh=tp8) == (1 << 30)
  assert planner.kv_cache_bytes(cfg, batch=64, max_len=4096, mesh=tp16) == 16 * (1 << 30)


def test_kv_cache_bytes_count_the_sliding_layers_rings():
  """Gemma 3 12B: 40 of its 48 layers slide over 1,024 keys and keep rings of 1,536
  slots (1,024 + 512 - 1, rounded up), not the rows' 8,192; the plan counts the arrays
  `init_cache` builds, byte for byte."""
  cfg = models.get_preset("gemma3_12b")  # 8 kv heads of 256, bfloat16
  fsdp32 = planner.abstract_mesh({"data": 1, "fsdp": 32, "tensor": 1, "sequence": 1})
  assert models.sliding_cache_slots(cfg, 8192) == 1536
  assert planner.kv_cache_bytes(cfg, batch=64, max_len=8192, mesh=fsdp32) == (
      2 * (8 * 8192 + 40 * 1536) * 8 * 256 * 2 * 2)
  whole = planner.kv_cache_bytes(cfg.replace(sliding_window=None, layer_types=None),
                                 batch=64, max_len=8192, mesh=fsdp32)
  assert planner.kv_cache_bytes(cfg, batch=64, max_len=8192, mesh=fsdp32) / whole == (
      (8 * 8192 + 40 * 1536) / (48 * 8192))  # 0.32x
  one = planner.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1})
  for scan in (False, True):
    for dtype in (None, "int8"):
      for max_len, chunk in ((8192, 512), (1024, 512), (8192, 16)):
        small = cfg.replace(num_layers=12, scan_layers=scan)  # the pattern kept: 10 + 2
        arrays = jax.eval_shape(lambda: models.init_cache(  # noqa: B023
            small, 2, max_len, jnp.int8 if dtype else None, write_tokens=chunk))  # noqa: B023
        assert planner.kv_cache_bytes(small, batch=2, max_len=max_len, mesh=one, dtype=dtype,
                                      write_tokens=chunk) == sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(arrays))


def test_expert_padding_counts_widths_no_multiple_of_128():
  """gpt-oss-20b under tensor 2: each expert 1440 wide on a device, padded to 1536 in the
  sampler's gathered copy (gate, up and down, and the biases), and the down experts' D of
  2880 to 2944; Qwen3-30B-A3B's 384 and 2048 and dense models need none."""
  mesh = {"data": 1, "fsdp": 16, "tensor": 2, "sequence": 1}
  gathered = {"data": 1, "fsdp": 1, "tensor": 2, "sequence": 1}
  oss = models.get_preset("gpt_oss_20b")
  assert planner.expert_padding_bytes(oss, gathered) == 2 * 24 * 32 * (
      96 * (2 * 2880 + 2) + 1536 * 2944 - 1440 * 2880)
  assert planner.decode_weight_bytes(oss, mesh) == (
      planner.state_bytes(oss, gathered)[0] + planner.expert_padding_bytes(oss, gathered))
  assert planner.expert_padding_bytes(models.get_preset("qwen3_30b_a3b"), gathered) == 0
  assert planner.expert_padding_bytes(models.get_preset("llama3_8b"), gathered) == 0


def test_prefill_and_decode_step_bytes_by_hand():
  """What a generate call holds beside the weights and its cache: the prompts' own cache
  and one layer's forward over them (prefill); the logits and, weights left sharded, one
  layer's weights gathered (a decode step)."""
  cfg = models.get_preset("llama3_8b").replace(dtype="bfloat16", attention_impl="flash")
  fsdp8 = planner.abstract_mesh({"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1})
  d, f, nh, kh = 4096, 14336, 32 * 128, 8 * 128
  # 16 prompts of 1,024 over 8 devices: 2 a device.
  prompt_cache = 2 * 1024 * kh * 2 * 2 * 32
  assert planner.kv_cache_bytes(cfg, batch=16, max_len=1024, mesh=fsdp8) == prompt_cache
  forward = 2 * 1024 * 2 * (2 * d + nh + 2 * kh + 5 * f)
  assert planner.prefill_bytes(cfg, prompts=16, prompt_len=1024, rows=128,
                               mesh=fsdp8) == prompt_cache + forward
  # Reference attention adds its float32 scores and mask: 9 bytes per head per key.
  ref = cfg.replace(attention_impl="reference")
  assert planner.prefill_bytes(ref, prompts=16, prompt_len=1024, rows=128, mesh=fsdp8) == (
      prompt_cache + forward + 2 * 1024 * 9 * 32 * 1024)
  # Gathered weights: this device's 16 rows' logits. Left sharded: every row's logits
  # (over a slice of D) and one layer's weights, 0.41 GiB for this model.
  assert planner.decode_step_bytes(cfg, rows=128, mesh=fsdp8) == 16 * cfg.vocab_size * 4
  layer = 2 * (2 * d * nh + 2 * d * kh + 3 * d * f)
  assert planner.decode_step_bytes(cfg, rows=128, mesh=fsdp8, gathered=False) == (
      128 * cfg.vocab_size * 4 + layer)
  assert 0.40 < layer / 2**30 < 0.42
  # Left sharded, the prefill's layer forward gathers that layer's weights too.
  assert planner.prefill_bytes(cfg, prompts=16, prompt_len=1024, rows=128, mesh=fsdp8,
                               gathered=False) == prompt_cache + forward + layer
  # tensor=8 splits the heads, the MLP and the vocabulary.
  tp8 = planner.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 8, "sequence": 1})
  assert planner.decode_step_bytes(cfg, rows=128, mesh=tp8, gathered=False) == (
      128 * cfg.vocab_size // 8 * 4 + layer // 8)


def test_streamed_rollouts_plan_the_larger_of_the_fill_and_a_refill():
  """Continuous batching fills the slots with one prefill per group, then refills an
  eighth of them at a time, one prefill a row: with groups of 16 the refill's 8 rows
  outnumber the fill's 4 prompts, and the plan's prefill is the refill's."""
  streamed = _config(**{"rl.group_size": 16, "rollout.chunk_rows": 64,
                        "rollout.prompts_per_step": 8, "mesh.fsdp": 1})
  assert planner.continuous_rollout(streamed, 16, 1)
  assert sampler_lib.refill_rows(64) == 8 and sampler_lib.refill_rows(64, 4) == 8
  assert sampler_lib.refill_rows(64, 16) == 16  # one row on every device at least
  p = planner.plan(streamed, num_devices=1)
  cfg, prompt_len = experiment.model_config(streamed), default_length_bucket(168, 192)
  one = planner.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1})
  assert p.components["prefill"].bytes == planner.prefill_bytes(
      cfg, prompts=8, prompt_len=prompt_len, rows=8, mesh=one) > planner.prefill_bytes(
      cfg, prompts=4, prompt_len=prompt_len, rows=64, mesh=one)
  assert "a refill of 8 slots" in p.components["prefill"].formula
  # Multi-turn: later turns are refilled as transcripts up to max_len - 1 tokens.
  turns = planner.plan(planner.override(streamed, {"rollout.max_turns": 3}), num_devices=1)
  assert turns.components["prefill"].bytes == planner.prefill_bytes(
      cfg, prompts=8, prompt_len=default_length_bucket(191, 192), rows=8, mesh=one)
  assert f"cache of {default_length_bucket(191, 192)}" in turns.components["prefill"].formula
  # Chunks instead: the cache holds every row of a chunk, no refill.
  for change in ({"rollout.continuous_batching": False}, {"rollout.chunk_rows": 128},
                 {"placement.step_tokens": 8}):
    assert not planner.continuous_rollout(planner.override(streamed, change), 16, 1), change
  # Segments cap a streamed rollout's rounds (the lock let go between them); later turns
  # come back between rounds: both stream.
  for change in ({"placement.segment_tokens": 8}, {"rollout.max_turns": 2}):
    assert planner.continuous_rollout(planner.override(streamed, change), 16, 1), change
  # Multi-turn rows that fit the cache run in rounds too (next turns come back between
  # them), unless they pause every segment_tokens (segments, as chunks).
  fit = planner.override(streamed, {"rollout.chunk_rows": 128, "rollout.max_turns": 3})
  assert planner.continuous_rollout(fit, 16, 1)
  assert not planner.continuous_rollout(
      planner.override(fit, {"placement.segment_tokens": 8}), 16, 1)


def test_head_bytes_by_hand_and_in_the_train_peak():
  """The log-prob head, the projection's D split over fsdp: the vocabulary splits over
  fsdp instead, two compute-dtype copies of the [D, V / fsdp] slice, when trained its
  float32 gradient and a copy, and one chunk's rows gathered over fsdp with their
  gradient. A vocabulary that fsdp does not divide, or fewer vocabulary entries than a
  chunk's rows x positions, gathers the whole [D, V]."""
  cfg = models.get_preset("llama3_8b").replace(dtype="bfloat16", param_dtype="bfloat16")
  d, v, chunk = 4096, cfg.vocab_size, cfg.logprob_chunk
  fsdp8 = planner.abstract_mesh({"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1})
  dp2_fsdp4 = planner.abstract_mesh({"data": 2, "fsdp": 4, "tensor": 1, "sequence": 1})
  tp8 = planner.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 8, "sequence": 1})
  dp8 = planner.abstract_mesh({"data": 8, "fsdp": 1, "tensor": 1, "sequence": 1})
  rows = dict(rows=16, row_len=2048)
  gathered_rows = 2 * 2 * 16 * chunk * d
  assert planner.head_bytes(cfg, mesh=fsdp8, **rows) == (
      (2 * 2 + 4 + 2) * d * v // 8 + gathered_rows)  # 0.67 GiB, not 4.89 GiB
  assert planner.head_bytes(cfg.replace(lora_rank=8), mesh=fsdp8, **rows) == (
      2 * 2 * d * v // 8 + gathered_rows)
  # The rows gather over fsdp only: each data replica keeps its own half.
  assert planner.head_bytes(cfg, mesh=dp2_fsdp4, **rows) == (
      (2 * 2 + 4 + 2) * d * v // 4 + gathered_rows // 2)
  odd = cfg.replace(vocab_size=v + 1)
  assert planner.head_bytes(odd, mesh=fsdp8, **rows) == (2 * 2 + 4 + 2) * d * (v + 1)
  # 1024 rows x 256 positions outnumber the vocabulary: gathering [D, V] holds less.
  assert planner.head_bytes(cfg, mesh=fsdp8, rows=1024, row_len=2048) == (2 * 2 + 4 + 2) * d * v
  assert planner.head_bytes(cfg, mesh=tp8) == 0 and planner.head_bytes(cfg, mesh=dp8) == 0
  # In the plan: the head's phase (saved activations + a logits chunk + head) against a
  # layer's backward (all of activations), whichever is fuller.
  # Layers scanned: the abstract model traces one layer (the same bytes as a list).
  config = _config(**{"model.preset": "llama3_8b", "mesh.fsdp": 8,
                      "model.overrides": {"remat": "full", "scan_layers": True},
                      "train.rows_per_microbatch": 8})
  p = planner.plan(config)
  cfg8 = experiment.model_config(config)
  saved = planner.saved_activation_bytes(cfg8, rows=8, row_len=int(config.train.row_len),
                                         mesh=fsdp8)
  chunk = 3 * min(cfg8.logprob_chunk, int(config.train.row_len)) * v * 4
  assert p["head"] == planner.head_bytes(cfg8, mesh=fsdp8, rows=8,
                                         row_len=int(config.train.row_len))
  head_phase = saved + chunk + p["head"]
  assert p["activations"] > head_phase  # the split vocabulary: a layer's backward is fuller
  assert p.placement == "colocated"  # the sampler's copy of the weights is resident too
  static = p["params"] + p["optimizer"] + p["reference"] + p["sampler"]
  assert p.train_peak == static + p["gradients"] + p["activations"] + p["batch"]
  # A vocabulary fsdp does not divide gathers the projection: its phase is the fuller.
  odd = planner.plan(_config(**{"model.preset": "llama3_8b", "mesh.fsdp": 8,
                                "model.overrides": {"remat": "full", "scan_layers": True,
                                                    "vocab_size": v + 1},
                                "train.rows_per_microbatch": 8}))
  assert odd["head"] > odd["activations"]
  assert odd.train_peak == (odd["params"] + odd["optimizer"] + odd["reference"]
                            + odd["sampler"] + odd["gradients"] + odd["batch"] + saved
                            + 3 * min(cfg8.logprob_chunk, int(config.train.row_len))
                            * (v + 1) * 4 + odd["head"])


def test_divergence_head_bytes_by_hand():
  """What an in-step divergence to a distillation teacher holds beside the log-prob
  head: one more float32 logits chunk; where the vocabulary splits over fsdp, the
  teacher's [E, V / fsdp] slice (twice when its vocabulary is padded) and a chunk's
  teacher rows gathered; trained, the first pass's projection gradient. With D whole the
  teacher's projection is read where it lies, unless distill.dtype casts it."""
  cfg = models.get_preset("llama3_8b").replace(dtype="bfloat16", param_dtype="float32")
  teacher = cfg.replace(d_model=3072, num_heads=24)
  d, e, v, chunk = 4096, 3072, cfg.vocab_size, cfg.logprob_chunk
  fsdp8 = planner.abstract_mesh({"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1})
  dp8 = planner.abstract_mesh({"data": 8, "fsdp": 1, "tensor": 1, "sequence": 1})
  rows = dict(rows=16, row_len=2048)
  logits = 4 * 2 * chunk * v  # 2 rows a device, float32
  split = 2 * e * v // 8 + 2 * 16 * chunk * e  # the teacher's slice, its rows gathered
  grad = 2 * d * v // 8
  assert planner.divergence_head_bytes(cfg, teacher, mesh=fsdp8, **rows) == (
      logits + split + grad)  # 0.48 GiB
  assert planner.divergence_head_bytes(cfg.replace(lora_rank=8), teacher, mesh=fsdp8,
                                       **rows) == logits + split
  padded = teacher.replace(vocab_size=v + 256)
  assert planner.divergence_head_bytes(cfg, padded, mesh=fsdp8, **rows) == (
      logits + split + 2 * e * v // 8 + grad)
  assert planner.divergence_head_bytes(cfg, teacher, mesh=dp8, **rows) == logits + 2 * d * v
  cast = teacher.replace(dtype="float32", param_dtype="float32")
  assert planner.divergence_head_bytes(cfg, cast, mesh=dp8, **rows) == (
      logits + 2 * e * v + 2 * d * v)
  # A vocabulary fsdp does not divide: both projections gathered whole, no rows gathered.
  odd, odd_teacher = cfg.replace(vocab_size=v + 1), teacher.replace(vocab_size=v + 1)
  assert planner.divergence_head_bytes(odd, odd_teacher, mesh=fsdp8, **rows) == (
      4 * 2 * chunk * (v + 1) + 2 * e * (v + 1) + 2 * d * (v + 1))
  score = cfg.replace(lm_head=False, value_head=True)
  assert planner.divergence_head_bytes(score, teacher, mesh=fsdp8, **rows) == 0


def test_plan_counts_the_divergence_when_the_update_computes_it(tmp_path):
  """distill.loss reverse_kl / forward_kl / jsd in RL: the divergence joins the head's
  phase; not for distill.loss=sampled, SFT alone (distill.stages=sft) or no teacher."""
  vocab = models.get_preset("llama3_8b").vocab_size + 1  # the head's phase is the fuller
  base = {"model.preset": "llama3_8b", "mesh.fsdp": 8,
          "model.overrides": {"remat": "full", "scan_layers": True, "vocab_size": vocab},
          "train.rows_per_microbatch": 8}
  cfg = experiment.model_config(_config(**base))
  teacher = cfg.replace(d_model=3072, num_heads=24, ffn_dim=8192, num_layers=2)
  (tmp_path / "config.json").write_text(json.dumps(models.hf.model_config_to_hf(teacher)))
  distill = {"distill.teacher": str(tmp_path), "distill.loss": "reverse_kl"}
  p = planner.plan(_config(**base, **distill))
  mesh = planner.abstract_mesh(p.mesh)
  row_len = int(_config().train.row_len)
  teacher_cfg = experiment.teacher_config(_config(**base, **distill))
  want = planner.divergence_head_bytes(cfg, teacher_cfg, mesh=mesh, rows=8, row_len=row_len)
  assert p["divergence"] == want > 0
  text = p.components["divergence"].formula
  assert "reverse_kl" in text and "projection gradient" in text and "E 3072" in text
  saved = planner.saved_activation_bytes(cfg, rows=8, row_len=row_len, mesh=mesh)
  head_phase = saved + 3 * min(cfg.logprob_chunk, row_len) * vocab * 4 + p["head"]
  assert head_phase + p["divergence"] > p["activations"]
  static = p["params"] + p["optimizer"] + p["reference"] + p["teacher"] + p["sampler"]
  assert p.train_peak == static + p["gradients"] + head_phase + p["divergence"] + p["batch"]
  jsd = planner.plan(_config(**{**base, **distill, "distill.loss": "jsd"}))
  assert jsd["divergence"] == want
  for changes, why in (({"distill.loss": "sampled"}, "distill.loss=sampled"),
                       ({"distill.stages": "sft"}, "distill.stages=sft"),
                       ({"distill.teacher": ""}, "distill.teacher unset")):
    other = planner.plan(_config(**{**base, **distill, **changes}))
    assert other["divergence"] == 0 and why in other.components["divergence"].formula


def test_real_scale_presets_give_sane_numbers():
  def state(preset, param_dtype, fsdp):
    # Layers scanned: the abstract model traces one layer, not 32 or 80 (same bytes).
    config = _config(**{"model.preset": preset, "mesh.fsdp": fsdp,
                        "model.overrides": {"param_dtype": param_dtype, "scan_layers": True},
                        "train.rows_per_microbatch": fsdp})
    p = planner.plan(config)
    return experiment.model_config(config).num_params, p["params"], p["optimizer"]

  n, params, opt = state("llama3_8b", "bfloat16", 32)
  assert 8.0e9 < n < 8.1e9
  assert params * 32 == pytest.approx(16.06e9, rel=0.01)  # ~16 GB of bf16 weights
  assert opt == pytest.approx(2 * params, rel=0.01)        # Adam mu and nu, param dtype
  n, params, opt = state("llama3_70b", "float32", 128)
  assert params * 128 == pytest.approx(4 * 70.55e9, rel=0.01)  # ~282 GB in float32


@pytest.mark.parametrize("path", REAL_CONFIGS, ids=os.path.basename)
def test_shipped_configs_fit_the_hardware_their_docstring_names(path):
  text = pathlib.Path(path).read_text()
  command = re.search(r"python -m launch\.plan --config=(configs/\S+\.py) "
                      r"--device_memory_gb=(\d+)", text)
  assert command and command.group(1) == os.path.relpath(path, ROOT), "no plan command"
  assert "python -m launch.train" in text or "launch/tpu_pod.sh train" in text
  config = importlib.import_module(f"configs.{os.path.basename(path)[:-3]}").get_config()
  # The same keys as the default config, so every --config.* flag means the same thing.
  assert _keys(config, skip=("model.overrides",)) == _keys(default.get_config(),
                                                           skip=("model.overrides",))
  p = planner.plan(config, device_memory_gb=float(command.group(2)))
  assert p.fits, planner.format_plan(p)
  assert p["params"] > 0 and p["kv_cache"] > 0 and p["activations"] > 0


def _keys(config, prefix="", skip=()):
  out = set()
  for k, v in config.items():
    name = f"{prefix}{k}"
    if hasattr(v, "items") and name not in skip:
      out |= _keys(v, f"{name}.", skip)
    else:
      out.add(name)
  return out


def test_advice_names_a_knob_that_makes_it_fit():
  config = _config(**{"model.preset": "llama3_8b", "model.overrides": {"remat": "none"},
                      "mesh.fsdp": 8, "train.rows_per_microbatch": 64, "train.row_len": 1024,
                      "rollout.max_len": 1024, "rollout.chunk_rows": 64})
  p = planner.plan(config, device_memory_gb=80)
  assert not p.fits and p.advice[0].startswith("does not fit")
  knobs = [re.findall(r"--config\.(\S+?)=([^\s:]+)", line) for line in p.advice[1:]]
  knobs = [k for k in knobs if k]
  assert len(knobs) >= 2, p.advice  # remat and rows_per_microbatch
  for knob in knobs:
    changes = {k: int(v) if v.isdigit() else v for k, v in knob}
    assert planner.plan(planner.override(config, changes), device_memory_gb=80).fits, knob


def test_params_that_cannot_fit_ask_for_more_devices():
  # bf16 8B: 16 GB of weights + 32 GB of Adam moments; 2 x 16 GiB devices cannot hold them.
  config = _config(**{"model.preset": "llama3_8b", "model.overrides": {"scan_layers": True},
                      "mesh.fsdp": 2, "rl.kl_coef": 0.0, "train.rows_per_microbatch": 4})
  p = planner.plan(config, device_memory_gb=16)
  assert not p.fits
  line = next(a for a in p.advice if "params + optimizer alone" in a)
  devices = int(re.search(r"at least (\d+) devices", line).group(1))
  assert devices == 4
  bigger = planner.plan(planner.override(config, {"mesh.fsdp": devices}), device_memory_gb=16,
                        advise=False)
  assert bigger["params"] + bigger["optimizer"] <= bigger.capacity


@pytest.mark.parametrize("changes, num_devices, message", [
    ({"mesh.fsdp": -1}, 12, None),
    ({"mesh.fsdp": -1, "mesh.tensor": 8}, 12, "does not divide num_devices=12"),
    ({"mesh.fsdp": 4}, 8, "mesh (1, 4, 1, 1) needs 4 devices, but num_devices=8"),
    ({"mesh.fsdp": 0}, None, "must hold positive sizes"),
    ({"mesh.fsdp": 4, "train.rows_per_microbatch": 6}, None,
     "train.rows_per_microbatch=6 must be a multiple of the batch mesh axes' size 4"),
])
def test_bad_meshes_are_one_line_errors(changes, num_devices, message):
  config = _config(**{"train.rows_per_microbatch": 12, **changes})
  if message is None:
    assert planner.plan(config, num_devices=num_devices).mesh["fsdp"] == 12
    return
  with pytest.raises(ValueError, match=re.escape(message)):
    planner.plan(config, num_devices=num_devices)


def _plan_cli(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "launch.plan", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_plan_command_prints_the_table_and_exits_by_verdict():
  ok = _plan_cli("--config=configs/llama3_70b_grpo_v5p256.py", "--device_memory_gb=95")
  assert ok.returncode == 0, ok.stderr
  for word in ("params", "optimizer", "gradients", "activations", "kv_cache", "fits: peak"):
    assert word in ok.stdout
  assert "(128 devices)" in ok.stdout
  too_small = _plan_cli("--config=configs/default.py", "--num_devices=8",
                        "--device_memory_gb=0.0003", "--kv_cache_dtype=int8")
  assert too_small.returncode == 1 and "does not fit" in too_small.stdout
  assert "x 2 x 32, int8" in too_small.stdout and "use at least" in too_small.stdout
  bad = _plan_cli("--config=configs/default.py", "--num_devices=3", "--config.mesh.tensor=2")
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
      "error: mesh (1, -1, 2, 1) does not divide num_devices=3")
  assert "Traceback" not in bad.stderr
  missing = _plan_cli("--config=configs/no_such_config.py")
  assert missing.returncode == 2 and "Traceback" not in missing.stderr
  assert missing.stderr.strip().splitlines()[-1] == (
      "error: [Errno 2] No such file or directory: 'configs/no_such_config.py'")


def test_lora_plan_counts_adapters_for_the_optimizer_and_gradients_and_no_reference():
  config = _config(**TINY, **{"model.overrides.lora_rank": 4, "rl.kl_coef": 0.1})
  p = planner.plan(config)
  real_mesh, cfg, state = _real_train_state(config)
  adapters = rl_state.split_trainable(state.params)[0]
  assert p["params"] == pytest.approx(_real_per_device_bytes(state.params), rel=0.05)
  assert p["optimizer"] == pytest.approx(_real_per_device_bytes(state.opt_state), rel=0.05)
  assert p["reference"] == 0
  per_update = planner.microbatches(config, experiment.algorithm(config))[0]
  assert p["gradients"] == pytest.approx(
      _real_per_device_bytes(adapters) * (2 if per_update > 1 else 1), rel=0.05)
  full = planner.plan(_config(**TINY, **{"rl.kl_coef": 0.1}))
  assert full["reference"] == full["params"] and full["gradients"] > 3 * p["gradients"]


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_quantized_base_is_planned_as_the_live_codes(kind):
  """QLoRA: the planned params are the live state's bytes a device (codes, bfloat16
  scales, the unquantized embeddings and adapters), and the formula says so."""
  config = _config(**TINY, **{"model.overrides.lora_rank": 4, "rl.kl_coef": 0.1,
                              "model.overrides.base_quantization": kind})
  p = planner.plan(config)
  _, cfg, state = _real_train_state(config)
  assert cfg.base_quantization == kind
  assert p["params"] == pytest.approx(_real_per_device_bytes(state.params), rel=0.05)
  assert f"projections as {kind} codes" in p.components["params"].formula
  plain = planner.plan(_config(**TINY, **{"model.overrides.lora_rank": 4,
                                          "rl.kl_coef": 0.1}))
  assert p["params"] < plain["params"] and p["optimizer"] == plain["optimizer"]
  assert p["reference"] == 0


def test_a_preference_stage_counts_its_frozen_reference():
  """DPO before RL holds a frozen copy of the params beside the update even when RL has
  no KL term; SimPO reads no reference, and with LoRA the reference is the base."""
  none = planner.plan(_config(**TINY, **{"rl.kl_coef": 0.0}))
  assert none["reference"] == 0
  dpo = planner.plan(_config(**TINY, **{"rl.kl_coef": 0.0, "preference.steps": 10}))
  assert dpo["reference"] == dpo["params"] > 0
  assert "preference loss" in dpo.components["reference"].formula
  simpo = planner.plan(_config(**TINY, **{"rl.kl_coef": 0.0, "preference.steps": 10,
                                          "preference.loss": "simpo"}))
  assert simpo["reference"] == 0
  lora = planner.plan(_config(**TINY, **{"rl.kl_coef": 0.0, "preference.steps": 10,
                                         "model.overrides.lora_rank": 4}))
  assert lora["reference"] == 0
  online = _config(**TINY, **{"algorithm": "online_dpo"})
  p = planner.plan(online)
  assert p["reference"] == p["params"]
  # Its log-probs are computed in the update: the copy is the update's argument.
  assert planner.resident_outside_programs(p, online)[0][0] == p["sampler"]


def test_a_pattern_of_many_runs_holds_its_layers_projection_buffers():
  """A scanned hybrid whose pattern does not repeat, of more than eight runs (Nemotron-H's)
  trains its single-layer runs in order (`ordered_layers`), and the plan holds each such
  layer's projection outputs (XLA:TPU allocates them at the top of the update): by hand,
  2sF an MLP, s(4V + 2K + Hv + D) a Mamba2 layer, s(2NH + 16KH) an attention layer. A
  pattern of eight runs or fewer, dots remat or the unscanned layout hold none."""
  from posttrain.models.transformer import ordered_layers
  pattern = "M-M*-M-M*-M--"
  kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
  cfg = models.get_preset("tiny", **NEMOTRON_H, num_layers=len(pattern),
                          layer_types=tuple(kinds[c] for c in pattern),
                          rope_layers=(0,) * len(pattern), remat="full", scan_layers=True,
                          dtype="bfloat16", param_dtype="bfloat16")
  assert ordered_layers(cfg) == {"linear": 5, "full": 2, "mlp": 4}  # "--" is a run of two
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  rows, length = 2, 64

  def planned(c):
    return planner.activation_bytes(c, rows=rows, row_len=length, mesh=one_device)[0]

  v, k = 6 * 24, 2 * 16
  per_token = (4 * 2 * 2 * 160 + 5 * 2 * (4 * v + 2 * k + 6 + 96)
               + 2 * 2 * (2 * 6 * 16 + 16 * 2 * 16))
  assert planned(cfg) - planned(cfg.replace(scan_layers=False)) == rows * length * per_token
  for other in (cfg.replace(remat="dots"), cfg.replace(scan_layers=False),
                cfg.replace(num_layers=8, layer_types=tuple(kinds[c] for c in "M-M*-MM-"),
                            rope_layers=(0,) * 8)):
    assert ordered_layers(other) == {}


def test_a_pattern_of_many_runs_holds_its_mixture_layers_buffers():
  """Nemotron 3's mixtures alone in a pattern of many runs are rebuilt in order too
  (`ordered_layers`), unless a load-balancing loss takes their router statistics; the
  plan holds each one's projection outputs by analogy with an MLP's (not compiled): by
  hand, its shared expert's up and activation 2sFs, its routed experts' 2skF, the
  router's float32 logits 4E and latent_in's output sL; an MLP alone's 2sF at
  dense_ffn_dim, not the experts' width."""
  from posttrain.models.transformer import ordered_layers
  pattern = "ME-M*EM-ME*-M"
  kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
  cfg = models.get_preset("tiny", **NEMOTRON_3, num_layers=len(pattern),
                          layer_types=tuple(kinds[c] for c in pattern), moe_latent_dim=16,
                          rope_layers=(0,) * len(pattern), remat="full", scan_layers=True,
                          dtype="bfloat16", param_dtype="bfloat16")
  assert ordered_layers(cfg) == {"linear": 5, "moe": 3, "mlp": 3, "full": 2}
  balanced = cfg.replace(router_aux_loss_coef=0.01)
  assert ordered_layers(balanced) == {"linear": 5, "mlp": 3, "full": 2}
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  rows, length = 2, 64

  def held(c):
    return (planner.activation_bytes(c, rows=rows, row_len=length, mesh=one_device)[0]
            - planner.activation_bytes(c.replace(scan_layers=False), rows=rows,
                                       row_len=length, mesh=one_device)[0])

  v, k, s = 6 * 24, 2 * 16, 2
  others = (3 * 2 * s * 160 + 5 * s * (4 * v + 2 * k + 6 + 96)
            + 2 * s * (2 * 6 * 16 + 16 * 2 * 16))
  moe = 2 * s * (24 + 2 * 40) + 4 * 6 + s * 16
  assert held(cfg) == rows * length * (others + 3 * moe)
  assert held(balanced) == rows * length * others


@pytest.mark.parametrize("layout, mlps", [
    (dict(NEMOTRON_H, num_layers=6, layer_types=NEMOTRON_H_LAYERS), True),
    (dict(MAMBA2, num_layers=4,
          layer_types=("linear_attention", "linear_attention", "full_attention",
                       "linear_attention")), False)])
def test_relaid_stacks_are_the_sharded_stacks_a_hybrid_prefill_lays_out(layout, mlps):
  """Left sharded, a scanned Mamba2 hybrid's prefill keeps relaid copies of whole weight
  stacks: every Mamba2 layer's x, z and out_proj (and with single-sublayer layers every
  MLP layer's matrices), each as the real arrays shard it over fsdp 4 x tensor 2; none
  unscanned, or for Gated DeltaNet layers."""
  mesh = (1, 4, 2, 1)
  cfg = models.get_preset("tiny", **layout, scan_layers=True)
  real = nnx.state(models.create_model(cfg, mesh=models.make_mesh(mesh)), nnx.Param)
  stacks = [real["linear_layers"]["linear_attn"][name] for name in ("v_proj", "z_proj",
                                                                     "o_proj")]
  if mlps:
    stacks += [real["mlp_layers"]["mlp"][name] for name in ("up_proj", "down_proj")]
  abstract = planner.abstract_mesh(dict(zip(models.MESH_AXES, mesh)))
  want = _real_per_device_bytes(stacks)
  assert planner._relaid_stack_bytes(cfg, abstract, models.DEFAULT_RULES) == want > 0
  assert planner.prefill_bytes(cfg, prompts=8, prompt_len=64, rows=8, mesh=abstract,
                               gathered=False) > want
  deltanet = models.get_preset("tiny", **QWEN3_5, scan_layers=True)
  for other in (cfg.replace(scan_layers=False), deltanet):
    assert planner._relaid_stack_bytes(other, abstract, models.DEFAULT_RULES) == 0


def test_routing_replay_is_planned_in_the_batch_and_beside_the_cache():
  """rl.routing_replay: each token's experts (uint8, every mixture layer's k) join the
  update's batch; with rollout, the sampler's record of every row's positions joins the
  KV cache. The AOT batch holds the same array."""
  from posttrain import aot
  base = {"model.preset": "qwen3_30b_a3b", "mesh.fsdp": 8, "rl.num_minibatches": 2,
          "model.overrides": {"scan_layers": True}, "train.rows_per_microbatch": 8}
  none = planner.plan(_config(**base))
  cfg = experiment.model_config(_config(**base))
  per_token = cfg.mixture_layers * cfg.num_experts_per_tok  # uint8: 128 experts
  config = _config(**base)
  _, micro = planner.microbatches(config, experiment.algorithm(config))
  mesh = planner.abstract_mesh(none.mesh)
  b, length = planner._logical_shard(mesh, models.DEFAULT_RULES, ("batch", "length"),
                                     (8, int(config.train.row_len)))
  for mode in ("old", "rollout"):
    config = _config(**base, **{"rl.routing_replay": mode})
    p = planner.plan(config)
    assert p["batch"] - none["batch"] == micro * b * length * per_token
    rows = planner.sampler_batch(config, int(experiment.algorithm(config).group_size), 8)
    extra = -(-rows // 8) * int(config.rollout.max_len) * per_token if mode == "rollout" else 0
    assert p["kv_cache"] - none["kv_cache"] == extra
    batch = aot.abstract_rl_batch(config, experiment.algorithm(config), (), None)
    assert batch["routing"].shape == batch["tokens"].shape + (48, 8)
    assert batch["routing"].dtype == np.uint8
  assert "routing" not in aot.abstract_rl_batch(_config(**base), experiment.algorithm(
      _config(**base)), (), None)


GEMMA4 = dict(qk_norm=True, sandwich_norms=True, embed_scale=True, mlp_activation="gelu_tanh",
              attention_multiplier=1.0, sliding_window=32, global_head_dim=32,
              global_kv_heads=1, k_eq_v=True, v_norm=True, layer_scale=True,
              layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2,
              rope=models.RopeConfig(theta=1e6, type="proportional", partial_rotary_factor=0.25),
              rope_local=models.RopeConfig(), architecture="Gemma4ForCausalLM")
# E2B's layout: per-layer inputs, the last three layers reading others' keys and values,
# their MLPs twice as wide.
GEMMA4_EDGE = dict(GEMMA4, k_eq_v=False, global_kv_heads=0, per_layer_dim=8,
                   kv_shared_layers=3, kv_shared_wide_mlp=True)


@pytest.mark.parametrize("dtype, remat, layout", [
    ("float32", "none", GEMMA4), ("bfloat16", "full", GEMMA4),
    ("float32", "none", GEMMA4_EDGE), ("bfloat16", "full", GEMMA4_EDGE),
])
def test_gemma4_saved_activations_match_what_jax_keeps(dtype, remat, layout):
  """Full layers of their own widths count at them; per-layer inputs and the keys and
  values other layers read are kept beside the layers'."""
  cfg = models.get_preset("tiny", num_layers=6, d_model=96, ffn_dim=160, num_heads=6,
                          num_kv_heads=2, head_dim=16, remat=remat, attention_impl="reference",
                          logprob_chunk=64, dtype=dtype, param_dtype=dtype, **layout)
  kept = sum(b for b, _, _ in _residuals(cfg, 4, 128))
  one_device = planner.abstract_mesh(dict.fromkeys(models.MESH_AXES, 1))
  estimate = planner.saved_activation_bytes(cfg, rows=4, row_len=128, mesh=one_device)
  assert estimate == pytest.approx(kept, rel=0.1)
