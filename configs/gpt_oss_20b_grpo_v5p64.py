"""gpt-oss-20b (mixture of experts, attention sinks), GRPO, on a TPU v5p-64 slice (32 chips
on 4 hosts, 95 GiB each).

Plan the memory first (no TPU needed):

    python -m launch.plan --config=configs/gpt_oss_20b_grpo_v5p64.py --device_memory_gb=95

and compile its RL update and rollout for the slice on this host (libtpu,
`pip install -e '.[tpu]'`):

    python -m launch.plan --config=configs/gpt_oss_20b_grpo_v5p64.py --device_memory_gb=95 \\
        --compile_for=v5p:2x4x4

Weights and tokenizer come from a Hugging Face folder present on every host (HF_DIR
below; the published MXFP4 experts are dequantized on load, `posttrain.models.mxfp4`).
From a checkout with gcloud configured (see launch/tpu_pod.sh):

    export BUCKET=gs://my-bucket        # shared checkpoint/metrics dir, /mnt/ckpt on hosts
    launch/tpu_pod.sh create pt-v5p64 us-east5-a v5p-64
    launch/tpu_pod.sh setup  pt-v5p64 us-east5-a
    launch/tpu_pod.sh model  pt-v5p64 us-east5-a openai/gpt-oss-20b /mnt/models/gpt-oss-20b
    launch/tpu_pod.sh train  pt-v5p64 us-east5-a configs/gpt_oss_20b_grpo_v5p64.py \\
        /mnt/ckpt/gpt_oss_20b_grpo
    launch/tpu_pod.sh logs   pt-v5p64 us-east5-a

Recipe (configs/qwen3_30b_a3b_grpo_v5p64.py's): GRPO with a small KL (0.001), 256 prompts
x 8 samples per step, 1024 new tokens (the harmony format: the model reasons in its
analysis channel, then answers in the final one), lr 1e-6 with 4 optimizer steps per
rollout batch. 20.9B parameters: 32
experts of width 2880 in each of 24 layers, 4 per token; sliding (128) and full layers
alternate, so half the KV cache is rings of 640 slots.
Mesh: FSDP 16 x tensor 2, as for Qwen3-30B-A3B: every chip holds every expert of a layer
(D gathered over fsdp, F split over tensor), so the sampler's gathered weights are half
the model. Each micro-batch holds eight 2048-token rows per fsdp shard.
Compiled for the slice on a CPU host (libtpu, 3.4 GiB of host memory, 2.3 min): the update
peaks at 40.3 GiB a chip with what stays resident beside it (planned 38.7), the rollout
at 37.4 (planned 36.6). The sampler pads its gathered experts to 128 columns a device
(1440 -> 1536, and the down experts' D 2880 -> 2944): unpadded, XLA:TPU kept relaid
copies of them through the decode loop and the rollout peaked at 48.1 GiB.
"""

import ml_collections

from configs import qwen3_30b_a3b_grpo_v5p64 as recipe

HF_DIR = "/mnt/models/gpt-oss-20b"  # huggingface-cli download openai/gpt-oss-20b ...


def get_config() -> ml_collections.ConfigDict:
  c = recipe.get_config()  # its tasks, GRPO settings, optimizer, rows, rollout and mesh
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "gpt_oss_20b"
  # float32 master weights (and Adam moments): a 1e-6 step is below bfloat16's resolution.
  # scan_layers: the 24 layers run as one lax.scan, the two kinds of attention picked per
  # layer (lax.cond) and their KV caches stacked apart.
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="fused_bwd=true",
      remat="dots_with_no_batch_dims", dtype="bfloat16", param_dtype="float32",
      scan_layers=True))
  return c
