"""Qwen3.5-27B (three Gated DeltaNet layers to each gated full-attention layer), GRPO, on
a TPU v5p-64 slice (32 chips on 4 hosts, 95 GiB each).

Plan the memory first (no TPU needed):

    python -m launch.plan --config=configs/qwen3_5_27b_grpo_v5p64.py --device_memory_gb=95

and compile its RL update and rollout for the slice on this host (libtpu,
`pip install -e '.[tpu]'`):

    python -m launch.plan --config=configs/qwen3_5_27b_grpo_v5p64.py --device_memory_gb=95 \
        --compile_for=v5p:2x4x4

Weights and tokenizer come from a Hugging Face folder present on every host (HF_DIR
below: the published Qwen3_5ForConditionalGeneration folder, whose language model is
read and whose vision tower is left in the files). From a checkout with gcloud
configured (see launch/tpu_pod.sh):

    export BUCKET=gs://my-bucket        # shared checkpoint/metrics dir, /mnt/ckpt on hosts
    launch/tpu_pod.sh create pt-v5p64 us-east5-a v5p-64
    launch/tpu_pod.sh setup  pt-v5p64 us-east5-a
    launch/tpu_pod.sh model  pt-v5p64 us-east5-a Qwen/Qwen3.5-27B /mnt/models/Qwen3.5-27B
    launch/tpu_pod.sh train  pt-v5p64 us-east5-a configs/qwen3_5_27b_grpo_v5p64.py \
        /mnt/ckpt/qwen3_5_27b_grpo
    launch/tpu_pod.sh logs   pt-v5p64 us-east5-a

`train` runs this on all 4 hosts at once, one process each (jax.distributed reads the
layout from the TPU metadata):

    gcloud compute tpus tpu-vm ssh pt-v5p64 --zone=us-east5-a --worker=all --command=\
      'cd ~/posttrain && ~/posttrain-venv/bin/python -m launch.train \
       --config=configs/qwen3_5_27b_grpo_v5p64.py --workdir=/mnt/ckpt/qwen3_5_27b_grpo'

Recipe: GRPO with a small KL (0.001), 256 prompts x 8 samples per step, 1024 new tokens,
lr 1e-6 with 4 optimizer steps per rollout batch. 26.9B parameters in 64 layers: 48
Gated DeltaNet layers (16 key and 48 value heads of 128; a fixed-size recurrent state
in the rollout's cache, whatever the length) and 16 full-attention layers (24 heads, 4
kv heads of 256, output gated). Mesh: FSDP 16 x tensor 2 (the linear layers' heads and
the MLP split over tensor). remat "full": a layer keeps only its input. Under
dots_with_no_batch_dims each linear layer also keeps its projections' outputs (q, k, v
and z are 10k wide a token), which does not fit at eight 2048-token rows per fsdp shard
(`launch.plan` says so and suggests this). Compiled for the slice on a CPU host (libtpu
0.0.42.1, 3.5 GiB of host memory, 5 min): the update peaks at 52.2 GiB a chip with what
stays resident beside it, where the plan says 52.5, the rollout at 54.9 (planned 55.2:
its prefill keeps a relaid copy of the linear layers' input projections, 3.77 GiB a chip).
Both fit the 85.5 GiB usable.
"""

import ml_collections

from configs import default

HF_DIR = "/mnt/models/Qwen3.5-27B"  # huggingface-cli download ... --local-dir


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "qwen3_5_27b"
  # float32 master weights (and Adam moments): a 1e-6 step is below bfloat16's resolution.
  # scan_layers: one lax.scan over periods of four layers (three linear, one full).
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="fused_bwd=true", remat="full",
      dtype="bfloat16", param_dtype="float32", scan_layers=True))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=16, tensor=2, sequence=1))

  c.tasks.domains = "*"
  c.tasks.levels = "3,4,5"      # an instruct model already solves levels 1-2
  c.tasks.max_domains = 0
  c.sft.steps = 0               # RL straight from the released model

  c.algorithm = "grpo"
  c.rl.group_size = 8
  c.rl.kl_coef = 0.001
  c.rl.num_minibatches = 4
  c.optim = ml_collections.ConfigDict(dict(lr=1e-6, warmup=10, weight_decay=0.01, clip=1.0))
  c.train = ml_collections.ConfigDict(dict(rl_steps=300, row_len=2048, rows_per_microbatch=128,
                                           log_every=1))
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=256, max_new_tokens=1024, temperature=1.0, top_p=0.0, top_k=0,
      max_len=2048, chunk_rows=1024, scoring_threads=32, max_turns=1, max_draws=1024,
      gather_weights=True, continuous_batching=True, reward_source="verifier",
      # Qwen3.5 thinks in a <think> block: the verifiers read what follows it.
      reasoning="auto", thinking="", system_prompt="", tool_format="text"))
  c.eval = ml_collections.ConfigDict(dict(seeds_per_domain=32, samples=4, domains=""))
  c.checkpoint = ml_collections.ConfigDict(dict(every=25, keep_last=3, keep_every=100,
                                                async_save=True))
  return c
