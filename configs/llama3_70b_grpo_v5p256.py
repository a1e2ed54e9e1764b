"""Llama 3.3 70B Instruct, GRPO, on a TPU v5p-256 slice (128 chips on 32 hosts, 95 GiB each).

Plan the memory first (no TPU needed):

    python -m launch.plan --config=configs/llama3_70b_grpo_v5p256.py --device_memory_gb=95

and compile its RL update and rollout for the slice on this host (libtpu,
`pip install -e '.[tpu]'`):

    python -m launch.plan --config=configs/llama3_70b_grpo_v5p256.py --compile_for=v5p:4x4x8

Weights and tokenizer come from a Hugging Face folder present on every host (HF_DIR
below; `--config.init_from=DIR --config.tokenizer=DIR` points elsewhere). From a
checkout with gcloud configured (see launch/tpu_pod.sh):

    export BUCKET=gs://my-bucket        # shared checkpoint/metrics dir, /mnt/ckpt on hosts
    launch/tpu_pod.sh create pt-v5p256 us-east5-a v5p-256
    launch/tpu_pod.sh setup  pt-v5p256 us-east5-a
    launch/tpu_pod.sh model  pt-v5p256 us-east5-a meta-llama/Llama-3.3-70B-Instruct \
        /mnt/models/Llama-3.3-70B-Instruct
    launch/tpu_pod.sh train  pt-v5p256 us-east5-a configs/llama3_70b_grpo_v5p256.py \
        /mnt/ckpt/llama3_70b_grpo
    launch/tpu_pod.sh logs   pt-v5p256 us-east5-a

`train` runs this on all 32 hosts at once, one process each (jax.distributed reads the
layout from the TPU metadata):

    gcloud compute tpus tpu-vm ssh pt-v5p256 --zone=us-east5-a --worker=all --command=\
      'cd ~/posttrain && ~/posttrain-venv/bin/python -m launch.train \
       --config=configs/llama3_70b_grpo_v5p256.py --workdir=/mnt/ckpt/llama3_70b_grpo'

Recipe: GRPO with a small KL (0.001), 256 prompts x 8 samples per step, 2048 new tokens,
lr 5e-7 with 4 optimizer steps per rollout batch. Mesh: FSDP 32 x tensor 4 (tensor
parallelism inside each 4-chip host splits heads, MLP and the KV cache); remat "full".
"""

import ml_collections

from configs import default

HF_DIR = "/mnt/models/Llama-3.3-70B-Instruct"  # huggingface-cli download ... --local-dir


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "llama3_70b"
  # float32 master weights (and Adam moments): a 5e-7 step is below bfloat16's resolution.
  # scan_layers: the 80 layers run as one lax.scan. Compiled for the slice on a 24 GiB
  # host the update takes 46 s and 2.3 GiB; the layer list ran the host out of memory.
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="", remat="full", dtype="bfloat16",
      param_dtype="float32", scan_layers=True))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=32, tensor=4, sequence=1))

  c.tasks.domains = "*"
  c.tasks.levels = "3,4,5"
  c.tasks.max_domains = 0
  c.sft.steps = 0

  c.algorithm = "grpo"
  c.rl.group_size = 8
  c.rl.kl_coef = 0.001
  c.rl.num_minibatches = 4
  c.optim = ml_collections.ConfigDict(dict(lr=5e-7, warmup=10, weight_decay=0.01, clip=1.0))
  c.train = ml_collections.ConfigDict(dict(rl_steps=200, row_len=3072, rows_per_microbatch=64,
                                           log_every=1))
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=256, max_new_tokens=2048, temperature=1.0, top_p=0.0, top_k=0,
      max_len=3072, chunk_rows=1024, scoring_threads=32, max_turns=1, max_draws=1024,
      gather_weights=True, continuous_batching=True, reward_source="verifier",
      reasoning="auto", thinking="", system_prompt="", tool_format="text"))
  c.eval = ml_collections.ConfigDict(dict(seeds_per_domain=16, samples=4, domains=""))
  c.checkpoint = ml_collections.ConfigDict(dict(every=20, keep_last=2, keep_every=100,
                                                async_save=True))
  return c
