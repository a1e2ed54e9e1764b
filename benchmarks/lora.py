"""LoRA: a GRPO step training rank-r adapters against the full fine-tune, side by side.

    python -m benchmarks.lora [--quick]

A GRPO step (the KL reference's log-probs and the update in one program, AdamW, remat
"full") of the "bench" widths on 8 fake CPU devices (fsdp 8), arms interleaved in one
process: the first step (compile included), the median warm step, the learner's
resident bytes (params, optimizer state and the KL reference: a frozen copy for the full
fine-tune, none with adapters, whose reference is the base weights) and XLA's temporary
bytes of the compiled update, per device.

The QLoRA arms hold the same base (the same draw) quantized (`base_quantization` int8 /
nf4, block 64) under rank-8 adapters; "base logprob error" is the largest and the mean
|log p| gap of their first pass (adapters still zero: the base alone) against the rank-8
arm's over the batch's trained tokens.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def _bytes_per_device(tree) -> int:
  import jax
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == x.addressable_shards[0].device)


def run(quick: bool = False) -> list[dict]:
  from benchmarks.scan_layers import grpo_batch, time_steps
  from posttrain import models
  from posttrain.rl import presets
  from posttrain.rl import state as state_lib
  from posttrain.rl import train_step as ts
  mesh = models.make_mesh((1, -1, 1, 1))
  batch = grpo_batch()
  inputs = {k: v for k, v in batch.items() if k in ts.TOKEN_KEYS and k != "ref_logprobs"}
  algo = presets.algorithm_config("grpo", kl_coef=0.04)
  optimizer = state_lib.make_optimizer(1e-5, warmup=0, total_steps=100)
  base = models.get_preset("bench", num_layers=4 if quick else 8, remat="full")
  arms = {"full fine-tune": base, "LoRA r=8": base.replace(lora_rank=8, lora_alpha=16.0),
          "LoRA r=64": base.replace(lora_rank=64, lora_alpha=128.0)}
  for kind in ("int8", "nf4"):
    arms[f"QLoRA r=8 {kind}"] = arms["LoRA r=8"].replace(base_quantization=kind)
  steps, states, refs, rows, logprobs = {}, {}, {}, [], {}
  mask = np.asarray(inputs["loss_mask"]) > 0
  for name, cfg in arms.items():
    steps[name] = ts.make_train_step(cfg, algo, optimizer, mesh=mesh, reference_in_step=True)
    states[name] = state_lib.init_train_state(models.create_model(cfg, mesh=mesh), optimizer,
                                              mesh=mesh)
    refs[name] = None if cfg.lora_rank else state_lib.frozen_copy(states[name].params)
    if cfg.lora_rank == 8:
      logprobs[name] = np.asarray(ts.make_compute_logprobs(cfg, mesh=mesh)(
          states[name].params, inputs)["logprobs"])[mask]
  first, warm = time_steps(steps, states, refs, batch)
  for name, cfg in arms.items():
    state = states[name]
    args = (state, inputs) + ((refs[name],) if refs[name] is not None else ())
    temp = steps[name].jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes
    learner = (_bytes_per_device(state.params) + _bytes_per_device(state.opt_state)
               + (_bytes_per_device(refs[name]) if refs[name] is not None else 0))
    rows.append({"arm": name, "trained params": cfg.num_lora_params or cfg.num_params,
                 "first step s": round(first[name], 2),
                 "warm step s (median)": round(warm[name], 3),
                 "learner MiB/device": round(learner / 2**20, 2),
                 "update temporaries MiB/device": round(temp / 2**20, 2),
                 "warm / full": round(warm[name] / warm["full fine-tune"], 2)})
    if cfg.base_quantization:
      gap = np.abs(logprobs[name] - logprobs["LoRA r=8"])
      rows[-1]["base logprob error max / mean"] = f"{gap.max():.3f} / {gap.mean():.4f}"
  full = rows[0]["learner MiB/device"]
  for row in rows:
    row["learner / full"] = round(row["learner MiB/device"] / full, 2)
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  from benchmarks.run import table
  print(table(run(args.quick)))


if __name__ == "__main__":
  main()
