"""Training a reward model on preference pairs: `objective="reward_model"` runs.

    python -m launch.train --config=configs/reward_model_tiny.py --workdir=/tmp/rm

The model is the run's transformer with a score head in place of the vocabulary
projection (`value_head=True, lm_head=False`; Hugging Face's `*ForSequenceClassification`
with one label). It starts from `init_from` (a Hugging Face folder: a causal LM, whose
trunk it keeps and whose head it drops, or a reward model to train further) or from random
weights, and trains with the Bradley-Terry loss (`posttrain.rl.reward_model`) on the pair
files of `rm.data` (`posttrain.data.preference`: TRL's formats, with an optional
`"margin"` per row). Every `rm.eval_every` steps and at the end it logs the held-out
pairs' loss and accuracy (`eval_rm/*`, from `rm.eval_data`). Checkpoints and resume work
as for a policy run (params, optimizer, step, data position). `export_hf` writes the
result as a Hugging Face sequence-classification folder, which an RL run reads with
`--config.reward_model.path=DIR`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from posttrain import distributed, models
from posttrain.checkpoint import CheckpointManager, PreemptionFlag
from posttrain.data.preference import PreferenceData
from posttrain.data.tokenizer import load_tokenizer
from posttrain.experiment import (abstract_checkpoint, build_mesh, check_config,
                                  data_cache_dir, from_checkpoint, objective,
                                  reward_model_config, to_checkpoint)
from posttrain.metrics import MetricsWriter, Progress
from posttrain.rl import losses as loss_lib
from posttrain.rl import preference, reward_model
from posttrain.rl import state as rl_state
from posttrain.rl import train_step as ts

log = logging.getLogger(__name__)

# Keys of a policy run that an objective=reward_model run has no use for: set, they are
# an error rather than silently ignored.
_POLICY_STAGES = (("sft.steps", "sft"), ("preference.steps", "preference"),
                  ("train.rl_steps", "RL"))


def _check(config) -> None:
  """One-line errors for an objective=reward_model config, before anything is built."""
  r = config.get("rm")
  if r is None:
    raise ValueError("objective=reward_model needs the config section rm (see "
                     "configs/reward_model_tiny.py)")
  for key, stage in _POLICY_STAGES:
    section, name = key.split(".")
    if int((config.get(section) or {}).get(name, 0) or 0) > 0:
      raise ValueError(f"objective=reward_model trains only a reward model: set {key}=0 "
                       f"(the {stage} stage is for a policy)")
  for key, low in (("steps", 1), ("batch_size", 1), ("eval_every", 0), ("warmup", 0)):
    if int(r.get(key, 0)) < low:
      raise ValueError(f"rm.{key}={r.get(key)!r} must be >= {low}")
  if not float(r.get("lr", 0)) > 0:
    raise ValueError(f"rm.lr={r.get('lr')!r} must be > 0")
  if not r.get("data"):
    raise ValueError("objective=reward_model needs rm.data: JSON-lines files of preference "
                     "pairs (posttrain.data.preference)")
  reward_model.RewardLossConfig(center_coef=float(r.get("center_coef", 0.0)))
  src = str(config.get("init_from", "") or "")
  if src and not os.path.exists(os.path.join(src, "config.json")):
    raise ValueError(f"init_from={src!r}: a reward model starts from a Hugging Face folder "
                     "(config.json), a causal LM or a reward model; export a policy run "
                     "with export_hf first")


@dataclasses.dataclass
class RewardProgress:
  """Where the run is; stored in every checkpoint's extras."""

  step: int = 0
  iterator: dict | None = None
  heldout: dict | None = None  # the last held-out metrics (rm.eval_data)


