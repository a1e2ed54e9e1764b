"""Llama 3.3 70B Instruct, GRPO through LoRA adapters on an NF4 base (QLoRA), on one TPU
v5e-8 host (eight 16 GiB chips).

    python -m launch.plan --config=configs/llama3_70b_qlora_grpo_v5e8.py --device_memory_gb=16
    python -m launch.plan --config=configs/llama3_70b_qlora_grpo_v5e8.py --compile_for=v5e:2x4
    python -m launch.train --config=configs/llama3_70b_qlora_grpo_v5e8.py --workdir=/mnt/ckpt/l3-70b-qlora

The 70B model's bfloat16 weights alone are 16.5 GiB a chip over eight chips: more than a
v5e chip holds, before any rollout. Held as NF4 codes with a bfloat16 scale per 64
values (`model.overrides.base_quantization`, `posttrain.models.quant`), its projections
take 0.27x of that (4.8 GiB a chip with the bfloat16 embeddings and head). The
checkpoint is read and quantized one tensor at a time, so no full-width copy is ever on
the chips. Each layer dequantizes its own weights where it runs (and again in the
backward pass), the rank-16 adapters train beside them, and the KL reference is the
quantized base with the adapters off. Compiled for a v5e-8 on a CPU host, the RL update
peaks at 11.3 GiB a chip and the rollout at 9.8 (BENCHMARKS.md, QLoRA).
`--config.model.overrides.base_quantization=int8` holds the base at 0.52x instead
(closer to the bfloat16 model: 8.8 GiB a chip), which compiles at the 14.4 GiB limit.

A quantized base cannot take in adapters and go on training (the rounding would undo
most of their update), so this config runs RL alone: an SFT stage before it is a run of
its own, exported merged (`launch.export`) and read from that folder.
"""

import ml_collections

from configs import llama3_70b_grpo_v5p256 as full


def get_config() -> ml_collections.ConfigDict:
  c = full.get_config()
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="", remat="full", dtype="bfloat16",
      param_dtype="bfloat16", scan_layers=True, lora_rank=16, lora_alpha=32.0,
      lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
      base_quantization="nf4", base_quantization_block=64))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=8, tensor=1, sequence=1))
  c.optim.lr = 1e-5
  c.train.rows_per_microbatch = 8
  c.train.row_len = 1536        # up to 512 of prompt, 1024 new tokens
  c.rollout.max_len = 1536
  c.rollout.max_new_tokens = 1024
  c.rl.num_minibatches = 1
  c.rollout.prompts_per_step = 8
  c.rollout.chunk_rows = 32
  c.rollout.gather_weights = False
  return c
