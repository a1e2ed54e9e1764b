"""Learner state: TrainState, its shardings, AdamW with warmup + cosine, frozen copies.

    optimizer = make_optimizer(1e-6, warmup=10, total_steps=1000, weight_decay=0.01, clip=1.0)
    state = init_train_state(model, optimizer, mesh=mesh)   # a sharded copy of the model
    reference = frozen_copy(state.params)                   # the frozen reference policy

The train step (`posttrain.rl.train_step`) donates the state; everything built here is a
copy, so neither the caller's model nor the reference is ever freed or updated by it.

A model with LoRA adapters (`ModelConfig.lora_rank`) trains only them: `split_trainable`
separates the adapters from the frozen base weights, the optimizer's state covers the
adapters alone, and the KL reference is the base (`models.without_lora(state.params)`),
not a copy.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posttrain import models
from posttrain.models.sharding import DEFAULT_RULES, Rules


@struct.dataclass
class TrainState:
  """What the learner updates. The reference policy is kept outside (`frozen_copy`).

  Attributes:
    params: the policy's `nnx.Param` state (value head included when the model has one;
      with LoRA, the adapters and the frozen base weights).
    opt_state: the optax state of the trainable params (`split_trainable(params)[0]`).
    step: int32 count of applied updates (a skipped non-finite update does not count).
    rng: PRNG key; fold it with `step` for any randomness inside a step.
    critic_params / critic_opt_state: a separate value model and its optimizer state
      (PPO with `critic_cfg`); None when the critic is the policy's value head or absent.
  """

  params: Any
  opt_state: Any
  step: jax.Array
  rng: jax.Array
  critic_params: Any = None
  critic_opt_state: Any = None


# ---------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------


# The model's layer stacks (`posttrain.models.transformer.layer_stacks`).
_LAYER_STACKS = ("layers", "dense_layers", "linear_layers", "mlp_layers", "moe_layers",
                 "global_layers", "shared_layers", "shared_global_layers",
                 "linear_dense_layers")


def _decay_mask(params):
  """Matrices decay; norm scales, biases and vectors do not (the usual AdamW recipe).

  By each parameter's own rank: a stacked layer axis (scan_layers: a path through one of
  the layer stacks, "layers", "dense_layers", "linear_layers", "mlp_layers" or
  "moe_layers", with no layer index) does not count, and biases ([heads, head_dim]) and
  a linear-attention layer's norm scale ([heads, head_dim] in Mamba2) are named.
  """
  def decays(path, x):
    keys = [getattr(p, "key", getattr(p, "name", getattr(p, "idx", None))) for p in path]
    keys = [k for k in keys if k != "value"]
    stacked = bool(keys) and keys[0] in _LAYER_STACKS and not (
        len(keys) > 1 and isinstance(keys[1], int))
    name = str(keys[-1]) if keys else ""
    return x.ndim - int(stacked) >= 2 and not name.endswith("bias") and name != "norm"

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(lr: float, warmup: int, total_steps: int, weight_decay: float = 0.0,
                   clip: float | None = 1.0, *, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, end_lr_ratio: float = 0.0) -> optax.GradientTransformation:
  """AdamW with linear warmup then cosine decay, after global-norm clipping.

  The learning rate is injected as a hyperparameter, so the step reports the value it
  used (`learning_rate` metric).

  Args:
    lr: peak learning rate.
    warmup: linear warmup steps from 0 to `lr`.
    total_steps: schedule length (warmup included); the rate ends at `lr * end_lr_ratio`.
    weight_decay: decoupled weight decay on matrices (not on norms or biases).
    clip: global gradient-norm bound; None disables clipping.
    b1, b2, eps: Adam moments.
    end_lr_ratio: final rate as a fraction of `lr`.
  """
  if not lr > 0:
    raise ValueError(f"learning rate must be > 0, got {lr}")
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1, got {total_steps}")
  if not 0 <= warmup < total_steps:
    raise ValueError(f"warmup must be in [0, total_steps={total_steps}), got {warmup}")
  if weight_decay < 0:
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
  if clip is not None and not clip > 0:
    raise ValueError(f"clip must be > 0 or None, got {clip}")
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=total_steps,
      end_value=lr * end_lr_ratio)
  adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
      learning_rate=schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
      mask=_decay_mask)
  return optax.chain(optax.clip_by_global_norm(clip), adamw) if clip is not None else adamw


# ---------------------------------------------------------------------------------------
# State and shardings
# ---------------------------------------------------------------------------------------


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def has_lora(params) -> bool:
  """Whether `params` (an nnx.State) holds LoRA adapters."""
  return any(isinstance(v, nnx.LoRAParam) for v in jax.tree.leaves(params, is_leaf=_is_variable))


# Trained beside the adapters of a LoRA model: a value or score head is new, not part of
# the base (PEFT's modules_to_save for a sequence classifier's score layer).
_HEADS = nnx.Any(nnx.LoRAParam, nnx.PathContains("value_w"), nnx.PathContains("value_b"))


def split_trainable(params):
  """(trainable, frozen): with LoRA adapters, the adapters (and a value or score head) and
  the base weights; without, every parameter and None."""
  if not has_lora(params):
    return params, None
  return nnx.split_state(params, _HEADS, ...)


def join_trainable(trainable, frozen):
  """The inverse of `split_trainable`."""
  return trainable if frozen is None else nnx.merge_state(trainable, frozen)

def _param_and_opt_shardings(params, optimizer, mesh, rules):
  """Params by their logical axes; optimizer moments like their params, the rest replicated."""
  param_shardings = models.state_shardings(params, mesh, rules)
  replicated = NamedSharding(mesh, PartitionSpec())
  trainable = split_trainable(params)[0]
  abstract_opt = jax.eval_shape(optimizer.init, trainable)
  opt_shardings = optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, abstract_opt,
      split_trainable(param_shardings)[0],
      transform_non_params=lambda _: replicated, is_leaf=_is_variable)
  return param_shardings, opt_shardings


def train_state_shardings(params, optimizer: optax.GradientTransformation, mesh: Mesh,
                          rules: Rules = DEFAULT_RULES, *, critic_params=None,
                          critic_optimizer: optax.GradientTransformation | None = None
                          ) -> TrainState:
  """Shardings of a TrainState (params may be abstract)."""
  replicated = NamedSharding(mesh, PartitionSpec())
  param_shardings, opt_shardings = _param_and_opt_shardings(params, optimizer, mesh, rules)
  critic_shardings = critic_opt_shardings = None
  if critic_params is not None:
    critic_shardings, critic_opt_shardings = _param_and_opt_shardings(
        critic_params, critic_optimizer, mesh, rules)
  return TrainState(params=param_shardings, opt_state=opt_shardings, step=replicated,
                    rng=replicated, critic_params=critic_shardings,
                    critic_opt_state=critic_opt_shardings)


def init_train_state(model: nnx.Module, optimizer: optax.GradientTransformation, *,
                     mesh: Mesh, rules: Rules = DEFAULT_RULES, seed: int = 0,
                     critic: nnx.Module | None = None,
                     critic_optimizer: optax.GradientTransformation | None = None
                     ) -> TrainState:
  """A TrainState on `mesh` from a model (its parameters are copied, never aliased).

  Args:
    model: the policy.
    optimizer: the policy's optimizer (e.g. `make_optimizer`).
    mesh, rules: where the state lives.
    seed: seeds `state.rng`.
    critic: a separate value model (built with `value_head=True`) for PPO, or None.
    critic_optimizer: its optimizer (default: `optimizer`).
  """
  critic_optimizer = critic_optimizer or optimizer
  params = nnx.state(model, nnx.Param)
  critic_params = None if critic is None else nnx.state(critic, nnx.Param)
  shardings = train_state_shardings(params, optimizer, mesh, rules, critic_params=critic_params,
                                    critic_optimizer=critic_optimizer)
  # No-ops when already on `mesh`.
  params = jax.device_put(params, shardings.params)
  critic_params = jax.device_put(critic_params, shardings.critic_params)

  @functools.partial(jax.jit, out_shardings=shardings)
  def init(params, critic_params):
    # Copies: the step donates the state, which must not free the caller's models.
    params, critic_params = jax.tree.map(jnp.copy, (params, critic_params))
    return TrainState(
        params=params, opt_state=optimizer.init(split_trainable(params)[0]),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.PRNGKey(seed), critic_params=critic_params,
        critic_opt_state=None if critic is None else critic_optimizer.init(critic_params))

  return init(params, critic_params)


def frozen_copy(params, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES):
  """A copy of `params` (e.g. the reference policy) that a donated train step cannot free."""
  shardings = (models.state_shardings(params, mesh, rules) if mesh is not None
               else jax.tree.map(lambda x: x.sharding, params))
  return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)