class RewardModelTrainer:
  """Holds the pieces of one reward-model run; `run()` trains to `rm.steps`."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    if "://" in str(workdir):
      raise ValueError(f"workdir {workdir!r} is a URL; the trainer writes through the local "
                       "filesystem: mount the bucket and pass the mount path")
    check_config(config)
    if objective(config) != "reward_model":
      raise ValueError(f"objective={objective(config)}: the reward-model trainer needs "
                       "objective=reward_model")
    _check(config)
    self.config, self.workdir = config, workdir
    r = config.rm
    self.seed = int(config.seed)
    self.loss_cfg = reward_model.RewardLossConfig(center_coef=float(r.get("center_coef", 0.0)))
    self.mesh = build_mesh(config)
    self.rules = models.rules_from_config(config.get("sharding_rules") or None)
    self.tok = load_tokenizer(config.tokenizer)
    self.cfg = reward_model_config(config, self.tok.vocab_size)
    if config.get("export_hf"):  # at the start, not after the run
      models.hf.check_exportable(self.cfg)
    t = config.train
    self.row_len, self.rows_per_mb = int(t.row_len), int(t.rows_per_microbatch)
    batch_devices = int(np.prod([self.mesh.shape[a] for a in self.mesh.axis_names
                                 if a in ("data", "fsdp")]))
    if self.rows_per_mb % batch_devices:
      raise ValueError(f"train.rows_per_microbatch={self.rows_per_mb} must be a multiple of "
                       f"the data x fsdp mesh size {batch_devices}")
    cache = data_cache_dir(config, workdir)
    self.data = PreferenceData.from_files(r.data, self.tok, row_len=self.row_len,
                                          cache_dir=cache)
    self.eval_data = (PreferenceData.from_files(r.eval_data, self.tok, row_len=self.row_len,
                                                cache_dir=cache)
                      if r.get("eval_data") else None)
    log.info("reward model data: %d pairs (%d with identical answers); %d steps of %d are "
             "%.2f epochs", len(self.data), self.data.identical, int(r.steps),
             int(r.batch_size), int(r.steps) * int(r.batch_size) / len(self.data))
    o = config.optim
    self.optimizer = rl_state.make_optimizer(float(r.lr), int(r.warmup),
                                             max(int(r.steps), int(r.warmup) + 1),
                                             float(o.weight_decay),
                                             float(o.clip) if o.clip else None)
    os.makedirs(workdir, exist_ok=True)
    ck = config.checkpoint
    self.ckpt = CheckpointManager(os.path.join(workdir, "checkpoints"),
                                  save_every=int(ck.every), keep_last=int(ck.keep_last),
                                  keep_every=int(ck.keep_every) or None,
                                  async_save=bool(ck.async_save))
    self.writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
    self.progress = RewardProgress()
    self._graphdef, _, self._rest = ts._split_abstract(self.cfg)
    self._step_fn = None
    self._eval_fn = None
    self._setup_state()

  # -- state ------------------------------------------------------------------------------

  def _init_model(self) -> models.Transformer:
    src = str(self.config.get("init_from", "") or "")
    if not src:
      return models.create_model(self.cfg, mesh=self.mesh, rules=self.rules, seed=self.seed)
    # reward_model_config read the folder's config.json: the model is the run's.
    return models.from_pretrained(src, mesh=self.mesh, rules=self.rules, seed=self.seed,
                                  **{f.name: getattr(self.cfg, f.name)
                                     for f in dataclasses.fields(self.cfg)})

  def _setup_state(self):
    abstract = abstract_checkpoint(self.cfg, self.optimizer, self.mesh, self.rules)
    restored = self.ckpt.restore(abstract)
    if restored is not None:
      state, extras, step = restored
      self.state = from_checkpoint(state)
      self.progress = RewardProgress(**extras["progress"])
      log.info("resumed from checkpoint %d (reward model step %d)", step, self.progress.step)
      self.resumed_from = step
      return
    model = self._init_model()
    if (model.cfg.num_layers, model.cfg.d_model, model.cfg.vocab_size) != (
        self.cfg.num_layers, self.cfg.d_model, self.cfg.vocab_size):
      raise ValueError(f"init_from={self.config.init_from!r} holds a model of "
                       f"{model.cfg.num_layers} layers, d_model {model.cfg.d_model}, vocab "
                       f"{model.cfg.vocab_size}; the config's preset has "
                       f"{self.cfg.num_layers}, {self.cfg.d_model}, {self.cfg.vocab_size}: "
                       "set model.preset to match")
    self.state = rl_state.init_train_state(model, self.optimizer, mesh=self.mesh,
                                           rules=self.rules, seed=self.seed)
    self.resumed_from = None

  def _model(self) -> models.Transformer:
    return nnx.merge(self._graphdef, self.state.params, self._rest)

  def save(self, force: bool = False) -> bool:
    extras = {"progress": dataclasses.asdict(self.progress),
              "config": json.loads(self.config.to_json_best_effort())}
    return self.ckpt.save(self.progress.step, to_checkpoint(self.state), extras, force=force)

  # -- training ---------------------------------------------------------------------------

  def _batch(self, pairs) -> dict[str, np.ndarray]:
    batch = preference.pack_pairs(pairs, self.row_len, rows_per_microbatch=self.rows_per_mb,
                                  pad_id=self.tok.pad_id)
    batch["pair_margin"] = reward_model.pair_margins(pairs, batch)
    return batch

  def run(self) -> dict[str, Any]:
    r = self.config.rm
    total, every = int(r.steps), int(r.eval_every)
    flag = PreemptionFlag()
    try:
      if self._step_fn is None:
        self._step_fn = ts.make_reward_model_step(self.cfg, self.loss_cfg, self.optimizer,
                                                  mesh=self.mesh, rules=self.rules)
      it = iter(self.data.dataset(self.seed).to_iter_dataset())
      if self.progress.iterator:
        it.set_state(self.progress.iterator)
      progress = Progress(total, "reward model", start_step=self.progress.step)
      # Steps run asynchronously: the time per step is the interval's between two logs.
      t_log, step_log = time.time(), self.progress.step
      while self.progress.step < total:
        if flag.reached(self.progress.step):
          self.save(force=True)
          return self._finish("preempted")
        pairs = [next(it) for _ in range(int(r.batch_size))]
        batch = self._batch(pairs)
        self.state, metrics = self._step_fn(self.state, batch)
        self.progress.step += 1
        self.progress.iterator = it.get_state()
        step = self.progress.step
        if step % int(self.config.train.log_every) == 0 or step == total:
          metrics = jax.device_get(metrics)
          step_s = (time.time() - t_log) / max(step - step_log, 1)
          row = self.writer.write(step, {
              **{f"rm/{k}": v for k, v in metrics.items()
                 if k.startswith(("loss/", "rewards/"))},
              "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
              "learning_rate": metrics["learning_rate"], "nonfinite": metrics["nonfinite"],
              "rm/truncated": int(batch["truncated"]), "timing/step_s": step_s})
          progress.line(step, {"loss": row["rm/loss/reward_model"],
                               "acc": row["rm/rewards/accuracy"],
                               "margin": row["rm/rewards/margin"]})
          if row["nonfinite"]:
            log.warning("reward model step %d: non-finite loss or gradient; the update was "
                        "skipped", step)
        if self.eval_data is not None and every and step % every == 0 and step < total:
          self.progress.heldout = self.heldout()
        if self.ckpt.should_save(step):
          self.save()
        if step % int(self.config.train.log_every) == 0:
          t_log, step_log = time.time(), step
      if self.eval_data is not None:
        self.progress.heldout = self.heldout()
      self.save(force=True)
      return self._finish("done")
    finally:
      flag.close()

  def heldout(self) -> dict[str, float]:
    """Loss, accuracy and rewards of rm.eval_data's pairs under the current model, one
    forward pass per micro-batch, and the accuracy of each `"domain"` the rows name;
    written as eval_rm/<name> and eval_rm/accuracy/<domain>."""
    cfg, ctx = self.loss_cfg, models.ShardingContext(self.mesh, self.rules)
    if self._eval_fn is None:
      graphdef, rest = self._graphdef, self._rest

      def eval_fn(params, batch):
        model = nnx.merge(graphdef, params, rest)

        def one(mb):
          h = model.hidden_states(mb["tokens"], mb["positions"], mb["segment_ids"], ctx=ctx)
          values = reward_model.score_values(h, model.value_w[...])
          ones = {"pairs": jnp.float32(1)}
          metrics = reward_model.microbatch_reward_loss(cfg, values, mb, denominators=ones)[1]
          return metrics, reward_model.pair_scores(values, mb)

        metrics, scores = jax.lax.map(one, batch)
        return loss_lib.merge_stacked_metrics(metrics), scores

      sharding = ts.batch_sharding(self.mesh, self.rules)
      replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      shardings = {**{k: sharding for k in reward_model.TOKEN_KEYS},
                   **{k: replicated for k in reward_model.PAIR_KEYS}}
      self._eval_fn = (jax.jit(eval_fn, out_shardings=replicated), shardings)
    fn, shardings = self._eval_fn
    data, merged = self.eval_data.examples, None
    right: dict[str, list[bool]] = {}
    per_call = self.rows_per_mb * 2
    for start in range(0, len(data), per_call):
      pairs = data[start:start + per_call]
      batch = self._batch(pairs)
      inputs = distributed.put({k: batch[k] for k in shardings}, shardings)
      metrics, (chosen, rejected) = fn(self.state.params, inputs)
      merged = metrics if merged is None else loss_lib.merge_metrics(merged, metrics)
      chosen, rejected = np.asarray(chosen), np.asarray(rejected)
      for m, k in zip(*np.nonzero(batch["pair_mask"])):
        domain = pairs[int(batch["pair_index"][m, k])].get("domain")
        if domain is not None:
          right.setdefault(domain, []).append(bool(chosen[m, k] > rejected[m, k]))
    report = {k: float(v) for k, v in loss_lib.compute_metrics(merged).items()}
    report["pairs"] = len(data)
    report.update({f"accuracy/{d}": float(np.mean(v)) for d, v in sorted(right.items())})
    self.writer.write(self.progress.step, {f"eval_rm/{k}": v for k, v in report.items()})
    log.info("held-out reward model: accuracy %.3f, margin %.4f, loss %.4f over %d pairs",
             report["rewards/accuracy"], report["rewards/margin"],
             report["loss/reward_model"], len(data))
    return report

  def _finish(self, status: str) -> dict[str, Any]:
    self.ckpt.wait()
    summary: dict[str, Any] = {"status": status, "objective": "reward_model",
                               "rm_steps": self.progress.step}
    if self.progress.heldout is not None:
      summary["rm_heldout"] = self.progress.heldout
    if status == "done":
      if jax.process_index() == 0:
        with open(os.path.join(self.workdir, "summary.json"), "w") as fh:
          json.dump(summary, fh, indent=2)
      export = str(self.config.get("export_hf", "") or "")
      if export:
        models.save_pretrained(self._model(), export, pad_token_id=self.tok.pad_id)
        if jax.process_index() == 0:  # with its tokenizer's files, when it has any
          self.tok.save(export)
        log.info("exported the reward model to %s", export)
    self.writer.close()
    return summary


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains a reward model to `rm.steps` (resuming from `workdir` if it holds a checkpoint)."""
  return RewardModelTrainer(config, workdir).run()
