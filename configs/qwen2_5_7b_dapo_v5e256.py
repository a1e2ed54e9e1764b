"""Qwen2.5 7B Instruct, DAPO, on a TPU v5e-256 slice (256 chips on 64 hosts, 16 GiB each).

Plan the memory first (no TPU needed):

    python -m launch.plan --config=configs/qwen2_5_7b_dapo_v5e256.py --device_memory_gb=16

and compile its RL update and rollout for the slice on this host (libtpu,
`pip install -e '.[tpu]'`):

    python -m launch.plan --config=configs/qwen2_5_7b_dapo_v5e256.py --compile_for=v5e:16x16

Weights and tokenizer come from a Hugging Face folder present on every host (HF_DIR
below; `--config.init_from=DIR --config.tokenizer=DIR` points elsewhere). From a
checkout with gcloud configured (see launch/tpu_pod.sh):

    export BUCKET=gs://my-bucket        # shared checkpoint/metrics dir, /mnt/ckpt on hosts
    launch/tpu_pod.sh create pt-v5e256 us-west4-a v5litepod-256
    launch/tpu_pod.sh setup  pt-v5e256 us-west4-a
    launch/tpu_pod.sh model  pt-v5e256 us-west4-a Qwen/Qwen2.5-7B-Instruct \
        /mnt/models/Qwen2.5-7B-Instruct
    launch/tpu_pod.sh train  pt-v5e256 us-west4-a configs/qwen2_5_7b_dapo_v5e256.py \
        /mnt/ckpt/qwen2_5_7b_dapo
    launch/tpu_pod.sh logs   pt-v5e256 us-west4-a

`train` runs this on all 64 hosts at once, one process each (jax.distributed reads the
layout from the TPU metadata):

    gcloud compute tpus tpu-vm ssh pt-v5e256 --zone=us-west4-a --worker=all --command=\
      'cd ~/posttrain && ~/posttrain-venv/bin/python -m launch.train \
       --config=configs/qwen2_5_7b_dapo_v5e256.py --workdir=/mnt/ckpt/qwen2_5_7b_dapo'

Recipe (Yu et al. 2025, scaled to a 7B model and 8k responses): 512 prompts x 16 samples
per step, clip-higher (eps_high 0.28), token-mean loss, dynamic sampling, the soft
overlong penalty over the last 2048 tokens, no KL, lr 1e-6 with 16 optimizer steps per
rollout batch. Mesh: FSDP 64 x tensor 4 (tensor parallelism inside each 4-chip host
keeps the 16 GiB chips' KV cache and activations small); remat "full" for 9k-token rows.
"""

import ml_collections

from configs import default

HF_DIR = "/mnt/models/Qwen2.5-7B-Instruct"  # huggingface-cli download ... --local-dir


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "qwen2_5_7b"
  # float32 master weights (and Adam moments): a 1e-6 step is below bfloat16's resolution.
  # fused_bwd: the TPU flash backward computes dq in its dk/dv kernel (5 block matmuls, not
  # 7); its f32 dq partials are counted by the plan (BENCHMARKS.md, TPU kernels).
  # scan_layers: the 28 layers run as one lax.scan; the update compiles in 42 s, not 154 s
  # (BENCHMARKS.md, scan_layers).
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="fused_bwd=true", remat="full",
      dtype="bfloat16", param_dtype="float32", scan_layers=True))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=64, tensor=4, sequence=1))

  c.tasks.domains = "*"
  c.tasks.levels = "3,4,5"
  c.tasks.max_domains = 0
  c.sft.steps = 0

  c.algorithm = "dapo"
  c.rl.group_size = 16
  c.rl.overlong_buffer_len = 2048
  c.rl.num_minibatches = 16
  c.optim = ml_collections.ConfigDict(dict(lr=1e-6, warmup=20, weight_decay=0.1, clip=1.0))
  c.train = ml_collections.ConfigDict(dict(rl_steps=200, row_len=9216, rows_per_microbatch=64,
                                           log_every=1))
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=512, max_new_tokens=8192, temperature=1.0, top_p=0.0, top_k=0,
      max_len=9216, chunk_rows=1024, scoring_threads=16, max_turns=1, max_draws=1536,
      gather_weights=True, continuous_batching=True, reward_source="verifier",
      reasoning="auto", thinking="", system_prompt="", tool_format="text"))
  c.eval = ml_collections.ConfigDict(dict(seeds_per_domain=32, samples=4, domains=""))
  c.checkpoint = ml_collections.ConfigDict(dict(every=20, keep_last=3, keep_every=100,
                                                async_save=True))
  return c
