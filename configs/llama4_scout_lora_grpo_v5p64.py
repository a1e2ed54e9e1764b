"""Llama 4 Scout (17B active, 16 experts), GRPO with LoRA, on a TPU v5p-64 slice (32
chips on 4 hosts, 95 GiB each).

Plan the memory first (no TPU needed), then compile its RL update and rollout for the
slice on this host (libtpu, `pip install -e '.[tpu]'`):

    python -m launch.plan --config=configs/llama4_scout_lora_grpo_v5p64.py --device_memory_gb=95
    python -m launch.plan --config=configs/llama4_scout_lora_grpo_v5p64.py --device_memory_gb=95 \
        --compile_for=v5p:2x4x4

Weights and tokenizer: the published folder (Llama4ForConditionalGeneration; its
language model is read, the vision tower left in the files) on every host, HF_DIR
below. From a checkout with gcloud configured (see launch/tpu_pod.sh):

    export BUCKET=gs://my-bucket        # shared checkpoint/metrics dir, /mnt/ckpt on hosts
    launch/tpu_pod.sh create pt-v5p64 us-east5-a v5p-64
    launch/tpu_pod.sh setup  pt-v5p64 us-east5-a
    launch/tpu_pod.sh model  pt-v5p64 us-east5-a meta-llama/Llama-4-Scout-17B-16E-Instruct \
        /mnt/models/Llama-4-Scout-17B-16E-Instruct
    launch/tpu_pod.sh train  pt-v5p64 us-east5-a configs/llama4_scout_lora_grpo_v5p64.py \
        /mnt/ckpt/llama4_scout_grpo

Maverick (`--config.model.preset=llama4_maverick`, 400.7B) compiles on the same slice
with the same mesh: update 56.3 GiB a chip, rollout 47.6, with what stays resident beside
each (the sampler shares the learner's frozen base; 79.7 and 70.9 with its own copy).
With expert parallelism (`--config.sharding_rules='(("experts", ("fsdp",)),)'`, 8
experts a chip, never gathered) they compile to 39.1 and 33.4 GiB (planned 42.8 and
36.0). For Scout it costs more (21.3 GiB compiled against 19.3): one expert a chip takes
the tokens of 16 chips to spare a 1.9 GiB layer of experts.

Recipe: GRPO with a small KL (0.001), 128 prompts x 8 samples per step, 1024 new tokens.
107.8B parameters, stored bfloat16 and frozen; LoRA of rank 16 on the attention and the
shared experts (the default targets of a mixture with a shared expert) trains 56M, lr
2e-5. Mesh: FSDP 16 x tensor 2: each chip's expert slice is 4096 wide (F over tensor).
The sampler decodes with the weights left sharded: gathered over fsdp, the bfloat16
model over 2 would be 100 GiB a chip. Compiled for the slice on a CPU host (libtpu
0.0.42.1, 2.8 GiB of host memory, 1.7 min): the update peaks at 19.3 GiB a chip with the
sampler's adapters beside it (planned 19.4), the rollout at 15.6 (planned 15.3).
"""

import ml_collections

from configs import default

HF_DIR = "/mnt/models/Llama-4-Scout-17B-16E-Instruct"  # huggingface-cli download ...


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "llama4_scout"
  # bfloat16 base weights (frozen under LoRA); the adapters train. scan_layers: the 48
  # layers run as one lax.scan. remat full: each layer keeps its input alone.
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="", remat="full", dtype="bfloat16",
      param_dtype="bfloat16", scan_layers=True, lora_rank=16, lora_alpha=32.0,
      lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=16, tensor=2, sequence=1))

  c.tasks.domains = "*"
  c.tasks.levels = "3,4,5"      # an instruct model already solves levels 1-2
  c.tasks.max_domains = 0
  c.sft.steps = 0               # RL straight from the released model

  c.algorithm = "grpo"
  c.rl.group_size = 8
  c.rl.kl_coef = 0.001
  c.rl.num_minibatches = 4
  c.optim = ml_collections.ConfigDict(dict(lr=2e-5, warmup=10, weight_decay=0.0, clip=1.0))
  c.train = ml_collections.ConfigDict(dict(rl_steps=300, row_len=2048, rows_per_microbatch=64,
                                           log_every=1))
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=128, max_new_tokens=1024, temperature=1.0, top_p=0.0, top_k=0,
      max_len=2048, chunk_rows=512, scoring_threads=32, max_turns=1, max_draws=1024,
      gather_weights=False, continuous_batching=True, reward_source="verifier",
      reasoning="auto", thinking="", system_prompt="", tool_format="text"))
  c.eval = ml_collections.ConfigDict(dict(seeds_per_domain=32, samples=4, domains=""))
  c.checkpoint = ml_collections.ConfigDict(dict(every=25, keep_last=3, keep_every=100,
                                                async_save=True))
  return c
