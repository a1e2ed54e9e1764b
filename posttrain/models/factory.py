"""Builds models with parameters created already sharded (never a full copy on one device)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from posttrain.models import quant
from posttrain.models.config import ModelConfig
from posttrain.models.sharding import DEFAULT_RULES, Rules, named_sharding
from posttrain.models.transformer import Transformer, layer_stacks


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """A tree like `state` whose leaves are NamedShardings from each variable's logical axes."""

  def one(v):
    raw = v.get_raw_value()
    if isinstance(raw, quant.QArray):  # codes and scales each by the weight's axes
      names = v.get_metadata()["logical_axes"]
      return v.replace(dataclasses.replace(
          raw, values=named_sharding(mesh, names, rules, raw.values.shape),
          scales=named_sharding(mesh, names, rules, raw.scales.shape)))
    names = v.get_metadata().get("logical_axes", (None,) * v.ndim)
    if len(names) != v.ndim:
      raise ValueError(f"logical axes {names} do not match shape {v.shape}")
    return v.replace(named_sharding(mesh, names, rules, v.shape))

  return jax.tree.map(one, state, is_leaf=_is_var)


def abstract_model(cfg: ModelConfig, seed: int = 0):
  """(graphdef, abstract state) without allocating anything."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
  return nnx.split(abstract)


def create_model(cfg: ModelConfig, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES,
                 seed: int = 0) -> Transformer:
  """Randomly initialised model; with a mesh, each parameter is born on its shards."""
  if mesh is None:
    return Transformer(cfg, rngs=nnx.Rngs(seed))
  graphdef, abstract_state = abstract_model(cfg, seed)
  shardings = state_shardings(abstract_state, mesh, rules)

  @jax.jit
  def init():
    return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))

  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def shard_model(model: Transformer, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Transformer:
  """Moves an existing model's parameters onto `mesh` by the rules (a resharding put)."""
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, state_shardings(state, mesh, rules))
  return nnx.merge(graphdef, state)


def relayout(model: Transformer, *, scan_layers: bool, mesh: Mesh | None = None,
             rules: Rules = DEFAULT_RULES) -> Transformer:
  """The same model with its layers stacked for a scan (`scan_layers=True`) or split
  into a list per layer: how a checkpoint saved in one layout serves the other. With a
  mesh the result's parameters are placed by the rules."""
  cfg = model.cfg
  if cfg.scan_layers == scan_layers:
    return model if mesh is None else shard_model(model, mesh, rules)
  graphdef, abstract = abstract_model(cfg.replace(scan_layers=scan_layers))
  pure = nnx.to_pure_dict(nnx.state(model))
  for stack, indices in layer_stacks(cfg):
    count = len(indices)
    layers = pure.pop(stack)
    if scan_layers:
      pure[stack] = jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[i] for i in range(count)))
    else:
      pure[stack] = {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(count)}
  nnx.replace_by_pure_dict(abstract, pure)
  out = nnx.merge(graphdef, abstract)
  return out if mesh is None else shard_model(out, mesh, rules)
