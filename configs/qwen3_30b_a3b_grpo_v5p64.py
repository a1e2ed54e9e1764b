"""Qwen3-30B-A3B (mixture of experts), GRPO, on a TPU v5p-64 slice (32 chips on 4 hosts,
95 GiB each).

Plan the memory first (no TPU needed):

    python -m launch.plan --config=configs/qwen3_30b_a3b_grpo_v5p64.py --device_memory_gb=95

and compile its RL update and rollout for the slice on this host (libtpu,
`pip install -e '.[tpu]'`):

    python -m launch.plan --config=configs/qwen3_30b_a3b_grpo_v5p64.py --device_memory_gb=95 \
        --compile_for=v5p:2x4x4

Weights and tokenizer come from a Hugging Face folder present on every host (HF_DIR
below; `--config.init_from=DIR --config.tokenizer=DIR` points elsewhere). From a
checkout with gcloud configured (see launch/tpu_pod.sh):

    export BUCKET=gs://my-bucket        # shared checkpoint/metrics dir, /mnt/ckpt on hosts
    launch/tpu_pod.sh create pt-v5p64 us-east5-a v5p-64
    launch/tpu_pod.sh setup  pt-v5p64 us-east5-a
    launch/tpu_pod.sh model  pt-v5p64 us-east5-a Qwen/Qwen3-30B-A3B /mnt/models/Qwen3-30B-A3B
    launch/tpu_pod.sh train  pt-v5p64 us-east5-a configs/qwen3_30b_a3b_grpo_v5p64.py \
        /mnt/ckpt/qwen3_30b_a3b_grpo
    launch/tpu_pod.sh logs   pt-v5p64 us-east5-a

`train` runs this on all 4 hosts at once, one process each (jax.distributed reads the
layout from the TPU metadata):

    gcloud compute tpus tpu-vm ssh pt-v5p64 --zone=us-east5-a --worker=all --command=\
      'cd ~/posttrain && ~/posttrain-venv/bin/python -m launch.train \
       --config=configs/qwen3_30b_a3b_grpo_v5p64.py --workdir=/mnt/ckpt/qwen3_30b_a3b_grpo'

Recipe: GRPO with a small KL (0.001), 256 prompts x 8 samples per step, 1024 new tokens,
lr 1e-6 with 4 optimizer steps per rollout batch. 30.5B parameters, 3.3B active a token:
128 experts of width 768 in each of 48 layers, 8 per token.
Mesh: FSDP 16 x tensor 2. Every chip holds every expert of a layer (D gathered over
fsdp, F split over tensor), so the sampler's weights gathered over fsdp are the whole
model over 2 (28 GiB); pure FSDP would put all 57 GiB on every chip. Tensor 2, not 4:
each chip's expert slice is then 384 wide, a multiple of TPU's 128 lanes. At 192
(tensor 4) XLA:TPU keeps a padded, relaid copy of every layer's gate and up experts
through the decode loop (12 GiB a chip) and pads their float32 gradients by a third.
Each micro-batch holds eight 2048-token rows per fsdp shard. Compiled for the slice on
a CPU host (libtpu 0.0.42.1, 3.1 GiB of host memory, 2.5 min): the update peaks at 51.2
GiB a chip with what stays resident beside it (planned 52.0), the rollout at 55.6
(planned 54.2). With LoRA of rank 16 on the attention and every routed expert
(`--config.model.overrides.lora_rank=16`, 0.64B adapter parameters) the update peaks
at 34.8 GiB with the sampler's weights (planned 36.2) and the rollout at 46.6 (planned
45.0): BENCHMARKS.md, LoRA.
With four updates a batch the routers move under the ratio: `--config.rl.routing_replay=
rollout` has the learner take the experts the sampler chose for every token (R3; `old`:
those of the policy before the first update), planned at +96 MiB a chip of batch and
+48 MiB beside the KV cache (uint8 experts; peak 54.25 GiB).
"""

import ml_collections

from configs import default

HF_DIR = "/mnt/models/Qwen3-30B-A3B"  # huggingface-cli download ... --local-dir


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "qwen3_30b_a3b"
  # float32 master weights (and Adam moments): a 1e-6 step is below bfloat16's resolution.
  # scan_layers: the 48 layers run as one lax.scan (one layer's program at any depth).
  # dots_with_no_batch_dims keeps attention's projections and the router's logits; the
  # experts' grouped matmuls are no dot_general, so the backward reruns them (planned).
  # lora_rank > 0 trains adapters on lora_targets alone, the routed experts each their own
  # (e.g. --config.model.overrides.lora_rank=16 --config.optim.lr=2e-5).
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="fused_bwd=true",
      remat="dots_with_no_batch_dims", dtype="bfloat16", param_dtype="float32",
      scan_layers=True, lora_rank=0, lora_alpha=32.0,
      lora_targets="q_proj,k_proj,v_proj,o_proj,experts_gate_up_proj,experts_down_proj"))
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
      # Qwen3 thinks in a <think> block: the verifiers read what follows it.
      reasoning="auto", thinking="", system_prompt="", tool_format="text"))
  c.eval = ml_collections.ConfigDict(dict(seeds_per_domain=32, samples=4, domains=""))
  c.checkpoint = ml_collections.ConfigDict(dict(every=25, keep_last=3, keep_every=100,
                                                async_save=True))
  return c
