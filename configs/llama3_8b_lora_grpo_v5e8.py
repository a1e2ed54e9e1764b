"""Llama 3.1 8B Instruct, GRPO with LoRA adapters (rank 64) on a TPU v5e-8 (one host).

    python -m launch.plan --config=configs/llama3_8b_lora_grpo_v5e8.py --device_memory_gb=16
    python -m launch.train --config=configs/llama3_8b_lora_grpo_v5e8.py --workdir=gs://BUCKET/runs/l3-8b-lora

A full fine-tune of the 8B model needs a v5p-64 slice (configs/llama3_8b_grpo_v5p64.py:
float32 master weights, AdamW moments and a frozen reference copy). Trained through
rank-64 adapters on every projection, the base weights stay bfloat16 and frozen, AdamW
keeps moments for the 168M adapter parameters only, and the KL reference is the base
itself (adapters off), so the run fits eight 16 GiB v5e chips. `launch.plan` gives the
bytes per device; the final policy is exported merged (`export_hf`), and
`models.save_lora_adapter` writes the adapter alone in PEFT's format.
"""

import ml_collections

from configs import llama3_8b_grpo_v5p64 as full


def get_config() -> ml_collections.ConfigDict:
  c = full.get_config()
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="", remat="full", dtype="bfloat16",
      param_dtype="bfloat16", scan_layers=True, lora_rank=64, lora_alpha=128.0,
      lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
      base_quantization=""))  # int8 / nf4: the base held quantized (QLoRA)
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=8, tensor=1, sequence=1))
  c.optim.lr = 1e-5             # adapters take a larger step than full weights
  c.train.rows_per_microbatch = 8
  c.rollout.prompts_per_step = 32
  # 256 rows a step, sampled 128 at a time with the weights left sharded (gathering the
  # whole bfloat16 model onto every chip for decode would take 15 GiB of the 16).
  c.rollout.chunk_rows = 128
  c.rollout.gather_weights = False
  return c
