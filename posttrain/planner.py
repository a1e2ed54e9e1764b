"""Memory planner: bytes per device of a run config, from shapes and sharding rules alone.

    plan = planner.plan(config, device_memory_gb=95, num_devices=32)
    print(planner.format_plan(plan))

Nothing is allocated and no device is needed: parameters and optimizer state come from
`jax.eval_shape`, their PartitionSpecs from the config's sharding rules
(`models.state_shardings`, `logical_to_spec`) on a `jax.sharding.AbstractMesh`, so a
v5p-256 mesh plans on a laptop. Per-device bytes of an array = the bytes of its shard,
`prod(NamedSharding.shard_shape(shape)) * itemsize` (global bytes divided by the sizes of
the mesh axes its spec uses).

Components (all per device):
  params       the policy's parameters (param_dtype).
  optimizer    AdamW moments and counters (the run's optimizer state, sharded like params).
  reference    a frozen copy of the params when the algorithm has a KL term (kl_coef > 0);
               none with LoRA adapters (the reference is the base weights in params).
  teacher      an on-policy distillation teacher's parameters on the train devices
               (distill.teacher, counted from its config.json, in distill.dtype).
  gradients    one tree the size of the trained params (all of them, or the LoRA
               adapters), two when a step accumulates over micro-batches; then a
               mixture's trained experts once more, as XLA:TPU holds them.
  activations  what the backward pass of one micro-batch holds (see `activation_bytes`).
  head         the log-prob head's slice of the output projection when its D axis is split
               over the mesh (fsdp), its gradient when trained, and one chunk's hidden
               states gathered over fsdp (see `head_bytes`).
  divergence   what an in-step distillation divergence (distill.loss reverse_kl /
               forward_kl / jsd) holds beside the head: the teacher's projection slice
               and a chunk's teacher rows, one more logits chunk and, when trained, the
               first pass's projection gradient (see `divergence_head_bytes`).
  batch        the rollout batch on device: [M, rows, row_len] token arrays.
  sampler      the sampler's own copy of the weights (colocated: params-sized, on the same
               devices; disaggregated: on the rollout mesh).
  gathered     the weights the sampler gathers over the batch axes for one generate call
               (rollout.gather_weights; see `decode_weight_bytes`).
  kv_cache     the sampler's cache for one generate call (see `kv_cache_bytes`).
  prefill      what the call's prefill holds beside it: the prompts' own cache and one
               layer's forward over them, that layer's weights gathered when the sampler
               leaves them sharded (see `prefill_bytes`).
  decode_step  what one decode step holds beside it: the logits, and one layer's weights
               gathered when the sampler leaves them sharded (see `decode_step_bytes`).
  reward_model a learned reward model's parameters on the rollout devices
               (reward_model.path, counted from its config.json; the forward pass of a
               scoring call is not counted: it runs after sampling, whose cache is gone).

Colocated placement samples and updates one after the other on the same devices:
  peak = params + optimizer + reference + teacher + sampler + reward_model
         + max(gradients + max(activations, saved + logits + head + divergence) + batch,
               gathered + kv_cache + max(prefill, decode_step)).
Disaggregated placement puts them on different devices:
  peak = max(params + optimizer + reference + teacher + gradients
             + max(activations, saved + logits + head + divergence) + batch,   (train)
             sampler + reward_model + gathered + kv_cache
             + max(prefill, decode_step))                                         (rollout)
saved and logits are the saved activations and one log-prob chunk's logits within
`activations` (the head's phase: no layer is being differentiated). Parameter and
optimizer bytes are exact; activations are formulas fitted to what JAX saves for the
backward pass (XLA may fuse or free some earlier).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from posttrain import experiment, models
from posttrain.rl import state as rl_state
from posttrain.rl import train_step as rl_train_step
from posttrain.models.config import REMAT_POLICIES
from posttrain.models.transformer import (CACHE_AXES, LINEAR_CACHE_AXES, init_layer_cache,
                                          init_linear_cache, ordered_layers)
from posttrain.rollout import reward_model as reward_model_lib
from posttrain.sampling.sampler import default_length_bucket, refill_rows

GIB = 1 << 30
# XLA needs room beyond the live arrays (fragmentation, program buffers, collectives).
USABLE_FRACTION = 0.9
# Cheapest to strongest: the order in which the planner suggests a remat policy.
_REMAT_ORDER = ("none", "dots", "dots_with_no_batch_dims", "full")
_KV_DTYPES = ("int8", "bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Component:
  """One line of the plan: bytes per device and how they were counted."""

  name: str
  bytes: int
  formula: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """The per-device memory of one config.

  Attributes:
    mesh: train mesh axis sizes, e.g. {"data": 1, "fsdp": 32, "tensor": 1, "sequence": 1}.
    rollout_mesh: the sampler's mesh (the same as `mesh` when colocated).
    placement: colocated or disaggregated; reward_model for a reward-model run (the
      update alone: rollout_peak 0).
    components: by name (params, optimizer, reference, teacher, gradients, activations,
      head, divergence, batch, sampler, gathered, kv_cache, prefill, decode_step,
      reward_model).
    train_peak / rollout_peak: the fullest moment of a train device / a sampling device.
    capacity: bytes per device the plan may use (`USABLE_FRACTION` of the memory), or None.
    advice: the verdict, then knobs that make it fit.
  """

  mesh: dict[str, int]
  rollout_mesh: dict[str, int]
  placement: str
  components: dict[str, Component]
  train_peak: int
  rollout_peak: int
  capacity: int | None
  advice: tuple[str, ...] = ()

  @property
  def peak(self) -> int:
    return max(self.train_peak, self.rollout_peak)

  @property
  def fits(self) -> bool | None:
    return None if self.capacity is None else self.peak <= self.capacity

  def __getitem__(self, name: str) -> int:
    return self.components[name].bytes


# ----------------------------------------------------------------------------------------
# Meshes and sharded bytes
# ----------------------------------------------------------------------------------------


def _sizes(raw, what: str) -> list[int]:
  sizes = [int(s) for s in raw]
  if len(sizes) != len(models.MESH_AXES):
    raise ValueError(f"{what} {tuple(sizes)} needs {len(models.MESH_AXES)} sizes "
                     f"{models.MESH_AXES}")
  if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
    raise ValueError(f"{what} {tuple(sizes)} must hold positive sizes and at most one -1")
  return sizes


def _fill(raw, num_devices: int, what: str) -> dict[str, int]:
  sizes = _sizes(raw, what)
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"{what} {tuple(sizes)} does not divide num_devices={num_devices}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"{what} {tuple(sizes)} needs {math.prod(sizes)} devices, "
                     f"but num_devices={num_devices}")
  return dict(zip(models.MESH_AXES, sizes))


def mesh_shapes(config: ml_collections.ConfigDict, num_devices: int | None = None
                ) -> tuple[dict[str, int], dict[str, int]]:
  """(train mesh, rollout mesh) sizes of `config` on `num_devices` devices.

  The device count defaults to `placement.devices`, else the mesh product (plus the
  rollout devices), else, for a `-1` mesh, the local device count. Disaggregated runs
  give `placement.rollout_devices` devices to the sampler, as the trainer does.
  """
  p = config.get("placement") or ml_collections.ConfigDict({"mode": "colocated"})
  mode = p.get("mode", "colocated")
  if mode not in experiment.PLACEMENTS:
    raise ValueError(f"placement.mode={mode!r}; expected one of {experiment.PLACEMENTS}")
  sizes = _sizes([config.mesh[a] for a in models.MESH_AXES], "mesh")
  rollout = int(p.get("rollout_devices", 0) or 0) if mode == "disaggregated" else 0
  if num_devices is None:
    num_devices = int(p.get("devices", 0) or 0) or (
        math.prod(sizes) + rollout if -1 not in sizes else jax.device_count())
  if num_devices < 1:
    raise ValueError(f"num_devices={num_devices} must be >= 1")
  if mode == "colocated":
    shape = _fill(sizes, num_devices, "mesh")
    return shape, shape
  if not 0 < rollout < num_devices:
    raise ValueError(f"placement.rollout_devices={rollout} must leave devices for training "
                     f"(1..{num_devices - 1})")
  return (_fill(sizes, num_devices - rollout, "mesh"),
          _fill(p.get("rollout_mesh", (1, -1, 1, 1)), rollout, "placement.rollout_mesh"))


def abstract_mesh(shape: dict[str, int]) -> AbstractMesh:
  return AbstractMesh(tuple(shape.values()), tuple(shape))


def shard_bytes(shape, dtype, sharding: NamedSharding) -> int:
  """Bytes of one device's shard of an array."""
  return int(np.prod(sharding.shard_shape(tuple(shape)), dtype=np.int64)) * np.dtype(dtype).itemsize


def _logical_shard(mesh: AbstractMesh, rules, names, shape) -> tuple[int, ...]:
  spec = models.logical_to_spec(names, rules, mesh, shape)
  return NamedSharding(mesh, spec).shard_shape(tuple(shape))


