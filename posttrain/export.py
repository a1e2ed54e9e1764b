"""A run's checkpoint as a Hugging Face folder, after the fact.

    export_checkpoint(config, workdir, "out/", step=40)       # merged weights + tokenizer
    export_checkpoint(config, workdir, "adapter/", adapter=True)   # PEFT LoRA adapter

`export_hf` writes the final model when a run ends; this writes any checkpoint of a run
(the best evaluation's, a preempted run's newest, one kept by `checkpoint.keep_every`),
as veRL's model merger and MaxText's checkpoint converters do. The run's config gives the
model: a policy run (`objective="policy"`) is written as its *ForCausalLM class, a reward
model run as its *ForSequenceClassification with `pad_token_id` the tokenizer's. LoRA
adapters are merged into the weights, or written alone as a PEFT adapter folder. The
tokenizer's files go beside the weights, so the folder loads on its own.

The checkpoint is restored read-only onto the run's train mesh (any device count: a
checkpoint restores onto a different mesh). With several processes, every one restores
and gathers, and process 0 writes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
from flax import nnx

from posttrain import models
from posttrain.checkpoint import CheckpointManager
from posttrain.data.tokenizer import load_tokenizer
from posttrain.experiment import (abstract_checkpoint, build_mesh, model_config, objective,
                                  optimizer_like, reward_model_config)
from posttrain.rl import train_step as ts

log = logging.getLogger("posttrain")

DTYPES = ("float32", "bfloat16", "float16")


def _check_adapter_base(extras: dict | None, step: int) -> None:
  """Refuses an adapter export whose adapters are not relative to the run's starting
  weights: entering preference training or RL, a LoRA run folds the earlier stage's
  trained adapters into its base weights and trains fresh ones (the stage's reference),
  so the checkpoint's adapters alone would drop that stage's update."""
  progress = (extras or {}).get("progress") or {}
  stage = progress.get("stage", "sft")
  folded = [f"{name} ({n} steps)" for name, n, later in (
      ("SFT", progress.get("sft_step", 0), ("preference", "rl", "done")),
      ("preference", progress.get("pref_step", 0), ("rl", "done"))) if n and stage in later]
  # The trainer counts what it folded; checkpoints older than that count folded always.
  if not progress.get("folded_steps", 1):
    folded = []
  if folded:
    raise ValueError(f"checkpoint {step} is past this run's {' and '.join(folded)} stage, "
                     "whose adapters were folded into the base weights: its adapters alone "
                     "would drop that update; export merged weights (adapter=False), or "
                     "run the stages as runs of their own (RL from the merged SFT export)")


def export_checkpoint(config, workdir: str, out: str, *, step: int | None = None,
                      dtype: str | None = None, adapter: bool = False,
                      max_shard_bytes: int = 4 << 30) -> dict[str, Any]:
  """Writes checkpoint `step` of the run in `workdir` (None: the newest complete one) to
  the folder `out`.

  Args:
    config: the run's config (its model, tokenizer, mesh and objective).
    workdir: the run's workdir (checkpoints/ inside).
    out: the folder to write (created; files of the same names are replaced).
    step: the checkpoint step.
    dtype: the tensors' dtype (default: the model's param_dtype); not with `adapter`.
    adapter: write the LoRA adapters alone, as a PEFT adapter folder (a reward model's
      with its score head); the run must have trained adapters, over the weights it
      started from (not past an SFT or preference stage that trained them).
    max_shard_bytes: the largest safetensors file of the merged weights.

  Returns:
    `{"step", "out", "architecture", "adapter"}`.

  Raises:
    ValueError: no checkpoints, an unknown step, a model the Hugging Face class cannot
      hold, `adapter` without adapters or past a stage whose adapters were folded into
      the base (`_check_adapter_base`), or a bad dtype.
  """
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}; expected one of {DTYPES}")
  if adapter and dtype is not None:
    raise ValueError("dtype applies to merged weights; an adapter keeps its own dtype")
  if os.path.abspath(out) == os.path.abspath(workdir):
    raise ValueError(f"out={out!r} is the run's workdir; write the export elsewhere")
  kind = objective(config)
  tok = load_tokenizer(config.tokenizer)
  cfg = (reward_model_config if kind == "reward_model" else model_config)(config,
                                                                          tok.vocab_size)
  if adapter and not cfg.lora_rank:
    raise ValueError("adapter=True needs a run with LoRA adapters (model.overrides."
                     "lora_rank > 0); this run trained every weight")
  models.hf.check_exportable(cfg)
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise ValueError(f"workdir={workdir!r} has no checkpoints/ folder")
  mesh = build_mesh(config)
  rules = models.rules_from_config(config.get("sharding_rules") or None)
  manager = CheckpointManager(directory, read_only=True)
  try:
    steps = manager.all_steps()
    if step is not None and step not in steps:
      raise ValueError(f"step={step} is not a checkpoint in {directory}; have {steps}")
    restored = manager.restore(abstract_checkpoint(cfg, optimizer_like(config), mesh, rules),
                               step=step)
  finally:
    manager.close()
  if restored is None:
    raise ValueError(f"no complete checkpoint in {directory}")
  state, extras, step = restored
  if adapter:
    _check_adapter_base(extras, step)
  graphdef, _, rest = ts._split_abstract(cfg)
  model = nnx.merge(graphdef, state["params"], rest)
  if adapter:
    models.save_lora_adapter(model, out,
                             base_model_name_or_path=str(config.get("init_from", "") or ""))
  else:
    models.save_pretrained(model, out, max_shard_bytes=max_shard_bytes, dtype=dtype,
                           pad_token_id=tok.pad_id if kind == "reward_model" else None)
  if jax.process_index() == 0:  # with its tokenizer's files, when it has any
    tok.save(out)
  log.info("exported checkpoint %d of %s to %s (%s%s)", step, workdir, out, cfg.architecture,
           ", LoRA adapter" if adapter else "")
  return {"step": int(step), "out": out, "architecture": cfg.architecture,
          "adapter": bool(adapter)}
