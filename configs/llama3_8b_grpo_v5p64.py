"""Llama 3.1 8B Instruct, GRPO, on a TPU v5p-64 slice (32 chips on 4 hosts, 95 GiB each).

Plan the memory first (no TPU needed):

    python -m launch.plan --config=configs/llama3_8b_grpo_v5p64.py --device_memory_gb=95

and compile its RL update and rollout for the slice on this host (libtpu,
`pip install -e '.[tpu]'`):

    python -m launch.plan --config=configs/llama3_8b_grpo_v5p64.py --compile_for=v5p:2x4x4

Weights and tokenizer come from a Hugging Face folder present on every host (HF_DIR
below; `--config.init_from=DIR --config.tokenizer=DIR` points elsewhere). From a
checkout with gcloud configured (see launch/tpu_pod.sh):

    export BUCKET=gs://my-bucket        # shared checkpoint/metrics dir, /mnt/ckpt on hosts
    launch/tpu_pod.sh create pt-v5p64 us-east5-a v5p-64
    launch/tpu_pod.sh setup  pt-v5p64 us-east5-a
    launch/tpu_pod.sh model  pt-v5p64 us-east5-a meta-llama/Llama-3.1-8B-Instruct \
        /mnt/models/Llama-3.1-8B-Instruct
    launch/tpu_pod.sh train  pt-v5p64 us-east5-a configs/llama3_8b_grpo_v5p64.py \
        /mnt/ckpt/llama3_8b_grpo
    launch/tpu_pod.sh logs   pt-v5p64 us-east5-a

`train` runs this on all 4 hosts at once, one process each (jax.distributed reads the
layout from the TPU metadata):

    gcloud compute tpus tpu-vm ssh pt-v5p64 --zone=us-east5-a --worker=all --command=\
      'cd ~/posttrain && ~/posttrain-venv/bin/python -m launch.train \
       --config=configs/llama3_8b_grpo_v5p64.py --workdir=/mnt/ckpt/llama3_8b_grpo'

Recipe (DeepSeekMath GRPO with the KL weight most open recipes use): 256 prompts x 8
samples per step, 1024 new tokens, lr 1e-6 with 4 optimizer steps per rollout batch.
Mesh: pure FSDP over the 32 chips; each micro-batch holds two 2048-token rows per chip.
"""

import ml_collections

from configs import default

HF_DIR = "/mnt/models/Llama-3.1-8B-Instruct"  # huggingface-cli download ... --local-dir


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "llama3_8b"
  # float32 master weights (and Adam moments): a 1e-6 step is below bfloat16's resolution.
  # fused_bwd: the TPU flash backward computes dq in its dk/dv kernel (5 block matmuls, not
  # 7); its f32 dq partials are counted by the plan (BENCHMARKS.md, TPU kernels).
  # scan_layers: the 32 layers run as one lax.scan; the update compiles in 38 s, not 266 s
  # (BENCHMARKS.md, scan_layers).
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="fused_bwd=true", remat="dots_with_no_batch_dims",
      dtype="bfloat16", param_dtype="float32", scan_layers=True))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=32, tensor=1, sequence=1))

  c.tasks.domains = "*"
  c.tasks.levels = "3,4,5"      # an instruct model already solves levels 1-2
  c.tasks.max_domains = 0
  c.sft.steps = 0               # RL straight from the instruct model

  c.algorithm = "grpo"
  c.rl.group_size = 8
  c.rl.kl_coef = 0.001
  c.rl.num_minibatches = 4
  c.optim = ml_collections.ConfigDict(dict(lr=1e-6, warmup=10, weight_decay=0.01, clip=1.0))
  c.train = ml_collections.ConfigDict(dict(rl_steps=300, row_len=2048, rows_per_microbatch=64,
                                           log_every=1))
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=256, max_new_tokens=1024, temperature=1.0, top_p=0.0, top_k=0,
      max_len=2048, chunk_rows=1024, scoring_threads=32, max_turns=1, max_draws=1024,
      gather_weights=True, continuous_batching=True, reward_source="verifier",
      reasoning="auto", thinking="", system_prompt="", tool_format="text"))
  c.eval = ml_collections.ConfigDict(dict(seeds_per_domain=32, samples=4, domains=""))
  c.checkpoint = ml_collections.ConfigDict(dict(every=25, keep_last=3, keep_every=100,
                                                async_save=True))
  return c