def _sharded_bytes(tree) -> int:
  """Per-device bytes of a tree of ShapeDtypeStructs that carry their shardings."""
  return sum(shard_bytes(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=256)
def _state_bytes(model_cfg, shape: tuple, rules: tuple, clip: bool) -> tuple[int, int, int]:
  # The trainer's own checkpoint layout (eval_shape + shardings), on an abstract mesh.
  optimizer = experiment.optimizer_like(ml_collections.ConfigDict({"optim": {"clip": clip}}))
  state = experiment.abstract_checkpoint(model_cfg, optimizer, abstract_mesh(dict(shape)),
                                         rules)
  trainable = rl_state.split_trainable(state["params"])[0]
  return (_sharded_bytes(state["params"]), _sharded_bytes(state["opt_state"]),
          _sharded_bytes(trainable))


def state_bytes(model_cfg: models.ModelConfig, mesh_shape: dict[str, int],
                rules=models.DEFAULT_RULES, *, clip: bool = True) -> tuple[int, int]:
  """(params, AdamW state) bytes per device, from eval_shape and the rules (cached: the
  advice re-plans the same model many times)."""
  return _cached_state_bytes(model_cfg, mesh_shape, rules, clip)[:2]


def trainable_bytes(model_cfg: models.ModelConfig, mesh_shape: dict[str, int],
                    rules=models.DEFAULT_RULES) -> int:
  """Bytes per device of the params the optimizer updates: all, or the LoRA adapters."""
  return _cached_state_bytes(model_cfg, mesh_shape, rules, True)[2]


def _cached_state_bytes(model_cfg, mesh_shape, rules, clip) -> tuple[int, int, int]:
  rules = tuple((n, tuple(a)) for n, a in rules)
  # Fields that change no parameter share one cache entry (the advice varies remat).
  shapes_only = model_cfg.replace(remat="none", attention_impl="reference", attention_options="",
                                  dtype="float32", attention_chunk=512, logprob_chunk=256)
  return _state_bytes(shapes_only, tuple(mesh_shape.items()), rules, bool(clip))


def _gather_shape(mesh_shape: dict[str, int], rules=models.DEFAULT_RULES) -> dict[str, int]:
  """The mesh shape without the batch axes (the sampler's gathered weights' layout)."""
  batch_axes = set(dict(models.rules_from_config(rules)).get("batch", ()))
  return {a: (1 if a in batch_axes else n) for a, n in mesh_shape.items()}


def decode_weight_bytes(model_cfg: models.ModelConfig, mesh_shape: dict[str, int],
                        rules=models.DEFAULT_RULES) -> int:
  """Per-device bytes of the copy of the weights the sampler gathers for each generate
  call (`Sampler(gather_weights=True)`): sharded by the rules without the batch mesh
  axes, floating weights in the compute dtype when that is narrower, with the experts'
  padding (`expert_padding_bytes`); a mixture's experts split over the batch axes
  (expert parallelism) keep their E split (`Sampler._without_batch_axes`)."""
  shape = _gather_shape(mesh_shape, rules)
  ratio = min(1.0, np.dtype(model_cfg.dtype).itemsize / np.dtype(model_cfg.param_dtype).itemsize)
  if shape == dict(mesh_shape) and ratio == 1.0:
    return 0  # nothing to gather or cast: the sampler reads its own weights
  total = int(state_bytes(model_cfg, shape, rules)[0] * ratio)
  local = _split_experts(model_cfg, mesh_shape, rules)
  if local < model_cfg.num_experts:
    # Expert parallelism: the experts keep E split over the batch axes (and D whole).
    dtype = model_cfg.dtype if ratio < 1.0 else model_cfg.param_dtype
    total += (expert_bytes(model_cfg, abstract_mesh(mesh_shape), rules, dtype)
              - expert_bytes(model_cfg, abstract_mesh(shape), rules, dtype))
  return total + expert_padding_bytes(model_cfg, shape, rules,
                                      experts=local)


def _split_experts(cfg: models.ModelConfig, mesh_shape: dict[str, int], rules) -> int:
  """A mixture's experts on one device of `mesh_shape` (E without expert parallelism)."""
  if not cfg.num_experts:
    return 0
  return _logical_shard(abstract_mesh(mesh_shape), rules, ("experts",), (cfg.num_experts,))[0]


def expert_padding_bytes(model_cfg: models.ModelConfig, mesh_shape: dict[str, int],
                         rules=models.DEFAULT_RULES, *, experts: int | None = None) -> int:
  """Per-device bytes the sampler's gathered copy adds to a mixture's experts when an
  expert's width on a device F', or D, is no multiple of 128: each device's slice of
  the gate and up experts (and their biases) is padded with zeros to ceil128(F'), the
  down experts' to ceil128(F') x ceil128(D) (`Sampler._expert_padding`). Unpadded,
  XLA:TPU kept relaid copies of them through the decode loop: for gpt-oss-20b (F' 1440,
  D 2880 on a v5p-64) 18 GiB a chip, against 1.6 GiB of padding. The mixture layers'
  experts only (`ModelConfig.mixture_layers`): a shared expert and the leading dense
  layers' MLPs are dense and left as they are. Experts without a gate (relu2) pad their
  up and down alone; experts in a latent (moe_latent_dim) pad its width in D's place.
  `experts`: those on one device (E / ep with expert parallelism; default E). 0 for a
  quantized base (QLoRA), whose experts' codes are kept as they are."""
  cfg = model_cfg
  if not cfg.num_experts or cfg.base_quantization:
    return 0
  mesh = abstract_mesh(mesh_shape)
  _, d, f = _logical_shard(mesh, rules, ("experts", "embed", "mlp"),
                           (cfg.num_experts, _expert_width(cfg), cfg.ffn_dim))
  f_pad, d_pad = -(-f // 128) * 128, -(-d // 128) * 128
  s = np.dtype(cfg.dtype).itemsize
  inputs = _mlp_matrices(cfg) - 1  # gate and up, or up alone
  per_expert = ((f_pad - f) * (inputs * d + 2 * cfg.expert_bias)  # gate, up (and biases)
                + f_pad * d_pad - f * d)                            # down, F and D padded
  return s * cfg.mixture_layers * (experts or cfg.num_experts) * per_expert


# ----------------------------------------------------------------------------------------
# Activations and the KV cache
# ----------------------------------------------------------------------------------------


def layer_activation_bytes(model_cfg: models.ModelConfig, remat: str, *, heads: int,
                           kv_heads: int, mlp: int, kv_len: int, shared: int | None = None,
                           dense: bool = False, local: int | None = None,
                           routed: int = 1) -> float:
  """Bytes one layer keeps per token for the backward pass, by remat policy.

  A mixture's (cfg.num_experts) mixture layer, unless `dense`: one of its dense layers
  (leading, cfg.dense_layers, or between its mixture layers, cfg.moe_layer_step), `mlp`
  then their dense_ffn_dim on one device. `shared` is a
  mixture layer's shared expert's width on one device (default cfg.shared_expert_dim).

  s = bytes of the compute dtype; D = d_model; NH = heads * head_dim, KH = kv_heads *
  head_dim, F = mlp, with heads / kv_heads / mlp the widths of one device's shard; N =
  heads, H = head_dim, T = kv_len, c = attention_chunk. Norm internals, RoPE tables and
  attention scores are float32 (4 bytes) whatever the compute dtype:

    none                     s(4D + 2NH + 2KH) + MLP + 4(4D + 4H + N) + attention
                               attention: reference 4(2NT) + NT (scores, probs, mask)
    dots                     s(2D + NH + 2KH) + MLP dots + batched attention matmuls:
                               reference 4NT + s NH, chunked 4(NT + NH T/c)
    dots_with_no_batch_dims  s(2D + NH + 2KH) + MLP dots   (the weight matmuls + block input)
    full                     s D                            (the block input)

  Fitted to what JAX saves (`jax.ad_checkpoint.print_saved_residuals`); flash and ring
  attention keep O(N) per token. A dense MLP keeps gate, up and their SwiGLU product,
  MLP = 3sF (`models.transformer.swiglu` recomputes the sigmoid in its backward), and its
  dots gate and up, MLP dots = 2sF. A mixture of E experts, k a token, F each expert's
  shard (`models.transformer.expert_mlps`) keeps per token

    MLP = s(kD + 3kF) + 4(kD + E + 5k + 4)
      the k sorted input rows and each row's gate, up and product; the float32 expert
      outputs back in token order; the float32 router probabilities; the top-k weights
      (before and after normalising), expert ids and the two permutations (4 bytes each);
      four float32 softmax / normaliser columns
    MLP dots = 4E   the router's float32 logits only: the experts' grouped matmuls
      (`kernels.grouped_matmul`, `ragged_dot`) are no dot_general, so the dots policies
      save none of them: the backward reruns the experts' forward (sort, gate / up / down).

  With expert parallelism (`local` < E experts on a device, the pairs of `routed` = g
  devices' tokens gathered to them: `expert_parallelism`) the routing stays on the
  device's own tokens and the experts' share grows with g:

    MLP = 4(E + 2k + 4) + g (s(kD + 3kF) + 4(kD + 4k) + k)
      the router's probabilities, its top-k weights and ids and four columns a token;
      for each gathered token its weights and ids, which pairs are this device's (a
      bool each), the sorted rows, gate, up and product, the permutations, the float32
      outputs (most of them zero: another device's pairs)
    MLP dots = 4E   as without it

  The routing's and the shared expert's terms below hold either way (the routing runs on
  the device's own tokens); its router, gathered whole, is per layer
  (`saved_activation_bytes`).

  A mixture's dense layers (`ModelConfig.num_dense_layers`) keep a dense MLP's 3sF / 2sF, F
  their dense_ffn_dim on one device. Its mixture layers' routing and shared expert add
  (fitted the same way, on Qwen2-MoE's and GLM-4.5's layouts; Fs = the shared expert's
  width on one device):
    remat none, router_scoring sigmoid   (4 - s)D - 8   the router's float32 input rows
      in place of the compute-dtype ones; the float32 scores [N, E] in the softmax's
      place, the chosen experts' scores and ids (take_along_axis) and the normaliser's
      column in place of the top-k values, ids and two softmax columns. The correction
      bias, the choice, the group ranking and masks (router_groups) keep nothing: no
      gradient reaches them
    remat none, routed_scaling_factor   0   the scaled weights [N, k] in place of the
      normalised ones (and a float32 scalar a layer, `saved_activation_bytes`)
    remat none, norm_topk_prob off   -4(k + 2)   no normaliser: its sum, its power and the
      normalised weights
    remat none, shared expert        s(D + 3Fs)   its own input rows, gate, up and
      product, as a dense MLP of width Fs (outside the experts' shard_map)
    a dots policy, shared expert     2sFs         its gate and up
    remat none, shared_expert_gate   s(2D + 1) + 4   the block's normed input and the
      shared expert's output, which the gate's gradients read, its sigmoid in the
      compute dtype and a float32 column
    a dots policy, shared_expert_gate   sD + 4   the shared expert's down projection and
      the gate's float32 logit (both dots)
    full                             nothing more: the block input alone

  Experts and a shared expert without a gate (mlp_activation relu2, Nemotron 3: relu(x
  up)^2 down), and experts in a latent (moe_latent_dim L: x latent_in [D, L] in, their
  weighted sum latent_out [L, D] out; the router and the shared expert read x), fitted
  the same way, with and without expert parallelism:
    remat none, relu2   (3s + 1)kF in place of 3skF (up, relu^2's mask and its two
      products), (3s + 1)Fs in place of 3sFs; a dots policy sFs, its up alone
    remat none, latent  kL in place of kD in the sorted rows and the float32 outputs,
      and s(D + L) more: latent_in's input (the normed rows) and latent_out's input
    dots, latent        sL + 4gL   latent_in's output and the float32 weighted sum of
      the g devices' tokens (a dot with a batch dimension)
    dots_with_no_batch_dims, latent   sL   latent_in's output

  Gemma's options add (fitted the same way, on Gemma 2 / 3's combination and on each
  alone; a GeGLU MLP keeps what SwiGLU does, `models.transformer.geglu`):
    remat none, sandwich_norms and norm_unit_offset   (32 - 2s)D + 16   the two output
                                    norms, and float32 in place of compute-dtype norm
                                    tensors
    remat none, norm_unit_offset alone    2(4 - s)D
    remat none, sandwich_norms alone      (2s + 16)D + 16
    a dots policy, sandwich_norms   sD   the MLP's down projection, which its norm reads
    remat none, reference attention, attn_logit_softcap   4(2NT)   the capped scores

  Qwen3-Next's / Qwen3.5's attention output gate (cfg.attn_output_gate: the output
  times sigmoid(x W_gate), fitted the same way with each attention_impl):
    remat none      (4 + 2s)NH   the float32 sigmoid, its compute-dtype cast and the
                      gated output that o_proj reads (the kernel's own output stays)
    a dots policy   sNH          the gate's projection (a dot)
    full            nothing more

  q/k norms and OLMo's output norms (fitted the same way, on Qwen3's and OLMo 2's
  layouts):
    remat none, qk_norm     (s + 8)(NH + KH) + 8(N + K)   the normed q and k and their
                              float32 internals; over every head at once (qk_norm_heads)
                              the last term is 16, one normaliser per token for each;
                              with norm_unit_offset (Gemma 3) (4 - s)(NH + KH) more
    a dots policy, output_norms     sD   the MLP's down projection, as sandwich_norms

  Multi-head latent attention (cfg.kv_lora_rank; fitted the same way, on DeepSeek-V3's
  layout with and without a query latent, against standard attention of as many kv
  heads). Rq = q_lora_rank (0: one q_proj), R = kv_lora_rank, both whole on every device
  (the "latent" axis is replicated), Hr = qk_rope_head_dim, V = v_head_dim; kv_heads =
  heads, and the keys expanded over the heads and the values zero-padded to H take 2KH's
  place (k and v), as the rotated q and the attention output take NH's:
    remat none   (2s + 8)(Rq + R) + 8L   each latent's a-projection output, its norm's
                   float32 rows (input and normalised), compute-dtype output and two
                   float32 columns, L the latents (1, or 2 with Rq)
                 + sNV   the output cut back to V (V < H), which o_proj reads; with
                   reference attention it replaces the full-width output (sNV - sNH)
                 (and per layer s(Rq + R + 1), `saved_activation_bytes`: the latent
                   norms' scales and the values' zero padding)
    a dots policy   s(Rq + R + Hr + N(H - Hr) + NV) in place of 2sKH   the latents, the
                   rotated key part (one for every head), the keys' unrotated part and
                   the values before the padding (the matmuls' outputs; q's sNH stays)
    full         nothing more: the block input alone
  """
  d, hd = model_cfg.d_model, model_cfg.head_dim
  nh, kh, n, t = heads * hd, kv_heads * hd, heads, kv_len
  s = np.dtype(model_cfg.dtype).itemsize
  impl = model_cfg.attention_impl
  gated = model_cfg.attn_output_gate
  mixer = {"q_proj": nh * (1 + gated), "k_proj": kh, "v_proj": kh, "o_proj": d}
  if model_cfg.kv_lora_rank:  # k_b_proj's unrotated keys, v_b_proj's values
    mixer.update(k_proj=n * (hd - model_cfg.qk_rope_head_dim),
                 v_proj=n * model_cfg.v_head_dim)
  mlp_kept = (_mlp_kept(model_cfg, remat, mlp, shared, dense, local, routed)
              + _lora_kept(model_cfg, remat, mixer,
                           _lora_mlp_width(model_cfg, mlp, shared, dense),
                           gated_mlp=model_cfg.shared_expert_gate and not dense))
  if remat == "none":
    attn = 4 * 2 * n * t + n * t if impl == "reference" else 0
    if impl == "reference" and model_cfg.attn_logit_softcap is not None:
      attn += 4 * 2 * n * t
    attn += (4 + 2 * s) * nh if gated else 0
    norms = _block_norms_kept(model_cfg)
    if model_cfg.qk_norm:
      norms += (s + 8) * (nh + kh) + (16 if model_cfg.qk_norm_heads else 8 * (n + kv_heads))
      if model_cfg.norm_unit_offset:
        norms += (4 - s) * (nh + kh)
    return (s * (4 * d + 2 * nh + 2 * kh) + mlp_kept + 4 * (4 * d + 4 * hd + n) + attn
            + norms + _latent_kept(model_cfg, remat, heads))
  kv = _latent_kept(model_cfg, remat, heads) if model_cfg.kv_lora_rank else s * 2 * kh
  weight_matmuls = s * (2 * d + nh) + kv + mlp_kept
  if model_cfg.sandwich_norms or model_cfg.output_norms:
    weight_matmuls += s * d
  if gated:
    weight_matmuls += s * nh
  if remat == "dots":
    if impl == "reference":
      return weight_matmuls + 4 * n * t + s * nh
    if impl == "chunked":
      return weight_matmuls + 4 * (n * t + nh * -(-t // model_cfg.attention_chunk))
    return weight_matmuls
  if remat == "dots_with_no_batch_dims":
    return weight_matmuls
  if remat == "full":
    return s * d
  raise ValueError(f"remat={remat!r}; expected one of {REMAT_POLICIES}")


def linear_layer_activation_bytes(model_cfg: models.ModelConfig, remat: str, *,
                                  key_heads: int, value_heads: int, mlp: int, kv_len: int,
                                  shared: int | None = None, dense: bool = False,
                                  local: int | None = None, routed: int = 1) -> float:
  """Bytes one Gated DeltaNet layer (a "linear_attention" layer, `LinearAttention`) keeps
  per token for the backward pass, by remat policy; its MLP as `layer_activation_bytes`'
  (`mlp`, `shared`, `dense`, `local`, `routed` the same keywords).

  s = bytes of the compute dtype; D = d_model; Hk = key_heads, Hv = value_heads (one
  device's shard of the "linear_heads" axis), Dk / Dv = linear_key / value_head_dim,
  K = Hk Dk, V = Hv Dv; T = kv_len, c = min(linear_chunk, T), p = ceil(T / c) c / T (the
  scan pads the last chunk); MLP and MLP dots as `layer_activation_bytes`':

    none                     s 4D + 4(4D + 4) + MLP         the block, as attention's
                             + (33 + 3s)V + (18 + 2s)K + 34Hv + 16Hk
                             + p(4(2K + V + 2Hv) + 1 + 4 Hv Dk Dv / c)
    dots                     s(2D + 2K + 2V + 2Hv) + MLP dots
                             + 4p(2Hk c + 2m Hv c + Hv(5Dv + 2Dk) + Hv Dk Dv / c)
    dots_with_no_batch_dims  s(2D + 2K + 2V + 2Hv) + MLP dots
    full                     s D                            (the block input)

  Fitted to what JAX saves (`jax.ad_checkpoint.print_saved_residuals`) on Qwen3.5's
  layout, float32 and bfloat16. Without remat: z and the convolutions' inputs (q, k, v
  in the compute dtype; `kernels.causal_conv1d` is rematerialised), q's and k's
  float32 rows and l2norm columns, the float32 masked q, k, v, g and beta with their
  masks (1 byte each) and again cut into chunks (with the chunks' reset flags), beta's
  and softplus' float32 columns, the delta rule's float32 output, its per-head RMS norm
  and the SiLU(z) gate (float32 rows and their casts), and the state [Hv, Dk, Dv] carried
  into each chunk (float32: 4 Hv Dk Dv every c tokens; the chunk bodies are
  rematerialised). The terms in s are the compute-dtype arrays that float32 rows take
  the place of in a float32 model. Per layer, beside these (`saved_activation_bytes`):
  the convolutions' taps s(2K + V) linear_conv_kernel, the norm's scale s Dv and two
  float32 [Hv] columns of the decay.
  A dots policy keeps the six projections' outputs (q, k, v, z in the compute dtype, b
  and a [Hv]), o_proj's output and the block output, and, inside the outer checkpoint,
  every batched matmul of each chunk's body that `checkpoint_dots` names, in float32:
  q.k and k.k [Hk, c, c], the 2m products of `kernels.gated_delta_rule`'s unit-lower
  inverse (m = ceil(log2 c) - 1 squarings, [Hv, c, c] each), the solve [c, Dv + Dk], the
  outputs' and the state update's partial products ([c, Dv] four times, [c, Dk] once)
  and the updated state [Dv, Dk] per chunk. For Qwen3.5-27B (16 key and 48 value heads
  of 128, c 64, bfloat16) that is 344 KiB a token, beside 120 KiB for the rest of the
  layer under dots (610 KiB without remat). dots_with_no_batch_dims keeps none of them
  (every one has batch dimensions), nor the states: its backward reruns the scan.

  A Mamba2 layer (cfg.linear_mixer "mamba2", `Mamba2`: Hk its groups, Dk its state, Hv
  its heads, Dv their width) keeps instead:

    none                     s 4D + 4(4D + 4) + MLP         the block, as attention's
                             + s(4V + 2K) + 4V(2 + p) + V + 8K(1 + p) + 2K + 29Hv
                             + p(4Hv + 1 + 4 Hv Dk Dv / c)  (+ 4V below float32)
    dots                     s(2D + 2K + 2V + Hv) + MLP dots
                             + 4p(3 Hv Dv + Hv Dk + Hk c + Hv Dk Dv / c)
    dots_with_no_batch_dims  s(2D + 2K + 2V + Hv) + MLP dots
    full                     s D

  Without remat: z, the convolutions' inputs and x's output (the compute dtype), x in
  float32 (the same array in a float32 model), the float32 masked q, k, v and g with
  their masks and again cut into chunks, the state entering each chunk, the scan's
  float32 output and the gated norm's output (`_mamba2_gated_norm` is rematerialised),
  and the time step's float32 columns. A dots policy keeps the five projections, the
  gated norm's output and out_proj's, and in each chunk's body C.B [Hk, c, c], the
  decayed values and outputs ([c, Dv] three times), the decayed keys [c, Dk] and the
  state. Beside these once per layer: the taps (and biases) s(2K + V)(C + 1) and two
  float32 [Hv] columns of the decay.

  A short-convolution layer (cfg.linear_mixer "short_conv", LFM2's `ShortConv`; its E
  channels on one device are `value_heads`, d_model over the "linear_heads" axis,
  `_linear_shards`) keeps instead:

    none                     s 4D + 4(4D + 4) + MLP + 6sE   the block, as attention's
    dots                     s(2D + 3E) + MLP dots
    dots_with_no_batch_dims  s(2D + 3E) + MLP dots
    full                     s D

  Without remat: B, C and x (in_proj's three parts, their biases added or not), B * x
  (the convolution's input: `kernels.causal_conv1d` is rematerialised), the
  convolution's output and C times it (out_proj's input), all in the compute dtype. A
  dots policy keeps B, C and x and out_proj's output (in its 2D): the convolution is
  elementwise, no matmul, so both dots policies keep the same. Nothing once a layer (its
  taps and biases are read as stored, params in the compute dtype). Fitted the same way
  on LFM2's layout, float32 and bfloat16, with and without linear_conv_bias, and with
  LoRA on in_proj (one adapter over B, C and x, 3E wide) and out_proj.
  """
  cfg = model_cfg
  s, d = np.dtype(cfg.dtype).itemsize, cfg.d_model
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  hk, hv = key_heads, value_heads
  k, v = hk * dk, hv * dv
  c = max(1, min(cfg.linear_chunk, kv_len))
  padded = -(-kv_len // c) * c / kv_len
  if cfg.linear_mixer == "short_conv":  # in_proj's B, C and x, E channels each
    widths = {"in_proj": 3 * hv, "out_proj": d}
  else:
    widths = {"in_proj_qkv": 2 * k + v, "in_proj_z": v, "in_proj_b": hv, "in_proj_a": hv,
              "in_proj_qkvz": 2 * k + 2 * v, "in_proj_ba": 2 * hv,
              "in_proj": 2 * k + 2 * v + hv, "out_proj": d}
  mlp_kept = (_mlp_kept(cfg, remat, mlp, shared, dense, local, routed)
              + _lora_kept(cfg, remat, widths, _lora_mlp_width(cfg, mlp, shared, dense),
                           gated_mlp=cfg.shared_expert_gate and not dense))
  if cfg.linear_mixer == "mamba2":
    return _mamba2_layer_bytes(cfg, remat, s, d, hk, hv, c, padded, mlp_kept)
  if cfg.linear_mixer == "short_conv":
    return _short_conv_layer_bytes(cfg, remat, s, d, hv, mlp_kept)
  if cfg.linear_mixer == "mamba1":  # the block's terms, its MLP's, the mixer's
    if remat == "full":
      return s * d
    block = (s * 4 * d + 4 * (4 * d + 4) + _block_norms_kept(cfg) if remat == "none"
             else s * 2 * d)
    return block + mlp_kept + _mamba1_mixer_kept(cfg, remat, hv, kv_len)
  if remat == "none":
    return (s * 4 * d + 4 * (4 * d + 4) + _block_norms_kept(cfg) + mlp_kept
            + (33 + 3 * s) * v + (18 + 2 * s) * k + 34 * hv + 16 * hk
            + padded * (4 * (2 * k + v + 2 * hv) + 1 + 4 * hv * dk * dv / c))
  projections = s * (2 * d + 2 * k + 2 * v + 2 * hv) + mlp_kept
  if remat == "dots":
    squarings = max(0, (c - 1).bit_length() - 1)  # `_unit_lower_inverse`'s loop
    return projections + 4 * padded * (2 * hk * c + 2 * squarings * hv * c
                                       + hv * (5 * dv + 2 * dk) + hv * dk * dv / c)
  if remat == "dots_with_no_batch_dims":
    return projections
  if remat == "full":
    return s * d
  raise ValueError(f"remat={remat!r}; expected one of {REMAT_POLICIES}")


def _mamba2_layer_bytes(cfg: models.ModelConfig, remat: str, s: int, d: int, hk: int,
                       hv: int, c: int, padded: float, mlp_kept: float) -> float:
  """`linear_layer_activation_bytes` of a Mamba2 layer (the table in its docstring): the
  block's terms and the mixer's own (`_mamba2_mixer_kept`)."""
  mixer = _mamba2_mixer_kept(cfg, remat, hk, hv, c, padded)
  if remat == "none":
    return s * 4 * d + 4 * (4 * d + 4) + _block_norms_kept(cfg) + mlp_kept + mixer
  if remat in ("dots", "dots_with_no_batch_dims"):
    return s * 2 * d + mlp_kept + mixer
  if remat == "full":
    return s * d
  raise ValueError(f"remat={remat!r}; expected one of {REMAT_POLICIES}")


def _short_conv_layer_bytes(cfg: models.ModelConfig, remat: str, s: int, d: int,
                            channels: int, mlp_kept: float) -> float:
  """`linear_layer_activation_bytes` of a short-convolution layer (the table in its
  docstring), `channels` its E on one device: the block's terms and the mixer's six
  [E] rows without remat (B, C, x, B * x, the convolution and C times it), in_proj's
  three under a dots policy."""
  if remat == "none":
    return (s * 4 * d + 4 * (4 * d + 4) + _block_norms_kept(cfg) + mlp_kept
            + 6 * s * channels)
  if remat in ("dots", "dots_with_no_batch_dims"):
    return s * (2 * d + 3 * channels) + mlp_kept
  if remat == "full":
    return s * d
  raise ValueError(f"remat={remat!r}; expected one of {REMAT_POLICIES}")


def _mamba2_mixer_kept(cfg: models.ModelConfig, remat: str, hk: int, hv: int, c: int,
                       padded: float) -> float:
  """What a Mamba2 mixer keeps per token beyond its block's terms (the rows of the table
  in `linear_layer_activation_bytes` past its D terms and MLP): a Mamba2 layer's, or
  the one beside the attention in every parallel_mixer layer
  (`parallel_mixer_activation_bytes`). `hk` / `hv` its groups / heads on one device, `c`
  its chunk and `padded` the scan's padding, p."""
  s = np.dtype(cfg.dtype).itemsize
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  k, v = hk * dk, hv * dv
  state = hv * dk * dv / c
  if remat == "none":
    return (s * (4 * v + 2 * k) + (4 * v if s < 4 else 0) + 4 * v * (2 + padded) + v
            + 8 * k * (1 + padded) + 2 * k + 29 * hv + padded * (4 * hv + 1 + 4 * state))
  projections = s * (2 * k + 2 * v + hv)
  if remat == "dots":
    return projections + 4 * padded * (3 * hv * dv + hv * dk + hk * c + state)
  if remat == "dots_with_no_batch_dims":
    return projections
  if remat == "full":
    return 0
  raise ValueError(f"remat={remat!r}; expected one of {REMAT_POLICIES}")


def parallel_mixer_activation_bytes(model_cfg: models.ModelConfig, remat: str, *,
                                    key_heads: int, value_heads: int, kv_len: int) -> float:
  """What a parallel_mixer layer (Falcon-H1's: a Mamba2 mixer beside the attention, both
  on the block's normed input, their scaled outputs summed before the residual add)
  keeps per token beyond its attention layer's `layer_activation_bytes`: the Mamba2
  mixer's own terms (`_mamba2_mixer_kept`; `key_heads` / `value_heads` its groups /
  heads on one device), its in_proj / out_proj adapters (`_lora_kept`), and

    none                     sD   when attention_in_multiplier or ssm_in_multiplier is
                                  not 1: the mixers read scaled copies of the normed
                                  input, kept in its place or beside it (a product by a
                                  constant keeps not its input)
    dots, dots_with_no_batch_dims   sD   out_proj's output, beside o_proj's (a Mamba2
                                  layer's block counts it among its 2D): the MLP's norm
                                  reads their sum
    full                     nothing: the block input alone

  (and once a layer, `saved_activation_bytes`, a Mamba2 layer's taps and decay columns,
  and each multiplier's scalar). ssm_multipliers and the output multipliers keep nothing
  per token: each scaled in_proj part takes its unscaled one's place. Fitted to what
  JAX saves on a Falcon-H1 layout, float32 and bfloat16, linear_norm after_gate and
  none (the gated norm is rematerialised either way), with LoRA on in_proj and
  out_proj; 0 for other models."""
  cfg = model_cfg
  if not cfg.parallel_mixer:
    return 0
  s, d = np.dtype(cfg.dtype).itemsize, cfg.d_model
  k = key_heads * cfg.linear_key_head_dim
  v = value_heads * cfg.linear_value_head_dim
  c = max(1, min(cfg.linear_chunk, kv_len))
  padded = -(-kv_len // c) * c / kv_len
  kept = (_mamba2_mixer_kept(cfg, remat, key_heads, value_heads, c, padded)
          + _lora_kept(cfg, remat, {"in_proj": 2 * k + 2 * v + value_heads, "out_proj": d},
                       0))
  if remat == "none":
    scaled = cfg.attention_in_multiplier != 1.0 or cfg.ssm_in_multiplier != 1.0
    return kept + s * d * scaled
  return kept + (s * d if remat != "full" else 0)


def _linear_backward_bytes(cfg: models.ModelConfig, key_heads: int, value_heads: int, *,
                           kv_len: int) -> float:
  """What XLA:TPU holds per token, beyond a linear-attention layer's saved activations,
  while it differentiates one such layer (Gated DeltaNet or Mamba2): its causal
  convolution's float32 backward over the 2K + V channels (`kernels.causal_conv1d`: six
  float32 copies, 24 bytes a token and channel, the convolution alone compiled for a v5p
  chip: 1,925 MiB for 8 rows of 2,048 tokens of 5,120 channels, BENCHMARKS.md) and four
  more float32 copies of the state entering each chunk, 16 Hv Dk Dv / c.

  Without it, Qwen3.5-27B's update on v5p-64 was planned at 49.1 GiB a chip against
  52.2 compiled, and a Bamba-9B-shaped model with LoRA on a v5e-8 at 8.48 against 9.19
  (XLA's memory-usage report: a dozen float32 [T, 8192] arrays of x's convolution and
  f32 [chunks, 256, 128, 64] states).

  A short-convolution layer (`ShortConv`, E = `value_heads` its channels on the device)
  runs the same convolution over its E channels and carries no state: 24E (by analogy,
  not compiled)."""
  if cfg.linear_mixer == "short_conv":
    return 24 * value_heads
  k = key_heads * cfg.linear_key_head_dim
  v = value_heads * cfg.linear_value_head_dim
  c = max(1, min(cfg.linear_chunk, kv_len))
  padded = -(-kv_len // c) * c / kv_len
  state = value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
  return 24 * (2 * k + v) + 16 * padded * state / c


def _mixer_layers(cfg: models.ModelConfig) -> int:
  """Layers with a Gated DeltaNet, Mamba2 or short-convolution mixer: the
  linear_attention layers, or with parallel_mixer every layer (its Mamba2 beside its
  attention)."""
  return cfg.num_layers if cfg.parallel_mixer else sum(cfg.linear_layers)


def _multiplier_scalars(cfg: models.ModelConfig, remat: str) -> int:
  """What Falcon-H1's multipliers keep in all, without remat: the scalar (in the compute
  dtype) of each product by one that is not 1, which its backward reads, in every layer
  that has it: the mixers' in and out multipliers (parallel_mixer), ssm_multipliers
  (every Mamba2 mixer) and the MLP's (every layer with a dense MLP)."""
  if remat != "none":
    return 0

  def scaled(*multipliers: float) -> int:
    return sum(m != 1.0 for m in multipliers)

  mlps = sum(cfg.mlp_layers) if cfg.split_layers else cfg.num_layers
  return np.dtype(cfg.dtype).itemsize * (
      cfg.num_layers * scaled(cfg.attention_in_multiplier, cfg.attention_out_multiplier,
                              cfg.ssm_in_multiplier, cfg.ssm_out_multiplier)
      + _mixer_layers(cfg) * scaled(*cfg.ssm_multipliers)
      + mlps * scaled(cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier))


def _linear_layer_constant(cfg: models.ModelConfig, remat: str, key_heads: int,
                           value_heads: int, kv_len: int) -> int:
  """What a Gated DeltaNet layer keeps once, whatever its tokens, without remat: the
  convolutions' taps s(2K + V) linear_conv_kernel, the output norm's scale s Dv, the
  decay's float32 -exp(A_log) [Hv] (and its negation), the scan's float32 query scale
  and, when it pads its last chunk (kv_len no multiple of linear_chunk), the float32
  padding value of each of its five inputs (q, k, v, g, beta); a Mamba2 layer's its taps
  and biases (its norm is rematerialised) and four padded inputs (no beta). Nothing
  under a remat policy, nor for a short-convolution layer (its taps and biases are read
  as stored; no scan, nothing padded)."""
  if remat != "none" or cfg.linear_mixer == "short_conv":
    return 0
  s = np.dtype(cfg.dtype).itemsize
  if cfg.linear_mixer == "mamba1":  # -exp(A_log) [E, N] twice in float32, the taps, the
    # skip's and the dt bias's rows, the norm's scale
    e = value_heads
    return (8 * e * cfg.linear_key_head_dim + s * e * cfg.linear_conv_kernel + 4 * e
            + s * e + s * cfg.d_model)
  k, v = key_heads * cfg.linear_key_head_dim, value_heads * cfg.linear_value_head_dim
  mamba2 = cfg.linear_mixer == "mamba2"
  scalars = 4 + (4 * (5 - mamba2) if kv_len % max(1, min(cfg.linear_chunk, kv_len)) else 0)
  if mamba2:
    return (s * (2 * k + v) * (cfg.linear_conv_kernel + cfg.linear_conv_bias)
            + 8 * value_heads + scalars)
  return (s * ((2 * k + v) * cfg.linear_conv_kernel + cfg.linear_value_head_dim)
          + 8 * value_heads + scalars)


def _block_norms_kept(cfg: models.ModelConfig) -> int:
  """What a block's D-wide norms keep per token without remat beyond plain RMS norms in
  the compute dtype (`layer_activation_bytes`' Gemma terms): float32 in place of
  compute-dtype rows with norm_unit_offset, the two output norms with sandwich_norms."""
  s, d = np.dtype(cfg.dtype).itemsize, cfg.d_model
  if cfg.sandwich_norms and cfg.norm_unit_offset:
    return (32 - 2 * s) * d + 16
  if cfg.norm_unit_offset:
    return 2 * (4 - s) * d
  if cfg.sandwich_norms:
    return (2 * s + 16) * d + 16
  return 0


def _latent_kept(cfg: models.ModelConfig, remat: str, heads: int) -> int:
  """Multi-head latent attention's share of `layer_activation_bytes` per token, `heads`
  on one device: with remat none what it keeps beyond standard attention of as many kv
  heads (the latents and their norms, the output cut back to v_head_dim); with a dots
  policy its projections' outputs, in place of k's and v's. 0 for standard attention."""
  if not cfg.kv_lora_rank:
    return 0
  s = np.dtype(cfg.dtype).itemsize
  rq, r, hd = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim
  hr, v, n = cfg.qk_rope_head_dim, cfg.v_head_dim, heads
  if remat == "none":
    kept = (2 * s + 8) * (rq + r) + 8 * (2 if rq else 1)
    if v < hd:  # the cut-back output; reference attention then keeps no full-width one
      kept += s * n * v - (s * n * hd if cfg.attention_impl == "reference" else 0)
    return kept
  return s * (rq + r + hr + n * (hd - hr) + n * v)


def _lora_mlp_width(cfg: models.ModelConfig, mlp: int, shared: int | None,
                    dense: bool) -> int:
  """The width on one device of the MLP a layer's gate / up / down adapters sit on: a
  dense layer's (`mlp`), a mixture layer's shared expert's (`shared`, default
  cfg.shared_expert_dim), or 0 (a mixture layer without one)."""
  if dense or not cfg.num_experts:
    return mlp
  return cfg.shared_expert_dim if shared is None else shared


def _lora_kept(cfg: models.ModelConfig, remat: str, mixer: dict[str, int], mlp: int,
               gated_mlp: bool = False) -> int:
  """What a layer's LoRA adapters add to `layer_activation_bytes` per token (fitted to
  `jax.ad_checkpoint.print_saved_residuals`, exact on Llama's layout), for the
  projections in cfg.lora_target_names that the layer has: its mixer's (`mixer`: each
  projection's output width on one device) and its MLP's (gate, up and down of width
  `mlp`, 0 for none). r = lora_rank, whole on every device:

    none       s r a projection    its x A (the rest is kept anyway)
    dots       s r a projection + s (its output width) for every one but down_proj:
               both products are dots, and (x A) B is what the backward recomputes the
               block's norms and activations from (down_proj's only feeds the block's
               output, but for a shared expert under a sigmoid gate, `gated_mlp`, whose
               gradient reads it). Multi-head latent attention's k_proj and v_proj are
               its k_b_proj and v_b_proj (N(H - Hr) and NV wide)
    full       nothing: the block input alone

  The routed experts' adapters (grouped matmuls) are no dots: none under a dots policy;
  without remat they keep their sorted rows' products too, which this does not count
  (Qwen2-MoE's layout: 2.2 KB a token and layer more)."""
  if not cfg.lora_rank or remat == "full":
    return 0
  s, r = np.dtype(cfg.dtype).itemsize, cfg.lora_rank
  widths = dict(mixer)
  if mlp:
    widths.update(gate_proj=mlp, up_proj=mlp, down_proj=cfg.d_model if gated_mlp else 0)
  adapted = [t for t in cfg.lora_target_names if t in widths]
  if remat == "none":
    return s * r * len(adapted)
  return sum(s * (r + widths[t]) for t in adapted)


def _gathered_token_bytes(cfg: models.ModelConfig, mlp: int, shared: int | None = None,
                          dense: bool = False, local: int | None = None,
                          routed: int = 1) -> int:
  """Bytes a mixture layer's backward holds per token of the device for the `routed` - 1
  other devices' tokens gathered to its experts (expert parallelism, `_layer_mlps`'
  keywords; 0 without it, or for a dense layer):

    (g - 1) (kD(2s + 8) + 3s kF [+ s(2kF + 2kD) with LoRA on the experts])

  for each of a token's k pairs its sorted row and its outputs in float32, and their
  cotangents; its gate, up and product once; the experts' adapters add their outputs
  over gate and up, and over down with that output's cotangent. Experts without a gate
  (relu2) count what their backward keeps in 3s's place (3s + 1: up, relu^2's mask and
  its two products), experts in a latent its width in D's (both by analogy, not
  compiled). Fitted to XLA:TPU's update on a v5p-64 (fsdp 16 x tensor 2, experts over
  fsdp, libtpu 0.0.42.1, g = 16): Qwen3-30B-A3B (k 8 of 128, D 2048, F 384 a chip)
  99.22 GiB compiled against 99.56 planned, with LoRA on the experts 94.90 against
  96.93; Llama 4 Maverick (k 1, D 5120, F 4096) 62.47 against 66.14 and Scout 27.62
  against 31.79, both with LoRA elsewhere."""
  del shared, local
  if dense or routed <= 1:
    return 0
  s, k, x = np.dtype(cfg.dtype).itemsize, cfg.num_experts_per_tok, _expert_width(cfg)
  per_token = k * x * (2 * s + 8) + _expert_rows_kept(cfg) * k * mlp
  if set(cfg.lora_target_names) & set(models.config.EXPERT_LORA_TARGETS):
    inputs = _mlp_matrices(cfg) - 1  # gate and up, or without a gate up alone
    per_token += s * (inputs * k * mlp + 2 * k * x)
  return (routed - 1) * per_token


def _mlp_kept(cfg: models.ModelConfig, remat: str, mlp: int, shared: int | None = None,
              dense: bool = False, local: int | None = None, routed: int = 1) -> int:
  """The MLP's share of `layer_activation_bytes` (remat none or a dots policy): a dense
  MLP's (`dense`, or a dense model; without a gate, mlp_activation relu2, (3s + 1)F
  without remat, its up projection sF under a dots policy), else a mixture layer's with
  its shared expert of width `shared` on one device (default cfg.shared_expert_dim) and
  its latent (moe_latent_dim), its experts split as `local` and `routed` say
  (`expert_parallelism`)."""
  s = np.dtype(cfg.dtype).itemsize
  if dense or not cfg.num_experts:
    if cfg.mlp_activation == "relu2":  # up, relu^2's mask, its two products / up alone
      return (3 * s + 1) * mlp if remat == "none" else s * mlp
    if cfg.mlp_activation == "xielu":  # up, x > 0's mask, the branches' terms / up alone
      return (4 * s + 2) * mlp if remat == "none" else s * mlp
    return s * (3 if remat == "none" else 2) * mlp
  e, k, d = cfg.num_experts, cfg.num_experts_per_tok, cfg.d_model
  x, row_bytes = _expert_width(cfg), _expert_rows_kept(cfg)
  latent = cfg.moe_latent_dim
  if remat == "none" and (local or e) < e:
    # Expert parallelism: the routing's on the device's own tokens; the pairs of g of
    # them each (the gathered weights, ids and which are this device's among them).
    kept = 4 * (e + 2 * k + 4) + routed * (s * k * x + row_bytes * k * mlp
                                           + 4 * (k * x + 4 * k) + k)
  elif remat == "none":
    kept = s * k * x + row_bytes * k * mlp + 4 * (k * x + e + 5 * k + 4)
  else:
    kept = 4 * e
  if remat == "none":  # the routing's variants, on the device's own tokens either way
    if cfg.router_scoring == "sigmoid":
      kept += (4 - s) * d - 8
    if not cfg.norm_topk_prob:
      kept -= 4 * (k + 2)
  if latent:  # latent_in's input and output; latent_out's input (dots: the float32 sum
    # of the g devices' tokens)
    kept += (s * (d + latent) if remat == "none" else
             s * latent + (4 * latent * routed if remat == "dots" else 0))
  return kept + _shared_kept(cfg, remat, cfg.shared_expert_dim if shared is None else shared)


def _expert_width(cfg: models.ModelConfig) -> int:
  """The width the routed experts read and write: moe_latent_dim, else d_model."""
  return cfg.moe_latent_dim or cfg.d_model


def _mlp_matrices(cfg: models.ModelConfig) -> int:
  """Weight matrices of an MLP or an expert: gate, up and down, or without a gate
  (mlp_activation relu2, xielu) up and down."""
  return 2 if cfg.ungated else 3


def _expert_rows_kept(cfg: models.ModelConfig) -> int:
  """Bytes per [k, F] element a routed expert keeps without remat: gate, up and their
  SwiGLU product, 3s; without a gate (relu2) its up, relu^2's mask (a byte) and its two
  products, 3s + 1."""
  s = np.dtype(cfg.dtype).itemsize
  return 3 * s + (cfg.mlp_activation == "relu2")


def _shared_kept(cfg: models.ModelConfig, remat: str, shared: int) -> int:
  """A mixture layer's shared expert's share of `_mlp_kept` (remat none or a dots
  policy), `shared` its width on one device: a dense MLP's (gate, up and with remat none
  their product; relu2's up, mask and products), with remat none its input rows, and
  what its sigmoid gate's gradients read."""
  if not cfg.shared_expert_dim:
    return 0
  s, d = np.dtype(cfg.dtype).itemsize, cfg.d_model
  gated = cfg.shared_expert_gate
  # A dense MLP of its width, beside its own input rows without remat (relu2: no gate).
  mlp = _mlp_kept(cfg, remat, shared, dense=True)
  if remat == "none":
    return s * d + mlp + (s * (2 * d + 1) + 4 if gated else 0)
  return mlp + (s * d + 4 if gated else 0)


def fused_dq_bytes(model_cfg: models.ModelConfig, *, rows: int, row_len: int,
                   heads: int) -> int:
  """The TPU fused flash backward's (attention option fused_bwd=true) float32 dq
  partials while one layer is differentiated: one [rows, row_len, heads, head_dim] per
  kv block of the backward's blocks (`block_kv_bwd`, else `block_kv`, else the kernel's
  TPU default). `row_len` is one device's share (ring attention runs the kernel on each
  device's chunk). 0 for any other attention."""
  cfg = model_cfg
  if cfg.attention_impl not in ("flash", "ring"):
    return 0
  options = models.config.parse_attention_options(cfg.attention_options)
  if not options.get("fused_bwd"):
    return 0
  # The kernel's own config: its default blocks and their fit to short rows.
  fa = importlib.import_module("kernels.flash_attention")  # the module, not the function
  options = {k: v for k, v in options.items() if k != "backend"}
  q = jax.ShapeDtypeStruct((rows, row_len, 1, cfg.head_dim), np.dtype(cfg.dtype))
  slots, _ = fa.fused_dq_slots(fa.make_config(q, q, backend="tpu", interpret=True,  # any host
                                             **options).for_backward())
  return rows * row_len * heads * cfg.head_dim * 4 * slots


def _activation_shards(cfg: models.ModelConfig, rows: int, row_len: int, mesh, rules):
  """(rows, length, heads, kv_heads, mlp, vocab) of one device's activation shard."""
  b, t, _ = _logical_shard(mesh, rules, ("batch", "length", "embed"),
                           (rows, row_len, cfg.d_model))
  heads = _logical_shard(mesh, rules, ("batch", "length", "heads", "head_dim"),
                         (rows, row_len, cfg.num_heads, cfg.head_dim))[2]
  kv_heads = _logical_shard(mesh, rules, ("batch", "length", "kv_heads", "head_dim"),
                            (rows, row_len, cfg.num_kv_heads, cfg.head_dim))[2]
  mlp = _logical_shard(mesh, rules, ("batch", "length", "mlp"), (rows, row_len, cfg.ffn_dim))[2]
  vocab = _logical_shard(mesh, rules, ("embed", "vocab"), (cfg.d_model, cfg.vocab_size))[1]
  return b, t, heads, kv_heads, mlp, vocab


def expert_parallelism(model_cfg: models.ModelConfig, rows: int, row_len: int, mesh,
                       rules=models.DEFAULT_RULES) -> tuple[int, int]:
  """(L, g) of a mixture's layers on `mesh`: L = the experts one device holds and runs,
  and g = the devices whose tokens each device's experts take, as
  `models.transformer.MoE` splits them. By default L = E and g = 1: every device
  runs its own tokens through every expert (D gathered over fsdp). With the experts'
  E split over mesh axes (expert parallelism, e.g. the rule ("experts", ("fsdp",))),
  L = E / ep, and the tokens are all-gathered over those of its axes that also split
  the tokens (the "batch" and "length" axes): g = their size, M = g N rows a device."""
  cfg = model_cfg
  local = _logical_shard(mesh, rules, ("experts",), (cfg.num_experts,))[0]
  if local == cfg.num_experts:
    return local, 1

  def axes(names, shape):
    return {a for entry in models.logical_to_spec(names, rules, mesh, shape) if entry
            for a in ((entry,) if isinstance(entry, str) else entry)}

  tokens = axes(("batch", "length"), (rows, row_len))
  ep = axes(("experts",), (cfg.num_experts,))
  return local, math.prod(mesh.shape[a] for a in ep & tokens)


def _layer_mlps(cfg: models.ModelConfig, rows: int, row_len: int, mesh,
                rules) -> tuple[tuple[int, dict[str, Any]], ...]:
  """(layers, their MLP's keywords for `layer_activation_bytes`) of each kind of layer,
  every width one device's shard of the "mlp" axis (as `_activation_shards`' mlp): a
  dense model's layers (ffn_dim); a mixture's dense layers (dense_ffn_dim: leading,
  interleaved, or with cfg.split_layers its MLPs alone), then its mixture layers (each
  expert's ffn_dim and the shared expert's width, and the experts a device holds and
  the devices whose tokens they take, `expert_parallelism`)."""
  def width(f: int) -> int:
    if not f:
      return 0
    return _logical_shard(mesh, rules, ("batch", "length", "mlp"), (rows, row_len, f))[2]

  if not cfg.num_experts:
    return ((cfg.num_layers, {"mlp": width(cfg.ffn_dim), "dense": True}),)
  local, routed = expert_parallelism(cfg, rows, row_len, mesh, rules)
  mixture = (cfg.mixture_layers, {"mlp": width(cfg.ffn_dim),
                                  "shared": width(cfg.shared_expert_dim),
                                  "local": local, "routed": routed})
  if not cfg.num_dense_layers:
    return (mixture,)
  return ((cfg.num_dense_layers, {"mlp": width(cfg.dense_ffn_dim), "dense": True}), mixture)


def _linear_shards(cfg: models.ModelConfig, rows: int, row_len: int, mesh,
                   rules) -> tuple[int, int]:
  """(key heads, value heads) of one device's shard of a Gated DeltaNet layer's q / k and
  v / z (the "linear_heads" axis, over `tensor` by default); (0, 0) without such layers.
  A short convolution's channels (d_model of them, on the same axis) are (0, E), E its
  channels on the device: heads of width 1, as its cache's window [B, C-1, D, 1] holds
  them."""
  if not cfg.linear_mixers:
    return 0, 0
  if cfg.linear_mixer == "short_conv":
    return 0, _logical_shard(mesh, rules, ("batch", "length", "linear_heads"),
                             (rows, row_len, cfg.d_model))[2]
  names = ("batch", "length", "linear_heads", "head_dim")
  key = _logical_shard(mesh, rules, names, (rows, row_len, cfg.linear_num_key_heads,
                                            cfg.linear_key_head_dim))[2]
  value = _logical_shard(mesh, rules, names, (rows, row_len, cfg.linear_num_value_heads,
                                              cfg.linear_value_head_dim))[2]
  return key, value


def _layer_kinds(cfg: models.ModelConfig, rows: int, row_len: int, mesh,
                 rules) -> tuple[tuple[int, bool, dict[str, Any]], ...]:
  """(layers, linear, their MLP's keywords) of each kind of layer: `_layer_mlps`' kinds,
  each split into its linear-attention layers (linear, cfg.linear_layers) and its
  attention layers (a mixture's dense layers and its mixture layers apart). With
  cfg.split_layers
  (Nemotron-H, Nemotron 3) the attention layers and the linear layers (no MLP), the
  MLPs alone (dense, of dense_ffn_dim in a model with experts) and the mixtures alone,
  each kind's keywords naming its `part` of a block ("mixer", "mlp" or "moe",
  `_kind_bytes`)."""
  *lead, (n, mlp) = _layer_mlps(cfg, rows, row_len, mesh, rules)
  linear = sum(cfg.linear_layers)
  if cfg.split_layers:  # single-sublayer layers: each kind's `part` of a block
    mixer = {"mlp": 0, "dense": True, "part": "mixer"}
    # The MLPs alone: a dense model's layers, or a mixture's dense kind.
    dense = lead[0][1] if lead else mlp if not cfg.num_experts else {}
    kinds = [(sum(cfg.attention_layers), False, mixer), (linear, True, mixer),
             (sum(cfg.mlp_layers), False, {**dense, "part": "mlp"}),
             (sum(cfg.moe_layers), False, {**mlp, "part": "moe"})]
    return tuple(kind for kind in kinds if kind[0])
  moe = cfg.mixture_flags if cfg.num_experts else (True,) * cfg.num_layers
  lead_linear = sum(lin and not m for lin, m in zip(cfg.linear_layers, moe))
  kinds = [kind for m, kw in lead for kind in ((m - lead_linear, False, kw),
                                                (lead_linear, True, kw))]
  linear -= lead_linear
  kinds += [(n - linear, False, mlp), (linear, True, mlp)]
  return tuple(kind for kind in kinds if kind[0])


def _kind_bytes(cfg: models.ModelConfig, remat: str, linear: bool, mlp: dict[str, Any], *,
                heads: int, kv_heads: int, linear_heads: tuple[int, int],
                kv_len: int) -> float:
  """`layer_activation_bytes`, or for a Gated DeltaNet layer `linear_layer_activation_bytes`
  (`linear_heads` its (key, value) heads on one device); a single-sublayer layer's
  (`mlp`'s "part") `split_layer_activation_bytes`."""
  mlp = dict(mlp)
  part = mlp.pop("part", None)
  if part is not None:
    return split_layer_activation_bytes(cfg, remat, part, linear, mlp, heads=heads,
                                        kv_heads=kv_heads, linear_heads=linear_heads,
                                        kv_len=kv_len)
  if linear:
    return linear_layer_activation_bytes(cfg, remat, key_heads=linear_heads[0],
                                         value_heads=linear_heads[1], kv_len=kv_len, **mlp)
  # An attention layer of a model without rotary layers, under a remat policy: its unit
  # cos and zero sin tables, float32 (`split_layer_activation_bytes` counts its own).
  tables = (4 * cfg.head_dim if remat != "none" and all(cfg.nope_layers)
            and not cfg.split_layers else 0)
  return (layer_activation_bytes(cfg, remat, heads=heads, kv_heads=kv_heads, kv_len=kv_len,
                                 **mlp) + tables
          + parallel_mixer_activation_bytes(cfg, remat, key_heads=linear_heads[0],
                                            value_heads=linear_heads[1], kv_len=kv_len))


def _mamba1_kept(cfg: models.ModelConfig, remat: str, channels: int, kv_len: int) -> float:
  """Bytes a Mamba 1 layer alone (cfg.linear_mixer "mamba1", `Mamba1`) keeps per token for
  the backward pass, E its channels on the device, N its state, R its time-step rank:

    dots    3sE + 4E + sD + 2sN + sR          in_proj's x and gate, the convolution's
                                              output, the float32 time step, the layer's
                                              input, x_proj's B, C and dt
    none    (54 + 3s)E + (8 + 2s)D + 18N + sR + 9 + 4EN / chunk
                                              the float32 steps of the convolution, the
                                              time step, the gate and the scan's inputs,
                                              the norm's rows, B and C in float32, and
                                              the state carried into each chunk

  (full: sD, as every single-sublayer layer). Fitted to what JAX saves on the layout of
  transformers' MambaForCausalLM in float32 and bfloat16."""
  s, d = np.dtype(cfg.dtype).itemsize, cfg.d_model
  block = s * d if remat != "none" else (8 + 2 * s) * d + 8
  return block + _mamba1_mixer_kept(cfg, remat, channels, kv_len)


def _mamba1_mixer_kept(cfg: models.ModelConfig, remat: str, channels: int,
                       kv_len: int) -> float:
  """What a Mamba 1 mixer keeps per token beyond its layer's D terms (`_mamba1_kept`'s
  table less them): 3sE + 4E + 2sN + sR under a dots policy, (54 + 3s)E + 18N + sR + 1 +
  4EN / chunk without remat, and with norms on dt, B and C (cfg.linear_bcdt_norm) their
  float32 rows and scales, 8(2N + R) + 4R, and weighted, their normed rows, s(2N + R)."""
  s = np.dtype(cfg.dtype).itemsize
  e, n, r = channels, cfg.linear_key_head_dim, cfg.linear_dt_rank
  if remat != "none":
    return 3 * s * e + 4 * e + 2 * s * n + s * r
  chunk = max(1, min(cfg.linear_chunk, kv_len))
  normed = ((8 + s * (cfg.linear_bcdt_norm == "weighted")) * (2 * n + r) + 4 * r
            if cfg.linear_bcdt_norm != "none" else 0)
  return (54 + 3 * s) * e + 18 * n + s * r + 1 + 4 * e * n / chunk + normed


def split_layer_activation_bytes(cfg: models.ModelConfig, remat: str, part: str,
                                 linear: bool, mlp: dict[str, Any], *, heads: int,
                                 kv_heads: int, linear_heads: tuple[int, int],
                                 kv_len: int) -> float:
  """Bytes a single-sublayer layer (cfg.split_layers, Nemotron-H, Nemotron 3:
  x + f(norm(x)), one norm) keeps per token for the backward pass: its `part` of a
  block, "mixer" (the attention, or with `linear` a Gated DeltaNet / Mamba2 mixer), "mlp"
  (a dense MLP) or "moe" (a mixture of experts; `mlp` the `_layer_mlps` keywords). s, D,
  H and F as in `layer_activation_bytes`:

    mlp, none        (8 + 2s)D + 8 + MLP     its input norm's float32 rows and
                                             columns, its compute-dtype output and the
                                             block's input, then the MLP's own
    mlp, dots        sD + MLP dots           the block output and the up projection
    moe              as mlp, with a mixture layer's MLP and MLP dots (its shared expert
                     and, with moe_latent_dim, its latent's: `layer_activation_bytes`)
    mixer, none      the block's, no MLP, less (8 + 2s)D + 8 (the MLP's norm and
                     block rows; an attention layer's NoPE rotation keeps 8H, not 16H)
    mixer, dots      the block's, no MLP, less sD; + 4H for an attention layer of a
                     NoPE model (its unit cos and zero sin tables, float32); less sD
                     more with a LoRA adapter on its output projection (o_proj,
                     out_proj), whose product only the residual reads
    full             sD (+ 4H as above)

  Fitted to what JAX saves (`jax.ad_checkpoint.print_saved_residuals`) on Nemotron-H's
  layout (relu^2 MLPs, Mamba2 layers, NoPE attention) and Nemotron 3's (its mixtures of
  relu^2 experts beside them, with and without a latent), float32 and bfloat16."""
  s, d, hd = np.dtype(cfg.dtype).itemsize, cfg.d_model, cfg.head_dim
  tables = 4 * hd if not linear and all(cfg.nope_layers) else 0  # NoPE's cos / sin
  if remat == "full":
    return s * d + (tables if part == "mixer" else 0)
  if part in ("mlp", "moe"):
    kept = (_mlp_kept(cfg, remat, **mlp)
            + _lora_kept(cfg, remat, {}, _lora_mlp_width(cfg, mlp["mlp"], mlp.get("shared"),
                                                         mlp.get("dense", False))))
    return ((8 + 2 * s) * d + 8 if remat == "none" else s * d) + kept
  if linear and cfg.linear_mixer == "mamba1":
    return _mamba1_kept(cfg, remat, linear_heads[1], kv_len)
  block = _kind_bytes(cfg, remat, linear, {"mlp": 0, "dense": True},
                      heads=heads, kv_heads=kv_heads, linear_heads=linear_heads,
                      kv_len=kv_len)
  if remat == "none":
    return block - (8 + 2 * s) * d - 8 - (8 * hd - 16 if tables else 0)
  # An adapted output projection feeds the residual alone: its x A, no (x A) B.
  adapted = ("out_proj" if linear else "o_proj") in cfg.lora_target_names
  return block - s * d * (1 + adapted) + tables


def saved_activation_bytes(model_cfg: models.ModelConfig, *, rows: int, row_len: int,
                           mesh: AbstractMesh, rules=models.DEFAULT_RULES,
                           remat: str | None = None) -> int:
  """What the backward pass of one micro-batch [rows, row_len] keeps, per device:

    tokens * (layers * layer_activation_bytes + 2sD + 4(2D + H) + 8) [+ s D V if tied]

    [+ mixture layers * (4E [+ s 3EDF + rDE on a mesh] [+ 4DE on one device, sigmoid
       routing, params narrower than float32] [+ 4 with routed_scaling_factor])
                                                   a mixture without remat]

  the second term outside the layers: embedding output, final norm, the hidden state the
  chunked log-prob pass reads, RoPE tables (none in a model with no rotary layer: 4H
  less), int32 positions and targets (with
  norm_unit_offset the final norm's in float32: (4 - s)D more, with embed_scale as in
  Gemma or without as in Qwen3.5); tied embeddings also keep the transposed output
  projection. A float32 residual stream (cfg.residual_fp32, Mamba2's) keeps the final
  norm's input, and under remat each layer's input, in float32: (4 - s)D more each.
  tokens = one device's share of the micro-batch (rows over the batch axes, row_len over
  `sequence`). Without remat, a mixture keeps each layer's int32 group sizes [E] and, on
  a mesh, the experts and router its `shard_map` was given (D gathered over fsdp, F
  split): 1.1 GiB a layer for Qwen3-30B-A3B on one tensor shard, which any remat policy
  gathers again in the backward instead. With expert parallelism (`expert_parallelism`:
  L experts on a device) the group sizes are L's, the experts are the device's own L,
  kept only as their cast to a narrower compute dtype (s 3LDF), and the router is
  gathered whole, rDE. r = s, or 4 for a sigmoid router (GLM-4.5's, run in float32,
  which on one device keeps its float32 copy of narrower params too);
  routed_scaling_factor adds its float32 scalar. Experts without a gate (relu2) are 2
  matrices in 3's place, and experts in a latent (moe_latent_dim) its width in D's. A
  mixture's dense layers (`ModelConfig.num_dense_layers`) count as dense layers of width
  dense_ffn_dim, its mixture layers (`ModelConfig.mixture_layers`) with their shared
  expert (`layer_activation_bytes`); a shared expert's weights, outside the experts'
  shard_map, are a dense MLP's. Single-sublayer layers (cfg.split_layers) count with
  `split_layer_activation_bytes`.
  Without remat, multi-head latent attention (cfg.kv_lora_rank) keeps in each layer its
  latent norms' scales and its values' zero padding: s(q_lora_rank + kv_lora_rank + 1).
  Gated DeltaNet, Mamba2 and short-convolution layers (cfg.linear_layers) count with
  `linear_layer_activation_bytes`, the others with `layer_activation_bytes`, and with
  cfg.parallel_mixer (Falcon-H1) each with its Mamba2 beside the attention,
  `parallel_mixer_activation_bytes`; without remat each Gated DeltaNet or Mamba2 mixer
  keeps its convolutions' taps, its norm's scale, two [Hv] columns and a few float32
  scalars besides (`_linear_layer_constant`; a short convolution none), and each
  multiplier that is not 1 its scalar (`_multiplier_scalars`).
  Full layers of their own widths (cfg.global_layers_apart, Gemma 4) count at those
  widths (`width_views`); per-layer embeddings add each token's [L, P] inputs, held
  through the step, and the layers sharing keys and values their producers' k and v
  (`_gemma4_extra_bytes`).
  """
  cfg = model_cfg
  remat = remat or cfg.remat
  if cfg.global_layers_apart or cfg.per_layer_dim or cfg.kv_shared_layers:
    # Each view counts every layer at its widths and the rest alike: weighted by its
    # layers, the rest once and each layer at its own widths.
    return int(sum(count / cfg.num_layers * saved_activation_bytes(
        view, rows=rows, row_len=row_len, mesh=mesh, rules=rules, remat=remat)
                   for count, view in width_views(cfg))
               + _gemma4_extra_bytes(cfg, rows, row_len, mesh, rules, remat))
  b, t, heads, kv_heads, mlp, vocab = _activation_shards(cfg, rows, row_len, mesh, rules)
  linear_heads = _linear_shards(cfg, rows, row_len, mesh, rules)
  layers = sum(n * _kind_bytes(cfg, remat, linear, mlps, heads=heads, kv_heads=kv_heads,
                               linear_heads=linear_heads, kv_len=row_len)
               for n, linear, mlps in _layer_kinds(cfg, rows, row_len, mesh, rules))
  s = np.dtype(cfg.dtype).itemsize
  # The rotary tables (4H); a model without any rotary layer reads none of them.
  tables = 0 if all(cfg.nope_layers) else 4 * cfg.head_dim
  outside = 2 * s * cfg.d_model + 4 * 2 * cfg.d_model + tables + 8
  if cfg.norm_unit_offset:
    outside += (4 - s) * cfg.d_model
  if cfg.residual_fp32:  # the float32 stream: the final norm's input, and under remat
    # each layer's input (what the layer keeps of the stream)
    outside += (4 - s) * cfg.d_model
    layers += cfg.num_layers * (4 - s) * cfg.d_model * (remat != "none")
  # Tied embeddings: the transposed [D, V] output projection is a residual of its own.
  unembed = s * cfg.d_model * vocab if cfg.tie_embeddings and cfg.lm_head else 0
  experts = 0
  if cfg.num_experts and remat == "none":
    local, _ = expert_parallelism(cfg, rows, row_len, mesh, rules)
    if local < cfg.num_experts:  # its own experts, a copy only when cast; the router
      # gathered whole (a sigmoid router's in float32)
      wider = np.dtype(cfg.param_dtype).itemsize > np.dtype(cfg.dtype).itemsize
      weights = ((s * _mlp_matrices(cfg) * local * _expert_width(cfg) * mlp if wider else 0)
                 + _expert_weight_bytes(cfg, mlp, gathered=False))
    elif mesh.size > 1:
      weights = _expert_weight_bytes(cfg, mlp)
    else:  # the sigmoid router's float32 copy of narrower params
      sigmoid = cfg.router_scoring == "sigmoid" and np.dtype(cfg.param_dtype).itemsize < 4
      weights = 4 * cfg.d_model * cfg.num_experts if sigmoid else 0
    scale = 4 if cfg.routed_scaling_factor != 1.0 else 0
    experts = cfg.mixture_layers * (4 * local + weights + scale)
  per_layer = (_mixer_layers(cfg) * _linear_layer_constant(cfg, remat, *linear_heads,
                                                             kv_len=row_len)
               + _multiplier_scalars(cfg, remat))
  if cfg.kv_lora_rank and remat == "none":  # the latent norms' scales, the padding's zero
    per_layer += cfg.num_layers * s * (cfg.q_lora_rank + cfg.kv_lora_rank + 1)
  return int(b * t * (layers + outside) + unembed + experts + per_layer)


def activation_bytes(model_cfg: models.ModelConfig, *, rows: int, row_len: int,
                     mesh: AbstractMesh, rules=models.DEFAULT_RULES,
                     remat: str | None = None) -> tuple[int, str]:
  """Peak activation bytes per device of one micro-batch's forward + backward:

    saved_activation_bytes
    + (1 if remat == none else 2) * tokens * layer_activation_bytes(none)
                                  the layer being differentiated (recomputed) + cotangents
                                  (the fuller kind of layer: a mixture's dense or mixture
                                  layer, a Gated DeltaNet, Mamba2 or short-convolution
                                  layer with `linear_layer_activation_bytes` or an
                                  attention layer, with parallel_mixer and its Mamba2's
                                  terms)
    + tokens * _linear_backward_bytes   with linear-attention layers (or parallel_mixer's
                                  Mamba2 mixers): what XLA:TPU holds differentiating one
                                  beyond its saved activations (its convolution's float32
                                  copies, more chunk states; a short convolution's
                                  float32 copies alone)
    + fused_dq_bytes              the fused flash backward's dq partials, if on
    + 2 * gathered layer          with D split over fsdp: two layers' weights gathered in
                                  the compute dtype (the layer differentiated and the
                                  next); XLA:TPU held 0.8 GiB beyond the rest of this
                                  formula for Llama 3 8B, LoRA and full fine-tune alike;
                                  a mixture's layer is every expert (`_mlp_weight_bytes`)
                                  and it holds three: one more for the experts' weight
                                  gradients in full D, before their reduce-scatter (none
                                  under LoRA, the experts frozen);
                                  with leading dense layers, the larger kind of layer;
                                  multi-head latent attention's projections in place
                                  of q, k, v and o (`_attention_weight_bytes`); a Gated
                                  DeltaNet, Mamba2 or short-convolution layer's where
                                  larger (`_linear_weight_bytes`);
                                  with parallel_mixer the attention's and the Mamba2's
    + 2 * experts in compute dtype    a mixture whose params are wider: XLA:TPU hoists
                                  the cast of every layer's experts out of the layer
                                  loop; against bfloat16 params the update held two such
                                  copies (`expert_bytes`; 2 x 1.69 GiB for Qwen3-30B-A3B
                                  in float32 on a v5p-64 at fsdp 16 x tensor 2), one
                                  when they are frozen (LoRA)
    + 3 * rows * logprob_chunk * vocab * 4       float32 logits, softmax and their grad

  With expert parallelism (`expert_parallelism`: L experts on a device, never gathered,
  and the tokens of g devices gathered to them) a mixture layer gathers its router and
  shared expert alone, and the layer being differentiated holds what the other g - 1
  devices' tokens add (`_gathered_token_bytes`). Compiled for a v5p-64 (fsdp 16 x
  tensor 2, experts over fsdp, g = 16): Qwen3-30B-A3B 99.22 GiB a chip against 99.56
  planned (51.2 without expert parallelism: its 8 of 128 experts a token gather 16 x 8
  pairs a token); Llama 4 Maverick with LoRA 62.47 against 66.14 (79.66 without), and
  Scout 27.62 against 31.79 (25.61 without: one expert a chip takes 16 chips' tokens to
  spare a 1.9 GiB layer of experts).

  The mixture's terms (and its extra gradient in `plan`) are fitted to XLA:TPU's update
  for Qwen3-30B-A3B at fsdp 16 x tensor 2 (libtpu 0.0.42.1; `kernels.grouped_matmul`):
  8K and 16K tokens a chip, dots or full remat, float32 or bfloat16 params, one or four
  micro-batches an update, all within -0.7 / +0.3 GiB of the compiled temporaries. Bytes
  are logical: an expert slice whose F is not a multiple of TPU's 128 lanes (tensor 4:
  192) is padded, and XLA:TPU then relays every layer's gate and up experts for the
  decode loop, none of which this counts (+12 GiB in that decode).

  Returns (bytes, a one-line description).
  """
  cfg = model_cfg
  remat = remat or cfg.remat
  if cfg.global_layers_apart or cfg.per_layer_dim or cfg.kv_shared_layers:
    return _two_widths_activation_bytes(cfg, rows=rows, row_len=row_len, mesh=mesh,
                                        rules=rules, remat=remat)
  b, t, heads, kv_heads, _, vocab = _activation_shards(cfg, rows, row_len, mesh, rules)
  linear_heads = _linear_shards(cfg, rows, row_len, mesh, rules)
  mlps = _layer_mlps(cfg, rows, row_len, mesh, rules)
  saved = saved_activation_bytes(cfg, rows=rows, row_len=row_len, mesh=mesh, rules=rules,
                                 remat=remat)
  kinds = _layer_kinds(cfg, rows, row_len, mesh, rules)

  def layer(linear: bool, kw: dict[str, Any]) -> float:
    return b * t * _kind_bytes(cfg, "none", linear, kw, heads=heads, kv_heads=kv_heads,
                               linear_heads=linear_heads, kv_len=row_len)

  one_layer = max(layer(linear, {**kw, "routed": 1}) for _, linear, kw in kinds)
  transient = (1 if remat == "none" else 2) * one_layer
  if cfg.linear_mixers:
    transient += b * t * _linear_backward_bytes(cfg, *linear_heads, kv_len=row_len)
  transient += b * t * max(_gathered_token_bytes(cfg, **{k: v for k, v in kw.items()
                                                         if k != "part"})
                           for _, _, kw in kinds)
  transient += fused_dq_bytes(cfg, rows=b, row_len=t, heads=heads)
  transient += b * t * _ordered_held_bytes(cfg, heads, kv_heads, mlps, linear_heads)
  if _logical_shard(mesh, rules, ("embed",), (cfg.d_model,))[0] != cfg.d_model:
    # A mixture's third copy is its experts' weight gradient: none for frozen experts
    # (LoRA; Llama 4 Maverick's on a v5p-64: 79.5 GiB compiled, 101.2 planned with it).
    transient += (3 if cfg.num_experts and not cfg.lora_rank else 2) * _gathered_layer_bytes(
        cfg, heads, kv_heads, mlps, linear_heads)
  if np.dtype(cfg.dtype).itemsize < np.dtype(cfg.param_dtype).itemsize:
    # Frozen experts (LoRA) are cast once: Qwen3-30B-A3B's update held one 1.69 GiB copy.
    transient += (1 if cfg.lora_rank else 2) * expert_bytes(cfg, mesh, rules, cfg.dtype)
  logits = _logit_chunk_bytes(cfg, b, t, vocab) if cfg.lm_head else 0  # a score head: none
  note = (f"{cfg.num_layers} layers x {b}x{t} tokens, remat={remat}, "
          f"{cfg.attention_impl} attention")
  if cfg.kv_lora_rank:
    note += (f" (latent: kv rank {cfg.kv_lora_rank}"
             + (f", q rank {cfg.q_lora_rank})" if cfg.q_lora_rank else ")"))
  if cfg.parallel_mixer:
    note += " beside a Mamba2 mixer in every layer"
  elif cfg.linear_mixer == "short_conv" and any(cfg.linear_layers):
    note += f", {sum(cfg.linear_layers)} of the layers short convolutions"
  if cfg.num_experts:
    note += f", {cfg.num_experts} experts (top {cfg.num_experts_per_tok})"
    if cfg.moe_latent_dim:
      note += f" in a latent of {cfg.moe_latent_dim}"
    if cfg.shared_expert_dim:
      note += f" + a shared expert of {cfg.shared_expert_dim}"
    local, routed = expert_parallelism(cfg, rows, row_len, mesh, rules)
    if local < cfg.num_experts:
      note += f", {local} experts a device" + (
          f" taking {routed} devices' tokens" if routed > 1 else "")
    if cfg.moe_layer_step > 1:
      note += f", every {cfg.moe_layer_step}th layer a mixture, the others dense"
    elif cfg.dense_layers:
      note += (f", the first {cfg.dense_layers} layers dense" if cfg.dense_layers > 1
               else ", the first layer dense")
    elif cfg.split_layers:
      note += f", {cfg.mixture_layers} of the layers a mixture alone"
  return int(saved + transient + logits), note


def width_views(cfg: models.ModelConfig) -> tuple[tuple[int, models.ModelConfig], ...]:
  """(layers, a config every layer of which is as they are) of a model whose full layers
  have widths of their own (cfg.global_layers_apart, Gemma 4): its sliding layers, then
  its full ones (values counted as their own projection's where the keys give them); and
  where the layers sharing keys and values have MLPs twice as wide (E2B), those (counted
  as the sliding layers' widths, their MLPs doubled)."""
  plain = dict(global_head_dim=0, global_kv_heads=0, k_eq_v=False, per_layer_dim=0,
               per_layer_vocab=0, kv_shared_layers=0, kv_shared_wide_mlp=False)
  wide = cfg.num_layers - cfg.kv_shared_layers if cfg.kv_shared_wide_mlp else cfg.num_layers
  views = []
  for kind, view in ((True, cfg), (False, cfg.global_config())):
    for lo, hi, ffn in ((0, wide, view.ffn_dim), (wide, cfg.num_layers, 2 * view.ffn_dim)):
      count = sum(s == kind for s in cfg.sliding_layers[lo:hi])
      if count:
        views.append((count, dataclasses.replace(view, **plain, ffn_dim=ffn)))
  return tuple(views)


def _two_widths_activation_bytes(cfg: models.ModelConfig, *, rows: int, row_len: int,
                                 mesh: AbstractMesh, rules, remat: str) -> tuple[int, str]:
  """`activation_bytes` of a model whose full layers have widths of their own: each kind's
  saved activations for its own layers, and the larger kind's layer being
  differentiated."""
  rest, note = 0, ""
  for _, view in width_views(cfg):
    total, note = activation_bytes(view, rows=rows, row_len=row_len, mesh=mesh, rules=rules,
                                   remat=remat)
    rest = max(rest, total - saved_activation_bytes(view, rows=rows, row_len=row_len,
                                                    mesh=mesh, rules=rules, remat=remat))
  saved = saved_activation_bytes(cfg, rows=rows, row_len=row_len, mesh=mesh, rules=rules,
                                 remat=remat)
  wide = cfg.global_config()
  note += (f"; the {cfg.num_layers - sum(cfg.sliding_layers)} full layers "
           f"{wide.num_kv_heads} x {wide.head_dim} wide")
  if cfg.per_layer_dim:
    note += f", per-layer inputs of {cfg.per_layer_dim}"
  if cfg.kv_shared_layers:
    note += f", {cfg.kv_shared_layers} layers reading others' keys and values"
  return int(saved + rest), note


def _gemma4_extra_bytes(cfg: models.ModelConfig, rows: int, row_len: int, mesh, rules,
                        remat: str | None = None) -> int:
  """What a model with per-layer embeddings keeps beyond its layers (each token's [L, P]
  inputs, held through the step) and one with layers sharing keys and values (the k and
  v of each layer they read)."""
  b, t, _, kv_heads, _, _ = _activation_shards(cfg, rows, row_len, mesh, rules)
  s = np.dtype(cfg.dtype).itemsize
  layers, p = cfg.num_layers, cfg.per_layer_dim
  # The inputs, their norm's float32 input and rsqrt (kept for its backward), and under
  # remat each layer's slice, an argument its checkpoint keeps.
  extra = b * t * (layers * p * (s + 4) + 4 * layers) * bool(p)
  if p and (remat or cfg.remat) != "none":
    extra += b * t * layers * p * s
  for i in {cfg.kv_producer(i) for i in range(cfg.num_layers)} - {None}:
    view = cfg if cfg.sliding_layers[i] else cfg.global_config()
    heads = max(1, kv_heads * view.num_kv_heads // cfg.num_kv_heads)
    extra += 2 * b * t * heads * view.head_dim * s
  return extra


def _ordered_held_bytes(cfg: models.ModelConfig, heads: int, kv_heads: int,
                        mlps: tuple[tuple[int, dict[str, Any]], ...],
                        linear_heads: tuple[int, int]) -> int:
  """Per token, what XLA:TPU holds for every layer a hybrid's training rebuilds in order
  (`models.transformer.ordered_layers`: a pattern of many runs that does not repeat,
  unrolled): the output buffers of each such layer's projections over FSDP-gathered
  weights, which it allocates at the top of the program and keeps ("AllocateBuffer"
  custom calls: 354 of them, 8.4 GiB a chip, at the peak of a Nemotron-H-8B-shaped
  update on a v5e-8):

    an MLP         2sF                      its up projection's and activation's
    a Mamba2 layer s(2V + 2K + Hv) + 2sV + sD   in_proj's, x's and z's, out_proj's
    attention      s(2NH + 16KH)

  (a layer with both a mixer and an MLP, both). Fitted to that report; 0 for other
  models. A mixture of experts alone (Nemotron 3's moe layers, `mlps`' mixture kind: k
  experts a token of width F, a shared expert of Fs, a latent of L) counts by analogy,
  not compiled: its shared expert's 2sFs as an MLP's, the routed experts' up and
  activation rows 2skF, the router's float32 logits 4E and latent_in's output sL. A
  short-convolution layer (LFM2's, E its channels) counts its projections' outputs by
  analogy, not compiled: in_proj's B, C and x and out_proj's, s(3E + D)."""
  counts = ordered_layers(cfg)
  if not counts:
    return 0
  s, d, hd = np.dtype(cfg.dtype).itemsize, cfg.d_model, cfg.head_dim
  dense = [kw for _, kw in mlps if kw.get("dense") or not cfg.num_experts]
  f = max((kw["mlp"] for kw in dense), default=0)
  k = linear_heads[0] * cfg.linear_key_head_dim
  v = linear_heads[1] * cfg.linear_value_head_dim
  mlp = 2 * s * f
  moe = 0
  if cfg.num_experts:
    mixture = mlps[-1][1]
    shared = mixture.get("shared", 0) or 0
    moe = (2 * s * (shared + cfg.num_experts_per_tok * mixture["mlp"])
           + 4 * cfg.num_experts + s * cfg.moe_latent_dim)
  linear = s * (4 * v + 2 * k + linear_heads[1] + d)
  if cfg.linear_mixer == "short_conv":
    linear = s * (3 * linear_heads[1] + d)
  mixer = {"linear": linear,
           "full": s * (2 * heads * hd + 16 * kv_heads * hd), "mlp": 0, "moe": moe}
  return sum(n * (mixer[kind] + (mlp if kind == "mlp" or not cfg.split_layers else 0))
             for kind, n in counts.items())


def expert_bytes(model_cfg: models.ModelConfig, mesh: AbstractMesh, rules=models.DEFAULT_RULES,
                 dtype: str | None = None) -> int:
  """Per-device bytes of every mixture layer's experts (gate, up, down; up and down
  without a gate, relu2; D their latent's width with moe_latent_dim; the router, a
  latent's projections, a shared expert and the dense layers aside) in `dtype` (default
  param_dtype), sharded by the rules; 0 for a dense model."""
  cfg = model_cfg
  if not cfg.num_experts:
    return 0
  shard = _logical_shard(mesh, rules, ("experts", "embed", "mlp"),
                         (cfg.num_experts, _expert_width(cfg), cfg.ffn_dim))
  return (cfg.mixture_layers * _mlp_matrices(cfg) * math.prod(shard)
          * np.dtype(dtype or cfg.param_dtype).itemsize)


def _logit_chunk_bytes(cfg: models.ModelConfig, rows: int, length: int, vocab: int) -> int:
  """float32 logits, softmax and their gradient of one log-prob chunk."""
  return 3 * rows * max(1, min(cfg.logprob_chunk, length)) * vocab * 4


def head_bytes(model_cfg: models.ModelConfig, *, mesh: AbstractMesh,
               rules=models.DEFAULT_RULES, rows: int = 1, row_len: int = 1) -> int:
  """Per-device bytes the train step's log-prob head holds beside one chunk's logits, for
  `rows` x `row_len` tokens a micro-batch, when the rules split the output projection's
  D (fsdp). The head then splits the vocabulary over those axes instead
  (`ShardingContext.vocab_parallel_head`), V' = V / (tensor x fsdp):

    2 * s * D * V'                two compute-dtype copies of its slice of the projection
    + (4 + s) * D * V'            trained (no LoRA): the slice's float32 gradient, summed
                                  over the chunks, and a compute-dtype copy of it
    + 2 * s * R * C * D           one chunk's hidden states gathered over fsdp (R rows of
                                  C positions) and their gradient

  Where the vocabulary does not divide over fsdp, or a chunk's R x C outnumber V / tensor
  (the rows would outweigh the projection), every device gathers the whole [D, V /
  tensor] instead, V' = V / tensor, and projects only its own rows (no gather term).
  Compiled by XLA:TPU for Llama 3 8B (D 4096, V 128256), a full fine-tune on a v5e-16:
  0.37 GiB here, where the gathered projection and its float32 gradient took 4.9 GiB.
  The head runs after the layers' forward and its backward before theirs, so `plan`
  counts it beside the saved activations and a chunk's logits, not beside a layer's
  backward."""
  cfg = model_cfg
  if not cfg.lm_head:
    return 0  # a reward model's score head: no projection, no log-probs
  d_shard, vocab = _logical_shard(mesh, rules, ("embed", "vocab"), (cfg.d_model, cfg.vocab_size))
  if d_shard == cfg.d_model:
    return 0  # D whole on each device: the head reads its own shard of the projection
  s = np.dtype(cfg.dtype).itemsize
  trained = 0 if cfg.lora_rank else 4 + s
  chunk, layout = _head_layout(cfg, mesh, rules, rows, row_len)
  if layout is None:
    return int((2 * s + trained) * cfg.d_model * vocab)
  w_spec, logits_spec = layout
  vocab = NamedSharding(mesh, w_spec).shard_shape((cfg.d_model, cfg.vocab_size))[1]
  gathered_rows = NamedSharding(mesh, PartitionSpec(logits_spec[0])).shard_shape((rows,))[0]
  return int((2 * s + trained) * cfg.d_model * vocab
             + 2 * s * gathered_rows * chunk * cfg.d_model)


def divergence_head_bytes(model_cfg: models.ModelConfig, teacher_cfg: models.ModelConfig, *,
                          mesh: AbstractMesh, rules=models.DEFAULT_RULES, rows: int = 1,
                          row_len: int = 1) -> int:
  """Per-device bytes the train step's divergence to a distillation teacher
  (`models.chunked_divergence`, distill.loss reverse_kl / forward_kl / jsd) holds beside
  what `head_bytes` and a chunk's logits count, for `rows` x `row_len` tokens a
  micro-batch. It reads the same hidden states and projection as the log-prob head, one
  pass after the other, in the same layout: V' the vocabulary a device holds (V / (tensor
  x fsdp) where the vocabulary splits, `ShardingContext.vocab_parallel_head`; V / tensor
  otherwise), E the teacher's d_model, W its vocabulary:

    s * D * V'          trained (no LoRA): the projection's gradient from the pass that
                        ran first, in the compute dtype, live while the other runs
    + s * E * V'        the teacher's slice of its projection [E, V'] in the compute
                        dtype, moved to the split vocabulary (twice when W > V: the
                        sliced [E / fsdp, V] before it moves), or gathered whole where
                        the rules split E and the vocabulary does not split; with E whole
                        on each device, only a cast copy (distill.dtype not the compute
                        dtype)
    + 4 * R * C * V'    one float32 chunk of logits more than the head's three (the
                        teacher's), R x C the chunk's rows and positions on a device
    + s * R_g * C * E   where the vocabulary splits, the chunk's teacher hidden states
                        gathered over fsdp (R_g rows, as `head_bytes` gathers the
                        policy's), with no gradient

  Compiled by XLA:TPU (libtpu 0.0.42.1) on a v5e-8 for Llama 3 8B's head (D 4096, V
  128256) and a teacher of E 3072, 8 rows of 1,024, chunks of 256, the head's phase with
  the divergence held more than without it: 0.32 GiB trained with the vocabulary split
  over fsdp 8 (this counts 0.35), 0.98 GiB trained data parallel (1.10), 0.126 GiB data
  parallel with LoRA (0.122). A one-layer model's whole RL update held 0.40 GiB more with
  distill.loss=reverse_kl than without a teacher (16 rows: 0.49), where this and the
  teacher's hidden states count 0.35 (0.49). Where XLA's head alone keeps slack that the
  divergence fills (LoRA under fsdp: 0.15 GiB more in the update, 0.23 counted; chunks of
  8 x 128), it adds less than this."""
  return sum(_divergence_parts(model_cfg, teacher_cfg, mesh, rules, rows, row_len).values())


def _divergence_parts(cfg: models.ModelConfig, tcfg: models.ModelConfig, mesh: AbstractMesh,
                      rules, rows: int, row_len: int) -> dict[str, int]:
  """`divergence_head_bytes` by term, named as the plan's note names them."""
  if not cfg.lm_head:
    return {}
  d, e, v = cfg.d_model, tcfg.d_model, cfg.vocab_size
  s = np.dtype(cfg.dtype).itemsize
  chunk = max(1, min(cfg.logprob_chunk, row_len))
  ctx = models.ShardingContext(mesh, rules)
  # As chunked_divergence picks it: the model's D, else the teacher's E, decides.
  layout = (ctx.vocab_parallel_head(rows, chunk, d, v)
            or ctx.vocab_parallel_head(rows, chunk, e, v))
  b, t, _, _, _, vocab = _activation_shards(cfg, rows, row_len, mesh, rules)
  parts = {"one more float32 logits chunk": _logit_chunk_bytes(cfg, b, t, vocab) // 3}
  if layout is None:
    e_whole = _logical_shard(mesh, rules, ("embed",), (e,))[0] == e
    cast = np.dtype(tcfg.dtype) != np.dtype(cfg.dtype)
    teacher = s * e * vocab if (not e_whole or cast) else 0
  else:
    w_spec, logits_spec = layout
    vocab = NamedSharding(mesh, w_spec).shard_shape((d, v))[1]
    gathered_rows = NamedSharding(mesh, PartitionSpec(logits_spec[0])).shard_shape((rows,))[0]
    teacher = s * e * vocab * (2 if tcfg.vocab_size > v else 1)
    parts["the chunk's teacher rows gathered"] = s * gathered_rows * chunk * e
  parts[f"the teacher's [E, V'] projection (E {e})"] = teacher
  if not cfg.lora_rank:
    parts["the first pass's projection gradient"] = s * d * vocab
  return {name: int(n) for name, n in parts.items() if n}


def _head_layout(cfg: models.ModelConfig, mesh: AbstractMesh, rules, rows: int, row_len: int):
  """(positions a log-prob chunk holds, the head's split-vocabulary specs or None), as
  `chunked_logprobs` picks them for a micro-batch of rows x row_len."""
  chunk = max(1, min(cfg.logprob_chunk, row_len))
  return chunk, models.ShardingContext(mesh, rules).vocab_parallel_head(
      rows, chunk, cfg.d_model, cfg.vocab_size)


def _head_note(cfg: models.ModelConfig, mesh: AbstractMesh, rules, rows: int,
               row_len: int) -> str:
  grad = "" if cfg.lora_rank else " and its gradient (float32 + a copy)"
  if _head_layout(cfg, mesh, rules, rows, row_len)[1] is None:
    return f"the output projection gathered for the log-prob head (2 copies){grad}"
  return (f"the log-prob head's vocabulary slice of the projection (2 copies){grad}, "
          "a chunk's rows gathered")


def kv_cache_bytes(model_cfg: models.ModelConfig, *, batch: int, max_len: int,
                   mesh: AbstractMesh, rules=models.DEFAULT_RULES,
                   dtype: str | None = None,
                   write_tokens: int = models.CACHED_WRITE_TOKENS) -> int:
  """Per-device bytes of the sampler's cache: k and v [batch, kv_heads, slots, head_dim]
  per layer (`batch` over the batch axes, kv heads over `tensor` where they divide), plus
  float32 scales [batch, kv_heads, slots] per k and v for an int8 cache. slots is max_len,
  or for a sliding layer its ring (`models.sliding_cache_slots`, for the sampler's
  `extend_chunk` = write_tokens). The arrays are the model's own, as `init_layer_cache`
  builds them (`_cache_arrays`): multi-head latent attention caches its latent alone,
  one array [batch, 1, slots, qk_rope_head_dim + kv_lora_rank] (no v; its one head
  whole on every tensor shard), and its int8 scales [batch, 1, slots]; with DeepSeek
  Sparse Attention the indexer's keys beside it in v [batch, 1, slots, index_head_dim]
  (int8: with their scales). A linear-attention
  layer's is its `LinearCache`, whatever max_len: the recurrent state [batch, value heads,
  key head dim, value head dim] float32 and the convolutions' last inputs; with
  cfg.parallel_mixer (Falcon-H1) every layer holds a KV cache and a `LinearCache` (its
  Mamba2's) both. An MLP or a mixture of experts alone (cfg.split_layers) has none."""
  cfg = model_cfg
  dtype = np.dtype("int8" if dtype == "int8" else (dtype or cfg.dtype))

  def layer(slots: int) -> int:
    return sum(shard_bytes(shape, dt, NamedSharding(mesh, models.logical_to_spec(
        CACHE_AXES[:len(shape)], rules, mesh, shape)))
               for shape, dt in _cache_arrays(cfg, batch, slots, dtype.name))

  ring = models.sliding_cache_slots(cfg, max_len, write_tokens)
  sliding, linear = sum(cfg.sliding_layers), _mixer_layers(cfg)
  if cfg.global_layers_apart or cfg.kv_shared_layers:
    # Gemma 4: the full layers' caches at their own widths; the layers sharing another's
    # keys and values (kv_shared_layers) hold none.
    wide = cfg.global_config()
    full_layer = sum(shard_bytes(shape, dt, NamedSharding(mesh, models.logical_to_spec(
        CACHE_AXES[:len(shape)], rules, mesh, shape)))
                     for shape, dt in _cache_arrays(wide, batch, max_len, dtype.name))
    own = cfg.sliding_layers[:cfg.num_layers - cfg.kv_shared_layers]
    return (len(own) - sum(own)) * full_layer + sum(own) * layer(ring)
  recurrent = 0
  if linear:
    arrays = jax.eval_shape(lambda: init_linear_cache(cfg, batch, dtype))
    recurrent = sum(shard_bytes(x.shape, x.dtype, NamedSharding(mesh, models.logical_to_spec(
        axes, rules, mesh, x.shape))) for x, axes in zip(arrays, LINEAR_CACHE_AXES))
  full = sum(cfg.attention_layers) - sliding  # an MLP or a mixture alone: no cache
  return full * layer(max_len) + sliding * layer(ring) + linear * recurrent


@functools.lru_cache(maxsize=256)
def _cache_arrays(cfg: models.ModelConfig, batch: int, slots: int, dtype: str
                  ) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
  """(shape, dtype) of each array of one layer's cache of `batch` rows x `slots`, as
  `init_layer_cache` builds it (abstractly): k and v [batch, kv_heads, slots, head_dim]
  (multi-head latent attention: k alone, the latent), then an int8 cache's float32
  scales [batch, kv_heads, slots]."""
  arrays = jax.eval_shape(lambda: init_layer_cache(cfg, batch, slots, np.dtype(dtype)))
  return tuple((tuple(x.shape), np.dtype(x.dtype)) for x in arrays if x is not None)


def _cache_note(cfg: models.ModelConfig, dtype: np.dtype) -> str:
  """How one token's cache in a layer is laid out: '2 x <heads> x <head_dim>' (k and
  v), or a latent cache's single array."""
  arrays = [shape for shape, _ in _cache_arrays(cfg, 1, 1, dtype.name) if len(shape) == 4]
  heads, width = arrays[0][1], arrays[0][3]
  if len(arrays) == 1:
    return f"1 x {heads} x {width} (the latent: k and v both)"
  return f"{len(arrays)} x {heads} x {width}"


def _cache_layers_note(cfg: models.ModelConfig, max_len: int) -> str:
  """'<slots> x <layers> layers', with the sliding layers' rings apart (and the linear
  layers' fixed-size states apart: '<slots> x <full> layers (+ <n> linear layers'
  states)', a short convolution's its window; with parallel_mixer every layer's Mamba2
  state beside its KV cache)."""
  sliding = sum(cfg.sliding_layers)
  linear = sum(cfg.linear_layers)
  if cfg.parallel_mixer:
    return f"{max_len} x {cfg.num_layers} layers (+ {cfg.num_layers} Mamba2 states)"
  if linear:
    state = ("short convolutions' windows" if cfg.linear_mixer == "short_conv" else
             "linear layers' states")
    return f"{max_len} x {sum(cfg.attention_layers)} layers (+ {linear} {state})"
  ring = models.sliding_cache_slots(cfg, max_len)
  if not sliding or ring == max_len:
    return f"{max_len} x {cfg.num_layers} layers"
  full = cfg.num_layers - sliding
  return (f"({max_len} x {full} layers + {ring} x {sliding} sliding)" if full else
          f"{ring} x {sliding} sliding layers")


def prefill_bytes(model_cfg: models.ModelConfig, *, prompts: int, prompt_len: int, rows: int,
                  mesh: AbstractMesh, rules=models.DEFAULT_RULES,
                  dtype: str | None = None, gathered: bool = True) -> int:
  """Per-device bytes a generate call's prefill holds beside the cache it fills:

    kv_cache_bytes(prompts, prompt_len)   the distinct prompts' own cache, live until
                                          every row has copied its prompt's
    [+ relaid]                            Gated DeltaNet projections (below)
    + max(tokens * (s(2D + NH + 2KH + 5F) + attention)    one layer's forward
          [+ layer],                                       (weights left sharded: that
                                                            layer's weights gathered)
          2 * rows * prompt_len * KH * s)                 one layer's rows copied out
                                                          (k and v; a latent cache's
                                                          one array, `_cache_arrays`)

  tokens = one device's share of prompts x prompt_len. XLA:TPU keeps about five
  [tokens, F] MLP arrays live in a layer's forward (gate, up, their product and the
  partial sums of the down projection); a mixture, k experts a token, keeps
  s(kD + 5kF) + 4(2kD + 2E) in place of 5sF (the k sorted input rows, five [k, F] rows,
  the float32 expert outputs sorted and back in token order, the router's float32
  logits and probabilities). Attention is the reference's float32 scores 4(2NT) + NT a
  token, O(N) for the others. With `gathered=False` (the sampler leaves its weights
  sharded over the batch axes) each layer's forward gathers that layer's weights,
  s(2 D NH + 2 D KH) + `_mlp_weight_bytes`, as a decode step does (`decode_step_bytes`;
  multi-head latent attention's projections, `_attention_weight_bytes`).
  A mixture layer's shared expert (width Fs on a device) adds a dense MLP's 5sFs (by
  analogy, not compiled), and experts in a latent (moe_latent_dim L) take L in D's place
  in their rows and add latent_in's output and latent_out's input, 2sL (by analogy); an
  MLP or a mixture alone (cfg.split_layers) holds its MLP's beside the block's 2sD;
  with leading dense layers (5sF, F their dense_ffn_dim) the fuller kind of layer
  counts, its weights with it. With expert parallelism
  (`expert_parallelism`: g devices' tokens gathered to each device's experts) the
  experts are never gathered, the router alone (`_mlp_weight_bytes`), and each of the
  other g - 1 devices' tokens adds kD(s + 12) + 3s kF: its k sorted rows, their
  float32 outputs sorted, back in token order and weighted, and gate, up and product.
  Over a v5p-64's fsdp 16 (g = 16, libtpu 0.0.42.1) the prefill compiled to 29.3 GiB
  beyond the weights and the cache for Qwen3-30B-A3B (k 8, D 2048; this counts 30.3)
  and 3.5 GiB for Llama 4 Scout (k 1, D 5120; this counts 6.7).
  Multi-head latent attention (kv
  heads = heads: its q, expanded k and padded v are NH + 2KH) adds its projections'
  outputs, what a dots policy saves (`layer_activation_bytes`): s(Rq + R + Hr + N(H -
  Hr) + NV), the latents, the rotated key part, the keys' unrotated part and the values
  before they are expanded and padded (by analogy, not compiled). An attention output
  gate (attn_output_gate) adds its projection, sNH (by analogy).
  A Gated DeltaNet layer (a "linear_attention" layer; Hk, Hv its key and value heads on a
  device, K = Hk Dk, V = Hv Dv, c = min(linear_chunk, prompt_len)) holds in place of
  attention's s(2D + NH + 2KH) + attention, by analogy with what its backward keeps
  (`linear_layer_activation_bytes`; not compiled for TPU):
    s(2D + 2K + 2V + 2Hv)   the block's input and output and the six projections
    + s(2K + V)             the convolutions' outputs
    + 4(2K + V + 2Hv)       the float32 q, k, v, g and beta the chunked scan reads
    + 4V                    its float32 output, normed and gated in place
    + per row (not per token) 4Hv(5c^2 + 2 Dk Dv)   one chunk's float32 [c, c] matrices
                            per value head (the decay, the system, its inverse and the
                            inverse's two running products) and the carried state and
                            its update
  and, weights left sharded, its own weights gathered (`_linear_weight_bytes`): the
  fuller kind of layer counts. With the weights gathered, the prefill of a model with
  such layers also holds a relaid copy of every linear layer's input projections (q,
  k, v, z, b and a: s D (2K + 2V + 2Hv) a layer, D whole), which XLA:TPU lays out with the
  heads major for the chunked scan and keeps, hoisted out of the loop over layers,
  for the whole call: compiled for Qwen3.5-27B on a v5p-64 (tensor 2), 3.77 GiB a chip
  (the decode programs keep none).
  A parallel_mixer layer (Falcon-H1: a Mamba2 mixer beside the attention) holds the
  attention's terms and the Mamba2's beside them, a linear layer's less its block's
  2sD, per row its chunk's matrices and state, and, weights left sharded, both mixers'
  weights; with the weights gathered every layer's Mamba2 input projections are relaid
  as a linear layer's (by analogy, not compiled).
  With the weights left sharded, a scanned model of Mamba2 layers beside attention
  layers holds relaid copies of whole weight stacks, sharded as stored
  (`_relaid_stack_bytes`).
  A short-convolution layer (LFM2's `ShortConv`, E its channels on a device) holds in
  place of attention's s(2D + NH + 2KH) + attention, by analogy with what its backward
  keeps without remat (`linear_layer_activation_bytes`; not compiled for TPU):
    s(2D + 6E)              the block's input and output, B, C and x, B * x, the
                            convolution's output and C times it
  no per-row term (no scan: its state is the window its cache holds), and, weights
  left sharded, its own weights gathered (`_linear_weight_bytes`). Nothing is relaid,
  gathered or not: no chunked scan lays out its projections (none seen, not compiled).
  Compiled for a v5e-8 (Llama 3 8B, 16 prompts of 1,024, weights left sharded), XLA's
  prefill needs 1.10 GiB beyond the weights and the cache; this counts 0.98 GiB of it
  (0.58 GiB before the gathered layer was counted)."""
  cfg = model_cfg
  b, t, heads, kv_heads, _, _ = _activation_shards(cfg, prompts, prompt_len, mesh, rules)
  s = np.dtype(cfg.dtype).itemsize
  nh, kh = heads * cfg.head_dim, kv_heads * cfg.head_dim
  attn = 4 * 2 * heads * prompt_len + heads * prompt_len if cfg.attention_impl == "reference" else 0
  # Multi-head latent attention: its projections' outputs beside the expanded k and v.
  attn += _latent_kept(cfg, "dots", heads)
  attn += s * nh if cfg.attn_output_gate else 0  # the gate's projection
  d, e, k = cfg.d_model, cfg.num_experts, cfg.num_experts_per_tok
  # A Gated DeltaNet layer's key and value heads on a device, their widths, its chunk.
  hk, hv = _linear_shards(cfg, prompts, prompt_len, mesh, rules)
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  c = max(1, min(cfg.linear_chunk, prompt_len))

  linear_mixer = (s * (2 * d + 4 * hk * dk + 3 * hv * dv + 2 * hv)
                  + 4 * (2 * hk * dk + 2 * hv * dv + 2 * hv))
  linear_row = 4 * hv * (5 * c * c + 2 * dk * dv)  # one chunk's matrices, the state
  short_conv = cfg.linear_mixer == "short_conv"
  if short_conv:  # the block's rows and six of E channels (hv); no scan, no chunk
    linear_mixer, linear_row = s * (2 * d + 6 * hv), 0

  x = _expert_width(cfg)  # the routed experts' rows: D, or their latent's
  latent = 2 * s * cfg.moe_latent_dim  # latent_in's output and latent_out's input

  def layer(linear: bool, mlp: int, shared: int = 0, dense: bool = False,
            local: int | None = None, routed: int = 1, part: str | None = None) -> int:
    ffn = (s * 5 * mlp if dense else
           s * (k * x + 5 * k * mlp) + 4 * (2 * k * x + 2 * e) + s * 5 * (shared or 0)
           + latent
           # the other devices' tokens gathered to this one's experts (`routed` - 1 more)
           + (routed - 1) * (k * x * (s + 12) + 3 * s * k * mlp))
    if part in ("mlp", "moe"):  # an MLP or a mixture alone (split_layers): block and MLP
      return (b * t * (s * 2 * d + ffn)
              + (0 if gathered else _mlp_weight_bytes(cfg, mlp, shared, dense, local)))
    if part == "mixer":
      ffn = 0
    if linear:
      mixer, per_row = linear_mixer, linear_row
      weights = _linear_weight_bytes(cfg, hk, hv)
    else:
      mixer, per_row = s * (2 * d + nh + 2 * kh) + attn, 0
      weights = _attention_weight_bytes(cfg, heads, kv_heads)
      if cfg.parallel_mixer:  # the Mamba2 beside it: a linear layer's, less the block's
        mixer += linear_mixer - s * 2 * d
        per_row = linear_row
        weights += _linear_weight_bytes(cfg, hk, hv)
    if part is None:
      weights += _mlp_weight_bytes(cfg, mlp, shared, dense, local)
    return b * t * (mixer + ffn) + b * per_row + (0 if gathered else weights)

  forward = max(layer(linear, **kw)
                for _, linear, kw in _layer_kinds(cfg, prompts, prompt_len, mesh, rules))
  # The linear layers' input projections, relaid for the prefill (gathered weights);
  # left sharded, a hybrid scan's whole stacks (`_relaid_stack_bytes`). A short
  # convolution has no chunked scan to relay them for.
  relaid = (0 if short_conv else
            s * cfg.d_model * (2 * hk * dk + 2 * hv * dv + 2 * hv) * _mixer_layers(cfg)
            if gathered else _relaid_stack_bytes(cfg, mesh, rules))
  kv_dtype = np.dtype("int8" if dtype == "int8" else (dtype or cfg.dtype))
  # One layer's k and v (a latent cache: its one array) of every row, scales aside.
  copied = sum(shard_bytes(shape, dt, NamedSharding(mesh, models.logical_to_spec(
      CACHE_AXES, rules, mesh, shape)))
               for shape, dt in _cache_arrays(cfg, rows, prompt_len, kv_dtype.name)
               if len(shape) == 4)
  prompt_cache = kv_cache_bytes(cfg, batch=prompts, max_len=prompt_len, mesh=mesh,
                                rules=rules, dtype=dtype)
  return int(prompt_cache + relaid + max(forward, copied))


def _relaid_stack_bytes(cfg: models.ModelConfig, mesh: AbstractMesh, rules) -> int:
  """Per-device bytes of the weight stacks a scanned model of Mamba2 and attention layers
  (linear_attention layers of linear_mixer "mamba2", `_scan_hybrid`) keeps relaid in its
  prefill with the weights left sharded: a copy of every Mamba2 layer's x, z and
  out_proj stacks ([L, D, Hv, Dv] and [L, Hv, Dv, D], their head dim minor), and with
  single-sublayer layers (cfg.split_layers) of every MLP layer's matrices, each sharded
  as stored, in the compute dtype. XLA:TPU lays them out for the layers it runs unrolled
  in the loop over periods and keeps them for the whole call. Read from its live-range
  reports of the fill (libtpu 0.0.42.1, v5e-8, fsdp 8): a Nemotron-H-8B-shaped model
  held its two MLP stacks (504 MiB each) and its 24 Mamba2 layers' x, z and out_proj
  (0.6 GiB), 1.6 GiB the plan missed; a Bamba-9B-shaped one three 232 MiB stacks of its
  29 Mamba2 layers. 0 for other models (LFM2's short convolutions among them: their
  prefill has no chunked scan to lay out for; not compiled)."""
  mamba = sum(cfg.linear_layers)
  if not (cfg.scan_layers and mamba and cfg.linear_mixer == "mamba2"):
    return 0
  d, hv, dv = cfg.d_model, cfg.linear_num_value_heads, cfg.linear_value_head_dim

  def stack(names, shape):
    spec = models.logical_to_spec(names, rules, mesh, shape)
    return shard_bytes(shape, np.dtype(cfg.dtype), NamedSharding(mesh, spec))

  heads = ("layers", "embed", "linear_heads", "head_dim")
  total = (2 * stack(heads, (mamba, d, hv, dv))
           + stack(("layers", "linear_heads", "head_dim", "embed"), (mamba, hv, dv, d)))
  mlps = sum(cfg.mlp_layers) if cfg.split_layers else 0
  if mlps:
    width = cfg.dense_ffn_dim if cfg.num_experts else cfg.ffn_dim
    total += ((_mlp_matrices(cfg) - 1) * stack(("layers", "embed", "mlp"), (mlps, d, width))
              + stack(("layers", "mlp", "embed"), (mlps, width, d)))
  return total


def _gathered_layer_bytes(cfg: models.ModelConfig, heads: int, kv_heads: int,
                          mlps: tuple[tuple[int, dict[str, Any]], ...],
                          linear_heads: tuple[int, int] = (0, 0)) -> int:
  """The largest layer's weights in the compute dtype, gathered over the batch axes
  (heads, kv heads and the MLP as the tensor axis leaves them on one device), of the
  kinds of layer `mlps` (`_layer_mlps`): its attention (`_attention_weight_bytes`), or a
  Gated DeltaNet, Mamba2 or short-convolution layer's mixer (`_linear_weight_bytes`,
  `linear_heads` its (key, value) heads on the device, a short convolution's (0,
  channels)) where the model has such layers and it is larger (LFM2's: 4D^2 a layer
  against its attention's 2D(NH + KH)), and a mixture layer's experts and shared
  expert, or a leading dense layer's MLP, whichever is larger (a linear layer's MLP is
  its attention layers' kind). With cfg.split_layers a layer
  is a mixer or an MLP: the larger of them. With cfg.parallel_mixer every layer holds
  its attention and its Mamba2 (`_linear_weight_bytes`) both."""
  mixer = _attention_weight_bytes(cfg, heads, kv_heads)
  if cfg.parallel_mixer:  # its Mamba2 beside the attention in every layer
    mixer += _linear_weight_bytes(cfg, *linear_heads)
  elif any(cfg.linear_layers):
    mixer = max(mixer, _linear_weight_bytes(cfg, *linear_heads))
  mlp = max(_mlp_weight_bytes(cfg, **kw) for _, kw in mlps)
  return max(mixer, mlp) if cfg.split_layers else mixer + mlp  # a sublayer a layer


def _linear_weight_bytes(cfg: models.ModelConfig, key_heads: int, value_heads: int) -> int:
  """One Gated DeltaNet layer's weights in the compute dtype, D whole, Hk / Hv the
  device's key / value heads, K = Hk Dk, V = Hv Dv, C = linear_conv_kernel (the norm's
  scale, A_log and dt_bias aside):

    s(D(2K + 2V + 2Hv)    q_proj, k_proj [D, Hk, Dk], v_proj, z_proj [D, Hv, Dv], b_proj,
                          a_proj [D, Hv]
      + (2K + V)C         the convolutions' taps
      + V D)              o_proj [Hv, Dv, D]

  A Mamba2 layer has no b_proj: s D Hv less (its convolution biases and D aside). A
  short-convolution layer (`ShortConv`, E = `value_heads` its channels on the device,
  d_model split over "linear_heads" as its arrays are):

    s(3DE       b_proj, c_proj, x_proj [D, E]
      + EC      the taps `conv` [E, C]
      + ED      o_proj [E, D]
      [+ 4E + D])   with linear_conv_bias: b_bias, c_bias, x_bias, conv_bias [E] and
                o_bias [D] (over "embed", whole once gathered)"""
  s, d = np.dtype(cfg.dtype).itemsize, cfg.d_model
  if cfg.linear_mixer == "short_conv":
    e = value_heads
    return s * (4 * d * e + e * cfg.linear_conv_kernel
                + (4 * e + d) * cfg.linear_conv_bias)
  k, v = key_heads * cfg.linear_key_head_dim, value_heads * cfg.linear_value_head_dim
  gates = 1 if cfg.linear_mixer == "mamba2" else 2
  return s * (d * (2 * k + 2 * v + gates * value_heads)
              + (2 * k + v) * cfg.linear_conv_kernel + v * d)


def _attention_weight_bytes(cfg: models.ModelConfig, heads: int, kv_heads: int) -> int:
  """One layer's attention projections in the compute dtype, D whole, `heads` /
  `kv_heads` the device's shard (norm scales and biases aside): s(2 D NH + 2 D KH), q, k,
  v and o, and s D NH more for an output gate's q_gate (attn_output_gate). Multi-head
  latent attention (Rq, R the latents' widths, whole on every device; Hr the rotated
  key part, V the values' width):

    s(D Rq + Rq NH       q_a_proj [D, Rq], q_b_proj [Rq, N, H]  (without Rq: D NH, q_proj)
      + D (R + Hr)       kv_a_proj [D, R], k_rope_proj [D, Hr]  (no heads: whole)
      + R N (H - Hr + V) k_b_proj [R, N, H - Hr], v_b_proj [R, N, V]
      + N V D)           o_proj [N, V, D]"""
  s, d, hd = np.dtype(cfg.dtype).itemsize, cfg.d_model, cfg.head_dim
  if not cfg.kv_lora_rank:
    return s * ((2 + cfg.attn_output_gate) * d * heads * hd + 2 * d * kv_heads * hd)
  rq, r, hr, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
  q = d * rq + rq * heads * hd if rq else d * heads * hd
  return s * (q + d * (r + hr) + r * heads * (hd - hr + v) + heads * v * d)


def _mlp_weight_bytes(cfg: models.ModelConfig, mlp: int, shared: int | None = None,
                      dense: bool = False, local: int | None = None, routed: int = 1) -> int:
  """One layer's MLP weights in the compute dtype, D whole and F the device's shard:
  s 3DF for a dense layer (`dense`, or a dense model; s 2DF without a gate, relu2), or
  for a mixture layer every expert and the router (`_expert_weight_bytes`;
  Qwen3-30B-A3B: 1.1 GiB, 32x its attention weights; with expert parallelism, `local` <
  E, the router alone: each device runs the experts it holds, never gathering them),
  its latent projections (moe_latent_dim L: latent_in and latent_out, s 2DL) and its
  shared expert of width Fs = `shared` on the device (default cfg.shared_expert_dim),
  s 3DFs (s 2DFs without a gate), and its gate, s D. (`routed`, the tokens' share, is
  `_mlp_kept`'s.)"""
  del routed
  s, d, mats = np.dtype(cfg.dtype).itemsize, cfg.d_model, _mlp_matrices(cfg)
  if dense or not cfg.num_experts:
    return s * mats * d * mlp
  experts = _expert_weight_bytes(cfg, mlp, gathered=(local or cfg.num_experts)
                                 == cfg.num_experts)
  experts += s * 2 * d * cfg.moe_latent_dim
  if not cfg.shared_expert_dim:
    return experts
  shared = cfg.shared_expert_dim if shared is None else shared
  return experts + s * (mats * d * shared + d * cfg.shared_expert_gate)


def _expert_weight_bytes(cfg: models.ModelConfig, mlp: int, gathered: bool = True) -> int:
  """A mixture layer's experts and router, what its `shard_map` is given: s 3EXF + rDE,
  X the experts' width (moe_latent_dim, else D) whole and F the device's shard (s 2EXF
  without a gate, relu2), r = s, or 4 for a sigmoid router (run in float32); the
  router's rDE alone when the experts are not `gathered` (expert parallelism)."""
  s, e, d = np.dtype(cfg.dtype).itemsize, cfg.num_experts, cfg.d_model
  r = 4 if cfg.router_scoring == "sigmoid" else s
  return (s * _mlp_matrices(cfg) * _expert_width(cfg) * mlp * e if gathered else 0) + r * d * e


def decode_step_bytes(model_cfg: models.ModelConfig, *, rows: int, mesh: AbstractMesh,
                      rules=models.DEFAULT_RULES, gathered: bool = True) -> int:
  """Per-device bytes one decode step holds beyond the weights and the cache: the float32
  logits [rows, V] (V over the tensor axis; every row's, over a slice of D, when the
  weights are left sharded;
  see `Sampler._logits`) and, with weights left sharded over the batch axes
  (`gathered=False`), one layer's weights gathered in the compute dtype:
  s(2 D NH + 2 D KH + 3 D F), NH, KH and F over the tensor axis (multi-head latent
  attention: its projections, `_attention_weight_bytes`, in place of 2 D NH + 2 D KH;
  a Gated DeltaNet, Mamba2 or short-convolution layer's, `_linear_weight_bytes`, where
  larger, or with parallel_mixer beside the attention's; a mixture: all E experts and
  the router and a shared expert, `_mlp_weight_bytes`, whatever the routing; with
  leading dense layers, the larger kind of layer). XLA:TPU
  needed 0.54 GiB for a Llama 3 8B layer (0.41 GiB) and 128 rows' logits (0.06 GiB) on
  a v5e-8."""
  cfg = model_cfg
  _, _, heads, kv_heads, _, vocab = _activation_shards(cfg, rows, 1, mesh, rules)
  if gathered:
    return int(_logical_shard(mesh, rules, ("batch",), (rows,))[0] * vocab * 4)
  mlps = _layer_mlps(cfg, rows, 1, mesh, rules)
  return int(rows * vocab * 4 + _gathered_layer_bytes(
      cfg, heads, kv_heads, mlps, _linear_shards(cfg, rows, 1, mesh, rules)))


def batch_mesh_size(mesh: AbstractMesh, rules=models.DEFAULT_RULES) -> int:
  """Devices the logical batch axis spreads over (the data x fsdp axes by default)."""
  spec = models.logical_to_spec(("batch",), rules, mesh)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return math.prod(mesh.shape[a] for a in axes)


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def sampler_batch(config: ml_collections.ConfigDict, group_size: int, batch_shards: int) -> int:
  """Rows of one generate call: a chunk of prompts x group_size, padded to its bucket."""
  r = config.rollout
  rows = min(int(r.chunk_rows), int(r.prompts_per_step) * group_size)
  return -(-_next_pow2(rows) // batch_shards) * batch_shards


def continuous_rollout(config: ml_collections.ConfigDict, group_size: int,
                       batch_shards: int) -> bool:
  """Whether the rollout worker streams the step's rows through the sampler's
  `sampler_batch` cache rows (continuous batching: no partial rollouts across steps,
  more rows than the cache holds, or multi-turn rows that fit it without pausing every
  placement.segment_tokens) rather than generating them in chunks."""
  r = config.rollout
  placement = config.get("placement") or {}
  fit = (int(r.prompts_per_step) * group_size
         <= sampler_batch(config, group_size, batch_shards))
  turns = int(r.get("max_turns", 1)) > 1 and not int(placement.get("segment_tokens", 0) or 0)
  return (bool(r.get("continuous_batching", True))
          and not int(placement.get("step_tokens", 0) or 0) and (not fit or turns))


def microbatches(config: ml_collections.ConfigDict, algo) -> tuple[int, int]:
  """(micro-batches one optimizer step scans over, micro-batches of the rollout batch)
  for a worst-case rollout: every sequence rollout.max_len long (as the trainer packs)."""
  r, t = config.rollout, config.train
  row_len, max_len = int(t.row_len), int(r.max_len)
  sequences = int(r.prompts_per_step) * int(algo.group_size)
  rows = -(-sequences // max(1, row_len // max_len))
  micro = _next_pow2(max(1, -(-rows // int(t.rows_per_microbatch))))
  minibatches = int(algo.num_minibatches)
  micro = -(-micro // minibatches) * minibatches
  return micro // minibatches, micro


# ----------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------


def plan(config: ml_collections.ConfigDict, *, device_memory_gb: float | None = None,
         num_devices: int | None = None, kv_cache_dtype: str | None = None,
         advise: bool = True) -> Plan:
  """Bytes per device of every component of `config`'s run.

  Args:
    config: a run config (configs/*.py get_config()).
    device_memory_gb: memory of one device in GiB (v5p 95, v5e 16, H100 ~79); None: no
      verdict.
    num_devices: devices in the run (see `mesh_shapes` for the default).
    kv_cache_dtype: "int8" for a quantized sampler cache; default the model's dtype.
    advise: work out the knobs that make it fit.

  Raises:
    ValueError: a mesh that does not fit the device count, or an inconsistent config.
  """
  if device_memory_gb is not None and not device_memory_gb > 0:
    raise ValueError(f"device_memory_gb={device_memory_gb} must be > 0")
  if kv_cache_dtype not in (None, *_KV_DTYPES):
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; expected one of {_KV_DTYPES}")
  experiment.check_config(config)
  if experiment.objective(config) == "reward_model":
    return _plan_reward_model(config, device_memory_gb=device_memory_gb,
                              num_devices=num_devices, advise=advise)
  shape, rollout_shape = mesh_shapes(config, num_devices)
  placement = "colocated" if shape is rollout_shape else "disaggregated"
  mesh, rollout_mesh = abstract_mesh(shape), abstract_mesh(rollout_shape)
  rules = models.rules_from_config(config.get("sharding_rules") or None)
  cfg = experiment.model_config(config)
  algo = experiment.algorithm(config)
  t, r = config.train, config.rollout
  rows, row_len = int(t.rows_per_microbatch), int(t.row_len)
  batch_shards = batch_mesh_size(mesh, rules)
  if rows % batch_shards:
    raise ValueError(f"train.rows_per_microbatch={rows} must be a multiple of the batch "
                     f"mesh axes' size {batch_shards}")

  params, opt = state_bytes(cfg, shape, rules, clip=bool(config.optim.get("clip")))
  # A frozen copy for RL's KL term, or for a preference stage (DPO) before RL: the same
  # params + optimizer + reference + update on the train devices.
  stage_ref, rl_ref = experiment.frozen_references(config, algo)
  pref_ref = stage_ref or (rl_ref and float(algo.kl_coef) == 0)
  reference = params if (stage_ref or rl_ref) and not cfg.lora_rank else 0
  per_update, micro = microbatches(config, algo)
  trained = trainable_bytes(cfg, shape, rules) if cfg.lora_rank else params
  grads = trained * (2 if per_update > 1 else 1)
  # Accumulating micro-batches, XLA:TPU keeps the experts' gradient once more (measured
  # for Qwen3-30B-A3B: 3.37 GiB a chip in float32, 1.69 in bfloat16; none with one).
  expert_grads = expert_bytes(cfg, mesh, rules) if per_update > 1 and not cfg.lora_rank else 0
  grads += expert_grads
  acts, act_note = activation_bytes(cfg, rows=rows, row_len=row_len, mesh=mesh, rules=rules)
  head = head_bytes(cfg, mesh=mesh, rules=rules, rows=rows, row_len=row_len)
  b, length = _logical_shard(mesh, rules, ("batch", "length"), (rows, row_len))
  batch = micro * b * length * 4 * 10  # ~10 int32 / float32 arrays per token
  replay = algo.get("routing_replay", "none")
  replay = None if replay == "none" else replay
  if replay:  # each token's experts in every mixture layer
    batch += (micro * b * length * cfg.mixture_layers * cfg.num_experts_per_tok
              * np.dtype(rl_train_step.routing_dtype(cfg)).itemsize)
  # The Sampler copies the weights it is given (never an alias), colocated or not, but
  # a colocated LoRA learner's frozen base, which it holds as it is (the train step never
  # donates it: `Trainer._shared_base`): then its own are the adapters (and heads).
  sampler = trained if placement == "colocated" else state_bytes(cfg, rollout_shape, rules)[0]
  rollout_shards = batch_mesh_size(rollout_mesh, rules)
  s_rows = sampler_batch(config, int(algo.group_size), rollout_shards)
  cache_dtype = kv_cache_dtype or r.get("cache_dtype", None)
  kv = kv_cache_bytes(cfg, batch=s_rows, max_len=int(r.max_len), mesh=rollout_mesh,
                      rules=rules, dtype=cache_dtype)
  if replay == "rollout":
    # The experts each row's tokens took, by position, beside the cache: rows over
    # the batch axes (`Sampler(record_routing=True)`).
    kv += (-(-s_rows // rollout_shards) * int(r.max_len) * cfg.mixture_layers
           * cfg.num_experts_per_tok * np.dtype(rl_train_step.routing_dtype(cfg)).itemsize)
  kv_dtype = np.dtype("int8" if cache_dtype == "int8" else (cache_dtype or cfg.dtype))
  size = np.dtype(cfg.param_dtype).itemsize
  gathered = decode_weight_bytes(cfg, rollout_shape, rules) if r.get("gather_weights", True) else 0
  # The Sampler reads its own weights when it gathers nothing: left sharded if they are.
  sharded = rollout_shards > 1 and not gathered
  # One prefill per group, its rows padded as the Sampler pads them.
  prompts = _next_pow2(-(-s_rows // int(algo.group_size)))
  prompts = -(-prompts // rollout_shards) * rollout_shards
  new = int(r.max_new_tokens)
  prompt_len = default_length_bucket(int(r.max_len) - new, int(r.max_len))
  prefill = prefill_bytes(cfg, prompts=prompts, prompt_len=prompt_len, rows=s_rows,
                          mesh=rollout_mesh, rules=rules, dtype=cache_dtype,
                          gathered=not sharded)
  prefill_note = (f"{prompts} prompts' cache of {prompt_len} and one layer's forward over "
                  "them")
  if continuous_rollout(config, int(algo.group_size), rollout_shards):
    # A refill prefills its rows beside the full cache of the slots; at worst (groups
    # split across devices, or finishing apart) every row is a prompt of its own. Later
    # turns come back as transcripts of up to max_len - 1 tokens; one that goes on in
    # its slot holds a copy of as many rows' cache, and a shorter forward.
    refill = refill_rows(s_rows, rollout_shards)
    refill_len = (default_length_bucket(int(r.max_len) - 1, int(r.max_len))
                  if int(r.get("max_turns", 1)) > 1 else prompt_len)
    refill_bytes = prefill_bytes(cfg, prompts=refill, prompt_len=refill_len, rows=refill,
                                 mesh=rollout_mesh, rules=rules, dtype=cache_dtype,
                                 gathered=not sharded)
    if refill_bytes > prefill:
      prefill = refill_bytes
      prefill_note = (f"a refill of {refill} slots (continuous batching): their prompts' "
                      f"cache of {refill_len} and one layer's forward over them")
  if cfg.linear_mixers and not sharded and cfg.linear_mixer != "short_conv":
    prefill_note += (", the Mamba2 mixers' input projections relaid" if cfg.parallel_mixer
                     else ", the linear layers' input projections relaid")
  elif _relaid_stack_bytes(cfg, rollout_mesh, rules):
    prefill_note += (", relaid whole: the Mamba2 layers' x, z and out_proj stacks"
                     + (" and the MLP layers' matrices" if any(cfg.mlp_layers) else ""))
  step = decode_step_bytes(cfg, rows=s_rows, mesh=rollout_mesh, rules=rules,
                           gathered=not sharded)
  rm_bytes, rm_note = reward_model_bytes(config, rollout_shape, rules)
  teacher, teacher_note = teacher_bytes(config, shape, rules)
  divergence, divergence_note = divergence_bytes(config, shape, rules)
  comps = [
      Component("params", params, (
          f"{_count(cfg.num_params)}: the layers' projections as {cfg.base_quantization} "
          f"codes with a bfloat16 scale per {cfg.base_quantization_block} (QLoRA), the rest "
          f"x {size} bytes" if cfg.base_quantization else
          f"{_count(cfg.num_params)} x {size} bytes") + ", sharded by the rules"
                + (f", + {_count(cfg.num_lora_params)} in LoRA adapters of rank "
                   f"{cfg.lora_rank}" if cfg.lora_rank else "")),
      Component("optimizer", opt, "AdamW mu + nu (param dtype) + counters"
                + (" of the LoRA adapters" if cfg.lora_rank else "")),
      Component("reference", reference,
                (f"frozen params copy (kl_coef={float(algo.kl_coef):g})"
                 if float(algo.kl_coef) > 0 else "frozen params copy (preference loss)")
                if reference else "none: the base weights, adapters off (LoRA)"
                if cfg.lora_rank and (float(algo.kl_coef) > 0 or pref_ref)
                else "none (kl_coef=0)"),
      Component("teacher", teacher, teacher_note),
      Component("gradients", grads, f"{'2' if per_update > 1 else '1'} x "
                f"{'the LoRA adapters' if cfg.lora_rank else 'params'} "
                + ("+ 1 x the experts " if expert_grads else "")
                + f"({per_update} micro-batch{'es' if per_update > 1 else ''} per update)"),
      Component("activations", acts, act_note),
      Component("head", head, _head_note(cfg, mesh, rules, rows, row_len) if head else
                "none: the head reads its own shard of the projection"),
      Component("divergence", divergence, divergence_note),
      Component("batch", batch, f"{micro} x {rows} x {row_len} tokens x ~10 arrays x 4 B"
                + (f" + each token's experts ({cfg.mixture_layers} layers x "
                   f"{cfg.num_experts_per_tok}, "
                   f"{np.dtype(rl_train_step.routing_dtype(cfg))}: routing replay)"
                   if replay else "")),
      Component("sampler", sampler, ("its own copy of the adapters; the frozen base "
                                     "shared with the learner (colocated)"
                                     if cfg.lora_rank else "its own copy of params (colocated)")
                if placement == "colocated"
                else f"its own weights on the rollout mesh {rollout_shape}"),
      Component("gathered", gathered,
                "the sampler's weights gathered over the batch axes for a generate call, "
                f"{np.dtype(cfg.dtype)}"
                + (", the experts padded to 128 columns a device (`expert_padding_bytes`)"
                   if gathered and expert_padding_bytes(cfg, _gather_shape(rollout_shape,
                                                                           rules), rules)
                   else "") if gathered else "not gathered (gather_weights=False)"),
      Component("kv_cache", kv, f"{s_rows} rows x {_cache_layers_note(cfg, int(r.max_len))} "
                f"x {_cache_note(cfg, kv_dtype)}, {kv_dtype}"
                + (" + the experts each position took ("
                   f"{np.dtype(rl_train_step.routing_dtype(cfg))}, the sampler's routing "
                   "record)" if replay == "rollout" else "")),
      Component("prefill", prefill, prefill_note + (", its weights gathered (left sharded)"
                                                     if sharded else "")),
      Component("decode_step", step, "the logits" + (", one layer's weights gathered "
                                                    "(left sharded)" if sharded else "")),
      Component("reward_model", rm_bytes, rm_note),
  ]
  static = (params + opt + reference + teacher
            + (sampler + rm_bytes if placement == "colocated" else 0))
  # The head's gathered projection (and a distillation divergence's arrays beside it) are
  # live while no layer is differentiated.
  b_tok, t_tok, _, _, _, vocab = _activation_shards(cfg, rows, row_len, mesh, rules)
  head_phase = (saved_activation_bytes(cfg, rows=rows, row_len=row_len, mesh=mesh, rules=rules)
                + _logit_chunk_bytes(cfg, b_tok, t_tok, vocab) + head + divergence)
  train_peak = static + grads + max(acts, head_phase) + batch
  rollout_peak = ((static if placement == "colocated" else sampler + rm_bytes) + gathered
                  + kv + max(prefill, step))
  capacity = None if device_memory_gb is None else int(device_memory_gb * GIB * USABLE_FRACTION)
  result = Plan(shape, rollout_shape, placement, {c.name: c for c in comps}, train_peak,
                rollout_peak, capacity)
  if advise and capacity is not None:
    total = math.prod(shape.values()) + (
        0 if placement == "colocated" else math.prod(rollout_shape.values()))
    result = dataclasses.replace(result, advice=tuple(_advice(
        config, result, device_memory_gb=device_memory_gb, num_devices=total,
        kv_cache_dtype=cache_dtype)))
  return result


def _plan_reward_model(config: ml_collections.ConfigDict, *, device_memory_gb: float | None,
                       num_devices: int | None, advise: bool) -> Plan:
  """The plan of an objective=reward_model run: the update alone (no sampler, no
  reference) of the score-head model on the train mesh. Each micro-batch holds pairs'
  two sequences packed into `train.rows_per_microbatch` rows; with more sequences a step
  (2 x rm.batch_size) than rows, the update accumulates micro-batches (two gradients)."""
  shape, _ = mesh_shapes(config, num_devices)
  mesh = abstract_mesh(shape)
  rules = models.rules_from_config(config.get("sharding_rules") or None)
  cfg = experiment.reward_model_config(config)
  rows, row_len = int(config.train.rows_per_microbatch), int(config.train.row_len)
  batch_shards = batch_mesh_size(mesh, rules)
  if rows % batch_shards:
    raise ValueError(f"train.rows_per_microbatch={rows} must be a multiple of the batch "
                     f"mesh axes' size {batch_shards}")
  params, opt = state_bytes(cfg, shape, rules, clip=bool(config.optim.get("clip")))
  accumulate = 2 * int(config.rm.batch_size) > rows
  trained = trainable_bytes(cfg, shape, rules) if cfg.lora_rank else params
  grads = trained * (2 if accumulate else 1)
  acts, act_note = activation_bytes(cfg, rows=rows, row_len=row_len, mesh=mesh, rules=rules)
  b, length = _logical_shard(mesh, rules, ("batch", "length"), (rows, row_len))
  micro = _next_pow2(-(-2 * int(config.rm.batch_size) // rows))
  batch = micro * b * length * 4 * 8  # ~8 int32 / float32 arrays per token
  size = np.dtype(cfg.param_dtype).itemsize
  none = "none: a reward model samples nothing"
  comps = [
      Component("params", params, f"{_count(cfg.num_params)} x {size} bytes, sharded by "
                "the rules (a score head, no vocabulary projection)"
                + (f", + {_count(cfg.num_lora_params)} in LoRA adapters of rank "
                   f"{cfg.lora_rank}" if cfg.lora_rank else "")),
      Component("optimizer", opt, "AdamW mu + nu (param dtype) + counters"
                + (" of the LoRA adapters and the score head" if cfg.lora_rank else "")),
      Component("gradients", grads, f"{'2' if accumulate else '1'} x "
                f"{'the LoRA adapters and the score head' if cfg.lora_rank else 'params'} "
                f"({2 * int(config.rm.batch_size)} sequences a step in rows of "
                f"{rows})"),
      Component("activations", acts, act_note),
      Component("batch", batch, f"{micro} x {rows} x {row_len} tokens x ~8 arrays x 4 B"),
      *(Component(name, 0, none) for name in ("sampler", "kv_cache", "reward_model")),
  ]
  train_peak = params + opt + grads + acts + batch
  capacity = None if device_memory_gb is None else int(device_memory_gb * GIB * USABLE_FRACTION)
  result = Plan(shape, shape, "reward_model", {c.name: c for c in comps}, train_peak, 0,
                capacity)
  if advise and capacity is not None:
    result = dataclasses.replace(result, advice=tuple(_advice(
        config, result, device_memory_gb=device_memory_gb,
        num_devices=math.prod(shape.values()), kv_cache_dtype=None)))
  return result


def reward_model_bytes(config: ml_collections.ConfigDict, rollout_shape: dict[str, int],
                       rules=models.DEFAULT_RULES) -> tuple[int, str]:
  """(bytes per rollout device, how counted) of the parameters of the run's reward model
  (reward_model.path), from its config.json alone; 0 without one, or when the folder is
  not readable here (planning a run whose files live elsewhere)."""
  rm = config.get("reward_model")
  path = str(rm.get("path", "") or "") if rm is not None else ""
  if not path:
    return 0, "none (reward_model.path unset)"
  try:
    cfg = reward_model_lib.reward_model_config(path)
  except ValueError as e:
    return 0, f"not counted: {e}"
  return (state_bytes(cfg, rollout_shape, rules)[0],
          f"{_count(cfg.num_params)} x {np.dtype(cfg.param_dtype).itemsize} bytes on the "
          f"rollout mesh {rollout_shape}, sharded by the rules")


def teacher_bytes(config: ml_collections.ConfigDict, shape: dict[str, int],
                  rules=models.DEFAULT_RULES) -> tuple[int, str]:
  """(bytes per train device, how counted) of the parameters of the run's distillation
  teacher (distill.teacher), from its config.json alone, and, when the update reads it
  (distill.loss reverse_kl / forward_kl), its final hidden states of one micro-batch; 0
  without one, or when the folder is not readable here (planning a run whose files live
  elsewhere), or when it joins SFT alone (distill.stages=sft: freed before RL)."""
  if not experiment.distill_teacher(config):
    return 0, "none (distill.teacher unset)"
  if "rl" not in experiment.distill_stages(config):
    return 0, "none in RL (distill.stages=sft: the teacher is freed when SFT ends)"
  try:
    cfg = experiment.teacher_config(config)
  except ValueError as e:
    return 0, f"not counted: {e}"
  size = np.dtype(cfg.param_dtype).itemsize
  n = state_bytes(cfg, shape, rules)[0]
  note = (f"{_count(cfg.num_params)} x {size} bytes on the train mesh {shape}, sharded by "
          "the rules (frozen, no optimizer)")
  if str(config.distill.get("loss", "sampled")) != "sampled":
    rows, row_len = int(config.train.rows_per_microbatch), int(config.train.row_len)
    b, t, e = _logical_shard(abstract_mesh(shape), rules, ("batch", "length", "embed"),
                             (rows, row_len, cfg.d_model))
    n += b * t * e * size
    note += f", + its hidden states of a micro-batch in the update ({rows} x {row_len} x " \
            f"{cfg.d_model})"
  return n, note


def divergence_bytes(config: ml_collections.ConfigDict, shape: dict[str, int],
                     rules=models.DEFAULT_RULES) -> tuple[int, str]:
  """(bytes per train device, how counted) the RL update's divergence to the
  distillation teacher holds beside the log-prob head (`divergence_head_bytes`), when
  the update computes it (distill.loss reverse_kl / forward_kl / jsd, the teacher in
  RL); 0 otherwise, or when the teacher's folder is not readable here."""
  if not experiment.distill_teacher(config):
    return 0, "none (distill.teacher unset)"
  if "rl" not in experiment.distill_stages(config):
    return 0, "none in RL (distill.stages=sft)"
  loss = str(config.distill.get("loss", "sampled"))
  if loss == "sampled":
    return 0, "none (distill.loss=sampled: the teacher's log-probs, outside the update)"
  try:
    teacher_cfg = experiment.teacher_config(config)
  except ValueError as e:
    return 0, f"not counted: {e}"
  cfg = experiment.model_config(config)
  rows, row_len = int(config.train.rows_per_microbatch), int(config.train.row_len)
  parts = _divergence_parts(cfg, teacher_cfg, abstract_mesh(shape), rules, rows, row_len)
  return sum(parts.values()), (f"distill.loss={loss}, beside the head: "
                               + ", ".join(reversed(parts)))


def resident_outside_programs(p: Plan, config: ml_collections.ConfigDict
                              ) -> tuple[tuple[int, str], tuple[int, str]]:
  """Bytes a device holds outside the compiled update and outside the compiled sampling
  programs (what `launch.plan --compile_for` adds to XLA's figures), with what they are:
  colocated, the sampler's copy of the weights during the update, and the learner's
  state (params, optimizer, reference) and that copy while sampling. A sampler that
  gathers its weights (rollout.gather_weights) reads the gathered copy, so its own copy
  lies outside its programs; one that does not takes its own copy as an argument, inside
  XLA's figures (counted twice before: compiled / planned 1.43 for an 8B LoRA run on a
  v5e-8, of which 1.91 GiB was that copy). The KL reference is an argument of the update
  only when the update computes its log-probs (`train_step.reference_in_step`: one
  update per batch); otherwise it waits on the train devices beside the update (left
  out before: 3.56 GiB a chip for Qwen3-30B-A3B on a v5p-64). A colocated LoRA sampler
  holds the learner's frozen base itself (its own copy is the adapters): a sampling
  program that takes the sampler's weights takes that base too, so the learner's share
  outside it is less the base."""
  gather = bool(config.rollout.get("gather_weights", True)) and p["gathered"] > 0
  in_step = rl_train_step.reference_in_step(experiment.algorithm(config))
  reference = 0 if in_step else p["reference"]
  rm_bytes = p.components["reward_model"].bytes if "reward_model" in p.components else 0
  # A distillation teacher's weights wait on the train devices outside every program but
  # its own log-prob pass.
  teacher = p.components["teacher"].bytes if "teacher" in p.components else 0
  and_teacher = " and the distillation teacher" if teacher else ""

  def plus_rm(resident: tuple[int, str]) -> tuple[int, str]:
    """`resident` and the reward model, which no program holds but its own scoring."""
    n, what = resident
    if not rm_bytes:
      return resident
    return n + rm_bytes, f"{what} and the reward model" if what else "the reward model"

  if p.placement == "colocated":
    train = (p["sampler"] + reference + teacher, "the sampler's copy of the weights"
             + (" and the KL reference" if reference else "") + and_teacher)
    learner = p["params"] + p["optimizer"] + p["reference"] + teacher
    if not gather:  # the sampling programs take the sampler's own weights as arguments
      # (a LoRA sampler's: the learner's base, shared, and its own adapters)
      base = p["params"] - p["sampler"] if experiment.model_config(config).lora_rank else 0
      return plus_rm(train), plus_rm((learner - base, "the learner's params, optimizer and "
                                      "reference" + and_teacher
                                      + (" (less the base the sampler shares)" if base
                                         else "")))
    return plus_rm(train), plus_rm((learner + p["sampler"], "the learner's params, optimizer "
                                    "and reference" + and_teacher + ", and the sampler's "
                                    "copy of the weights"))
  if reference or teacher:
    train = (reference + teacher, ("the KL reference" + and_teacher) if reference
             else "the distillation teacher")
  else:
    train = (0, "")
  return train, plus_rm((p["sampler"], "the sampler's own weights") if gather else (0, ""))


def override(config: ml_collections.ConfigDict, changes: dict[str, Any]
             ) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted keys replaced, e.g. {"train.row_len": 4096}."""
  c = ml_collections.ConfigDict(config.to_dict())
  for key, value in changes.items():
    node = c
    *path, leaf = key.split(".")
    for p in path:
      node = node[p]
    node[leaf] = value
  return c


def _expert_parallel_rules(config, mesh_shape: dict[str, int]) -> tuple | None:
  """The config's sharding rules with a mixture's experts split over fsdp, where they
  are not split yet and fsdp divides them; else None."""
  rules = tuple(tuple(r) for r in (config.get("sharding_rules") or ()))
  if any(name == "experts" for name, _ in rules):
    return None
  cfg = experiment.model_config(config)
  fsdp = mesh_shape.get("fsdp", 1)
  if not cfg.num_experts or fsdp < 2 or cfg.num_experts % fsdp:
    return None
  return rules + (("experts", ("fsdp",)),)


def _advice(config, current: Plan, *, device_memory_gb: float, num_devices: int,
            kv_cache_dtype: str | None) -> list[str]:
  """The verdict, then one line per knob that alone makes the run fit, with its peak."""
  cap = current.capacity
  usable = f"{human_bytes(cap)} usable ({USABLE_FRACTION:.0%} of {device_memory_gb:g} GiB)"
  if current.fits:
    return [f"fits: peak {human_bytes(current.peak)} of {usable}"]
  out = [f"does not fit: peak {human_bytes(current.peak)} > {usable}"]

  def fitting(changes: dict[str, Any], kv: str | None = kv_cache_dtype) -> Plan | None:
    try:
      p = plan(override(config, changes), device_memory_gb=device_memory_gb,
               num_devices=num_devices, kv_cache_dtype=kv, advise=False)
    except ValueError:
      return None
    return p if p.fits else None

  def suggest(flags: str, p: Plan, why: str = ""):
    out.append(f"{flags}{why}: peak {human_bytes(p.peak)}")

  if current.train_peak > cap:
    remat = experiment.model_config(config).remat
    for policy in _REMAT_ORDER[_REMAT_ORDER.index(remat) + 1:]:
      if p := fitting({"model.overrides.remat": policy}):
        suggest(f"--config.model.overrides.remat={policy}", p)
        break
    rows = int(config.train.rows_per_microbatch) // 2
    while rows >= 1:
      if p := fitting({"train.rows_per_microbatch": rows}):
        suggest(f"--config.train.rows_per_microbatch={rows}", p,
                " (more micro-batches, the same update)")
        break
      rows //= 2
    shape = current.mesh
    if shape["data"] > 1:
      fsdp = shape["fsdp"] * shape["data"]
      if p := fitting({"mesh.data": 1, "mesh.fsdp": fsdp}):
        suggest(f"--config.mesh.data=1 --config.mesh.fsdp={fsdp}", p,
                " (shard params and optimizer state over the data axis too)")
  if current.rollout_peak > cap:
    chunk = int(config.rollout.chunk_rows) // 2
    while chunk >= 1:
      if p := fitting({"rollout.chunk_rows": chunk}):
        suggest(f"--config.rollout.chunk_rows={chunk}", p, " (smaller generate calls)")
        break
      chunk //= 2
    if kv_cache_dtype != "int8" and (p := fitting({}, kv="int8")):
      suggest("--kv_cache_dtype=int8", p, " (an int8 KV cache: Sampler(cache_dtype='int8'))")
  if (rules := _expert_parallel_rules(config, current.mesh)) and (
      p := fitting({"sharding_rules": rules})):
    flag = repr(rules).replace("'", '"')
    suggest(f"--config.sharding_rules='{flag}'", p, f" (expert parallelism: "
            f"{current.mesh['fsdp']}-way, the experts never gathered)")
  static = current["params"] + current["optimizer"] + current["reference"]
  if static > cap:
    devices = num_devices * static / cap
    out.append(f"params + optimizer{' + reference' if current['reference'] else ''} alone "
               f"need {human_bytes(static)} per device: use at least {_next_pow2(math.ceil(devices))} "
               "devices (a wider fsdp axis), or a smaller model")
  if len(out) == 1:
    out.append("no single knob fits it: combine them (remat, rows_per_microbatch, "
               "chunk_rows) or use more devices")
  return out


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def human_bytes(n: float) -> str:
  for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


def format_plan(p: Plan) -> str:
  """A table: component, bytes per device, how it was counted; then peaks and verdict."""
  devices = math.prod(p.mesh.values())
  lines = [f"placement: {p.placement}; train mesh {p.mesh} ({devices} devices)"]
  if p.placement != "colocated":
    lines[0] += f"; rollout mesh {p.rollout_mesh} ({math.prod(p.rollout_mesh.values())})"
  lines.append(f"{'component':<12}{'per device':>12}  formula")
  for c in p.components.values():
    lines.append(f"{c.name:<12}{human_bytes(c.bytes):>12}  {c.formula}")
  if p.placement == "reward_model":
    lines[0] = f"reward model training; train mesh {p.mesh} ({devices} devices)"
    lines.append(f"{'peak':<12}{human_bytes(p.peak):>12}  params + optimizer + gradients + "
                 "activations + batch")
  elif p.placement == "colocated":
    lines.append(f"{'peak':<12}{human_bytes(p.peak):>12}  params + optimizer + reference + "
                 "teacher + sampler + reward_model + max(gradients + max(activations, head phase) "
                 "+ batch, gathered + kv_cache + max(prefill, decode_step))")
  else:
    lines.append(f"{'train peak':<12}{human_bytes(p.train_peak):>12}  params + optimizer + "
                 "reference + teacher + gradients + max(activations, head phase) + batch")
    lines.append(f"{'rollout peak':<12}{human_bytes(p.rollout_peak):>12}  sampler + "
                 "reward_model + gathered + kv_cache + max(prefill, decode_step)")
  lines += list(p.advice)
  return "\n".join(lines)
