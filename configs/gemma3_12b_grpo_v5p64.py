"""Gemma 3 12B (instruction-tuned), GRPO, on a TPU v5p-64 slice (32 chips on 4 hosts,
95 GiB each).

Plan the memory first (no TPU needed):

    python -m launch.plan --config=configs/gemma3_12b_grpo_v5p64.py --device_memory_gb=95

and compile its RL update and rollout for the slice on this host (libtpu,
`pip install -e '.[tpu]'`):

    python -m launch.plan --config=configs/gemma3_12b_grpo_v5p64.py --compile_for=v5p:2x4x4

The published folder is a Gemma3ForConditionalGeneration: its language model is read
alone (the vision tower is not), and `export_hf` writes a Gemma3ForCausalLM. From a
checkout with gcloud configured (see launch/tpu_pod.sh):

    export BUCKET=gs://my-bucket        # shared checkpoint/metrics dir, /mnt/ckpt on hosts
    launch/tpu_pod.sh create pt-v5p64 us-east5-a v5p-64
    launch/tpu_pod.sh setup  pt-v5p64 us-east5-a
    launch/tpu_pod.sh model  pt-v5p64 us-east5-a google/gemma-3-12b-it \
        /mnt/models/gemma-3-12b-it
    launch/tpu_pod.sh train  pt-v5p64 us-east5-a configs/gemma3_12b_grpo_v5p64.py \
        /mnt/ckpt/gemma3_12b_grpo

which runs, on every host at once:

    python -m launch.train --config=configs/gemma3_12b_grpo_v5p64.py \
        --workdir=/mnt/ckpt/gemma3_12b_grpo

Recipe: the Llama 3 8B recipe (configs/llama3_8b_grpo_v5p64.py): 256 prompts x 8
samples per step, 1024 new tokens, lr 1e-6 with 4 optimizer steps per rollout batch, KL
0.001. Layers: 40 of the 48 attend over a 1024-token window, every sixth over the whole
row; scanned, each layer's flag picks its flash kernel. Mesh: pure FSDP over the 32
chips; each micro-batch holds two 2048-token rows per chip. The 262K vocabulary's
log-prob head is split over the chips (no chip holds the whole projection). Compiled
for the slice on a CPU host (libtpu from the `[tpu]` extra, 2.4 GiB of host memory):
the update in 60 s, peaking at 33.1 GiB a chip with what stays resident beside it
(planned 32.7), the rollout in 70 s at 57.2 (planned 55.0).
"""

import ml_collections

from configs import llama3_8b_grpo_v5p64 as recipe

HF_DIR = "/mnt/models/gemma-3-12b-it"  # huggingface-cli download ... --local-dir


def get_config() -> ml_collections.ConfigDict:
  c = recipe.get_config()  # its tasks, GRPO settings, optimizer, rows, rollout and mesh
  c.tokenizer = HF_DIR
  c.init_from = HF_DIR
  c.model.preset = "gemma3_12b"
  # float32 master weights (and Adam moments): a 1e-6 step is below bfloat16's resolution.
  c.model.overrides = ml_collections.ConfigDict(dict(
      attention_impl="flash", attention_options="", remat="dots_with_no_batch_dims",
      dtype="bfloat16", param_dtype="float32", scan_layers=True))
  return c
