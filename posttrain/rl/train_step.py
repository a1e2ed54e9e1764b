"""One jitted update for the PPO/GRPO family and for DPO, log-probs without gradient, PPO epochs.

    from posttrain.rl import state as state_lib
    optimizer = state_lib.make_optimizer(1e-6, warmup=10, total_steps=1000, clip=1.0)
    state = state_lib.init_train_state(model, optimizer, mesh=mesh)
    reference = state_lib.frozen_copy(state.params)        # never donated, never updated
    compute_logprobs = make_compute_logprobs(model_cfg, mesh=mesh)
    train_step = make_train_step(model_cfg, presets.algorithm_config("grpo"), optimizer,
                                 mesh=mesh)
    batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
    state, metrics = train_step(state, batch)              # metrics: device scalars

A batch is a dict of arrays with a leading micro-batch axis, `[M, B, T]` per token
(`[M, B]` rows are split across micro-batches, never sequences), the layout
`posttrain.rl.packing` produces:

    tokens, targets       int32, the model reads `tokens`, is scored on `targets`
    loss_mask             nonzero on the model's own generated targets
    advantages            float32
    positions, segment_ids   optional (default 0..T-1 and one sequence per row)
    old_logprobs          optional; absent = on-policy (stop_gradient of the current ones);
                          needed by clip_cov / kl_cov, whose token selection reads them
    old_entropies         the learner's entropies before the update, needed when
                          top_entropy_fraction < 1 (its token selection reads them):
                          `make_compute_logprobs(..., with_entropy=True)`
    behaviour_logprobs    sampler log-probs, needed when the preset's tis_cap > 0
    routing               optional `[M, B, T, mixture layers, k]` int (a mixture of
                          experts): routing replay, the experts each token takes in
                          each mixture layer (`make_compute_logprobs(..., with_routing=
                          True)` of the policy before the update); every forward of the
                          policy on the batch follows them (`Transformer.hidden_states`)
    ref_logprobs          needed when the KL is a loss term (kl_coef > 0, not kl_in_reward)
    kl_coef               optional `[M, B]`: each row's KL weight in place of the preset's
                          kl_coef (the adaptive KL controller's value: no recompile)
    old_values, returns   needed by the critic (use_critic)

The step scans over the M micro-batches, summing gradients; every loss term is a
weighted token sum over a denominator computed from the masks of the whole batch first
(`losses.loss_denominator`), so the accumulated update equals the one-batch update.

PPO (critic on the policy's value head, `value_head=True`):

    out = compute_logprobs(state.params, batch)            # log-probs and values, one pass
    batch.update(old_logprobs=out["logprobs"],
                 ref_logprobs=compute_logprobs(reference, batch)["logprobs"])
    batch = add_gae_advantages(batch, out["values"], algo_cfg)
    state, metrics = ppo_update(train_step, state, batch, epochs=2, minibatches=4)

Preference optimisation (DPO and variants, `posttrain.rl.preference`) runs the same update
on packed pairs:

    batch = preference.pack_pairs(pairs, row_len, rows_per_microbatch=8)
    batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
    dpo_step = make_preference_step(model_cfg, preference.PreferenceConfig(beta=0.1),
                                    optimizer, mesh=mesh)
    state, metrics = dpo_step(state, batch)

A reward model (`posttrain.rl.reward_model`: a score head, the Bradley-Terry loss) trains
on the same packed pairs:

    batch["pair_margin"] = reward_model.pair_margins(pairs, batch)
    rm_step = make_reward_model_step(rm_cfg, reward_model.RewardLossConfig(), optimizer,
                                     mesh=mesh)
    state, metrics = rm_step(state, batch)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posttrain import distributed, models
from posttrain.models.sharding import DEFAULT_RULES, Rules
from posttrain.rl import advantages as advantages_lib
from posttrain.rl import kto, losses, preference, reward_model
from posttrain.rl.state import TrainState, join_trainable, split_trainable, train_state_shardings

Batch = Mapping[str, Any]

TOKEN_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask", "advantages",
              "old_logprobs", "old_entropies", "behaviour_logprobs", "ref_logprobs",
              "old_values", "returns")
# Per-row inputs `[M, B]`: each row's KL weight (the adaptive KL controller's value).
ROW_KEYS = ("kl_coef",)
# Per token and mixture layer `[M, B, T, layers, k]`: the experts routing replay takes.
ROUTING_KEY = "routing"
MODEL_KEYS = ("tokens", "targets", "positions", "segment_ids", ROUTING_KEY)

# Every step reports these (0 or 1 where a term is off), so the metric dict has one
# structure whatever the algorithm and a logger can rely on the names.
STANDARD_METRICS = ("loss/policy", "loss/value", "loss/kl", "kl", "entropy",
                    "clip_fraction/low", "clip_fraction/high", "ratio/mean", "ratio/max",
                    "is_weight/mean", "advantages/mean", "advantages/std", "grad_norm",
                    "learning_rate")
_METRIC_DEFAULTS = {"is_weight/mean": 1.0}


# ---------------------------------------------------------------------------------------
# Shardings
# ---------------------------------------------------------------------------------------


def _split_abstract(model_cfg: models.ModelConfig):
  """(graphdef, abstract params, abstract rest) of the model, allocating nothing."""
  abstract = nnx.eval_shape(lambda: models.Transformer(model_cfg, rngs=nnx.Rngs(0)))
  return nnx.split(abstract, nnx.Param, ...)


def _batch_axes(mesh: Mesh, rules: Rules) -> tuple[str, ...]:
  """Mesh axes the logical `batch` axis is sharded over (those of size > 1)."""
  spec = models.logical_to_spec(("batch",), rules, mesh)[0]
  if spec is None:
    return ()
  return (spec,) if isinstance(spec, str) else tuple(spec)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """Sharding of every batch array: micro-batch axis replicated, rows by `batch` rules."""
  axes = _batch_axes(mesh, rules)
  return NamedSharding(mesh, PartitionSpec(None, axes or None))


# ---------------------------------------------------------------------------------------
# Batch checks (host side, shapes only: no device sync)
# ---------------------------------------------------------------------------------------


def routing_dtype(model_cfg: models.ModelConfig):
  """The integer type a batch's recorded routing is held in (`models.transformer.
  routing_dtype`: uint8 for up to 256 experts)."""
  return models.transformer.routing_dtype(model_cfg)


def routing_mismatch_counts(replayed, own, mask) -> tuple[jax.Array, jax.Array]:
  """(pairs that differ, pairs): the (token, mixture layer) pairs over the tokens where
  `mask` is set, and those whose k experts in `own` are not those in `replayed` (as
  sets), both [..., layers, k]."""
  differ = jnp.any(jnp.sort(jnp.asarray(replayed), -1) != jnp.sort(jnp.asarray(own), -1), -1)
  mask = jnp.asarray(mask) != 0
  return (jnp.sum(jnp.where(mask[..., None], differ, False)),
          jnp.sum(mask) * differ.shape[-1])


def routing_mismatch(replayed, own, mask) -> jax.Array:
  """The share of (token, mixture layer) pairs, over the tokens where `mask` is set, whose
  k experts in `own` are not those in `replayed` (`routing_mismatch_counts`)."""
  differ, count = routing_mismatch_counts(replayed, own, mask)
  return differ / jnp.maximum(count, 1)


def _check_routing(batch: Batch, model_cfg: models.ModelConfig) -> None:
  if ROUTING_KEY not in batch:
    return
  if not model_cfg.num_experts:
    raise ValueError("batch['routing'] replays a mixture's experts; this model has none")
  want = (*np.shape(batch["tokens"]), model_cfg.mixture_layers, model_cfg.num_experts_per_tok)
  if np.shape(batch[ROUTING_KEY]) != want:
    raise ValueError(f"batch['routing'] has shape {np.shape(batch[ROUTING_KEY])}, expected "
                     f"{want} (micro-batches, rows, length, mixture layers, "
                     "num_experts_per_tok)")


def _check_batch(batch: Batch, required: tuple[str, ...], row_multiple: int) -> None:
  if not isinstance(batch, Mapping):
    raise ValueError(f"batch must be a dict of arrays, got {type(batch).__name__}")
  missing = [k for k in required if k not in batch]
  if missing:
    raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
  shape = np.shape(batch["tokens"])
  if len(shape) != 3:
    raise ValueError(f"batch['tokens'] must be [microbatches, rows, length], got shape {shape}")
  for key in TOKEN_KEYS:
    if key in batch and np.shape(batch[key]) != shape:
      raise ValueError(f"batch[{key!r}] has shape {np.shape(batch[key])}, expected {shape} "
                       f"like batch['tokens']")
  for key in ROW_KEYS:
    if key in batch and np.shape(batch[key]) != shape[:2]:
      raise ValueError(f"batch[{key!r}] has shape {np.shape(batch[key])}, expected "
                       f"{shape[:2]} (micro-batches, rows) like batch['tokens']")
  if shape[1] % row_multiple:
    raise ValueError(f"{shape[1]} rows per micro-batch do not divide over the {row_multiple} "
                     f"devices of the batch mesh axes")


# ---------------------------------------------------------------------------------------
# Forward pass
# ---------------------------------------------------------------------------------------


def _hidden(model: models.Transformer, mb: Batch, ctx: models.ShardingContext):
  """The trunk's states; a mixture replays the batch's `routing` when it has one."""
  return model.hidden_states(mb["tokens"], mb.get("positions"), mb.get("segment_ids"), ctx=ctx,
                             routing=mb.get(ROUTING_KEY))


def without_routing(mb: Batch) -> Batch:
  """The micro-batch as another model (reference, teacher, critic) reads it: the policy's
  routing is the policy's alone."""
  return {k: v for k, v in mb.items() if k != ROUTING_KEY}


def _value_head(model: models.Transformer, h_BxTxD):
  h = h_BxTxD.astype(jnp.float32)
  return jnp.einsum("BTD,D->BT", h, model.value_w[...]) + model.value_b[...]


def _forward(model: models.Transformer, mb: Batch, ctx: models.ShardingContext, *,
             temperature: float, with_values: bool, with_entropy: bool,
             with_router_loss: bool = False, hidden=None):
  """(log-probs, entropies or None, values or None) [B, T] and the mixture's
  load-balancing loss (None without `with_router_loss`), from one trunk pass (or from
  the trunk's `hidden` states, already computed)."""
  cfg = model.cfg
  aux = None
  if hidden is not None:
    h = hidden
  elif with_router_loss:
    h, aux = model.hidden_states(mb["tokens"], mb.get("positions"), mb.get("segment_ids"),
                                 ctx=ctx, router_loss=True, routing=mb.get(ROUTING_KEY))
  else:
    h = _hidden(model, mb, ctx)
  out = models.chunked_logprobs(h, model.unembed(), mb["targets"], chunk=cfg.logprob_chunk,
                                return_entropy=with_entropy, temperature=temperature,
                                compute_dtype=jnp.dtype(cfg.dtype), ctx=ctx,
                                logit_soft_cap=cfg.final_logit_softcap,
                                bias_V=model.unembed_bias())
  logprobs, entropies = out if with_entropy else (out, None)
  values = _value_head(model, h) if with_values else None
  return logprobs, entropies, values, aux


def _scan_or_call(fn, xs, length: int):
  """lax.scan of a carry-less `fn` over the leading axis; a plain call when it has one entry."""
  if length == 1:
    return jax.tree.map(lambda y: y[None], fn(jax.tree.map(lambda x: x[0], xs)))
  return jax.lax.scan(lambda _, x: (None, fn(x)), None, xs)[1]


# ---------------------------------------------------------------------------------------
# Log-probs without gradient (old policy, reference, critic values)
# ---------------------------------------------------------------------------------------


def make_compute_logprobs(model_cfg: models.ModelConfig, *, mesh: Mesh,
                          rules: Rules = DEFAULT_RULES, temperature: float = 1.0,
                          with_values: bool | None = None,
                          with_entropy: bool = False, with_routing: bool = False) -> Callable:
  """`compute_logprobs(params, batch) -> {"logprobs", ["values"], ["entropies"],
  ["routing"]}`, jitted, no gradient.

  One trunk pass per micro-batch gives the target log-probs `[M, B, T]` and, when the
  model has a value head, the critic's values (the `old_values` GAE needs).

  Args:
    model_cfg: the policy (or reference) architecture.
    mesh, rules: where params and batch live.
    temperature: the sampler's temperature (log-probs of the tempered distribution).
    with_values: return values too; default: when `model_cfg.value_head`.
    with_entropy: return `entropies` `[M, B, T]` too, each position's entropy of the
      tempered next-token distribution (the `old_entropies` of `top_entropy_fraction`).
    with_routing: return `routing` `[M, B, T, mixture layers, k]` too (`routing_dtype`),
      the experts each mixture layer chose for each token: the batch's routing for
      routing replay in the updates that follow.

  A batch with `routing` replays it; `with_routing` then returns the experts the
  policy's routers would have chosen on the way (how far the batch's routing is from
  the policy's own, `routing_mismatch`).
  """
  with_values = model_cfg.value_head if with_values is None else with_values
  if with_values and not model_cfg.value_head:
    raise ValueError("with_values=True needs a model built with value_head=True")
  if with_routing and not model_cfg.num_experts:
    raise ValueError("with_routing=True records a mixture's experts; this model has none")
  graphdef, abstract_params, rest = _split_abstract(model_cfg)
  ctx = models.ShardingContext(mesh, rules)
  data_sharding = batch_sharding(mesh, rules)
  row_multiple = int(np.prod([mesh.shape[a] for a in _batch_axes(mesh, rules)]))

  def logprobs_fn(params, batch):
    model = nnx.merge(graphdef, params, rest)
    inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}

    def one(mb):
      hidden = routing = None
      if with_routing:
        hidden, routing = model.hidden_states(
            mb["tokens"], mb.get("positions"), mb.get("segment_ids"), ctx=ctx,
            routing=mb.get(ROUTING_KEY), return_routing=True)
      logprobs, entropies, values, _ = _forward(model, mb, ctx, temperature=temperature,
                                                with_values=with_values,
                                                with_entropy=with_entropy, hidden=hidden)
      return {"logprobs": logprobs, **({"values": values} if with_values else {}),
              **({"entropies": entropies} if with_entropy else {}),
              **({"routing": routing.astype(routing_dtype(model_cfg))} if with_routing
                 else {})}

    return _scan_or_call(one, inputs, batch["tokens"].shape[0])

  jitted = jax.jit(logprobs_fn, in_shardings=(models.state_shardings(abstract_params, mesh,
                                                                     rules), data_sharding),
                   out_shardings=data_sharding)

  def compute_logprobs(params, batch: Batch) -> dict[str, jax.Array]:
    _check_batch(batch, ("tokens", "targets"), row_multiple)
    _check_routing(batch, model_cfg)
    inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}
    # A no-op for arrays already laid out so; reshards e.g. a rollout mesh's output.
    return jitted(params, distributed.put(inputs, data_sharding))

  compute_logprobs.jitted = jitted
  return compute_logprobs


# ---------------------------------------------------------------------------------------
# The train step
# ---------------------------------------------------------------------------------------


def _required_keys(loss_cfg: losses.LossConfig) -> tuple[str, ...]:
  keys = ["tokens", "targets", "loss_mask", "advantages"]
  if loss_cfg.tis_cap > 0:
    keys.append("behaviour_logprobs")
  if loss_cfg.kl_coef > 0 and not loss_cfg.kl_in_reward:
    keys.append("ref_logprobs")
  if loss_cfg.use_critic:
    keys += ["old_values", "returns"]
  if loss_cfg.policy_loss in losses.COVARIANCE_LOSSES:
    keys.append("old_logprobs")  # the token selection reads them for the whole batch
  if loss_cfg.top_entropy_fraction < 1:
    keys.append("old_entropies")  # likewise
  return tuple(keys)


def _learning_rate(opt_state) -> jax.Array:
  # inject_hyperparams keeps the value it used this step (an array) next to the
  # schedule's own state under the same key.
  lr = optax.tree_utils.tree_get(opt_state, "learning_rate",
                                 filtering=lambda _, value: isinstance(value, jax.Array))
  return jnp.asarray(jnp.nan if lr is None else lr, jnp.float32)


def reference_in_step(algo) -> bool:
  """Whether the KL reference's log-probs are computed inside the update program (one
  program per step): when they only feed a loss term of a single update per batch."""
  if algo.get("preference_loss"):  # online preference optimisation: always in the step
    return algo.preference_loss in preference.REFERENCE_LOSSES
  return (float(algo.kl_coef) > 0 and not algo.kl_in_reward
          and int(algo.ppo_epochs) * int(algo.num_minibatches) == 1)


def _reference_logprobs_fn(graphdef, rest, ctx: models.ShardingContext, temperature: float):
  """`(reference params, mb) -> [B, T]` log-probs of the targets, without gradient."""
  def reference_logprobs(reference, mb):
    model = nnx.merge(graphdef, reference, rest)
    logprobs, _, _, _ = _forward(model, without_routing(mb), ctx, temperature=temperature,
                                 with_values=False, with_entropy=False)
    return jax.lax.stop_gradient(logprobs)

  return reference_logprobs


def _with_router_aux(loss, metrics, aux, coef: float, micro_share: float):
  """A mixture's load-balancing loss joins the loss, averaged over the micro-batches."""
  if aux is None:
    return loss, metrics
  return (loss + coef * micro_share * aux,
          {**metrics, "loss/router_aux": losses.Metric.mean(aux, 1.0)})


def _check_reference_arg(reference, *, lora: bool, reference_in_step: bool) -> None:
  if lora and reference is not None:
    raise ValueError("a LoRA model's KL reference is its base weights, already in the "
                     "state: call train_step(state, batch) without reference params")
  if reference_in_step and not lora and reference is None:
    raise ValueError("this train step computes ref_logprobs in the step "
                     "(reference_in_step=True): call train_step(state, batch, reference)")
  if reference is not None and not reference_in_step:
    raise ValueError("reference params given to a train step built without "
                     "reference_in_step=True; pass batch['ref_logprobs'] instead")


def _jit_update(loss_fn: Callable, optimizer: optax.GradientTransformation, *,
                batch_totals: Callable, finish_metrics: Callable,
                reference_logprobs: Callable, lora: bool, reference_in_step: bool,
                state_shardings, batch_shardings, reference_shardings, donate: bool,
                critic_optimizer: optax.GradientTransformation | None = None,
                totals_read_params: bool = False,
                microbatch_keys: tuple[str, ...] | None = None,
                prepare_batch: Callable | None = None,
                teacher_hidden: Callable | None = None, teacher_shardings=None):
  """The update every train step shares, jitted: gradients summed over the micro-batches,
  the optimizer step, a guard that keeps the old state when anything is non-finite.

  Args:
    loss_fn: `(trainable, mb, totals, frozen, micro_share) -> (loss, metrics)` of one
      micro-batch: `trainable` is (policy params, critic params or None), `frozen` the
      LoRA base or None, `metrics` a dict of `losses.Metric`.
    optimizer: the policy's optimizer.
    batch_totals: `batch -> totals`, the whole batch's denominators, computed before the
      micro-batches so that their losses add up to the batch loss.
    finish_metrics: `(metric values, batch) -> metrics`, the step's own metric dict.
    reference_logprobs: `(reference params, mb) -> [B, T]`, for `reference_in_step`.
    lora: the policy has LoRA adapters (with `reference_in_step`, the base is the
      reference).
    reference_in_step: each micro-batch gets `ref_logprobs` computed in the step.
    state_shardings, batch_shardings: the jit's input shardings.
    reference_shardings: those of a reference argument (`reference_in_step`, no LoRA).
    donate: donate the input state.
    critic_optimizer: a separate critic's optimizer (its params in `state.critic_params`).
    totals_read_params: call `batch_totals(batch, trainable, frozen, reference)`: totals
      that need a forward pass of the current policy (or the reference) without gradient.
    microbatch_keys: the batch keys the micro-batch loop runs over (default all); the
      others (with another leading axis) are for `batch_totals` alone.
    prepare_batch: `(batch, state) -> batch`, run on the whole batch first: inputs the
      micro-batches read that depend on all of them (e.g. covariance-selected tokens).
    teacher_hidden: `(teacher params, mb) -> (hidden [B, T, E], projection [E, W], its
      bias [W] or None)`, no gradient: a distillation teacher read in the step, its
      arrays given to each micro-batch as `teacher_h`, `teacher_w` and `teacher_b`; the
      step then takes the teacher's params after the reference (`teacher_shardings`).

  Returns:
    `(jitted, run)`: the `jax.jit` function and `run(state, inputs, reference, teacher)`,
    which lays the inputs out and calls it.
  """
  separate_critic = critic_optimizer is not None
  reference_arg = reference_in_step and not lora
  teacher_arg = teacher_hidden is not None
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step_fn(state: TrainState, batch: Batch, *args):
    reference = args[0] if reference_arg else None
    teacher = args[-1] if teacher_arg else None
    if prepare_batch is not None:
      batch = prepare_batch(batch, state)
    microbatches = (batch if microbatch_keys is None
                    else {key: batch[key] for key in microbatch_keys})
    num_micro = batch["tokens"].shape[0]
    # Only the trainable params are differentiated: with LoRA, the adapters (XLA then
    # drops the base weights' gradients); the frozen base passes through.
    policy_params, frozen = split_trainable(state.params)
    trainable = (policy_params, state.critic_params)
    if reference_in_step and lora:
      reference = models.without_lora(state.params)
    # The global denominators first: each micro-batch's loss is then its exact share.
    totals = (batch_totals(batch, trainable, frozen, reference) if totals_read_params
              else batch_totals(batch))

    def micro_grad(mb):
      if reference is not None:
        mb = {**mb, "ref_logprobs": reference_logprobs(reference, mb)}
      if teacher is not None:
        teacher_h, teacher_w, teacher_b = teacher_hidden(teacher, mb)
        mb = {**mb, "teacher_h": teacher_h, "teacher_w": teacher_w, "teacher_b": teacher_b}
      return grad_fn(trainable, mb, totals, frozen, 1.0 / num_micro)

    def accumulate(carry, mb):
      grads_sum, loss_sum = carry
      (loss, metrics), grads = micro_grad(mb)
      grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
      return (grads_sum, loss_sum + loss), metrics

    if num_micro == 1:
      (loss, merged), grads = micro_grad(jax.tree.map(lambda x: x[0], microbatches))
    else:
      zeros = jax.tree.map(jnp.zeros_like, trainable)
      (grads, loss), stacked = jax.lax.scan(accumulate, (zeros, jnp.zeros(())), microbatches)
      # Merge the per-micro-batch (sum, count) metrics: exact token averages.
      merged = functools.reduce(
          losses.merge_metrics,
          [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_micro)])
    grads, critic_grads = grads

    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, policy_params)
    new_policy = optax.apply_updates(policy_params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    critic_params, critic_opt_state = state.critic_params, state.critic_opt_state
    if separate_critic:
      critic_grad_norm = optax.global_norm(critic_grads)
      critic_updates, critic_opt_state = critic_optimizer.update(
          critic_grads, state.critic_opt_state, state.critic_params)
      critic_params = optax.apply_updates(state.critic_params, critic_updates)
      finite &= jnp.isfinite(critic_grad_norm)
    nonfinite = ~finite

    def keep_old_if_nonfinite(new, old):
      return jax.tree.map(lambda n, o: jnp.where(nonfinite, o, n), new, old)

    new_state = TrainState(
        params=join_trainable(keep_old_if_nonfinite(new_policy, policy_params), frozen),
        opt_state=keep_old_if_nonfinite(opt_state, state.opt_state),
        step=state.step + jnp.where(nonfinite, 0, 1).astype(state.step.dtype),
        rng=state.rng,
        critic_params=keep_old_if_nonfinite(critic_params, state.critic_params),
        critic_opt_state=keep_old_if_nonfinite(critic_opt_state, state.critic_opt_state))
    metrics = finish_metrics(losses.compute_metrics(merged), batch)
    metrics.update({
        "loss": loss,
        "grad_norm": grad_norm,
        "learning_rate": _learning_rate(opt_state),
        "nonfinite": nonfinite.astype(jnp.float32),
    })
    if separate_critic:
      metrics["critic/grad_norm"] = critic_grad_norm
    return new_state, metrics

  in_shardings = (state_shardings, batch_shardings)
  if reference_arg:
    in_shardings += (reference_shardings,)
  if teacher_arg:
    in_shardings += (teacher_shardings,)
  jitted = jax.jit(step_fn, in_shardings=in_shardings, out_shardings=(state_shardings, None),
                   donate_argnums=(0,) if donate else ())

  def run(state: TrainState, inputs: Batch, reference=None, teacher=None):
    inputs = distributed.put(inputs, batch_shardings)
    args = ((reference,) if reference_arg else ()) + ((teacher,) if teacher_arg else ())
    return jitted(state, inputs, *args)

  return jitted, run


def make_train_step(model_cfg: models.ModelConfig, algo_cfg: Mapping[str, Any],
                    optimizer: optax.GradientTransformation, *, mesh: Mesh,
                    rules: Rules = DEFAULT_RULES, max_response_len: int | None = None,
                    temperature: float = 1.0, critic_cfg: models.ModelConfig | None = None,
                    critic_optimizer: optax.GradientTransformation | None = None,
                    donate: bool = True, reference_in_step: bool = False,
                    teacher_cfg: models.ModelConfig | None = None,
                    distill_loss: str = "reverse_kl", distill_coef: float = 1.0,
                    distill_beta: float = 0.5) -> Callable:
  """Builds `train_step(state, batch) -> (state, metrics)`, jitted once for every algorithm.

  The loss is `losses.rl_loss` with the preset's knobs: PPO/GSPO surrogate, TIS weights,
  KL to the reference, entropy bonus and, with `use_critic`, the clipped value loss on the
  policy's value head (same trunk) or on a separate critic (`critic_cfg`). Token selections
  (clip_cov / kl_cov's covariance tokens, `top_entropy_fraction`'s high-entropy ones) are
  made over the whole batch before its micro-batches. A non-finite loss or gradient norm
  leaves params, optimizer states and step unchanged and sets the `nonfinite` metric to 1.

  Args:
    model_cfg: the policy architecture (`value_head=True` for a critic on the same trunk).
    algo_cfg: a preset from `posttrain.rl.presets.algorithm_config`, or any mapping with
      `losses.LossConfig`'s fields.
    optimizer: e.g. `make_optimizer(...)`; must be the one the state was built with.
    mesh, rules: where the state and the batch live.
    max_response_len: Dr.GRPO's constant normaliser when the preset's is 0.
    temperature: the sampler's temperature.
    critic_cfg: a separate value model (`value_head=True`) trained on the value loss.
    critic_optimizer: the critic's optimizer (default: `optimizer`).
    donate: donate the input state's buffers (the caller must not reuse that state).
    reference_in_step: the step computes `ref_logprobs` itself, micro-batch by micro-batch
      in the same program, from the frozen reference params it is given:
      `train_step(state, batch, reference)`. One program instead of two per update (no
      second dispatch, no `[M, B, T]` log-prob array between them); for a single update
      per rollout batch, as GRPO/DAPO run by default (with several PPO epochs, compute the
      reference log-probs once with `make_compute_logprobs` instead). With LoRA
      adapters (`model_cfg.lora_rank`) the reference is the base weights already in the
      state, adapters off: call `train_step(state, batch)`, no copy of the model.
    teacher_cfg: a distillation teacher read in the step (GKD-style, Agarwal et al.
      2024): `train_step(state, batch, teacher=params)` runs its forward pass on each
      micro-batch and adds `distill_coef * sum_t w_t D_t / denominator` to the loss, `D_t`
      the whole-vocabulary `distill_loss` (`models.DIVERGENCES`: reverse_kl, forward_kl,
      jsd with `distill_beta`) between the policy's next-token distribution (at `temperature`) and the teacher's,
      on the trained tokens, weighted like the policy loss (`loss_agg_mode`). The teacher
      must share the policy's token ids (its vocabulary at least as large).

  With LoRA adapters only they are differentiated and updated (`state.opt_state` covers
  them alone); the base weights pass through the step unchanged.

  Returns:
    The step; `train_step.jitted` is the underlying `jax.jit` function and
    `train_step.required` the batch keys the loss reads.
  """
  overrides = {}
  if max_response_len and not algo_cfg.get("max_response_len"):
    overrides["max_response_len"] = max_response_len
  loss_cfg = losses.LossConfig.from_config(algo_cfg, **overrides)
  separate_critic = critic_cfg is not None
  if separate_critic and not loss_cfg.use_critic:
    raise ValueError(f"critic_cfg is given but algorithm {algo_cfg.get('algorithm')!r} "
                     "trains no critic (use_critic=False)")
  if separate_critic and not critic_cfg.value_head:
    raise ValueError("critic_cfg must have value_head=True")
  if reference_in_step and not (loss_cfg.kl_coef > 0 and not loss_cfg.kl_in_reward):
    raise ValueError("reference_in_step needs a KL loss term (kl_coef > 0, kl_in_reward "
                     f"False); algorithm {algo_cfg.get('algorithm')!r} reads no reference")
  if loss_cfg.use_critic and not separate_critic and not model_cfg.value_head:
    raise ValueError("the algorithm trains a critic (use_critic=True) but the model has no "
                     "value head; build it with value_head=True or pass critic_cfg")
  critic_optimizer = critic_optimizer or optimizer
  graphdef, abstract_params, rest = _split_abstract(model_cfg)
  critic_graphdef, abstract_critic, critic_rest = (
      _split_abstract(critic_cfg) if separate_critic else (None, None, None))
  ctx = models.ShardingContext(mesh, rules)
  state_shardings = train_state_shardings(abstract_params, optimizer, mesh, rules,
                                          critic_params=abstract_critic,
                                          critic_optimizer=critic_optimizer)
  data_sharding = batch_sharding(mesh, rules)
  row_multiple = int(np.prod([mesh.shape[a] for a in _batch_axes(mesh, rules)]))
  required = _required_keys(loss_cfg)
  if reference_in_step:
    required = tuple(k for k in required if k != "ref_logprobs")
  lora = bool(model_cfg.lora_rank)
  aux_coef = float(model_cfg.router_aux_loss_coef)
  distilling = teacher_cfg is not None
  if distilling:
    if distill_loss not in models.DIVERGENCES:
      raise ValueError(f"distill_loss={distill_loss!r}; expected one of {models.DIVERGENCES}")
    if not distill_coef >= 0:
      raise ValueError(f"distill_coef must be >= 0, got {distill_coef}")
    if distill_loss == "jsd" and not 0 < distill_beta < 1:
      raise ValueError(f"distill_beta must be in (0, 1) for jsd, got {distill_beta}")
    if not teacher_cfg.lm_head or teacher_cfg.vocab_size < model_cfg.vocab_size:
      raise ValueError(f"the teacher needs a language-model head over at least the "
                       f"policy's {model_cfg.vocab_size} tokens, has "
                       f"{teacher_cfg.vocab_size if teacher_cfg.lm_head else 'none'}")
    teacher_graphdef, abstract_teacher, teacher_rest = _split_abstract(teacher_cfg)

  def teacher_hidden(teacher_params, mb):
    teacher = nnx.merge(teacher_graphdef, teacher_params, teacher_rest)
    return (jax.lax.stop_gradient(_hidden(teacher, without_routing(mb), ctx)),
            jax.lax.stop_gradient(teacher.unembed()),
            jax.lax.stop_gradient(teacher.unembed_bias()))

  def microbatch_loss(trainable, mb, denominator, frozen, micro_share):
    params, critic_params = trainable
    model = nnx.merge(graphdef, join_trainable(params, frozen), rest)
    hidden, aux, own = None, None, None
    if ROUTING_KEY in mb:
      # Routing replay: the trunk follows the batch's experts and records those its
      # routers would have chosen (`routing/mismatch`).
      out = model.hidden_states(mb["tokens"], mb.get("positions"), mb.get("segment_ids"),
                                ctx=ctx, router_loss=aux_coef > 0, routing=mb[ROUTING_KEY],
                                return_routing=True)
      hidden, own = out[0], out[-1]
      aux = out[1] if aux_coef > 0 else None
    elif distilling:  # the trunk's states feed the log-probs and the divergence both
      if aux_coef > 0:
        hidden, aux = model.hidden_states(mb["tokens"], mb.get("positions"),
                                          mb.get("segment_ids"), ctx=ctx, router_loss=True)
      else:
        hidden = _hidden(model, mb, ctx)
    logprobs, entropies, values, forward_aux = _forward(
        model, mb, ctx, temperature=temperature,
        with_values=loss_cfg.use_critic and not separate_critic, with_entropy=True,
        with_router_loss=aux_coef > 0 and hidden is None, hidden=hidden)
    aux = forward_aux if hidden is None else aux
    if separate_critic:
      critic = nnx.merge(critic_graphdef, critic_params, critic_rest)
      values = _value_head(critic, _hidden(critic, without_routing(mb), ctx))
    loss, metrics = losses.rl_loss(loss_cfg, logprobs, mb, denominator=denominator,
                                   entropies=entropies, values=values)
    if own is not None:
      metrics["routing/mismatch"] = losses.Metric.mean(*routing_mismatch_counts(
          mb[ROUTING_KEY], own, mb["loss_mask"]))
    if distilling:
      divergence = models.chunked_divergence(
          hidden, model.unembed(), mb["teacher_h"], mb["teacher_w"], kind=distill_loss,
          chunk=model_cfg.logprob_chunk, temperature=temperature,
          compute_dtype=jnp.dtype(model_cfg.dtype), beta=distill_beta,
          logit_soft_cap=model_cfg.final_logit_softcap,
          teacher_logit_soft_cap=teacher_cfg.final_logit_softcap, ctx=ctx,
          bias_V=model.unembed_bias(), teacher_bias_W=mb["teacher_b"])
      mask = losses.as_mask(mb["loss_mask"])
      weights, local_denominator = losses.token_weights(
          mask, loss_cfg.loss_agg_mode, segment_ids=mb.get("segment_ids"),
          max_response_len=loss_cfg.max_response_len)
      weighted = jnp.sum(jnp.where(mask, divergence * weights, 0.0))
      loss = loss + distill_coef * jnp.where(
          denominator > 0, weighted / jnp.maximum(denominator, 1e-30), 0.0)
      metrics["loss/distill"] = losses.Metric.mean(weighted, local_denominator)
      metrics["distill/divergence"] = losses.Metric.mean(
          jnp.sum(jnp.where(mask, jax.lax.stop_gradient(divergence), 0.0)), jnp.sum(mask))
    return _with_router_aux(loss, metrics, aux, aux_coef, micro_share)

  def denominator(batch):
    return jnp.sum(jax.vmap(functools.partial(losses.loss_denominator, loss_cfg))(batch))

  covariance = loss_cfg.policy_loss in losses.COVARIANCE_LOSSES
  high_entropy = loss_cfg.top_entropy_fraction < 1

  def select_tokens(batch, state):
    # Over the whole batch, from the learner before the update (its old log-probs and
    # entropies): known before any micro-batch runs, so the micro-batch losses add up
    # exactly. A key per step: a resumed run draws what the uninterrupted one drew.
    if covariance:
      selected = losses.covariance_selection(
          batch["advantages"], batch["old_logprobs"], batch["loss_mask"],
          mode=loss_cfg.policy_loss, fraction=loss_cfg.cov_fraction,
          lower=loss_cfg.clip_cov_lb, upper=loss_cfg.clip_cov_ub,
          key=jax.random.fold_in(state.rng, state.step))
      batch = {**batch, "cov_selected": jax.lax.with_sharding_constraint(selected,
                                                                          data_sharding)}
    if high_entropy:
      selected = losses.high_entropy_selection(batch["old_entropies"], batch["loss_mask"],
                                               fraction=loss_cfg.top_entropy_fraction)
      batch = {**batch, "entropy_selected": jax.lax.with_sharding_constraint(selected,
                                                                              data_sharding)}
    return batch

  def finish_metrics(values, batch):
    metrics = {name: jnp.asarray(values.get(name, _METRIC_DEFAULTS.get(name, 0.0)),
                                 jnp.float32) for name in STANDARD_METRICS}
    metrics.update({name: v for name, v in values.items() if name not in metrics})
    metrics["tokens"] = jnp.sum(batch["loss_mask"] != 0).astype(jnp.float32)
    if high_entropy:  # the smallest entropy kept: the batch's cut
      selected = batch["entropy_selected"]
      kept = jnp.where(selected, batch["old_entropies"].astype(jnp.float32), jnp.inf)
      metrics["entropy/threshold"] = jnp.where(jnp.any(selected), jnp.min(kept), 0.0)
    return metrics

  jitted, run = _jit_update(
      microbatch_loss, optimizer, batch_totals=denominator, finish_metrics=finish_metrics,
      reference_logprobs=_reference_logprobs_fn(graphdef, rest, ctx, temperature),
      lora=lora, reference_in_step=reference_in_step, state_shardings=state_shardings,
      batch_shardings=data_sharding,
      reference_shardings=models.state_shardings(abstract_params, mesh, rules),
      donate=donate, critic_optimizer=critic_optimizer if separate_critic else None,
      prepare_batch=select_tokens if covariance or high_entropy else None,
      teacher_hidden=teacher_hidden if distilling else None,
      teacher_shardings=(models.state_shardings(abstract_teacher, mesh, rules)
                         if distilling else None))

  def train_step(state: TrainState, batch: Batch, reference=None, teacher=None):
    _check_reference_arg(reference, lora=lora, reference_in_step=reference_in_step)
    if distilling and teacher is None:
      raise ValueError("this step distils from a teacher (teacher_cfg): call "
                       "train_step(state, batch, teacher=teacher_params)")
    if teacher is not None and not distilling:
      raise ValueError("teacher params given to a train step built without teacher_cfg")
    if high_entropy and isinstance(batch, Mapping) and "old_entropies" not in batch:
      raise ValueError(f"top_entropy_fraction={loss_cfg.top_entropy_fraction} selects tokens "
                       "by batch['old_entropies'], the learner's entropies before the update: "
                       "make_compute_logprobs(..., with_entropy=True)")
    _check_batch(batch, required, row_multiple)
    _check_routing(batch, model_cfg)
    inputs = {k: v for k, v in batch.items() if k in TOKEN_KEYS + ROW_KEYS + (ROUTING_KEY,)}
    if "kl_coef" in inputs and not (loss_cfg.kl_coef > 0 and not loss_cfg.kl_in_reward):
      raise ValueError("batch['kl_coef'] weighs a KL loss term, which this config has not "
                       "(kl_coef > 0 and kl_in_reward False)")
    if reference_in_step:
      inputs.pop("ref_logprobs", None)  # computed in the step
    return run(state, inputs, reference, teacher)

  train_step.jitted = jitted
  train_step.required = required  # the batch keys it reads (besides the model's)
  return train_step


# ---------------------------------------------------------------------------------------
# The preference step (DPO and variants)
# ---------------------------------------------------------------------------------------


def _step_layout(model_cfg: models.ModelConfig, optimizer: optax.GradientTransformation,
                 mesh: Mesh, rules: Rules) -> tuple:
  """What a pair or example step builder lays out first: (graphdef, abstract params, rest,
  sharding context, state shardings, the batch rows' sharding, the rows' device multiple)."""
  graphdef, abstract_params, rest = _split_abstract(model_cfg)
  row_multiple = int(np.prod([mesh.shape[a] for a in _batch_axes(mesh, rules)]))
  return (graphdef, abstract_params, rest, models.ShardingContext(mesh, rules),
          train_state_shardings(abstract_params, optimizer, mesh, rules),
          batch_sharding(mesh, rules), row_multiple)


def make_preference_step(model_cfg: models.ModelConfig,
                         pref_cfg: preference.PreferenceConfig,
                         optimizer: optax.GradientTransformation, *, mesh: Mesh,
                         rules: Rules = DEFAULT_RULES, donate: bool = True,
                         reference_in_step: bool = False) -> Callable:
  """Builds `step(state, batch) -> (state, metrics)` for offline preference optimisation.

  The batch is `preference.pack_pairs`'s (both sequences of a pair in one micro-batch)
  plus, for the losses with a reference (all but simpo and orpo), `ref_logprobs`
  `[M, B, T]`, e.g.
  `make_compute_logprobs(model_cfg, mesh=mesh)(reference, batch)["logprobs"]`. The loss
  is `preference.microbatch_preference_loss` normalised by the whole batch's pairs, plus
  the router's load-balancing loss of a mixture; the update is the RL step's (micro-batch
  accumulation, LoRA adapters alone trained, a non-finite update skipped and reported).

  Args:
    model_cfg: the policy architecture.
    pref_cfg: the loss.
    optimizer: the one the state was built with.
    mesh, rules: where the state and the batch live.
    donate: donate the input state's buffers.
    reference_in_step: compute the reference log-probs in the step from the reference
      params it is given, `step(state, batch, reference)`; with LoRA adapters the
      reference is the base weights in the state, `step(state, batch)`.

  Returns:
    The step; `step.jitted` is the `jax.jit` function, `step.required` the batch keys.
  """
  if reference_in_step and not pref_cfg.needs_reference:
    raise ValueError(f"reference_in_step: the {pref_cfg.loss} loss reads no reference")
  if pref_cfg.unpaired:
    return _make_unpaired_step(model_cfg, pref_cfg, optimizer, mesh=mesh, rules=rules,
                               donate=donate, reference_in_step=reference_in_step)
  (graphdef, abstract_params, rest, ctx, state_shardings, data_sharding,
   row_multiple) = _step_layout(model_cfg, optimizer, mesh, rules)
  lora = bool(model_cfg.lora_rank)
  aux_coef = float(model_cfg.router_aux_loss_coef)
  reads_ref = pref_cfg.needs_reference and not reference_in_step
  required = preference.TOKEN_KEYS + ("pair_mask",) + (("ref_logprobs",) if reads_ref else ())
  # Pair slots are few: replicated, whatever the rows' layout.
  batch_shardings = {key: data_sharding for key in required}
  batch_shardings["pair_mask"] = NamedSharding(mesh, PartitionSpec())

  def microbatch_loss(trainable, mb, denominators, frozen, micro_share):
    params, _ = trainable
    model = nnx.merge(graphdef, join_trainable(params, frozen), rest)
    logprobs, _, _, aux = _forward(model, mb, ctx, temperature=1.0, with_values=False,
                                   with_entropy=False, with_router_loss=aux_coef > 0)
    loss, metrics = preference.microbatch_preference_loss(pref_cfg, logprobs, mb,
                                                          denominators=denominators)
    return _with_router_aux(loss, metrics, aux, aux_coef, micro_share)

  def finish_metrics(values, batch):
    return {**values,
            "pairs": jnp.sum(batch["pair_mask"]).astype(jnp.float32),
            "tokens": jnp.sum(batch["loss_mask"] != 0).astype(jnp.float32)}

  jitted, run = _jit_update(
      microbatch_loss, optimizer, batch_totals=preference.batch_denominators,
      finish_metrics=finish_metrics,
      reference_logprobs=_reference_logprobs_fn(graphdef, rest, ctx, 1.0),
      lora=lora, reference_in_step=reference_in_step, state_shardings=state_shardings,
      batch_shardings=batch_shardings,
      reference_shardings=models.state_shardings(abstract_params, mesh, rules),
      donate=donate)

  def step(state: TrainState, batch: Batch, reference=None):
    _check_reference_arg(reference, lora=lora, reference_in_step=reference_in_step)
    _check_pair_batch(batch, required, preference.TOKEN_KEYS, row_multiple)
    return run(state, {key: batch[key] for key in required}, reference)

  step.jitted = jitted
  step.required = required
  return step


def _make_unpaired_step(model_cfg: models.ModelConfig, pref_cfg: preference.PreferenceConfig,
                        optimizer: optax.GradientTransformation, *, mesh: Mesh, rules: Rules,
                        donate: bool, reference_in_step: bool) -> Callable:
  """`make_preference_step` for the unpaired losses (KTO): the batch is
  `kto.pack_examples`'s plus, without `reference_in_step`, `ref_logprobs` `[M, B, T]` and
  (kto) `kl_ref_logprobs` `[K, B, T]`. KTO's reference point is computed first, over the
  whole batch's mismatched sequences, by forward passes of the policy and the reference."""
  (graphdef, abstract_params, rest, ctx, state_shardings, data_sharding,
   row_multiple) = _step_layout(model_cfg, optimizer, mesh, rules)
  lora = bool(model_cfg.lora_rank)
  aux_coef = float(model_cfg.router_aux_loss_coef)
  with_kl = kto.needs_kl(pref_cfg)
  ref_key = () if reference_in_step else ("ref_logprobs",)
  microbatch_keys = kto.TOKEN_KEYS + kto.SLOT_KEYS + ref_key
  kl_keys = (kto.KL_KEYS + tuple(f"kl_{k}" for k in ref_key)) if with_kl else ()
  required = microbatch_keys + kl_keys
  batch_shardings = {key: data_sharding for key in required}
  for key in kto.SLOT_KEYS:  # few slots: replicated, whatever the rows' layout
    batch_shardings[key] = NamedSharding(mesh, PartitionSpec())
  logprobs_of = _reference_logprobs_fn(graphdef, rest, ctx, 1.0)

  def batch_totals(batch, trainable, frozen, reference):
    examples = jnp.sum(batch["example_mask"]).astype(jnp.float32)
    if not with_kl:
      return {"examples": examples, "kl": jnp.zeros((), jnp.float32)}
    policy = join_trainable(trainable[0], frozen)

    def sums(mb):  # (policy, reference) log-probs summed over one micro-batch's scored tokens
      mask = mb["loss_mask"] != 0
      ref = mb["ref_logprobs"] if reference is None else logprobs_of(reference, mb)
      return (jnp.sum(jnp.where(mask, logprobs_of(policy, mb), 0.0)),
              jnp.sum(jnp.where(mask, ref, 0.0)))

    mismatched = {key[len("kl_"):]: batch[key] for key in kl_keys}
    policy_sums, reference_sums = _scan_or_call(sums, mismatched,
                                                mismatched["tokens"].shape[0])
    return {"examples": examples,
            "kl": kto.kl_reference_point(jnp.sum(policy_sums), jnp.sum(reference_sums),
                                         examples)}

  def microbatch_loss(trainable, mb, totals, frozen, micro_share):
    params, _ = trainable
    model = nnx.merge(graphdef, join_trainable(params, frozen), rest)
    logprobs, _, _, aux = _forward(model, mb, ctx, temperature=1.0, with_values=False,
                                   with_entropy=False, with_router_loss=aux_coef > 0)
    loss, metrics = kto.microbatch_loss(pref_cfg, logprobs, mb, kl=totals["kl"],
                                        denominator=totals["examples"])
    metrics["kl"] = losses.Metric.mean(totals["kl"], 1.0)
    return _with_router_aux(loss, metrics, aux, aux_coef, micro_share)

  def finish_metrics(values, batch):
    return {**kto.finish_metrics(values),
            "examples": jnp.sum(batch["example_mask"]).astype(jnp.float32),
            "desirable": jnp.sum(batch["example_mask"] & batch["desirable"]
                                 ).astype(jnp.float32),
            "tokens": jnp.sum(batch["loss_mask"] != 0).astype(jnp.float32)}

  jitted, run = _jit_update(
      microbatch_loss, optimizer, batch_totals=batch_totals, finish_metrics=finish_metrics,
      reference_logprobs=logprobs_of, lora=lora, reference_in_step=reference_in_step,
      state_shardings=state_shardings, batch_shardings=batch_shardings,
      reference_shardings=models.state_shardings(abstract_params, mesh, rules),
      donate=donate, totals_read_params=True, microbatch_keys=microbatch_keys)

  def step(state: TrainState, batch: Batch, reference=None):
    _check_reference_arg(reference, lora=lora, reference_in_step=reference_in_step)
    _check_example_batch(batch, required, kl_keys, row_multiple)
    return run(state, {key: batch[key] for key in required}, reference)

  step.jitted = jitted
  step.required = required
  return step


def _check_example_batch(batch: Batch, required: tuple[str, ...], kl_keys: tuple[str, ...],
                         row_multiple: int):
  """Shapes of a `kto.pack_examples` batch: per-token keys like tokens `[M, B, T]`, the
  per-slot ones `[M, S]`, the mismatched sequences' like kl_tokens `[K, B, T]`."""
  _check_batch(batch, required, row_multiple)
  shape = np.shape(batch["tokens"])
  for key in kto.TOKEN_KEYS + tuple(k for k in ("ref_logprobs",) if k in required):
    if np.shape(batch[key]) != shape:
      raise ValueError(f"batch[{key!r}] has shape {np.shape(batch[key])}, expected {shape} "
                       "like batch['tokens']")
  slots = np.shape(batch["example_mask"])
  if len(slots) != 2 or slots[0] != shape[0]:
    raise ValueError(f"batch['example_mask'] must be [microbatches, slots] with {shape[0]} "
                     f"micro-batches like batch['tokens'], got shape {slots}")
  if np.shape(batch["desirable"]) != slots:
    raise ValueError(f"batch['desirable'] has shape {np.shape(batch['desirable'])}, "
                     f"expected {slots} like batch['example_mask']")
  if kl_keys:
    kl_shape = np.shape(batch["kl_tokens"])
    if len(kl_shape) != 3 or kl_shape[1:] != shape[1:]:
      raise ValueError(f"batch['kl_tokens'] must be [microbatches, {shape[1]} rows, "
                       f"{shape[2]}] like batch['tokens'] rows, got shape {kl_shape}")
    for key in kl_keys:
      if np.shape(batch[key]) != kl_shape:
        raise ValueError(f"batch[{key!r}] has shape {np.shape(batch[key])}, expected "
                         f"{kl_shape} like batch['kl_tokens']")


def make_reward_model_step(model_cfg: models.ModelConfig,
                           loss_cfg: reward_model.RewardLossConfig,
                           optimizer: optax.GradientTransformation, *, mesh: Mesh,
                           rules: Rules = DEFAULT_RULES, donate: bool = True) -> Callable:
  """Builds `step(state, batch) -> (state, metrics)` training a reward model on pairs.

  The model is a score-head transformer (`value_head=True`, usually `lm_head=False`);
  the batch is `preference.pack_pairs`'s plus `pair_margin` `[M, P]`
  (`reward_model.pair_margins`; zeros for the plain Bradley-Terry loss). The loss is
  `reward_model.microbatch_reward_loss` on the head's values `h . w` (no bias: Hugging
  Face's score layer has none, so the bias stays as it is), plus the router's
  load-balancing loss of a mixture; the update is the RL step's (micro-batch
  accumulation, LoRA adapters alone trained, a non-finite update skipped and reported).

  Args:
    model_cfg: the reward model's architecture.
    loss_cfg: the loss.
    optimizer: the one the state was built with.
    mesh, rules: where the state and the batch live.
    donate: donate the input state's buffers.

  Returns:
    The step; `step.jitted` is the `jax.jit` function, `step.required` the batch keys.
  """
  if not model_cfg.value_head:
    raise ValueError("a reward model needs a score head: build it with value_head=True")
  (graphdef, abstract_params, rest, ctx, state_shardings, data_sharding,
   row_multiple) = _step_layout(model_cfg, optimizer, mesh, rules)
  aux_coef = float(model_cfg.router_aux_loss_coef)
  required = reward_model.TOKEN_KEYS + reward_model.PAIR_KEYS
  batch_shardings = {key: data_sharding for key in reward_model.TOKEN_KEYS}
  # Pair slots are few: replicated, whatever the rows' layout.
  batch_shardings.update({key: NamedSharding(mesh, PartitionSpec())
                          for key in reward_model.PAIR_KEYS})

  def microbatch_loss(trainable, mb, denominators, frozen, micro_share):
    params, _ = trainable
    model = nnx.merge(graphdef, join_trainable(params, frozen), rest)
    aux = None
    if aux_coef > 0:
      h, aux = model.hidden_states(mb["tokens"], mb["positions"], mb["segment_ids"], ctx=ctx,
                                   router_loss=True)
    else:
      h = model.hidden_states(mb["tokens"], mb["positions"], mb["segment_ids"], ctx=ctx)
    values = reward_model.score_values(h, model.value_w[...])
    loss, metrics = reward_model.microbatch_reward_loss(loss_cfg, values, mb,
                                                        denominators=denominators)
    return _with_router_aux(loss, metrics, aux, aux_coef, micro_share)

  def finish_metrics(values, batch):
    return {**values, "pairs": jnp.sum(batch["pair_mask"]).astype(jnp.float32)}

  jitted, run = _jit_update(
      microbatch_loss, optimizer, batch_totals=reward_model.batch_denominators,
      finish_metrics=finish_metrics, reference_logprobs=None, lora=bool(model_cfg.lora_rank),
      reference_in_step=False, state_shardings=state_shardings,
      batch_shardings=batch_shardings, reference_shardings=None, donate=donate)

  def step(state: TrainState, batch: Batch):
    _check_pair_batch(batch, required, reward_model.TOKEN_KEYS, row_multiple)
    return run(state, {key: batch[key] for key in required})

  step.jitted = jitted
  step.required = required
  return step


def _check_pair_batch(batch: Batch, required: tuple[str, ...], token_keys: tuple[str, ...],
                      row_multiple: int):
  """Shapes of a packed pair batch: the per-token keys like tokens `[M, B, T]`, the
  per-pair ones (pair_mask, and pair_margin when required) `[M, P]`."""
  _check_batch(batch, required, row_multiple)
  shape = np.shape(batch["tokens"])
  for key in token_keys:
    if np.shape(batch[key]) != shape:
      raise ValueError(f"batch[{key!r}] has shape {np.shape(batch[key])}, expected {shape} "
                       "like batch['tokens']")
  pair_shape = np.shape(batch["pair_mask"])
  if len(pair_shape) != 2 or pair_shape[0] != shape[0]:
    raise ValueError(f"batch['pair_mask'] must be [microbatches, pairs] with {shape[0]} "
                     f"micro-batches like batch['tokens'], got shape {pair_shape}")
  if "pair_margin" in required and np.shape(batch["pair_margin"]) != pair_shape:
    raise ValueError(f"batch['pair_margin'] has shape {np.shape(batch['pair_margin'])}, "
                     f"expected {pair_shape} like batch['pair_mask'] "
                     "(reward_model.pair_margins)")


# ---------------------------------------------------------------------------------------
# Critic advantages (PPO)
# ---------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("gamma", "lam", "kl_coef", "kl_estimator"))
def _gae(rewards, values, mask, segment_ids, old_logprobs, ref_logprobs, *, gamma, lam,
         kl_coef, kl_estimator):
  shape = rewards.shape

  def rows(x):  # [M, B, T] -> [M*B, T]: GAE runs per row, whitening over the whole batch.
    return None if x is None else x.reshape(-1, shape[-1])

  token_rewards = rows(rewards)
  if kl_coef > 0:
    token_rewards = losses.kl_penalized_rewards(
        token_rewards, rows(old_logprobs), rows(ref_logprobs), rows(mask), kl_coef=kl_coef,
        estimator=kl_estimator)
  adv, returns = advantages_lib.gae_advantages(token_rewards, rows(values), rows(mask),
                                               gamma=gamma, lam=lam,
                                               segment_ids=rows(segment_ids))
  return adv.reshape(shape), returns.reshape(shape)


def add_gae_advantages(batch: Batch, values, algo_cfg: Mapping[str, Any]) -> dict:
  """PPO: the batch plus GAE `advantages`, `returns` and `old_values` from critic values.

  Rewards are the per-target `rewards` (packing puts a sequence's reward on its last
  trained target), minus `kl_coef * KL(old policy || reference)` per token when the preset
  puts the KL in the reward (needs `old_logprobs` and `ref_logprobs`). Call it once on the
  whole rollout batch: advantages are whitened over all of its tokens.

  Args:
    batch: `[M, B, T]` arrays with `rewards`, `loss_mask` and optionally `segment_ids`.
    values: `[M, B, T]` critic values, e.g. `compute_logprobs(params, batch)["values"]`.
    algo_cfg: the preset (`gamma`, `lam`, `kl_coef`, `kl_estimator`, `kl_in_reward`).
  """
  for key in ("rewards", "loss_mask"):
    if key not in batch:
      raise ValueError(f"GAE needs batch[{key!r}]; the batch has {sorted(batch)}")
  kl_coef = float(algo_cfg["kl_coef"]) if algo_cfg.get("kl_in_reward") else 0.0
  if kl_coef > 0 and not {"old_logprobs", "ref_logprobs"} <= set(batch):
    raise ValueError("a KL penalty in the reward needs batch['old_logprobs'] and "
                     "batch['ref_logprobs']")
  adv, returns = _gae(batch["rewards"], values, batch["loss_mask"], batch.get("segment_ids"),
                      batch.get("old_logprobs"), batch.get("ref_logprobs"),
                      gamma=float(algo_cfg["gamma"]), lam=float(algo_cfg["lam"]),
                      kl_coef=kl_coef, kl_estimator=str(algo_cfg["kl_estimator"]))
  return {**batch, "advantages": adv, "returns": returns, "old_values": values}


# ---------------------------------------------------------------------------------------
# PPO epochs and minibatches
# ---------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(2,))
def _gather_rows(batch, rows, num_micro):
  """Rows (flat indices into M*B) of `batch`, regrouped as `num_micro` micro-batches."""
  def take(x):
    flat = x.reshape((-1,) + x.shape[2:])
    picked = jnp.take(flat, rows, axis=0)
    return picked.reshape((num_micro, -1) + x.shape[2:])
  return jax.tree.map(take, batch)


def ppo_update(train_step: Callable, state: TrainState, batch: Batch, *, epochs: int,
               minibatches: int, shuffle: bool = True, seed: int = 0):
  """Several optimizer steps over one rollout batch: `epochs` passes of `minibatches` steps.

  Each minibatch takes M / minibatches of the batch's M micro-batches (rows shuffled per
  epoch on the host, so nothing waits on the device). Call it with `old_logprobs` in the
  batch (from `compute_logprobs` before the first update) when `epochs * minibatches > 1`.

  Returns:
    `(state, metrics)`: metrics is a list with one dict of device scalars per step.
  """
  num_micro, rows = np.shape(batch["tokens"])[:2]
  if epochs < 1 or minibatches < 1:
    raise ValueError(f"epochs and minibatches must be >= 1, got {epochs} and {minibatches}")
  if num_micro % minibatches:
    raise ValueError(f"minibatches={minibatches} does not divide the batch's {num_micro} "
                     f"micro-batches")
  if epochs * minibatches > 1 and "old_logprobs" not in batch:
    raise ValueError("several updates per rollout batch need batch['old_logprobs'] "
                     "(compute_logprobs of the params that sampled it)")
  per_step = num_micro // minibatches
  batch = {k: v for k, v in batch.items() if k in TOKEN_KEYS + ROW_KEYS + (ROUTING_KEY,)}
  rng = np.random.default_rng(seed)
  history = []
  for _ in range(epochs):
    order = rng.permutation(num_micro * rows) if shuffle else np.arange(num_micro * rows)
    for k in range(minibatches):
      if minibatches == 1 and not shuffle:
        minibatch = batch
      else:
        chunk = order[k * per_step * rows:(k + 1) * per_step * rows]
        minibatch = _gather_rows(batch, jnp.asarray(chunk, jnp.int32), per_step)
      state, metrics = train_step(state, minibatch)
      history.append(metrics)
  return state, history
