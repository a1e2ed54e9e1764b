"""The trainer: an optional SFT warm start, optional preference optimisation (DPO and its
variants on pair files), then RL on the scheduler's multi-domain stream.

    summary = trainer.train(config, workdir)

Colocated placement: the sampler and the learner share one mesh and the sampler always
holds the current weights (on-policy). With reward_model.path set, a frozen learned reward
model on the rollout devices scores the RL samples as they come out of the rollout, and
its scores are mixed into their rewards (`posttrain.tasks.reward_model.mix_rewards`).
With distill.teacher set, a frozen teacher on the train devices reads each RL batch:
every sampled token's advantage gains its distillation term
(`posttrain.rl.advantages.distillation_advantages`, distill.loss=sampled), or the update
adds the whole-vocabulary divergence to the teacher (`models.chunked_divergence`,
distill.loss=reverse_kl | forward_kl).
Everything a run needs to continue exactly lives in the checkpoint: params, optimizer
state, step, RNG, policy version, scheduler state, the grain iterator states of the SFT
and preference streams and the config. Restarting with the same workdir resumes from the
latest complete checkpoint; SIGTERM/SIGINT write one and stop.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import queue
import threading
import time
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from posttrain import distributed, evaluation, majority_vote, models
from posttrain.experiment import (abstract_checkpoint, algorithm, build_meshes, check_config,
                                  data_cache_dir, distill_stages, distill_teacher, eval_domains,
                                  from_checkpoint, frozen_references, initial_model,
                                  model_config, objective, reward_model_domains,
                                  rollout_reasoning, rollout_thinking, rollout_tool_format,
                                  run_domains,
                                  teacher_config, to_checkpoint)
from posttrain.checkpoint import CheckpointManager, PreemptionFlag
from posttrain.data.preference import PreferenceData, UnpairedData
from posttrain.data.sft import SFTData
from posttrain.data.tokenizer import load_tokenizer, with_thinking
from posttrain.metrics import MetricsWriter, Progress
from posttrain.rl import advantages as adv_lib
from posttrain.rl import losses as loss_lib
from posttrain.rl import kto, packing, preference, presets
from posttrain.rl import state as rl_state
from posttrain.rl import train_step as ts
from posttrain.rollout import FairLock, RolloutWorker, group_to_trajectories, task_messages
from posttrain.rollout import reward_model as reward_model_lib
from posttrain.sampling import Sampler
from posttrain.tasks import Scheduler, registry, train_seed
from posttrain.tasks.reward_model import mix_rewards, verifier_value
from posttrain.tasks.scheduler import dynamic_sample

log = logging.getLogger("posttrain")


class RolloutStalledError(RuntimeError):
  """The rollouts cannot produce a trainable batch with this config (a budget no group
  finishes in, or no informative group within max_draws)."""


class NonFiniteLossError(RuntimeError):
  """The loss or gradient became NaN/inf; a checkpoint was written for inspection."""


# ----------------------------------------------------------------------------------------
# Set-up
# ----------------------------------------------------------------------------------------


def _sft_algorithm() -> ml_collections.ConfigDict:
  # Supervised fine-tuning as the on-policy surrogate with advantage 1: the gradient of
  # -A * exp(logp - stop_gradient(logp)) is exactly -grad(logp), so one train step serves both.
  return presets.algorithm_config("grpo", kl_coef=0.0, entropy_coef=0.0,
                                  loss_agg_mode="token_mean", tis_cap=0.0)


@dataclasses.dataclass
class Progress_:
  """Where the run is; stored in every checkpoint's extras."""

  stage: str = "sft"            # sft | preference | rl | done
  sft_step: int = 0
  pref_step: int = 0
  rl_step: int = 0
  policy_version: int = 0
  sft_iterator: dict | None = None
  scheduler: dict | None = None
  sft_eval: dict | None = None
  sft_nll: float | None = None  # held-out NLL per token after SFT (sft.eval_data)
  pref_iterator: dict | None = None
  pref_eval: dict | None = None     # pass rates after the preference stage
  pref_heldout: dict | None = None  # held-out pair metrics (preference.eval_data)
  kl_coef: float | None = None  # the adaptive KL controller's value for the next RL step
  # LoRA: the steps of earlier stages whose trained adapters were folded into the base
  # weights (`Trainer._enter_stage`); the adapters alone are not the run's update then.
  folded_steps: int = 0


# ----------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------


