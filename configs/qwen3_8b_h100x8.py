"""Qwen3 8B, GRPO, on one host with 8 NVIDIA H100 80GB GPUs (one process).

Plan the memory first:

    python -m launch.plan --config=configs/qwen3_8b_h100x8.py --device_memory_gb=79

Weights and tokenizer come from a Hugging Face folder (HF_DIR below;
`--config.init_from=DIR --config.tokenizer=DIR` points elsewhere):

    pip install -e '.[hf]' 'jax[cuda12]>=0.10.0,<0.12'
    huggingface-cli download Qwen/Qwen3-8B --local-dir /data/models/Qwen3-8B
    # XLA takes 75% of each GPU by default; the plan assumes it may use ~90%.
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python -m launch.train \
        --config=configs/qwen3_8b_h100x8.py --workdir=/data/runs/qwen3_8b_grpo

Several such hosts: the same command on each, plus `--coordinator_address=HOST0:8476
--num_processes=N --process_id=I` (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID), a shared --workdir, and `--config.mesh.fsdp=-1`.

Recipe: GRPO with a small KL (0.001), 128 prompts x 8 samples per step, 4096 new
tokens (Qwen3 reasons at length), lr 1e-6 with 4 optimizer steps per rollout batch.
Mesh: FSDP over the 8 GPUs (NVLink); one 5120-token row per GPU per micro-batch.
"""

import ml_collections

from configs import default

HF_DIR = "/data/models/Qwen3-8B"  # huggingface-cli download Qwen/Qwen3-8B --local-dir ...


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "qwen3_8b"
  # float32 master weights (and Adam moments): a 1e-6 step is below bfloat16's resolution.
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="", remat="dots_with_no_batch_dims",
      dtype="bfloat16", param_dtype="float32", scan_layers=False))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=8, tensor=1, sequence=1))

  c.tasks.domains = "*"
  c.tasks.levels = "3,4,5"
  c.tasks.max_domains = 0
  c.sft.steps = 0

  c.algorithm = "grpo"
  c.rl.group_size = 8
  c.rl.kl_coef = 0.001
  c.rl.num_minibatches = 4
  c.optim = ml_collections.ConfigDict(dict(lr=1e-6, warmup=10, weight_decay=0.01, clip=1.0))
  c.train = ml_collections.ConfigDict(dict(rl_steps=300, row_len=5120, rows_per_microbatch=8,
                                           log_every=1))
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=128, max_new_tokens=4096, temperature=1.0, top_p=0.0, top_k=0,
      max_len=5120, chunk_rows=256, scoring_threads=16, max_turns=1, max_draws=512,
      gather_weights=True, continuous_batching=True, reward_source="verifier",
      # Qwen3 thinks in a <think> block: the verifiers read what follows it.
      reasoning="auto", thinking="", system_prompt="", tool_format="text"))
  c.eval = ml_collections.ConfigDict(dict(seeds_per_domain=32, samples=4, domains=""))
  c.checkpoint = ml_collections.ConfigDict(dict(every=25, keep_last=3, keep_every=100,
                                                async_save=True))
  return c