def _to_batch(trajectories, *, row_len: int, rows_per_mb: int, micro_multiple: int,
              pad_id: int) -> dict[str, np.ndarray]:
  """Packs trajectories into [M, rows_per_mb, row_len]; M rounds up to a power of two
  (times micro_multiple) so a run compiles a handful of step programs."""
  packed = packing.pack_trajectories(trajectories, row_len, truncate=True, pad_id=pad_id)
  rows = packed["tokens"].shape[0]
  needed = max(1, -(-rows // rows_per_mb))
  micro = 1 << (needed - 1).bit_length()
  micro = -(-micro // micro_multiple) * micro_multiple
  return packing.split_microbatches(packed, rows_per_mb * row_len, num_microbatches=micro,
                                    pad_id=pad_id)


def _turn_by_turn(tok, messages: list[dict], demo: list[dict], tools, thinking
                  ) -> tuple[list[int], list[int]]:
  """(ids, mask) of a multi-turn demonstration as a rollout transcript holds it, where
  every generation prompt opens the reasoning block (Qwen3.5's): the rollouts' prompt;
  each assistant turn as the model writes it after a prompt (the conversation so far
  rendered with that turn last, an empty block closed, after the conversation with a
  generation prompt), trained; each other message as the rollout continues after a turn
  (`continuation`), not trained. A template renders an earlier turn without its empty
  block, so the whole conversation rendered at once would start each turn elsewhere
  than the rollouts' prompts do."""
  ids = tok.encode_chat(messages, add_generation_prompt=True, thinking=thinking,
                        tools=tools)[0]
  mask, so_far = [0] * len(ids), list(messages)
  for m in demo:
    if m.get("role") != "assistant":
      more = tok.chat.continuation([m], ended=True, thinking=thinking)
      ids, mask = ids + more, mask + [0] * len(more)
      so_far.append(m)
      continue
    m = dict(m, reasoning_content=m.get("reasoning_content") or "")
    before = tok.encode_chat(so_far, add_generation_prompt=True, thinking=thinking,
                             tools=tools)[0]
    full, own = tok.encode_chat(so_far + [m], thinking=thinking, tools=tools)
    last = max((i for i, o in enumerate(own) if o), default=-1) + 1
    if full[:len(before)] != before or last <= len(before):
      raise ValueError("the chat template does not render an assistant turn after the "
                       "generation prompt it opens; cannot write the demonstration as a "
                       "rollout's turns")
    turn = full[len(before):last]
    ids, mask = ids + turn, mask + [1] * len(turn)
    so_far.append(m)
  return ids, mask


def _sft_example(domains: list[str], tok, index: int, system_prompt: str = "",
                 thinking=None, tool_format: str = "text") -> dict[str, np.ndarray]:
  """The index-th demonstration: domains round-robin, training seeds in order; in the
  rollouts' conversation (their system prompt, reasoning switch and tool format)."""
  domain = registry.get(domains[index % len(domains)])
  task = domain.sample(train_seed(index // len(domains)))
  if tool_format == "native" and hasattr(domain, "native_tools"):
    prompt, tools = domain.native_tools(task)
    messages = task_messages(dataclasses.replace(task, prompt=prompt), system_prompt)
    if tok.chat.opens_reasoning:
      ids, mask = _turn_by_turn(tok, messages, domain.native_demonstration(task), tools,
                                thinking)
    else:
      ids, mask = tok.encode_chat(messages + domain.native_demonstration(task),
                                  thinking=thinking, tools=tools)
  else:
    demo = {"role": "assistant", "content": domain.demonstration(task)}
    if tok.chat.opens_reasoning:  # open as the rollouts' prompt does: an empty block
      demo["reasoning_content"] = ""
    ids, mask = tok.encode_chat(task_messages(task, system_prompt) + [demo],
                                thinking=thinking)
  first = mask.index(1)
  return {"prompt_tokens": np.asarray(ids[:first], np.int32),
          "response_tokens": np.asarray(ids[first:], np.int32),
          "response_mask": np.asarray(mask[first:], np.int32),
          "advantages": np.float32(1.0)}


def sft_dataset(domains: list[str], tok, seed: int, shard: tuple[int, int] = (0, 1),
                system_prompt: str = "", thinking=None, tool_format: str = "text"):
  """An endless, shuffled grain stream of demonstrations; its iterator state checkpoints.

  With `shard=(i, n)` the stream is every n-th element from the i-th: process i of n
  loads only its share, and the n shards interleaved are the unsharded stream.
  """
  index, count = shard
  if not 0 <= index < count:
    raise ValueError(f"shard index {index} is out of range for {count} shards")
  ds = grain.MapDataset.range(1 << 40).shuffle(seed=seed)
  if count > 1:
    ds = ds[index::count]
  return ds.map(lambda i: _sft_example(domains, tok, int(i), system_prompt, thinking,
                                       tool_format))


def sft_iterator_state(saved: dict, shards: int) -> dict:
  """A saved SFT iterator state (`{"next_index": k, "shards": n}`: k demonstrations into
  each of n shards) as the state of one of `shards` shards at the same global position."""
  state = dict(saved)
  saved_shards = int(state.pop("shards", 1))
  if saved_shards != shards:
    state["next_index"] = int(state["next_index"]) * saved_shards // shards
  return state


# ----------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------


def _process_cpu_s() -> float:
  t = os.times()
  return t.user + t.system


def _greedy_group(group):
  """ReMax: the group with its greedy baseline completion as its only sample."""
  if getattr(group, "baseline", None) is None:
    raise RuntimeError(f"advantage_estimator=remax needs each group's greedy baseline, and "
                       f"the group of {group.domain!r} seed {group.seed} has none (groups "
                       "get one in Trainer._rollout)")
  return dataclasses.replace(group, samples=[group.baseline], baseline=None)


class Trainer:
  """Holds the pieces of one run; `run()` executes the remaining stages."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    if "://" in str(workdir):
      # os.makedirs("gs://b/run") would make a local "gs:" folder and split the run between
      # it (metrics, evaluations) and the bucket (Orbax's checkpoints).
      raise ValueError(f"workdir {workdir!r} is a URL; the trainer writes through the local "
                       "filesystem: mount the bucket (gcsfuse, see launch/tpu_pod.sh) and "
                       "pass the mount path")
    check_config(config)
    if objective(config) != "policy":
      raise ValueError(f"objective={objective(config)} trains no policy: run it with "
                       "posttrain.reward_trainer.train (launch.train picks it)")
    rm = config.get("reward_model")
    self.rm_path = str(rm.get("path", "") or "") if rm is not None else ""
    if self.rm_path:  # a folder that is no reward model fails here, before anything is built
      reward_model_lib.reward_model_config(self.rm_path)
    self.config, self.workdir = config, workdir
    os.makedirs(workdir, exist_ok=True)
    self.seed = int(config.seed)
    self.mesh, self.rollout_mesh = build_meshes(config)
    if jax.process_count() > 1 and not distributed.use_coordination_barriers():
      log.warning("absl flags are not parsed: Orbax synchronises processes with device "
                  "collectives, which can hang a disaggregated multi-host run")
    placement = config.get("placement") or ml_collections.ConfigDict(dict(mode="colocated"))
    self.disaggregated = placement.get("mode", "colocated") == "disaggregated"
    self.sync_every = max(int(placement.get("sync_every", 1) or 1), 1)
    self.max_policy_lag = int(placement.get("max_policy_lag", 0) or 0)
    self.partial = str(placement.get("partial", "resume"))
    # Partial rollouts across steps: each rollout generates at most this many tokens per
    # row; unfinished groups continue in the next step's rollout (0 = off).
    self.step_tokens = int(placement.get("step_tokens", 0) or 0)
    if self.partial not in ("resume", "drop"):
      raise ValueError(f"placement.partial={self.partial!r}; expected resume or drop")
    # When rollout weights change in a disaggregated run. between_batches: only between
    # two batches, at a fixed point (batch j samples with version j - max_policy_lag), so
    # a run repeats exactly; several processes need it (every host swaps at the same
    # point). in_flight: as soon as the learner syncs, mid-batch too (fresher samples,
    # timing-dependent). auto: between_batches on several processes, else in_flight.
    self.weight_swap = str(placement.get("weight_swap", "auto"))
    if self.weight_swap not in ("auto", "between_batches", "in_flight"):
      raise ValueError(f"placement.weight_swap={self.weight_swap!r}; expected auto, "
                       "between_batches or in_flight")
    if self.weight_swap == "in_flight" and jax.process_count() > 1:
      raise ValueError("placement.weight_swap=in_flight needs a single process: with "
                       f"{jax.process_count()} every host must swap weights at the same "
                       "point (use between_batches or auto)")
    if self.weight_swap == "auto":
      self.weight_swap = "between_batches" if jax.process_count() > 1 else "in_flight"
    # On the CPU backend a process's devices share its host threads, and two programs that
    # span processes, dispatched in opposite orders on two hosts (the learner's update and
    # the rollout thread's sampling), deadlock even on disjoint devices. There the learner
    # and the rollout thread take turns on the devices, in the same order on every host
    # (no overlap); accelerators run both at once.
    self.alternate = (self.disaggregated and jax.process_count() > 1
                      and jax.default_backend() == "cpu")
    if self.alternate:
      log.info("disaggregated on CPU across %d processes: the learner and the rollouts take "
               "turns on the devices", jax.process_count())
    # Fair: the learner waiting to sync gets it whenever the rollout thread lets go.
    self._sampler_lock = FairLock()
    self._sync_path_logged = False
    self.sampler_version = 0
    self.rules = models.rules_from_config(config.get("sharding_rules") or None)
    self.tok = load_tokenizer(config.tokenizer)
    # SFT and preference files' conversations under the rollouts' reasoning switch.
    self._data_tok = with_thinking(self.tok, rollout_thinking(config))
    self.cfg = model_config(config, self.tok.vocab_size)
    if config.get("export_hf"):  # at the start, not after the run
      models.hf.check_exportable(self.cfg)
    self.domains = run_domains(config)
    self.rm_domains = set(reward_model_domains(config, self.domains)) if self.rm_path else set()
    self.reward_source = str(config.rollout.get("reward_source", "verifier"))
    self._check_reward_source()
    self.algo = algorithm(config)
    if self.algo.routing_replay != "none" and not self.cfg.num_experts:
      raise ValueError(f"rl.routing_replay={self.algo.routing_replay!r} replays a mixture's "
                       f"experts; this model ({self.cfg.architecture}) has none")
    t = config.train
    self.row_len, self.rows_per_mb = int(t.row_len), int(t.rows_per_microbatch)
    self.sft_data, self.sft_eval_data = self._load_sft_data(config.sft)
    self.pref_cfg, self.pref_data, self.pref_eval_data = self._load_preference(config)
    self._check_foldable()
    if self.step_tokens and self.algo.dynamic_sampling:
      raise ValueError("placement.step_tokens (partial rollouts across steps) cannot be "
                       "combined with dynamic sampling")
    multi = [d for d in self.domains if registry.get(d).multi_turn]
    if multi and int(config.rollout.max_turns) < 2:
      log.warning("%d multi-turn domains (%s%s) with rollout.max_turns=%s: a tool call "
                  "ends the sample unanswered; set rollout.max_turns (e.g. 4)", len(multi),
                  multi[0], ", ..." if len(multi) > 1 else "", config.rollout.max_turns)
    if self.step_tokens and int(config.rollout.max_turns) != 1:
      raise ValueError("placement.step_tokens (partial rollouts across steps) needs "
                       f"rollout.max_turns=1, got {config.rollout.max_turns}")
    # Online preference optimisation (algorithm online_dpo): pairs from each group, the
    # preference step instead of the policy-gradient one.
    self.online_pref = presets.preference_config(self.algo)
    self._reward_kl = float("nan")  # the batch's KL in the reward, for the KL controller
    self.teacher_path = distill_teacher(config)
    stages = distill_stages(config)
    # The teacher joins RL and / or SFT (distill.stages).
    self.rl_teacher = "rl" in stages
    self.sft_teacher = "sft" in stages and int(config.sft.steps) > 0
    # distill.loss: "sampled" adds each sampled token's log-prob gap to its advantage;
    # reverse_kl / forward_kl add the whole-vocabulary divergence as a loss in the step.
    self.distill_in_step = self.rl_teacher and str(
        config.distill.get("loss", "sampled")) != "sampled"
    self.teacher_cfg = self._check_distill() if self.teacher_path else None
    self.teacher_params = None
    self._distill_stats: dict[str, float] = {}
    off_policy = (self.disaggregated and self.max_policy_lag > 0) or self.step_tokens > 0
    if off_policy and float(self.algo.tis_cap) == 0 and self.online_pref is None:
      # Stale samples are corrected with truncated importance weights (Yao et al. 2025).
      self.algo.tis_cap = 2.0
      log.info("samples from older policies (disaggregated with max_policy_lag>0, or "
               "partial rollouts across steps): truncated importance weights, cap 2")
    self.eval_domains = eval_domains(config)
    sched = dict(config.scheduler)
    rule = sched.pop("rule")
    self.scheduler = Scheduler(self.domains, rule=rule, seed=self.seed, **sched)
    batch_devices = math.prod(self.mesh.shape[a] for a in self.mesh.axis_names
                              if a in ("data", "fsdp"))
    if self.rows_per_mb % batch_devices:
      raise ValueError(f"train.rows_per_microbatch={self.rows_per_mb} must be a multiple of "
                       f"the data x fsdp mesh size {batch_devices}")
    # With several processes whose devices split the batch rows, each loads and packs only
    # its share of the SFT demonstrations (None: every process loads the whole batch).
    self._sft_spans, self._sft_tags = None, []
    processes = jax.process_count()
    if processes > 1 and int(config.sft.steps) > 0:
      spans = distributed.process_row_spans(ts.batch_sharding(self.mesh, self.rules),
                                            (1, self.rows_per_mb, self.row_len))
      if spans is not None and int(config.sft.batch_size) % processes == 0:
        self._sft_spans = spans
      else:
        log.warning("every process loads the whole SFT batch: the batch rows are not split "
                    "evenly over the %d processes, or sft.batch_size=%d is not a multiple "
                    "of them", processes, int(config.sft.batch_size))
    o = config.optim
    rl_updates = max(int(t.rl_steps) * self._updates_per_step(), int(o.warmup) + 1)
    self.rl_optimizer = rl_state.make_optimizer(float(o.lr), int(o.warmup), rl_updates,
                                          float(o.weight_decay), float(o.clip) if o.clip else None)
    s = config.sft
    self.sft_optimizer = rl_state.make_optimizer(float(s.lr), int(s.warmup),
                                           max(int(s.steps), int(s.warmup) + 1),
                                           float(o.weight_decay),
                                           float(o.clip) if o.clip else None)
    self.pref_optimizer = None
    if self.pref_cfg is not None:
      p = config.preference
      self.pref_optimizer = rl_state.make_optimizer(float(p.lr), int(p.warmup),
                                                    max(int(p.steps), int(p.warmup) + 1),
                                                    float(o.weight_decay),
                                                    float(o.clip) if o.clip else None)
    # Checkpoints the frozen references are rebuilt from on resume: the start of the
    # preference stage and the start of RL. Retention must not delete them.
    stage_ref, rl_ref = frozen_references(config, self.algo)
    keep = set()
    if stage_ref:
      keep.add(int(config.sft.steps))
    if rl_ref:
      keep.add(self._rl_start())
    self.ckpt = CheckpointManager(os.path.join(workdir, "checkpoints"),
                                  save_every=int(config.checkpoint.every),
                                  keep_last=int(config.checkpoint.keep_last),
                                  keep_every=int(config.checkpoint.keep_every) or None,
                                  keep_steps=tuple(sorted(keep)),
                                  async_save=bool(config.checkpoint.async_save))
    self.writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
    self.progress = Progress_()
    self._graphdef, _, self._rest = ts._split_abstract(self.cfg)
    self._sft_step_fn = None
    self._pref_step_fn = None
    self._pref_metrics_fn = None
    self.pref_reference = None
    self._rl_step_fn = None
    self._logprobs_fns = {}
    self._nll_sum_fn = None
    self._setup_state()
    self.sampler = Sampler(self._model(), mesh=self.rollout_mesh, rules=self.rules,
                           max_len=int(config.rollout.max_len), pad_id=self.tok.pad_id,
                           gather_weights=bool(config.rollout.get("gather_weights", True)),
                           share=self._shared_base(),
                           record_routing=self.algo.routing_replay == "rollout")
    self.sampler_version = self.progress.policy_version
    r = config.rollout
    self.worker = RolloutWorker(
        self.sampler, self.tok, group_size=int(self.algo.group_size),
        max_new_tokens=int(r.max_new_tokens), temperature=float(r.temperature),
        top_p=float(r.top_p) if r.get("top_p") else None,
        top_k=int(r.top_k) if r.get("top_k") else None, chunk_rows=int(r.chunk_rows),
        scoring_threads=int(r.scoring_threads), max_turns=int(r.max_turns),
        segment_tokens=int(placement.get("segment_tokens", 0) or 0),
        # Only a disaggregated run's learner swaps weights while the worker generates.
        lock=self._sampler_lock if self.disaggregated else None,
        version_fn=lambda: self.sampler_version,
        continuous=bool(r.get("continuous_batching", True)),
        reasoning=rollout_reasoning(config), thinking=rollout_thinking(config),
        system_prompt=str(r.get("system_prompt", "") or "") or None,
        tool_format=rollout_tool_format(config))
    self.reward_model = None
    if self.rm_path:
      # Frozen, on the rollout devices (the rollout thread scores what it generates);
      # nothing of it is checkpointed: a resumed run loads the folder again.
      t_load = time.time()
      self.reward_model = reward_model_lib.TransformerRewardModel.from_config(
          config.reward_model, tokenizer=self.tok, mesh=self.rollout_mesh, rules=self.rules,
          default_max_len=int(r.max_len))
      log.info("reward model %s (%s params) scores %d of %d domains, mix %g, squash %s; "
               "loaded in %.1f s", self.rm_path, f"{self.reward_model.cfg.num_params:,}",
               len(self.rm_domains), len(self.domains), float(config.reward_model.mix),
               config.reward_model.squash, time.time() - t_load)
    if (self.rl_teacher and int(config.train.rl_steps) > 0) or self.sft_teacher:
      self._load_teacher()  # a folder that cannot load fails now, not after SFT

  def _check_distill(self) -> models.ModelConfig:
    """The teacher's config, after refusing what on-policy distillation cannot join."""
    d = self.config.distill
    if self.rl_teacher and self.online_pref is not None:
      raise ValueError(f"distill.teacher adds to a policy-gradient advantage; algorithm "
                       f"{self.config.algorithm!r} trains a preference loss on pairs")
    if self.rl_teacher and float(d.reward_weight) == 0 and self.algo.dynamic_sampling:
      raise ValueError("distill.reward_weight=0 (distillation alone) with dynamic sampling "
                       "would drop every group whose rewards are equal: set "
                       "rl.dynamic_sampling=False")
    cfg = teacher_config(self.config)
    if cfg.vocab_size < self.cfg.vocab_size:
      raise ValueError(f"distill.teacher={self.teacher_path!r} has a vocabulary of "
                       f"{cfg.vocab_size} tokens, fewer than the student's "
                       f"{self.cfg.vocab_size}: the teacher must read the student's token ids")
    return cfg

  def _load_teacher(self) -> None:
    """The frozen teacher on the train devices; nothing of it is checkpointed (a resumed
    run loads the folder again)."""
    t_load = time.time()
    dtype = self.teacher_cfg.dtype  # distill.dtype, or the run's model dtype
    model = models.from_pretrained(self.teacher_path, mesh=self.mesh, rules=self.rules,
                                   dtype=dtype, attention_impl=self.cfg.attention_impl,
                                   logprob_chunk=self.cfg.logprob_chunk)
    self.teacher_cfg = model.cfg
    self.teacher_params = nnx.state(model, nnx.Param)
    log.info("distillation teacher %s (%s params, %s) loaded in %.1f s; coef %g, "
             "reward_weight %g", self.teacher_path, f"{model.cfg.num_params:,}", dtype,
             time.time() - t_load, float(self.config.distill.coef),
             float(self.config.distill.reward_weight))

  def _add_distillation(self, out: dict[str, Any], shape) -> None:
    """Scales the batch's advantages by distill.reward_weight and, with distill.loss
    "sampled", adds each sampled token's distillation advantage
    (`advantages.distillation_advantages`); the other losses act in the step."""
    if self.teacher_params is None:
      self._load_teacher()
    d = self.config.distill
    if self.distill_in_step:
      if float(d.reward_weight) != 1.0:
        out["advantages"] = float(d.reward_weight) * jnp.asarray(out["advantages"])
      self._distill_stats = {}
      return
    t0 = time.time()
    key = ("teacher", 1.0)
    if key not in self._logprobs_fns:
      self._logprobs_fns[key] = ts.make_compute_logprobs(
          self.teacher_cfg, mesh=self.mesh, rules=self.rules, temperature=1.0,
          with_values=False)
    teacher = self._logprobs_fns[key](self.teacher_params,
                                      ts.without_routing(out))["logprobs"]
    flat = lambda x: jnp.asarray(x).reshape(-1, shape[-1])  # noqa: E731
    mask = flat(out["loss_mask"])
    gap = adv_lib.distillation_advantages(flat(teacher), flat(out["old_logprobs"]), mask,
                                          coef=1.0)
    advantages = (float(d.reward_weight) * flat(out["advantages"])
                  + float(d.coef) * gap)
    out["advantages"] = advantages.reshape(shape)
    count = jnp.maximum(jnp.sum(mask != 0), 1)
    self._distill_stats = {
        # The sampled per-token reverse KL, KL(student || teacher), before the update.
        "distill/reverse_kl": float(-jnp.sum(gap) / count),
        "distill/teacher_logprob": float(jnp.sum(jnp.where(mask != 0, flat(teacher), 0.0))
                                         / count),
        "timing/teacher_s": time.time() - t0}

  def _load_sft_data(self, s) -> tuple[SFTData | None, SFTData | None]:
    """The SFT stage's files (sft.data) and held-out files (sft.eval_data), tokenized;
    None where not given (SFT then trains on the domains' own demonstrations)."""
    train = eval_ = None
    cache = data_cache_dir(self.config, self.workdir)
    if int(s.steps) > 0 and s.get("data"):
      train = SFTData.from_files(s.data, self._data_tok, row_len=self.row_len,
                                 cache_dir=cache)
      log.info("SFT data: %d conversations, %d trained tokens; %d steps of %d are %.2f "
               "epochs", len(train), train.trained_tokens, int(s.steps), int(s.batch_size),
               int(s.steps) * int(s.batch_size) / len(train))
    if int(s.steps) > 0 and s.get("eval_data"):
      eval_ = SFTData.from_files(s.eval_data, self._data_tok, row_len=self.row_len,
                                 cache_dir=cache)
    return train, eval_

  def _load_preference(self, config):
    """(loss config, pair files, held-out pair files) of the preference stage; Nones
    when it is off (preference.steps=0)."""
    p = config.get("preference")
    if p is None or int(p.get("steps", 0) or 0) <= 0:
      return None, None, None
    cfg = preference.PreferenceConfig(
        loss=str(p.loss), beta=float(p.beta), label_smoothing=float(p.label_smoothing),
        simpo_gamma=float(p.simpo_gamma), sft_coef=float(p.sft_coef),
        desirable_weight=float(p.get("desirable_weight", 1.0)),
        undesirable_weight=float(p.get("undesirable_weight", 1.0)),
        discopop_tau=float(p.get("discopop_tau", 0.05)))
    for key, low in (("batch_size", 1), ("eval_every", 0), ("warmup", 0)):
      if int(p[key]) < low:
        raise ValueError(f"preference.{key}={p[key]!r} must be >= {low}")
    if not float(p.lr) > 0:
      raise ValueError(f"preference.lr={p.lr!r} must be > 0")
    if kto.needs_kl(cfg) and int(p.batch_size) < 2:
      raise ValueError(f"preference.batch_size={p.batch_size} with loss=kto: its KL estimate "
                       "pairs each prompt with another example's completion; use >= 2")
    what = "labelled answers (unpaired)" if cfg.unpaired else "pairs"
    if not p.get("data"):
      raise ValueError(f"preference.steps > 0 needs preference.data: JSON-lines files of "
                       f"{what} (posttrain.data.preference)")
    cache = data_cache_dir(config, self.workdir)
    kind = UnpairedData if cfg.unpaired else PreferenceData
    data = kind.from_files(p.data, self._data_tok, row_len=self.row_len, cache_dir=cache)
    held = (kind.from_files(p.eval_data, self._data_tok, row_len=self.row_len,
                             cache_dir=cache)
            if p.get("eval_data") else None)
    if held is not None and kto.needs_kl(cfg) and len(held) < 2:
      raise ValueError("preference.eval_data holds one example; kto's KL estimate needs 2")
    if cfg.unpaired:
      log.info("preference data: %d examples (%d desirable, %d undesirable); %d steps of %d "
               "are %.2f epochs of %s", len(data), data.desirable, data.undesirable,
               int(p.steps), int(p.batch_size), int(p.steps) * int(p.batch_size) / len(data),
               cfg.loss)
      if not data.desirable or not data.undesirable:
        log.warning("preference data: every example is %s; %s learns from both kinds",
                    "desirable" if data.desirable else "undesirable", cfg.loss)
      return cfg, data, held
    log.info("preference data: %d pairs (%d with identical answers); %d steps of %d are "
             "%.2f epochs of %s", len(data), data.identical, int(p.steps), int(p.batch_size),
             int(p.steps) * int(p.batch_size) / len(data), cfg.loss)
    return cfg, data, held

  def _rl_needs_reference(self) -> bool:
    """RL keeps the policy it started from: for a KL term, or an online preference loss."""
    return frozen_references(self.config, self.algo)[1]

  def _check_foldable(self) -> None:
    """Refuses, before anything is built, a LoRA run whose stages would fold adapters
    into a quantized base (`models.check_foldable`): a stage after SFT or preference
    training that has steps of its own."""
    if not self.cfg.base_quantization:
      return
    pref = int(self.config.preference.steps) if self._pref_enabled() else 0
    rl = int(self.config.train.rl_steps)
    if (int(self.config.sft.steps) > 0 and (pref > 0 or rl > 0)) or (pref > 0 and rl > 0):
      try:
        models.check_foldable(self.cfg)
      except ValueError as e:
        raise ValueError(f"sft.steps={self.config.sft.steps}, preference.steps="
                         f"{pref}, train.rl_steps={rl}: {e}") from None

  def _pref_enabled(self) -> bool:
    return self.pref_cfg is not None

  def _rl_start(self) -> int:
    """The checkpoint step at which RL begins."""
    return int(self.config.sft.steps) + (int(self.config.preference.steps)
                                         if self._pref_enabled() else 0)

  # -- state --------------------------------------------------------------------------------

  def _updates_per_step(self) -> int:
    return int(self.algo.ppo_epochs) * int(self.algo.num_minibatches)

  def _reference_in_step(self) -> bool:
    return ts.reference_in_step(self.algo)

  def _setup_state(self):
    stage_opt = self.sft_optimizer  # Both optimizers have the same state structure.
    abstract = abstract_checkpoint(self.cfg, stage_opt, self.mesh, self.rules)
    restored = self.ckpt.restore(abstract)
    if restored is not None:
      state, extras, step = restored
      self.state = from_checkpoint(state)
      self.progress = Progress_(**extras["progress"])
      if self.progress.scheduler:
        self.scheduler.load_state_dict(self.progress.scheduler)
      log.info("resumed from checkpoint %d (stage %s, sft step %d, preference step %d, "
               "rl step %d)", step, self.progress.stage, self.progress.sft_step,
               self.progress.pref_step, self.progress.rl_step)
      self.resumed_from = step
    else:
      model = initial_model(self.config, self.cfg, self.mesh, self.rules)
      if self._sft_enabled():
        opt = self.sft_optimizer
      elif self._pref_enabled():
        opt, self.progress.stage = self.pref_optimizer, "preference"
      else:
        opt, self.progress.stage = self.rl_optimizer, "rl"
      self.state = rl_state.init_train_state(model, opt, mesh=self.mesh, rules=self.rules,
                                       seed=self.seed)
      self.resumed_from = None
    self.reference = None

  def sync_weights(self) -> tuple[float, float]:
    """Copies the learner's params to the sampler (a resharding put across meshes).

    Returns (copy seconds, seconds waiting for the sampler: a disaggregated rollout
    thread holds it for one round of a streamed rollout, one chunk's generation call, or
    one segment with placement.segment_tokens).
    The copy seconds are what the learner spends; a copy that stays on the devices is
    dispatched asynchronously and finishes before the sampler's next program reads it.
    """
    if self.disaggregated and jax.process_count() > 1 and not self._sync_path_logged:
      self._sync_path_logged = True
      src = jax.tree.leaves(self.state.params)[0].sharding
      log.info("weight sync train mesh -> rollout mesh across %d processes: %s path",
               jax.process_count(),
               distributed.cross_host_path(src, self.sampler.param_shardings()[0]))
    t0 = time.time()
    with self._sampler_lock:
      t1 = time.time()
      self.sampler.update_params(self.state.params, share=self._shared_base())
      self.sampler_version = self.progress.policy_version
    return time.time() - t1, t1 - t0

  def _shared_base(self):
    """The frozen LoRA base the colocated sampler holds uncopied, or None: without LoRA,
    or disaggregated (the sampler's weights live on the rollout mesh). Each train step
    donates it and hands it back unchanged; the `state` setter then points the sampler
    at the new arrays (`Sampler.reshare`)."""
    if self.disaggregated or not self.cfg.lora_rank:
      return None
    return rl_state.split_trainable(self.state.params)[1]

  @property
  def state(self) -> rl_state.TrainState:
    """The learner's TrainState."""
    return self._state

  @state.setter
  def state(self, value: rl_state.TrainState) -> None:
    self._state = value
    sampler = getattr(self, "sampler", None)
    if sampler is not None and sampler.shares_weights:  # the base's new arrays
      with self._sampler_lock:
        sampler.reshare(value.params)

  def _sft_enabled(self) -> bool:
    return int(self.config.sft.steps) > 0

  def _model(self) -> models.Transformer:
    return nnx.merge(self._graphdef, self.state.params, self._rest)

  def _extras(self) -> dict[str, Any]:
    self.progress.scheduler = self.scheduler.state_dict()
    return {"progress": dataclasses.asdict(self.progress),
            "config": json.loads(self.config.to_json_best_effort())}

  def _ckpt_step(self) -> int:
    # One increasing counter across stages: SFT, preference, then RL steps.
    return self.progress.sft_step + self.progress.pref_step + self.progress.rl_step

  def save(self, force: bool = False) -> float:
    t0 = time.time()
    saved = self.ckpt.save(self._ckpt_step(), to_checkpoint(self.state), self._extras(),
                           force=force)
    return time.time() - t0 if saved else 0.0

  # -- stages -------------------------------------------------------------------------------

  def run(self) -> dict[str, Any]:
    flag = PreemptionFlag()
    try:
      if self.progress.stage == "sft":
        if not self._sft_stage(flag):
          return self._finish("preempted")
        self.progress.sft_eval = self.evaluate("sft")
        if self._pref_enabled():
          self._enter_stage("preference", self.pref_optimizer, seed_offset=2)
        else:
          self._enter_rl()
        self.save(force=True)
      if self.progress.stage == "preference":
        if not self._preference_stage(flag):
          return self._finish("preempted")
        self.progress.pref_eval = self.evaluate("preference")
        self._enter_rl()
        self.save(force=True)
      if self.progress.stage == "rl":
        if not self._rl_stage(flag):
          return self._finish("preempted")
        self.progress.stage = "done"
        self.save(force=True)
      return self._finish("done")
    finally:
      flag.close()

  def _enter_stage(self, stage: str, optimizer, seed_offset: int):
    """A fresh optimizer state on the current policy for the next stage. With LoRA the
    previous stage's adapters go into the base weights and the stage trains fresh ones:
    the base (the stage's reference, adapters off) is then the policy it starts from. A
    stage of no steps (train.rl_steps=0: SFT alone) keeps them, so that the run's
    adapters stay its whole update over the weights it started from."""
    self.progress.stage = stage
    model = self._model()
    steps = (int(self.config.train.rl_steps) if stage == "rl" else
             int(self.config.preference.steps))
    if self.cfg.lora_rank and steps > 0:
      model = models.fold_lora(model, jax.random.key(self.seed + seed_offset))
      self.progress.folded_steps = self.progress.sft_step + self.progress.pref_step
    self.state = rl_state.init_train_state(model, optimizer, mesh=self.mesh, rules=self.rules,
                                           seed=self.seed + seed_offset)

  def _enter_rl(self):
    self.pref_reference = None  # the preference stage's frozen copy is done with
    self._enter_stage("rl", self.rl_optimizer, seed_offset=1)
    self.sync_weights()

  def _finish(self, status: str) -> dict[str, Any]:
    self.ckpt.wait()
    summary: dict[str, Any] = {"status": status, "sft_steps": self.progress.sft_step,
                               "rl_steps": self.progress.rl_step,
                               "policy_version": self.progress.policy_version}
    if self.progress.sft_nll is not None:
      summary["sft_heldout_nll"] = self.progress.sft_nll
    if self._pref_enabled():
      summary["preference_steps"] = self.progress.pref_step
    if self.progress.pref_heldout is not None:
      summary["preference_heldout"] = self.progress.pref_heldout
    if status == "done":
      final = self.evaluate("final")
      summary["eval"] = {"sft": self.progress.sft_eval, "final": final}
      # RL's change is measured from the policy it started from.
      before = self.progress.sft_eval
      if self.progress.pref_eval is not None:
        summary["eval"]["preference"] = before = self.progress.pref_eval
      if before and final:
        summary["eval"]["change"] = evaluation.pass_rate_change(before, final)
      _print_eval_table(before, final, summary["eval"].get("change"))
      if jax.process_index() == 0:
        with open(os.path.join(self.workdir, "summary.json"), "w") as fh:
          json.dump(summary, fh, indent=2)
      export = str(self.config.get("export_hf", "") or "")
      if export:
        models.save_pretrained(self._model(), export)
        if jax.process_index() == 0:  # with its tokenizer's files, when it has any
          self.tok.save(export)
        log.info("exported the policy to %s", export)
    self.writer.close()
    return summary

  def evaluate(self, tag: str) -> dict[str, Any]:
    e = self.config.eval
    if int(e.seeds_per_domain) <= 0:
      return {}
    self.sync_weights()
    # The verifiers' pass rates alone: the worker's rollouts never meet the reward model
    # (the trainer mixes its scores into the RL rollouts only, in `_rollout`).
    report = evaluation.pass_rates(self.worker, self.eval_domains,
                                   seeds_per_domain=int(e.seeds_per_domain),
                                   samples=int(e.get("samples", 0) or 0),
                                   temperature=float(self.config.rollout.temperature) or 1.0)
    if jax.process_index() == 0:
      with open(os.path.join(self.workdir, f"eval_{tag}.json"), "w") as fh:
        json.dump(report, fh, indent=2)
    step = self._ckpt_step()
    row = {f"eval_{tag}/pass_rate": report["pass_rate"],
           **{f"eval_{tag}/{f}": v for f, v in report["families"].items()}}
    if "sampled" in report:
      row[f"eval_{tag}/sampled_pass_rate"] = report["sampled"]["pass_rate"]
    self.writer.write(step, row)
    return report

  def _sft_stage(self, flag: PreemptionFlag) -> bool:
    s = self.config.sft
    total = int(s.steps)
    if self.sft_teacher and self.teacher_params is None:
      self._load_teacher()
    if self._sft_step_fn is None:
      d = self.config.distill
      self._sft_step_fn = ts.make_train_step(
          self.cfg, _sft_algorithm(), self.sft_optimizer, mesh=self.mesh, rules=self.rules,
          teacher_cfg=self.teacher_cfg if self.sft_teacher else None,
          distill_loss=str(d.get("sft_loss", "forward_kl")) if self.sft_teacher
          else "reverse_kl", distill_coef=float(d.get("coef", 1.0)),
          distill_beta=float(d.get("beta", 0.5)))
      if self.sft_teacher:  # Logit distillation: the teacher reads every demonstration.
        self._sft_step_fn = functools.partial(self._sft_step_fn, teacher=self.teacher_params)
    shard = (jax.process_index(), jax.process_count()) if self._sft_spans else (0, 1)
    per_step = int(s.batch_size) // shard[1]
    if shard[1] > 1:
      log.info("SFT data: process %d of %d loads %d of the %d demonstrations of each step",
               shard[0], shard[1], per_step, int(s.batch_size))
    # Every shard advances by the same count, so process 0's saved state fits them all; a
    # run resumed with another process count converts the position through the global one.
    if self.sft_data is not None:
      ds = self.sft_data.dataset(self.seed, shard)
    else:
      ds = sft_dataset(self.domains, self.tok, self.seed, shard,
                       system_prompt=str(self.config.rollout.get("system_prompt", "") or ""),
                       thinking=rollout_thinking(self.config),
                       tool_format=rollout_tool_format(self.config))
    it = iter(ds.to_iter_dataset())
    if self.progress.sft_iterator:
      it.set_state(sft_iterator_state(self.progress.sft_iterator, shard[1]))
    progress = Progress(total, "sft", start_step=self.progress.sft_step)
    while self.progress.sft_step < total:
      if flag.reached(self._ckpt_step()):
        self.save(force=True)
        return False
      t0 = time.time()
      examples = [next(it) for _ in range(per_step)]
      self.state, metrics = self._sft_step_fn(self.state, self._sft_batch(examples))
      self.progress.sft_step += 1
      self.progress.sft_iterator = {**it.get_state(), "shards": shard[1]}
      step = self.progress.sft_step
      if step % int(self.config.train.log_every) == 0 or step == total:
        # The step's mean log-prob of the batch before its update: no extra forward pass.
        # Fetched first, so the step time covers the step's compute, not just its dispatch.
        metrics = jax.device_get(metrics)
        row = self.writer.write(step, {"sft/nll": -metrics["logprob/mean"],
                                       "grad_norm": metrics["grad_norm"],
                                       "learning_rate": metrics["learning_rate"],
                                       "timing/sft_step_s": time.time() - t0,
                                       **({"sft/distill": metrics["distill/divergence"]}
                                          if self.sft_teacher else {})})
        self._check_finite(row, metrics)
        progress.line(step, {"nll": row["sft/nll"], "lr": row["learning_rate"]})
      every = int(s.get("eval_every", 0) or 0)
      if self.sft_eval_data is not None and every and step % every == 0 and step < total:
        self.heldout_nll()
      if self.ckpt.should_save(self._ckpt_step()):
        self.save()
    if self.sft_eval_data is not None:
      self.progress.sft_nll = self.heldout_nll()
    if self.sft_teacher and not self.rl_teacher:  # its one stage is over: free its memory
      self.teacher_params, self._sft_step_fn = None, None
    return True

  # -- preference optimisation ---------------------------------------------------------------

  def _preference_stage(self, flag: PreemptionFlag) -> bool:
    p = self.config.preference
    total = int(p.steps)
    # The reference (all losses but simpo) is the policy the stage started from: a frozen
    # copy, rebuilt on resume from the checkpoint written when the stage began; with LoRA
    # the base weights in the state, adapters off.
    in_step = self.pref_cfg.needs_reference
    if self._pref_step_fn is None:
      self._pref_step_fn = ts.make_preference_step(self.cfg, self.pref_cfg,
                                                   self.pref_optimizer, mesh=self.mesh,
                                                   rules=self.rules, reference_in_step=in_step)
    if in_step and not self.cfg.lora_rank and self.pref_reference is None:
      self.pref_reference = self._reference_params("preference")
    if in_step and self.progress.pref_step == 0:
      self._save_stage_start()
    step_fn = self._pref_step_fn
    if in_step and not self.cfg.lora_rank:
      step_fn = functools.partial(step_fn, reference=self.pref_reference)
    it = iter(self.pref_data.dataset(self.seed).to_iter_dataset())
    if self.progress.pref_iterator:
      it.set_state(self.progress.pref_iterator)
    progress = Progress(total, self.pref_cfg.loss, start_step=self.progress.pref_step)
    every = int(p.eval_every)
    while self.progress.pref_step < total:
      if flag.reached(self._ckpt_step()):
        self.save(force=True)
        return False
      t0 = time.time()
      batch = self._pack_preference([next(it) for _ in range(int(p.batch_size))])
      self.state, metrics = step_fn(self.state, batch)
      self.progress.pref_step += 1
      self.progress.pref_iterator = it.get_state()
      step = self.progress.pref_step
      if step % int(self.config.train.log_every) == 0 or step == total:
        metrics = jax.device_get(metrics)
        row = self.writer.write(self._ckpt_step(), {
            **{f"preference/{k}": v for k, v in metrics.items() if k.startswith(
                ("loss/", "rewards/", "logps/")) or k == "kl"},
            "grad_norm": metrics["grad_norm"], "learning_rate": metrics["learning_rate"],
            "preference/truncated": int(batch["truncated"]),
            "timing/preference_step_s": time.time() - t0})
        self._check_finite(row, metrics)
        shown = {"loss": row["preference/loss/preference"]}
        if self.pref_cfg.unpaired:
          shown["kl"] = row["preference/kl"]
        else:
          shown["acc"] = row["preference/rewards/accuracy"]
        progress.line(step, {**shown, "margin": row["preference/rewards/margin"]})
      if self.pref_eval_data is not None and every and step % every == 0 and step < total:
        self.preference_heldout()
      if self.ckpt.should_save(self._ckpt_step()):
        self.save()
    if self.pref_eval_data is not None:
      self.progress.pref_heldout = self.preference_heldout()
    return True

  def _pack_preference(self, items) -> dict[str, np.ndarray]:
    """One preference batch: pairs (`preference.pack_pairs`) or unpaired examples."""
    if self.pref_cfg.unpaired:
      return kto.pack_examples(items, self.row_len, rows_per_microbatch=self.rows_per_mb,
                               pad_id=self.tok.pad_id, with_kl=kto.needs_kl(self.pref_cfg))
    return preference.pack_pairs(items, self.row_len, rows_per_microbatch=self.rows_per_mb,
                                 pad_id=self.tok.pad_id)

  def preference_heldout(self) -> dict[str, float]:
    """The preference loss, rewards and accuracy of preference.eval_data's pairs (or, for
    an unpaired loss, its examples) under the current policy and the stage's reference,
    one forward pass each per micro-batch; written as eval_preference/<name>."""
    if self.pref_cfg.unpaired:
      report = self._unpaired_heldout()
    else:
      report = self._paired_heldout()
    self.writer.write(self._ckpt_step(), {f"eval_preference/{k}": v for k, v in report.items()})
    if self.pref_cfg.unpaired:
      log.info("held-out %s: margin %.4f, loss %.4f, kl %.4f over %d examples",
               self.pref_cfg.loss, report["rewards/margin"], report["loss/preference"],
               report["kl"], report["examples"])
    else:
      log.info("held-out preference: accuracy %.3f, margin %.4f, loss %.4f over %d pairs",
               report["rewards/accuracy"], report["rewards/margin"],
               report["loss/preference"], report["pairs"])
    return report

  def _pref_reference_params(self):
    return (models.without_lora(self.state.params) if self.cfg.lora_rank
            else self.pref_reference)

  def _paired_heldout(self) -> dict[str, float]:
    cfg = self.pref_cfg
    if self._pref_metrics_fn is None:

      def metrics_fn(logprobs, ref_logprobs, batch):
        def one(lp, ref, mb):
          mb = dict(mb) if ref is None else {**mb, "ref_logprobs": ref}
          ones = {"pairs": jnp.float32(1), "chosen_tokens": jnp.float32(1)}
          return preference.microbatch_preference_loss(cfg, lp, mb, denominators=ones)[1]

        return loss_lib.merge_stacked_metrics(jax.vmap(one)(logprobs, ref_logprobs, batch))

      self._pref_metrics_fn = jax.jit(metrics_fn, out_shardings=jax.sharding.NamedSharding(
          self.mesh, jax.sharding.PartitionSpec()))
    reference = self._pref_reference_params()
    sharding = ts.batch_sharding(self.mesh, self.rules)
    data, merged = self.pref_eval_data.examples, None
    per_call = self.rows_per_mb * 2
    for start in range(0, len(data), per_call):
      batch = self._pack_preference(data[start:start + per_call])
      logprobs = self._logprobs(self.state.params, batch, temperature=1.0)["logprobs"]
      ref = (self._logprobs(reference, batch, temperature=1.0)["logprobs"]
             if cfg.needs_reference else None)
      inputs = distributed.put({k: batch[k] for k in ("loss_mask", "pair_ids", "chosen")},
                               sharding)
      inputs["pair_mask"] = batch["pair_mask"]
      metrics = self._pref_metrics_fn(logprobs, ref, inputs)
      merged = metrics if merged is None else loss_lib.merge_metrics(merged, metrics)
    report = {k: float(v) for k, v in loss_lib.compute_metrics(merged).items()}
    report["pairs"] = len(data)
    return report

  def _unpaired_heldout(self) -> dict[str, float]:
    """KTO's metrics over all of eval_data: per-example log-prob sums and the mismatched
    sequences' totals, chunk by chunk (each chunk pairs its own prompts and completions
    for the KL estimate, as a training batch does), then the loss with one reference point."""
    cfg = self.pref_cfg
    if self._pref_metrics_fn is None:

      def sums_fn(logprobs, ref_logprobs, batch):
        def one(lp, ref, mb):
          slots = mb["example_mask"].shape[-1]
          mask = mb["loss_mask"] != 0
          return tuple(kto.example_sums(jnp.where(mask, x, 0.0), mb["example_ids"], slots)
                       for x in (lp, ref))

        return jax.vmap(one)(logprobs, ref_logprobs, batch)

      self._pref_metrics_fn = jax.jit(sums_fn, out_shardings=jax.sharding.NamedSharding(
          self.mesh, jax.sharding.PartitionSpec()))
    reference = self._pref_reference_params()
    sharding = ts.batch_sharding(self.mesh, self.rules)
    data = self.pref_eval_data.examples
    per_call = self.rows_per_mb * 2
    starts = list(range(0, len(data), per_call))
    if len(starts) > 1 and len(data) - starts[-1] < 2:
      starts.pop()  # a last chunk of one example joins the one before (KL pairs need 2)
    n = len(data)
    policy, ref, desirable = np.zeros(n), np.zeros(n), np.zeros(n, bool)
    kl_policy = kl_ref = 0.0
    for i, start in enumerate(starts):
      end = starts[i + 1] if i + 1 < len(starts) else n
      batch = self._pack_preference([self.pref_eval_data.item(x) for x in data[start:end]])
      lp = self._logprobs(self.state.params, batch, temperature=1.0)["logprobs"]
      ref_lp = self._logprobs(reference, batch, temperature=1.0)["logprobs"]
      inputs = distributed.put({k: batch[k] for k in ("loss_mask", "example_ids")}, sharding)
      inputs["example_mask"] = batch["example_mask"]
      sums = jax.device_get(self._pref_metrics_fn(lp, ref_lp, inputs))
      slots = batch["example_mask"]
      index = start + batch["example_index"][slots]
      policy[index], ref[index] = sums[0][slots], sums[1][slots]
      desirable[index] = batch["desirable"][slots]
      if kto.needs_kl(cfg):
        mismatched = {k[len("kl_"):]: v for k, v in batch.items() if k.startswith("kl_")}
        scored = mismatched["loss_mask"]
        kl_policy += float(np.asarray(self._logprobs(
            self.state.params, mismatched, temperature=1.0)["logprobs"])[scored].sum())
        kl_ref += float(np.asarray(self._logprobs(
            reference, mismatched, temperature=1.0)["logprobs"])[scored].sum())
    kl = kto.kl_reference_point(kl_policy, kl_ref, n) if kto.needs_kl(cfg) else 0.0
    _, metrics = kto.unpaired_loss(cfg, policy, ref, desirable, kl=kl)
    report = {k: float(v) for k, v in kto.finish_metrics(
        loss_lib.compute_metrics(metrics)).items()}
    report.update(kl=float(kl), examples=n, desirable=int(desirable.sum()))
    return report

  def heldout_nll(self) -> float:
    """The policy's mean negative log-likelihood per trained token of sft.eval_data, in
    file order, one forward pass per micro-batch; written as eval_sft/nll."""
    data = self.sft_eval_data
    if self._nll_sum_fn is None:
      self._nll_sum_fn = jax.jit(lambda lp, m: jnp.sum(jnp.where(m, -lp, 0.0)))
    sharding = ts.batch_sharding(self.mesh, self.rules)
    total, count = 0.0, 0
    per_call = self.rows_per_mb * 4
    for start in range(0, len(data), per_call):
      batch = _to_batch(data.examples[start:start + per_call], row_len=self.row_len,
                        rows_per_mb=self.rows_per_mb, micro_multiple=1, pad_id=self.tok.pad_id)
      logprobs = self._logprobs(self.state.params, batch, temperature=1.0)["logprobs"]
      mask = distributed.put(batch["loss_mask"], sharding)
      total = total + self._nll_sum_fn(logprobs, mask)  # on the device: one fetch at the end
      count += int(np.count_nonzero(batch["loss_mask"]))
    nll = float(total) / max(count, 1)
    self.writer.write(self._ckpt_step(), {"eval_sft/nll": nll, "eval_sft/tokens": count})
    log.info("held-out SFT NLL %.4f over %d tokens", nll, count)
    return nll

  def _sft_batch(self, examples: list[dict[str, np.ndarray]]):
    """The step's batch: packed here from every example, or, with SFT data sharded by
    process, from this process's examples into its rows of the global batch."""
    if not self._sft_spans:
      return _to_batch(examples, row_len=self.row_len, rows_per_mb=self.rows_per_mb,
                       micro_multiple=1, pad_id=self.tok.pad_id)
    index, count = jax.process_index(), jax.process_count()
    local_rows = self.rows_per_mb // count
    packed = packing.pack_trajectories(examples, self.row_len, truncate=True,
                                       pad_id=self.tok.pad_id)
    # Sequence ids unique over the global batch: each process numbers its own from 0.
    packed["seq_ids"] = np.where(packed["seq_ids"] >= 0,
                                 packed["seq_ids"] + index * len(examples), -1)
    needed = max(1, -(-packed["tokens"].shape[0] // local_rows))
    micro = 1 << (needed - 1).bit_length()
    # Every process runs the same number of micro-batches: the most any of them needs.
    tag = f"posttrain/sft_microbatches/{self.progress.sft_step}"
    micro = max(int(m) for m in distributed.allgather_json(micro, tag))
    # Every process has read the answers two exchanges back before writing the last ones.
    self._sft_tags.append(tag)
    if len(self._sft_tags) > 2:
      distributed.delete_key(f"{self._sft_tags.pop(0)}/{index}")
    local = packing.split_microbatches(packed, local_rows * self.row_len,
                                       num_microbatches=micro, pad_id=self.tok.pad_id)
    return distributed.assemble_rows(local, ts.batch_sharding(self.mesh, self.rules),
                                     self._sft_spans, self.rows_per_mb)

  def _logprobs(self, params, batch, temperature: float | None = None,
                with_entropy: bool = False, with_routing: bool = False):
    """Log-probs without gradient at the sampler's temperature, or at `temperature`; with
    `with_entropy`, the tempered distribution's entropies too (same pass); with
    `with_routing`, the experts each token took (routing replay's)."""
    if temperature is None:
      temperature = float(self.config.rollout.temperature) or 1.0
    key = (temperature, with_entropy, with_routing)
    if key not in self._logprobs_fns:
      self._logprobs_fns[key] = ts.make_compute_logprobs(
          self.cfg, mesh=self.mesh, rules=self.rules, temperature=temperature,
          with_entropy=with_entropy, with_routing=with_routing)
    return self._logprobs_fns[key](params, batch)

  def _check_finite(self, row: dict, metrics):
    if row.get("nonfinite", 0) or not all(math.isfinite(v) for v in row.values()):
      self.save(force=True)
      self.ckpt.wait()
      raise NonFiniteLossError(
          f"non-finite loss or gradient at step {self._ckpt_step()}: the update was skipped "
          f"and a checkpoint was written to {self.ckpt.directory} for inspection")

  # -- RL -----------------------------------------------------------------------------------

  def _rl_stage(self, flag: PreemptionFlag) -> bool:
    total = int(self.config.train.rl_steps)
    if self.teacher_params is not None and not self.rl_teacher:
      # A teacher of SFT alone (distill.stages=sft): its device memory goes back to RL.
      self.teacher_params, self._sft_step_fn = None, None
    if self._rl_step_fn is None and self.online_pref is not None:
      self._rl_step_fn = ts.make_preference_step(self.cfg, self.online_pref, self.rl_optimizer,
                                                 mesh=self.mesh, rules=self.rules,
                                                 reference_in_step=self._reference_in_step())
    elif self._rl_step_fn is None:
      # The update's log-probs at the sampler's temperature, as the old, reference and
      # behaviour log-probs it compares them with: a ratio of 1 on-policy.
      d = self.config.get("distill") or {}
      self._rl_step_fn = ts.make_train_step(
          self.cfg, self.algo, self.rl_optimizer, mesh=self.mesh, rules=self.rules,
          reference_in_step=self._reference_in_step(),
          temperature=float(self.config.rollout.temperature) or 1.0,
          teacher_cfg=self.teacher_cfg if self.distill_in_step else None,
          distill_loss=str(d.get("loss", "reverse_kl")) if self.distill_in_step
          else "reverse_kl", distill_coef=float(d.get("coef", 1.0)),
          distill_beta=float(d.get("beta", 0.5)))
    if self._rl_needs_reference() and self.reference is None and not self.cfg.lora_rank:
      # The reference is the policy RL started from; re-derived on resume from the
      # checkpoint written when RL began (kept as its own copy, never updated). With LoRA
      # it is the state's base weights, adapters off (`_enter_rl` folds SFT's in).
      self.reference = self._reference_params()
      if self.progress.rl_step == 0:
        self._save_stage_start()
    self.sync_weights()
    progress = Progress(total, self.config.algorithm, start_step=self.progress.rl_step)
    source = AsyncRollouts(self, total) if self.disaggregated else None
    try:
      while self.progress.rl_step < total:
        if flag.reached(self._ckpt_step()):  # All processes stop at the same step.
          self.save(force=True)
          return False
        row = self._rl_step(source)
        step = self.progress.rl_step
        if step % int(self.config.train.log_every) == 0 or step == total:
          progress.line(step, {"reward": row.get("reward/mean", 0.0),
                               "pass": row.get("pass_rate/mean", 0.0),
                               "tok/s": row.get("throughput/tokens_per_s", 0.0)})
        if self.ckpt.should_save(self._ckpt_step()):
          self.writer.write(self._ckpt_step(), {"timing/checkpoint_s": self.save()})
    finally:
      if source is not None:
        source.close()
    return True

  def _save_stage_start(self):
    """Writes the checkpoint a stage's frozen reference is rebuilt from on resume (a no-op
    when the previous stage's end wrote it; a run starting at this stage has none)."""
    self.save(force=True)

  def _reference_params(self, stage: str = "rl"):
    """The frozen policy a stage started from: a copy of the current params before its
    first step, else the params of the checkpoint written when it began."""
    if stage == "rl":
      start = self.progress.sft_step + self.progress.pref_step
      steps_done, what, way_out = self.progress.rl_step, "the KL reference", " or set kl_coef=0"
    else:
      start, steps_done = self.progress.sft_step, self.progress.pref_step
      what, way_out = "the preference reference", ""
    if steps_done == 0:
      return rl_state.frozen_copy(self.state.params, self.mesh, self.rules)
    abstract = abstract_checkpoint(self.cfg, self.rl_optimizer, self.mesh, self.rules)
    restored = self.ckpt.restore(abstract, step=start)
    if restored is None:
      raise ValueError(f"cannot rebuild {what}: checkpoint {start} (start of {stage}) is "
                       f"gone; keep it with checkpoint.keep_every{way_out}")
    return restored[0]["params"]

  def _step_seed(self, rl_step: int) -> int:
    return self.seed * 1_000_003 + rl_step

  def _rollout(self, step_seed: int):
    algo, r = self.algo, self.config.rollout
    n = int(r.prompts_per_step)
    calls = [0]
    scored: dict[str, Any] = {"scores": [], "truncated": 0.0, "seconds": 0.0}
    remax = algo.advantage_estimator == "remax"
    baseline_s = [0.0]
    votes: dict[int, dict[str, float]] = {}  # id(group) -> its majority-vote statistics

    def make_groups(pairs):
      calls[0] += 1
      groups = self.worker.rollout(pairs, seed=step_seed * 131 + calls[0],
                                   policy_version=self.sampler_version,
                                   token_budget=self.step_tokens)
      # Here, so that dynamic sampling's filter, the scheduler and the advantages all see
      # the mixed rewards (and ReMax's baselines, in the rollout thread too).
      self._score_with_reward_model(groups, scored)
      if remax:
        baseline_s[0] += self._attach_greedy_baselines(groups, seed=step_seed * 131 + calls[0])
      if self.reward_source == "majority_vote":
        self._vote(groups, votes)
      return groups

    extra: dict[str, float] = {}
    if algo.dynamic_sampling:
      # ReMax: samples that tie still learn when the greedy completion scored otherwise.
      rewards_of = ({"rewards_of": lambda g: np.append(g.rewards, _greedy_group(g).rewards)}
                    if remax else {})
      batch = dynamic_sample(self.scheduler, make_groups, n, batched=True, update=False,
                             max_draws=int(r.get("max_draws", 4 * n)), **rewards_of)
      groups = [g for _, _, g in batch.groups]
      extra = {"dynamic_sampling/draws": batch.draws, "dynamic_sampling/dropped": batch.dropped}
    elif self.step_tokens:
      # Groups still generating from earlier steps count toward this step's prompts; keep
      # generating until at least one group is complete. With placement.partial=drop the
      # groups not complete within the step's tokens are discarded instead of carried.
      drop = self.partial == "drop"
      fresh = n - self.worker.carried
      groups = make_groups(self.scheduler.draw(fresh) if fresh > 0 else [])
      dropped = self.worker.drop_carried() if drop else 0
      while not groups:
        if drop and calls[0] >= 8:
          raise RolloutStalledError(f"no group finished within placement.step_tokens="
                                    f"{self.step_tokens} in {calls[0]} tries with "
                                    "placement.partial=drop; raise step_tokens or use resume")
        groups = make_groups(self.scheduler.draw(n) if drop else [])
        dropped += self.worker.drop_carried() if drop else 0
      extra = {"rollout/carried_groups": self.worker.last_stats["carried_groups"],
               "rollout/calls": float(calls[0])}
      if drop:
        extra["rollout/dropped_partial"] = float(dropped)
    else:
      groups = make_groups(self.scheduler.draw(n))
    if "resumed_fraction" in self.worker.last_stats:  # segments resumed from the KV cache
      extra["rollout/resumed_fraction"] = self.worker.last_stats["resumed_fraction"]
    if "decode_occupancy" in self.worker.last_stats:  # decode work spent on live rows
      extra["rollout/decode_occupancy"] = self.worker.last_stats["decode_occupancy"]
    if "weight_swaps" in self.worker.last_stats:  # new weights landed mid-rollout
      extra["rollout/weight_swaps"] = self.worker.last_stats["weight_swaps"]
    if "reused_prefix_fraction" in self.worker.last_stats:  # later turns not prefilled again
      extra["rollout/reused_prefix_fraction"] = self.worker.last_stats["reused_prefix_fraction"]
    if self.reward_model is not None:
      scores = np.asarray(scored["scores"], np.float64)
      finite = scores[np.isfinite(scores)]
      extra.update({"reward_model/scored": float(scores.size),
                    "reward_model/score_mean": float(finite.mean()) if finite.size else 0.0,
                    "reward_model/score_std": float(finite.std()) if finite.size else 0.0,
                    "reward_model/nonfinite": float(scores.size - finite.size),
                    "reward_model/truncated": scored["truncated"],
                    "timing/reward_model_s": scored["seconds"]})
    voted = [votes[id(g)] for g in groups if id(g) in votes]
    if voted:
      extra.update({f"majority/{k}": float(np.mean([v[k] for v in voted]))
                    for k in ("agreement", "label_correct", "no_answer")})
    if remax and groups:
      greedy = [_greedy_group(g) for g in groups]
      extra.update({"remax/baseline_reward": float(np.mean([b.rewards[0] for b in greedy])),
                    "remax/baseline_tokens": float(np.mean([b.samples[0].num_generated
                                                            for b in greedy])),
                    "timing/remax_baseline_s": baseline_s[0]})
    return groups, extra

  def _check_reward_source(self) -> None:
    if self.reward_source not in ("verifier", "majority_vote"):
      raise ValueError(f"rollout.reward_source must be 'verifier' or 'majority_vote', got "
                       f"{self.reward_source!r}")
    if self.reward_source != "majority_vote":
      return
    voteless = sorted(d for d in self.domains if not majority_vote.votes_on(registry.get(d)))
    if voteless:
      more = f" and {len(voteless) - 3} more" if len(voteless) > 3 else ""
      raise ValueError(f"rollout.reward_source=majority_vote needs answers to vote on; the "
                       f"code domains {', '.join(voteless[:3])}{more} give none: drop them "
                       "from tasks.domains")
    if self.rm_path:
      raise ValueError("rollout.reward_source=majority_vote rewards agreement with the "
                       "group's majority answer; a reward model (reward_model.path) would mix "
                       "a second reward in: use one or the other")

  def _vote(self, groups, stats: dict[int, dict[str, float]]) -> None:
    """Label-free rewards (TTRL): each group's samples (and ReMax baseline) rewarded by
    agreement with the group's majority answer; the verifier's value stays the pass."""
    for g in groups:
      stats[id(g)] = majority_vote.relabel_by_majority(registry.get(g.domain), g)

  def _attach_greedy_baselines(self, groups, seed: int) -> float:
    """ReMax (Li et al. 2023): one greedy (temperature 0) completion of each group's prompt
    by the rollout policy becomes `group.baseline`, scored by the same verifier and reward
    model as the samples (its scores stay out of the reward_model stats, the samples'
    rollout stats stay the worker's `last_stats`). Returns the seconds it took."""
    if not groups:
      return 0.0
    t0 = time.time()
    stats = self.worker.last_stats
    greedy = self.worker.rollout([(g.domain, g.seed) for g in groups], seed=seed,
                                 policy_version=self.sampler_version, group_size=1,
                                 temperature=0.0)
    self.worker.last_stats = stats
    self._score_with_reward_model(greedy, {"scores": [], "truncated": 0.0, "seconds": 0.0})
    for g, b in zip(groups, greedy, strict=True):
      g.baseline = b.samples[0]
    return time.time() - t0

  def _score_with_reward_model(self, groups, scored: dict[str, Any]) -> None:
    """Mixes the reward model's scores into the rewards of every sample of the groups of
    its domains (reward_model.domains), with one scoring call; adds the raw scores, the
    truncated count and the seconds to `scored`.

    Every process holds every group's samples and texts once `worker.rollout` returns
    and calls this at the same point, so the scoring programs, which span the rollout
    mesh's devices on every host, get the same inputs everywhere.
    """
    if self.reward_model is None:
      return
    picked = [(g, s) for g in groups if g.domain in self.rm_domains for s in g.samples]
    if not picked:
      return
    t0 = time.time()
    scores = self.reward_model.score_texts([task_messages(g.task) for g, _ in picked],
                                           [s.text for _, s in picked])
    rm = self.config.reward_model
    mixed = mix_rewards([s.reward for _, s in picked], scores, float(rm.mix), str(rm.squash))
    for (_, sample), reward in zip(picked, mixed):
      sample.reward = reward
    scored["scores"] += scores
    scored["truncated"] += self.reward_model.last_stats["truncated"]
    scored["seconds"] += time.time() - t0

  def _rl_step(self, source: "AsyncRollouts | None" = None) -> dict[str, float]:
    algo = self.algo
    timings: dict[str, float] = {}
    t0, cpu0 = time.time(), _process_cpu_s()
    if source is None:
      groups, extra = self._rollout(self._step_seed(self.progress.rl_step))
      timings["timing/rollout_s"] = time.time() - t0
      timings["timing/scoring_s"] = self.worker.last_stats.get("scoring_wait_s", 0.0)
      # Each process scores its share of the samples (1.0 with one process).
      timings["rollout/scored_fraction"] = self.worker.last_stats.get("scored_fraction", 1.0)
      if "tool_step_fraction" in self.worker.last_stats:
        timings["rollout/tool_step_fraction"] = self.worker.last_stats["tool_step_fraction"]
    else:
      if self.alternate:  # the rollout thread's turn: every batch it may make until then
        source.publish(self.progress.rl_step)
      groups, extra, gen_s = source.get()
      if self.alternate:
        source.wait_generated(self.progress.rl_step + 1 + self.max_policy_lag)
      timings["timing/rollout_s"] = gen_s
      timings["timing/wait_for_rollout_s"] = time.time() - t0
    staleness = [self.progress.policy_version - min(s.oldest_version for s in g.samples)
                 for g in groups]
    extra = {**extra, "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
             "staleness/max": float(max(staleness, default=0))}
    if not groups:
      raise RolloutStalledError("dynamic sampling produced no informative group within "
                                "max_draws; raise rollout.max_draws or check the domains' "
                                "difficulty")
    rewards = [g.rewards for g in groups]
    shaped = [self._shape(g, r) for g, r in zip(groups, rewards)]
    seq_adv = self._sequence_advantages(shaped, groups)
    trajectories = []
    for g, a in zip(groups, seq_adv):
      trajectories += group_to_trajectories(g, a)
    for traj, r in zip(trajectories, np.concatenate(shaped)):
      traj["rewards"] = np.float32(r)
    truncated = [s.finish_reason == "length" for g in groups for s in g.samples]
    if algo.mask_truncated:  # overlong filtering: a sample that never ended trains nothing
      for traj, cut in zip(trajectories, truncated):
        if cut:
          traj["response_mask"] = np.zeros_like(traj["response_mask"])
    kl_coef = self._kl_coef()  # before the controller moves it for the next step
    step_fn = self._rl_step_fn
    if self._reference_in_step() and not self.cfg.lora_rank:
      step_fn = functools.partial(step_fn, reference=self.reference)
    if self.distill_in_step:
      step_fn = functools.partial(step_fn, teacher=self.teacher_params)
    t1 = t2 = time.time()
    if self.online_pref is not None:
      batch, history, pair_stats = self._online_preference_update(step_fn, groups,
                                                                  trajectories, shaped)
      extra.update(pair_stats)
    else:
      batch = _to_batch(trajectories, row_len=self.row_len, rows_per_mb=self.rows_per_mb,
                        micro_multiple=int(algo.num_minibatches), pad_id=self.tok.pad_id)
      batch = self._add_learner_inputs(batch)
      extra.update(self._distill_stats)
      timings["timing/reference_s"] = time.time() - t1
      t2 = time.time()
      self.state, history = ts.ppo_update(step_fn, self.state, batch,
                                          epochs=int(algo.ppo_epochs),
                                          minibatches=int(algo.num_minibatches),
                                          seed=self.progress.rl_step)
    for g, a in zip(groups, seq_adv):
      # Passing is the verifier's verdict, whatever a reward model mixed into the rewards.
      self.scheduler.update(g.domain, g.rewards.tolist(), np.abs(a).tolist(),
                            verdicts=[verifier_value(s.reward) for s in g.samples])
    self.progress.rl_step += 1
    self.progress.policy_version += 1
    if not self.disaggregated or self.progress.rl_step % self.sync_every == 0:
      waited = 0.0
      if source is not None and self.weight_swap == "between_batches":
        # Swap the rollout weights only between batches, after the last batch the old
        # version may still produce (max_policy_lag ahead of this step) and before the next
        # starts (it waits for the publish below): batch j then uses version
        # j - max_policy_lag, whatever the timing, and on every host (with several
        # processes each must swap between the same two sampler calls, or one host samples
        # with other weights, or other programs, than the rest).
        t_wait = time.time()
        source.wait_generated(self.progress.rl_step + self.max_policy_lag)
        waited = time.time() - t_wait
      timings["timing/weight_sync_s"], timings["timing/weight_sync_wait_s"] = (
          self.sync_weights())
      timings["timing/weight_sync_wait_s"] += waited
    if source is not None and not self.alternate:
      source.publish(self.progress.rl_step)
    metrics = ({k: jnp.mean(jnp.stack([m[k] for m in history])) for k in history[-1]}
               if history else {})
    extra.update(self._control_kl(kl_coef, metrics, len(trajectories)))
    timings["timing/update_s"] = time.time() - t2
    timings["timing/step_s"] = time.time() - t0
    # CPU seconds of the whole process during the step (every thread: XLA:CPU compute,
    # sampling, scoring, a concurrent rollout thread). cpu_s / step_s is the number of host
    # cores kept busy: near the core count, the host is the bottleneck.
    timings["host/cpu_s"] = _process_cpu_s() - cpu0
    gen = sum(s.num_generated for g in groups for s in g.samples)
    # ReMax's greedy completions take rollout time too: count their tokens in the rate.
    greedy = sum(g.baseline.num_generated for g in groups if g.baseline is not None)
    flat_rewards = np.concatenate(rewards)
    # Passing is the verifier's verdict, whatever a reward model mixed into the value.
    passed = np.asarray([verifier_value(s.reward) >= 1.0 for g in groups for s in g.samples],
                        np.float64)
    host = {"reward/mean": float(flat_rewards.mean()), "pass_rate/mean": float(passed.mean()),
            "response_length/mean": gen / max(len(passed), 1),
            "response_length/truncated_fraction": float(np.mean(truncated)),
            "throughput/tokens_per_s": (gen + greedy) / max(timings["timing/rollout_s"], 1e-9),
            "padding_fraction": packing.padding_fraction(
                {"segment_ids": np.asarray(batch["segment_ids"])}), **extra, **timings}
    if self.worker.reads_reasoning:  # reasoning models: how long they think, and how often
      flat = [s for g in groups for s in g.samples]  # they run out of tokens doing so
      host["reasoning/length_mean"] = float(np.mean([s.reasoning_tokens for s in flat]))
      host["reasoning/unclosed_fraction"] = float(np.mean([not s.reasoning_closed
                                                           for s in flat]))
    for dom in sorted({g.domain for g in groups}):
      host[f"reward/{dom}"] = float(np.mean([g.rewards.mean() for g in groups
                                             if g.domain == dom]))
    for k, v in self.scheduler.metrics().items():
      host[f"scheduler/{k}"] = v
    step = self._ckpt_step()
    if self.progress.rl_step % int(self.config.train.log_every) == 0:
      row = self.writer.write(step, {**metrics, **host})
      self._check_finite(row, metrics)
      return row
    return host

  def _online_preference_update(self, step_fn, groups, trajectories, rewards):
    """Online preference optimisation: each group's best samples against its worst
    (`algorithm.pairs_per_group`), one preference update on all the pairs. Returns the
    packed batch, the step's metrics (none when no group had a pair: every reward tied)
    and the pair counts. An unpaired loss (online KTO) labels samples instead
    (`_online_unpaired_update`)."""
    if self.online_pref.unpaired:
      return self._online_unpaired_update(step_fn, groups, trajectories, rewards)
    pairs, start = [], 0
    for g, r in zip(groups, rewards):
      samples = trajectories[start:start + len(g.samples)]
      start += len(g.samples)
      pairs += preference.pairs_from_group(samples, r,
                                           pairs_per_group=int(self.algo.pairs_per_group))
    stats = {"preference/pairs": float(len(pairs))}
    if not pairs:
      log.info("rl step %d: no group has a better and a worse sample; no update",
               self.progress.rl_step + 1)
      return {"segment_ids": np.zeros((1, self.row_len), np.int32)}, [], stats
    batch = preference.pack_pairs(pairs, self.row_len, rows_per_microbatch=self.rows_per_mb,
                                  pad_id=self.tok.pad_id)
    stats["preference/truncated"] = float(batch["truncated"])
    self.state, metrics = step_fn(self.state, batch)
    renamed = {(f"preference/{k}" if k.startswith(("rewards/", "logps/")) else k): v
               for k, v in metrics.items()}
    return batch, [renamed], stats

  def _online_unpaired_update(self, step_fn, groups, trajectories, rewards):
    """Online KTO: a sample above its group's mean reward is desirable, one below it
    undesirable (one at the mean, as every sample of a tied group, is left out); one
    update on the labelled samples. Returns as `_online_preference_update`."""
    examples, start = [], 0
    for g, r in zip(groups, rewards):
      r = np.asarray(r, np.float64)
      for s, v in zip(trajectories[start:start + len(g.samples)], r):
        if v != r.mean() and len(s["response_tokens"]) and np.any(s["response_mask"]):
          examples.append({"prompt_tokens": s["prompt_tokens"],
                           "completion_tokens": s["response_tokens"],
                           "completion_mask": s["response_mask"],
                           "label": bool(v > r.mean())})
      start += len(g.samples)
    stats = {"preference/examples": float(len(examples)),
             "preference/desirable": float(sum(e["label"] for e in examples))}
    if len(examples) < (2 if kto.needs_kl(self.online_pref) else 1):
      log.info("rl step %d: %d labelled samples (every group's rewards tied); no update",
               self.progress.rl_step + 1, len(examples))
      return {"segment_ids": np.zeros((1, self.row_len), np.int32)}, [], stats
    batch = kto.pack_examples(examples, self.row_len, rows_per_microbatch=self.rows_per_mb,
                              pad_id=self.tok.pad_id, with_kl=kto.needs_kl(self.online_pref))
    stats["preference/truncated"] = float(batch["truncated"])
    self.state, metrics = step_fn(self.state, batch)
    renamed = {(f"preference/{k}" if k.startswith(("rewards/", "logps/")) else k): v
               for k, v in metrics.items()}
    return batch, [renamed], stats

  def _shape(self, group, rewards: np.ndarray) -> np.ndarray:
    algo = self.algo
    if not algo.overlong_penalty:
      return rewards
    max_len = int(self.config.rollout.max_new_tokens)
    lengths = np.asarray([s.num_generated for s in group.samples])
    buffer = min(int(algo.overlong_buffer_len), max_len)
    pen = adv_lib.overlong_penalty(lengths, max_response_len=max_len, buffer_len=buffer,
                                   factor=float(algo.overlong_penalty_factor))
    return rewards + np.asarray(pen, np.float64)

  def _sequence_advantages(self, rewards: list[np.ndarray], groups) -> list[np.ndarray]:
    est = self.algo.advantage_estimator
    if est not in adv_lib.SEQUENCE_LEVEL_ESTIMATORS:
      return [np.zeros_like(r) for r in rewards]  # Token-level: filled in on the device.
    flat = np.concatenate(rewards).astype(np.float32)
    ids = np.concatenate([np.full(len(r), i) for i, r in enumerate(rewards)])
    if est in ("grpo", "gpg", "grpo_passk"):
      a = adv_lib.get_advantage_estimator(est)(flat, ids,
                                               normalize_std=bool(self.algo.normalize_std))
    elif est == "remax":
      # The greedy completion's reward, shaped as the samples' are (overlong penalty).
      greedy = [_greedy_group(g) for g in groups]
      baselines = np.concatenate([self._shape(b, b.rewards) for b in greedy])
      a = adv_lib.remax_advantages(flat, baselines.astype(np.float32), ids)
    elif est in adv_lib.LENGTH_WEIGHTED_ESTIMATORS:
      lengths = np.asarray([s.num_generated for g in groups for s in g.samples], np.float32)
      a = adv_lib.get_advantage_estimator(est)(flat, lengths, ids)
    else:
      a = adv_lib.rloo_advantages(flat, ids)
    a = np.asarray(a)
    out, i = [], 0
    for r in rewards:
      out.append(a[i:i + len(r)])
      i += len(r)
    return out

  def _kl_coef(self) -> float:
    """The KL coefficient of this RL step: the preset's, or the adaptive controller's."""
    if self.algo.kl_controller == "adaptive" and self.progress.kl_coef is not None:
      return self.progress.kl_coef
    return float(self.algo.kl_coef)

  def _control_kl(self, coef: float, metrics, sequences: int) -> dict[str, float]:
    """Moves the adaptive controller's coefficient by the KL this step measured: the
    rollout policy's to the reference on the batch (KL in the reward, as veRL), or the
    step's KL loss term's (the learner's, averaged over the step's updates)."""
    if self.algo.kl_controller != "adaptive":
      return {}
    kl = self._reward_kl if self.algo.kl_in_reward else float(metrics.get("kl", np.nan))
    self.progress.kl_coef = loss_lib.adaptive_kl_coef(
        coef, kl, target=float(self.algo.kl_target), horizon=int(self.algo.kl_horizon),
        n_steps=sequences)
    return {"kl/coef": coef, "kl/controlled": kl}

  def _add_learner_inputs(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Old/reference log-probs, critic values and token-level advantages, on the devices."""
    algo = self.algo
    out: dict[str, Any] = dict(batch)
    kl_coef = self._kl_coef()
    if algo.kl_controller == "adaptive" and not algo.kl_in_reward:
      # One weight per row, an input of the step: the coefficient moves without a compile.
      out["kl_coef"] = np.full(np.shape(batch["tokens"])[:2], kl_coef, np.float32)
    # The high-entropy token selection reads the learner's entropies before the update,
    # for the whole batch: they come with the old log-probs, one pass, even for one update.
    needs_entropy = float(algo.top_entropy_fraction) < 1
    needs_old = (self._updates_per_step() > 1 or algo.kl_in_reward or algo.use_critic
                 or float(algo.tis_cap) > 0
                 or algo.policy_loss in loss_lib.COVARIANCE_LOSSES or needs_entropy
                 or (self.rl_teacher and not self.distill_in_step))
    if float(algo.tis_cap) > 0:
      out["behaviour_logprobs"] = batch["behaviour_logprobs"]
    # Routing replay: the updates take the experts of this pass (the policy before them;
    # routing_replay=old comes with several updates, so with old log-probs). With
    # routing_replay=rollout the batch brings the sampler's, which this pass replays too.
    replay = algo.routing_replay == "old"
    cur = (self._logprobs(self.state.params, batch, with_entropy=needs_entropy,
                          **({"with_routing": True} if replay else {}))
           if needs_old else None)
    if replay:
      out["routing"] = cur["routing"]
    if cur is not None:
      out["old_logprobs"] = cur["logprobs"]
    if needs_entropy:
      out["old_entropies"] = cur["entropies"]
    if float(algo.kl_coef) > 0 and not self._reference_in_step():
      reference = (models.without_lora(self.state.params) if self.cfg.lora_rank
                   else self.reference)
      out["ref_logprobs"] = self._logprobs(reference, ts.without_routing(batch))["logprobs"]
    est = algo.advantage_estimator
    shape = batch["tokens"].shape
    if est in adv_lib.SEQUENCE_LEVEL_ESTIMATORS:
      if self.rl_teacher:
        self._add_distillation(out, shape)
      return out
    flat = lambda x: jnp.asarray(x).reshape(-1, shape[-1])  # noqa: E731
    mask, seg = flat(batch["loss_mask"]), flat(batch["segment_ids"])
    token_rewards = flat(batch["rewards"]) * _last_token(mask, seg)
    kl = None
    if algo.kl_in_reward and float(algo.kl_coef) > 0:
      kl = loss_lib.kl_divergence(flat(out["old_logprobs"]), flat(out["ref_logprobs"]), mask,
                                  estimator=str(algo.kl_estimator))
      if algo.kl_controller == "adaptive":
        self._reward_kl = float(jnp.sum(kl) / jnp.maximum(jnp.sum(mask != 0), 1))
    if est == "gae":
      if kl is not None:
        token_rewards = token_rewards - kl_coef * kl
      values = flat(cur["values"])
      a, ret = adv_lib.gae_advantages(token_rewards, values, mask, gamma=float(algo.gamma),
                                      lam=float(algo.lam), segment_ids=seg)
      out["old_values"] = cur["values"]
      out["returns"] = ret.reshape(shape)
    else:
      a, ret = adv_lib.reinforce_plus_plus_advantages(
          token_rewards, mask, gamma=float(algo.gamma), kl=kl,
          kl_coef=kl_coef, segment_ids=seg)
    out["advantages"] = a.reshape(shape)
    if self.rl_teacher:
      self._add_distillation(out, shape)
    return out


class AsyncRollouts:
  """Disaggregated rollouts: a host thread generates step k's groups on the rollout mesh
  while the learner trains, at most `max_policy_lag` steps ahead of it.

  Groups whose oldest token came from a policy more than `max_policy_lag` versions behind
  the learner are dropped (dropped_stale) and the thread's next batch is used instead.
  With max_policy_lag=0 the thread waits for each update, which reproduces the colocated
  run exactly.
  """

  def __init__(self, trainer: Trainer, total_steps: int):
    self.t, self.total = trainer, total_steps
    self.lag = trainer.max_policy_lag
    self._queue: queue.Queue = queue.Queue(maxsize=self.lag + 1)
    self._cv = threading.Condition()
    self._done_steps = trainer.progress.rl_step
    self._next = trainer.progress.rl_step
    self._stop = False
    self._error: BaseException | None = None
    self._allowance = 0  # Extra batches owed for batches dropped whole.
    self._finished = trainer.progress.rl_step  # batches generated in full so far
    self._thread = threading.Thread(target=self._loop, name="rollouts", daemon=True)
    self._thread.start()

  def publish(self, done_steps: int):
    with self._cv:
      self._done_steps = done_steps
      self._cv.notify_all()

  def _loop(self):
    try:
      while True:
        with self._cv:
          # Never past the run's last batch (plus one for each batch dropped whole): an
          # extra batch would be generated for nothing, and on several hosts the final
          # weight sync would wait for it.
          self._cv.wait_for(lambda: self._stop or (
              self._next < self.total + self._allowance
              and self._next - self._done_steps - self._allowance <= self.lag))
          if self._stop:
            return
          k = self._next
          self._next += 1
        t0 = time.time()
        groups, extra = self.t._rollout(self.t._step_seed(k))
        item = (groups, extra, time.time() - t0)
        with self._cv:
          self._finished = k + 1
          self._cv.notify_all()
        while not self._stop:
          try:
            self._queue.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
    except BaseException as e:  # noqa: BLE001 - re-raised in the learner thread.
      self._error = e

  def wait_generated(self, n: int):
    """Blocks until the first `n` batches are generated in full, or all the run will
    generate (or the thread stopped)."""
    with self._cv:
      self._cv.wait_for(lambda: self._finished >= min(n, self.total + self._allowance)
                        or self._stop or self._error is not None)
    if self._error is not None:
      raise self._error

  def get(self):
    """The next batch within the staleness bound: (groups, extra metrics, generation s)."""
    dropped = 0
    while True:
      while True:
        if self._error is not None:
          raise self._error
        try:
          groups, extra, gen_s = self._queue.get(timeout=0.1)
          break
        except queue.Empty:
          continue
      version = self.t.progress.policy_version
      fresh = [g for g in groups
               if version - min(s.oldest_version for s in g.samples) <= self.lag]
      if self.t.partial == "drop":
        fresh = [g for g in fresh if len({v for s in g.samples for v in s.versions}) <= 1]
      dropped += len(groups) - len(fresh)
      if fresh:
        return fresh, {**extra, "dropped_stale": dropped}, gen_s
      # A whole batch was stale: the sampler's weights are too old to ever produce a fresh
      # one, so sync now (the bound wins over sync_every) and let the thread make another.
      if self.t.progress.policy_version - self.t.sampler_version > self.lag:
        self.t.sync_weights()
      with self._cv:
        self._allowance += 1
        self._cv.notify_all()

  def close(self):
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    self._thread.join(timeout=60)


def _last_token(mask, seg):
  """1.0 on the last trained target of each sequence (where its reward is credited)."""
  m = mask.astype(bool)

  def row(m_row, s_row):
    # Right to left, carrying the segment of the nearest masked position seen so far.
    def body(seen, x):
      mi, si = x
      return jnp.where(mi, si, seen), mi & (seen != si)
    _, last = jax.lax.scan(body, jnp.int32(-1), (m_row[::-1], s_row[::-1]))
    return last[::-1]

  return jax.vmap(row)(m, seg.astype(jnp.int32)).astype(jnp.float32)


def _print_eval_table(before: dict | None, after: dict | None, change: dict | None = None):
  """Held-out pass rates per family after SFT and after RL: pass@1 over the sampled
  completions at the rollout temperature when they were run (what RL maximises), and
  greedy; then the change over the paired tasks with its interval."""
  if not before or not after:
    return
  sampled = "sampled" in before and "sampled" in after
  fams = sorted(set(before["families"]) | set(after["families"]))
  reports = ([("pass@1", before["sampled"], after["sampled"])] if sampled else []) + [
      ("greedy", before, after)]
  print(f"{'':<14}" + "".join(f"{name:>16}" for name, _, _ in reports))
  print(f"{'family':<14}" + f"{'SFT':>8}{'RL':>8}" * len(reports))

  def row(name, key):
    line = f"{name:<14}"
    for _, *reps in reports:
      for rep in reps:
        line += f"{(rep['families'].get(key, 0) if key else rep['pass_rate']):>8.3f}"
    print(line)

  for f in fams:
    row(f, f)
  row("all", None)
  if change:
    parts = [f"{name} {c['difference']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]"
             for name in ("pass@1", "greedy") if (c := change.get(name))]
    print(f"RL - SFT over {change['tasks']} paired held-out tasks, "
          f"{round(100 * change['confidence'])}% interval: " + "; ".join(parts))
  if sampled:
    print("(pass@1: mean pass rate of eval.samples samples per held-out task at the rollout "
          "temperature, the quantity RL maximises; greedy: one temperature-0 answer)",
          flush=True)


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) the stages of `config` in `workdir`; returns a summary dict."""
  trainer = Trainer(config, workdir)
  try:
    return trainer.run()
  finally:
    trainer.worker.close()
    trainer.ckpt.close()
